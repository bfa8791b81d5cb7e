"""The public entry point `solve`: input checks, the working precision, the compiled and
cached solve, and the dense output's dependence on the output times."""

import dataclasses
import math
import os
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import ArrayLike

from ._adjoint import Adjoint
from ._autodiff import solve_core
from ._closures import lift_closures
from ._core import Config, Inputs
from ._discrete_adjoint import DiscreteAdjoint
from ._consistency import AUTO_SPLIT_MAX_N, unknown_mask
from ._forward_sensitivity import ForwardSensitivity
from ._initialization import SUCCESS, failure_messages, message_index
from ._krylov import Preconditioner
from ._linear_solver import AbstractLinearSolver
from ._sparse import default_linear_solver
from ._events import Event
from ._results import RESULTS, succeeded
from ._solution import Solution

_INIT_MODES = (None, "ya_ydp", "y")
# Below this multiple of machine epsilon the Newton tests (0.33·tol) and the error test
# drown in rounding: the corrections they accept are no longer resolved.
_MIN_RTOL_EPS = 100.0
# With more output times than this the default reverse mode is the discrete adjoint,
# whose cost does not grow with the number of observations (the continuous adjoint
# restarts at each one: Calver & Enright).
MANY_OBSERVATIONS = 32
# Derivatives of the dense output y^(m)(t_i) carried by the core: y, y', y''. The
# saveat-time Taylor shift below is exact to this order.
DENSE_ORDER = 2


def _concrete(x):
    """The value of x if it is known before tracing, else None."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError, TypeError):
        return None


# The working precisions: the BDF tests (Newton 0.33·tol, rtol ≥ 100·eps) need at least
# float32's 24 bits; float16 and bfloat16 cannot meet any useful tolerance.
_SUPPORTED_DTYPES = (np.dtype("float32"), np.dtype("float64"))
_COMPLEX_HINT = ("daeadjoint integrates real DAEs: write a complex state as its real and "
                 "imaginary parts (y = concatenate([y.real, y.imag]), and the residual "
                 "likewise).")


def _refuse_complex_args(args):
    """Complex arrays (or Python complex numbers) in `args` are refused by name: the
    solver's arithmetic, error norms and derivatives are real."""
    leaves = jax.tree_util.tree_leaves_with_path(args)
    for path, leaf in leaves:
        dtype = (jnp.result_type(leaf) if isinstance(leaf, complex) or hasattr(leaf, "dtype")
                 else None)
        if dtype is not None and jnp.issubdtype(dtype, jnp.complexfloating):
            where = "args" + jax.tree_util.keystr(path)
            raise TypeError(f"`{where}` is complex ({jnp.dtype(dtype).name}). {_COMPLEX_HINT}")


def _working_dtype(residual, t0, y0, yp0, args):
    """The promoted dtype of y0, yp0 and the residual's output (e.g. float32 y0 with
    float64 parameters works in float64, as jnp arithmetic would). Complex values and
    precisions other than float32/float64 are refused by name."""
    for name, x in (("y0", y0), ("yp0", yp0)):
        if x is not None and jnp.issubdtype(x.dtype, jnp.complexfloating):
            raise TypeError(f"`{name}` is complex ({x.dtype.name}). {_COMPLEX_HINT}")
    _refuse_complex_args(args)
    dtype = y0.dtype if yp0 is None else jnp.result_type(y0, yp0)
    if not jnp.issubdtype(dtype, jnp.floating):
        dtype = jnp.result_type(float)
    y = jax.ShapeDtypeStruct(y0.shape, dtype)
    try:
        out = eqx.filter_eval_shape(residual, jax.ShapeDtypeStruct((), dtype), y, y, args)
    except Exception as e:   # noqa: BLE001 - report the user's error with context
        # Re-raise the user's own exception (JAX's tracer errors cannot be rebuilt from a
        # message), with the context as a note.
        e.add_note("daeadjoint: raised while calling residual(t, y, yp, args) with abstract "
                   f"(traced) arguments: t {jnp.dtype(dtype).name} scalar, y and yp "
                   f"{jnp.dtype(dtype).name}{list(y0.shape)}. The residual must be a JAX "
                   "function of them: use jnp.where or jax.lax.cond, not Python `if`, on "
                   "their values.")
        raise
    if not (hasattr(out, "shape") and hasattr(out, "dtype")):
        raise ValueError("`residual` must return an array shaped like y "
                         f"{y0.shape}; it returned {type(out).__name__}.")
    if out.shape != y0.shape:
        raise ValueError(
            f"`residual` must return an array shaped like y {y0.shape}; it returned {out.shape}.")
    if jnp.issubdtype(out.dtype, jnp.complexfloating):
        raise TypeError(f"`residual` returned a complex array ({out.dtype.name}). "
                        f"{_COMPLEX_HINT}")
    if jnp.issubdtype(out.dtype, jnp.floating):
        dtype = jnp.result_type(dtype, out.dtype)
    if np.dtype(dtype) not in _SUPPORTED_DTYPES:
        raise TypeError(
            f"The working precision would be {jnp.dtype(dtype).name} (the promoted dtype of "
            "`y0`, `yp0` and the residual's output): daeadjoint supports float32 and float64 "
            "only; convert y0 with y0.astype(jnp.float32) (or float64, with "
            "jax.config.update('jax_enable_x64', True)).")
    return dtype


