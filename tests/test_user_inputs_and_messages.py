"""`solve` called as users call it — every kind of input, every transformation, bad
input and failed solves — against exact answers and the messages users should read:
silent wrong answers first, then JAX citizenship and failure messages.

Exact solutions used: y' = −k y, y(0) = 1 gives y(1) = e^{−k}, dy(1)/dk = −e^{−k},
d²y(1)/dk² = e^{−k}. Tolerances: rtol = atol = 1e-8 and the exact-solution tests' bound
of 100·rtol on the global error (which derivatives of the same integration inherit).
"""

import logging

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import daeadjoint as dae
from .problems import oscillator

RTOL = 1e-8
BOUND = 100 * RTOL


def decay(t, y, yp, k):
    return yp + k * y


def y_end(k):
    return dae.solve(decay, 0.0, 1.0, jnp.ones(1), args=k, rtol=RTOL, atol=RTOL).ys[-1, 0]


# ------------------------------------------------------------ silent wrong answers
# The defect was weak-typed inputs outside jit; numpy and jnp float64 scalars are
# strongly typed like every other test's inputs, and jitted calls of every kind share
# one path — those combinations run with --runslow (the default suite's budget). So does
# jit with a Python float (~20 s of compilation): jit(grad) of a Python-float parameter
# stays checked by default in
# test_closures.py::test_residual_closure_is_differentiated_in_every_mode[jit-grad], and
# jitted forward mode throughout test_transformations.py.
INPUT_KINDS = [pytest.param(kind, jit, id=f"{'jit' if jit else 'eager'}-{kind}",
                            marks=[] if (kind, jit) in {("python-float", False),
                                                        ("weak-jnp", False)}
                            else [pytest.mark.slow])
               for jit in (False, True)
               for kind in ("python-float", "weak-jnp", "numpy", "jnp-f64")]


@pytest.mark.parametrize(("kind", "jit"), INPUT_KINDS)
def test_gradient_for_every_input_kind(kind, jit):
    """jax.grad of a Python-float parameter returned 0.0 outside jit (equinox's
    filter_custom_vjp dropped weak-typed cotangents). Every input kind, eager and jitted,
    in reverse and forward mode, now gives −e^{−k}."""
    k = {"python-float": 0.5, "weak-jnp": jnp.asarray(0.5), "numpy": np.float64(0.5),
         "jnp-f64": jnp.asarray(0.5, jnp.float64)}[kind]
    exact = -np.exp(-0.5)
    grad = jax.jit(jax.grad(y_end)) if jit else jax.grad(y_end)
    fwd = jax.jit(jax.jacfwd(y_end)) if jit else jax.jacfwd(y_end)
    assert abs(float(grad(k)) - exact) <= BOUND
    assert abs(float(fwd(k)) - exact) <= BOUND
    _, tangent = jax.jvp(y_end, (k,), (1.0,))
    assert abs(float(tangent) - exact) <= BOUND


def test_integer_inputs_are_promoted():
    """Python ints for y0, t0, t1 and an int parameter: the working dtype is float64."""
    sol = dae.solve(decay, 0, 1, [1], args=1, rtol=RTOL, atol=RTOL)
    assert sol.ys.dtype == jnp.float64
    assert abs(float(sol.ys[-1, 0]) - np.exp(-1.0)) <= BOUND


def _growth(t, y, yp, a):
    return yp - y


@jax.jit
def _decay_at(saveat):
    return dae.solve(_growth, 0.0, 1.0, jnp.ones(1), saveat=saveat, throw=False)


# Module level, so that the three cases share one compiled program (a function defined in
# the test would be compiled anew for each).
@jax.jit
def _decay_at_throwing(saveat):
    return dae.solve(_growth, 0.0, 1.0, jnp.ones(1), saveat=saveat).ys


@pytest.mark.parametrize("saveat", [[-1.0, 1.0], [0.5, 2.0], [0.7, 0.3]],
                         ids=["before-t0", "after-t1", "unsorted"])
