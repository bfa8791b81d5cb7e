"""Constant-lag delay DAEs (`solve(..., delays=, history=)`).

Exact solutions by the method of steps:

- y'(t) = −y(t − τ), y = c for t ≤ 0: on [(j−1)τ, jτ] the solution is a polynomial, and
  summed over the pieces y(t) = c Σ_{k=0}^{⌊t/τ⌋+1} (−1)^k (t − (k−1)τ)^k / k!, whose
  derivative in τ is exact too (the sum is C^⌊t/τ⌋ in τ at t = jτ, so the formula is
  differentiable there). dy/dc = y/c (linear in c).
- the same with the history h(t) = 1 + a t: its pieces are polynomials in t and a,
  integrated exactly (polynomials); dy(5)/da exactly.
- the same equation written as a DAE, y1' = −z(t − 1), 0 = z − y1 (the lagged argument
  is the algebraic variable): the same solution.

Kermack–McKendrick (Calver & Enright, §3.2.2) against an independent solver: the
method of steps with scipy's DOP853 at rtol = atol = 1e-13 on the unit intervals
between its breaking points (all integers, since τ1 = 1 and τ2 = 10).

Tolerances: the bound 100·tol of the library's exact-solution tests (the global error of
an integration over five delays, each restart at a breaking point included, is a modest
multiple of the local tolerance).
"""

import math

import equinox as eqx
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

import daeadjoint as dae

T = 5.0
SAVEAT = jnp.array([0.5, 1.0, 1.5, 2.3, 3.0, 3.7, 4.2, 5.0])


def retarded(t, y, yp, y_lag, args):
    """y'(t) = −y(t − τ)."""
    return yp + y_lag[0]


def first_arg(p):
    return p[:1]


def exact(t, tau=1.0, c=1.0):
    return c * sum((-1) ** k * (t - (k - 1) * tau) ** k / math.factorial(k)
                   for k in range(int(t / tau) + 2))


def exact_dtau(t, tau=1.0, c=1.0):
    return c * sum((-1) ** k * (t - (k - 1) * tau) ** (k - 1) / math.factorial(k - 1) * (1 - k)
                   for k in range(1, int(t / tau) + 2))


def solve_retarded(p, tol):
    """p = (τ, c): y' = −y(t − τ), y = c for t ≤ 0."""
    return dae.solve(retarded, 0.0, T, p[1] * jnp.ones(1), args=p, delays=first_arg,
                     saveat=SAVEAT, rtol=tol, atol=tol)


def y_end(p, tol):
    return solve_retarded(p, tol).ys[-1, 0]


def solution_and_forward_derivatives(p, tol):
    """The solution at SAVEAT (the primal output of jax.jvp) and d y(5)/d(τ, history
    value) by forward sensitivities: one compiled program (the solve's jvp) for both
    directions and both tolerances, and no separate forward program."""
    sol, J = None, []
    for e in jnp.eye(2):
        sol, tangent = jax.jvp(lambda p: solve_retarded(p, tol), (p,), (e,))
        J.append(float(tangent.ys[-1, 0]))
    return np.array(J), sol


@pytest.mark.parametrize("tol", [1e-6, 1e-9])
def test_exact_solution_and_forward_derivatives(tol):
    """y and y' at SAVEAT, and d y(5)/dτ, d y(5)/d(history value) by forward
    sensitivities, against the exact ones."""
    J, sol = solution_and_forward_derivatives(jnp.array([1.0, 1.0]), tol)
    assert sol.result == dae.RESULTS.successful
    want = np.array([exact(float(t)) for t in SAVEAT])
    err = np.max(np.abs(np.asarray(sol.ys[:, 0]) - want))
    assert err < 100 * tol, err
    # y' is the dense output's derivative: y'(t) = −y(t − 1).
    want_p = np.array([-exact(float(t) - 1.0) if t > 1 else -1.0 for t in SAVEAT])
    assert np.max(np.abs(np.asarray(sol.yps[:, 0]) - want_p)) < 100 * tol
    want_J = np.array([exact_dtau(T), exact(T)])   # (7/6, 19/120)
    assert np.max(np.abs(J - want_J)) < 100 * tol, (J, want_J)


@pytest.mark.slow
def test_jacfwd_exact():
    tol = 1e-9
    J = np.asarray(jax.jacfwd(y_end)(jnp.array([1.0, 1.0]), tol))
    assert np.max(np.abs(J - np.array([exact_dtau(T), exact(T)]))) < 100 * tol, J


@pytest.mark.slow
def test_forward_derivative_away_from_a_breaking_point():
    """τ = 0.9: t = 5 is not a breaking point; jvp along τ against the exact sum and
    against central differences of the solver."""
    tol = 1e-9
    p = jnp.array([0.9, 1.0])
    v, dv = jax.jvp(lambda p: y_end(p, tol), (p,), (jnp.array([1.0, 0.0]),))
    assert abs(float(v) - exact(T, 0.9)) < 100 * tol
    assert abs(float(dv) - exact_dtau(T, 0.9)) < 100 * tol
    eps = 1e-4   # central differences: truncation O(eps²·y''') ~ 1e-8, noise tol/eps ~ 1e-5
    fd = (y_end(p + jnp.array([eps, 0.0]), tol) - y_end(p - jnp.array([eps, 0.0]), tol)) / (2 * eps)
    assert abs(float(dv) - float(fd)) < 1e-4


# ------------------------------------------------------------- history function


def linear_history(t, p):
    return jnp.array([1.0 + p[0] * t])


def one_lag(p):
    return jnp.array([1.0])


def exact_linear_history(a_value, t_end=5):
    """y(t_end) and dy(t_end)/da for y' = −y(t − 1), y = 1 + a t (t ≤ 0), exactly (to
    rounding): the method of steps on polynomials, y(t) = y(j − 1) − ∫_{j−1}^t y(s − 1) ds
    on [j − 1, j]. The problem is linear and the history affine in a, so y(t_end) is
    affine in a: its derivative is y(t_end; a = 1) − y(t_end; a = 0)."""
    from numpy.polynomial import Polynomial as P

    def y_end(a):
        piece = P([1.0, a])                       # y on [−1, 0]
        value_at = 1.0                            # y(0)
        for j in range(1, t_end + 1):             # y on [j − 1, j]
            lagged = piece(P([-1.0, 1.0]))        # y(s − 1) as a polynomial in s
            antiderivative = lagged.integ()
            piece = value_at - (antiderivative - antiderivative(j - 1))
            value_at = piece(j)
        return value_at

    return y_end(a_value), y_end(1.0) - y_end(0.0)


@pytest.mark.slow
def test_history_function_and_its_parameter():
    tol = 1e-9

    def end(p):
        sol = dae.solve(retarded, 0.0, T, jnp.ones(1), args=p, delays=one_lag,
                        history=linear_history, rtol=tol, atol=tol)
        return sol.ys[-1, 0]

    a = 0.3
    v, dv = jax.jvp(end, (jnp.array([a]),), (jnp.array([1.0]),))
    want, dwant = exact_linear_history(a)
    assert abs(float(v) - want) < 100 * tol
    assert abs(float(dv) - dwant) < 100 * tol


# ------------------------------------------------------------------- delay DAE


def retarded_dae(t, y, yp, y_lag, args):
    """y1' = −z(t − τ), 0 = z − y1: the lagged argument is the algebraic variable."""
    return jnp.array([yp[0] + y_lag[0, 1], y[1] - y[0]])


