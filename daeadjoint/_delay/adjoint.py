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

How it is solved. λ = F_y'^{−T} w needs F_y' nonsingular: index 0 (an ODE in
implicit form; index 1 below). Writing w = v + H with the known step function H(t) = Σ_{t_k ≥ t} g_k, v
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

Index 1. With algebraic components (mask a, d = 1 − a: F_y' has zero columns at a),
λ = F_y'^{−T} w is not defined, and the algebraic rows of the adjoint are constraints.
Since w = F_y'ᵀλ has no algebraic components, the coefficient of δy_a in the
Lagrangian gives (Cao, Li, Petzold & Serban, "Adjoint sensitivity analysis for
differential-algebraic equations: the adjoint DAE system and its numerical solution";
Li & Petzold, DASPKADJOINT)

    w_d' = (F_yᵀλ)_d + Σᵢ [F_{νᵢ}ᵀλ]_d(t + τᵢ) − Σ_k g_{k,d} δ(t − t_k),
    0    = (F_yᵀλ)_a + Σᵢ [F_{νᵢ}ᵀλ]_a(t + τᵢ) − Σ_k g_{k,a} δ(t − t_k),

as distributions. An observation of an algebraic component (g_{k,a} ≠ 0) forces a
point mass into λ: λ = λ_r + Σ_k ν_k δ(t − t_k). If some F_{νᵢ} has a nonzero column
at an algebraic component (a lagged algebraic argument), the second line at t_k − τᵢ
receives [F_{νᵢ}ᵀν_k]_a δ(t − (t_k − τᵢ)), a new point mass of λ there, which moves on to
t_k − 2τᵢ, … — not built (refused: `solve._adjoint_split`). **With no lagged algebraic
argument** ((F_{νᵢ})_{:,a} = 0, found from the residual's program, `lag_structure`)
the advanced terms have no algebraic rows, so the point masses stay at the t_k:

    Cᵀ ν_k = a∘g_k,   C = F_y' diag(d) + F_y diag(a)   (the consistency matrix, at t_k;
                                                         nonsingular: index 1),

(F_y'ᵀν_k = 0: no point mass in w, whose derivative holds only the δ's). What they
leave is jumps of w:

    w(t_k⁻) = w(t_k⁺) + d∘(g_k − F_yᵀν_k)                   (at the observation),
    w((t_k − τᵢ)⁻) = w((t_k − τᵢ)⁺) − F_{νᵢ}(t_k)ᵀν_k        (the advanced term's δ,
                                                             differential rows only),

the second only for t_k − τᵢ > t0 (before t0 it falls on the history: the gradient's
history term takes it), and the gradient gains the point terms −Σ_k ν_kᵀ dΦ/dp(t_k).
Between the jumps the regular part satisfies the algebraic rows with no source,
(F_yᵀλ_r)_a = 0, which with w = F_y'ᵀλ_r is

    λ_r = C^{−T} (d∘w)

(for index 0, a = 0: C = F_y', the formula above). So the index-1 case is the index-0
backward delay equation with λ = C^{−T}(d∘(x + H)), x_a ≡ 0, and H the step function of
all the jumps, at T − t_k and T − t_k + τᵢ in reversed time (`Backward.
observation_jumps`, before the backward solve: ν_k needs only the forward solution at
t_k). Its x' then jumps at s_k, s_k + τᵢ and, where λ(t + τⱼ) meets the jumps at
t_k − τᵢ, at s_k + τᵢ + τⱼ: all of them are step boundaries. The derivative with respect
to y0 is w(t0⁻) on the differential components (the algebraic part of y(t0) is computed
from them by the consistent initialization, as in the DAE adjoint without delays).

Cost of an evaluation. The residual reads the forward solution at t and at each t + τᵢ:
y, y' (one search of the stored steps for both) and the lagged values at t − τⱼ (one
search each): (1 + m)² searches per evaluation for m lags, the quadrature 1 + m. (The
program once asked (2 + m)(2 + 2m) times; XLA's common-subexpression elimination merged
the repeats, so the compiled residual has as many search loops either way.)
"""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._bdf import derivative_weights
from .._results import RESULTS
from .buffer import count_below
from .checkpoint import Window

# Half-width of the side window of a lagged step function, in ulps of the time scale (as
# `buffer.SIDE_ULPS`): above the rounding of s − τ, far below any step.
SIDE_ULPS = 16


class AdjointData(eqx.Module):
    """Arrays of the backward solve (its `args`): the forward interpolant, the model's
    parameters, the jumps of w as a step function (in reversed time, sorted ascending)
    and the lags."""

    dense: Any
    p: Any
    s_obs: Any        # (J,) where w jumps, in reversed time, ascending: T − t_k (and,
                      # index 1, T − t_k + τᵢ)
    g_cum: Any        # (J + 1, n): g_cum[j] = Σ of the jumps at the j first s_obs
    T: Any
    t0: Any
    tau: Any
    breaks: Any       # (B,) the backward solve's breakpoints (for the side of H(s − τ))


def _H(d: AdjointData, s):
    """H(T − s) = Σ_{s_j ≤ s} of the jumps (those at or after t = T − s)."""
    j = jnp.searchsorted(d.s_obs, s, side="right")
    return d.g_cum[j]


def _dense_values(dense, t, slope: bool = True):
    """(y(t), y'(t) or None) from the stored interpolant of the step containing t: one
    search (`DenseRecorder.evaluate`'s, with the weights of both derivatives from it).
    `dense` is the stored trajectory or a checkpoint `Window` of recomputed steps (NaN
    outside it, as `Window.evaluate`)."""
    window = dense if isinstance(dense, Window) else None
    if window is not None:
        dense = window.dense
    i = jnp.clip(jnp.searchsorted(dense.t, t), 1, jnp.maximum(dense.count, 1))
    w = derivative_weights(t, dense.t[i], dense.psi[i - 1], dense.k_used[i - 1],
                           1 if slope else 0)
    phi = dense.phi[i - 1]
    y, yp = w[0] @ phi, (w[1] @ phi if slope else None)
    if window is not None:
        inside = window.inside(t)
        y = jnp.where(inside, y, jnp.nan)
        yp = None if yp is None else jnp.where(inside, yp, jnp.nan)
    return y, yp


class Point(eqx.Module):
    """The forward solution at one time t: y, y', the lagged values νᵢ = y(t − τᵢ) (or
    the history) and the slopes y'(t − τᵢ) of the stored solution there (for the lag
    term of the gradient)."""

    y: Any
    yp: Any
    nu: Any
    nu_slope: Any


class Backward(eqx.Module):
    """The reversed-time adjoint's residual, history and gradient quadrature (module
    docstring); `model` is the forward `Model`, `algebraic` the forward's algebraic
    components (a tuple of bools; None for index 0)."""

    model: Any = eqx.field(static=True)
    n: int = eqx.field(static=True)
    algebraic: tuple | None = eqx.field(static=True, default=None)

    def _point(self, d: AdjointData, t, slopes: bool = False) -> Point:
        """The forward solution at t: one search of the stored steps for t and one for
        each t − τᵢ (each time point is looked up once, whatever is read from it); the
        lagged slopes only with `slopes` (the gradient's lag term)."""
        y, yp = _dense_values(d.dense, jnp.clip(t, d.t0, d.T))

        def lag(tau):
            u = t - tau
            in_hist = u <= d.t0
            v, vp = _dense_values(d.dense, jnp.clip(u, d.t0, d.T), slopes)
            return jnp.where(in_hist, self.model.h(jnp.minimum(u, d.t0), d.p), v), vp

        nu, nu_slope = jax.vmap(lag)(d.tau)
        return Point(y=y, yp=yp, nu=nu, nu_slope=nu_slope)

    def _lam(self, d: AdjointData, t, pt: Point, w):
        """λ = C(t)^{−T} (d∘w), C = F_y' diag(d) + F_y diag(a) (module docstring); for
        index 0 (no algebraic components) C = F_y'."""
        if self.algebraic is None:
            Fyp = jax.jacfwd(lambda v: self.model.primal(t, pt.y, v, pt.nu, d.p))(pt.yp)
            return jnp.linalg.solve(Fyp.T, w)
        return jnp.linalg.solve(self.consistency(d, t, pt).T, self._differential(w))

    def consistency(self, d: AdjointData, t, pt: Point):
        """C = ∂F/∂z of F(t, y + a∘z, y' + (1 − a)∘z, ν): the consistency matrix, whose
        transpose is the index-1 adjoint's M (nonsingular exactly for index 1)."""
        a = jnp.asarray(self.algebraic)
        return jax.jacfwd(lambda z: self.model.primal(
            t, pt.y + jnp.where(a, z, 0.0), pt.yp + jnp.where(a, 0.0, z), pt.nu, d.p))(
                jnp.zeros_like(pt.y))

    def _differential(self, v):
        """v with its algebraic components zeroed (exact zeros: the adjoint's w has
        none)."""
        return v if self.algebraic is None else jnp.where(jnp.asarray(self.algebraic), 0.0, v)

    def residual(self, s, x, xp, x_lag, d: AdjointData):
        t = d.T - s
        pt = self._point(d, t)
        lam = self._lam(d, t, pt, x + _H(d, s))
        _, vjp = jax.vjp(lambda y_, nu_: self.model.primal(t, y_, pt.yp, nu_, d.p),
                         pt.y, pt.nu)
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
            pa = self._point(d, ta_c)
            lam_a = self._lam(d, ta_c, pa, x_lag[i] + _H(d, s - d.tau[i] + side))
            _, vjp_a = jax.vjp(lambda nu_: self.model.primal(ta_c, pa.y, pa.yp, nu_, d.p),
                               pa.nu)
            (ct_nu,) = vjp_a(lam_a)
            return jnp.where(live, ct_nu[i], 0.0)

        m = d.tau.shape[0]
        total = Fy_lam
        for i in range(m):   # m is small and static
            total = total + advanced(i)
        # Index 1: the algebraic rows of the adjoint, (F_yᵀλ)_a = 0 (and no lagged
        # algebraic argument), hold by λ's construction; x_a stays 0.
        return xp + self._differential(total)

    def history(self, s, d: AdjointData):
        return jnp.zeros((self.n,), d.T.dtype)

    def gradient_density(self, d: AdjointData, t, pt: Point, lam):
        """−λᵀ dΦ/dp at t over the inexact leaves of p, flattened (module docstring)."""
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
                # y held fixed on [t0, T]: only the read position moves, y'(t − τ)·δ(−τ).
                sol = (jax.lax.stop_gradient(pt.nu[i])
                       - jax.lax.stop_gradient(pt.nu_slope[i]) * (tau[i] - tau0[i]))
                return jnp.where(u0 <= d.t0, hist, sol)

            nu = jnp.stack([lag(i) for i in range(tau0.shape[0])])
            return model.primal(t, pt.y, pt.yp, nu, p)

        _, vjp = jax.vjp(phi, dyn)
        (g,) = vjp(-lam)
        leaves = jax.tree_util.tree_leaves(g)
        return jnp.concatenate([jnp.ravel(v) for v in leaves]) if leaves else jnp.zeros((0,))

    def quadrature(self, s, x, xp, d: AdjointData):
        """−λᵀ dΦ/dp over the inexact leaves of p, flattened (module docstring)."""
        t = d.T - s
        pt = self._point(d, t, slopes=True)
        return self.gradient_density(d, t, pt, self._lam(d, t, pt, x + _H(d, s)))

    def observation_jumps(self, d: AdjointData, s_obs, g):
        """Index 1: the jumps of w and the Dirac masses of λ at the observations
        (module docstring). For each observation t_k = T − s_k with cotangent g_k,
        ν_k = C(t_k)^{−T}(a∘g_k); w jumps by (1 − a)∘(g_k − F_yᵀν_k) at t_k and by
        −F_{νᵢ}ᵀν_k at t_k − τᵢ (where that is after t0; before, the history term of the
        gradient takes it). Returns (jump points in reversed time, ascending; their
        cumulative sums (J + 1, n); the gradient's point terms −Σ_k ν_kᵀ dΦ/dp(t_k))."""
        a = jnp.asarray(self.algebraic)

        def one(sk, gk):
            tk = d.T - sk
            pt = self._point(d, tk, slopes=True)
            nu_k = jnp.linalg.solve(self.consistency(d, tk, pt).T, jnp.where(a, gk, 0.0))
            _, vjp = jax.vjp(lambda y_, nu_: self.model.primal(tk, y_, pt.yp, nu_, d.p),
                             pt.y, pt.nu)
            Fy_nu, Fnu_nu = vjp(nu_k)
            at_obs = self._differential(gk - Fy_nu)
            live = tk - d.tau > d.t0
            lagged = jnp.where(live[:, None], -self._differential(Fnu_nu), 0.0)
            return at_obs, lagged, self.gradient_density(d, tk, pt, nu_k)

        at_obs, lagged, dirac = jax.vmap(one)(s_obs, g)
        n, m = self.n, d.tau.shape[0]
        points = jnp.concatenate([s_obs] + [s_obs + d.tau[i] for i in range(m)])
        jumps = jnp.concatenate([at_obs] + [lagged[:, i] for i in range(m)])
        order = jnp.argsort(points, stable=True)
        cum = jnp.concatenate([jnp.zeros((1, n), jumps.dtype),
                               jnp.cumsum(jumps[order], axis=0)])
        return points[order], cum, jnp.sum(dirac, axis=0)


def lag_structure(model, p, t0, y0, m: int):
    """(the components y_j whose y'_j the residual never reads, (n,) bool; the pairs
    (i, j) of the lagged values y_lag[i, j] = y_j(t − τᵢ) it reads, (m, n) bool), from
    the residual's program (asdex's global sparsity detection, as
    `_linalg.jacobian.structurally_algebraic`): valid for every input, never sampled at
    one point; a column it cannot prove zero counts as read. Raises
    `SparsityDetectionError` when the program cannot be analysed."""
    from .._linalg.jacobian import SparsityDetectionError
    n = y0.shape[0]
    dtype = y0.dtype
    dynamic, static = eqx.partition(p, eqx.is_array)

    def fn(yp_, nu_, y_, t_, dyn):
        return model.primal(t_, y_, yp_, nu_, eqx.combine(dyn, static))

    sample = jnp.zeros((n,), dtype)
    nu_sample = jnp.zeros((m, n), dtype)
    t_sample = jnp.zeros((), dtype)
    dyn_sample = jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, x.dtype), dynamic)
    try:
        import asdex

        # Traced values the residual closes over (parameters under jit/grad) become
        # extra, undifferentiated inputs: the detector needs a closed program.
        converted, consts = jax.closure_convert(fn, sample, nu_sample, sample, t_sample,
                                                dyn_sample)
        extra = (sample, t_sample, dyn_sample,
                 [jnp.zeros(jnp.shape(c), jnp.result_type(c)) for c in consts])
        pattern = asdex.jacobian_sparsity(
            lambda yp_, nu_, e: converted(yp_, nu_, e[0], e[1], e[2], *e[3]),
            sample, nu_sample, extra, argnums=(0, 1))
    except Exception as err:   # any failure of the analysis is reported
        raise SparsityDetectionError(
            "daeadjoint could not find which lagged values the delay residual reads from "
            f"its program ({type(err).__name__}: {err}).") from err
    cols = np.asarray(pattern.cols)
    yp_free = np.ones((n,), bool)
    yp_free[cols[cols < n]] = False
    lagged = np.zeros((m * n,), bool)
    lagged[cols[cols >= n] - n] = True
    return yp_free, lagged.reshape(m, n)


