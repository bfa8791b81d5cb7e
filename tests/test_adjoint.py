"""Gradients through `solve` by the continuous adjoint (`dae.Adjoint`), against published
values (R1–R4 of `problems.py`), exact derivatives and central finite differences; and
R1's forward-mode dG/dp and Hessian-vector product, which compare with the same
compiled adjoint gradient of G (the other transformations: tests/test_transformations.py)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import daeadjoint as dae
from .problems import (ROBERTSON_ALGEBRAIC, ROBERTSON_P, ROBERTSON_Y0, ROBERTSON_YP0,
                      mass_index0, mass_index1, oscillator, robertson)


# The continuous adjoint without its fallback to the discrete adjoint, in the tests of
# the continuous adjoint's answers (against exact derivatives, published values,
# differences, forward sensitivities and the discrete adjoint): a failed backward
# integration must raise there, not pass with the discrete adjoint's gradient and a
# warning (which would also make the comparison with the discrete adjoint trivial); and
# each gradient program compiles without the fallback branch (a quarter of Robertson's
# gradient program's compilation, docs/performance.md). The fallback, which the default
# `Adjoint()` compiles: test_fallback_equals_the_discrete_adjoint_of_the_same_steps and
# the tests after it here, and the default gradients of the other test files.
CONTINUOUS = dae.Adjoint(fallback=False)


# ----------------------------------------------------------- R4: the step-size pitfall
def x1(t, x, xp, args):
    return x[:1]


@jax.jit
def _r4_grads(c, v0, t0, t1, rtol, tstop):
    """The derivatives of ψ1 = x1(t1) and ψ2 = ∫_{t0}^{t1} x1 with respect to (c, v0, t0,
    t1) by the adjoint. Times, tolerances and tstop are traced: one compilation for the
    R4 tests and `test_time_gradients`."""
    def psi(c, v0, t0, t1):
        sol = dae.solve(oscillator, t0, t1, jnp.stack([0.0, v0]), jnp.stack([v0, 0.0]),
                        jnp.stack([c]), quadrature=x1, quad_error_control=True, rtol=rtol,
                        atol=rtol, tstop=tstop, sensitivity=CONTINUOUS)
        return sol.ys[-1, 0], sol.qs[-1, 0]

    return jax.jacrev(psi, argnums=(0, 1, 2, 3))(c, v0, t0, t1)


def r4_grads(c, v0, rtol, at_step_end):
    """All four exact derivatives of ψ1 = x1(π/2) and ψ2 = ∫ x1 (Eberhard & Bischof §3) by the
    adjoint; t1 inside a step (interpolated) or at a step end (tstop = t1)."""
    (d1c, d1v, _, _), (d2c, d2v, _, _) = _r4_grads(c, v0, 0.0, np.pi / 2, rtol,
                                                   np.pi / 2 if at_step_end else np.inf)
    return (d1c, d1v), (d2c, d2v)


@pytest.mark.parametrize("rtol", [1e-5, 1e-8])
@pytest.mark.parametrize("at_step_end", [False, True], ids=["t1-inside-step", "t1-at-step-end"])
def test_oscillator_exact_derivatives(rtol, at_step_end):
    """dψ1/dc = −1/4, dψ1/dv0 = 1, dψ2/dc = π/8 − 1/2, dψ2/dv0 = 1 (R4),
    to 100·rtol: the global-error bound of the forward tests, which the adjoint (solved
    at the same tolerances) inherits."""
    (d1c, d1v), (d2c, d2v) = r4_grads(1.0, 0.5, rtol, at_step_end)
    exact = [(-0.25, d1c), (1.0, d1v), (np.pi / 8 - 0.5, d2c), (1.0, d2v)]
    for want, got in exact:
        assert abs(float(got) - want) <= 100 * rtol, (want, float(got))


def test_differentiating_the_controller_is_wrong():
    """Eberhard & Bischof's pitfall, shown on our own integrator: forward-mode AD straight through
    the adaptive loop (bypassing the adjoint) differentiates the step sizes too. At
    rtol = 1e-8 the last step's time t_N moves with c (∇t_N ≠ 0), and the AD derivative
    of x1(t_N) is off from the exact ∂x1/∂c(t_N) = v0 (t cos t − sin t)/2 by ẋ1·∇t_N —
    tens of thousands of tolerances (how many depends on the step sequence: 8.6e4 with
    the step selection of 7d0a449), over 100 times the adjoint's error bound of
    100·rtol."""
    from daeadjoint._core import Config, Inputs, build_problem
    from daeadjoint._derivatives.forward_sensitivity import ForwardSensitivity
    from daeadjoint._integrator import Outputs, initial_state, initial_step, integrate

    rtol = 1e-8
    config = Config(residual=oscillator, quadrature=None, linear_solver=dae.DenseLU(),
                    reverse=dae.Adjoint(), forward=ForwardSensitivity(), init=None,
                    max_steps=10_000, suppress_algebraic_error=False, quad_error_control=False)

    def last_step(c):
        """The raw integrator loop (no custom derivative rule): its final step."""
        t0, t1 = jnp.asarray(0.0), jnp.asarray(np.pi / 2)
        y0, yp0 = jnp.array([0.0, 0.5]), jnp.array([0.5, 0.0])
        inputs = Inputs(t0=t0, t1=t1, y0=y0, yp0=yp0, args=jnp.stack([c]),
                        saveat=t1[None], algebraic=jnp.zeros(2, bool), rtol=jnp.asarray(rtol),
                        atol=jnp.full(2, rtol), quad_rtol=jnp.asarray(rtol),
                        quad_atol=jnp.zeros(0), tstop=jnp.asarray(jnp.inf))
        problem = build_problem(config, inputs)
        h0 = initial_step(problem, t0, y0, yp0, jnp.zeros(0), t1)
        state = initial_state(problem, t0, y0, yp0, h0)
        outputs = Outputs.create(t1[None], 2, 0, 0, 1, y0.dtype)
        state, _, _, _ = integrate(problem, state, outputs, t1, config.max_steps)
        return state.t, state.phi[0, 0]

    (t_n, _), (dt_n, dx_n) = jax.jit(lambda c: jax.jvp(last_step, (c,), (1.0,)))(1.0)
    t_n = float(t_n)
    exact = 0.5 * (t_n * np.cos(t_n) - np.sin(t_n)) / 2     # v0 = 0.5, c = 1
    assert float(dt_n) != 0.0
    assert abs(float(dx_n) - exact) > 100 * (100 * rtol)
    np.testing.assert_allclose(float(dx_n) - exact, 0.5 * np.cos(t_n) * float(dt_n), rtol=1e-3)
    (d1c, _), _ = r4_grads(1.0, 0.5, rtol, False)
    assert abs(float(d1c) + 0.25) <= 100 * rtol


# --------------------------------------------------------- R1: Robertson, G = ∫ y3 dt
IDAS_ASA = np.array([1.4879e06, -5.9470e00, 9.9117e-04])
IDAS_FSA = np.array([1.4895e06, -5.9536e00, 9.9196e-04])


def robertson_G(p, rtol, t1):
    """G = ∫_0^{t1} y3 at idasRoberts_ASAi_dns's settings: forward atol (1e-8, 1e-14,
    1e-6), adjoint atol 1e-8 at rtol = 1e-6, all scaled with rtol for the convergence
    study."""
    scale = rtol / 1e-6
    sol = dae.solve(robertson, 0.0, t1, ROBERTSON_Y0, ROBERTSON_YP0, p,
                    algebraic=ROBERTSON_ALGEBRAIC, rtol=rtol,
                    atol=jnp.array([1e-8, 1e-14, 1e-6]) * scale,
                    quadrature=lambda t, y, yp, p: y[2:3],
                    sensitivity=dae.Adjoint(atol=1e-8 * scale, fallback=False))
    return sol.qs[-1, 0]


_robertson_G_value_and_grad = jax.jit(jax.value_and_grad(robertson_G))


def robertson_G_grad(p, rtol, t1=4e10):
    """(G, ∇G) to idasRoberts_ASAi_dns's t1 = 4e10 by default. rtol and t1 are traced:
    every tolerance and horizon (the HVP test below uses 4e5)
    shares one compilation."""
    return _robertson_G_value_and_grad(p, rtol, t1)


def test_robertson_adjoint_vs_idas():
    """At IDAS's tolerances, IDAS's adjoint and forward-sensitivity answers differ by
    |ASA − FSA| (~1e-3 relative: 'the tolerance at work'); a third method at the same
    tolerance must agree with that pair to within the same spread (distance to the
    pair's midpoint ≤ |ASA − FSA|). G = 4.0000e10 to IDAS's 5 digits. The objective
    depends on the algebraic y3 (CasADi's IDAS adjoint fails here)."""
    G, grad = robertson_G_grad(ROBERTSON_P, 1e-6)
    np.testing.assert_allclose(float(G), 4.0000e10, rtol=5e-5)
    spread = np.abs(IDAS_ASA - IDAS_FSA)
    mid = (IDAS_ASA + IDAS_FSA) / 2
    assert np.all(np.abs(np.asarray(grad) - mid) <= spread), np.asarray(grad)


def test_robertson_adjoint_converges():
    """Tightening rtol 100x twice: the gradient at rtol 1e-8 is within 1e-5 relative of
    the one at 1e-10 (error ∝ rtol), and the rtol-1e-6 gradient within 1e-4 of it — more
    accurate than IDAS's own pair at that tolerance, whose ASA number is 1.2e-4 from the
    converged value (and FSA 1.2e-3); so the converged value lies just outside
    [ASA, FSA], as finite differences at rtol 1e-11 also show (dG/dp1 ≈ 1.4877e6).
    (Central differences are not asserted here: G = 4e10 makes them noisy at the 1e-3
    level for p2, p3; the nonlinear index-1 test below checks against them.)"""
    _, g6 = robertson_G_grad(ROBERTSON_P, 1e-6)
    _, g8 = robertson_G_grad(ROBERTSON_P, 1e-8)
    _, g10 = robertson_G_grad(ROBERTSON_P, 1e-10)
    g6, g8, g10 = np.asarray(g6), np.asarray(g8), np.asarray(g10)
    assert np.all(np.abs(g8 - g10) <= 1e-5 * np.abs(g10)), (g8, g10)
    assert np.all(np.abs(g6 - g10) <= 1e-4 * np.abs(g10)), (g6, g10)


# Forward mode and second order on R1, in this module with the compiled gradient program
# they compare with (tests/test_transformations.py has the other transformations; in
# one module the program compiles once in the suite, not once per module).
ROB_ATOL = jnp.array([1e-8, 1e-14, 1e-6])     # idasRoberts_FSA_dns / _ASAi_dns


@jax.jit
def robertson_G_forward(p, rtol):
    """dG/dp for G = ∫ y3 by forward sensitivities (jacfwd) at IDAS's FSA settings."""
    def G(p):
        return dae.solve(robertson, 0.0, 4e10, ROBERTSON_Y0, ROBERTSON_YP0, p,
                         algebraic=ROBERTSON_ALGEBRAIC, rtol=rtol,
                         atol=ROB_ATOL * rtol / 1e-6, quadrature=lambda t, y, yp, p: y[2:3],
                         quad_error_control=True).qs[-1, 0]
    return jax.jacfwd(G)(p)


def test_jacfwd_of_G_agrees_with_the_adjoint():
    """Forward mode and the adjoint are two methods at the same tolerance: at rtol 1e-6
    they must agree within the spread IDAS's own FSA and ASA runs show there
    (|ASA − FSA|, ~1e-3 relative); and as the tolerance tightens forward mode converges
    to the adjoint's converged gradient (within 1e-4 relative at rtol 1e-8: the
    global-error bound 100·rtol of the forward tests)."""
    fwd6 = np.asarray(robertson_G_forward(ROBERTSON_P, 1e-6))
    _, adj6 = robertson_G_grad(ROBERTSON_P, 1e-6)
    assert np.all(np.abs(fwd6 - np.asarray(adj6)) <= np.abs(IDAS_ASA - IDAS_FSA)), (fwd6, adj6)
    fwd8 = np.asarray(robertson_G_forward(ROBERTSON_P, 1e-8))
    _, adj10 = robertson_G_grad(ROBERTSON_P, 1e-10)
    np.testing.assert_allclose(fwd8, np.asarray(adj10), rtol=1e-4)


def hvp_vs_fd(hvp, grad, x, v, rtol_hvp, rtol_fd, eps):
    """(hvp(x, v), central difference of grad along v with step eps)."""
    h = np.asarray(hvp(x, v, rtol_hvp))
    fd = (np.asarray(grad(x + eps * v, rtol_fd)) - np.asarray(grad(x - eps * v, rtol_fd))) / (2 * eps)
    return h, fd


# G = ∫_0^{4e5} y3 (a horizon over which the second-order adjoint is well conditioned;
# see docs on the cost at t ~ 1e10), the G above with the horizon traced: the
# differenced gradients are the compiled gradient program of the tests above.
ROB_HVP_T1 = 4e5
_rob_hvp = jax.jit(lambda p, v, r: jax.jvp(lambda q: jax.grad(robertson_G)(q, r, ROB_HVP_T1),
                                           (p,), (v,))[1])


def _rob_grad(p, rtol):
    return robertson_G_grad(p, rtol, ROB_HVP_T1)[1]


def test_hvp_robertson_against_differences_of_adjoint_gradients():
    """jvp(grad G) (forward over adjoint) in a direction v that moves every rate constant
    by a relative amount, at rtol 1e-8, against central differences of adjoint gradients
    (ε = 1e-3 relative, gradients at rtol 1e-10): FD truncation ~ε² ~ 1e-6, noise ~1e-8/ε
    = 1e-5 relative, the HVP's own error ~100·rtol = 1e-6: agree to 5e-5 relative."""
    v = ROBERTSON_P * jnp.array([1.0, -1.0, 0.5])
    h, fd = hvp_vs_fd(_rob_hvp, _rob_grad, ROBERTSON_P, v, 1e-8, 1e-10, 1e-3)
    np.testing.assert_allclose(h, fd, rtol=5e-5)


@jax.jit
def _robertson_y1_final(p, rtol):
    return dae.solve(robertson, 0.0, 4e10, ROBERTSON_Y0, ROBERTSON_YP0, p,
                     algebraic=ROBERTSON_ALGEBRAIC, rtol=rtol,
                     atol=jnp.array([1e-10, 1e-14, 1e-8]) * rtol / 1e-6,
                     sensitivity=CONTINUOUS).ys[-1, 0]


def test_adjoint_boundary_layer_at_late_times():
    """A cotangent on y1(4e10) excites the adjoint's fast mode (rate ~1e4): its boundary
    layer needs first steps of ~1e-8, below the float spacing of t near 4e10. The
    adjoint used to fail (adjoint_failed, step size too small at once; also for any
    output after t = 4e8); it now runs in the restart-relative time s = t_r − t. The
    gradient at rtol 1e-6 is within 100·rtol of the forward-sensitivity Jacobian at
    rtol 1e-10 (forward sensitivities are checked against IDAS's FSA values in
    test_transformations.py); measured 3e-6."""
    # jitted: one program each (eagerly, the gradient's forward and backward parts
    # compile separately)
    g = np.asarray(jax.jit(jax.grad(_robertson_y1_final))(ROBERTSON_P, 1e-6))
    ref = np.asarray(jax.jit(jax.jacfwd(_robertson_y1_final))(ROBERTSON_P, 1e-10))
    np.testing.assert_allclose(g, ref, rtol=100 * 1e-6)


# --------------------------------------------------- R2/R3: state-dependent mass matrix
@jax.jit
def r2_grad(y0, rtol):
    return jax.grad(lambda y0: dae.solve(mass_index0, 0.0, 1.57, y0, jnp.array([1.0, 0.0]),
                                         rtol=rtol, atol=rtol * 1e-2,
                                         sensitivity=CONTINUOUS).ys[-1].sum())(y0)


@jax.jit
def r3_grad(y0, rtol):
    return jax.grad(lambda y0: dae.solve(mass_index1, 0.0, 1.0, y0, jnp.array([-1.0, 0.0]),
                                         algebraic=jnp.array([False, True]), rtol=rtol,
                                         atol=rtol * 1e-2, sensitivity=CONTINUOUS).ys[-1].sum())(y0)


@pytest.mark.parametrize("rtol", [1e-7, 1e-9])
def test_r2_index0_mass_matrix(rtol):
    """True dg/dy(0) = (−0.999203356, 1.00079601) (Li & Petzold, DASPKADJOINT, Table 2, needs the augmented
    adjoint). At the paper's rtol 1e-7 / atol 1e-9 DASPKADJOINT was 4.4e-7 off; we ask
    100·rtol (the forward global-error bound that the adjoint inherits), which at 1e-9
    means the paper's 7 digits."""
    g = np.asarray(r2_grad(jnp.array([0.0, 1.0]), rtol))
    np.testing.assert_allclose(g, [-0.999203356, 1.00079601], rtol=0, atol=100 * rtol)


@pytest.mark.parametrize("rtol", [1e-7, 1e-9])
def test_r3_index1_mass_matrix(rtol):
    """g = y1 + y2 at T = 1 depends on the algebraic y2; only y1(0) is free: dg/dy1(0) =
    2/e exactly, and the algebraic y2(0) gets zero (it is determined by y1(0))."""
    g = np.asarray(r3_grad(jnp.array([1.0, 2.0]), rtol))
    assert abs(g[0] - 2 / np.e) <= 100 * rtol
    assert g[1] == 0.0


# ------------------------------------------ nonlinear index-1 DAE vs finite differences
def kinetics(t, y, yp, p):
    """Semi-explicit index 1: y3 solves the cubic y3³ + y3 = y1 + p4 y2 (∂/∂y3 > 0)."""
    return jnp.stack([
        yp[0] + p[0] * y[0] - p[1] * y[1] * y[2],
        yp[1] - p[0] * y[0] + p[1] * y[1] * y[2] + p[2] * y[1],
        y[2] ** 3 + y[2] - y[0] - p[3] * y[1],
    ])


KIN_TS = jnp.array([0.5, 1.0, 2.0, 3.0])
KIN_W = jnp.array([[1.0, -0.5, 2.0], [0.3, 0.0, -1.0], [0.0, 1.5, 0.7], [-0.4, 0.2, 1.0]])


def _kinetics_loss(theta, rtol, sensitivity=None):
    """Observations on every component (incl. the algebraic y3) at 4 times, y' of a
    differential component, and an integral of y3²; θ = (p1..p4, y1(0), y2(0))."""
    p, y0d = theta[:4], theta[4:]
    y0 = jnp.concatenate([y0d, jnp.zeros(1)])
    sol = dae.solve(kinetics, 0.0, 3.0, y0, jnp.zeros(3), p, saveat=KIN_TS,
                    algebraic=jnp.array([False, False, True]), init="ya_ydp",
                    quadrature=lambda t, y, yp, p: y[2:3] ** 2, quad_error_control=True,
                    rtol=rtol, atol=rtol, sensitivity=sensitivity)
    return (jnp.sum(KIN_W * sol.ys) + jnp.sum(jnp.sin(sol.ys[:, 2]))
            + 0.7 * sol.yps[1, 0] + sol.qs[-1, 0])


kinetics_loss = jax.jit(_kinetics_loss)
# The continuous adjoint alone (CONTINUOUS above).
kinetics_grad = jax.jit(jax.grad(functools.partial(_kinetics_loss, sensitivity=CONTINUOUS)))


def test_index1_gradient_matches_finite_differences():
    """Adjoint gradient at rtol 1e-10 vs central differences with step 1e-4 at rtol 1e-12:
    truncation ~1e-8, solver noise ~1e-12/1e-4 = 1e-8; allow 1e-6 relative to the
    gradient's size (the adjoint's own error at rtol 1e-10 is ~100·rtol)."""
    theta = jnp.array([0.8, 2.0, 0.3, 0.5, 1.0, 0.2])
    grad = np.asarray(kinetics_grad(theta, 1e-10))
    f = lambda th: float(kinetics_loss(th, 1e-12))  # noqa: E731
    eps = 1e-4
    fd = np.array([(f(theta.at[i].add(eps)) - f(theta.at[i].add(-eps))) / (2 * eps)
                   for i in range(theta.shape[0])])
    np.testing.assert_allclose(grad, fd, rtol=0, atol=1e-6 * np.max(np.abs(fd)))


# Slow (~50 s of compilation; the default suite's budget): jit(vmap(grad)) through the
# continuous adjoint, members taking their own steps, stays checked by default against
# exact derivatives in test_closures.py::test_jit_vmap_grad_of_a_closure_gives_every_member_its_gradient
# and test_events.py::test_vmap_members_with_different_events_and_none (and with a failed
# member in test_failed_batch_member_gets_nan_derivatives).
@pytest.mark.slow
def test_batched_gradients_under_vmap():
    """jax.vmap of jax.grad equals per-member gradients, to 20 tolerance units (members
    take their own steps; see the forward vmap test for why not bitwise)."""
    thetas = jnp.array([[0.8, 2.0, 0.3, 0.5, 1.0, 0.2], [1.2, 1.0, 0.5, 0.2, 0.5, 0.4]])
    batched = jax.jit(jax.vmap(jax.grad(kinetics_loss), in_axes=(0, None)))(thetas, 1e-8)
    for i in range(2):
        single = kinetics_grad(thetas[i], 1e-8)
        np.testing.assert_allclose(batched[i], single, rtol=2e-7, atol=2e-7)


# ------------------------------------------------- DiscreteAdjoint (frozen step sequence)
@jax.jit
def r4_discrete(c, rtol):
    def psi(c, v0):
        sol = dae.solve(oscillator, 0.0, jnp.pi / 2, jnp.stack([0.0, v0]), jnp.stack([v0, 0.0]),
                        jnp.stack([c]), quadrature=x1, quad_error_control=True, rtol=rtol,
                        atol=rtol, max_steps=2000, sensitivity=dae.DiscreteAdjoint())
        return sol.ys[-1, 0], sol.qs[-1, 0]

    return jax.jacrev(psi, argnums=(0, 1))(c, 0.5)


# Slow (~12 s of compilation; the default suite's budget): the discrete adjoint stays
# checked by default against exact derivatives of R4 (through jax.hessian, in
# test_user_inputs_and_messages.py::test_hessian_with_discrete_adjoint) and of R3 (in
# test_discrete_adjoint_recomputing_steps below), and with a quadrature, in
# test_discrete_adjoint_index1_and_finite_differences below.
@pytest.mark.slow
def test_discrete_adjoint_exact_oscillator():
    """The discrete adjoint differentiates the discrete map with h_n frozen (Eberhard & Bischof's
    remedy ∇h = 0): it converges to the exact R4 derivatives like the solution does,
    within 100·rtol."""
    rtol = 1e-8
    (d1c, d1v), (d2c, d2v) = r4_discrete(1.0, rtol)
    for want, got in [(-0.25, d1c), (1.0, d1v), (np.pi / 8 - 0.5, d2c), (1.0, d2v)]:
        assert abs(float(got) - want) <= 100 * rtol, (want, float(got))


def test_discrete_adjoint_index1_and_finite_differences():
    """On the nonlinear index-1 kinetics loss (observations of algebraic components, y',
    quadrature, init="ya_ydp") the discrete and continuous gradients agree at rtol 1e-10
    to the same 1e-6 the finite-difference test uses. (R3 — an observation of an
    algebraic component, fully implicit index 1 — against its exact gradient:
    `test_discrete_adjoint_recomputing_steps`, with both ways of storing the steps.)"""
    def loss(theta, sens):
        p, y0d = theta[:4], theta[4:]
        sol = dae.solve(kinetics, 0.0, 3.0, jnp.concatenate([y0d, jnp.zeros(1)]), jnp.zeros(3),
                        p, saveat=KIN_TS, algebraic=jnp.array([False, False, True]),
                        init="ya_ydp", quadrature=lambda t, y, yp, p: y[2:3] ** 2,
                        quad_error_control=True, rtol=1e-10, atol=1e-10, max_steps=5000,
                        sensitivity=sens)
        return (jnp.sum(KIN_W * sol.ys) + jnp.sum(jnp.sin(sol.ys[:, 2]))
                + 0.7 * sol.yps[1, 0] + sol.qs[-1, 0])

    theta = jnp.array([0.8, 2.0, 0.3, 0.5, 1.0, 0.2])
    gd = np.asarray(jax.jit(jax.grad(loss), static_argnums=1)(theta, dae.DiscreteAdjoint()))
    gc = np.asarray(kinetics_grad(theta, 1e-10))
    np.testing.assert_allclose(gd, gc, rtol=0, atol=1e-6 * np.max(np.abs(gc)))


def test_time_gradients():
    """x1(t1) = v0 sin(t1 − t0) for x(t0) = (0, v0), c = 1: d/dt1 = v0 cos(t1 − t0) (the
    cotangent times y'(t1), here through the default saveat = [t1]) and d/dt0 =
    −v0 cos(t1 − t0) (moving the start with y(t0) fixed). ∫_{t0}^{t1} x1 = v0(1 − cos(t1 −
    t0)) gives ∓v0 sin(t1 − t0). Within 100·rtol as the other exact checks."""
    rtol = 1e-8
    # The R4 tests' program (c = 1, v0 = 0.5, no tstop), times traced.
    (_, _, dx_dt0, dx_dt1), (_, _, dq_dt0, dq_dt1) = _r4_grads(1.0, 0.5, 0.2, 1.3, rtol, np.inf)
    c, s = 0.5 * np.cos(1.1), 0.5 * np.sin(1.1)
    for got, want in [(dx_dt1, c), (dx_dt0, -c), (dq_dt1, s), (dq_dt0, -s)]:
        assert abs(float(got) - want) <= 100 * rtol, (float(got), want)


def test_init_y_gradient_semantics():
    """init="y" computes y0 from y'0: F = (y1' + y1 − p, y2 − y1²) with y1'(0) = c gives
    y1(0) = p − c and y1(t) = p − c e^{−t}, so d y1(1)/dc = −1/e, d y1(1)/dp = 1, and the
    (recomputed) y0 gets zero cotangent. Within 100·rtol as the other exact checks."""
    rtol = 1e-9

    def y1_end(y0, c, p):
        sol = dae.solve(lambda t, y, yp, p: jnp.stack([yp[0] + y[0] - p, y[1] - y[0] ** 2]),
                        0.0, 1.0, y0, jnp.stack([c, 0.0]), p,
                        algebraic=jnp.array([False, True]), init="y", rtol=rtol, atol=rtol,
                        sensitivity=CONTINUOUS)
        return sol.ys[-1, 0]

    g_y0, g_c, g_p = jax.jit(jax.grad(y1_end, argnums=(0, 1, 2)))(jnp.zeros(2), 0.3, 2.0)
    assert abs(float(g_c) + np.exp(-1.0)) <= 100 * rtol
    assert abs(float(g_p) - 1.0) <= 100 * rtol
    assert np.all(np.asarray(g_y0) == 0.0)


# ------------------------------------------------------------- the kept last segment
def _chain(t, y, yp, p):
    """12 unknowns (enough for the forward run to keep its last segment, see
    `SegmentRecorder.pays`): a damped chain y'_i = p0 (y_{i−1} − y_i) − p1 y_i, y_0' =
    −p1 y_0, and an algebraic y_11 = Σ_{i<11} y_i² (index 1)."""
    d = yp[:11] + p[1] * y[:11] - p[0] * jnp.concatenate([jnp.zeros(1), y[:10] - y[1:11]])
    return jnp.concatenate([d, (y[11] - jnp.sum(y[:11] ** 2))[None]])


def _chain_loss(p, interpolation, keep_bytes=0):
    y0 = jnp.concatenate([jnp.linspace(1.0, 0.5, 11), jnp.zeros(1)])
    sol = dae.solve(_chain, 0.0, 5.0, y0, jnp.zeros(12), p, init="ya_ydp",
                    algebraic=jnp.arange(12) == 11, saveat=jnp.array([0.7, 2.0, 5.0]),
                    event=dae.Event(lambda t, y, yp, p: y[11] - 2.0, direction=-1),
                    sensitivity=dae.Adjoint(checkpoint_every=4, interpolation=interpolation,
                                            keep_bytes=keep_bytes),
                    rtol=1e-6, atol=1e-8)
    rows = jnp.where(jnp.isfinite(sol.ys), sol.ys, 0.0)
    return jnp.sum(rows[:, [0, 5, 11]]) + sol.event_ts[0]


# Slow (~55 s: two traces and compilations of the gradient; the default suite's budget).
# The kept segment is what every continuous adjoint of n ≥ 11 unknowns uses; by default it
# stays checked against an exact derivative in test_singular_mass_matrix.py (n = 201,
# `test_large_semi_explicit_dae_without_a_mask_continuous_adjoint`, no fallback).
@pytest.mark.slow
@pytest.mark.parametrize("interpolation", ["hermite", "bdf"])
def test_kept_last_segment_equals_its_replay(interpolation, monkeypatch):
    """The forward run keeps its last checkpoint segment for the backward pass instead
    of having it replayed; the replay repeats the original steps bit for bit, so the
    gradient must be *identical* with the kept segment and with the replay. Here with
    several segments (checkpoint_every=4), a terminal event in the last one, outputs
    and an algebraic component. The jaxprs differ by the kept ring (checkpoint_every + 1
    rows of 12), which proves both paths ran."""
    from daeadjoint._integrator import SegmentRecorder

    p = jnp.array([0.9, 0.2])
    grad = jax.jit(jax.grad(_chain_loss), static_argnums=1)

    def run():
        jax.clear_caches()      # trace anew: `pays` is consulted while tracing
        return (np.asarray(grad(p, interpolation)),
                str(jax.make_jaxpr(jax.grad(_chain_loss), static_argnums=1)(p, interpolation)))

    g_kept, jaxpr_kept = run()
    monkeypatch.setattr(SegmentRecorder, "pays", staticmethod(lambda state: False))
    g_replayed, jaxpr_replayed = run()
    assert "f64[5,12]" in jaxpr_kept and "f64[5,12]" not in jaxpr_replayed
    assert np.all(np.isfinite(g_kept)) and np.any(g_kept != 0)
    np.testing.assert_array_equal(g_kept, g_replayed)


# Slow (~80 s: three traces and compilations of the gradient), like the test above.
@pytest.mark.slow
def test_kept_trajectory_equals_its_replay():
    """`Adjoint(keep_bytes=...)`: the forward run keeps the Hermite nodes of its first
    S whole segments and the backward pass reads them instead of replaying the segments;
    the replay repeats the original steps bit for bit, so the gradient must be
    *identical* with every segment kept (a budget of 256 KiB), with only the first two
    kept and the rest replayed, and with every segment replayed (keep_bytes=0). Chain
    problem of the test above (n = 12, checkpoint_every=4, a terminal event, outputs, an
    algebraic component). The budget's rule gives the kept buffer's rows: S·4 + 9 with
    S = ⌊(⌊keep_bytes / ((2n + 1)·8)⌋ − 9) / 4⌋; the jaxprs show them, which proves the
    paths ran."""
    p = jnp.array([0.9, 0.2])
    grad = jax.jit(jax.grad(_chain_loss), static_argnums=(1, 2))

    def run(keep_bytes):
        jaxpr = str(jax.make_jaxpr(jax.grad(_chain_loss), static_argnums=(1, 2))(
            p, "hermite", keep_bytes))
        return np.asarray(grad(p, "hermite", keep_bytes)), jaxpr

    def rows(keep_bytes):
        return ((keep_bytes // (25 * 8) - 9) // 4) * 4 + 9

    default = 256 * 1024                # every segment of this run
    two = (9 + 2 * 4) * 25 * 8          # S = 2
    g_all, jaxpr_all = run(default)
    g_two, jaxpr_two = run(two)
    g_none, jaxpr_none = run(0)
    assert f"f64[{rows(default)},12]" in jaxpr_all and rows(default) > 1000
    assert f"f64[{rows(two)},12]" in jaxpr_two and rows(two) == 17
    assert f"f64[{rows(two)},12]" not in jaxpr_none and f"f64[{rows(default)},12]" not in jaxpr_none
    assert np.all(np.isfinite(g_none)) and np.any(g_none != 0)
    np.testing.assert_array_equal(g_all, g_none)
    np.testing.assert_array_equal(g_two, g_none)


def _robertson(t, y, yp, p):
    r1 = -p[0] * y[0] + p[2] * y[1] * y[2]
    r2 = p[0] * y[0] - p[2] * y[1] * y[2] - p[1] * y[1] ** 2
    return jnp.stack([yp[0] - r1, yp[1] - r2, y[0] + y[1] + y[2] - 1.0])


def _robertson_loss(p, keep_bytes):
    sol = dae.solve(_robertson, 0.0, 4e5, jnp.array([1.0, 0.0, 0.0]),
                    jnp.array([-p[0], p[0], 0.0]), p, algebraic=jnp.array([False, False, True]),
                    saveat=jnp.array([1.0, 100.0, 4e5]), rtol=1e-6,
                    atol=jnp.array([1e-8, 1e-12, 1e-8]), quadrature=lambda t, y, yp, p: y[2:3],
                    sensitivity=dae.Adjoint(atol=1e-8, keep_bytes=keep_bytes,
                                            checkpoint_every=7))
    return sol.qs[-1, 0] + jnp.sum(sol.ys[:, 1])


# Slow (~80 s: three compilations of the gradient), like the test above.
@pytest.mark.slow
def test_kept_robertson_steps_equal_their_replay():
    """The kept steps of a small system (Robertson, n = 3) are recorded through a stage
    of 20 steps (≤ 512 bytes) in the step loop, appended when it is full and at every
    output time: with checkpoint_every=7 the stage boundaries fall inside checkpoint
    segments and between output times. The gradient must be identical (bit for bit:
    the replay repeats the forward steps) with every step kept, with two segments kept
    and the rest replayed, and with every segment replayed."""
    p = jnp.array([0.04, 3e7, 1e4])
    grad = jax.jit(jax.grad(_robertson_loss), static_argnums=1)
    g_none = np.asarray(grad(p, 0))
    g_all = np.asarray(grad(p, 256 * 1024))
    g_two = np.asarray(grad(p, (9 + 2 * 7 + 1) * 7 * 8))
    # The kept buffer's rows, S·7 + 9 (the rule of the test above, (2n + 1)·8 = 56 bytes
    # a node), in the traced program: the kept path ran.
    jaxpr = str(jax.make_jaxpr(jax.grad(_robertson_loss), static_argnums=1)(p, 256 * 1024))
    assert f"f64[{((256 * 1024 // 56 - 9) // 7) * 7 + 9},3]" in jaxpr
    assert np.all(np.isfinite(g_none)) and np.all(g_none != 0)
    np.testing.assert_array_equal(g_all, g_none)
    np.testing.assert_array_equal(g_two, g_none)


# Slow (8.5 min at load ~6: six compilations, two of them of a Hessian), like the test above.
@pytest.mark.slow
def test_kept_steps_under_vmap_jacfwd_and_hessian(monkeypatch):
    """The kept forward steps under the other transformations, on the Robertson loss of
    the test above: vmap(grad) (every member keeps its own steps) and jax.hessian
    (forward over adjoint: the vjp of the augmented DAE's solve keeps that solve's
    steps) give the same results bit for bit with every step kept (256 KiB) as with
    every segment replayed (keep_bytes=0) — the replay repeats the forward steps bit
    for bit. The kept path ran (a `TrajectoryRecorder` was created while tracing); and
    jax.jacfwd (forward sensitivities) records no steps at all, so keeping none and
    keeping all give the same Jacobian."""
    from daeadjoint._derivatives.adjoint import TrajectoryRecorder

    created = []
    real = TrajectoryRecorder.create.__func__
    monkeypatch.setattr(TrajectoryRecorder, "create", classmethod(
        lambda cls, *a: created.append(a[-1]) or real(cls, *a)))
    p = jnp.array([0.04, 3e7, 1e4])
    ps = jnp.stack([p, p * jnp.array([1.5, 1.0, 0.7])])
    modes = {
        "vmap(grad)": (jax.vmap(jax.grad(_robertson_loss), in_axes=(0, None)), ps),
        "hessian": (jax.hessian(_robertson_loss), p),
        "jacfwd": (jax.jacfwd(_robertson_loss), p),
    }
    for name, (f, x) in modes.items():
        f = jax.jit(f, static_argnums=1)
        del created[:]
        none = np.asarray(f(x, 0))
        assert created == [], name
        kept = np.asarray(f(x, 256 * 1024))
        assert (created != []) == (name != "jacfwd"), (name, created)
        assert np.all(np.isfinite(none)) and np.any(none != 0), name
        np.testing.assert_array_equal(kept, none, err_msg=name)


def _square_wave_decay(t, y, yp, a):
    """y' = −a y + u(t), u a square wave of period 1: a kink every half period, where
    attempted steps overshoot and fail the error test."""
    return yp + a * y - jnp.where(jnp.mod(t, 1.0) < 0.5, 1.0, -1.0)


# The runs of `_square_wave_forward`, by `every`: the tests below replay the same run
# (one compiled forward program for all of them instead of one per test).
_SQUARE_WAVE_RUNS: dict = {}


def _square_wave_forward(every, monkeypatch):
    """The recording forward run of `_square_wave_decay` over 0 … 10 (rtol 1e-8,
    checkpoints every `every` steps), every step kept too: (dense steps, the recording,
    the problem a replay integrates, its max_steps). Computed once per `every` (before
    any test patches the module: the callers patch only after it returns)."""
    if every not in _SQUARE_WAVE_RUNS:
        _SQUARE_WAVE_RUNS[every] = _square_wave_run(every, monkeypatch)
    return _SQUARE_WAVE_RUNS[every]


def _square_wave_run(every, monkeypatch):
    import dataclasses

    import daeadjoint._solve as solve_module
    from daeadjoint._core import build_problem, run_forward

    got = {}

    class Captured(Exception):
        pass

    def capture(config, inputs):   # the solve's configuration, as `solve` builds it
        got.update(config=config, inputs=inputs)
        raise Captured

    with monkeypatch.context() as m:
        m.setattr(solve_module, "_solve_compiled", capture)
        with pytest.raises(Captured):
            dae.solve(_square_wave_decay, 0.0, 10.0, jnp.ones(1), args=jnp.asarray(3.0),
                      rtol=1e-8, atol=1e-8, sensitivity=dae.Adjoint(checkpoint_every=every))
    config = dataclasses.replace(got["config"], dense=1)   # also keep every step
    core, rec = jax.jit(lambda i: run_forward(config, i, record=True))(got["inputs"])
    problem = build_problem(config, dataclasses.replace(got["inputs"], y0=rec.y0, yp0=rec.yp0))
    return core.dense, rec, problem, config.max_steps


def test_every_replayed_segment_repeats_the_forward_steps(monkeypatch):
    """The backward pass replays each checkpoint segment; its steps must be the forward
    run's, bit for bit. The replay used to stop at the segment's end (tstop), which
    shortened every attempt that overshot it: the forward run had tried those and,
    failing, chosen other steps. Here 38 of 168 segments of a square-wave-driven decay
    came out different (and on the Test Set's NAND gate at rtol 1e-8 a replay
    overflowed its buffer, so the gradient was NaN)."""
    from daeadjoint._derivatives.adjoint import replay_segment
    from daeadjoint._integrator import StepRecorder, segment_capacity

    every = 10
    steps, rec, problem, max_steps = _square_wave_forward(every, monkeypatch)
    cks = rec.checkpoints
    buf0 = StepRecorder.create(segment_capacity(every), 1, jnp.float64)

    @jax.jit
    def replay(i):
        ck = jax.tree_util.tree_map(lambda x: x[i], cks.states)
        return replay_segment(problem, ck, i, cks.states.t[i + 1], rec.yp0, buf0, max_steps)

    n_full = int(steps.count) // every   # segments that end on a checkpoint
    assert n_full > 100
    differ = []
    for i in range(n_full):
        buf, ok = replay(i)
        span = slice(i * every, (i + 1) * every + 1)
        if not (bool(ok) and int(buf.count) == every
                and np.array_equal(buf.t[:every + 1], steps.t[span])
                and np.array_equal(buf.y[:every + 1], steps.y[span])):
            differ.append(i)
    assert differ == []


@pytest.mark.parametrize("hermite, limit", [(True, 32), (False, 150)], ids=["hermite", "bdf"])
def test_staged_replay_records_what_the_unstaged_one_does(hermite, limit, monkeypatch):
    """A replay records its steps into a small stage in the step loop and appends the
    stage to the segment's buffer every few steps (`StepRecorder.stage`, `append`).
    With a stage of 3 steps here (each of its arrays within `limit` bytes), every
    segment of 10 steps (with error-test failures at the square wave's kinks) spans
    four stages; the buffer must hold exactly what recording every step into it
    (no stage: a limit of 0) gives, nodes, BDF histories and step log alike."""
    from daeadjoint._derivatives import adjoint as adjoint_module
    from daeadjoint._integrator import StepRecorder, segment_capacity

    every = 10
    steps, rec, problem, max_steps = _square_wave_forward(every, monkeypatch)
    cks = rec.checkpoints
    buf0 = StepRecorder.create(segment_capacity(every), 1, jnp.float64, hermite=hermite,
                               per_step=False, log=True)
    assert buf0.stage(limit).t.shape[0] - 1 == 3 and buf0.stage(0) is None

    def replayer(stage_limit):
        """The replay compiled with the stage's size limit `stage_limit` (read while
        tracing; a new function each time, so that nothing traced is reused)."""
        def replay(i):
            ck = jax.tree_util.tree_map(lambda x: x[i], cks.states)
            return adjoint_module.replay_segment(problem, ck, i, cks.states.t[i + 1], rec.yp0,
                                                 buf0, max_steps)

        monkeypatch.setattr(adjoint_module, "SEQUENTIAL_BUFFER_BYTES", stage_limit)
        return jax.jit(replay).lower(jnp.int32(0)).compile()

    staged, unstaged = replayer(limit), replayer(0)
    n_full = int(steps.count) // every
    differ = []
    for i in range(n_full):
        a, b = staged(jnp.int32(i)), unstaged(jnp.int32(i))
        if not (bool(a[1]) and int(a[0].count) == every and all(
                np.array_equal(x, y) for x, y in zip(jax.tree_util.tree_leaves(a),
                                                     jax.tree_util.tree_leaves(b)))):
            differ.append(i)
    assert differ == []


def test_discrete_adjoint_recomputing_steps(monkeypatch):
    """Above `STORED_FACTORS_LIMIT` numbers of linear-solver setups per segment the
    discrete adjoint recomputes each replayed step in its backward pass instead of keeping it
    (`jax.checkpoint`). Forced here on R3 (limit 0) with segments of 7 steps: the same
    gradient as the stored path (the recomputation repeats the same arithmetic; 1e-12
    relative leaves room for the compiler ordering it differently), and both are R3's
    exact gradient: g = y1 + y2 at T = 1 observes the algebraic y2 (fully implicit index
    1), dg/dy1(0) = 2/e within 100·rtol (as the exact-solution tests), and the algebraic
    y2(0) gets zero (it is determined by y1(0))."""
    from daeadjoint._derivatives import discrete_adjoint

    def grad():     # a new function each time: traced again under the patched limit
        return np.asarray(jax.jit(jax.grad(lambda y0: dae.solve(
            mass_index1, 0.0, 1.0, y0, jnp.array([-1.0, 0.0]),
            algebraic=jnp.array([False, True]), rtol=1e-9, atol=1e-11, max_steps=2000,
            sensitivity=dae.DiscreteAdjoint(segment=7)).ys[-1].sum()))(jnp.array([1.0, 2.0])))

    kept = grad()
    assert abs(kept[0] - 2 / np.e) <= 100 * 1e-9 and kept[1] == 0.0
    monkeypatch.setattr(discrete_adjoint, "STORED_FACTORS_LIMIT", 0)
    recomputed = grad()
    np.testing.assert_allclose(recomputed, kept, rtol=1e-12, atol=0)
    assert abs(recomputed[0] - 2 / np.e) <= 100 * 1e-9 and recomputed[1] == 0.0


def _decay_end(k, adjoint):
    """y(1) of y' = −k y, y(0) = 1 (rtol = atol = 1e-8)."""
    return dae.solve(lambda t, y, yp, a: yp + a * y, 0.0, 1.0, jnp.ones(1), args=k,
                     rtol=1e-8, atol=1e-8, sensitivity=adjoint, throw=False).ys[-1, 0]


def test_fallback_whose_replay_fails_reports_the_failure(monkeypatch):
    """If the discrete pass of the fallback cannot replay a segment, its cotangents are
    incomplete: they must be reported as the failure (warning "failed too", NaN), never
    as a gradient. Every replay is forced to fail here (so the continuous pass fails
    first, and the discrete pass after it; keep_bytes=0, so that the continuous pass
    replays its segments instead of reading the kept forward steps)."""
    from daeadjoint._derivatives import adjoint as adjoint_module

    real = adjoint_module.replay_segment

    def failing_replay(*a, **kw):
        buf, _ = real(*a, **kw)
        return buf, jnp.zeros((), bool)

    monkeypatch.setattr(adjoint_module, "replay_segment", failing_replay)
    with pytest.warns(RuntimeWarning, match="failed too"):
        g = jax.grad(_decay_end)(0.7, dae.Adjoint(keep_bytes=0))
    assert np.isnan(float(g))


def _quadrature_decay(k, adjoint, n=1):
    """n copies of y' = −k y observed at 7 times with ∫ y₁² dt: loss Σ y(t_i) + ∫ y₁²."""
    sol = dae.solve(lambda t, y, yp, a: yp + a * y, 0.0, 2.0, jnp.ones(n), args=k,
                    saveat=jnp.linspace(0.0, 2.0, 7), quadrature=lambda t, y, yp, a: y[:1]**2,
                    rtol=1e-7, atol=1e-9, sensitivity=adjoint)
    return jnp.sum(sol.ys) + sol.qs[-1, 0]


def test_small_adjoint_sets_up_its_matrix_and_iterates_once_per_attempt(monkeypatch):
    """For small dense systems (A)'s iteration matrix is set up at every attempt and its
    one iteration is exact (`adjoint.fresh_matrix`): Newton iterations = Jacobian setups
    = attempts, none failing; the gradient is the exact one (`_quadrature_decay`, as in
    the fallback test below) to 100·rtol. Larger n reuses J (not run here: the choice
    is static, by the solver and n)."""
    from daeadjoint._derivatives import adjoint as adjoint_module
    from daeadjoint._linalg.linear_solver import UNROLLED_GAUSS_JORDAN_N, DenseLU
    assert adjoint_module.fresh_matrix(DenseLU(), UNROLLED_GAUSS_JORDAN_N)
    assert not adjoint_module.fresh_matrix(DenseLU(), UNROLLED_GAUSS_JORDAN_N + 1)
    counts = {}
    orig = adjoint_module.integrate

    def counted(problem, state, *a, **kw):
        out = orig(problem, state, *a, **kw)
        if isinstance(problem.linear_solver, adjoint_module.AdjointSolver):
            keys = ("num_steps", "num_error_test_failures", "num_nonlinear_convergence_failures",
                    "num_nonlinear_iters", "num_jacobian_evals")
            jax.debug.callback(lambda d: [counts.__setitem__(k, counts.get(k, 0) + int(v))
                                          for k, v in d.items()],
                               {k: out[0].stats[k] - state.stats[k] for k in keys})
        return out

    monkeypatch.setattr(adjoint_module, "integrate", counted)
    n, k = 2, 0.7
    g = float(jax.grad(_quadrature_decay)(k, dae.Adjoint(fallback=False), n))
    jax.effects_barrier()
    attempts = counts["num_steps"] + counts["num_error_test_failures"]
    assert counts["num_nonlinear_convergence_failures"] == 0, counts
    assert attempts > 10, counts
    assert counts["num_nonlinear_iters"] == counts["num_jacobian_evals"] == attempts, counts
    ts = np.linspace(0.0, 2.0, 7)
    exact = (n * np.sum(-ts * np.exp(-k * ts)) + 4 * np.exp(-4 * k) / (2 * k)
             - (1 - np.exp(-4 * k)) / (2 * k**2))
    assert abs(g - exact) <= 100 * 1e-7 * abs(exact)


# n = 12: the forward run keeps its last segment (`SegmentRecorder.pays`), which the
# continuous pass reads and the discrete pass replays.
@pytest.mark.parametrize("n", [1, 12])
def test_fallback_equals_the_discrete_adjoint_of_the_same_steps(n, monkeypatch):
    """A backward integration that cannot finish (here: 2 adjoint steps allowed) on a
    successful forward solve: the gradient comes from the discrete adjoint, with a
    warning, instead of NaN; without the fallback the failure is reported. The fallback
    is the discrete adjoint of the primal's own steps, segment by segment from its
    replays (segments of 7 steps: outputs and the quadrature cross many segment
    boundaries): the same gradient as `DiscreteAdjoint(segment=7)`, which differentiates
    the same steps from the primal's step log — equal up to the compiler ordering the
    same arithmetic differently (1e-12 relative) — and within 100·rtol of the exact one
    (as the exact-solution tests): d/dk [n Σ e^{−k t_i} + (1 − e^{−4k})/(2k)].

    The fallback's discrete adjoint replays every checkpoint segment (with the same
    replay loop as the continuous backward pass, which reads the segments the forward
    pass kept instead), with the primal's own steps: the gradient
    program contains the forward solve once. (It used to re-run the forward solve with
    a step log, a second program that could fail where the primal had succeeded: a run
    need not repeat to the last bit.) Counted in the same gradient's trace (the residual
    is a new function at each call, so nothing comes from JAX's caches)."""
    from daeadjoint import _core

    every, k = 7, 0.7
    runs = []
    real = _core.run

    def counted(*a, **kw):
        runs.append(kw.get("record", False))
        return real(*a, **kw)

    monkeypatch.setattr(_core, "run", counted)
    # The warning names the cause: the adjoint's own step budget.
    with pytest.warns(RuntimeWarning,
                      match=r"took Adjoint\(max_steps\) steps.*comes from the discrete adjoint"):
        g = float(jax.grad(_quadrature_decay)(k, dae.Adjoint(max_steps=2,
                                                             checkpoint_every=every), n))
    # One recording run: the primal's (custom_jvp also traces the primal function
    # without recording, a jaxpr the gradient program does not contain).
    assert runs.count(True) == 1
    monkeypatch.setattr(_core, "run", real)
    if n == 1:
        with pytest.raises(Exception, match=r"adjoint_failed.*Adjoint\(max_steps="):
            jax.grad(_quadrature_decay)(k, dae.Adjoint(max_steps=2, checkpoint_every=every,
                                                       fallback=False), n)
    gd = float(jax.grad(_quadrature_decay)(k, dae.DiscreteAdjoint(segment=every), n))
    assert abs(g - gd) <= 1e-12 * abs(gd)
    ts = np.linspace(0.0, 2.0, 7)
    exact = (n * np.sum(-ts * np.exp(-k * ts)) + 4 * np.exp(-4 * k) / (2 * k)
             - (1 - np.exp(-4 * k)) / (2 * k**2))
    assert abs(g - exact) <= 100 * 1e-7 * abs(exact)


def test_fallback_in_a_batch_only_where_the_continuous_adjoint_fails():
    """vmap over a batch in which one member's continuous adjoint fails (c = 0: the
    algebraic block of x' = z, 0 = x − p t + c z is singular, index 2) and the other's
    succeeds (c = 1: index 1): the first gets the discrete adjoint's gradient, the
    second the continuous one's. d(x(1) + z(1))/dp = 2 for c = 0 (x = p t, z = p; exact
    to rounding, bound 1e-9 as test_continuous_adjoint_singular_algebraic_block_reported)
    and 1 for c = 1 (z = p t − x: x + z = p at t = 1 whatever x; the continuous adjoint
    within 100·rtol)."""
    def out(p, c):
        sol = dae.solve(lambda t, y, yp, a: jnp.stack([yp[0] - y[1], y[0] - a[0] * t + a[1] * y[1]]),
                        0.0, 1.0, jnp.stack([0.0, p * (1 - c)]), jnp.stack([p * (1 - c), 0.0]),
                        args=jnp.stack([p, c]), rtol=1e-8, atol=1e-8)
        return sol.ys[-1, 0] + sol.ys[-1, 1]

    lowered = jax.jit(jax.vmap(jax.grad(out), in_axes=(None, 0))).lower(2.0, jnp.array([0.0, 1.0]))
    # One host callback for the batch's warning (the program's only side-effecting one),
    # not one per member: `jax.debug.callback` of batched operands is unrolled member by
    # member.
    warn_calls = [ln for ln in lowered.as_text().splitlines()
                  if "python_cpu_callback" in ln and "has_side_effect = true" in ln]
    assert len(warn_calls) == 1
    with pytest.warns(RuntimeWarning) as caught:
        g = lowered.compile()(2.0, jnp.array([0.0, 1.0]))
    # One warning, the singular member's; the other member did not fall back.
    fallbacks = [w for w in caught if "continuous adjoint failed" in str(w.message)]
    assert len(fallbacks) == 1 and "not index 1" in str(fallbacks[0].message)
    assert "max_steps" not in str(fallbacks[0].message)
    assert abs(float(g[0]) - 2.0) < 1e-9
    assert abs(float(g[1]) - 1.0) <= 100 * 1e-8


# ------------------------------------- the backward pass's consistency solves, undifferentiated
@pytest.mark.parametrize("transpose", [False, True])
def test_consistency_solve_without_derivative_rules_solves_the_consistency_matrix(transpose):
    """The adjoint's consistency solves (`_consistency.consistency_solve(...,
    differentiable=False)`, JAX never differentiates the backward pass) solve with
    C = F_y diag(m) + F_y' diag(1 − m), m the algebraic mask, or its transpose: against
    numpy's LAPACK solve of C built from the residual's analytic partial derivatives
    (Robertson's, written out here). They are the same factorization and solve as the
    differentiable form's, so equal to it bit for bit, and their program holds no
    `custom_linear_solve` (no matrix–vector products traced). Tolerance 1e-13 relative:
    C's condition number here is 1.3 and both sides are backward-stable pivoted
    eliminations (error ~ n · cond · eps ≈ 1e-15, in different operation orders)."""
    from daeadjoint._consistency import consistency_solve
    from daeadjoint._linalg.linear_solver import DenseLU

    p = jnp.asarray(ROBERTSON_P)
    y = jnp.array([0.9, 2.0e-5, 0.1])
    yp = jnp.array([-0.03, 1.0e-4, 0.0])
    mask = jnp.array([False, False, True])
    rhs = jnp.array([[1.0, -2.0, 0.5], [0.3, 0.7, -1.1]])
    k1, k2, k3 = (float(x) for x in ROBERTSON_P)
    y1, y2, y3 = (float(x) for x in y)
    Fy = np.array([[k1, -k2 * y3, -k2 * y2],
                   [-k1, k2 * y3 + 2 * k3 * y2, k2 * y2],
                   [1.0, 1.0, 1.0]])
    Fyp = np.diag([1.0, 1.0, 0.0])
    m = np.array([0.0, 0.0, 1.0])
    C = Fy * m[None, :] + Fyp * (1 - m)[None, :]
    want = np.linalg.solve(C.T if transpose else C, np.asarray(rhs).T).T

    def run(differentiable):
        return consistency_solve(DenseLU(), robertson, 0.0, y, yp, p, mask, rhs,
                                 transpose=transpose, differentiable=differentiable)

    x, singular = jax.jit(lambda: run(False))()
    x_diff, _ = jax.jit(lambda: run(True))()
    assert not bool(singular)
    np.testing.assert_allclose(x, want, rtol=1e-13, atol=0)
    assert np.array_equal(np.asarray(x), np.asarray(x_diff))
    assert "custom_linear_solve" not in str(jax.make_jaxpr(lambda: run(False))())
    assert "custom_linear_solve" in str(jax.make_jaxpr(lambda: run(True))())