@pytest.mark.slow
def test_delay_dae_with_algebraic_lagged_variable():
    tol = 1e-8

    def end(p):
        sol = dae.solve(retarded_dae, 0.0, T, p[1] * jnp.ones(2), args=p, delays=first_arg,
                        algebraic=jnp.array([False, True]), rtol=tol, atol=tol)
        return sol.ys[-1]

    p = jnp.array([1.0, 1.0])
    y = np.asarray(end(p))
    assert np.max(np.abs(y - exact(T))) < 100 * tol
    J = np.asarray(jax.jacfwd(end)(p))
    want = np.array([exact_dtau(T), exact(T)])
    assert np.max(np.abs(J[0] - want)) < 100 * tol, (J, want)
    assert np.max(np.abs(J[1] - want)) < 100 * tol


# ------------------------------------------------------------------ limits, errors


def test_reverse_mode_through_a_differentiated_jit_is_refused_clearly():
    """jax.grad(jax.jit(f)) linearizes after the forward-mode rule chose one variational
    solve, which has no transpose: refused while JAX builds the backward pass (traced
    only, nothing is compiled), with the way round it."""
    with pytest.raises(Exception, match=r"write jax.jit\(jax.grad\(f\)\)"):
        jax.make_jaxpr(jax.grad(jax.jit(lambda p: y_end(p, 1e-6))))(jnp.array([1.0, 1.0]))


@pytest.mark.slow
def test_grad_exact():
    """jax.grad (J·ṗ transposed, J from one variational solve per input) inside jit."""
    tol = 1e-9
    g = np.asarray(jax.jit(jax.grad(lambda p: y_end(p, tol)))(jnp.array([1.0, 1.0])))
    assert np.max(np.abs(g - np.array([exact_dtau(T), exact(T)]))) < 100 * tol, g


@pytest.mark.slow
def test_history_ring_too_small_is_a_status():
    sol = dae.solve(retarded, 0.0, T, jnp.ones(1), args=jnp.array([1.0, 1.0]),
                    delays=first_arg, rtol=1e-9, atol=1e-9, history_steps=5, throw=False)
    assert sol.result == dae.RESULTS.delay_history_lost
    assert float(sol.stats["t_final"]) < 1.0
    assert "history_steps" in dae.RESULTS.delay_history_lost.__repr__()


@pytest.mark.parametrize("tau", [0.0, -1.0, float("inf")])
def test_nonpositive_delay_is_refused(tau):
    with pytest.raises(ValueError, match="positive and finite"):
        dae.solve(retarded, 0.0, T, jnp.ones(1), delays=jnp.array([tau]))


@pytest.mark.slow
def test_traced_nonpositive_delay_is_a_status():
    @jax.jit
    def run(tau):
        return dae.solve(retarded, 0.0, T, jnp.ones(1), args=jnp.array([tau, 1.0]),
                         delays=first_arg, throw=False).result

    assert run(-1.0) == dae.RESULTS.invalid_delay


def test_out_of_scope_inputs_are_refused():
    y0 = jnp.ones(1)
    with pytest.raises(ValueError, match="state- or time-dependent delays"):
        dae.solve(retarded, 0.0, T, y0, delays=lambda t, y: jnp.array([1.0]))
    with pytest.raises(ValueError, match="F\\(t, y, yp, y_lag, args\\)"):
        dae.solve(lambda t, y, yp, a: yp + y, 0.0, T, y0, delays=jnp.array([1.0]))
    with pytest.raises(ValueError, match="Neutral terms"):
        dae.solve(lambda t, y, yp, yl, ypl, a: yp + yl[0], 0.0, T, y0, delays=jnp.array([1.0]))
    with pytest.raises(ValueError, match=r"history.*delays"):
        dae.solve(lambda t, y, yp, a: yp + y, 0.0, T, y0, history=lambda t, a: y0)
    with pytest.raises(ValueError, match="shaped like y0"):
        dae.solve(retarded, 0.0, T, y0, delays=jnp.array([1.0]),
                  history=lambda t, a: jnp.ones(2))
    for name, value in (("event", dae.Event(lambda t, y, yp, a: y)), ("dense", True)):
        with pytest.raises(ValueError, match=f"`{name}=` is not supported with `delays=`"):
            dae.solve(retarded, 0.0, T, y0, delays=jnp.array([1.0]), **{name: value})


def test_derivative_wrt_output_time_is_refused():
    def end(t1):
        return dae.solve(retarded, 0.0, t1, jnp.ones(1), delays=jnp.array([1.0])).ys[-1, 0]

    with pytest.raises(ValueError, match="with respect to t1"):
        jax.jvp(end, (5.0,), (1.0,))


def test_breaking_points():
    """t0 + Σ kᵢτᵢ, 1 ≤ Σ kᵢ ≤ order, sorted; near-coincident sums merged (0.1·3 vs 0.3)."""
    from daeadjoint._delay.solve import breaking_points
    b = np.asarray(breaking_points(jnp.asarray(0.5), jnp.array([1.0, 2.5]), 2))
    assert np.allclose(np.unique(b), [1.5, 2.5, 3.0, 4.0, 5.5])
    b = np.asarray(breaking_points(jnp.asarray(0.0), jnp.array([0.1, 0.3]), 3))
    assert np.unique(b).shape[0] == np.unique(np.round(b, 12)).shape[0]
    assert np.min(np.diff(np.unique(b))) > 1e-3


def test_step_lookup_is_the_linear_scan():
    """The lagged values' step lookup (a binary search over the ring in the order the
    steps were taken) against its definition, a scan of every slot for a < q ≤ b with
    the newest step where none holds q: rings partly filled, full, and wrapped several
    times, at points inside steps, on both ends of each step, before the oldest kept
    step and past the newest. And the sorted-breakpoint searches against theirs."""
    from collections import namedtuple

    from daeadjoint._delay.buffer import DelayBuffer, count_below
    Step = namedtuple("Step", "t phi psi k_used")   # what `record` reads of a step
    rng = np.random.default_rng(1)
    C, n = 7, 2
    buf = DelayBuffer.empty(0.0, 3.0, None, C, n, jnp.float64)
    locate, record = jax.jit(DelayBuffer.locate), jax.jit(DelayBuffer.record)
    t = 0.0
    for attempt in range(26):
        tl, tr = np.asarray(buf.t_left), np.asarray(buf.t_right)
        filled = tr[np.isfinite(tr)]
        q = np.concatenate([tl[np.isfinite(tl)], filled, rng.uniform(-1.0, t + 1.0, 20),
                            [t, t + 1e-3, -1.0]])
        # the definition (as it was computed before the binary search)
        inside = (tl[None, :] < q[:, None]) & (q[:, None] <= tr[None, :])
        want = np.where(inside.any(axis=1), inside.argmax(axis=1), (int(buf.count) - 1) % C)
        got = np.asarray(locate(buf, jnp.asarray(q)))
        assert np.array_equal(got, want), (attempt, q, got, want)
        t += float(rng.uniform(0.05, 1.0))
        state = Step(t=jnp.asarray(t), phi=jnp.zeros((6, n)), psi=jnp.ones(6),
                     k_used=jnp.asarray(1, jnp.int32))
        buf = record(buf, state, jnp.asarray(attempt % 5 != 3))   # some rejected steps
    for size in (1, 5, 33):
        b = np.sort(np.round(rng.uniform(0.0, 5.0, size), 1))   # with repeated values
        x = np.concatenate([b, b + 1e-15, b - 1e-15, rng.uniform(-1.0, 6.0, 30)])
        got = np.asarray(count_below(jnp.asarray(b), jnp.asarray(x)))
        assert np.array_equal(got, np.searchsorted(b, x, side="left"))
        bb = DelayBuffer.empty(0.0, 1.0, jnp.asarray(b), 3, n, jnp.float64)
        width = 16 * np.finfo(float).eps * np.maximum(np.abs(b), 1.0)
        got = np.asarray(jax.vmap(bb.is_breakpoint)(jnp.asarray(x)))
        assert np.array_equal(got, np.any(b[None] == x[:, None], axis=1))
        got = np.asarray(jax.vmap(bb.just_after_breakpoint)(jnp.asarray(x)))
        near = (x[:, None] > b[None]) & (x[:, None] - b[None] <= width[None])
        assert np.array_equal(got, np.any(near, axis=1))


