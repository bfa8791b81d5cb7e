"""Input validation for `solve`: every check that can be made before tracing, each with a
message naming the argument, and the working precision (the promoted dtype of y0, yp0 and
the residual's output). Values only known at run time are checked again inside the
solve (`_core.input_status`)."""

from typing import get_args

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np

from ._derivatives.reverse import AbstractAdjoint
from ._events import Event
from ._initialization import InitMode
from ._linalg.krylov import AbstractPreconditioner
from ._linalg.linear_solver import AbstractLinearSolver

_INIT_MODES = get_args(InitMode)
# Below this multiple of machine epsilon the Newton tests (0.33·tol) and the error test
# drown in rounding: the corrections they accept are no longer resolved.
_MIN_RTOL_EPS = 100.0


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
    except Exception as e:   # report the user's error with context
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


# Long but flat: one independent check after another, in the order of `solve`'s
# arguments, each raising its own message; splitting it would only spread that list.
def _check_inputs(residual, t0, t1, y0, yp0, args, saveat, algebraic, init, quadrature,
                  rtol, atol, tstop, max_steps):
    """Every check that can be made before tracing, each with a message naming the
    argument. Returns the arrays converted to the working dtype. (Values only known at
    run time are checked again inside the solve: `_core.input_status`.)"""
    if not callable(residual):
        hint = ""
        if _library(residual) == "diffrax":
            hint = (f" A diffrax term ({type(residual).__name__}) is not needed: pass the "
                    "function itself; an ODE y' = f(t, y, args) is the residual "
                    "F = yp - f(t, y, args).")
        raise TypeError("`residual` must be a function residual(t, y, yp, args) -> array."
                        + hint)
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
    if init is not None and init not in _INIT_MODES:
        allowed = ", ".join(map(repr, _INIT_MODES))
        raise ValueError(f"`init` must be None or one of {allowed}; got {init!r}.")
    dtype = _working_dtype(residual, t0, y0, yp0, args)
    _refuse_nonfinite(y0=y0, yp0=yp0, t0=t0, t1=t1, saveat=saveat)
    given_t0, given_t1 = _concrete(t0), _concrete(t1)
    y0 = y0.astype(dtype)
    yp0 = None if yp0 is None else yp0.astype(dtype)
    t0 = jnp.asarray(t0, dtype)
    t1 = jnp.asarray(t1, dtype)
    if t0.ndim or t1.ndim:
        raise ValueError("`t0` and `t1` must be scalars.")
    # Times given as numbers are known under `jit` too, where the conversion above is
    # traced: checked as converted to the working dtype.
    ct0 = None if given_t0 is None else np.asarray(given_t0).astype(dtype)
    ct1 = None if given_t1 is None else np.asarray(given_t1).astype(dtype)
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
        saveat = jnp.asarray(_check_saveat_type(saveat), dtype)
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
    if max_steps is None:
        raise ValueError(
            "`max_steps` must be a positive integer; None (no limit, as diffrax allows) is "
            "not supported: the integration is one compiled loop whose checkpoint and "
            "step buffers are sized by max_steps. Pass an upper bound on the number of "
            "steps (default 100_000).")
    if not (isinstance(max_steps, (int, np.integer)) and not isinstance(max_steps, bool)
            and max_steps > 0):
        raise ValueError(f"`max_steps` must be a positive integer, got {max_steps!r}.")
    if quadrature is not None:
        y = jax.ShapeDtypeStruct((n,), dtype)
        qout = eqx.filter_eval_shape(quadrature, jax.ShapeDtypeStruct((), dtype), y, y, args)
        if not (hasattr(qout, "shape") and len(qout.shape) == 1):
            raise ValueError(
                "`quadrature` must return a 1-D array q(t, y, yp, args); it returned "
                f"{getattr(qout, 'shape', type(qout).__name__)}.")
    return t0, t1, y0, yp0, saveat, algebraic, rtol, atol, tstop


def _library(x) -> str:
    """The top-level package that defines x's type (e.g. "diffrax", "lineax")."""
    return type(x).__module__.split(".")[0]


def _check_saveat_type(saveat):
    """`saveat` is an array of times. Other objects (a diffrax `SaveAt`, anything with
    `ts`/`subs` attributes, a dict) are refused with what to pass instead, before JAX
    reports an opaque conversion error."""
    if (isinstance(saveat, (jax.Array, np.ndarray, list, tuple, float, int, np.number))
            or hasattr(saveat, "__array__") or hasattr(saveat, "__jax_array__")):
        return saveat
    if hasattr(saveat, "ts") or hasattr(saveat, "subs") or _library(saveat) == "diffrax":
        raise TypeError(
            f"`saveat` takes the output times as a 1-D array, not a {type(saveat).__name__} "
            "object. For diffrax's SaveAt(ts=ts) pass saveat=ts; SaveAt(t1=True) is the "
            "default (saveat=None); SaveAt(steps=True) is steps=True (sol.step_ts, "
            "sol.step_ys) and SaveAt(dense=True) is dense=True (sol.evaluate(t)).")
    try:
        np.asarray(saveat, dtype=float)
    except (TypeError, ValueError):
        raise TypeError("`saveat` must be a 1-D array of output times, got a "
                        f"{type(saveat).__name__}.") from None
    return saveat


