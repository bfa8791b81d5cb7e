r"""The continuous adjoint of a constant-lag delay DAE (Calver & Enright, "Numerical
methods for computing sensitivities for ODEs and DDEs", §2.3 and its multi-delay form).

For G = Σ_k g_kᵀ y(t_k) (the cotangents of `ys` at the output times t_k ≤ T = t1) and
F(t, y, y', ν, p) = 0 with νᵢ = y(t − τᵢ), subtracting ∫ λᵀ δF dt from δG and integrating
by parts gives, with w = F_y'ᵀ λ,

    w'(t) = F_y(t)ᵀ λ(t) + Σᵢ [F_{νᵢ}ᵀ λ](t + τᵢ),     λ(t) = 0 for t > T,
    w(t_k⁻) = w(t_k⁺) + g_k                             (a jump at every observation),

with *advanced* arguments t + τᵢ, and

    dG/dp = −∫_{t0}^{T} λᵀ dΦ/dp dt + w(t0)ᵀ ∂y0/∂p,
    Φ(p) = F(t, y, y', ν(p), p),   νᵢ(p) = y(t − τᵢ(p)) (t − τᵢ > t0),  h(t − τᵢ(p), p) (else),

where the p-dependence of ν (y held fixed on [t0, T]) carries the lag terms
−F_ν y'(t − τᵢ) ∂τᵢ/∂p and the history term F_ν ∂h/∂p(t − τᵢ) — the latter is
∫_{t0−τᵢ}^{t0} λ(s + τᵢ)ᵀ F_ν(s + τᵢ) ∂h/∂p(s) ds shifted to t ∈ [t0, t0 + τᵢ].

How it is solved. λ = F_y'^{−T} w needs F_y' nonsingular: **index 0** (an ODE in
implicit form). Writing w = v + H with the known step function H(t) = Σ_{t_k ≥ t} g_k, v
is continuous; in reversed time s = T − t, x(s) = v(T − s) solves

    x'(s) + F_y(t)ᵀ λ(t) + Σᵢ [F_{νᵢ}ᵀ λ](t + τᵢ) = 0,   λ(t) = F_y'(t)^{−T}(x(s) + H(t)),
    λ(t + τᵢ) = F_y'(t + τᵢ)^{−T}(x(s − τᵢ) + H(t + τᵢ)),   x = 0 for s ≤ 0,

a constant-lag delay equation with the same lags: `solve(..., delays=τ)` integrates it,
with the gradient integral as its quadrature. The forward solution and its y' are read
from the forward solve's stored interpolating polynomials (`solve(dense=True)`, recomputed
here: memory O(max_steps · 6n) for that second forward run), or recomputed segment by
segment from checkpoints (`checkpoint.py`, where that stores less). Step boundaries of the
backward solve: the observation times s_k = T − t_k (where H jumps, so x' jumps) and
s_k + τᵢ (where H(t + τᵢ) jumps), the forward breaking points T − b and T − b + τᵢ (where
the coefficients F_y, F_ν(t + τᵢ) lose smoothness), and the backward solve's own
breaking points Σ kᵢτᵢ (the zero history meets x at s = 0). The jumps of λ propagate to
s_k + Σ kᵢτᵢ with Σ kᵢ ≥ 2 in derivatives of order ≥ 2 of x; those are not step
boundaries (the error test resolves them).
"""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from .._results import RESULTS
from .buffer import count_below

# Half-width of the side window of a lagged step function, in ulps of the time scale (as
# `buffer.SIDE_ULPS`): above the rounding of s − τ, far below any step.
SIDE_ULPS = 16


class AdjointData(eqx.Module):
    """Arrays of the backward solve (its `args`): the forward interpolant, the model's
    parameters, the observation data (in reversed time, sorted ascending) and the lags."""

    dense: Any
    p: Any
    s_obs: Any        # (K,) T − t_k, ascending
    g_cum: Any        # (K + 1, n): g_cum[j] = Σ of the cotangents of the j first s_obs
    T: Any
    t0: Any
    tau: Any
    breaks: Any       # (B,) the backward solve's breakpoints (for the side of H(s − τ))


def _H(d: AdjointData, s):
    """H(T − s) = Σ_{s_k ≤ s} g_k (the observations at or after t = T − s)."""
    j = jnp.searchsorted(d.s_obs, s, side="right")
    return d.g_cum[j]


