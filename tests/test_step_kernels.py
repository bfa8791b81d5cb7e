"""The step's computations that were rewritten to make fewer XLA kernels
(docs/performance.md, "Where the time goes") give the numbers of the computations they
replace, bit for bit: the leading coefficient's partial sums, the error test's stacked
norms, and the Newton iteration's compacted loop carry."""

import fractions
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from daeadjoint import DenseLU, _newton
from daeadjoint._bdf import NPHI, _alpha_s_sums, history_row, set_coefficients, wrms
from daeadjoint._integrator import Parts, stacked_norms


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_alpha_s_rows_are_the_reduction_they_replace(dtype):
    """α_s = −Σ_{i<k} 1/(i+1) as the reduction over the orders computed it, for every k
    (clipped below 0 and above 6 as that reduction's mask is), and within one rounding
    per term of the exact harmonic number (fractions)."""
    if dtype == jnp.float64 and not jax.config.jax_enable_x64:
        pytest.skip("needs x64")
    i = jnp.arange(NPHI)
    fi = i.astype(dtype)

    @jax.jit
    def reduction(k):
        return -jnp.sum(jnp.where(i < k, 1.0 / (fi + 1), 0.0))

    rows = _alpha_s_sums(np.dtype(dtype))
    eps = float(jnp.finfo(dtype).eps)
    for k in range(-1, NPHI + 2):
        expect = np.asarray(reduction(jnp.int32(k)))
        got = -rows[min(max(k, 0), NPHI)]
        assert got.dtype == expect.dtype and got == expect, (k, got, expect)
        exact = sum(fractions.Fraction(1, j + 1) for j in range(min(max(k, 0), NPHI)))
        # One rounding per term and per partial sum: at most 2·6 eps relative.
        assert abs(-float(got) - float(exact)) <= 12 * eps * max(float(exact), 1.0)
        # The coefficient that uses it: cj = −α_s/h (h an argument, as in a step: a
        # compile-time constant h would let XLA divide by multiplying with 1/h).
        h = jnp.asarray(0.37, dtype)
        cj = jax.jit(lambda k, h: set_coefficients(jnp.zeros(NPHI, dtype).at[0].set(h), h, k,
                                                   k, h, jnp.int32(0), dtype).cj)
        divide = jax.jit(lambda a, h: -a / h)
        assert np.asarray(cj(jnp.int32(k), h)) == np.asarray(divide(jnp.asarray(expect), h))


def test_stacked_norms_are_the_separate_norms():
    """`stacked_norms` against `wrms` of each difference on its own (the error test's
    and the order selection's), bit for bit, for every order and several n; None where
    the norm is more than the state's WRMS or the step is batched. Each norm is
    compiled on its own, as the step compiled them (one kernel each): compiled into one
    program with the stacked norms, XLA fuses parts of the two and may round the last
    bit differently (a product and a sum contracted or not)."""
    plain = types.SimpleNamespace(batched=False, error_groups=1, quad_error_control=False,
                                  sens=None)
    stacked = jax.jit(lambda k, phi, c, w: stacked_norms(
        plain, types.SimpleNamespace(error=w), Parts(y=phi), Parts(y=c), k))
    separate = [jax.jit(lambda k, phi, c, w: wrms(c, w)),
                jax.jit(lambda k, phi, c, w: wrms(history_row(phi, k) + c, w)),
                jax.jit(lambda k, phi, c, w: wrms(history_row(phi, k) + c
                                                  + history_row(phi, k - 1), w)),
                jax.jit(lambda k, phi, c, w: wrms(c - history_row(phi, k + 1), w) / (k + 2))]
    rng = np.random.default_rng(3)
    for n in (1, 3, 5, 8, 49):
        phi = jnp.asarray(rng.standard_normal((NPHI, n)))
        corr = jnp.asarray(rng.standard_normal(n) * 1e-3)
        w = jnp.asarray(rng.uniform(1e2, 1e6, n))
        for k in range(1, NPHI):
            args = (jnp.int32(k), phi, corr, w)
            got = np.asarray(stacked(*args))
            expect = np.array([f(*args) for f in separate])
            assert np.array_equal(got, expect), (n, k, got, expect)
    weights = types.SimpleNamespace(error=w)
    for other in (dict(batched=True), dict(error_groups=2)):
        problem = types.SimpleNamespace(**{**vars(plain), **other})
        assert stacked_norms(problem, weights, Parts(y=phi), Parts(y=corr), 2) is None


def _robertson(t, y, yp, p):
    r1 = yp[0] + p[0] * y[0] - p[1] * y[1] * y[2]
    r2 = yp[1] - p[0] * y[0] + p[1] * y[1] * y[2] + p[2] * y[1] ** 2
    return jnp.stack([r1, r2, y[0] + y[1] + y[2] - 1.0])


@pytest.mark.parametrize("force_setup,cj_old,at_predictor,setups", [
    (True, 2.0e3, False, 1),      # set up at the start
    (False, 2.0e3, True, 0),      # the old matrix, from this predictor: reused
    (False, 1.0e3, False, 1)])    # an old matrix from elsewhere: fails, retried
def test_compact_newton_carry_changes_no_iterate(monkeypatch, force_setup, cj_old,
                                                 at_predictor, setups):
    """The unbatched Newton loop with its compacted carry (`_newton._compact`) against
    the same loop carrying every field (the packing replaced by the identity): the same
    result, bit for bit (the same operations on the same values) — with a setup at the
    start, with the old matrix reused, and with an old matrix (of another point and cj)
    whose iteration fails and is retried with a new one (the retry's `setup`, `jcur`
    and `cj_old` are fields the compact carry derives)."""
    p = jnp.asarray([0.04, 1e4, 3e7])
    y0 = jnp.asarray([0.9, 3e-5, 0.1])
    yp0 = jnp.asarray([-0.01, 1e-4, 0.0])
    y_pred = y0 + jnp.asarray([1e-4, -2e-6, 3e-4])
    ls = DenseLU()
    cj, t = 2.0e3, 1e-3
    t_old, y_old = (t, y_pred) if at_predictor else (0.0, y0)
    lin_old = ls.setup(_robertson, t_old, y_old, yp0, cj_old, p)
    ewt = 1.0 / (1e-6 * jnp.abs(y0) + jnp.asarray([1e-10, 1e-14, 1e-8]))

    def solve(y_pred):
        return _newton.newton_solve(_robertson, p, ls, t, y_pred, yp0, jnp.asarray(cj), ewt,
                                    lin_old, (jnp.asarray(t_old), y_old, yp0),
                                    jnp.asarray(cj_old), jnp.asarray(20.0),
                                    jnp.asarray(force_setup))

    compact = jax.jit(solve)(y_pred)

    def full(t_, cj_, linear_solver, keep_mask):
        return (lambda c, start=None: c), (lambda c: c)

    monkeypatch.setattr(_newton, "_compact", full)
    reference = jax.jit(solve)(y_pred)
    assert bool(reference.converged) and int(reference.num_jacobian_evals) == setups
    a, b = jax.tree_util.tree_leaves(compact), jax.tree_util.tree_leaves(reference)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert np.array_equal(np.asarray(x), np.asarray(y)), (x, y)
