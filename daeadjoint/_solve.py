"""The public entry point `solve`: input checks, consistent initialization, the forward
integration, and the choice of how derivatives are computed."""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ._adjoint import Adjoint, backward
from ._discrete_adjoint import DiscreteAdjoint, discrete_backward
from ._initialization import consistent_initial_conditions
from ._integrator import (CheckpointRecorder, Outputs, Problem, StepLog, initial_state,
                          initial_step, integrate, write_outputs)
from ._linear_solver import DenseLU
from ._results import RESULTS
from ._solution import Solution

_INIT_MODES = (None, "ya_ydp", "y")
# Below this multiple of machine epsilon the Newton tests (0.33·tol) and the error test
# drown in rounding: the corrections they accept are no longer resolved.
_MIN_RTOL_EPS = 100.0


def _concrete(x):
    """The value of x if it is known before tracing, else None."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError, TypeError):
        return None


def _check_inputs(residual, t0, t1, y0, yp0, args, saveat, algebraic, init, quadrature,
                  rtol, atol, tstop, max_steps):
    """Every check that can be made before tracing, each with a message naming the
    argument. Returns the arrays converted to the working dtype."""
    if not callable(residual):
        raise TypeError("`residual` must be a function residual(t, y, yp, args) -> array.")
    y0 = jnp.asarray(y0)
    if not jnp.issubdtype(y0.dtype, jnp.floating):
        y0 = y0.astype(jnp.result_type(float))
    if y0.ndim != 1:
        raise ValueError(f"`y0` must be a 1-D array, got shape {y0.shape}.")
    n = y0.shape[0]
    if n == 0:
        raise ValueError("`y0` is empty: there is nothing to integrate.")
    dtype = y0.dtype
    if yp0 is not None:
        yp0 = jnp.asarray(yp0, dtype)
        if yp0.shape != y0.shape:
            raise ValueError(f"`yp0` has shape {yp0.shape} but `y0` has shape {y0.shape}.")
    if init not in _INIT_MODES:
        raise ValueError(f"`init` must be one of None, 'ya_ydp', 'y'; got {init!r}.")
    t0 = jnp.asarray(t0, dtype)
    t1 = jnp.asarray(t1, dtype)
    if t0.ndim or t1.ndim:
        raise ValueError("`t0` and `t1` must be scalars.")
    ct0, ct1 = _concrete(t0), _concrete(t1)
    if ct0 is not None and ct1 is not None:
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
            if ct0 is not None and ct1 is not None and (cs[0] < ct0 or cs[-1] > ct1):
                raise ValueError(
                    f"`saveat` must lie in [t0, t1] = [{float(ct0)}, {float(ct1)}]; got "
                    f"[{float(cs[0])}, {float(cs[-1])}].")
    if algebraic is None:
        algebraic = jnp.zeros((n,), bool)
    else:
        algebraic = jnp.asarray(algebraic)
        if algebraic.shape != (n,) or algebraic.dtype != bool:
            raise ValueError(
                f"`algebraic` must be a boolean mask of shape ({n},), got {algebraic.dtype} "
                f"of shape {algebraic.shape}.")
    rtol = jnp.asarray(rtol, dtype)
    atol = jnp.asarray(atol, dtype)
    if rtol.ndim != 0:
        raise ValueError("`rtol` must be a scalar.")
    if atol.shape not in ((), (n,)):
        raise ValueError(f"`atol` must be a scalar or have shape ({n},), got {atol.shape}.")
    atol = jnp.broadcast_to(atol, (n,))
    crt, cat = _concrete(rtol), _concrete(atol)
    if crt is not None and cat is not None:
        if crt < 0 or np.any(cat < 0) or (crt == 0 and np.any(cat == 0)):
            raise ValueError(
                f"Tolerances must be non-negative and not both zero: rtol={crt}, atol={cat}.")
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
        if cts is not None and ct1 is not None and cts < ct1:
            raise ValueError(f"`tstop` ({float(cts)}) must be >= t1 ({float(ct1)}).")
    if not (isinstance(max_steps, (int, np.integer)) and max_steps > 0):
        raise ValueError(f"`max_steps` must be a positive integer, got {max_steps!r}.")

    yp_probe = y0 if yp0 is None else yp0
    out = jax.eval_shape(residual, t0, y0, yp_probe, args)
    if not (hasattr(out, "shape") and out.shape == y0.shape):
        shape = getattr(out, "shape", type(out).__name__)
        raise ValueError(
            f"`residual` must return an array shaped like y {y0.shape}; it returned {shape}.")
    if quadrature is not None:
        qout = jax.eval_shape(quadrature, t0, y0, yp_probe, args)
        if not (hasattr(qout, "shape") and len(qout.shape) == 1):
            raise ValueError(
                "`quadrature` must return a 1-D array q(t, y, yp, args); it returned "
                f"{getattr(qout, 'shape', type(qout).__name__)}.")
    return t0, t1, y0, yp0, saveat, algebraic, rtol, atol, tstop


class _Static(eqx.Module):
    """The non-array configuration of a solve (hashable; part of the compiled program)."""

    residual: Callable = eqx.field(static=True)
    quadrature: Callable | None = eqx.field(static=True)
    init: str | None = eqx.field(static=True)
    max_steps: int = eqx.field(static=True)
    suppress_algebraic_error: bool = eqx.field(static=True)
    quad_error_control: bool = eqx.field(static=True)


def build_problem(static: _Static, linear_solver, t0, y0, yp0, args, algebraic, rtol, atol,
                  quad_rtol, quad_atol, tstop) -> Problem:
    dtype = y0.dtype
    error_mask = jnp.where(algebraic & static.suppress_algebraic_error, 0.0, 1.0).astype(dtype)
    nq = 0
    if static.quadrature is not None:
        nq = jax.eval_shape(static.quadrature, t0, y0, yp0, args).shape[0]
    return Problem(
        residual=static.residual, quadrature=static.quadrature, linear_solver=linear_solver,
        args=args, rtol=rtol, atol=atol, error_mask=error_mask,
        quad_rtol=jnp.broadcast_to(jnp.asarray(quad_rtol, dtype), ()),
        quad_atol=jnp.broadcast_to(jnp.asarray(quad_atol, dtype), (nq,)),
        quad_error_control=static.quad_error_control, tstop=tstop,
    )


def forward_solve(static: _Static, linear_solver, t0, t1, y0, yp0, args, saveat,
                  algebraic, rtol, atol, quad_rtol, quad_atol, tstop, checkpoint_every=None,
                  log_steps=False):
    """Consistent initialization (if asked) and the forward integration; pure JAX.

    Returns (solution, final BDF state, recorder or None, consistent (y0, y'0)); the
    recorder holds checkpoints (`checkpoint_every`) or the step sequence (`log_steps`)."""
    init_ok = jnp.ones((), bool)
    if static.init is not None:
        y0, yp0, init_ok = consistent_initial_conditions(
            static.residual, t0, y0, yp0, args, algebraic, static.init, rtol, atol)
    problem = build_problem(static, linear_solver, t0, y0, yp0, args, algebraic, rtol, atol,
                            quad_rtol, quad_atol, tstop)
    # IDAS bases the first step on the distance to the first output time.
    t_out = jnp.min(jnp.where(saveat > t0, saveat, t1))
    qp0 = problem.quad(t0, y0, yp0)
    h0 = initial_step(problem, t0, y0, yp0, qp0, t_out)
    state = initial_state(problem, t0, y0, yp0, h0)
    state = eqx.tree_at(lambda s: s.result, state,
                        RESULTS.where(init_ok, RESULTS.successful, RESULTS.initialization_failed))
    n_save, n, nq = saveat.shape[0], y0.shape[0], qp0.shape[0]
    inf = jnp.asarray(jnp.inf, y0.dtype)
    outputs = Outputs(ts=saveat, ys=jnp.full((n_save, n), inf), yps=jnp.full((n_save, n), inf),
                      qs=jnp.full((n_save, nq), inf), index=jnp.zeros((), jnp.int32))
    outputs = write_outputs(state, outputs)     # rows at t0
    recorders = ()
    if checkpoint_every is not None:
        recorders = (CheckpointRecorder.create(state, checkpoint_every, static.max_steps),)
    elif log_steps:
        recorders = (StepLog.create(static.max_steps, y0.dtype),)
    state, outputs, recorders = integrate(problem, state, outputs, t1, static.max_steps, recorders)
    stats = dict(state.stats)
    stats["t_final"] = state.t
    sol = Solution(ts=saveat, ys=outputs.ys, yps=outputs.yps,
                   qs=outputs.qs if static.quadrature is not None else None,
                   stats=stats, result=state.result)
    checkpoints = recorders[0] if recorders else None
    return sol, state, checkpoints, (y0, yp0)


@eqx.filter_custom_vjp
def _solve_differentiable(diff, static, adjoint, linear_solver, nondiff):
    """`forward_solve` with reverse-mode derivatives by the adjoint (`_adjoint.py`).

    diff = (t0, t1, y0, yp0, args, saveat) are differentiated; nondiff = (algebraic,
    rtol, atol, quad_rtol, quad_atol, tstop) are not."""
    t0, t1, y0, yp0, args, saveat = diff
    sol, _, _, _ = forward_solve(static, linear_solver, t0, t1, y0, yp0, args, saveat,
                                 nondiff[0], *nondiff[1:])
    return sol


@_solve_differentiable.def_fwd
def _solve_fwd(perturbed, diff, static, adjoint, linear_solver, nondiff):
    t0, t1, y0, yp0, args, saveat = diff
    discrete = isinstance(adjoint, DiscreteAdjoint)
    sol, state, recorder, (y0c, yp0c) = forward_solve(
        static, linear_solver, t0, t1, y0, yp0, args, saveat, nondiff[0], *nondiff[1:],
        checkpoint_every=None if discrete else adjoint.checkpoint_every, log_steps=discrete)
    return sol, (sol, recorder, state.t, y0c, yp0c)


@_solve_differentiable.def_bwd
def _solve_bwd(residuals, grad_sol, perturbed, diff, static, adjoint, linear_solver, nondiff):
    sol, checkpoints, t_final, y0c, yp0c = residuals
    t0, t1, y0, yp0, args, saveat = diff
    algebraic, rtol, atol, quad_rtol, quad_atol, tstop = nondiff

    def zero_if_none(g, like):
        return jnp.zeros_like(like) if g is None else g

    ybar = zero_if_none(grad_sol.ys, sol.ys)
    ypbar = zero_if_none(grad_sol.yps, sol.yps)
    qs = sol.qs if sol.qs is not None else jnp.zeros((saveat.shape[0], 0), y0c.dtype)
    qbar = zero_if_none(grad_sol.qs, qs) if sol.qs is not None else qs
    sol = sol.result.error_if(sol, sol.result != RESULTS.successful)
    if isinstance(adjoint, DiscreteAdjoint):
        ybar0, ypbar0, argsbar, t0bar, tsbar = discrete_backward(
            adjoint, static, checkpoints, y0c, yp0c, diff, nondiff, sol, (ybar, ypbar, qbar))
    else:
        problem = build_problem(static, linear_solver, t0, y0c, yp0c, args, algebraic, rtol,
                                atol, quad_rtol, quad_atol, tstop)
        ybar0, ypbar0, argsbar, t0bar, tsbar, _ = backward(
            adjoint, static, problem, checkpoints, y0c, yp0c, diff, nondiff, sol,
            (ybar, ypbar, qbar))
    grads = (t0bar, jnp.zeros_like(t1), ybar0, ypbar0, argsbar, tsbar)
    return jax.tree_util.tree_map(lambda g, p: g if p else None, grads, perturbed,
                                  is_leaf=lambda x: x is None)


def solve(
    residual: Callable,
    t0,
    t1,
    y0,
    yp0=None,
    args: Any = None,
    *,
    saveat=None,
    algebraic=None,
    init: str | None = None,
    quadrature: Callable | None = None,
    rtol=1e-6,
    atol=1e-6,
    max_steps: int = 100_000,
    sensitivity=None,
    throw: bool = True,
    tstop=None,
    suppress_algebraic_error: bool = False,
    quad_rtol=None,
    quad_atol=None,
    quad_error_control: bool = False,
    linear_solver=DenseLU(),
) -> Solution:
    r"""Solve the DAE F(t, y, y', args) = 0 on [t0, t1] with variable-order BDF (IDAS).

    **Arguments:**

    - `residual`: `F(t, y, yp, args) -> array` shaped like `y`.
    - `t0`, `t1`: the interval, t1 > t0.
    - `y0`: 1-D initial state. Its dtype is the working precision (float64 recommended).
    - `yp0`: initial y'. Default None: computed together with the algebraic components of
      y0 by consistent initialization (as `init="ya_ydp"`).
    - `args`: any pytree passed to `residual` (and `quadrature`).
    - `saveat`: sorted 1-D array of output times in [t0, t1]; default `[t1]`. Outputs come
      from the BDF interpolating polynomial; steps are not forced onto them.
    - `algebraic`: bool mask, True where y_i is algebraic (F does not depend on y'_i).
    - `init`: None (take y0, yp0 as consistent), `"ya_ydp"` (compute the algebraic part of
      y0 and the differential part of y'0 from the differential part of y0), or `"y"`
      (compute all of y0 from y'0).
    - `quadrature`: `q(t, y, yp, args) -> 1-D array`; `sol.qs[i]` = ∫_{t0}^{ts[i]} q dt.
      Quadratures are corrected after each step, never inside Newton; they enter the error
      test only with `quad_error_control=True` (tolerances `quad_rtol`, `quad_atol`,
      defaulting to `rtol`, `atol`).
    - `rtol`, `atol`: error weights W_i = 1/(rtol |y_i| + atol_i); atol scalar or (n,).
    - `max_steps`: give up (status `max_steps_reached`) after this many steps.
    - `sensitivity`: how reverse-mode derivatives through `solve` are computed:
      `Adjoint()` (default; the continuous adjoint DAE) or `DiscreteAdjoint()` (the
      discrete adjoint of the recorded steps; for losses with many observation times).
    - `throw`: raise on failure (via `equinox.error_if`, works under jit). With False,
      inspect `sol.result`; the solution up to the failure is returned.
    - `tstop`: never step past this time (≥ t1). Default: the integrator may step past t1
      and interpolate back, as IDAS does.
    - `suppress_algebraic_error`: leave algebraic components out of the local error test
      (IDAS `IDASetSuppressAlg`).
    - `linear_solver`: `DenseLU()` (default; `DenseLU(jac=...)` for a user iteration
      matrix F_y + cj F_y').

    **Returns:** a `Solution` with `ts`, `ys`, `yps`, `qs`, `stats`, `result`.
    """
    t0, t1, y0, yp0, saveat, algebraic, rtol, atol, tstop = _check_inputs(
        residual, t0, t1, y0, yp0, args, saveat, algebraic, init, quadrature, rtol, atol,
        tstop, max_steps)
    if yp0 is None:
        yp0 = jnp.zeros_like(y0)
        if init is None:
            init = "ya_ydp"
    quad_rtol = rtol if quad_rtol is None else quad_rtol
    quad_atol = jnp.max(atol) if quad_atol is None else quad_atol
    static = _Static(residual=residual, quadrature=quadrature, init=init, max_steps=int(max_steps),
                     suppress_algebraic_error=bool(suppress_algebraic_error),
                     quad_error_control=bool(quad_error_control))
    if sensitivity is None:
        sensitivity = Adjoint()
    if not isinstance(sensitivity, (Adjoint, DiscreteAdjoint)):
        raise TypeError("`sensitivity` must be daeadjoint.Adjoint() or "
                        f"daeadjoint.DiscreteAdjoint(), got {sensitivity!r}.")
    sol = _solve_differentiable((t0, t1, y0, yp0, args, saveat), static, sensitivity,
                                linear_solver, (algebraic, rtol, atol, quad_rtol, quad_atol, tstop))
    if throw:
        # The status is an integer output of the custom_vjp: keep it out of the JVP trace.
        result = jax.tree_util.tree_map(jax.lax.stop_gradient, sol.result)
        sol = result.error_if(sol, result != RESULTS.successful)
    return sol
