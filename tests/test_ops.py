"""`daeadjoint._ops`: `where` and `row` give what `jnp.where` and indexing give — the same
values, dtype, weak type and shape — inside `jit` and outside, for the operand kinds the
solver passes (arrays of one dtype, Python scalars, scalar and broadcast predicates) and
those left to `jnp.where` (mixed dtypes, weak types, NumPy scalars, narrow floats)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from daeadjoint._ops import _PACK_MAX, _packing, packed_cond, packed_while_loop, row, tree_where, where

PRED = [np.array([True, False, True]), np.array(True), np.array(False),
        np.array([[True], [False]])]


def _operands():
    f64 = np.array([1.5, -2.25, 3.0])
    yield f64, np.array([0.1, 0.2, 0.3])
    yield f64, 0.1                                    # Python float, rounded as jnp does
    yield 0.1, np.array([[0.7], [0.8]])
    yield np.array(4.0), np.array([0.5, 0.6, 0.7])
    yield f64.astype(np.float32), 0.1                 # rounded once to float32
    yield f64.astype(np.float32), 3
    yield np.array([1, 2, 3], np.int32), 7
    yield np.array([1, 2, 3], np.int32), -7
    yield np.array([1, 2, 3], np.int32), 2.5          # promoted: to jnp.where
    yield np.array([1, 2, 3], np.uint8), 300          # out of range: to jnp.where
    yield f64.astype(np.float32), f64                 # mixed dtypes: to jnp.where
    yield f64.astype(jnp.bfloat16), 0.1               # narrow float: to jnp.where
    yield f64, np.float64(0.1)                        # NumPy scalar: to jnp.where
    yield 1.0, 2.0                                    # both weak: to jnp.where
    yield 3, f64
    yield np.array([True, False, True]), False


def _same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape and a.weak_type == b.weak_type
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _check(pred, x, y):
    operands = [jnp.asarray(v) if isinstance(v, np.ndarray) else v for v in (pred, x, y)]
    _same(where(*operands), jnp.where(*operands))
    # Traced: the operands that are arrays become tracers (not weakly typed), the Python
    # scalars stay Python scalars.
    traced = [i for i, v in enumerate(operands) if not isinstance(v, (int, float))]

    def call(fn, *arrays):
        args = list(operands)
        for i, a in zip(traced, arrays):
            args[i] = a
        return fn(*args)

    arrays = [operands[i] for i in traced]
    _same(jax.jit(lambda *a: call(where, *a))(*arrays),
          jax.jit(lambda *a: call(jnp.where, *a))(*arrays))


@pytest.mark.parametrize("x, y", list(_operands()))
def test_where_matches_jnp_where(x, y):
    checked = 0
    for pred in PRED:
        try:
            jnp.where(pred, x, y)
        except (TypeError, ValueError, OverflowError):
            continue            # shapes that do not broadcast
        _check(pred, x, y)
        checked += 1
    assert checked


def test_where_with_weak_arrays():
    # A weakly typed array (a Python float made an array) keeps jnp.where's promotion.
    for x, y in itertools.product([jnp.asarray(0.5), jnp.ones(3, jnp.float32)], repeat=2):
        pred = jnp.array([True, False, False])
        _same(where(pred, x, y), jnp.where(pred, x, y))
        _same(jax.jit(where)(pred, x, y), jax.jit(jnp.where)(pred, x, y))


def test_tree_where():
    pred = jnp.array(False)
    a, b = {"u": jnp.arange(3.0), "v": jnp.int32(1)}, {"u": -jnp.arange(3.0), "v": jnp.int32(2)}
    out = tree_where(pred, a, b)
    _same(out["u"], b["u"])
    _same(out["v"], b["v"])


def test_row_is_clipped_indexing():
    x = jnp.arange(12.0).reshape(6, 2)
    for i in range(-3, 9):
        i_ = jnp.int32(i)
        _same(jax.jit(row)(x, i_), x[jnp.clip(i_, 0, 5)])


def _carry(x):
    """A carry with scalars of several dtypes (two or more of each, so that each is
    packed), weakly typed ones among them, arrays, None and a dict."""
    return (dict(t=jnp.float64(0.0) + x, h=jnp.float64(0.5), k=jnp.int32(1),
                 done=jnp.zeros((), bool), odd=jnp.ones((), bool),
                 w=jnp.asarray(2.0) * 1, u=jnp.asarray(0.5) * 1, none=None,
                 v=jnp.arange(3.0) * x, f32=jnp.float32(1.25)),
            jnp.int32(0), jnp.float64(3.0))


def _step(c):
    s, i, y = c
    h = jnp.where(s["k"] % 3 == 0, s["h"] * 0.7, s["h"] * 1.1)
    s = dict(s, t=s["t"] + h, h=h, k=s["k"] + 1, done=s["t"] + h > 5.0, odd=~s["odd"],
             w=s["w"] * 0.5 + 1, u=s["u"] - s["w"], v=s["v"] + h, f32=s["f32"] * jnp.float32(1.5))
    return s, i + 2, y * 0.9 + s["t"]


@pytest.mark.parametrize("part", [None, 0])
def test_packed_while_loop_is_the_while_loop(part):
    """The packed loop computes what `lax.while_loop` does, bit for bit, with the carry's
    dtypes and weak types, under jit, vmap and jvp (it moves data only)."""
    def plain(x):
        return jax.lax.while_loop(lambda c: ~c[0]["done"], _step, _carry(x))

    def packed(x):
        return packed_while_loop(lambda c: ~c[0]["done"], _step, _carry(x), part=part)

    for f in (lambda x: (plain(x), packed(x)),
              jax.jit(lambda x: (plain(x), packed(x)))):
        a, b = f(jnp.float64(0.3))
        for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
            _same(u, v)
            np.testing.assert_array_equal(u, v)
    xs = jnp.array([0.1, 0.7, 2.0])
    for u, v in zip(jax.tree_util.tree_leaves(jax.vmap(plain)(xs)),
                    jax.tree_util.tree_leaves(jax.vmap(packed)(xs))):
        np.testing.assert_array_equal(u, v)
    ta = jax.jvp(lambda x: plain(x)[2], (0.3,), (1.0,))
    tb = jax.jvp(lambda x: packed(x)[2], (0.3,), (1.0,))
    np.testing.assert_array_equal(ta, tb)


def test_packed_cond_is_the_cond():
    """`packed_cond` takes the branch `lax.cond` does, with the operand unchanged."""
    op = _carry(jnp.float64(0.3))[0]
    for pred in (True, False):
        a = jax.lax.cond(pred, _step, lambda c: c, (op, jnp.int32(0), jnp.float64(1.0)))
        b = packed_cond(pred, _step, lambda c: c, (op, jnp.int32(0), jnp.float64(1.0)))
        for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
            _same(u, v)
            np.testing.assert_array_equal(u, v)


@pytest.mark.parametrize("n", [_PACK_MAX, _PACK_MAX + 1, 2 * _PACK_MAX + 3])
def test_packing_splits_long_groups(n):
    """A dtype's scalars go into vectors of at most `_PACK_MAX` elements (XLA's CPU
    fusion leaves a longer concatenate unfused), of balanced lengths, every scalar in
    exactly one; the loop is still `lax.while_loop` bit for bit, with the weak types."""
    def carry(x):
        return ([jnp.float64(0.1 * j) + x for j in range(n)], jnp.asarray(1.5) * 1,
                jnp.asarray(2.5) * 1, jnp.int32(0))

    def step(c):
        xs, w, u, i = c
        return ([v * 1.1 + w - j for j, v in enumerate(xs)], w * 0.5, u + w, i + 1)

    tree = carry(jnp.float64(0.3))
    pack, unpack = _packing(tree)
    _, vecs = pack(tree)
    lengths = sorted(len(v) for v in vecs)
    f64 = [k for k in lengths if k > 2]           # the weak pair (w, u) is a vector of 2
    assert max(lengths) <= _PACK_MAX and sum(f64) == n
    assert len(f64) == -(-n // _PACK_MAX) and max(f64) - min(f64) <= 1
    for u, v in zip(jax.tree_util.tree_leaves(unpack(pack(tree))), jax.tree_util.tree_leaves(tree)):
        _same(u, v)

    def plain(x):
        return jax.lax.while_loop(lambda c: c[3] < 7, step, carry(x))

    def packed(x):
        return packed_while_loop(lambda c: c[3] < 7, step, carry(x))

    a, b = jax.jit(lambda x: (plain(x), packed(x)))(jnp.float64(0.3))
    for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        _same(u, v)