def default_rtol(dtype) -> float:
    """The default `rtol`: 1e-6 where the dtype resolves it (float64), else 1e-4 (float32,
    whose smallest accepted rtol is 100·eps = 1.2e-5)."""
    eps = float(jnp.finfo(dtype).eps)
    return 1e-6 if 1e-6 >= _MIN_RTOL_EPS * eps else 1e-4


def _refuse_nonfinite(**arrays):
    """Concrete NaN/inf in the times or initial values: a ValueError naming the argument
    (traced ones are checked at run time: `RESULTS.nonfinite_input`)."""
    for name, x in arrays.items():
        cx = None if x is None else _concrete(x)
        if cx is not None and cx.dtype.kind in "fiub" and not np.all(np.isfinite(cx)):
            bad = np.nonzero(~np.isfinite(np.atleast_1d(cx)))[0].tolist()
            where = f" at {bad}" if np.ndim(cx) else ""
            raise ValueError(f"`{name}` contains NaN or inf{where}.")


# Output times within this many machine epsilons (relative) of t0 or t1 count as t0 or
# t1: e.g. the last of jnp.arange(t0, t1 + dt/2, dt), one ulp past t1 by rounding.
_SNAP_EPS = 4


def _time_roundoff(t):
    return _SNAP_EPS * np.finfo(np.asarray(t).dtype).eps * abs(float(t))


def _snap_saveat(saveat, t0, t1):
    """Output times within round-off (`_SNAP_EPS`) outside [t0, t1] moved onto t0 or t1;
    the others unchanged (the run-time check still sees times truly outside)."""
    eps = jnp.finfo(saveat.dtype).eps
    near0 = (saveat < t0) & (saveat >= t0 - _SNAP_EPS * eps * jnp.abs(t0))
    near1 = (saveat > t1) & (saveat <= t1 + _SNAP_EPS * eps * jnp.abs(t1))
    return jnp.where(near0, t0, jnp.where(near1, t1, saveat))


