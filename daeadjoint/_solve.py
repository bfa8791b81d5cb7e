"""The public entry point `solve`: input checks (`_validation.py`) and the working
precision, the compiled and cached solve, and the dense output's dependence on the output
times."""

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import ArrayLike

from ._closures import lift_closures, traced_once
from ._consistency import AUTO_SPLIT_MAX_N, consistency_factor, split_at, unknown_mask
from ._delay.buffer import DelayArgs
from ._core import Config, Inputs
from ._derivatives import batching  # noqa: F401 - installs the primitives' batching rules
from ._derivatives.adjoint import Adjoint
from ._derivatives.autodiff import solve_core
from ._derivatives.discrete_adjoint import DiscreteAdjoint
from ._derivatives.forward_sensitivity import ForwardSensitivity
from ._events import Event
from ._jax_internals import (batched_loops, explicit_batch_axis, is_batched, linearized_in_jit,
                             unvmap_any)
from ._index2 import check_index2_mask, index2_check, project
from ._initialization import SUCCESS, InitMode, failure_messages, message_index
from ._linalg.linear_solver import AbstractLinearSolver, DenseLU, masked_residual
from ._linalg.jacobian import SparsityDetectionError, structurally_algebraic
from ._linalg.sparse import default_linear_solver
from ._results import RESULTS, runtime_errors_raise, succeeded
from ._solution import EventRoots, Solution
from ._validation import (_check_breakpoints, _check_event, _check_inputs, _check_linear_solver,
                          _check_sensitivity, _check_step_options, _concrete, _snap_saveat)

# With more output times than this the default reverse mode is the discrete adjoint,
# whose cost does not grow with the number of observations (the continuous adjoint
# restarts at each one: Calver & Enright).
MANY_OBSERVATIONS = 32
# Derivatives of the dense output y^(m)(t_i) carried by the core: y, y', y''. The
# saveat-time Taylor shift below is exact to this order.
DENSE_ORDER = 2


# ------------------------------------------------------------- output-time dependence


def _zero_until(order: int, beyond: str):
    """Z(Δ) = 0 with derivatives 0 up to `order` (by custom JVPs: Z_m' = Z_{m−1}(Δ)·Δ̇),
    and beyond: NaN (`beyond="nan"`, Z_0' = NaN·Δ̇) or an error when JAX differentiates
    Z_0 (`"raise"`)."""

    def zeros(delta):
        # Exact zeros computed from Δ (a select, not `zeros_like`): under a `vmap` that
        # batches Δ they are batched like the tangent below, which JAX requires of a
        # custom JVP's outputs inside a `jit` when it linearizes (with an unbatched
        # primal, `grad` of a vmapped solve with batched output times failed to trace:
        # "broadcast_in_dim broadcast_dimensions must have length equal to operand ndim").
        return jnp.where(jnp.ones_like(delta, dtype=bool), jnp.zeros((), delta.dtype), delta)

    @jax.custom_jvp
    def zero(delta):
        return zeros(delta)

    @zero.defjvp
    def zero_jvp(primals, tangents):
        (delta,), (delta_dot,) = primals, tangents
        if order > 0:
            return zeros(delta), _zero_until(order - 1, beyond)(delta) * delta_dot
        if beyond == "nan":
            return zeros(delta), delta_dot * jnp.nan
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


def _solve_body(config: Config, inputs: Inputs):
    """The solve as one program (`_solve_compiled` compiles it): (Solution, (reason,
    component) of a failed initialization). Raising on failure (`throw`) is left to
    `_raise_on_failure`, outside this cached program, so that an error names the call
    that failed."""
    core = solve_core(config, _core_inputs(inputs))
    return _solution(config, inputs, core)


_solve_compiled = eqx.filter_jit(_solve_body)


