"""The batching rules of `autodiff.py`'s primitives. A batch of the linear operand alone
(tangents under `jacfwd`, cotangents under `jacrev`, directions of a Hessian-vector
product) is folded into the directions of one integration; anything else is vmapped as
`equinox.internal.create_vprim` would. A batch along an explicitly sharded mesh axis
(`jax.make_mesh`'s default axis type) is split over the devices first (`_shard_mapped`:
`shard_map` of a per-device `vmap`). Importing this module installs the rules (`_solve`
imports it); replacing a primitive's batching rule is one of the internals of JAX that
`_jax_internals.py` gathers."""

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from .._jax_internals import (MISSING, batch_explicit_axis, batching_rule, filter_primitive_bind,
                              set_batching_rule, unflatten_operands)
from .autodiff import (_unfused, cotangent_p, forward_p, hessian_p, hessian_total_p,
                       primal_tangent_p, tangent_p)

# ------------------------------------------------------------------- batching rules


def _dims_tree(dims, static, treedef):
    """The operands' batch axes as their pytree: None at every static (non-array) leaf,
    so that only the array operands count as batched."""
    return unflatten_operands(dims, [x if x is MISSING else None for x in static], treedef)


# equinox's rules (vmap of the primitives' rules), read before they are replaced below.
_vprim_rules = {p: batching_rule(p)
                for p in (tangent_p, cotangent_p, hessian_p, hessian_total_p, primal_tangent_p,
                          forward_p)}
# Which operand of each primitive is linear (tangent, cotangent, direction).
_LINEAR = {tangent_p: 3, cotangent_p: 3, hessian_p: 3, primal_tangent_p: 2}


def _vmapped(prim, axis_data, vals, dims, params):
    """create_vprim's rule (vmap of impl/jvp/transpose), with the linear operand
    broadcast to the batch first: the transpose of a batched linear map gives a batched
    cotangent, which vprim can only return for a batched operand (the broadcast's own
    transpose then sums it, as JAX's semantics require)."""
    if all(d is None for d in dims):
        out = prim.bind(*vals, **params)
        return out, [None] * len(out)
    if axis_data.size == 1:
        # A batch of one (jax.hessian of a scalar, jacrev of one output): no vmap of the
        # integrators (whose batching rule re-traces every nested loop).
        vals = [v if d is None else jnp.take(v, 0, axis=d) for v, d in zip(vals, dims)]
        out = prim.bind(*vals, **params)
        return [o[None] for o in out], [0] * len(out)
    counter = iter(range(len(vals)))
    flat_idx = [next(counter) if s is MISSING else None for s in params["static"]]
    tree_idx = jax.tree_util.tree_unflatten(params["treedef"], flat_idx)
    vals, dims = list(vals), list(dims)
    linear = tree_idx[_LINEAR[prim]] if prim in _LINEAR else None
    for i in jax.tree_util.tree_leaves(linear):
        if dims[i] is None:
            vals[i] = jnp.broadcast_to(vals[i], (axis_data.size,) + jnp.shape(vals[i]))
            dims[i] = 0
    return _vprim_rules[prim](axis_data, tuple(vals), tuple(dims), **params)


def _fold_directions(x, dims, b: int, ndir):
    """A batch (size b, axes `dims`) of an operand with `ndir` directions (None: one)
    as b·ndir directions of one run: (folded operand, new ndir)."""
    def to_front(v, d):
        return jnp.broadcast_to(v, (b,) + jnp.shape(v)) if d is None else jnp.moveaxis(v, d, 0)

    x = jax.tree_util.tree_map(to_front, x, dims)
    if ndir is None:
        return x, b
    return jax.tree_util.tree_map(lambda v: v.reshape((b * ndir,) + v.shape[2:]), x), b * ndir


def _unfold_directions(out, b: int, ndir):
    """The inverse of `_fold_directions` on a run's outputs (batch axis 0)."""
    if ndir is None:
        return out
    return jax.tree_util.tree_map(lambda v: v.reshape((b, ndir) + v.shape[1:]), out)


def _tangent_batch(axis_data, vals, dims, *, treedef, static, flatten):
    """A batch of tangents alone (`jacfwd`, `vmap` of `jvp` over tangents) becomes the
    directions of one sensitivity integration; anything else is vmapped (create_vprim)."""
    if all(d is None for d in dims):
        out = tangent_p.bind(*vals, treedef=treedef, static=static, flatten=flatten)
        return out, [None] * len(out)
    inputs_all = unflatten_operands(vals, static, treedef)
    dims_all = _dims_tree(dims, static, treedef)
    config_d, inputs_d, rec_d, t_d, _ = dims_all
    others = jax.tree_util.tree_leaves((config_d, inputs_d, rec_d))
    if any(d is not None for d in others):
        return _vmapped(tangent_p, axis_data, vals, dims,
                        dict(treedef=treedef, static=static, flatten=flatten))
    config, inputs, rec, t, ndir = inputs_all
    b = axis_data.size
    t, new_ndir = _fold_directions(t, t_d, b, ndir)
    out = filter_primitive_bind(tangent_p, config, inputs, rec, t, new_ndir)
    out = _unfold_directions(out, b, ndir)
    out_dims = jax.tree_util.tree_map(lambda _: 0, out)
    return flatten(out, out_dims)


