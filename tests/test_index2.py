"""Hessenberg index-2 DAEs (`solve(index2=...)`): forward accuracy against exact and
independent reference solutions, the Test Set's index-2 problems against their published
reference solutions, and clear errors for what is not index 2 or not consistent.

Bounds:
- differential variables within 100·rtol of the exact solution: the project's global
  error bound for a local error control (as in test_forward.py);
- index-2 variables within 1000·rtol: they are out of the error test and fixed by the
  hidden constraint, i.e. by y' — one order lower, the bound test_forward.py uses for
  y' of the dense output;
- Test Set problems: `scd` against the published reference (the slider crank: `mescd`
  of its positions, the Test Set's score), with the bound's source stated per problem.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.integrate import solve_ivp

import daeadjoint as dae
from .testset import FEKETE_ALPHA, crank, crank_reduced, fekete, mescd, tube


# ------------------------------------------------- a linear problem with closed form
def linear(t, y, yp, args):
    """x1' = z − x2, x2' = z − 2 x2, 0 = x1 − sin t (index 2: g_x f_z = 1)."""
    del args
    return jnp.stack([yp[0] + y[1] - y[2], yp[1] + 2.0 * y[1] - y[2], y[0] - jnp.sin(t)])


def linear_exact(t):
    """x1 = sin t; the hidden constraint x1' = cos t gives z = cos t + x2, so
    x2' = cos t − x2: x2 = (cos t + sin t)/2 + e^{−t}/2 with x2(0) = 1."""
    x2 = (np.cos(t) + np.sin(t)) / 2 + np.exp(-t) / 2
    x2p = (np.cos(t) - np.sin(t)) / 2 - np.exp(-t) / 2
    y = np.stack([np.sin(t), x2, np.cos(t) + x2], -1)
    yp = np.stack([np.cos(t), x2p, np.zeros_like(t)], -1)
    return y, yp


LINEAR_INDEX2 = np.array([False, False, True])


@pytest.mark.parametrize("rtol", [1e-6, 1e-8])
def test_linear_index2_exact(rtol):
    ts = np.linspace(0.0, 5.0, 11)
    y0, yp0 = linear_exact(np.array(0.0))
    sol = dae.solve(linear, 0.0, 5.0, jnp.asarray(y0), jnp.asarray(yp0), index2=LINEAR_INDEX2,
                    saveat=jnp.asarray(ts), rtol=rtol, atol=rtol)
    err = np.abs(np.asarray(sol.ys) - linear_exact(ts)[0])
    assert np.max(err[:, :2]) <= 100 * rtol, np.max(err[:, :2]) / rtol
    assert np.max(err[:, 2]) <= 1000 * rtol, np.max(err[:, 2]) / rtol


# ------------------------------------------- the pendulum with its velocity constraint
L, G, THETA0 = 1.5, 9.81, 0.7
PENDULUM_INDEX2 = np.array([False] * 4 + [True])


def pendulum(t, y, yp, args):
    """Pendulum of length L in index-2 form: positions x, y, velocities u, v, the rod
    force λ; the constraint at λ's index is the velocity constraint x u + y v = 0."""
    length, g = args
    del length
    x, yy, u, v, lam = y
    return jnp.stack([yp[0] - u, yp[1] - v, yp[2] + lam * x, yp[3] + lam * yy + g,
                      x * u + yy * v])


def pendulum_state(theta, omega):
    """(x, y, u, v, λ) of the angle θ and θ', with λ = θ'² + (g/L) cos θ from the hidden
    constraint u² + v² − λ(x² + y²) − g y = 0."""
    x, yy = L * np.sin(theta), -L * np.cos(theta)
    u, v = L * np.cos(theta) * omega, L * np.sin(theta) * omega
    return np.stack([x, yy, u, v, omega ** 2 + (G / L) * np.cos(theta)], -1)


def pendulum_initial():
    y0 = pendulum_state(THETA0, 0.0)
    acc = -(G / L) * np.sin(THETA0)   # θ'' at rest; u' = L cos θ θ'', v' = L sin θ θ''
    yp0 = np.array([0.0, 0.0, L * np.cos(THETA0) * acc, L * np.sin(THETA0) * acc, 0.0])
    return jnp.asarray(y0), jnp.asarray(yp0)


@pytest.mark.parametrize("rtol", [1e-6, 1e-8])
def test_pendulum_against_angle_ode(rtol):
    """Against θ'' = −(g/L) sin θ solved by scipy's DOP853 at 1e-13 (an independent
    method, its error far below both tolerances)."""
    ts = np.linspace(0.0, 3.0, 7)
    ref = solve_ivp(lambda t, s: [s[1], -(G / L) * np.sin(s[0])], (0.0, 3.0), [THETA0, 0.0],
                    method="DOP853", rtol=1e-13, atol=1e-13, t_eval=ts)
    y0, yp0 = pendulum_initial()
    sol = dae.solve(pendulum, 0.0, 3.0, y0, yp0, (L, G), index2=PENDULUM_INDEX2,
                    saveat=jnp.asarray(ts), rtol=rtol, atol=rtol)
    err = np.abs(np.asarray(sol.ys) - pendulum_state(*ref.y))
    assert np.max(err[:, :4]) <= 100 * rtol, np.max(err[:, :4]) / rtol
    assert np.max(err[:, 4]) <= 1000 * rtol, np.max(err[:, 4]) / rtol


# ----------------------------------------------------------- Test Set: tube, Fekete
def _testset_solve(pr, rtol, first_step=None):
    y0, yp0 = pr.initial(pr.p)
    return dae.solve(pr.residual, pr.t0, pr.t1, y0, yp0, pr.params(), algebraic=pr.algebraic,
                     index2=pr.index2, rtol=rtol, atol=rtol, first_step=first_step)


def test_tube_rtol_1e6():
    """IDA (SUNDIALS 7, same residual and tolerances) gets ~2 correct digits (issue 24);
    so must we. Measured: 2.4 digits, 305 steps."""
    sol = _testset_solve(tube, 1e-6)
    assert tube.scd(np.asarray(sol.ys[-1])) >= 2.0


def test_tube_rtol_1e8_first_step_rtol():
    """The Test Set's run: rtol = atol = 1e-8 and first step h0 = rtol. Undeclared, the
    iteration matrix at h = 1e-8 has a pivot ratio 8e-15 (the Schur complement of the
    pressures shrinks like h) and the solve stops with `singular_matrix`; with `index2`
    its index-2 columns are scaled by cj and it starts.

    How many digits it keeps depends on where its steps land at the friction factors'
    kinks (each tube's switch between laminar and turbulent flow): rtol changed by a few
    1e-12 relative, or XLA's code generation changed, moves one run anywhere between 2.7
    and 4.2 digits (2026-11-28, 30 runs; median 3.0–3.1), so one run is not a measure.
    The check is over eight such perturbations in one compiled program: each run at
    least 2.5 digits and their median at least 2.8 — regression bounds below that
    spread. IDA's single run reported in issue 24 (3.7 digits) lies inside the spread;
    our typical run is ~0.6 digit below it, and whether IDA's runs scatter as much was
    not measured."""
    y0, yp0 = tube.initial(tube.p)

    @jax.jit
    def final_state(rtol):
        sol = dae.solve(tube.residual, tube.t0, tube.t1, y0, yp0, tube.params(),
                        algebraic=tube.algebraic, index2=tube.index2, rtol=rtol, atol=rtol,
                        first_step=1e-8, throw=False)
        return sol.ys[-1], sol.result._value

    digits = []
    for k in range(-4, 4):
        y, status = final_state(1e-8 * (1.0 + k * 1e-12))
        assert int(status) == dae.RESULTS.successful._value
        digits.append(tube.scd(np.asarray(y)))
    assert min(digits) >= 2.5, digits
    assert np.median(digits) >= 2.8, digits


