r"""How JAX's transformations reach the solver: one derivative machinery for every order.

`solve_core(config, inputs)` is a `jax.custom_jvp`. Its tangent is the *linear* primitive
`tangent_p`,

    ẏ = L(x) ẋ,            impl: forward sensitivities (`forward_sensitivity.py`),

whose transpose is the primitive `cotangent_p`,

    x̄ = L(x)ᵀ ȳ,          impl: the reverse pass of `config.reverse` (the continuous
                           adjoint DAE, `adjoint.py`, or the discrete adjoint),

so `jax.jvp`/`jax.jacfwd`/`jax.linearize` run forward sensitivities and
`jax.grad`/`jax.vjp`/`jax.jacrev` (which JAX builds by transposing the linearization)
run the adjoint: JAX's own transformation picks the mode. Both primitives are made with
`equinox.internal`'s filtered primitives (as lineax builds `linear_solve`; every internal
of JAX and equinox used here comes from `_jax_internals.py`, which says why), batched by
`create_vprim` (vmap of their rules) — except that a batch of tangents alone (`jacfwd`)
is folded into the directions of one sensitivity integration (`batching.py`).

Pure forward mode. Under `jax.jvp`/`jax.jacfwd` the primal and its tangent come from
one integration, `primal_tangent_p` (the state with its sensitivities), instead of a
primal solve plus a second run re-integrating the state for `tangent_p`. When JAX
linearizes instead (`linearize`, `grad`), the tangents are unknowns of a partial
evaluation: then the primal solve and the linear `tangent_p` stay apart
(`being_linearized`; and `primal_tangent_p`'s partial-evaluation rule inlines that
unfused form where the solve sits inside a `jit` whose jaxpr JAX partially evaluates).

Higher orders. The derivatives of L and Lᵀ with respect to x come from the augmented DAE
(G) of `augmented.py`, solved by `solve_core` itself: with T(x, u) = (y(x), L(x) u) the
outputs of (G),

    d[L(x) ẋ]            = jvp of T's second output in (x, ẋ),
    d[L(x)ᵀ ȳ] (x ← x + ε δx, ȳ ← ȳ + ε δȳ)
                         = the cotangent of x of the vjp of T at (x, u = δx) with
                           cotangent (δȳ, ȳ); its cotangent of u is L(x)ᵀ ȳ itself,

the second line being the symmetry of second derivatives (forward over adjoint, IDAS
manual §6.2.8: one forward solve of (G) and one adjoint solve of (G)). Every derivative
of every order is thus a derivative of the continuous problem, each derived problem
integrated with its own error control; no step size or order is ever differentiated
(Eberhard & Bischof).
"""

import collections
import dataclasses
import functools as ft

import equinox as eqx
import jax
import jax.numpy as jnp

from .._consistency import consistent_values, initial_sensitivities
from .._core import Inputs, Tangents, run, run_forward, run_tangent
from .._events import event_tangents
from .._jax_internals import (UndefinedPrimal, being_linearized, create_vprim,
                              filter_primitive_bind, filter_primitive_def, filter_primitive_jvp,
                              filter_primitive_transpose, set_partial_eval_rule, shaped_array)
from .._results import RESULTS, succeeded
from .augmented import AugmentedSolver, augmented_quadrature, augmented_residual
from .forward_sensitivity import direction_scale, sensitivity_atol
from .tangents import (_differentiable_part, _full, _is_symbolic_zero, _nones_like, _restrict,
                       _wanted, _with_differentiable, _zero_tangent, input_tangents)

# ------------------------------------------------------------------------- the core


def solve_core(config, inputs: Inputs, record: bool = False):
    """The differentiable solve: Core (and, with `record`, the Record of the forward run
    for the reverse pass, whose tangent is zero).

    Every array (including any inside `config`, e.g. traced adjoint tolerances) is an
    explicit argument of the custom_jvp function: a closed-over tracer would leak."""
    dyn, static = eqx.partition((config, inputs), eqx.is_array)
    return _core_function(static, record)(dyn)


