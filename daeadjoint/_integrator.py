"""The IDAS time-stepping loop: one `lax.while_loop`, one step attempt per iteration.

An attempt (seed 002 §6.2.2):
 1. coefficients for (h, k) and the predictor from the divided differences φ;
 2. modified Newton for the corrector (`_newton.py`);
 3. quadratures corrected explicitly from the converged y, y' (§6.2.5);
 4. local error test (6.9) with the order-lowering estimates at k−1, k−2;
 5. accept: update φ, choose the next order and step (IDAS `IDACompleteStep`), write the
    outputs that now lie inside [t_{n−1}, t_n] by the interpolating polynomial;
    reject: keep φ, cut h and perhaps k (IDAS `IDAHandleNFlag`), give up with a status
    after 10 failures of one kind in a step.

The carried state has a fixed shape, so the whole solve is one compiled loop that
`jax.vmap` batches (members that finish early are held by the loop's `select`).
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import equinox.internal as eqxi
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from ._bdf import (MAXORD, NPHI, complete_history, error_weights, interpolate,
                   interpolation_weights, predict, scale_history, set_coefficients, wrms)
from ._newton import FAIL_NONFINITE, FAIL_SINGULAR, newton_solve, tree_where
from ._results import RESULTS

MAX_ERROR_TEST_FAILS = 10   # IDAS maxnef
MAX_CONV_FAILS = 10         # IDAS maxncf
ETA_MIN_EF = 0.25           # h cut after the second error-test failure
ETA_LOW = 0.9
ETA_MIN = 0.5
ETA_CF = 0.25               # h cut after a Newton convergence failure

STAT_NAMES = (
    "num_steps", "num_residual_evals", "num_jacobian_evals", "num_nonlinear_iters",
    "num_error_test_failures", "num_nonlinear_convergence_failures",
    "num_quadrature_evals",
)


class Problem(eqx.Module):
    """Everything fixed during one integration (closed over by the loop, not carried)."""

    residual: Callable = eqx.field(static=True)
    quadrature: Callable | None = eqx.field(static=True)
    linear_solver: Any
    args: Any
    rtol: Array
    atol: Array            # (n,)
    error_mask: Array      # (n,) 1.0 where a component enters the local error test
    quad_rtol: Array
    quad_atol: Array       # (nq,)
    quad_error_control: bool = eqx.field(static=True)
    tstop: Array           # +inf when stepping past t1 is allowed
    # The adjoint is linear: its Newton convergence rate is re-estimated on every step
    # instead of trusting the previous step's (seed 000 §5.5).
    reset_newton_rate: bool = eqx.field(static=True, default=False)

    def quad(self, t, y, yp):
        if self.quadrature is None:
            return jnp.zeros((0,), y.dtype)
        return jnp.asarray(self.quadrature(t, y, yp, self.args), dtype=y.dtype)


class State(eqx.Module):
    """Fixed-size integrator state: IDAS's history arrays, scalars and counters."""

    t: Float[Array, ""]
    h: Float[Array, ""]          # step size to attempt next
    h_used: Float[Array, ""]
    k: Int[Array, ""]            # order to attempt next
    k_used: Int[Array, ""]
    ns: Int[Array, ""]
    phase: Int[Array, ""]        # 0 during the initial order-raising phase
    phi: Float[Array, "6 n"]
    phiq: Float[Array, "6 nq"]
    psi: Float[Array, "6"]
    cj: Float[Array, ""]
    cj_old: Float[Array, ""]     # cj at the last Jacobian setup
    ss: Float[Array, ""]         # Newton convergence-rate factor S
    lin_state: Any
    jac_point: tuple             # (t, y, yp) where lin_state was built (hot restarts)
    nef: Int[Array, ""]          # error-test failures in the current step
    ncf: Int[Array, ""]          # convergence failures in the current step
    stats: dict
    result: Any

    @property
    def y(self):
        return self.phi[0]