# Steps the backward solve may take after each restart at an observation-derived step
# boundary before its step size has grown back (order 1 and a small first step, at the
# tolerances of the tests: Kermack–McKendrick with 1000 observations overflowed a ring of
# 4000 steps within τ2 = 10, which holds ~550 such boundaries).
STEPS_PER_RESTART = 10


def backward_history_steps(forward: int, n_obs: int, m: int, index1: bool = False) -> int:
    """The backward solve's ring: the forward's `history_steps` plus room for the
    restarts at the n_obs(1 + m) observation-derived step boundaries (index 1: n_obs(1 +
    m + m(m + 1)/2), with s_k + τᵢ + τⱼ) (memory O(ring · 6n); a ring still too small
    stops with `RESULTS.delay_history_lost`)."""
    per_obs = 1 + m + (m * (m + 1) // 2 if index1 else 0)
    return forward + STEPS_PER_RESTART * n_obs * per_obs


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
    bw = Backward(model=model, n=n, algebraic=static.get("adjoint_algebraic"))
    if bw.algebraic is not None:
        # Index 1: w also jumps at t_k − τᵢ, so x' jumps at s_k + τᵢ + τⱼ too (where
        # λ(t + τⱼ) meets those jumps); see `Backward.observation_jumps`.
        m = tau.shape[0]
        obs_b = jnp.concatenate([obs_b] + [s_obs + tau[i] + tau[j]
                                           for i in range(m) for j in range(i, m)])
    breaks = jnp.concatenate([obs_b, fwd_bb])
    # Points outside (0, T − t0) are no step boundaries; parking them at 0 keeps the
    # array's (static) size.
    breaks = jnp.where((breaks > 0) & (breaks < span), breaks, 0.0)
    breaks = jnp.sort(breaks)
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
                                             tau.shape[0], bw.algebraic is not None),
        linear_solver=None, throw=kw.get("throw", True))

    def data_with(dense, s_jump=s_obs, g_jump=g_cum):
        return AdjointData(dense=dense, p=p, s_obs=s_jump, g_cum=g_jump, T=T, t0=t0, tau=tau,
                           breaks=breaks)

    dirac = None
    # Index 1 reads the forward solution at every observation before the backward solve
    # (`Backward.observation_jumps`), so it keeps the stored trajectory.
    if bw.algebraic is None and use_checkpoints(
            options.checkpoint_every, kw.get("max_steps", 100_000), static["history_steps"]):
        x_end, q_end, ok = _checkpointed(static, dyn, options.checkpoint_every, bw, data_with,
                                         tau, span, breaks, bw_kwargs)
        g_end = g_cum[-1]
    else:
        from .solve import _forward_dense   # circular import at module load
        sol = _forward_dense(static, dyn)
        data = data_with(sol.dense)
        if bw.algebraic is not None:
            jump_s, jump_cum, dirac = bw.observation_jumps(data, s_obs, g)
            data = data_with(sol.dense, jump_s, jump_cum)
        x = solve(bw.residual, jnp.zeros((), dtype), span, jnp.zeros((n,), dtype), None,
                  data, delays=tau, history=bw.history,
                  quadrature=bw.quadrature, saveat=jnp.reshape(span, (1,)),
                  breakpoints=breaks, **bw_kwargs)
        x_end, q_end = x.ys[-1], x.qs[-1]
        ok = (x.result == RESULTS.successful) & (sol.result == RESULTS.successful)
        g_end = data.g_cum[-1]
    w0 = x_end + g_end
    flat = q_end if dirac is None else q_end + dirac
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
    from .buffer import DelayArgs, DelayBuffer, delay_residual
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
        delay_residual(model.primal, model.h), t0, dyn["t1"], y0, dyn["yp0"],
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
            delay_residual(bw_model.primal, bw_model.h), zero, span,
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
