r"""`solve(..., delays=..., history=...)`: constant-lag delay DAEs

    F(t, y(t), y'(t), [y(t − τ₁), …, y(t − τ_m)], args) = 0,   t0 ≤ t ≤ t1,
    y(t) = h(t, args)  for t ≤ t0,

integrated by the same BDF (`_integrator.py`), with the lagged values from its own
interpolating polynomials (`buffer.py`), and differentiated in forward mode by the
variational (forward-sensitivity) system of the delay equation.

Discontinuities. Where the history meets the solution, at t0, y' jumps in general (for a
constant history y'(t0⁻) = 0 while y'(t0⁺) = f(t0, …)). A lag τᵢ carries that jump to
t0 + τᵢ, one derivative higher for a retarded equation (y'' jumps there), and so on:
derivatives of y jump at the breaking points t0 + Σ kᵢτᵢ, the derivative of order 1 + Σ kᵢ
(Calver & Enright, §2.3.1). A BDF step of order k needs y ∈ C^{k+1} inside the step, so
the breaking points with Σ kᵢ ≤ `breakpoint_order` (default the maximum BDF order, 5)
are made breakpoints of the integration (`solve(breakpoints=...)`): steps end exactly on
them and the BDF restarts there at order 1. Smaller lags than the step are excluded by
step restriction: every step is at most min τᵢ, so t − τᵢ always lies in a completed
step or in the history (no extrapolation of the step being solved for).

Forward mode. With p the differentiable inputs (args, the lags, the history, y0) and one
tangent direction ṗ, s = dy/dp·ṗ solves the variational delay DAE (Calver & Enright,
eq. (20) and its multi-delay form)

    F_y s + F_y' s' + Σᵢ F_{νᵢ} (s(t − τᵢ) − y'(t − τᵢ) τ̇ᵢ) + F_p ṗ = 0,
    s(t) = h_p(t) ṗ for t ≤ t0,

whose −y'(t − τᵢ)τ̇ᵢ term is the derivative of the lag's position. `jax.jvp` /
`jax.jacfwd` solve it together with y as one delay DAE of size 2n per direction, with its
own error control (as IDAS's full error control: its y agrees with the plain solve's
within the tolerances). The step sequence is never differentiated (Eberhard & Bischof):
the derivative is that of the continuous problem.

Reverse mode. When JAX linearizes (`grad`, `vjp`), the tangent is either
- (`sensitivity=ForwardSensitivity()`) J·ṗ with J from one integration of the
  variational system carrying all N input directions (Y of size n(1 + N)), so that what
  JAX transposes is a product: correct, at a cost growing with N; or
- (`sensitivity=Adjoint()`) the linear primitive `delay_tangent_p`, whose transpose is
  the continuous adjoint (Calver & Enright §2.3, `adjoint.py`): a second forward run
  keeping its interpolants (or checkpoints to recompute them, `checkpoint.py`) and one
  backward delay solve of size n with an N-vector
  quadrature, for index-0 equations. A cotangent on `yps` or on quadratures is
  transposed through the variational Jacobian instead (correct, at its cost).
`sensitivity=None` takes the adjoint above `ADJOINT_MIN_INPUTS` input components with at
most `ADJOINT_MAX_OBSERVATIONS` output times (and without quadratures or algebraic
components).
"""

import inspect
import itertools
import types
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from .._jax_internals import (UndefinedPrimal, being_linearized, create_vprim,
                              filter_primitive_bind, filter_primitive_def, filter_primitive_jvp,
                              filter_primitive_transpose, nondifferentiable_backward,
                              shaped_array)
from .._validation import _concrete
from .buffer import DelayArgs, DelayBuffer, delay_residual

# Options of `solve` that a delay DAE does not support yet (name: why).
UNSUPPORTED = {
    "event": "events of a delay DAE",
    "index2": "index-2 delay DAEs",
    "dense": "dense output of a delay DAE",
    "steps": "the step sequence of a delay DAE",
    "forward_sensitivity": "forward-sensitivity options for a delay DAE",
}
DEFAULT_HISTORY_STEPS = 1000
# With sensitivity=None, reverse mode uses the continuous adjoint above this many input
# components (args, lags, history and y0 together), the variational system otherwise.
ADJOINT_MIN_INPUTS = 16
# ... and at most this many output times: the backward solve restarts at every
# observation (and at its shifts by the lags), so its cost grows with their number, while
# the variational route reads outputs off the dense output. Kermack–McKendrick
# (benchmarks/delays.py --gradient-scaling, docs/delays.md): at 10 outputs the adjoint
# is about even at ~31 input components (1.1 s against 0.9 s) and the cheaper at 71 (1.5
# s against 3.1 s); at 100 outputs it costs 3.2 s against 0.41 s for the variational
# route at 11 components (which grows about linearly in them); at 1000 outputs 18.9 s
# against 0.20 s.
ADJOINT_MAX_OBSERVATIONS = 32


