"""The assumptions `daeadjoint/_jax_internals.py` makes about JAX's and equinox's
internals, checked on toy primitives (no solve, a second or two): after an upgrade of
jax or equinox, a failure here names the internal that changed, where the solver's own
tests would fail somewhere inside a gradient.

The toy: f(x) = 3x as a `jax.custom_jvp` whose forward mode, like the solve's, fuses the
primal and its tangent into one primitive `fused_p` unless `being_linearized`, in which
case it uses the primal primitive `scale_p` and the linear primitive `linear_p` (whose
transpose is the only one defined)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from daeadjoint import _jax_internals as ji

SCALE = 3.0


def _shaped(x):
    return jax.core.ShapedArray(jnp.shape(x), jnp.result_type(x))


def _primitive(name, impl, jvp, transpose):
    def abstract(*args):
        return tuple(_shaped(o) for o in jax.eval_shape(impl, *args))
    return ji.create_vprim(name, ji.filter_primitive_def(impl), ji.filter_primitive_def(abstract),
                           ji.filter_primitive_jvp(jvp),
                           ji.filter_primitive_transpose(materialise_zeros=False)(transpose))


def _linear_jvp(primals, tangents):
    x, s = primals
    dx, _ = tangents
    return (ji.filter_primitive_bind(linear_p, x, s),
            None if dx is None else ji.filter_primitive_bind(linear_p, dx, s))


def _linear_transpose(inputs, cts):
    x, s = inputs
    assert isinstance(x, ji.UndefinedPrimal), "the linear operand is not an UndefinedPrimal"
    (ct,) = cts
    return s * ct, None


def _scale_jvp(primals, tangents):
    x, s = primals
    dx, _ = tangents
    return (ji.filter_primitive_bind(scale_p, x, s),
            None if dx is None else ji.filter_primitive_bind(linear_p, dx, s))


def _not_transposable(inputs, cts):
    raise NotImplementedError("the primal or fused primitive was transposed")


linear_p = _primitive("test_internals_linear", lambda x, s: (s * x,), _linear_jvp,
                      _linear_transpose)
scale_p = _primitive("test_internals_scale", lambda x, s: (s * x,), _scale_jvp,
                     _not_transposable)

inlined = []


def _unfused(x, dx, s):
    inlined.append(True)
    (y,) = ji.filter_primitive_bind(scale_p, x, s)
    (dy,) = ji.filter_primitive_bind(linear_p, dx, s)
    return y, dy


def _fused_jvp(primals, tangents):
    x, dx, s = primals
    tx, tdx, _ = tangents
    out = _unfused(x, dx, s)
    return out, (None if tx is None else ji.filter_primitive_bind(linear_p, tx, s)[0],
                 None if tdx is None else ji.filter_primitive_bind(linear_p, tdx, s)[0])


fused_p = _primitive("test_internals_fused", lambda x, dx, s: (s * x, s * dx), _fused_jvp,
                     _not_transposable)
ji.set_partial_eval_rule(fused_p, _unfused)

seen_linearized = []


@jax.custom_jvp
def f(x):
    return SCALE * x


@f.defjvp
def _f_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    linearized = ji.being_linearized(dx)
    seen_linearized.append(linearized)
    if linearized:
        return _unfused(x, dx, SCALE)
    y, dy = ji.filter_primitive_bind(fused_p, x, dx, SCALE)
    return y, dy


def _record(fn, *args):
    seen_linearized.clear()
    inlined.clear()
    return fn(*args), list(seen_linearized), list(inlined)


X = jnp.array([1.0, -2.0])


def test_filtered_primitive_encoding():
    """`filter_primitive_bind` passes the array leaves as the primitive's operands and the
    rest in `static` (arrays marked `MISSING`), with `treedef` and `flatten`:
    `unflatten_operands` must rebuild the operands from them."""
    jaxpr = jax.make_jaxpr(lambda x: ji.filter_primitive_bind(scale_p, x, SCALE))(X)
    (eqn,) = [e for e in jaxpr.eqns if e.primitive is scale_p]
    assert set(eqn.params) == {"treedef", "static", "flatten"}, (
        f"equinox's filtered primitives changed their parameters: {sorted(eqn.params)}")
    static = eqn.params["static"]
    assert [s is ji.MISSING for s in static] == [True, False], (
        "equinox's filtered primitives no longer mark array operands with "
        "equinox.internal._primitive._missing_dynamic")
    x, s = ji.unflatten_operands(["array"], static, eqn.params["treedef"])
    assert (x, s) == ("array", SCALE)


def test_being_linearized_tells_linearization_from_forward_mode():
    """Forward mode (`jvp`) sees known tangents; `grad`, `linearize` and `grad`
    of a `vmap` see unknowns of a partial evaluation (JAX's JaxprTracer, possibly inside
    a BatchTracer)."""
    cases = {
        "jvp": (lambda x: jax.jvp(f, (x,), (jnp.ones_like(x),))[1], False),
        "grad": (jax.grad(lambda x: f(x).sum()), True),
        "linearize": (lambda x: jax.linearize(f, x)[1](jnp.ones_like(x)), True),
        "grad of vmap": (jax.grad(lambda x: jax.vmap(f)(x).sum()), True),
    }
    for name, (fn, expected) in cases.items():
        _, seen, _ = _record(fn, X)
        assert seen and all(s == expected for s in seen), (
            f"being_linearized under {name}: {seen}, expected {expected} (jax's tracer "
            "classes BatchTracer/JaxprTracer or their `val`/`pval` changed)")


def test_derivatives_through_the_fused_primitive():
    """The values: forward mode through the fused primitive, reverse mode through the
    linear one (d(3x)/dx = 3; the toy's fused primitive has no batching rule of its own,
    so `jacfwd` is left to the solver's tests)."""
    np.testing.assert_array_equal(jax.jvp(f, (X,), (jnp.ones_like(X),))[1], SCALE)
    np.testing.assert_array_equal(jax.grad(lambda x: f(x).sum())(X), SCALE)


def test_partial_eval_rule_inlines_the_unfused_form():
    """`grad` of a `jit`: JAX traces the jitted jvp with known tangents (the fused run is
    chosen), then partially evaluates it; the custom partial-evaluation rule must replace
    the fused primitive by its unfused form, or `grad` fails ("Linearization failed to
    produce known values")."""
    g, seen, inlined_now = _record(jax.grad(jax.jit(lambda x: f(x).sum())), X)
    assert seen == [False], f"expected the fused run to be chosen inside jit, saw {seen}"
    assert inlined_now, "the custom partial-evaluation rule was not called"
    np.testing.assert_array_equal(g, SCALE)


def test_batching_rules_can_be_read_and_replaced():
    """equinox's rule is installed in `fancy_primitive_batchers` (read by `batching_rule`),
    called as rule(axis_data, values, dims, **params) with `axis_data.size`."""
    prim = _primitive("test_internals_batched", lambda x, s: (s * x,), _linear_jvp,
                      _linear_transpose)
    vprim_rule = ji.batching_rule(prim)
    sizes = []

    def rule(axis_data, vals, dims, **params):
        sizes.append(axis_data.size)
        return vprim_rule(axis_data, vals, dims, **params)

    ji.set_batching_rule(prim, rule)
    out = jax.vmap(lambda x: ji.filter_primitive_bind(prim, x, SCALE)[0])(jnp.arange(5.0))
    assert sizes == [5], f"the replaced batching rule was called with sizes {sizes}"
    np.testing.assert_array_equal(out, SCALE * np.arange(5.0))


def test_unvmap_any_keeps_a_branch_under_vmap():
    """A `lax.cond` on `unvmap_any(p)` stays a conditional under `vmap` (a batched
    predicate would turn it into a `select` that runs both branches), and is true for
    the whole batch if any member's predicate is."""
    def g(p, x):
        return jax.lax.cond(ji.unvmap_any(p), lambda: x + 1.0, lambda: x)

    batched = jax.vmap(g)
    prims = {e.primitive.name for e in jax.make_jaxpr(batched)(jnp.array([False, True]), X).eqns}
    assert "cond" in prims, f"unvmap_any's predicate was batched: {sorted(prims)}"
    np.testing.assert_array_equal(batched(jnp.array([False, True]), X), X + 1.0)
    np.testing.assert_array_equal(batched(jnp.array([False, False]), X), X)


def test_nondifferentiable_backward_refuses_only_reverse_mode():
    """The identity in value and in forward mode (under vmap too, as jacfwd batches it);
    transposing it raises the given message (a delay DAE's refusal of `grad`)."""
    def f(x):
        return ji.nondifferentiable_backward(2.0 * x, msg="no reverse here")

    np.testing.assert_array_equal(jax.jvp(f, (X,), (jnp.ones_like(X),))[1], 2.0 * jnp.ones_like(X))
    np.testing.assert_array_equal(jax.jacfwd(f)(X), 2.0 * jnp.eye(X.shape[0]))
    with pytest.raises(Exception, match="no reverse here"):
        jax.grad(lambda x: jnp.sum(f(x)))(X)


@pytest.mark.parametrize("table", ["ad.primitive_jvps", "ad.primitive_transposes",
                                   "batching.primitive_batchers", "mlir.register_lowering",
                                   "mlir.lower_fun", "ad.Zero", "ad.is_undefined_primal"])
def test_primitive_definition_api(table):
    """What the band LU and KLU primitives are registered with (`_linalg/`)."""
    module, name = table.split(".")
    assert hasattr(getattr(ji, module), name), (
        f"jax.interpreters.{table} is gone: the band LU and KLU primitives cannot be "
        "registered (see daeadjoint/_jax_internals.py, item 6)")


def test_linearized_in_jit_reads_the_trace_stack():
    """`linearized_in_jit` (item 10) is true where JAX linearizes inside a `jit` being
    traced (`jit(grad)`, `jit(vjp)`, `jit(linearize)`), and false without the `jit`,
    without linearization (`jit`, `jit(jvp)`), with a `vmap` in between
    (`jit(vmap(grad))`, `jit(grad(vmap))`), with another transformation between
    (`jit(jvp(grad))`, `jit(hessian)`) and inside a nested `jit` (`grad(jit)`, whose
    function JAX traces on its own first): there `solve` keeps its own `jit`."""
    seen = []

    def g(x):
        seen.append(ji.linearized_in_jit())
        return jnp.sin(x) * 2.0

    def fresh_jit(x):          # `jax.jit(g)` would be traced once, in the "jit" case
        return jax.jit(lambda v: g(v))(x)

    x = jnp.ones(3)
    cases = {
        "jit(grad)": (jax.jit(jax.grad(lambda v: g(v).sum())), x, True),
        "jit(vjp)": (jax.jit(lambda v: jax.vjp(g, v)[1](v)), x, True),
        "jit(linearize)": (jax.jit(lambda v: jax.linearize(g, v)[1](v)), x, True),
        "grad": (jax.grad(lambda v: g(v).sum()), x, False),
        "jit": (jax.jit(g), x, False),
        "jit(jvp)": (jax.jit(lambda v: jax.jvp(g, (v,), (v,))[1]), x, False),
        "jit(vmap(grad))": (jax.jit(jax.vmap(jax.grad(lambda v: g(v).sum()))), x[:, None],
                            False),
        "jit(grad(vmap))": (jax.jit(jax.grad(lambda v: jax.vmap(g)(v).sum())), x, False),
        "grad(jit)": (jax.grad(lambda v: fresh_jit(v).sum()), x, False),
        # A transformation between the linearization and the jit: the solve keeps its
        # own jit (test_user_inputs_and_messages::test_every_transformation_and_second_order
        # failed when jit(jvp(grad)) traced it inline).
        "jit(jvp(grad))": (jax.jit(lambda v: jax.jvp(jax.grad(lambda u: g(u).sum()), (v,),
                                                     (v,))[1]), x, False),
        "jit(hessian)": (jax.jit(jax.hessian(lambda v: g(v).sum())), x, False),
    }
    for name, (fn, arg, expected) in cases.items():
        seen.clear()
        fn(arg)
        assert seen and all(s == expected for s in seen), (
            f"linearized_in_jit under {name}: {seen}, expected {expected} (jax's trace "
            "classes LinearizeTrace/DynamicJaxprTrace/BatchTrace/EvalTrace or "
            "`parent_trace` changed)")


def test_explicit_batch_axis_reads_the_trace_stack():
    """`explicit_batch_axis` finds a `vmap` over an explicitly sharded mesh axis through
    the traces between it and the call (here `grad`), and nothing for a plain `vmap` or
    an `Auto` axis. (A one-device mesh: the axis type, not the device count, matters.)"""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    seen = []

    def g(x):
        seen.append(ji.explicit_batch_axis())
        return x * 2.0

    x = np.ones((2, 3))
    for axis_type in (AxisType.Explicit, AxisType.Auto):
        mesh = jax.make_mesh((1,), ("b",), axis_types=(axis_type,))
        xs = jax.device_put(x, NamedSharding(mesh, P("b")))
        with jax.set_mesh(mesh):
            jax.jit(jax.vmap(g))(xs)
            jax.jit(jax.vmap(jax.grad(lambda v: g(v).sum())))(xs)
    jax.vmap(g)(x)
    assert seen == [("b",), ("b",), None, None, None], (
        f"explicit_batch_axis saw {seen}: jax's trace stack (trace_ctx.trace, "
        "parent_trace, BatchTrace.axis_data.explicit_mesh_axis) changed")


# ------------------------------------------- 8. the batching rule of while loops
# Loops whose carries become batched in each way JAX's rule distinguishes. Each is a
# function of (x, y), x and y of shape (2,), vmapped over x only (y unbatched), the
# batch along x's axis 0 or 1.

def _pred_batched_at_init(x, y):
    # The predicate reads x (batched): every carry is batched, the counter too.
    def body(c):
        i, v, w = c
        return i + 1, v * 0.5, w + y
    return jax.lax.while_loop(lambda c: jnp.sum(c[1]) > 0.1 * jnp.sum(x), body,
                                  (0, x, y))


def _pred_never_batched(x, y):
    # A fixed count: the predicate stays unbatched; v becomes batched through the body
    # (a second pass), w never does.
    def body(c):
        i, v, w = c
        return i + 1, v + x * i, w * 2.0
    return jax.lax.while_loop(lambda c: c[0] < 4, body, (0, y, y))


def _pred_batched_after_a_pass(x, y):
    # The predicate reads v, which only the body makes batched.
    def body(c):
        i, v = c
        return i + 1, v + x
    return jax.lax.while_loop(lambda c: jnp.sum(c[1]) < 3.0, body, (0, y))


def _unvmapped_pred(x, y):
    # A one-trip loop on a predicate reduced over the batch (the solver's Newton updates):
    # unbatched; v becomes batched through the body (a second pass).
    def body(c):
        _, v = c
        return jnp.zeros((), bool), v + x
    return jax.lax.while_loop(lambda c: ji.unvmap_any(c[0]), body, (jnp.all(x > 0.0), y))


def _nested(x, y):
    # Loops three deep with each of the kinds above inside, and some work of the outer
    # body's own (a solver's loop bodies are mostly such work; their predicates are a
    # few comparisons).
    def outer(c):
        k, v, s = c
        _, v2, _ = _pred_never_batched(v, s)
        _, s2 = _pred_batched_after_a_pass(v2, s)
        _, u = _unvmapped_pred(s2, y)
        for _ in range(20):
            u = jnp.cos(u) * 0.5 + 0.1 * y
        return k + 1, v2 * 0.1, u

    # A predicate batched at init (it reads v): JAX's rule batches the outer body three
    # times (s becomes batched: a second pass; then all of it), this one once.
    return jax.lax.while_loop(lambda c: (c[0] < 2) & (jnp.sum(c[1]) > 0.0), outer, (0, x, y))


_LOOPS = [_pred_batched_at_init, _pred_never_batched, _pred_batched_after_a_pass,
          _unvmapped_pred, _nested]


def _batched_jaxpr(f, axis, x, y):
    return jax.make_jaxpr(jax.vmap(f, in_axes=(axis, None)))(x, y)


@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("f", _LOOPS, ids=lambda f: f.__name__)
def test_while_batching_rule_builds_jax_rules_loop(f, axis):
    """Inside `batched_loops` (the solver's loops under `vmap`) a while loop is batched to
    the same jaxpr as by JAX's own rule, outside it; with the batch along axis 1 the
    loop's constants are batched along axis 1 (JAX's rule is used as it is for those)."""
    x = jnp.linspace(0.5, 2.0, 6).reshape((3, 2) if axis == 0 else (2, 3))
    y = jnp.array([0.3, 0.7])
    ours = ji.batched_loops(_batched_jaxpr)(f, axis, x, y)
    jaxs = _batched_jaxpr(f, axis, x, y)
    assert str(ours) == str(jaxs)
    out = jax.vmap(ji.batched_loops(f), in_axes=(axis, None))(x, y)
    ref = jax.vmap(f, in_axes=(axis, None))(x, y)
    for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(ref)):
        np.testing.assert_array_equal(a, b)


