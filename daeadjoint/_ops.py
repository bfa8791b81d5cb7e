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
    loop fusion. Robertson's State has 9 f64 scalars: as vectors of 4 and 5 the forward
    step loop runs 40 thunks an attempt, as one vector 46 (the concatenate and 8 operand
    kernels against 2 fusions and one more copy of the carry). Built instead by
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


def compacted_update(pred, fn, old, parts: int):
    """`taken_where(pred, fn(old), old)`, for code that runs only where
    `unvmap_any(pred)` holds (the one trip of `_newton.maybe_update`), with `fn`
    evaluated under `vmap` only for the members where `pred` holds.

    Unbatched (and where a `vmap` batches every input but not `pred`, which is then
    true) this is `fn(old)`. Where a `vmap` of B members batches `pred`, its batching
    rule (`jax.custom_batching.custom_vmap`) gathers the members with `pred` into
    sub-batches of K = ⌈B / `parts`⌉ members (in member order, by a running count of
    `pred`), evaluates `fn` for the K rows of each sub-batch by a `vmap` of its own,
    and scatters the results into `old`'s rows: one sub-batch after another in a loop
    while members are left, so every member with `pred` gets `fn` of its own values in
    the trip it asks for them. Every member's values are those of `fn` evaluated for
    all members and selected (the same operations on the same member's values; the
    unfilled places of the last sub-batch evaluate `fn` for a member already done and
    are dropped by the scatter). Why: with `fn` the Jacobian and factorization of a
    batched Newton iteration, most trips of a batched step loop need it for some
    member but only a few members need it in a trip (Robertson, 256 members: ~18 of
    them, in ~95 % of the trips), and the Jacobian and factorization of every member
    were ~⅓ of a trip's operations (docs/performance.md, "Batches").

    `fn` may close over batched values (the iterate, the problem's arguments): it is
    traced to a jaxpr here and its closed-over values passed to the batched rule as
    inputs (`jax.make_jaxpr`), which gathers their rows like `old`'s."""
    closed, shapes = jax.make_jaxpr(fn, return_shape=True)(old)
    out_tree = jax.tree_util.tree_structure(shapes)
    old_leaves, old_tree = jax.tree_util.tree_flatten(old)
    if str(out_tree) != str(old_tree):
        raise TypeError(f"compacted_update: fn returns {out_tree}, not old's {old_tree}")

    def call(consts, old_leaves):
        return jax.core.eval_jaxpr(closed.jaxpr, consts, *old_leaves)

    @jax.custom_batching.custom_vmap
    def run(pred, consts, old_leaves):
        del pred        # unbatched the code runs only where pred holds
        return call(consts, old_leaves)

    @run.def_vmap
    def _rule(size, in_batched, pred, consts, old_leaves):
        _, c_batched, o_batched = in_batched
        full = [x if b else jnp.broadcast_to(x, (size,) + x.shape)
                for x, b in zip(old_leaves, o_batched)]
        if not in_batched[0]:
            axes = ([0 if b else None for b in c_batched],
                    [0 if b else None for b in o_batched])
            new = jax.vmap(call, in_axes=axes, axis_size=size)(consts, old_leaves)
            return new, [True] * len(new)
        # The batched inputs `fn` reads, packed by dtype into (size, m) arrays: one
        # gather of each per sub-batch (a kernel each), its columns sliced in the
        # kernels that read them.
        used = _used_inputs(closed.jaxpr)
        inputs = list(consts) + list(old_leaves)
        batched = list(c_batched) + list(o_batched)
        take = [i for i, (x, b) in enumerate(zip(inputs, batched)) if b and used[i]]
        groups: dict = {}
        for i in take:
            groups.setdefault(inputs[i].dtype, []).append(i)
        packed = {dt: lax.concatenate([inputs[i].reshape(size, -1) for i in idx], 1)
                  for dt, idx in groups.items()}

        def evaluate(rows, n):
            # fn of the n members whose packed rows are `rows` (dtype -> (n, m)).
            args = [x if not b else jnp.zeros(x.shape[1:], x.dtype)
                    for x, b in zip(inputs, batched)]
            axes = [None] * len(inputs)
            for dt, idx in groups.items():
                start = 0
                for i in idx:
                    width = int(np.prod(inputs[i].shape[1:], dtype=int))
                    args[i] = lax.slice_in_dim(rows[dt], start, start + width, axis=1
                                               ).reshape((n,) + inputs[i].shape[1:])
                    axes[i] = 0
                    start += width
            nc = len(consts)
            return jax.vmap(call, in_axes=(axes[:nc], axes[nc:]), axis_size=n)(
                args[:nc], args[nc:])

        k = max(1, -(-size // parts))
        chunks = -(-size // k)
        count = running_count(pred)
        # members[j]: the member with the (j + 1)-th pred (size past the last one).
        members = jnp.full((chunks * k,), size, jnp.int32).at[
            where(pred, count - 1, chunks * k)].set(
                lax.iota(jnp.int32, size), mode="drop")

        def chunk(i, out):
            idx = lax.dynamic_slice_in_dim(members, i * k, k)
            at = jnp.minimum(idx, size - 1)
            new = evaluate({dt: x.at[at].get(mode="promise_in_bounds")
                            for dt, x in packed.items()}, k)
            return [o.at[idx].set(v, mode="drop", indices_are_sorted=True)
                    for o, v in zip(out, new)]

        # The first sub-batch is taken (pred holds somewhere); the loop takes the rest.
        out = chunk(jnp.zeros((), jnp.int32), full)
        _, out = lax.while_loop(lambda c: c[0] * k < count[-1],
                                lambda c: (c[0] + 1, chunk(c[0], c[1])),
                                (jnp.ones((), jnp.int32), out))
        return out, [True] * len(out)

    new = run(pred, list(closed.consts), old_leaves)
    return jax.tree_util.tree_unflatten(old_tree, new)


def _used_inputs(jaxpr) -> list:
    """Whether each input of `jaxpr` (its constvars, then its invars) is read."""
    read = {id(v) for eqn in jaxpr.eqns for v in eqn.invars}
    read |= {id(v) for v in jaxpr.outvars}
    return [id(v) in read for v in list(jaxpr.constvars) + list(jaxpr.invars)]


def running_count(pred):
    """`jnp.cumsum(pred)` of a boolean vector, as int32, by 32-bit words: each element's
    count is the population count of its word's bits up to its own plus the counts of
    the words before it (a cumulative sum of n/32 values). Elementwise but for that
    short sum, where XLA's CPU cumulative sum is a reduce-window of O(n²) additions
    (256 values: 0.7 against 2.1 µs)."""
    n = pred.shape[0]
    w = -(-n // 32)
    bits = jnp.pad(pred, (0, 32 * w - n)).reshape(w, 32).astype(jnp.uint32)
    shifts = lax.iota(jnp.uint32, 32)
    words = jnp.sum(bits << shifts, axis=1, dtype=jnp.uint32)
    total = lax.population_count(words).astype(jnp.int32)
    before = jnp.cumsum(total) - total
    upto = where(shifts == 31, np.uint32(0xFFFFFFFF), (np.uint32(2) << shifts) - np.uint32(1))
    count = lax.population_count(words[:, None] & upto[None, :]).astype(jnp.int32)
    return (count + before[:, None]).reshape(-1)[:n]
