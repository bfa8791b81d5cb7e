r"""Reverse-mode derivatives of `solve`: the continuous augmented adjoint DAE, solved
backward with checkpoint recomputation.

Mathematics (seed 000 eqs. (10)/(14), seed 001 eqs. (38), (40)–(42)). For a loss with
point terms on y(t_i), y'(t_i) and integral terms ∫_{t0}^{t_i} q dt, the Lagrangian
L − ∫ λᵀF dt is stationary in y when μ := F_y'ᵀλ − g_y'ᵀ satisfies

    dμ/dt = F_yᵀ λ − g_yᵀ,        μ − F_y'ᵀ λ + g_y'ᵀ = 0,                        (A)

with g(t, y, y') = w(t)ᵀ q(t, y, y') and w(t) = Σ_{t_i ≥ t} q̄_i (the quadrature
cotangents), integrated backward in time. Then

    dL/dp  = ∫_{t0}^{T} (w ᵀq_p − λᵀF_p) dt + Σ_i (jump terms),
    dL/dy0 = μ(t0) on the free (differential) components.

(A) is solved as an index-1 DAE in Z = (μ, λ) with s = −t by the same BDF integrator, with
error control on μ (= the "λ̄" of seed 000), on the λ_i of differential equations and on
the parameter-gradient quadrature (seed 000 §5.3, Table 2). The multipliers of algebraic
equations are left out of the test: they follow F_y(t, y(t), y'(t)) of the interpolated
forward solution algebraically, and asking the error test to resolve that interpolant's
kinks only shrinks the steps (seen on R3 at rtol 1e-9). The
Newton rate re-estimated every step because (A) is linear (§5.5). Its iteration matrix
[[cj I, F_yᵀ], [I, −F_y'ᵀ]] is solved through the *transpose* of the forward iteration
matrix J = F_y + cj F_y':  δλ = J⁻ᵀ(r₁ − cj r₂),  δμ = r₂ + F_y'ᵀ δλ  (`_AdjointLU`).

Point cotangents (ȳ_i, ȳp_i) at t_i make λ carry a Dirac mass ν δ(t − t_i) with
F_y'ᵀν = 0 on the algebraic part, giving the consistent jump (seed 003 eq. (16),
seed 000 §4.1)

    M ν = a∘ȳ + d∘ȳp,   M = diag(d) F_y'ᵀ + diag(a) F_yᵀ,
    μ(t_i⁻) = μ(t_i⁺) + ȳ − F_yᵀν,       dL/dp −= F_pᵀν,

where a (d) masks algebraic (differential) components. M is nonsingular exactly when the
DAE is index 1 with those algebraic variables, so cotangents on algebraic components are
mapped onto the differential ones through the algebraic equations. For an ODE (a = 0)
the jump is ȳ − F_yᵀF_y'^{-ᵀ}ȳp.

Only the step sequence of the forward pass is reused; step sizes and orders are never
differentiated (seed 004): what is differentiated is the continuous problem.
"""

import dataclasses
from collections.abc import Callable

import equinox as eqx
import equinox.internal as eqxi
import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from ._integrator import (Outputs, StepRecorder, initial_state, initial_step, integrate,
                          restore_linear_state)
from ._integrator import Problem
from ._linear_solver import factor, factored_is_singular, factored_solve
from ._newton import tree_where
from ._results import RESULTS


class Adjoint(eqx.Module):
    """Gradients by the continuous adjoint DAE solved backward (the default).

    **Arguments:**

    - `checkpoint_every`: steps between hot-restart checkpoints of the forward pass.
      Memory: O(max_steps / checkpoint_every) checkpoints of O(n) each, plus one segment
      buffer of O(checkpoint_every · n) in the backward pass — independent of the number
      of steps taken.
    - `interpolation`: how the backward pass evaluates the forward solution between
      steps: `"hermite"` (default; piecewise cubic Hermite on the step nodes, C¹, so the
      adjoint's coefficients are continuous) or `"bdf"` (the forward BDF polynomial, as
      the forward dense output; y' jumps at step ends by the local error, which the
      adjoint's error test on λ then has to step through).
    - `rtol`, `atol`: tolerances of the adjoint variables (μ, λ); default: the forward
      rtol and the largest forward atol. Scale `atol` to the size of your cotangents.
    - `quad_error_control`: include the parameter-gradient quadrature ∫(wᵀq_p − λᵀF_p)
      in the adjoint error test (IDAS errconQB; default True: on Robertson it makes the
      rtol-1e-6 gradient 30x more accurate for ~the same number of steps).
    - `max_steps`: adjoint steps allowed between two restarts (default: the forward one).
    """

    checkpoint_every: int = 50
    interpolation: str = "hermite"
    rtol: float | None = None
    atol: float | None = None
    quad_error_control: bool = True
    max_steps: int | None = None


