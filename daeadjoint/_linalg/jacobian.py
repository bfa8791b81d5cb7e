"""The sparsity of the iteration matrix J = F_y + cj F_y', and J assembled from it.

A large DAE (a semi-discretized PDE, a network) couples each equation to a few unknowns,
so J has few nonzeros per row. Three pieces, each usable on its own:

- `Sparsity`: the pattern as static index arrays (rows, cols), hashable, so a solver
  configuration holding one is static under `jax.jit`.
- `detect_sparsity`: the pattern of F_y ∪ F_y' found from the residual's jaxpr (asdex's
  global sparsity detection: it propagates index sets through the program, so the
  pattern is valid for *every* input, never sampled at one point). J = F_y + cj F_y' has
  this pattern for every cj, and so do the matrices built from the residual by
  `masked_residual` (they mix the same columns), so one detection serves every linear
  system of a solve.
- `colour_columns` / `compressed_jacobian` / `assemble`: Curtis–Powell–Reid compression.
  Columns that share no row get one colour; the sum of a colour's unit vectors is one
  tangent of a `jax.jvp`, and each nonzero J_ij is read back from the tangent of its
  column's colour at row i. A banded matrix needs l + u + 1 colours (j mod (l + u + 1)),
  a 5-point Laplacian ~5-7, instead of n for a dense `jax.jacfwd`.

`pattern_mismatch` checks one product J·v against `jax.jvp` for a fixed random v: a
pattern that misses a nonzero (a user's wrong sparsity or too-small bandwidth) makes the
compressed entries wrong, and this test exposes it instead of a silently wrong Newton
matrix.
"""

import hashlib
import weakref
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float


class SparsityDetectionError(ValueError):
    """The sparsity pattern of the residual could not be detected from its program."""


