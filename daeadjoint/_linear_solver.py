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
        return factor(matrix)

    def solve(self, state, rhs: Float[Array, " n"], transpose: bool = False):
        return factored_solve(state, rhs, transpose)

    def is_singular(self, state) -> Bool[Array, ""]:
        return factored_is_singular(state)


def factor(matrix: Float[Array, "n n"]):
    """Row-equilibrated LU: J = D⁻¹ J_s with D = diag(1/‖row_i‖∞), J_s = L U (lineax).

    The rows of an iteration matrix differ wildly in scale (cj ~ 1/h on differential
    rows, O(1) on algebraic ones); equilibrating makes the pivots comparable, so the
    singularity test below is scale-free and the factorization more accurate."""
    rownorm = jnp.max(jnp.abs(matrix), axis=1)
    d = 1.0 / jnp.where(rownorm > 0, rownorm, 1.0)
    lu_state = lx.LU().init(lx.MatrixLinearOperator(matrix * d[:, None]), {})
    return lu_state, d


def factored_solve(state, rhs, transpose: bool = False):
    """J x = rhs, or Jᵀ x = rhs, with the factors of `factor`."""
    lu_state, d = state
    solver = lx.LU()
    if transpose:   # Jᵀ = J_sᵀ D⁻¹ ⇒ x = D J_s⁻ᵀ rhs
        lu_t, _ = solver.transpose(lu_state, {})
        x, _, _ = solver.compute(lu_t, rhs, {})
        return d * x
    x, _, _ = solver.compute(lu_state, d * rhs, {})
    return x


def factored_is_singular(state) -> Bool[Array, ""]:
    """A zero row, a non-finite factor, or a pivot of U at the rounding level (n·eps
    relative to the largest) of the equilibrated matrix. IDAS's dense LU reports only
    exact zeros; the relative test also catches the rank deficiency of an index-2 or
    inconsistent algebraic block, which rounding turns into a pivot of size ~eps."""
    ((lu, _), _, _), d = state
    pivots = jnp.abs(jnp.diagonal(lu))
    n = pivots.shape[0]
    eps = jnp.finfo(lu.dtype).eps
    bad = ~jnp.all(jnp.isfinite(lu))
    return bad | (jnp.min(pivots) <= n * eps * jnp.max(pivots))
