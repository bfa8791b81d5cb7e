"""The IDAS time-stepping loop: one `lax.while_loop`, one step attempt per iteration.

An attempt (IDAS manual §6.2.2):
 1. coefficients for (h, k) and the predictor from the divided differences φ;
 2. modified Newton for the corrector (`_newton.py`);
 3. quadratures corrected explicitly from the converged y, y' (§6.2.5);
 4. local error test (6.9) with the order-lowering estimates at k−1, k−2;
 5. accept: update φ, choose the next order and step (IDAS `IDACompleteStep`), write the
    outputs that now lie inside [t_{n−1}, t_n] by the interpolating polynomial;
    reject: keep φ, cut h and perhaps k (IDAS `IDAHandleNFlag`), give up with a status
    after 10 failures of one kind in a step.

With a `SensitivityProblem` (forward mode) each accepted state corrector is followed by
the staggered sensitivity corrector (`_derivatives/forward_sensitivity.py`), and the sensitivities
share the history update, the error test and the output writing.

The carried state has a fixed shape, so the whole solve is one compiled loop that
`jax.vmap` batches (members that finish early are held by the loop's `select`).
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from ._bdf import (MAXORD, NPHI, Coefficients, complete_history, derivative_weights, error_weights,
                   grouped_wrms, history_layout, history_row, interpolate,
                   interpolation_weights, node_values_at_tn, predict, scale_history, set_coefficients,
                   small_rows, stacked, update_row, wrms)
from ._delay.buffer import DelayBuffer
from ._events import Event, EventState, search_step
from ._derivatives.forward_sensitivity import (SensitivityProblem, quadrature_sensitivities,
                                               sensitivity_corrector)
from ._initialization import violated
from ._jax_internals import is_batched, unvmap_any, unvmap_max
from ._ops import packed_cond, packed_while_loop, row, taken_where, where
from ._newton import (EPS_NEWT, FAIL_LINEAR, FAIL_NONFINITE, FAIL_SINGULAR, NewtonResult,
                      _builds_from_residual, idle_iteration, maybe_update, newton_solve, setup_linear,
                      tree_where)
from ._results import RESULTS

MAX_ERROR_TEST_FAILS = 10   # IDAS maxnef
MAX_CONV_FAILS = 10         # IDAS maxncf (Newton and constraint failures together)
ETA_MIN_EF = 0.25           # h cut after the second error-test failure
ETA_LOW = 0.9
ETA_MIN = 0.5
ETA_CF = 0.25               # h cut after a Newton convergence failure

STAT_NAMES = (
    "num_steps", "num_residual_evals", "num_jacobian_evals", "num_nonlinear_iters",
    "num_error_test_failures", "num_nonlinear_convergence_failures",
    "num_quadrature_evals",
)


class Counters(eqx.Module):
    """The integration's counters (`STAT_NAMES`, the linear solver's), one int32 each:
    `num_steps` on its own (the loops' conditions read it every trip), the others as one
    vector; read one by name (`counters["num_steps"]`), add to several at once (`add`).
    As separate scalars in the step loop's carry, the counters' additions, selects and
    the copies XLA makes at the loop boundary (where an old value is read after the new
    one is written) were operations of their own, each dispatched separately by XLA's
    CPU runtime; as one vector they are one of each (Robertson's forward step loop 68 ->
    64 operations an attempt; a batched trip unchanged, which `num_steps` inside the
    vector made 2 operations longer)."""

    num_steps: Int[Array, ""]
    values: Int[Array, " m"]
    names: tuple = eqx.field(static=True)      # of `values`

    @classmethod
    def zeros(cls, names: tuple) -> "Counters":
        others = tuple(name for name in names if name != "num_steps")
        return cls(num_steps=jnp.zeros((), jnp.int32),
                   values=jnp.zeros((len(others),), jnp.int32), names=others)

    def __getitem__(self, name: str) -> Int[Array, ""]:
        if name == "num_steps":
            return self.num_steps
        return jax.lax.index_in_dim(self.values, self.names.index(name), axis=-1,
                                    keepdims=False)

    def items(self):
        return ((name, self[name]) for name in ("num_steps",) + self.names)

    def add(self, increments: dict) -> "Counters":
        """The counters plus `increments` (name: int32 scalar; the others unchanged)."""
        unknown = set(increments) - set(self.names) - {"num_steps"}
        if unknown:
            raise KeyError(f"no counters named {sorted(unknown)}")
        zero = jnp.zeros((), jnp.int32)
        step = jnp.stack([jnp.asarray(increments.get(name, zero), jnp.int32)
                          for name in self.names])
        num_steps = self.num_steps + jnp.asarray(increments.get("num_steps", zero), jnp.int32)
        return Counters(num_steps=num_steps, values=self.values + step, names=self.names)


class Problem(eqx.Module):
    """Everything fixed during one integration (closed over by the loop, not carried)."""

    residual: Callable = eqx.field(static=True)
    quadrature: Callable | None = eqx.field(static=True)
    linear_solver: Any
    args: Any
    rtol: Array
    atol: Array            # (n,)
    error_mask: Array      # (n,) 1.0 where a component enters the local error test
    # The state (and the quadratures) are `error_groups` problems stacked (the adjoint's
    # cotangent directions): the error norm is the largest of theirs (`grouped_wrms`).
    error_groups: int = eqx.field(static=True, kw_only=True, default=1)
    quad_rtol: Array
    quad_atol: Array       # (nq,)
    quad_error_control: bool = eqx.field(static=True)
    tstop: Array           # +inf when stepping past t1 is allowed
    # The residual is linear in y (the adjoint): its Newton convergence rate is
    # re-estimated on every step instead of trusting the previous step's, and an
    # iteration with a current J is exact (Li & Petzold, DASPKADJOINT §5.3).
    reset_newton_rate: bool = eqx.field(static=True, default=False)
    # With `reset_newton_rate`, unbatched: set J up at every attempt, so that its one
    # iteration is exact (`newton_solve`'s `fresh`; `_derivatives.adjoint.fresh_matrix`).
    fresh_matrix: bool = eqx.field(static=True, default=False)
    # Forward sensitivities (k tangent directions), or None.
    sens: SensitivityProblem | None = None
    # IDASetConstraints (0, ±1, ±2 per component) or None; IDASetMaxStep, IDASetMinStep,
    # IDASetMaxOrd.
    constraints: Array | None = None
    max_step: Array | float = jnp.inf
    min_step: Array | float = 0.0
    max_order: int = eqx.field(static=True, default=MAXORD)
    event: Event | None = None
    # a∘r (algebraic mask times distinct weights): checked at each Jacobian setup to be
    # in the null space of F_y' (`newton_solve`), or None (no algebraic mask given).
    algebraic_probe: Array | None = None
    # Bool mask of the index-2 variables (`solve(index2=...)`), or None: their columns of
    # the iteration matrix are scaled by cj (`newton_solve`).
    index2: Array | None = None
    # Report progress every this many accepted steps (0: off; costs nothing then).
    progress: int = eqx.field(static=True, default=0)
    # The solve is batched by `vmap` (`Config.batched`): one flat loop (`integrate`).
    batched: bool = eqx.field(static=True, default=False)
    # Sorted times where the model's inputs are not smooth, or None: steps end exactly
    # on each and the BDF restarts there at order 1 (`restart_at_breakpoint`), from
    # values made consistent with the split of `algebraic` / `auto_split`
    # (`_consistency.split_at`).
    breakpoints: Array | None = None
    algebraic: Array | None = None
    auto_split: bool = eqx.field(static=True, default=False)

    def quad(self, t, y, yp):
        if self.quadrature is None:
            return jnp.zeros((0,), y.dtype)
        return jnp.asarray(self.quadrature(t, y, yp, self.args), dtype=y.dtype)


class State(eqx.Module):
    """Fixed-size integrator state: IDAS's history arrays, scalars and counters.

    Flags that only a feature of the problem can set (`new_matrix`, `ss_sens`: forward
    sensitivities; `npress`: constraints; `restart_pending`: breakpoints) are None
    without it: each carried scalar costs the step loop a select and often a copy on
    every attempt, even when it can never change (and `ss_sens` made Robertson's ninth
    float scalar, one past a packed vector's 8: a second vector, its concatenate and its
    copy in every attempt, `_ops._packing`)."""

    t: Float[Array, ""]
    h: Float[Array, ""]          # step size to attempt next
    h_used: Float[Array, ""]
    k: Int[Array, ""]            # order to attempt next
    k_used: Int[Array, ""]
    ns: Int[Array, ""]
    phase: Int[Array, ""]        # 0 during the initial order-raising phase
    phi: Float[Array, "6 n"]
    phiq: Float[Array, "6 nq"]
    # Forward sensitivities' history (k = 0 without them): one array, or its 6 rows
    # where that keeps every buffer under XLA's 512 bytes (see _bdf.history_layout).
    phis: Float[Array, "6 k n"] | tuple[Float[Array, "k n"], ...]
    phiqs: Float[Array, "6 k nq"] | tuple[Float[Array, "k nq"], ...]
    psi: Float[Array, "6"]
    cj: Float[Array, ""]
    cj_old: Float[Array, ""]     # cj at the last Jacobian setup
    ss: Float[Array, ""]         # Newton convergence-rate factor S
    ss_sens: Float[Array, ""] | None  # the same for the sensitivities' corrector (IDAS ssS)
    new_matrix: Bool[Array, ""] | None  # attempt the next step with J rebuilt (attempt_step)
    lin_state: Any
    jac_point: tuple             # (t, y, yp) where lin_state was built (hot restarts)
    nef: Int[Array, ""]          # error-test failures in the current step
    ncf: Int[Array, ""]          # convergence failures in the current step
    # Consecutive accepted steps whose y was projected onto a bound the DAE drives it
    # across (`constraints`; see attempt_step).
    npress: Int[Array, ""] | None
    # The step size of the last attempt that failed on a NaN/inf residual, until an
    # accepted step is as large again (0: none): the integration is at the edge of the
    # residual's domain, which the failures that follow are blamed on.
    h_nan: Float[Array, ""]
    # The next attempt starts the integration (IDAS's nst == 0 logic: J set up, phi_1
    # rescaled with h on a failure): at t0 and after a restart at a breakpoint.
    fresh: Bool[Array, ""]
    # The last step ended on a breakpoint: the next attempt restarts the history there.
    # (Not at once: the outputs in that step, and a checkpoint, are taken from the
    # history of the step itself.)
    restart_pending: Bool[Array, ""] | None
    # An error-test failure since the order selection last kept the order after k + 1
    # steps at constant step size (see the recovery rule in attempt_step).
    recovering: Bool[Array, ""]
    # (norm, h, t_n, k) of the last attempt that failed the error test on the algebraic
    # sensitivities alone (zeros before any), or None: see `sensitivity_jump`.
    sens_jump: Float[Array, "4"] | None
    stats: Counters
    result: Any

    @property
    def y(self):
        return self.phi[0]


def initial_step(problem: Problem, t0, y0, yp0, qp0, t_out, s0=None, sp0=None) -> Float[Array, ""]:
    """IDAS initial step: h = 0.001 |t_out − t0|, reduced so that ‖h y'0‖ ≤ 1/2 (the
    norm including the sensitivities' s'0 under full error control)."""
    h = 0.001 * jnp.abs(t_out - t0)
    ewt = error_weights(y0, problem.rtol, problem.atol) * problem.error_mask
    g = problem.error_groups
    ypnorm = grouped_wrms(yp0, ewt, g)
    if problem.quad_error_control and qp0.shape[0] > 0:
        ypnorm = jnp.maximum(ypnorm, grouped_wrms(qp0, 1.0 / problem.quad_atol, g))
    sens = problem.sens
    if sens is not None and sens.error_control and sens.k > 0:
        ewt_s = error_weights(s0, problem.rtol, sens.atol) * problem.error_mask
        ypnorm = jnp.maximum(ypnorm, jnp.max(jax.vmap(wrms)(sp0, ewt_s)))
    h = where(ypnorm > 0.5 / h, 0.5 / ypnorm, h)
    # Resolvable at t0: a step below the spacing of floating-point numbers at |t0| would
    # not advance t (matters when t0 is large, as for an adjoint started at T = 4e10).
    h = jnp.maximum(h, 10.0 * jnp.finfo(h.dtype).eps * jnp.abs(t0))
    return clamp_to_tstop(problem, t0, h)


def next_stop(problem: Problem, t):
    """Where the next step must end at the latest: tstop, or the first breakpoint after
    t."""
    if problem.breakpoints is None:
        return problem.tstop
    bps = problem.breakpoints
    return jnp.minimum(problem.tstop, jnp.min(where(bps > t, bps, jnp.inf)))


def clamp_to_tstop(problem, t, h):
    """h, or the step to the next stop (tstop or a breakpoint) where t + h would pass it
    (`step_end` then lands on it)."""
    stop = next_stop(problem, t)
    return where(t + h > stop, stop - t, h)


def evaluation_time(problem: Problem, t_new):
    """Where a step ending at t_new evaluates the model: a few ulps before t_new when
    t_new is a breakpoint (`_consistency.before`), so that the step sees the piece of
    the inputs it integrates, however the model assigns the corner itself (a square wave
    written `where(t < ½, 1, −1)` gives the next piece's value at ½); the restart
    there sees the piece after it (`_consistency.after`)."""
    if problem.breakpoints is None:
        return t_new
    from ._consistency import before
    return where(jnp.any(problem.breakpoints == t_new), before(t_new), t_new)


def restart_at_breakpoint(problem: Problem, s: State) -> State:
    """After a step that ended on a breakpoint, start the BDF afresh there: order 1,
    phase 0, histories [y, h y'] (and likewise for quadratures and sensitivities) from
    values made consistent at t⁺ (`_consistency.restart_point`: y' may jump with the
    inputs), and a first step by IDAS's rule ‖h y'‖ ≤ 1/2, at most the last step. The
    last step's history spans the kink of the inputs: its polynomial would predict past
    the kink as if there were none (the Test Set's drivers restart the integration at
    every breakpoint, as IDAReInit and IDACalcIC do). Only for states with
    `restart_pending` (a loop of at most one trip: the restart costs nothing on the
    other steps)."""
    from ._consistency import after, restart_point, restart_sensitivities, split_at

    def restarted():
        dtype = s.phi.dtype
        t = s.t
        c, d = interpolation_weights(t, t, s.psi, s.k_used)
        y, yp = jnp.tensordot(c, s.phi, 1), jnp.tensordot(d, s.phi, 1)
        split = split_at(problem.auto_split, problem.residual, t, y, yp, problem.args,
                         problem.algebraic)
        y, yp = restart_point(problem.residual, problem.linear_solver, split, t, y, yp,
                              problem.args)
        ewt = error_weights(y, problem.rtol, problem.atol) * problem.error_mask
        ypnorm = grouped_wrms(yp, ewt, problem.error_groups)
        sens = problem.sens if (problem.sens is not None and problem.sens.k > 0) else None
        if sens is not None:
            phis = stacked(s.phis)
            sv, sp = jnp.tensordot(c, phis, 1), jnp.tensordot(d, phis, 1)
            sv, sp = restart_sensitivities(problem.residual, problem.linear_solver, split, t,
                                           y, yp, problem.args, sv, sp, sens.args_dot)
            if sens.error_control:
                ewt_s = error_weights(sv, problem.rtol, sens.atol) * problem.error_mask
                ypnorm = jnp.maximum(ypnorm, jnp.max(jax.vmap(wrms)(sp, ewt_s)))
        h_last = where(s.h_used > 0, s.h_used, s.h)
        h0 = where(ypnorm * h_last > 0.5, 0.5 / where(ypnorm > 0, ypnorm, 1.0), h_last)
        h0 = clamp_to_tstop(problem, t, h0)

        def fresh(value, slope):
            return jnp.zeros((NPHI,) + value.shape, dtype).at[0].set(value).at[1].set(h0 * slope)

        phiq = fresh(s.phiq[0], problem.quad(after(t), y, yp))
        phis, phiqs = s.phis, s.phiqs
        if sens is not None:
            phis = history_layout(fresh(sv, sp))
            qs = stacked(s.phiqs)[0]
            qsp = (quadrature_sensitivities(problem, sens, after(t), y, yp, sv, sp)
                   if qs.shape[-1] else jnp.zeros_like(qs))
            phiqs = history_layout(fresh(qs, qsp))
        return dataclasses.replace(
            s, h=h0, h_used=jnp.zeros((), dtype), k=jnp.ones_like(s.k),
            k_used=jnp.zeros_like(s.k), ns=jnp.zeros_like(s.ns), phase=jnp.zeros_like(s.phase),
            phi=fresh(y, yp), phiq=phiq, phis=phis, phiqs=phiqs,
            psi=jnp.zeros_like(s.psi).at[0].set(h0), cj=1 / h0, fresh=jnp.ones((), bool),
            restart_pending=jnp.zeros((), bool), recovering=jnp.zeros((), bool))

    return maybe_update(s.restart_pending, restarted, s)


# The clock's round-off a step may leave unaccounted, in tolerance units: above it the
# step is taken as the difference of the represented times (`step_end`).
CLOCK_TOL = 1e-4


def step_end(problem: Problem, t, h, yp_norm):
    """(t_new, h) of a step of intended size h from t (h ≤ max_step): t_new = t + h as
    represented in floating point, never past tstop (a step that would pass it ends
    exactly on it, h = tstop − t; IDAS shortens it by 4 eps instead and then stops
    within a round-off band of tstop, which would extrapolate the outputs).

    The represented t_new − t differs from h by up to half a spacing of t. IDAS ignores
    that; its effect on the solution, up to eps·|t|·‖y'‖_W tolerance units a step
    (`yp_norm` = ‖y'‖_WRMS), is negligible unless t is large for the solution's time
    scale (e.g. t0 = 1.7e9 for a process of microseconds: steps of a few spacings of t,
    rounded by tens of percent, gave wrong solutions marked successful). Above
    `CLOCK_TOL` the step is therefore the difference of the represented times,
    h = t_new − t, so the integrator never falls out of step with its clock, and a step
    below half a spacing of t is 0 (status `step_size_too_small`). Below it h is kept
    as intended, as in IDAS (the difference wobbles by a spacing of t, and exact tests
    like cj == cj_old would flip with it, making the step sequence — and so the
    solution — jitter with rounding-level changes of the data)."""
    stop = next_stop(problem, t)
    lands = t + h > stop
    t_new = where(lands, stop, t + h)
    coarse = jnp.finfo(t.dtype).eps * jnp.abs(t_new) * yp_norm > CLOCK_TOL
    return t_new, where(lands | coarse, t_new - t, h)


def initial_state(problem: Problem, t0, y0, yp0, h0, s0=None, sp0=None, qsp0=None) -> State:
    """The state before the first step. With forward sensitivities, (s0, sp0) are their
    consistent initial values (k, n) and qsp0 (k, nq) the quadrature sensitivities' rate;
    the quadrature sensitivities themselves start at 0 (a moving t0 enters through
    qsp0's companion term, see `_consistency.initial_sensitivities`)."""
    dtype = y0.dtype
    n = y0.shape[0]
    qp0 = problem.quad(t0, y0, yp0)
    nq = qp0.shape[0]
    phi = jnp.zeros((NPHI, n), dtype).at[0].set(y0).at[1].set(h0 * yp0)
    phiq = jnp.zeros((NPHI, nq), dtype).at[1].set(h0 * qp0)
    k = 0 if problem.sens is None else problem.sens.k
    phis = jnp.zeros((NPHI, k, n), dtype)
    phiqs = jnp.zeros((NPHI, k, nq), dtype)
    if k:
        phis = phis.at[0].set(s0).at[1].set(h0 * sp0)
        phiqs = phiqs.at[1].set(h0 * qsp0)
    phis, phiqs = history_layout(phis), history_layout(phiqs)
    lin_shape = jax.eval_shape(
        lambda: problem.linear_solver.setup(problem.residual, t0, y0, yp0, 1 / h0, problem.args))
    lin_state = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), lin_shape)
    izero = jnp.zeros((), jnp.int32)
    names = STAT_NAMES + problem.linear_solver.stat_names
    if k:
        names = names + ("num_sensitivity_residual_evals",)
    stats = Counters.zeros(names).add({"num_quadrature_evals": jnp.asarray(int(nq > 0), jnp.int32)})
    return State(
        t=jnp.asarray(t0, dtype), h=h0, h_used=jnp.zeros((), dtype), k=izero + 1,
        k_used=izero, ns=izero, phase=izero, phi=phi, phiq=phiq, phis=phis, phiqs=phiqs,
        psi=jnp.zeros((NPHI,), dtype).at[0].set(h0), cj=1 / h0, cj_old=1 / h0,
        ss=jnp.asarray(20.0, dtype), ss_sens=jnp.asarray(20.0, dtype) if k else None,
        new_matrix=jnp.zeros((), bool) if k else None, lin_state=lin_state,
        jac_point=(jnp.asarray(t0, dtype), y0, yp0), nef=izero, ncf=izero,
        npress=None if problem.constraints is None else izero,
        h_nan=jnp.zeros((), dtype), fresh=jnp.ones((), bool),
        restart_pending=None if problem.breakpoints is None else jnp.zeros((), bool),
        recovering=jnp.zeros((), bool),
        sens_jump=(None if problem.sens is None or problem.sens.algebraic is None
                   else jnp.zeros((4,), dtype)),
        stats=stats, result=RESULTS.successful,
    )


def _at(v, i):
    return row(v, i)


class Parts(NamedTuple):
    """One value for each history that moves with the state's: the state `y`, the
    quadratures `q`, the forward sensitivities `s` and their quadratures `sq`. A part
    that does not exist is None and costs nothing: on CPU every operation of the loop
    body costs, even on an empty array."""

    y: Any
    q: Any = None
    s: Any = None
    sq: Any = None

    def map(self, f: Callable, *others: "Parts") -> "Parts":
        """f applied to each existing part (and the same part of `others`)."""
        return Parts(*(None if v is None else f(v, *(o[i] for o in others))
                       for i, v in enumerate(self)))

    def fill(self, default: "Parts") -> "Parts":
        """The existing parts, and `default`'s where a part does not exist."""
        return Parts(*(d if v is None else v for v, d in zip(self, default)))


class Weights(NamedTuple):
    """Error weights 1/(rtol |v| + atol) of a step, from the values at t_{n−1} (IDAS
    recomputes them after every accepted step; manual eq. (6.5))."""

    y: Array                  # the state's, for the Newton iteration
    error: Array              # the state's, 0 where a component is kept out of the error test
    q: Array                  # the quadratures'
    s: Array | None           # the sensitivities' (k, n), or None
    sq: Array | None          # the quadrature sensitivities' (k, nq), or None


def error_norm(problem: Problem, weights: Weights, v: Parts, split: bool = False):
    """WRMS norm (IDAS manual eq. (6.5)) of a correction-like `Parts`: the largest over
    the parts under error control (IDAS's combined norm; the stacked adjoint problems,
    `error_groups`, each by its own).

    `split` (with the sensitivities' `algebraic` mask): (the norm, the norm without the
    sensitivities' algebraic components, the largest norm of those alone), for
    `sensitivity_jump`. A WRMS norm squared is additive over disjoint components, so
    each direction's norm is √(d² + a²) of its two parts."""
    nrm = grouped_wrms(v.y, weights.error, problem.error_groups)
    if problem.quad_error_control and v.q is not None:
        nrm = jnp.maximum(nrm, grouped_wrms(v.q, weights.q, problem.error_groups))
    sens = problem.sens
    smooth = alg = None
    if sens is not None and sens.error_control and v.s is not None and weights.s is not None:
        if split and sens.algebraic is not None:
            w = weights.s * problem.error_mask
            d = jax.vmap(wrms)(v.s, w * (1.0 - sens.algebraic))
            a = jax.vmap(wrms)(v.s, w * sens.algebraic)
            smooth, alg = jnp.maximum(nrm, jnp.max(d)), jnp.max(a)
            nrm = jnp.maximum(nrm, jnp.max(jnp.sqrt(d * d + a * a)))
        else:
            nrm = jnp.maximum(nrm, jnp.max(jax.vmap(wrms)(v.s, weights.s * problem.error_mask)))
        if problem.quad_error_control and v.sq is not None:
            sq = jnp.max(jax.vmap(wrms)(v.sq, weights.sq))
            nrm = jnp.maximum(nrm, sq)
            smooth = None if smooth is None else jnp.maximum(smooth, sq)
    if split:
        return nrm, smooth, alg
    return nrm


class Corrector(NamedTuple):
    """The outcome of the state's corrector (`correct_state`)."""

    newton: NewtonResult
    correction: Array         # y_n − y_n(0), after a projection onto the constraints
    y: Array
    yp: Array
    converged: Bool[Array, ""]
    constraint_fail: Bool[Array, ""]   # converged onto a constraint violation: retry
    eta_constraint: Array     # the step-size factor for that retry
    pressing: Bool[Array, ""]  # projected onto a bound the DAE drives y across


def correct_state(problem: Problem, s: State, coef: Coefficients, t_eval, h,
                  y_pred, yp_pred, ewt, resume=None, iterations: int | None = None,
                  active=None) -> Corrector:
    """The corrector (IDAS manual §6.2.2, eqs. (6.6)–(6.8)): solve
    G(y) = F(t_n, y, y'_(0) + cj (y − y_(0)), p) = 0 from the predictor y_(0) by modified
    Newton with the iteration matrix J = F_y + cj_old F_y' (`newton_solve`).

    J is rebuilt (IDAS's lsetup) on the first step, when cj has moved out of
    [0.6, 1/0.6] times the cj J was built with, or when the last attempt asked for it
    (`new_matrix`). The convergence-rate factor S restarts at 20 with a new J and at 100
    when cj changed (IDAS `IDANls`); for a residual linear in y (the adjoint) it is reset
    every step and one iteration with a current J is exact (Li & Petzold, DASPKADJOINT
    §5.3); with `fresh_matrix` (small n, unbatched) J is set up at every attempt and that
    one exact iteration taken.

    With `constraints` (IDAS `IDANls`): a converged y violating them is projected back
    when the projection's norm is below the Newton tolerance; otherwise the step is
    retried with h' = η h, η = max(0.9 min φ_0/(φ_0 − y) over the violators, 0.1).

    `iterations`, `resume`, `active`: at most that many Newton iterations, continuing the
    pending iteration `resume`, J set up only where `active` (`newton_solve`; the
    batched step loop's)."""
    dtype = s.phi.dtype
    cj = coef.cj
    first = s.fresh
    cj_old = where(first, cj, s.cj_old)
    rate_factor = where(first, 20.0, s.ss)
    ratio = cj / cj_old
    setup = first | (ratio < 0.6) | (ratio > 1.0 / 0.6)
    if s.new_matrix is not None:
        setup = setup | s.new_matrix
    rate_factor = where(cj != s.cj, 100.0, rate_factor)
    if problem.reset_newton_rate:
        rate_factor = jnp.full_like(rate_factor, 100.0)
    # A batched step loop (`iterations`) keeps the reused J and the rate test.
    fresh = problem.fresh_matrix and problem.reset_newton_rate and iterations is None
    newton = newton_solve(problem.residual, problem.args, problem.linear_solver, t_eval,
                          y_pred, yp_pred, cj, ewt, s.lin_state, s.jac_point, cj_old,
                          rate_factor, setup, linear=problem.reset_newton_rate,
                          mask_probe=problem.algebraic_probe, index2=problem.index2,
                          iterations=iterations, resume=resume, active=active,
                          fresh=fresh)
    ee = newton.ee
    converged = newton.converged
    constraint_fail = jnp.zeros((), bool)
    eta_constraint = jnp.ones((), dtype)
    pressing = jnp.zeros((), bool)
    if problem.constraints is not None:
        y_try = y_pred + ee
        violators = violated(problem.constraints, y_try)
        c = problem.constraints.astype(dtype)
        strict = (jnp.abs(c) > 1.5).astype(dtype)
        projection = where(violators, y_try - 0.1 * strict * c / ewt, 0.0)
        small = wrms(projection, ewt) <= EPS_NEWT
        projected = converged & jnp.any(violators) & small
        # A projection the DAE undoes at once: y' points across the bound, by more than
        # 1e-3 tolerance units over the step. Repeated step after step (10 times) the
        # constraint is infeasible — the integration would creep along the bound in
        # steps of the Newton tolerance (y ≥ 0 with y' = −1 ran to max_steps).
        yp_try = yp_pred + cj * ee
        outward = violators & (c * yp_try < 0) & (jnp.abs(h * yp_try) * ewt > 1e-3)
        pressing = projected & jnp.any(outward)
        ee = where(projected, ee - projection, ee)
        constraint_fail = converged & jnp.any(violators) & ~small
        ratio_c = where(violators,
                            s.phi[0] / where(violators, s.phi[0] - y_try, 1.0), jnp.inf)
        eta_constraint = jnp.maximum(0.9 * jnp.min(ratio_c), 0.1)
        converged = converged & ~constraint_fail
    return Corrector(newton=newton, correction=ee, y=y_pred + ee, yp=yp_pred + cj * ee,
                     converged=converged, constraint_fail=constraint_fail,
                     eta_constraint=eta_constraint, pressing=pressing)


class SensitivityCorrector(NamedTuple):
    """The outcome of the sensitivities' corrector (`correct_sensitivities`)."""

    correction: Array          # s_n − s_n(0), (k, n)
    quad_rate: Array | None    # the quadrature sensitivities' rate at t_n, or None
    rate_factor: Array         # IDAS ssS after the iteration
    converged: Bool[Array, ""]
    redo: Bool[Array, ""]      # retry the step with J rebuilt (same h, k)
    num_residual_evals: Array
    linear_stats: dict


def correct_sensitivities(problem: Problem, s: State, sens: SensitivityProblem, cj, t_eval,
                          corrector: Corrector, s_pred, sp_pred, ewt_s,
                          with_quadratures: bool) -> SensitivityCorrector:
    """The staggered corrector of the forward sensitivities (IDAS manual §6.2.6): with y_n
    converged, the k sensitivity systems F_y s + F_y' s' + F_p = 0 are solved by
    modified Newton with the state's iteration matrix
    (`forward_sensitivity.sensitivity_corrector`). IDAS keeps the rate factor ssS from
    step to step: 20 after a new J, 100 when cj changed.

    Not converged with a J from an earlier step, the step is redone with the same h and
    order and J rebuilt — IDAS's staggered solver calls lsetup and iterates again within
    the step; redoing it keeps the loop body free of control flow."""
    newton = corrector.newton
    rate_factor = where(s.fresh | (newton.num_jacobian_evals > 0), 20.0, s.ss_sens)
    rate_factor = where(cj != s.cj, 100.0, rate_factor)
    corrected = sensitivity_corrector(problem, sens, t_eval, corrector.y, corrector.yp, cj, s_pred,
                                      sp_pred, ewt_s, newton.lin_state, newton.cj_old,
                                      rate_factor)
    quad_rate = None
    if with_quadratures:
        quad_rate = quadrature_sensitivities(problem, sens, t_eval, corrector.y, corrector.yp,
                                             s_pred + corrected.ee, sp_pred + cj * corrected.ee)
    return SensitivityCorrector(
        correction=corrected.ee, quad_rate=quad_rate, rate_factor=corrected.ss,
        converged=corrected.converged,
        redo=corrector.converged & ~corrected.converged & (newton.num_jacobian_evals == 0),
        num_residual_evals=corrected.num_residual_evals, linear_stats=corrected.linear_stats)


class ErrorTest(NamedTuple):
    """The local error estimates of a step (`error_test`)."""

    norm_k: Array        # ‖y_n − y_n(0)‖ (the combined WRMS norm)
    err_k: Array         # the error estimate at order k (σ_k ‖·‖) …
    err_km1: Array       # … at k − 1 …
    terr_k: Array        # … and the terms (k + 1) err_k, k err_{k−1}
    terr_km1: Array
    k_new: Int[Array, ""]   # k − 1 where the estimates favour lowering the order
    # ‖·‖ without the sensitivities' algebraic components, and of those alone (None
    # without the `algebraic` mask of the sensitivities): `sensitivity_jump`.
    norm_smooth: Array | None = None
    norm_alg: Array | None = None


def stacked_norms(problem: Problem, weights: Weights, hist: Parts, corr: Parts, k):
    """The norms of `error_test` (of the correction and of the differences for orders
    k − 1, k − 2) and `select_order_and_step`'s estimate for k + 1 (its norm / (k + 2))
    as one reduction over a (4, n) array — or None where the norm is more than the
    state's WRMS (quadratures or sensitivities under error control, stacked problems, no
    unknowns) or the step is batched (`Problem.batched`). Each norm of its own was a
    kernel of the step (a reduction whose result several operations read), and so was
    the division; the same sums in the same order (`wrms` row by row) and the others
    divided by 1, so the same numbers."""
    if (problem.batched or problem.error_groups != 1 or corr.y.shape[0] == 0
            or (problem.quad_error_control and corr.q is not None)
            or (problem.sens is not None and problem.sens.error_control
                and corr.s is not None)):
        return None
    c = corr.y
    d1 = history_row(hist.y, k) + c
    d2 = d1 + history_row(hist.y, k - 1)
    up = c - history_row(hist.y, k + 1)
    one = jnp.ones((), c.dtype)
    divisor = jnp.stack([one, one, one, (k + 2).astype(c.dtype)])
    return jnp.sqrt(jnp.mean((jnp.stack([c, d1, d2, up]) * weights.error) ** 2,
                             axis=1)) / divisor


def error_test(problem: Problem, weights: Weights, coef: Coefficients, hist: Parts,
               corr: Parts, k, norms=None) -> ErrorTest:
    """The local error test's estimates (IDAS manual §6.2.2): the step passes when
    C_k ‖y_n − y_n(0)‖ ≤ 1 (eq. (6.9), C_k = `coef.ck`). The estimates at orders k − 1
    and k − 2 use the differences φ_k + corr and φ_k + φ_{k−1} + corr; the order is
    lowered when max(T_{k−1}, T_{k−2}) ≤ T_k (k > 2), or T_{k−1} ≤ T_k/2 (k = 2), with
    T_j = (j + 1) σ_j ‖·‖ (IDAS `IDATestError`). `norms`: `stacked_norms`, or None."""
    sigma = coef.sigma
    if norms is None:
        norm_k, norm_smooth, norm_alg = error_norm(problem, weights, corr, split=True)
        diff1 = hist.map(lambda h_, c: history_row(h_, k) + c, corr)
        diff2 = hist.map(lambda h_, d: d + history_row(h_, k - 1), diff1)
        norm_km1 = error_norm(problem, weights, diff1)
        norm_km2 = error_norm(problem, weights, diff2)
    else:
        norm_k, norm_km1, norm_km2 = norms[0], norms[1], norms[2]
        norm_smooth = norm_alg = None
    err_k = _at(sigma, k) * norm_k
    terr_k = (k + 1) * err_k
    err_km1 = _at(sigma, k - 1) * norm_km1
    terr_km1 = k * err_km1
    err_km2 = _at(sigma, k - 2) * norm_km2
    terr_km2 = (k - 1) * err_km2
    lower = where(k > 2, jnp.maximum(terr_km1, terr_km2) <= terr_k,
                      (k == 2) & (terr_km1 <= 0.5 * terr_k))
    return ErrorTest(norm_k=norm_k, err_k=err_k, err_km1=err_km1, terr_k=terr_k,
                     terr_km1=terr_km1, k_new=where(lower, k - 1, k),
                     norm_smooth=norm_smooth, norm_alg=norm_alg)


# A jump of the algebraic sensitivities is recognized when their estimate fell by less
# than JUMP_RATIO while h fell to at most JUMP_STEP of the last failure's
# (`sensitivity_jump`).
JUMP_RATIO = 0.5
JUMP_STEP = 0.26


def sensitivity_jump(problem: Problem, s: State, coef: Coefficients, test: ErrorTest,
                     failing, t_new, h, k):
    """Whether a step that fails the error test (`failing`) only on the algebraic
    components of the forward sensitivities is stepping over a jump of theirs, which
    no step size resolves: (jump, the record for `State.sens_jump`, the error test to
    use).

    Where the residual has a kink along the solution (`jnp.maximum`, `abs`, a
    `jnp.where` switching continuously on the state), an algebraic variable z = φ(x)
    has a kink too, which steps resolve (its BDF error estimate shrinks like h), but its
    sensitivity s_z = φ'(x) s_x jumps: the estimate of a jump does not shrink with h at
    all, and the full error control (IDAS's) drove the step size to underflow where the
    solution itself passes (the Test Set's water tube, whose friction factors switch
    from the laminar to the turbulent law, stopped with `step_size_too_small`). The
    value of s_z at t_n needs no history: it is fixed by s_x(t_n) through the algebraic
    equations, which the corrector solves at t_n, so stepping over the jump costs no
    accuracy at the steps (only the interpolant across that one step is off).

    A jump is recognized when (a) the state, the quadratures and the differential
    sensitivities pass the test and only the error-tested algebraic sensitivities fail
    it, and the last attempt that failed that way (b) ended past this one's end, at
    the same order, with a step at least 1/`JUMP_STEP` times this one, and (c) had a
    correction norm less than 1/`JUMP_RATIO` times this one's: over a quarter of the
    step, a smooth component's estimate falls like h^(k+1) (≥ 16x), a kink's like h
    (4x); a jump's stays. (The steps approach the jump from both sides of it: attempts
    that end before it pass, those over it fail with the step cut by 4.) The step is
    then accepted on the estimate without those components, at the same order (no
    order change is judged on it), and their differences in the history are dropped
    (`_forget_differences`)."""
    assert s.sens_jump is not None and test.norm_smooth is not None
    assert test.norm_alg is not None
    alg_only = failing & (coef.ck * test.norm_smooth <= 1.0)
    last_norm, last_h, last_t, last_k = s.sens_jump
    jump = (alg_only & (last_norm > 0) & (t_new <= last_t) & (k == last_k)
            & (h <= JUMP_STEP * last_h) & (test.norm_alg >= JUMP_RATIO * last_norm))
    record = where(alg_only & ~jump,
                       jnp.stack([test.norm_alg, h, t_new, k.astype(h.dtype)]), s.sens_jump)
    err = _at(coef.sigma, k) * test.norm_smooth
    inf = jnp.full_like(err, jnp.inf)
    over = test._replace(norm_k=test.norm_smooth, err_k=err, err_km1=inf,
                         terr_k=(k + 1) * err, terr_km1=inf, k_new=k)
    return jump, record, jax.tree_util.tree_map(lambda a, b: where(jump, a, b), over, test)


def _forget_differences(phi, keep):
    """The history with rows 1.. multiplied by `keep` (n,) (row 0, the value, kept)."""
    if isinstance(phi, tuple):
        return (phi[0],) + tuple(row * keep for row in phi[1:])
    return phi.at[1:].multiply(keep)


class NextStep(NamedTuple):
    """Order and step size after an accepted step (`select_order_and_step`)."""

    k: Int[Array, ""]
    h: Array
    phase: Int[Array, ""]
    still_recovering: Bool[Array, ""]
    # The power of `_eta_power` with `failed` given: a failed attempt's ratio where it
    # failed (`handle_failure`'s), else this step's.
    eta_power: Array | None = None


def _eta_power(base, k_new, other=None):
    """IDAS's step ratio base^(−1/(k_new+1)). `other` = (use, base, k_new): the ratio
    of another candidate where `use` (a failed attempt's retry, `handle_failure`),
    from the same power: an attempt uses one of the two, and the power of 256
    members' values is among the dearest operations of a batched trip."""
    if other is not None:
        use, base_o, k_o = other
        base, k_new = where(use, base_o, base), where(use, k_o, k_new)
    return base ** (-1.0 / (k_new + 1))


def select_order_and_step(problem: Problem, s: State, weights: Weights, coef: Coefficients,
                          hist: Parts, corr: Parts, test: ErrorTest, h, k,
                          failed=None, err_kp1=None) -> NextStep:
    """Order and step size for the step after an accepted one (IDAS `IDACompleteStep`,
    manual §6.2.2). In the initial phase (phase 0) the order rises by one and h doubles
    each step until the order is lowered or reaches its maximum. Afterwards, once k + 1
    steps have been taken at constant step size (and not just after an order change),
    the order moves to the one of k − 1, k, k + 1 with the smallest T_j (T_{k+1} from
    the difference corr − φ_{k+1}); the step is then h η, η = (2 err_knew + 10⁻⁴)^(−1/(knew+1)),
    doubled when η ≥ 2, kept when 1 < η < 2, and cut to η clipped to [0.5, 0.9]
    otherwise.

    Recovery after an error-test failure (a deviation from IDAS, whose rules are kept
    otherwise): until the order selection has seen k + 1 steps at constant step size
    and chosen to keep the order, the step size is not increased, an order raise is not
    combined with a larger step, and the order is not lowered on an accepted step.
    Why: the error estimate of a low-order step can be a small difference of large
    terms that cancel only at constant step size. On the transistor amplifier at
    rtol 1e-8 (Test Set), after three failures dropped the order to 1, the estimate at
    constant h was 0.025 while at 2h it was 1.6 (≈ 65x for a doubling, against the 4x
    of an h² error): IDAS's rules then doubled the step after each success, failed,
    halved it, and never saw k + 1 steps at one step size, so the order, which alone
    allows larger steps there, never rose again — tens of thousands of order-1 steps
    of ~5e-8 with an error-test failure every other step (IDA itself shows the same
    trap: 76 000–138 000 steps on that run). The order-1 estimate also favoured
    lowering back from order 2 while its cancellation lasted."""
    num_steps = s.stats["num_steps"] + 1
    kdiff = k - s.k_used
    top = jnp.minimum(problem.max_order, MAXORD)
    phase = where((test.k_new == k - 1) | (k >= top), 1, s.phase)
    if err_kp1 is None:   # (else `stacked_norms`')
        err_kp1 = error_norm(problem, weights,
                             corr.map(lambda c, h_: c - history_row(h_, k + 1), hist)) / (k + 2)
    terr_kp1 = (k + 2) * err_kp1
    hold = (k >= top) | (k + 1 >= coef.ns) | (kdiff == 1)
    recovering = s.recovering
    act_lower = (((test.k_new == k - 1)
                  | (~hold & (k > 1) & (test.terr_km1 <= jnp.minimum(test.terr_k, terr_kp1))))
                 & ~recovering)
    act_raise = ~act_lower & ~hold & where(k == 1, terr_kp1 < 0.5 * test.terr_k,
                                              terr_kp1 < test.terr_k)
    k_sel = k + act_raise.astype(k.dtype) - act_lower.astype(k.dtype)
    err_knew = where(act_raise, err_kp1, where(act_lower, test.err_km1, test.err_k))
    eta = _eta_power(2.0 * err_knew + 1e-4, k_sel, failed)
    h_sel = where(eta >= 2.0, 2.0 * h,
                      where(eta <= 1.0, h * jnp.clip(eta, ETA_MIN, ETA_LOW), h))
    still_recovering = recovering & ((coef.ns <= k + 1) | act_raise)
    h_sel = where(still_recovering, jnp.minimum(h_sel, h), h_sel)
    h_sel = jnp.maximum(h_sel, problem.min_step)
    in_phase0 = phase == 0
    k_next = jnp.minimum(where(in_phase0, where(num_steps > 1, k + 1, k), k_sel), top)
    h_next = where(in_phase0, where(num_steps > 1, 2.0 * h, h), h_sel)
    return NextStep(k=k_next, h=h_next, phase=phase, still_recovering=still_recovering,
                    eta_power=None if failed is None else eta)


class Failure(NamedTuple):
    """How a failed attempt is retried (`handle_failure`)."""

    conv_fail: Bool[Array, ""]    # the corrector failed (Newton, linear solve, constraints)
    error_fail: Bool[Array, ""]   # the corrector converged, the error test failed
    nef: Int[Array, ""]           # error-test failures in this step, with this one
    ncf: Int[Array, ""]           # convergence failures in this step, with this one
    h: Array
    k: Int[Array, ""]
    rescale: Array                # factor on φ_1 (the first step only)


def failure_power(test: ErrorTest, k):
    """(base, k_new) of the first error-test failure's retry (`handle_failure`):
    η = 0.9 base^(−1/(k_new+1))."""
    err_knew = where(test.k_new == k, test.err_k, test.err_km1)
    return 2.0 * err_knew + 1e-4, test.k_new


def handle_failure(problem: Problem, s: State, corrector: Corrector, test: ErrorTest,
                   converged, passed, redo, h, k, eta_power=None) -> Failure:
    """The retry after a failed attempt (IDAS `IDAHandleNFlag`, manual §6.2.2): after a
    convergence failure h ← h/4 (or η h with the constraint's η) at the same order;
    after the first error-test failure h ← η h, η = 0.9 (2 err_knew + 10⁻⁴)^(−1/(knew+1))
    clipped to [0.25, 0.9], at the order the error test chose; after the second h ← h/4;
    from the third on also the order drops to 1. A sensitivity `redo` keeps h and k. On
    the very first step φ_1 = h y'_0 and ψ_0 = h are rescaled with h (IDAS `IDAReset`)."""
    conv_fail = ~converged & ~redo
    error_fail = converged & ~passed
    nef = s.nef + error_fail.astype(jnp.int32)
    ncf = s.ncf + conv_fail.astype(jnp.int32)
    if eta_power is None:
        eta_power = _eta_power(*failure_power(test, k))
    eta_ef1 = jnp.clip(0.9 * eta_power,
                       ETA_MIN_EF, ETA_LOW)
    eta = where(conv_fail, where(corrector.constraint_fail, corrector.eta_constraint, ETA_CF),
                    where(redo, 1.0, where(nef == 1, eta_ef1, ETA_MIN_EF)))
    k_fail = where(conv_fail | redo, k, where(nef >= 3, 1, test.k_new))
    return Failure(conv_fail=conv_fail, error_fail=error_fail, nef=nef, ncf=ncf,
                   h=jnp.maximum(h * eta, problem.min_step), k=k_fail,
                   rescale=where(s.fresh, eta, 1.0))


def updated_stats(problem: Problem, s: State, newton: NewtonResult, linear_stats: dict,
                  sens_residual_evals, passed, failure: Failure) -> Counters:
    """The statistics after an attempt (IDAS's counters, and the linear solver's)."""
    inc = dict(linear_stats)
    inc.update(num_residual_evals=newton.num_residual_evals,
               num_jacobian_evals=newton.num_jacobian_evals,
               num_nonlinear_iters=newton.num_iters,
               num_steps=passed.astype(jnp.int32),
               num_error_test_failures=failure.error_fail,
               num_nonlinear_convergence_failures=failure.conv_fail)
    if s.phiq.shape[1] > 0:
        inc["num_quadrature_evals"] = jnp.ones((), jnp.int32)
    if sens_residual_evals is not None:
        inc["num_sensitivity_residual_evals"] = sens_residual_evals
    return s.stats.add(inc)


def status(problem: Problem, s: State, corrector: Corrector, failure: Failure, passed, npress,
           at_min_step, h_next, t_new, too_accurate):
    """The attempt's `RESULTS`: IDAS gives up after maxncf convergence or maxnef
    error-test failures in one step, or at once when a step already at the minimum step
    size fails; the other statuses name what the step sizes collapsed on."""
    where = RESULTS.where
    newton = corrector.newton
    conv_fail = failure.conv_fail
    gave_up_conv = conv_fail & ((failure.ncf >= MAX_CONV_FAILS) | at_min_step)
    # At the edge of the residual's domain (h_nan: a NaN residual at a larger step not
    # yet recovered from), the step sizes collapse between NaN failures, error-test
    # failures and iteration matrices that are not finite there (which look singular):
    # the cause reported is the domain.
    nan_fail = conv_fail & (newton.fail_kind == FAIL_NONFINITE)
    at_edge = s.h_nan > 0
    fail_kind = jnp.where(at_edge & (newton.fail_kind == FAIL_SINGULAR), FAIL_NONFINITE,
                          newton.fail_kind)
    # A matrix-free solver's preconditioner sees J with the index-2 columns unscaled
    # (`_newton.newton_solve`), singular at small h however well posed the DAE is.
    singular = (RESULTS.singular_unscaled_index2
                if problem.index2 is not None and problem.linear_solver.matrix_free
                else RESULTS.singular_matrix)
    conv_result = where(corrector.constraint_fail, RESULTS.constraint_failures,
                        where(fail_kind == FAIL_SINGULAR, singular,
                              where(fail_kind == FAIL_NONFINITE, RESULTS.nonfinite_residual,
                                    where(fail_kind == FAIL_LINEAR,
                                          RESULTS.linear_solver_failures,
                                          RESULTS.convergence_failures))))
    result = where(gave_up_conv, conv_result,
                   where(failure.error_fail & ((failure.nef >= MAX_ERROR_TEST_FAILS)
                                               | at_min_step),
                         RESULTS.error_test_failures,
                         RESULTS.successful if npress is None
                         else where(passed & (npress >= MAX_CONV_FAILS),
                                    RESULTS.constraint_failures, RESULTS.successful)))
    # A step size driven to underflow by NaN residuals is a domain error (the solution
    # reached the edge of the residual's domain, e.g. sqrt of a state going negative).
    # Likewise a step size driven to underflow by an iterative linear solver that cannot
    # reach its tolerance is that solver's failure, not a singularity of the solution.
    underflow = where(nan_fail | at_edge, RESULTS.nonfinite_residual,
                      where(conv_fail & (fail_kind == FAIL_LINEAR),
                            RESULTS.linear_solver_failures, RESULTS.step_size_too_small))
    result = where(s.t + h_next == s.t, underflow, result)
    result = where(newton.mask_violated, RESULTS.wrong_algebraic_mask, result)
    # A step below half a spacing of t (`step_end`): nothing was attempted.
    result = where(t_new == s.t, RESULTS.step_size_too_small, result)
    return where(too_accurate, RESULTS.tolerance_too_small, result)


def attempt_step(problem: Problem, s: State) -> tuple[State, Bool[Array, ""]]:
    """One step attempt from s.t with (s.h, s.k) (IDAS manual §6.2.2): predictor,
    `correct_state`, `correct_sensitivities`, `error_test`, then on success
    `select_order_and_step` (IDAS `IDACompleteStep`) and on failure `handle_failure`
    (`IDAHandleNFlag`), and the attempt's `status`. Returns the new state and whether
    the step was accepted."""
    new, passed, _ = attempt_step_part(problem, s)
    return new, passed


def attempt_step_part(problem: Problem, s: State, pending=None, iterations: int | None = None,
                      active=None, rows: bool = False):
    """`attempt_step`, or with `iterations` a part of it: at most that many Newton
    iterations, continuing the iteration `pending` left by the last part (a
    `newton_solve` carry, status 0 where one is pending). Returns (state, accepted,
    carry; None without `iterations`). Where the carry's status is 0 the iteration is
    still pending and the state and `accepted` are meaningless except for J
    (`lin_state`, `jac_point`): the caller keeps the step state it passed and takes J
    from the returned one, and the next part recomputes the same predictor and cj
    from that state (a breakpoint's restart included) and continues the same
    iterates, so the attempts, their iterations and their results are those of
    `attempt_step`. `active` (bool, or None: all): where False the caller drops the
    attempt and J is not set up (`newton_solve`): the returned `lin_state` and
    `jac_point` are those of `s`. `rows`: the state's history φ is updated as its six
    rows and returned so (a tuple, for the caller to stack: `_integrate_flat`), where
    they are small (`_bdf.small_rows`)."""
    if problem.breakpoints is not None:
        s = restart_at_breakpoint(problem, s)
    dtype = s.phi.dtype
    uround = jnp.finfo(dtype).eps
    sens = problem.sens if (problem.sens is not None and problem.sens.k > 0) else None
    k = s.k
    nq = s.phiq.shape[1]
    ewt = error_weights(s.phi[0], problem.rtol, problem.atol)
    weights = Weights(
        y=ewt,
        error=ewt * problem.error_mask,
        q=error_weights(s.phiq[0], problem.quad_rtol, problem.quad_atol),
        s=None if sens is None else error_weights(s.phis[0], problem.rtol, sens.atol),
        sq=None if sens is None else error_weights(s.phiqs[0], problem.quad_rtol,
                                                   sens.quad_atol))
    # φ_1/ψ_0 ≈ y' (on the first step φ_1 = h0·y'0, ψ_0 = h0).
    yp_norm = wrms(s.phi[1], ewt) / s.psi[0]
    t_new, h = step_end(problem, s.t, jnp.minimum(s.h, problem.max_step), yp_norm)
    t_eval = evaluation_time(problem, t_new)
    coef = set_coefficients(s.psi, h, k, s.k_used, s.h_used, s.ns, dtype)
    cj = coef.cj
    too_accurate = uround * wrms(s.phi[0], ewt) > 1.0

    # --- predictor: all histories rescaled to the new step and extrapolated -----------
    phi = tuple(s.phi) if rows and small_rows(s.phi) else s.phi
    source = Parts(phi, s.phiq, s.phis, s.phiqs)
    hist = Parts(y=phi, q=s.phiq if nq else None, s=s.phis if sens else None,
                 sq=s.phiqs if (sens and nq) else None)
    hist = hist.map(lambda phi: scale_history(phi, coef.beta, coef.ns, k))
    preds = hist.map(lambda phi: predict(phi, coef.gamma, k))
    y_pred, yp_pred = preds.y

    # --- corrector: the state, then quadratures and sensitivities at the converged y ---
    corrector = correct_state(problem, s, coef, t_eval, h, y_pred, yp_pred, ewt,
                              resume=pending, iterations=iterations, active=active)
    newton = corrector.newton
    converged = corrector.converged
    # Quadratures: explicit correction e_Q = (q(t, y, y') − y_Q'(0))/cj (§6.2.5).
    corr = Parts(y=corrector.correction,
                 q=None if preds.q is None
                 else (problem.quad(t_eval, corrector.y, corrector.yp) - preds.q[1]) / cj)
    redo = jnp.zeros((), bool)
    ss_sens = s.ss_sens
    linear_stats = dict(newton.linear_stats)
    sens_residual_evals = None
    if sens is not None:
        s_pred, sp_pred = preds.s
        sensitivities = correct_sensitivities(problem, s, sens, cj, t_eval, corrector, s_pred,
                                              sp_pred, weights.s, preds.sq is not None)
        ss_sens = sensitivities.rate_factor
        redo = sensitivities.redo
        converged = converged & sensitivities.converged
        sens_residual_evals = sensitivities.num_residual_evals
        linear_stats = {name: linear_stats[name] + sensitivities.linear_stats[name]
                        for name in linear_stats}
        corr = corr._replace(
            s=sensitivities.correction,
            sq=None if preds.sq is None else (sensitivities.quad_rate - preds.sq[1]) / cj)

    # --- error test, then the next step on success or the retry on failure -----------
    norms = stacked_norms(problem, weights, hist, corr, k)
    test = error_test(problem, weights, coef, hist, corr, k, norms)
    passed = (converged & (coef.ck * test.norm_k <= 1.0) & (t_new > s.t)
              & ~newton.mask_violated)
    jump = jump_record = None
    if s.sens_jump is not None:
        jump, jump_record, test = sensitivity_jump(
            problem, s, coef, test,
            converged & (t_new > s.t) & ~newton.mask_violated & ~passed, t_new, h, k)
        passed = passed | jump
    # One power for both outcomes' step ratios (the attempt uses one of them).
    base_f, k_f = failure_power(test, k)
    accept = select_order_and_step(problem, s, weights, coef, hist, corr, test, h, k,
                                   failed=(~passed, base_f, k_f),
                                   err_kp1=None if norms is None else norms[3])
    failure = handle_failure(problem, s, corrector, test, converged, passed, redo, h, k,
                             eta_power=accept.eta_power)
    at_min_step = h <= problem.min_step * (1 + 4 * uround)
    hist_fail = hist.map(lambda _, phi: update_row(phi, 1, lambda row: row * failure.rescale),
                         source).fill(source)
    stats = updated_stats(problem, s, newton, linear_stats, sens_residual_evals, passed, failure)
    npress = None if s.npress is None else where(corrector.pressing, s.npress + 1, 0)
    result = status(problem, s, corrector, failure, passed, npress, at_min_step,
                    where(passed, accept.h, failure.h), t_new, too_accurate)

    # --- the two outcomes -------------------------------------------------------------
    new_hist = hist.map(lambda phi, c: complete_history(phi, c, k), corr).fill(source)
    if jump is not None and sens is not None and sens.algebraic is not None:
        # Over a jump the algebraic sensitivities' differences hold the jump, not their
        # variation: keep their value only (the next predictor holds it constant), as
        # a restart would.
        keep = where(jump, 1.0 - sens.algebraic, 1.0)
        new_hist = new_hist._replace(s=_forget_differences(new_hist.s, keep))
    accepted_state = State(
        t=t_new, h=accept.h, h_used=h, k=accept.k, k_used=k, ns=coef.ns, phase=accept.phase,
        phi=new_hist.y, phiq=new_hist.q, phis=new_hist.s, phiqs=new_hist.sq,
        psi=coef.psi, cj=cj, cj_old=newton.cj_old, ss=newton.ss, ss_sens=ss_sens,
        new_matrix=None if s.new_matrix is None else jnp.zeros((), bool),
        lin_state=newton.lin_state,
        jac_point=newton.jac_point, nef=jnp.zeros_like(failure.nef),
        ncf=jnp.zeros_like(failure.ncf), npress=npress,
        h_nan=where(h >= s.h_nan, 0.0, s.h_nan), fresh=jnp.zeros((), bool),
        restart_pending=(None if problem.breakpoints is None
                         else jnp.any(problem.breakpoints == t_new)),
        recovering=accept.still_recovering | (s.nef > 0),
        sens_jump=jump_record,
        stats=stats, result=result,
    )
    nan_fail = failure.conv_fail & (newton.fail_kind == FAIL_NONFINITE)
    rejected_state = State(
        t=s.t, h=failure.h, h_used=s.h_used, k=failure.k, k_used=s.k_used, ns=coef.ns,
        phase=where(redo, s.phase, jnp.ones_like(accept.phase)), phi=hist_fail.y,
        phiq=hist_fail.q, phis=hist_fail.s, phiqs=hist_fail.sq,
        psi=where(s.fresh & (jnp.arange(NPHI) == 0), failure.h, s.psi), cj=cj,
        cj_old=newton.cj_old, ss=newton.ss, ss_sens=ss_sens,
        new_matrix=None if s.new_matrix is None else redo,
        lin_state=newton.lin_state, jac_point=newton.jac_point,
        nef=where(failure.conv_fail, s.nef, failure.nef), ncf=failure.ncf,
        npress=s.npress, h_nan=where(nan_fail, h, s.h_nan), fresh=s.fresh,
        restart_pending=s.restart_pending, recovering=s.recovering | failure.error_fail,
        sens_jump=jump_record,
        stats=stats, result=result,
    )
    # Both outcomes share the Newton's factorization: select everything else, not the
    # (n×n) factors.
    new = tree_where(passed, strip_linear_state(accepted_state),
                     strip_linear_state(rejected_state))
    return dataclasses.replace(new, lin_state=newton.lin_state), passed, newton.carry


class Outputs(eqx.Module):
    """Dense output at the requested times, filled as the steps pass them: the
    interpolating polynomial and its derivatives up to `order` (`yd[i, m]` = y^(m)(ts[i])),
    the quadratures, and the same for the forward sensitivities. Rows never reached stay
    inf (never NaN)."""

    ts: Float[Array, " n_save"]
    yd: Float[Array, "n_save order+1 n"]
    qs: Float[Array, "n_save nq"]
    sd: Float[Array, "n_save k order+1 n"]
    qsd: Float[Array, "n_save k nq"]
    index: Int[Array, ""]         # next row to fill

    @classmethod
    def create(cls, ts, n: int, nq: int, k: int, order: int, dtype) -> "Outputs":
        m = ts.shape[0]
        inf = jnp.asarray(jnp.inf, dtype)
        return cls(ts=ts, yd=jnp.full((m, order + 1, n), inf), qs=jnp.full((m, nq), inf),
                   sd=jnp.full((m, k, order + 1, n), inf), qsd=jnp.full((m, k, nq), inf),
                   index=jnp.zeros((), jnp.int32))

    @property
    def ys(self):
        return self.yd[:, 0]

    @property
    def yps(self):
        return self.yd[:, 1]


OUTPUT_BLOCK = 8   # output rows written per masked block update
# XLA's CPU runtime runs a loop body sequentially only while every buffer it touches is
# at most this size; larger ones put each iteration's operations on its thread pool
# (ThunkExecutor's sequential threshold in jaxlib 0.10; not configurable from JAX).
LOOP_BYTES = 512


def write_outputs(s: State, out: Outputs, t_limit=None, passed=True) -> Outputs:
    """Fill every output row with t_out ≤ t_n (≤ t_limit, a terminal event, if given) by
    IDAS's interpolant (nothing unless the step `passed`). Never beyond t_n: the
    integration stops only once t_n ≥ t1 (a step past tstop ends on it, `step_end`),
    so no row is extrapolated (a round-off band of 100·eps·|t| extrapolated a whole
    solution at large t, e.g. t0 = 1.7e9, from the initial values).

    The due rows are written in blocks of `OUTPUT_BLOCK` consecutive rows by one masked
    update each, by a loop that runs while a row is due (more than one trip only for
    more than 8 outputs in one step, e.g. thousands of observation times). Every loop
    iteration that touches the output buffers runs on XLA's CPU thread pool (they pass
    its ~512-byte threshold for sequential execution), so rows are written 8 at a
    time rather than one by one: Barnes with 2400 outputs, 4x fewer iterations. The
    block update is traced once, in that loop (`integrate` writes the rows at t0 by this
    same call): each copy of it was ~150 instructions for XLA to compile."""
    n_save = out.ts.shape[0]
    if n_save == 0:
        return out
    order = out.yd.shape[1] - 1
    block = min(OUTPUT_BLOCK, n_save)

    def limit_of(s):
        return s.t if t_limit is None else jnp.minimum(s.t, t_limit)

    def due(limit, o):
        return passed & (o.index < n_save) & (row(o.ts, o.index) <= limit)

    def write_block(s, limit, o):
        # Rows index … index + block − 1, clipped to the buffer: the slice start is
        # shifted back at the end (rows before `index` are then rewritten unchanged).
        start = jnp.clip(o.index, 0, n_save - block)
        rows = start + jnp.arange(block)
        ts = jax.lax.dynamic_slice_in_dim(o.ts, start, block)
        do = passed & (rows >= o.index) & (ts <= limit)
        w = jax.vmap(lambda t: derivative_weights(t, s.t, s.psi, s.k_used, order))(ts)

        def put(buf, new):
            old = jax.lax.dynamic_slice_in_dim(buf, start, block)
            mask = do.reshape((block,) + (1,) * (old.ndim - 1))
            return jax.lax.dynamic_update_slice_in_dim(buf, where(mask, new, old), start, 0)

        # Due rows are consecutive from `index`: the count advances the index.
        new = dict(yd=put(o.yd, jnp.einsum("bmj,jn->bmn", w, s.phi)),
                   index=o.index + jnp.sum(do, dtype=jnp.int32))
        # Only the parts that exist.
        if o.qs is not None and o.qs.size:
            new["qs"] = put(o.qs, w[:, 0] @ s.phiq)
        if o.sd is not None and o.sd.size:
            new["sd"] = put(o.sd, jnp.einsum("bmj,jkn->bkmn", w, stacked(s.phis)))
        if o.qsd is not None and o.qsd.size:
            new["qsd"] = put(o.qsd, jnp.einsum("bj,jkn->bkn", w[:, 0], stacked(s.phiqs)))
        return dataclasses.replace(o, **new)

    # The loop behind a branch taken only when a row is due: as a bare loop, XLA peeled
    # its first block out of it, so the interpolation weights and their products ran in
    # every trip of `integrate`'s outer loop — which a kept trajectory (a stage append
    # every ~20 steps) and the checkpoints make run far more often than output rows
    # are due.
    # The state goes into the branch packed (`packed_cond`), as `integrate`'s loops carry it.
    def written(s_):
        limit = limit_of(s_)
        return jax.lax.while_loop(functools.partial(due, limit),
                                  functools.partial(write_block, s_, limit), out)

    return packed_cond(unvmap_any(due(limit_of(s), out)), written, lambda s_: out, s)


def integrate(problem: Problem, state: State, outputs: Outputs, t_end, max_steps: int,
              recorders: tuple = (), events: EventState | None = None, until=None):
    """Step from `state` until t_end is reached (or passed, unless tstop forbids it) or a
    terminal event stops it (status `RESULTS.event`), writing outputs on the way, locating
    events on each accepted step, and passing every accepted step to each recorder
    (checkpoints, step buffers). Returns the final state, outputs, recorders and event
    state.

    Unbatched, two loops: the inner one takes steps until the next output time is
    passed or a sparse recorder (a checkpoint, `per_step = False`) is due, carrying only
    the (small) step state and the per-step recorders; the outer one writes the outputs
    that step made due and the checkpoint. The rows at the start time are written by the
    outer loop's first trip (its inner loop takes no step when the next output time is
    already reached), so that the output writing is traced once. A step loop that
    carried the output or checkpoint buffers made XLA's CPU runtime switch, once a
    buffer of its body passed ~512 bytes, from sequential to thread-pool execution of
    every step's operations, several times slower for small problems (a few dozen
    output values, a recording forward run).

    Batched (`solve` called under a `vmap` that batches its inputs, `Problem.batched`,
    or traced here with batched inputs, `is_batched`), one flat loop
    (`_integrate_flat`): each trip attempts one step of every member and writes the
    output rows and checkpoints that member's step made due. A vmapped loop runs until
    its last member is done, so the nested loops made every member wait for the slowest
    one at every output time (Robertson, 256 members of 885–1296 steps, 12 outputs:
    1825 step-loop trips); the flat loop runs as many trips as the member with the most
    step attempts (and the extra trips of its attempts whose Newton iteration is longer
    than a trip's `BATCH_NEWTON_ITERATIONS`). The size threshold above does not apply:
    batched, the step state alone is past it. Each member takes the same steps and
    writes the same rows as in the nested loops.

    `until` (optional): also stop, with no change of status, once the accepted steps
    (`stats["num_steps"]`) reach it. The returned carry then resumes: calling `integrate`
    on it again takes the same steps as one uninterrupted call (the step loop stops
    between attempts, before the next output time is passed, so no output row is due
    at the stop)."""
    n_save = outputs.ts.shape[0]
    if problem.batched or is_batched((problem, state, outputs, recorders, events, t_end, until)):
        return _integrate_flat(problem, state, outputs, t_end, max_steps, recorders, events,
                               until)

    def running(s):
        go = (s.t < t_end) & (s.result == RESULTS.successful)
        if until is not None:
            go = go & (s.stats["num_steps"] < until)
        return go

    def next_output(out):
        if n_save == 0:
            return t_end
        t_next = row(out.ts, out.index)
        return where(out.index < n_save, jnp.minimum(t_next, t_end), t_end)

    # Recorders writing every step stay in the step loop; sparse ones (checkpoints)
    # make the step loop stop when they are due and record in the outer loop. A staged
    # one (`staged = True`: a kept trajectory, too large for the step loop) records into
    # a small stage of its own (`new_stage()`) in the step loop, which stops when the
    # stage is full (`full()`); the outer loop appends the stage (`append`).
    staged = tuple(getattr(r, "staged", False) for r in recorders)
    sparse = tuple(not getattr(r, "per_step", True) and not st
                   for r, st in zip(recorders, staged))
    due_checks = [r for r, sp in zip(recorders, sparse) if sp]
    stage_at = tuple(i for i, st in enumerate(x for x, sp in zip(staged, sparse) if not sp)
                     if st)

    def step_cond(carry):
        s, _, _, t_target, flush = carry
        return running(s) & (s.t < t_target) & ~flush

    def step_body(carry):
        s, recs, ev, t_target, _ = carry
        s, passed = attempt_step(_with_step_history(problem, recs), s)
        ev = _search_events(problem, s, ev, passed)
        flush = jnp.zeros((), bool)
        for r in due_checks:   # `due` reads only static fields (e.g. `every`)
            flush = flush | r.due(s, passed)
        recs = tuple(r.record(s, passed) for r in recs)
        for i in stage_at:
            flush = flush | recs[i].full()
        _report_progress(problem, s, passed, t_end)
        s = _step_status(s, passed, recs, ev, t_end, max_steps)
        return s, recs, ev, t_target, flush

    def outer_cond(carry):
        return running(carry[0])

    def outer_body(carry):
        s, out, recs, ev = carry
        inner = tuple(r.new_stage() if st else r
                      for r, sp, st in zip(recs, sparse, staged) if not sp)
        outer = [r for r, sp in zip(recs, sparse) if sp]
        s, inner, ev, _, flush = packed_while_loop(
            step_cond, step_body, (s, inner, ev, next_output(out), jnp.zeros((), bool)), part=0)
        it_inner, it_outer = iter(inner), iter(outer)
        # `flush`: the last step was accepted and a checkpoint is due after it (or a
        # stage is full: `record_due` checks again whether it is due).
        recs = tuple(_record_due(next(it_outer), s, flush) if sp
                     else r.append(next(it_inner)) if st else next(it_inner)
                     for r, sp, st in zip(recs, sparse, staged))
        # The rows due now all lie in the last step (the inner loop stops at the first
        # step that passes the next output time), or at the start time (before the
        # first step; interpolated there from the initial history, which gives y0, y'0).
        out = write_outputs(s, out, _output_limit(problem, ev))
        return s, out, recs, ev

    # Empty output arrays (no quadratures / sensitivities) stay out of the loop carry.
    empty = {f: getattr(outputs, f) for f in ("qs", "sd", "qsd") if getattr(outputs, f).size == 0}
    outputs = dataclasses.replace(outputs, **{f: None for f in empty})
    state, outputs, recorders, events = packed_while_loop(
        outer_cond, outer_body, (state, outputs, tuple(recorders), events), part=0)
    return state, dataclasses.replace(outputs, **empty), recorders, events


def _record_due(r, s: State, passed):
    """A sparse recorder's (a checkpoint's) record of the accepted step, as a branch taken
    only where it is due. Written unconditionally, the record reads and writes back a row
    of each of the state's ~25 fields (a select each): ~55 operations in every trip of
    the outer loop, which a kept trajectory's stage appends make run every ~20 steps, on
    XLA's thread-pool executor (the checkpoint buffers are past its sequential size)."""
    return packed_cond(unvmap_any(r.due(s, passed)), lambda s_: r.record(s_, passed),
                       lambda s_: r, s)


def _search_events(problem: Problem, s: State, ev: EventState | None, passed):
    """The event state after an attempt: the roots of the event function on the step
    just accepted (`search_step`; nothing on a rejected attempt)."""
    if ev is None:
        return ev
    order = ev.yd.shape[1] - 2
    return jax.lax.cond(unvmap_any(passed),
                        lambda: taken_where(passed, search_step(problem.event, problem.args,
                                                                s, ev, order), ev),
                        lambda: ev)


def _report_progress(problem: Problem, s: State, passed, t_end):
    """`progress=`: a report every `problem.progress` accepted steps (none when 0)."""
    if problem.progress:
        report = passed & (s.stats["num_steps"] % problem.progress == 0)
        # One report for a batch, of its slowest member: the operands reduced over the
        # batch first (`jax.debug.callback` of batched operands is unrolled into one host
        # call per member, each with its own slicing kernels).
        jax.lax.cond(unvmap_any(report),
                     lambda: jax.debug.callback(
                         _print_progress, -unvmap_max(-s.t), unvmap_max(t_end),
                         unvmap_max(s.stats["num_steps"]), -unvmap_max(-s.h_used)),
                     lambda: None)


def _step_status(s: State, passed, recs: tuple, ev: EventState | None, t_end,
                 max_steps: int) -> State:
    """The state with the status an accepted step may end the integration with:
    `max_steps_reached`, `delay_history_lost` (a delay DAE whose step history ring
    overflowed), `event` (a terminal event found)."""
    hit_max = passed & (s.stats["num_steps"] >= max_steps) & (s.t < t_end)
    result = RESULTS.where(hit_max & (s.result == RESULTS.successful),
                           RESULTS.max_steps_reached, s.result)
    for r in recs:
        if isinstance(r, DelayBuffer):
            result = RESULTS.where(r.lost & (result == RESULTS.successful),
                                   RESULTS.delay_history_lost, result)
    if ev is not None:
        result = RESULTS.where(ev.stopped & (result == RESULTS.successful),
                               RESULTS.event, result)
    return eqx.tree_at(lambda z: z.result, s, result)


def _output_limit(problem: Problem, ev: EventState | None):
    """The latest output time that may be written: a terminal event's time once found
    (None without events)."""
    if ev is None or problem.event is None:
        return None
    return where(ev.stopped & problem.event.terminal, ev.t[0], jnp.inf)


# Newton iterations per trip of the batched step loop (`attempt_step_part`; None: each
# trip iterates until every member's iteration is done, as `attempt_step` does).
# Robertson, 256 members, CPU time of the batch in one process: 1 → 0.92x, 2 → 0.80x,
# 3 → 1.03x that of None (docs/performance.md, "Batches").
BATCH_NEWTON_ITERATIONS: int | None = 2


def _integrate_flat(problem: Problem, state: State, outputs: Outputs, t_end, max_steps: int,
                    recorders: tuple, events: EventState | None, until):
    """`integrate` as one loop of step attempts, for batched members (see there): after
    each attempt, the output rows the member's accepted step made due are written
    (`write_output_rows`, by the interpolant of that step, as the nested loops write
    them), every recorder records it, and a sparse recorder (a checkpoint) only in a
    trip where some member's is due (a branch: writing the stored state into the
    checkpoint buffer costs a few dozen row updates, which most trips need for no
    member). The rows at the start time are written before the loop.

    The loop runs while any member is running (`unvmap_any`), and the body itself keeps
    the members that are done as they are: their attempt's state is dropped (a select
    of the step state) and the attempt counts as not accepted, so no recorder, event or
    output row changes for them (each writes only for an accepted step). With a
    batched predicate, `vmap`'s rule would instead select every carry after every trip,
    the output and recorder buffers included (Robertson, 256 members, 12 output rows:
    that select cost ~50 µs a trip, profiled).

    A trip runs at most `BATCH_NEWTON_ITERATIONS` Newton iterations of each member's
    attempt (`attempt_step_part`), straight-line: a member whose iteration needs more
    keeps its step state and finishes the attempt in the next trips, while the others
    go on stepping. A loop that iterated until every member was done ran the slowest
    member's iterations in almost every trip (Robertson, 256 members: 2.93 per trip
    against 1.2 per attempt unbatched)."""
    def running(s):
        go = (s.t < t_end) & (s.result == RESULTS.successful)
        if until is not None:
            go = go & (s.stats["num_steps"] < until)
        return go

    def record(r, s, passed):
        if getattr(r, "per_step", True):
            return r.record(s, passed)
        return _record_due(r, s, passed)

    def body(carry):
        s_old, out, recs, ev, pending_old = carry
        go = running(s_old)
        # A member that is done sets up no J in its (dropped) attempt: its factors and
        # their setup point come back as they went in, with no select (under `vmap` a
        # select of J is a copy of the whole batch's factors on every trip).
        s, passed, pending = attempt_step_part(_with_step_history(problem, recs), s_old,
                                               pending_old, BATCH_NEWTON_ITERATIONS, go,
                                               rows=True)
        # Small histories φ come back as their six rows (`attempt_step_part`), selected
        # row by row and stacked only after the last select below. As one (batch, 6, n)
        # array, XLA fused the history update (`complete_history`: a reverse cumulative
        # sum over the rows, a concatenate under `vmap`) with the selects of the outcome
        # into one loop of branchy scalar code over all the elements (Robertson, 256
        # members: ~20-25 µs of a ~190 µs trip, profiled); as rows, the batch took 3-8 %
        # less CPU time (medians of 30 interleaved rounds against the one-array
        # program, load 3.4-4.9), with the same numbers bit for bit.
        if isinstance(s.phi, tuple):
            s_old = dataclasses.replace(s_old, phi=tuple(s_old.phi))
        if pending is None:
            s = dataclasses.replace(tree_where(go, strip_linear_state(s),
                                               strip_linear_state(s_old)),
                                    lin_state=s.lin_state)
        else:
            # A member whose Newton iteration is pending keeps its step state, as a
            # member that is done does (one select for both), but takes J and the
            # point it was set up at from the iteration. The carry of a member that is
            # done is never resumed: no select.
            waiting = pending.status == 0
            keep = ~go | waiting
            lin = (s.lin_state, s.jac_point)
            s = tree_where(keep, dataclasses.replace(s_old, lin_state=(), jac_point=()),
                           dataclasses.replace(s, lin_state=(), jac_point=()))
            s = dataclasses.replace(s, lin_state=lin[0], jac_point=lin[1])
            passed = passed & ~waiting
        s = dataclasses.replace(s, phi=stacked(s.phi))
        passed = passed & go
        ev = _search_events(problem, s, ev, passed)
        recs = tuple(record(r, s, passed) for r in recs)
        _report_progress(problem, s, passed, t_end)
        s = _step_status(s, passed, recs, ev, t_end, max_steps)
        out = write_output_rows(s, out, _output_limit(problem, ev), passed)
        return s, out, recs, ev, pending

    empty = {f: getattr(outputs, f) for f in ("qs", "sd", "qsd") if getattr(outputs, f).size == 0}
    outputs = dataclasses.replace(outputs, **{f: None for f in empty})
    outputs = write_output_rows(state, outputs, _output_limit(problem, events))
    state, outputs, recorders, events, _ = jax.lax.while_loop(
        lambda carry: unvmap_any(running(carry[0])), body,
        (state, outputs, tuple(recorders), events,
         None if BATCH_NEWTON_ITERATIONS is None
         else idle_iteration(state.phi[0], problem.linear_solver)))
    return state, dataclasses.replace(outputs, **empty), recorders, events


def _weighted_rows(w, phi):
    """Σ_j w[m, j] φ_j for each row m of `w` (m, 6), over the six rows of φ unrolled:
    under `vmap` a contraction over φ's leading axis is a batched dot product, which
    XLA's CPU backend hands to a library kernel costing tens of µs for these sizes
    (`_bdf._row_sum`)."""
    total = w[:, 0, None] * phi[0][None]
    for j in range(1, NPHI):
        total = total + w[:, j, None] * phi[j][None]
    return total


def write_output_rows(s: State, out: Outputs, t_limit=None, passed=True) -> Outputs:
    """`write_outputs` for batched members: the same rows (t_out ≤ t_n, ≤ t_limit),
    from the same interpolating polynomial, one row per member per trip of a loop that
    runs while any member has a row due (`unvmap_any`: no select of the output buffers
    after each trip) and writes only the members' due rows (a gather and a scatter of
    one row per member, in place). A step usually makes at most one row due, so most
    calls take no trip or one."""
    n_save = out.ts.shape[0]
    if n_save == 0:
        return out
    order = out.yd.shape[1] - 1
    limit = s.t if t_limit is None else jnp.minimum(s.t, t_limit)

    def due(o):
        return passed & (o.index < n_save) & (row(o.ts, o.index) <= limit)

    def write_row(o):
        do = due(o)
        i = jnp.minimum(o.index, n_save - 1)
        # The weights computed once (a barrier to fusion): fused into the sums below, XLA
        # recomputed their recurrence for every value of the rows (Robertson, 256
        # members: ~13 µs of a write, profiled, against ~10 µs for the two now).
        # Values may differ from the fused program's by rounding (1 ulp in 59 of its
        # 9216 output values; steps and statistics unchanged).
        w = jax.lax.optimization_barrier(
            derivative_weights(o.ts[i], s.t, s.psi, s.k_used, order))

        # A member with no row due writes past the end (dropped): no read of the row
        # to write it back unchanged.
        row = where(do, i, n_save)

        def put(buf, new):
            return buf.at[row].set(new, mode="drop")

        new = dict(yd=put(o.yd, _weighted_rows(w, s.phi)),
                   index=o.index + do.astype(jnp.int32))
        if o.qs is not None and o.qs.size:
            new["qs"] = put(o.qs, _weighted_rows(w[:1], s.phiq)[0])
        if o.sd is not None and o.sd.size:
            new["sd"] = put(o.sd, jnp.einsum("mj,jkn->kmn", w, stacked(s.phis)))
        if o.qsd is not None and o.qsd.size:
            new["qsd"] = put(o.qsd, jnp.einsum("j,jkn->kn", w[0], stacked(s.phiqs)))
        return dataclasses.replace(o, **new)

    return jax.lax.while_loop(lambda o: unvmap_any(due(o)), write_row, out)


def _with_step_history(problem: Problem, recorders: tuple) -> Problem:
    """The problem whose residual sees the steps taken so far: a delay DAE's lagged
    values come from its `DelayBuffer`, a recorder of this loop, which replaces the one in
    its `DelayArgs`. Unchanged (nothing traced) without one."""
    for r in recorders:
        if isinstance(r, DelayBuffer):
            return dataclasses.replace(problem, args=dataclasses.replace(problem.args, buffer=r))
    return problem


_last_print = [0.0]


def _print_progress(t, t_end, steps, h):
    """Host side of `progress=`: one line at most every 0.5 s (a batched solve reports
    its slowest member: the operands are the batch's least t and h, largest step
    count)."""
    import time

    import numpy as np
    now = time.monotonic()
    if now - _last_print[0] < 0.5:
        return
    _last_print[0] = now
    t, t_end, steps, h = (np.asarray(v) for v in (t, t_end, steps, h))
    print(f"daeadjoint: t = {t:.6g} of {t_end:.6g}, {steps} steps, h = {h:.3g}", flush=True)


def _write_slot(buffer, i, value, do):
    return jax.tree_util.tree_map(
        lambda b, v: b.at[i].set(where(do, v, b[i])), buffer, value)


def strip_linear_state(s: State) -> State:
    """The state without its factorization (rebuilt from `jac_point` on restart)."""
    return dataclasses.replace(s, lin_state=())


def restore_linear_state(problem: Problem, s: State) -> State:
    """Rebuild the factorization at the stored setup point with the stored cj_old:
    the restarted integration then repeats the original steps."""
    t, y, yp = s.jac_point
    # The Newton iteration of an index-2 problem factors J D, D = cj on the index-2
    # columns (`newton_solve`): rebuild that one, or the replay's corrections x = D w
    # would come from the unscaled J and leave the original steps.
    scaled = problem.index2 is not None and _builds_from_residual(problem.linear_solver)
    lin = setup_linear(problem.linear_solver, problem.residual, t, y, yp, s.cj_old,
                       problem.args, problem.index2 if scaled else None)
    return dataclasses.replace(s, lin_state=lin)


class CheckpointRecorder(eqx.Module):
    """Hot-restart checkpoints: the full BDF state (less the LU factors) at steps
    0, N, 2N, ... (IDAS manual §6.2.7.3). Capacity is fixed: ceil(max_steps/N) + 1."""

    every: int = eqx.field(static=True)
    states: State
    count: Int[Array, ""]

    @classmethod
    def create(cls, state: State, every: int, max_steps: int):
        capacity = -(-max_steps // every) + 1
        stripped = strip_linear_state(state)
        states = jax.tree_util.tree_map(
            lambda x: jnp.broadcast_to(x, (capacity,) + jnp.shape(x)).copy(), stripped)
        return cls(every=every, states=states, count=jnp.ones((), jnp.int32))

    per_step = False   # recorded by `integrate`'s outer loop, see there

    def due(self, s: State, passed) -> Bool[Array, ""]:
        return passed & (s.stats["num_steps"] % self.every == 0)

    def record(self, s: State, passed) -> "CheckpointRecorder":
        do = self.due(s, passed)
        i = jnp.minimum(self.count, jax.tree_util.tree_leaves(self.states)[0].shape[0] - 1)
        states = _write_slot(self.states, i, strip_linear_state(s), do)
        return CheckpointRecorder(self.every, states, self.count + do.astype(jnp.int32))


def hermite(t, ta, tb, ya, yb, ypa, ypb):
    """The cubic Hermite interpolant on [ta, tb] with values ya, yb and derivatives
    ypa, ypb: y(t) and y'(t), with x = (t − ta)/h, h = tb − ta and the basis
    h00 = 2x³ − 3x² + 1, h10 = x³ − 2x² + x, h01 = −2x³ + 3x², h11 = x³ − x²
    (y = h00 ya + h10 h ypa + h01 yb + h11 h ypb; y' its derivative in t)."""
    h = tb - ta
    x = (t - ta) / h
    ma, mb = h * ypa, h * ypb
    h00, h10, h01, h11 = (2 * x**3 - 3 * x**2 + 1, x**3 - 2 * x**2 + x,
                          -2 * x**3 + 3 * x**2, x**3 - x**2)
    d00, d10, d01, d11 = 6 * x**2 - 6 * x, 3 * x**2 - 4 * x + 1, -6 * x**2 + 6 * x, 3 * x**2 - 2 * x
    y = h00 * ya + h10 * ma + h01 * yb + h11 * mb
    yp = (d00 * ya + d10 * ma + d01 * yb + d11 * mb) / h
    return y, yp


class StepRecorder(eqx.Module):
    """Every accepted step of one segment, to evaluate the forward solution anywhere in
    it during the backward pass (for the adjoint's F_y, F_y' and F_p):

    - nodes (t_n, y_n, y'_n), n = 0 (the segment start) … count, for piecewise cubic
      Hermite interpolation — C¹ across steps, so the adjoint's coefficients
      F_y(t, y(t), y'(t)) have no jumps at forward step boundaries;
    - (φ, ψ, k_used) of each step, for the BDF interpolating polynomial — exactly the
      forward dense output, but its y' jumps at step boundaries. Kept only for
      `hermite=False`: the Hermite nodes need 2n numbers a step, the BDF history 6n, and
      at n ≈ 10³ writing and allocating the unused history cost the backward pass more
      than its arithmetic;
    - with `log=True`, the segment's step sequence (h_n, k_n): with the node times t_n
      and the checkpoint the segment starts from, what the discrete adjoint replays the
      segment from (`Adjoint`'s fallback, `discrete_adjoint.replayed_steps`). Two
      numbers a step, written with the node.
    """

    hermite: bool = eqx.field(static=True)
    t: Float[Array, " N+1"]
    y: Float[Array, "N+1 n"]
    yp: Float[Array, "N+1 n"]
    phi: Float[Array, "N 6 n"]
    psi: Float[Array, "N 6"]
    k_used: Int[Array, " N"]
    count: Int[Array, ""]
    h_step: Float[Array, " N"]         # (`log=True` only; else no rows)
    k_step: Int[Array, " N"]
    # False: recorded by `integrate`'s outer loop after each accepted step, so that the
    # step loop itself never touches the buffer (see `integrate`: on small systems that
    # keeps the step loop off XLA's thread pool; Robertson's backward pass 10-15 %).
    per_step: bool = eqx.field(static=True, default=True)

    @classmethod
    def create(cls, capacity: int, n: int, dtype, hermite: bool = True, per_step: bool = True,
               log: bool = False):
        cap_h = 0 if hermite else capacity
        cap_l = capacity if log else 0
        return cls(hermite=hermite, per_step=per_step, t=jnp.full((capacity + 1,), jnp.inf, dtype),
                   y=jnp.zeros((capacity + 1, n), dtype), yp=jnp.zeros((capacity + 1, n), dtype),
                   phi=jnp.zeros((cap_h, NPHI, n), dtype),
                   psi=jnp.ones((cap_h, NPHI), dtype),
                   k_used=jnp.ones((cap_h,), jnp.int32), count=jnp.zeros((), jnp.int32),
                   h_step=jnp.ones((cap_l,), dtype), k_step=jnp.ones((cap_l,), jnp.int32))

    @staticmethod
    def _node(s: State):
        return node_values_at_tn(s.t, s.phi, s.psi, s.k_used)

    def start(self, s: State, yp0) -> "StepRecorder":
        """Node 0: the state the segment starts from (y'0 given: at t0 the history
        holds h·y'0, not yet a polynomial)."""
        return dataclasses.replace(self, t=self.t.at[0].set(s.t), y=self.y.at[0].set(s.phi[0]),
                                   yp=self.yp.at[0].set(yp0))

    def record(self, s: State, passed) -> "StepRecorder":
        i = jnp.minimum(self.count, self.t.shape[0] - 2)
        new = _write_step(self, i + 1, i, s, passed)
        if self.h_step.shape[0]:
            h, k = _write_slot((self.h_step, self.k_step), i, (s.h_used, s.k_used), passed)
            new = dataclasses.replace(new, h_step=h, k_step=k)
        return dataclasses.replace(new, count=self.count + passed.astype(jnp.int32))

    def overflowed(self):
        return self.count > self.t.shape[0] - 1

    def stage(self, limit: int) -> "StepRecorder | None":
        """An empty recorder of this layout, recorded in the step loop (`per_step`), for
        as many steps as keep each of its arrays within `limit` bytes; None where fewer
        than two steps fit. Its node 0 is not written: `append` copies its steps into
        this recorder. A step loop that carried this recorder instead would run on XLA's
        thread pool once an array passed `LOOP_BYTES` (see `integrate`); the small one
        keeps it sequential, and the copy runs once per `stage` steps."""
        item, n = self.y.dtype.itemsize, self.y.shape[1]
        # Node arrays have a row more than the per-step ones.
        steps = limit // max(n * item, 1) - 1
        if not self.hermite:
            steps = min(steps, limit // (NPHI * n * item))
        if steps < 2:
            return None
        return StepRecorder.create(steps, n, self.y.dtype, hermite=self.hermite,
                                   per_step=True, log=self.h_step.shape[0] > 0)

    def append(self, stage: "StepRecorder") -> "StepRecorder":
        """These steps, then those `stage` (from `stage()`) recorded: the rows `record`
        would have written for them, one scatter per array. Steps past the capacity are
        dropped, not written over the last row as `record` does: either way
        `overflowed()` reports them, and a replay that overflowed has failed."""
        j = jnp.arange(stage.t.shape[0] - 1)
        rows = self.t.shape[0]
        # Row `rows` is out of bounds: the stage's unused rows are not written.
        history = where(j < stage.count, self.count + j, rows)

        def put(b, v, at):
            return b.at[at].set(v, mode="drop")

        new = dataclasses.replace(self, t=put(self.t, stage.t[1:], history + 1),
                                  y=put(self.y, stage.y[1:], history + 1),
                                  yp=put(self.yp, stage.yp[1:], history + 1),
                                  count=self.count + stage.count)
        if not self.hermite:
            new = dataclasses.replace(new, phi=put(self.phi, stage.phi, history),
                                      psi=put(self.psi, stage.psi, history),
                                      k_used=put(self.k_used, stage.k_used, history))
        if self.h_step.shape[0]:
            new = dataclasses.replace(new, h_step=put(self.h_step, stage.h_step, history),
                                      k_step=put(self.k_step, stage.k_step, history))
        return new

    def due(self, s: State, passed) -> Bool[Array, ""]:
        return passed

    def evaluate(self, t):
        """y(t), y'(t) on the step [t_{i-1}, t_i] that contains t."""
        i = jnp.clip(jnp.searchsorted(self.t, t), 1, jnp.maximum(self.count, 1))
        if not self.hermite:
            c, d = interpolation_weights(t, self.t[i], self.psi[i - 1], self.k_used[i - 1])
            return interpolate(self.phi[i - 1], c, d)
        return hermite(t, self.t[i - 1], self.t[i], self.y[i - 1], self.y[i],
                       self.yp[i - 1], self.yp[i])


def _write_step(rec, node_row, history_row, s: State, passed):
    """Write the node after an accepted step (t, y, y' of the BDF interpolant) into row
    `node_row` of a step buffer (`StepRecorder`, `SegmentRecorder`) and, for
    `hermite=False`, the step's history (φ, ψ, k) into `history_row`: one row write per
    array, which XLA does in place inside the step loop."""
    y, yp = StepRecorder._node(s)
    t, y, yp = _write_slot((rec.t, rec.y, rec.yp), node_row, (s.t, y, yp), passed)
    new = dataclasses.replace(rec, t=t, y=y, yp=yp)
    if not rec.hermite:
        phi, psi, k = _write_slot((rec.phi, rec.psi, rec.k_used), history_row,
                                  (s.phi, s.psi, s.k_used), passed)
        new = dataclasses.replace(new, phi=phi, psi=psi, k_used=k)
    return new


def segment_capacity(every: int) -> int:
    """Step slots of a segment buffer for checkpoints `every` steps apart. A replay
    repeats the original steps bit for bit, so a segment has at most `every`; the
    margin is a guard (a replay that overflowed would report the adjoint as failed)."""
    return every + 8


class SegmentRecorder(eqx.Module):
    """The steps of the checkpoint segment in progress, kept by the recording forward
    run: at the end they are the last segment, the first one the backward pass needs,
    which then starts without replaying it (IDAS keeps the last check-point interval's
    data the same way). Segment c holds steps cN+1 … (c+1)N, N = `every`, and starts at
    node cN (checkpoint c).

    A ring of N + 1 rows: the node after step m (as `StepRecorder` records it) goes to
    row m mod (N + 1), one row write per step and never a read of another row, so XLA
    updates the ring in place inside the step loop (writing a segment's node 0 into the
    step buffer's row 0 as well cost two whole copies of the buffer per step).
    `buffer()` unrolls it into the `StepRecorder` the backward pass reads."""

    every: int = eqx.field(static=True)
    hermite: bool = eqx.field(static=True)
    t: Float[Array, " N+1"]
    y: Float[Array, "N+1 n"]
    yp: Float[Array, "N+1 n"]
    phi: Float[Array, "N+1 6 n"]       # the BDF history of the step ending at the node
    psi: Float[Array, "N+1 6"]         # (`hermite=False` only; else no rows)
    k_used: Int[Array, " N+1"]
    steps: Int[Array, ""]              # accepted steps so far

    per_step = True

    @classmethod
    def create(cls, state: State, yp0, every: int, hermite: bool):
        n, dtype = state.phi.shape[1], state.phi.dtype
        rows, rows_h = every + 1, 0 if hermite else every + 1
        return cls(every=every, hermite=hermite,
                   t=jnp.full((rows,), jnp.inf, dtype).at[0].set(state.t),
                   y=jnp.zeros((rows, n), dtype).at[0].set(state.phi[0]),
                   yp=jnp.zeros((rows, n), dtype).at[0].set(yp0),
                   phi=jnp.zeros((rows_h, NPHI, n), dtype), psi=jnp.ones((rows_h, NPHI), dtype),
                   k_used=jnp.ones((rows_h,), jnp.int32), steps=jnp.zeros((), jnp.int32))

    @staticmethod
    def pays(state: State) -> bool:
        """Whether keeping the segment is cheaper than replaying it. Writing the ring in
        the step loop puts that loop on XLA's thread pool (see `integrate`) unless the
        step state alone already does (its history φ over ~512 bytes, n ≥ 11 in float64):
        on Robertson (n = 3) the kept segment cost the recording forward run more than
        the replay it saved."""
        phi = state.phi
        return phi.size * phi.dtype.itemsize > LOOP_BYTES

    @property
    def index(self) -> Int[Array, ""]:
        """The segment the ring ends in (−1 before the first step)."""
        return where(self.steps > 0, (self.steps - 1) // self.every, -1)

    def record(self, s: State, passed) -> "SegmentRecorder":
        row = s.stats["num_steps"] % (self.every + 1)      # counts this step if it passed
        new = _write_step(self, row, row, s, passed)
        return dataclasses.replace(new, steps=self.steps + passed.astype(jnp.int32))

    def buffer(self, like: StepRecorder) -> StepRecorder:
        """The last segment as a `StepRecorder` shaped as `like` (node j = step start +
        j; the BDF history of step j in slot j − 1)."""
        rows = self.every + 1
        start = jnp.maximum(self.index, 0) * self.every
        count = self.steps - start
        j = jnp.arange(like.t.shape[0])
        src = (start + j) % rows
        t = where(j <= count, self.t[src], jnp.inf)
        new = dataclasses.replace(like, t=t, y=self.y[src], yp=self.yp[src], count=count)
        if not self.hermite:
            new = dataclasses.replace(new, phi=self.phi[src[1:]], psi=self.psi[src[1:]],
                                      k_used=self.k_used[src[1:]])
        return new


class StepLog(eqx.Module):
    """The accepted step sequence (t_n, h_n, k_n): with the initial state it determines
    every BDF coefficient of the run, so the discrete solution map can be replayed with
    the step sequence frozen (`DiscreteAdjoint`). Capacity: max_steps."""

    t: Float[Array, " N"]
    h: Float[Array, " N"]
    k: Int[Array, " N"]
    count: Int[Array, ""]

    @classmethod
    def create(cls, capacity: int, dtype):
        return cls(t=jnp.full((capacity,), jnp.inf, dtype), h=jnp.zeros((capacity,), dtype),
                   k=jnp.ones((capacity,), jnp.int32), count=jnp.zeros((), jnp.int32))

    def record(self, s: State, passed) -> "StepLog":
        i = jnp.minimum(self.count, self.t.shape[0] - 1)
        t, h, k = _write_slot((self.t, self.h, self.k), i, (s.t, s.h_used, s.k_used), passed)
        return StepLog(t, h, k, self.count + passed.astype(jnp.int32))


class DenseRecorder(eqx.Module):
    """Every accepted step of a solve for `steps=True` / `dense=True`: the step times and
    values (t_n, y_n), and with `interpolant` also each step's (φ, ψ, k_used), from which
    `Solution.evaluate` evaluates IDAS's interpolating polynomial anywhere in [t0, t_n].
    Capacity max_steps; unreached slots are inf."""

    interpolant: bool = eqx.field(static=True)
    t: Float[Array, " N+1"]
    y: Float[Array, "N+1 n"]
    phi: Float[Array, "N 6 n"]
    psi: Float[Array, "N 6"]
    k_used: Int[Array, " N"]
    count: Int[Array, ""]

    @classmethod
    def create(cls, state: "State", capacity: int, interpolant: bool):
        n, dtype = state.phi.shape[1], state.phi.dtype
        cap_i = capacity if interpolant else 0
        t = jnp.full((capacity + 1,), jnp.inf, dtype).at[0].set(state.t)
        y = jnp.full((capacity + 1, n), jnp.inf, dtype).at[0].set(state.phi[0])
        return cls(interpolant=interpolant, t=t, y=y, phi=jnp.zeros((cap_i, NPHI, n), dtype),
                   psi=jnp.ones((cap_i, NPHI), dtype), k_used=jnp.ones((cap_i,), jnp.int32),
                   count=jnp.zeros((), jnp.int32))

    def record(self, s: "State", passed) -> "DenseRecorder":
        i = jnp.minimum(self.count, self.t.shape[0] - 2)
        t, y = _write_slot((self.t, self.y), i + 1, (s.t, s.phi[0]), passed)
        new = dataclasses.replace(self, t=t, y=y, count=self.count + passed.astype(jnp.int32))
        if self.interpolant:
            phi, psi, k = _write_slot((self.phi, self.psi, self.k_used), i,
                                      (s.phi, s.psi, s.k_used), passed)
            new = dataclasses.replace(new, phi=phi, psi=psi, k_used=k)
        return new

    def evaluate(self, t, order: int = 0):
        """y^(order)(t) by the interpolant of the step [t_{i−1}, t_i] containing t."""
        i = jnp.clip(jnp.searchsorted(self.t, t), 1, jnp.maximum(self.count, 1))
        w = derivative_weights(t, self.t[i], self.psi[i - 1], self.k_used[i - 1], order)
        return w[order] @ self.phi[i - 1]
