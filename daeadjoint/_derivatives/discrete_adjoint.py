r"""Reverse-mode derivatives by the exact discrete adjoint of the recorded BDF steps.

The continuous adjoint (`Adjoint`) must stop and restart at every observation time with
a non-zero cotangent (the jump of Calver & Enright eq. (16)), so its cost grows with the
number of observations n_o. `DiscreteAdjoint` instead differentiates the *discrete*
solution map of the forward run with its step sequence frozen (step sizes h_n, orders
k_n and times t_n are constants — the correction Eberhard & Bischof prescribe, ∇h_n =
0). Observations at any times enter through the interpolation weights of the step that
contains them, so n_o only changes a gather, never the number of steps.

One step of the discrete map (replayed from the recorded h_n, k_n):

    φ* = β-scaled history;  y_(0), y'_(0) from φ*;
    e solves F(t_n, y_(0) + e, y'_(0) + cj e, p) = 0     (Newton to rounding; derivative by
                                                         the implicit function theorem)
    φ ← history update with e;   quadratures e_Q = (q(t_n, y_n, y'_n) − y'_Q(0))/cj.

Its VJP is the discrete adjoint: per step one transposed solve with J = F_y + cj F_y'
(through the configured linear solver) and one VJP of the residual.

Memory: the forward pass keeps the step sequence (three numbers per step) and a
hot-restart checkpoint every `segment` steps; the backward pass replays one segment at a
time from its checkpoint and applies that segment's VJP — O(max_steps/segment · n +
segment · n), like the continuous adjoint, once the segment's linear-solver setups
(segment · n² numbers for a dense LU) would pass `STORED_FACTORS_LIMIT` (below it the
segment's VJP keeps each step's setup rather than recompute the steps).
"""

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree
from jaxtyping import Array

from .._bdf import (NPHI, complete_history, derivative_weights, interpolation_weights, predict,
                    scale_history, set_coefficients)
from .._consistency import (after, before, consistent_values, initial_sensitivities,
                            restart_point, split_at)
from .._core import Tangents
from .._events import observations
from .._integrator import CheckpointRecorder, StepLog
from .._linalg.linear_solver import SetupWithArgs
from .._ops import where
from .._results import RESULTS, succeeded
from .reverse import AbstractAdjoint
from .tangents import _restrict, reverse_tangents_at_t0


# Above this many numbers of stored linear-solver setups per segment (segment · n² for
# a dense LU) the discrete adjoint recomputes each step in its backward pass (see
# `step_body` in `discrete_backward`).
STORED_FACTORS_LIMIT = 2**23


class DiscreteAdjoint(AbstractAdjoint):
    """Gradients by the exact discrete adjoint of the forward BDF steps (frozen step
    sequence). Use it when the loss observes the solution at many times (least squares
    on dense data): its cost does not grow with the number of observations (`solve`
    chooses it by default for more than 32 output times). Converges to the continuous
    gradient as the tolerances tighten, like the solution itself.

    **Arguments:**

    - `segment`: steps replayed and differentiated together (checkpoint spacing).
      Memory O(max_steps/segment · n + segment · n), plus the replayed steps' linear
      solver setups (segment · n² numbers for a dense LU) while those are under 2²³
      numbers (kept rather than recomputed).
    - `newton_iters`: Newton iterations (Jacobian at the predictor) of each replayed
      corrector; the replay must converge each step to rounding for the implicit-function
      derivative to be exact.
    """

    segment: int = eqx.field(static=True, default=50)
    newton_iters: int = eqx.field(static=True, default=4)

    def __check_init__(self):
        if not (isinstance(self.segment, int) and self.segment > 0):
            raise ValueError(f"DiscreteAdjoint(segment=...) must be a positive integer, got "
                             f"{self.segment!r}.")

    def recorders(self, state, yp0, max_steps: int) -> tuple:
        return (StepLog.create(max_steps, state.phi.dtype),
                CheckpointRecorder.create(state, self.segment, max_steps))

    def backward(self, config, inputs, rec, ct, wanted):
        return discrete_backward(self, config, inputs, rec, ct, wanted)