class Sparsity:
    """A static n×n sparsity pattern: the nonzeros (rows[k], cols[k]), sorted row-major,
    without duplicates, always including the diagonal (a pivot candidate in every row).

    Build one with `Sparsity(rows, cols, n)`, `Sparsity.from_dense(mask)`,
    `Sparsity.banded(n, lower, upper)`, or let `detect_sparsity` find it. It is hashable
    (by content), so solver configurations that hold one are static under `jax.jit`.
    """

    __slots__ = ("rows", "cols", "n", "_hash", "__weakref__")

    def __init__(self, rows, cols, n: int):
        n = int(n)
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        cols = np.asarray(cols, dtype=np.int64).reshape(-1)
        if rows.shape != cols.shape:
            raise ValueError("Sparsity: `rows` and `cols` must have the same length.")
        if rows.size and (rows.min() < 0 or cols.min() < 0 or rows.max() >= n
                          or cols.max() >= n):
            raise ValueError(f"Sparsity: indices must lie in [0, {n}).")
        diag = np.arange(n)
        keys = np.unique(np.concatenate([rows * n + cols, diag * n + diag]))
        self.rows = (keys // n).astype(np.int32)
        self.cols = (keys % n).astype(np.int32)
        self.rows.setflags(write=False)
        self.cols.setflags(write=False)
        self.n = n
        self._hash = hash((n, hashlib.sha1(keys.tobytes()).hexdigest()))

    @classmethod
    def from_dense(cls, mask) -> "Sparsity":
        """The nonzeros of an (n, n) boolean (or numeric) array."""
        mask = np.asarray(mask)
        if mask.ndim != 2 or mask.shape[0] != mask.shape[1]:
            raise ValueError(f"Sparsity.from_dense needs a square matrix, got {mask.shape}.")
        rows, cols = np.nonzero(mask)
        return cls(rows, cols, mask.shape[0])

    @classmethod
    def banded(cls, n: int, lower: int, upper: int) -> "Sparsity":
        """All (i, j) with −lower ≤ j − i ≤ upper."""
        offsets = np.arange(-int(lower), int(upper) + 1)
        rows = np.repeat(np.arange(n), offsets.size)
        cols = rows + np.tile(offsets, n)
        keep = (cols >= 0) & (cols < n)
        return cls(rows[keep], cols[keep], n)

    @property
    def nnz(self) -> int:
        return int(self.rows.size)

    @property
    def lower(self) -> int:
        """Lower bandwidth: max(i − j) over the nonzeros."""
        return int(max(0, np.max(self.rows.astype(np.int64) - self.cols)))

    @property
    def upper(self) -> int:
        """Upper bandwidth: max(j − i) over the nonzeros."""
        return int(max(0, np.max(self.cols.astype(np.int64) - self.rows)))

    @property
    def density(self) -> float:
        return self.nnz / float(self.n * self.n)

    def permuted(self, perm) -> "Sparsity":
        """The pattern of P J Pᵀ with (P x)_i = x[perm[i]]."""
        inverse = np.empty(self.n, np.int64)
        inverse[np.asarray(perm)] = np.arange(self.n)
        return Sparsity(inverse[self.rows], inverse[self.cols], self.n)

    def contains(self, other: "Sparsity") -> bool:
        """Whether every nonzero of `other` is a nonzero of this pattern."""
        mine = self.rows.astype(np.int64) * self.n + self.cols
        theirs = other.rows.astype(np.int64) * other.n + other.cols
        return other.n == self.n and bool(np.all(np.isin(theirs, mine)))

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        return (isinstance(other, Sparsity) and other.n == self.n and other._hash == self._hash
                and np.array_equal(other.rows, self.rows)
                and np.array_equal(other.cols, self.cols))

    def __repr__(self):
        return (f"Sparsity(n={self.n}, nnz={self.nnz}, lower={self.lower}, "
                f"upper={self.upper})")


# ------------------------------------------------------------------ detection

# Detection costs a trace of the residual plus index-set propagation (growing with n and
# the program's size); `solve` detects once per residual, shapes and static arguments.
_CACHE: "weakref.WeakKeyDictionary[Callable, dict]" = weakref.WeakKeyDictionary()


def detect_sparsity(residual: Callable, t, y, yp, args) -> Sparsity:
    """The pattern of F_y ∪ F_y' (plus the diagonal) of `residual(t, y, yp, args)`; see
    `_detect`, which finds it."""
    return _detect(residual, t, y, yp, args)[0]


def structurally_algebraic(residual: Callable, t, y, yp, args) -> np.ndarray:
    """The components y_j whose column of F_y' is zero in the residual's program for
    every input (F never reads y'_j): the algebraic components of a semi-explicit DAE,
    found without a user mask. A column the detector cannot prove zero counts as
    differential (the detection over-approximates nonzeros), so the mask never marks a
    component algebraic that is not. Raises `SparsityDetectionError` as
    `detect_sparsity` does."""
    return _detect(residual, t, y, yp, args)[1]


def _detect(residual: Callable, t, y, yp, args) -> tuple[Sparsity, np.ndarray]:
    """The pattern of F_y ∪ F_y' (plus the diagonal) of `residual(t, y, yp, args)`, and
    the mask of the columns of F_y' that are structurally zero (one analysis, cached).

    Only shapes, dtypes and the program's structure are used: `y`, `yp`, `args` may be
    tracers (under `jit`, `vmap`, `grad`), and values the residual closes over may be
    tracers too (they are hoisted into inputs that are not differentiated). Control flow
    (`lax.cond`, `while_loop`) is handled conservatively — the union over branches.

    Raises `SparsityDetectionError` when the program cannot be analysed (a primitive the
    detector does not know, e.g. a host callback, or indexing whose indices it cannot
    follow); pass the pattern yourself then (`SparseLU(sparsity=...)`,
    `BandedLU(lower, upper)`).
    """
    y = jnp.asarray(y)
    n = y.shape[0]
    dynamic, static = eqx.partition(args, eqx.is_array)
    leaves = jax.tree_util.tree_leaves(dynamic)
    static_key = _static_key(static)
    key = (n, str(y.dtype), jax.tree_util.tree_structure(dynamic),
           tuple((x.shape, str(x.dtype)) for x in leaves), static_key)
    try:
        # Keyed by the function object itself (held weakly): never by its `id`, which a
        # later function may reuse once this one is garbage-collected.
        per_fn = {} if static_key is None else _CACHE.setdefault(residual, {})
    except TypeError:           # not hashable or not weak-referenceable: no caching
        per_fn = {}
    if key in per_fn:
        return per_fn[key]

    def fn(y_, yp_, t_, dyn):
        return residual(t_, y_, yp_, eqx.combine(dyn, static))

    sample = jnp.zeros((n,), y.dtype)
    t_sample = jnp.zeros((), jnp.result_type(float))
    dyn_sample = jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, x.dtype), dynamic)
    try:
        import asdex

        # Values the residual closes over may be tracers of an enclosing transformation
        # (a parameter captured under jit/grad, the point (y, y') of `masked_residual`);
        # the detector needs concrete constants, so they become extra, undifferentiated
        # inputs — a conservative treatment (no index is read from them).
        converted, consts = jax.closure_convert(fn, sample, sample, t_sample, dyn_sample)
        extra = (t_sample, dyn_sample,
                 [jnp.zeros(jnp.shape(c), jnp.result_type(c)) for c in consts])
        pattern = asdex.jacobian_sparsity(
            lambda y_, yp_, e: converted(y_, yp_, e[0], e[1], *e[2]),
            sample, sample, extra, argnums=(0, 1))
    except Exception as err:   # any failure of the analysis is reported
        raise SparsityDetectionError(
            "daeadjoint could not detect the sparsity pattern of the residual from its "
            f"program ({type(err).__name__}: {err}). Pass it yourself: "
            "SparseLU(sparsity=daeadjoint.Sparsity(rows, cols, n)) or "
            "BandedLU(lower, upper), or use DenseLU().") from err
    rows = np.asarray(pattern.rows)
    cols = np.asarray(pattern.cols)
    # asdex numbers the columns of [F_y, F_y']: y'_j is column n + j.
    yp_free = np.ones((n,), bool)
    yp_free[cols[cols >= n] - n] = False
    sparsity = Sparsity(rows, cols % n, n)     # columns of F_y and of F_y' coincide
    per_fn[key] = (sparsity, yp_free)
    return sparsity, yp_free