# --------------------------------------------------------------------- parameters


class Params(eqx.Module):
    """Everything the delay model depends on, as one pytree: the user's args, the
    constant history value (None with a history function), the lags when given as an
    array (None when `delays` is a function of args), and the residual / history
    functions when they close over traced values (closure-converted, so that those
    values are inputs; None otherwise)."""

    args: Any
    y_hist: Any
    tau_given: Any
    residual: Any
    history: Any
    quadrature: Any = None


class Model(eqx.Module):
    """The user's functions (static) with `Params` supplying the arrays."""

    residual: Callable = eqx.field(static=True)
    history: Callable | None = eqx.field(static=True)
    delays: Callable | None = eqx.field(static=True)
    quadrature: Callable | None = eqx.field(static=True, default=None)

    def F(self, p: Params):
        return self.residual if p.residual is None else p.residual

    def h(self, t, p: Params):
        if self.history is None:
            return p.y_hist
        fn = self.history if p.history is None else p.history
        return fn(t, p.args)

    def tau(self, p: Params):
        return p.tau_given if self.delays is None else _as_lags(self.delays(p.args))

    def primal(self, t, y, yp, lag, p: Params):
        return self.F(p)(t, y, yp, lag, p.args)

    def quad(self, t, y, yp, p: Params):
        fn = self.quadrature if p.quadrature is None else p.quadrature
        assert fn is not None   # only called when a quadrature was given
        return fn(t, y, yp, p.args)


class DelayQuadrature(eqx.Module):
    """q(t, y, y', args) as the core calls it, with `DelayArgs` (the user's
    quadrature sees no lagged values)."""

    model: Model = eqx.field(static=True)

    def __call__(self, t, y, yp, a: DelayArgs):
        return self.model.quad(t, y, yp, a.user)


def _as_lags(tau):
    tau = jnp.asarray(tau)
    return tau.reshape(1) if tau.ndim == 0 else tau


def jvp_params(fn, p, p_dot):
    """jax.jvp of fn(p) along p_dot (a tangent for each inexact array of p, None
    elsewhere): (fn(p), its derivative)."""
    dyn, static = eqx.partition(p, eqx.is_inexact_array)
    return jax.jvp(lambda d: fn(eqx.combine(d, static)), (dyn,), (p_dot,))


class Augmented(eqx.Module):
    """The variational system of k directions as one delay DAE in Y = (y, s_1, …, s_k)
    (module docstring): residual (F, Ḟ_1, …, Ḟ_k) with Ḟ_j the jvp of F in
    (y, y', y(t − τ), p) along (s_j, s_j', s_j(t − τ) − y'(t − τ)τ̇_j, ṗ_j); history
    (h, h_p ṗ_1, …). The tangents ṗ carry a leading axis k. One integration for all
    directions: the state is integrated once, and no `vmap` of the step loop (which
    would select its whole carry, the step history included, on every step)."""

    model: Model = eqx.field(static=True)
    n: int = eqx.field(static=True)
    k: int = eqx.field(static=True)

    def residual(self, t, Y, Yp, lag, lag_d, pa):
        p, p_dot = pa
        n, k = self.n, self.k
        m = lag.shape[0]
        dyn, static = eqx.partition(p, eqx.is_inexact_array)
        nu, nu_d = lag[:, :n], lag_d[:, :n]
        sigma = lag[:, n:].reshape(m, k, n)

        def model(y, yp, v, d):
            return self.model.primal(t, y, yp, v, eqx.combine(d, static))

        def direction(s, sp, sig, d_dot):
            tau_dot = jvp_params(self.model.tau, p, d_dot)[1]
            return jax.jvp(model, (Y[:n], Yp[:n], nu, dyn),
                           (s, sp, sig - nu_d * tau_dot[:, None], d_dot))[1]

        f_dot = jax.vmap(direction, in_axes=(0, 0, 1, 0))(
            Y[n:].reshape(k, n), Yp[n:].reshape(k, n), sigma, p_dot)
        return jnp.concatenate([model(Y[:n], Yp[:n], nu, dyn), f_dot.reshape(-1)])

    def history(self, t, pa):
        p, p_dot = pa
        h = self.model.h(t, p)
        h_dot = jax.vmap(lambda d: jvp_params(lambda q: self.model.h(t, q), p, d)[1])(p_dot)
        return jnp.concatenate([h, h_dot.reshape(-1)])

    def quadrature(self, t, Y, Yp, a: DelayArgs):
        """(q, q̇_1, …, q̇_k): q and its jvp along (s_j, s_j', ṗ_j)."""
        p, p_dot = a.user
        n, k = self.n, self.k
        dyn, static = eqx.partition(p, eqx.is_inexact_array)

        def q(y, yp, d):
            return self.model.quad(t, y, yp, eqx.combine(d, static))

        q_dot = jax.vmap(lambda s, sp, d: jax.jvp(q, (Y[:n], Yp[:n], dyn), (s, sp, d))[1])(
            Y[n:].reshape(k, n), Yp[n:].reshape(k, n), p_dot)
        return jnp.concatenate([q(Y[:n], Yp[:n], dyn), q_dot.reshape(-1)])