def _check_inputs(residual, t0, t1, y0, yp0, args, saveat, algebraic, init, quadrature,
                  rtol, atol, tstop, max_steps):
    """Every check that can be made before tracing, each with a message naming the
    argument. Returns the arrays converted to the working dtype. (Values only known at
    run time are checked again inside the solve: `_core.input_status`.)"""
    if not callable(residual):
        raise TypeError("`residual` must be a function residual(t, y, yp, args) -> array.")
    y0 = jnp.asarray(y0)
    if y0.ndim != 1:
        raise ValueError(f"`y0` must be a 1-D array, got shape {y0.shape}.")
    n = y0.shape[0]
    if n == 0:
        raise ValueError("`y0` is empty: there is nothing to integrate.")
    if yp0 is not None:
        yp0 = jnp.asarray(yp0)
        if yp0.shape != y0.shape:
            raise ValueError(f"`yp0` has shape {yp0.shape} but `y0` has shape {y0.shape}.")
    if init not in _INIT_MODES:
        raise ValueError(f"`init` must be one of None, 'ya_ydp', 'y'; got {init!r}.")
    dtype = _working_dtype(residual, t0, y0, yp0, args)
    _refuse_nonfinite(y0=y0, yp0=yp0, t0=t0, t1=t1, saveat=saveat)
    given_t0, given_t1 = _concrete(t0), _concrete(t1)
    y0 = y0.astype(dtype)
    yp0 = None if yp0 is None else yp0.astype(dtype)
    t0 = jnp.asarray(t0, dtype)
    t1 = jnp.asarray(t1, dtype)
    if t0.ndim or t1.ndim:
        raise ValueError("`t0` and `t1` must be scalars.")
    ct0, ct1 = _concrete(t0), _concrete(t1)
    if ct0 is not None and ct1 is not None:
        if ct1 == ct0 and given_t0 is not None and given_t1 is not None and given_t1 > given_t0:
            raise ValueError(
                f"`t1` - `t0` ({float(given_t1 - given_t0):.3g}) is below the spacing of "
                f"{jnp.dtype(dtype).name} numbers at t0 ({float(np.spacing(ct0)):.3g}): both "
                f"round to {float(ct0)!r}. Shift the time origin (solve in tau = t - t0 with "
                "residual F(t0 + tau, y, y', args)) or use float64.")
        if ct1 == ct0:
            raise ValueError(f"`t1` equals `t0` ({float(ct0)}): the interval is empty.")
        if ct1 < ct0:
            raise ValueError(
                f"`t1` ({float(ct1)}) < `t0` ({float(ct0)}): integrate forward in the time "
                "s = -t instead (residual F(-s, y, -y', args)).")
    if saveat is None:
        saveat = t1[None]
    else:
        saveat = jnp.asarray(saveat, dtype)
        if saveat.ndim != 1 or saveat.shape[0] == 0:
            raise ValueError(f"`saveat` must be a non-empty 1-D array of times, got shape {saveat.shape}.")
        cs = _concrete(saveat)
        if cs is not None:
            if np.any(np.diff(cs) < 0):
                raise ValueError("`saveat` must be sorted in increasing order.")
            if ct0 is not None and ct1 is not None:
                lo, hi = ct0 - _time_roundoff(ct0), ct1 + _time_roundoff(ct1)
                if cs[0] < lo or cs[-1] > hi:
                    raise ValueError(
                        f"`saveat` must lie in [t0, t1] = [{float(ct0)}, {float(ct1)}] (to "
                        f"within {_SNAP_EPS} machine epsilons of either end); got "
                        f"[{float(cs[0])}, {float(cs[-1])}].")
    if algebraic is None:
        algebraic = jnp.zeros((n,), bool)
    else:
        algebraic = jnp.asarray(algebraic)
        if algebraic.shape != (n,) or algebraic.dtype != bool:
            raise ValueError(
                f"`algebraic` must be a boolean mask of shape ({n},), got {algebraic.dtype} "
                f"of shape {algebraic.shape}.")
    rtol = jnp.asarray(default_rtol(dtype) if rtol is None else rtol, dtype)
    atol = jnp.asarray(atol, dtype)
    if rtol.ndim != 0:
        raise ValueError("`rtol` must be a scalar.")
    if atol.shape not in ((), (n,)):
        raise ValueError(f"`atol` must be a scalar or have shape ({n},), got {atol.shape}.")
    atol = jnp.broadcast_to(atol, (n,))
    crt, cat = _concrete(rtol), _concrete(atol)
    if crt is not None and cat is not None:
        if not (np.isfinite(crt) and np.all(np.isfinite(cat))):
            raise ValueError(f"Tolerances must be finite: rtol={crt}, atol={cat}.")
        if crt < 0 or np.any(cat < 0) or (crt == 0 and np.any(cat == 0)):
            raise ValueError(
                f"Tolerances must be non-negative and not both zero: rtol={crt}, atol={cat}.")
        cy = _concrete(y0)
        if cy is not None:   # IDAS: "some initial ewt component = 0.0 illegal"
            zero = np.nonzero(crt * np.abs(cy) + cat == 0)[0]
            if zero.size:
                raise ValueError(
                    f"`atol` is 0 at components {zero.tolist()} where `y0` is 0 too: their "
                    "error weight 1/(rtol*|y0_i| + atol_i) is infinite, so no error or "
                    "Newton test can be measured there (IDAS refuses this start too). Give "
                    "those components an atol > 0 (the size below which they stop mattering).")
        eps = float(jnp.finfo(dtype).eps)
        if 0 < crt < _MIN_RTOL_EPS * eps:
            hint = (" or enable float64 with jax.config.update('jax_enable_x64', True)"
                    if dtype != jnp.float64 else "")
            raise ValueError(
                f"{jnp.dtype(dtype).name} cannot meet rtol={float(crt):.3g}: its machine "
                f"epsilon is {eps:.3g}, so use rtol >= {_MIN_RTOL_EPS * eps:.3g}{hint}.")
    if tstop is None:
        tstop = jnp.asarray(jnp.inf, dtype)
    else:
        tstop = jnp.asarray(tstop, dtype)
        cts = _concrete(tstop)
        if cts is not None and np.isnan(cts):
            raise ValueError("`tstop` is NaN.")
        if cts is not None and ct1 is not None and cts < ct1:
            raise ValueError(f"`tstop` ({float(cts)}) must be >= t1 ({float(ct1)}).")
    if not (isinstance(max_steps, (int, np.integer)) and max_steps > 0):
        raise ValueError(f"`max_steps` must be a positive integer, got {max_steps!r}.")
    if quadrature is not None:
        y = jax.ShapeDtypeStruct((n,), dtype)
        qout = eqx.filter_eval_shape(quadrature, jax.ShapeDtypeStruct((), dtype), y, y, args)
        if not (hasattr(qout, "shape") and len(qout.shape) == 1):
            raise ValueError(
                "`quadrature` must return a 1-D array q(t, y, yp, args); it returned "
                f"{getattr(qout, 'shape', type(qout).__name__)}.")
    return t0, t1, y0, yp0, saveat, algebraic, rtol, atol, tstop