# ------------------------------------------------------------ Kermack–McKendrick

KM_P = np.array([5.0, 0.1, 1.0, 1.0, 10.0])   # a, b, c (history), τ1, τ2
KM_TS = np.array([5.0, 10.0, 20.0, 30.0, 40.0, 55.0])


def km(t, y, yp, y_lag, p):
    y1, y2, _ = y
    lag1, lag2 = y_lag[0, 1], y_lag[1, 1]
    return yp - jnp.array([-y1 * lag1 + lag2, y1 * lag1 - y2, y2 - lag2])


def km_lags(p):
    return p[3:]


def km_solve(p, tol, history_steps=1000):
    return dae.solve(km, 0.0, 55.0, p[:3], args=p, delays=km_lags, saveat=jnp.asarray(KM_TS),
                     rtol=tol, atol=tol, history_steps=history_steps).ys


def km_reference(p=KM_P, ts=KM_TS):
    """The method of steps with scipy's DOP853 (rtol = atol = 1e-13) on [k, k + 1]."""
    from scipy.integrate import solve_ivp
    a, b, c, tau1, tau2 = p
    assert tau1 == 1.0 and tau2 == 10.0   # the unit intervals are then its breaking points
    pieces = []

    def y_at(s):
        if s <= 0:
            return np.array([a, b, c])
        return pieces[min(int(np.ceil(s)) - 1, len(pieces) - 1)](s)

    def rhs(t, y):
        l1, l2 = y_at(t - tau1)[1], y_at(t - tau2)[1]
        return [-y[0] * l1 + l2, y[0] * l1 - y[1], y[1] - l2]

    y = np.array([a, b, c])
    for k in range(55):
        sol = solve_ivp(rhs, (k, k + 1), y, method="DOP853", rtol=1e-13, atol=1e-13,
                        dense_output=True)
        pieces.append(sol.sol)
        y = sol.y[:, -1]
    return np.array([y_at(t) for t in ts])


@pytest.mark.slow
@pytest.mark.parametrize("tol", [1e-6, 1e-9])
def test_kermack_mckendrick(tol):
    ys = np.asarray(km_solve(jnp.asarray(KM_P), tol))
    ref = km_reference()
    err = np.max(np.abs(ys - ref) / np.maximum(np.abs(ref), 1.0))
    assert err < 100 * tol, err
    # y1 + y2 + y3 is conserved (the lagged terms cancel).
    assert np.max(np.abs(ys.sum(axis=1) - KM_P[:3].sum())) < 100 * tol


@pytest.mark.slow
def test_kermack_mckendrick_forward_derivatives():
    """d y(t_i)/d(a, b, c, τ1, τ2) by jax.jacfwd against central differences of the
    independent reference (step 1e-5 in a, b, c; the lags are fixed at 1 and 10 there,
    so their columns are checked against central differences of the solver itself at
    rtol 1e-10)."""
    tol = 1e-9
    J = np.asarray(jax.jacfwd(km_solve)(jnp.asarray(KM_P), tol))   # (6, 3, 5)
    eps = 1e-5   # truncation eps²·y''' ~ 1e-10; reference noise 1e-13/eps ~ 1e-8
    for i in range(3):
        e = np.zeros(5)
        e[i] = eps
        fd = (km_reference(KM_P + e) - km_reference(KM_P - e)) / (2 * eps)
        scale = np.maximum(np.abs(fd), 1.0)
        assert np.max(np.abs(J[:, :, i] - fd) / scale) < 1e-5, (i, J[:, :, i], fd)
    eps = 1e-4
    for i in (3, 4):
        e = np.zeros(5)
        e[i] = eps
        # (at rtol 1e-10 more than 1000 steps fall within τ2 = 10)
        fd = (np.asarray(km_solve(jnp.asarray(KM_P + e), 1e-10, 5000))
              - np.asarray(km_solve(jnp.asarray(KM_P - e), 1e-10, 5000))) / (2 * eps)
        scale = np.maximum(np.abs(fd), 1.0)
        # solver noise 1e-10·(error growth ~1e2)/eps ~ 1e-4 relative at worst
        assert np.max(np.abs(J[:, :, i] - fd) / scale) < 1e-3, (i, J[:, :, i], fd)


@pytest.mark.slow
def test_vmap_over_delays():
    """vmap of the solve and of jacfwd over τ (t = 5 a breaking point or not)."""
    taus = jnp.array([0.7, 0.9, 1.0, 1.3])
    P = jnp.stack([taus, jnp.ones(4)], axis=1)
    tol = 1e-8
    v = np.asarray(jax.vmap(lambda p: y_end(p, tol))(P))
    J = np.asarray(jax.vmap(jax.jacfwd(lambda p: y_end(p, tol)))(P))
    for i, tau in enumerate(np.asarray(taus)):
        assert abs(v[i] - exact(T, tau)) < 100 * tol
        assert abs(J[i, 0] - exact_dtau(T, tau)) < 100 * tol
        assert abs(J[i, 1] - exact(T, tau)) < 100 * tol


def jumping_history(t, p):
    """(y1, z) = (1, 0) for t ≤ 0, while z(0) = y1(0) = 1: z jumps at t0."""
    return jnp.array([1.0, 0.0])


@pytest.mark.slow
def test_lagged_algebraic_jump_is_read_from_the_correct_side():
    """y1' = −z(t − 1), 0 = z − y1 with z = 0 before t0 and 1 at t0: y1 = 1 on [0, 1],
    then y1(t) = u(t − 1) with u the solution of y' = −y(t − 1), y = 1 for t ≤ 0, so
    y1(5) = u(4) · y1(0) (linear in y1(0)). The step ending on t = 1 must read z(0⁻) = 0
    (the left limit), the restart there z(0⁺) = 1. (Measured: reading the left limit at
    the restart too fails the solve with repeated error-test failures; reading the
    right one everywhere is caught only by the error test, at 186 steps instead of 151.)"""
    tol = 1e-8

    def end(y10):
        y0 = jnp.array([y10, y10])
        sol = dae.solve(retarded_dae, 0.0, T, y0, args=jnp.array([1.0]), delays=one_lag,
                        history=jumping_history, algebraic=jnp.array([False, True]),
                        saveat=jnp.array([0.5, 1.0, T]), rtol=tol, atol=tol)
        return sol.ys[:, 0]

    v, dv = jax.jvp(end, (1.0,), (1.0,))
    want = np.array([1.0, 1.0, exact(T - 1.0)])
    assert np.max(np.abs(np.asarray(v) - want)) < 100 * tol, v
    assert np.max(np.abs(np.asarray(dv) - want)) < 100 * tol, dv