def _core_inputs(inputs: Inputs) -> Inputs:
    """The inputs of the integration: output times within rounding outside [t0, t1] moved
    onto t0 or t1, t1 and the output times not differentiated through (the solution's
    derivatives with respect to them are added by `_shift_to_saveat`)."""
    sg = jax.lax.stop_gradient
    return dataclasses.replace(
        inputs, t1=sg(inputs.t1),
        saveat=_snap_saveat(sg(inputs.saveat), sg(inputs.t0), sg(inputs.t1)))


def _with_batched_tangents(residual, batched):
    """`residual` with its time and state inputs multiplied by an exact 1 that depends
    on `batched` (a batched scalar that every outer derivative reaches): the same
    values, and every tangent batched — the inner ones (the Jacobians') through the
    product, the outer ones' (jacfwd or grad around the solve) through 0·d`batched`,
    which JAX cannot drop as a symbolic zero."""
    def F(t, y, yp, args):
        one = 1.0 + 0.0 * jnp.where(jnp.isfinite(batched), batched, 0.0).astype(y.dtype)
        return residual(t * one, y * one, yp * one, args)
    return F


def _rates_at_t0(config: Config, inputs: Inputs, yd):
    """The dense output `yd` with y' and y'' of its rows at t0 made the solution's.

    Rows at t0 are the initial values (y0, y'0) with y'' = 0 (the initial state's
    polynomial is of degree 1), and along ker F_y' (the algebraic components) y'0 is not
    determined by F = 0: `init="ya_ydp"` computes y_a and y'_d only (as IDAS does),
    `init=None` and `init="y"` keep the caller's y'0. So y'_a there was an unused guess
    (0 by default), reported in `sol.yps`, and the output-time derivatives
    (`_shift_to_saveat`: d sol.ys/dt = y', d sol.yps/dt and d² sol.ys/dt² = y'') of a
    row at t0 used it and y'' = 0 — and so did the derivatives with respect to t0.

    The solution's values are those of the differentiated DAE (index 1: Brenan,
    Campbell & Petzold, *Numerical Solution of Initial-Value Problems in
    Differential-Algebraic Equations*, §2.5). Along the solution F_t + F_y y' + F_y' y''
    = 0, and with F_y' Π = 0 the unknowns Π y' and (I − Π) y'' solve

        C u = −(F_t + F_y (I − Π) y'),   C = F_y Π + F_y' (I − Π),

    the consistency matrix of `init="ya_ydp"` (y'_a does not enter it: F_y' Π = 0);
    differentiated once more (with ker F_y' constant, as for a mask), Π y'' and
    (I − Π) y⁽³⁾ solve C w = −g⁽²⁾(0) for g(τ) = F(t0 + τ, y + τ y' + τ² (I − Π) y''/2,
    y' + τ (I − Π) y''). One factorization of C (dense up to AUTO_SPLIT_MAX_N unknowns,
    else the configured solver's) and two solves, differentiable, only when a row is at
    t0.
    Rows at other times come from the interpolating polynomial and are unchanged; so is
    the integration."""
    if config.index2 or isinstance(inputs.args, DelayArgs) or yd.shape[1] < 3:
        return yd
    sg = jax.lax.stop_gradient
    n = yd.shape[-1]
    # Up to AUTO_SPLIT_MAX_N unknowns C is formed and factored densely by plain JAX
    # operations, differentiable to any order. Above, the configured solver's
    # `custom_linear_solve`, whose JVP rule in jax 0.10 fails to trace some nested
    # derivatives (`jax.hessian` with respect to t0: it binds a symbolic zero
    # right-hand side in the transposed solve); used there only where a row is known to
    # be at t0, so that a traced t0 or `saveat` compiles the program it did before.
    if config.rows_at_t0 == 0 or (n > AUTO_SPLIT_MAX_N and config.rows_at_t0 < 2):
        return yd
    # The rows are the core's, at the output times not differentiated through (their
    # motion, and so t0's, is `_shift_to_saveat`'s): their time is t0's value.
    t0 = sg(inputs.t0)
    at_t0 = _snap_saveat(sg(inputs.saveat), t0, sg(inputs.t1)) == t0
    # The first row at t0 by a one-hot select (a gather at a batched index has no
    # unambiguous sharding in an explicitly sharded vmap).
    first = (at_t0 & (jnp.cumsum(at_t0) == 1))[:, None]
    args = inputs.args
    F = config.residual
    if config.explicit_batch:
        # Under a vmap over an explicitly sharded axis (outside the integrations'
        # shard_map), a tangent that depends on no batched value is unsharded, and JAX
        # cannot stack it with sharded ones in the residual (`jnp.stack` of its
        # components: ShardingTypeError). Multiplying the residual's inputs by a batched
        # exact 1 makes every tangent the Jacobians push through it batched.
        F = _with_batched_tangents(F, yd[0, 0, 0])

    def consistent(yd):
        y = jnp.sum(jnp.where(first, yd[:, 0], 0), axis=0)
        yp = jnp.sum(jnp.where(first, yd[:, 1], 0), axis=0)
        split = split_at(config.auto_split, F, t0, y, yp, args, inputs.algebraic)
        # C depends on y' only through F_y', which ker F_y' = range Π leaves out of
        # reach of y'_a: the same matrix for both right-hand sides, factored once.
        if n <= AUTO_SPLIT_MAX_N:
            # DenseLU's setup and solve, not under stop_gradient (as the consistency
            # solves' factorizations are): plain JAX operations, differentiated as such.
            dense, zero = DenseLU(), jnp.zeros_like(y)
            state = dense.setup(masked_residual(F, y, yp, split), t0, zero, zero,
                                jnp.zeros((), y.dtype), args)
            singular = dense.is_singular(state)

            def solve_c(rhs):
                return jax.vmap(lambda b: dense.solve(state, b)[0])(rhs)
        else:
            solve_c, singular = consistency_factor(config.linear_solver, F, t0, y, yp,
                                                   args, split)
        yp_d = split.diff(yp)
        _, r = jax.jvp(lambda t, y_: F(t, y_, yp, args), (t0, y), (jnp.ones_like(t0), yp_d))
        u = solve_c(-jnp.asarray(r, yd.dtype)[None])
        yp = yp_d + split.alg(u[0])
        ypp_d = split.diff(u[0])

        def g(tau):
            return F(t0 + tau, y + tau * yp + 0.5 * tau**2 * ypp_d, yp + tau * ypp_d, args)

        def dg(tau):
            return jax.jvp(g, (tau,), (jnp.ones_like(tau),))[1]

        tau = jnp.zeros_like(t0)
        _, r2 = jax.jvp(dg, (tau,), (jnp.ones_like(tau),))
        w = solve_c(-jnp.asarray(r2, yd.dtype)[None])
        ypp = ypp_d + split.alg(w[0])
        use = (at_t0 & ~singular & jnp.all(jnp.isfinite(yp))
               & jnp.all(jnp.isfinite(ypp)))[:, None]
        yd = yd.at[:, 1].set(jnp.where(use, yp, yd[:, 1]))
        return yd.at[:, 2].set(jnp.where(use, ypp, yd[:, 2]))

    return jax.lax.cond(unvmap_any(at_t0), consistent, lambda yd: yd, yd)