# -------------------------------------------------------------------- breakpoints


def breaking_points(t0, tau, order: int, extra=None):
    """t0 + Σ kᵢτᵢ for 1 ≤ Σ kᵢ ≤ order (and the user's `extra` breakpoints), sorted,
    with points closer than a few hundred ulps merged (0.1 + 0.2 vs 0.3: a step of
    rounding size between them would fail), as a non-differentiable array."""
    tau = jax.lax.stop_gradient(tau)
    m = tau.shape[0]
    combos = [k for k in itertools.product(range(order + 1), repeat=m) if 1 <= sum(k) <= order]
    b = jax.lax.stop_gradient(t0) + jnp.asarray(np.array(combos, float), tau.dtype) @ tau
    if extra is not None:
        b = jnp.concatenate([b, extra])
    b = jnp.sort(b)
    tol = 256 * jnp.finfo(b.dtype).eps * jnp.maximum(jnp.max(jnp.abs(b)), 1.0)
    keep = jnp.concatenate([jnp.ones((1,), bool), jnp.diff(b) > tol])
    # A merged point becomes a copy of the point kept before it (duplicates are harmless).
    return jax.lax.cummax(jnp.where(keep, b, -jnp.inf))


# ----------------------------------------------------------------- input checks


def _positional_count(fn) -> int | None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    params = list(sig.parameters.values())
    if any(q.kind == q.VAR_POSITIONAL for q in params):
        return None
    return sum(q.kind in (q.POSITIONAL_ONLY, q.POSITIONAL_OR_KEYWORD) for q in params)


def _check_delays(delays, args):
    """(delays function or None, lags array or None, m)."""
    if callable(delays):
        count = _positional_count(delays)
        if count is not None and count != 1:
            raise ValueError(
                "`delays` must be a function of args only, tau = delays(args) (constant "
                f"lags), but it takes {count} arguments: state- or time-dependent delays "
                "tau(t, y) are not supported.")
        tau = _as_lags(delays(args))
        fn, given = delays, None
    else:
        tau = _as_lags(delays)
        fn, given = None, tau
    if tau.ndim != 1 or tau.shape[0] == 0:
        raise ValueError(f"`delays` must give a 1-D array of m >= 1 lags, got shape {tau.shape}.")
    if not jnp.issubdtype(tau.dtype, jnp.floating):
        tau = tau.astype(float)
        given = tau if given is not None else None
    ct = _concrete(tau)
    if ct is not None and not np.all((ct > 0) & np.isfinite(ct)):
        raise ValueError(
            f"`delays` must be positive and finite, got {ct}: a lag tau <= 0 would read "
            "the solution at or after t (a vanishing or advanced delay), which is not "
            "supported.")
    return fn, given, tau


def _check_history(history, t0, y0, args):
    if history is None:
        return
    if not callable(history):
        raise TypeError("`history` must be a function h(t, args) -> y(t) for t <= t0, or None "
                        "(the constant history y(t) = y0).")
    out = jax.eval_shape(history, jax.ShapeDtypeStruct((), y0.dtype), args)
    if getattr(out, "shape", None) != y0.shape:
        raise ValueError(f"`history(t, args)` must return an array shaped like y0 {y0.shape}, "
                         f"got {getattr(out, 'shape', out)}.")


def _check_residual(residual, t0, y0, m, args):
    count = _positional_count(residual)
    if count is not None and count != 5:
        raise ValueError(
            "with `delays=`, the residual is F(t, y, yp, y_lag, args) with y_lag[i] = "
            f"y(t - tau_i) (shape (m, n)); the given residual takes {count} arguments. "
            "Neutral terms y'(t - tau) are not supported.")
    y = jax.ShapeDtypeStruct(y0.shape, y0.dtype)
    lag = jax.ShapeDtypeStruct((m,) + y0.shape, y0.dtype)
    out = jax.eval_shape(residual, jax.ShapeDtypeStruct((), y0.dtype), y, y, lag, args)
    if getattr(out, "shape", None) != y0.shape:
        raise ValueError(f"The residual F(t, y, yp, y_lag, args) must return an array shaped "
                         f"like y0 {y0.shape}, got {getattr(out, 'shape', out)}.")


