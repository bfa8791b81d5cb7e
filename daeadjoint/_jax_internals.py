"""Every use of JAX's and equinox's internals, in one place.

The derivatives of a solve are JAX transformations of custom primitives (`_derivatives/
autodiff.py`), and the band LU and KLU are XLA custom calls (`_linalg/`). Part of what
that takes has no public API: it comes from `jax._src`, `jax.interpreters`, `jax.extend`
(JAX's extension modules, which carry no compatibility guarantee) and `equinox.internal`.
Each such name is imported here, and only here, with why it is needed and what breaks
without it; the rest of the package imports it from this module. An upgrade of jax or
equinox is checked against this module: `tests/test_jax_internals.py` checks each
assumption below cheaply (no solve), and `pyproject.toml` bounds `jax`, `jaxlib` and
`equinox` above at the newest versions the test suite passed with.

Not here: the names `jax.core` still exports as public (`ShapedArray`, `Tracer`,
`eval_jaxpr`), `jax.custom_jvp`, `jax.ffi` and `equinox`'s public API.

1. **Filtered primitives** (`equinox.internal`). The solve's derivative maps — the tangent
   map L(x) ẋ, its transpose L(x)ᵀ ȳ, the Hessian action and the fused primal–tangent run
   — are primitives whose operands are pytrees (the solver's configuration, the inputs,
   the forward run's record), built as lineax builds `linear_solve`: `create_vprim` with
   `filter_primitive_def/jvp/transpose`, called with `filter_primitive_bind`. Without
   them each primitive would flatten and rebuild its operands by hand. The batching and
   partial-evaluation rules below receive the operands in equinox's flattened encoding
   (parameters `treedef`, `static`, `flatten`; array leaves marked by `MISSING`), which
   `unflatten_operands` decodes: if equinox changes that encoding, those rules would
   rebuild the wrong operands.
2. **`unvmap_any`, `unvmap_all`, `unvmap_max`** (`equinox.internal`): a predicate (or
   a value) reduced over every `vmap` batch axis, so that a `lax.cond` or a one-trip
   `while_loop` on it stays a branch under `vmap` instead of becoming a `select` that
   runs both sides (the Newton update, event handling, the adjoint's restarts and
   fallbacks). Without it batched solves compute every branch: the same results,
   several times slower. Also the operands of a host callback (the adjoint's fallback
   warning, `progress=`): `jax.debug.callback` of batched operands is unrolled into one
   callback per member by its batching rule.
3. **Tracer classes** (`jax._src`): `being_linearized` tells a tangent that JAX is
   linearizing (`grad`, `vjp`, `linearize`: the tangent is an unknown of a partial
   evaluation, a `JaxprTracer` whose value is not known, possibly inside `BatchTracer`s)
   from one it is pushing forward (`jvp`, `jacfwd`). Pure forward mode runs the state
   and its sensitivities in one integration; a linearized solve must keep the primal
   apart from the linear tangent map that `grad` transposes into the adjoint. Without
   the check, `grad` would meet the fused run, which has no transpose. `is_batched`
   tells `integrate` that `vmap` is batching the arrays it is traced with (a
   `BatchTracer` with a batch dimension): it then steps every member in one flat loop
   instead of the output-interval loops of an unbatched solve. Without the check a
   batched solve keeps the nested loops: the same results, its members waiting for
   each other at every output time.
4. **A custom partial-evaluation rule** (`jax.interpreters.partial_eval`,
   `jax.extend.core.set_current_trace`): where a solve inside `jit` is linearized after
   its forward-mode rule already chose the fused run (JAX partially evaluates the jitted
   jvp), the fused primitive is replaced by its unfused form, whose primal part is known
   and whose tangent part is the linear, transposable primitive. Without it `grad`
   through a `jit` around a solve would reach the fused run's transpose (an internal
   error). The same replacement is registered for JAX's partial evaluation of jaxprs
   (`partial_eval_jaxpr_custom_rules`, handing the unfused form to the rule of
   `closed_call`), which `jax.checkpoint` uses: without it `grad` of a checkpointed
   solve failed ("Linearization failed to produce known values").
5. **Replaced batching rules** (`jax.interpreters.batching.fancy_primitive_batchers`):
   `create_vprim` batches a primitive by `vmap` of its rules. A batch of the linear
   operand alone (the tangents of `jacfwd`, the cotangents of `jacrev`) is instead
   folded into the directions of one sensitivity or adjoint integration
   (`_derivatives/batching.py`), which reads equinox's own rule first (`batching_rule`)
   and falls back to it for anything else. Without the replacement `jacfwd`/`jacrev`
   run one integration per direction; if the rules' calling convention changes (the
   `AxisData` with its `.size`, value and dimension lists), batched derivatives fail.
6. **The trace stack** (`jax._src.core.trace_ctx`, each trace's `parent_trace` and a
   `BatchTrace`'s `axis_data.explicit_mesh_axis`): `explicit_batch_axis` tells `solve`
   that it runs under a `vmap` whose batch axis is an explicitly sharded mesh axis (the
   default of `jax.make_mesh`). Its integrations are then primitives whose batching
   rules split the batch over the devices with `shard_map` (`_derivatives/batching.py`):
   JAX's own batching of a `while_loop` over an explicitly sharded axis failed in
   tracing (carries and buffers created unsharded, updated with sharded values). Without
   the check, explicitly sharded batches fail to trace; if JAX renames these
   attributes, it returns None and such batches fail the same way.
7. **JAX's primitive-definition API** (`jax.extend.core.Primitive` and the
   `jax.interpreters.ad`/`batching`/`mlir` rule tables): the band LU and KLU solves are
   primitives lowered to XLA custom calls, with their own JVP, transpose and batching
   rules (as in JAX's guide to defining primitives). Without them those solvers cannot
   be differentiated or batched.
7. **`nondifferentiable_backward`** (`equinox.internal`): the identity, whose transpose
   raises a given message. A delay DAE's forward-mode rule (`_delay/solve.py`) passes
   its tangents through it where it solves one variational system (not linearized), so
   that `jax.grad(jax.jit(f))` of such a solve stops with a clear error instead of
   JAX's failure to transpose that solve. Without it that case would fail with an
   internal message. (`being_linearized`, item 3, picks the transposable J·ṗ form
   otherwise.)
8. **JAX's batching rule of `while_loop`** (`jax._src.lax.control_flow.loops.while_p`, the
   `batching` module's `batch_jaxpr`, `batch_jaxpr_axes`, `broadcast` and `moveaxis`):
   replaced at import by a rule that calls JAX's own, except inside `batched_loops` (the
   solver's tracing: `solve`, the primitives' implementations), where it calls
   `_while_batching_rule`: the same batched loop with fewer batchings of its body. JAX's
   rule finds the batched carries by batching the body until no further carry becomes
   batched (usually two passes: the init's, then a check), then batches it once more for
   the final axes; with the solver's loops nested 3–5 deep under `vmap` (the backward
   pass's segment loop > step loop > Newton iteration > Jacobian setup) that was a good
   part of lowering `vmap(grad)` and `jax.hessian`. The replacement tests the predicate
   before each pass: batched → every carry is batched whatever the body does (JAX's rule
   then batches all of them too), so the body is batched once; never batched → JAX's
   passes, the last one's body used as the loop's. Without it the programs are the same
   (`tests/test_jax_internals.py` compares the jaxprs of both rules), only slower to
   build. If JAX changes the rule's calling convention or the helpers it uses, batched
   solves fail to trace; that test fails first.
9. **A select that only a batch needs** (`taken_select`, a primitive with the API of
   item 7 and `jax.interpreters.batching.fancy_primitive_batchers`): `where(pred, new,
   old)` in code that runs only where `unvmap_any(pred)` holds — the branch of a
   `lax.cond`, or the one trip of a loop, on that predicate. Unbatched the branch runs
   only when pred is true, so the select is the identity and the primitive is `new`;
   its batching rule, run whenever a `vmap` batches pred — while the solve is traced
   or afterwards (`jax.vmap(jax.jit(f))`, which `is_batched` cannot see) —, is the
   select that keeps the members whose pred is false as they were. Without it every
   such branch carries selects that XLA cannot drop (they are kernels of the compiled
   program: ~60 in Robertson's gradient), or the solver would have to decide at trace
   time, wrongly for a batch applied later. If JAX changes the rule tables, the
   primitive fails to trace or batch; `tests/test_jax_internals.py` checks it under
   `jit`, `vmap`, `vmap` of `jit`, `jvp` and `vjp`.
10. **The trace stack, for `solve`'s own `jit`** (the trace classes of `jax._src`:
   `LinearizeTrace`, `DynamicJaxprTrace`; `core.trace_ctx` and a trace's
   `parent_trace`): `linearized_in_jit` tells `solve` that JAX linearizes it (`grad`,
   `vjp`, `linearize`) directly inside a `jit` being traced, with no other
   transformation between or above. `solve` then traces its body inline instead of through its
   `eqx.filter_jit` (whose cache serves eager calls): JAX traces a nested `jit` under
   `grad` once for its primal and then re-evaluates its whole jaxpr to linearize it,
   while inline only the custom JVP's run is traced — the integrator traced once
   instead of twice (Robertson's `grad`: 8 % fewer of JAX's Python calls in tracing and
   lowering, 24 % fewer in tracing). Inside the outer `jit` the program is compiled
   whole either way (the same results, bit for bit). Under a `vmap` the nested `jit`
   stays: traced inline, the solver would see batched values where it now sees the
   `jit`'s unbatched ones, and build another program; under a `jvp` of the `grad` (or
   `jax.hessian`) too: the `jit`'s boundary turns Python numbers among the tangents
   into arrays, which the second-order rule needs. If JAX renames these classes the
   check returns False and the nested `jit` is kept: the same results, traced more
   slowly; `tests/test_jax_internals.py` checks it under `jit(grad)`, `jit(vjp)`,
   `jit(linearize)` and where it must be false.
"""