def _j_solve(solver, F, t, y, yp, cj, p, b):
    """x with J x = b, J = F_y + cj F_y' at (t, y, y'), differentiable (and
    transposable) through `jax.lax.custom_linear_solve` with the configured solver."""
    zero = jnp.zeros_like(y)

    def matvec(v):
        return jax.jvp(lambda v_: F(t, y + v_, yp + cj * v_, p), (zero,), (v,))[1]

    state = jax.lax.stop_gradient(solver.setup(F, t, y, yp, cj, p))
    op = matvec if solver.needs_operator else None
    return jax.lax.custom_linear_solve(
        matvec, b, lambda _, r: solver.solve(state, r, operator=op)[0],
        lambda _, r: solver.solve(state, r, transpose=True, operator=op)[0])


def _corrector(solver, F, t, y_pred, yp_pred, cj, p, iters):
    """e with F(t, y_(0) + e, y'_(0) + cj e, p) = 0: Newton from e = 0 with J set up at
    the predictor; the derivative by the implicit function theorem (one solve with J at
    the solution), never through the iterations. (`p` is any pytree; every array is an
    argument of the custom_jvp function, none is closed over.)"""

    @jax.custom_jvp
    def root(y_pred, yp_pred, p, t, cj):
        state = solver.setup(F, t, y_pred, yp_pred, cj, p)

        def body(_, e):
            y, yp = y_pred + e, yp_pred + cj * e
            op = None
            if solver.needs_operator:
                _, op = jax.linearize(lambda v: F(t, y + v, yp + cj * v, p), jnp.zeros_like(e))
            return e + solver.solve(state, -F(t, y, yp, p), operator=op)[0]

        return jax.lax.fori_loop(0, iters, body, jnp.zeros_like(y_pred))

    @root.defjvp
    def root_jvp(primals, tangents):
        y_pred, yp_pred, p, t, cj = primals
        e = root(y_pred, yp_pred, p, t, cj)
        y, yp = y_pred + e, yp_pred + cj * e
        _, f_dot = jax.jvp(lambda a, b, c: F(t, a, b, c), (y, yp, p), tangents[:3])
        return e, -_j_solve(solver, F, t, y, yp, cj, p, f_dot)

    return root(y_pred, yp_pred, p, t, cj)


class _Control(NamedTuple):
    """The step-size history a replayed step starts from (with φ, φ_Q)."""

    psi: Array
    k_used: Array
    h_used: Array
    ns: Array


def _fresh_control(h, dtype) -> _Control:
    """Before a first step of size h: ψ_0 = h, nothing used yet."""
    return _Control(jnp.zeros((NPHI,), dtype).at[0].set(h), jnp.zeros((), jnp.int32),
                    jnp.zeros((), dtype), jnp.zeros((), jnp.int32))


class _StepData(NamedTuple):
    """One recorded step, as the replay scans it."""

    t_new: Array         # where it ends
    h: Array
    k: Array
    valid: Array         # a recorded step (not the padding after the last)
    t_prev: Array        # where it starts
    restarted: Array     # the forward run restarted the history at t_prev


class _Replay(NamedTuple):
    """The discrete map's fixed parts: the residual F and quadrature Q as functions of
    (flat differentiable args, their non-inexact arrays), the configured linear solver
    set up through them, and what decides where the forward run evaluated and
    restarted."""

    config: Any
    F: Callable
    Q: Callable
    solver: Any
    pst_arrays: Any
    algebraic: Array
    breakpoints: Array | None
    dtype: Any
    newton_iters: int


