r"""Forward sensitivities: the staggered corrector (IDAS manual §6.2.6).

For k tangent directions (s_i(t0), ṗ_i) the sensitivities s_i = ∂y/∂x · ẋ_i satisfy the
linearized DAE (IDAS manual eq. (6.11))

    F_y s_i + F_y' s_i' + F_p ṗ_i = 0,

integrated by the state's BDF formula and step sequence. After the state corrector has
converged at (t_n, y_n, y'_n), each s_i is corrected by a modified Newton iteration with
the state's iteration matrix J = F_y + cj F_y' and its factorization (eq. (6.13)):

    J (ξ_{m+1} − ξ_m) = −[F_y ξ_m + F_y' (s'_(0) + cj (ξ_m − s_(0))) + F_p ṗ_i],

the bracket being one `jax.jvp` of the residual at the converged point, all directions
batched by `vmap` over one `jax.linearize`. The system is linear, so with a current J
one iteration solves it; with a J built at an older point or cj the iteration contracts
at a rate that the convergence test watches. Two iterations are always done; if they
have not converged the step is redone with J rebuilt (IDAS's staggered solver calls
lsetup and iterates again), and if J was current already it is a convergence failure
(the step is retried with a smaller h).

Quadrature sensitivities (§6.2.6.4) are corrected explicitly like the quadratures:
q̇_i = q_y s_i + q_y' s_i' + q_p ṗ_i.

Error control (§6.2.6.2): with `error_control=True` (IDAS's default, "full") the
sensitivities enter the local error test and the step/order selection through the
maximum of the state's and every direction's WRMS norm; their weights are
1/(rtol |s_i| + atol_i) with atol_i the state's atol scaled to the direction (see
`sensitivity_atol`).
"""

from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from .._bdf import wrms
from .._ops import where
from .._newton import EPS_NEWT, MAX_ITERS, RATE_MAX, TOLDEL, _builds_from_residual


class SensitivityProblem(eqx.Module):
    """The forward-sensitivity part of an integration: k directions.

    - `args_dot`: tangents of the differentiable (inexact-array) leaves of `args`, each
      with a leading axis of size k; None when no direction moves the parameters.
    - `atol`: (k, n) absolute tolerances of the sensitivities; `quad_atol`: (k, nq).
    - `error_control`: include them in the local error test (IDAS's full error control).
    - `algebraic`: (n,) 1.0 on the algebraic components (index 1 and 2), whose
      sensitivities may jump where the residual has a kink along the solution (see
      `_integrator.attempt_step`); None when there are none or no mask was given.
    """

    args_dot: Any
    atol: Float[Array, "k n"]
    quad_atol: Float[Array, "k nq"]
    k: int = eqx.field(static=True)
    error_control: bool = eqx.field(static=True, default=True)
    algebraic: Float[Array, " n"] | None = None


def sensitivity_atol(atol, scale) -> Float[Array, "k n"]:
    """atol_j · ν_i for direction i (IDAS §6.2.6.2 sets atol_j/|p̄_i| for the direction
    e_i of parameter p_i; for a general tangent ẋ_i the sensitivity scales with it, so the
    tolerance must too: ν_i is the size of ẋ_i relative to the inputs it perturbs, see
    `direction_scale`). Keeps the integration of s_i invariant under scaling of ẋ_i."""
    return scale[:, None] * atol[None, :]


def direction_scale(x_dot_leaves, x_leaves, y0, yp0, t0_dot) -> Float[Array, " k"]:
    """ν_i = max over the perturbed inputs of |ẋ| / max(|x|, 1) (each leaf with a leading
    axis k), plus the start-time shift |ṫ0| ‖y'(t0)‖∞ / max(‖y0‖∞, 1) — IDAS's p̄ = |p|
    (floored at 1 so that inputs equal to zero do not make tolerances vanish). Directions
    that perturb nothing get ν = 1 (their sensitivities stay exactly zero)."""
    scales = []
    for xd, x in zip(x_dot_leaves, x_leaves):
        k = xd.shape[0]
        rel = jnp.abs(xd) / jnp.maximum(jnp.abs(x), 1.0)[None]
        scales.append(jnp.max(rel.reshape(k, -1), axis=1) if rel.size else jnp.zeros((k,)))
    if t0_dot is not None:
        scales.append(jnp.abs(t0_dot) * jnp.max(jnp.abs(yp0)) / jnp.maximum(jnp.max(jnp.abs(y0)), 1.0))
    nu = jnp.max(jnp.stack(scales), axis=0)
    return where(nu > 0, nu, 1.0)