def test_krylov_small_first_step_fails_clearly():
    """Krylov with index2: its operator and its preconditioner see J with the index-2
    columns unscaled, whose Schur complement in z is ~h: from h0 = 1e-16 the
    preconditioner's LU is singular, where DenseLU (columns scaled) starts and solves
    `linear` (159-163 steps, within the bounds of the module docstring from h0 = 1e-14
    and 1e-16). Refused with a status that names that cause (before: `singular_matrix`,
    whose message said to declare `index2`, which was declared)."""
    y0, yp0 = linear_exact(np.array(0.0))
    sol = dae.solve(linear, 0.0, 5.0, jnp.asarray(y0), jnp.asarray(yp0), index2=LINEAR_INDEX2,
                    rtol=1e-8, atol=1e-8, first_step=1e-16,
                    linear_solver=dae.Krylov(preconditioner=dae.DenseLU()), throw=False)
    assert sol.result == dae.RESULTS.singular_unscaled_index2
    assert "first_step" in str(dae.RESULTS.singular_unscaled_index2)


@pytest.mark.slow   # ~1 min at load 10 (n = 49, Krylov's own compilation); above on `linear`
def test_tube_krylov_small_first_step_fails_clearly():
    """The same on the water tube from the Test Set's h0 = rtol = 1e-8, which DenseLU
    starts and solves (above). Where the steps stay larger Krylov(DenseLU()) solves the
    tube (rtol 1e-6: 2.3 digits, 275 steps; 1e-8 from the default first step: 3.0
    digits, 1888 steps)."""
    y0, yp0 = tube.initial(tube.p)
    sol = dae.solve(tube.residual, tube.t0, tube.t1, y0, yp0, tube.params(),
                    algebraic=tube.algebraic, index2=tube.index2, rtol=1e-8, atol=1e-8,
                    first_step=1e-8, linear_solver=dae.Krylov(preconditioner=dae.DenseLU()),
                    throw=False, max_steps=50)
    assert sol.result == dae.RESULTS.singular_unscaled_index2
    assert "first_step" in str(dae.RESULTS.singular_unscaled_index2)


def linear_kinked(t, y, yp, a):
    """`linear` with the constraint 0 = x1 − a sin t and an index-1 algebraic
    w = max(x1, 1/2) beside it, whose sensitivity jumps where a sin t crosses 1/2."""
    return jnp.concatenate([linear(t, y[:3], yp[:3], None).at[2].add(jnp.sin(t) * (1.0 - a)),
                            (y[3] - jnp.maximum(y[0], 0.5))[None]])


def test_index2_sensitivities_across_a_kink():
    """jacfwd with respect to a of `linear_kinked` across the two kinks of w (t = π/6,
    5π/6 for a = 1). Closed form: x1 = a sin t, z = a cos t + x2, x2' = a cos t − x2
    with x2(0) = 1, so ∂x1/∂a = sin t, ∂x2/∂a = (cos t + sin t − e^{−t})/2,
    ∂z/∂a = cos t + ∂x2/∂a, ∂w/∂a = [sin t > 1/2] sin t — a jump of 1/2 at each kink,
    where the full error control stopped with `step_size_too_small` (the solve itself
    succeeds). Bounds of the module docstring (w, index-1 algebraic, fixed by x1: the
    differential variables' bound)."""
    rtol = 1e-8
    ts = np.array([0.3, 1.5, 3.0])
    y0, yp0 = linear_exact(np.array(0.0))
    y0, yp0 = jnp.append(jnp.asarray(y0), 0.5), jnp.append(jnp.asarray(yp0), 0.0)

    def f(a):
        return dae.solve(linear_kinked, 0.0, 3.0, y0, yp0, a, saveat=jnp.asarray(ts),
                         algebraic=np.array([False, False, True, True]),
                         index2=np.array([False, False, True, False]), rtol=rtol,
                         atol=rtol).ys

    J = np.asarray(jax.jacfwd(f)(1.0))
    dx2 = (np.cos(ts) + np.sin(ts) - np.exp(-ts)) / 2
    exact = np.stack([np.sin(ts), dx2, np.cos(ts) + dx2,
                      np.where(np.sin(ts) > 0.5, np.sin(ts), 0.0)], 1)
    err = np.abs(J - exact)
    assert np.max(err[:, [0, 1, 3]]) <= 100 * rtol, np.max(err[:, [0, 1, 3]]) / rtol
    assert np.max(err[:, 2]) <= 1000 * rtol, np.max(err[:, 2]) / rtol


# ~1-2 min: n = 49 with a sensitivity, and six solves at rtol 1e-10 for the differences;
# the default suite keeps the same jump on small problems (above, and in
# test_transformations.py).
@pytest.mark.slow
def test_tube_forward_sensitivity_across_flow_regime_switches():
    """d y(T)/d b (the buffers' capacity) of the water tube by jacfwd at rtol 1e-6. Each
    tube switches from the laminar to the turbulent friction law where its Reynolds
    number passes 2300; there the friction factor (index-1 algebraic) has a kink and its
    sensitivity jumps (at t = 12207.8 s by 61 in the error weights), which stopped the
    full error control with `step_size_too_small` where the forward solve succeeds.
    Against central differences of solves at rtol 1e-10 (step 1e-3 b: truncation
    ~1e-6 relative; measured agreement of the differences at 1e-8 and 1e-10: 8e-4),
    on the pressures (the derivative's size, 6.6, is theirs; the flows' derivatives at
    T, ~1e-7, are below the differences' noise). Bound: 1000·rtol of the pressures'
    derivative, the index-2 variables' bound of the module docstring (measured 8e-5).

    (The friction law's switch also makes φ' jump, whose switching-time term no
    sensitivity through a `jnp.where` sees; at T it is below this bound.)"""
    y0, yp0 = tube.initial(tube.p)
    b0 = tube.p["b"]

    def final(b, rtol):
        return dae.solve(tube.residual, tube.t0, tube.t1, y0, yp0, tube.params(b=b),
                         algebraic=tube.algebraic, index2=tube.index2, rtol=rtol,
                         atol=rtol).ys[-1]

    J = np.asarray(jax.jacfwd(lambda b: final(b, 1e-6))(jnp.asarray(b0)))
    db = 1e-3 * b0
    fd = (np.asarray(final(jnp.asarray(b0 + db), 1e-10))
          - np.asarray(final(jnp.asarray(b0 - db), 1e-10))) / (2 * db)
    pres = slice(36, 49)
    err = np.max(np.abs(J[pres] - fd[pres])) / np.max(np.abs(fd[pres]))
    assert err <= 1000 * 1e-6, err


