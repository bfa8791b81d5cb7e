r"""Events: roots of g(t, y(t), y'(t), args) located on the BDF interpolant, and the
derivatives of event times and states.

Location (IDAS manual §6.2.4). After every accepted step the sign of each component of g
at the step end is compared with its sign at the previous point t_lo (the previous step
end or the last root); a change (in the requested `direction`) starts a root search on
the step's interpolating polynomial — the same dense output the solution uses — by
IDAS's modified secant method (Illinois weights α halved/doubled when the bracket keeps
moving on the same side) to the tolerance τ = 100 U (|t_n| + |h|). The reported root is
the upper end of the final bracket, where g already has its new sign. With several
components changing sign in a step, the first root wins (IDAS picks the component with
the largest |g(t_hi)|/|g(t_hi) − g(t_lo)|, the closest secant estimate to t_lo).

Derivatives (the implicit function theorem on g(t*, y(t*; x), y'(t*; x), x) = 0, never the
root search's iterations). With s = ∂y/∂x ẋ and ġ = g_t + g_y y' + g_y' y'' the total time
derivative of g along the solution at t*,

    ṫ* = −(g_y s + g_y' s' + g_p ṗ) / ġ,        (y^(m)(t*))˙ = s^(m)(t*) + y^(m+1)(t*) ṫ*.

In reverse mode a cotangent (t̄*, ȳ^(m)*) is therefore a point observation at t* with
cotangents ȳ* − (c/ġ) g_yᵀ on y and ȳ'* − (c/ġ) g_y'ᵀ on y', plus −(c/ġ) g_pᵀ on p,
where c = t̄* + Σ_m ȳ^(m)*·y^(m+1)(t*) — which both adjoints take like any other
observation: the jump a moving final time adds at t*.
"""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from ._bdf import derivative_weights, stacked
from ._ops import where

MAX_SEARCH = 100   # secant iterations per root (the bracket shrinks geometrically)


class Event(eqx.Module):
    """Stop (or mark) the solve where a component of `cond` crosses zero.

    **Arguments:**

    - `cond`: `cond(t, y, yp, args) -> 1-D array`; a root of any component is an event.
      It may depend on algebraic components and on y'.
    - `terminal`: stop the solve at the first root (status `RESULTS.event`, a success);
      output rows after it are unreached (`inf`). With False the solve continues and
      the first `max_roots` roots are recorded.
    - `direction`: 0 (any crossing), +1 (g increasing through 0) or −1 (decreasing);
      an int for all components or a tuple with one per component.
    - `max_roots`: how many roots are recorded (`sol.event_ts`); a terminal event has 1.
    """

    cond: Callable
    terminal: bool = eqx.field(static=True, default=True)
    direction: int | tuple = eqx.field(static=True, default=0)
    max_roots: int = eqx.field(static=True, default=1)

    def __check_init__(self):
        dirs = self.direction if isinstance(self.direction, tuple) else (self.direction,)
        if any(d not in (-1, 0, 1) for d in dirs):
            raise ValueError(f"Event(direction=...) must be -1, 0 or 1 (or a tuple of them), "
                             f"got {self.direction!r}.")
        if not (isinstance(self.max_roots, int) and self.max_roots >= 1):
            raise ValueError(f"Event(max_roots=...) must be a positive integer, got "
                             f"{self.max_roots!r}.")

    @property
    def n_roots(self) -> int:
        return 1 if self.terminal else self.max_roots

    def g(self, t, y, yp, args):
        return jnp.asarray(self.cond(t, y, yp, args), y.dtype).reshape(-1)


class EventState(eqx.Module):
    """Carried through the step loop: the sign reference (t_lo, g_lo) and the roots
    found, with the dense-output derivative stack y^(m)(t*) (and the sensitivities')."""

    t_lo: Float[Array, ""]
    g_lo: Float[Array, " n_ev"]
    count: Int[Array, ""]
    t: Float[Array, " R"]
    yd: Float[Array, "R order+2 n"]
    sd: Float[Array, "R k order+2 n"]
    mask: Bool[Array, "R n_ev"]
    stopped: Bool[Array, ""]

    @classmethod
    def create(cls, event: Event, t0, y0, yp0, args, order: int, k: int):
        g0 = event.g(t0, y0, yp0, args)
        R, n = event.n_roots, y0.shape[0]
        inf = jnp.asarray(jnp.inf, y0.dtype)
        return cls(t_lo=jnp.asarray(t0, y0.dtype), g_lo=g0, count=jnp.zeros((), jnp.int32),
                   t=jnp.full((R,), inf), yd=jnp.full((R, order + 2, n), inf),
                   sd=jnp.full((R, k, order + 2, n), inf),
                   mask=jnp.zeros((R,) + g0.shape, bool), stopped=jnp.zeros((), bool))