def _traced(tree) -> bool:
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(tree))


def _lift(fn, *example):
    """`fn` closure-converted when it closes over traced values (a parameter of an
    enclosing jit/grad/vmap: it must become an input, never a silent constant), else
    None (the function itself is used: repeated solves reuse the compiled program)."""
    if isinstance(fn, types.FunctionType) and not fn.__closure__:
        return None   # a plain function closes over nothing (no trace needed to know it)
    conv = eqx.filter_closure_convert(fn, *example)
    return conv if _traced(conv) else None


# ----------------------------------------------------------------------- solve


def solve_delayed(solve, residual, t0, t1, y0, yp0, args, *, delays, history, history_steps,
                  breakpoint_order, kwargs):
    """`solve(..., delays=...)`: see `solve`'s docstring and the module docstring."""
    from .._derivatives.adjoint import Adjoint
    from .._derivatives.forward_sensitivity import ForwardSensitivity
    reverse = kwargs.pop("sensitivity", None)
    saveat_arg = kwargs.get("saveat")
    if reverse is not None and not isinstance(reverse, (Adjoint, ForwardSensitivity)):
        raise ValueError(
            f"`sensitivity={reverse!r}` is not supported with `delays=`: reverse mode of a "
            "delay DAE is the continuous adjoint (sensitivity=Adjoint()), the variational "
            "system with a direction per input component (sensitivity=ForwardSensitivity()), "
            "or None (chosen by the number of input components).")
    for name, what in UNSUPPORTED.items():
        v = kwargs.get(name)
        if v is not None and v is not False:
            raise ValueError(f"`{name}=` is not supported with `delays=` ({what} is not "
                             "implemented yet).")
    if not (isinstance(history_steps, (int, np.integer)) and history_steps > 0):
        raise ValueError(f"`history_steps` must be a positive integer, got {history_steps!r}.")
    if not (isinstance(breakpoint_order, (int, np.integer)) and 0 <= breakpoint_order <= 10):
        raise ValueError(f"`breakpoint_order` must be an integer in 0..10, got "
                         f"{breakpoint_order!r}.")
    y0 = jnp.asarray(y0)
    if y0.ndim != 1:
        raise ValueError(f"`y0` must be a 1-D array, got shape {y0.shape}.")
    if not jnp.issubdtype(y0.dtype, jnp.inexact):
        y0 = y0.astype(float)
    args = jax.tree_util.tree_map(
        lambda a: jnp.asarray(a) if isinstance(a, (float, complex)) else a, args)
    t0 = jnp.asarray(t0, y0.dtype)
    delays_fn, tau_given, tau = _check_delays(delays, args)
    tau = tau.astype(y0.dtype)
    tau_given = None if tau_given is None else tau_given.astype(y0.dtype)
    m = tau.shape[0]
    _check_history(history, t0, y0, args)
    _check_residual(residual, t0, y0, m, args)
    lag = jnp.zeros((m,) + y0.shape, y0.dtype)
    quadrature = kwargs.pop("quadrature", None)
    if quadrature is not None:
        out = jax.eval_shape(quadrature, jax.ShapeDtypeStruct((), y0.dtype),
                             jax.ShapeDtypeStruct(y0.shape, y0.dtype),
                             jax.ShapeDtypeStruct(y0.shape, y0.dtype), args)
        if getattr(out, "ndim", None) != 1:
            raise ValueError("`quadrature(t, y, yp, args)` must return a 1-D array, got "
                             f"{getattr(out, 'shape', out)}.")
    params = Params(
        args=args, y_hist=y0 if history is None else None, tau_given=tau_given,
        residual=_lift(residual, t0, y0, y0, lag, args),
        history=None if history is None else _lift(history, t0, args),
        quadrature=None if quadrature is None else _lift(quadrature, t0, y0, y0, args))
    model = Model(residual=residual, history=history, delays=delays_fn, quadrature=quadrature)
    user_bps = kwargs.pop("breakpoints", None)
    extra = None
    if user_bps is not None:
        extra = jnp.asarray(user_bps, y0.dtype).reshape(-1)
    bps = breaking_points(t0, tau, breakpoint_order, extra)
    max_step = kwargs.pop("max_step", None)
    h_max = jax.lax.stop_gradient(jnp.min(tau))
    max_step = h_max if max_step is None else jnp.minimum(jnp.asarray(max_step, y0.dtype), h_max)
    saveat = kwargs.pop("saveat", None)
    saveat = jnp.reshape(jnp.asarray(t1, y0.dtype), (1,)) if saveat is None else saveat
    n_inputs = sum(x.size for x in jax.tree_util.tree_leaves(
        eqx.filter(params, eqx.is_inexact_array))) + y0.size
    adjoint_algebraic = None
    if reverse is None:
        # Measured choice (docs/delays.md): the variational route costs a solve of size
        # n(1 + N) for N input components, the adjoint a second forward run and a
        # backward solve of size n with an N-vector quadrature, restarted at every
        # observation.
        n_obs = 1 if saveat_arg is None else int(np.size(saveat_arg))
        use_adjoint = (n_inputs > ADJOINT_MIN_INPUTS and n_obs <= ADJOINT_MAX_OBSERVATIONS
                       and quadrature is None)
        reverse = Adjoint() if use_adjoint else ForwardSensitivity()
        explicit = False
    else:
        explicit = True
    if isinstance(reverse, Adjoint):
        adjoint_algebraic, refusal = _adjoint_split(model, params, t0, y0, m,
                                                    kwargs.get("algebraic"))
        if refusal is not None:
            if explicit:
                raise ValueError(f"sensitivity=Adjoint() with `delays=`: {refusal}")
            reverse = ForwardSensitivity()     # the default falls back to forward mode
    static = dict(solve=solve, model=model, history_steps=int(history_steps), kwargs=kwargs,
                  n=y0.shape[0], reverse=reverse if isinstance(reverse, Adjoint) else None,
                  adjoint_algebraic=adjoint_algebraic)
    dyn = dict(params=params, y0=y0, yp0=yp0, t0=t0, t1=t1, saveat=saveat, bps=bps,
               max_step=max_step)
    d, s = eqx.partition(dyn, eqx.is_array)
    ys, yps, qs, result, stats, t_final = _delay_function(static, s)(d)
    return ys, yps, qs, saveat, result, stats, t_final