def test_tube_undeclared_singular_at_small_h():
    """Without `index2` the same start is refused clearly (not solved wrongly), with a
    message that says how to declare it."""
    y0, yp0 = tube.initial(tube.p)
    sol = dae.solve(tube.residual, tube.t0, tube.t1, y0, yp0, tube.params(),
                    algebraic=tube.algebraic, rtol=1e-8, atol=1e-8, first_step=1e-8,
                    throw=False, max_steps=50)
    assert sol.result == dae.RESULTS.singular_matrix
    assert "index2" in str(dae.RESULTS.singular_matrix)


@pytest.mark.parametrize("rtol", [1e-6, pytest.param(1e-8, marks=pytest.mark.slow)])
def test_fekete(rtol):
    """Bound: the tolerance's digits − 2 (4 at 1e-6, 6 at 1e-8): the index-2 multipliers
    are out of the error test and the positions' global error is a few tolerance units
    (issue 24 measured 4.7 and 6.1 digits with the algebraic components suppressed;
    with `index2` we measure 4.7 (1011 steps) and 6.05 (1405 steps))."""
    sol = _testset_solve(fekete, rtol)
    assert fekete.scd(np.asarray(sol.ys[-1])) >= -np.log10(rtol) - 2


# ------------------------------------------------------------ Test Set: slider crank
def _crank_mescd(pr, sol, rtol):
    """The Test Set's score of the slider crank: mescd over the seven positions."""
    y = pr.testset_values(np.asarray(sol.ys[-1]))
    return mescd(y[:7], pr.yref[:7], rtol, rtol)


def _crank_reduced_solve(rtol, first_step=None):
    y0, yp0 = crank_reduced.initial(crank_reduced.p)
    return dae.solve(crank_reduced.residual, crank_reduced.t0, crank_reduced.t1, y0, yp0,
                     crank_reduced.params(), algebraic=crank_reduced.algebraic,
                     index2=crank_reduced.index2, rtol=rtol, atol=rtol,
                     first_step=first_step, max_steps=20_000, throw=False)


def test_crank():   # ~15 CPU s (one compilation), 45 s wall at load 11
    """The slider crank with the accelerations eliminated (λ index 2), from the Test
    Set's start, at the Test Set's tolerances rtol = atol = 1e-4 … 1e-7: mescd of the
    positions against the published reference ≥ the tolerance's digits − 1 — a global
    error of at most ten tolerance units, about a digit under what IDAS reaches on the
    Test Set's form with its algebraic variables suppressed (3.93, 5.33, 6.22 digits at
    1e-4 … 1e-6; 7.22 at 1e-7 from a first step of 1e-6; docs/index2.md). Measured: 4.30,
    5.60, 6.40, 7.19 digits, 3090 to 4682 steps. At 1e-8 the default first step is 4e-12
    (the IDAS rule 0.5/‖y'0‖_W: the rod's accelerations are large against its
    velocities' tolerance), where the rounding of the velocities over such a step moves
    λ by more than its Newton tolerance: the solve must then fail clearly (measured:
    convergence failures; IDAS fails there too) or be right."""
    for rtol in (1e-4, 1e-5, 1e-6, 1e-7):
        sol = _crank_reduced_solve(rtol)
        assert sol.result == dae.RESULTS.successful, (rtol, sol.result)
        assert _crank_mescd(crank_reduced, sol, rtol) >= -np.log10(rtol) - 1, rtol
    sol = _crank_reduced_solve(1e-8)
    assert (sol.result != dae.RESULTS.successful
            or _crank_mescd(crank_reduced, sol, 1e-8) >= 7.0)


@pytest.mark.slow   # a second compilation (a given first step) of ~30 s
def test_crank_rtol_1e8_first_step():
    """At rtol = atol = 1e-8 from a first step of 1e-6 the solve is right: bound as in
    `test_crank` (measured 8.46 digits, 7673 steps; IDAS from the same first step: 7.98
    digits, 7359 steps)."""
    sol = _crank_reduced_solve(1e-8, first_step=1e-6)
    assert sol.result == dae.RESULTS.successful
    assert _crank_mescd(crank_reduced, sol, 1e-8) >= 7.0


@pytest.mark.slow   # a second compilation (n = 24) of ~30 s
def test_crank_testset_form():
    """The Test Set's own form (n = 24, the accelerations w as variables) with λ
    declared and w out of the error test (`suppress_algebraic_error`: w = M⁻¹(f − Gᵀλ)
    follows λ, one order lower in h) — IDAS's setting with `suppress_alg`: right at
    1e-4 … 1e-6 (bound as in `test_crank`; measured 4.13, 5.29, 6.23 digits, 3624 to
    4249 steps; IDAS 3.93, 5.33, 6.22). At the small first steps of rtol ≤ 1e-7 the
    Newton iteration fails as in the reduced form (IDAS: convergence failures at
    t = 9.7e-10 and t = 0), here reported as `singular_matrix`: w's columns of the
    iteration matrix are not scaled by cj (only declared index-2 variables are), and as
    the step shrinks the pivot test finds it singular. A clear failure, never a wrong
    answer (docs/index2.md)."""
    y0, yp0 = crank.initial(crank.p)
    for rtol in (1e-4, 1e-5, 1e-6, 1e-8):
        sol = dae.solve(crank.residual, crank.t0, crank.t1, y0, yp0, crank.params(),
                        algebraic=crank.algebraic, index2=crank.index2, rtol=rtol, atol=rtol,
                        suppress_algebraic_error=True, max_steps=20_000, throw=False)
        if rtol < 1e-7:
            assert sol.result != dae.RESULTS.successful or _crank_mescd(crank, sol, rtol) >= 7
        else:
            assert sol.result == dae.RESULTS.successful, (rtol, sol.result)
            assert _crank_mescd(crank, sol, rtol) >= -np.log10(rtol) - 1, rtol


# ------------------------------------------------------------------ clear errors
def test_violated_hidden_constraint_raises():
    y0, yp0 = pendulum_initial()
    bad = yp0.at[2].add(0.1)   # u' off: d/dt(x u + y v) = x u' + … ≠ 0
    with pytest.raises(ValueError, match="hidden constraint of equation 4"):
        dae.solve(pendulum, 0.0, 1.0, y0, bad, (L, G), index2=PENDULUM_INDEX2)


def test_violated_constraint_raises():
    y0, yp0 = pendulum_initial()
    with pytest.raises(ValueError, match="violate the index-2 constraint equation 4"):
        dae.solve(pendulum, 0.0, 1.0, y0.at[2].set(0.3), yp0, (L, G), index2=PENDULUM_INDEX2)


def test_violated_hidden_constraint_under_jit():
    """Traced initial values: the same check, raised by the compiled program."""
    y0, yp0 = pendulum_initial()
    f = jax.jit(lambda yp: dae.solve(pendulum, 0.0, 1.0, y0, yp, (L, G),
                                     index2=PENDULUM_INDEX2).ys)
    with pytest.raises(Exception, match="hidden constraint of equation 4"):
        f(yp0.at[2].add(0.1))


def test_not_hessenberg_raises():
    """A marked equation with y' in it, or with an algebraic variable in it, is not a
    Hessenberg index-2 constraint."""
    y0, yp0 = linear_exact(np.array(0.0))
    y0, yp0 = jnp.asarray(y0), jnp.asarray(yp0)
    with pytest.raises(ValueError, match=r"equation 2 .* depends on y'"):
        dae.solve(lambda t, y, yp, a: linear(t, y, yp, a).at[2].add(yp[2]), 0.0, 1.0, y0, yp0,
                  index2=LINEAR_INDEX2)
    with pytest.raises(ValueError, match=r"equation 2 .* depends on an algebraic variable"):
        dae.solve(lambda t, y, yp, a: linear(t, y, yp, a).at[2].add(y[2] - y0[2]),
                  0.0, 1.0, y0, yp0, index2=LINEAR_INDEX2)