def _restart(rp: _Replay, carry, t_b, h, p):
    """The forward run's restart at a breakpoint t_b (`restart_at_breakpoint`): y, y'
    of the last step's interpolant made consistent at t_b⁺ (`restart_point`), the
    histories [y, h y'] with h the first step's size."""
    phi, phiq, control = carry
    c, d = interpolation_weights(t_b, t_b, control.psi, control.k_used)
    y, yp = jnp.tensordot(c, phi, 1), jnp.tensordot(d, phi, 1)
    args = (p, rp.pst_arrays)
    split = split_at(rp.config.auto_split, rp.F, t_b, y, yp, args, rp.algebraic)
    y, yp = restart_point(rp.F, rp.solver, split, t_b, y, yp, args)

    def fresh(value, slope):
        return jnp.zeros((NPHI,) + value.shape, rp.dtype).at[0].set(value).at[1].set(h * slope)

    return fresh(y, yp), fresh(phiq[0], rp.Q(after(t_b), y, yp, p)), _fresh_control(h, rp.dtype)


def _replay_step(rp: _Replay, carry, xs: _StepData, p):
    """One step of the discrete map with (t_n, h_n, k_n) frozen (module docstring):
    β-scaled history, predictor, the corrector e solved to rounding (derivative by the
    implicit function theorem, `_corrector`), the quadratures' explicit correction and
    the history update. Returns the new carry and (φ, φ_Q, ψ, k) for the outputs."""
    t_new, h, k, valid = xs.t_new, xs.h, xs.k, xs.valid
    bps = rp.breakpoints
    if bps is not None:
        carry = jax.lax.cond(xs.restarted, lambda: _restart(rp, carry, xs.t_prev, h, p),
                             lambda: carry)
    # Past the last recorded step the replay computes a dummy step that the `where`
    # below discards. Its inputs are cut from the gradient, so that a dummy step that
    # diverges (NaN) cannot poison the gradient through the discarded branch
    # (0 · NaN = NaN).
    sg = jax.lax.stop_gradient
    picked, p = jax.tree_util.tree_map(lambda a: where(valid, a, sg(a)), (carry, p))
    phi, phiq, control = picked
    t_new = where(valid, t_new, control.h_used * 0)
    h = where(valid, h, 1.0)
    coef = sg(set_coefficients(control.psi, h, k, control.k_used, control.h_used, control.ns,
                               rp.dtype))
    phi_s = scale_history(phi, coef.beta, coef.ns, k)
    phiq_s = scale_history(phiq, coef.beta, coef.ns, k)
    y_pred, yp_pred = predict(phi_s, coef.gamma, k)
    # The forward step's evaluation time (`_integrator.evaluation_time`).
    t_eval = t_new if bps is None else where(jnp.any(bps == t_new), before(t_new), t_new)
    e = _corrector(rp.solver, rp.F, t_eval, y_pred, yp_pred, coef.cj, (p, rp.pst_arrays),
                   rp.newton_iters)
    y, yp = y_pred + e, yp_pred + coef.cj * e
    _, ypq_pred = predict(phiq_s, coef.gamma, k)
    eq = (rp.Q(t_eval, y, yp, p) - ypq_pred) / coef.cj
    new = (complete_history(phi_s, e, k), complete_history(phiq_s, eq, k),
           _Control(coef.psi, k, h, coef.ns))
    new = jax.tree_util.tree_map(lambda x, y_: where(valid, x, y_), new, carry)
    return new, (new[0], new[1], new[2].psi, new[2].k_used)


def _initial_history(rp: _Replay, t0, y0, yp0, h1, p):
    """The history before the first step of size h1: φ = [y0, h1 y'0], φ_Q = [0, h1 q]."""
    dtype = rp.dtype
    q = rp.Q(t0, y0, yp0, p)
    phi = jnp.zeros((NPHI,) + y0.shape, dtype).at[0].set(y0).at[1].set(h1 * yp0)
    phiq = jnp.zeros((NPHI,) + q.shape, dtype).at[1].set(h1 * q)
    return phi, phiq, _fresh_control(h1, dtype)


