"""Linear algebra of the Newton iteration: the iteration matrix J = F_y + cj F_y'.

Seed 002 eq. (6.7): each Newton iteration solves J δ = -G with J = ∂F/∂y + cj ∂F/∂y',
cj = α_{n,0}/h_n. A linear solver here is an `eqx.Module` with three pure methods:

- `setup(residual, t, y, yp, cj, args) -> state`: build and factorize J (the IDAS
  "lsetup"), returning a pytree of fixed shape that the integrator carries between steps
  so the factorization can be reused while cj/cj_old stays in [3/5, 5/3];
- `solve(state, rhs, transpose=False) -> x`: one solve with J (or Jᵀ, for the adjoint);
- `is_singular(state) -> bool`: whether the factorization failed.
"""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
from jaxtyping import Array, Bool, Float


def iteration_matrix(residual, t, y, yp, cj, args) -> Float[Array, "n n"]:
    """J = F_y + cj F_y' as the Jacobian of v ↦ F(t, y + v, yp + cj v) at v = 0.

    One `jax.jacfwd` pushes the n unit tangents (e_j, cj e_j) through the residual in a
    single vectorized evaluation, instead of two separate Jacobians.
    """

    def shifted(v):
        return residual(t, y + v, yp + cj * v, args)

    return jax.jacfwd(shifted)(jnp.zeros_like(y))


class DenseLU(eqx.Module):
    """Dense LU factorization (lineax `LU`) of J; J from `jax.jacfwd` of the residual.

    **Arguments:**

    - `jac`: optional user iteration matrix `jac(t, y, yp, cj, args) -> (n, n)` returning
      F_y + cj F_y'. Default: automatic differentiation of the residual.
    """

    jac: Callable | None = None

    def setup(self, residual, t, y, yp, cj, args) -> Any:
        if self.jac is None:
            matrix = iteration_matrix(residual, t, y, yp, cj, args)
        else:
            matrix = jnp.asarray(self.jac(t, y, yp, cj, args), dtype=y.dtype)
        operator = lx.MatrixLinearOperator(matrix)
        return lx.LU().init(operator, {})

    def solve(self, state, rhs: Float[Array, " n"], transpose: bool = False):
        solver = lx.LU()
        if transpose:
            state, _ = solver.transpose(state, {})
        x, _, _ = solver.compute(state, rhs, {})
        return x

    def is_singular(self, state) -> Bool[Array, ""]:
        # A zero (relative to the largest, at the n·eps level) or non-finite pivot of U.
        # IDAS's dense LU reports only exact zeros; the relative test also catches the
        # rank deficiency of an index-2 or inconsistent algebraic block, which rounding
        # turns into a pivot of size ~eps instead of exactly zero.
        (lu, _), _, _ = state
        pivots = jnp.abs(jnp.diagonal(lu))
        n = pivots.shape[0]
        eps = jnp.finfo(lu.dtype).eps
        bad = ~jnp.all(jnp.isfinite(lu))
        return bad | (jnp.min(pivots) <= n * eps * jnp.max(pivots))
