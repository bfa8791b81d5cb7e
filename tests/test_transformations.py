"""Every JAX transformation through `solve`: forward sensitivities against IDAS's FSA
values, forward mode against reverse mode, second derivatives against exact ones and
against central differences of adjoint gradients (R1, R4 of `problems.py`). R1's
forward-mode dG/dp and Hessian-vector product, which compare with the adjoint gradient
of G, are in tests/test_adjoint.py beside its compiled program."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import daeadjoint as dae
from .problems import (ROBERTSON_ALGEBRAIC, ROBERTSON_P, ROBERTSON_Y0, ROBERTSON_YP0,
                      oscillator, robertson)
from .test_adjoint import (CONTINUOUS, KIN_TS, KIN_W, ROB_ATOL, hvp_vs_fd, kinetics,
                           kinetics_grad, kinetics_loss)

# CONTINUOUS (Adjoint(fallback=False), tests/test_adjoint.py) in the reverse-mode checks
# against exact derivatives, forward mode and differences below: the continuous
# adjoint's answers, a failed backward integration raising instead of passing with the
# discrete adjoint's gradient, and no fallback branch to compile. The default
# `Adjoint()` (with the fallback) stays in the batched gradients here and, under forward
# over reverse (jax.hessian), in
# test_right_answer_or_clear_failure.py::test_reverse_mode_for_a_float32_parameter_of_a_float64_solve.

# ------------------------------------------------------- R1: forward sensitivities
# (dG/dp by forward mode against the adjoint's: tests/test_adjoint.py's
# test_jacfwd_of_G_agrees_with_the_adjoint, beside the adjoint's compiled program.)


@jax.jit
def robertson_sensitivities(p, rtol):
    """∂y/∂p at IDAS's output times by jax.jacfwd: one forward integration carrying the
    three directions (staggered corrector, full error control)."""
    def ys(p):
        return dae.solve(robertson, 0.0, 4e10, ROBERTSON_Y0, ROBERTSON_YP0, p,
                         algebraic=ROBERTSON_ALGEBRAIC, saveat=jnp.array([0.4, 40.0, 4e4, 4e10]),
                         rtol=rtol, atol=ROB_ATOL * rtol / 1e-6).ys
    return jax.jacfwd(ys)(p)


def test_robertson_forward_sensitivities_match_idas_fsa():
    """s1 = ∂y/∂p1 at t = 40 from IDAS's FSA run at rtol 1e-6: (−4.2476, 4.5912e-5,
    4.2475), to its 5 printed digits (half a unit in the last digit, plus 1% of that for
    our own rounding). The second component is the sensitivity of y2 ~ 1e-5, at the
    atol floor of y2's tolerance (1e-14) relative to its own size 5e-5: still 5 digits."""
    S = np.asarray(robertson_sensitivities(ROBERTSON_P, 1e-6))
    s1_40 = S[1, :, 0]
    idas = np.array([-4.2476e00, 4.5912e-05, 4.2475e00])
    assert np.all(np.abs(s1_40 - idas) <= 5e-5 * np.abs(idas) * 1.01), s1_40
    # Algebraic y3 = 1 − y1 − y2, so its sensitivity is minus the others' sum (exactly,
    # since the corrector satisfies the algebraic equation to the Newton tolerance).
    np.testing.assert_allclose(S[:, 2, :], -(S[:, 0, :] + S[:, 1, :]), rtol=1e-6, atol=1e-12)


def test_sensitivity_nonconvergence_redoes_the_step_not_fails_it():
    """The staggered corrector does two iterations with the state's (possibly stale) J;
    when they have not converged the step is redone with J rebuilt, which is neither a
    convergence nor an error-test failure (IDAS rebuilds J within the step). On
    Robertson with one direction that happens on a few percent of the steps: the run
    must count no convergence failures, evaluate J more often than the plain forward,
    and still agree with IDAS's s1 at t = 40 (as in the test above)."""
    def sol(p):
        return dae.solve(robertson, 0.0, 4e10, ROBERTSON_Y0, ROBERTSON_YP0, p,
                         algebraic=ROBERTSON_ALGEBRAIC, saveat=jnp.array([40.0, 4e10]),
                         rtol=1e-6, atol=ROB_ATOL)
    e1 = jnp.array([1.0, 0.0, 0.0])
    primal, tangent = jax.jit(lambda p: jax.jvp(sol, (p,), (e1,)))(ROBERTSON_P)
    plain = jax.jit(sol)(ROBERTSON_P)
    assert primal.result == dae.RESULTS.successful
    assert int(primal.stats["num_nonlinear_convergence_failures"]) == 0, primal.stats
    assert int(primal.stats["num_jacobian_evals"]) > int(plain.stats["num_jacobian_evals"])
    idas = np.array([-4.2476e00, 4.5912e-05, 4.2475e00])
    assert np.all(np.abs(np.asarray(tangent.ys[0]) - idas) <= 5e-5 * np.abs(idas) * 1.01)


