"""Linear algebra of the Newton iterations: the one interface every linear solver follows.

Every linear system daeadjoint solves has the matrix of some residual R(t, y, y', args)
linearized as

    J = ∂R/∂y + cj ∂R/∂y'                              (IDAS manual eq. (6.7))

— the forward Newton iteration (R = F), the forward-sensitivity correctors (the same J),
the adjoint Newton iteration (Jᵀ), and, with cj = 0 and the masked residual of
`masked_residual`, the matrices of consistent initialization, of consistent initial
sensitivities and of the adjoint's jumps at observation times. A linear solver is an
`eqx.Module` (its configuration) implementing `AbstractLinearSolver`; one solver therefore
serves all of them, forward and transposed.
"""

import abc
from collections.abc import Callable
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
from jaxtyping import Array, Bool, Float

from .._ops import taken_where, where


class AbstractLinearSolver(eqx.Module):
    """How the linear systems J x = b (or Jᵀ x = b) with J = R_y + cj R_y' are solved.

    Subclasses implement three pure methods (and may override `auxiliary`):

    - `setup(residual, t, y, yp, cj, args) -> state`: build (and factorize, or set up a
      preconditioner for) J of `residual` at the point (t, y, y') — IDAS's "lsetup". The
      state is a pytree of arrays of fixed shape: the integrator carries it between steps
      and reuses it while cj/cj_old stays in [3/5, 5/3] (modified Newton).
    - `solve(state, rhs, *, transpose=False, weights=None, operator=None) -> (x, stats)`:
      one solve with J, or with Jᵀ when `transpose` (the adjoint). `weights` are the WRMS
      weights of x (iterative solvers stop on ‖P⁻¹(J x − b)‖_WRMS ≤ 0.05·0.33, IDAS's
      epslin); `operator` is v ↦ J v at the *current* iterate, given by every caller
      when `matrix_free` is True (the solver transposes it itself with
      `jax.linear_transpose` when needed); matrix-based solvers ignore both. `stats` is a
      dict with exactly the keys `stat_names` (int32 counters, e.g. Krylov iterations),
      summed by the caller into `Solution.stats`.
    - `is_singular(state) -> bool`: whether the set-up matrix is (numerically) singular;
      the Newton iteration treats it as a convergence failure, and repeated failures give
      `RESULTS.singular_matrix` (index > 1, or algebraic equations that do not determine
      the algebraic variables).
    - `setup_where(pred, state, residual, t, y, yp, cj, args) -> state` (optional):
      `setup` where `pred`, else `state`; the Newton iteration's refresh, called only
      where `unvmap_any(pred)` holds (unbatched, pred is true). Default: set up and
      select (a select only under `vmap`, `_ops.taken_where`); a batched kernel may set
      up only the members with `pred`.
    - `solve_where(pred, state, rhs, ...) -> (x, stats)` (optional): `solve` where `pred`,
      elsewhere unspecified; the batched Newton iteration's solve. Default: `solve`.
    - `solve_failed(stats) -> bool`: whether the solve that returned `stats` missed its
      tolerance (iterative solvers; default never). Like IDAS, the Newton iteration
      accepts such a correction on its first iteration and fails (recoverably: a smaller
      step, a fresh setup) on later ones; repeated failures give
      `RESULTS.linear_solver_failures`.
    - `auxiliary() -> AbstractLinearSolver`: the solver for the *other* matrices built from
      the residual through `masked_residual` (consistent initialization, initial
      sensitivities, the adjoint's jumps). User-supplied Jacobians or preconditioners are
      for the iteration matrix of F only, so solvers that hold them return a copy without.
    - `prepare(residual, t0, y0, yp0, args) -> AbstractLinearSolver` (optional): called
      once by `solve`, e.g. to detect the sparsity pattern; default identity.

    Attributes (class attributes or properties): `matrix_free` (True: J is applied at
    the current iterate, so the Newton update is not rescaled by 2/(1 + cj/cj_old), as
    IDAS does for iterative solvers), `needs_operator` (callers must pass `operator`;
    defaults to `matrix_free`) and `stat_names`.
    """

    matrix_free: ClassVar[bool] = False
    stat_names: ClassVar[tuple[str, ...]] = ()

    @property
    def needs_operator(self) -> bool:
        return self.matrix_free

    @abc.abstractmethod
    def setup(self, residual, t, y, yp, cj, args) -> Any:
        ...

    @abc.abstractmethod
    def solve(self, state, rhs, *, transpose: bool = False, weights=None, operator=None):
        ...

    @abc.abstractmethod
    def is_singular(self, state) -> Bool[Array, ""]:
        ...

    def solve_failed(self, stats) -> Bool[Array, ""]:
        del stats
        return jnp.zeros((), bool)

    def setup_where(self, pred, state, residual, t, y, yp, cj, args) -> Any:
        """`setup(residual, t, y, yp, cj, args)` where `pred`, else `state` — the
        refresh of the Newton iteration. Under `vmap` `pred` is per member and a solver
        may set up only the members that need it (the LAPACK band kernel factorizes only
        those, `SparseLU`/`BandedLU`); this default sets up every member and selects.
        Called only where `unvmap_any(pred)` holds (`newton_solve`'s refresh), so the
        select is needed only under `vmap` (`taken_where`)."""
        new = self.setup(residual, t, y, yp, cj, args)
        return taken_where(pred, new, state)

    def solve_where(self, pred, state, rhs, *, transpose: bool = False, weights=None,
                    operator=None):
        """`solve(state, rhs, ...)` where `pred`; elsewhere the result is unspecified
        (the caller drops it: a batch's members whose Newton iteration has ended). Under
        `vmap` a solver may solve only the members with `pred` (the LAPACK band
        kernel); this default solves every member."""
        del pred
        return self.solve(state, rhs, transpose=transpose, weights=weights, operator=operator)

    def auxiliary(self) -> "AbstractLinearSolver":
        return self

    def prepare(self, residual, t0, y0, yp0, args) -> "AbstractLinearSolver":
        """This solver specialized to `residual` — called once by `solve` before the
        integration is traced (e.g. `SparseLU` detects the sparsity pattern here).
        Whatever it fixes must hold for every matrix of the solve: those of
        `masked_residual` mix the same columns of F_y and F_y', so a pattern of
        F_y ∪ F_y' does. Default: the solver itself."""
        del residual, t0, y0, yp0, args
        return self


