r"""Values that user functions close over, made inputs of the solve.

JAX users write models as closures: `lambda t, y, yp, a: yp + p * y` with `p` the
parameter being fitted. Under `jax.grad`, `jax.jacfwd` or `jax.vmap`, `p` is a tracer of
that transformation. The solve's derivatives are custom rules (`_derivatives/autodiff.py`) that see
only their explicit inputs, so a tracer hidden inside a function would either leak (an
error outside `jit`) or be treated as a constant — a derivative of zero, silently.

`lift_closures` traces every user function once (the residual, the quadrature, the
event condition, a user Jacobian, a preconditioner's setup and solve) and, when any of
them closes over tracers, rewrites the problem so that those tracers are ordinary leaves
of `args`:

    args  ↦  ClosureArgs(user=args, closures=(tracers of f₁, tracers of f₂, …))
    fᵢ    ↦  Lifted(jaxpr of fᵢ, slot i):  fᵢ(…, ClosureArgs) = jaxprᵢ(…, user; closuresᵢ)

Every derivative the solver computes with respect to `args` (forward sensitivities,
the adjoint's ∫ λᵀ F_p dt, the Hessian's augmented solves) and every batching rule then
covers the closed-over values too, in every transformation and order — the closure
conversion that `equinox.filter_closure_convert` and diffrax apply, adapted to functions
whose `args` the solver passes on. Values the function closes over that are not tracers
(NumPy arrays, concrete `jnp` arrays) stay constants of the program, as before.

The Jacobian and the preconditioner only steer the Newton iteration: the solution, and
so its derivatives, do not depend on what they close over. Their closed-over values are
lifted too (a tracer must not leak), behind `stop_gradient`.

When nothing closes over a tracer (the common case, and always for plain functions
without a closure) the problem is returned unchanged, so repeated calls with the same
functions keep reusing their compiled solve.
"""

import types
import weakref
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp


class ClosureArgs(eqx.Module):
    """`args` as the solver's internals see it once closures are lifted: the user's
    `args` and, per lifted function, the values it closed over (a list of arrays)."""

    user: Any
    closures: tuple


class _Identity:
    """Hashes and compares by identity (for constants kept as static data)."""

    def __init__(self, value):
        self.value = value


class Lifted(eqx.Module):
    """A user function as its jaxpr, whose closed-over tracers come from the
    `ClosureArgs` passed in place of `args` (the argument at position `args_at`), or are
    passed explicitly to `call` (a preconditioner's solve, which takes no `args`).

    Closed-over constants that are not tracers stay here (`constants`: static, compared
    by identity), with None where a lifted tracer goes."""

    jaxpr: Any = eqx.field(static=True)
    constants: _Identity = eqx.field(static=True)
    in_shapes: tuple = eqx.field(static=True)    # (shape, dtype) of each array input
    out_tree: Any = eqx.field(static=True)       # (treedef of array outputs, static outputs)
    slot: int = eqx.field(static=True)
    args_at: int | None = eqx.field(static=True)
    stop_gradient: bool = eqx.field(static=True, default=False)

    def __call__(self, *xs):
        ext = xs[self.args_at]
        if not isinstance(ext, ClosureArgs):
            raise TypeError("daeadjoint internal error: a function with lifted closures "
                            "was called without them.")
        # Positional inputs before args (t, y, y', cj) were traced as arrays.
        inputs = [jnp.asarray(x) for x in xs[:self.args_at]] + [ext.user]
        return self.call(inputs + list(xs[self.args_at + 1:]), ext.closures[self.slot])

    def call(self, inputs, lifted):
        if self.stop_gradient:
            lifted = jax.lax.stop_gradient(lifted)
        flat = [x for x in jax.tree_util.tree_leaves(inputs) if _is_traced(x)]
        if len(flat) != len(self.in_shapes) or any(
                jnp.shape(x) != shape for x, (shape, _) in zip(flat, self.in_shapes)):
            raise TypeError(
                "daeadjoint internal error: a function with lifted closures was called "
                f"with inputs of shapes {[jnp.shape(x) for x in flat]}; it was traced with "
                f"{[shape for shape, _ in self.in_shapes]}.")
        flat = [jnp.asarray(x, dtype) for x, (_, dtype) in zip(flat, self.in_shapes)]
        it = iter(lifted)
        consts = [next(it) if c is None else c for c in self.constants.value]
        out = jax.core.eval_jaxpr(self.jaxpr, consts, *flat)
        treedef, static = self.out_tree
        return eqx.combine(jax.tree_util.tree_unflatten(treedef, out), static.value)


class PassUserArgs(eqx.Module):
    """A function that closes over no tracer, in a problem whose `args` are
    `ClosureArgs` (another function's closures were lifted): it gets the user's args."""

    fn: Callable
    args_at: int = eqx.field(static=True)

    def __call__(self, *xs):
        xs = list(xs)
        xs[self.args_at] = xs[self.args_at].user
        return self.fn(*xs)


