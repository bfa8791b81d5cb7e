"""Sparse direct solvers: `SparseLU`, and `default_linear_solver` (which solver to use).

J = F_y + cj F_y' is assembled from its sparsity pattern (detected from the residual's
program, or given) by one vmapped `jax.jvp` per column colour (`jacobian.py`), never as an
n×n array, and factorized by one of two backends:

- `"banded"` (default; jit/vmap, any device): the reverse Cuthill–McKee ordering of the
  symmetrized pattern (scipy, once, at trace time) permutes J to a narrow band, P J Pᵀ,
  which `banded.py`'s band LU factorizes in O(n·b) memory, b the permuted bandwidth —
  LAPACK's gbtrf as an XLA custom call on CPUs, block GEPP in pure JAX elsewhere
  (`kernel=`). Right for 1-D chains, meshes of modest width, networks that RCM orders
  well. Singular matrices are reported as `DenseLU` does (relative pivot test).
- `"klu"`: KLU (Davis & Palamadai Natarajan; the sparse direct solver of IDAS's
  SUNLinSol_KLU and PyBaMM's IDAKLU) through `klujax`, CPU only (`klu.py`). The symbolic
  analysis (BTF + AMD ordering) is done once per pattern. Each solve refactorizes from
  the carried O(nnz) values (`solve_with_symbol`) — still far cheaper than a dense or
  wide-band factorization on 2-D/3-D meshes: klujax's numeric factorizations made inside
  a compiled program are raw C++ handles that no operation in the program can free (a
  factorization per setup would leak one per setup), and its in-place `refactor` would
  make the matrices alive at the same time (adjoint iteration and jump matrices, vmap
  members) share one. KLU stops the program with a runtime error on a singular matrix
  and exposes no pivots, so each setup tests J on the host (`klu.klu_singular`:
  `DenseLU`'s pivot test on a SuperLU factorization) and hands KLU the identity instead
  of a singular J; `is_singular` reports the test. The pattern and the symbolic handle
  are static parameters of `klu.klu_solve_p`, not arrays, so `vmap` over whole solves
  (batched `lax.cond`s batch every array operand) works.
"""

import functools
import warnings
from typing import Literal, get_args

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool

from .banded import (KERNELS, Kernel, band_singular, factor_band, factor_band_where,
                     resolve_kernel, solve_band, solve_band_where)
from .jacobian import (Sparsity, assemble, check_pattern, colour_columns,
                        compressed_jacobian, detect_sparsity, pattern_mismatch, seeds)
from .klu import klu_singular, klu_solve, klujax as _klujax
from .linear_solver import AbstractLinearSolver, DenseLU


# ------------------------------------------------------------------ static plans


class _Plan:
    """Everything static about factorizing matrices of one pattern: the colouring and
    the seeds of the compressed Jacobian, the RCM permutation and the permuted pattern
    (or the KLU symbolic analysis). Built once per pattern (cached)."""

    def __init__(self, sparsity: Sparsity, backend: str):
        self.sparsity = sparsity
        self.colours, self.n_colours = colour_columns(sparsity)
        self.seeds = seeds(self.colours, self.n_colours)
        if backend == "banded":
            # RCM narrows scattered patterns; a pattern already banded in its own
            # ordering (a grid numbered row by row) can be narrower as it is: keep the
            # ordering with the smaller bandwidth (the natural one on a tie).
            orders = (np.arange(sparsity.n, dtype=np.int64), reverse_cuthill_mckee(sparsity))
            self.perm = min(orders, key=lambda p: bandwidth(sparsity.permuted(p)))
            self.inverse = np.argsort(self.perm)
            self.permuted = sparsity.permuted(self.perm)
            self.bandwidth = bandwidth(self.permuted)
            # `values` are in `sparsity`'s (row-major) order; the permuted pattern sorts
            # them differently, so gather them into its order once.
            permuted = self.inverse[sparsity.rows].astype(np.int64) * sparsity.n \
                + self.inverse[sparsity.cols]
            self.order = np.argsort(permuted, kind="stable")
        else:
            klujax = _klujax()
            # Eagerly, also when first reached while tracing: the handle must be a
            # concrete C++ object owned (and freed) by this plan, not a traced value.
            with jax.ensure_compile_time_eval():
                self.symbolic = klujax.analyze(np.asarray(sparsity.rows),
                                               np.asarray(sparsity.cols), sparsity.n)
            # What KLU factorizes instead of a singular J (see `_klu_guard`): the
            # identity, which every pattern contains.
            self.identity = (sparsity.rows == sparsity.cols).astype(np.float64)


@functools.lru_cache(maxsize=32)
def _plan(sparsity: Sparsity, backend: str) -> _Plan:
    # The cache also keeps the KLU symbolic object (and so the C++ memory its handle in
    # compiled programs points to) alive.
    return _Plan(sparsity, backend)