# diffrax's adjoints and the daeadjoint reverse mode that does the same.
_DIFFRAX_ADJOINTS = {
    "BacksolveAdjoint": "daeadjoint.Adjoint() (the continuous adjoint DAE, solved backward "
                        "with checkpoints)",
    "RecursiveCheckpointAdjoint": "daeadjoint.DiscreteAdjoint() (the adjoint of the "
                                  "recorded steps)",
    "DirectAdjoint": "daeadjoint.DiscreteAdjoint() (the adjoint of the recorded steps)",
}


def _check_sensitivity(sensitivity):
    """`sensitivity` is a reverse mode (`Adjoint()`, `DiscreteAdjoint()`). A diffrax
    adjoint or solver — a diffrax user's first try — is named with its counterpart."""
    if isinstance(sensitivity, AbstractAdjoint):
        return
    what = type(sensitivity).__name__
    hint = ""
    if _library(sensitivity) == "diffrax":
        bases = [c.__name__ for c in type(sensitivity).__mro__]
        if what in _DIFFRAX_ADJOINTS:
            hint = f" For diffrax.{what}() pass sensitivity={_DIFFRAX_ADJOINTS[what]}."
        elif what == "ForwardMode":
            hint = (" Forward mode needs no option: jax.jvp and jax.jacfwd through solve use "
                    "forward sensitivities (options: forward_sensitivity="
                    "daeadjoint.ForwardSensitivity(...)).")
        elif "AbstractSolver" in bases:
            hint = (f" diffrax.{what} is an integrator: daeadjoint always integrates with "
                    "variable-order BDF (IDAS), and `sensitivity` chooses how reverse-mode "
                    "derivatives are computed.")
    raise TypeError("`sensitivity` must be daeadjoint.Adjoint() or "
                    f"daeadjoint.DiscreteAdjoint(), got {sensitivity!r}.{hint}")


# lineax's solvers and the daeadjoint linear solver that does the same.
_LINEAX_SOLVERS = {
    **dict.fromkeys(("LU", "QR", "SVD", "Cholesky", "AutoLinearSolver", "Triangular"),
                    "daeadjoint.DenseLU()"),
    "Tridiagonal": "daeadjoint.BandedLU(1, 1)",
    "Diagonal": "daeadjoint.BandedLU(0, 0)",
    **dict.fromkeys(("GMRES", "BiCGStab", "CG", "NormalCG"),
                    "daeadjoint.Krylov(preconditioner=...)"),
}


def _check_linear_solver(linear_solver):
    """`linear_solver` is a daeadjoint linear solver. A preconditioner, or a lineax solver
    (which solves a given operator, where daeadjoint's build and factor the iteration
    matrix from the residual), is named with what to pass instead."""
    if isinstance(linear_solver, AbstractPreconditioner):
        raise TypeError(f"`linear_solver` is a preconditioner ({type(linear_solver).__name__}), "
                        "which only approximates the iteration matrix: use it through "
                        "linear_solver=daeadjoint.Krylov(preconditioner=...).")
    if isinstance(linear_solver, AbstractLinearSolver):
        return
    what = type(linear_solver).__name__
    hint = ""
    if isinstance(linear_solver, lx.AbstractLinearSolver):
        instead = _LINEAX_SOLVERS.get(what, "daeadjoint.DenseLU() or another daeadjoint solver")
        hint = (f" lineax.{what} solves a given operator; daeadjoint's solvers build, factor "
                "and reuse the Newton iteration matrix J = F_y + cj F_y' from the residual "
                f"(and its transpose for the adjoint): pass {instead}.")
    raise TypeError("`linear_solver` must be a daeadjoint linear solver (e.g. "
                    f"daeadjoint.DenseLU()), got {linear_solver!r}.{hint}")


def _check_breakpoints(breakpoints, dtype):
    """`breakpoints` as a sorted 1-D array of the working dtype, or None."""
    if breakpoints is None:
        return None
    bps = jnp.asarray(breakpoints, dtype)
    if bps.ndim != 1:
        raise ValueError(f"`breakpoints` must be a 1-D array of times, got shape {bps.shape}.")
    if bps.shape[0] == 0:
        return None
    cb = _concrete(bps)
    if cb is not None:
        if not np.all(np.isfinite(cb)):
            raise ValueError(f"`breakpoints` must be finite, got {cb}.")
        if np.any(np.diff(cb) < 0):
            raise ValueError("`breakpoints` must be sorted in increasing order.")
    # Where the integration stops, not a quantity the solution depends on smoothly.
    return jax.lax.stop_gradient(bps)


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