# ------------------------------------------- two incommensurate lags, t0 ≠ 0, h(t)

MG_T0, MG_T1, MG_TAU = 2.0, 12.0, (0.7, 1.9)
MG_TS = np.array([3.0, 5.5, 8.0, 12.0])


def mg_rate(y, l1, l2):
    """A Mackey–Glass-type feedback with a second, damping lag."""
    return 0.2 * l1 / (1 + l1**10) - 0.1 * y - 0.05 * l2


def mg(t, y, yp, y_lag, p):
    return yp - mg_rate(y, y_lag[0], y_lag[1])


def mg_history(t, p):
    return jnp.array([0.5 + p[0] * jnp.sin(t)])


def mg_reference(amplitude):
    """The method of steps with DOP853 (rtol = atol = 1e-13) between every breaking
    point t0 + a τ1 + b τ2 in (t0, t1)."""
    from scipy.integrate import solve_ivp

    def hist(t):
        return np.array([0.5 + amplitude * np.sin(t)])

    bps = sorted({MG_T0 + a * MG_TAU[0] + b * MG_TAU[1] for a in range(16) for b in range(6)})
    bps = [b for b in bps if MG_T0 < b < MG_T1] + [MG_T1]
    pieces = []

    def y_at(s):
        if s <= MG_T0:
            return hist(s)
        for lo, hi, sol in pieces:
            if lo <= s <= hi:
                return sol(s)
        raise ValueError(s)

    y, lo = hist(MG_T0), MG_T0
    for b in bps:
        sol = solve_ivp(lambda t, y: mg_rate(y, y_at(t - MG_TAU[0]), y_at(t - MG_TAU[1])),
                        (lo, b), y, method="DOP853", rtol=1e-13, atol=1e-13, dense_output=True)
        pieces.append((lo, b, sol.sol))
        y, lo = sol.y[:, -1], b
    return np.array([y_at(t)[0] for t in MG_TS])


@pytest.mark.slow
def test_two_lags_history_function_and_shifted_origin():
    tol = 1e-9

    def ys(p):
        sol = dae.solve(mg, MG_T0, MG_T1, mg_history(MG_T0, p), args=p,
                        delays=jnp.array(MG_TAU), history=mg_history,
                        saveat=jnp.asarray(MG_TS), rtol=tol, atol=tol)
        return sol.ys[:, 0]

    p = jnp.array([0.1])
    v, dv = jax.jvp(ys, (p,), (jnp.ones(1),))
    assert np.max(np.abs(np.asarray(v) - mg_reference(0.1))) < 100 * tol
    eps = 1e-4   # truncation eps²·y''' ~ 1e-9; reference noise 1e-13/eps ~ 1e-9
    fd = (mg_reference(0.1 + eps) - mg_reference(0.1 - eps)) / (2 * eps)
    assert np.max(np.abs(np.asarray(dv) - fd)) < 100 * tol, (dv, fd)


# ----------------------------------------------------------------- quadratures


def integrand(t, y, yp, args):
    return y


@pytest.mark.slow
def test_quadrature_and_its_forward_derivatives():
    """I(τ, c) = ∫_0^4 y dt for y' = −y(t − τ), y = c (t ≤ 0). Integrating the equation,
    ∫_0^{4+τ} y'(t) dt = −∫_{−τ}^{4} y, so I = c − cτ − y(4 + τ): at τ = 1, I = −y(5),
    dI/dc = I, dI/dτ = −1 − y'(5) − ∂y(5)/∂τ = −1 + y(4) − ∂y(5)/∂τ (c = 1)."""
    tol = 1e-9

    def integral(p):
        sol = dae.solve(retarded, 0.0, T, p[1] * jnp.ones(1), args=p, delays=first_arg,
                        quadrature=integrand, quad_error_control=True,
                        saveat=jnp.array([4.0, T]), rtol=tol, atol=tol)
        return sol.qs[0, 0]

    p = jnp.array([1.0, 1.0])
    value, dI_dtau = jax.jvp(integral, (p,), (jnp.array([1.0, 0.0]),))
    _, dI_dc = jax.jvp(integral, (p,), (jnp.array([0.0, 1.0]),))
    assert abs(float(value) + exact(T)) < 100 * tol
    assert abs(float(dI_dc) + exact(T)) < 100 * tol
    assert abs(float(dI_dtau) - (-1.0 + exact(4.0) - exact_dtau(T))) < 100 * tol


@pytest.mark.slow
def test_closed_over_parameter_is_differentiated():
    """A residual closing over the parameter k (y' = −k y(t − 1), y = 1 for t ≤ 0): on
    [0, 3] y(3) = 1 − 3k + 2k² − k³/6, so dy(3)/dk = −3 + 4k − k²/2 (method of steps)."""
    tol = 1e-9

    def end(k):
        def residual(t, y, yp, y_lag, args):
            return yp + k * y_lag[0]
        return dae.solve(residual, 0.0, 3.0, jnp.ones(1), delays=jnp.array([1.0]),
                         rtol=tol, atol=tol).ys[0, 0]

    k = 0.7
    v, dv = jax.jvp(end, (k,), (1.0,))
    assert abs(float(v) - (1 - 3 * k + 2 * k**2 - k**3 / 6)) < 100 * tol
    assert abs(float(dv) - (-3 + 4 * k - k**2 / 2)) < 100 * tol
    assert abs(float(jax.jit(jax.grad(end))(k)) - (-3 + 4 * k - k**2 / 2)) < 100 * tol


# ------------------------------------------- a delayed feedback controller on a plant


def controlled_tank(t, y, yp, y_lag, p):
    """A tank (level h) drained through an orifice (q_out = c√h, algebraic) and filled by
    a proportional controller that sees the level τ late (q_in = k (h_ref − h(t − τ)),
    algebraic): an index-1 delay DAE whose lag and gains are parameters."""
    k, _, c = p
    h, q_out, q_in = y
    return jnp.array([yp[0] - q_in + q_out,
                      q_out - c * jnp.sqrt(h),
                      q_in - k * (1.0 - y_lag[0, 0])])


def controlled_tank_loss(p, tol, history_steps=1000):
    """h(T) and the tracking error ∫ (h − 1)² dt of the controlled tank on [0, 20]."""
    sol = dae.solve(controlled_tank, 0.0, 20.0, jnp.array([0.5, 0.0, 0.0]), args=p,
                    delays=lambda p: p[1:2], algebraic=jnp.array([False, True, True]),
                    init="ya_ydp", quadrature=lambda t, y, yp, p: (y[:1] - 1.0) ** 2,
                    rtol=tol, atol=tol, history_steps=history_steps)
    return jnp.stack([sol.ys[-1, 0], sol.qs[-1, 0]])


