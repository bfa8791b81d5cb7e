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


SMALL_N = 8


def factor(matrix: Float[Array, "n n"]):
    """Factorize J for repeated solves (IDAS's modified Newton reuses it for many steps).

    Rows are equilibrated first, J = D⁻¹ J_s with D = diag(1/‖row_i‖∞): the rows of an
    iteration matrix differ wildly in scale (cj ~ 1/h on differential rows, O(1) on
    algebraic ones), and equilibrating makes the pivots comparable, so the singularity
    test below is scale-free. Then:

    - n ≤ SMALL_N: the explicit inverse by Gauss–Jordan with partial pivoting, unrolled
      over the n columns. Solves become one mat-vec; under `vmap` everything is plain
      vectorized arithmetic (a batch of 256 3×3 LAPACK solves costs ~370 µs per call on
      CPU, the mat-vec microseconds).
    - otherwise: LU through lineax (O(n²) triangular solves)."""
    rownorm = jnp.max(jnp.abs(matrix), axis=1)
    d = 1.0 / jnp.where(rownorm > 0, rownorm, 1.0)
    scaled = matrix * d[:, None]
    n = matrix.shape[0]
    if n <= SMALL_N:
        inverse, pivots = _gauss_jordan_inverse(scaled)
        return inverse * d[None, :], pivots
    lu_state = lx.LU().init(lx.MatrixLinearOperator(scaled), {})
    (lu, _), _, _ = lu_state
    return lu_state, d, jnp.diagonal(lu)


def _gauss_jordan_inverse(a):
    """Inverse and the pivots (= U's diagonal of LU with partial pivoting)."""
    n = a.shape[0]
    m = jnp.concatenate([a, jnp.eye(n, dtype=a.dtype)], axis=1)
    rows = jnp.arange(n)
    pivots = []
    for j in range(n):
        p = jnp.argmax(jnp.where(rows >= j, jnp.abs(m[:, j]), -1.0))
        rj, rp = m[j], m[p]
        m = m.at[p].set(rj).at[j].set(rp)
        piv = m[j, j]
        pivots.append(piv)
        m = m.at[j].set(m[j] / piv)
        m = m - jnp.where(rows == j, 0.0, m[:, j])[:, None] * m[j][None, :]
    return m[:, n:], jnp.stack(pivots)


def factored_solve(state, rhs, transpose: bool = False):
    """J x = rhs, or Jᵀ x = rhs, with the factors of `factor`."""
    if len(state) == 2:
        inverse, _ = state
        return (inverse.T if transpose else inverse) @ rhs
    lu_state, d, _ = state
    solver = lx.LU()
    if transpose:   # Jᵀ = J_sᵀ D⁻¹ ⇒ x = D J_s⁻ᵀ rhs
        lu_t, _ = solver.transpose(lu_state, {})
        x, _, _ = solver.compute(lu_t, rhs, {})
        return d * x
    x, _, _ = solver.compute(lu_state, d * rhs, {})
    return x


def factored_is_singular(state) -> Bool[Array, ""]:
    """A non-finite pivot, or a pivot at the rounding level (n·eps relative to the
    largest) of the equilibrated matrix. IDAS's dense LU reports only exact zeros; the
    relative test also catches the rank deficiency of an index-2 or inconsistent
    algebraic block, which rounding turns into a pivot of size ~eps."""
    pivots = jnp.abs(state[-1])
    n = pivots.shape[0]
    eps = jnp.finfo(pivots.dtype).eps
    bad = ~jnp.all(jnp.isfinite(pivots))
    return bad | (jnp.min(pivots) <= n * eps * jnp.max(pivots))