def test_mask_errors():
    y0, yp0 = pendulum_initial()
    with pytest.raises(ValueError, match=r"index2\[4\] is True but algebraic\[4\] is False"):
        dae.solve(pendulum, 0.0, 1.0, y0, yp0, (L, G), index2=PENDULUM_INDEX2,
                  algebraic=np.zeros(5, bool))
    with pytest.raises(ValueError, match="init='y'"):
        dae.solve(pendulum, 0.0, 1.0, y0, yp0, (L, G), index2=PENDULUM_INDEX2, init="y")
    with pytest.raises(ValueError, match="shape"):
        dae.solve(pendulum, 0.0, 1.0, y0, yp0, (L, G), index2=np.ones(4, bool))


# ------------------------------------------------------------------- derivatives
# Bounds of the derivative tests: the sensitivities are integrated under full error
# control (forward) or are the exact derivatives of the computed steps (discrete
# adjoint), so their global error is bounded like the solution's (module docstring):
# 100·rtol on the differential variables and 1000·rtol on the index-2 variables,
# relative to the size of the derivative (floored at 1).
DERIV_RTOL = 1e-9


def _check_derivative(J, ref, index2_cols, rtol=DERIV_RTOL):
    """J, ref: (outputs, inputs); `index2_cols`: the outputs that are index-2 variables."""
    J, ref = np.asarray(J), np.asarray(ref)
    scale = np.maximum(np.max(np.abs(ref)), 1.0)
    err = np.abs(J - ref) / scale
    diff = np.delete(err, index2_cols, axis=0)
    assert np.max(diff) <= 100 * rtol, np.max(diff) / rtol
    if index2_cols:
        assert np.max(err[index2_cols]) <= 1000 * rtol, np.max(err[index2_cols]) / rtol


def pendulum_of(theta, omega, length, g):
    """(x, y, u, v, λ) of the angle, angular velocity, radius and gravity (JAX)."""
    s, c = jnp.sin(theta), jnp.cos(theta)
    return jnp.stack([length * s, -length * c, length * c * omega, length * s * omega,
                      omega ** 2 + (g / length) * c])


def angle_ode_sensitivities(theta0, omega0, length, g, t1):
    """θ(t1), θ'(t1) of θ'' = −(g/L) sin θ and their derivatives with respect to
    q = (θ0, θ'0, L, g), from the variational equations S'' = −(g/L) cos θ S −
    sin θ ∂(g/L)/∂q, all by scipy's DOP853 at 1e-13 (an independent method, its error
    far below the bounds)."""
    dk = np.array([0.0, 0.0, -g / length ** 2, 1.0 / length])   # ∂(g/L)/∂q

    def rhs(t, z):
        th, om, st, so = z[0], z[1], z[2:6], z[6:10]
        return np.concatenate([[om, -(g / length) * np.sin(th)], so,
                               -(g / length) * np.cos(th) * st - np.sin(th) * dk])

    z0 = np.concatenate([[theta0, omega0], [1.0, 0, 0, 0], [0, 1.0, 0, 0]])
    z = solve_ivp(rhs, (0.0, t1), z0, method="DOP853", rtol=1e-13, atol=1e-13).y[:, -1]
    return z[0], z[1], z[2:6], z[6:10]


def pendulum_final_jacobian(theta0, omega0, length, g, t1):
    """d(x, y, u, v, λ)(t1)/dq, q = (θ0, θ'0, L, g), by the chain rule through
    `pendulum_of` and the angle ODE's sensitivities."""
    th, om, s_th, s_om = angle_ode_sensitivities(theta0, omega0, length, g, t1)
    partial = np.stack(jax.jacfwd(pendulum_of, argnums=(0, 1, 2, 3))(th, om, length, g), 1)
    return partial[:, :2] @ np.stack([s_th, s_om]) + partial[:, 2:] @ np.eye(4)[2:]


def pendulum_rest_inputs(q):
    """y0, y'0 and args = (L, g) of the pendulum from rest at θ0, radius L, gravity g;
    q = (θ0, L, g). (The residual reads g from args; the radius is set by y0.)"""
    theta0, length, g = q[0], q[1], q[2]
    y0 = pendulum_of(theta0, 0.0 * theta0, length, g)
    acc = -(g / length) * jnp.sin(theta0)
    yp0 = jnp.stack([0.0 * acc, 0.0 * acc, length * jnp.cos(theta0) * acc,
                     length * jnp.sin(theta0) * acc, 0.0 * acc])
    return y0, yp0, (length, g)


def pendulum_at_rest(theta0, length, g, t1, rtol=DERIV_RTOL, **kw):
    """The index-2 pendulum from rest at θ0, radius `length`, gravity g: (x, y, u, v, λ)
    at t1."""
    y0, yp0, args = pendulum_rest_inputs((theta0, length, g))
    return dae.solve(pendulum, 0.0, t1, y0, yp0, args, index2=PENDULUM_INDEX2,
                     rtol=rtol, atol=rtol, **kw).ys[-1]


T_DERIV = 2.0
# The continuous adjoint without its fallback to the discrete one: a failure of the
# index-2 adjoint must fail the test, not pass as the discrete adjoint's gradient.
CONTINUOUS = dae.Adjoint(fallback=False)
# (transform, sensitivity) of the derivative tests: forward sensitivities, the discrete
# adjoint and the continuous adjoint.
MODES = {"jacfwd": (jax.jacfwd, None), "jacrev": (jax.jacrev, dae.DiscreteAdjoint()),
         "adjoint": (jax.jacrev, CONTINUOUS)}


def _pendulum_final(y0, yp0, args, sensitivity):
    return dae.solve(pendulum, 0.0, T_DERIV, y0, yp0, args, index2=PENDULUM_INDEX2,
                     rtol=DERIV_RTOL, atol=DERIV_RTOL, sensitivity=sensitivity).ys[-1]


@functools.cache
def pendulum_derivatives(mode):
    """d(x, y, u, v, λ)(T)/d(y0, y'0, args) of the pendulum, by `mode` (of MODES): one
    compiled program per mode, shared by the parameter and the initial-value tests
    (separately, each compiled its own program of about this size)."""
    transform, sensitivity = MODES[mode]
    return jax.jit(transform(lambda y0, yp0, args: _pendulum_final(y0, yp0, args, sensitivity),
                             argnums=(0, 1, 2)))


@pytest.mark.parametrize("mode", list(MODES))
def test_pendulum_parameter_derivatives(mode):
    """d(x, y, u, v, λ)(T)/d(θ0, L, g) — the initial angle and the radius through y0,
    gravity through args — by forward sensitivities (jacfwd), the discrete adjoint and
    the continuous adjoint (jacrev; its final conditions for the cotangents on x, u at
    T, and on λ — an index-2 variable, Li & Petzold's g_{y^a} ≠ 0 case), against the
    angle ODE's variational equations (exact up to DOP853's 1e-13). The chain rule
    through (y0, y'0, args)(θ0, L, g) on the solve's derivatives with respect to them."""
    q = jnp.array([THETA0, L, G])
    d_y0, d_yp0, (d_l, d_g) = pendulum_derivatives(mode)(*pendulum_rest_inputs(q))
    i_y0, i_yp0, (i_l, i_g) = jax.jacfwd(pendulum_rest_inputs)(q)
    J = d_y0 @ i_y0 + d_yp0 @ i_yp0 + d_l[:, None] * i_l + d_g[:, None] * i_g
    ref = pendulum_final_jacobian(THETA0, 0.0, L, G, T_DERIV)[:, [0, 2, 3]]
    _check_derivative(J, ref, [4])