import functools
import threading
from collections.abc import Callable
from typing import Any

import equinox.internal as eqxi
import jax
import jax.extend.core
from jax.interpreters import ad, batching, mlir
from jax.interpreters import partial_eval as _partial_eval

# Module-level names that JAX and equinox versions may move or remove: an ImportError or
# AttributeError here would name a private module; say instead what it is and what to do.
try:
    from equinox.internal._primitive import _missing_dynamic as MISSING
    from jax._src.interpreters.batching import BatchTracer
    from jax._src.interpreters.partial_eval import JaxprTracer
    from jax._src.interpreters import batching as _batching
    from jax._src.lax.control_flow.loops import while_p as _while_p
except (ImportError, AttributeError) as err:     # pragma: no cover - version dependent
    raise ImportError(
        "daeadjoint relies on internals of jax and equinox (see daeadjoint/_jax_internals.py) "
        f"that this installation lacks: {err}. Tested with jax/jaxlib 0.10.2 and equinox "
        "0.13.8; install those versions (`pip install -e .` respects the bounds in "
        "pyproject.toml).") from err

__all__ = [
    # 1. filtered primitives
    "create_vprim", "filter_primitive_def", "filter_primitive_jvp",
    "filter_primitive_transpose", "filter_primitive_bind", "MISSING", "unflatten_operands",
    # 2.
    "unvmap_any", "unvmap_all", "unvmap_max",
    # 7.
    "nondifferentiable_backward",
    # 3.
    "being_linearized", "is_batched",
    # 4.
    "set_partial_eval_rule",
    # 5.
    "batching_rule", "set_batching_rule",
    # 6.
    "explicit_batch_axis", "batch_explicit_axis", "shaped_array",
    # 7. (and UndefinedPrimal for the filtered primitives' transpose rules)
    "Primitive", "ad", "batching", "mlir", "UndefinedPrimal",
    # 8.
    "batched_loops",
    # 9.
    "taken_select",
    # 10.
    "linearized_in_jit",
]