def _core_function(static, record: bool):
    @jax.custom_jvp
    def core(dyn):
        config, inputs = eqx.combine(dyn, static)
        if config.explicit_batch:
            out, rec = filter_primitive_bind(forward_p, config, inputs, record)
        else:
            out, rec = run_forward(config, inputs, record=record)
        _remember_core_shape(config, inputs, out)
        return (out, rec) if record else out

    def core_jvp(primals, tangents):
        (dyn,), (dyn_dot,) = primals, tangents
        config, inputs = eqx.combine(dyn, static)
        config_dot, inputs_dot = dyn_dot
        if any(not _is_symbolic_zero(x) and getattr(x, "dtype", None) != jax.dtypes.float0
               for x in jax.tree_util.tree_leaves(config_dot, is_leaf=_is_symbolic_zero)):
            raise ValueError(
                "daeadjoint: `solve` is not differentiable with respect to the solver's "
                "options (e.g. Adjoint(rtol=..., atol=...)): wrap them in "
                "jax.lax.stop_gradient.")
        t = input_tangents(inputs, inputs_dot)
        if not record and not config.dense and t is not None and not being_linearized(t):
            # Pure forward mode (jvp, jacfwd): the state and its sensitivities in one run.
            out, dots = filter_primitive_bind(primal_tangent_p, config, inputs, t, None)
            out_dot = jax.tree_util.tree_map(_zero_tangent, out)
            out_dot = eqx.tree_at(lambda c: (c.yd, c.qs, c.event_t, c.event_yd), out_dot, dots)
            return out, out_dot
        out, rec = _core_function(static, True)(dyn)
        out_dot = jax.tree_util.tree_map(_zero_tangent, out)
        if t is not None:
            dots = filter_primitive_bind(tangent_p, config, inputs, rec, t, None)
            out_dot = eqx.tree_at(lambda c: (c.yd, c.qs, c.event_t, c.event_yd), out_dot, dots)
        if record:
            return (out, rec), (out_dot, jax.tree_util.tree_map(_zero_tangent, rec))
        return out, out_dot

    core.defjvp(core_jvp, symbolic_zeros=True)
    return core


# ------------------------------------------- the primal run as a primitive (sharded batches)


def _forward_impl(config, inputs, record):
    return run_forward(config, inputs, record=record)


def _forward_abstract(config, inputs, record):
    def shaped(x):
        return shaped_array(x.shape, x.dtype) if isinstance(x, jax.ShapeDtypeStruct) else x

    def struct(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype) if isinstance(x, jax.core.ShapedArray) else x

    args = jax.tree_util.tree_map(struct, (config, inputs))
    out = eqx.filter_eval_shape(_forward_impl, *args, record)
    return jax.tree_util.tree_map(shaped, out)


def _forward_jvp(primals, tangents):
    raise NotImplementedError(
        "daeadjoint internal error: the primal run was differentiated directly; its "
        "derivatives come from the custom_jvp around it.")


def _forward_transpose(inputs_all, cts_out):
    raise NotImplementedError("daeadjoint internal error: the primal run is not linear.")


# The primal run (`run_forward`) as a primitive, used where `solve` runs under a `vmap`
# whose batch axis is an explicitly sharded mesh axis (`Config.explicit_batch`): its
# batching rule (`batching.py`) then splits the batch over the devices with `shard_map`
# and vmaps each device's part, instead of JAX vmapping the integrator's loops over an
# explicitly sharded axis. Elsewhere the run is traced inline (one trace fewer: this
# primitive's abstract evaluation traces the whole integrator once more).
forward_p = create_vprim(
    "daeadjoint_forward",
    filter_primitive_def(_forward_impl),
    filter_primitive_def(_forward_abstract),
    filter_primitive_jvp(_forward_jvp),
    filter_primitive_transpose(materialise_zeros=False)(_forward_transpose),
)


# --------------------------------------- pure forward mode: the primal and L(x) ẋ at once


def _unfused(config, inputs, t, ndir):
    """What `primal_tangent_p` computes, as two computations: the primal solve (with
    its record) and the linear tangent primitive — the form JAX can linearize."""
    out, rec = solve_core(config, inputs, record=True)
    return out, filter_primitive_bind(tangent_p, config, inputs, rec, t, ndir)


def _primal_tangent_impl(config, inputs, t, ndir):
    """(Core, (ẏd, q̇s, ṫ*, ẏd*)) from one integration carrying the sensitivities."""
    k = 1 if ndir is None else ndir
    tk = t if ndir is not None else jax.tree_util.tree_map(lambda x: x[None], t)
    core, _, (dots, result) = run(config, inputs, tangents=tk, k=k)
    dots = tuple(jnp.where(jnp.isfinite(d), d, 0.0) for d in dots)
    # The primal and its tangents come from this one run, so the tangents report its
    # failure themselves: `jax.jacfwd` (and a jvp whose primal is unused) discards the
    # primal, and under `jit` its error check goes with it — a failure of the run (e.g.
    # `singular_initial_sensitivity`, set at t0 before any step) would otherwise give
    # NaN derivatives with no error.
    dots = _flag_failure(config, result, RESULTS.successful, dots)
    if ndir is None:
        dots = tuple(d[0] for d in dots)
    return core, dots


