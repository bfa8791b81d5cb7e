"""Banded LU: `BandedLU(lower, upper)`, and its pure-JAX kernel.

Two kernels factorize the band (`kernel=`, chosen by `resolve_kernel`): on one CPU
device LAPACK's gbtrf/gbtrs as XLA custom calls (`band_lapack.py`), elsewhere (GPUs,
several devices) the block elimination below, in pure JAX (on a CPU several times
slower than LAPACK's single call: it runs n/b dependent steps of small kernels).

A matrix with lower bandwidth l and upper bandwidth u (J_ij = 0 unless −l ≤ j − i ≤ u)
is, in blocks of any size b ≥ max(l, u) (we use max(l, u, 16), see `MIN_BLOCK`), block
tridiagonal: row block k touches only column blocks k − 1, k, k + 1. Gaussian
elimination with partial pivoting (GEPP, as LAPACK's gbtrf) then works on a sliding
window of two block rows: for column block k the only rows that can hold a nonzero below
the diagonal are those of block rows k and k + 1 (row i > j + l is structurally zero), so

    P_k [D̃_k  C̃_k  0    ]   [L11]                      [0      ]
        [A_k+1 D_k+1 C_k+1] = [L21] [U11  U12  U13]  +   [S_k+1  ]

— one LU with partial pivoting of the 2b×b panel [D̃_k; A_k+1], one unit triangular
solve for U12, U13 and one product for the Schur complement S_k+1 = (D̃_k+1, C̃_k+1),
the modified block row carried to the next step. The pivot choice is exactly GEPP's (the
same candidates, the same largest-magnitude rule), so the factorization is as stable as
`DenseLU`'s; the fill-in of pivoting is the extra block U13 (U has bandwidth ≤ 2b, as
gbtrf's l + u). The loop is a `lax.scan` over n/b block steps of dense b-sized LAPACK
kernels — few loop iterations, vectorized work, and it runs under `jit` and `vmap` and
on any device. Memory O(n·b) = O(n·(l + u)); time O(n·b²).

Rows are equilibrated first (row ∞-norms), and the singularity test is `DenseLU`'s: a
non-finite pivot or a pivot ≤ n·eps·max|pivot| (IDAS manual §6.2.2.1 uses band LU for
this matrix; its singularity test is exact zeros only, the relative one also catches
index-2 and inconsistent algebraic blocks).

The matrix is assembled by l + u + 1 coloured `jax.jvp`s (columns j ≡ c mod (l + u + 1),
`jacobian.banded_colours`). A bandwidth that is too small would fold the missing
entries into wrong ones; each setup compares J v from the band with `jax.jvp` for one
fixed random v and raises (through `equinox.error_if`, under jit too) naming the
bandwidth.
"""

import functools
import warnings
from typing import Literal, NamedTuple, get_args

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import numpy as np
from jaxtyping import Array, Bool, Float

from . import band_lapack, lapack_ffi
from .jacobian import (Sparsity, assemble, banded_colours, check_pattern,
                        compressed_jacobian, pattern_mismatch, seeds)
from .linear_solver import AbstractLinearSolver


# The band LU's kernels (`BandedLU(kernel=...)`, `SparseLU(kernel=...)`).
Kernel = Literal["auto", "lapack", "jax"]
KERNELS = get_args(Kernel)