@pytest.mark.slow
def test_delayed_feedback_controller_gradients():
    """jax.jacfwd and jax.jacrev w.r.t. the gain, the lag and the orifice coefficient
    against central differences of rtol-1e-12 solves. h = 1e-3: the truncation error
    h²·f‴/6 is ~6e-8 (h = 1e-2 differs by 6e-6), the noise 1e-12/h ~ 1e-9 (at rtol
    1e-10 and h = 1e-4 the noise was 1.2e-5, larger than the derivatives' error). The
    rtol-1e-8 derivatives measured within 2e-7 of these; the bound 1e-5 relative to
    max(|derivative|, 1) leaves 50x, and a wrong lag term (−y'(t − τ)·τ̇ enters the
    *algebraic* controller equation: its derivative w.r.t. τ is ~2e-2) fails it.
    Before the lagged derivative was made continuous across past step boundaries
    (`_delay/buffer.py`), the τ-direction stopped with step_size_too_small at t = 2τ."""
    p = jnp.array([0.8, 1.5, 0.5])
    jf = np.asarray(jax.jacfwd(lambda p: controlled_tank_loss(p, 1e-8))(p))
    jr = np.asarray(jax.jit(jax.jacrev(lambda p: controlled_tank_loss(p, 1e-8)))(p))
    tight = jax.jit(lambda p: controlled_tank_loss(p, 1e-12, 20_000))
    h = 1e-3
    fd = np.stack([(np.asarray(tight(p.at[i].add(h))) - np.asarray(tight(p.at[i].add(-h))))
                   / (2 * h) for i in range(3)], axis=1)
    scale = np.maximum(np.abs(fd), 1.0)
    assert np.max(np.abs(jf - fd) / scale) < 1e-5, (jf, fd)
    assert np.max(np.abs(jr - fd) / scale) < 1e-5, (jr, fd)


# ------------------------------------------------------------- continuous adjoint


def test_adjoint_options_are_checked():
    """Reverse-mode choices with `delays=`: the discrete adjoint does not exist for them,
    and the continuous adjoint of an index-1 equation is refused, by name, for a lagged
    algebraic argument (the point masses of λ it would carry back)."""
    y0 = jnp.ones(1)
    with pytest.raises(ValueError, match="not supported with `delays=`"):
        dae.solve(retarded, 0.0, T, y0, delays=jnp.array([1.0]),
                  sensitivity=dae.DiscreteAdjoint())
    with pytest.raises(ValueError, match=r"reads y_lag\[0, 1\] = y_1\(t - tau_0\), a lagged "
                       "algebraic component"):
        dae.solve(retarded_dae, 0.0, T, jnp.ones(2), delays=jnp.array([1.0]),
                  algebraic=jnp.array([False, True]), sensitivity=dae.Adjoint())


def test_adjoint_lagged_algebraic_found_from_the_program():
    """Which lagged values the residual reads, from its program (no solve): the tank's
    controller reads y_lag[0, 0] (the level, differential) only, so the index-1 adjoint
    applies; `retarded_dae` reads y_lag[0, 1] (z, algebraic), refused by name — also
    without `algebraic=` (z' is never read: z is algebraic) and with the mask traced
    under jit, where it is the structural one. The default (sensitivity=None) then
    falls back to the variational route instead of raising (`_adjoint_split` returns
    the reason, `solve` raises it only for an explicit Adjoint())."""
    from daeadjoint._delay.adjoint import lag_structure
    from daeadjoint._delay.solve import Model, Params, _adjoint_split

    def model_of(residual, args):
        return (Model(residual=residual, history=None, delays=None),
                Params(args=args, y_hist=None, tau_given=jnp.ones(1), residual=None,
                       history=None))

    model, params = model_of(controlled_tank, jnp.array([0.8, 1.5, 0.5]))
    yp_free, lagged = lag_structure(model, params, jnp.zeros(()), jnp.zeros(3), 1)
    assert yp_free.tolist() == [False, True, True]
    assert lagged.tolist() == [[True, False, False]]
    mask = jnp.array([False, True, True])
    assert _adjoint_split(model, params, 0.0, jnp.zeros(3), 1, mask) == ((False, True, True),
                                                                          None)
    model, params = model_of(retarded_dae, jnp.array([1.0]))
    for given in (jnp.array([False, True]), None):
        split, why = _adjoint_split(model, params, 0.0, jnp.zeros(2), 1, given)
        assert split is None and "y_lag[0, 1]" in why, why
    jax.make_jaxpr(lambda x: _check_traced_mask(model, params, x))(1.0)


def _check_traced_mask(model, params, x):
    from daeadjoint._delay.solve import _adjoint_split
    split, why = _adjoint_split(model, params, 0.0, jnp.zeros(2), 1,
                                jnp.array([False, True]) & (x > 0))
    assert split is None and "y_lag[0, 1]" in why, why
    return x


OBS_TANK = jnp.array([0.0, 1.0, 2.0, 5.0, 9.5, 14.0, 20.0])
# Weights of the observed components (level, outflow, inflow) at OBS_TANK: the two
# algebraic ones observed at every time — at t0 (their consistent initial values), and
# at t = 1 < τ, where t − τ lies in the history.
W_TANK = jnp.array([[1.0, 0.3, -0.7]]) * jnp.arange(1, 8)[:, None] / 7


def controlled_tank_observed(p, tol, sensitivity=None, history_steps=1000):
    """Σ W ∘ y(OBS_TANK) of the controlled tank, p = (gain, τ, orifice, initial level;
    the level's constant history)."""
    sol = dae.solve(controlled_tank, 0.0, 20.0, jnp.array([p[3], 0.0, 0.0]), args=p[:3],
                    delays=lambda p: p[1:2], algebraic=jnp.array([False, True, True]),
                    init="ya_ydp", saveat=OBS_TANK, rtol=tol, atol=tol,
                    sensitivity=sensitivity, history_steps=history_steps)
    return jnp.sum(W_TANK * sol.ys)


@pytest.mark.slow
def test_adjoint_index1_delayed_controller():
    """The continuous adjoint of an index-1 delay DAE (the controlled tank: two
    algebraic components, the lag on the differential level) for observations of all
    three components at seven times, w.r.t. the gain, the lag, the orifice coefficient
    and the initial level (also the history): against central differences of
    rtol-1e-12 solves (h = 1e-3, as test_delayed_feedback_controller_gradients:
    truncation ~6e-8, noise ~1e-9) and against forward mode (jacfwd, the variational
    system). Bound 1e-5 relative to max(|derivative|, 1), as there: the rtol-1e-8
    gradients measured within 5.2e-7 of the central differences and 3.8e-7 of jacfwd.
    Leaving out the point masses of λ at the observations of the algebraic components
    (their cotangents dropped) changed the orifice component by 0.69 (of 3.0), leaving
    out only the jumps of w they cause at t_k − τ by 1.23 (both measured without the
    observation at t0 and the initial level): either fails by orders of magnitude."""
    p = jnp.array([0.8, 1.5, 0.5, 0.5])
    ga = np.asarray(jax.jit(jax.grad(
        lambda p: controlled_tank_observed(p, 1e-8, dae.Adjoint())))(p))
    gf = np.asarray(jax.jacfwd(lambda p: controlled_tank_observed(p, 1e-8))(p))
    tight = jax.jit(lambda p: controlled_tank_observed(p, 1e-12, None, 20_000))
    h = 1e-3
    fd = np.array([(float(tight(p.at[i].add(h))) - float(tight(p.at[i].add(-h)))) / (2 * h)
                   for i in range(4)])
    scale = np.maximum(np.abs(fd), 1.0)
    assert np.max(np.abs(ga - fd) / scale) < 1e-5, (ga, fd)
    assert np.max(np.abs(ga - gf) / scale) < 1e-5, (ga, gf)