def test_traced_saveat_out_of_range_is_an_error(saveat):
    """Under jit, saveat = [−1, 1] returned y(−1) ≈ 4.5e-17 (exact e⁻¹) and a time past t1
    returned inf, both marked successful. Values known only at run time are now checked
    at run time: a status, and an error with throw=True."""
    sol = _decay_at(jnp.array(saveat))
    assert sol.result == dae.RESULTS.invalid_saveat
    assert not np.any(np.isnan(np.asarray(sol.ys)))
    with pytest.raises(Exception, match="invalid_saveat"):
        _decay_at_throwing(jnp.array(saveat))


def test_traced_interval_and_tolerances_checked_at_run_time():
    f = jax.jit(lambda t1, tol: dae.solve(lambda t, y, yp, a: yp - y, 0.0, t1, jnp.ones(1),
                                          rtol=tol, atol=tol, throw=False).result)
    assert f(-1.0, 1e-6) == dae.RESULTS.invalid_interval
    assert f(1.0, -1e-6) == dae.RESULTS.invalid_tolerance
    assert f(jnp.nan, 1e-6) == dae.RESULTS.nonfinite_input
    assert f(1.0, 1e-6) == dae.RESULTS.successful


def _psi1(theta, sensitivity):
    c, v0 = theta[0], theta[1]
    return dae.solve(oscillator, 0.0, jnp.pi / 2, jnp.stack([0.0, v0]), jnp.stack([v0, 0.0]),
                     jnp.stack([c]), rtol=RTOL, atol=RTOL, max_steps=4000,
                     sensitivity=sensitivity).ys[-1, 0]


def _psi1_exact(theta):
    c, v0 = theta[0], theta[1]
    return v0 * jnp.sin(jnp.sqrt(c) * jnp.pi / 2) / jnp.sqrt(c)


def test_hessian_with_discrete_adjoint():
    """jax.hessian with sensitivity=DiscreteAdjoint() gave entries of −72…−772 (central
    differences: 0.07–0.25) and non-symmetric matrices: forward-over-reverse
    differentiated the replay's frozen-step loops. Now the Hessian of the one-mass
    oscillator's x1(π/2) (Eberhard & Bischof) equals the exact one,
    [[v0(3 − π²/4)/4, −1/2], [−1/2, 0]] at c = 1, v0 = 1/2, within the 100·rtol bound."""
    theta = jnp.array([1.0, 0.5])
    H = jax.jit(jax.hessian(lambda th: _psi1(th, dae.DiscreteAdjoint())))(theta)
    exact = jax.hessian(_psi1_exact)(theta)
    np.testing.assert_allclose(np.asarray(H), np.asarray(exact), rtol=0, atol=BOUND)


# ------------------------------------------------------------------ JAX citizenship
def test_args_any_pytree_equinox_mlp():
    """args=eqx.nn.MLP(...) failed in the input check (jax.eval_shape on the activation
    function). Now its arrays are traced and differentiated, the rest static: the
    gradient w.r.t. one weight matches central differences of the solve (step 1e-5 at
    rtol 1e-10: truncation ~1e-10, noise ~1e-10/1e-5, so 1e-4 relative)."""
    mlp = eqx.nn.MLP(1, 1, 8, 2, key=jax.random.PRNGKey(0))

    def closure(t, y, yp, model):   # y' = −y + 0.1 MLP(y)
        return yp + y - 0.1 * model(y)

    def loss(model, rtol=1e-10):
        return dae.solve(closure, 0.0, 1.0, jnp.ones(1), args=model, rtol=rtol,
                         atol=rtol).ys[-1, 0]

    # The values for the central differences come from the gradient's own forward runs
    # (one compiled program for all three calls, no separate forward program).
    value_and_grad = eqx.filter_jit(eqx.filter_value_and_grad(loss))
    _, grads = value_and_grad(mlp)
    g = float(grads.layers[0].weight[3, 0])

    def f(model):
        return value_and_grad(model)[0]

    def shifted(eps):
        return eqx.tree_at(lambda m: m.layers[0].weight, mlp,
                           mlp.layers[0].weight.at[3, 0].add(eps))

    eps = 1e-5
    fd = (float(f(shifted(eps))) - float(f(shifted(-eps)))) / (2 * eps)
    assert abs(g - fd) <= 1e-4 * abs(fd)


def _decay_residual(t, y, yp, k):
    return yp + k * y


