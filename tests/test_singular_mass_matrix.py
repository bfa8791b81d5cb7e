"""Fully implicit index-1 DAEs whose singular F_y' mixes components (no component is
absent from y', so no `algebraic` mask describes them) — circuits with a capacitor
between two nodes, as the Test Set's transistor amplifier. The continuous adjoint and
forward sensitivities take the algebraic directions from ker F_y' (`_consistency.Split`);
an `algebraic` mask alone would make the adjoint fail (`adjoint_failed`) and the
forward sensitivities refuse (`singular_initial_sensitivity`).

The circuit: a source u(t) = sin t drives node 1 through R1; a capacitor C joins nodes 1
and 2; R2 ties node 2 to ground:

    C (y1' − y2') + (y1 − u)/R1 = 0,    −C (y1' − y2') + y2/R2 = 0.

F_y' = C [[1, −1], [−1, 1]]: ker F_y' = span{(1, 1)}, and the constraint is the sum of the
rows, (y1 − u)/R1 + y2/R2 = 0. Exact solution with τ = C (R1 + R2) and the capacitor
voltage v = y1 − y2, v(0) = v0:

    v(t) = v0 e^{−t/τ} + (sin t − τ cos t + τ e^{−t/τ})/(1 + τ²),
    y2 = (sin t − v) R2/(R1 + R2),   y1 = v + y2.

Its derivatives are those of this formula (`jax.grad` of the closed form, exact). The
given part of y0 is the differential direction (I − Π)y0, Π = ½[[1, 1], [1, 1]]: a
change δ of y0 changes v0 by δ1 − δ2, so dL/dy0 = dL/dv0 · (1, −1).
Tolerances: rtol = atol = 1e-8 and the bound 100·rtol of the exact-solution tests.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import daeadjoint as dae

RTOL = 1e-8
BOUND = 100 * RTOL
T = 2.0
P = jnp.array([1.0, 2.0, 0.5])   # R1, R2, C
V0 = 0.1


def residual(t, y, yp, p):
    r1, r2, c = p
    i_c = c * (yp[0] - yp[1])
    return jnp.stack([i_c + (y[0] - jnp.sin(t)) / r1, -i_c + y[1] / r2])


def exact(p, v0, t=T):
    r1, r2, c = p
    tau = c * (r1 + r2)
    v = v0 * jnp.exp(-t / tau) + (jnp.sin(t) - tau * jnp.cos(t) + tau * jnp.exp(-t / tau)) / (1 + tau**2)
    y2 = (jnp.sin(t) - v) * r2 / (r1 + r2)
    return jnp.stack([v + y2, y2])


def consistent(p, v0):
    """y(0) and y'(0) from the exact solution (consistent for these p, v0)."""
    return exact(p, v0, 0.0), jax.jacfwd(lambda t: exact(p, v0, t))(0.0)


def y2_end(p, y0, yp0=None, **kw):
    return dae.solve(residual, 0.0, T, y0, yp0, args=p, rtol=RTOL, atol=RTOL, **kw).ys[-1, 1]


EXACT_DP = np.asarray(jax.grad(lambda p: exact(p, V0)[1])(P))
EXACT_DV0 = float(jax.grad(lambda v0: exact(P, v0)[1])(V0))


def test_forward_and_initialization_without_a_mask():
    """Given consistent values, and from y0 alone (init="ya_ydp", the default without
    yp0): the capacitor voltage y1 − y2 of y0 is kept, the rest made consistent."""
    y0, yp0 = consistent(P, V0)
    assert abs(float(y2_end(P, y0, yp0)) - float(exact(P, V0)[1])) <= BOUND
    # From a guess with the right capacitor voltage but inconsistent node voltages.
    guess = jnp.array([V0 + 0.3, 0.3])
    sol = dae.solve(residual, 0.0, T, guess, args=P, rtol=RTOL, atol=RTOL)
    np.testing.assert_allclose(sol.ys[-1], exact(P, V0), rtol=0, atol=BOUND)


SENSITIVITIES = {
    "adjoint": lambda f: jax.grad(f),
    "discrete-adjoint": lambda f: jax.grad(lambda p: f(p, sensitivity=dae.DiscreteAdjoint())),
    "forward": lambda f: jax.jacfwd(f),
}

# The derivatives of y2(T) with respect to p, y0 and yp0 at once, by the continuous
# adjoint and by forward sensitivities: one compiled program per mode, shared by the
# tests below (each takes the part it checks; a derivative through y0(p), yp0(p) is the
# chain rule on them). Separate eager derivatives compiled a program for each set of
# differentiated inputs.
ALL_INPUTS = {"adjoint": jax.jit(jax.grad(y2_end, argnums=(0, 1, 2))),
              "forward": jax.jit(jax.jacfwd(y2_end, argnums=(0, 1, 2)))}


def through_consistent_values(mode, p):
    """d y2(T)/dp with y0, yp0 consistent for each p: ∂p + ∂y0 dy0/dp + ∂yp0 dyp0/dp."""
    d_p, d_y0, d_yp0 = ALL_INPUTS[mode](p, *consistent(p, V0))
    dy0_dp, dyp0_dp = jax.jacfwd(lambda p: consistent(p, V0))(p)
    return d_p + d_y0 @ dy0_dp + d_yp0 @ dyp0_dp


