"""`solve_ensemble`'s queue (`queue=True`): a working set of 2 slots for 6 members, each
advanced 16 steps at a time, refilled as members finish. Every member equals its own
unbatched solve — values, step count and status — and the results come back in the
batch's order whatever order the queue runs them in.

The members: `test_ensemble`'s Robertson batch (rate constants 15 % apart, member 3 with
a NaN y0: status `nonfinite_input` before any step), and member 4 integrated to t1 = 1e5
with the shared `max_steps=150`: it fails mid-run (`max_steps_reached`, after the output
rows at 0.5 and 1 were written) while the others (≈ 90 steps to t1 = 1) succeed. So the
queue holds members beyond the working set, slots free up at different segments, and
two kinds of failure keep their statuses.

Tolerance: `test_ensemble.TOL` (1e-9 of each member's largest output; why there)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import daeadjoint as dae

from .test_ensemble import B, BAD, K, KW, Y0, Y0_BAD, _close, robertson

LONG = 4                               # integrated to 1e5: runs out of steps
T1 = np.ones(B)
T1[LONG] = 1e5
QKW = dict(KW, max_steps=150)


@pytest.fixture(scope="module")
def queued():
    return dae.solve_ensemble(robertson, 0.0, T1, Y0_BAD, args=K, batch=("t1", "y0", "args"),
                              queue=True, chunk_size=2, segment=16, **QKW)


@pytest.fixture(scope="module")
def references():
    single = jax.jit(lambda t1, y0, k: dae.solve(robertson, 0.0, t1, y0, args=k, throw=False,
                                                 **QKW))
    return [single(T1[i], jnp.asarray(Y0_BAD[i]), jnp.asarray(K[i])) for i in range(B)]


def _check(sol, references):
    assert sol.ys.shape == (B, 2, 3)
    for i, ref in enumerate(references):
        np.testing.assert_array_equal(np.asarray(sol.result._value[i]),
                                      np.asarray(ref.result._value), err_msg=str(i))
        assert int(sol.stats["num_steps"][i]) == int(ref.stats["num_steps"]), i
        if i != BAD:
            assert _close(sol.ys[i], ref.ys), i


def test_queued_members_equal_their_own_solves(queued, references):
    _check(queued, references)
    status = np.asarray(queued.result._value)
    assert status[BAD] == dae.RESULTS.nonfinite_input._value
    assert status[LONG] == dae.RESULTS.max_steps_reached._value
    ok = [i for i in range(B) if i not in (BAD, LONG)]
    assert np.all(status[ok] == dae.RESULTS.successful._value)
    assert int(queued.stats["num_steps"][LONG]) == 150


def test_queue_order_by_cost_keeps_the_batch_order(queued, references):
    """Run longest-predicted first (the queue's order: here member 5 first, 0 last), with
    progress after each segment that finishes members; results in the batch's order."""
    seen = []
    sol = dae.solve_ensemble(robertson, 0.0, T1, Y0_BAD, args=K, batch=("t1", "y0", "args"),
                             queue=True, chunk_size=2, segment=16, cost=np.arange(B),
                             progress=lambda done, total: seen.append((done, total)), **QKW)
    _check(sol, references)
    assert seen[-1] == (B, B) and all(t == B for _, t in seen)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)


def test_queue_bad_input_is_named():
    with pytest.raises(ValueError, match="throw=False and without delays"):
        dae.solve_ensemble(robertson, 0.0, 1.0, Y0, args=K, queue=True, throw=True, **KW)
    with pytest.raises(ValueError, match="segment must be a positive integer"):
        dae.solve_ensemble(robertson, 0.0, 1.0, Y0, args=K, queue=True, segment=0, **KW)
    with pytest.raises(ValueError, match="one entry per member"):
        dae.solve_ensemble(robertson, 0.0, 1.0, Y0, args=K, queue=True, cost=np.ones(2), **KW)