def _solution(config: Config, inputs: Inputs, core):
    """(Solution, init_info) of a run's Core."""
    ys, yps, qs = _shift_to_saveat(_rates_at_t0(config, inputs, core.yd), core.qs,
                                   inputs.saveat, inputs.args, config.quadrature)
    stats = dict(core.stats)
    stats["t_final"] = core.t_final
    result = jax.tree_util.tree_map(jax.lax.stop_gradient, core.result)
    events = None
    if config.event is not None:
        stats["num_events"] = jnp.sum(jnp.isfinite(core.event_t)).astype(jnp.int32)
        events = EventRoots(ts=core.event_t, ys=core.event_yd[:, 0], yps=core.event_yd[:, 1],
                            masks=core.event_mask)
    sentinel = None
    if core.dense is not None:
        diff = [inputs.t0, inputs.t1, inputs.y0, inputs.yp0, inputs.saveat] + \
            jax.tree_util.tree_leaves(eqx.filter(inputs.args, eqx.is_inexact_array))
        sentinel = sum(0.0 * jnp.sum(x) for x in diff)
    sol = Solution(ts=inputs.saveat, ys=ys, yps=yps,
                   qs=qs if config.quadrature is not None else None,
                   stats=stats, result=result, events=events, dense=core.dense,
                   _sentinel=sentinel)
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
        # A one-hot select rather than an index: a gather of an unbatched mask at a
        # batched index has no unambiguous sharding in an explicitly sharded vmap.
        is_y = jnp.any(unknown_mask(config.init, inputs.algebraic)
                       & (jnp.arange(n) == jnp.clip(worst, 0, n - 1)))
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
    if cf is not None and ci is not None and runtime_errors_raise():
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