class Sweep(NamedTuple):
    """What every segment of the discrete reverse sweep shares: the replayed map
    (`_Replay`), the differentiated args (flat p and how to rebuild them), the point
    observations (times `ts`, cotangents ȳd (k, m, order+1, n), q̄ (k, m, nq)) and
    whether each replayed step is recomputed in the reverse pass (`jax.checkpoint`)."""

    rp: _Replay
    p_flat: Array
    unravel: Callable
    pd: Any
    pst: Any
    ts: Array
    yd_bar: Array
    qbar: Array
    recompute: bool


def sweep_setup(adjoint: DiscreteAdjoint, config, inputs, rec, ts, yd_bar, qbar) -> Sweep:
    """The discrete map of the recorded run (`rec`: its consistent y0, y'0) and the
    observations, for `discrete_segment`. Shared by `DiscreteAdjoint` and `Adjoint`'s
    fallback."""
    dtype = rec.y0.dtype
    pd, pst = eqx.partition(inputs.args, eqx.is_inexact_array)
    p_flat, unravel = ravel_pytree(pd)

    # Non-inexact arrays of args (e.g. integer tables) travel as arguments, everything
    # else non-array is closed over (custom_jvp functions may close over no tracers).
    pst_arrays, pst_static = eqx.partition(pst, eqx.is_array)

    def full_args(args):
        p, st = args
        return eqx.combine(unravel(p), st, pst_static)

    def F(t, y, yp, args):
        return config.residual(t, y, yp, full_args(args))

    def Q(t, y, yp, p):
        if config.quadrature is None:
            return jnp.zeros((0,), dtype)
        return jnp.asarray(config.quadrature(t, y, yp, eqx.combine(unravel(p), pst)), dtype)

    rp = _Replay(config=config, F=F, Q=Q,
                 solver=SetupWithArgs(config.linear_solver, config.residual, full_args),
                 pst_arrays=pst_arrays, algebraic=inputs.algebraic,
                 breakpoints=inputs.breakpoints, dtype=dtype, newton_iters=adjoint.newton_iters)
    # `jax.vjp` of a segment keeps every step's residuals, the linear solver's setup (a
    # dense LU: n² numbers) among them. Where `segment` of those would pass 2²³ numbers
    # (64 MiB in float64) each step is recomputed in the reverse pass instead, leaving
    # O(segment·n); below the threshold keeping them is the faster way.
    setup = jax.eval_shape(lambda: rp.solver.setup(F, inputs.t0, rec.y0, rec.yp0,
                                                   jnp.ones((), dtype), (p_flat, pst_arrays)))
    stored = sum(x.size for x in jax.tree_util.tree_leaves(setup))
    return Sweep(rp=rp, p_flat=p_flat, unravel=unravel, pd=pd, pst=pst, ts=ts,
                 yd_bar=yd_bar, qbar=qbar,
                 recompute=adjoint.segment * stored > STORED_FACTORS_LIMIT)


class SegmentSteps(NamedTuple):
    """One segment's recorded steps as the replay scans them (`_StepData`, fixed length
    with `valid` marking the recorded ones) and, for each observation row, the step
    whose interval (t_{m−1}, t_m] contains it: its index in the segment (`local`), its
    end time t_m (`t_end`) and whether it lies in this segment at all (`here`)."""

    xs: _StepData
    local: Array
    t_end: Array
    here: Array