@pytest.mark.slow
def test_lagged_algebraic_default_grad_falls_back():
    """A lagged algebraic argument with more than ADJOINT_MIN_INPUTS input components:
    the default reverse mode would take the adjoint, which is refused for it, so it
    takes the variational route (no error): jax.grad of y(5) of `retarded_dae` w.r.t.
    (τ, c) and twelve parameters it does not read, against the exact 7/6, 19/120 and
    zeros, within the 100·tol of the other exact tests."""
    tol = 1e-8

    def end(p):
        sol = dae.solve(retarded_dae, 0.0, T, p[1] * jnp.ones(2), args=p, delays=first_arg,
                        algebraic=jnp.array([False, True]), rtol=tol, atol=tol)
        return sol.ys[-1, 0]

    p = jnp.concatenate([jnp.array([1.0, 1.0]), jnp.zeros(12)])
    g = np.asarray(jax.jit(jax.grad(end))(p))
    want = np.concatenate([[exact_dtau(T), exact(T)], np.zeros(12)])
    assert np.max(np.abs(g - want)) < 100 * tol, g


def _adjoint_end(p, tol):
    """y(5) of y' = −y(t − τ), y = c for t ≤ 0, p = (τ, c), reverse mode by the adjoint."""
    return dae.solve(retarded, 0.0, T, p[1] * jnp.ones(1), args=p, delays=first_arg,
                     saveat=SAVEAT, rtol=tol, atol=tol, sensitivity=dae.Adjoint()).ys[-1, 0]


def test_adjoint_grad_exact():
    """The continuous adjoint (sensitivity=Adjoint()): d y(5)/dτ and d y(5)/d(history
    value) against the exact 7/6 and 19/120, within the 100·tol of the forward tests (the
    backward solve's error is controlled to the same tolerance, and the gradient
    quadrature is in its error test). Measured: 1.6e-5 / 6.2e-9. The default run's
    correctness check of the delay adjoint: one compiled program, the tolerance traced."""
    grad = jax.jit(jax.grad(_adjoint_end))
    for tol in (1e-6, 1e-9):
        g = np.asarray(grad(jnp.array([1.0, 1.0]), tol))
        assert np.max(np.abs(g - np.array([exact_dtau(T), exact(T)]))) < 100 * tol, (tol, g)


@pytest.mark.slow
def test_adjoint_vmap_of_grad():
    """jax.vmap(jax.grad(f)) with the continuous adjoint over three (τ, c), the lags
    different, so that the forward and backward solves have their own breaking points
    and step sequences: each member against the exact dy(5)/dτ and dy(5)/dc = y(5)/c
    within 100·tol (as test_adjoint_grad_exact), and against its own unbatched grad
    within 10·tol (the batched solves take the same steps in exact arithmetic; their
    rounding may differ, and a different step taken is an error of the order of tol).
    Measured: 1.1e-5–2.9e-5 from the exact values, 1.3e-15 from the unbatched grads."""
    tol = 1e-6
    P = jnp.array([[0.9, 1.0], [1.0, 0.5], [1.2, 2.0]])
    g = jax.jit(jax.grad(lambda p: _adjoint_end(p, tol)))
    gv = np.asarray(jax.jit(jax.vmap(jax.grad(lambda p: _adjoint_end(p, tol))))(P))
    for p, gi in zip(np.asarray(P), gv):
        tau, c = p
        want = np.array([exact_dtau(T, tau, c), exact(T, tau)])
        assert np.max(np.abs(gi - want)) < 100 * tol, (p, gi, want)
        assert np.max(np.abs(gi - np.asarray(g(jnp.asarray(p))))) < 10 * tol


@pytest.mark.slow
def test_adjoint_history_function_parameter():
    """The adjoint's history term ∫_{t0−τ}^{t0} λ(s + τ)ᵀ F_ν ∂h/∂a ds for h = 1 + a t,
    against the exact dy(5)/da (method of steps on polynomials), same bound as above."""
    tol = 1e-9

    def end(p):
        return dae.solve(retarded, 0.0, T, jnp.ones(1), args=p, delays=one_lag,
                         history=linear_history, rtol=tol, atol=tol,
                         sensitivity=dae.Adjoint()).ys[-1, 0]

    a = 0.3
    g = float(jax.jit(jax.grad(end))(jnp.array([a]))[0])
    assert abs(g - exact_linear_history(a)[1]) < 100 * tol, g


@pytest.mark.slow
@pytest.mark.parametrize("n_obs", [10, 1000])
def test_adjoint_kermack_mckendrick_least_squares(n_obs):
    """Gradient of ½ Σ‖y(t_i) − ỹ_i‖² (noisy data at n_obs times) w.r.t. (a, b, c, τ1, τ2)
    by the continuous adjoint, by forward mode (jacfwd) and by central differences.

    Bounds, relative to max |gradient| (3.58, the b component): adjoint vs jacfwd 1e-4 —
    two rtol-1e-8 approximations of the same continuous gradient over 55 time units
    (measured 1.6e-6 at n_obs = 10), while leaving out the lag term or the history term
    changes a component by ≥ 1e-2 of that; vs central differences (step 1e-5 of rtol-1e-8
    solves) 1e-3 — their noise tol/h (measured 1.3e-5)."""
    tol = 1e-8
    p0 = jnp.asarray(KM_P)
    ts = jnp.linspace(55.0 / n_obs, 55.0, n_obs)

    def ys(p, sens=None):
        return dae.solve(km, 0.0, 55.0, p[:3], args=p, delays=km_lags, saveat=ts, rtol=tol,
                         atol=tol, sensitivity=sens, history_steps=4000).ys

    base = np.asarray(jax.jit(ys)(p0))
    data = base + 0.05 * np.random.default_rng(0).standard_normal(base.shape)

    def loss(p, sens=None):
        return 0.5 * jnp.sum((ys(p, sens) - data) ** 2)

    g_adj = np.asarray(jax.jit(jax.grad(lambda p: loss(p, dae.Adjoint())))(p0))
    g_fwd = np.asarray(jax.jit(jax.jacfwd(loss))(p0))
    f = jax.jit(loss)
    h = 1e-5
    g_cd = np.array([(float(f(p0.at[i].add(h))) - float(f(p0.at[i].add(-h)))) / (2 * h)
                     for i in range(5)])
    scale = np.max(np.abs(g_fwd))
    assert np.max(np.abs(g_adj - g_fwd)) / scale < 1e-4, (g_adj, g_fwd)
    assert np.max(np.abs(g_adj - g_cd)) / scale < 1e-3, (g_adj, g_cd)


@pytest.mark.slow
def test_adjoint_jacrev_and_the_quadrature_fallback():
    """jax.jacrev by the adjoint (one backward solve per output, batched) against the
    exact d y(t_i)/d(τ, c) at the eight output times, bound 100·tol as above (measured
    2.2e-7 at tol 1e-8); and a cotangent on a quadrature with sensitivity=Adjoint(),
    which goes through the variational Jacobian's transpose: against forward mode and
    dq/dc = q/c (q is linear in c), 100·tol (forward mode integrates one direction per
    solve, the Jacobian all of them in one, so their steps and errors differ by the
    tolerance). With quad_error_control=True: without it this quadrature came out
    −0.0549 instead of the exact 0.0569 (a separate, open problem of delay quadratures)."""
    tol = 1e-8
    p = jnp.array([1.0, 1.0])

    def ys(p):
        return dae.solve(retarded, 0.0, T, p[1] * jnp.ones(1), args=p, delays=first_arg,
                         saveat=SAVEAT, rtol=tol, atol=tol, sensitivity=dae.Adjoint()).ys[:, 0]

    J = np.asarray(jax.jit(jax.jacrev(ys))(p))
    want = np.array([[exact_dtau(float(t)), exact(float(t))] for t in SAVEAT])
    assert np.max(np.abs(J - want)) < 100 * tol, J - want

    def q(p):
        return dae.solve(retarded, 0.0, T, p[1] * jnp.ones(1), args=p, delays=first_arg,
                         quadrature=lambda t, y, yp, a: y, quad_error_control=True,
                         rtol=tol, atol=tol, sensitivity=dae.Adjoint()).qs[-1, 0]

    g = np.asarray(jax.jit(jax.grad(q))(p))
    gf = np.asarray(jax.jacfwd(q)(p))
    assert np.max(np.abs(g - gf)) < 100 * tol, (g, gf)
    assert abs(g[1] - float(q(p))) < 100 * tol