def test_while_batching_rule_batches_bodies_fewer_times(monkeypatch):
    """What the replacement is for: nested loops batched with fewer batchings of their
    bodies' operations than JAX's rule needs."""
    from jax._src.interpreters import batching as jax_batching
    count = [0]
    process = jax_batching.BatchTrace.process_primitive

    def counted(self, *args, **kwargs):
        count[0] += 1
        return process(self, *args, **kwargs)

    monkeypatch.setattr(jax_batching.BatchTrace, "process_primitive", counted)

    def batched_operations(build):
        jax_batching._batch_jaxpr_axes.cache_clear()    # each rule batches anew
        count[0] = 0
        build()
        return count[0]

    x, y = jnp.linspace(0.5, 2.0, 6).reshape(3, 2), jnp.array([0.3, 0.7])
    ours = batched_operations(lambda: ji.batched_loops(_batched_jaxpr)(_nested, 0, x, y))
    jaxs = batched_operations(lambda: _batched_jaxpr(_nested, 0, x, y))
    # The outer body's ~70 operations batched once instead of three times (`_nested`);
    # the inner loops' bodies are small, their predicate tests cost a few more.
    assert ours < 0.6 * jaxs, (ours, jaxs)


def _taken(x, pred):
    """x + 1 where pred, as a branch taken only where `unvmap_any(pred)` holds, the
    select by `taken_select`."""
    return jax.lax.cond(ji.unvmap_any(pred),
                        lambda: ji.taken_select(pred, jnp.sin(x) + 1.0, x), lambda: x)