def _adjoint_split(model, params, t0, y0, m: int, algebraic):
    """(the algebraic components for the continuous adjoint, as a tuple of bools, or None
    for index 0; None, or why the adjoint cannot be used). The adjoint of an index-1
    delay DAE (`adjoint.py`) needs every lagged argument to be differential: whether
    the residual reads y_lag[i, j] of an algebraic j is found from its program
    (`adjoint.lag_structure`), never assumed. Without `algebraic=`, the components whose
    y' the residual never reads are the algebraic ones (index 0 when there are none, or
    when the program cannot be analysed: as before, F_y' must then be nonsingular)."""
    from .._linalg.jacobian import SparsityDetectionError
    from .adjoint import lag_structure
    try:
        yp_free, lagged = lag_structure(model, params, t0, y0, m)
    except SparsityDetectionError as err:
        if algebraic is None:
            return None, None
        return None, (f"{err} The adjoint of an index-1 delay DAE needs to know that no "
                      "lagged argument is algebraic. Use sensitivity=ForwardSensitivity() "
                      "(the variational system).")
    mask = None if algebraic is None else _concrete(jnp.asarray(algebraic))
    # A mask traced under jit (jnp.array inside the traced function) is not known here:
    # the components whose y' the residual never reads are the algebraic ones (the
    # forward solve checks that a marked component's y' is not read).
    mask = yp_free if mask is None else np.asarray(mask, bool).reshape(-1)
    if not mask.any():
        return None, None
    bad = np.argwhere(lagged & mask[None, :])
    if bad.shape[0]:
        i, j = (int(v) for v in bad[0])
        more = f" (and {bad.shape[0] - 1} more)" if bad.shape[0] > 1 else ""
        return None, (
            f"the residual reads y_lag[{i}, {j}] = y_{j}(t - tau_{i}), a lagged algebraic "
            f"component{more}. The continuous adjoint of an index-1 delay DAE is built "
            "for lagged differential components only: an observation of an algebraic "
            "component puts a point mass into the adjoint variable, which a lagged "
            "algebraic argument carries on to t_k - tau, t_k - 2 tau, ... (docs/delays.md). "
            "Use sensitivity=ForwardSensitivity() (the variational system; the default "
            "falls back to it).")
    return tuple(bool(v) for v in mask), None