# ------------------------------------- nonlinear index 1: forward == reverse == FD
def _theta_loss(theta, rtol, sensitivity=None):
    """The kinetics loss of test_adjoint with an observation time also a parameter."""
    return kinetics_loss_t(theta[:6], theta[6], rtol, sensitivity)


def kinetics_loss_t(theta, t_obs, rtol, sensitivity=None):
    p, y0d = theta[:4], theta[4:]
    y0 = jnp.concatenate([y0d, jnp.zeros(1)])
    sol = dae.solve(kinetics, 0.0, 3.0, y0, jnp.zeros(3), p, saveat=KIN_TS.at[1].set(t_obs),
                    algebraic=jnp.array([False, False, True]), init="ya_ydp",
                    quadrature=lambda t, y, yp, p: y[2:3] ** 2, quad_error_control=True,
                    rtol=rtol, atol=rtol, sensitivity=sensitivity)
    return (jnp.sum(KIN_W * sol.ys) + jnp.sum(jnp.sin(sol.ys[:, 2]))
            + 0.7 * sol.yps[1, 0] + sol.qs[-1, 0])


THETA7 = jnp.array([0.8, 2.0, 0.3, 0.5, 1.0, 0.2, 1.0])
_fwd7 = jax.jit(jax.jacfwd(_theta_loss))
_rev7 = jax.jit(jax.grad(functools.partial(_theta_loss, sensitivity=CONTINUOUS)))


def test_jacfwd_equals_jacrev_nonlinear_index1():
    """Parameters in the residual, in y0 (with init="ya_ydp") and an observation time;
    outputs on all components incl. the algebraic one, on y' and a quadrature. At rtol
    1e-9 both modes are within ~100·rtol of the truth, so they agree to 1e-6 of the
    gradient's size; and both agree with central differences (step 1e-4 at rtol 1e-12:
    truncation ~1e-8, noise ~1e-8) to the same."""
    gf = np.asarray(_fwd7(THETA7, 1e-9))
    gr = np.asarray(_rev7(THETA7, 1e-9))
    scale = np.max(np.abs(gr))
    np.testing.assert_allclose(gf, gr, rtol=0, atol=1e-6 * scale)
    f = jax.jit(_theta_loss)
    eps = 1e-4
    fd = np.array([(f(THETA7.at[i].add(eps), 1e-12) - f(THETA7.at[i].add(-eps), 1e-12)) / (2 * eps)
                   for i in range(7)])
    np.testing.assert_allclose(gf, fd, rtol=0, atol=1e-6 * scale)


@jax.jit
def kinetics_algebraic(p, rtol):
    y0 = jnp.array([1.0, 0.2, 0.0])
    return dae.solve(kinetics, 0.0, 3.0, y0, jnp.zeros(3), p, saveat=KIN_TS,
                     algebraic=jnp.array([False, False, True]), init="ya_ydp", rtol=rtol,
                     atol=rtol).ys[:, 2]


# One compiled jacfwd of `kinetics_algebraic` (rtol traced), shared by the tests below;
# its auxiliary output is the primal of the same forward-mode run (the state integrated
# with its sensitivities in one run).
_kinetics_algebraic_jacfwd_and_value = jax.jit(jax.jacfwd(
    lambda p, rtol: (kinetics_algebraic(p, rtol),) * 2, has_aux=True))


def _kinetics_algebraic_jacfwd(p, rtol):
    return _kinetics_algebraic_jacfwd_and_value(p, rtol)[0]


def test_forward_sensitivities_of_algebraic_components():
    """∂y3(t_i)/∂p of the algebraic y3 (the cubic y3³ + y3 = y1 + p4 y2) by jacfwd at
    rtol 1e-9 against central differences (step 1e-5, rtol 1e-12: truncation ~1e-10,
    noise ~1e-7): 1e-6 of the largest entry."""
    p = jnp.array([0.8, 2.0, 0.3, 0.5])
    S = np.asarray(_kinetics_algebraic_jacfwd(p, 1e-9))
    eps = 1e-5
    fd = np.stack([(kinetics_algebraic(p.at[i].add(eps), 1e-12)
                    - kinetics_algebraic(p.at[i].add(-eps), 1e-12)) / (2 * eps) for i in range(4)], 1)
    np.testing.assert_allclose(S, fd, rtol=0, atol=1e-6 * np.max(np.abs(fd)))