def pendulum_mass(t, y, yp, args):
    """The pendulum of mass m in index-2 form: m u' = −λ x, m v' = −λ y − m g, with the
    velocity constraint x u + y v = 0 at λ's index. λ = m (θ'² + (g/L) cos θ) is the
    rod force over L: proportional to m, while the motion does not depend on m."""
    m, g = args
    x, yy, u, v, lam = y
    return jnp.stack([yp[0] - u, yp[1] - v, m * yp[2] + lam * x, m * yp[3] + lam * yy + m * g,
                      x * u + yy * v])


MASS = 2.5


def pendulum_mass_objective(q, rtol=DERIV_RTOL, sensitivity=None):
    """λ(T) + x(T) of the pendulum of mass m from rest at θ0, radius L; q = (θ0, L, m)."""
    theta0, length, m = q[0], q[1], q[2]
    y0 = pendulum_of(theta0, 0.0 * theta0, length, G) * jnp.array([1.0, 1, 1, 1, 0]) \
        + jnp.array([0.0, 0, 0, 0, 1]) * m * (G / length) * jnp.cos(theta0)
    acc = -(G / length) * jnp.sin(theta0)
    yp0 = jnp.stack([0.0 * acc, 0.0 * acc, length * jnp.cos(theta0) * acc,
                     length * jnp.sin(theta0) * acc, 0.0 * acc])
    yT = dae.solve(pendulum_mass, 0.0, T_DERIV, y0, yp0, (m, G), index2=PENDULUM_INDEX2,
                   rtol=rtol, atol=rtol, sensitivity=sensitivity).ys[-1]
    return yT[4] + yT[0]


# The continuous adjoint's variant (~70 s at load 10, 12-148 rtol off the reference;
# jacfwd 16 rtol) to --runslow: the default suite keeps that adjoint on the pendulum's
# other parameters (test_pendulum_parameter_derivatives).
@pytest.mark.parametrize("mode", ["jacfwd", pytest.param("grad", marks=pytest.mark.slow)])
def test_pendulum_mass_derivatives(mode):
    """d(λ(T) + x(T))/d(θ0, L, m) for the pendulum of mass m = 2.5 by forward
    sensitivities and by the continuous adjoint (grad's default, without its fallback).
    Reference: the angle ODE's variational equations (λ = m λ₁ with λ₁ the unit-mass
    force, x independent of m): m ∂λ₁/∂q + ∂x/∂q for θ0 and L, and λ₁(T) for m.
    Bound: 1000·DERIV_RTOL of the derivative's size (the objective holds λ, an index-2
    variable: the module docstring's bound). The m column also against central
    differences of two solves at rtol 1e-11 with step 0.1 m: λ is linear in m, so the
    difference has no truncation error, and its noise is the solves' error over the
    step, ~100·1e-11·|λ|/(0.2 m) ≈ 1e-9 — the same bound covers it."""
    q = jnp.array([THETA0, L, MASS])
    f = lambda q_: pendulum_mass_objective(q_, sensitivity=CONTINUOUS)   # noqa: E731
    J = np.asarray(jax.jacfwd(f)(q) if mode == "jacfwd" else jax.grad(f)(q))
    ref1 = pendulum_final_jacobian(THETA0, 0.0, L, G, T_DERIV)     # (5, (θ0, θ'0, L, g))
    th, om = angle_ode_sensitivities(THETA0, 0.0, L, G, T_DERIV)[:2]
    lam1 = om ** 2 + (G / L) * np.cos(th)
    ref = np.array([MASS * ref1[4, 0] + ref1[0, 0], MASS * ref1[4, 2] + ref1[0, 2], lam1])
    scale = np.max(np.abs(ref))
    assert np.max(np.abs(J - ref)) <= 1000 * DERIV_RTOL * scale, np.abs(J - ref) / scale
    dm = 0.1 * MASS
    fd = (float(pendulum_mass_objective(q.at[2].add(dm), rtol=1e-11))
          - float(pendulum_mass_objective(q.at[2].add(-dm), rtol=1e-11))) / (2 * dm)
    assert abs(J[2] - fd) <= 1000 * DERIV_RTOL * scale, abs(J[2] - fd) / scale


# ~1 min (13 solves at rtol 1e-11); the default suite checks the same derivatives against
# the angle ODE's variational equations (test_pendulum_parameter_derivatives).
@pytest.mark.slow
def test_pendulum_derivatives_central_differences():
    """The same derivatives (forward and reverse) against fourth-order central
    differences of solves at rtol 1e-11 with step 1e-3: truncation ~1e-12, noise ~
    1.5·(100·1e-11)/1e-3 = 1.5e-6 (the stencil's weights times the solves' global error
    over the step). Bound: 1e-5 of the derivative's size, which covers that noise (the
    derivatives themselves are within 100·DERIV_RTOL = 1e-7)."""
    q = np.array([THETA0, L, G])

    def final(q_, rtol):
        return np.asarray(pendulum_at_rest(q_[0], q_[1], q_[2], T_DERIV, rtol=rtol))

    h = 1e-3
    fd = np.stack([(8 * (final(q + h * e, 1e-11) - final(q - h * e, 1e-11))
                    - (final(q + 2 * h * e, 1e-11) - final(q - 2 * h * e, 1e-11))) / (12 * h)
                   for e in np.eye(3)], 1)
    for transform, sensitivity in MODES.values():
        f = lambda q_, s_=sensitivity: pendulum_at_rest(   # noqa: E731
            q_[0], q_[1], q_[2], T_DERIV, sensitivity=s_)
        J = np.asarray(transform(f)(jnp.asarray(q)))
        err = np.max(np.abs(J - fd)) / max(np.max(np.abs(fd)), 1.0)
        assert err <= 1e-5, err