def _check_event(event, residual, t0, y0, args):
    if event is None:
        return None
    if not isinstance(event, Event):
        raise TypeError(f"`event` must be daeadjoint.Event(cond, ...), got {event!r}.")
    y = jax.ShapeDtypeStruct(y0.shape, y0.dtype)
    out = eqx.filter_eval_shape(event.cond, jax.ShapeDtypeStruct((), y0.dtype), y, y, args)
    if not hasattr(out, "shape") or len(out.shape) > 1:
        raise ValueError("Event `cond(t, y, yp, args)` must return a scalar or a 1-D array; "
                         f"it returned {getattr(out, 'shape', type(out).__name__)}.")
    n_ev = max(1, int(np.prod(out.shape)))
    if isinstance(event.direction, tuple) and len(event.direction) != n_ev:
        raise ValueError(f"Event(direction=...) has {len(event.direction)} entries but cond "
                         f"returns {n_ev}.")
    return event


def _check_step_options(y0, constraints, max_step, min_step, first_step, max_order):
    """The IDAS optional inputs: clear errors before tracing, arrays of the working dtype."""
    n, dtype = y0.shape[0], y0.dtype
    if constraints is not None:
        constraints = jnp.asarray(constraints)
        if constraints.shape != (n,) or not jnp.issubdtype(constraints.dtype, jnp.integer):
            raise ValueError(f"`constraints` must be an integer array of shape ({n},) with "
                             f"entries in {{0, ±1, ±2}}; got {constraints.dtype} of shape "
                             f"{constraints.shape}.")
        cc = _concrete(constraints)
        if cc is not None and not np.all(np.isin(cc, [-2, -1, 0, 1, 2])):
            raise ValueError(f"`constraints` entries must be 0, ±1 or ±2; got {np.unique(cc)}.")
        cy = _concrete(y0)
        if cc is not None and cy is not None:
            bad = ((np.abs(cc) == 2) & (cy * cc <= 0)) | ((np.abs(cc) >= 1) & (cy * cc < 0))
            if np.any(bad):
                raise ValueError(f"`y0` violates `constraints` at components {np.nonzero(bad)[0].tolist()} "
                                 "(IDAS requires a start that satisfies them; with init= only the "
                                 "given components must).")
    def positive(name, x, allow_zero=False):
        x = jnp.asarray(x, dtype)
        cx = _concrete(x)
        if x.ndim or (cx is not None and not (cx > 0 or (allow_zero and cx == 0))):
            raise ValueError(f"`{name}` must be a {'non-negative' if allow_zero else 'positive'} "
                             f"scalar, got {x if cx is None else cx}.")
        return x
    max_step = jnp.asarray(jnp.inf, dtype) if max_step is None else positive("max_step", max_step)
    min_step = jnp.asarray(0.0, dtype) if min_step is None else positive("min_step", min_step, True)
    first_step = (jnp.asarray(jnp.nan, dtype) if first_step is None
                  else positive("first_step", first_step))
    if not (isinstance(max_order, (int, np.integer)) and 1 <= max_order <= 5):
        raise ValueError(f"`max_order` must be an integer in 1..5, got {max_order!r}.")
    return constraints, max_step, min_step, first_step


# ------------------------------------------------------------- output-time dependence


def _zero_until(order: int, beyond: str):
    """Z(Δ) = 0 with derivatives 0 up to `order` (by custom JVPs: Z_m' = Z_{m−1}(Δ)·Δ̇),
    and beyond: NaN (`beyond="nan"`, Z_0' = NaN·Δ̇) or an error when JAX differentiates
    Z_0 (`"raise"`)."""

    @jax.custom_jvp
    def zero(delta):
        return jnp.zeros_like(delta)

    @zero.defjvp
    def zero_jvp(primals, tangents):
        (delta,), (delta_dot,) = primals, tangents
        if order > 0:
            return zero(delta), _zero_until(order - 1, beyond)(delta) * delta_dot
        if beyond == "nan":
            return zero(delta), delta_dot * jnp.nan
        raise ValueError(
            "daeadjoint: this derivative of order > "
            f"{DENSE_ORDER} with respect to the output times (saveat or t1) is not "
            "available (the dense output carries y, y' and y'' only).")

    return zero