def _static_key(static):
    """The non-array part of `args` as a cache key equal to another only when the two are
    equal: its tree structure and leaves (held by the key, so a later object can never be
    mistaken for them), or None — do not cache — when they are not hashable."""
    leaves, treedef = jax.tree_util.tree_flatten(static)
    key = (treedef, tuple(leaves))
    try:
        hash(key)
    except TypeError:
        return None
    return key


# ------------------------------------------------------------------ colouring


def colour_columns(sparsity: Sparsity) -> tuple[np.ndarray, int]:
    """Greedy distance-2 colouring of the columns (largest-degree first): two columns
    that have a nonzero in the same row never share a colour, so one `jvp` with the sum
    of a colour's unit vectors reads each of their entries off unmixed (Curtis, Powell
    & Reid). Returns (colour of each column, number of colours)."""
    n = sparsity.n
    rows, cols = sparsity.rows, sparsity.cols
    by_col = np.argsort(cols, kind="stable")
    col_ptr = np.searchsorted(cols[by_col], np.arange(n + 1))
    col_rows = rows[by_col]
    row_ptr = np.searchsorted(rows, np.arange(n + 1))      # rows are sorted already
    degree = np.diff(col_ptr)
    colour = np.full(n, -1, np.int64)
    forbidden = np.full(n + 1, -1, np.int64)
    for j in np.argsort(-degree, kind="stable"):
        for i in col_rows[col_ptr[j]:col_ptr[j + 1]]:
            neighbours = colour[cols[row_ptr[i]:row_ptr[i + 1]]]
            forbidden[neighbours[neighbours >= 0]] = j
        c = 0
        while forbidden[c] == j:
            c += 1
        colour[j] = c
    return colour.astype(np.int32), int(colour.max()) + 1