def _explicit_batch() -> bool:
    """Whether this solve runs under a `vmap` over an explicitly sharded mesh axis (or in
    a `jax.set_mesh` context with explicit axes, where a `jit` may hide the `vmap`):
    then its integrations are primitives batched by `shard_map` (`batching.py`)."""
    mesh = jax.sharding.get_abstract_mesh()
    axis = explicit_batch_axis()
    if axis is not None and mesh.empty:
        # JAX's batching along an explicit axis needs the mesh in context (without it
        # even a plain vmapped while_loop fails, naming an axis "not found in mesh: ()").
        raise ValueError(
            f"daeadjoint: `solve` is vmapped over a batch sharded along the explicit mesh "
            f"axis {axis} without a mesh in context: call it inside `with "
            "jax.set_mesh(mesh):`, or make the mesh with "
            "`axis_types=(jax.sharding.AxisType.Auto, ...)`.")
    return axis is not None or (not mesh.empty and bool(mesh.explicit_axes))


def _structural_algebraic(residual, t0, y0, yp0, args, default):
    """Above AUTO_SPLIT_MAX_N unknowns without a mask: the components whose y' the
    residual's program never reads (`structurally_algebraic`), so that a large
    semi-explicit DAE gets the algebraic split its initialization, initial sensitivities
    and adjoint need (the adjoint's final and restart conditions are solved in the
    algebraic directions: with none, the adjoint of a DAE fails). `default` (all False)
    when the program cannot be analysed or every column of F_y' may be nonzero."""
    try:
        mask = structurally_algebraic(residual, t0, y0, yp0, args)
    except SparsityDetectionError:
        return default
    return jnp.asarray(mask) if mask.any() else default


def _rows_at_t0(saveat, t0, t1) -> int:
    """Whether an output row lies at t0 (`Config.rows_at_t0`): 0 when the output times
    are known (not traced) and none can be at t0 after the working dtype's rounding and
    `_snap_saveat` (a time is at t0 only if it is not above it, so a margin of 1e-5
    relative, above float32's snapping, stays on the safe side); 2 when one is known to
    be (within the same margin); 1 when anything is traced."""
    s, a, b = (_concrete(x) for x in (t1 if saveat is None else saveat, t0, t1))
    if s is None or a is None or b is None:
        return 1
    try:
        s, a, b = (np.asarray(x, np.float64) for x in (s, a, b))
    except (TypeError, ValueError):
        return 1
    margin = 1e-5 * np.maximum(np.abs(a), np.abs(s)) + np.finfo(np.float64).tiny
    return 2 if (np.any(s <= a + margin) or np.any(b <= a + margin)) else 0