def _primal_tangent_abstract(config, inputs, t, ndir):
    def shaped(x):
        return shaped_array(x.shape, x.dtype) if isinstance(x, jax.ShapeDtypeStruct) else x
    def struct(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype) if isinstance(x, jax.core.ShapedArray) else x
    core = _known_core_shape(config, inputs)
    if core is not None:
        # The fused run's Core is the primal run's (`run`: the same pytree), and its
        # tangent outputs have the shapes of the Core's yd, qs, event_t and event_yd with
        # a leading direction axis: no second trace of the integrator for the shapes.
        lead = () if ndir is None else (ndir,)
        dots = tuple(jax.ShapeDtypeStruct(lead + x.shape, x.dtype)
                     for x in (core.yd, core.qs, core.event_t, core.event_yd))
        return jax.tree_util.tree_map(shaped, (core, dots))
    args = jax.tree_util.tree_map(struct, (config, inputs, t))
    out = eqx.filter_eval_shape(_primal_tangent_impl, *args, ndir)
    return jax.tree_util.tree_map(shaped, out)


# The output shapes of the primal runs traced so far, by the static part and the shapes
# of (config, inputs): JAX traces the primal run (inside `solve`'s jit) before it
# differentiates it, so `_primal_tangent_abstract` finds its Core here instead of
# tracing the whole integrator once more only for the shapes of its outputs. Bounded:
# the keys hold the user's functions.
_CORE_SHAPES: "collections.OrderedDict" = collections.OrderedDict()
_CORE_SHAPES_MAX = 64


def _shape_key(config, inputs):
    """A hashable key of (config, inputs) up to the values of their arrays, or None."""
    leaves, tree = jax.tree_util.tree_flatten((config, inputs))
    key = (tree, tuple((tuple(x.shape), jnp.dtype(x.dtype)) if hasattr(x, "shape")
                       and hasattr(x, "dtype") else x for x in leaves))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _remember_core_shape(config, inputs, out):
    key = _shape_key(config, inputs)
    if key is None:
        return
    _CORE_SHAPES[key] = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if eqx.is_array(x) else x, out)
    _CORE_SHAPES.move_to_end(key)
    while len(_CORE_SHAPES) > _CORE_SHAPES_MAX:
        _CORE_SHAPES.popitem(last=False)


def _known_core_shape(config, inputs):
    key = _shape_key(config, inputs)
    return None if key is None else _CORE_SHAPES.get(key)


def _primal_tangent_jvp(primals, tangents):
    """Higher orders go through the unfused form (whose primitives have their rules)."""
    config, inputs, t, ndir = primals
    _, inputs_dot, t_dot, _ = tangents

    # Differentiate with respect to the leaves that have tangents only (the others, e.g.
    # t1 or saveat, must reach the core without any, not with zeros).
    def leaf_tangents(x, dx):   # dx: like x with None at leaves without a tangent
        tr = jax.tree_util.tree_structure(x)
        return [None] * tr.num_leaves if dx is None else tr.flatten_up_to(dx)

    leaves, tree = jax.tree_util.tree_flatten((inputs, t))
    dots = leaf_tangents(inputs, inputs_dot) + leaf_tangents(t, t_dot)
    live = [i for i, (x, d) in enumerate(zip(leaves, dots)) if d is not None and eqx.is_array(x)]

    def f(*xs):
        full = list(leaves)
        for i, x in zip(live, xs):
            full[i] = x
        inputs_, t_ = jax.tree_util.tree_unflatten(tree, full)
        return _unfused(config, inputs_, t_, ndir)

    out, out_dot = jax.jvp(f, tuple(leaves[i] for i in live), tuple(dots[i] for i in live))
    out_dot = jax.tree_util.tree_map(
        lambda d: None if getattr(d, "dtype", None) == jax.dtypes.float0 else d, out_dot)
    return out, out_dot


def _primal_tangent_transpose(inputs_all, cts_out):
    raise NotImplementedError(
        "daeadjoint internal error: the fused primal–tangent run was transposed; it is "
        "only used when JAX is not linearizing the solve.")


primal_tangent_p = create_vprim(
    "daeadjoint_primal_tangent",
    filter_primitive_def(_primal_tangent_impl),
    filter_primitive_def(_primal_tangent_abstract),
    filter_primitive_jvp(_primal_tangent_jvp),
    filter_primitive_transpose(materialise_zeros=False)(_primal_tangent_transpose),
)


# Partial evaluation (a linearization `being_linearized` could not see: a solve in a
# `jit` whose jvp JAX partially evaluates): inline the unfused form, whose primal part is
# known and whose tangent part is the linear `tangent_p`.
set_partial_eval_rule(primal_tangent_p, _unfused)


# ------------------------------------------------------- the augmented system T(x, u)


