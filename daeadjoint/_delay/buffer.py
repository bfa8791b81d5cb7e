r"""The lagged values y(t − τᵢ) of a delay DAE from the integrator's own interpolating
polynomials.

Every accepted BDF step [t_{j−1}, t_j] leaves IDAS's modified divided differences
(φ_0 … φ_5, ψ_0 … ψ_5, the order k_j): the interpolating polynomial of that step,
evaluated by `derivative_weights` exactly as the dense output is (IDAS `IDAGetDky`). A
`DelayBuffer` keeps the last C of them in a ring (memory O(C·6n), whatever the length of
the integration), and `lagged` evaluates y(s) (and y'(s)) at s = t − τᵢ from the step
containing s, or from the history function h(s, args) for s ≤ t0.

The buffer travels through the integration as a per-step recorder of the step loop
(`_integrator.integrate` hands the current one to the residual inside `DelayArgs`), so
the residual sees the steps taken so far without host callbacks.

Which side of a step boundary. The breakpoints of y (t0 + Σ kᵢτᵢ, `solve.py`) are step
boundaries, and there some derivative of y jumps. A step ending on a breakpoint b is
evaluated at `before(b)` (a few ulps short of it): its lagged points lie a few ulps short
of b − τᵢ, which is itself a step boundary, and they must read the polynomial of the step
*ending* there (the left limit: the step integrates the piece before b); the restart at
b evaluates at `after(b)` and must read the step *starting* there. Rounding in t − τ can
put s a few ulps on either side, so the containing step is searched for at s ∓ δ with δ
a few ulps of the time scale: −δ (left limit) unless t lies a few ulps past a
breakpoint. (For the values this matters only where y itself jumps — an algebraic
component whose history is inconsistent at t0 — but the derivatives w.r.t. τ see
−y'(t − τ) and y' jumps at t0.)

Lagged derivatives (`derivatives=True`, for the forward-sensitivity system's term
−y'(t − τ)·τ̇). The derivative of the piecewise interpolant jumps at every past step
boundary (each step's polynomial has its own slope there, different by the local error
over h — after a restart at order 1 by h·y''/2). Where y'(t − τ) enters an *algebraic*
equation of the variational system (an algebraic variable fed by a lagged state, e.g. a
delayed controller), such a jump is a jump of an algebraic sensitivity, which no step
size resolves: the error test fails until the step size underflows. So the lagged
derivative is made continuous: on step j = [a, b] it is p_j'(s) + (1 − θ)·d_j,
θ = (s − a)/(b − a), where d_j = p_{j−1}'(a) − p_j'(a) is the jump of the slopes at the
step's left end — O(h^k) like the local error, so the order of the polynomials is kept —
and the right end is left as it is (the next step corrects its own left end). A step
starting at t0 or at a breakpoint (where y' may jump) has d_j = 0.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from .._bdf import NPHI, derivative_weights
from .._closures import TracedOnce

# Half-width of the search window around s = t − τ, in ulps of the time scale (see the
# module docstring): above the rounding of t − τ, far below any step.
SIDE_ULPS = 16


def count_below(b, x) -> Int[Array, "..."]:
    """The number of entries of the ascending array b (B,) below x (any shape): JAX's
    `searchsorted` as unrolled rounds of a binary search (one gather each; no loop of its
    own inside the step loop)."""
    return jnp.searchsorted(b, x, side="left", method="scan_unrolled")


class DelayBuffer(eqx.Module):
    """The last `capacity` accepted steps: their end points, (φ, ψ, k_used), and whether
    a step still needed was overwritten (`lost`: the ring was too small for the longest
    delay; the solve stops with `RESULTS.delay_history_lost`)."""

    t0: Float[Array, ""]
    tau_max: Float[Array, ""]
    breakpoints: Float[Array, " B"] | None      # ascending (`solve.breaking_points`)
    t_left: Float[Array, " C"]
    t_right: Float[Array, " C"]
    phi: Float[Array, "C 6 n"]
    psi: Float[Array, "C 6"]
    k_used: Int[Array, " C"]
    t_last: Float[Array, ""]
    count: Int[Array, ""]
    lost: Bool[Array, ""]
    # With `continuous_slopes` (lagged derivatives wanted): each step's jump of the
    # slopes at its left end, d_j, and the newest step's slope at its right end.
    slope_jump: Float[Array, "C n"] | None = None
    yp_last: Float[Array, " n"] | None = None
    per_step = True          # a recorder of the step loop (`_integrator.integrate`)

    @classmethod
    def empty(cls, t0, tau_max, breakpoints, capacity: int, n: int, dtype,
              continuous_slopes: bool = False) -> "DelayBuffer":
        """An empty ring of `capacity` steps; `continuous_slopes`: also keep what makes
        the lagged derivatives continuous (module docstring)."""
        inf = jnp.asarray(jnp.inf, dtype)
        t0 = jnp.asarray(t0, dtype)
        slopes = jnp.zeros((capacity, n), dtype) if continuous_slopes else None
        return cls(t0=t0, tau_max=jnp.asarray(tau_max, dtype), breakpoints=breakpoints,
                   t_left=jnp.full((capacity,), inf), t_right=jnp.full((capacity,), -inf),
                   phi=jnp.zeros((capacity, NPHI, n), dtype),
                   psi=jnp.ones((capacity, NPHI), dtype),
                   k_used=jnp.ones((capacity,), jnp.int32), t_last=t0,
                   count=jnp.zeros((), jnp.int32), lost=jnp.zeros((), bool),
                   slope_jump=slopes,
                   yp_last=None if slopes is None else jnp.zeros((n,), dtype))

    @property
    def capacity(self) -> int:
        return self.t_left.shape[0]

    def record(self, s, passed) -> "DelayBuffer":
        """Store an accepted step (state `s` after it) in the oldest slot. The slot's old
        step [a, b] is still needed if a later lagged point can fall in it: the next
        steps evaluate at t − τᵢ > s.t − τ_max, so b > s.t − τ_max means it is lost."""
        i = jnp.mod(self.count, self.capacity)
        lost = self.lost | (passed & (self.count >= self.capacity)
                            & (self.t_right[i] > s.t - self.tau_max))

        def put(buf, value):
            return buf.at[i].set(jnp.where(passed, value, buf[i]))

        slopes = {}
        if self.yp_last is not None:
            # The step polynomial's slopes at both ends; the jump at the left end against
            # the previous step's right slope, none where the step starts at t0 or at a
            # breakpoint (y' may jump there).
            right = derivative_weights(s.t, s.t, s.psi, s.k_used, 1)[1] @ s.phi
            left = derivative_weights(self.t_last, s.t, s.psi, s.k_used, 1)[1] @ s.phi
            fresh = self.count == 0
            if self.breakpoints is not None:
                fresh = fresh | self.is_breakpoint(self.t_last)
            jump = jnp.where(fresh, 0.0, self.yp_last - left)
            slopes = dict(slope_jump=put(self.slope_jump, jump),
                          yp_last=jnp.where(passed, right, self.yp_last))
        return dataclasses.replace(
            self, t_left=put(self.t_left, self.t_last), t_right=put(self.t_right, s.t),
            phi=put(self.phi, s.phi), psi=put(self.psi, s.psi), k_used=put(self.k_used, s.k_used),
            t_last=jnp.where(passed, s.t, self.t_last), count=self.count + passed.astype(jnp.int32),
            lost=lost, **slopes)

    def locate(self, q) -> Int[Array, " d"]:
        """The slot of the stored step [a, b] with a < q ≤ b, for each point of q (d,);
        the newest step's slot where none contains q (q past it, or in the history, or
        in a step already overwritten).

        A binary search over the steps in the order they were taken: the j-th oldest
        stored step is in slot (start + j) mod C (start = 0 until the ring is full, then
        the oldest slot, count mod C), and its right ends increase with j, so the first
        step with b ≥ q is the only one that can contain q (the steps tile [a_oldest,
        b_newest] without gaps or overlaps). ⌈log₂(C + 1)⌉ rounds of one gather each, in
        place of comparing q with all C slots: the lagged values are read at every
        residual evaluation, and the adjoint's backward ring holds tens of thousands of
        steps with many observations."""
        C = self.capacity
        filled = jnp.minimum(self.count, C)
        start = jnp.where(self.count >= C, jnp.mod(self.count, C), 0)
        lo = jnp.zeros(q.shape, jnp.int32)
        hi = jnp.broadcast_to(filled, q.shape).astype(jnp.int32)
        # Invariant: the answer lies in [lo, hi] (hi = filled: no step ends at or after q).
        for _ in range(C.bit_length()):      # C.bit_length() = ⌈log₂(C + 1)⌉
            mid = (lo + hi) // 2
            open_ = lo < hi
            up = self.t_right[jnp.mod(start + mid, C)] >= q
            hi = jnp.where(open_ & up, mid, hi)
            lo = jnp.where(open_ & ~up, mid + 1, lo)
        slot = jnp.mod(start + lo, C)
        found = (lo < filled) & (self.t_left[slot] < q)
        return jnp.where(found, slot, jnp.mod(self.count - 1, C))

    def is_breakpoint(self, t) -> Bool[Array, ""]:
        """t is one of the (sorted) breakpoints: a binary search."""
        if self.breakpoints is None:
            return jnp.zeros((), bool)
        b = self.breakpoints
        if b.shape[0] == 0:
            return jnp.zeros((), bool)
        return b[jnp.minimum(count_below(b, t), b.shape[0] - 1)] == t

    def just_after_breakpoint(self, t) -> Bool[Array, ""]:
        """t lies a few ulps past a breakpoint (the restart's evaluation point there).
        The breakpoints are sorted: only the last one before t can be that close (the
        adjoint's backward solve has one per observation and lag)."""
        if self.breakpoints is None:
            return jnp.zeros((), bool)
        b = self.breakpoints
        if b.shape[0] == 0:
            return jnp.zeros((), bool)
        j = count_below(b, t) - 1                             # the last b < t, if any
        bj = b[jnp.maximum(j, 0)]
        width = SIDE_ULPS * jnp.finfo(b.dtype).eps * jnp.maximum(jnp.abs(bj), 1.0)
        return (j >= 0) & (t > bj) & (t - bj <= width)

    def evaluate(self, s, right, order: int):
        """y^(m)(s), m = 0 … order, for the points s (m_d,) from the stored steps: (m_d,
        order+1, n). Points past the newest step extrapolate it (only by rounding: steps
        are at most min τ)."""
        dtype = self.phi.dtype
        scale = jnp.maximum(jnp.maximum(jnp.abs(s), jnp.abs(self.t0)), self.tau_max)
        delta = SIDE_ULPS * jnp.finfo(dtype).eps * scale
        q = jnp.where(right, s + delta, s - delta)
        idx = self.locate(q)
        w = jax.vmap(lambda si, j: derivative_weights(si, self.t_right[j], self.psi[j],
                                                      self.k_used[j], order))(s, idx)
        out = jnp.einsum("dmj,djn->dmn", w, self.phi[idx])
        if order >= 1 and self.slope_jump is not None:
            theta = (s - self.t_left[idx]) / (self.t_right[idx] - self.t_left[idx])
            out = out.at[:, 1].add((1 - theta)[:, None] * self.slope_jump[idx])
        return out, q


class DelayArgs(eqx.Module):
    """`args` as the core sees the residual of a delay DAE: the user's args, the lags τ
    (m,), and the step history (replaced on every step by the integration loop)."""

    user: Any
    tau: Float[Array, " m"]
    buffer: DelayBuffer


class DelayResidual(eqx.Module):
    """F_core(t, y, y', DelayArgs) = F(t, y, y', Y_lag, args) with Y_lag[i] = y(t − τᵢ)
    (and, with `derivatives`, F(t, y, y', Y_lag, Y'_lag, args): the forward-sensitivity
    system needs y'(t − τᵢ)). `history(s, args)` is y(s) for s ≤ t0. Static: the
    functions only; every array is in `DelayArgs`."""

    model: Callable = eqx.field(static=True)
    history: Callable = eqx.field(static=True)
    derivatives: bool = eqx.field(static=True, default=False)

    def lagged(self, t, a: DelayArgs):
        """(Y_lag, Y'_lag or None) at t."""
        buf = a.buffer
        s = t - a.tau
        order = 1 if self.derivatives else 0
        right = buf.just_after_breakpoint(t)
        stored, q = buf.evaluate(s, right, order)
        in_history = q <= buf.t0
        s_hist = jnp.minimum(s, buf.t0)   # the history is only asked for at s ≤ t0
        if self.derivatives:
            hv, hd = jax.vmap(lambda si: jax.jvp(lambda x: self.history(x, a.user),
                                                 (si,), (jnp.ones_like(si),)))(s_hist)
        else:
            hv, hd = jax.vmap(lambda si: self.history(si, a.user))(s_hist), None
        vals = jnp.where(in_history[:, None], hv, stored[:, 0])
        ders = None if hd is None else jnp.where(in_history[:, None], hd, stored[:, 1])
        return vals, ders

    def __call__(self, t, y, yp, a: DelayArgs):
        vals, ders = self.lagged(t, a)
        if self.derivatives:
            return self.model(t, y, yp, vals, ders, a.user)
        return self.model(t, y, yp, vals, a.user)


def delay_residual(model: Callable, history: Callable, derivatives: bool = False) -> Callable:
    """`DelayResidual` traced once per signature (`TracedOnce`, as `solve` does for a
    plain residual function; a Module it would otherwise call at every use). The solver
    evaluates the residual at many places of one program, and a delay residual's
    tracing is its lag lookup's (the binary search over the step ring, the interpolation
    weights, the history), not only the user's function: recorded once, its jaxpr is
    called everywhere, and JAX builds its derivatives and batchings once. The compiled
    programs compute the same values, bit for bit (the gradient of y(5) of
    y' = -y(t - tau) w.r.t. (tau, c) by the adjoint, and the forward solve's values and
    sensitivities, at rtol 1e-6 and 1e-9); that gradient program's tracing and lowering
    took 12.1 instead of 23.7 CPU s (54792 -> 32321 StableHLO lines, the residual now a
    called function), the two traced gradients of
    tests/test_delays.py::test_checkpointed_adjoint_memory_is_bounded_by_its_segments
    20.0 instead of 38.8 CPU s (load ~3.5)."""
    return TracedOnce(DelayResidual(model=model, history=history, derivatives=derivatives))