def _directions(event: Event, n_ev: int):
    d = event.direction
    d = d if isinstance(d, tuple) else (d,) * n_ev
    if len(d) != n_ev:
        raise ValueError(f"Event(direction=...) has {len(d)} entries but cond returns {n_ev}.")
    return jnp.asarray(d)


def _crossed(g_lo, g_hi, direction):
    """Components whose sign changes in (t_lo, t_hi] in the requested direction (a zero
    at t_hi counts, as IDAS reports exact zeros)."""
    up = (g_lo < 0) & (g_hi >= 0)
    down = (g_lo > 0) & (g_hi <= 0)
    return where(direction > 0, up, where(direction < 0, down, up | down))


def search_step(event: Event, args, s, es: EventState, order: int) -> EventState:
    """Roots of g in (t_lo, t_n] of the accepted step in state `s` (see the module
    docstring); records them and sets `stopped` for a terminal event."""
    R = event.n_roots
    uround = jnp.finfo(s.phi.dtype).eps
    tau = 100.0 * uround * (jnp.abs(s.t) + jnp.abs(s.h_used))

    def g_at(t):
        w = derivative_weights(t, s.t, s.psi, s.k_used, 1)
        y, yp = w @ s.phi
        return event.g(t, y, yp, args)

    g_hi = g_at(s.t)
    direction = _directions(event, g_hi.shape[0])

    def more(c):
        es_, _, _ = c
        crossed = _crossed(es_.g_lo, g_hi, direction)
        return jnp.any(crossed) & (es_.count < R) & ~es_.stopped

    def find(c):
        es_, _, _ = c
        root, mask = _secant(g_at, es_.t_lo, es_.g_lo, s.t, g_hi, direction, tau)
        w = derivative_weights(root, s.t, s.psi, s.k_used, order + 1)
        i = jnp.minimum(es_.count, R - 1)
        es_ = eqx.tree_at(
            lambda e: (e.t, e.yd, e.sd, e.mask, e.count, e.t_lo, e.g_lo, e.stopped), es_,
            (es_.t.at[i].set(root), es_.yd.at[i].set(w @ s.phi),
             es_.sd.at[i].set(jnp.einsum("mj,jkn->kmn", w, stacked(s.phis))),
             es_.mask.at[i].set(mask),
             # Past a root the reference sign is the new one: g at the bracket's upper end.
             es_.count + 1, root, g_at(root), jnp.asarray(event.terminal)))
        return es_, root, mask

    es, _, _ = jax.lax.while_loop(more, find, (es, jnp.zeros((), s.phi.dtype),
                                               jnp.zeros_like(es.mask[0])))
    # The next step searches from this step's end (unless stopped).
    return eqx.tree_at(lambda e: (e.t_lo, e.g_lo), es,
                       (where(es.stopped, es.t_lo, s.t), where(es.stopped, es.g_lo, g_hi)))