def _is_traced(x) -> bool:
    """The inputs `equinox.filter_make_jaxpr` traces (the rest is static)."""
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def _trace(fn: Callable, example: tuple, force: bool = False):
    """fn(*example) as (jaxpr, constants, input shapes, output structure, tracers), or
    None when fn closes over no tracer (and `force` is False)."""
    if not force and isinstance(fn, types.FunctionType) and fn.__closure__ is None:
        return None   # no closure: nothing but module globals, never a live tracer
    closed, out_struct, out_static = eqx.filter_make_jaxpr(fn)(*example)
    consts = list(closed.consts)
    is_tracer = [isinstance(c, jax.core.Tracer) for c in consts]
    if not (force or any(is_tracer)):
        return None
    in_shapes = tuple((tuple(x.shape), jnp.dtype(x.dtype))
                      for x in jax.tree_util.tree_leaves(example) if _is_traced(x))
    treedef = jax.tree_util.tree_structure(out_struct)
    constants = _Identity([None if tr else c for c, tr in zip(consts, is_tracer)])
    tracers = [c for c, tr in zip(consts, is_tracer) if tr]
    return closed.jaxpr, constants, in_shapes, (treedef, _Identity(out_static)), tracers


def _structs(x):
    """Example inputs for tracing: arrays as ShapeDtypeStructs, the rest as it is."""
    return jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a))
        if eqx.is_array(a) else a, x)


class _Lifter:
    """Collects the tracers of each lifted function, in slot order."""

    def __init__(self):
        self.closures = []

    def __call__(self, fn, example, args_at, stop_gradient=False, force=False):
        if fn is None:
            return None
        traced = _trace(fn, example, force)
        if traced is None:   # with other functions lifted, it still gets the user's args
            return fn if args_at is None else PassUserArgs(fn, args_at)
        jaxpr, constants, in_shapes, out_tree, tracers = traced
        self.closures.append(tracers)
        return Lifted(jaxpr, constants, in_shapes, out_tree, len(self.closures) - 1,
                      args_at, stop_gradient)


def lift_closures(residual, quadrature, event, linear_solver, y0, args):
    """The problem with every tracer that a user function closes over moved into `args`
    (module docstring). Returns (residual, quadrature, event, linear_solver, args),
    all unchanged when no function closes over a tracer."""
    t = jax.ShapeDtypeStruct((), y0.dtype)
    y = jax.ShapeDtypeStruct(y0.shape, y0.dtype)
    a = _structs(args)
    example, example_cj = (t, y, y, a), (t, y, y, t, a)
    lift = _Lifter()
    new_residual = lift(residual, example, 3)
    new_quadrature = lift(quadrature, example, 3)
    new_event = None if event is None else eqx.tree_at(
        lambda e: e.cond, event, lift(event.cond, example, 3))
    new_solver = _lift_solver(linear_solver, lift, example_cj)
    if not lift.closures:
        return residual, quadrature, event, linear_solver, args
    return (new_residual, new_quadrature, new_event, new_solver,
            ClosureArgs(user=args, closures=tuple(lift.closures)))


def _lift_solver(solver, lift: _Lifter, example_cj):
    """User Jacobians (`DenseLU(jac=...)`) and preconditioners anywhere in the linear
    solver's configuration, lifted behind stop_gradient."""
    from ._linalg.krylov import Preconditioner
    from ._linalg.linear_solver import DenseLU

    def replace(x):
        if isinstance(x, DenseLU) and x.jac is not None:
            return eqx.tree_at(lambda s: s.jac, x, lift(x.jac, example_cj, 4, stop_gradient=True))
        if isinstance(x, Preconditioner):
            return _lift_preconditioner(x, lift, example_cj)
        return x

    return jax.tree_util.tree_map(
        replace, solver, is_leaf=lambda x: isinstance(x, (DenseLU, Preconditioner)))


def _lift_preconditioner(pre, lift: _Lifter, example_cj):
    """A preconditioner's setup and solve. The solve takes no `args`: when it closes over
    tracers, the setup hands them on in its state, (user state, lifted values)."""
    setup = lift(pre.psetup, example_cj, 4, stop_gradient=True)
    state = _structs(eqx.filter_eval_shape(pre.psetup, *example_cj))
    example = (state, example_cj[1])
    flags = (False, True)
    if all(_trace(pre.psolve, (*example, f)) is None for f in flags):
        return eqx.tree_at(lambda p: p.psetup, pre, setup)
    solves = tuple(lift(pre.psolve, (*example, f), None, stop_gradient=True, force=True)
                   for f in flags)
    return eqx.tree_at(lambda p: (p.psetup, p.psolve), pre,
                       (_SetupHandingOn(setup, tuple(s.slot for s in solves)),
                        _SolveWithLifted(solves)))


class _SetupHandingOn(eqx.Module):
    """A preconditioner setup whose state also carries the values its solve closes
    over."""

    setup: Callable
    slots: tuple = eqx.field(static=True)

    def __call__(self, t, y, yp, cj, args):
        return self.setup(t, y, yp, cj, args), tuple(args.closures[s] for s in self.slots)