def banded_colours(n: int, lower: int, upper: int) -> tuple[np.ndarray, int]:
    """Columns j ≡ c (mod l + u + 1) share colour c: a row's l + u + 1 band entries fall
    into distinct residues, so this is a valid (and optimal) colouring of a band."""
    width = int(lower) + int(upper) + 1
    return (np.arange(n) % width).astype(np.int32), min(width, n)


def seeds(colours: np.ndarray, n_colours: int) -> np.ndarray:
    """The (n_colours, n) 0/1 tangents: row c is the sum of the unit vectors of colour c."""
    out = np.zeros((n_colours, colours.size))
    out[colours, np.arange(colours.size)] = 1.0
    return out


def compressed_jacobian(residual, t, y, yp, cj, args, seed) -> Float[Array, "c n"]:
    """J·s for each seed row s (one vmapped `jax.jvp` of v ↦ F(t, y + v, y' + cj v)):
    the tangent (s, cj s) gives F_y s + cj F_y' s = J s."""
    seed = jnp.asarray(seed, y.dtype)

    def shifted(v):
        return residual(t, y + v, yp + cj * v, args)

    zero = jnp.zeros_like(y)
    return jax.vmap(lambda s: jax.jvp(shifted, (zero,), (s,))[1])(seed)


def assemble(compressed, sparsity: Sparsity, colours: np.ndarray) -> Float[Array, " nnz"]:
    """The nonzeros J[rows[k], cols[k]] = (J s_c)[rows[k]] with c the colour of cols[k]."""
    return compressed[colours[sparsity.cols], sparsity.rows]


def sparse_matvec(values, sparsity: Sparsity, v) -> Float[Array, " n"]:
    """J v from the nonzeros (COO)."""
    return jax.ops.segment_sum(values * v[sparsity.cols], sparsity.rows,
                               num_segments=sparsity.n, indices_are_sorted=True)


def probe_vector(n: int, dtype) -> np.ndarray:
    """A fixed random vector with entries of magnitude in [1/2, 1] and random signs:
    no component vanishes, so every column of J contributes to J v."""
    rng = np.random.default_rng(20240601)
    return (rng.uniform(0.5, 1.0, n) * rng.choice([-1.0, 1.0], n)).astype(dtype)


def pattern_mismatch(residual, t, y, yp, cj, args, values, sparsity: Sparsity
                     ) -> Float[Array, ""]:
    """max_i |(J v)_i − (J_assembled v)_i| / scale_i with scale_i = (|J_assembled| |v|)_i
    + |(J v)_i| (+ tiny): ≈ 1e-16 for a correct pattern (rounding only), O(1) when the
    pattern misses a nonzero of J (its value is then both absent from and folded into
    another entry of the assembled matrix)."""
    v = jnp.asarray(probe_vector(sparsity.n, np.dtype(y.dtype)))

    def shifted(w):
        return residual(t, y + w, yp + cj * w, args)

    exact = jax.jvp(shifted, (jnp.zeros_like(y),), (v,))[1]
    approx = sparse_matvec(values, sparsity, v)
    scale = sparse_matvec(jnp.abs(values), sparsity, jnp.abs(v)) + jnp.abs(exact)
    tiny = jnp.finfo(y.dtype).tiny
    return jnp.max(jnp.abs(exact - approx) / (scale + tiny))


def mismatch_tolerance(dtype) -> float:
    """√eps: a correct pattern gives rounding-level mismatches (a few eps); an error
    below √eps relative to the row would not slow modified Newton (which tolerates a
    stale Jacobian) — above it the pattern is wrong."""
    return float(np.sqrt(np.finfo(dtype).eps))


def check_pattern(values, mismatch, message: str):
    """`values` unchanged, raising `message` (via `equinox.error_if`, works under jit
    and vmap) when the assembled matrix does not reproduce J v."""
    return eqx.error_if(values, mismatch > mismatch_tolerance(values.dtype), message)


__all__ = ["Sparsity", "SparsityDetectionError", "detect_sparsity", "structurally_algebraic", "colour_columns",
           "banded_colours", "seeds", "compressed_jacobian", "assemble", "sparse_matvec",
           "pattern_mismatch", "check_pattern"]