def _secant(g_at, t_lo, g_lo, t_hi, g_hi, direction, tau):
    """IDAS's modified secant (Illinois) search for the first root in (t_lo, t_hi]."""
    active0 = _crossed(g_lo, g_hi, direction)

    def cond(c):
        t_lo, _, t_hi, _, _, _, it = c
        return (jnp.abs(t_hi - t_lo) > tau) & (it < MAX_SEARCH)

    def body(c):
        t_lo, g_lo, t_hi, g_hi, alpha, side, it = c
        active = _crossed(g_lo, g_hi, direction)
        # The component whose secant root lies closest to t_lo.
        score = where(active, jnp.abs(g_hi) / jnp.maximum(jnp.abs(g_hi - g_lo), 1e-300), -1.0)
        i = jnp.argmax(score)
        gl, gh = g_lo[i], g_hi[i]
        denom = gh - alpha * gl
        t_mid = t_hi - (t_hi - t_lo) * gh / where(denom == 0, 1.0, denom)
        t_mid = where(denom == 0, 0.5 * (t_lo + t_hi), t_mid)
        # Keep t_mid strictly inside, at least τ/2 from the ends (IDAS's adjustment).
        width = t_hi - t_lo
        fraction = jnp.clip((t_mid - t_lo) / width, 0.0, 1.0)
        near_lo = (t_mid - t_lo) < 0.5 * tau
        near_hi = (t_hi - t_mid) < 0.5 * tau
        small = jnp.maximum(0.5 * tau / jnp.abs(width), 0.1)
        fraction = where(near_lo, jnp.minimum(small, 0.5), fraction)
        fraction = where(near_hi, 1.0 - jnp.minimum(small, 0.5), fraction)
        t_mid = t_lo + fraction * width
        g_mid = g_at(t_mid)
        low = jnp.any(_crossed(g_lo, g_mid, direction) & active)   # root in (t_lo, t_mid]
        new_side = where(low, -1, 1).astype(jnp.int32)
        alpha = where(new_side == side, where(low, 0.5 * alpha, 2.0 * alpha), 1.0)
        alpha = where(it < 2, 1.0, alpha)
        t_lo, g_lo = where(low, t_lo, t_mid), where(low, g_lo, g_mid)
        t_hi, g_hi = where(low, t_mid, t_hi), where(low, g_mid, g_hi)
        return t_lo, g_lo, t_hi, g_hi, alpha, new_side, it + 1

    one = jnp.ones((), t_lo.dtype)
    t_lo, g_lo, t_hi, g_hi, _, _, _ = jax.lax.while_loop(
        cond, body, (t_lo, g_lo, t_hi, g_hi, one, jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32)))
    return t_hi, _crossed(g_lo, g_hi, direction) & active0


# --------------------------------------------------------------------- derivatives


def _g_terms(event: Event, args, t, yd):
    """g and its partial derivatives at the root: returns (ġ, vjp) with ġ the total
    time derivative g_t + g_y y' + g_y' y'' and vjp(w) = (wᵀg_y, wᵀg_y', wᵀg_args)."""
    y, yp, ypp = yd[0], yd[1], yd[2]
    dyn, static = eqx.partition(args, eqx.is_inexact_array)

    def g(t_, y_, yp_, d_):
        return event.g(t_, y_, yp_, eqx.combine(d_, static))

    zero_d = jax.tree_util.tree_map(jnp.zeros_like, dyn)
    _, gdot = jax.jvp(g, (t, y, yp, dyn), (jnp.ones_like(t), yp, ypp, zero_d))
    _, vjp = jax.vjp(lambda y_, yp_, d_: g(t, y_, yp_, d_), y, yp, dyn)
    return gdot, vjp, (g, dyn)


def event_tangents(event: Event, args, t, mask, yd, sd, args_dot):
    """ṫ* and (y^(m)(t*))˙ for every recorded root and direction: t (R,), mask (R, n_ev),
    yd (R, order+2, n), sd (R, k, order+2, n), args_dot (k-leading pytree or None).
    Returns (t_dot (k, R), yd_dot (k, R, order+1, n)); roots not found give 0."""

    def one_root(t_r, mask_r, yd_r, sd_r):
        found = jnp.isfinite(t_r)
        t_r = where(found, t_r, 0.0)
        yd_r = where(found, yd_r, 0.0)
        sd_r = where(found, sd_r, 0.0)
        gdot, _, (g, dyn) = _g_terms(event, args, t_r, yd_r)
        # The component that crossed (the first, if several crossed together).
        i = jnp.argmax(mask_r)

        def per_direction(s_r, d_dot):
            d_dot = jax.tree_util.tree_map(jnp.zeros_like, dyn) if d_dot is None else d_dot
            _, gs = jax.jvp(lambda y_, yp_, d_: g(t_r, y_, yp_, d_), (yd_r[0], yd_r[1], dyn),
                            (s_r[0], s_r[1], d_dot))
            t_dot = -gs[i] / gdot[i]
            # y^(m)(t*)˙ = s^(m) + y^(m+1) ṫ*; the top entry's y^(m+1) is not kept (it only
            # enters derivatives of order three and higher of event states).
            shift = jnp.concatenate([yd_r[1:], jnp.zeros_like(yd_r[:1])], 0)
            yd_dot = s_r + shift * t_dot
            return where(found, t_dot, 0.0), where(found, yd_dot, 0.0)

        if args_dot is None:
            return jax.vmap(lambda s_r: per_direction(s_r, None))(sd_r)
        return jax.vmap(per_direction)(sd_r, args_dot)

    t_dot, yd_dot = jax.vmap(one_root)(t, mask, yd, sd)     # (R, k), (R, k, ...)
    return jnp.moveaxis(t_dot, 1, 0), jnp.moveaxis(yd_dot, 1, 0)