def replayed_steps(sw: Sweep, buf, i, t_final) -> SegmentSteps:
    """The steps of forward segment i as an `Adjoint` replay recorded them
    (`StepRecorder` with `log=True`: nodes t_0 (the checkpoint) … t_count, step sizes
    and orders). The same steps, observation rows and restarts as the whole run's step
    log gives `DiscreteAdjoint` (`discrete_backward`): a row at t goes to the first step
    with t_m ≥ t, clipped to the run's steps."""
    L = buf.h_step.shape[0]
    count = buf.count
    j = jnp.arange(L)
    t_start, t_new = buf.t[0], buf.t[1:]
    t_prev = jnp.concatenate([t_start[None], t_new[:-1]])
    bps = sw.rp.breakpoints
    # The run's very first step never restarts (the history is fresh there anyway).
    restarted = (jnp.zeros((L,), bool) if bps is None
                 else jnp.any(t_prev[:, None] == bps[None, :], axis=1) & ((i > 0) | (j > 0)))
    xs = _StepData(t_new=t_new, h=buf.h_step, k=buf.k_step, valid=j < count, t_prev=t_prev,
                   restarted=restarted)
    ts = sw.ts
    local = jnp.clip(jnp.searchsorted(t_new, ts), 0, jnp.maximum(count - 1, 0))
    t_last = buf.t[count]
    here = ((count > 0) & ((ts > t_start) | (i == 0))
            & ((ts <= t_last) | (t_last >= t_final)))
    # A row of another segment gets a finite dummy end time: its zero cotangent times
    # interpolation weights at an unreached (inf) node would be NaN.
    return SegmentSteps(xs=xs, local=local, t_end=where(here, t_new[local], ts), here=here)


def discrete_segment(sw: Sweep, inputs, rec, steps: SegmentSteps, ck, first, h1, bars):
    """The VJP of one segment of the discrete map (its steps `steps`, started from the
    checkpoint `ck`, or from the initial history when `first`; h1: the run's first
    step) for the k cotangent directions: bars = (φ̄, φ̄_Q, p̄) at the segment's end in,
    at its start out (p̄ accumulated)."""
    rp, p_flat = sw.rp, sw.p_flat
    order = sw.yd_bar.shape[2] - 1
    phi_bar, phiq_bar, p_bar = bars
    start = (ck.phi, ck.phiq, _Control(ck.psi, ck.k_used, ck.h_used, ck.ns))
    # The first segment starts from the initial values (differentiated by
    # `initial_value_tangents`).
    init = _initial_history(rp, inputs.t0, rec.y0, rec.yp0, h1, p_flat)
    phi, phiq, control = jax.tree_util.tree_map(lambda x, y: where(first, x, y), init, start)

    def segment(phi, phiq, p):
        """The steps from (φ, φ_Q) with the step data frozen; returns the end history
        and this segment's contribution to every output row (others zero)."""
        body = lambda cr, x: _replay_step(rp, cr, x, p)  # noqa: E731
        (phi, phiq, _), (phis, phiqs, psis, ks) = jax.lax.scan(
            jax.checkpoint(body) if sw.recompute else body, (phi, phiq, control), steps.xs)

        def output(tau, j, t_end):
            w = derivative_weights(tau, t_end, psis[j], ks[j], order)
            return w @ phis[j], w[0] @ phiqs[j]

        yd, qs = jax.vmap(output)(sw.ts, steps.local, steps.t_end)
        here = steps.here
        return phi, phiq, (where(here[:, None, None], yd, 0.0),
                           where(here[:, None], qs, 0.0))

    _, vjp = jax.vjp(segment, phi, phiq, p_flat)
    f_bar, fq_bar, pb = jax.vmap(vjp)((phi_bar, phiq_bar, (sw.yd_bar, sw.qbar)))
    return f_bar, fq_bar, p_bar + pb


def zero_bars(sw: Sweep, k: int, n: int):
    """(φ̄, φ̄_Q, p̄) = 0 for k directions: the cotangents after the last step."""
    dtype = sw.rp.dtype
    return (jnp.zeros((k, NPHI, n), dtype), jnp.zeros((k, NPHI, sw.qbar.shape[2]), dtype),
            jnp.zeros((k,) + sw.p_flat.shape, dtype))