def _configure(residual, t0, t1, y0, yp0, args, *, saveat, algebraic, index2, init, quadrature,
               rtol, atol, max_steps, sensitivity, forward_sensitivity, throw, tstop, breakpoints,
               suppress_algebraic_error, quad_rtol, quad_atol, quad_error_control, linear_solver, constraints, max_step,
               min_step, first_step, max_order, event, steps, dense, progress):
    """`solve`'s inputs checked and completed (defaults, linear solver, lifted closures):
    (Config, Inputs) of the compiled solve (`_core.run`). Also `solve_ensemble`'s queue
    builds each member's solve from these."""
    index2_mask = None
    if index2 is not None:
        index2_mask, algebraic = check_index2_mask(index2, algebraic, np.shape(y0)[0], init,
                                                   yp0 is not None, breakpoints)
    # Without a mask the algebraic directions are found from F_y' where needed.
    auto_split = algebraic is None and np.shape(y0)[0] <= AUTO_SPLIT_MAX_N
    check_algebraic = algebraic is not None
    rows_at_t0 = _rows_at_t0(saveat, t0, t1)
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
    if not check_algebraic and not auto_split:
        algebraic = _structural_algebraic(residual, t0, y0, yp0, args, algebraic)
    if sensitivity is None:
        # The same rule with `index2` (docs/index2.md, "Derivatives": on Fekete, n = 160,
        # the continuous adjoint's gradient runs ~20x faster than the discrete one, with
        # the same accuracy).
        sensitivity = (Adjoint() if saveat.shape[0] <= MANY_OBSERVATIONS
                       else DiscreteAdjoint())
    _check_sensitivity(sensitivity)
    if forward_sensitivity is None:
        forward_sensitivity = ForwardSensitivity()
    if linear_solver is None:
        linear_solver = default_linear_solver(residual, t0, y0, yp0, args)
    _check_linear_solver(linear_solver)
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
    # The residual and quadrature traced once per signature, not once per use (the
    # residual is used at ~8 places of a forward program, ~50 of a gradient's).
    residual, quadrature = traced_once(residual), traced_once(quadrature)
    if index2_mask is not None:
        if init is not None:   # "ya_ydp" (or yp0=None): project onto the constraints
            y0, yp0 = project(residual, t0, y0, yp0, args, index2_mask, algebraic, rtol, atol)
            init = None
        y0 = index2_check(residual, t0, t1, y0, yp0, args, index2_mask, algebraic, rtol, atol)
    config = Config(
        residual=residual, quadrature=quadrature, linear_solver=linear_solver,
        reverse=sensitivity, forward=forward_sensitivity, init=init,
        max_steps=int(max_steps), suppress_algebraic_error=bool(suppress_algebraic_error),
        quad_error_control=bool(quad_error_control), order=DENSE_ORDER, throw=bool(throw),
        max_order=int(max_order), event=event,
        progress=(100 if progress is True else int(progress)),
        auto_split=auto_split, explicit_batch=_explicit_batch(), rows_at_t0=rows_at_t0,
        dense=(2 if dense else (1 if steps else 0)), check_algebraic=check_algebraic,
        index2=() if index2_mask is None else tuple(int(i) for i in np.flatnonzero(index2_mask)))
    inputs = Inputs(t0=t0, t1=t1, y0=y0, yp0=yp0, args=args, saveat=saveat,
                    breakpoints=_check_breakpoints(breakpoints, dtype),
                    algebraic=algebraic, rtol=rtol, atol=atol, quad_rtol=quad_rtol,
                    quad_atol=quad_atol, tstop=tstop, constraints=constraints,
                    max_step=max_step, min_step=min_step, first_step=first_step,
                    index2=None if index2_mask is None else jnp.asarray(index2_mask))
    # Under a `vmap` that batches any input: the integrations' flat loop (`integrate`).
    config = dataclasses.replace(config, batched=is_batched((config, inputs)))
    return config, inputs