def resolve_kernel(kernel: str) -> str:
    """`"auto"` → `"lapack"` when the program runs on a single CPU device and the LAPACK
    custom calls build here (`lapack_ffi.py`: numba compiles them), `"jax"` otherwise: on
    GPUs, and with several devices, where XLA's partitioner cannot split a custom call
    and runs it replicated, on the whole batch on every device, while the pure-JAX kernel
    partitions like any JAX code. An explicit `"lapack"` that cannot be built raises
    naming why; with several devices it warns."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}.")
    if kernel == "auto":
        single_cpu = jax.default_backend() == "cpu" and jax.device_count() == 1
        return "lapack" if single_cpu and lapack_ffi.available() is None else "jax"
    if kernel == "lapack":
        if jax.default_backend() != "cpu":
            raise ValueError(f"kernel='lapack' runs on the CPU; the default backend here is "
                             f"{jax.default_backend()!r}: use kernel='jax' (or 'auto').")
        if (why := lapack_ffi.available()) is not None:
            raise ValueError(f"kernel='lapack' is unavailable here ({why}); use "
                             "kernel='jax' (or 'auto').")
        if jax.device_count() > 1:
            warnings.warn(
                f"kernel='lapack' with {jax.device_count()} devices: XLA cannot partition "
                "the LAPACK custom call, so a computation sharded across devices gathers "
                "the whole batch and factorizes it on every device. Use kernel='jax' (or "
                "'auto') for sharded computations.", stacklevel=3)
    return kernel


def factor_band(values: Float[Array, " nnz"], sparsity: Sparsity, kernel: str):
    """Factorize the matrix with nonzeros `values` on the band pattern `sparsity` with the
    (resolved) kernel; the state for `solve_band`/`band_singular`."""
    if kernel == "lapack":
        return band_lapack.factor(values, sparsity)
    return factor_blocks(to_blocks(values, block_layout(sparsity)))


def factor_band_where(pred, state, values: Float[Array, " nnz"], sparsity: Sparsity,
                      kernel: str):
    """`factor_band(values, ...)` where `pred`, else `state`: with the LAPACK kernel
    under `vmap`, only the members with `pred` are factorized (`band_lapack.factor_where`);
    the pure-JAX kernel factorizes every member and selects."""
    if kernel == "lapack":
        return band_lapack.factor_where(pred, state, values, sparsity)
    new = factor_band(values, sparsity, kernel)
    return jax.tree_util.tree_map(lambda a, b: jnp.where(pred, a, b), new, state)


def solve_band(state, rhs: Float[Array, " n"], sparsity: Sparsity, kernel: str,
               transpose: bool = False):
    """J x = rhs (or Jᵀ x = rhs) with the state of `factor_band`."""
    if kernel == "lapack":
        return band_lapack.solve(state, rhs, sparsity, transpose)
    if transpose:
        return solve_blocks_transposed(state, rhs, sparsity.n)
    return solve_blocks(state, rhs, sparsity.n)


def solve_band_where(pred, state, rhs: Float[Array, " n"], sparsity: Sparsity, kernel: str,
                     transpose: bool = False):
    """`solve_band` where `pred`, elsewhere unspecified: with the LAPACK kernel under
    `vmap`, only the members with `pred` are solved (`band_lapack.solve_where`)."""
    if kernel == "lapack":
        return band_lapack.solve_where(pred, state, rhs, sparsity, transpose)
    return solve_band(state, rhs, sparsity, kernel, transpose)


def band_singular(state, kernel: str) -> Bool[Array, ""]:
    """`DenseLU`'s singularity test on the pivots of `factor_band`."""
    if kernel == "lapack":
        return band_lapack.singular(state)
    return blocks_singular(state)


# ------------------------------------------------------------------ block layout


# The smallest block: a band of width l, u < 16 is factorized in blocks of 16 (a banded
# matrix is block tridiagonal for every block size ≥ max(l, u)), trading a little
# arithmetic on zeros for n/16 instead of n/max(l, u) sequential scan steps (each step's
# fixed cost dominates the arithmetic of a narrow band).
MIN_BLOCK = 16


class BlockLayout(NamedTuple):
    """Where each nonzero (rows[k], cols[k]) of a band lands in the block-tridiagonal
    storage `blocks[(block row), (0: sub, 1: diagonal, 2: super), i, j]`: nb = ⌈n/b⌉
    block rows plus one trailing identity block (the window of the last elimination
    step). Rows n … nb·b − 1 are padding with a unit diagonal. Static (numpy)."""

    n: int
    b: int
    nb: int
    index: tuple          # 4 index arrays: block row, block diagonal, row, column
    base: np.ndarray      # the identity of the padding rows and of the trailing block


