"""Reference problems with published values, written once for all tests. The tests
call them by these labels:

- R1: Robertson kinetics, index 1 (SUNDIALS IDAS examples idasRoberts_dns,
  idasRoberts_FSA_dns, idasRoberts_ASAi_dns);
- R2, R3: state-dependent mass matrices, index 0 and 1 (Li & Petzold, DASPKADJOINT,
  eqs. (31) and (32));
- R4: the one-mass oscillator (Eberhard & Bischof, *Automatic differentiation of
  numerical integration algorithms*, §3), exact derivatives at any tolerance;
- R5: the 2-D heat equation with 1766 parameters (Li & Petzold, DASPKADJOINT, §7.1.1,
  Table 1; `test_heat_equation_gradient.py`).
"""

import jax.numpy as jnp

# R1: Robertson kinetics (SUNDIALS idasRoberts_dns), y3 algebraic.
ROBERTSON_P = jnp.array([0.04, 1e4, 3e7])
ROBERTSON_Y0 = jnp.array([1.0, 0.0, 0.0])
ROBERTSON_YP0 = jnp.array([-0.04, 0.04, 0.0])
ROBERTSON_ALGEBRAIC = jnp.array([False, False, True])


def robertson(t, y, yp, p):
    p1, p2, p3 = p[0], p[1], p[2]
    return jnp.stack([
        yp[0] + p1 * y[0] - p2 * y[1] * y[2],
        yp[1] - p1 * y[0] + p2 * y[1] * y[2] + p3 * y[1] ** 2,
        y[0] + y[1] + y[2] - 1.0,
    ])


# R2: state-dependent mass matrix, index 0 (Li & Petzold, DASPKADJOINT, eq. (31)); exact y = (sin t, cos t).
def mass_index0(t, y, yp, args):
    y1, y2 = y[0], y[1]
    return jnp.stack([
        y1 * yp[0] + y2 * yp[1],
        -y2 * yp[0] + y1 * yp[1] + (y1 ** 2 + y2 ** 2),
    ])


# R3: state-dependent mass matrix, index 1 (Li & Petzold, DASPKADJOINT, eq. (32)); y2 algebraic.
# Exact: y2 = y1 + 1 and y2 y1' = -y2 (y2 - 1)  =>  y1 = e^{-t}, y2 = e^{-t} + 1.
def mass_index1(t, y, yp, args):
    y1, y2 = y[0], y[1]
    return jnp.stack([
        y2 * yp[0] + y2 * (y2 - 1.0),
        y2 - y1 - 1.0,
    ])


# R4: one-mass oscillator (Eberhard & Bischof §3), args = (c, v0) enters only through y0 = (0, v0).
def oscillator(t, x, xp, args):
    c = args[0]
    return jnp.stack([xp[0] - x[1], xp[1] + c * x[0]])
