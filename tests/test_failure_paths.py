"""Failure paths: bad input rejected before tracing with an error naming the argument,
float32 handling, and failures under `jit` reported by a status (`sol.result`) with the
partial solution (failures of the initialization: tests/test_initialization.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import daeadjoint as dae
from .problems import ROBERTSON_ALGEBRAIC, ROBERTSON_P, ROBERTSON_Y0, robertson

ROB_ATOL = jnp.array([1e-8, 1e-6, 1e-6])


# ------------------------------------------------------------- bad input, before tracing
def test_wrong_residual_shape():
    with pytest.raises(ValueError, match="residual.*shaped like y"):
        dae.solve(lambda t, y, yp, a: y[:2] - yp[:2], 0.0, 1.0, jnp.ones(3), jnp.zeros(3))


@pytest.mark.parametrize("kwargs, match", [
    (dict(t1=0.0), "t1` equals `t0"),
    (dict(t1=-1.0), "integrate forward"),
    (dict(rtol=-1.0), "non-negative"),
    (dict(atol=jnp.ones(5)), "atol"),
    (dict(saveat=jnp.array([0.5, 2.0])), "saveat"),
    (dict(saveat=jnp.array([0.5, 0.2])), "sorted"),
    (dict(algebraic=jnp.array([1, 0])), "algebraic"),
    (dict(init="bogus"), "init"),
    (dict(max_steps=0), "max_steps"),
    (dict(tstop=0.5), "tstop"),
    (dict(yp0=jnp.zeros(3)), "yp0"),
    (dict(y0=jnp.ones((2, 2))), "1-D"),
])
def test_bad_input_named(kwargs, match):
    base = dict(t1=1.0, y0=jnp.ones(2), yp0=jnp.zeros(2))
    base.update(kwargs)
    t1, y0, yp0 = base.pop("t1"), base.pop("y0"), base.pop("yp0")
    with pytest.raises(ValueError, match=match):
        dae.solve(lambda t, y, yp, a: yp + y, 0.0, t1, y0, yp0, **base)


def test_float32_cannot_meet_tolerance():
    """float32 (eps 1.2e-7) cannot resolve rtol = 1e-6 corrections: clear error that
    names the dtype and the smallest workable rtol; float64 at 1e-16 likewise."""
    with pytest.raises(ValueError, match="float32 cannot meet rtol=1e-06"):
        dae.solve(lambda t, y, yp, a: yp + y, 0.0, 1.0, jnp.ones(2, jnp.float32),
                  jnp.zeros(2, jnp.float32), rtol=1e-6)
    with pytest.raises(ValueError, match="float64 cannot meet"):
        dae.solve(lambda t, y, yp, a: yp + y, 0.0, 1.0, jnp.ones(2), -jnp.ones(2), rtol=1e-16)


def test_float32_solve_respects_dtype():
    """A float32 problem at a tolerance float32 can meet stays float32 and is accurate:
    y = e^{-t}, error within 100·rtol (as in the float64 exact-solution tests)."""
    sol = dae.solve(lambda t, y, yp, a: yp + y, 0.0, 1.0, jnp.ones(1, jnp.float32),
                    -jnp.ones(1, jnp.float32), rtol=1e-4, atol=1e-6)
    assert sol.ys.dtype == jnp.float32
    assert abs(float(sol.ys[-1, 0]) - np.exp(-1.0)) <= 100 * 1e-4


# ------------------------------------------------------ failures under jit: status
def test_max_steps_partial_solution():
    ts = jnp.array([0.4, 4.0e1, 4.0e4, 4.0e10])
    sol = dae.solve(robertson, 0.0, 4e10, ROBERTSON_Y0, jnp.array([-0.04, 0.04, 0.0]),
                    ROBERTSON_P, saveat=ts, algebraic=ROBERTSON_ALGEBRAIC, rtol=1e-4,
                    atol=ROB_ATOL, max_steps=60, throw=False)
    assert sol.result == dae.RESULTS.max_steps_reached
    assert int(sol.stats["num_steps"]) == 60
    t_final = float(sol.stats["t_final"])
    reached = np.asarray(ts) <= t_final
    assert reached[0] and not reached[-1]
    ys = np.asarray(sol.ys)
    # What was reached is the real solution (IDAS table, 4 digits); the rest is marked
    # unreached with inf, never NaN.
    np.testing.assert_allclose(ys[0], [9.8517e-01, 3.3864e-05, 1.4794e-02], rtol=5e-4)
    assert np.all(np.isinf(ys[~reached])) and not np.any(np.isnan(ys))
    with pytest.raises(Exception, match="maximum number of steps"):
        dae.solve(robertson, 0.0, 4e10, ROBERTSON_Y0, jnp.array([-0.04, 0.04, 0.0]),
                  ROBERTSON_P, saveat=ts, algebraic=ROBERTSON_ALGEBRAIC, rtol=1e-4,
                  atol=ROB_ATOL, max_steps=60)


def _decay_grad(throw):
    """y' = −p y to t1 = 1 with too few steps: dy(1)/dp of a failed solve, jitted, the
    primal's outputs not returned (so its own error check is not in the program)."""
    def y1(p):
        return dae.solve(lambda t, y, yp, a: yp + a * y, 0.0, 1.0, jnp.ones(1), None, p,
                         rtol=1e-8, atol=1e-10, max_steps=3, throw=throw).ys[-1, 0]
    return jax.jit(jax.grad(y1))


def test_jit_grad_of_a_failed_solve_raises():
    """`jax.jit(jax.grad(f))` returns only the gradient: the failed forward solve's
    error check left the program with its unused outputs, and the gradient came back
    NaN with no error. The derivative reports the primal's failure itself (as
    `jax.jacfwd` does); with throw=False it is NaN, as documented."""
    with pytest.raises(Exception, match="max_steps_reached"):
        jax.block_until_ready(_decay_grad(True)(0.5))
    assert np.isnan(float(_decay_grad(False)(0.5)))


