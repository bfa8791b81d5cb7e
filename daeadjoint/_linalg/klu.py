"""The KLU backend of `SparseLU` (klujax): a solve primitive whose pattern is static, and
the singularity test KLU itself does not offer.

Why a primitive of our own. klujax's primitives take the pattern (row and column index
arrays) and the symbolic handle as array *operands*. Under `jax.vmap` of a whole
`solve`, a `lax.cond` whose predicate is batched turns into a `select` of both branches
and batches every operand of the branches — the pattern's constants included — and
klujax's batching rules refuse a batched pattern ("Ai cannot be vectorized"). Our
`klu_solve_p` takes only the values and the right-hand side as operands; the pattern and
the symbolic analysis are primitive parameters (static), turned into constants only when
the primitive is lowered, after every transformation, so nothing can batch them. Its
batching rule maps a batch of matrices onto klujax's own batch of matrices (n_lhs) and a
batch of right-hand sides for one matrix onto klujax's multiple right-hand sides (one
factorization). JVP and transpose rules make it a differentiable linear solve, as
klujax's `solve_with_symbol` is.

Why a singularity test outside KLU. klujax stops the whole compiled program with a
runtime error when KLU meets an exactly zero pivot, and it exposes neither the pivots
nor KLU's rcond; a runtime error cannot be caught inside the program. So at each setup
(`klu_singular`) a host callback factorizes the row-equilibrated J with SuperLU (scipy,
partial pivoting) and applies `DenseLU`'s test to its pivots (non-finite, exactly
singular, or min |pivot| ≤ n·eps·max |pivot|). A singular J is then never given to KLU:
the state holds the identity instead (every `Sparsity` contains the diagonal), so the
solves run, and `is_singular` reports the status.
"""

import jax
import jax.numpy as jnp
import numpy as np

from .._jax_internals import Primitive, ad, batching, mlir, shaped_array
from .jacobian import Sparsity


def klujax():
    """Import klujax without its import-time side effect of pinning JAX to the CPU
    platform for the whole process (it sets `jax_platform_name`)."""
    previous = jax.config.read("jax_platform_name")
    try:
        import klujax as module
    except ImportError as err:
        raise ImportError("SparseLU(backend='klu') needs klujax: pip install "
                          "'daeadjoint[klu]' (or klujax>=0.5.1).") from err
    finally:
        jax.config.update("jax_platform_name", previous)
    return module


# ------------------------------------------------------------------ singular matrices


def pivots_singular(sparsity: Sparsity, values: np.ndarray) -> bool:
    """`DenseLU`'s singularity test (`factored_is_singular`) on a sparse LU: rows
    equilibrated by their ∞-norms, LU with partial pivoting (SuperLU, threshold 1), then
    a non-finite value, an exactly singular factor or min |pivot| ≤ n·eps·max |pivot|.
    The pivots depend on the ordering (SuperLU's COLAMD, not `DenseLU`'s natural one),
    but a numerically singular matrix has a pivot at the rounding level in any pivoted
    LU."""
    import scipy.sparse as sps
    import scipy.sparse.linalg as spla

    values = np.asarray(values, dtype=np.float64)
    if not np.all(np.isfinite(values)):
        return True
    n = sparsity.n
    rownorm = np.zeros(n)
    np.maximum.at(rownorm, sparsity.rows, np.abs(values))
    scaled = values / np.where(rownorm > 0, rownorm, 1.0)[sparsity.rows]
    matrix = sps.csc_matrix((scaled, (sparsity.rows, sparsity.cols)), shape=(n, n))
    try:
        lu = spla.splu(matrix, permc_spec="COLAMD", diag_pivot_thresh=1.0,
                       options={"Equil": False})
    except RuntimeError:      # "Factor is exactly singular"
        return True
    pivots = np.abs(lu.U.diagonal())
    return bool(pivots.min() <= n * np.finfo(np.float64).eps * pivots.max())


def klu_singular(sparsity: Sparsity, values) -> jax.Array:
    """`pivots_singular` of the assembled J, from inside compiled programs (a host
    callback; a batch is checked member by member). The test is not differentiable and
    needs none: its input is detached, so setups traced under `jax.jvp` work."""
    return jax.pure_callback(
        lambda v: np.asarray(pivots_singular(sparsity, v)),
        jax.ShapeDtypeStruct((), jnp.bool_), jax.lax.stop_gradient(values),
        vmap_method="sequential")


# ------------------------------------------------------------------ the solve primitive


klu_solve_p = Primitive("daeadjoint_klu_solve")


def klu_solve(plan, values, rhs, transpose: bool = False):
    """J x = rhs (or Jᵀ x = rhs) with J given by `values` on `plan.sparsity`, KLU reusing
    `plan.symbolic`. `values` (…, nnz) and `rhs` (…, n) have equal leading (batch) axes,
    or `values` has none (one matrix, any number of right-hand sides)."""
    return klu_solve_p.bind(values, rhs, plan=plan, transpose=bool(transpose))


