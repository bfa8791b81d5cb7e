"""The solve as a pure function of arrays: what `_derivatives/autodiff.py` differentiates.

`run(config, inputs)` validates the run-time inputs, computes consistent initial values,
integrates and writes the dense output; with `record=True` it also keeps what the
reverse pass needs (`Record`: checkpoints or the step log), and with `tangents` it
carries k forward-sensitivity directions in the same integration (`run_forward` and
`run_tangent` are its two one-purpose forms). Nothing here knows about JAX's
transformations: step sizes and orders are plain values of the loop, never
differentiated.
"""

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from ._bdf import error_weights, update_row, wrms
from ._consistency import (consistency_solve, consistent_values, initial_sensitivities,
                           split_at)
from ._delay.buffer import DelayArgs
from ._events import Event, EventState, event_tangents
from ._derivatives.forward_sensitivity import (ForwardSensitivity, SensitivityProblem,
                                               direction_scale, sensitivity_atol)
from ._derivatives.reverse import AbstractAdjoint
from ._initialization import InitMode, violated
from ._jax_internals import unvmap_any
from ._integrator import (CheckpointRecorder, DenseRecorder, Outputs, Problem, SegmentRecorder,
                          initial_state, initial_step, integrate)
from ._ops import where
from ._linalg.linear_solver import (AbstractLinearSolver, DenseLU, factored_is_singular,
                                    gauss_jordan_columns, masked_residual,
                                    row_scaling)
from ._results import RESULTS


class Config(eqx.Module):
    """Everything about a solve that is not an input array (functions, modes, options).
    Array leaves (e.g. in a linear solver's configuration) are data like any other."""

    residual: Callable
    quadrature: Callable | None
    linear_solver: AbstractLinearSolver
    reverse: AbstractAdjoint          # Adjoint | DiscreteAdjoint: how cotangents are computed
    forward: ForwardSensitivity       # how tangents are computed
    init: InitMode | None = eqx.field(static=True)
    max_steps: int = eqx.field(static=True)
    suppress_algebraic_error: bool = eqx.field(static=True)
    quad_error_control: bool = eqx.field(static=True)
    order: int = eqx.field(static=True, default=2)   # dense output y, y', …, y^(order)
    throw: bool = eqx.field(static=True, default=True)
    max_order: int = eqx.field(static=True, default=5)
    event: Event | None = None
    progress: int = eqx.field(static=True, default=0)   # report every this many steps
    dense: int = eqx.field(static=True, default=0)      # 1: step values, 2: + interpolant
    # No `algebraic` mask given (and n small enough): the algebraic directions come
    # from F_y' at each point where they are needed (`_consistency.Split`).
    auto_split: bool = eqx.field(static=True, default=False)
    # An `algebraic` mask was given: check it (`mask_violation`, `newton_solve`).
    check_algebraic: bool = eqx.field(static=True, default=False)
    # The index-2 variables (and constraint equations) declared with `index2=`
    # (`Inputs.index2`), as static indices: the consistent initial sensitivities
    # (`_consistency.initial_sensitivities`) select the constraint rows by them.
    index2: tuple[int, ...] = eqx.field(static=True, default=())
    # `solve` was called under a `vmap` over an explicitly sharded mesh axis: the
    # primal run is a primitive too (`autodiff.forward_p`), so that every integration
    # of the batch is split over the devices by `shard_map` (`batching.py`).
    explicit_batch: bool = eqx.field(static=True, default=False)
    # Whether an output row lies at t0: 0 no, 1 perhaps (something traced), 2 yes (known
    # before tracing). The rows at t0 get y' and y'' of the differentiated DAE
    # (`_solve._rates_at_t0`), compiled in only where one may be.
    rows_at_t0: int = eqx.field(static=True, default=1)
    # `solve` was called under a `vmap` that batches its inputs (`is_batched`): the
    # integrations step the members in one flat loop (`_integrator.integrate`). Static,
    # because the solve is traced unbatched inside its own `jit`, which the `vmap` then
    # batches.
    batched: bool = eqx.field(static=True, default=False)