class _AdjointLU(eqx.Module):
    """Linear solver of the adjoint Newton iteration via the forward matrix transposed."""

    jacobians: Callable = eqx.field(static=True)
    n: int = eqx.field(static=True)

    def setup(self, residual, s, Z, Zs, cj, aargs):
        buf, _, pd = aargs
        y, yp = buf.evaluate(-s)
        fy, fyp = self.jacobians(-s, y, yp, pd)
        return factor(fy + cj * fyp), fyp, cj

    def solve(self, state, g, transpose=False):
        lu, fyp, cj = state
        g1, g2 = g[: self.n], g[self.n:]
        x_lam = factored_solve(lu, g1 - cj * g2, transpose=True)
        return jnp.concatenate([g2 + fyp.T @ x_lam, x_lam])

    def is_singular(self, state):
        return factored_is_singular(state[0])


def _empty_outputs(n, nq, dtype):
    return Outputs(ts=jnp.zeros((0,), dtype), ys=jnp.zeros((0, n), dtype),
                   yps=jnp.zeros((0, n), dtype), qs=jnp.zeros((0, nq), dtype),
                   index=jnp.zeros((), jnp.int32))


def backward(adjoint: Adjoint, static, problem_fwd: Problem, checkpoints, y0, yp0, diff,
             nondiff, sol, cot):
    """The backward pass. Returns (ȳ0, ȳp0, p̄ (args pytree), t̄0, t̄s)."""
    t0, t1, _, _, args, ts = diff
    algebraic, rtol, atol, _, _, tstop = nondiff
    ybar, ypbar, qbar = cot
    dtype, n = y0.dtype, y0.shape[0]
    n_save = ts.shape[0]
    nq = qbar.shape[1]
    a = algebraic
    pd, pst = eqx.partition(args, eqx.is_inexact_array)
    flat_pd, unravel = ravel_pytree(pd)
    npar = flat_pd.shape[0]

    def F(t, y, yp, p):
        return static.residual(t, y, yp, eqx.combine(p, pst))

    def source(t, y, yp, w, p):
        """g = wᵀq: returns (g_y, g_y', g_p flat)."""
        if static.quadrature is None:
            return jnp.zeros_like(y), jnp.zeros_like(y), jnp.zeros((npar,), dtype)
        _, vjp = jax.vjp(lambda y_, yp_, p_: static.quadrature(t, y_, yp_, eqx.combine(p_, pst)),
                         y, yp, p)
        gy, gyp, gp = vjp(w)
        return gy, gyp, ravel_pytree(gp)[0] if npar else jnp.zeros((0,), dtype)

    user_jac = getattr(problem_fwd.linear_solver, "jac", None)

    def jacobians(t, y, yp, p):
        """(F_y, F_y') from the user's `DenseLU(jac=...)` if given (J at cj = 0 and 1),
        else by forward-mode AD."""
        if user_jac is not None:
            fy = user_jac(t, y, yp, 0.0, eqx.combine(p, pst))
            return fy, user_jac(t, y, yp, 1.0, eqx.combine(p, pst)) - fy
        zero = jnp.zeros_like(y)
        fy = jax.jacfwd(lambda v: F(t, y + v, yp, p))(zero)
        fyp = jax.jacfwd(lambda v: F(t, y, yp + v, p))(zero)
        return fy, fyp

    def f_p_transpose(t, y, yp, p, v):
        if npar == 0:
            return jnp.zeros((0,), dtype)
        _, vjp = jax.vjp(lambda p_: F(t, y, yp, p_), p)
        return ravel_pytree(vjp(v)[0])[0]

    # --- the adjoint DAE (A) in s = −t --------------------------------------------
    def adj_residual(s, Z, Zs, aargs):
        buf, w, p = aargs
        t = -s
        y, yp = buf.evaluate(t)
        mu, lam = Z[:n], Z[n:]
        _, vjp = jax.vjp(lambda y_, yp_: F(t, y_, yp_, p), y, yp)
        fy_lam, fyp_lam = vjp(lam)
        gy, gyp, _ = source(t, y, yp, w, p)
        return jnp.concatenate([Zs[:n] + fy_lam - gy, mu - fyp_lam + gyp])

    def adj_quadrature(s, Z, Zs, aargs):
        buf, w, p = aargs
        t = -s
        y, yp = buf.evaluate(t)
        _, _, gp = source(t, y, yp, w, p)
        return gp - f_p_transpose(t, y, yp, p, Z[n:])

    adj_rtol = jnp.asarray(rtol if adjoint.rtol is None else adjoint.rtol, dtype)
    adj_atol = jnp.asarray(jnp.max(atol) if adjoint.atol is None else adjoint.atol, dtype)

    def adj_problem(buf, w, s_stop):
        return Problem(
            residual=adj_residual, quadrature=adj_quadrature if npar else None,
            linear_solver=_AdjointLU(jacobians=jacobians, n=n), args=(buf, w, pd),
            rtol=adj_rtol, atol=jnp.full((2 * n,), adj_atol, dtype),
            error_mask=jnp.concatenate([jnp.ones((n,), dtype), jnp.where(a, 0.0, 1.0).astype(dtype)]), quad_rtol=adj_rtol,
            quad_atol=jnp.full((npar,), adj_atol, dtype),
            quad_error_control=adjoint.quad_error_control and npar > 0, tstop=s_stop,
            reset_newton_rate=True)

    def jump(t, y, yp, mu, yb, ypb):
        """μ(t⁻) = μ(t⁺) + ȳ − F_yᵀν with M ν = a∘ȳ + d∘ȳp, and −F_pᵀν; also returns
        (F_y, F_y') and the factors of M for the caller's further solves."""
        fy, fyp = jacobians(t, y, yp, pd)
        m_lu = jax.scipy.linalg.lu_factor(jnp.where(a[:, None], fy.T, fyp.T))
        nu = jax.scipy.linalg.lu_solve(m_lu, jnp.where(a, yb, ypb))
        return mu + yb - fy.T @ nu, -f_p_transpose(t, y, yp, pd, nu), (fy, fyp), m_lu

    def restart(t, mu, yb, ypb, w, buf):
        """Jump of μ at t for cotangents (ȳ, ȳp) and consistent (Z, Z_s) for the new w."""
        y, yp = buf.evaluate(t)
        mu, p_jump, (fy, _), m_lu = jump(t, y, yp, mu, yb, ypb)
        gy, gyp, _ = source(t, y, yp, w, pd)
        mu = jnp.where(a, -gyp, mu)
        lam = jax.scipy.linalg.lu_solve(m_lu, jnp.where(a, gy, mu + gyp))
        mu_s = gy - fy.T @ lam
        # λ_s from the s-derivative of the two relations with the coefficients frozen;
        # only the starting predictor uses it, and the BDF corrects the rest.
        lam_s = jax.scipy.linalg.lu_solve(m_lu, jnp.where(a, 0.0, mu_s))
        return jnp.concatenate([mu, lam]), jnp.concatenate([mu_s, lam_s]), p_jump

    # --- buffers and initial carry --------------------------------------------------
    every = adjoint.checkpoint_every
    capacity = 2 * every + 20
    ck_states = checkpoints.states
    n_ck = checkpoints.count
    ck_cap = ck_states.t.shape[0]
    max_fwd = static.max_steps
    max_adj = adjoint.max_steps or static.max_steps
    empty_fwd = _empty_outputs(n, problem_fwd.quad_atol.shape[0], dtype)
    empty_adj = _empty_outputs(2 * n, npar, dtype)
    if adjoint.interpolation not in ("hermite", "bdf"):
        raise ValueError(f"Adjoint(interpolation=...) must be 'hermite' or 'bdf', got "
                         f"{adjoint.interpolation!r}.")
    buf0 = StepRecorder.create(capacity, n, dtype, hermite=adjoint.interpolation == "hermite")
    w0 = jnp.zeros((nq,), dtype)
    Z0 = jnp.zeros((2 * n,), dtype)
    dummy_problem = adj_problem(buf0, w0, jnp.asarray(jnp.inf, dtype))
    adj0 = initial_state(dummy_problem, -ts[-1], Z0, Z0, jnp.ones((), dtype))

    def recompute(c, ck, t_next):
        """Replay forward segment c from its checkpoint `ck` to t_next, recording every
        step. (The checkpoint is sliced outside any `cond`, so the whole checkpoint
        buffer is never an operand of a branch, which XLA would copy.)"""
        last = c + 1 >= n_ck
        prob = dataclasses.replace(problem_fwd, tstop=jnp.where(last, tstop, t_next))
        st = restore_linear_state(prob, ck)
        # y' at the checkpoint: the BDF interpolant there, or y'0 at the very start.
        _, yp_start = StepRecorder._node(st)
        yp_start = jnp.where(c == 0, yp0, yp_start)
        st, _, (rec,) = integrate(prob, st, empty_fwd, t_next, max_fwd, (buf0.start(st, yp_start),))
        ok = (st.result == RESULTS.successful) & ~rec.overflowed()
        return rec, ok

    def obs_sum(idx, t):
        """Sum the cotangents of all outputs at time t (rows idx, idx−1, ...)."""
        def cond(c):
            i = c[0]
            return (i >= 0) & (ts[jnp.maximum(i, 0)] >= t)

        def body(c):
            i, yb, ypb, qb = c
            return i - 1, yb + ybar[i], ypb + ypbar[i], qb + qbar[i]

        z = jnp.zeros((n,), dtype)
        return jax.lax.while_loop(cond, body, (idx, z, z, jnp.zeros((nq,), dtype)))

    carry0 = dict(c=n_ck - 1, t_cur=ts[-1], obs=jnp.asarray(n_save - 1, jnp.int32), adj=adj0,
                  w=w0, pbar=jnp.zeros((npar,), dtype), buf=buf0, started=jnp.zeros((), bool),
                  ok=jnp.ones((), bool), adj_steps=jnp.zeros((), jnp.int32))

    def inner_cond(k):
        return (k["t_cur"] > k["t_low"]) & k["ok"]

    def inner_body(k):
        obs, yb, ypb, qb = obs_sum(k["obs"], k["t_cur"])
        jump = jnp.any(yb != 0) | jnp.any(ypb != 0) | jnp.any(qb != 0) | ~k["started"]
        adj_old = k["adj"]

        def do_restart():
            mu = jnp.where(k["started"], adj_old.phi[0, :n], 0.0)
            banked = jnp.where(k["started"], adj_old.phiq[0], 0.0)
            w = k["w"] + qb
            Z, Zs, p_jump = restart(k["t_cur"], mu, yb, ypb, w, k["buf"])
            t_next = jnp.maximum(k["t_low"], jnp.where(obs >= 0, ts[jnp.maximum(obs, 0)], -jnp.inf))
            prob = adj_problem(k["buf"], w, -t_next)
            qp = prob.quad(-k["t_cur"], Z, Zs)
            h0 = initial_step(prob, -k["t_cur"], Z, Zs, qp, -t_next)
            fresh = initial_state(prob, -k["t_cur"], Z, Zs, h0)
            steps = k["adj_steps"] + jnp.where(k["started"], adj_old.stats["num_steps"], 0)
            new = (fresh, w, k["pbar"] + banked + p_jump, steps)
            return tree_where(jump, new, (adj_old, k["w"], k["pbar"], k["adj_steps"]))

        adj, w, pbar, steps = jax.lax.cond(
            eqxi.unvmap_any(jump), do_restart,
            lambda: (adj_old, k["w"], k["pbar"], k["adj_steps"]))
        t_next = jnp.maximum(k["t_low"], jnp.where(obs >= 0, ts[jnp.maximum(obs, 0)], -jnp.inf))
        prob = adj_problem(k["buf"], w, -t_next)
        adj, _, _ = integrate(prob, adj, empty_adj, -t_next, max_adj)
        ok = adj.result == RESULTS.successful
        return dict(k, obs=obs, adj=adj, w=w, pbar=pbar, adj_steps=steps, started=jnp.ones((), bool),
                    t_cur=t_next, ok=k["ok"] & ok)

    def outer_cond(k):
        return (k["c"] >= 0) & k["ok"]

    def outer_body(k):
        c = k["c"]
        t_low = ck_states.t[c]
        need = (t_low < k["t_cur"]) | (c == 0)
        ck = jax.tree_util.tree_map(lambda x: x[c], ck_states)
        t_next = jnp.where(c + 1 >= n_ck, t1, ck_states.t[jnp.minimum(c + 1, ck_cap - 1)])
        buf, ok = jax.lax.cond(eqxi.unvmap_any(need), lambda: recompute(c, ck, t_next),
                               lambda: (k["buf"], jnp.ones((), bool)))
        buf = tree_where(need, buf, k["buf"])
        k = dict(k, buf=buf, ok=k["ok"] & (ok | ~need), t_low=t_low)
        k = jax.lax.while_loop(inner_cond, inner_body, k)
        del k["t_low"]
        return dict(k, c=c - 1)

    k = jax.lax.while_loop(outer_cond, outer_body, carry0)

    # --- at t0: observations there, then the initial-value gradients ---------------
    buf = k["buf"]
    adj = k["adj"]
    mu = jnp.where(k["started"], adj.phi[0, :n], 0.0)
    pbar = k["pbar"] + jnp.where(k["started"], adj.phiq[0], 0.0)
    obs, yb, ypb, qb = obs_sum(k["obs"], t0)
    y_t0, yp_t0 = buf.evaluate(t0)
    mu, p_jump, (fy, fyp), _ = jump(t0, y_t0, yp_t0, mu, yb, ypb)
    pbar = pbar + p_jump
    w = k["w"] + qb

    ok = k["ok"]
    mu = eqx.error_if(mu, ~ok, "daeadjoint: the backward (adjoint) integration failed; try "
                      "looser adjoint tolerances (Adjoint(rtol=..., atol=...)) or more max_steps.")
    mu = eqx.error_if(mu, jnp.any(jnp.where(a[None, :], ypbar, 0.0) != 0),
                      "daeadjoint: cotangents on y' of algebraic components are not supported.")

    if static.init == "y":
        # y0 solves F(t0, y0, y'0, p) = 0 given y'0: δy0 = −F_y⁻¹(F_y' δy'0 + F_p δp).
        z = jnp.linalg.solve(fy.T, mu)
        ybar0 = jnp.zeros_like(mu)
        ypbar0 = -fyp.T @ z
        pbar = pbar - f_p_transpose(t0, y_t0, yp_t0, pd, z)
    else:
        # The algebraic part of y0 and all of y'0 are determined by the differential part.
        ybar0 = jnp.where(a, 0.0, mu)
        ypbar0 = jnp.zeros_like(mu)

    # Moving t0 with y(t0) fixed shifts the trajectory; ∫_{t0} q loses q(t0).
    t0bar = -(mu @ yp_t0)
    if static.quadrature is not None:
        t0bar = t0bar - w @ static.quadrature(t0, y_t0, yp_t0, args)
    # Output times: d ys_i/dt_i = yps_i, d qs_i/dt_i = q(t_i).
    tsbar = jnp.sum(ybar * sol.yps, axis=1)
    if static.quadrature is not None:
        q_at = jax.vmap(lambda t, y, yp: static.quadrature(t, y, yp, args))(ts, sol.ys, sol.yps)
        tsbar = tsbar + jnp.sum(qbar * q_at, axis=1)
    stats = dict(adjoint_steps=k["adj_steps"] + adj.stats["num_steps"])
    return ybar0, ypbar0, unravel(pbar) if npar else pd, t0bar, tsbar, stats