def _order_guard(order: int, beyond: str = "raise"):
    """Δ ↦ Δ + Z(Δ): derivatives of order 2 … `order` are 0 (exact: the Taylor shift
    below is a polynomial in Δ); the next one would need y^(DENSE_ORDER + 1), which the
    dense output does not carry, and would be silently zero. It raises (the shift of y
    and of the quadratures: at the third derivative, whatever output is used), or is
    NaN (the shift of y', one order short: jax.hessian of sol.ys with respect to t1
    differentiates the shift of sol.yps twice too, since JAX differentiates every
    output, and raising there refused it although only ys was used; a second derivative
    of sol.yps itself is NaN)."""

    def guard(delta):
        return delta + _zero_until(order, beyond)(delta)

    return guard


def _shift_to_saveat(yd, qs, saveat, args, quadrature):
    """The outputs as functions of the output times: the core evaluates the dense output
    at saveat without differentiating the times, and here Δ = saveat − stop_gradient
    (saveat) (zero in value) re-attaches them exactly through the interpolant's Taylor
    expansion y(t_i + Δ) = Σ_m y^(m)(t_i) Δ^m/m!, and ∫^{t_i+Δ} q = ∫^{t_i} q +
    ∫_0^Δ q(t_i + τ) dτ by 2-point Gauss–Legendre (exact derivatives up to order 4 at
    Δ = 0)."""
    delta = saveat - jax.lax.stop_gradient(saveat)
    order = yd.shape[1] - 1
    # Rows never reached are inf: keep them inf (the m = 0 term), not inf·0 = NaN.
    yd = jnp.concatenate([yd[:, :1], jnp.where(jnp.isfinite(yd[:, 1:]), yd[:, 1:], 0.0)], axis=1)
    d_y = _order_guard(order)(delta)[:, None]
    d_yp = _order_guard(order - 1, "nan")(delta)[:, None]
    ys = sum(yd[:, m] * d_y**m / math.factorial(m) for m in range(order + 1))
    yps = sum(yd[:, m + 1] * d_yp**m / math.factorial(m) for m in range(order))
    if quadrature is None:
        return ys, yps, qs
    d_q = _order_guard(order)(delta)

    yd = jnp.where(jnp.isfinite(yd), yd, 0.0)

    def taylor(tau):
        y = sum(yd[:, m] * tau[:, None]**m / math.factorial(m) for m in range(order + 1))
        yp = sum(yd[:, m + 1] * tau[:, None]**m / math.factorial(m) for m in range(order))
        return jax.vmap(lambda t, y_, yp_: jnp.asarray(quadrature(t, y_, yp_, args), yd.dtype))(
            jax.lax.stop_gradient(saveat) + tau, y, yp)

    nodes = (0.5 - 0.5 / math.sqrt(3.0), 0.5 + 0.5 / math.sqrt(3.0))
    extra = sum(0.5 * d_q[:, None] * taylor(c * d_q) for c in nodes)
    return ys, yps, qs + extra


# ------------------------------------------------------------------ compiled solve


@eqx.filter_jit
def _solve_compiled(config: Config, inputs: Inputs):
    """The solve as one compiled program: (Solution, (reason, component) of a failed
    initialization). Raising on failure (`throw`) is left to `_raise_on_failure`, outside
    this cached program, so that an error names the call that failed."""
    sg = jax.lax.stop_gradient
    core_inputs = dataclasses.replace(
        inputs, t1=sg(inputs.t1),
        saveat=_snap_saveat(sg(inputs.saveat), sg(inputs.t0), sg(inputs.t1)))
    core = solve_core(config, core_inputs)
    ys, yps, qs = _shift_to_saveat(core.yd, core.qs, inputs.saveat, inputs.args,
                                   config.quadrature)
    stats = dict(core.stats)
    stats["t_final"] = core.t_final
    result = jax.tree_util.tree_map(jax.lax.stop_gradient, core.result)
    events = {}
    if config.event is not None:
        stats["num_events"] = jnp.sum(jnp.isfinite(core.event_t)).astype(jnp.int32)
        events = dict(event_ts=core.event_t, event_ys=core.event_yd[:, 0],
                      event_yps=core.event_yd[:, 1], event_masks=core.event_mask,
                      event_t=core.event_t[0], event_y=core.event_yd[0, 0],
                      event_yp=core.event_yd[0, 1], event_mask=core.event_mask[0])
    sentinel = None
    if core.dense is not None:
        diff = [inputs.t0, inputs.t1, inputs.y0, inputs.yp0, inputs.saveat] + \
            jax.tree_util.tree_leaves(eqx.filter(inputs.args, eqx.is_inexact_array))
        sentinel = sum(0.0 * jnp.sum(x) for x in diff)
    sol = Solution(ts=inputs.saveat, ys=ys, yps=yps,
                   qs=qs if config.quadrature is not None else None,
                   stats=stats, result=result, dense=core.dense, sentinel=sentinel, **events)
    return sol, core.init_info