class Inputs(eqx.Module):
    """The array inputs of a solve. Differentiable: `t0`, `y0`, `yp0` and the inexact
    arrays in `args`; the rest must not carry tangents. `saveat` and
    `t1` act on the outputs only through the dense output's time shift (in `_solve.py`),
    so inside the core they are plain data."""

    t0: Float[Array, ""]
    t1: Float[Array, ""]
    y0: Float[Array, " n"]
    yp0: Float[Array, " n"]
    args: Any
    saveat: Float[Array, " n_save"]
    algebraic: Bool[Array, " n"]
    rtol: Float[Array, ""]
    atol: Float[Array, " n"]
    quad_rtol: Float[Array, ""]
    quad_atol: Float[Array, " nq"]
    tstop: Float[Array, ""]
    constraints: Int[Array, " n"] | None = None   # IDASetConstraints codes, or None
    max_step: Float[Array, ""] | float = jnp.inf
    min_step: Float[Array, ""] | float = 0.0
    first_step: Float[Array, ""] | float = jnp.nan   # NaN: IDAS's heuristic
    breakpoints: Float[Array, " B"] | None = None     # sorted; None: no breakpoints
    # Index-2 variables (and, by the same indices, the index-2 constraint equations) of
    # a Hessenberg index-2 DAE, or None.
    index2: Bool[Array, " n"] | None = None


class Core(eqx.Module):
    """The outputs of a run: dense output `yd[i, m]` = y^(m)(saveat[i]), quadratures,
    IDAS statistics, status, and the last time reached."""

    yd: Float[Array, "n_save order+1 n"]
    qs: Float[Array, "n_save nq"]
    stats: dict
    result: RESULTS
    t_final: Float[Array, ""]
    init_info: tuple          # (reason, component) of a failed initialization
    # Event roots (R = Event.n_roots; none without an event): times (inf if not found),
    # the dense-output stack y^(m)(t*) for m = 0 … order+1, the components that crossed.
    event_t: Float[Array, " R"]
    event_yd: Float[Array, "R order+2 n"]
    event_mask: Bool[Array, "R n_ev"]
    dense: Any = None          # DenseRecorder with `steps=`/`dense=`, else None


class Record(eqx.Module):
    """What the reverse pass needs from the forward run: the consistent initial values,
    hot-restart checkpoints and the last segment's steps (`Adjoint`) and/or the
    accepted step sequence (`DiscreteAdjoint`), and the run's status."""

    y0: Float[Array, " n"]
    yp0: Float[Array, " n"]
    checkpoints: Any
    log: Any
    segment: Any
    result: RESULTS
    t_final: Float[Array, ""]
    event_t: Float[Array, " R"]
    event_yd: Float[Array, "R order+2 n"]
    event_mask: Bool[Array, "R n_ev"]


def input_status(inputs: Inputs) -> RESULTS:
    """Checks of the values only known at run time (traced inputs; the same checks run
    before tracing in `_solve.py` when the values are concrete)."""
    W = RESULTS.where
    t0, t1, ts = inputs.t0, inputs.t1, inputs.saveat
    finite = (jnp.isfinite(t0) & jnp.isfinite(t1) & jnp.all(jnp.isfinite(ts))
              & jnp.all(jnp.isfinite(inputs.y0)) & jnp.all(jnp.isfinite(inputs.yp0)))
    bad_tol = ((inputs.rtol < 0) | jnp.any(inputs.atol < 0) | ~jnp.isfinite(inputs.rtol)
               | ~jnp.all(jnp.isfinite(inputs.atol))
               | ((inputs.rtol == 0) & jnp.any(inputs.atol == 0)))
    bad_saveat = ts.shape[0] > 0 and (jnp.any(ts < t0) | jnp.any(ts > t1)
                                       | jnp.any(jnp.diff(ts) < 0))
    bad_tstop = inputs.tstop < t1
    result = RESULTS.successful
    if isinstance(inputs.args, DelayArgs):
        tau = inputs.args.tau
        result = W(jnp.any(~(tau > 0) | ~jnp.isfinite(tau)), RESULTS.invalid_delay, result)
    result = W(bad_tstop, RESULTS.invalid_tstop, result)
    result = W(bad_saveat, RESULTS.invalid_saveat, result)
    result = W(bad_tol, RESULTS.invalid_tolerance, result)
    result = W(t1 <= t0, RESULTS.invalid_interval, result)
    return W(~finite, RESULTS.nonfinite_input, result)