def initial_step(problem: Problem, t0, y0, yp0, qp0, t_out) -> Float[Array, ""]:
    """IDAS initial step: h = 0.001 |t_out − t0|, reduced so that ‖h y'0‖ ≤ 1/2."""
    h = 0.001 * jnp.abs(t_out - t0)
    ewt = error_weights(y0, problem.rtol, problem.atol) * problem.error_mask
    ypnorm = wrms(yp0, ewt)
    if problem.quad_error_control and qp0.shape[0] > 0:
        ypnorm = jnp.maximum(ypnorm, wrms(qp0, 1.0 / problem.quad_atol))
    h = jnp.where(ypnorm > 0.5 / h, 0.5 / ypnorm, h)
    # Resolvable at t0: a step below the spacing of floating-point numbers at |t0| would
    # not advance t (matters when t0 is large, as for an adjoint started at T = 4e10).
    h = jnp.maximum(h, 10.0 * jnp.finfo(h.dtype).eps * jnp.abs(t0))
    return clamp_to_tstop(problem, t0, h)


def clamp_to_tstop(problem, t, h):
    uround = jnp.finfo(h.dtype).eps
    return jnp.where(t + h > problem.tstop, (problem.tstop - t) * (1 - 4 * uround), h)


def initial_state(problem: Problem, t0, y0, yp0, h0) -> State:
    dtype = y0.dtype
    n = y0.shape[0]
    qp0 = problem.quad(t0, y0, yp0)
    nq = qp0.shape[0]
    phi = jnp.zeros((NPHI, n), dtype).at[0].set(y0).at[1].set(h0 * yp0)
    phiq = jnp.zeros((NPHI, nq), dtype).at[1].set(h0 * qp0)
    lin_shape = jax.eval_shape(
        lambda: problem.linear_solver.setup(problem.residual, t0, y0, yp0, 1 / h0, problem.args))
    lin_state = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), lin_shape)
    izero = jnp.zeros((), jnp.int32)
    stats = {name: izero for name in STAT_NAMES}
    stats["num_quadrature_evals"] = jnp.asarray(int(nq > 0), jnp.int32)
    return State(
        t=jnp.asarray(t0, dtype), h=h0, h_used=jnp.zeros((), dtype), k=izero + 1,
        k_used=izero, ns=izero, phase=izero, phi=phi, phiq=phiq,
        psi=jnp.zeros((NPHI,), dtype).at[0].set(h0), cj=1 / h0, cj_old=1 / h0,
        ss=jnp.asarray(20.0, dtype), lin_state=lin_state,
        jac_point=(jnp.asarray(t0, dtype), y0, yp0), nef=izero, ncf=izero,
        stats=stats, result=RESULTS.successful,
    )


def _at(v, i):
    return v[jnp.clip(i, 0, v.shape[0] - 1)]