def test_times_given_as_numbers_are_checked_under_jit():
    """t0 and t1 given as Python numbers are known under `jit` as well: two times that
    round to the same float32 number raise the same error as outside `jit` (before,
    `jit` traced their conversion and the gradient came back NaN)."""
    def y1(p):
        return dae.solve(lambda t, y, yp, a: yp + a * y, 1.0e9, 1.0e9 + 1.0,
                         jnp.ones(1, jnp.float32), None, p, rtol=1e-4, atol=1e-6).ys[-1, 0]

    for f in (y1, jax.jit(y1), jax.jit(jax.grad(y1))):
        with pytest.raises(ValueError, match="below the spacing of float32"):
            f(jnp.float32(0.5))


def nan_residual(t, y, yp, args):
    return yp + jnp.log(y - 2.0)   # y0 = 1: log of a negative number everywhere


def test_nan_residual():
    """The residual is NaN at the initial values themselves: reported as such (not as a
    singular iteration matrix, whose factors the NaN also poisons)."""
    sol = dae.solve(nan_residual, 0.0, 1.0, jnp.ones(1), jnp.zeros(1), throw=False)
    assert sol.result == dae.RESULTS.nonfinite_initial_residual
    assert not np.any(np.isnan(np.asarray(sol.ys)))
    with pytest.raises(Exception, match="NaN or inf at t0"):
        jax.jit(lambda y0: dae.solve(nan_residual, 0.0, 1.0, y0, jnp.zeros(1)))(jnp.ones(1))


def underdetermined(t, y, yp, args):
    # Index-2-looking system given as index 1: differentiating y1 − y2 = t gives
    # y3 − y3 = 1, so y3 is not determined at all and F_y + cj F_y' is singular for
    # every step size.
    return jnp.stack([yp[0] - y[2], yp[1] - y[2], y[0] - y[1] - t])


def test_singular_iteration_matrix():
    sol = dae.solve(underdetermined, 0.0, 1.0, jnp.zeros(3), jnp.zeros(3),
                    algebraic=jnp.array([False, False, True]), throw=False)
    assert sol.result == dae.RESULTS.singular_matrix
    with pytest.raises(Exception, match="singular"):
        dae.solve(underdetermined, 0.0, 1.0, jnp.zeros(3), jnp.zeros(3),
                  algebraic=jnp.array([False, False, True]))


def test_impossible_tolerance_at_runtime():
    """Tolerances only known at run time (traced) are checked by IDAS's test
    uround·‖y‖_WRMS > 1: rtol = atol = 1e-20 cannot be met in float64."""
    f = jax.jit(lambda tol: dae.solve(lambda t, y, yp, a: yp + y, 0.0, 1.0, jnp.ones(1),
                                      -jnp.ones(1), rtol=tol, atol=tol, throw=False))
    assert f(1e-20).result == dae.RESULTS.tolerance_too_small
    assert f(1e-8).result == dae.RESULTS.successful


# ------------------------------------- derivatives of a DAE that is not index 1 (issue 20)
#
# x' = z, 0 = x − p t: the algebraic block F_z = 0 is singular (z is an index-2 variable,
# fixed only by the hidden constraint x' = p). The forward solve succeeds (BDF is exact
# on this linear problem: x = p t, z = p), but consistent initial sensitivities and the
# continuous adjoint's consistent values need index 1. The two-bit adder of the Test
# Set meets this through 13 floating nodes (tests/test_testset.py, slow).

def _index2_residual(t, y, yp, p):
    return jnp.stack([yp[0] - y[1], y[0] - p * t])


def _index2_output(p, sensitivity=None, throw=True):
    sol = dae.solve(_index2_residual, 0.0, 1.0, jnp.array([0.0, p]), jnp.array([p, 0.0]),
                    args=p, sensitivity=sensitivity, throw=throw)
    return sol.ys[-1] @ jnp.array([1.0, 1.0])      # x(1) + z(1) = 2p


_index2_jacfwd = jax.jit(jax.jacfwd(_index2_output))
_index2_grad = jax.jit(jax.grad(_index2_output))
_index2_grad_strict = jax.jit(jax.grad(
    lambda p: _index2_output(p, dae.Adjoint(fallback=False))))


def test_jacfwd_singular_algebraic_block_raises_under_jit():
    """Under jit, `jax.jacfwd` discards the primal (and its error check): the tangents
    must report the run's failure themselves, not come back NaN."""
    with pytest.raises(Exception, match="singular_initial_sensitivity"):
        _index2_jacfwd(2.0)
    sol = dae.solve(_index2_residual, 0.0, 1.0, jnp.array([0.0, 2.0]), jnp.array([2.0, 0.0]),
                    args=2.0, throw=False)
    assert sol.result == dae.RESULTS.successful      # the forward solve itself is fine
    assert "no capacitance to ground" in str(dae.RESULTS.singular_initial_sensitivity)


def test_continuous_adjoint_singular_algebraic_block_reported():
    """The continuous adjoint stops at its first restart (M singular) instead of
    integrating from non-finite values; the fallback's warning says why, and the
    discrete adjoint's gradient is the exact d(x + z)/dp = 2 (the solution is exact to
    rounding on this linear problem: bound 1e-9). Without the fallback the error names
    the cause."""
    with pytest.warns(RuntimeWarning, match="not index 1 in its algebraic variables"):
        g = _index2_grad(2.0)
    assert abs(float(g) - 2.0) < 1e-9
    with pytest.raises(Exception, match="no consistent values"):
        _index2_grad_strict(2.0)