class SetupWithArgs(AbstractLinearSolver):
    """`inner` for a caller that evaluates the residual with args of its own making (the
    discrete adjoint's flat parameter vector): it is set up with the problem's
    `residual` at `to_args(args)`, so that a user Jacobian or preconditioner inside
    `inner` receives the args it was written for."""

    inner: AbstractLinearSolver
    residual: Callable
    to_args: Callable

    @property
    def matrix_free(self) -> bool:
        return self.inner.matrix_free

    @property
    def needs_operator(self) -> bool:
        return self.inner.needs_operator

    @property
    def stat_names(self) -> tuple:
        return self.inner.stat_names

    def setup(self, residual, t, y, yp, cj, args):
        del residual
        return self.inner.setup(self.residual, t, y, yp, cj, self.to_args(args))

    def solve(self, state, rhs, *, transpose=False, weights=None, operator=None):
        return self.inner.solve(state, rhs, transpose=transpose, weights=weights,
                                operator=operator)

    def is_singular(self, state):
        return self.inner.is_singular(state)

    def solve_failed(self, stats):
        return self.inner.solve_failed(stats)

    def auxiliary(self) -> AbstractLinearSolver:
        # The auxiliary matrices come from residuals the caller builds; no user function.
        return self.inner.auxiliary()


def masked_residual(residual, y, yp, split) -> Callable:
    """The residual whose iteration matrix at cj = 0 is C = R_y Π + R_y' (I − Π).

    `(t, v, w, args) ↦ residual(t, y + Πv, y' + (I − Π)v, args)` linearized at v = 0:
    its J = ∂/∂v (w is unused). Π is diag(m) for a bool mask m, or a
    `_consistency.Split`. With m the algebraic mask, C is the Jacobian of IDAS's
    consistent initialization in mode YA_YDP (unknowns y_a and y'_d), Cᵀ is the matrix M
    of the adjoint's consistent jumps (Li & Petzold, DASPKADJOINT, §4.1); with m = 1 it is
    R_y (mode Y). For a mask its sparsity and bandwidth are within those of
    R_y + cj R_y', so every solver set up for the iteration matrix can factor it too."""
    if hasattr(split, "alg"):
        alg, diff = split.alg, split.diff
    else:
        m = split.astype(y.dtype)
        alg, diff = (lambda v: m * v), (lambda v: (1 - m) * v)

    def fn(t, v, w, args):
        del w
        return residual(t, y + alg(v), yp + diff(v), args)

    return fn