def augmented(config, inputs: Inputs, u: Tangents, rec=None):
    """T(x, u) = ((yd, qs), (L(x) u)) from one solve of the augmented DAE (G) (see the
    module docstring), differentiable in `inputs`' differentiable part and in `u` (one
    direction, all parts present). `rec`: the primal run's Record at these inputs, whose
    consistent initial values are then those of (G)'s start (`consistent_values`'
    `known`: the same values and derivatives, one Newton loop fewer in the program)."""
    if config.index2:
        raise ValueError(INDEX2_SECOND_ORDER_MESSAGE)
    n = inputs.y0.shape[0]
    known = None if rec is None else (rec.y0, rec.yp0)
    y0, yp0, _, _ = consistent_values(config, inputs, known=known)
    one = jax.tree_util.tree_map(lambda x: x[None], u)
    s0, sp0, qs0, _, _ = initial_sensitivities(config, inputs, y0, yp0, one, 1)
    s0, sp0, qs0 = s0[0], sp0[0], qs0[0]
    # Tolerances of s as in a forward-sensitivity run (not differentiated).
    pairs = [(u.y0, inputs.y0), (u.yp0, inputs.yp0)] + list(zip(
        jax.tree_util.tree_leaves(u.args),
        jax.tree_util.tree_leaves(eqx.filter(inputs.args, eqx.is_inexact_array))))
    nu = jax.lax.stop_gradient(direction_scale(
        [d[None] for d, _ in pairs], [v for _, v in pairs], y0, yp0, u.t0[None]))
    atol_s = jax.lax.stop_gradient(sensitivity_atol(jnp.broadcast_to(inputs.atol, (n,)), nu)[0])
    qatol_s = jax.lax.stop_gradient(sensitivity_atol(inputs.quad_atol, nu)[0])
    g_event = None
    if config.event is not None:
        cond = config.event.cond
        g_event = dataclasses.replace(
            config.event, cond=lambda t, Y, Yp, a: cond(t, Y[:n], Yp[:n], a[0]))
    g_config = dataclasses.replace(
        config, residual=augmented_residual(config.residual, n),
        quadrature=augmented_quadrature(config.quadrature, n),
        linear_solver=AugmentedSolver(config.linear_solver, n), init=None, event=g_event)
    g_inputs = Inputs(
        t0=inputs.t0, t1=inputs.t1, y0=jnp.concatenate([y0, s0]),
        yp0=jnp.concatenate([yp0, sp0]), args=(inputs.args, u.args), saveat=inputs.saveat,
        algebraic=jnp.concatenate([inputs.algebraic, inputs.algebraic]), rtol=inputs.rtol,
        atol=jnp.concatenate([jnp.broadcast_to(inputs.atol, (n,)), atol_s]),
        quad_rtol=inputs.quad_rtol, quad_atol=jnp.concatenate([inputs.quad_atol, qatol_s]),
        tstop=inputs.tstop, breakpoints=inputs.breakpoints)
    out = solve_core(g_config, g_inputs)
    nq = inputs.quad_atol.shape[0]
    primal = (out.yd[..., :n], out.qs[:, :nq], out.event_t, out.event_yd[..., :n])
    tangent = (out.yd[..., n:], out.qs[:, nq:] + qs0[None])
    if config.event is None:
        tangent = tangent + (jnp.zeros_like(out.event_t), out.event_yd[..., n:])
    else:
        t_dot, yd_dot = event_tangents(config.event, inputs.args, out.event_t, out.event_mask,
                                       out.event_yd[..., :n], out.event_yd[:, None, :, n:],
                                       jax.tree_util.tree_map(lambda x: x[None], u.args))
        tangent = tangent + (t_dot[0], yd_dot[0])
    return primal, tangent, out.result


# ------------------------------------------------------ the tangent primitive L(x) ẋ


def _tangent_impl(config, inputs, rec, t, ndir):
    """(ẏd, q̇s, ṫ*, ẏd*) — tangents of the dense output, quadratures and event roots."""
    k = 1 if ndir is None else ndir
    tk = t if ndir is not None else jax.tree_util.tree_map(lambda x: x[None], t)
    # The recorded primal run (same config and inputs) has the consistent initial values
    # already: its (y0, y'0) instead of a second consistent initialization (a Newton
    # loop: ~65 kernels of a Hessian's program). A primal run that failed makes this
    # one fail at its start; its derivatives are NaN either way (`_flag_failure`).
    dots, result = run_tangent(config, inputs, tk, k,
                               consistent=(rec.y0, rec.yp0, succeeded(rec.result)))
    # Rows a terminal event left unreached (inf) carry no derivative.
    dots = tuple(jnp.where(jnp.isfinite(d), d, 0.0) for d in dots)
    dots = _flag_failure(config, result, rec.result, dots)
    if ndir is None:
        return tuple(d[0] for d in dots)
    return dots