def event_cotangents(event: Event, args, t, mask, yd, t_bar, yd_bar):
    """The reverse of `event_tangents` for one cotangent direction: cotangents t̄* (R,)
    and ȳd* (R, order+1, n) become point observations at t* (ȳ (R, n), ȳ' (R, n), their
    higher-derivative part (R, order−1, n) which must vanish) and a direct cotangent on
    the differentiable args (pytree)."""

    def one_root(t_r, mask_r, yd_r, tb, ydb):
        found = jnp.isfinite(t_r)
        t_r = where(found, t_r, 0.0)
        yd_r = where(found, yd_r, 0.0)
        gdot, vjp, _ = _g_terms(event, args, t_r, yd_r)
        i = jnp.argmax(mask_r)
        c = tb + jnp.sum(ydb[:-1] * yd_r[1:])
        w = jnp.zeros_like(gdot).at[i].set(-c / gdot[i])
        gy, gyp, gp = vjp(w)
        zero = where(found, 1.0, 0.0)
        return ((ydb[0] + gy) * zero, (ydb[1] + gyp) * zero, ydb[2:] * zero,
                jax.tree_util.tree_map(lambda x: x * zero, gp))

    yb, ypb, higher, pb = jax.vmap(one_root)(t, mask, yd, t_bar, yd_bar)
    return yb, ypb, higher, jax.tree_util.tree_map(lambda x: jnp.sum(x, 0), pb)


def observations(config, inputs, rec, ct):
    """The reverse passes' point observations: the output rows and the event roots
    (their cotangents turned into observations at t* by `event_cotangents`), sorted by
    time, for k cotangent directions. Rows a terminal event left unreached, and roots
    not found, get zero cotangent at the harmless time t0.

    Returns (times (m,), ȳd (k, m, order+1, n), q̄ (k, m, nq), direct args cotangent
    (k-leading pytree, or None without events))."""
    yd_bar, qbar, t_bar, ev_bar = ct
    ts, t0 = inputs.saveat, inputs.t0
    event = config.event
    if event is None:
        return ts, yd_bar, qbar, None
    k = yd_bar.shape[0]
    order = yd_bar.shape[2] - 1
    t_stop = where(event.terminal & jnp.isfinite(rec.event_t[0]), rec.event_t[0], jnp.inf)
    reached = ts <= t_stop
    times_out = where(reached, ts, t0)
    yd_bar = where(reached[None, :, None, None], yd_bar, 0.0)
    qbar = where(reached[None, :, None], qbar, 0.0)
    found = jnp.isfinite(rec.event_t)

    def per_direction(tb, eb):
        yb, ypb, higher, pb = event_cotangents(event, inputs.args, rec.event_t, rec.event_mask,
                                               rec.event_yd, tb, eb)
        return jnp.concatenate([yb[:, None], ypb[:, None], higher[:, :order - 1]], axis=1), pb

    ev_yd_bar, p_direct = jax.vmap(per_direction)(t_bar, ev_bar)
    times = jnp.concatenate([times_out, where(found, rec.event_t, t0)])
    yd_all = jnp.concatenate([yd_bar, where(found[None, :, None, None], ev_yd_bar, 0.0)], 1)
    q_all = jnp.concatenate([qbar, jnp.zeros((k, rec.event_t.shape[0], qbar.shape[2]), qbar.dtype)], 1)
    perm = jnp.argsort(times, stable=True)
    return times[perm], yd_all[:, perm], q_all[:, perm], p_direct