@functools.lru_cache(maxsize=64)
def block_layout(sparsity: Sparsity) -> BlockLayout:
    """The layout of `sparsity` (already permuted, if it is to be), blocks of
    b = max(l, u, min(MIN_BLOCK, n))."""
    n = sparsity.n
    b = max(sparsity.lower, sparsity.upper, min(MIN_BLOCK, n), 1)
    nb = -(-n // b)
    r = sparsity.rows.astype(np.int64)
    c = sparsity.cols.astype(np.int64)
    k = r // b
    index = (k, c // b - k + 1, r % b, c % b)
    base = np.zeros((nb + 1, 3, b, b))
    pad = np.arange(n, nb * b)
    base[pad // b, 1, pad % b, pad % b] = 1.0
    base[nb, 1] = np.eye(b)
    return BlockLayout(n=n, b=b, nb=nb, index=index, base=base)


def to_blocks(values: Float[Array, " nnz"], layout: BlockLayout):
    """The block-tridiagonal storage of the matrix with nonzeros `values`."""
    base = jnp.asarray(layout.base, values.dtype)
    return base.at[layout.index].add(values)


# ------------------------------------------------------------------ factorization


def factor_blocks(blocks):
    """Row-equilibrate and factorize (block GEPP, see the module docstring).

    Returns the state (d, perm, lu11, l21, u_rest, pivots): d the row scaling (J_s =
    diag(d) J), per block step the panel's row permutation (2b,), the packed unit-lower
    L11 / upper U11 (b, b), L21 (b, b), [U12 U13] (b, 2b), and U's diagonal."""
    _, _, b, _ = blocks.shape
    rownorm = jnp.max(jnp.abs(blocks), axis=(1, 3))
    d = 1.0 / jnp.where(rownorm > 0, rownorm, 1.0)
    scaled = blocks * d[:, None, :, None]
    zero = jnp.zeros((b, b), blocks.dtype)

    def step(carry, nxt):
        dk, ck = carry
        sub, diag, sup = nxt[0], nxt[1], nxt[2]
        window = jnp.concatenate([jnp.concatenate([dk, ck, zero], axis=1),
                                  jnp.concatenate([sub, diag, sup], axis=1)], axis=0)
        lu, _, perm = jax.lax.linalg.lu(window[:, :b])
        rest = window[perm, b:]
        u_rest = jsl.solve_triangular(lu[:b], rest[:b], lower=True, unit_diagonal=True)
        schur = rest[b:] - lu[b:] @ u_rest
        return (schur[:, :b], schur[:, b:]), (perm, lu[:b], lu[b:], u_rest)

    _, (perm, lu11, l21, u_rest) = jax.lax.scan(step, (scaled[0, 1], scaled[0, 2]),
                                                scaled[1:])
    pivots = jnp.diagonal(lu11, axis1=1, axis2=2).reshape(-1)
    return d, perm, lu11, l21, u_rest, pivots


def solve_blocks(state, rhs: Float[Array, " n"], n: int):
    """J x = rhs with the factors of `factor_blocks` (forward elimination with the
    window permutations and L, then back substitution with U's three block diagonals)."""
    d, perm, lu11, l21, u_rest, _ = state
    nbp, b = d.shape
    r = jnp.zeros(nbp * b, rhs.dtype).at[:n].set(rhs).reshape(nbp, b) * d

    def forward(z, xs):
        p, l11, l2, r_next = xs
        w = jnp.concatenate([z, r_next])[p]
        yk = jsl.solve_triangular(l11, w[:b], lower=True, unit_diagonal=True)
        return w[b:] - l2 @ yk, yk

    _, ys = jax.lax.scan(forward, r[0], (perm, lu11, l21, r[1:]))

    def backward(carry, xs):
        x1, x2 = carry
        u11, ur, yk = xs
        xk = jsl.solve_triangular(u11, yk - ur[:, :b] @ x1 - ur[:, b:] @ x2, lower=False)
        return (xk, x1), xk

    zero = jnp.zeros((b,), rhs.dtype)
    _, xs = jax.lax.scan(backward, (zero, zero), (lu11, u_rest, ys), reverse=True)
    return xs.reshape(-1)[:n]


def solve_blocks_transposed(state, rhs: Float[Array, " n"], n: int):
    """Jᵀ x = rhs: J = D⁻¹ J_s and J_s⁻¹ = U⁻¹ M_{nb−1} ⋯ M_0 (M_k = L_k⁻¹ P_k on the
    window of block rows k, k + 1), so x = D J_s⁻ᵀ rhs = D M_0ᵀ ⋯ M_{nb−1}ᵀ U⁻ᵀ rhs:
    a forward block substitution with Uᵀ, then the windows in reverse order."""
    d, perm, lu11, l21, u_rest, _ = state
    nbp, b = d.shape
    nb = nbp - 1
    r = jnp.zeros(nb * b, rhs.dtype).at[:n].set(rhs).reshape(nb, b)
    zero_v = jnp.zeros((b,), rhs.dtype)
    zero_m = jnp.zeros((b, 2 * b), rhs.dtype)

    def upper_t(carry, xs):        # z_k = U11ᵀ⁻¹ (r_k − U12_{k−1}ᵀ z_{k−1} − U13_{k−2}ᵀ z_{k−2})
        z1, z2, ur1, ur2 = carry
        u11, ur, rk = xs
        rhs_k = rk - ur1[:, :b].T @ z1 - ur2[:, b:].T @ z2
        zk = jsl.solve_triangular(u11, rhs_k, lower=False, trans=1)
        return (zk, z1, ur, ur1), zk

    _, z = jax.lax.scan(upper_t, (zero_v, zero_v, zero_m, zero_m), (lu11, u_rest, r))

    def windows_t(c, xs):          # M_kᵀ = P_kᵀ L_k⁻ᵀ on (block k, block k + 1)
        p, l11, l2, zk = xs
        top = jsl.solve_triangular(l11, zk - l2.T @ c, lower=True, unit_diagonal=True,
                                   trans=1)
        out = jnp.zeros((2 * b,), rhs.dtype).at[p].set(jnp.concatenate([top, c]))
        return out[:b], out[b:]

    x0, rest = jax.lax.scan(windows_t, zero_v, (perm, lu11, l21, z), reverse=True)
    x = jnp.concatenate([x0[None], rest[:-1]]).reshape(-1)   # rest[k] = block k + 1
    return (d[:nb].reshape(-1) * x)[:n]


def blocks_singular(state) -> Bool[Array, ""]:
    """`DenseLU`'s test on the equilibrated pivots: non-finite, or ≤ n·eps·max."""
    pivots = jnp.abs(state[-1])
    eps = jnp.finfo(pivots.dtype).eps
    bad = ~jnp.all(jnp.isfinite(pivots))
    return bad | (jnp.min(pivots) <= pivots.shape[0] * eps * jnp.max(pivots))


# ------------------------------------------------------------------ the solver


class BandedLU(AbstractLinearSolver):
    """Banded LU of J = F_y + cj F_y' with lower bandwidth `lower` and upper `upper`
    (J_ij = 0 unless −lower ≤ j − i ≤ upper).

    J is built by `lower + upper + 1` coloured `jax.jvp`s of the residual (never n×n) and
    factorized by Gaussian elimination with partial pivoting on the band in
    O(n·(l + u)) memory and O(n·(l + u)²) time; the adjoint uses the transposed solve of
    the same factors.

    **Arguments:**

    - `lower`, `upper`: the bandwidths, e.g. both M + 2 for a 2-D grid of (M + 2)²
      nodes numbered row by row (the 5-point stencil reaches ±(M + 2)).
    - `check`: verify at each setup that the band reproduces J v = `jax.jvp` for a fixed
      random v, and raise an error naming the bandwidth if not (a too-small bandwidth).
      One extra `jvp` per setup. Default True.
    - `kernel`: `"lapack"` (LAPACK's gbtrf/gbtrs — the factorization of IDAS's
      SUNLinSol_LapackBand — as XLA custom calls compiled by numba; CPU), `"jax"` (block
      elimination in pure JAX, see `daeadjoint._linalg.banded`; any device) or `"auto"`
      (default: `"lapack"` when the program runs on a single CPU device, `"jax"` on GPUs
      and whenever several devices exist — XLA cannot partition the custom call over a
      sharded batch). Both run under `jit`, `vmap` and every derivative, and give the same
      factorization up to rounding.
    """

    lower: int = eqx.field(static=True)
    upper: int = eqx.field(static=True)
    check: bool = eqx.field(static=True, default=True)
    kernel: Kernel = eqx.field(static=True, default="auto")

    def __check_init__(self):
        if not (isinstance(self.lower, (int, np.integer)) and isinstance(self.upper, (int, np.integer))
                and self.lower >= 0 and self.upper >= 0):
            raise ValueError("BandedLU(lower, upper) needs non-negative integer bandwidths, "
                             f"got lower={self.lower!r}, upper={self.upper!r}.")
        if self.kernel not in KERNELS:
            raise ValueError(f"BandedLU(kernel=...) must be one of {KERNELS}, got "
                             f"{self.kernel!r}.")

    def setup(self, residual, t, y, yp, cj, args):
        sparsity = self._sparsity(y.shape[0])
        return factor_band(self._values(residual, t, y, yp, cj, args), sparsity,
                           resolve_kernel(self.kernel))

    def setup_where(self, pred, state, residual, t, y, yp, cj, args):
        sparsity = self._sparsity(y.shape[0])
        return factor_band_where(pred, state, self._values(residual, t, y, yp, cj, args),
                                 sparsity, resolve_kernel(self.kernel))

    def _values(self, residual, t, y, yp, cj, args):
        """J's nonzeros on the band, by l + u + 1 coloured jvps (checked if `check`)."""
        sparsity = self._sparsity(y.shape[0])
        colours, n_colours = banded_colours(sparsity.n, sparsity.lower, sparsity.upper)
        values = assemble(compressed_jacobian(residual, t, y, yp, cj, args,
                                              seeds(colours, n_colours)),
                          sparsity, colours)
        if self.check:
            mismatch = pattern_mismatch(residual, t, y, yp, cj, args, values, sparsity)
            values = check_pattern(
                values, mismatch,
                f"BandedLU(lower={self.lower}, upper={self.upper}): the iteration matrix "
                "has nonzeros outside this band (J v from the band differs from jax.jvp). "
                "Increase the bandwidths (the largest |i - j| with dF_i/dy_j or "
                "dF_i/dy'_j nonzero), or use SparseLU() to detect the pattern.")
        return values

    def solve(self, state, rhs, *, transpose=False, weights=None, operator=None):
        return solve_band(state, rhs, self._sparsity(rhs.shape[-1]),
                          resolve_kernel(self.kernel), transpose), {}

    def solve_where(self, pred, state, rhs, *, transpose=False, weights=None, operator=None):
        return solve_band_where(pred, state, rhs, self._sparsity(rhs.shape[-1]),
                                resolve_kernel(self.kernel), transpose), {}

    def is_singular(self, state) -> Bool[Array, ""]:
        return band_singular(state, resolve_kernel(self.kernel))

    def _sparsity(self, n: int) -> Sparsity:
        return _band(n, min(int(self.lower), n - 1), min(int(self.upper), n - 1))


@functools.lru_cache(maxsize=64)
def _band(n: int, lower: int, upper: int) -> Sparsity:
    return Sparsity.banded(n, lower, upper)
