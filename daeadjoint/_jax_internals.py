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
2. **`unvmap_any`** (`equinox.internal`): a predicate reduced over every `vmap` batch
   axis, so that a `lax.cond` or a one-trip `while_loop` on it stays a branch under
   `vmap` instead of becoming a `select` that runs both sides (the Newton update, event
   handling, the adjoint's restarts and fallbacks). Without it batched solves compute
   every branch: the same results, several times slower.
3. **Tracer classes** (`jax._src`): `being_linearized` tells a tangent that JAX is
   linearizing (`grad`, `vjp`, `linearize`: the tangent is an unknown of a partial
   evaluation, a `JaxprTracer` whose value is not known, possibly inside `BatchTracer`s)
   from one it is pushing forward (`jvp`, `jacfwd`). Pure forward mode runs the state
   and its sensitivities in one integration; a linearized solve must keep the primal
   apart from the linear tangent map that `grad` transposes into the adjoint. Without
   the check, `grad` would meet the fused run, which has no transpose.
4. **A custom partial-evaluation rule** (`jax.interpreters.partial_eval`,
   `jax.extend.core.set_current_trace`): where a solve inside `jit` is linearized after
   its forward-mode rule already chose the fused run (JAX partially evaluates the jitted
   jvp), the fused primitive is replaced by its unfused form, whose primal part is known
   and whose tangent part is the linear, transposable primitive. Without it `grad`
   through a `jit` around a solve would reach the fused run's transpose (an internal
   error).
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
"""

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
    "unvmap_any",
    # 7.
    "nondifferentiable_backward",
    # 3.
    "being_linearized",
    # 4.
    "set_partial_eval_rule",
    # 5.
    "batching_rule", "set_batching_rule",
    # 6.
    "explicit_batch_axis", "batch_explicit_axis", "shaped_array",
    # 7. (and UndefinedPrimal for the filtered primitives' transpose rules)
    "Primitive", "ad", "batching", "mlir", "UndefinedPrimal",
]

# ------------------------------------------------------- 1. filtered primitives

create_vprim = eqxi.create_vprim
filter_primitive_def = eqxi.filter_primitive_def
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