def build_problem(config: Config, inputs: Inputs, sens=None, linear_solver=None) -> Problem:
    n = inputs.y0.shape[0]
    dtype = inputs.y0.dtype
    error_mask = where(inputs.algebraic & config.suppress_algebraic_error, 0.0, 1.0)
    if inputs.index2 is not None:
        # Index-2 variables leave the local error test (as DASPK3.0's and IDAS's users
        # do, IDASetSuppressAlg): errors of algebraic variables on earlier steps do not
        # propagate, and the estimate of an index-2 variable (fixed through y', one
        # order lower in h) would only reject good steps. Li & Petzold, DASPKADJOINT
        # §5: index-1 algebraic variables stay in the test, index-2 ones leave it.
        error_mask = where(inputs.index2, 0.0, error_mask)
    return Problem(
        residual=config.residual, quadrature=config.quadrature,
        linear_solver=config.linear_solver if linear_solver is None else linear_solver,
        args=inputs.args, rtol=inputs.rtol, atol=jnp.broadcast_to(inputs.atol, (n,)),
        error_mask=error_mask.astype(dtype), quad_rtol=inputs.quad_rtol,
        quad_atol=inputs.quad_atol, quad_error_control=config.quad_error_control,
        tstop=inputs.tstop, sens=sens, constraints=inputs.constraints,
        breakpoints=inputs.breakpoints,
        algebraic=None if inputs.breakpoints is None else inputs.algebraic,
        auto_split=config.auto_split,
        max_step=inputs.max_step, min_step=inputs.min_step, max_order=config.max_order,
        event=config.event, algebraic_probe=algebraic_probe(config, inputs),
        index2=inputs.index2, batched=config.batched)


def _probe_weights(n: int, dtype):
    """Distinct weights in [1, 2) (golden-ratio fractions): F_y' (a∘r) = Σ_{i algebraic}
    r_i F_y' e_i is zero only if every algebraic column is, barring an exact
    cancellation between columns with these weights. A constant of the program (NumPy,
    in the working dtype: the same IEEE operations as in JAX), not computed in it."""
    dtype = np.dtype(dtype)
    w = np.arange(n, dtype=dtype) * dtype.type(0.6180339887498949)
    return np.asarray(dtype.type(1.0) + np.mod(w, dtype.type(1.0)), dtype)


def algebraic_probe(config: Config, inputs: Inputs):
    """a∘r for the checks of the algebraic mask, or None when no mask was given."""
    if not config.check_algebraic:
        return None
    y0 = inputs.y0
    return where(inputs.algebraic, _probe_weights(y0.shape[0], y0.dtype), 0.0)


def mask_violation(config: Config, inputs: Inputs):
    """Whether F depends on y'_i at (t0, y0, y'0) — the given values, before any
    initialization (which a wrong mask would make solve a different problem) — for some
    i marked algebraic: one `jax.jvp` with a∘r. (`solve` names the component when it
    raises.)"""
    return _given_residual(config, inputs)[1]


def _given_residual(config: Config, inputs: Inputs):
    """(F(t0, y0, y'0) at the given values, `mask_violation`): with an algebraic mask to
    check, both from one `jax.jvp` (its primal output is F), so that the program holds
    one copy of the residual at t0 instead of two."""
    t0, y0, yp0, args = inputs.t0, inputs.y0, inputs.yp0, inputs.args
    probe = algebraic_probe(config, inputs)
    if probe is None:
        return config.residual(t0, y0, yp0, args), jnp.zeros((), bool)
    f0, d = jax.jvp(lambda yp_: config.residual(t0, y0, yp_, args), (yp0,), (probe,))
    return f0, jnp.any(jnp.isfinite(d) & (d != 0))


def _with_progress(problem: Problem, config: Config) -> Problem:
    return dataclasses.replace(problem, progress=config.progress)


def _start_status(config: Config, inputs: Inputs, y0, yp0, init_ok, mask_bad, f0) -> RESULTS:
    """Status before the first step: run-time input checks, then the algebraic mask
    (`mask_violation`), then initialization, then the residual at t0 (`f0`, at the
    consistent (y0, y'0); a NaN there is a domain error of the initial values, not a
    singular matrix), then — without `init` — whether (y0, y'0) is consistent."""
    W = RESULTS.where
    result = input_status(inputs)
    result = W((result == RESULTS.successful) & mask_bad, RESULTS.wrong_algebraic_mask, result)
    result = W((result == RESULTS.successful) & ~init_ok, RESULTS.initialization_failed, result)
    result = W((result == RESULTS.successful) & ~jnp.all(jnp.isfinite(f0)),
               RESULTS.nonfinite_initial_residual, result)
    if inputs.constraints is not None:   # IDAS: y0 must satisfy the constraints
        result = W((result == RESULTS.successful) & jnp.any(violated(inputs.constraints, y0)),
                   RESULTS.initial_values_violate_constraints, result)
    return result


