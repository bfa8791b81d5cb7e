"""Breakpoints of the inputs (`solve(..., breakpoints=...)`): every integration steps
onto them and restarts there, and all derivatives see the restarts.

Problems with exact solutions, driven by the square wave u(t) = 1 on [k, k + 1/2),
−1 on [k + 1/2, k + 1) (jumps at every half period):

- decay: y' = −a y + u(t), y(0) = 1: on each piece y = u_i/a + (y_i − u_i/a) e^{−a(t − t_i)}.
- the RC circuit of test_singular_mass_matrix.py with the source u(t) (F_y' singular and
  not diagonal, no mask): the capacitor voltage v = y1 − y2 obeys v' = (u − v)/τ,
  τ = C (R1 + R2), and y2 = (u − v) R2/(R1 + R2) jumps with u — an algebraic jump the
  restart must make consistent.

Derivatives: `jax.grad` of the closed forms (exact). Tolerances: rtol = atol = 1e-8 and
the bound 100·rtol of the exact-solution tests.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import daeadjoint as dae

RTOL = 1e-8
BOUND = 100 * RTOL
T = 2.3
BREAKS = jnp.array([0.5, 1.0, 1.5, 2.0])


def square(t):
    return jnp.where(jnp.mod(t, 1.0) < 0.5, 1.0, -1.0)


def piecewise(rate, target, x0, t=T):
    """x' = rate·(target(t) − x) from x(0) = x0, exactly, piece by piece."""
    x, t_i = x0, 0.0
    for t_b in list(np.asarray(BREAKS)) + [t]:
        t_b = min(float(t_b), t)
        u = square(t_i)
        x = u + (x - u) * jnp.exp(-rate * (t_b - t_i))
        t_i = t_b
    return x


def decay(t, y, yp, a):
    return yp + a * y - square(t)


def decay_exact(a):
    # y' = a (u/a − y): rate a, target u/a.
    x, t_i = 1.0, 0.0
    for t_b in list(np.asarray(BREAKS)) + [T]:
        u = square(t_i)
        x = u / a + (x - u / a) * jnp.exp(-a * (float(t_b) - t_i))
        t_i = float(t_b)
    return x


def decay_end(a, **kw):
    return dae.solve(decay, 0.0, T, jnp.ones(1), args=a, rtol=RTOL, atol=RTOL, **kw)


A = 3.0


def test_forward_steps_onto_breakpoints():
    """Exact to the bound with breakpoints; the restarts spare the error-test failures
    of steps that straddle the jumps."""
    with_bp = decay_end(A, breakpoints=BREAKS, steps=True)
    without = decay_end(A)
    exact = float(decay_exact(A))
    assert abs(float(with_bp.ys[-1, 0]) - exact) <= BOUND
    assert abs(float(without.ys[-1, 0]) - exact) <= BOUND
    assert set(np.asarray(BREAKS).tolist()) <= set(np.asarray(with_bp.step_ts).tolist())
    assert (with_bp.stats["num_error_test_failures"]
            < without.stats["num_error_test_failures"])


SENSITIVITIES = {
    "adjoint": lambda f: jax.grad(f),
    "discrete-adjoint": lambda f: jax.grad(lambda a: f(a, sensitivity=dae.DiscreteAdjoint())),
    "forward": lambda f: jax.jacfwd(f),
}


# Slow (~10-25 s of compilation per mode; the default suite's budget): each mode's
# derivative through the breakpoint restarts stays checked by default in
# `test_algebraic_jumps_at_breakpoints_without_a_mask`, the same three modes through the
# same restarts, with the algebraic jump on top.
@pytest.mark.slow
@pytest.mark.parametrize("name", list(SENSITIVITIES))
def test_decay_gradient_through_breakpoints(name):
    def f(a, **kw):
        return decay_end(a, breakpoints=BREAKS, **kw).ys[-1, 0]
    exact = float(jax.grad(decay_exact)(A))
    assert abs(float(SENSITIVITIES[name](f)(A)) - exact) <= BOUND


P = jnp.array([1.0, 2.0, 0.5])   # R1, R2, C


def circuit(t, y, yp, p):
    r1, r2, c = p
    i_c = c * (yp[0] - yp[1])
    return jnp.stack([i_c + (y[0] - square(t)) / r1, -i_c + y[1] / r2])


def circuit_exact(p):
    r1, r2, c = p
    v = piecewise(1.0 / (c * (r1 + r2)), square, 0.0)
    y2 = (square(T) - v) * r2 / (r1 + r2)
    return y2


def circuit_end(p, **kw):
    # v(0) = 0 and the source at +1: y2 = R2/(R1 + R2), y1 = y2 (init computes y' and
    # checks y).
    y0 = jnp.full(2, p[1] / (p[0] + p[1]))
    return dae.solve(circuit, 0.0, T, y0, args=p, rtol=RTOL, atol=RTOL,
                     breakpoints=BREAKS, **kw).ys[-1, 1]


def circuit_end_twice(p, **kw):
    """(y2(T), y2(T)): the derivative's output and, as its auxiliary output, the value of
    its own forward run."""
    y2 = circuit_end(p, **kw)
    return y2, y2


# Each mode's derivative with the value of its forward run (a separate solve compiled
# another program for the value). The discrete adjoint and forward mode jitted: one
# program each. The continuous adjoint's gradient stays eager, its forward and backward
# parts compiled apart: jitted as one program, XLA took longer (26 s against 18-22 s for the
# eager pieces, 2026-11-29 at load ~4).
WITH_VALUE = {
    "adjoint": jax.grad(circuit_end_twice, has_aux=True),
    "discrete-adjoint": jax.jit(jax.grad(
        lambda p: circuit_end_twice(p, sensitivity=dae.DiscreteAdjoint()), has_aux=True)),
    "forward": jax.jit(jax.jacfwd(circuit_end_twice, has_aux=True)),
}
# The closed form's value and gradient: one small program (eagerly, each of its
# operations compiles alone).
_circuit_exact_value_and_grad = jax.jit(jax.value_and_grad(circuit_exact))


@pytest.mark.parametrize("name", list(SENSITIVITIES))
def test_algebraic_jumps_at_breakpoints_without_a_mask(name):
    """The node voltages jump with the source: the restart makes them consistent."""
    exact, g_exact = _circuit_exact_value_and_grad(P)
    g, value = WITH_VALUE[name](P)
    assert abs(float(value) - float(exact)) <= BOUND
    np.testing.assert_allclose(g, g_exact, rtol=0, atol=BOUND)


def test_breakpoints_must_be_sorted():
    with pytest.raises(ValueError, match="sorted"):
        decay_end(A, breakpoints=jnp.array([1.0, 0.5]))