# Every mode's derivatives with respect to y0 come from the program the parameter
# derivatives above use (`pendulum_derivatives`).
@pytest.mark.parametrize("mode", list(MODES))
def test_pendulum_initial_value_derivatives(mode):
    """Derivatives with respect to y0 itself, whose directions off the constraint
    x u + y v = 0 (a velocity with a radial part) are moved onto its linearization the
    least in the error weights' norm — the derivative of the solve from y0 projected by
    `init="ya_ydp"` (docs/index2.md). At rest the constraint's gradient is (0, 0, x, y),
    so (δu, δv) is projected onto the tangent (cos θ, sin θ): δθ'0 = (cos θ δu +
    sin θ δv)/L; (δx, δy) changes the angle and the radius, δθ0 = (cos θ δx + sin θ
    δy)/L, δL = sin θ δx − cos θ δy; λ and y'0 are determined by them (zero columns).
    Reference: the angle ODE's sensitivities through that map."""
    y0, yp0 = pendulum_initial()
    # args as the parameter test makes them (strongly typed scalars: a weakly typed
    # jnp.asarray(L) would compile another program).
    args = pendulum_rest_inputs(jnp.array([THETA0, L, G]))[2]
    J, Jp, _ = pendulum_derivatives(mode)(y0, yp0, args)
    s, c = np.sin(THETA0), np.cos(THETA0)
    dq_dy0 = np.array([[c / L, s / L, 0, 0, 0],      # θ0
                       [0, 0, c / L, s / L, 0],      # θ'0
                       [s, -c, 0, 0, 0],             # L (the radius)
                       [0, 0, 0, 0, 0]])             # g
    ref = pendulum_final_jacobian(THETA0, 0.0, L, G, T_DERIV) @ dq_dy0
    _check_derivative(J, ref, [4])
    if mode == "jacfwd":
        # The same through the projection itself (init="ya_ydp", differentiated by JAX).
        _check_derivative(jax.jacfwd(lambda y: dae.solve(
            pendulum, 0.0, T_DERIV, y, yp0, (L, G), index2=PENDULUM_INDEX2,
            rtol=DERIV_RTOL, atol=DERIV_RTOL, init="ya_ydp").ys[-1])(y0), ref, [4])
        # y'0 is determined by y0: zero derivative. (y'_λ, which no equation reads,
        # only enters s_λ's BDF predictor, which the corrector replaces: what remains
        # is rounding, 1e-41 here; bound: 1e-14, rounding relative to the O(1) outputs.)
        assert np.max(np.abs(np.asarray(Jp))) <= 1e-14


def pendulum_bottom(q):
    """(t_e, x, y, u, v, λ) where the pendulum from rest at θ0 (radius L, gravity g)
    first passes the bottom, in closed form: t_e = √(L/g) K(sin²(θ0/2)) (a quarter
    period, K the complete elliptic integral of the first kind in scipy's parameter
    convention), and by energy conservation u = −√(2 g L (1 − cos θ0)), y = −L,
    x = v = 0, λ = (u² + v² − g y)/L² = (g/L)(3 − 2 cos θ0)."""
    from scipy.special import ellipk
    th, length, g = q
    return np.array([np.sqrt(length / g) * ellipk(np.sin(th / 2) ** 2), 0.0, -length,
                     -np.sqrt(2 * g * length * (1 - np.cos(th))), 0.0,
                     (g / length) * (3 - 2 * np.cos(th))])


@pytest.mark.parametrize("mode", [
    "jacfwd",
    # ~30 s; the default suite checks the adjoint's jumps without events
    pytest.param("jacrev", marks=pytest.mark.slow)])
def test_derivatives_through_terminal_event(mode):
    """A terminal event (x = 0, the bottom) by forward sensitivities and by the
    continuous adjoint: the derivatives of the event time and of the state there — λ
    included, an index-2 variable — with respect to (θ0, L, g) against fourth-order
    central differences of the closed form (`pendulum_bottom`; step 1e-3: truncation
    ~1e-12). Bounds as above: 100·rtol (t_e and the differential variables), 1000·rtol
    (λ), of the derivative's size. dλ(t*)/dp = s_λ(t*) + λ'(t*) dt*/dp needs λ' from
    the hidden constraint, not from the interpolant (out of the error test: with it,
    forward mode was off by 1e-4 relative); λ'(t*) is exactly 0 at the bottom, and the
    reported event slope must be 0 within 1000·rtol of g/L."""
    def at_event(q):
        th, length, g = q[0], q[1], q[2]
        y0 = pendulum_of(th, 0.0 * th, length, g)
        acc = -(g / length) * jnp.sin(th)
        yp0 = jnp.stack([0.0 * acc, 0.0 * acc, length * jnp.cos(th) * acc,
                         length * jnp.sin(th) * acc, 0.0 * acc])
        sol = dae.solve(pendulum, 0.0, 3.0, y0, yp0, (length, g), index2=PENDULUM_INDEX2,
                        rtol=DERIV_RTOL, atol=DERIV_RTOL, sensitivity=CONTINUOUS,
                        event=dae.Event(lambda t, y, yp, a: y[:1]))
        return jnp.concatenate([sol.event_t[None], sol.event_y]), sol.event_yp[4]

    q = np.array([THETA0, L, G])
    h = 1e-3
    ref = np.stack([(8 * (pendulum_bottom(q + h * e) - pendulum_bottom(q - h * e))
                     - (pendulum_bottom(q + 2 * h * e) - pendulum_bottom(q - 2 * h * e)))
                    / (12 * h) for e in np.eye(3)], 1)
    derivative = jax.jacfwd if mode == "jacfwd" else jax.jacrev
    # λ'(t*) is the derivative program's auxiliary (primal) output: one compilation.
    J, slope = jax.jit(derivative(at_event, has_aux=True))(jnp.asarray(q))
    _check_derivative(J, ref, [5])
    assert abs(float(slope)) <= 1000 * DERIV_RTOL * G / L


# A constraint with parameters: x1' = z − x2, x2' = z − 2 x2, 0 = x1 − a sin t − b.
# Closed form: x1 = a sin t + b; the hidden constraint x1' = a cos t gives
# z = a cos t + x2, so x2' = a cos t − x2: x2 = a (cos t + sin t)/2 + (x2(0) − a/2) e^{−t}.
def linear_p(t, y, yp, args):
    a, b = args
    return jnp.stack([yp[0] + y[1] - y[2], yp[1] + 2.0 * y[1] - y[2],
                      y[0] - a * jnp.sin(t) - b])


def linear_p_derivatives(ts):
    """d(x1, x2, z, ∫x2, ∫z)/d(a, b, t0) at ts, t0 = 0, with y0 fixed (x2(t0) = 1):
    ∂x1/∂a = sin t, ∂x1/∂b = 1, ∂x2/∂a = (cos t + sin t − e^{−t})/2,
    ∂z/∂a = cos t + ∂x2/∂a, their integrals from 0: (sin t − cos t + e^{−t})/2 and
    sin t + that; nothing else on b. Moving t0 with y0 fixed starts x2 at 1 at t0:
    ∂x2/∂t0 = ∂z/∂t0 = c e^{−t}, c = x2(0) − a (cos 0 + sin 0)/2 − a (cos 0 − sin 0)/2
    = 1 − a; ∂∫x2/∂t0 = −x2(0) + c (1 − e^{−t}), ∂∫z/∂t0 = −z(0) + c (1 − e^{−t})."""
    a = LINEAR_P[0]
    da_x2 = (np.cos(ts) + np.sin(ts) - np.exp(-ts)) / 2
    da_q2 = (np.sin(ts) - np.cos(ts) + np.exp(-ts)) / 2
    da = np.stack([np.sin(ts), da_x2, np.cos(ts) + da_x2, da_q2, np.sin(ts) + da_q2], -1)
    db = np.stack([np.ones_like(ts), 0 * ts, 0 * ts, 0 * ts, 0 * ts], -1)
    c, decay = 1.0 - a, np.exp(-ts)
    dt0 = np.stack([0 * ts, c * decay, c * decay, -1.0 + c * (1 - decay),
                    -(a + 1.0) + c * (1 - decay)], -1)
    return np.stack([da, db, dt0], -1)    # (n_save, 5, 3)


LINEAR_P = (0.8, 0.3)
LINEAR_P_TS = np.array([1.0, 2.5, 4.0])