def test_taken_select_is_the_identity_unbatched_and_a_select_in_a_batch():
    x = jnp.array([0.3, -1.2, 2.0])
    pred = jnp.array([True, False, True])
    want = np.where(pred, np.sin(x) + 1.0, x)
    # Unbatched the branch runs only where pred holds: no select in the program.
    for p, w in ((True, np.sin(0.3) + 1.0), (False, 0.3)):
        assert np.array_equal(jax.jit(_taken)(x[0], jnp.asarray(p)), w)
    assert "select" not in str(jax.jit(_taken).lower(x[0], jnp.asarray(True)).as_text())
    # Batched while tracing, and batched after tracing (`vmap` of a traced `jit`, which
    # the solver's `is_batched` cannot see): the select per member.
    for f in (jax.vmap(_taken), jax.jit(jax.vmap(_taken)), jax.vmap(jax.jit(_taken)),
              jax.jit(jax.vmap(jax.jit(_taken)))):
        assert np.array_equal(f(x, pred), want)
    # An unbatched predicate with a batched operand (pred shared by the members).
    assert np.array_equal(jax.vmap(_taken, in_axes=(0, None))(x, jnp.asarray(False)), x)
    assert np.array_equal(jax.vmap(_taken, in_axes=(0, None))(x, jnp.asarray(True)),
                          np.sin(x) + 1.0)
    # Derivatives: d/dx is cos(x) where pred, 1 elsewhere — by jvp, vjp, under vmap
    # (rtol 1e-15: JAX's derivative of sin is its cos, equal to NumPy's to the last bit
    # or two).
    dwant = np.where(pred, np.cos(x), 1.0)
    for d in (jax.vmap(jax.grad(_taken)), jax.jit(jax.vmap(jax.grad(_taken))),
              jax.vmap(lambda a, b: jax.jvp(lambda y: _taken(y, b), (a,), (1.0,))[1])):
        np.testing.assert_allclose(d(x, pred), dwant, rtol=1e-15)


def test_taken_select_without_its_batching_select_fails(monkeypatch):
    # The mutation the test above must catch: a batching rule that drops the select
    # (what deciding "unbatched" at trace time does to `jax.vmap(jax.jit(f))`).
    x, pred = jnp.array([0.3, -1.2, 2.0]), jnp.array([True, False, True])
    prim = ji._taken_select_p
    rule = ji.batching.fancy_primitive_batchers[prim]

    def dropped(axis_data, args, dims):
        return rule(axis_data, (jnp.ones_like(args[0]),) + tuple(args[1:]), dims)

    monkeypatch.setitem(ji.batching.fancy_primitive_batchers, prim, dropped)
    got = jax.vmap(jax.jit(lambda a, b: _taken(a, b)))(x, pred)   # a new function: no cache
    assert not np.array_equal(got, np.where(pred, np.sin(x) + 1.0, x))