def _run(static, dyn, augmented_tangent=None):
    """One solve of the delay DAE (or, with `augmented_tangent` = ṗ-like tangents, of its
    variational system in Y = (y, s)): (ys, yps, result, stats, t_final)."""
    solve, model, n = static["solve"], static["model"], static["n"]
    kwargs = dict(static["kwargs"])
    p, y0, t0 = dyn["params"], dyn["y0"], dyn["t0"]
    dtype = y0.dtype
    if augmented_tangent is None:
        core_residual = delay_residual(model.primal, model.h)
        if model.quadrature is not None:
            kwargs["quadrature"] = DelayQuadrature(model=model)
        user = p
        tau = model.tau(p)
        start, yp0 = y0, dyn["yp0"]
    else:
        p_dot, y0_dot = augmented_tangent   # leading axis k: the directions
        k = y0_dot.shape[0]
        aug = Augmented(model=model, n=n, k=k)
        core_residual = delay_residual(aug.residual, aug.history, derivatives=True)
        user = (p, p_dot)
        tau = model.tau(p)
        start, yp0 = jnp.concatenate([y0, y0_dot.reshape(-1)]), None
        if model.quadrature is not None:
            kwargs["quadrature"] = aug.quadrature
        for name in ("atol", "quad_atol", "algebraic"):
            v = kwargs.get(name)
            if v is not None and jnp.ndim(v) == 1:
                kwargs[name] = jnp.concatenate([jnp.asarray(v)] * (1 + k))
        if kwargs.get("constraints") is not None:   # bounds on y, none on dy/dp
            c = jnp.asarray(kwargs["constraints"])
            kwargs["constraints"] = jnp.concatenate([c, jnp.zeros((k * n,), c.dtype)])
        if kwargs.get("init") == "y":
            raise ValueError("forward-mode derivatives of a delay DAE with init='y' are not "
                             "supported.")
    nn = start.shape[0]
    tau_max = jax.lax.stop_gradient(jnp.max(tau))
    buffer = DelayBuffer.empty(jax.lax.stop_gradient(t0), tau_max, dyn["bps"],
                               static["history_steps"], nn, dtype,
                               continuous_slopes=augmented_tangent is not None)
    sol = solve(core_residual, t0, dyn["t1"], start, yp0, DelayArgs(user=user, tau=tau,
                                                                     buffer=buffer),
                saveat=dyn["saveat"], breakpoints=dyn["bps"], max_step=dyn["max_step"],
                **kwargs)
    stats = dict(sol.stats)
    t_final = stats.pop("t_final")
    return sol.ys, sol.yps, sol.qs, sol.result, stats, t_final


def _delay_function(static, static_dyn):
    """The solve as a `jax.custom_jvp` of its array inputs: the primal is `_run`, the
    tangent the variational system (`Augmented`), with a guard that turns reverse mode
    into a clear error."""
    @jax.custom_jvp
    def f(d):
        return _run(static, eqx.combine(d, static_dyn))

    def f_jvp(primals, tangents):
        (d,), (d_dot,) = primals, tangents
        # A Python float primal (jax.jvp(f, (1.0,), ...) of a closed-over value) as an
        # array, as `solve` makes it: the tangents below are built for the arrays.
        d = jax.tree_util.tree_map(jnp.asarray, d)
        dyn = eqx.combine(d, static_dyn)
        for name, what in (("t0", "t0"), ("t1", "t1"), ("saveat", "saveat"),
                           ("yp0", "yp0"), ("max_step", "max_step"), ("bps", "breakpoints")):
            if name in d_dot and not all(isinstance(x, SymbolicZero) for x in
                                         jax.tree_util.tree_leaves(
                                             d_dot[name],
                                             is_leaf=lambda x: isinstance(x, SymbolicZero))):
                raise ValueError(f"Derivatives of a delay DAE's solution with respect to "
                                 f"{what} are not available (differentiate with respect to "
                                 "args, the delays, the history or y0).")
        def pick(x, dx):
            if not eqx.is_inexact_array(x):
                return None
            if dx is None or isinstance(dx, SymbolicZero):
                return jnp.zeros_like(x)
            return jnp.asarray(dx, x.dtype)

        dyn_dot = eqx.combine(d_dot, jax.tree_util.tree_map(lambda _: None, static_dyn))
        dot = jax.tree_util.tree_map(pick, dyn, dyn_dot,
                                     is_leaf=lambda v: v is None or isinstance(v, SymbolicZero))
        p_dot, y0_dot = dot["params"], dot["y0"]
        # The primal from its own solve: under jax.jacfwd the tangents are batched and
        # the primal must not depend on them.
        out = _run(static, dyn)
        _, _, qs, result, stats, t_final = out
        n = static["n"]
        live = [x for x in jax.tree_util.tree_leaves(
            d_dot, is_leaf=lambda x: isinstance(x, SymbolicZero))
            if not isinstance(x, SymbolicZero)]
        if being_linearized(live):
            # grad / vjp / linearize: the tangent as J ṗ with the Jacobian J from one
            # variational solve per input direction (known: it depends on the primal
            # only), so that what JAX transposes is the product, not a solve.
            if static["reverse"] is not None:
                # The continuous adjoint: a linear primitive whose transpose is the
                # backward solve (`adjoint.py`).
                zs, zps, zqs = filter_primitive_bind(
                    delay_tangent_p, _static_param(static), dyn, p_dot, y0_dot)
            else:
                zs, zps, zqs = _jacobian_product(static, dyn, p_dot, y0_dot)
            guard = _identity
        else:
            one = jax.tree_util.tree_map(lambda x: x[None], (p_dot, y0_dot))
            zs, zps, zqs = _run(static, dyn, augmented_tangent=one)[:3]
            zs, zps = zs[:, n:], zps[:, n:]
            zqs = None if qs is None else zqs[:, qs.shape[1]:]
            guard = _no_reverse
        qs_dot = None if qs is None else guard(zqs)
        out_dot = (guard(zs), guard(zps), qs_dot,
                   jax.tree_util.tree_map(_float0, result),
                   jax.tree_util.tree_map(_float0, stats),
                   jnp.zeros_like(t_final))
        return out, out_dot

    f.defjvp(f_jvp, symbolic_zeros=True)
    return f