def attempt_step(problem: Problem, s: State) -> tuple[State, Bool[Array, ""]]:
    """One step attempt from s.t with (s.h, s.k). Returns the new state and whether the
    step was accepted. See the module docstring for the sequence."""
    dtype = s.phi.dtype
    uround = jnp.finfo(dtype).eps
    k = s.k
    h = clamp_to_tstop(problem, s.t, s.h)
    co = set_coefficients(s.psi, h, k, s.k_used, s.h_used, s.ns, dtype)
    phi = scale_history(s.phi, co["beta"], co["ns"], k)
    phiq = scale_history(s.phiq, co["beta"], co["ns"], k)
    t_new = s.t + h
    cj = co["cj"]

    # Error weights from y_{n-1} (IDAS recomputes them after every accepted step).
    ewt = error_weights(s.phi[0], problem.rtol, problem.atol)
    ewt_err = ewt * problem.error_mask
    ewtq = error_weights(s.phiq[0], problem.quad_rtol, problem.quad_atol)
    too_accurate = uround * wrms(s.phi[0], ewt) > 1.0

    def err_norm(v, vq):
        nrm = wrms(v, ewt_err)
        if problem.quad_error_control and vq.shape[0] > 0:
            nrm = jnp.maximum(nrm, wrms(vq, ewtq))
        return nrm

    # --- Newton ---------------------------------------------------------------------
    first = s.stats["num_steps"] == 0
    cj_old = jnp.where(first, cj, s.cj_old)
    ss = jnp.where(first, 20.0, s.ss)
    ratio = cj / cj_old
    setup = first | (ratio < 0.6) | (ratio > 1.0 / 0.6)
    ss = jnp.where(cj != s.cj, 100.0, ss)
    if problem.reset_newton_rate:
        ss = jnp.full_like(ss, 100.0)
    y_pred, yp_pred = predict(phi, co["gamma"], k)
    nw = newton_solve(problem.residual, problem.args, problem.linear_solver, t_new, y_pred,
                      yp_pred, cj, ewt, s.lin_state, s.jac_point, cj_old, ss, setup)
    ee = nw.ee
    y = y_pred + ee
    yp = yp_pred + cj * ee

    # --- quadratures: explicit correction eeQ = (q(t, y, y') − yQ'_(0))/cj -----------
    yq_pred, ypq_pred = predict(phiq, co["gamma"], k)
    eeq = (problem.quad(t_new, y, yp) - ypq_pred) / cj

    # --- local error test (6.9) and the order-lowering estimates ------------------
    sigma = co["sigma"]
    enorm_k = err_norm(ee, eeq)
    err_k = _at(sigma, k) * enorm_k
    terr_k = (k + 1) * err_k
    d1, d1q = _at(phi, k) + ee, _at(phiq, k) + eeq
    err_km1 = _at(sigma, k - 1) * err_norm(d1, d1q)
    terr_km1 = k * err_km1
    d2, d2q = d1 + _at(phi, k - 1), d1q + _at(phiq, k - 1)
    err_km2 = _at(sigma, k - 2) * err_norm(d2, d2q)
    terr_km2 = (k - 1) * err_km2
    lower = jnp.where(k > 2, jnp.maximum(terr_km1, terr_km2) <= terr_k,
                      (k == 2) & (terr_km1 <= 0.5 * terr_k))
    knew = jnp.where(lower, k - 1, k)
    passed = nw.converged & (co["ck"] * enorm_k <= 1.0)

    # --- accepted: IDACompleteStep ---------------------------------------------------
    nst = s.stats["num_steps"] + 1
    kdiff = k - s.k_used
    phase = jnp.where((knew == k - 1) | (k == MAXORD), 1, s.phase)
    err_kp1 = err_norm(ee - _at(phi, k + 1), eeq - _at(phiq, k + 1)) / (k + 2)
    terr_kp1 = (k + 2) * err_kp1
    hold = (k == MAXORD) | (k + 1 >= co["ns"]) | (kdiff == 1)
    act_lower = (knew == k - 1) | (~hold & (k > 1) & (terr_km1 <= jnp.minimum(terr_k, terr_kp1)))
    act_raise = ~act_lower & ~hold & jnp.where(k == 1, terr_kp1 < 0.5 * terr_k,
                                              terr_kp1 < terr_k)
    k_sel = k + act_raise.astype(k.dtype) - act_lower.astype(k.dtype)
    err_knew = jnp.where(act_raise, err_kp1, jnp.where(act_lower, err_km1, err_k))
    rr = (2.0 * err_knew + 1e-4) ** (-1.0 / (k_sel + 1))
    h_sel = jnp.where(rr >= 2.0, 2.0 * h, jnp.where(rr <= 1.0, h * jnp.clip(rr, ETA_MIN, ETA_LOW), h))
    in_phase0 = phase == 0
    k_acc = jnp.where(in_phase0, jnp.where(nst > 1, k + 1, k), k_sel)
    h_acc = jnp.where(in_phase0, jnp.where(nst > 1, 2.0 * h, h), h_sel)

    # --- rejected: IDAHandleNFlag ------------------------------------------------------
    conv_fail = ~nw.converged
    nef = s.nef + (~conv_fail).astype(jnp.int32)
    ncf = s.ncf + conv_fail.astype(jnp.int32)
    err_knew_f = jnp.where(knew == k, err_k, err_km1)
    eta_ef1 = jnp.clip(0.9 * (2.0 * err_knew_f + 1e-4) ** (-1.0 / (knew + 1)), ETA_MIN_EF, ETA_LOW)
    eta_fail = jnp.where(conv_fail, ETA_CF, jnp.where(nef == 1, eta_ef1, ETA_MIN_EF))
    k_fail = jnp.where(conv_fail, k, jnp.where(nef >= 3, 1, knew))
    h_fail = h * eta_fail
    # On the very first step φ_1 = h y'_0 and ψ_0 = h are rescaled with h (IDAS IDAReset).
    rescale = jnp.where(first, eta_fail, 1.0)
    phi_fail = s.phi.at[1].multiply(rescale)
    phiq_fail = s.phiq.at[1].multiply(rescale)

    # --- assemble ------------------------------------------------------------------------
    st = dict(s.stats)
    st["num_residual_evals"] = st["num_residual_evals"] + nw.num_residual_evals
    st["num_jacobian_evals"] = st["num_jacobian_evals"] + nw.num_jacobian_evals
    st["num_nonlinear_iters"] = st["num_nonlinear_iters"] + nw.num_iters
    if phiq.shape[1] > 0:
        st["num_quadrature_evals"] = st["num_quadrature_evals"] + 1
    st["num_steps"] = jnp.where(passed, nst, s.stats["num_steps"])
    st["num_error_test_failures"] = st["num_error_test_failures"] + (nw.converged & ~passed)
    st["num_nonlinear_convergence_failures"] = st["num_nonlinear_convergence_failures"] + conv_fail

    h_next = jnp.where(passed, h_acc, h_fail)
    W = RESULTS.where
    gave_up_conv = conv_fail & (ncf >= MAX_CONV_FAILS)
    conv_result = W(nw.fail_kind == FAIL_SINGULAR, RESULTS.singular_matrix,
                    W(nw.fail_kind == FAIL_NONFINITE, RESULTS.nonfinite_residual,
                      RESULTS.convergence_failures))
    result = W(gave_up_conv, conv_result,
               W(~conv_fail & ~passed & (nef >= MAX_ERROR_TEST_FAILS),
                 RESULTS.error_test_failures, RESULTS.successful))
    result = W(s.t + h_next == s.t, RESULTS.step_size_too_small, result)
    result = W(too_accurate, RESULTS.tolerance_too_small, result)

    accepted_state = State(
        t=t_new, h=h_acc, h_used=h, k=k_acc, k_used=k, ns=co["ns"], phase=phase,
        phi=complete_history(phi, ee, k), phiq=complete_history(phiq, eeq, k),
        psi=co["psi"], cj=cj, cj_old=nw.cj_old, ss=nw.ss, lin_state=nw.lin_state,
        jac_point=nw.jac_point, nef=jnp.zeros_like(nef), ncf=jnp.zeros_like(ncf), stats=st, result=result,
    )
    rejected_state = State(
        t=s.t, h=h_fail, h_used=s.h_used, k=k_fail, k_used=s.k_used, ns=co["ns"],
        phase=jnp.ones_like(phase), phi=phi_fail, phiq=phiq_fail,
        psi=jnp.where(first, s.psi.at[0].set(h_fail), s.psi), cj=cj,
        cj_old=nw.cj_old, ss=nw.ss, lin_state=nw.lin_state, jac_point=nw.jac_point,
        nef=jnp.where(conv_fail, s.nef, nef),
        ncf=ncf, stats=st, result=result,
    )
    # Both outcomes share the Newton's factorization: select everything else, not the
    # (n×n) factors.
    strip = strip_linear_state
    new = tree_where(passed, strip(accepted_state), strip(rejected_state))
    return dataclasses.replace(new, lin_state=nw.lin_state), passed