def kinked(t, y, yp, k):
    """x' = −k x, 0 = z − max(x, 1/2): z has a kink where x passes 1/2 (t = ln 2 / k),
    its sensitivity ∂z/∂k = [x > 1/2] ∂x/∂k a jump."""
    x, z = y
    return jnp.stack([yp[0] + k * x, z - jnp.maximum(x, 0.5)])


@pytest.mark.parametrize("mode", ["jacfwd", "grad"])
def test_derivative_across_a_kink_of_an_algebraic_variable(mode):
    """Forward sensitivities under full error control across the jump of an algebraic
    sensitivity, which no step size resolves (the state's kink passes; its sensitivity's
    error estimate stayed at 2.6e5 down to t + h == t: `step_size_too_small`, while the
    forward solve succeeds). Exact: x = e^{−kt}, ∂x/∂k = −t e^{−kt}, ∂z/∂k = 0 after the
    kink and ∂x/∂k before it. Bound: 100·rtol of the derivative's size, the project's
    global error bound (the adjoint must agree as well)."""
    rtol = 1e-6
    ts = jnp.array([0.5, 2.0])          # before and after the kink at ln 2

    def f(k):
        return dae.solve(kinked, 0.0, 2.0, jnp.array([1.0, 1.0]), jnp.array([-k, 0.0]), k,
                         algebraic=jnp.array([False, True]), saveat=ts, rtol=rtol,
                         atol=rtol, sensitivity=CONTINUOUS).ys

    t = np.asarray(ts)
    exact = np.stack([-t * np.exp(-t), np.where(np.exp(-t) > 0.5, -t * np.exp(-t), 0.0)], 1)
    if mode == "jacfwd":     # jitted: one program (eager compiles each primitive alone)
        J = np.asarray(jax.jit(jax.jacfwd(f))(1.0))
    else:   # one gradient: of x + z at both times
        J = np.asarray(jax.jit(jax.grad(lambda k: jnp.sum(f(k))))(1.0))
        exact = np.sum(exact)
    np.testing.assert_allclose(J, exact, rtol=0, atol=100 * rtol * np.max(np.abs(exact)))


def test_vmap_of_jacfwd_and_linearize():
    """jax.vmap(jax.jacfwd(...)) over two parameter sets equals each member's jacfwd (to
    20 tolerance units, as the forward vmap tests: members take their own steps), and
    jax.linearize's linear map equals jacfwd."""
    ps = jnp.array([[0.8, 2.0, 0.3, 0.5], [1.2, 1.0, 0.5, 0.2]])
    batched = jax.jit(jax.vmap(jax.jacfwd(kinetics_algebraic), in_axes=(0, None)))(ps, 1e-8)
    single = _kinetics_algebraic_jacfwd     # the shared program
    for i in range(2):
        np.testing.assert_allclose(batched[i], single(ps[i], 1e-8), rtol=2e-7, atol=2e-7)
    v = jnp.array([0.3, -0.2, 0.5, 0.1])
    # jitted: one program (eagerly, the linearization's known and unknown parts compile
    # separately)
    lin_v = jax.jit(lambda p, v: jax.linearize(lambda q: kinetics_algebraic(q, 1e-8), p)[1](v))
    np.testing.assert_allclose(lin_v(ps[0], v), single(ps[0], 1e-8) @ v, rtol=1e-6, atol=1e-9)


def test_grad_of_vmap_with_batched_output_times():
    """grad of a sum over a vmapped solve whose members have their own output times
    (failed to trace: a custom JVP of the output-time shift returned an unbatched primal
    with a batched tangent inside the solve's jit) equals the exact derivatives of
    y = e^(-p t) with respect to each member's p and output time, to 100·rtol (the
    solution's global error, amplified at most by the O(1) constants of y' = -p y)."""
    def y_at(p, t):
        return dae.solve(lambda t, y, yp, p: yp + p * y, 0.0, 2.0, jnp.ones(1), args=p,
                         saveat=jnp.stack([t, 2.0]), rtol=1e-8, atol=1e-10).ys[0, 0]

    ps, ts = jnp.array([0.5, 0.7]), jnp.array([0.5, 1.0])
    gp, gt = jax.jit(jax.grad(lambda ps, ts: jnp.sum(jax.vmap(y_at)(ps, ts)),
                              argnums=(0, 1)))(ps, ts)
    e = np.exp(-np.asarray(ps) * np.asarray(ts))
    np.testing.assert_allclose(gp, -np.asarray(ts) * e, rtol=1e-6)
    np.testing.assert_allclose(gt, -np.asarray(ps) * e, rtol=1e-6)


