"""Events with differentiable event times, inequality constraints, the IDAS step
options, and failures inside batches (IDAS parity for real models).

Exact solutions: a falling body h' = v, v' = −g written as an index-1 DAE with the
algebraic z = h − 1, so h = h0 + v0 t − g t²/2 hits 0 at t* = (v0 + √(v0² + 2 g h0))/g
and z hits 0 at t* = (v0 + √(v0² + 2 g (h0 − 1)))/g. Tolerances: rtol = atol = 1e-8 and
the exact-solution tests' bound of 100·rtol (relative to the value's size).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import daeadjoint as dae
from .problems import ROBERTSON_ALGEBRAIC, ROBERTSON_P, ROBERTSON_Y0, ROBERTSON_YP0, robertson

RTOL = 1e-8
BOUND = 100 * RTOL
# tests/ida_event_reference.py: SUNDIALS IDA at rtol 1e-10, dt*/dp by central differences.
IDA_ROBERTSON_EVENT = dict(
    t_star=268.33325502460525,
    dt_dp=(-12665.479291051439, 0.04765762779041438, -7.943009053642906e-06),
)


def body(t, y, yp, args):
    """y = (h, v, z): h' = v, v' = −g, z = h − 1 (algebraic)."""
    g = args[0]
    return jnp.stack([yp[0] - y[1], yp[1] + g, y[2] - (y[0] - 1.0)])


ALG = jnp.array([False, False, True])
THETA = jnp.array([10.0, 2.0, 9.81])      # h0, v0, g
# The event watches h (differential) or z (algebraic): a traced selector `which` in args,
# so both cases share one compilation.
EV_BODY = dae.Event(lambda t, y, yp, a: jnp.where(a[1] > 0.5, y[2], y[0]), direction=-1)


# The falling body's reverse-mode checks (against its exact derivatives) use the
# continuous adjoint without its fallback to the discrete adjoint: the fallback is never
# taken here (the backward solve succeeds), and its branch is a quarter of a gradient
# program's compilation (docs/performance.md). The default `Adjoint()` with the fallback
# stays compiled under an event in test_robertson_stopped_at_y3_one_half_vs_ida,
# test_failed_batch_member_gets_nan_derivatives and
# tests/test_closures.py::test_event_condition_closure; the fallback's own answers are
# tests/test_adjoint.py's test_fallback_equals_the_discrete_adjoint_of_the_same_steps and
# test_fallback_in_a_batch_only_where_the_continuous_adjoint_fails.
ADJOINT = dae.Adjoint(fallback=False)


def _body_event(theta, which=0.0, rtol=RTOL):
    h0, v0, g = theta[0], theta[1], theta[2]
    sol = dae.solve(body, 0.0, 10.0, jnp.stack([h0, v0, h0 - 1.0]),
                    args=jnp.stack([g, jnp.asarray(which, g.dtype)]), algebraic=ALG,
                    event=EV_BODY, rtol=rtol, atol=rtol, saveat=jnp.array([0.5, 9.0]),
                    sensitivity=ADJOINT)
    return sol


def _impact(theta, which):
    sol = _body_event(theta, which)
    return jnp.stack([sol.event_t, sol.event_y[1]])   # event time, velocity there


def _impact_exact(theta, level):
    h0, v0, g = theta[0], theta[1], theta[2]
    t = (v0 + jnp.sqrt(v0 ** 2 + 2 * g * (h0 - level))) / g
    return jnp.stack([t, v0 - g * t])


def _impact_and_solution(theta, which):
    sol = _body_event(theta, which)
    return jnp.stack([sol.event_t, sol.event_y[1]]), sol


# jacrev's auxiliary output is the solution of its own forward run: the forward checks
# come from the derivative's program (one program for both, no separate solve).
_impact_rev = jax.jit(jax.jacrev(_impact_and_solution, has_aux=True))
_impact_fwd = jax.jit(jax.jacfwd(_impact))
# The exact values and Jacobian in one small program (eagerly, each of their ~40
# operations compiles alone); `level` traced: both cases share it.
_impact_exact_jac = jax.jit(lambda th, level: (_impact_exact(th, level),
                                               jax.jacfwd(_impact_exact)(th, level)))


@pytest.mark.parametrize("which, level", [(0.0, 0.0), (1.0, 1.0)],
                         ids=["differential-h", "algebraic-z"])
def test_event_time_and_state_exact(which, level):
    """t* and v(t*), their derivatives w.r.t. (h0, v0, g) by jax.jacrev (the adjoint with
    the moving-final-time jump at t*) and jax.jacfwd (the implicit function theorem on
    the sensitivities): all equal the exact ones within 100·rtol of their size; rows
    saved after the terminal event are unreached (inf), the status is a success."""
    J_rev, sol = _impact_rev(THETA, which)
    assert sol.result == dae.RESULTS.event
    assert np.all(np.isinf(np.asarray(sol.ys[1]))) and np.all(np.isfinite(np.asarray(sol.ys[0])))
    exact, J_exact = (np.asarray(x) for x in _impact_exact_jac(THETA, level))
    np.testing.assert_allclose([float(sol.event_t), float(sol.event_y[1])], exact,
                               rtol=BOUND)
    for J in (J_rev, _impact_fwd(THETA, which)):
        np.testing.assert_allclose(np.asarray(J), J_exact, rtol=0,
                                   atol=BOUND * np.max(np.abs(J_exact)))


EV_ROB = dae.Event(lambda t, y, yp, p: y[2] - 0.5)


@jax.jit
def robertson_event_time(p, rtol):
    return dae.solve(robertson, 0.0, 1e6, ROBERTSON_Y0, ROBERTSON_YP0, p,
                     algebraic=ROBERTSON_ALGEBRAIC, rtol=rtol,
                     atol=jnp.array([1e-8, 1e-14, 1e-6]) * rtol / 1e-6, event=EV_ROB).event_t


def test_robertson_stopped_at_y3_one_half_vs_ida():
    """Robertson stopped where the algebraic y3 reaches 0.5, against SUNDIALS IDA's
    rootfinding at rtol 1e-10: t* within 100·rtol at rtol 1e-8, and dt*/dp (jax.grad and
    jax.jacfwd) against central differences of IDA's event times within 1e-4 relative
    (their own error ~1e-5, see tests/ida_event_reference.py, plus ours ~100·rtol)."""
    ref = IDA_ROBERTSON_EVENT
    # t* from the gradient's own forward run (one program for both)
    t, g_rev = jax.jit(jax.value_and_grad(robertson_event_time))(ROBERTSON_P, RTOL)
    assert abs(float(t) - ref["t_star"]) <= BOUND * ref["t_star"]
    for g in (g_rev, jax.jit(jax.jacfwd(robertson_event_time))(ROBERTSON_P, RTOL)):
        np.testing.assert_allclose(np.asarray(g), ref["dt_dp"], rtol=1e-4)


def test_vmap_members_with_different_events_and_none():
    """A batch where members hit the ground at different times and one never does
    (thrown upward fast enough to stay above ground until t1 = 10 would need v0 > 44; here
    g ≈ 0 keeps it flying): each member's t* is its own exact one (inf for the one that
    never hits, with status successful and zero derivative), and jax.vmap(jax.grad)
    gives each member its own exact dt*/dh0."""
    thetas = jnp.array([[10.0, 2.0, 9.81], [5.0, 0.0, 9.81], [10.0, 2.0, 1e-3]])

    def event_t(th):
        sol = _body_event(th)
        return sol.event_t, sol

    # The solutions are the gradients' own forward runs (one program for both).
    g, sols = jax.jit(jax.vmap(jax.grad(event_t, has_aux=True)))(thetas)
    g = np.asarray(g)
    t = np.asarray(sols.event_t)
    exact, g_exact = (np.asarray(x) for x in jax.jit(jax.vmap(jax.value_and_grad(
        lambda th: _impact_exact(th, 0.0)[0])))(thetas))
    np.testing.assert_allclose(t[:2], exact[:2], rtol=BOUND)
    assert np.isinf(t[2]) and sols.result._value[2] == dae.RESULTS.successful._value
    np.testing.assert_allclose(g[:2], g_exact[:2], rtol=0, atol=BOUND * np.max(np.abs(g_exact[:2])))
    assert np.all(g[2] == 0.0)


def test_non_terminal_roots_are_recorded():
    """x1 = sin t (oscillator) crosses zero downward at π, 3π and upward at 2π: a
    non-terminal event records the first `max_roots` crossings of the chosen direction
    exactly (to 100·rtol) and the solve reaches t1."""
    from .problems import oscillator
    ev = dae.Event(lambda t, y, yp, c: y[0], terminal=False, direction=-1, max_roots=3)
    sol = dae.solve(oscillator, 0.0, 12.0, jnp.array([0.0, 1.0]), jnp.array([1.0, 0.0]),
                    jnp.array([1.0]), event=ev, rtol=RTOL, atol=RTOL)
    assert sol.result == dae.RESULTS.successful
    np.testing.assert_allclose(np.asarray(sol.event_ts), [np.pi, 3 * np.pi, np.inf],
                               rtol=BOUND)
    assert int(sol.stats["num_events"]) == 2


# --------------------------------------------------------------------- constraints
@jax.jit
def _robertson_loose(constraints):
    ts = 4e-6 * 10.0 ** jnp.linspace(0, 16, 200)
    return dae.solve(robertson, 0.0, 4e10, ROBERTSON_Y0, ROBERTSON_YP0, ROBERTSON_P,
                     algebraic=ROBERTSON_ALGEBRAIC, saveat=ts, rtol=1e-3, atol=1e-4,
                     constraints=constraints).ys


def test_constraints_keep_robertson_nonnegative():
    """At rtol 1e-3, atol 1e-4 the unconstrained y1, y2 go negative (the well-known
    Robertson artefact at loose tolerances); with y1, y2 ≥ 0 constrained (IDAS
    IDASetConstraints) they do not, and the constrained solution stays within the
    tolerance of the unconstrained one (10 tolerance units: two runs of one method at the
    same tolerance, each within a few units of the truth). "Do not" up to the rounding of
    the projection: it puts a violator on the bound in exact arithmetic, and the history
    adds the projected correction to the predicted value (y2 ~ 1e-11 there), which rounds
    at ~1e-27 — below eps·atol, 10^16 times below the tolerance."""
    free = np.asarray(_robertson_loose(jnp.array([0, 0, 0])))
    held = np.asarray(_robertson_loose(jnp.array([1, 1, 0])))
    assert np.min(free[:, :2]) < 0
    assert np.min(held[:, :2]) >= -np.finfo(np.float64).eps * 1e-4
    np.testing.assert_array_less(np.abs(held - free), 10 * (1e-3 * np.abs(free) + 1e-4))


def test_constraints_checked_before_tracing():
    with pytest.raises(ValueError, match="violates `constraints`"):
        dae.solve(lambda t, y, yp, a: yp + y, 0.0, 1.0, jnp.array([-1.0]), jnp.array([1.0]),
                  constraints=jnp.array([1]))
    with pytest.raises(ValueError, match="constraints"):
        dae.solve(lambda t, y, yp, a: yp + y, 0.0, 1.0, jnp.array([1.0]), jnp.array([-1.0]),
                  constraints=jnp.array([3]))


# ------------------------------------------------------------------ step options
def test_step_options():
    """max_step bounds every step (so at least T/max_step steps); max_order=1 is
    backward Euler: at a tolerance loose enough (0.1) that max_step sets the steps, its
    error is first order (falls 5–20x per 10x in the step bound, ~10x expected); and
    first_step/min_step are accepted; all still meet y = e^{−t} to their accuracy."""
    f = lambda t, y, yp, a: yp + y  # noqa: E731

    def run(**kw):
        return dae.solve(f, 0.0, 1.0, jnp.ones(1), -jnp.ones(1), rtol=1e-10, atol=1e-10,
                         throw=False, **kw)

    sol = run(max_step=0.01, first_step=1e-4, min_step=1e-12)
    assert int(sol.stats["num_steps"]) >= 100
    assert abs(float(sol.ys[-1, 0]) - np.exp(-1.0)) <= 100 * 1e-10
    def loose(h):
        return dae.solve(f, 0.0, 1.0, jnp.ones(1), -jnp.ones(1), rtol=0.1, atol=0.1,
                         max_order=1, max_step=h).ys[-1, 0]

    err = [abs(float(loose(h)) - np.exp(-1.0)) for h in (1e-2, 1e-3)]
    assert 5 <= err[0] / err[1] <= 20, err


def test_min_step_failure_is_reported():
    """y' = y² from y = 1 blows up at t = 1: with min_step the solve stops with a
    failure status (not a silent result) before t1 = 2."""
    sol = dae.solve(lambda t, y, yp, a: yp - y ** 2, 0.0, 2.0, jnp.ones(1), jnp.ones(1),
                    min_step=1e-6, throw=False)
    assert sol.result != dae.RESULTS.successful
    assert float(sol.stats["t_final"]) < 1.0


# ------------------------------------------------------ failures inside batches
def test_failed_batch_member_gets_nan_derivatives():
    """y' = p y², y(0) = 1 blows up at t = 1/p: with throw=False, in a batch where the
    member p = 2 fails before t1 = 1, that member's gradient (and jacfwd) is NaN with a
    failed status, and the others get their exact dy(1)/dp = 1/(1 − p)² (to 100·rtol)."""
    def _blowup(p):
        return dae.solve(lambda t, y, yp, p: yp - p * y ** 2, 0.0, 1.0, jnp.ones(1), args=p,
                         throw=False, rtol=RTOL, atol=RTOL, max_steps=2000)

    def f(p):
        return _blowup(p).ys[-1, 0]

    def f_and_status(p):
        sol = _blowup(p)
        return sol.ys[-1, 0], sol.result._value

    ps = jnp.array([0.5, 2.0, 0.25])
    # The status from the gradient's own forward runs (one program for both).
    g_rev, status = jax.jit(jax.vmap(jax.grad(f_and_status, has_aux=True)))(ps)
    assert status[1] != dae.RESULTS.successful._value
    exact = 1 / (1 - np.asarray(ps)) ** 2
    for g in (g_rev, jax.jit(jax.vmap(jax.jacfwd(f)))(ps)):
        g = np.asarray(g)
        assert np.isnan(g[1])
        np.testing.assert_allclose(g[[0, 2]], exact[[0, 2]], rtol=BOUND)