# Long mostly by its docstring (the reference of every argument, ~150 lines); the body
# is the short sequence check → configure → compile → raise. (`batched_loops`: a `vmap`
# around the call batches the solver's loops with fewer passes, the same program.)
@batched_loops
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
    index2: ArrayLike | None = None,
    init: InitMode | None = None,
    quadrature: Callable | None = None,
    rtol: ArrayLike | None = None,
    atol: ArrayLike = 1e-6,
    max_steps: int = 100_000,
    sensitivity: Adjoint | DiscreteAdjoint | None = None,
    forward_sensitivity: ForwardSensitivity | None = None,
    throw: bool = True,
    tstop: ArrayLike | None = None,
    breakpoints: ArrayLike | None = None,
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
    delays: Any = None,
    history: Callable | None = None,
    history_steps: int = 1000,
    breakpoint_order: int | None = None,
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
      either end count as that end); default `[t1]`. The times themselves, not an
      object like diffrax's `SaveAt` (whose other options are `steps=` and `dense=`). Outputs come from the BDF
      interpolating polynomial; steps are not forced onto them.
    - `algebraic`: bool mask, True where y_i is algebraic (F does not depend on y'_i).
      Checked: column i of F_y' must be zero at t0 and at each Jacobian setup, else
      `RESULTS.wrong_algebraic_mask`.
      Default None: no mask; up to 200 unknowns the algebraic directions are then
      found from the null space of F_y' wherever consistency matters (fully implicit
      DAEs whose singular F_y' mixes components, e.g. circuits with floating
      capacitors); above that, the components whose y'_j the residual's program never
      reads (found by the same program analysis as the sparsity pattern: the algebraic
      components of a semi-explicit DAE). A larger DAE whose singular F_y' mixes
      components needs the mask, or its constraints written in the variables they
      determine.
    - `index2`: bool mask for a Hessenberg index-2 DAE (x' = f(t, x, z), 0 = g(t, x)
      with g_x f_z nonsingular; see the index-2 page), True where y_i is an index-2
      variable — and, by the same indices, where equation i is an index-2 constraint
      (write each constraint at the index of a variable it determines). Index-2
      variables are algebraic: the mask must be a subset of `algebraic` if that is
      given, and is `algebraic` when it is not. They leave the local error test, and
      their columns of the iteration matrix are scaled by cj so that it stays well
      conditioned as h → 0. `y0`, `yp0` are checked before the solve against each
      constraint and its hidden constraint (its time derivative, by `jax.jvp`), with an
      error naming the violated equation. `init="ya_ydp"` (or `yp0=None`) first
      projects them: y0's differential part the least change (error weights' norm)
      onto the constraints, then y' of the differential variables and the algebraic
      variables from the other equations and the hidden constraints (up to 1000
      unknowns); `init="y"` is refused. First derivatives: forward sensitivities
      (`jvp`, `jacfwd`), the continuous adjoint with its index-2 final conditions and
      the discrete adjoint (`grad`, `jacrev`; `sensitivity` as below), from initial
      sensitivities made consistent as `init="ya_ydp"` makes the state; second
      derivatives raise an error, and `breakpoints` are refused. Default None:
      index ≤ 1.
    - `init`: None (take y0, yp0 as consistent), `"ya_ydp"` (compute the algebraic part of
      y0 and the differential part of y'0 from the differential part of y0), or `"y"`
      (compute all of y0 from y'0).
    - `quadrature`: `q(t, y, yp, args) -> 1-D array`; `sol.qs[i]` = ∫_{t0}^{ts[i]} q dt.
      Quadratures are corrected after each step, never inside Newton; they enter the error
      test only with `quad_error_control=True` (IDAS's errconQ; tolerances `quad_rtol`,
      `quad_atol`, defaulting to `rtol`, `atol`). The adjoint's gradient quadrature has
      its own switch, `Adjoint(quad_error_control=...)`.
    - `rtol`, `atol`: error weights W_i = 1/(rtol |y_i| + atol_i); atol scalar or (n,).
      Default rtol: 1e-6 in float64, 1e-4 in float32 (whose smallest accepted rtol is
      100·eps = 1.2e-5); default atol 1e-6. An atol_i of 0 needs y0_i ≠ 0.
    - `max_steps`: give up (status `max_steps_reached`) after this many steps. A
      positive integer, never None: the checkpoint and step buffers are sized by it.
    - `sensitivity`: how reverse-mode derivatives are computed: `Adjoint()` (the
      continuous adjoint DAE; diffrax's `BacksolveAdjoint` is the same idea) or
      `DiscreteAdjoint()` (the adjoint of the recorded steps, like diffrax's
      `RecursiveCheckpointAdjoint`).
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
    - `breakpoints`: sorted 1-D array of times where the inputs of the model are not
      smooth (kinks or jumps of a forcing, e.g. the corners of a piecewise-linear
      pulse). Every integration — the forward solve, the adjoint's replays, the
      backward (adjoint) integration and forward sensitivities — steps exactly onto
      each and restarts the BDF there at order 1, as IDAS users do with `tstop` and
      `IDAReInit`, so that no step's polynomial straddles a kink. At a breakpoint
      the residual should describe what holds after it. Times outside (t0, t1) are
      ignored.
    - `suppress_algebraic_error`: leave algebraic components out of the local error test
      (IDAS `IDASetSuppressAlg`).
    - `linear_solver`: how the Newton systems are solved (`DenseLU()`, `BandedLU(l, u)`,
      `SparseLU()`, …). Default None: `default_linear_solver` — `DenseLU()` up to 100
      unknowns (so small problems are unchanged), above that `SparseLU` with the
      sparsity pattern detected from the residual's program (`DenseLU()` if it is
      dense or cannot be detected). Pass a daeadjoint solver to override it (not a
      lineax one: these build and factor the iteration matrix from the residual); for
      very large systems `Krylov(preconditioner=...)` (matrix-free GMRES; see the
      linear solvers page).
    - `constraints`: int array like y0 (IDASetConstraints): 0 none, 1 y ≥ 0, 2 y > 0,
      −1 y ≤ 0, −2 y < 0. After each Newton solve a violating step is projected back if
      the violation is below the Newton tolerance, else redone with a smaller step (IDAS
      §6.2.2.4); consistent initialization (`init=`) enforces them too. y0 must satisfy
      them.
    - `event`: `Event(cond, terminal=True, direction=0)`: locate the roots of
      `cond(t, y, yp, args)` on the dense output (IDAS §6.2.4); every recorded root in
      `sol.events`, the first in `sol.event_t`, `event_y`, `event_yp`, `event_mask`. A
      terminal event stops the solve there (status `RESULTS.event`, a success; later
      output rows are `inf`). Event times and states are differentiable in every mode.
    - `steps`: also return the accepted step sequence (`sol.step_ts`, `sol.step_ys`).
    - `dense`: also keep every step's interpolating polynomial for `sol.evaluate(t)`
      (memory O(max_steps · 6n)). Neither is differentiable (they depend on the steps).
    - `progress`: print t and the step count while integrating (True: every 100 steps,
      an int: every that many; at most two lines a second; under `vmap` one line for
      the batch, its slowest member's); nothing when False.
    - `max_step`, `min_step`, `first_step`, `max_order`: IDASetMaxStep, IDASetMinStep,
      IDASetInitStep, IDASetMaxOrd (1–5). A step that fails at `min_step` ends the solve
      with the failure's status.

    - `delays`: constant lags τ = (τ_1, …, τ_m) of a delay DAE: an array, or a function
      `delays(args) -> (m,) array` (differentiable like any value in `args`). The
      residual is then `F(t, y, yp, y_lag, args)` with `y_lag[i]` = y(t − τ_i) (shape
      (m, n)), taken from the integrator's interpolating polynomials; see the delays
      page. Derivatives with respect to `args`, the lags, `y0` and the history by the
      variational delay system: `jax.jvp`/`jax.jacfwd`; `jax.grad`/`jax.vjp` by the
      continuous adjoint with advanced arguments λ(t + τ) (`sensitivity=Adjoint()`,
      index 0) or through the Jacobian of one variational solve with a direction per
      input component (`sensitivity=ForwardSensitivity()`); None chooses by the number
      of input components (the delays page); jit outside grad. `quadrature` sees no
      lagged values; no events, dense output or index-2 variables yet.
    - `history`: `h(t, args) -> y(t)` for t ≤ t0 (with `delays=`). Default None: the
      constant history y(t) = y0.
    - `history_steps`: with `delays=`, how many past steps are kept for the lagged
      values (memory O(history_steps · 6n)); a solve that takes more steps within the
      longest lag stops with `RESULTS.delay_history_lost`.
    - `breakpoint_order`: with `delays=`, the breaking points t0 + Σ k_i τ_i with
      1 ≤ Σ k_i ≤ `breakpoint_order` are steps' ends (default `max_order`).

    **Returns:** a `Solution` with `ts`, `ys`, `yps`, `qs`, `stats`, `result` (and
    `events` with `event=`).
    """
    if delays is not None or history is not None:
        if delays is None:
            raise ValueError("`history=` is the history of a delay DAE: pass its lags with "
                             "`delays=`.")
        from ._delay.solve import solve_delayed
        kwargs = dict(
            saveat=saveat, algebraic=algebraic, index2=index2, init=init,
            quadrature=quadrature, rtol=rtol, atol=atol, max_steps=max_steps,
            sensitivity=sensitivity, forward_sensitivity=forward_sensitivity, throw=throw,
            tstop=tstop, breakpoints=breakpoints,
            suppress_algebraic_error=suppress_algebraic_error, linear_solver=linear_solver,
            quad_rtol=quad_rtol, quad_atol=quad_atol, quad_error_control=quad_error_control,
            constraints=constraints, max_step=max_step, min_step=min_step,
            first_step=first_step, max_order=max_order, event=event, steps=steps,
            dense=dense, progress=progress)
        ys, yps, qs, ts, result, stats, t_final = solve_delayed(
            solve, residual, t0, t1, y0, yp0, args, delays=delays, history=history,
            history_steps=history_steps,
            breakpoint_order=max_order if breakpoint_order is None else breakpoint_order,
            kwargs=kwargs)
        return Solution(ts=ts, ys=ys, yps=yps, qs=qs, stats=dict(stats, t_final=t_final),
                        result=result)
    config, inputs = _configure(
        residual, t0, t1, y0, yp0, args,
        saveat=saveat, algebraic=algebraic, index2=index2, init=init, quadrature=quadrature,
        rtol=rtol, atol=atol, max_steps=max_steps, sensitivity=sensitivity,
        forward_sensitivity=forward_sensitivity, throw=throw, tstop=tstop,
        breakpoints=breakpoints, suppress_algebraic_error=suppress_algebraic_error,
        quad_rtol=quad_rtol, quad_atol=quad_atol, quad_error_control=quad_error_control,
        linear_solver=linear_solver, constraints=constraints, max_step=max_step,
        min_step=min_step, first_step=first_step, max_order=max_order, event=event,
        steps=steps, dense=dense, progress=progress)
    # Linearized inside a `jit` (`jax.jit(jax.grad(f))`): traced inline, not through the
    # cached `jit` (`_jax_internals.linearized_in_jit`: one trace of the integrator less).
    sol, init_info = (_solve_body if linearized_in_jit() else _solve_compiled)(config, inputs)
    if throw:
        sol = _raise_on_failure(sol, init_info, config, inputs)
    return sol