class SensitivityCorrection(eqx.Module):
    ee: Float[Array, "k n"]           # s_n − s_(0) for every direction
    converged: Bool[Array, ""]
    num_residual_evals: Array         # sensitivity residual evaluations (k directions each)
    linear_stats: dict
    ss: Array                         # convergence-rate factor for the next step


# Corrector iterations done unconditionally, as straight-line code. On the CPU, XLA runs
# a `while_loop` or `cond` through a nested executor whose fixed cost (with the copies
# of its operands) exceeds that of an iteration for small systems: with the loop the
# sensitivities of Robertson cost twice as much per step. Two iterations also make the
# sensitivities more accurate than one would (IDAS stops after one when
# ssS·‖δ‖ ≤ 0.33); under full error control that can make the error estimate less
# noisy (one direction of Robertson: 1135 steps instead of 1375; three: 1348, 1340).
CORRECTOR_ITERS = 2


class _Iteration(NamedTuple):
    """`sensitivity_corrector`'s iteration state."""

    ee: Array          # (k, n): the corrections s − s_(0) so far
    m: Array           # iterations taken
    oldnrm: Array      # ‖δ‖ of the first (the rate's base)
    ss: Array          # the convergence-rate factor ssS
    status: Array      # 0 running, 1 converged, 2 failed
    nre: Array         # sensitivity residual evaluations
    lin_stats: dict


def sensitivity_corrector(problem, sens: SensitivityProblem, t, y, yp, cj, s_pred, sp_pred,
                          ewt_s, lin_state, cj_old, ss) -> SensitivityCorrection:
    """Staggered corrector for all k directions at the converged state (t, y, y'):
    `CORRECTOR_ITERS` modified Newton iterations with the state's factorization.

    `ss` is IDAS's ssS, the convergence-rate factor carried from step to step: with it
    the first iteration can already pass the test ssS·‖δ‖ ≤ 0.33 (IDAS
    idaNlsConvTestSensStg); later iterations estimate the rate as IDAS does. If the
    iterations have not converged, the caller redoes the step with J rebuilt (IDAS's
    staggered solver calls lsetup and iterates again), or, if J was already current,
    counts a convergence failure. Matrix-free (Krylov) solves are inexact, so the
    iteration converges only linearly even with a current J: for them a loop goes on
    up to IDAS's maxcorS iterations."""
    solver = problem.linear_solver
    dyn, static = eqx.partition(problem.args, eqx.is_inexact_array)
    int_ = jnp.int32

    def f(y_, yp_, d_):
        return problem.residual(t, y_, yp_, eqx.combine(d_, static))

    _, f_lin = jax.linearize(f, y, yp, dyn)
    zero_dyn = jax.tree_util.tree_map(jnp.zeros_like, dyn)

    def sens_residual(e):
        """(k, n): F_y s + F_y' s' + F_p ṗ with s = s_(0) + e, s' = s'_(0) + cj e."""
        if sens.args_dot is None:
            return jax.vmap(lambda s, sp: f_lin(s, sp, zero_dyn))(s_pred + e, sp_pred + cj * e)
        return jax.vmap(f_lin)(s_pred + e, sp_pred + cj * e, sens.args_dot)

    # J at the converged state (matrix-free solvers: the staggered direct method).
    operator = (lambda v: f_lin(v, cj * v, zero_dyn)) if solver.needs_operator else None
    # A factorization built at cj_old solves with J(cj) approximately; this factor makes
    # the correction of the differential components right (IDAS cjratio scaling).
    scale = 1.0 if solver.matrix_free else 2.0 / (1.0 + cj / cj_old)

    # With `index2` a matrix-based solver factored J D, D = cj_old on the index-2
    # columns (`_newton.newton_solve`): the correction is D w from (J D) w = −r.
    col_scale: float | jax.Array = 1.0
    ewt_conv = ewt_s
    if problem.index2 is not None:
        if _builds_from_residual(solver):
            col_scale = where(problem.index2, cj_old, 1.0)
        # The convergence test divides the index-2 weights by cj (their tolerance
        # times ~1/h, as RADAU5 scales its index-2 components: Hairer & Wanner,
        # *Solving Ordinary Differential Equations II*): s_z is fixed through the
        # constraint rows divided by h, so its correction carries their rounding error
        # times cj. With s_z near zero (weight 1/atol) that alone failed the test on
        # every retry at small h (the pendulum's sensitivity to its initial velocity
        # at rtol 1e-9 stopped with `convergence_failures` at t = 8e-9).
        ewt_conv = where(problem.index2, ewt_s / cj, ewt_s)

    def norm(v):
        return jnp.max(jax.vmap(wrms)(v, ewt_conv))

    def iteration(c: _Iteration) -> _Iteration:
        r = sens_residual(c.ee)
        delta, stats = jax.vmap(
            lambda rhs, w: solver.solve(lin_state, -rhs, weights=w, operator=operator))(r, ewt_s)
        delta = delta * (scale * col_scale)
        delnrm = norm(delta)
        m = c.m
        first = m == 0
        rate = (delnrm / where(first, 1.0, c.oldnrm)) ** (1.0 / jnp.maximum(m, 1))
        diverging = ~first & (rate > RATE_MAX)
        ss = where(first, c.ss, rate / (1.0 - rate))
        conv = (first & (delnrm <= 1e-4 * TOLDEL)) | (~diverging & (ss * delnrm <= EPS_NEWT))
        bad = ~jnp.all(jnp.isfinite(r)) | ~jnp.isfinite(delnrm)
        # An iterative linear solve that missed its tolerance: as in `newton_solve`.
        lin_failed = solver.solve_failed({k: jnp.sum(v, dtype=int_) for k, v in stats.items()})
        conv = conv & ~lin_failed
        failed = bad | diverging | (~conv & (m + 1 >= MAX_ITERS)) | (lin_failed & ~first)
        status = where(conv & ~bad, 1, where(failed, 2, 0)).astype(int_)
        # An iteration after convergence refines e where it contracts and never undoes
        # the convergence; one after a failure changes nothing.
        done, dead = c.status == 1, c.status == 2
        keep = dead | (done & (diverging | bad | lin_failed))
        return _Iteration(ee=where(keep, c.ee, c.ee + delta), m=m + 1,
                          oldnrm=where(first, delnrm, c.oldnrm),
                          ss=where(keep, c.ss, ss),
                          status=where(done | dead, c.status, status), nre=c.nre + 1,
                          lin_stats={k: c.lin_stats[k] + jnp.sum(stats[k], dtype=int_)
                                     for k in c.lin_stats})

    zero = jnp.zeros((), int_)
    c = _Iteration(ee=jnp.zeros_like(s_pred), m=zero, oldnrm=jnp.ones((), y.dtype),
                   ss=jnp.asarray(ss, y.dtype), status=zero, nre=zero,
                   lin_stats={k: zero for k in solver.stat_names})
    for _ in range(CORRECTOR_ITERS):
        c = iteration(c)
    if solver.matrix_free:
        c = jax.lax.while_loop(lambda c: c.status == 0, iteration, c)
    return SensitivityCorrection(ee=c.ee, converged=c.status == 1,
                                 num_residual_evals=c.nre, linear_stats=c.lin_stats,
                                 ss=c.ss)