# ------------------------------------------------------- 1. filtered primitives

create_vprim = eqxi.create_vprim


def filter_primitive_def(fn):
    """equinox's `filter_primitive_def` of `fn` run under `batched_loops` (item 8): a
    primitive's implementation is where `vmap` batches the solver's loops when the
    program is lowered."""
    return eqxi.filter_primitive_def(batched_loops(fn))


filter_primitive_jvp = eqxi.filter_primitive_jvp
filter_primitive_transpose = eqxi.filter_primitive_transpose
filter_primitive_bind = eqxi.filter_primitive_bind


def unflatten_operands(values, static, treedef):
    """The operands of a filtered primitive from a rule's arguments: the array values
    (in order) fill the `MISSING` places of `static`, unflattened by `treedef`."""
    it = iter(values)
    flat = [next(it) if s is MISSING else s for s in static]
    return jax.tree_util.tree_unflatten(treedef, flat)


# --------------------------------------------------------------- 2. unvmap_any

unvmap_any = eqxi.unvmap_any
unvmap_all = eqxi.unvmap_all
unvmap_max = eqxi.unvmap_max

# ------------------------------------------------- 7. nondifferentiable_backward

nondifferentiable_backward = eqxi.nondifferentiable_backward


# ------------------------------------------------------ 3. linearization check