class Outputs(eqx.Module):
    """Dense output at the requested times, filled as the steps pass them."""

    ts: Float[Array, " n_save"]
    ys: Float[Array, "n_save n"]
    yps: Float[Array, "n_save n"]
    qs: Float[Array, "n_save nq"]
    index: Int[Array, ""]         # next row to fill


def troundoff(s: State):
    uround = jnp.finfo(s.phi.dtype).eps
    return 100.0 * uround * (jnp.abs(s.t) + jnp.abs(s.h))


def write_outputs(s: State, out: Outputs) -> Outputs:
    """Fill every output row with t_out ≤ t_n (+ roundoff) by IDAS's interpolant."""
    n_save = out.ts.shape[0]
    if n_save == 0:
        return out
    limit = s.t + troundoff(s)

    def cond(o):
        return (o.index < n_save) & (o.ts[jnp.minimum(o.index, n_save - 1)] <= limit)

    def body(o):
        i = o.index
        c, d = interpolation_weights(o.ts[i], s.t, s.psi, s.k_used)
        y, yp = interpolate(s.phi, c, d)
        q, _ = interpolate(s.phiq, c, d)
        return Outputs(ts=o.ts, ys=o.ys.at[i].set(y), yps=o.yps.at[i].set(yp),
                       qs=o.qs.at[i].set(q), index=i + 1)

    return jax.lax.while_loop(cond, body, out)


