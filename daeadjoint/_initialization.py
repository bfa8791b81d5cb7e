"""Consistent initial conditions, IDAS `IDACalcIC` (seed 002 §6.2.1).

Both modes solve F(t0, y0, y'0) = 0 for a subset u of the 2n initial values, the rest
held fixed:

- `"ya_ydp"`: u = (algebraic components of y0, differential components of y'0), given
  the differential components of y0 (semi-explicit and fully implicit index-1 systems);
- `"y"`: u = y0, given y'0 (e.g. y'0 = 0 for a quasi-steady-state start).

Newton's method with a backtracking line search on the merit ‖J⁻¹F‖_WRMS (the Newton
step norm, as IDAS uses), with J = ∂F/∂u rebuilt each iteration by `jax.jacfwd`: the
systems are small and the start may be far from consistency, so full Newton pays off.
Converged when the Newton step is below 0.01·0.33 in the WRMS norm (IDAS epiccon).
"""

import jax
import jax.numpy as jnp
import lineax as lx

from ._bdf import error_weights, wrms

MAX_ITERS = 20
MAX_BACKTRACKS = 10
EPICCON = 0.01 * 0.33
ARMIJO = 1e-4


def unknown_mask(mode, algebraic, n):
    """Bool (n,): True where u_i is y0_i, False where u_i is y'0_i."""
    if mode == "y":
        return jnp.ones((n,), bool)
    return algebraic


def consistent_initial_conditions(residual, t0, y0, yp0, args, algebraic, mode, rtol, atol):
    """Returns (y0, yp0, converged). See the module docstring."""
    is_y = unknown_mask(mode, algebraic, y0.shape[0])

    def split(u):
        return jnp.where(is_y, u, y0), jnp.where(is_y, yp0, u)

    def g(u):
        y, yp = split(u)
        return residual(t0, y, yp, args)

    def newton_step(u):
        jac = jax.jacfwd(g)(u)
        du = lx.linear_solve(lx.MatrixLinearOperator(jac), -g(u), lx.LU(), throw=False).value
        return du, jac

    # The weights scale each unknown as a y (or, for y' unknowns, as y·(1/time)); using
    # the y-weights for both matches IDAS, which scales y' unknowns by the first step h.
    def merit(u, du):
        y, _ = split(u)
        return wrms(du, error_weights(y, rtol, atol))

    def cond(c):
        u, du, nrm, it, ok, failed = c
        return ~ok & ~failed & (it < MAX_ITERS)

    def body(c):
        u, du, nrm, it, _, _ = c

        def bt_cond(b):
            lam, u_new, du_new, nrm_new, tries = b
            return (nrm_new > (1 - ARMIJO * lam) * nrm) & (tries < MAX_BACKTRACKS)

        def bt_body(b):
            lam, _, _, _, tries = b
            lam = 0.5 * lam
            u_new = u + lam * du
            du_new, _ = newton_step(u_new)
            return lam, u_new, du_new, merit(u_new, du_new), tries + 1

        u1 = u + du
        du1, _ = newton_step(u1)
        start = (jnp.ones((), u.dtype), u1, du1, merit(u1, du1), 0)
        lam, u_new, du_new, nrm_new, tries = jax.lax.while_loop(bt_cond, bt_body, start)
        finite = jnp.all(jnp.isfinite(u_new)) & jnp.isfinite(nrm_new)
        # Converged once the next Newton step is negligible; a line search that cannot
        # decrease the merit means no solution near the guess.
        ok = finite & (nrm_new <= EPICCON)
        failed = ~finite | ((tries >= MAX_BACKTRACKS) & (nrm_new > (1 - ARMIJO * lam) * nrm))
        return u_new + jnp.where(ok, du_new, 0.0), du_new, nrm_new, it + 1, ok, failed

    u0 = jnp.where(is_y, y0, yp0)
    du0, _ = newton_step(u0)
    nrm0 = merit(u0, du0)
    done0 = nrm0 <= EPICCON
    init = (u0, du0, nrm0, 0, done0, ~jnp.isfinite(nrm0))
    u, _, _, _, ok, _ = jax.lax.while_loop(cond, body, init)
    y, yp = split(u)
    return y, yp, ok