def discrete_backward(adjoint: DiscreteAdjoint, config, inputs, rec, ct, wanted):
    """VJP of the replayed discrete map, segment by segment from the last, for k
    cotangent directions; then through the consistent initialization to the inputs
    (`initial_value_tangents`). Returns (Tangents with a leading axis k, restricted to
    `wanted`, result)."""
    log, cks = rec.log, rec.checkpoints
    # Output rows and event roots as point observations, sorted by time.
    ts, yd_bar, qbar, p_events = observations(config, inputs, rec, ct)
    sw = sweep_setup(adjoint, config, inputs, rec, ts, yd_bar, qbar)
    N = adjoint.segment
    dtype = rec.y0.dtype

    count = log.count
    # A failed forward run is skipped (its derivatives are reported NaN by the caller).
    n_seg = where(succeeded(rec.result), (count + N - 1) // N, 0)
    cap = -(-log.t.shape[0] // N) * N
    pad = cap - log.t.shape[0]
    log_t = jnp.pad(log.t, (0, pad), constant_values=jnp.inf)
    log_h = jnp.pad(log.h, (0, pad), constant_values=1.0)
    log_k = jnp.pad(log.k, (0, pad), constant_values=1)
    # Each step's start time, and whether the forward run restarted the history there
    # (the step before it ended on a breakpoint of the inputs).
    prev_t = jnp.concatenate([jnp.full((1,), -jnp.inf, dtype), log_t[:-1]])
    bps = inputs.breakpoints
    restarts = (jnp.zeros(log_t.shape, bool) if bps is None
                else jnp.any(prev_t[:, None] == bps[None, :], axis=1))
    # The step whose interval (t_{m−1}, t_m] contains each output (non-differentiable data).
    step_of = jnp.clip(jnp.searchsorted(log.t, ts), 0, jnp.maximum(count - 1, 0))

    def logged_steps(c) -> SegmentSteps:
        """Steps cN … cN+N−1 of the whole run's step log."""
        start = c * N

        def window(x):
            return jax.lax.dynamic_slice(x, (start,), (N,))

        xs = _StepData(t_new=window(log_t), h=window(log_h), k=window(log_k),
                       valid=start + jnp.arange(N) < count, t_prev=window(prev_t),
                       restarted=window(restarts))
        return SegmentSteps(xs=xs, local=jnp.clip(step_of - start, 0, N - 1),
                            t_end=log_t[step_of],
                            here=(step_of >= start) & (step_of < start + N))

    def backward_body(carry):
        c, bars = carry
        ck = jax.tree_util.tree_map(lambda x: x[c], cks.states)
        return c - 1, discrete_segment(sw, inputs, rec, logged_steps(c), ck, c == 0,
                                       log.h[0], bars)

    zero = (n_seg - 1, zero_bars(sw, yd_bar.shape[0], rec.y0.shape[0]))
    _, bars = jax.lax.while_loop(lambda cr: cr[0] >= 0, backward_body, zero)
    out = initial_value_tangents(sw, inputs, rec, log.h[0], bars, p_events)
    # A failed forward record has no steps to replay (n_seg = 0 above): its zero
    # cotangents must not pass as a gradient. The plain solve's failure is flagged by the
    # caller from the primal result.
    ok, failed = RESULTS.successful, RESULTS.adjoint_failed
    # mypy types Enumeration members as str (pyproject.toml's baseline: RESULTS).
    return _restrict(out, wanted), RESULTS.where(succeeded(rec.result), ok, failed)  # type: ignore[arg-type]


def initial_value_tangents(sw: Sweep, inputs, rec, h1, bars, p_events) -> Tangents:
    """From the cotangents on the initial history bars = (φ̄, φ̄_Q, p̄) (h1: the first
    step's size) to the user's y0, yp0 and args, through the consistent initialization
    (differentiated by the implicit function theorem); then the `init` semantics of
    DESIGN.md §1 — what the initialization recomputes (or, with init=None, what
    consistency determines) gets zero cotangent — and the tail shared with the
    continuous adjoint (`reverse_tangents_at_t0`)."""
    rp, p_flat, unravel, pd, pst = sw.rp, sw.p_flat, sw.unravel, sw.pd, sw.pst
    phi_bar, phiq_bar, p_bar = bars
    w = jnp.sum(sw.qbar, axis=1)
    config, t0 = rp.config, inputs.t0
    y0c, yp0c = rec.y0, rec.yp0
    if config.index2:
        return _index2_initial_value_tangents(rp, inputs, rec, h1, phi_bar, phiq_bar, p_bar,
                                              w, p_flat, unravel, pd, pst, p_events)

    def from_inputs(y0_, yp0_, p):
        inp = dataclasses.replace(inputs, y0=y0_, yp0=yp0_, args=eqx.combine(unravel(p), pst))
        # The recorded run's consistent values, differentiated by the implicit function
        # theorem: no second initialization (a Newton loop) in the program.
        y0v, yp0v, _, _ = consistent_values(config, inp, known=(y0c, yp0c))
        phi, phiq, _ = _initial_history(rp, t0, y0v, yp0v, h1, p)
        return phi, phiq

    _, vjp0 = jax.vjp(from_inputs, inputs.y0, inputs.yp0, p_flat)
    ybar0, ypbar0, pb0 = jax.vmap(vjp0)((phi_bar, phiq_bar))
    p_bar = p_bar + pb0
    split = split_at(config.auto_split, config.residual, t0, y0c, yp0c, inputs.args,
                     inputs.algebraic)
    if config.init == "y":
        ybar0 = jnp.zeros_like(ybar0)
    else:
        ybar0 = split.diff_t(ybar0)
        ypbar0 = jnp.zeros_like(ypbar0)
    return reverse_tangents_at_t0(config, inputs, split, ybar0, y0c, yp0c, w, p_bar, unravel,
                                  pd, p_events, y0_bar=ybar0, yp0_bar=ypbar0)


def _index2_initial_value_tangents(rp: _Replay, inputs, rec, h1, phi_bar, phiq_bar, p_bar, w,
                                   p_flat, unravel, pd, pst, p_events) -> Tangents:
    """`initial_value_tangents` for a Hessenberg index-2 DAE: the cotangents on the
    initial history pulled back through the linear map (δt0, δy0, δp) ↦ (s(t0), s'(t0))
    of the consistent initial sensitivities (`_consistency.initial_sensitivities`: δy0's
    differential part moved onto the linearized constraints, the rest from the
    linearized index-reduced system) — its transpose, by `jax.vjp` of that linear map.
    y'0 and the algebraic part of y0 are determined by the rest: zero cotangent."""
    config, t0 = rp.config, inputs.t0
    y0c, yp0c = rec.y0, rec.yp0

    def history_tangent(t0d, y0d, pdot):
        tan = Tangents(t0=t0d[None], y0=y0d[None],
                       args=jax.tree_util.tree_map(lambda x: x[None], unravel(pdot)))
        s0, sp0, _, _, _ = initial_sensitivities(config, inputs, y0c, yp0c, tan, 1)
        _, (phi_dot, phiq_dot, _) = jax.jvp(
            lambda y, yp, p: _initial_history(rp, t0, y, yp, h1, p),
            (y0c, yp0c, p_flat), (s0[0], sp0[0], pdot))
        return phi_dot, phiq_dot

    zeros = (jnp.zeros_like(t0), jnp.zeros_like(y0c), jnp.zeros_like(p_flat))
    _, vjp0 = jax.vjp(history_tangent, *zeros)
    t0bar, ybar0, pb0 = jax.vmap(vjp0)((phi_bar, phiq_bar))
    # The shared tail adds the quadratures' −w·q(t0) to t̄0 (a zero state cotangent
    # makes its own trajectory-shift term vanish: that one is in t0bar already).
    split = split_at(config.auto_split, config.residual, t0, y0c, yp0c, inputs.args,
                     inputs.algebraic)
    out = reverse_tangents_at_t0(config, inputs, split, jnp.zeros_like(ybar0), y0c, yp0c, w,
                                 p_bar + pb0, unravel, pd, p_events, y0_bar=ybar0,
                                 yp0_bar=jnp.zeros_like(ybar0))
    return dataclasses.replace(out, t0=out.t0 + t0bar)
