"""Property tests on random linear index-1 DAEs with exact solutions and exact gradients.

The family (n_d = 3 differential, n_a = 2 algebraic unknowns, k = 2 forcing parameters,
θ a scalar rate parameter):

    y_d' = θ A0 y_d + B y_a + Pb p
    0    = C y_d + D y_a + Pc p

D is well conditioned (singular values in [0.5, 2]), so the DAE has index 1 and the
algebraic part is y_a = −D⁻¹(C y_d + Pc p). Eliminating it leaves the affine ODE
y_d' = M y_d + N p with M = θ A0 − B D⁻¹ C and N = Pb − B D⁻¹ Pc, whose solution is exact
through the matrix exponential of the augmented matrix

    Mz = [[M, N p], [0, 0]],   [y_d(t); 1] = expm(Mz t) [y_d(0); 1].

A0 is built so that M is stable at the drawn θ (eigenvalues with real part ≤ −0.5).

Exact derivatives: for any parameter q of Mz, d/dq expm(Mz t) = L(Mz t, t ∂Mz/∂q), the
Fréchet derivative of the exponential (`scipy.linalg.expm_frechet`), with
∂Mz/∂θ = [[A0, 0], [0, 0]] and ∂Mz/∂p_j = [[0, N_j], [0, 0]]; and d y_d(t)/d y_d(0) is
the top-left block of expm(Mz t). The loss G = Σ_i w_iᵀ y(t_i) observes differential
and algebraic components at three times, so the adjoint's jumps on algebraic components
are exercised.

Tolerances (each assertion says which applies):
- Solution: global error within 100 tolerance units, |y_i − y_i,exact| ≤ 100 (rtol |y_i|
  + atol), the bound the exact-solution tests of tests/test_forward.py use (local error
  ≤ 1 unit per step, accumulated over O(100) steps on a stable problem).
- Gradient vs exact: the adjoint is solved to the same rtol, atol on O(1) adjoint
  variables, so it gets the same 100 units, measured on the gradient's scale:
  |g − g_exact| ≤ 100 rtol (|g_exact| + ‖g_exact‖_∞).
- Central differences: step h = 1e-3 on solves at rtol = atol = 1e-11, with the bound
  |FD − G'| ≤ h²/6 · 2|G'''| + 100 units(G)/h. The truncation term is 0 in p and y_d(0)
  (G is affine in them); in θ, G''' is computed from the exact solution (second central
  difference, step 1e-3, of the exact θ-derivative) and doubled to cover its variation
  over [θ − h, θ + h]. The noise term: each solve's error in G = Σ w·y is at most
  100 units, 100 · 1e-11 · Σ|w|(|y| + 1), and the two solves' errors add, /(2h).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import daeadjoint as dae

ND, NA, NK = 3, 2, 2
N = ND + NA
T1 = 2.0
T_OBS = np.array([0.5, 1.3, T1])
RTOL = ATOL = 1e-8
FD_RTOL = FD_ATOL = 1e-11
FD_STEP = 1e-3
ALGEBRAIC = np.array([False] * ND + [True] * NA)


# --------------------------------------------------------------------------- the family
def draw_problem(seed: int, theta: float) -> dict:
    """Matrices of one random DAE (numpy, float64), stable reduced ODE at this θ."""
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.standard_normal((NA, NA)))
    r, _ = np.linalg.qr(rng.standard_normal((NA, NA)))
    D = q @ np.diag(rng.uniform(0.5, 2.0, NA)) @ r           # singular values in [0.5, 2]
    B = rng.standard_normal((ND, NA)) / np.sqrt(NA)
    C = rng.standard_normal((NA, ND)) / np.sqrt(ND)
    R = rng.standard_normal((ND, ND)) / np.sqrt(ND)
    K = rng.standard_normal((ND, ND)) / np.sqrt(ND)
    M_target = -(R @ R.T + 0.5 * np.eye(ND)) + (K - K.T)      # Re λ ≤ −0.5
    A0 = (M_target + B @ np.linalg.solve(D, C)) / theta      # so that M(θ) = M_target
    return dict(
        A0=A0, B=B, C=C, D=D,
        Pb=rng.standard_normal((ND, NK)), Pc=rng.standard_normal((NA, NK)),
        p=rng.standard_normal(NK), yd0=rng.standard_normal(ND),
        ya_guess=rng.standard_normal(NA),   # any guess: init="ya_ydp" replaces it
        w=rng.standard_normal((len(T_OBS), N)),
    )


def residual(t, y, yp, args):
    theta, p, mats = args
    A0, B, C, D, Pb, Pc = mats
    yd, ya = y[:ND], y[ND:]
    return jnp.concatenate([yp[:ND] - (theta * A0 @ yd + B @ ya + Pb @ p),
                            C @ yd + D @ ya + Pc @ p])


def _mats(prob):
    return tuple(jnp.asarray(prob[k]) for k in ("A0", "B", "C", "D", "Pb", "Pc"))


# The continuous adjoint without its fallback to the discrete adjoint: the gradients
# checked here are the continuous adjoint's, and a failed backward integration must
# raise, not pass with the discrete adjoint's gradient and a warning; and the gradient
# program compiles without the fallback branch (a quarter of a gradient program's
# compilation, docs/performance.md). The fallback, which the default `Adjoint()`
# compiles: tests/test_adjoint.py::test_fallback_equals_the_discrete_adjoint_of_the_same_steps
# and the tests after it. (Forward solves and forward mode do not use it.)
CONTINUOUS = dae.Adjoint(fallback=False)


def solve(theta, p, y0, mats, rtol, atol):
    # y0's algebraic part is only a guess: init="ya_ydp" computes it (and y'0).
    return dae.solve(residual, 0.0, T1, y0, args=(theta, p, mats), saveat=jnp.asarray(T_OBS),
                     algebraic=jnp.asarray(ALGEBRAIC), init="ya_ydp", rtol=rtol, atol=atol,
                     sensitivity=CONTINUOUS)


def loss(theta, p, y0, mats, w, rtol=RTOL, atol=ATOL):
    return jnp.sum(w * solve(theta, p, y0, mats, rtol, atol).ys)


def loss_and_solution(theta, p, y0, mats, w):
    sol = solve(theta, p, y0, mats, RTOL, ATOL)
    return jnp.sum(w * sol.ys), sol


# The gradient and, as its auxiliary output, the solution of its forward run: one
# program for both checks (a separate solve compiled a program for the same
# integration).
grad_and_solution = jax.grad(loss_and_solution, argnums=(0, 1, 2), has_aux=True)
# Module-level compiled functions: every example of a test reuses one executable (the
# matrices and tolerances are arguments, not constants).
grad_jit = jax.jit(grad_and_solution)
loss_fd = jax.jit(jax.vmap(loss, in_axes=(0, 0, 0, None, None, None, None)))


# ------------------------------------------------------------------ exact solution/grad
def exact(prob, theta):
    """y(t_i) (len(T_OBS), N) and dG/d(θ, p, y_d0) from matrix exponentials."""
    A0, B, C, D, Pb, Pc = (prob[k] for k in ("A0", "B", "C", "D", "Pb", "Pc"))
    p, yd0, w = prob["p"], prob["yd0"], prob["w"]
    DinvC, DinvPc = np.linalg.solve(D, C), np.linalg.solve(D, Pc)
    M = theta * A0 - B @ DinvC
    Nmat = Pb - B @ DinvPc
    Mz = np.zeros((ND + 1, ND + 1))
    Mz[:ND, :ND], Mz[:ND, ND] = M, Nmat @ p
    z0 = np.append(yd0, 1.0)
    dMz = []                                         # ∂Mz/∂θ, ∂Mz/∂p_j
    E = np.zeros_like(Mz)
    E[:ND, :ND] = A0
    dMz.append(E)
    for j in range(NK):
        E = np.zeros_like(Mz)
        E[:ND, ND] = Nmat[:, j]
        dMz.append(E)
    ys = np.zeros((len(T_OBS), N))
    g_q = np.zeros(1 + NK)
    g_y0 = np.zeros(ND)
    for i, t in enumerate(T_OBS):
        expo = scipy.linalg.expm(Mz * t)
        yd = (expo @ z0)[:ND]
        ya = -(DinvC @ yd + DinvPc @ p)
        ys[i] = np.concatenate([yd, ya])
        wd, wa = w[i, :ND], w[i, ND:]
        # G_i = wd·y_d + wa·y_a = (wd − Cᵀ D⁻ᵀ wa)·y_d − wa·D⁻¹ Pc p
        w_eff = wd - DinvC.T @ wa
        for j, E in enumerate(dMz):
            _, dexpo = scipy.linalg.expm_frechet(Mz * t, E * t)
            g_q[j] += w_eff @ (dexpo @ z0)[:ND]
        g_q[1:] -= DinvPc.T @ wa
        g_y0 += expo[:ND, :ND].T @ w_eff
    return ys, g_q[0], g_q[1:], g_y0


def central_differences(prob, theta, mats):
    """Central differences of G in (θ, p, y_d0), all perturbations in one vmapped call."""
    n = 1 + NK + ND
    steps = FD_STEP * np.eye(n)
    th = np.concatenate([theta + steps[:, 0], theta - steps[:, 0]])
    ps = np.concatenate([prob["p"] + steps[:, 1:1 + NK], prob["p"] - steps[:, 1:1 + NK]])
    y0 = np.concatenate([prob["yd0"], prob["ya_guess"]])
    dy = np.pad(steps[:, 1 + NK:], ((0, 0), (0, NA)))       # differential part only
    ys = np.concatenate([y0 + dy, y0 - dy])
    vals = np.asarray(loss_fd(jnp.asarray(th), jnp.asarray(ps), jnp.asarray(ys), mats,
                              jnp.asarray(prob["w"]), FD_RTOL, FD_ATOL))
    fd = (vals[:n] - vals[n:]) / (2 * FD_STEP)
    return fd[0], fd[1:1 + NK], fd[1 + NK:]


def fd_error_bound(prob, theta, ys_exact):
    """Per-component bound on |central difference − exact derivative| (module docstring):
    truncation (θ only) + noise of the rtol-1e-11 solves."""
    d = 1e-3
    g3 = (exact(prob, theta + d)[1] - 2 * exact(prob, theta)[1] + exact(prob, theta - d)[1]) / d**2
    truncation = np.zeros(1 + NK + ND)
    truncation[0] = FD_STEP**2 / 6 * 2 * abs(g3)
    solve_error = 100 * np.sum(np.abs(prob["w"]) * (FD_RTOL * np.abs(ys_exact) + FD_ATOL))
    return truncation + 2 * solve_error / (2 * FD_STEP)


def units(err, ref, rtol, atol):
    """Error in tolerance units: max_i |err_i| / (rtol |ref_i| + atol)."""
    return float(np.max(np.abs(err) / (rtol * np.abs(ref) + atol)))


def grad_units(g, g_exact, rtol):
    """Gradient error in units of rtol on the gradient's scale (see module docstring)."""
    g, g_exact = np.atleast_1d(g), np.atleast_1d(g_exact)
    scale = np.abs(g_exact) + np.max(np.abs(g_exact))
    return float(np.max(np.abs(g - g_exact) / (rtol * scale)))