def _flag_failure(config, result, primal_result, outs):
    """Derivatives of a failed derived run, or of a failed primal solve: NaN (with
    `throw`, an error naming why). The primal solve's failure is raised here as well as
    by its own outputs: under `jit`, a program that returns only derivatives
    (`jax.jit(jax.grad(f))`) drops the primal outputs and their check with them, and the
    failure would be a silent NaN. A run that fails the run-time input checks (t1 <= t0,
    non-finite or unsorted times, ...) gets NaN without an error here: its inputs may be
    placeholders no solve was meant to run on — e.g. the zero-filled Jacobian that
    optimistix's Gauss–Newton/Levenberg–Marquardt evaluate in their first step and
    discard; the primal solve's own check reports them where its outputs are used."""
    bad = ~succeeded(result) & succeeded(primal_result) & ~_input_failure(result)
    failed = ~succeeded(result) | ~succeeded(primal_result)
    outs = jax.tree_util.tree_map(lambda x: jnp.where(failed, jnp.nan, x), outs)
    if config.throw:
        # One check for both (a failed primal makes `bad` false): the derived run's
        # failure, else the primal's.
        bad_primal = ~succeeded(primal_result) & ~_input_failure(primal_result)
        outs = RESULTS.where(bad, result, primal_result).error_if(outs, bad | bad_primal)
    return outs


def _input_failure(result):
    bad = jnp.zeros((), bool)
    for r in (RESULTS.nonfinite_input, RESULTS.invalid_interval, RESULTS.invalid_saveat,
              RESULTS.invalid_tolerance, RESULTS.invalid_tstop):
        bad = bad | (result == r)
    return bad


def _tangent_abstract(config, inputs, rec, t, ndir):
    n = inputs.y0.shape[0]
    nq = inputs.quad_atol.shape[0]
    lead = () if ndir is None else (ndir,)
    dtype = inputs.y0.dtype
    m = inputs.saveat.shape[0]
    R = 0 if config.event is None else config.event.n_roots
    return (shaped_array(lead + (m, config.order + 1, n), dtype),
            shaped_array(lead + (m, nq), dtype),
            shaped_array(lead + (R,), dtype),
            shaped_array(lead + (R, config.order + 2, n), dtype))


def _tangent_jvp(primals, tangents):
    config, inputs, rec, t, ndir = primals
    _, inputs_dot, _, t_dot, _ = tangents
    x_dot = None if inputs_dot is None else input_tangents(inputs, inputs_dot)
    t_dot = _tangents_or_none(t_dot)
    if x_dot is None:
        out = filter_primitive_bind(tangent_p, config, inputs, rec, t, ndir)
        if t_dot is None:
            return out, None
        t_dot = _restrict(_full(inputs, t_dot, _lead(ndir)), _wanted(t))
        return out, filter_primitive_bind(tangent_p, config, inputs, rec, t_dot, ndir)
    if config.index2:
        raise ValueError(INDEX2_SECOND_ORDER_MESSAGE)
    xd = _differentiable_part(inputs)
    xd_dot = _full(inputs, x_dot)
    xd_dot = (xd_dot.t0, xd_dot.y0, xd_dot.yp0, xd_dot.args)
    lead = _lead(ndir)
    u = _full(inputs, t, lead)
    u_dot = _full(inputs, t_dot, lead)

    def S(xd_, u_):
        return augmented(config, _with_differentiable(inputs, xd_), u_)[1]

    def one(u_, ud_):
        return jax.jvp(S, (xd, u_), (xd_dot, ud_))

    if ndir is None:
        return one(u, u_dot)
    return jax.vmap(one)(u, u_dot)


def _lead(ndir):
    return () if ndir is None else (ndir,)


def _tangents_or_none(t):
    if t is None:
        return None
    if all(getattr(t, f) is None for f in ("t0", "y0", "yp0", "args")):
        return None
    return t


def _only_linear(operand, cot):
    """Cotangents for the leaves of `operand` that are linear (UndefinedPrimal) only:
    JAX allows none for the defined ones (e.g. zeros a JVP rule materialized)."""
    return jax.tree_util.tree_map(
        lambda o, c: c if isinstance(o, UndefinedPrimal) else None,
        operand, cot, is_leaf=lambda x: isinstance(x, UndefinedPrimal))


def _linear_fields(t) -> Tangents:
    """Marker of the fields of `t` with at least one linear (UndefinedPrimal) leaf."""
    def linear(x):
        return any(isinstance(v, UndefinedPrimal)
                   for v in jax.tree_util.tree_leaves(
                       x, is_leaf=lambda v: isinstance(v, UndefinedPrimal)))
    return Tangents(**{f: (True if getattr(t, f) is not None and linear(getattr(t, f)) else None)
                       for f in ("t0", "y0", "yp0", "args")})


INDEX2_SECOND_ORDER_MESSAGE = (
    "daeadjoint: second-order derivatives (Hessians, jvp of grad, jacfwd of jacfwd, ...) "
    "of a solve with `index2=` are not supported (the augmented sensitivity DAE is not "
    "declared index 2). First-order derivatives work: jax.jvp/jax.jacfwd (forward "
    "sensitivities) and jax.grad/jax.jacrev (sensitivity=DiscreteAdjoint() or Adjoint()).")

