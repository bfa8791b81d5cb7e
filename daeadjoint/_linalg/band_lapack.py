"""The CPU kernel of the banded LU: LAPACK's gbtrf/gbtrs inside the XLA program.

`banded.py`'s block elimination is pure JAX and runs anywhere, but on a CPU it executes
n/b dependent steps of small kernels inside XLA's loop machinery; LAPACK's band
factorization (the one IDAS's SUNLinSol_LapackBand calls, and the reference
implementation of GEPP on a band) does the same O(n·l·(l + u)) arithmetic in one call.
Both LAPACK routines run as XLA FFI custom calls (`lapack_ffi.py`): in place, on the
program's buffers, without Python — several times faster on a CPU than the block scan,
and than the same LAPACK calls through `jax.pure_callback` (which enters the interpreter
and copies the factors on every solve).

The matrix lives in LAPACK's band storage, transposed so that a C-ordered JAX array of
shape (n, 2l + u + 1) is the Fortran-ordered (2l + u + 1, n) array LAPACK reads:

    band[j, l + u + i − j] = J[i, j]      (−l ≤ j − i ≤ u; the first l entries of each
                                           row are gbtrf's workspace for pivoting fill)

Rows are equilibrated by their ∞-norms first (as `banded.py`), and the singularity test is
`DenseLU`'s on U's diagonal (gbtrf's pivots): non-finite, or ≤ n·eps·max |pivot|.

- `factor(values, sparsity)` → `BandFactors` (gbtrf, in place; not differentiated: the factors
  are data for the solve, whose derivative rules use the matrix itself).
- `factor_where(pred, state, values, sparsity)`: `factor` where `pred`, else `state`; a
  batch's members with `pred` are factorized in one custom call, the others' factors
  stay in place (the Newton iteration's refresh under `vmap`).
- `solve_where(pred, state, rhs, sparsity)`: `solve` where `pred` (elsewhere unspecified):
  under `vmap`, one custom call solves only the members with `pred`.
- `band_solve_p(values, lu, ipiv, rhs)`: J x = rhs (or Jᵀ x = rhs) by gbtrs. A primitive,
  like `klu.klu_solve_p`, so that it is a differentiable linear solve: JVP
  d(J⁻¹ b) = J⁻¹ (db − dJ x) with dJ from the tangent of `values` (J's nonzeros),
  transpose = the solve with Jᵀ (`DiscreteAdjoint` differentiates through it), and a
  batching rule that hands a batch of matrices, or many right-hand sides of one matrix,
  to one custom call.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from .._jax_internals import Primitive, ad, batching, mlir, shaped_array
from . import lapack_ffi
from .jacobian import Sparsity


class BandLayout(NamedTuple):
    """Where each nonzero (rows[k], cols[k]) of a pattern lands in the transposed band
    storage (module docstring). Static (numpy)."""

    n: int
    lower: int
    upper: int
    rows: np.ndarray      # the row of each nonzero
    index: tuple          # (column, l + u + row − column) per nonzero

    @property
    def width(self) -> int:
        return 2 * self.lower + self.upper + 1

    @property
    def flat(self) -> np.ndarray:
        """The position of each nonzero in the C-ordered (n, w) storage (int32)."""
        return (self.index[0] * self.width + self.index[1]).astype(np.int32)


@functools.lru_cache(maxsize=64)
def band_layout(sparsity: Sparsity) -> BandLayout:
    """The layout of `sparsity` (already permuted, if it is to be)."""
    l, u = sparsity.lower, sparsity.upper
    r = sparsity.rows.astype(np.int64)
    c = sparsity.cols.astype(np.int64)
    return BandLayout(n=sparsity.n, lower=l, upper=u, rows=r, index=(c, l + u + r - c))


class BandFactors(NamedTuple):
    """The state of one factorization: the row scaling d (J_s = diag(d) J), J_s's
    nonzeros on the layout (the derivative rules of the solve need the matrix: nnz
    numbers, not the n·w of the band storage — the state is carried, and under `vmap`
    selected and copied, through the step and Newton loops), its LU factors, gbtrf's
    pivot rows (1-based, as LAPACK's), and U's diagonal (the singularity test)."""

    d: Float[Array, " n"]
    values: Float[Array, " nnz"]
    lu: Float[Array, "n w"]
    ipiv: Int[Array, " n"]
    pivots: Float[Array, " n"]


def _equilibrate(values, layout: BandLayout):
    """(d, J_s's nonzeros): d = 1/‖row‖∞ (1 for a zero row), J_s = diag(d) J."""
    rownorm = jnp.zeros(layout.n, values.dtype).at[layout.rows].max(jnp.abs(values))
    d = 1.0 / jnp.where(rownorm > 0, rownorm, 1.0)
    return d, values * d[layout.rows]


def factor(values: Float[Array, " nnz"], sparsity: Sparsity) -> BandFactors:
    """Row-equilibrate and factorize the matrix with nonzeros `values` on `sparsity`."""
    layout = band_layout(sparsity)
    n, l, u = layout.n, layout.lower, layout.upper
    d, scaled = _equilibrate(values, layout)
    factor_target, _, _, _ = lapack_ffi.targets(values.dtype)
    # The custom call assembles each member's band from the nonzeros itself (no zero fill
    # and scatter of a batch of n·w arrays in XLA) and factorizes it in place.
    lu, ipiv = jax.ffi.ffi_call(
        factor_target,
        (jax.ShapeDtypeStruct((n, layout.width), values.dtype),
         jax.ShapeDtypeStruct((n,), jnp.int32)),
        vmap_method="expand_dims",
    )(_params(l, u, False), jax.lax.stop_gradient(scaled), jnp.asarray(layout.flat))
    return BandFactors(d, scaled, lu, ipiv, lu[..., :, l + u])


def factor_where(pred: Bool[Array, ""], state: BandFactors, values: Float[Array, " nnz"],
                 sparsity: Sparsity) -> BandFactors:
    """`factor(values, sparsity)` where `pred`, else `state`. Under `vmap` with a batched
    `pred`, one custom call factorizes only the members with `pred` and leaves the
    others' factors where they are (aliased: no copy); unbatched it is `factor` when
    `pred` (else `state`). The per-member results equal `factor`'s bit for bit."""
    layout = band_layout(sparsity)
    l, u = layout.lower, layout.upper
    d, scaled = _equilibrate(values, layout)
    _, _, where_target, _ = lapack_ffi.targets(values.dtype)
    lu, ipiv = jax.ffi.ffi_call(
        where_target,
        (jax.ShapeDtypeStruct(state.lu.shape, state.lu.dtype),
         jax.ShapeDtypeStruct(state.ipiv.shape, jnp.int32)),
        vmap_method="broadcast_all", input_output_aliases={4: 0, 5: 1},
    )(_params(l, u, False), jax.lax.stop_gradient(scaled), jnp.asarray(layout.flat),
      jnp.asarray(pred).astype(jnp.int32), jax.lax.stop_gradient(state.lu), state.ipiv)
    return BandFactors(jnp.where(pred, d, state.d), jnp.where(pred, scaled, state.values),
                       lu, ipiv, lu[..., :, l + u])


def solve(state: BandFactors, rhs: Float[Array, " n"], sparsity: Sparsity,
          transpose: bool = False) -> Float[Array, " n"]:
    """J x = rhs, or Jᵀ x = rhs: J = D⁻¹ J_s, so x = J_s⁻¹ (D rhs), or x = D J_s⁻ᵀ rhs."""
    # The pattern (hashable) is the primitive's static parameter; its layout's index
    # arrays are derived from it where needed.
    kw = dict(sparsity=sparsity, transpose=bool(transpose))
    b = jnp.asarray(rhs).astype(state.lu.dtype)   # LAPACK solves in the factors' precision
    if transpose:
        x = state.d * band_solve_p.bind(state.values, state.lu, state.ipiv, b, **kw)
    else:
        x = band_solve_p.bind(state.values, state.lu, state.ipiv, state.d * b, **kw)
    return x.astype(jnp.result_type(rhs))


def solve_where(pred: Bool[Array, ""], state: BandFactors, rhs: Float[Array, " n"],
                sparsity: Sparsity, transpose: bool = False) -> Float[Array, " n"]:
    """`solve(state, rhs, ...)` where `pred`; elsewhere the result is unspecified (the
    caller drops it). Under `vmap` with a batched `pred` one custom call solves only
    the members with `pred` (the Newton iteration's members still iterating); the
    results there equal `solve`'s bit for bit. Its derivatives are `solve`'s."""
    kw = dict(sparsity=sparsity, transpose=bool(transpose))
    b = jnp.asarray(rhs).astype(state.lu.dtype)
    pred = jnp.asarray(pred, bool)
    if transpose:
        x = state.d * band_solve_where_p.bind(state.values, state.lu, state.ipiv, b, pred, **kw)
    else:
        x = band_solve_where_p.bind(state.values, state.lu, state.ipiv, state.d * b, pred, **kw)
    return x.astype(jnp.result_type(rhs))


def singular(state: BandFactors) -> Bool[Array, ""]:
    """`DenseLU`'s test on the equilibrated pivots: non-finite, or ≤ n·eps·max."""
    pivots = jnp.abs(state.pivots)
    eps = jnp.finfo(pivots.dtype).eps
    bad = ~jnp.all(jnp.isfinite(pivots))
    return bad | (jnp.min(pivots) <= pivots.shape[-1] * eps * jnp.max(pivots))


def _params(lower: int, upper: int, transpose: bool) -> Int[Array, " 3"]:
    """The custom calls' static integers, as an operand (`lapack_ffi.py`)."""
    return jnp.array([lower, upper, int(transpose)], jnp.int32)


# ------------------------------------------------------------------ the solve primitive


band_solve_p = Primitive("daeadjoint_band_solve")


def _solve_body(values, lu, ipiv, rhs, *, sparsity, transpose):
    """gbtrs in XLA; `values` (the matrix) are carried only for the derivative rules.
    `lu` is one matrix (every right-hand side solved with it) or a batch aligned with
    `rhs` (`_batch`)."""
    del values
    _, solve_target, _, _ = lapack_ffi.targets(lu.dtype)
    return jax.ffi.ffi_call(solve_target, jax.ShapeDtypeStruct(rhs.shape, rhs.dtype))(
        _params(sparsity.lower, sparsity.upper, transpose), lu, ipiv, rhs)


def _abstract_eval(values, lu, ipiv, rhs, *, sparsity, transpose):
    del transpose, ipiv
    layout = band_layout(sparsity)
    if rhs.dtype != lu.dtype:   # the custom call reads both as one LAPACK precision
        raise TypeError(f"band_solve: right-hand sides of dtype {rhs.dtype} for factors of "
                        f"dtype {lu.dtype}.")
    if (values.shape[:-1] != lu.shape[:-2] or values.shape[-1] != layout.rows.size
            or lu.shape[-2:] != (layout.n, layout.width)
            or (lu.ndim > 2 and lu.shape[:-2] != rhs.shape[:-1])):
        raise ValueError(f"band_solve: matrices {values.shape}, factors {lu.shape} do not "
                         f"match the layout (n = {layout.n}, nnz = {layout.rows.size}) or "
                         f"the right-hand sides {rhs.shape}.")
    return shaped_array(rhs.shape, rhs.dtype)


def sparse_matvec(values, x, layout: BandLayout, transpose: bool = False):
    """J x (or Jᵀ x) from the nonzeros on `layout`, batched over leading axes (aligned as
    for the solve)."""
    rows, cols = layout.rows, layout.index[0]
    src, dst = (rows, cols) if transpose else (cols, rows)
    out = jnp.zeros(jnp.broadcast_shapes(values.shape[:-1], x.shape[:-1]) + x.shape[-1:],
                    x.dtype)
    return out.at[..., dst].add(values * x[..., src])


def _jvp(primals, tangents, *, sparsity, transpose):
    """d(J⁻¹ b) = J⁻¹ (db − dJ x); the factors are data (their tangents are zero: they
    are computed from a `stop_gradient`ed matrix)."""
    values, lu, ipiv, rhs = primals
    dvalues, _, _, drhs = tangents
    kw = dict(sparsity=sparsity, transpose=transpose)
    x = band_solve_p.bind(values, lu, ipiv, rhs, **kw)
    t = jnp.zeros_like(x) if type(drhs) is ad.Zero else drhs
    if type(dvalues) is not ad.Zero:
        t = t - sparse_matvec(dvalues, x, band_layout(sparsity), transpose)
    return x, band_solve_p.bind(values, lu, ipiv, jnp.broadcast_to(t, x.shape), **kw)


def _transpose(ct, values, lu, ipiv, rhs, *, sparsity, transpose):
    """Linear in the right-hand side only (the JVP never makes the matrix linear)."""
    if any(ad.is_undefined_primal(a) for a in (values, lu, ipiv)):
        raise ValueError("band_solve is linear in the right-hand side only.")
    ct = jnp.zeros(rhs.aval.shape, rhs.aval.dtype) if type(ct) is ad.Zero else ct
    return None, None, None, band_solve_p.bind(values, lu, ipiv, ct, sparsity=sparsity,
                                               transpose=not transpose)


def _batch(args, dims, *, sparsity, transpose):
    """Batch axes to the front; one matrix with more right-hand sides, or as many
    matrices as right-hand sides (matrices' batch axes are none or the rhs's)."""
    values, lu, ipiv, rhs = args
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    kw = dict(sparsity=sparsity, transpose=transpose)
    rhs = (jnp.moveaxis(rhs, dims[3], 0) if dims[3] is not None
           else jnp.broadcast_to(rhs, (size, *rhs.shape)))
    matrices = (values, lu, ipiv)
    if all(d is None for d in dims[:3]) and lu.ndim == 2:   # more right-hand sides
        return band_solve_p.bind(*matrices, rhs, **kw), 0
    moved = []
    for a, d, core in zip(matrices, dims[:3], (1, 2, 1)):   # (nnz,), (n, w), (n,)
        a = jnp.moveaxis(a, d, 0) if d is not None else jnp.broadcast_to(a, (size, *a.shape))
        lead, tail = a.shape[:-core], a.shape[-core:]
        # one matrix per batch member with more right-hand sides each: repeat it
        a = a.reshape(*lead, *(1,) * (rhs.ndim - 1 - len(lead)), *tail)
        moved.append(jnp.broadcast_to(a, (*rhs.shape[:-1], *tail)))
    return band_solve_p.bind(*moved, rhs, **kw), 0


band_solve_p.def_impl(_solve_body)
band_solve_p.def_abstract_eval(_abstract_eval)
batching.primitive_batchers[band_solve_p] = _batch
ad.primitive_jvps[band_solve_p] = _jvp
ad.primitive_transposes[band_solve_p] = _transpose
mlir.register_lowering(band_solve_p, mlir.lower_fun(_solve_body, multiple_results=False))


# ------------------------------------------------------- the solve of some members only


band_solve_where_p = Primitive("daeadjoint_band_solve_where")


def _solve_where_body(values, lu, ipiv, rhs, pred, *, sparsity, transpose):
    """gbtrs with the matrices where `pred` (one per matrix of `lu`), x = rhs elsewhere."""
    del values
    _, _, _, target = lapack_ffi.targets(lu.dtype)
    return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(rhs.shape, rhs.dtype))(
        _params(sparsity.lower, sparsity.upper, transpose), lu, ipiv, rhs,
        jnp.broadcast_to(pred, lu.shape[:-2]).astype(jnp.int32))


def _where_abstract_eval(values, lu, ipiv, rhs, pred, *, sparsity, transpose):
    if pred.shape not in ((), lu.shape[:-2]):
        raise ValueError(f"band_solve_where: predicate {pred.shape} for factors {lu.shape}.")
    return _abstract_eval(values, lu, ipiv, rhs, sparsity=sparsity, transpose=transpose)


def _where_jvp(primals, tangents, *, sparsity, transpose):
    """The primal where `pred`; the tangent is `band_solve_p`'s (for every member: where
    not `pred` the primal is unspecified, and so may the tangent be), so that the
    transpose only meets `band_solve_p`."""
    values, lu, ipiv, rhs, pred = primals
    dvalues, _, _, drhs, _ = tangents
    kw = dict(sparsity=sparsity, transpose=transpose)
    x = band_solve_where_p.bind(values, lu, ipiv, rhs, pred, **kw)
    t = jnp.zeros_like(x) if type(drhs) is ad.Zero else drhs
    if type(dvalues) is not ad.Zero:
        t = t - sparse_matvec(dvalues, x, band_layout(sparsity), transpose)
    return x, band_solve_p.bind(values, lu, ipiv, jnp.broadcast_to(t, x.shape), **kw)


def _where_batch(args, dims, *, sparsity, transpose):
    """As `_batch`, the predicate going with the matrices (one per matrix)."""
    values, lu, ipiv, rhs, pred = args
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    kw = dict(sparsity=sparsity, transpose=transpose)
    rhs = (jnp.moveaxis(rhs, dims[3], 0) if dims[3] is not None
           else jnp.broadcast_to(rhs, (size, *rhs.shape)))
    if all(d is None for d in (*dims[:3], dims[4])) and lu.ndim == 2:   # more right-hand sides
        return band_solve_where_p.bind(values, lu, ipiv, rhs, pred, **kw), 0
    moved = []
    for a, d, core in zip((values, lu, ipiv, pred), (*dims[:3], dims[4]), (1, 2, 1, 0)):
        a = jnp.moveaxis(a, d, 0) if d is not None else jnp.broadcast_to(a, (size, *a.shape))
        lead, tail = a.shape[:len(a.shape) - core], a.shape[len(a.shape) - core:]
        a = a.reshape(*lead, *(1,) * (rhs.ndim - 1 - len(lead)), *tail)
        moved.append(jnp.broadcast_to(a, (*rhs.shape[:-1], *tail)))
    values, lu, ipiv, pred = moved
    return band_solve_where_p.bind(values, lu, ipiv, rhs, pred, **kw), 0


band_solve_where_p.def_impl(_solve_where_body)
band_solve_where_p.def_abstract_eval(_where_abstract_eval)
batching.primitive_batchers[band_solve_where_p] = _where_batch
ad.primitive_jvps[band_solve_where_p] = _where_jvp
mlir.register_lowering(band_solve_where_p,
                       mlir.lower_fun(_solve_where_body, multiple_results=False))