def linear_p_solve(p, sensitivity=None, follow=False, t0=0.0):
    """Without `follow`, y0 is consistent at LINEAR_P but fixed (it does not follow b):
    the derivative with respect to b comes from moving x1(0) onto the linearized
    constraint δx1 − δb = 0, i.e. from the constraint's own dependence on p. With it,
    y0 and y'0 are the consistent ones of p (the same derivatives). y0 is given at t0
    (a start time other than 0 moves it off the constraint: x1(t0) is projected)."""
    a0, b0 = p if follow else LINEAR_P
    x20 = 1.0
    y0 = jnp.array([b0, x20, a0 + x20])
    yp0 = jnp.array([a0, a0 - x20, 0.0])
    sol = dae.solve(linear_p, t0, 4.0, y0, yp0, (p[0], p[1]), index2=LINEAR_INDEX2,
                    saveat=jnp.asarray(LINEAR_P_TS), rtol=DERIV_RTOL, atol=DERIV_RTOL,
                    quadrature=lambda t, y, yp, args: y[1:], sensitivity=sensitivity)
    return jnp.concatenate([sol.ys, sol.qs], axis=1)    # (x1, x2, z, ∫x2, ∫z)


@pytest.mark.parametrize("mode", list(MODES))
def test_parameter_dependent_constraint(mode):
    """Forward sensitivities, the discrete and the continuous adjoint of a problem whose
    index-2 constraint depends on the parameters, with quadratures of a differential
    and the index-2 variable, and the start time (y0 fixed: the start moves off the
    constraint and is projected), against the closed form.

    For the continuous adjoint this is the case of Li & Petzold's extra term
    (DASPKADJOINT §5.6): b enters only the constraint, so ∂x1/∂b = 1 comes entirely
    from the parameter terms of the observations' jumps and final conditions
    (`adjoint.index2_jump`, `index2_restart_values`). Measured with either term
    dropped: errors of 0.5–1.0 in the a and b columns (against ≤ 1e-8 with both)."""
    q = jnp.array(LINEAR_P + (0.0,))
    transform, sensitivity = MODES[mode]
    J = transform(lambda q_: linear_p_solve(q_[:2], sensitivity, t0=q_[2]))(q)
    ref = linear_p_derivatives(LINEAR_P_TS)
    for i in range(len(LINEAR_P_TS)):
        # ∫z integrates the index-2 variable: its bound is z's.
        _check_derivative(J[i], ref[i], [2, 4])


VMAP_PS = jnp.array([[0.8, 0.3], [1.2, -0.5]])


@pytest.mark.filterwarnings("error::RuntimeWarning")
@pytest.mark.parametrize("mode", ["jacrev", "default"])
def test_vmap_of_index2_gradient(mode):
    """`vmap` over parameters of the discrete adjoint's gradients and of `grad`'s default
    (the continuous adjoint, with its fallback to the discrete one: a fallback warns,
    and the warning is an error here, so the default path must not fall back): each
    member against the closed form (bounds as above; ∂x2/∂(a, b) does not depend on
    (a, b))."""
    sensitivity = MODES[mode][1] if mode in MODES else None

    def loss(p):
        return jnp.sum(linear_p_solve(p, sensitivity, follow=True)[:, 1])   # Σ_i x2(t_i)

    ref = linear_p_derivatives(LINEAR_P_TS)
    for g in jax.vmap(jax.grad(loss))(VMAP_PS):
        _check_derivative(np.asarray(g)[None], np.sum(ref[:, 1, :2], 0)[None], [])


@pytest.mark.slow   # ~50 s; the default suite keeps vmap of the gradient (above)
def test_vmap_of_index2_jvp():
    """`vmap` over parameters of forward sensitivities (∂/∂a), against the closed form."""
    tangents = jax.vmap(lambda p: jax.jvp(lambda q: linear_p_solve(q, follow=True), (p,),
                                          (jnp.array([1.0, 0.0]),))[1])(VMAP_PS)
    ref = linear_p_derivatives(LINEAR_P_TS)
    for tan in tangents:
        for i in range(len(LINEAR_P_TS)):
            _check_derivative(np.asarray(tan[i])[:, None], ref[i][:, :1], [2, 4])


def fekete_log_v(alpha, sensitivity=None):
    """log V(x(T)) of the Fekete problem at rtol 1e-6 from the start of parameters α,
    V(x) = Π_{i<j} ‖x_i − x_j‖ (the log: V itself is ~3e23)."""
    y0, yp0 = fekete.initial(fekete.p, alpha)
    sol = dae.solve(fekete.residual, fekete.t0, fekete.t1, y0, yp0, fekete.params(),
                    algebraic=fekete.algebraic, index2=fekete.index2, rtol=1e-6, atol=1e-6,
                    sensitivity=sensitivity)
    pos = sol.ys[-1, :60].reshape(20, 3)
    i, j = np.triu_indices(20, 1)
    return jnp.sum(jnp.log(jnp.linalg.norm(pos[i] - pos[j], axis=1)))


@pytest.mark.slow   # n = 160 with 8 sensitivity directions: ~3 min of compilation and run
def test_fekete_sensitivities_vanish():
    """Li & Petzold, DASPKADJOINT §7.3, Table 4: V(x(T)) at the maximum it converges to
    does not depend on the start, so ∂V/∂α_i = 0 for the eight parameters of the start
    (their forward sensitivities: ~4e-11, their adjoint's: within the tolerance 1e-4).
    Forward sensitivities of log V, bound: rtol = 1e-6 (relative to V; measured
    ≤ 3e-15)."""
    alpha = jnp.asarray(FEKETE_ALPHA)
    J = jax.jacfwd(fekete_log_v)(alpha)
    assert np.max(np.abs(np.asarray(J))) <= 1e-6, J
    # The discrete adjoint (measured ≤ 5e-11) and the continuous adjoint (its index-2
    # final conditions: the cotangent is on the positions at T; measured ≤ 8e-12), same
    # bound — so both agree with the forward method within it.
    for sensitivity in (dae.DiscreteAdjoint(), CONTINUOUS):
        g = jax.grad(lambda a, s_=sensitivity: fekete_log_v(a, s_))(alpha)
        assert np.max(np.abs(np.asarray(g))) <= 1e-6, g


@pytest.mark.slow   # n = 160: ~2 min of compilation and run
def test_fekete_early_gradient_continuous_adjoint_vs_forward():
    """Before the points settle (T = 10), ∂ log V(x(T))/∂α is not zero (|J| up to 0.1):
    the continuous adjoint against forward sensitivities on the GGL form with its two
    multipliers. Bound: 1e-2 of the largest entry. Both are rtol-1e-6 approximations of
    the same derivative (the solution itself has ~4.7 correct digits at this rtol);
    measured: 1.7e-3 between them, and the same between forward and the discrete
    adjoint (the exact derivative of the computed solution). (Without the projection
    of μ_d onto the adjoint's constraint, its backward integration fails outright.)"""
    alpha = jnp.asarray(FEKETE_ALPHA)

    def log_v(a, sensitivity=None):
        y0, yp0 = fekete.initial(fekete.p, a)
        sol = dae.solve(fekete.residual, fekete.t0, 10.0, y0, yp0, fekete.params(),
                        algebraic=fekete.algebraic, index2=fekete.index2, rtol=1e-6,
                        atol=1e-6, sensitivity=sensitivity)
        pos = sol.ys[-1, :60].reshape(20, 3)
        i, j = np.triu_indices(20, 1)
        return jnp.sum(jnp.log(jnp.linalg.norm(pos[i] - pos[j], axis=1)))

    J = np.asarray(jax.jacfwd(log_v)(alpha))
    g = np.asarray(jax.grad(lambda a: log_v(a, CONTINUOUS))(alpha))
    assert np.max(np.abs(J)) >= 0.05, J          # the check is not of zeros
    assert np.max(np.abs(g - J)) <= 1e-2 * np.max(np.abs(J)), (g, J)