# The discrete adjoint's case runs with --runslow (~10 s of compilation; the default
# suite's budget): it stays checked by default on the same circuit, without a mask and
# with its initial values made consistent by the solve, in
# test_breakpoints.py::test_algebraic_jumps_at_breakpoints_without_a_mask[discrete-adjoint].
@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slow] if n == "discrete-adjoint"
                                               else []) for n in SENSITIVITIES])
def test_parameter_gradient_in_every_mode(name):
    """d y2(T)/d(R1, R2, C) with y0, yp0 consistent for each p (they depend on p)."""
    def f(p, **kw):
        y0, yp0 = consistent(p, V0)
        return y2_end(p, y0, yp0, **kw)
    derivative = (SENSITIVITIES[name](f)(P) if name == "discrete-adjoint"
                  else through_consistent_values(name, P))
    np.testing.assert_allclose(derivative, EXACT_DP, rtol=0, atol=BOUND)


def test_parameter_gradient_with_fixed_initial_values():
    """y0, yp0 held fixed while p moves: the initial sensitivities must be projected
    onto the constraint (which depends on R1, R2), not taken as zero. v0 stays put."""
    y0, yp0 = consistent(P, V0)
    for mode in ("adjoint", "forward"):
        np.testing.assert_allclose(ALL_INPUTS[mode](P, y0, yp0)[0], EXACT_DP, rtol=0,
                                   atol=BOUND, err_msg=mode)


# Each (init, mode) pair is its own compiled program (~10-25 s of compilation) except
# the two with yp0 given, the programs shared above. The adjoint through the
# initialization ("ya_ydp", y0 projected onto the constraint) runs by default; forward
# sensitivities through it with --runslow (forward mode through "ya_ydp" stays checked
# by default in test_breakpoints.py::test_algebraic_jumps_at_breakpoints_without_a_mask
# [forward], on the same circuit).
@pytest.mark.parametrize("init, mode", [
    (None, "adjoint"), (None, "forward"),
    ("ya_ydp", "adjoint"), pytest.param("ya_ydp", "forward", marks=pytest.mark.slow)])
def test_initial_value_gradient_is_along_the_differential_direction(init, mode):
    """dL/dy0 = dL/dv0 · (1, −1), by adjoint and forward mode."""
    y0, yp0 = consistent(P, V0)
    expected = EXACT_DV0 * np.array([1.0, -1.0])
    if init is None:
        derivative = ALL_INPUTS[mode](P, y0, yp0)[1]
    else:
        f = lambda y: y2_end(P, y)  # noqa: E731
        derivative = (jax.grad if mode == "adjoint" else jax.jacfwd)(f)(y0)
    np.testing.assert_allclose(derivative, expected, rtol=0, atol=BOUND)


# ------------------------------------------- a large semi-explicit DAE without a mask
#
# Above 200 unknowns no null space of F_y' is computed; the algebraic components are
# those whose y' the residual's program never reads. A chain of N − 1 decays
# y_i' = −k w_i y_i and one algebraic output z = Σ c_i y_i (its own y' unread):
# z(T) = Σ c_i y0_i e^{−k w_i T}, so dz(T)/dk = −T Σ c_i w_i y0_i e^{−k w_i T} (exact).
# The objective observes the algebraic component, whose cotangent the adjoint must map
# to a consistent final condition. Bound 100·rtol, as above.

N_LARGE = 201
W = 1.0 + jnp.arange(N_LARGE - 1) / N_LARGE
C_OUT = jnp.linspace(0.5, 1.5, N_LARGE - 1)
Y0_DIFF = jnp.linspace(1.0, 2.0, N_LARGE - 1)


def decays(t, y, yp, k):
    return jnp.concatenate([yp[:-1] + k * W * y[:-1], (y[-1] - C_OUT @ y[:-1])[None]])


def z_end(k, sensitivity=None):
    y0 = jnp.concatenate([Y0_DIFF, jnp.zeros(1)])     # z(0) computed by the initialization
    sol = dae.solve(decays, 0.0, T, y0, args=k, rtol=RTOL, atol=RTOL, sensitivity=sensitivity)
    return sol.ys[-1, -1]


K_LARGE = 0.7
Z_LARGE = float(jnp.sum(C_OUT * Y0_DIFF * jnp.exp(-K_LARGE * W * T)))
DZ_LARGE = float(-T * jnp.sum(C_OUT * W * Y0_DIFF * jnp.exp(-K_LARGE * W * T)))


def test_large_semi_explicit_dae_without_a_mask_continuous_adjoint():
    # The continuous adjoint on its own (no fallback to the discrete adjoint). The value
    # is that of the gradient's forward run (a plain solve would compile another
    # program of this size for the same integration).
    z, g = jax.value_and_grad(z_end)(K_LARGE, dae.Adjoint(fallback=False))
    assert abs(float(z) - Z_LARGE) <= BOUND * abs(Z_LARGE)
    assert abs(float(g) - DZ_LARGE) <= BOUND * abs(DZ_LARGE)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["discrete", "jacfwd"])
def test_large_semi_explicit_dae_without_a_mask_other_modes(mode):
    g = (jax.grad(z_end)(K_LARGE, dae.DiscreteAdjoint()) if mode == "discrete"
         else jax.jacfwd(z_end)(K_LARGE))
    assert abs(float(g) - DZ_LARGE) <= BOUND * abs(DZ_LARGE)