class _SolveWithLifted(eqx.Module):
    """A preconditioner solve on the state of `_SetupHandingOn`, traced once per value
    of its static flag `transpose`."""

    solves: tuple

    def __call__(self, state, r, transpose):
        user_state, lifted = state
        i = 1 if transpose else 0
        return self.solves[i].call([user_state, r], lifted[i])


# --------------------------------------------------------------- one trace per signature
# fn ↦ {(input structure, avals of the traced inputs, static inputs): ClosedJaxpr or
# None (not reusable)}. Weak: an entry lives as long as the user's function.
_JAXPRS: "weakref.WeakKeyDictionary[Callable, dict]" = weakref.WeakKeyDictionary()


class TracedOnce(eqx.Module):
    """A user function (the residual, the quadrature) traced once per signature.

    The solver evaluates the residual at many places of one program — at t0, in the
    Newton iteration, under `jax.jacfwd` for the iteration matrix, in the replays and
    adjoint steps of the backward pass — each time with inputs of the same shapes and
    dtypes. Calling the function itself would run the user's Python again at each
    place (its tracing time, once per place: for a large model the most of the solve's
    tracing). Here the first call
    with a signature records the function's jaxpr (`jax.make_jaxpr`) and every call
    is one call of a `jax.jit` that evaluates it (`jax.core.eval_jaxpr`): the same
    primitives with the same constants, in a nested jaxpr that is the same object at
    every call. JAX caches its derivatives and batchings by that object (its JVP,
    linearization, transpose and `vmap` are built once, not once per place) and lowers
    it once, as a function the program calls; XLA inlines those calls before it
    optimizes, so the compiled program computes the same values as before, bit for bit
    (Robertson's `grad`: 12 % fewer of JAX's Python calls in tracing and lowering).

    Not under a mesh (`jax.set_mesh`, `shard_map`): there the function runs at each use.
    The signature is the pytree structure of the inputs, the abstract value (shape,
    dtype, weak type) of each traced leaf (a JAX tracer), and every other leaf as it is
    (a Python number, None): those the function sees as constants, as before. A call
    with any other leaf (a concrete or NumPy array, an unhashable object) runs the
    function itself. Only plain Python functions are cached: they close over no tracer
    here (`lift_closures` has made those `Lifted`), so their jaxprs hold constants only
    and are valid in every trace. Equality and hashing are the function's, so that the
    compiled solve is reused for the same function as before."""

    fn: Callable

    def __call__(self, *xs):
        if not jax.sharding.get_abstract_mesh().empty:
            # Under a mesh (`jax.set_mesh`, inside `shard_map`) the jaxpr would carry the
            # shardings of the trace it was recorded in: replayed in another one (a
            # recording outside the solver's per-device `shard_map`, used inside it) its
            # values came out sharded on the batch axis inside the map, which JAX
            # rejects ("Closing over inputs to shard_map where the input is sharded on
            # `Explicit` axes"). There the function is run at each use, as before.
            return self.fn(*xs)
        leaves, treedef = jax.tree_util.tree_flatten(xs)
        key = []
        for x in leaves:
            if isinstance(x, jax.core.Tracer):
                key.append(jax.typeof(x))
            elif x is None or type(x) in (bool, int, float):
                key.append((type(x), x))
            else:
                return self.fn(*xs)
        key = (treedef, tuple(key))
        try:
            table = _JAXPRS.setdefault(self.fn, {})
        except TypeError:   # not weakly referenceable
            return self.fn(*xs)
        if key not in table:
            table[key] = _record(self.fn, treedef, leaves)
        entry = table[key]
        if entry is None:
            return self.fn(*xs)
        call, out_tree = entry
        dynamic = [x for x in leaves if isinstance(x, jax.core.Tracer)]
        return jax.tree_util.tree_unflatten(out_tree, call(*dynamic))


def _record(fn, treedef, leaves):
    """(fn at these inputs as a jitted function of its traced inputs, evaluating its
    ClosedJaxpr; output structure), or None when the jaxpr
    cannot stand in for fn: its inputs traced to other abstract values, a constant
    that is a tracer, or an output that is not an array. fn's own errors propagate, as
    from a direct call with these tracers."""
    traced = [isinstance(x, jax.core.Tracer) for x in leaves]
    avals = [jax.typeof(x) for x, tr in zip(leaves, traced) if tr]

    def flat_fn(*dyn):
        it = iter(dyn)
        full = [next(it) if tr else x for x, tr in zip(leaves, traced)]
        return fn(*jax.tree_util.tree_unflatten(treedef, full))

    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in avals]
    closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*structs)
    out_leaves, out_tree = jax.tree_util.tree_flatten(out_shape)
    if (list(closed.in_avals) != avals
            or any(isinstance(c, jax.core.Tracer) for c in closed.consts)
            or not all(isinstance(o, jax.ShapeDtypeStruct) for o in out_leaves)):
        return None

    def call(*dyn):
        return jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *dyn)

    call.__name__ = getattr(fn, "__name__", "fn")
    return jax.jit(call), out_tree


def traced_once(fn):
    """fn as a `TracedOnce` if it is a plain Python function; otherwise fn itself."""
    if isinstance(fn, types.FunctionType):
        return TracedOnce(fn)
    return fn