def _tangent_transpose(inputs_all, cts_out):
    config, inputs, rec, t, ndir = inputs_all
    wanted = _linear_fields(t)
    shapes = _tangent_abstract(config, inputs, rec, t, ndir)
    cts = tuple(jnp.zeros(sh.shape, sh.dtype) if c is None else c
                for c, sh in zip(cts_out, shapes))
    cot = filter_primitive_bind(cotangent_p, config, inputs, rec, cts, wanted, ndir)
    cot = Tangents(**{f: (None if getattr(t, f) is None else _only_linear(getattr(t, f), getattr(cot, f)))
                      for f in ("t0", "y0", "yp0", "args")})
    return _nones_like(config), _nones_like(inputs), _nones_like(rec), cot, None


tangent_p = create_vprim(
    "daeadjoint_tangent",
    filter_primitive_def(_tangent_impl),
    filter_primitive_def(_tangent_abstract),
    filter_primitive_jvp(_tangent_jvp),
    filter_primitive_transpose(materialise_zeros=False)(_tangent_transpose),
)


# ---------------------------------------------------- the cotangent primitive L(x)ᵀ ȳ


def _cotangent_impl(config, inputs, rec, ct, wanted, ndir):
    """The reverse pass; a batch of cotangents (ndir) shares one backward integration."""
    ctk = ct if ndir is not None else jax.tree_util.tree_map(lambda x: x[None], ct)
    out, result = config.reverse.backward(config, inputs, rec, ctk, wanted)
    out = _flag_failure(config, result, rec.result, out)
    # Each cotangent in its input's dtype (the backward pass works in the state's: a
    # float32 parameter of a float64 solve got a float64 cotangent, which XLA refused).
    like = _restrict(_full(inputs, None), wanted)
    out = jax.tree_util.tree_map(lambda o, x: o.astype(jnp.result_type(x)), out, like)
    if ndir is None:
        return jax.tree_util.tree_map(lambda x: x[0], out)
    return out


def _cotangent_abstract(config, inputs, rec, ct, wanted, ndir):
    lead = _lead(ndir)
    # Traced, not evaluated: abstract evaluation may run inside a `shard_map` (a
    # sharded batch), where JAX cannot place concrete arrays.
    full = jax.eval_shape(lambda: _full(inputs, None))
    shape = lambda x: shaped_array(lead + jnp.shape(x), jnp.result_type(x))  # noqa: E731
    return _restrict(jax.tree_util.tree_map(shape, full), wanted)


def _cotangent_jvp(primals, tangents):
    """d[L(x)ᵀ ȳ] = L(x)ᵀ δȳ + H(x, ȳ) δx, with H(x, ȳ) the Hessian of ⟨ȳ, y(x)⟩
    (`hessian_p`, forward over adjoint). The primal output is the plain adjoint, so
    primal and tangent stay separate computations (as reverse-over-reverse needs)."""
    config, inputs, rec, ct, wanted, ndir = primals
    _, inputs_dot, _, ct_dot, _, _ = tangents
    x_dot = None if inputs_dot is None else input_tangents(inputs, inputs_dot)
    out = filter_primitive_bind(cotangent_p, config, inputs, rec, ct, wanted, ndir)
    out_dot = None
    has_ct_dot = ct_dot is not None and any(c is not None for c in ct_dot)
    if has_ct_dot:
        ct_dot = tuple(jnp.zeros_like(c) if d is None else d for c, d in zip(ct, ct_dot))
    if (has_ct_dot and x_dot is not None and not config.index2
            and not being_linearized((ct_dot, x_dot))):
        # Forward over reverse (`jax.hessian`, `jacfwd(jacrev)`): both terms from one
        # augmented adjoint solve (`hessian_total_p`) instead of a second adjoint pass.
        return out, filter_primitive_bind(hessian_total_p, config, inputs, rec, ct, ct_dot,
                                          x_dot, wanted, ndir)
    if has_ct_dot:
        out_dot = filter_primitive_bind(cotangent_p, config, inputs, rec, ct_dot, wanted, ndir)
    if x_dot is not None:
        if config.index2:
            raise ValueError(INDEX2_SECOND_ORDER_MESSAGE)
        h = filter_primitive_bind(hessian_p, config, inputs, ct, x_dot, wanted, ndir)
        out_dot = h if out_dot is None else jax.tree_util.tree_map(jnp.add, out_dot, h)
    return out, out_dot