def bandwidth(sparsity: Sparsity) -> int:
    return max(sparsity.lower, sparsity.upper)


def reverse_cuthill_mckee(sparsity: Sparsity) -> np.ndarray:
    """The RCM ordering of the pattern ∪ its transpose (a bandwidth-reducing ordering:
    breadth-first from a peripheral node, reversed)."""
    import scipy.sparse as sps
    from scipy.sparse.csgraph import reverse_cuthill_mckee as rcm

    n = sparsity.n
    ones = np.ones(sparsity.nnz, np.int8)
    a = sps.csr_matrix((ones, (sparsity.rows, sparsity.cols)), shape=(n, n))
    return np.asarray(rcm((a + a.T).tocsr(), symmetric_mode=True), dtype=np.int64)


# ------------------------------------------------------------------ the solver


# How `SparseLU` factorizes (its `backend`).
Backend = Literal["banded", "klu"]


class SparseLU(AbstractLinearSolver):
    """Sparse direct LU of J = F_y + cj F_y': J assembled from its sparsity pattern by
    coloured `jax.jvp`s (one per colour: ~5–10 for a 2-D 5-point stencil, whatever n),
    factorized by a sparse direct method. Never forms an n×n array.

    **Arguments:**

    - `sparsity`: a `daeadjoint.Sparsity` of F_y ∪ F_y' (e.g.
      `Sparsity(rows, cols, n)`). Default None: detected from the residual's program by
      `solve` (once per residual and shapes); a residual the detector cannot analyse
      raises `SparsityDetectionError` asking for the pattern.
    - `backend`: `"banded"` (default: reverse Cuthill–McKee to a band, then band LU with
      partial pivoting — jit, vmap, CPU and GPU) or `"klu"` (KLU through klujax, CPU; see
      `daeadjoint._linalg.sparse`).
    - `kernel`: the band LU's kernel for `backend="banded"`, as `BandedLU(kernel=...)`:
      `"auto"` (default: LAPACK on a single CPU device, pure JAX on GPUs and with
      several devices), `"lapack"` or `"jax"`.
    - `check`: verify at each setup that the assembled matrix reproduces J v =
      `jax.jvp` for a fixed random v, and raise an error if not (a given pattern that
      misses nonzeros). One extra `jvp` per setup. Default True.
    """

    sparsity: Sparsity | None = eqx.field(static=True, default=None)
    backend: Backend = eqx.field(static=True, default="banded")
    check: bool = eqx.field(static=True, default=True)
    kernel: Kernel = eqx.field(static=True, default="auto")

    def __check_init__(self):
        if self.backend not in get_args(Backend):
            raise ValueError(f"SparseLU(backend=...) must be one of {get_args(Backend)}, "
                             f"got {self.backend!r}.")
        if self.kernel not in KERNELS:
            raise ValueError(f"SparseLU(kernel=...) must be one of {KERNELS}, got "
                             f"{self.kernel!r}.")
        if self.sparsity is not None and not isinstance(self.sparsity, Sparsity):
            raise TypeError("SparseLU(sparsity=...) must be a daeadjoint.Sparsity, got "
                            f"{type(self.sparsity).__name__}.")

    def prepare(self, residual, t0, y0, yp0, args) -> "SparseLU":
        if self.sparsity is not None:
            if self.sparsity.n != y0.shape[0]:
                raise ValueError(f"SparseLU: the sparsity pattern is {self.sparsity.n}×"
                                 f"{self.sparsity.n} but y0 has {y0.shape[0]} components.")
            return self
        return SparseLU(detect_sparsity(residual, t0, y0, yp0, args), self.backend,
                        self.check, self.kernel)

    def setup(self, residual, t, y, yp, cj, args):
        plan, values = self._values(residual, t, y, yp, cj, args)
        if self.backend == "banded":
            return factor_band(values[plan.order], plan.permuted, resolve_kernel(self.kernel))
        return _klu_guard(plan, values)

    def setup_where(self, pred, state, residual, t, y, yp, cj, args):
        if self.backend != "banded":
            return super().setup_where(pred, state, residual, t, y, yp, cj, args)
        plan, values = self._values(residual, t, y, yp, cj, args)
        return factor_band_where(pred, state, values[plan.order], plan.permuted,
                                 resolve_kernel(self.kernel))

    def _values(self, residual, t, y, yp, cj, args):
        """(plan, J's nonzeros in the pattern's order), by coloured jvps (checked if
        `check`)."""
        sparsity = self.sparsity
        if sparsity is None:   # not prepared by `solve`: detect from this residual
            sparsity = detect_sparsity(residual, t, y, yp, args)
        plan = _plan(sparsity, self.backend)
        values = assemble(compressed_jacobian(residual, t, y, yp, cj, args, plan.seeds),
                          sparsity, plan.colours)
        if self.check:
            mismatch = pattern_mismatch(residual, t, y, yp, cj, args, values, sparsity)
            values = check_pattern(
                values, mismatch,
                "SparseLU: the iteration matrix has nonzeros outside the given sparsity "
                "pattern (J v from the pattern differs from jax.jvp). Pass the pattern of "
                "dF/dy ∪ dF/dy', or sparsity=None to detect it.")
        return plan, values

    def solve(self, state, rhs, *, transpose=False, weights=None, operator=None):
        if self.backend == "klu":
            return self._solve_klu(state, rhs, transpose), {}
        plan = _plan(self._sparsity_of(state), self.backend)
        x = solve_band(state, rhs[plan.perm], plan.permuted,   # P J Pᵀ (P x) = P rhs
                       resolve_kernel(self.kernel), transpose)
        return x[plan.inverse], {}

    def solve_where(self, pred, state, rhs, *, transpose=False, weights=None, operator=None):
        if self.backend == "klu":
            return self.solve(state, rhs, transpose=transpose)
        plan = _plan(self._sparsity_of(state), self.backend)
        x = solve_band_where(pred, state, rhs[plan.perm], plan.permuted,
                             resolve_kernel(self.kernel), transpose)
        return x[plan.inverse], {}

    def _sparsity_of(self, state):
        if self.sparsity is None:
            raise ValueError("SparseLU(sparsity=None): the pattern is detected by "
                             "`solve` (via `prepare`); outside it pass `sparsity=`.")
        return self.sparsity

    def _solve_klu(self, state, rhs, transpose):
        plan = _plan(self._sparsity_of(state), "klu")
        values = state[0]
        # A loop starts from a zero state, before any setup. Under `vmap` a member that
        # never sets up (its initialization failed) still runs the batch's solves, and
        # KLU would stop the whole program on its zero matrix; such a member solves with
        # the identity instead (its results are discarded, its status already failed).
        blank = jnp.all(values == 0, axis=-1, keepdims=True)
        values = jnp.where(blank, jnp.asarray(plan.identity, values.dtype), values)
        return klu_solve(plan, values, rhs, transpose)

    def is_singular(self, state) -> Bool[Array, ""]:
        if self.backend == "klu":
            return state[1]
        return band_singular(state, resolve_kernel(self.kernel))