def _identity(x):
    return x


def _jacobian_product(static, dyn, p_dot, y0_dot):
    """(ys, yps, qs) tangents as J·ṗ: J from one variational solve with a direction
    per component of every differentiable input (the inexact arrays of `Params` and
    y0), contracted with the tangents — linear in them, hence transposable: this is how
    `jax.grad` of a delay DAE works until its continuous adjoint exists (cost: a solve
    of size n(1 + N) for N input components)."""
    n = static["n"]
    x = {"p": eqx.filter(dyn["params"], eqx.is_inexact_array), "y0": dyn["y0"]}
    leaves, treedef = jax.tree_util.tree_flatten(x)
    dots = treedef.flatten_up_to({"p": p_dot, "y0": y0_dot})
    v = jnp.concatenate([jnp.ravel(d).astype(dyn["y0"].dtype) for d in dots])
    offsets = np.cumsum([0] + [leaf.size for leaf in leaves])
    N = int(offsets[-1])
    basis = jnp.eye(N, dtype=dyn["y0"].dtype)
    parts = [basis[:, a:b].reshape((N,) + leaf.shape).astype(leaf.dtype)
             for a, b, leaf in zip(offsets[:-1], offsets[1:], leaves)]
    tang = jax.tree_util.tree_unflatten(treedef, parts)
    zs, zps, zqs = _run(static, dyn, augmented_tangent=(tang["p"], tang["y0"]))[:3]

    def contract(z, width):   # (n_save, width·(1 + N)) → Σ_j J_j v_j
        return jnp.einsum("skw,k->sw", z[:, width:].reshape(z.shape[0], N, width), v)

    qs_dot = None if zqs is None else contract(zqs, zqs.shape[1] // (1 + N))
    return contract(zs, n), contract(zps, n), qs_dot


def _float0(x):
    return np.zeros(np.shape(x), jax.dtypes.float0)


REVERSE_MESSAGE = (
    "Reverse-mode derivatives (jax.grad, jax.vjp, jax.jacrev) of a delay DAE's solution "
    "cannot pass through a jax.jit that is itself differentiated, as in "
    "jax.grad(jax.jit(f)): write jax.jit(jax.grad(f)) instead (reverse mode runs the "
    "variational system or the continuous adjoint, chosen when JAX linearizes).")


def _no_reverse(x):
    return nondifferentiable_backward(x, msg=REVERSE_MESSAGE)


# ------------------------------------------------- the adjoint's linear primitive


def _forward_dense(static, dyn):
    """The forward solve again, keeping every step's interpolating polynomial
    (`solve(dense=True)`: memory O(max_steps · 6n)) for the backward solve."""
    solve, model = static["solve"], static["model"]
    kwargs = dict(static["kwargs"])
    kwargs["dense"] = True
    p, y0, t0 = dyn["params"], dyn["y0"], dyn["t0"]
    if model.quadrature is not None:
        kwargs["quadrature"] = DelayQuadrature(model=model)
    tau = model.tau(p)
    buffer = DelayBuffer.empty(jax.lax.stop_gradient(t0), jax.lax.stop_gradient(jnp.max(tau)),
                               dyn["bps"], static["history_steps"], y0.shape[0], y0.dtype)
    return solve(delay_residual(model.primal, model.h), t0, dyn["t1"], y0,
                 dyn["yp0"], DelayArgs(user=p, tau=tau, buffer=buffer), saveat=dyn["saveat"],
                 breakpoints=dyn["bps"], max_step=dyn["max_step"], **kwargs)


class _Static(eqx.Module):
    """The static half of a delay solve as one hashable primitive parameter."""

    static: Any = eqx.field(static=True)

    def __hash__(self):
        return id(self.static)

    def __eq__(self, other):
        return isinstance(other, _Static) and other.static is self.static


def _static_param(static) -> _Static:
    """`_Static(static)`. The solver options in `static["kwargs"]` may hold arrays of the
    enclosing trace (an `algebraic=` mask made with jnp.array inside a jitted function);
    they are used within that trace only, and `_Static` hashes by identity, never by
    value, so equinox's warning about arrays in static fields does not apply."""
    import warnings
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="A JAX array is being set as static")
        return _Static(static)