def being_linearized(tangents) -> bool:
    """Whether any leaf of `tangents` is an unknown of a partial evaluation (JAX is
    linearizing: `grad`, `vjp`, `linearize`), looking through batching (`grad` of a
    `vmap`ped solve). False under `jvp`/`jacfwd`, where tangents are known values."""
    def unknown(x):
        while isinstance(x, BatchTracer):
            x = x.val
        return isinstance(x, JaxprTracer) and not x.pval.is_known()

    return any(unknown(x) for x in jax.tree_util.tree_leaves(tangents))


def is_batched(tree) -> bool:
    """Whether any array leaf of `tree` is batched by an enclosing `vmap` traced now (a
    `BatchTracer` with a batch dimension, at any depth of tracers). False inside a `jit`
    that a `vmap` batches afterwards (`jax.vmap(jax.jit(f))` traces f unbatched)."""
    def batched(x):
        while True:
            if isinstance(x, BatchTracer):
                if x.batch_dim is not None:
                    return True
                x = x.val
            elif hasattr(x, "primal"):      # a JVP or linearize tracer: look at its primal
                x = x.primal
            else:
                return False

    return any(batched(x) for x in jax.tree_util.tree_leaves(tree))


# ------------------------------------------------- 4. partial-evaluation rule


def set_partial_eval_rule(prim, inline: Callable[..., Any]) -> None:
    """Partial evaluation of the filtered primitive `prim`: with every operand known,
    the primitive as it is; otherwise `inline(*operands)` traced in its place."""
    def rule(trace, *tracers, treedef, static, flatten):
        if all(x.pval.is_known() for x in tracers):
            return trace.default_process_primitive(
                prim, tracers, dict(treedef=treedef, static=static, flatten=flatten))
        operands = unflatten_operands(tracers, static, treedef)
        with jax.extend.core.set_current_trace(trace):
            return flatten(inline(*operands))

    _partial_eval.custom_partial_eval_rules[prim] = rule

    def jaxpr_rule(saveable, unks_in, inst_in, eqn):
        # The same inlining where JAX partially evaluates a jaxpr rather than a trace
        # (`jax.checkpoint`'s rematerialization: its jvp jaxpr holds the fused run, and
        # without this rule the whole run was staged as unknown, so `grad` of a
        # checkpointed solve failed with "Linearization failed to produce known values
        # for all output primals"): `inline` traced as a `closed_call`, whose rule splits
        # it into its known and staged parts.
        params = eqn.params

        def flat(*values):
            return params["flatten"](inline(*unflatten_operands(values, params["static"],
                                                                 params["treedef"])))

        avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype,
                                      weak_type=getattr(v.aval, "weak_type", False))
                 for v in eqn.invars]
        call = jax.make_jaxpr(flat)(*avals)
        inlined = jax.extend.core.new_jaxpr_eqn(
            eqn.invars, eqn.outvars, jax.extend.core.primitives.closed_call_p,
            dict(call_jaxpr=call), call.effects, eqn.source_info, eqn.ctx)
        return _partial_eval.partial_eval_jaxpr_custom_rules[
            jax.extend.core.primitives.closed_call_p](saveable, unks_in, inst_in, inlined)

    _partial_eval.partial_eval_jaxpr_custom_rules[prim] = jaxpr_rule