def _failure_message(sol, init_info, config, inputs):
    """(failed, message index, messages) of a solve: the initialization's own message
    (reason and component) when it failed, else the status's."""
    result = sol.result
    failed = ~succeeded(result)
    index = result._value
    msgs = RESULTS._index_to_message
    if config.init is not None:
        reason, worst = init_info
        n = inputs.y0.shape[0]
        is_y = unknown_mask(config.init, inputs.algebraic)[jnp.clip(worst, 0, n - 1)]
        init_failed = (reason != SUCCESS) & (result == RESULTS.initialization_failed)
        init_msgs = failure_messages(config.init)
        index = jnp.where(init_failed, message_index(reason, worst, is_y) + len(msgs), index)
        msgs = tuple(msgs) + tuple(init_msgs)
    return failed, index, msgs


def _first_dependent_algebraic(config, inputs):
    """The first component marked algebraic on whose y' the residual depends at
    (t0, y0, y'0) (concrete inputs), or None: bisection on the probe F_y' (a∘r) of
    `_core.mask_violation`, O(log n) `jax.jvp`s, run only to name it in an error."""
    from ._core import algebraic_probe
    from ._newton import depends_on_yp
    probe = np.asarray(algebraic_probe(config, inputs))
    test = jax.jit(lambda v: depends_on_yp(config.residual, inputs.t0, inputs.y0,
                                           inputs.yp0, inputs.args, v))
    lo, hi = 0, probe.shape[0]
    if not bool(test(probe)):
        return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        part = np.where(np.arange(probe.shape[0]) < mid, probe, 0.0)
        part[:lo] = 0.0
        lo, hi = (lo, mid) if bool(test(part)) else (mid, hi)
    return lo


def _raise_on_failure(sol, init_info, config, inputs):
    """`throw=True`: a failed solve raises its status's message. With concrete results
    (a solve called outside jit) this is a Python exception raised here, so its
    traceback is this call's; under jit/vmap it is `equinox.branched_error_if` (the
    compiled program raises at run time)."""
    failed, index, msgs = _failure_message(sol, init_info, config, inputs)
    cf, ci = _concrete(failed), _concrete(index)
    if cf is not None and ci is not None and os.environ.get("EQX_ON_ERROR", "raise") == "raise":
        if np.any(cf):
            first = int(np.broadcast_to(ci, np.shape(cf))[cf].reshape(-1)[0])
            message = msgs[first]
            if first == RESULTS.wrong_algebraic_mask._value and np.ndim(ci) == 0:
                i = _first_dependent_algebraic(config, inputs)
                where = (f"at t0 its column {i} is not zero" if i is not None else
                         f"at t0 it is zero, at t = {float(sol.stats['t_final']):.6g} not")
                message = f"{message[:-1]}: {where}."
            raise eqx.EquinoxRuntimeError(message)
        return sol
    return eqx.branched_error_if(sol, failed, index, msgs)