def _cotangent_transpose(inputs_all, cts_out):
    config, inputs, rec, ct, wanted, ndir = inputs_all
    t = _tangents_or_none(cts_out)
    nones = (_nones_like(config), _nones_like(inputs), _nones_like(rec))
    if t is None:
        return (*nones, _nones_like(ct), _nones_like(wanted), None)
    t = _restrict(_full(inputs, t, _lead(ndir)), wanted)
    out = filter_primitive_bind(tangent_p, config, inputs, rec, t, ndir)
    out = tuple(o if isinstance(c, UndefinedPrimal) else None
                for o, c in zip(out, ct))
    return (*nones, out, _nones_like(wanted), None)


cotangent_p = create_vprim(
    "daeadjoint_cotangent",
    filter_primitive_def(_cotangent_impl),
    filter_primitive_def(_cotangent_abstract),
    filter_primitive_jvp(_cotangent_jvp),
    filter_primitive_transpose(materialise_zeros=False)(_cotangent_transpose),
)


# ------------------------------------------------ the Hessian primitive H(x, ȳ) δx


def _hessian_value(config, inputs, ct, x_dot, wanted):
    """H(x, ȳ) δx = ∂_x ⟨ȳ, L(x) δx⟩: the vjp with respect to x of T's second output at
    u = δx — one forward and one adjoint solve of the augmented DAE (G)."""
    xd = _differentiable_part(inputs)
    u = _full(inputs, x_dot)

    def S(xd_):
        return augmented(config, _with_differentiable(inputs, xd_), u)[1]

    _, vjp = jax.vjp(S, xd)
    (xbar,) = vjp(ct)
    xbar = Tangents(t0=xbar[0], y0=xbar[1], yp0=xbar[2], args=xbar[3])
    return _restrict(xbar, wanted)


def _hessian_total_value(config, inputs, rec, ct, ct_dot, x_dot, wanted):
    """L(x)ᵀ δȳ + H(x, ȳ) δx = ∂_x [⟨δȳ, y(x)⟩ + ⟨ȳ, L(x) δx⟩]: the vjp with respect to x
    of both outputs of T at u = δx with cotangent (δȳ, ȳ) (the module docstring) — one
    forward and one adjoint solve of the augmented DAE (G), whose adjoint carries the
    first-order term too, where `cotangent_p` + `hessian_p` would run a second adjoint
    pass (of the plain DAE) for L(x)ᵀ δȳ."""
    xd = _differentiable_part(inputs)
    u = _full(inputs, x_dot)

    def T(xd_):
        primal, tangent, _ = augmented(config, _with_differentiable(inputs, xd_), u, rec)
        return primal, tangent

    _, vjp = jax.vjp(T, xd)
    (xbar,) = vjp((ct_dot, ct))
    xbar = Tangents(t0=xbar[0], y0=xbar[1], yp0=xbar[2], args=xbar[3])
    return _restrict(xbar, wanted)


def _hessian_total_impl(config, inputs, rec, ct, ct_dot, x_dot, wanted, ndir):
    if ndir is None:
        return _hessian_total_value(config, inputs, rec, ct, ct_dot, x_dot, wanted)
    return jax.vmap(lambda c, cd: _hessian_total_value(config, inputs, rec, c, cd, x_dot,
                                                       wanted))(ct, ct_dot)


def _hessian_total_abstract(config, inputs, rec, ct, ct_dot, x_dot, wanted, ndir):
    return _cotangent_abstract(config, inputs, None, ct, wanted, ndir)


def _hessian_total_unfused(config, inputs, rec, ct, ct_dot, x_dot, wanted, ndir):
    """What `hessian_total_p` computes, as `cotangent_p` (L(x)ᵀ δȳ) plus `hessian_p`
    (H(x, ȳ) δx): the form with transposition and higher-order rules."""
    a = filter_primitive_bind(cotangent_p, config, inputs, rec, ct_dot, wanted, ndir)
    h = filter_primitive_bind(hessian_p, config, inputs, ct, x_dot, wanted, ndir)
    return jax.tree_util.tree_map(jnp.add, a, h)


def _hessian_total_jvp(primals, tangents):
    """Third order: through the unfused form (whose primitives have their rules)."""
    config, _, _, _, _, _, wanted, ndir = primals
    live_primals = primals[1:6]
    live_tangents = tangents[1:6]

    def leaf_tangents(x, dx):
        tr = jax.tree_util.tree_structure(x)
        return [None] * tr.num_leaves if dx is None else tr.flatten_up_to(dx)

    leaves, tree = jax.tree_util.tree_flatten(live_primals)
    dots = [d for x, dx in zip(live_primals, live_tangents) for d in leaf_tangents(x, dx)]
    live = [i for i, (x, d) in enumerate(zip(leaves, dots)) if d is not None and eqx.is_array(x)]

    def f(*xs):
        full = list(leaves)
        for i, x in zip(live, xs):
            full[i] = x
        return _hessian_total_unfused(config, *jax.tree_util.tree_unflatten(tree, full),
                                      wanted, ndir)

    return jax.jvp(f, tuple(leaves[i] for i in live), tuple(dots[i] for i in live))