def test_pure_forward_mode_is_one_run_and_grad_of_vmap_is_not():
    """jax.jvp (and jax.jacfwd, jvp in every direction at once) integrates the state
    with its sensitivities in one run (the fused primitive, no separate primal solve),
    and its primal output is that run's solution: within 200·rtol of the plain solve
    (both within ~100·rtol of the truth, as above; the steps differ under full error
    control). Linearization (`grad`, also of a vmapped solve, where JAX's tangents reach
    the solve through vmap) keeps the primal solve and the linear tangent map apart, so
    the adjoint serves it (its program holds the adjoint's cotangent primitive; its
    values: test_grad_of_vmap_equals_the_members_gradients)."""
    p = jnp.array([0.8, 2.0, 0.3, 0.5])
    v = jnp.array([0.3, -0.2, 0.5, 0.1])
    jvp = jax.jit(lambda p, v: jax.jvp(lambda q: kinetics_algebraic(q, 1e-8), (p,), (v,)))
    prims = {e.primitive.name for e in jax.make_jaxpr(jvp)(p, v).jaxpr.eqns[0].params["jaxpr"].eqns}
    text = str(jax.make_jaxpr(jvp)(p, v))
    assert "daeadjoint_primal_tangent" in text and "daeadjoint_tangent[" not in text, prims
    # The primal output checked is that of jacfwd (jvp in the four directions at once,
    # the same fused primitive), whose program the tests above compiled: compiling the
    # jvp's own program for it cost a program more.
    jac_text = str(jax.make_jaxpr(_kinetics_algebraic_jacfwd_and_value)(p, 1e-8))
    assert "daeadjoint_primal_tangent" in jac_text and "daeadjoint_tangent[" not in jac_text
    _, y = _kinetics_algebraic_jacfwd_and_value(p, 1e-8)
    np.testing.assert_allclose(y, kinetics_algebraic(p, 1e-8), rtol=0, atol=200 * 1e-8)

    assert "daeadjoint_cotangent" in str(_grad_of_vmap_traced().jaxpr)


_GOV_THETAS = jnp.stack([THETA7[:6], jnp.array([1.2, 1.0, 0.5, 0.2, 0.5, 0.4])])


def _grad_of_vmap_traced():
    """grad of a sum over a vmapped kinetics solve (rtol and the observation time traced,
    the latter shared by the members), traced: its jaxpr is inspected above, and the
    same trace lowered and compiled below."""
    return jax.jit(jax.grad(lambda ths, t, r: jnp.sum(
        jax.vmap(lambda th: kinetics_loss_t(th, t, r))(ths)))).trace(_GOV_THETAS, THETA7[6], 1e-8)


# Slow (the default suite's budget: the vmapped gradient's program, ~25 CPU s): grad of a
# sum over a vmapped solve stays checked by default against the exact derivatives with
# respect to each member's parameter and output time in
# test_grad_of_vmap_with_batched_output_times, and that the adjoint serves it (its
# cotangent primitive in the program) in test_pure_forward_mode_is_one_run_and_grad_of_vmap_is_not.
@pytest.mark.slow
def test_grad_of_vmap_equals_the_members_gradients():
    """grad of a sum over a vmapped solve equals the members' gradients (rtol 1e-7,
    reverse mode run the same way for both): the members' gradients with respect to the
    parameters in the residual and y0 are those of `_rev7` (rtol and the observation
    time traced in both programs)."""
    t_obs = THETA7[6]
    g_batched = _grad_of_vmap_traced().lower().compile()(_GOV_THETAS, t_obs, 1e-8)
    for i in range(2):
        g_single = _rev7(jnp.concatenate([_GOV_THETAS[i], t_obs[None]]), 1e-8)[:6]
        np.testing.assert_allclose(g_batched[i], g_single, rtol=1e-7, atol=1e-12)