def setup_masked(solver: AbstractLinearSolver, residual, t, y, yp, args, y_mask):
    """`solver.auxiliary()` set up for C of `masked_residual` at (t, y, y'); returns the
    auxiliary solver, its state, and the masked residual (for `operator`s)."""
    aux = solver.auxiliary()
    fn = masked_residual(residual, y, yp, y_mask)
    zero = jnp.zeros_like(y)
    return aux, aux.setup(fn, t, zero, zero, jnp.zeros((), y.dtype), args), fn


def operator_of(residual, t, y, yp, cj, args) -> Callable:
    """v ↦ J v = R_y v + cj R_y' v at (t, y, y') by one `jax.linearize` (for `operator`)."""
    _, lin = jax.linearize(lambda v: residual(t, y + v, yp + cj * v, args), jnp.zeros_like(y))
    return lin


def iteration_matrix(residual, t, y, yp, cj, args) -> Float[Array, "n n"]:
    """J = F_y + cj F_y' as the Jacobian of v ↦ F(t, y + v, yp + cj v) at v = 0.

    One `jax.jacfwd` pushes the n unit tangents (e_j, cj e_j) through the residual in a
    single vectorized evaluation, instead of two separate Jacobians.
    """

    def shifted(v):
        return residual(t, y + v, yp + cj * v, args)

    return jax.jacfwd(shifted)(jnp.zeros_like(y))