def integrate(problem: Problem, state: State, outputs: Outputs, t_end, max_steps: int,
              recorders: tuple = ()):
    """Step from `state` until t_end is reached (or passed, unless tstop forbids it),
    writing outputs on the way and passing every accepted step to each recorder
    (checkpoints, step buffers). Returns the final state, outputs and recorders."""

    def cond(carry):
        s, _, _ = carry
        not_done = (t_end - s.t) > troundoff(s)
        return not_done & (s.result == RESULTS.successful)

    def body(carry):
        s, out, recs = carry
        s, passed = attempt_step(problem, s)
        out = jax.lax.cond(eqxi.unvmap_any(passed), lambda: write_outputs(s, out), lambda: out)
        recs = tuple(r.record(s, passed) for r in recs)
        hit_max = passed & (s.stats["num_steps"] >= max_steps) & ((t_end - s.t) > troundoff(s))
        result = RESULTS.where(hit_max & (s.result == RESULTS.successful),
                               RESULTS.max_steps_reached, s.result)
        s = eqx.tree_at(lambda z: z.result, s, result)
        return s, out, recs

    return jax.lax.while_loop(cond, body, (state, outputs, tuple(recorders)))


def _write_slot(buffer, i, value, do):
    return jax.tree_util.tree_map(
        lambda b, v: b.at[i].set(jnp.where(do, v, b[i])), buffer, value)


def strip_linear_state(s: State) -> State:
    """The state without its factorization (rebuilt from `jac_point` on restart)."""
    return dataclasses.replace(s, lin_state=())


def restore_linear_state(problem: Problem, s: State) -> State:
    """Rebuild the factorization at the stored setup point with the stored cj_old:
    the restarted integration then repeats the original steps."""
    t, y, yp = s.jac_point
    lin = problem.linear_solver.setup(problem.residual, t, y, yp, s.cj_old, problem.args)
    return dataclasses.replace(s, lin_state=lin)


class CheckpointRecorder(eqx.Module):
    """Hot-restart checkpoints: the full BDF state (less the LU factors) at steps
    0, N, 2N, ... (seed 002 §6.2.7.3). Capacity is fixed: ceil(max_steps/N) + 1."""

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

    def record(self, s: State, passed) -> "CheckpointRecorder":
        do = passed & (s.stats["num_steps"] % self.every == 0)
        i = jnp.minimum(self.count, jax.tree_util.tree_leaves(self.states)[0].shape[0] - 1)
        states = _write_slot(self.states, i, strip_linear_state(s), do)
        return CheckpointRecorder(self.every, states, self.count + do.astype(jnp.int32))