def solve(
    residual: Callable,
    t0: ArrayLike,
    t1: ArrayLike,
    y0: ArrayLike,
    yp0: ArrayLike | None = None,
    args: Any = None,
    *,
    saveat: ArrayLike | None = None,
    algebraic: ArrayLike | None = None,
    init: str | None = None,
    quadrature: Callable | None = None,
    rtol: ArrayLike | None = None,
    atol: ArrayLike = 1e-6,
    max_steps: int = 100_000,
    sensitivity: Adjoint | DiscreteAdjoint | None = None,
    forward_sensitivity: ForwardSensitivity | None = None,
    throw: bool = True,
    tstop: ArrayLike | None = None,
    suppress_algebraic_error: bool = False,
    quad_rtol: ArrayLike | None = None,
    quad_atol: ArrayLike | None = None,
    quad_error_control: bool = False,
    linear_solver: AbstractLinearSolver | None = None,
    constraints: ArrayLike | None = None,
    max_step: ArrayLike | None = None,
    min_step: ArrayLike | None = None,
    first_step: ArrayLike | None = None,
    max_order: int = 5,
    event: Event | None = None,
    steps: bool = False,
    dense: bool = False,
    progress: bool | int = False,
) -> Solution:
    r"""Solve the DAE F(t, y, y', args) = 0 on [t0, t1] with variable-order BDF (IDAS).

    Every JAX transformation works through `solve`, to any order: `jax.jvp`,
    `jax.jacfwd`, `jax.linearize` (forward sensitivities), `jax.grad`, `jax.vjp`,
    `jax.jacrev` (the adjoint), `jax.hessian` and `jax.jvp(jax.grad(...))` (forward over
    adjoint), `jax.vmap` of any of them and `jax.jit` around all of it — always the
    derivatives of the continuous problem, never of the step-size controller.

    **Arguments:**

    - `residual`: `F(t, y, yp, args) -> array` shaped like `y`.
    - `t0`, `t1`: the interval, t1 > t0.
    - `y0`: 1-D initial state. The working precision is the promoted dtype of `y0`,
      `yp0` and the residual's output: float32 or float64 (recommended); complex values
      and other precisions are refused.
    - `yp0`: initial y'. Default None: computed together with the algebraic components of
      y0 by consistent initialization (as `init="ya_ydp"`).
    - `args`: any pytree passed to `residual` (and `quadrature`), e.g. an `eqx.nn.MLP`:
      its inexact arrays are differentiable, everything else is static.
    - `saveat`: sorted 1-D array of output times in [t0, t1] (times within 4·eps of
      either end count as that end); default `[t1]`. Outputs come from the BDF
      interpolating polynomial; steps are not forced onto them.
    - `algebraic`: bool mask, True where y_i is algebraic (F does not depend on y'_i).
      Checked: column i of F_y' must be zero at t0 and at each Jacobian setup, else
      `RESULTS.wrong_algebraic_mask`.
      Default None: no mask; up to 200 unknowns the algebraic directions are then
      found from the null space of F_y' wherever consistency matters (fully implicit
      DAEs whose singular F_y' mixes components, e.g. circuits with floating
      capacitors), above that none (an ODE in implicit form).
    - `init`: None (take y0, yp0 as consistent), `"ya_ydp"` (compute the algebraic part of
      y0 and the differential part of y'0 from the differential part of y0), or `"y"`
      (compute all of y0 from y'0).
    - `quadrature`: `q(t, y, yp, args) -> 1-D array`; `sol.qs[i]` = ∫_{t0}^{ts[i]} q dt.
      Quadratures are corrected after each step, never inside Newton; they enter the error
      test only with `quad_error_control=True` (tolerances `quad_rtol`, `quad_atol`,
      defaulting to `rtol`, `atol`).
    - `rtol`, `atol`: error weights W_i = 1/(rtol |y_i| + atol_i); atol scalar or (n,).
      Default rtol: 1e-6 in float64, 1e-4 in float32 (whose smallest accepted rtol is
      100·eps = 1.2e-5); default atol 1e-6. An atol_i of 0 needs y0_i ≠ 0.
    - `max_steps`: give up (status `max_steps_reached`) after this many steps.
    - `sensitivity`: how reverse-mode derivatives are computed: `Adjoint()` (the
      continuous adjoint DAE) or `DiscreteAdjoint()` (the adjoint of the recorded steps).
      None (default) chooses: `Adjoint()` for up to 32 output times, `DiscreteAdjoint()`
      for more (its cost does not grow with the number of observations).
    - `forward_sensitivity`: options of forward mode, `ForwardSensitivity()` by default
      (staggered corrector, full error control).
    - `throw`: raise on failure (`equinox.EquinoxRuntimeError`: from `solve` itself
      outside jit, via `equinox.error_if` under jit). With False,
      inspect `sol.result`; the solution up to the failure is returned, and derivatives
      of a failed solve are NaN.
    - `tstop`: never step past this time (≥ t1). Default: the integrator may step past t1
      and interpolate back, as IDAS does.
    - `suppress_algebraic_error`: leave algebraic components out of the local error test
      (IDAS `IDASetSuppressAlg`).
    - `linear_solver`: how the Newton systems are solved (`DenseLU()`, `BandedLU(l, u)`,
      `SparseLU()`, …). Default None: `default_linear_solver` — `DenseLU()` up to 100
      unknowns (so small problems are unchanged), above that `SparseLU` with the
      sparsity pattern detected from the residual's program (`DenseLU()` if it is
      dense or cannot be detected). Pass a solver to override it; for very large systems
      `Krylov(preconditioner=...)` (matrix-free GMRES; see the linear solvers page).
    - `constraints`: int array like y0 (IDASetConstraints): 0 none, 1 y ≥ 0, 2 y > 0,
      −1 y ≤ 0, −2 y < 0. After each Newton solve a violating step is projected back if
      the violation is below the Newton tolerance, else redone with a smaller step (IDAS
      §6.2.2.4); consistent initialization (`init=`) enforces them too. y0 must satisfy
      them.
    - `event`: `Event(cond, terminal=True, direction=0)`: locate the roots of
      `cond(t, y, yp, args)` on the dense output (IDAS §6.2.4); `sol.event_t`, `event_y`,
      `event_yp`, `event_mask`. A terminal event stops the solve there (status
      `RESULTS.event`, a success; later output rows are `inf`). Event times and states
      are differentiable in every mode.
    - `steps`: also return the accepted step sequence (`sol.step_ts`, `sol.step_ys`).
    - `dense`: also keep every step's interpolating polynomial for `sol.evaluate(t)`
      (memory O(max_steps · 6n)). Neither is differentiable (they depend on the steps).
    - `progress`: print t and the step count while integrating (True: every 100 steps,
      an int: every that many; at most two lines a second); nothing when False.
    - `max_step`, `min_step`, `first_step`, `max_order`: IDASetMaxStep, IDASetMinStep,
      IDASetInitStep, IDASetMaxOrd (1–5). A step that fails at `min_step` ends the solve
      with the failure's status.

    **Returns:** a `Solution` with `ts`, `ys`, `yps`, `qs`, `stats`, `result`.
    """
    # Without a mask the algebraic directions are found from F_y' where needed.
    auto_split = algebraic is None and np.shape(y0)[0] <= AUTO_SPLIT_MAX_N
    check_algebraic = algebraic is not None
    t0, t1, y0, yp0, saveat, algebraic, rtol, atol, tstop = _check_inputs(
        residual, t0, t1, y0, yp0, args, saveat, algebraic, init, quadrature, rtol, atol,
        tstop, max_steps)
    # Python floats in `args` become (weakly typed) arrays: traced, hence differentiable,
    # and a new value reuses the compiled solve instead of recompiling it as a new static
    # constant would (ints and non-numeric leaves stay static: they may set shapes).
    args = jax.tree_util.tree_map(
        lambda a: jnp.asarray(a) if isinstance(a, (float, complex)) else a, args)
    if yp0 is None:
        yp0 = jnp.zeros_like(y0)
        if init is None:
            init = "ya_ydp"
    dtype = y0.dtype
    if sensitivity is None:
        sensitivity = Adjoint() if saveat.shape[0] <= MANY_OBSERVATIONS else DiscreteAdjoint()
    if not isinstance(sensitivity, (Adjoint, DiscreteAdjoint)):
        raise TypeError("`sensitivity` must be daeadjoint.Adjoint() or "
                        f"daeadjoint.DiscreteAdjoint(), got {sensitivity!r}.")
    if forward_sensitivity is None:
        forward_sensitivity = ForwardSensitivity()
    if linear_solver is None:
        linear_solver = default_linear_solver(residual, t0, y0, yp0, args)
    if not isinstance(linear_solver, AbstractLinearSolver):
        raise TypeError("`linear_solver` must be a daeadjoint linear solver (e.g. "
                        f"daeadjoint.DenseLU()), got {linear_solver!r}.")
    if isinstance(linear_solver, Preconditioner):
        raise TypeError("`linear_solver` is a daeadjoint.Preconditioner, which only "
                        "approximates the iteration matrix: use it through "
                        "linear_solver=daeadjoint.Krylov(preconditioner=...).")
    linear_solver = linear_solver.prepare(residual, t0, y0, yp0, args)
    nq = 0
    if quadrature is not None:
        y = jax.ShapeDtypeStruct(y0.shape, dtype)
        nq = eqx.filter_eval_shape(quadrature, jax.ShapeDtypeStruct((), dtype), y, y, args).shape[0]
    quad_rtol = rtol if quad_rtol is None else jnp.asarray(quad_rtol, dtype)
    quad_atol = jnp.broadcast_to(jnp.max(atol) if quad_atol is None
                                 else jnp.asarray(quad_atol, dtype), (nq,))
    constraints, max_step, min_step, first_step = _check_step_options(
        y0, constraints, max_step, min_step, first_step, max_order)
    event = _check_event(event, residual, t0, y0, args)
    # Tracers the functions close over (a parameter under grad/jacfwd/vmap) become
    # leaves of args, differentiable and batchable like any other (`_closures.py`).
    residual, quadrature, event, linear_solver, args = lift_closures(
        residual, quadrature, event, linear_solver, y0, args)
    config = Config(
        residual=residual, quadrature=quadrature, linear_solver=linear_solver,
        reverse=sensitivity, forward=forward_sensitivity, init=init,
        max_steps=int(max_steps), suppress_algebraic_error=bool(suppress_algebraic_error),
        quad_error_control=bool(quad_error_control), order=DENSE_ORDER, throw=bool(throw),
        max_order=int(max_order), event=event,
        progress=(100 if progress is True else int(progress)),
        auto_split=auto_split,
        dense=(2 if dense else (1 if steps else 0)), check_algebraic=check_algebraic)
    inputs = Inputs(t0=t0, t1=t1, y0=y0, yp0=yp0, args=args, saveat=saveat,
                    algebraic=algebraic, rtol=rtol, atol=atol, quad_rtol=quad_rtol,
                    quad_atol=quad_atol, tstop=tstop, constraints=constraints,
                    max_step=max_step, min_step=min_step, first_step=first_step)
    sol, init_info = _solve_compiled(config, inputs)
    if throw:
        sol = _raise_on_failure(sol, init_info, config, inputs)
    return sol