class DenseLU(AbstractLinearSolver):
    """Dense LU factorization of J, built by one `jax.jacfwd` of the residual.

    Rows are equilibrated before factorizing (see `factor`); n ≤ 8 uses an explicit
    Gauss–Jordan inverse, larger n lineax's LU. O(n²) memory and O(n³) per setup: the
    right choice up to a few hundred unknowns, or for dense Jacobians.

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

    def solve(self, state, rhs, *, transpose=False, weights=None, operator=None):
        return factored_solve(state, rhs, transpose), {}

    def is_singular(self, state) -> Bool[Array, ""]:
        return factored_is_singular(state)

    def auxiliary(self) -> "DenseLU":
        return DenseLU()


SMALL_N = 8


def factor(matrix: Float[Array, "n n"]):
    """Factorize J for repeated solves (IDAS's modified Newton reuses it for many steps).

    Rows are equilibrated first, J = D⁻¹ J_s with D = diag(1/‖row_i‖∞): the rows of an
    iteration matrix differ wildly in scale (cj ~ 1/h on differential rows, O(1) on
    algebraic ones), and equilibrating makes the pivots comparable, so the singularity
    test below is scale-free. Then:

    - n ≤ SMALL_N: the explicit inverse by Gauss–Jordan with partial pivoting (unrolled
      over the columns for n ≤ 3, a loop over them above: `UNROLLED_GAUSS_JORDAN_N`).
      Solves become one mat-vec; under `vmap` everything is plain vectorized
      arithmetic (a batch of small LAPACK solves costs a library call per member on a
      CPU, the mat-vec one vectorized operation).
    - otherwise: LU through lineax (O(n²) triangular solves)."""
    d = row_scaling(matrix)
    scaled = matrix * d[:, None]
    n = matrix.shape[0]
    if n <= SMALL_N:
        inverse, pivots = _gauss_jordan_inverse(scaled)
        return inverse * d[None, :], pivots
    lu_state = lx.LU().init(lx.MatrixLinearOperator(scaled), {})
    (lu, _), _, _ = lu_state
    return lu_state, d, jnp.diagonal(lu)


# Up to this n `_gauss_jordan_inverse` is unrolled over the columns; above it, a loop.
# The unrolled pivot search is O(n²) selects of whole rows, which XLA duplicates into
# many kernels: `factor` alone of an 8×8 matrix compiled to 7.6k HLO lines, 82 kernels
# and 6-9 s (load 3-4), against 0.3-0.4 s and 331 lines in the loop, with the same
# results bit for bit (the same pivots, the same arithmetic) and no slower run (8×8:
# ~20-55 µs against 130-530 µs; a batch of 64: 200-460 µs against 340-900 µs). Every
# program that sets up a small dense matrix carries one copy per setup site (the
# transistor amplifier's gradient, n = 8: four). n ≤ 3 stays unrolled (0.2-0.4 s).
UNROLLED_GAUSS_JORDAN_N = 3


def _gauss_jordan_inverse(a):
    """Inverse and the pivots (= U's diagonal of LU with partial pivoting)."""
    n = a.shape[0]
    m = jnp.concatenate([a, jnp.eye(n, dtype=a.dtype)], axis=1)
    if n > UNROLLED_GAUSS_JORDAN_N:
        m, pivots = gauss_jordan_columns(m)
        return m[:, n:], pivots
    pivots = []
    for j in range(n):
        # p = argmax_{i ≥ j} |m_ij| (the first of equals; a NaN counts as the largest, as
        # in `jnp.argmax`) and its row, unrolled over the rows: elementwise, where an
        # argmax and a gather are operations of their own (under `vmap`, of every
        # batched Newton iteration that sets J up).
        col = jnp.abs(m[:, j])
        p, best, rp = jnp.asarray(j, jnp.int32), col[j], m[j]
        for i in range(j + 1, n):
            take = (col[i] > best) | (jnp.isnan(col[i]) & ~jnp.isnan(best))
            p = where(take, i, p)
            best = where(take, col[i], best)
            rp = where(take, m[i], rp)
        m, piv = gauss_jordan_step(m, j, p, rp)
        pivots.append(piv)
    return m[:, n:], jnp.stack(pivots)


def gauss_jordan_columns(m):
    """Gauss–Jordan elimination with partial pivoting of the first n columns of m (n,
    ·), n = m.shape[0], as a loop over the columns (`lax.fori_loop`: one copy of the
    column step in the program). Returns (m, the pivots): m's first n columns the
    identity, the rest multiplied by the inverse of the first n."""
    n = m.shape[0]
    rows = jax.lax.broadcasted_iota(jnp.int32, (n,), 0)

    def column(j, carry):
        m, pivots = carry
        col = jnp.abs(jax.lax.dynamic_index_in_dim(m, j, 1, keepdims=False))
        # p = argmax_{i ≥ j} |m_ij|: the first of equals, a NaN the largest (as the
        # unrolled search of `_gauss_jordan_inverse`); rows above j are out of the running.
        p = jnp.argmax(where(rows >= j, col, -1.0)).astype(jnp.int32)
        rp = jax.lax.dynamic_index_in_dim(m, p, 0, keepdims=False)
        m, piv = gauss_jordan_step(m, j, p, rp)
        return m, jax.lax.dynamic_update_index_in_dim(pivots, piv, j, 0)

    return jax.lax.fori_loop(0, n, column, (m, jnp.zeros((n,), m.dtype)))


def row_scaling(matrix):
    """D = diag(1/‖row_i‖∞) (1 for a zero row): D·matrix has rows of unit max-norm."""
    rownorm = jnp.max(jnp.abs(matrix), axis=1)
    return 1.0 / where(rownorm > 0, rownorm, 1.0)


def gauss_jordan_step(m, j, p, rp):
    """One column step of Gauss–Jordan elimination on m (n, ·) with partial pivoting:
    rows p and j swapped (`rp` is row p), row j divided by the pivot, column j
    eliminated from the other rows — by selects, elementwise (one fused operation,
    fewer instructions to compile than row updates). `j` a Python int (unrolled over
    the columns) or a traced one (in a loop). Returns (m, the pivot)."""
    def take(x, axis):
        if isinstance(j, int):
            return x[j] if axis == 0 else x[:, j]
        return jax.lax.dynamic_index_in_dim(x, j, axis, keepdims=False)

    rows = jax.lax.broadcasted_iota(jnp.int32, (m.shape[0],), 0)
    rj, piv = take(m, 0), take(rp, 0)
    m = where(rows[:, None] == j, rp / piv, where(rows[:, None] == p, rj, m))
    m = m - where(rows == j, 0.0, take(m, 1))[:, None] * take(m, 0)[None, :]
    return m, piv


def factored_solve(state, rhs, transpose: bool = False):
    """J x = rhs, or Jᵀ x = rhs, with the factors of `factor`."""
    if len(state) == 2:
        inverse, _ = state
        inverse = inverse.T if transpose else inverse
        return jnp.sum(inverse * rhs[..., None, :], axis=-1)
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