# ------------------------------------------------------------------------------ checks
def check_problem(seed, theta, scalar_theta, mode):
    prob = draw_problem(seed, theta)
    mats = _mats(prob)
    th = float(theta) if scalar_theta else jnp.asarray(theta)
    p = jnp.asarray(prob["p"])
    y0 = jnp.asarray(np.concatenate([prob["yd0"], prob["ya_guess"]]))
    ys_exact, g_th, g_p, g_y0 = exact(prob, theta)

    derivative = grad_jit if mode == "jit" else grad_and_solution
    grads, sol = derivative(th, p, y0, mats, jnp.asarray(prob["w"]))
    assert sol.result == dae.RESULTS.successful

    # Forward: within 100 tolerance units of the exact solution (module docstring).
    u = units(np.asarray(sol.ys) - ys_exact, ys_exact, RTOL, ATOL)
    assert u <= 100, f"solution error {u:.1f} tolerance units"

    # Gradient w.r.t. θ (a Python float or a 0-d array), p and y_d(0) against the exact
    # derivative, 100 units on the gradient's scale.
    d_th, d_p, d_y0 = (np.asarray(g) for g in grads)
    assert d_th.shape == () and d_p.shape == (NK,) and d_y0.shape == (N,)
    # init="ya_ydp": the algebraic part of y0 is recomputed, so it gets zero gradient.
    np.testing.assert_array_equal(d_y0[ND:], 0.0)
    got = np.concatenate([[d_th], d_p, d_y0[:ND]])
    want = np.concatenate([[g_th], g_p, g_y0])
    gu = grad_units(got, want, RTOL)
    assert gu <= 100, f"gradient error {gu:.1f} units: {got} vs exact {want}"

    # Central differences agree with the exact derivative (validates the FD bound) and
    # with the adjoint gradient (bound: FD bound + the adjoint's 100 units).
    fd_th, fd_p, fd_y0 = central_differences(prob, theta, mats)
    fd = np.concatenate([[fd_th], fd_p, fd_y0])
    fd_bound = fd_error_bound(prob, theta, ys_exact)
    assert np.all(np.abs(fd - want) <= fd_bound), (fd, want, fd_bound)
    adj_bound = fd_bound + 100 * RTOL * (np.abs(want) + np.max(np.abs(want)))
    assert np.all(np.abs(got - fd) <= adj_bound), (got, fd, adj_bound)