class Backward(eqx.Module):
    """The reversed-time adjoint's residual, history and gradient quadrature (module
    docstring); `model` is the forward `Model`."""

    model: Any = eqx.field(static=True)
    n: int = eqx.field(static=True)

    def _point(self, d: AdjointData, t):
        """y(t), y'(t) and the lagged values ν(t) of the forward solution."""
        tc = jnp.clip(t, d.t0, d.T)
        y = d.dense.evaluate(tc, 0)
        yp = d.dense.evaluate(tc, 1)

        def lag(tau):
            u = t - tau
            in_hist = u <= d.t0
            return jnp.where(in_hist, self.model.h(jnp.minimum(u, d.t0), d.p),
                             d.dense.evaluate(jnp.clip(u, d.t0, d.T), 0))

        return y, yp, jax.vmap(lag)(d.tau)

    def _lam(self, d: AdjointData, t, w):
        """λ = F_y'(t)^{−T} w."""
        y, yp, nu = self._point(d, t)
        Fyp = jax.jacfwd(lambda v: self.model.primal(t, y, v, nu, d.p))(yp)
        return jnp.linalg.solve(Fyp.T, w)

    def residual(self, s, x, xp, x_lag, d: AdjointData):
        t = d.T - s
        lam = self._lam(d, t, x + _H(d, s))
        y, yp, nu = self._point(d, t)
        _, vjp = jax.vjp(lambda y_, nu_: self.model.primal(t, y_, yp, nu_, d.p), y, nu)
        Fy_lam, _ = vjp(lam)
        # The side of H(s − τᵢ) at a breakpoint s = s_k + τᵢ: the left limit, unless s is
        # a few ulps past a breakpoint (the restart there), as the lagged values are read.
        delta = SIDE_ULPS * jnp.finfo(s.dtype).eps * jnp.maximum(jnp.abs(d.T - d.t0), 1.0)
        # d.breaks is ascending: the last breakpoint below s is the closest (binary search).
        j = count_below(d.breaks, s) - 1
        b_last = d.breaks[jnp.maximum(j, 0)]
        past = (j >= 0) & (s - b_last > 0) & (s - b_last < delta)
        side = jnp.where(past, delta, -delta)

        def advanced(i):
            ta = t + d.tau[i]
            live = s - d.tau[i] >= 0        # t + τᵢ ≤ T: inside the adjoint's interval
            ta_c = jnp.minimum(ta, d.T)
            lam_a = self._lam(d, ta_c, x_lag[i] + _H(d, s - d.tau[i] + side))
            ya, ypa, nua = self._point(d, ta_c)
            _, vjp_a = jax.vjp(lambda nu_: self.model.primal(ta_c, ya, ypa, nu_, d.p), nua)
            (ct_nu,) = vjp_a(lam_a)
            return jnp.where(live, ct_nu[i], 0.0)

        m = d.tau.shape[0]
        total = Fy_lam
        for i in range(m):   # m is small and static
            total = total + advanced(i)
        return xp + total

    def history(self, s, d: AdjointData):
        return jnp.zeros((self.n,), d.T.dtype)

    def quadrature(self, s, x, xp, d: AdjointData):
        """−λᵀ dΦ/dp over the inexact leaves of p, flattened (module docstring)."""
        t = d.T - s
        lam = self._lam(d, t, x + _H(d, s))
        y, yp, _ = self._point(d, t)
        model = self.model
        tau0 = d.tau
        dyn, static = eqx.partition(d.p, eqx.is_inexact_array)

        def phi(dp):
            p = eqx.combine(dp, static)
            tau = model.tau(p)

            def lag(i):
                u = t - tau[i]
                u0 = t - tau0[i]
                hist = model.h(jnp.minimum(u, d.t0), p)
                uc = jnp.clip(u0, d.t0, d.T)
                # y held fixed on [t0, T]: only the read position moves, y'(t − τ)·δ(−τ).
                sol = (jax.lax.stop_gradient(d.dense.evaluate(uc, 0))
                       - jax.lax.stop_gradient(d.dense.evaluate(uc, 1)) * (tau[i] - tau0[i]))
                return jnp.where(u0 <= d.t0, hist, sol)

            nu = jnp.stack([lag(i) for i in range(tau0.shape[0])])
            return model.primal(t, y, yp, nu, p)

        _, vjp = jax.vjp(phi, dyn)
        (g,) = vjp(-lam)
        leaves = jax.tree_util.tree_leaves(g)
        return jnp.concatenate([jnp.ravel(v) for v in leaves]) if leaves else jnp.zeros((0,))


