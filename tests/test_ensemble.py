"""`solve_ensemble` and `ensemble` on one device: every member equals its own unbatched
solve (or derivative), a failing member keeps its status, and chunking does not change
the results. (Several devices: `test_sharding.py`.)

Tolerance 1e-9 relative to each member's largest output: the per-member arithmetic is
the same batched or not, but XLA compiles a vmapped program differently (fusion), and
rounding differences pass through Newton's stopping test and the stiff problem
(observed ≤ 1e-12); a member given another member's results (rate constants 15 % apart)
would differ by more than 1e-3, and a different step sequence by ~1e-8 or more.

Derivatives: 1e-6 (the sensitivities' own error control, rtol 1e-6). A batched
`jacfwd` of batched primals runs the primal and the sensitivity integration apart
(`batching._primal_tangent_batch`) where the unbatched one runs them fused, and XLA
compiles the batched program with other fusions (other rounding), which moves the
corrector's iterates within its convergence test: observed 1.3e-8. (A Jacobian
refreshed for one member is not used by the others: `_newton.maybe_update` selects
per member.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import daeadjoint as dae

TOL = 1e-9
DTOL = 1e-6
ALGEBRAIC = np.array([False, False, True])
SAVEAT = np.array([0.5, 1.0])
KW = dict(saveat=SAVEAT, algebraic=ALGEBRAIC, init="ya_ydp", rtol=1e-6, atol=1e-9)
B = 6
K = np.array([0.04, 1e4, 3e7]) * (1.0 + 0.15 * np.arange(B))[:, None]
Y0 = np.tile([1.0, 0.0, 0.0], (B, 1)) * (1.0 - 0.01 * np.arange(B))[:, None]
Y0[:, 2] = 1.0 - Y0[:, 0]
BAD = 3                      # this member's y0 is NaN: status nonfinite_input
Y0_BAD = Y0.copy()
Y0_BAD[BAD, 0] = np.nan


def robertson(t, y, yp, k):
    return jnp.stack([
        yp[0] + k[0] * y[0] - k[1] * y[1] * y[2],
        yp[1] - k[0] * y[0] + k[1] * y[1] * y[2] + k[2] * y[1] ** 2,
        y[0] + y[1] + y[2] - 1.0,
    ])


def member_ys(y0, k):
    return dae.solve(robertson, 0.0, 1.0, y0, args=k, throw=False, **KW).ys


single_solve = jax.jit(lambda y0, k: dae.solve(robertson, 0.0, 1.0, y0, args=k, throw=False, **KW))


def _close(a, b, tol=TOL):
    a, b = np.asarray(a), np.asarray(b)
    return np.max(np.abs(a - b)) <= tol * np.max(np.abs(b))


@pytest.fixture(scope="module")
def chunked():
    return dae.solve_ensemble(robertson, 0.0, 1.0, Y0_BAD, args=K, chunk_size=4, queue=False,
                              **KW)


def test_members_equal_their_own_solves_and_a_failure_keeps_its_status(chunked):
    ok = np.asarray(chunked.result == dae.RESULTS.successful)
    assert chunked.ys.shape == (B, 2, 3)
    assert list(ok) == [i != BAD for i in range(B)]
    assert bool(chunked.result._value[BAD] == dae.RESULTS.nonfinite_input._value)
    for i in range(B):
        ref = single_solve(jnp.asarray(Y0_BAD[i]), jnp.asarray(K[i]))
        assert bool(np.asarray(ref.result._value) == np.asarray(chunked.result._value[i]))
        if i != BAD:
            assert _close(chunked.ys[i], ref.ys), i
            assert int(chunked.stats["num_steps"][i]) == int(ref.stats["num_steps"])


def test_chunking_gives_the_results_of_one_chunk(chunked):
    """Chunks of 4 (the last one padded) against all 6 members in one vmap."""
    whole = dae.solve_ensemble(robertson, 0.0, 1.0, Y0_BAD, args=K, **KW)
    good = np.arange(B) != BAD
    assert _close(chunked.ys[good], whole.ys[good])
    np.testing.assert_array_equal(np.asarray(chunked.result._value),
                                  np.asarray(whole.result._value))


def test_ensemble_of_jacfwd_and_progress():
    """A derivative of a per-member function (forward sensitivities, y0 and k): each
    member's Jacobian equals its unbatched one; the failing member's is NaN. Progress
    is reported after each chunk."""
    fn = jax.jacfwd(member_ys, argnums=(0, 1))
    seen = []
    jac = dae.ensemble(fn, Y0_BAD, K, chunk_size=4, progress=lambda d, t: seen.append((d, t)))
    assert seen == [(4, B), (B, B)]
    single = jax.jit(fn)
    for i in range(B):
        ref = single(jnp.asarray(Y0_BAD[i]), jnp.asarray(K[i]))
        for got, want in zip(jac, ref):
            if i == BAD:
                assert np.all(np.isnan(np.asarray(got[i])))
            else:
                assert _close(got[i], want, DTOL), i


@pytest.mark.slow
def test_ensemble_of_grad():
    """The adjoint: grad of y1(1) w.r.t. k for each member."""
    fn = jax.grad(lambda k, y0: member_ys(y0, k)[-1, 0])
    g = dae.ensemble(fn, K, Y0_BAD, chunk_size=4)
    single = jax.jit(fn)
    for i in range(B):
        ref = single(jnp.asarray(K[i]), jnp.asarray(Y0_BAD[i]))
        if i == BAD:
            assert np.all(np.isnan(np.asarray(g[i])))
        else:
            assert _close(g[i], ref, DTOL), i


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="disagree on the number of members"):
        dae.ensemble(lambda a, b: a, np.ones((3, 2)), np.ones((4, 2)))
    with pytest.raises(ValueError, match="chunk_size must be a positive integer"):
        dae.ensemble(lambda a: a, np.ones((3, 2)), chunk_size=0)
    with pytest.raises(ValueError, match="no arrays"):
        dae.ensemble(lambda a: a, None)
    with pytest.raises(ValueError, match="allowed"):
        dae.solve_ensemble(robertson, 0.0, 1.0, Y0, args=K, batch=("k",))
    with pytest.raises(ValueError, match="nothing is batched"):
        dae.solve_ensemble(robertson, 0.0, 1.0, Y0[0], args=None)


def _outer(x):
    return jnp.outer(x, x)


def test_memory_limit_sets_the_chunk():
    """One member of `_outer` at n = 50 holds its argument (400 bytes) and output (20 000
    bytes, and 24 for XLA's output tuple), no temporaries; a limit of two members' worth
    gives chunks of 2."""
    x = np.arange(5 * 50, dtype=np.float64).reshape(5, 50)
    seen = []
    out = dae.ensemble(_outer, x, memory_limit=2 * 20424 + 1,
                       progress=lambda d, t: seen.append(d))
    assert seen == [2, 4, 5]
    np.testing.assert_array_equal(out, np.einsum("bi,bj->bij", x, x))
    seen.clear()
    dae.ensemble(_outer, x, memory_limit=10**9, progress=lambda d, t: seen.append(d))
    assert seen == [5]
    with pytest.raises(ValueError, match="less than one member needs"):
        dae.ensemble(_outer, x, memory_limit=100)


def test_default_chunk_on_cpu_devices():
    """Without `chunk_size`, CPU devices take `CPU_CHUNK` members per device and call
    (where larger chunks cost more per member), and the results are the same."""
    from daeadjoint import _ensemble

    c = _ensemble.CPU_CHUNK
    x = np.arange(2 * (2 * c + c // 2), dtype=np.float64).reshape(-1, 2)
    seen = []
    out = dae.ensemble(_outer, x, devices=jax.devices("cpu")[:1],
                       progress=lambda d, t: seen.append(d))
    assert seen == [c, 2 * c, x.shape[0]]
    np.testing.assert_array_equal(out, np.einsum("bi,bj->bij", x, x))
    seen.clear()
    dae.ensemble(_outer, x[:c], devices=jax.devices("cpu")[:1],
                 progress=lambda d, t: seen.append(d))
    assert seen == [c]


def test_cost_order_returns_the_callers_order(monkeypatch):
    """Members run in order of `cost` (here reversed: the chunks hold members 4 3, 2 1,
    0) and come back in the caller's."""
    from daeadjoint import _ensemble

    x = np.arange(5 * 50, dtype=np.float64).reshape(5, 50)
    chunks, padded = [], _ensemble._padded

    def spy(x_, rows, size):
        out = padded(x_, rows, size)
        chunks.append(list(out[:rows.stop - rows.start, 0] // 50))
        return out

    monkeypatch.setattr(_ensemble, "_padded", spy)
    seen = []
    out = dae.ensemble(_outer, x, chunk_size=2, cost=-np.arange(5.0),
                       progress=lambda d, t: seen.append(d))
    assert seen == [2, 4, 5]
    assert chunks == [[4, 3], [2, 1], [0]]
    np.testing.assert_array_equal(out, np.einsum("bi,bj->bij", x, x))
    with pytest.raises(ValueError, match="one entry per member"):
        dae.ensemble(_outer, x, cost=np.ones(4))


# Two members whose hard parts lie in different output intervals: y' = cos(w (c + s t)²),
# a chirp whose frequency grows with t (c = 0, s = 1: most steps late) or falls (c = 2,
# s = -1: most steps early). Exact solution by Fresnel's integral C:
# ∫_0^U cos(w u²) du = sqrt(π/(2w)) C(U sqrt(2w/π)).
CHIRP_W = 20.0
CHIRP_TS = np.linspace(0.25, 2.0, 8)
CHIRP_ARGS = np.array([[0.0, 1.0], [2.0, -1.0]])


def chirp(t, y, yp, a):
    return yp - jnp.cos(CHIRP_W * (a[0] + a[1] * t) ** 2)


def chirp_exact(t, c, s):
    from scipy.special import fresnel
    k = np.sqrt(2 * CHIRP_W / np.pi)

    def integral(u):
        return np.sqrt(np.pi / (2 * CHIRP_W)) * np.sign(u) * fresnel(np.abs(u) * k)[1]

    return (integral(c + s * t) - integral(c)) / s


def test_batched_members_do_not_wait_for_each_other_at_output_times(monkeypatch):
    """In one `jit(vmap(solve))` each loop trip attempts one step of every member still
    running (`integrate`'s flat loop), so the batch's step attempts, counted by the
    progress reports (`progress=1`: one report per trip in which a member accepted a
    step, one for the whole batch under `vmap`), are at most the largest member's own
    attempts (steps + error-test and convergence failures): 780 here for members of 572
    and 769 steps. The nested loops of an unbatched solve, batched, made the members
    wait for each other at every output time (each output interval took its slowest
    member's steps): 951 reports, failing this test.

    The outputs against the exact solution: 2e-5, ten times the larger member's global
    error (2.0e-6, rtol 1e-6 over ~600 steps of an oscillating integrand); a member
    given the other's parameters would be off by up to 0.21."""
    from daeadjoint import _integrator

    reports = []
    monkeypatch.setattr(_integrator, "_print_progress", lambda *a: reports.append(a))
    sol = jax.jit(jax.vmap(lambda a: dae.solve(
        chirp, 0.0, 2.0, jnp.zeros(1), None, a, saveat=CHIRP_TS, rtol=1e-6, atol=1e-8,
        progress=1)))(jnp.asarray(CHIRP_ARGS))
    jax.block_until_ready(sol.ys)
    # One report a trip for the batch (its slowest member's t, its largest step count),
    # not one per member.
    assert all(np.ndim(v) == 0 for r in reports for v in r)
    trips = len(reports)
    st = {k: np.asarray(v) for k, v in sol.stats.items()}
    attempts = (st["num_steps"] + st["num_error_test_failures"]
                + st["num_nonlinear_convergence_failures"])
    assert np.all(np.asarray(sol.result._value) == dae.RESULTS.successful._value)
    assert st["num_steps"].max() <= trips <= attempts.max(), (trips, attempts)
    for i, (c, s) in enumerate(CHIRP_ARGS):
        np.testing.assert_allclose(np.asarray(sol.ys[i, :, 0]), chirp_exact(CHIRP_TS, c, s),
                                   rtol=0, atol=2e-5)


def test_newton_iterations_split_over_trips_leave_every_member_unchanged(monkeypatch):
    """A batched trip runs at most `BATCH_NEWTON_ITERATIONS` Newton iterations of each
    member's step; a member whose iteration needs more keeps its step state and resumes
    the iteration in the next trip (`_integrator.attempt_step_part`), from a predictor
    recomputed from the same state. So one iteration per trip and four per trip give
    every member the same iterates, step sequence and results, bit for bit: the same
    operations on the same numbers, only the loop is cut elsewhere (with members of
    1–4 iterations per attempt, as here, one iteration per trip resumes most
    multi-iteration attempts). A resume that restarted the iteration, or rebuilt the
    predictor from a changed state, would change the iteration counts or the results.
    The two programs differ (checked), so the comparison is not of one program with
    itself."""
    from daeadjoint import _integrator

    # The unbatched references first: `run` clears JAX's caches, which would make
    # `single_solve` (compiled by the first test) compile again.
    refs = [np.asarray(single_solve(jnp.asarray(Y0[i]), jnp.asarray(K[i])).ys) for i in range(B)]

    def run(iterations):
        monkeypatch.setattr(_integrator, "BATCH_NEWTON_ITERATIONS", iterations)
        jax.clear_caches()

        def residual(t, y, yp, k):      # a new function: no cached trace is reused
            return robertson(t, y, yp, k)

        fn = jax.jit(jax.vmap(lambda y0, k: dae.solve(residual, 0.0, 1.0, y0, args=k, **KW)))
        text = fn.lower(jnp.asarray(Y0), jnp.asarray(K)).as_text()
        sol = fn(jnp.asarray(Y0), jnp.asarray(K))
        return text, np.asarray(sol.ys), {k: np.asarray(v) for k, v in sol.stats.items()}

    text1, ys1, st1 = run(1)
    text4, ys4, st4 = run(4)
    assert text1 != text4
    attempts = (st1["num_steps"] + st1["num_error_test_failures"]
                + st1["num_nonlinear_convergence_failures"])
    assert np.all(st1["num_nonlinear_iters"] > attempts)   # some attempts iterate twice
    np.testing.assert_array_equal(ys1, ys4)
    for name in st1:
        np.testing.assert_array_equal(st1[name], st4[name], err_msg=name)
    for i in range(B):
        assert _close(ys1[i], refs[i])


def test_is_batched_reads_the_tracers():
    """`_jax_internals.is_batched` (how `solve` chooses the flat loop): True for a value
    batched by the `vmap` being traced, also seen through a `grad` inside it; False for
    an unbatched value under `vmap` and inside a `jit` that a `vmap` batches afterwards."""
    from daeadjoint._jax_internals import is_batched

    seen = []

    def probe(x, y):
        seen.append((is_batched(x), is_batched(y)))
        return x * y

    x, y = jnp.ones(3), jnp.ones(())
    jax.vmap(probe, in_axes=(0, None))(x, y)
    jax.vmap(jax.grad(probe), in_axes=(0, None))(x, y)
    jax.vmap(jax.jit(probe), in_axes=(0, None))(x, y)
    probe(x, y)
    assert seen == [(True, False), (True, False), (False, False), (False, False)]