seeds = st.integers(min_value=0, max_value=2**32 - 1)
thetas = st.floats(min_value=0.5, max_value=2.0)


@settings(max_examples=4, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(seed=seeds, theta=thetas, scalar_theta=st.booleans())
def test_random_linear_index1_dae_jit(seed, theta, scalar_theta):
    """Bounded run for the default suite: four random DAEs, one compiled gradient (with
    the solution) and one compiled batch of finite differences shared by all."""
    check_problem(seed, theta, scalar_theta, "jit")


# Both run with --runslow (the default suite's budget: eagerly the gradient compiles its
# pieces one by one, four programs, ~40 CPU s against the jitted gradient's one). The
# default suite covers jax.grad without an outer jit against the exact derivative in
# test_user_inputs_and_messages.py::test_gradient_for_every_input_kind[eager-python-float]
# and [eager-weak-jnp], and these random DAEs' checks (algebraic observations, the
# adjoint's jumps, init="ya_ydp", exact solution and gradient, central differences)
# through the same solver programs, jitted, in test_random_linear_index1_dae_jit.
@pytest.mark.parametrize("scalar_theta", [
    pytest.param(True, id="python-float", marks=pytest.mark.slow),
    pytest.param(False, id="array", marks=pytest.mark.slow)])
def test_random_linear_index1_dae_eager(scalar_theta):
    """The same checks without an outer jax.jit (each call traces anew, so one problem)."""
    check_problem(20261122, 1.3, scalar_theta, "eager")


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=seeds, theta=thetas, scalar_theta=st.booleans())
def test_random_linear_index1_dae_long(seed, theta, scalar_theta):
    """Long run: 150 random DAEs (same compiled functions)."""
    check_problem(seed, theta, scalar_theta, "jit")