def inconsistent_start(config: Config, inputs: Inputs, y0, yp0, f0=None) -> Bool[Array, ""]:
    """Without `init`: whether the algebraic components of y0 are inconsistent beyond
    the tolerances, ‖a∘C⁻¹F(t0, y0, y'0)‖_WRMS > 1 (the correction IDACalcIC would make;
    C the consistency matrix; `f0` = F(t0, y0, y'0) if known). Used only to explain a
    first step that fails; a singular C explains nothing (the integrator's status
    stays)."""
    if config.init is not None:
        return jnp.zeros((), bool)
    if f0 is None:
        f0 = config.residual(inputs.t0, y0, yp0, inputs.args)
    split = split_at(config.auto_split, config.residual, inputs.t0, y0, yp0, inputs.args,
                     inputs.algebraic)
    ewt = error_weights(y0, inputs.rtol, jnp.broadcast_to(inputs.atol, y0.shape))
    if split.projector is not None or isinstance(config.linear_solver.auxiliary(), DenseLU):
        u, singular = _dense_correction(config.residual, inputs.t0, y0, yp0, inputs.args,
                                        split, f0)
        return ~singular & (wrms(split.alg(u), ewt) > 1.0)
    u, _ = consistency_solve(config.linear_solver, config.residual, inputs.t0, y0, yp0,
                             inputs.args, split, f0[None])
    return wrms(split.alg(u[0]), ewt) > 1.0


def _dense_correction(residual, t, y, yp, args, split, f):
    """(C⁻¹f, whether C is singular) for a dense consistency matrix C of `split`: the
    row-equilibrated C and f eliminated by Gauss–Jordan with partial pivoting — the
    pivots and the singularity test (`factored_is_singular`) of `DenseLU`'s `factor` —
    in a loop over the columns (`lax.fori_loop`: one copy of the elimination step in the
    program, where `factor`'s unrolled inverse would compile a second copy of the Newton
    iteration's inverse into every forward program). For the diagnosis only (a yes/no
    at a threshold, never differentiated, run only when the first step failed); plain
    JAX operations, so that lowering the forward program calls no LAPACK (jaxlib loads
    scipy's LAPACK the first time a program needs it, ~0.15 s of every fresh process)."""
    fn = masked_residual(residual, y, yp, split)
    C = jax.jacfwd(lambda v: fn(t, v, None, args))(jnp.zeros_like(y))
    n = C.shape[0]
    d = row_scaling(C)
    # [D C | D f]: each column step makes column j a unit vector and carries out the
    # same row operations on D f, which ends as C⁻¹ f.
    m = jax.lax.concatenate([C * d[:, None], (d * f)[:, None]], 1)
    m, pivots = gauss_jordan_columns(m)
    return m[:, n], factored_is_singular((None, pivots))


# A step size underflow (t + h == t) within this fraction of |t| from t0 is blamed on the
# time origin (`RESULTS.time_not_resolved`): moving it to t0 would resolve the time
# 1/TIME_ORIGIN_FRACTION times more finely.
TIME_ORIGIN_FRACTION = 1e-3


def _explain_failure(config, inputs, y0, yp0, state, f0=None) -> RESULTS:
    """A failure before the first accepted step with inconsistent initial values is
    reported as such (with the hint to use `init=`); a step size that underflowed
    close to a large t0 as the time origin's fault (`RESULTS.time_not_resolved`)."""
    result = state.result
    first = (state.stats["num_steps"] == 0) & (result != RESULTS.successful)
    # unvmap_any: a batched predicate would turn the cond into a select that runs the
    # diagnosis (a dense factorization for auto-split problems) for every member of
    # every batch; under a sharded batch that select also deadlocked XLA's CPU runtime.
    inconsistent = jax.lax.cond(unvmap_any(first),
                                lambda: first & inconsistent_start(config, inputs, y0, yp0, f0),
                                lambda: jnp.zeros((), bool))
    result = RESULTS.where(first & inconsistent & ~_is_start_failure(result),
                           RESULTS.inconsistent_initial_conditions, result)
    near_origin = state.t - inputs.t0 < TIME_ORIGIN_FRACTION * jnp.abs(state.t)
    return RESULTS.where((result == RESULTS.step_size_too_small) & near_origin,
                         RESULTS.time_not_resolved, result)