def _klu_guard(plan: _Plan, values):
    """The KLU state (values, singular). KLU stops the whole program with a runtime
    error on a singular matrix, so a matrix found singular (`klu_singular`) is replaced by
    the identity: the solves still run (their results are unused: the Newton iteration
    fails on `is_singular`) and the status is reported."""
    singular = klu_singular(plan.sparsity, values)
    return jnp.where(singular, jnp.asarray(plan.identity, values.dtype), values), singular


# ------------------------------------------------------------------ the default


# Below this many unknowns a dense LU is as fast as anything else (LAPACK on a small
# matrix, one jacfwd), and it needs no pattern.
DENSE_MAX_N = 100
# A pattern denser than this (fraction of n²) gains nothing from sparse storage.
DENSE_MIN_DENSITY = 0.2


def default_linear_solver(residual, t0, y0, yp0, args) -> AbstractLinearSolver:
    """The linear solver `solve` uses when none is given.

    - n ≤ 100: `DenseLU()` (no pattern needed; unchanged from earlier versions).
    - otherwise the pattern of F_y ∪ F_y' is detected (statically: shapes and the
      program, so this works with tracers under jit/vmap/grad) and
      - dense (≥ 20% nonzeros, or no ordering gives a bandwidth below n/3):
        `DenseLU()`;
      - otherwise `SparseLU(pattern)`: banded LU in the natural or the RCM ordering,
        whichever is narrower (pure JAX; fewer coloured jvps than `BandedLU`).
    - a residual whose pattern cannot be detected: `DenseLU()` with a warning.
    """

    n = int(np.shape(y0)[0])
    if n <= DENSE_MAX_N:
        return DenseLU()
    try:
        sparsity = detect_sparsity(residual, t0, y0, yp0, args)
    except Exception as err:   # noqa: BLE001 — fall back, but say why
        warnings.warn(f"{err} Falling back to DenseLU().", stacklevel=3)
        return DenseLU()
    if sparsity.density >= DENSE_MIN_DENSITY:
        return DenseLU()
    band = _plan(sparsity, "banded").bandwidth    # the better of natural and RCM order
    if 3 * band >= n:   # the band LU would be a dense LU, ~3× the work
        return DenseLU()
    # Rather than BandedLU at the same bandwidth: SparseLU assembles J from the pattern's
    # colours (7 for a 5-point stencil) instead of l + u + 1 band colours: fewer jvps
    # per Jacobian.
    return SparseLU(sparsity)