def _primal_tangent_batch(axis_data, vals, dims, *, treedef, static, flatten):
    """A batch of tangents alone (`jacfwd`) becomes the directions of the one run (the
    primal stays unbatched); anything else is vmapped."""
    params = dict(treedef=treedef, static=static, flatten=flatten)
    if all(d is None for d in dims):
        out = primal_tangent_p.bind(*vals, **params)
        return out, [None] * len(out)
    config, inputs, t, ndir = unflatten_operands(vals, static, treedef)
    dims_all = _dims_tree(dims, static, treedef)
    if any(d is not None for d in jax.tree_util.tree_leaves(dims_all[:2])):
        # Batched primals: vmap the unfused form. (A vmapped fused run could not be
        # split again if JAX linearizes it later — `grad` of a vmapped, jitted solve
        # partially evaluates the vmapped jvp.)
        out = jax.vmap(lambda c, i, t_: _unfused(c, i, t_, ndir), in_axes=dims_all[:3],
                       axis_size=axis_data.size)(config, inputs, t)
        return flatten(out, jax.tree_util.tree_map(lambda _: 0, out))
    b = axis_data.size
    t, new_ndir = _fold_directions(t, dims_all[2], b, ndir)
    core, dots = filter_primitive_bind(primal_tangent_p, config, inputs, t, new_ndir)
    dots = _unfold_directions(dots, b, ndir)
    out_dims = (jax.tree_util.tree_map(lambda _: None, core),
                jax.tree_util.tree_map(lambda _: 0, dots))
    return flatten((core, dots), out_dims)


def _fold_batch(prim, linear: int):
    """A batch of the linear operand alone (`jacrev`: many cotangents; `jacfwd` over a
    Hessian-vector product: many directions) becomes `ndir` directions of one native
    integration (operand index `linear`, `ndir` the last operand); anything else is
    vmapped."""
    def rule(axis_data, vals, dims, *, treedef, static, flatten):
        if all(d is None for d in dims):
            out = prim.bind(*vals, treedef=treedef, static=static, flatten=flatten)
            return out, [None] * len(out)
        inputs_all = unflatten_operands(vals, static, treedef)
        dims_all = _dims_tree(dims, static, treedef)
        others = jax.tree_util.tree_leaves(dims_all[:linear] + dims_all[linear + 1:-1])
        if any(d is not None for d in others):
            return _vmapped(prim, axis_data, vals, dims,
                            dict(treedef=treedef, static=static, flatten=flatten))
        b = axis_data.size
        ndir = inputs_all[-1]
        lin, new_ndir = _fold_directions(inputs_all[linear], dims_all[linear], b, ndir)
        args = inputs_all[:linear] + (lin,) + inputs_all[linear + 1:-1] + (new_ndir,)
        out = _unfold_directions(filter_primitive_bind(prim, *args), b, ndir)
        return flatten(out, jax.tree_util.tree_map(lambda _: 0, out))
    return rule


def _fallback_batch(prim):
    def rule(axis_data, vals, dims, *, treedef, static, flatten):
        return _vmapped(prim, axis_data, vals, dims,
                        dict(treedef=treedef, static=static, flatten=flatten))
    return rule


def _shard_mapped(prim, rule):
    """`rule`, except for a batch along an explicitly sharded mesh axis (`jax.make_mesh`'s
    default): there each device integrates its own members, `shard_map` over that axis
    of a plain `vmap` over the device's members (which `rule` batches). The devices'
    loops are independent (no collective per step), and no integrator loop is batched
    along an explicitly sharded axis (JAX's batching of a `while_loop` there creates
    its carries unsharded and fails)."""
    def sharded_rule(axis_data, vals, dims, **params):
        axis = batch_explicit_axis(axis_data)
        if axis is None or all(d is None for d in dims):
            return rule(axis_data, vals, dims, **params)
        size = axis_data.size
        ref = next(v for v, d in zip(vals, dims) if d is not None)
        mesh = jax.typeof(ref).sharding.mesh
        names = axis if isinstance(axis, tuple) else (axis,)
        shards = math.prod(mesh.shape[a] for a in names)
        if size % shards:   # JAX refuses such shardings; a clear message if one slips by
            raise ValueError(
                f"daeadjoint: a batch of {size} members cannot be split evenly over the "
                f"{shards} devices of mesh axis {axis}.")
        spec = PartitionSpec(axis if len(names) > 1 else names[0])
        vals = [v if d is None else jnp.moveaxis(v, d, 0) for v, d in zip(vals, dims)]
        in_axes = [None if d is None else 0 for d in dims]

        def local(*vs):
            return jax.vmap(lambda *u: prim.bind(*u, **params), in_axes=in_axes)(*vs)

        out = jax.shard_map(
            local, mesh=mesh, in_specs=tuple(spec if d is not None else PartitionSpec()
                                             for d in dims),
            out_specs=spec, axis_names=set(names), check_vma=False)(*vals)
        return list(out), [0] * len(out)
    return sharded_rule


set_batching_rule(tangent_p, _shard_mapped(tangent_p, _tangent_batch))
set_batching_rule(primal_tangent_p, _shard_mapped(primal_tangent_p, _primal_tangent_batch))
set_batching_rule(cotangent_p, _shard_mapped(cotangent_p, _fold_batch(cotangent_p, 3)))
set_batching_rule(hessian_p, _shard_mapped(hessian_p, _fallback_batch(hessian_p)))
set_batching_rule(hessian_total_p, _shard_mapped(hessian_total_p, _fallback_batch(hessian_total_p)))
set_batching_rule(forward_p, _shard_mapped(forward_p, _fallback_batch(forward_p)))
