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

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from .._bdf import (NPHI, complete_history, derivative_weights, interpolation_weights, predict,
                    scale_history, set_coefficients)
from .._consistency import after, before, consistent_values, restart_point, split_at
from .._core import Tangents
from .._events import observations
from .._integrator import CheckpointRecorder, StepLog
from .._linalg.linear_solver import SetupWithArgs
from .._results import RESULTS, succeeded
from .tangents import _restrict


# Above this many numbers of stored linear-solver setups per segment (segment · n² for
# a dense LU) the discrete adjoint recomputes each step in its backward pass (see
# `step_body`).
STORED_FACTORS_LIMIT = 2**23


class DiscreteAdjoint(eqx.Module):
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


def discrete_backward(adjoint: DiscreteAdjoint, config, inputs, rec, ct, wanted):
    """VJP of the replayed discrete map, segment by segment from the last, for k
    cotangent directions. Returns (Tangents with a leading axis k, restricted to
    `wanted`, result)."""
    log, cks = rec.log, rec.checkpoints
    y0c, yp0c = rec.y0, rec.yp0
    t0, a = inputs.t0, inputs.algebraic
    # Output rows and event roots as point observations, sorted by time.
    ts, yd_bar, qbar, p_events = observations(config, inputs, rec, ct)
    k_dir = yd_bar.shape[0]
    order = yd_bar.shape[2] - 1
    dtype = y0c.dtype
    n = y0c.shape[0]
    nq = qbar.shape[2]
    N = adjoint.segment
    solver = config.linear_solver
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

    solver = SetupWithArgs(solver, config.residual, full_args)

    def Q(t, y, yp, p):
        if config.quadrature is None:
            return jnp.zeros((0,), dtype)
        return jnp.asarray(config.quadrature(t, y, yp, eqx.combine(unravel(p), pst)), dtype)

    count = log.count
    # A failed forward run is skipped (its derivatives are reported NaN by the caller).
    n_seg = jnp.where(succeeded(rec.result), (count + N - 1) // N, 0)
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

    def restart(carry, t_b, h, p):
        """The forward run's restart at a breakpoint t_b (`restart_at_breakpoint`): y, y'
        of the last step's interpolant made consistent at t_b⁺ (`restart_point`), the
        histories [y, h y'] with h the first step's size."""
        phi, phiq, (psi, k_used, _, _) = carry
        c, d = interpolation_weights(t_b, t_b, psi, k_used)
        y, yp = jnp.tensordot(c, phi, 1), jnp.tensordot(d, phi, 1)
        args = (p, pst_arrays)
        split = split_at(config.auto_split, F, t_b, y, yp, args, a)
        y, yp = restart_point(F, solver, split, t_b, y, yp, args)

        def fresh(value, slope):
            return jnp.zeros((NPHI,) + value.shape, dtype).at[0].set(value).at[1].set(h * slope)

        control = (jnp.zeros((NPHI,), dtype).at[0].set(h), jnp.zeros((), jnp.int32),
                   jnp.zeros((), dtype), jnp.zeros((), jnp.int32))
        return fresh(y, yp), fresh(phiq[0], Q(after(t_b), y, yp, p)), control

    def one_step(carry, xs, p):
        t_new, h, k, valid, t_prev, restarted = xs
        if bps is not None:
            carry = jax.lax.cond(restarted, lambda: restart(carry, t_prev, h, p), lambda: carry)
        # Past the last recorded step the replay computes a dummy step that the `where`
        # below discards. Its inputs are cut from the gradient, so that a dummy step that
        # diverges (NaN) cannot poison the gradient through the discarded branch
        # (0 · NaN = NaN).
        sg = jax.lax.stop_gradient
        picked, p = jax.tree_util.tree_map(lambda a: jnp.where(valid, a, sg(a)), (carry, p))
        phi, phiq, control = picked
        psi, k_used, h_used, ns = control
        t_new = jnp.where(valid, t_new, h_used * 0)
        h = jnp.where(valid, h, 1.0)
        co = jax.lax.stop_gradient(set_coefficients(psi, h, k, k_used, h_used, ns, dtype))
        phi_s = scale_history(phi, co["beta"], co["ns"], k)
        phiq_s = scale_history(phiq, co["beta"], co["ns"], k)
        y_pred, yp_pred = predict(phi_s, co["gamma"], k)
        # The forward step's evaluation time (`_integrator.evaluation_time`).
        t_eval = t_new if bps is None else jnp.where(jnp.any(bps == t_new), before(t_new), t_new)
        e = _corrector(solver, F, t_eval, y_pred, yp_pred, co["cj"], (p, pst_arrays), adjoint.newton_iters)
        y, yp = y_pred + e, yp_pred + co["cj"] * e
        _, ypq_pred = predict(phiq_s, co["gamma"], k)
        eq = (Q(t_eval, y, yp, p) - ypq_pred) / co["cj"]
        new = (complete_history(phi_s, e, k), complete_history(phiq_s, eq, k),
               (co["psi"], k, h, co["ns"]))
        new = jax.tree_util.tree_map(lambda x, y_: jnp.where(valid, x, y_), new, carry)
        return new, (new[0], new[1], new[2][0], new[2][1])

    def step_body(body):
        # `jax.vjp` of the segment keeps every step's residuals, the linear solver's
        # setup (a dense LU: n² numbers) among them. Where N of those would pass 2²³
        # numbers (64 MiB in float64) each step is recomputed in the backward pass
        # instead, leaving O(N·n): on a 350-unknown DAE with N = 50 (dense LU) the
        # temporaries went from 88 to 42 MiB and the gradient took 20 % longer; below
        # the threshold keeping them is the faster way.
        setup = jax.eval_shape(lambda: solver.setup(F, t0, y0c, yp0c, jnp.ones((), dtype),
                                                    (p_flat, pst_arrays)))
        stored = sum(x.size for x in jax.tree_util.tree_leaves(setup))
        return jax.checkpoint(body) if N * stored > STORED_FACTORS_LIMIT else body

    def segment(c, phi, phiq, control, p):
        """Steps cN … cN+N−1 from (φ, φ_Q) with the step data frozen; returns the end
        history and this segment's contribution to every output row (others zero)."""
        start = c * N
        idx = start + jnp.arange(N)
        t_prev = jax.lax.dynamic_slice(prev_t, (start,), (N,))
        xs = (jax.lax.dynamic_slice(log_t, (start,), (N,)),
              jax.lax.dynamic_slice(log_h, (start,), (N,)),
              jax.lax.dynamic_slice(log_k, (start,), (N,)), idx < count, t_prev,
              jax.lax.dynamic_slice(restarts, (start,), (N,)))
        (phi, phiq, _), (phis, phiqs, psis, ks) = jax.lax.scan(
            step_body(lambda cr, x: one_step(cr, x, p)), (phi, phiq, control), xs)
        local = jnp.clip(step_of - start, 0, N - 1)
        here = (step_of >= start) & (step_of < start + N)

        def output(tau, j, m):
            w = derivative_weights(tau, log_t[m], psis[j], ks[j], order)
            return w @ phis[j], w[0] @ phiqs[j]

        yd, qs = jax.vmap(output)(ts, local, step_of)
        return phi, phiq, (jnp.where(here[:, None, None], yd, 0.0),
                           jnp.where(here[:, None], qs, 0.0))

    def initial(y0_, yp0_, p):
        """The history before the first step, with the step size it was taken with."""
        h1 = log.h[0]
        phi = jnp.zeros((NPHI, n), dtype).at[0].set(y0_).at[1].set(h1 * yp0_)
        phiq = jnp.zeros((NPHI, nq), dtype).at[1].set(h1 * Q(t0, y0_, yp0_, p))
        control = (jnp.zeros((NPHI,), dtype).at[0].set(h1), jnp.zeros((), jnp.int32),
                   jnp.zeros((), dtype), jnp.zeros((), jnp.int32))
        return phi, phiq, control

    def start_of(c):
        ck = jax.tree_util.tree_map(lambda x: x[c], cks.states)
        return ck.phi, ck.phiq, (ck.psi, ck.k_used, ck.h_used, ck.ns)

    def backward_body(carry):
        c, phi_bar, phiq_bar, p_bar = carry
        phi, phiq, control = start_of(c)
        # The first segment starts from the initial values (differentiated below).
        init = initial(y0c, yp0c, p_flat)
        phi, phiq, control = jax.tree_util.tree_map(
            lambda x, y: jnp.where(c == 0, x, y), init, (phi, phiq, control))
        _, vjp = jax.vjp(lambda f, fq, p: segment(c, f, fq, control, p), phi, phiq, p_flat)
        f_bar, fq_bar, pb = jax.vmap(vjp)((phi_bar, phiq_bar, (yd_bar, qbar)))
        return c - 1, f_bar, fq_bar, p_bar + pb

    zero = (n_seg - 1, jnp.zeros((k_dir, NPHI, n), dtype), jnp.zeros((k_dir, NPHI, nq), dtype),
            jnp.zeros((k_dir,) + p_flat.shape, dtype))
    _, phi_bar, phiq_bar, p_bar = jax.lax.while_loop(lambda cr: cr[0] >= 0, backward_body, zero)

    # Through the initial history to the user's y0, yp0 and args (consistent
    # initialization differentiated by the implicit function theorem).
    def from_inputs(y0_, yp0_, p):
        inp = dataclasses.replace(inputs, y0=y0_, yp0=yp0_, args=eqx.combine(unravel(p), pst))
        y0v, yp0v, _, _ = consistent_values(config, inp)
        phi, phiq, _ = initial(y0v, yp0v, p)
        return phi, phiq

    _, vjp0 = jax.vjp(from_inputs, inputs.y0, inputs.yp0, p_flat)
    ybar0, ypbar0, pb0 = jax.vmap(vjp0)((phi_bar, phiq_bar))
    p_bar = p_bar + pb0
    # The init semantics of DESIGN.md §1: what the initialization recomputes (or, with
    # init=None, what consistency determines) gets zero cotangent.
    split = split_at(config.auto_split, config.residual, t0, y0c, yp0c, inputs.args, a)
    if config.init == "y":
        ybar0 = jnp.zeros_like(ybar0)
    else:
        ybar0 = split.diff_t(ybar0)
        ypbar0 = jnp.zeros_like(ypbar0)
    # The start time as for the continuous adjoint.
    t0bar = -(split.diff_t(ybar0) @ yp0c)
    if config.quadrature is not None:
        t0bar = t0bar - jnp.sum(qbar, axis=1) @ config.quadrature(t0, y0c, yp0c, inputs.args)
    args_bar = jax.vmap(unravel)(p_bar)
    if p_events is not None:
        args_bar = jax.tree_util.tree_map(jnp.add, args_bar, p_events)
    out = Tangents(t0=t0bar, y0=ybar0, yp0=ypbar0, args=args_bar)
    return _restrict(out, wanted), RESULTS.successful
