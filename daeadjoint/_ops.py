"""`jnp.where` and integer indexing as the primitives they trace to, for the solver's own
arrays.

`jnp.where` is a `jax.jit` of its own and `x[i]` goes through NumPy's indexing rules:
each call is a nested trace (one per new signature, every process), and `jnp.where` a
function call in the lowered program. A step of the solver makes a few hundred of them,
so they are a large part of the tracing and lowering that every process repeats before
its first result, even with the compiled program read from the persistent cache
(docs/performance.md, "Reusing compiled programs across processes"). Here they are the
same `select_n`, `broadcast_in_dim` and `dynamic_slice` operations, emitted directly:
the compiled program computes the same values.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ._jax_internals import is_batched, taken_select


def _array(x) -> bool:
    return isinstance(x, (jax.Array, jax.core.Tracer))


@functools.cache
def _scalar_kinds(dtype) -> tuple:
    """The Python scalar types that `jnp.where` converts to `dtype` (an array's), and
    the range of the integers: those that leave the result the array's dtype. Not
    floats below single precision: `jnp.where` rounds a Python float to the default
    float type first, so that a narrower one may round twice."""
    if jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits >= 32:
        return (int, float), None
    if jnp.issubdtype(dtype, jnp.integer):
        info = jnp.iinfo(dtype)
        return (int,), (int(info.min), int(info.max))
    return (), None


def _scalar_fits(s, dtype) -> bool:
    kinds, bounds = _scalar_kinds(dtype)
    return (type(s) in kinds and not isinstance(s, bool)
            and (bounds is None or bounds[0] <= s <= bounds[1]))


def _to(x, shape):
    """x broadcast to `shape` (NumPy's rules: trailing dimensions aligned)."""
    if x.shape == shape:
        return x
    return lax.broadcast_in_dim(x, shape, tuple(range(len(shape) - x.ndim, len(shape))))


def _constant(s, dtype, shape):
    """The Python scalar s as an array of `dtype` (rounded as XLA converts) and `shape`."""
    return lax.broadcast_in_dim(np.asarray(s, dtype), shape, ())


def where(pred, x, y):
    """`jnp.where(pred, x, y)`. Emitted as `lax.select` where the operands need no type
    promotion: `pred` a boolean array, x and y arrays of one dtype and not weakly typed,
    or one of them a Python scalar of that dtype's kind (the result then has the
    array's dtype, as `jnp.where`'s). Anything else goes to `jnp.where`."""
    if not (_array(pred) and pred.dtype == jnp.bool_):
        return jnp.where(pred, x, y)
    ax, ay = _array(x), _array(y)
    if ax and ay:
        ok = x.dtype == y.dtype and not x.weak_type and not y.weak_type
        dtype = x.dtype
    elif ax:
        dtype = x.dtype
        ok = not x.weak_type and _scalar_fits(y, dtype)
    elif ay:
        dtype = y.dtype
        ok = not y.weak_type and _scalar_fits(x, dtype)
    else:
        ok = False
    if not ok:
        return jnp.where(pred, x, y)
    shapes = {pred.shape} | {v.shape for v in (x, y) if _array(v)}
    shape = shapes.pop() if len(shapes) == 1 else np.broadcast_shapes(pred.shape, *shapes)
    x = _to(x, shape) if ax else _constant(x, dtype, shape)
    y = _to(y, shape) if ay else _constant(y, dtype, shape)
    return lax.select(pred if pred.ndim == 0 else _to(pred, shape), x, y)


def tree_where(pred, a, b):
    """`where` leaf by leaf over two pytrees of one structure."""
    return jax.tree_util.tree_map(lambda x, y: where(pred, x, y), a, b)


def taken_where(pred, new, old):
    """`where(pred, new, old)` in code that runs only where `unvmap_any(pred)` holds (a
    branch or one-trip loop on that predicate): unbatched the branch runs only when
    pred is true, so this is `new` and compiles to nothing; under `vmap` — applied while
    tracing or to the traced program later — it is the select
    (`_jax_internals.taken_select`). Leaves that would need `where`'s promotions or
    broadcasting take `where`."""
    def leaf(x, y):
        if (_array(pred) and pred.dtype == jnp.bool_ and _array(x) and _array(y)
                and x.shape == y.shape and x.dtype == y.dtype
                and x.weak_type == y.weak_type and pred.shape in ((), x.shape)):
            return taken_select(pred, x, y)
        return where(pred, x, y)

    return jax.tree_util.tree_map(leaf, new, old)


def row(x, i):
    """x[clip(i, 0, len(x) − 1)] along the first axis for a traced integer i, as one
    `dynamic_slice` (which clamps its start to fit; JAX's wraps a negative one, hence
    the max)."""
    return lax.dynamic_index_in_dim(x, lax.max(i, np.zeros((), i.dtype)), 0, keepdims=False)


def _pack_key(x):
    """The group a scalar leaf is packed in: its dtype and weak type (a slice of the
    packed vector must have the leaf's exact type for the loop's carry to match)."""
    return (jnp.result_type(x), bool(getattr(x, "weak_type", False)))


# The most scalars one packed vector takes (`_packing`): XLA's CPU fusion does not fuse a
# concatenate of more operands (`kMaxConcatenateArguments` in cpu_instruction_fusion.cc).
_PACK_MAX = 8


def _packing(tree, part=None):
    """(pack, unpack) for `tree`'s scalar arrays — of `tree[part]` only, if given —
    packed into vectors by dtype (and weak type); None where fewer than two scalars share
    a dtype. `pack` maps a tree of `tree`'s structure to (the other leaves, the vectors),
    `unpack` back: pure data movement, bit for bit.

    Up to `_PACK_MAX` (8) scalars of a dtype make one vector, more make several of
    balanced lengths: a vector is one `concatenate` of its scalars, and XLA's CPU fusion
    does not fuse a concatenate of more than 8 operands (it would select among them by a
    branch tree; a concatenate of shorter concatenates is merged back into one by XLA's
    simplifier first). Unfused, the concatenate is a thunk of its own
    and each operand (the select that keeps or replaces the scalar, the slice of the
    Newton loop's result) a small kernel of its own; within the limit they are all one
    loop fusion. Robertson's State had 9 f64 scalars: as vectors of 4 and 5 the forward
    step loop ran 40 thunks an attempt, as one vector 46 (the concatenate and 8 operand
    kernels against 2 fusions and one more copy of the carry); it has 8 since `ss_sens`
    is None without forward sensitivities, one vector. Built instead by
    elementwise selects on an iota (`select(iota == j, s_j, …)`, 39 thunks) the vector is
    not recognized as the concatenation of another vector's slices, so the loops that
    pass the state through (`integrate`'s outer loop, the adjoint's replay) would rebuild
    it every trip (forward outer loop 5 → 12 thunks, the gradient's 21 → 32)."""
    if is_batched(tree):
        # Under `vmap` the vectors are (batch, k) and every scalar a strided column of
        # one: measured slower (Robertson, 256 members: 253 -> 332 ms a solve).
        return None
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    n_before = 0 if part is None else len(jax.tree_util.tree_leaves(tree[:part]))
    n_part = len(leaves) if part is None else len(jax.tree_util.tree_leaves(tree[part]))
    groups: dict = {}
    for i, x in enumerate(leaves):
        if n_before <= i < n_before + n_part and _array(x) and x.ndim == 0:
            groups.setdefault(_pack_key(x), []).append(i)
    groups = {(k, q): idx[q * len(idx) // n:(q + 1) * len(idx) // n]
              for k, idx in groups.items() if len(idx) > 1
              for n in [-(-len(idx) // _PACK_MAX)] for q in range(n)}
    if not groups:
        return None
    packed = {i for idx in groups.values() for i in idx}

    def pack(t):
        flat = treedef.flatten_up_to(t)
        rest = [x for i, x in enumerate(flat) if i not in packed]
        vecs = [lax.concatenate([lax.broadcast_in_dim(flat[i], (1,), ()) for i in idx], 0)
                for idx in groups.values()]
        return rest, vecs

    def unpack(p):
        rest, vecs = p
        flat: list = [None] * len(leaves)
        it = iter(rest)
        for i in range(len(leaves)):
            if i not in packed:
                flat[i] = next(it)
        for vec, idx in zip(vecs, groups.values()):
            for j, i in enumerate(idx):
                flat[i] = lax.index_in_dim(vec, j, keepdims=False)
        return treedef.unflatten(flat)

    return pack, unpack


def packed_while_loop(cond_fun, body_fun, init, part=None):
    """`lax.while_loop` with the carry's scalars (of `init[part]` only, if given) packed
    into vectors by dtype (`_packing`: at most 8 scalars a vector).

    Each array of a loop's carry is a buffer of its own at the loop's boundary, and XLA's
    CPU runtime gives each scalar its own small operations: the select that keeps or
    replaces it, and often a copy into the carry's buffer when its old value is still
    read after the new one is computed. The step loop carries ~25 such scalars (t, h,
    the order, the counters, the flags). Packed, they cross the boundary as a few
    vectors; the body sees the same scalars (slices of the vectors), so the results are
    the same bit for bit. Loops nested in the body that carry the same part packed the
    same way (`integrate`'s outer and step loops: the `State`) pass the vectors through:
    XLA folds the concatenation of a vector's own slices back into the vector."""
    packing = _packing(init, part)
    if packing is None:
        return lax.while_loop(cond_fun, body_fun, init)
    pack, unpack = packing
    out = lax.while_loop(lambda p: cond_fun(unpack(p)), lambda p: pack(body_fun(unpack(p))),
                         pack(init))
    return unpack(out)


def packed_cond(pred, true_fun, false_fun, operand):
    """`lax.cond(pred, true_fun, false_fun, operand)` with the operand's scalars passed
    packed (`packed_while_loop`): a branch's operands are buffers, so scalars unpacked
    from a loop's vectors would each be copied out into one of their own on every trip,
    taken or not."""
    packing = _packing(operand)
    if packing is None:
        return lax.cond(pred, true_fun, false_fun, operand)
    pack, unpack = packing
    rest, vecs = pack(operand)
    return lax.cond(pred, lambda p: true_fun(unpack(p)), lambda p: false_fun(unpack(p)),
                    (rest, lax.optimization_barrier(vecs)))
