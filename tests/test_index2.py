"""Hessenberg index-2 DAEs (`solve(index2=...)`): forward accuracy against exact and
independent reference solutions, the Test Set's index-2 problems against their published
reference solutions, and clear errors for what is not index 2 or not consistent.

Bounds:
- differential variables within 100·rtol of the exact solution: the project's global
  error bound for a local error control (as in test_forward.py);
- index-2 variables within 1000·rtol: they are out of the error test and fixed by the
  hidden constraint, i.e. by y' — one order lower, the bound test_forward.py uses for
  y' of the dense output;
- Test Set problems: `scd` against the published reference, with the bound's source
  stated per problem.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.integrate import solve_ivp

import daeadjoint as dae
from .testset import fekete, tube


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
    """The Test Set's run: rtol = atol = 1e-8 and first step h0 = rtol, which IDA starts
    and solves to 3.7 digits. Undeclared, the iteration matrix at h = 1e-8 has a pivot
    ratio 8e-15 (the Schur complement of the pressures shrinks like h) and the solve
    stops with `singular_matrix`; with `index2` its index-2 columns are scaled by cj and
    it starts. Bound 3.5 digits: measured 3.6 (2253 steps), 0.1 digit under IDA's 3.7
    reported in issue 24 — not yet at IDA's level."""
    sol = _testset_solve(tube, 1e-8, first_step=1e-8)
    assert tube.scd(np.asarray(sol.ys[-1])) >= 3.5


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


def test_derivatives_refused():
    y0, yp0 = pendulum_initial()

    def final_x(length):
        return dae.solve(pendulum, 0.0, 1.0, y0, yp0, (length, G),
                         index2=PENDULUM_INDEX2).ys[-1, 0]

    for transform in (jax.grad, jax.jacfwd):
        with pytest.raises(ValueError, match=r"index2=.* not yet supported"):
            transform(final_x)(L)


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