def _hessian_total_transpose(inputs_all, cts_out):
    raise NotImplementedError(
        "daeadjoint internal error: the fused forward-over-reverse term was transposed; "
        "it is only used when JAX is not linearizing the reverse pass.")


def _hessian_impl(config, inputs, ct, x_dot, wanted, ndir):
    if ndir is None:
        return _hessian_value(config, inputs, ct, x_dot, wanted)
    return jax.vmap(lambda c: _hessian_value(config, inputs, c, x_dot, wanted))(ct)


def _hessian_abstract(config, inputs, ct, x_dot, wanted, ndir):
    return _cotangent_abstract(config, inputs, None, ct, wanted, ndir)


def _hessian_jvp(primals, tangents):
    """Third order: forward mode through the (custom_jvp) augmented solves; the tangent
    in δx is H itself (linear)."""
    config, inputs, ct, x_dot, wanted, ndir = primals
    _, inputs_dot, ct_dot, x_dot_dot, _, _ = tangents
    x2 = None if inputs_dot is None else input_tangents(inputs, inputs_dot)
    out = filter_primitive_bind(hessian_p, config, inputs, ct, x_dot, wanted, ndir)
    terms = []
    if x_dot_dot is not None and _tangents_or_none(x_dot_dot) is not None:
        xdd = _restrict(_full(inputs, x_dot_dot), _wanted(x_dot))
        terms.append(filter_primitive_bind(hessian_p, config, inputs, ct, xdd, wanted, ndir))
    if x2 is not None or (ct_dot is not None and any(c is not None for c in ct_dot)):
        ctd = (jax.tree_util.tree_map(jnp.zeros_like, ct) if ct_dot is None else
               tuple(jnp.zeros_like(c) if d is None else d for c, d in zip(ct, ct_dot)))
        xd = _differentiable_part(inputs)
        xd2 = _full(inputs, x2)
        xd2 = (xd2.t0, xd2.y0, xd2.yp0, xd2.args)

        def value(xd_, c):
            return _hessian_impl(config, _with_differentiable(inputs, xd_), c, x_dot, wanted, ndir)

        terms.append(jax.jvp(value, (xd, ct), (xd2, ctd))[1])
    if not terms:
        return out, None
    return out, ft.reduce(lambda a, b: jax.tree_util.tree_map(jnp.add, a, b), terms)


def _hessian_transpose(inputs_all, cts_out):
    """H(x, ȳ) is symmetric (a Hessian), so its transpose in δx is itself."""
    config, inputs, ct, x_dot, wanted, ndir = inputs_all
    w = _tangents_or_none(cts_out)
    nones = (_nones_like(config), _nones_like(inputs), _nones_like(ct))
    if w is None:
        return (*nones, _nones_like(x_dot), _nones_like(wanted), None)
    fields = _linear_fields(x_dot)
    if ndir is None:
        w = _full(inputs, w)
        out = filter_primitive_bind(hessian_p, config, inputs, ct, w, fields, None)
    else:
        # A batch of cotangents ȳ_i shares δx: the transpose is Σ_i H(x, ȳ_i) w_i
        # (`jacrev` of `jacrev`, whose inner cotangents were folded into ndir).
        w = _full(inputs, w, (ndir,))
        outs = jax.vmap(lambda c, wi: filter_primitive_bind(
            hessian_p, config, inputs, c, wi, fields, None))(ct, w)
        out = jax.tree_util.tree_map(lambda x: jnp.sum(x, axis=0), outs)
    out = Tangents(**{f: (None if getattr(x_dot, f) is None else _only_linear(getattr(x_dot, f), getattr(out, f)))
                      for f in ("t0", "y0", "yp0", "args")})
    return (*nones, out, _nones_like(wanted), None)


hessian_p = create_vprim(
    "daeadjoint_hessian",
    filter_primitive_def(_hessian_impl),
    filter_primitive_def(_hessian_abstract),
    filter_primitive_jvp(_hessian_jvp),
    filter_primitive_transpose(materialise_zeros=False)(_hessian_transpose),
)


hessian_total_p = create_vprim(
    "daeadjoint_hessian_total",
    filter_primitive_def(_hessian_total_impl),
    filter_primitive_def(_hessian_total_abstract),
    filter_primitive_jvp(_hessian_total_jvp),
    filter_primitive_transpose(materialise_zeros=False)(_hessian_total_transpose),
)
# Partial evaluation (a linearization `being_linearized` could not see): the unfused
# form, whose primitives JAX can transpose.
set_partial_eval_rule(hessian_total_p, _hessian_total_unfused)