def _klu_solve_body(values, rhs, *, plan, transpose):
    """The computation through klujax; the pattern and the symbolic handle enter here as
    constants, after every transformation has been applied."""
    klu = klujax()
    fn = klu.tsolve_with_symbol if transpose else klu.solve_with_symbol
    sparsity = plan.sparsity
    rows, cols = np.asarray(sparsity.rows), np.asarray(sparsity.cols)
    n = sparsity.n
    if values.ndim == 1:      # one factorization, the right-hand sides as columns
        x = fn(rows, cols, values, rhs.reshape(-1, n).T, plan.symbolic)
        return x.T.reshape(rhs.shape)
    x = fn(rows, cols, values.reshape(-1, values.shape[-1]), rhs.reshape(-1, n),
           plan.symbolic)
    return x.reshape(rhs.shape)


def _klu_solve_abstract_eval(values, rhs, *, plan, transpose):
    del plan, transpose
    if values.ndim > 1 and values.shape[:-1] != rhs.shape[:-1]:
        raise ValueError(f"klu_solve: batch axes of values {values.shape} and rhs "
                         f"{rhs.shape} differ.")
    return shaped_array(rhs.shape, rhs.dtype)


def _klu_solve_batch(args, dims, *, plan, transpose):
    """The batch axis to the front of both; then either one matrix with more right-hand
    sides, or as many matrices as right-hand-side rows (values' batch axes are either
    none or rhs's, `klu_solve`'s contract, so they are aligned from the left)."""
    values, rhs = args
    dv, dr = dims
    size = values.shape[dv] if dv is not None else rhs.shape[dr]
    rhs = jnp.moveaxis(rhs, dr, 0) if dr is not None else jnp.broadcast_to(
        rhs, (size, *rhs.shape))
    if dv is None and values.ndim == 1:      # one matrix: more right-hand sides
        return klu_solve(plan, values, rhs, transpose), 0
    if dv is None:
        values = jnp.broadcast_to(values, (size, *values.shape))
    else:
        values = jnp.moveaxis(values, dv, 0)
    if values.ndim == 2:                      # (B, nnz): one matrix per batch member
        values = values.reshape(size, *(1,) * (rhs.ndim - 2), values.shape[-1])
    values = jnp.broadcast_to(values, (*rhs.shape[:-1], values.shape[-1]))
    return klu_solve(plan, values, rhs, transpose), 0


def sparse_matvec(sparsity: Sparsity, values, x, transpose: bool = False):
    """J x (or Jᵀ x) from the pattern's values, batched over leading axes."""
    rows, cols = (sparsity.cols, sparsity.rows) if transpose else (sparsity.rows,
                                                                    sparsity.cols)
    out = jnp.zeros(jnp.broadcast_shapes(values.shape[:-1], x.shape[:-1]) + x.shape[-1:],
                    x.dtype)
    return out.at[..., rows].add(values * x[..., cols])


def _klu_solve_jvp(primals, tangents, *, plan, transpose):
    """d(J⁻¹ b) = J⁻¹ (db − dJ x): one more solve with the same matrix."""
    values, rhs = primals
    dvalues, drhs = tangents
    x = klu_solve(plan, values, rhs, transpose)
    t = jnp.zeros_like(x) if type(drhs) is ad.Zero else drhs
    if type(dvalues) is not ad.Zero:
        t = t - sparse_matvec(plan.sparsity, dvalues, x, transpose)
    return x, klu_solve(plan, values, jnp.broadcast_to(t, x.shape), transpose)


def _klu_solve_transpose(ct, values, rhs, *, plan, transpose):
    """Linear in rhs only (the JVP above never makes values a linear input)."""
    if ad.is_undefined_primal(values):
        raise ValueError("klu_solve is linear in the right-hand side only.")
    ct = jnp.zeros(rhs.aval.shape, rhs.aval.dtype) if type(ct) is ad.Zero else ct
    return None, klu_solve(plan, values, ct, not transpose)


klu_solve_p.def_impl(lambda values, rhs, *, plan, transpose: _klu_solve_body(
    values, rhs, plan=plan, transpose=transpose))
klu_solve_p.def_abstract_eval(_klu_solve_abstract_eval)
batching.primitive_batchers[klu_solve_p] = _klu_solve_batch
ad.primitive_jvps[klu_solve_p] = _klu_solve_jvp
ad.primitive_transposes[klu_solve_p] = _klu_solve_transpose
mlir.register_lowering(klu_solve_p, mlir.lower_fun(_klu_solve_body, multiple_results=False),
                       platform="cpu")