# --------------------------------------------------------- 5. batching rules


def batching_rule(prim) -> Callable[..., Any]:
    """The batching rule installed for `prim` (for a `create_vprim` primitive, equinox's
    `vmap` of its rules): `rule(axis_data, values, dims, **params) -> (outs, out_dims)`."""
    return batching.fancy_primitive_batchers[prim]


def set_batching_rule(prim, rule: Callable[..., Any]) -> None:
    """Install `rule` (the calling convention of `batching_rule`) for `prim`."""
    batching.fancy_primitive_batchers[prim] = rule


# ------------------------------------------------------------ 6. the trace stack


def explicit_batch_axis():
    """The mesh axis (a tuple of names) of the innermost enclosing `vmap` whose batch
    is explicitly sharded, or None: read from the current trace and its parents. (A
    `jit` between the `vmap` and the call hides it — the jitted function is traced
    unbatched first —, so `solve` also checks the mesh in context, `jax.set_mesh`.)"""
    from jax._src import core as _core
    trace = _core.trace_ctx.trace
    for _ in range(1000):   # the stack is finite; the bound guards a cyclic parent
        if trace is None:
            return None
        data = getattr(trace, "axis_data", None)
        if data is not None:
            try:
                axis = data.explicit_mesh_axis
            except (AttributeError, KeyError, AssertionError):
                axis = None
            if axis is not None:
                return axis
        trace = getattr(trace, "parent_trace", None)
    return None


def batch_explicit_axis(axis_data):
    """The explicitly sharded mesh axis a batching rule's `axis_data` batches over, or
    None (a plain `vmap`, or an axis of an `Auto` mesh)."""
    try:
        return axis_data.explicit_mesh_axis
    except (AttributeError, KeyError, AssertionError):
        return None


def shaped_array(shape, dtype):
    """The abstract value of a primitive's output: `ShapedArray` on the mesh in context
    (`jax.set_mesh`, or a `shard_map`'s), replicated. (Public API, kept beside the trace
    checks above because it serves the same purpose: an output on the empty mesh cannot
    be batched along an explicitly sharded axis — `vmap` names that axis in its
    sharding, and fails when the mesh lacks it.)"""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return jax.core.ShapedArray(shape, dtype)
    return jax.core.ShapedArray(shape, dtype, sharding=jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec()))


# -------------------------------------------- 7. primitive-definition API

Primitive = jax.extend.core.Primitive
UndefinedPrimal = ad.UndefinedPrimal


# ---------------------------------------- 8. the batching rule of while loops

_jax_while_rule = batching.fancy_primitive_batchers[_while_p]
_scope = threading.local()      # how deep this thread is in `batched_loops`