@pytest.mark.slow
def test_jacfwd_of_a_vmapped_solve():
    """jacfwd outside a vmap over the primal (examples/fit_event_time.py): the primal
    stays unbatched over the directions; equals the member's jacfwd (2e-7: 20 tolerance
    units, as in test_vmap_of_jacfwd_and_linearize). Slow (the default suite's budget):
    CI runs that example, and test_vmap_of_jacfwd_and_linearize covers vmap with jacfwd."""
    p = jnp.array([0.8, 2.0, 0.3, 0.5])
    two = lambda q: jax.vmap(lambda r: kinetics_algebraic(r, 1e-8))(jnp.stack([q, 1.1 * q]))  # noqa: E731
    J = jax.jit(jax.jacfwd(two))(p)
    single = jax.jit(jax.jacfwd(lambda q: kinetics_algebraic(q, 1e-8)))
    np.testing.assert_allclose(J[0], single(p), rtol=2e-7, atol=2e-7)


# ------------------------------------------------------------- second order
def _x1(t, x, xp, args):
    return x[:1]


@jax.jit
def r4_hessians(theta, rtol):
    """Hessians of ψ1 = x1(π/2) and ψ2 = ∫ x1 w.r.t. (c, v0) by jax.hessian (forward
    over adjoint); π/2 falls inside a step (no tstop)."""
    def psi(th):
        c, v0 = th[0], th[1]
        sol = dae.solve(oscillator, 0.0, jnp.pi / 2, jnp.stack([0.0, v0]), jnp.stack([v0, 0.0]),
                        jnp.stack([c]), quadrature=_x1, quad_error_control=True, rtol=rtol,
                        atol=rtol, sensitivity=CONTINUOUS)
        return jnp.stack([sol.ys[-1, 0], sol.qs[-1, 0]])
    return jax.hessian(psi)(theta)


def test_oscillator_second_derivatives_exact():
    """x1 = v0 sin(√c t)/√c and ∫ x1 = v0(1 − cos(√c t1))/c (Eberhard & Bischof's
    oscillator): their exact Hessians at c = 1, v0 = 1/2, within 100·rtol at rtol 1e-6 and
    1e-8 (the global-error bound of the exact-solution tests; the second derivatives come
    from the augmented DAE integrated at the same tolerance)."""
    theta = jnp.array([1.0, 0.5])

    def exact(th):
        c, v0 = th[0], th[1]
        w, t1 = jnp.sqrt(c), jnp.pi / 2
        return jnp.stack([v0 * jnp.sin(w * t1) / w, v0 * (1 - jnp.cos(w * t1)) / c])

    H_exact = np.asarray(jax.jit(jax.hessian(exact))(theta))   # one program, not ~40 eager ops
    for rtol in (1e-6, 1e-8):
        H = np.asarray(r4_hessians(theta, rtol))
        np.testing.assert_allclose(H, H_exact, rtol=0, atol=100 * rtol)


# The Hessian-vector product of Robertson's G (forward over adjoint) against differences
# of adjoint gradients: tests/test_adjoint.py's
# test_hvp_robertson_against_differences_of_adjoint_gradients, next to the compiled
# gradient program it differences (one compilation of it in the suite instead of one in
# each module).


_kin_hvp = jax.jit(lambda th, v, r: jax.jvp(lambda q: jax.grad(kinetics_loss)(q, r),
                                            (th,), (v,))[1])


# Slow (~80 s of compilation; the default suite's budget): forward over adjoint stays
# checked by default against exact Hessians (test_oscillator_second_derivatives_exact,
# with a quadrature), against differences of adjoint gradients on Robertson (algebraic
# y3, quadrature: tests/test_adjoint.py::test_hvp_robertson_against_differences_of_adjoint_gradients) and as
# jvp-of-grad in test_user_inputs_and_messages.py::test_every_transformation_and_second_order.
@pytest.mark.slow
def test_hvp_nonlinear_index1():
    """The kinetics loss (parameters in residual and y0, init="ya_ydp", algebraic
    observations, quadrature): jvp(grad) against central differences of adjoint
    gradients (step 1e-4, gradients at rtol 1e-11: truncation ~1e-8, noise ~1e-7; HVP at
    rtol 1e-9), 1e-5 of its size. (Full Hessians: the oscillator test above; forward over
    forward and reverse over reverse: tests/test_user_inputs_and_messages.py.)"""
    theta = jnp.array([0.8, 2.0, 0.3, 0.5, 1.0, 0.2])
    v = jnp.array([0.3, -0.2, 0.5, 0.1, -0.4, 0.7])
    h, fd = hvp_vs_fd(_kin_hvp, kinetics_grad, theta, v, 1e-9, 1e-11, 1e-4)
    scale = np.max(np.abs(fd))
    np.testing.assert_allclose(h, fd, rtol=0, atol=1e-5 * scale)