def _is_start_failure(result):
    """Statuses set before the first step (they already say what is wrong)."""
    bad = jnp.zeros((), bool)
    for r in (RESULTS.initialization_failed, RESULTS.nonfinite_initial_residual,
              RESULTS.nonfinite_input, RESULTS.invalid_interval, RESULTS.invalid_saveat,
              RESULTS.invalid_tolerance, RESULTS.invalid_tstop,
              RESULTS.initial_values_violate_constraints, RESULTS.wrong_algebraic_mask):
        bad = bad | (result == r)
    return bad


def _first_step(problem, inputs, h_heuristic):
    """IDASetInitStep if given (`first_step`), else IDAS's heuristic; within max_step."""
    h = where(jnp.isnan(inputs.first_step), h_heuristic, inputs.first_step)
    return jnp.minimum(h, inputs.max_step)


def run(config: Config, inputs: Inputs, record: bool = False,
        tangents: "Tangents | None" = None, k: int = 0, progress: bool = True,
        consistent=None):
    """Consistent initialization and the forward integration, optionally carrying k
    forward-sensitivity directions (IDAS's staggered corrector,
    `_derivatives/forward_sensitivity.py`).

    Returns (Core, Record or None, tangent outputs or None): with `record`, what the
    reverse pass needs; with `tangents`, ((yd_dot (k, n_save, order+1, n), qs_dot
    (k, n_save, nq), event_t_dot (k, R), event_yd_dot (k, R, order+2, n)), result) —
    rows never reached are inf, and a failed run (result) gives NaN derivatives for the
    caller to report. With sensitivities under full error control the state takes the
    steps the sensitivities need too (as in IDAS), so its values differ from a run
    without them within the tolerances; the Core's statistics are the run's, less the
    sensitivity residual count (so that both runs give the same pytree). `consistent`:
    see `begin`."""
    problem, carry, start = begin(config, inputs, record, tangents, k, progress, consistent)
    state, outputs, recorders, events = carry
    carry = integrate(problem, state, outputs, inputs.t1, config.max_steps, recorders, events)
    return end(config, inputs, carry, start, record, tangents, k)


class Start(NamedTuple):
    """What `end` needs of a run's start: the consistent initial values, the worst
    initialization residual and F(t0, y0, y'0) there."""
    y0: Any
    yp0: Any
    worst: Any
    f0: Any