def _while_batching_rule(axis_data, args, dims, *, cond_nconsts, cond_jaxpr, body_nconsts,
                         body_jaxpr):
    """JAX's batching rule of `while_p` (jax/_src/lax/control_flow/loops.py,
    `_while_loop_batching_rule`), with fewer batchings of the body; the same batched
    loop. JAX's rule: (i) the batched carries are the fixpoint of "batched in `init`, or
    made batched by the body", found by batching the body until no carry changes; (ii) if
    the predicate is batched given those, every carry is batched (all at axis 0);
    otherwise the fixpoint's are; (iii) the body and the predicate are batched once more
    for those axes. Here the predicate is tested before each pass: batching is monotone
    (a batched input never makes an output unbatched), so a predicate batched by a
    subset of the fixpoint is batched by the fixpoint, and then the body need not be
    batched before (ii). The init is broadcast to all-batched and JAX's rule does the
    rest: its fixpoint ends in one pass, and its (iii) is that pass (the same arguments
    of JAX's cache of batched jaxprs). Where the predicate stays unbatched, the passes
    are JAX's own, and the last one, whose arguments differ from (iii)'s only in how an
    unbatched output is asked for ("unbatched if it is" vs "unbatched"), is the
    body (iii) would build; the loop is bound here."""
    params = dict(cond_nconsts=cond_nconsts, cond_jaxpr=cond_jaxpr, body_nconsts=body_nconsts,
                  body_jaxpr=body_jaxpr)
    nc = cond_nconsts + body_nconsts
    if (cond_jaxpr.effects or body_jaxpr.effects or cond_jaxpr.out_avals[0].shape
            or any(d not in (None, 0) for d in dims[:nc])):
        # Effects (JAX's rule rejects some), a predicate that is not a scalar, constants
        # batched along another axis (the fixpoint's passes batch along axis 0, (iii)
        # along theirs): JAX's rule as it is.
        return _jax_while_rule(axis_data, args, dims, **params)
    bat = [d is not None for d in dims]
    cconst_bat, bconst_bat, carry_bat = bat[:cond_nconsts], bat[cond_nconsts:nc], bat[nc:]
    body = None
    for _ in range(1 + len(carry_bat)):
        _, (pred_bat,) = _batching.batch_jaxpr(cond_jaxpr, axis_data, cconst_bat + carry_bat,
                                              instantiate=False)
        if pred_bat:
            break
        body, out_bat = _batching.batch_jaxpr(body_jaxpr, axis_data, bconst_bat + carry_bat,
                                             instantiate=carry_bat)
        if list(out_bat) == carry_bat:
            break
        carry_bat = [a or b for a, b in zip(carry_bat, out_bat)]
    else:     # pragma: no cover - each pass batches one more carry, or stops
        return _jax_while_rule(axis_data, args, dims, **params)
    # The init as JAX's rule prepares it: broadcast where it becomes batched, the batch
    # axis moved to the front; in the order of the carries.
    carry_dims = [0 if pred_bat or b else None for b in carry_bat]
    init = []
    for x, old, new in zip(args[nc:], dims[nc:], carry_dims):
        if old is None and new is not None:
            init.append(_batching.broadcast(x, axis_data.size, new, axis_data.explicit_mesh_axis))
        elif old is None or old == new:
            init.append(x)
        else:
            init.append(_batching.moveaxis(x, old, new))
    if pred_bat:
        return _jax_while_rule(axis_data, list(args[:nc]) + init, list(dims[:nc]) + carry_dims,
                               **params)
    cond, _ = _batching.batch_jaxpr_axes(cond_jaxpr, axis_data,
                                        list(dims[:cond_nconsts]) + carry_dims, (None,))
    outs = _while_p.bind(*args[:nc], *init, cond_nconsts=cond_nconsts, cond_jaxpr=cond,
                         body_nconsts=body_nconsts, body_jaxpr=body)
    return outs, carry_dims


def _dispatching_while_rule(axis_data, args, dims, **params):
    """`_while_batching_rule` inside `batched_loops`, JAX's rule elsewhere."""
    if getattr(_scope, "depth", 0):
        return _while_batching_rule(axis_data, args, dims, **params)
    return _jax_while_rule(axis_data, args, dims, **params)


batching.fancy_primitive_batchers[_while_p] = _dispatching_while_rule