def quadrature_sensitivities(problem, sens: SensitivityProblem, t, y, yp, s, sp):
    """(k, nq): q_y s_i + q_y' s_i' + q_p ṗ_i (IDAS §6.2.6.4)."""
    dyn, static = eqx.partition(problem.args, eqx.is_inexact_array)

    def q(y_, yp_, d_):
        return jnp.asarray(problem.quadrature(t, y_, yp_, eqx.combine(d_, static)), y.dtype)

    _, q_lin = jax.linearize(q, y, yp, dyn)
    if sens.args_dot is None:
        zero_dyn = jax.tree_util.tree_map(jnp.zeros_like, dyn)
        return jax.vmap(lambda s_, sp_: q_lin(s_, sp_, zero_dyn))(s, sp)
    return jax.vmap(q_lin)(s, sp, sens.args_dot)


class ForwardSensitivity(eqx.Module):
    """How forward-mode derivatives through `solve` (`jax.jvp`, `jax.jacfwd`,
    `jax.linearize`, and the forward half of Hessians) are computed: forward sensitivities
    by IDAS's staggered corrector, all tangent directions of a `jacfwd` in one integration
    sharing the state's steps and factorizations.

    **Arguments:**

    - `error_control`: include the sensitivities in the local error test and in the
      step/order selection (IDAS's full error control, the default: the derivatives are
      then as accurate as the solution); False is IDAS's partial error control (the steps
      are chosen for y alone — cheaper, but the sensitivities' error is not controlled).
    """

    error_control: bool = eqx.field(static=True, default=True)