# Steps the backward solve may take after each restart at an observation-derived step
# boundary before its step size has grown back (order 1 and a small first step, at the
# tolerances of the tests: Kermack–McKendrick with 1000 observations overflowed a ring of
# 4000 steps within τ2 = 10, which holds ~550 such boundaries).
STEPS_PER_RESTART = 10


def backward_history_steps(forward: int, n_obs: int, m: int) -> int:
    """The backward solve's ring: the forward's `history_steps` plus room for the
    restarts at the n_obs(1 + m) observation-derived step boundaries (memory
    O(ring · 6n); a ring still too small stops with `RESULTS.delay_history_lost`)."""
    return forward + STEPS_PER_RESTART * n_obs * (1 + m)


def adjoint_cotangents(solve, static, dyn, ct_ys, options):
    """(cotangent of the inexact leaves of `Params` as a Params-like pytree, cotangent of
    y0): the continuous adjoint for the cotangent `ct_ys` (n_save, n) of `ys`. The
    forward interpolant comes from a stored trajectory or, where that stores fewer steps
    (`checkpoint.use_checkpoints`), from checkpoint recomputation (`checkpoint.py`)."""
    from .checkpoint import use_checkpoints
    model, n = static["model"], static["n"]
    p, y0, t0 = dyn["params"], dyn["y0"], dyn["t0"]
    dtype = y0.dtype
    T = jnp.asarray(dyn["t1"], dtype)
    tau = jax.lax.stop_gradient(model.tau(p))
    saveat = jnp.asarray(dyn["saveat"], dtype)
    s_obs = (T - saveat)[::-1]                       # ascending
    g = ct_ys.astype(dtype)[::-1]
    g_cum = jnp.concatenate([jnp.zeros((1, n), dtype), jnp.cumsum(g, axis=0)])
    fwd_b = T - dyn["bps"]
    obs_b = jnp.concatenate([s_obs] + [s_obs + tau[i] for i in range(tau.shape[0])])
    fwd_bb = jnp.concatenate([fwd_b] + [fwd_b + tau[i] for i in range(tau.shape[0])])
    span = T - t0
    breaks = jnp.concatenate([obs_b, fwd_bb])
    # Points outside (0, T − t0) are no step boundaries; parking them at 0 keeps the
    # array's (static) size.
    breaks = jnp.where((breaks > 0) & (breaks < span), breaks, 0.0)
    breaks = jnp.sort(breaks)
    bw = Backward(model=model, n=n)
    kw = static["kwargs"]
    rtol = options.rtol if options.rtol is not None else kw.get("rtol")
    atol = options.atol if options.atol is not None else jnp.max(jnp.asarray(kw.get("atol", 1e-6)))
    bw_kwargs = dict(
        rtol=rtol, atol=atol,
        # Always in the error test: a delay solve's quadrature without it was seen
        # grossly wrong (docs/delays.md), and this one is the gradient.
        quad_error_control=True, quad_rtol=rtol, quad_atol=atol,
        max_steps=kw.get("max_steps", 100_000),
        history_steps=backward_history_steps(static["history_steps"], saveat.shape[0],
                                             tau.shape[0]),
        linear_solver=None, throw=kw.get("throw", True))

    def data_with(dense):
        return AdjointData(dense=dense, p=p, s_obs=s_obs, g_cum=g_cum, T=T, t0=t0, tau=tau,
                           breaks=breaks)

    if use_checkpoints(options.checkpoint_every, kw.get("max_steps", 100_000),
                       static["history_steps"]):
        x_end, q_end, ok = _checkpointed(static, dyn, options.checkpoint_every, bw, data_with,
                                         tau, span, breaks, bw_kwargs)
    else:
        from .solve import _forward_dense   # circular import at module load
        sol = _forward_dense(static, dyn)
        x = solve(bw.residual, jnp.zeros((), dtype), span, jnp.zeros((n,), dtype), None,
                  data_with(sol.dense), delays=tau, history=bw.history,
                  quadrature=bw.quadrature, saveat=jnp.reshape(span, (1,)),
                  breakpoints=breaks, **bw_kwargs)
        x_end, q_end = x.ys[-1], x.qs[-1]
        ok = (x.result == RESULTS.successful) & (sol.result == RESULTS.successful)
    w0 = x_end + g_cum[-1]
    flat = q_end
    dyn_p = eqx.filter(p, eqx.is_inexact_array)
    leaves, treedef = jax.tree_util.tree_flatten(dyn_p)
    out, k = [], 0
    for leaf in leaves:
        out.append(flat[k:k + leaf.size].reshape(leaf.shape).astype(leaf.dtype))
        k += leaf.size
    # A failed backward solve (throw=False) gives NaN, never a finite wrong gradient.
    out = [jnp.where(ok, v, jnp.nan) for v in out]
    w0 = jnp.where(ok, w0, jnp.nan)
    return jax.tree_util.tree_unflatten(treedef, out), w0