def batched_loops(fn):
    """`fn` with JAX's while-loop batching replaced by `_while_batching_rule` (item 8)
    while it runs: where a `vmap` batches the loops `fn` traces (a solve called under
    `vmap`, a primitive's implementation vmapped when it is lowered). Loops batched
    elsewhere (e.g. `jax.vmap(jax.jit(solve))`, which batches an already traced
    program) keep JAX's rule: the same program, built more slowly."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        _scope.depth = getattr(_scope, "depth", 0) + 1
        try:
            return fn(*args, **kwargs)
        finally:
            _scope.depth -= 1
    return wrapper


# ------------------------------------------------- 9. a select only a batch needs

_taken_select_p = jax.extend.core.Primitive("daeadjoint_taken_select")


def taken_select(pred, new, old):
    """`lax.select(pred, new, old)` (pred a boolean scalar or of new's shape; new and
    old of one shape and dtype) where the code runs only where `unvmap_any(pred)` is
    true: `new` unbatched, the select under `vmap` (item 9)."""
    return _taken_select_p.bind(pred, new, old)


def _taken_select_abstract(pred, new, old):
    if (new.shape != old.shape or new.dtype != old.dtype or pred.dtype != bool
            or pred.shape not in ((), new.shape)):
        raise TypeError(f"taken_select of {pred}, {new}, {old}: pred must be a boolean "
                        "scalar or of the operands' shape, and the operands alike")
    return new


def _taken_select_batched(axis_data, args, dims):
    """Batched: pred batched selects per member; pred unbatched is true (the code runs
    only where unvmap_any(pred) is), so the result is `new`, batched like the carry it
    replaces."""
    pred, new, old = args
    pd, nd, od = dims
    size, mesh_axis = axis_data.size, axis_data.explicit_mesh_axis
    if pd is None:
        if od is None:
            return new, nd
        return _batching.bdim_at_front(new, nd, size, mesh_axis), 0
    new = _batching.bdim_at_front(new, nd, size, mesh_axis)
    old = _batching.bdim_at_front(old, od, size, mesh_axis)
    pred = _batching.moveaxis(pred, pd, 0)
    if pred.shape != new.shape:
        pred = jax.lax.broadcast_in_dim(pred, new.shape, tuple(range(pred.ndim)))
    return jax.lax.select(pred, new, old), 0


def _taken_select_jvp(primals, tangents):
    pred, new, old = primals
    _, dnew, dold = tangents
    out = _taken_select_p.bind(pred, new, old)
    if type(dnew) is ad.Zero and type(dold) is ad.Zero:
        return out, ad.Zero.from_primal_value(out)
    return out, _taken_select_p.bind(pred, ad.instantiate_zeros(dnew),
                                     ad.instantiate_zeros(dold))


def _taken_select_transpose(ct, pred, new, old):
    if ad.is_undefined_primal(pred):     # pragma: no cover - a boolean has no tangent
        raise ValueError("taken_select is not linear in its predicate")
    if type(ct) is ad.Zero:
        return [None, ad.Zero(new.aval) if ad.is_undefined_primal(new) else None,
                ad.Zero(old.aval) if ad.is_undefined_primal(old) else None]
    zero = jax.numpy.zeros_like(ct)
    return [None,
            _taken_select_p.bind(pred, ct, zero) if ad.is_undefined_primal(new) else None,
            _taken_select_p.bind(pred, zero, ct) if ad.is_undefined_primal(old) else None]


_taken_select_p.def_impl(lambda pred, new, old: new)
_taken_select_p.def_abstract_eval(_taken_select_abstract)
mlir.register_lowering(_taken_select_p, lambda ctx, pred, new, old: [new])
batching.fancy_primitive_batchers[_taken_select_p] = _taken_select_batched
ad.primitive_jvps[_taken_select_p] = _taken_select_jvp
ad.primitive_transposes[_taken_select_p] = _taken_select_transpose


# ---------------------------------------- 10. a solve linearized inside `jit`

def _trace_class(module: str, name: str):
    import importlib
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):     # pragma: no cover - version dependent
        return None


_LINEARIZE_TRACE = _trace_class("jax._src.interpreters.ad", "LinearizeTrace")
_JAXPR_TRACE = _trace_class("jax._src.interpreters.partial_eval", "DynamicJaxprTrace")


def linearized_in_jit() -> bool:
    """Whether the current trace is JAX's linearization (`grad`, `vjp`, `linearize`:
    a `LinearizeTrace`) directly inside a `jit` being traced (its parent a
    `DynamicJaxprTrace`), with nothing between them (item 10). Only that case: with
    another transformation between or above (a `jvp` of the `grad`, `jax.hessian`, a
    `vmap`) the solve keeps its own `jit`, whose boundary turns Python numbers among the
    tangents into arrays (traced inline, `jax.jit(jax.jvp(jax.grad(f), ...))` handed the
    second-order rule a Python float)."""
    if _LINEARIZE_TRACE is None or _JAXPR_TRACE is None:
        return False      # pragma: no cover - version dependent
    from jax._src import core as _core
    trace = getattr(getattr(_core, "trace_ctx", None), "trace", None)
    return (isinstance(trace, _LINEARIZE_TRACE)
            and isinstance(getattr(trace, "parent_trace", None), _JAXPR_TRACE))