@pytest.mark.parametrize("kind", ["array", "python-float"])
def test_repeated_calls_do_not_recompile(caplog, kind):
    """Calling solve without jit recompiled on every call (3.0 s, 1.3 s, 1.4 s). The
    compiled solve is now cached (as diffrax does): a second call with new parameter
    values compiles nothing — also when the parameter is a Python float, which
    equinox's filtering would otherwise treat as a static constant (1.9 s per new value
    before; benchmarks/eager_calls.py measures it). One residual function for both
    cases: the first call of the second case may then find the first case's program
    (it compiles nothing new when a float is traced like an array, as it must be), and
    the check is the second call, which must compile nothing either way."""
    residual = _decay_residual
    make = jnp.asarray if kind == "array" else float
    dae.solve(residual, 0.0, 1.0, jnp.ones(1), args=make(0.3))
    with jax.log_compiles(True), caplog.at_level(logging.WARNING, logger="jax"):
        caplog.clear()
        sol = dae.solve(residual, 0.0, 1.0, jnp.ones(1), args=make(0.7))
        compiled = [r for r in caplog.records if "Compiling" in r.getMessage()
                    and "solve" in r.getMessage()]
    assert not compiled, [r.getMessage() for r in compiled]
    assert abs(float(sol.ys[-1, 0]) - np.exp(-0.7)) <= 100 * 1e-6


def test_mixed_precision_is_promoted():
    """float32 y0 with float64 args died inside while_loop ('carry input and carry output
    must have equal types'). The working precision is now the promoted dtype of y0, yp0
    and the residual's output (float64 here), as jnp arithmetic promotes."""
    sol = dae.solve(decay, 0.0, 1.0, jnp.ones(1, jnp.float32), args=jnp.asarray(0.5, jnp.float64),
                    rtol=RTOL, atol=RTOL)
    assert sol.ys.dtype == jnp.float64
    assert abs(float(sol.ys[-1, 0]) - np.exp(-0.5)) <= BOUND


# ------------------------------------------------------- failures that point the way
def test_nan_at_the_initial_values_is_named():
    """yp + sqrt(y − 2) at y0 = 1 reported a singular iteration matrix / index > 1."""
    sol = dae.solve(lambda t, y, yp, a: yp + jnp.sqrt(y - 2.0), 0.0, 1.0, jnp.ones(1),
                    jnp.zeros(1), throw=False)
    assert sol.result == dae.RESULTS.nonfinite_initial_residual
    with pytest.raises(Exception, match="NaN or inf at t0"):
        dae.solve(lambda t, y, yp, a: yp + jnp.sqrt(y - 2.0), 0.0, 1.0, jnp.ones(1),
                  jnp.zeros(1))


def test_nan_mid_run_is_named():
    """y1' = −1, y2 = sqrt(y1): y1 reaches 0 at t = 1, after which sqrt is NaN. This
    reported a step-size underflow; it is a domain error, and the partial solution up to
    t ≈ 1 is returned (exact there: y1(0.5) = 0.5)."""
    F = lambda t, y, yp, a: jnp.stack([yp[0] + 1.0, y[1] - jnp.sqrt(y[0])])  # noqa: E731
    sol = dae.solve(F, 0.0, 2.0, jnp.array([1.0, 1.0]), jnp.array([-1.0, -0.5]),
                    saveat=jnp.array([0.5, 2.0]), algebraic=jnp.array([False, True]),
                    throw=False)
    assert sol.result == dae.RESULTS.nonfinite_residual
    assert abs(float(sol.stats["t_final"]) - 1.0) < 1e-3
    assert abs(float(sol.ys[0, 0]) - 0.5) <= 100 * 1e-6 and np.isinf(float(sol.ys[1, 0]))