def _checkpointed(static, dyn, every, bw, data_with, tau, span, breaks, bw_kwargs):
    """x(span) and the gradient quadrature of the backward solve over the forward
    solution recomputed from checkpoints (`checkpoint.backward`), with the backward
    delay solve built as `solve(bw.residual, ..., delays=tau, ...)` builds it (`solve.py`
    `solve_delayed` and `_run`: the same program, driven a segment at a time), and
    whether everything succeeded (with `throw`, a failure raises its status)."""
    from . import checkpoint
    from .buffer import DelayArgs, DelayBuffer, DelayResidual
    from .solve import DelayQuadrature, Model, Params, breaking_points
    model, n = static["model"], static["n"]
    p, y0, t0 = dyn["params"], dyn["y0"], dyn["t0"]
    dtype = y0.dtype
    # The forward solve as `_forward_dense` runs it, less the dense output.
    kwargs = dict(static["kwargs"])
    if model.quadrature is not None:
        kwargs["quadrature"] = DelayQuadrature(model=model)
    tau_f = model.tau(p)
    buf = DelayBuffer.empty(jax.lax.stop_gradient(t0), jax.lax.stop_gradient(jnp.max(tau_f)),
                            dyn["bps"], static["history_steps"], n, dtype)
    fwd_config, fwd_inputs = checkpoint.configure(
        DelayResidual(model=model.primal, history=model.h), t0, dyn["t1"], y0, dyn["yp0"],
        DelayArgs(user=p, tau=tau_f, buffer=buf), saveat=dyn["saveat"], breakpoints=dyn["bps"],
        max_step=dyn["max_step"], **kwargs)
    # The backward solve as `solve_delayed` and `_run` build it for a given lag array.
    bw_model = Model(residual=bw.residual, history=bw.history, delays=None,
                     quadrature=bw.quadrature)
    kw = dict(bw_kwargs)
    history_steps, throw = kw.pop("history_steps"), kw["throw"]
    zero = jnp.zeros((), dtype)
    bps = breaking_points(zero, tau, kw.get("max_order", 5), breaks)
    bw_buf = DelayBuffer.empty(zero, jnp.max(tau), bps, history_steps, n, dtype)

    def setup(window):
        params = Params(args=data_with(window), y_hist=None, tau_given=tau, residual=None,
                        history=None, quadrature=None)
        return checkpoint.configure(
            DelayResidual(model=bw_model.primal, history=bw_model.h), zero, span,
            jnp.zeros((n,), dtype), None, DelayArgs(user=params, tau=tau, buffer=bw_buf),
            saveat=jnp.reshape(span, (1,)), breakpoints=bps, max_step=jnp.min(tau),
            quadrature=DelayQuadrature(model=bw_model), **kw)

    def with_window(inputs, window):
        return eqx.tree_at(lambda i: i.args.user.args.dense, inputs, window)

    core, status = checkpoint.backward(fwd_config, fwd_inputs, every, setup, with_window,
                                       jnp.asarray(dyn["t1"], dtype))
    status = RESULTS.where(status == RESULTS.successful, core.result, status)
    x_end, q_end = core.yd[-1, 0], core.qs[-1]
    if throw:
        x_end = status.error_if(x_end, status != RESULTS.successful)
    return x_end, q_end, status == RESULTS.successful
