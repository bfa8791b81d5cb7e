"""The BDF history operations on both layouts (one (6, ...) array, or its 6 rows) against
IDAS's formulas written out as plain loops (IDAS manual §6.2.2, `IDACompleteStep`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from daeadjoint._bdf import (MAXORD, NPHI, complete_history, history_layout, history_row,
                             predict, scale_history, stacked, update_row)

RNG = np.random.default_rng(0)
PHI = RNG.standard_normal((NPHI, 4, 3))      # a (6, k, n) sensitivity history, k = 4
EE = RNG.standard_normal((4, 3))
BETA = RNG.uniform(0.5, 2.0, NPHI)
GAMMA = RNG.uniform(0.0, 3.0, NPHI)


def layouts():
    return [("stacked", jnp.asarray(PHI)), ("rows", tuple(jnp.asarray(PHI)))]


def test_layout_keeps_each_buffer_under_the_sequential_threshold():
    """Rows exactly where the stacked history exceeds 512 bytes and a row does not."""
    assert isinstance(history_layout(jnp.zeros((NPHI, 3, 3))), jax.Array)    # 432 bytes
    assert isinstance(history_layout(jnp.zeros((NPHI, 4, 3))), tuple)        # 576; rows 96
    assert isinstance(history_layout(jnp.zeros((NPHI, 30, 3))), jax.Array)   # rows 720
    assert isinstance(history_layout(jnp.zeros((NPHI, 4, 3), jnp.float32)), jax.Array)


@pytest.mark.parametrize("name,phi", layouts())
@pytest.mark.parametrize("k", range(1, MAXORD + 1))
def test_history_operations(name, phi, k):
    """Exact up to rounding (1e-14: sums of six O(1) terms in a different order)."""
    ns = 2
    scaled = np.asarray(stacked(scale_history(phi, jnp.asarray(BETA), ns, k)))
    expect = PHI.copy()
    for i in range(NPHI):
        if ns <= i <= k:
            expect[i] *= BETA[i]
    np.testing.assert_allclose(scaled, expect, rtol=1e-14)

    y, yp = predict(phi, jnp.asarray(GAMMA), k)
    np.testing.assert_allclose(y, sum(PHI[j] for j in range(k + 1)), rtol=1e-14, atol=1e-14)
    np.testing.assert_allclose(yp, sum(GAMMA[j] * PHI[j] for j in range(1, k + 1)),
                               rtol=1e-14, atol=1e-14)

    done = np.asarray(stacked(complete_history(phi, jnp.asarray(EE), k)))
    expect = PHI.copy()
    if k < MAXORD:
        expect[k + 1] = EE
    expect[k] += EE
    for j in range(k - 1, -1, -1):
        expect[j] += expect[j + 1]
    np.testing.assert_allclose(done, expect, rtol=1e-14, atol=1e-14)

    for i in (k - 1, k, k + 1):
        np.testing.assert_array_equal(history_row(phi, jnp.asarray(i)), PHI[min(i, NPHI - 1)])
    twice = np.asarray(stacked(update_row(phi, 1, lambda row: 2 * row)))
    np.testing.assert_array_equal(twice[1], 2 * PHI[1])
    np.testing.assert_array_equal(np.delete(twice, 1, 0), np.delete(PHI, 1, 0))