# ------------------------------------------------ the adjoint by checkpoint recomputation

# y' = −y(t − 1) at rtol 1e-6 takes 158 steps, at most ~45 of them within one lag: a ring
# of H = 50 steps, checkpoints every K = 60 steps (three segments), and max_steps = 5000,
# where the checkpoints store fewer step rows than the trajectory (`use_checkpoints`).
CK_H, CK_K, CK_MAX = 50, 60, 5000


def _ck_end(p, every, tol=1e-6):
    return dae.solve(retarded, 0.0, T, p[1] * jnp.ones(1), args=p, delays=first_arg,
                     saveat=SAVEAT, rtol=tol, atol=tol, history_steps=CK_H, max_steps=CK_MAX,
                     sensitivity=dae.Adjoint(checkpoint_every=every)).ys[-1, 0]


def test_checkpoint_rule():
    """Checkpoints when they store fewer step rows than the trajectory: not with the
    defaults (every checkpoint holds a ring of history_steps = 1000 steps, one every 100
    steps), yes for the settings of the tests below, and not for checkpoint_every ≥
    max_steps (one segment: nothing to save)."""
    from daeadjoint._delay.checkpoint import checkpoint_rows, use_checkpoints
    assert not use_checkpoints(100, 100_000, 1000)
    assert use_checkpoints(CK_K, CK_MAX, CK_H)
    assert not use_checkpoints(CK_MAX, CK_MAX, CK_H)
    assert checkpoint_rows(CK_K, CK_MAX, CK_H) == (84 + 1) * (CK_H + 1) + 4 * CK_K + 3 * CK_H


def _largest_arrays(fn, *args):
    """(largest dimension, most elements) of the arrays in fn's jaxpr, nested ones
    included: what the compiled program allocates, up to XLA's buffer reuse."""
    closed = jax.make_jaxpr(fn)(*args)
    dims, sizes = [0], [0]

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            for v in eqn.outvars:
                shape = getattr(v.aval, "shape", ())
                if shape:
                    dims.append(max(shape))
                    sizes.append(int(np.prod(shape)))
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(closed.jaxpr)
    return max(dims), max(sizes)