class StepRecorder(eqx.Module):
    """Every accepted step of one segment, to evaluate the forward solution anywhere in
    it during the backward pass (for the adjoint's F_y, F_y' and F_p):

    - nodes (t_n, y_n, y'_n), n = 0 (the segment start) … count, for piecewise cubic
      Hermite interpolation — C¹ across steps, so the adjoint's coefficients
      F_y(t, y(t), y'(t)) have no jumps at forward step boundaries;
    - (φ, ψ, k_used) of each step, for the BDF interpolating polynomial — exactly the
      forward dense output, but its y' jumps at step boundaries.
    """

    hermite: bool = eqx.field(static=True)
    t: Float[Array, " N+1"]
    y: Float[Array, "N+1 n"]
    yp: Float[Array, "N+1 n"]
    phi: Float[Array, "N 6 n"]
    psi: Float[Array, "N 6"]
    k_used: Int[Array, " N"]
    count: Int[Array, ""]

    @classmethod
    def create(cls, capacity: int, n: int, dtype, hermite: bool = True):
        return cls(hermite=hermite, t=jnp.full((capacity + 1,), jnp.inf, dtype),
                   y=jnp.zeros((capacity + 1, n), dtype), yp=jnp.zeros((capacity + 1, n), dtype),
                   phi=jnp.zeros((capacity, NPHI, n), dtype),
                   psi=jnp.ones((capacity, NPHI), dtype),
                   k_used=jnp.ones((capacity,), jnp.int32), count=jnp.zeros((), jnp.int32))

    @staticmethod
    def _node(s: State):
        c, d = interpolation_weights(s.t, s.t, s.psi, s.k_used)
        return interpolate(s.phi, c, d)

    def start(self, s: State, yp0) -> "StepRecorder":
        """Node 0: the state the segment starts from (y'0 given: at t0 the history
        holds h·y'0, not yet a polynomial)."""
        return dataclasses.replace(self, t=self.t.at[0].set(s.t), y=self.y.at[0].set(s.phi[0]),
                                   yp=self.yp.at[0].set(yp0))

    def record(self, s: State, passed) -> "StepRecorder":
        i = jnp.minimum(self.count, self.phi.shape[0] - 1)
        y, yp = self._node(s)
        t_, y_, yp_ = _write_slot((self.t, self.y, self.yp), i + 1, (s.t, y, yp), passed)
        phi, psi, k = _write_slot((self.phi, self.psi, self.k_used), i,
                                  (s.phi, s.psi, s.k_used), passed)
        return dataclasses.replace(self, t=t_, y=y_, yp=yp_, phi=phi, psi=psi, k_used=k,
                                   count=self.count + passed.astype(jnp.int32))

    def overflowed(self):
        return self.count > self.phi.shape[0]

    def evaluate(self, t):
        """y(t), y'(t) on the step [t_{i-1}, t_i] that contains t."""
        i = jnp.clip(jnp.searchsorted(self.t, t), 1, jnp.maximum(self.count, 1))
        if not self.hermite:
            c, d = interpolation_weights(t, self.t[i], self.psi[i - 1], self.k_used[i - 1])
            return interpolate(self.phi[i - 1], c, d)
        ta, tb = self.t[i - 1], self.t[i]
        h = tb - ta
        x = (t - ta) / h
        ya, yb, ma, mb = self.y[i - 1], self.y[i], h * self.yp[i - 1], h * self.yp[i]
        h00, h10, h01, h11 = (2 * x**3 - 3 * x**2 + 1, x**3 - 2 * x**2 + x,
                              -2 * x**3 + 3 * x**2, x**3 - x**2)
        d00, d10, d01, d11 = 6 * x**2 - 6 * x, 3 * x**2 - 4 * x + 1, -6 * x**2 + 6 * x, 3 * x**2 - 2 * x
        y = h00 * ya + h10 * ma + h01 * yb + h11 * mb
        yp = (d00 * ya + d10 * ma + d01 * yb + d11 * mb) / h
        return y, yp


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