def test_derivatives_refused_where_not_available():
    """Second-order derivatives are not available with `index2`: a clear error that
    names what works, raised while JAX traces the derivative (`eval_shape`: nothing is
    solved)."""
    p = jnp.array(LINEAR_P)
    with pytest.raises(ValueError, match="second-order derivatives"):
        jax.eval_shape(jax.hessian(lambda p: linear_p_solve(p)[-1, 0]), p)


def test_undeclared_index3_fails_clearly():
    """The position-level pendulum (index 3), given as if index 1, is refused with
    `singular_matrix` — never a wrong answer marked successful."""
    def pendulum3(t, y, yp, args):
        return pendulum(t, y, yp, args).at[4].set(y[0] ** 2 + y[1] ** 2 - L ** 2)

    y0, yp0 = pendulum_initial()
    sol = dae.solve(pendulum3, 0.0, 3.0, y0, yp0, (L, G), algebraic=PENDULUM_INDEX2,
                    throw=False)
    assert sol.result == dae.RESULTS.singular_matrix


def test_index3_declared_as_index2_raises():
    """The position constraint x² + y² = L² at λ's index passes the Hessenberg structure
    checks (it depends on positions only) and the initial values satisfy it and its
    hidden constraint, but its hidden constraint does not determine λ (g_x f_z = 0):
    index 3, refused before the solve."""
    def pendulum3(t, y, yp, args):
        return pendulum(t, y, yp, args).at[4].set(y[0] ** 2 + y[1] ** 2 - L ** 2)

    y0, yp0 = pendulum_initial()
    with pytest.raises(ValueError, match=r"is not index 2 .* velocity constraint"):
        dae.solve(pendulum3, 0.0, 3.0, y0, yp0, (L, G), index2=PENDULUM_INDEX2)


def _linear_jac(t, y, yp, cj, a):
    return (jax.jacfwd(lambda v: linear(t, v, yp, a))(y)
            + cj * jax.jacfwd(lambda v: linear(t, y, v, a))(yp))


# Each solver is its own compiled program (~5-10 s of compilation each): the default suite
# keeps SparseLU (the scaling applied through a solver other than the default DenseLU)
# and the batched solve; the solvers whose J does not come from the residual (a user
# `jac`, GMRES), where the scaling is skipped, run with --runslow.
@pytest.mark.parametrize("solver", [
    "sparse", "vmap", pytest.param("user-jac", marks=pytest.mark.slow),
    pytest.param("krylov", marks=pytest.mark.slow)])
def test_other_linear_solvers_and_vmap(solver):
    """The column scaling goes through any solver that builds J from the residual
    (SparseLU), is skipped where J comes from elsewhere (a user `jac`, GMRES), and the
    solve batches: each within the bounds of the module docstring of the exact
    solution."""
    rtol = 1e-8
    y0, yp0 = linear_exact(np.array(0.0))
    y0, yp0 = jnp.asarray(y0), jnp.asarray(yp0)
    exact = linear_exact(np.array(5.0))[0]

    def check(ys):
        err = np.abs(np.asarray(ys) - exact)
        assert np.max(err[..., :2]) <= 100 * rtol and np.max(err[..., 2]) <= 1000 * rtol, err

    if solver == "vmap":
        check(jax.vmap(lambda y0_: dae.solve(linear, 0.0, 5.0, y0_, yp0, index2=LINEAR_INDEX2,
                                             rtol=rtol, atol=rtol).ys[-1])(jnp.stack([y0, y0])))
        return
    ls = {"sparse": dae.SparseLU, "user-jac": lambda: dae.DenseLU(jac=jax.jit(_linear_jac)),
          "krylov": dae.Krylov}[solver]()
    check(dae.solve(linear, 0.0, 5.0, y0, yp0, index2=LINEAR_INDEX2, rtol=rtol, atol=rtol,
                    linear_solver=ls).ys[-1])


def test_projection_linear():
    """init="ya_ydp" with `index2` projects: x1 = 0.1 off the constraint x1 = sin 0 goes
    to 0 (the only change of y0's differential part that satisfies it), then the hidden
    constraint and the differential equations give x1' = 1, z = cos 0 + x2 = 2,
    x2' = z − 2 x2 = 0 — the closed form's start, so the solve follows it (bounds of
    the module docstring)."""
    rtol = 1e-8
    ts = np.linspace(0.0, 5.0, 6)
    guess = jnp.array([0.1, 1.0, 0.0])
    for yp0 in (None, jnp.array([0.3, -0.2, 0.0])):
        sol = dae.solve(linear, 0.0, 5.0, guess, yp0, index2=LINEAR_INDEX2, init="ya_ydp",
                        saveat=jnp.asarray(ts), rtol=rtol, atol=rtol)
        y_exact, yp_exact = linear_exact(ts)
        np.testing.assert_allclose(np.asarray(sol.ys[0]), y_exact[0], rtol=0, atol=1e-12)
        np.testing.assert_allclose(np.asarray(sol.yps[0, :2]), yp_exact[0, :2], rtol=0,
                                   atol=1e-12)
        err = np.abs(np.asarray(sol.ys) - y_exact)
        assert np.max(err[:, :2]) <= 100 * rtol and np.max(err[:, 2]) <= 1000 * rtol


def test_projection_pendulum():
    """The pendulum from a velocity off the constraint x u + y v = 0 and yp0=None. The
    projection is the least change of (x, y, u, v) in the error weights' norm onto the
    constraint: optimality says the change δ is parallel to W⁻² ∇g = W⁻² (u, v, x, y)
    (W⁻¹ = rtol |y0| + atol); then λ and the accelerations come from the hidden
    constraint: λ = (u² + v² − g y)/(x² + y²), u' = −λ x, v' = −λ y − g."""
    rtol = atol = 1e-8
    y0, _ = pendulum_initial()
    guess = y0.at[2].set(0.2).at[3].set(0.3).at[4].set(0.0)
    sol = dae.solve(pendulum, 0.0, 0.5, guess, None, (L, G), index2=PENDULUM_INDEX2,
                    saveat=jnp.array([0.0, 0.5]), rtol=rtol, atol=atol)
    x, yy, u, v, lam = np.asarray(sol.ys[0])
    assert abs(x * u + yy * v) <= 1e-12
    w2 = (rtol * np.abs(np.asarray(guess[:4])) + atol) ** 2
    step = (np.asarray(sol.ys[0, :4]) - np.asarray(guess[:4])) / w2
    grad = np.array([u, v, x, yy])
    c = step @ grad / (grad @ grad)
    np.testing.assert_allclose(step, c * grad, rtol=1e-9)
    np.testing.assert_allclose(lam, (u * u + v * v - G * yy) / (x * x + yy * yy), rtol=1e-12)
    np.testing.assert_allclose(np.asarray(sol.yps[0, :4]), [u, v, -lam * x, -lam * yy - G],
                               rtol=1e-12, atol=1e-12)