# ------------------------------------------------------------------------ forward mode
def test_random_linear_index1_dae_forward_mode():
    """jax.jvp and jax.jacfwd through solve: the directional derivative of y(t_i) and the
    Jacobian of G in (θ, p), against the exact derivatives, 100 units as above."""
    prob = draw_problem(7, 1.1)
    mats = _mats(prob)
    w = jnp.asarray(prob["w"])
    p = jnp.asarray(prob["p"])
    y0 = jnp.asarray(np.concatenate([prob["yd0"], prob["ya_guess"]]))
    _, g_th, g_p, g_y0 = exact(prob, 1.1)

    # jvp of G along (θ̇, ṗ, ẏ_d0) = (1, 1, ..., 1) (the algebraic guess held fixed): the
    # sum of all exact partials.
    _, dG = jax.jvp(lambda th, p, y0: loss(th, p, y0, mats, w), (1.1, p, y0),
                    (1.0, jnp.ones(NK), jnp.concatenate([jnp.ones(ND), jnp.zeros(NA)])))
    want = g_th + np.sum(g_p) + np.sum(g_y0)
    scale = abs(g_th) + np.sum(np.abs(g_p)) + np.sum(np.abs(g_y0))
    assert abs(float(dG) - want) <= 100 * RTOL * 2 * scale

    jac = jax.jacfwd(lambda q: loss(q[0], q[1:], y0, mats, w))(
        jnp.concatenate([jnp.array([1.1]), p]))
    assert grad_units(np.asarray(jac), np.concatenate([[g_th], g_p]), RTOL) <= 100