def test_checkpointed_adjoint_memory_is_bounded_by_its_segments():
    """The gradient program's arrays, with max_steps = 10^6: the stored trajectory holds
    arrays of max_steps step rows (its dense output: the check can fail), the
    checkpointed adjoint none longer than its window of 2H + 2K + 1 step ends, and none
    larger than its checkpoint rings' interpolants ((⌈max_steps/K⌉ + 1)·H·6n numbers,
    here 1.5·10^5 against the stored 6·10^6: memory O(max_steps·H/K + K + H))."""
    big, H, K = 10**6, 50, 2000

    def loss(p, every):
        return dae.solve(retarded, 0.0, T, p[1] * jnp.ones(1), args=p, delays=first_arg,
                         saveat=SAVEAT, rtol=1e-6, atol=1e-6, history_steps=H, max_steps=big,
                         sensitivity=dae.Adjoint(checkpoint_every=every)).ys[-1, 0]

    p = jnp.array([1.0, 1.0])
    dim_stored, _ = _largest_arrays(jax.grad(lambda q: loss(q, big)), p)
    assert dim_stored >= big
    dim, size = _largest_arrays(jax.grad(lambda q: loss(q, K)), p)
    assert dim <= 2 * H + 2 * K + 1, dim
    rings = (-(-big // K) + 1) * H * 6 * 1
    assert size <= rings, (size, rings)


@pytest.mark.slow
def test_recomputed_segment_repeats_the_forward_run_or_says_it_did_not():
    """Segments recomputed from their checkpoints (BDF state + step ring) take the
    forward run's steps bit for bit: their step ends and interpolants equal those of the
    dense output of one uninterrupted solve. One recomputed from a corrupted checkpoint
    (its next step size halved) is reported as not repeating them (the adjoint then fails
    with RESULTS.delay_recompute_failed, never a wrong gradient)."""
    from daeadjoint._core import run
    from daeadjoint._delay import checkpoint
    from daeadjoint._delay.buffer import DelayArgs, DelayBuffer, DelayResidual
    from daeadjoint._delay.solve import breaking_points

    tau = jnp.array([1.0])
    bps = breaking_points(jnp.asarray(0.0), tau, 5)

    def setup(dense=False):
        buf = DelayBuffer.empty(0.0, 1.0, bps, CK_H, 1, jnp.float64)
        return checkpoint.configure(
            DelayResidual(model=retarded, history=lambda t, a: jnp.ones(1)), 0.0, T,
            jnp.ones(1), None, DelayArgs(user=None, tau=tau, buffer=buf), saveat=SAVEAT,
            breakpoints=bps, max_step=1.0, rtol=1e-6, atol=1e-6, max_steps=CK_MAX, dense=dense)

    @jax.jit
    def segments(scale):
        config, inputs = setup()
        problem, cks, out = checkpoint.forward(config, inputs, CK_K)
        cks = eqx.tree_at(lambda c: c.states.h, cks, cks.states.h.at[1].multiply(scale))
        return cks.count, jax.lax.map(
            lambda c: checkpoint.recompute(problem, config, inputs, cks, out, c, CK_K),
            jnp.arange(3))

    dense = jax.jit(lambda: run(*setup(dense=True))[0].dense)()
    count, segs = segments(1.0)
    assert int(count) == 3 and int(dense.count) == 158     # segments of 60 steps
    recs, ok = segs
    assert np.all(np.asarray(ok))
    n = np.asarray(recs.count)
    t = np.concatenate([np.asarray(recs.t[c, 1:n[c] + 1]) for c in range(3)])
    phi = np.concatenate([np.asarray(recs.phi[c, :n[c]]) for c in range(3)])
    assert np.array_equal(t, np.asarray(dense.t[1:159]))
    assert np.array_equal(phi, np.asarray(dense.phi[:158]))
    _, (_, bad) = segments(0.5)
    assert list(np.asarray(bad)) == [True, False, True]   # only segment 1 starts corrupted


@pytest.mark.slow
def test_checkpointed_adjoint_equals_the_stored_one_exact_solution():
    """y' = −y(t − 1): the gradient (d y(5)/dτ, d y(5)/dc) by the checkpointed adjoint
    (three segments) is the stored-trajectory adjoint's bit for bit — the recomputed
    segments repeat the forward steps, and the backward solve reads the same
    polynomials by the same code and so takes the same steps — and within 100·tol of
    the exact 7/6 and 19/120 (test_adjoint_grad_exact's bound)."""
    p = jnp.array([1.0, 1.0])
    stored = np.asarray(jax.jit(jax.grad(lambda q: _ck_end(q, CK_MAX)))(p))
    ck = np.asarray(jax.jit(jax.grad(lambda q: _ck_end(q, CK_K)))(p))
    assert np.array_equal(ck, stored), (ck, stored)
    assert np.max(np.abs(ck - np.array([exact_dtau(T), exact(T)]))) < 100 * 1e-6, ck


@pytest.mark.slow
def test_checkpointed_adjoint_kermack_mckendrick():
    """Kermack–McKendrick's least-squares gradient (as
    test_adjoint_kermack_mckendrick_least_squares, n_o = 10, rtol 1e-8: 2043 steps, at
    most ~550 within τ2 = 10) with a ring of 600 steps and checkpoints every 700 steps
    (three segments; the two lags reach into the neighbouring segments): equal to the
    stored-trajectory adjoint's bit for bit (as above), and to central differences
    within 1e-3 of the largest component (that test's bound: their noise tol/h)."""
    tol, H, K = 1e-8, 600, 700
    p0 = jnp.asarray(KM_P)
    ts = jnp.linspace(5.5, 55.0, 10)

    def ys(p, every):
        return dae.solve(km, 0.0, 55.0, p[:3], args=p, delays=km_lags, saveat=ts, rtol=tol,
                         atol=tol, history_steps=H,
                         sensitivity=dae.Adjoint(checkpoint_every=every)).ys

    base = np.asarray(jax.jit(lambda p: ys(p, K))(p0))
    data = base + 0.05 * np.random.default_rng(0).standard_normal(base.shape)

    def loss(p, every=K):
        return 0.5 * jnp.sum((ys(p, every) - data) ** 2)

    from daeadjoint._delay.checkpoint import use_checkpoints
    assert use_checkpoints(K, 100_000, H) and not use_checkpoints(100_000, 100_000, H)
    g_ck = np.asarray(jax.jit(jax.grad(loss))(p0))
    g_st = np.asarray(jax.jit(jax.grad(lambda p: loss(p, 100_000)))(p0))
    assert np.array_equal(g_ck, g_st), (g_ck, g_st)
    f = jax.jit(loss)
    h = 1e-5
    g_cd = np.array([(float(f(p0.at[i].add(h))) - float(f(p0.at[i].add(-h)))) / (2 * h)
                     for i in range(5)])
    assert np.max(np.abs(g_ck - g_cd)) / np.max(np.abs(g_cd)) < 1e-3, (g_ck, g_cd)


@pytest.mark.slow
def test_failed_recomputation_is_a_status(monkeypatch):
    """A recomputed segment that does not repeat the forward run (here made so: its
    checkpoint's step size halved) fails the gradient with
    RESULTS.delay_recompute_failed: raised with throw=True, NaN with throw=False."""
    from daeadjoint._delay import checkpoint
    original = checkpoint.recompute

    def corrupted(problem, config, inputs, cks, out, c, every):
        cks = eqx.tree_at(lambda k: k.states.h, cks, cks.states.h * 0.5)
        return original(problem, config, inputs, cks, out, c, every)

    monkeypatch.setattr(checkpoint, "recompute", corrupted)

    def end(p, throw):
        return dae.solve(retarded, 0.0, T, p[1] * jnp.ones(1), args=p, delays=first_arg,
                         saveat=SAVEAT, rtol=1e-6, atol=1e-6, history_steps=CK_H,
                         max_steps=CK_MAX, throw=throw,
                         sensitivity=dae.Adjoint(checkpoint_every=CK_K)).ys[-1, 0]

    p = jnp.array([1.0, 1.0])
    g = np.asarray(jax.jit(jax.grad(lambda q: end(q, False)))(p))
    assert np.all(np.isnan(g)), g
    with pytest.raises(Exception, match="delay_recompute_failed"):
        jax.block_until_ready(jax.jit(jax.grad(lambda q: end(q, True)))(p))


@pytest.mark.slow
def test_checkpointed_adjoint_vmap_of_grad():
    """jax.vmap(jax.grad(f)) with the checkpointed adjoint over three (τ, c), each member
    with its own steps, checkpoints and number of segments: against the exact
    derivatives within 100·tol and against the batched stored-trajectory adjoint
    (within 10·tol, as test_adjoint_vmap_of_grad: batched programs may round otherwise)."""
    P = jnp.array([[0.9, 1.0], [1.0, 0.5], [1.2, 2.0]])
    ck = np.asarray(jax.jit(jax.vmap(jax.grad(lambda p: _ck_end(p, CK_K))))(P))
    st = np.asarray(jax.jit(jax.vmap(jax.grad(lambda p: _ck_end(p, CK_MAX))))(P))
    for (tau, c), gi, si in zip(np.asarray(P), ck, st):
        want = np.array([exact_dtau(T, tau, c), exact(T, tau)])
        assert np.max(np.abs(gi - want)) < 100 * 1e-6, (tau, c, gi, want)
        assert np.max(np.abs(gi - si)) < 10 * 1e-6, (gi, si)


def _observed_algebraic_copy(p):
    """y' = −y(t − τ) (y = c for t ≤ t0) with the algebraic z = g·y (not lagged), on
    [t0, t0 + 5] at t0 = 1000 (a large time offset), observed through z at t0 + 2.5 and
    t0 + 5: G = z(t0 + 5) + z(t0 + 2.5)/2, p = (τ, c, g)."""
    t0 = 1000.0

    def res(t, y, yp, y_lag, p):
        return jnp.array([yp[0] + y_lag[0, 0], y[1] - p[2] * y[0]])

    sol = dae.solve(res, t0, t0 + T, jnp.array([p[1], p[2] * p[1]]), args=p,
                    delays=first_arg, algebraic=jnp.array([False, True]),
                    saveat=t0 + jnp.array([2.5, T]), rtol=1e-8, atol=1e-8,
                    sensitivity=dae.Adjoint())
    return sol.ys[-1, 1] + 0.5 * sol.ys[0, 1]


@pytest.mark.slow
def test_adjoint_index1_exact_under_grad_jacrev_and_vmap():
    """The index-1 delay adjoint (observations of an algebraic component: point masses
    of λ) under grad, jacrev and vmap(grad), at a large start time, against the exact
    derivatives g·(dy/dτ, dy/dc) and y of the method-of-steps solution, within the
    100·tol of the other exact tests (measured 1.7e-7 at tol 1e-8)."""
    def want(gain):
        y = exact(T) + 0.5 * exact(2.5)
        return np.array([gain * (exact_dtau(T) + 0.5 * exact_dtau(2.5)), gain * y, y])

    p = jnp.array([1.0, 1.0, 2.0])
    grad = jax.jit(jax.grad(_observed_algebraic_copy))
    assert np.max(np.abs(np.asarray(grad(p)) - want(2.0))) < 100 * 1e-8
    g_rev = np.asarray(jax.jit(jax.jacrev(_observed_algebraic_copy))(p))
    assert np.max(np.abs(g_rev - want(2.0))) < 100 * 1e-8
    P = jnp.array([[1.0, 1.0, 2.0], [1.0, 1.0, 3.0]])
    gv = np.asarray(jax.jit(jax.vmap(jax.grad(_observed_algebraic_copy)))(P))
    assert np.max(np.abs(gv - np.stack([want(2.0), want(3.0)]))) < 100 * 1e-8