def begin(config: Config, inputs: Inputs, record: bool = False,
          tangents: "Tangents | None" = None, k: int = 0, progress: bool = True,
          consistent=None):
    """`run` up to its integration: (problem, (state, outputs, recorders, events),
    Start). The carry resumes: `integrate` with a step budget (`until`) may be called on
    it again and again (`solve_ensemble`'s queue advances members a segment at a time).
    `consistent`: (y0, y'0, ok) of an earlier run with the same config and inputs (the
    recorded primal run's, `run_tangent`), instead of a second consistent initialization
    (`consistent_values`, a Newton loop XLA would compile once more); `ok` false makes
    the start fail as a failed initialization does."""
    if consistent is None:
        y0, yp0, init_ok, worst = consistent_values(config, inputs)
    else:
        y0, yp0, init_ok = consistent
        zero = jnp.zeros((), jnp.int32)
        worst = (zero, zero - 1)
    n, dtype = y0.shape[0], y0.dtype
    t0, t1, saveat = inputs.t0, inputs.t1, inputs.saveat
    f_given, mask_bad = _given_residual(config, inputs)
    # Without `init` the start is the given (y0, y'0): F there is already known.
    f0 = (f_given if config.init is None
          else config.residual(inputs.t0, y0, yp0, inputs.args))
    result0 = _start_status(config, inputs, y0, yp0, init_ok, mask_bad, f0)
    sens = s0 = sp0 = qsp0 = None
    if tangents is not None:
        s0, sp0, qs0, qsp0, sing = initial_sensitivities(config, inputs, y0, yp0, tangents, k)
        sens = _sensitivity_problem(config, inputs, tangents, k, y0, yp0)
        result0 = RESULTS.where((result0 == RESULTS.successful) & sing,
                                RESULTS.singular_initial_sensitivity, result0)
    problem = build_problem(config, inputs, sens=sens)
    # IDAS bases the first step on the distance to the first output time.
    t_out = jnp.min(where(saveat > t0, saveat, t1))
    qp0 = problem.quad(t0, y0, yp0)
    h0 = _first_step(problem, inputs, initial_step(problem, t0, y0, yp0, qp0, t_out, s0, sp0))
    h0 = where(result0 == RESULTS.successful, h0, 1.0)
    state = initial_state(problem, t0, y0, yp0, h0, s0, sp0, qsp0)
    if sens is not None:
        state = eqx.tree_at(lambda z: z.phiqs, state, update_row(state.phiqs, 0, lambda _: qs0))
    state = eqx.tree_at(lambda z: z.result, state, result0)
    # The rows at t0 are written by `integrate` (when the start status is successful).
    outputs = Outputs.create(saveat, n, qp0.shape[0], k, config.order, dtype)
    recorders = record_for(config, state, yp0) if record else ()
    if config.dense:
        recorders = recorders + (DenseRecorder.create(state, config.max_steps, config.dense > 1),)
    delay = isinstance(inputs.args, DelayArgs)
    if delay:   # a delay DAE: its step history rides in the step loop (`_delay/buffer.py`)
        recorders = recorders + (inputs.args.buffer,)
    events = _event_state(config, inputs, y0, yp0, k)
    if progress:
        problem = _with_progress(problem, config)
    return problem, (state, outputs, recorders, events), Start(y0, yp0, worst, f0)


def end(config: Config, inputs: Inputs, carry, start: Start, record: bool = False,
        tangents: "Tangents | None" = None, k: int = 0):
    """`run` after its integration: (Core, Record or None, tangent outputs or None) of
    the integration's final carry."""
    state, outputs, recorders, events = carry
    y0, yp0, worst, f0 = start
    n, dtype = y0.shape[0], y0.dtype
    delay = isinstance(inputs.args, DelayArgs)
    dense = None
    if delay:
        recorders = recorders[:-1]
    if config.dense:
        recorders, dense = recorders[:-1], recorders[-1]
    state = eqx.tree_at(lambda z: z.result, state, _explain_failure(config, inputs, y0, yp0, state, f0))
    stats = {name: v for name, v in state.stats.items()
             if name != "num_sensitivity_residual_evals"}
    if events is not None and config.index2:
        events = _index2_event_slopes(config, inputs, events, y0, yp0)
    ev_t, ev_yd, ev_mask = _event_outputs(config, events, y0)
    core = Core(yd=outputs.yd, qs=outputs.qs, stats=stats, result=state.result, t_final=state.t,
                init_info=worst, event_t=ev_t, event_yd=ev_yd, event_mask=ev_mask, dense=dense)
    rec = dots = None
    if record:
        checkpoints = log = segment = None
        for r in recorders:
            if isinstance(r, CheckpointRecorder):
                checkpoints = r
            elif isinstance(r, SegmentRecorder):
                segment = r
            else:
                log = r
        rec = Record(y0=y0, yp0=yp0, checkpoints=checkpoints, log=log, segment=segment,
                     result=state.result, t_final=state.t, event_t=ev_t, event_yd=ev_yd,
                     event_mask=ev_mask)
    if tangents is not None:
        dots = (_tangent_outputs(config, inputs, tangents, k, outputs, events, dtype, n),
                state.result)
    return core, rec, dots


def run_forward(config: Config, inputs: Inputs, record: bool = False):
    """The primal run: (Core, Record or None)."""
    core, rec, _ = run(config, inputs, record=record)
    return core, rec


def run_tangent(config: Config, inputs: Inputs, tangents: "Tangents", k: int,
                consistent=None):
    """The run carrying k sensitivity directions, for its tangent outputs only (see
    `run`): ((yd_dot, qs_dot, event_t_dot, event_yd_dot), result). `consistent`: the
    recorded primal run's consistent initial values (see `begin`)."""
    _, _, dots = run(config, inputs, tangents=tangents, k=k, progress=False,
                     consistent=consistent)
    return dots