def test_inconsistent_initial_values_hint_init():
    """y2 = y1 + 1 algebraic with y0 = (1, 5) and a given yp0 reported 'error test
    failed 10 times' with no hint; now the status says the initial values are
    inconsistent and to use init=."""
    F = lambda t, y, yp, a: jnp.stack([yp[0] + y[0], y[1] - y[0] - 1.0])  # noqa: E731
    kwargs = dict(algebraic=jnp.array([False, True]))
    sol = dae.solve(F, 0.0, 1.0, jnp.array([1.0, 5.0]), jnp.array([-1.0, 0.0]), throw=False,
                    **kwargs)
    assert sol.result == dae.RESULTS.inconsistent_initial_conditions
    with pytest.raises(Exception, match="init='ya_ydp'"):
        dae.solve(F, 0.0, 1.0, jnp.array([1.0, 5.0]), jnp.array([-1.0, 0.0]), **kwargs)
    fixed = dae.solve(F, 0.0, 1.0, jnp.array([1.0, 5.0]), init="ya_ydp", **kwargs)
    assert abs(float(fixed.ys[-1, 1]) - (np.exp(-1.0) + 1.0)) <= 100 * 1e-6


def test_every_transformation_and_second_order():
    """Forward mode and nested reverse raised JAX's generic errors (and jax.hessian
    returned NaN). Now linearize, jvp-of-grad (forward over adjoint) and jacfwd-of-jacfwd
    (the fused forward run's own derivative rule, through the unfused primal and tangent
    primitives) give the exact derivatives of e^{−k}; jacfwd and jvp are checked above,
    jax.hessian (jacfwd of jacrev) with the DiscreteAdjoint above and with the adjoint in
    tests/test_transformations.py, two more compositions below. Each composition is
    jitted: one program each (eagerly, the pieces of the nested transformations compile
    one by one: 124 CPU s of compilation against 82 s jitted, the same values).
    jvp-of-grad differentiates the continuous adjoint without its fallback to the
    discrete adjoint (never taken here; the branch is a quarter of a gradient program's
    compilation): forward over the default `Adjoint()`, fallback included, is
    tests/test_right_answer_or_clear_failure.py's float32 Hessian (jacfwd of jacrev)."""
    k = 0.5
    e = np.exp(-k)
    lin = jax.jit(lambda k: jax.linearize(y_end, k)[1](1.0))(k)
    assert abs(float(lin) + e) <= BOUND

    def y_end_adjoint(k):
        return dae.solve(decay, 0.0, 1.0, jnp.ones(1), args=k, rtol=RTOL, atol=RTOL,
                         sensitivity=dae.Adjoint(fallback=False)).ys[-1, 0]

    hvp = jax.jit(lambda k: jax.jvp(jax.grad(y_end_adjoint), (k,), (1.0,))[1])(k)
    assert abs(float(hvp) - e) <= BOUND
    assert abs(float(jax.jit(jax.jacfwd(jax.jacfwd(y_end)))(k)) - e) <= BOUND


@pytest.mark.slow
def test_reverse_over_reverse_and_over_forward():
    """jacrev-of-jacrev (reverse over reverse) and jacrev-of-jacfwd (reverse over the
    fused forward run) give e^{−k}. Slow (~25 s of compilation; the default suite's
    budget): their pieces — the adjoint's own derivative rule, the fused run's rule —
    are exercised there by jax.hessian, jvp-of-grad and jacfwd-of-jacfwd."""
    k = 0.5
    e = np.exp(-k)
    assert abs(float(jax.jacrev(jax.jacrev(y_end))(k)) - e) <= BOUND
    assert abs(float(jax.jacrev(jax.jacfwd(y_end))(k)) - e) <= BOUND


def test_grad_of_a_checkpointed_solve():
    """jax.grad of a solve under jax.checkpoint (rematerialization, as in a memory-bound
    training step) failed with JAX's "Linearization failed to produce known values for
    all output primals": the checkpoint's jvp held the fused forward run, which its
    partial evaluation staged whole. Now it gives -e^{-k}."""
    g = jax.jit(jax.grad(jax.checkpoint(y_end)))(0.5)
    assert abs(float(g) + np.exp(-0.5)) <= BOUND


def test_derivative_wrt_tolerance_is_a_clear_error():
    with pytest.raises(ValueError, match="not differentiable with respect to rtol"):
        jax.grad(lambda r: dae.solve(decay, 0.0, 1.0, jnp.ones(1), args=0.5, rtol=r,
                                     atol=1e-8).ys[-1, 0])(1e-6)


def test_results_repr_is_readable():
    """RESULTS.successful printed as RESULTS<>."""
    assert "successful" in repr(dae.RESULTS.successful)
    assert "max_steps_reached" in repr(dae.RESULTS.max_steps_reached)