# ------------------------------------------------------- optimistix (forward-mode Jacobians)


def test_optimistix_levenberg_marquardt_through_solve():
    """optimistix's Gauss–Newton/Levenberg–Marquardt build J by `jax.linearize` and, in
    their first step, evaluate a zero-filled placeholder of it (t0 = t1 = 0) whose result
    they discard. That placeholder must not raise (it did: `invalid_interval` from the
    tangent solve), and the fit must recover the parameters of noise-free data."""
    optx = __import__("pytest").importorskip("optimistix")
    ts = jnp.array([0.5, 1.0, 2.0, 3.0])

    def res(t, y, yp, p):     # y1' = −k y1, 0 = y2 − c y1 (index 1)
        return jnp.stack([yp[0] + p[0] * y[0], y[1] - p[1] * y[0]])

    def outputs(p):
        return dae.solve(res, 0.0, 3.0, jnp.array([1.0, p[1]]), None, p, saveat=ts,
                         algebraic=jnp.array([False, True]), rtol=1e-8, atol=1e-10).ys

    p_true = jnp.array([0.7, 2.0])
    data = outputs(p_true)
    fit = jax.jit(lambda p0: optx.least_squares(
        lambda p, d: jnp.ravel(outputs(p) - d), optx.LevenbergMarquardt(rtol=1e-8, atol=1e-8),
        p0, args=data, max_steps=50).value)
    np.testing.assert_allclose(fit(jnp.array([1.0, 1.5])), p_true, rtol=1e-5)


def test_vmap_of_solve_and_grad_build_the_program_of_jaxs_loop_batching(monkeypatch):
    """The solver's loops are batched under `vmap` by the rule of `_jax_internals`
    (item 8) instead of JAX's: the same program — equal StableHLO of `vmap(solve)` and
    `vmap(grad)` (the backward pass's nested loops, batched when it is lowered) of the
    kinetics DAE with its quadrature —, built with fewer batchings
    (tests/test_jax_internals.py)."""
    from daeadjoint import _jax_internals as ji
    thetas = jnp.array([[0.9, 1.3, 0.4, 0.6, 1.0, 0.5], [1.0, 1.2, 0.5, 0.7, 0.9, 0.6]])

    def programs():
        """New functions each time, the residual too: nothing from JAX's caches of
        traces and of batched jaxprs (with the module's `kinetics` and `kinetics_loss`,
        the second round reused the first round's batched solve and never ran JAX's
        rule for `vmap(solve)`)."""
        def residual(t, y, yp, p):
            return kinetics(t, y, yp, p)

        def sol(theta, quadrature=None):
            p, y0d = theta[:4], theta[4:]
            return dae.solve(residual, 0.0, 3.0, jnp.concatenate([y0d, jnp.zeros(1)]),
                             jnp.zeros(3), p, saveat=KIN_TS,
                             algebraic=jnp.array([False, False, True]), init="ya_ydp",
                             quadrature=quadrature, quad_error_control=quadrature is not None,
                             rtol=1e-6, atol=1e-6)

        def loss(theta):    # tests/test_adjoint.py's kinetics_loss at rtol 1e-6
            s = sol(theta, lambda t, y, yp, p: y[2:3] ** 2)
            return (jnp.sum(KIN_W * s.ys) + jnp.sum(jnp.sin(s.ys[:, 2]))
                    + 0.7 * s.yps[1, 0] + s.qs[-1, 0])

        return [jax.vmap(lambda th: sol(th).ys), jax.vmap(jax.grad(loss))]

    used = {"ours": 0, "jax": 0}

    def counted(rule, key):
        def batch(*args, **kwargs):
            used[key] += 1
            return rule(*args, **kwargs)
        return batch

    def lower(key):
        texts = []
        for f in programs():
            before = used[key]
            texts.append(jax.jit(f).lower(thetas).as_text())
            assert used[key] > before, key      # this program's loops batched by `key`
        return texts

    monkeypatch.setattr(ji, "_while_batching_rule", counted(ji._while_batching_rule, "ours"))
    ours = lower("ours")
    monkeypatch.setattr(ji, "_while_batching_rule", counted(ji._jax_while_rule, "jax"))
    jaxs = lower("jax")
    assert ours[0] == jaxs[0]
    assert ours[1] == jaxs[1]