def _sensitivity_problem(config: Config, inputs: Inputs, tangents: "Tangents", k: int,
                         y0, yp0) -> SensitivityProblem:
    """The k directions with their tolerances (`sensitivity_atol`, scaled by
    `direction_scale`)."""
    dyn = eqx.filter(inputs.args, eqx.is_inexact_array)
    x_dot = [tangents.y0, tangents.yp0]
    x_val = [inputs.y0, inputs.yp0]
    if tangents.args is not None:
        x_dot += jax.tree_util.tree_leaves(tangents.args)
        x_val += jax.tree_util.tree_leaves(dyn)
    pairs = [(d, v) for d, v in zip(x_dot, x_val) if d is not None]
    nu = (direction_scale([d for d, _ in pairs], [v for _, v in pairs], y0, yp0, tangents.t0)
          if (pairs or tangents.t0 is not None) else jnp.ones((k,), y0.dtype))
    probe = build_problem(config, inputs)
    nq = probe.quad(inputs.t0, y0, yp0).shape[0]
    return SensitivityProblem(
        args_dot=tangents.args, atol=sensitivity_atol(probe.atol, nu),
        quad_atol=sensitivity_atol(jnp.broadcast_to(inputs.quad_atol, (nq,)), nu),
        k=k, error_control=config.forward.error_control,
        algebraic=(inputs.algebraic.astype(y0.dtype)
                   if config.forward.error_control and not config.auto_split else None))


def _tangent_outputs(config, inputs, tangents, k, outputs, events, dtype, n):
    yd_dot = jnp.moveaxis(outputs.sd, 1, 0)
    qs_dot = jnp.moveaxis(outputs.qsd, 1, 0)
    if events is None:
        ev_t_dot = jnp.zeros((k, 0), dtype)
        ev_yd_dot = jnp.zeros((k, 0, config.order + 2, n), dtype)
    else:
        ev_t_dot, ev_yd_dot = event_tangents(config.event, inputs.args, events.t, events.mask,
                                             events.yd, events.sd, tangents.args)
    return yd_dot, qs_dot, ev_t_dot, ev_yd_dot


def _event_state(config: Config, inputs: Inputs, y0, yp0, k: int):
    if config.event is None:
        return None
    return EventState.create(config.event, inputs.t0, y0, yp0, inputs.args, config.order, k)


def _index2_event_slopes(config: Config, inputs: Inputs, events, y0, yp0):
    """The recorded roots' y' with consistent slopes of the index-2 variables
    (`_index2.index2_slopes`): the interpolant's are not error-controlled, and they enter
    the derivatives of event states (`event_tangents`, `event_cotangents`)."""
    from ._index2 import index2_slopes

    def one(t_r, yd_r):
        found = jnp.isfinite(t_r)
        # A root not found: evaluated at the consistent start instead (a regular
        # point, so no NaN reaches the derivatives through the discarded branch).
        t_s = where(found, t_r, inputs.t0)
        y_s, yp_s = where(found, yd_r[0], y0), where(found, yd_r[1], yp0)
        yp = index2_slopes(config.residual, config.index2, inputs.algebraic, t_s, y_s, yp_s,
                           inputs.args)
        return yd_r.at[1].set(where(found, yp, yd_r[1]))

    return eqx.tree_at(lambda e: e.yd, events, jax.vmap(one)(events.t, events.yd))


def _event_outputs(config: Config, events, y0):
    """(event_t, event_yd, event_mask): the recorded roots, or empty arrays."""
    if events is None:
        n = y0.shape[0]
        return (jnp.zeros((0,), y0.dtype), jnp.zeros((0, config.order + 2, n), y0.dtype),
                jnp.zeros((0, 0), bool))
    return events.t, events.yd, events.mask


def record_for(config: Config, state, yp0) -> tuple:
    """The recorders the configured reverse pass needs (`config.reverse.recorders`)."""
    return config.reverse.recorders(state, yp0, config.max_steps)


class Tangents(eqx.Module):
    """Tangents of the differentiable inputs for k directions (leading axis k on every
    array), None where a whole input has no tangent."""

    t0: Any = None
    y0: Any = None
    yp0: Any = None
    args: Any = None   # pytree like the inexact-array part of args, or None