def _tangent_impl(st, dyn, p_dot, y0_dot):
    """The tangent (ys, yps, qs)˙ along one direction (p_dot, y0_dot): one variational
    solve (what `jax.linearize`'s linear function evaluates)."""
    static = st.static
    n = static["n"]
    one = jax.tree_util.tree_map(lambda x: x[None], (p_dot, y0_dot))
    zs, zps, zqs = _run(static, dyn, augmented_tangent=one)[:3]
    nq = None if zqs is None else zqs.shape[1] // 2
    return zs[:, n:], zps[:, n:], None if zqs is None else zqs[:, nq:]


def _tangent_shapes(st, dyn, p_dot, y0_dot):
    return jax.eval_shape(lambda a, b, c: _tangent_impl(st, a, b, c), dyn, p_dot, y0_dot)


def _tangent_abstract(st, dyn, p_dot, y0_dot):
    # Abstract values as `ShapedArray`s (a ShapeDtypeStruct here makes JAX treat the
    # output as a constant zero tangent).
    return jax.tree_util.tree_map(lambda x: shaped_array(x.shape, x.dtype),
                                  _tangent_shapes(st, dyn, p_dot, y0_dot))


def _tangent_jvp(primals, tangents):
    raise ValueError(
        "Second-order derivatives (jvp of grad, Hessians) of a delay DAE with the "
        "continuous adjoint (sensitivity=Adjoint(), or the default for many inputs) are "
        "not supported: use sensitivity=ForwardSensitivity() (reverse mode by the "
        "variational system).")


def _is_undefined(x):
    return isinstance(x, UndefinedPrimal)


def _tangent_transpose(inputs_all, cts_out):
    """The backward pass: the continuous adjoint (`adjoint.py`) for a cotangent on `ys`;
    with a cotangent on `yps` or on quadratures, the variational Jacobian's transpose
    (correct, at its cost)."""
    from .adjoint import adjoint_cotangents
    st, dyn, p_dot, y0_dot = inputs_all
    static = st.static
    ct_zs, ct_zps, ct_zqs = cts_out

    def aval(x):
        return jax.ShapeDtypeStruct(x.aval.shape, x.aval.dtype) if _is_undefined(x) else x

    p_av = jax.tree_util.tree_map(aval, p_dot, is_leaf=_is_undefined)
    y_av = jax.tree_util.tree_map(aval, y0_dot, is_leaf=_is_undefined)
    shapes = _tangent_shapes(st, dyn, p_av, y_av)
    if ct_zps is None and ct_zqs is None:
        if ct_zs is None:
            ct_zs = jnp.zeros(shapes[0].shape, shapes[0].dtype)
        ct_p, ct_y0 = adjoint_cotangents(static["solve"], static, dyn, ct_zs, static["reverse"])
    else:
        cts = tuple(None if sh is None else (jnp.zeros(sh.shape, sh.dtype) if c is None else c)
                    for c, sh in zip(cts_out, shapes))
        lin = jax.linear_transpose(
            lambda a, b: _jacobian_product(static, dyn, a, b), p_av, y_av)
        ct_p, ct_y0 = lin(cts)

    def only_linear(o, c):
        return c if _is_undefined(o) else None

    ct_p = jax.tree_util.tree_map(only_linear, p_dot, ct_p, is_leaf=_is_undefined)
    ct_y0 = only_linear(y0_dot, ct_y0)
    return (jax.tree_util.tree_map(lambda _: None, st), jax.tree_util.tree_map(lambda _: None, dyn),
            ct_p, ct_y0)


delay_tangent_p = create_vprim(
    "daeadjoint_delay_tangent",
    filter_primitive_def(_tangent_impl),
    filter_primitive_def(_tangent_abstract),
    filter_primitive_jvp(_tangent_jvp),
    filter_primitive_transpose(materialise_zeros=False)(_tangent_transpose),
)
