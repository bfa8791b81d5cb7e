r"""Reverse-mode derivatives of `solve`: the continuous augmented adjoint DAE, solved
backward with checkpoint recomputation (the impl of `autodiff.cotangent_p`).

Mathematics (Li & Petzold, DASPKADJOINT, eqs. (10)/(14); Bartlett, SAND2007-6699,
eqs. (38), (40)–(42)). For a loss with point terms on y(t_i), y'(t_i) and integral terms
∫_{t0}^{t_i} q dt, the Lagrangian L − ∫ λᵀF dt is stationary in y when μ := F_y'ᵀλ − g_y'ᵀ
satisfies

    dμ/dt = F_yᵀ λ − g_yᵀ,        μ − F_y'ᵀ λ + g_y'ᵀ = 0,                        (A)

with g(t, y, y') = w(t)ᵀ q(t, y, y') and w(t) = Σ_{t_i ≥ t} q̄_i (the quadrature
cotangents), integrated backward in time. Then

    dL/dp  = ∫_{t0}^{T} (w ᵀq_p − λᵀF_p) dt + Σ_i (jump terms),
    dL/dy0 = μ(t0) on the free (differential) components.

(A) is solved as an index-1 DAE in Z = (μ, λ) with s = t_r − t by the same BDF integrator.
t_r is the time of the latest restart, so that s starts at 0 after every observation: a
cotangent that excites a fast mode of the adjoint starts a boundary layer there, which
needs steps below the float spacing of t itself (Robertson's y1(4e10): first steps of
~1e-8 at t = 4e8, where t is spaced 6e-8). Once t is nearer to 0 than to t_r the
integration continues in s = −t (`rebase`), where the forward solution's transients near
t0 are resolvable. The integration has
error control on μ (the "λ̄" of Li & Petzold), on the λ_i of differential equations and
on the parameter-gradient quadrature (Li & Petzold §5.5, Table 2). The multipliers of
algebraic equations are left out of the test: they follow F_y(t, y(t), y'(t)) of the
interpolated forward solution algebraically. The Newton rate is re-estimated every step
because (A) is linear (Li & Petzold §5.3); for small dense systems the iteration matrix
is instead set up at every attempt and one exact iteration taken (`fresh_matrix`). Its
iteration matrix [[cj I, F_yᵀ], [I, −F_y'ᵀ]]
is solved through the *transpose* of the forward iteration matrix J = F_y + cj F_y', with
whatever linear solver the forward problem uses (`AdjointSolver`):

    δλ = J⁻ᵀ(r₁ − cj r₂),    δμ = r₂ + F_y'ᵀ δλ.

Point cotangents (ȳ_i, ȳp_i) at t_i make λ carry a Dirac mass ν δ(t − t_i) with
F_y'ᵀν = 0 on the algebraic part, giving the consistent jump (Calver & Enright eq. (16),
Li & Petzold §4.1)

    M ν = a∘ȳ + d∘ȳp,   M = diag(d) F_y'ᵀ + diag(a) F_yᵀ,
    μ(t_i⁻) = μ(t_i⁺) + ȳ − F_yᵀν,       dL/dp −= F_pᵀν,

where a (d) masks algebraic (differential) components: M is the transpose of the
consistency matrix C of `_consistency.py`, nonsingular exactly when the DAE is index 1
with those algebraic variables.

For a Hessenberg index-2 DAE (`index2`) M is singular and (A) is index 2 itself; the
jumps, restarts and initial-value cotangents use the transposed hidden-constraint
consistency matrix instead (Li & Petzold §4.2, §5.6; the section "Hessenberg index 2"
below).

Only the step sequence of the forward pass is reused; step sizes and orders are never
differentiated (Eberhard & Bischof): what is differentiated is the continuous problem.
"""

import dataclasses
from collections.abc import Callable
from typing import Literal, NamedTuple, get_args

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree
from jaxtyping import Array, Bool, Float, Int

from .._bdf import NPHI
from .._consistency import Split, consistency_factor, consistency_solve, split_at
from .._core import build_problem
from .._events import observations
from .._jax_internals import is_batched, unvmap_all, unvmap_any
from .._integrator import (LOOP_BYTES, CheckpointRecorder, Outputs, Problem, SegmentRecorder,
                           State, StepRecorder, _write_slot, hermite, initial_state,
                           initial_step, integrate, restore_linear_state, segment_capacity)
from .._linalg.linear_solver import UNROLLED_GAUSS_JORDAN_N, AbstractLinearSolver, DenseLU
from .._newton import maybe_update
from .._ops import packed_while_loop, taken_where, where
from .._results import RESULTS, runtime_errors_raise, succeeded
from .discrete_adjoint import (DiscreteAdjoint, discrete_segment, initial_value_tangents,
                               replayed_steps, sweep_setup, zero_bars)
from .reverse import AbstractAdjoint
from .tangents import _restrict, reverse_tangents_at_t0


# How the backward pass evaluates the forward solution between steps (`Adjoint`).
Interpolation = Literal["hermite", "bdf"]

# `Adjoint(keep_bytes=...)`'s default: 256 KiB. A kept segment is one the backward pass
# does not replay (its steps are recorded through the step loop's stage,
# `TrajectoryStage`), and keeping was not slower anywhere measured
# (benchmarks/gradient_cost.py --keep-bytes, interleaved rounds, gradient CPU medians,
# 2026-11-29, docs/performance.md): Robertson
# (n = 3, all 987 steps kept) 21.1 against 29.1 ms with the replay (load 7.8); heat n =
# 49 (all 100 steps kept) 47.9 against 50.6 ms (load 6.4); heat n = 400 (256 KiB keeps
# none there) 198.7 (1 MiB) and 187.6 (4 MiB) against 203.5 ms; vmap(grad) of 64
# Robertson members 998 against 1047 ms wall; bit for bit, also under jacfwd and
# jax.hessian; compile time the same within its noise. 256 KiB keeps every step of small
# systems' usual runs (4600 steps at n = 3, 300 at n = 49) and nothing past n ≈ 150,
# where larger budgets gained ≤ 8 % of the gradient; and memory is per solve (per member
# under vmap: +16 MiB for 64 members), so the default stays of the order of what the
# checkpoints already hold at the default max_steps for small n (1001 BDF states, each ≥
# 6n numbers: ≥ 141 KiB at n = 3).
KEEP_BYTES = 256 * 1024


class TrajectoryRecorder(eqx.Module):
    """The Hermite nodes (t_m, y_m, y'_m) of the first `steps_kept` accepted steps of
    the recording forward run (`Adjoint(keep_bytes=...)`), node 0 its start: the backward
    pass reads segment i (nodes iN … (i+1)N, N = checkpoint_every) from here instead of
    replaying it (`segment_steps`). The node values are those a replay from checkpoint
    i records (`StepRecorder`): the replay repeats the forward steps bit for bit.

    Staged (`integrate`): the step loop records the nodes into a small stage
    (`TrajectoryStage`, arrays of at most `SEQUENTIAL_BUFFER_BYTES`) and stops when it
    is full, and the outer loop appends the stage here — so the step loop never carries
    this buffer and stays on XLA's sequential executor for small systems, and the outer
    loop runs once per stage, not once per step, as the replay's stage does
    (`replay_segment`). Under a batch (`_integrate_flat`) `record` writes each step."""

    t: Float[Array, " R"]
    y: Float[Array, "R n"]
    yp: Float[Array, "R n"]
    steps: Int[Array, ""]              # nodes kept so far, less node 0 (≤ steps_kept)

    # Rows past the kept nodes, so that a segment's buffer (`segment_capacity` + 1
    # rows) is one slice from its start node at every kept segment.
    MARGIN = segment_capacity(0)
    per_step = False
    staged = True

    @classmethod
    def create(cls, state: State, yp0, steps_kept: int):
        n, dtype = state.phi.shape[1], state.phi.dtype
        rows = steps_kept + 1 + cls.MARGIN
        return cls(t=jnp.full((rows,), jnp.inf, dtype).at[0].set(state.t),
                   y=jnp.zeros((rows, n), dtype).at[0].set(state.phi[0]),
                   yp=jnp.zeros((rows, n), dtype).at[0].set(yp0),
                   steps=jnp.zeros((), jnp.int32))

    @property
    def steps_kept(self) -> int:
        return self.t.shape[0] - 1 - self.MARGIN

    def due(self, s: State, passed) -> Bool[Array, ""]:
        return passed

    def record(self, s: State, passed) -> "TrajectoryRecorder":
        m = s.stats["num_steps"]           # counts this step if it passed
        do = passed & (m <= self.steps_kept)
        y, yp = StepRecorder._node(s)
        t, y, yp = _write_slot((self.t, self.y, self.yp), jnp.minimum(m, self.steps_kept),
                               (s.t, y, yp), do)
        return TrajectoryRecorder(t=t, y=y, yp=yp, steps=self.steps + do.astype(jnp.int32))

    def new_stage(self) -> "TrajectoryStage":
        """An empty stage for the step loop (`integrate`)."""
        # The replay's stage (`StepRecorder.stage`: arrays within the sequential
        # executor's limit), or two steps where fewer fit (large n, whose step loop is
        # on the thread pool anyway).
        n, dtype = self.y.shape[1], self.y.dtype
        node = StepRecorder.create(1, n, dtype).stage(SEQUENTIAL_BUFFER_BYTES)
        return TrajectoryStage(node if node is not None else StepRecorder.create(2, n, dtype),
                               self.steps_kept)

    def append(self, stage: "TrajectoryStage") -> "TrajectoryRecorder":
        """These nodes, then those of `stage`: the rows `record` would have written."""
        node = stage.node
        j = jnp.arange(node.t.shape[0] - 1)
        at = where(j < node.count, self.steps + 1 + j, self.t.shape[0])

        def put(b, v):
            return b.at[at].set(v, mode="drop")

        return TrajectoryRecorder(t=put(self.t, node.t[1:]), y=put(self.y, node.y[1:]),
                                  yp=put(self.yp, node.yp[1:]), steps=self.steps + node.count)

    def holds(self, i, every: int) -> Bool[Array, ""]:
        """Whether segment i is kept whole."""
        return (i + 1) * every <= self.steps_kept

    def segment(self, i, every: int, like: StepRecorder) -> StepRecorder:
        """Segment i (nodes i·every … end) as a `StepRecorder` shaped as `like`; the
        last segment of the run ends at its last step."""
        rows = like.t.shape[0]
        start = jnp.minimum(i * every, self.steps_kept - every)
        count = jnp.clip(self.steps - start, 0, every)
        t = jax.lax.dynamic_slice_in_dim(self.t, start, rows)
        t = where(jnp.arange(rows) <= count, t, jnp.inf)
        return dataclasses.replace(like, t=t, y=jax.lax.dynamic_slice_in_dim(self.y, start, rows),
                                   yp=jax.lax.dynamic_slice_in_dim(self.yp, start, rows),
                                   count=count)


class TrajectoryStage(eqx.Module):
    """The nodes of the steps since the last append (`TrajectoryRecorder.new_stage`), of
    steps up to `steps_kept` only: recorded in `integrate`'s step loop."""

    node: StepRecorder
    steps_kept: int = eqx.field(static=True)
    per_step = True

    def record(self, s: State, passed) -> "TrajectoryStage":
        do = passed & (s.stats["num_steps"] <= self.steps_kept)
        return TrajectoryStage(self.node.record(s, do), self.steps_kept)

    def full(self) -> Bool[Array, ""]:
        return self.node.count >= self.node.t.shape[0] - 1


class Adjoint(AbstractAdjoint):
    """Gradients by the continuous adjoint DAE solved backward.

    **Arguments:**

    - `checkpoint_every`: steps between hot-restart checkpoints of the forward pass
      (default 100, as IDAS's adjoint examples). The forward pass also keeps the steps
      of its first segments (`keep_bytes`) and, for n ≥ 11 past those, of its last
      segment; the other segments are replayed, once each. Memory: ⌈max_steps /
      checkpoint_every⌉ + 1 checkpoints of O(n) each, `keep_bytes`, plus two segment
      buffers (the forward's last and the backward's current) of checkpoint_every + O(1)
      steps × 2n — independent of the number of steps taken. With `delays=` each checkpoint also holds the step
      history ring (`history_steps` steps), and the delay adjoint recomputes from
      checkpoints only where that stores fewer steps than the whole trajectory
      (`_delay/checkpoint.py`, docs/delays.md).
    - `interpolation`: how the backward pass evaluates the forward solution between
      steps: `"hermite"` (default; piecewise cubic Hermite on the step nodes, C¹, so the
      adjoint's coefficients are continuous) or `"bdf"` (the forward BDF polynomial, as
      the forward dense output; y' jumps at step ends by the local error, which the
      adjoint's error test on λ then has to step through).
    - `rtol`, `atol`: tolerances of the adjoint variables (μ, λ); default: the forward
      rtol and the largest forward atol. Scale `atol` to the size of your cotangents.
    - `quad_error_control`: include the parameter-gradient quadrature ∫(wᵀq_p − λᵀF_p)
      in the adjoint error test (IDAS errconQB; default True: on Robertson it makes the
      rtol-1e-6 gradient 30x more accurate for ~the same number of steps).
    - `keep_bytes`: memory for keeping the forward steps themselves (default 256 KiB:
      `KEEP_BYTES`, whose comment gives the measurements; 0 keeps none). The forward
      pass keeps the Hermite nodes (t, y, y', 2n + 1 numbers) of its first
      S·`checkpoint_every` steps, S = ⌊(keep_bytes / ((2n + 1)·itemsize) − 9) /
      checkpoint_every⌋ whole segments (no more than `max_steps` needs), and the
      backward pass reads those segments instead of replaying them; it replays only the
      segments past them (256 KiB: 4600 steps at n = 3, 300 at n = 49, none past
      n ≈ 150); the memory stays bounded by `keep_bytes` (per member under `vmap`).
      With `interpolation="bdf"` nothing is kept this way.
    - `max_steps`: adjoint steps allowed between two restarts (default: the forward one).
    - `fallback`: when the backward integration fails (`RESULTS.adjoint_failed`) but the
      forward solve succeeded, compute this gradient with the discrete adjoint of the
      forward solve's own steps instead (a second pass of the backward loop, which
      replays the segments from their checkpoints as the first one does, now
      differentiating the replayed steps: `DiscreteAdjoint(segment=checkpoint_every)`'s
      gradient) and warn (`RuntimeWarning`; the gradient is computed after the
      `Solution` is returned, so its `stats` cannot say so). Default True; with False
      the failure is reported (NaN, and an error with `throw=True`).
    """

    checkpoint_every: int = eqx.field(static=True, default=100)
    interpolation: Interpolation = eqx.field(static=True, default="hermite")
    rtol: float | None = None       # may be traced (a tolerance study under jit/vmap)
    atol: float | None = None
    quad_error_control: bool = eqx.field(static=True, default=True)
    keep_bytes: int = eqx.field(static=True, default=KEEP_BYTES)
    max_steps: int | None = eqx.field(static=True, default=None)
    fallback: bool = eqx.field(static=True, default=True)

    def __check_init__(self):
        if self.interpolation not in get_args(Interpolation):
            allowed = ", ".join(map(repr, get_args(Interpolation)))
            raise ValueError(f"Adjoint(interpolation=...) must be one of {allowed}; got "
                             f"{self.interpolation!r}.")
        if not (isinstance(self.checkpoint_every, int) and self.checkpoint_every > 0):
            raise ValueError("Adjoint(checkpoint_every=...) must be a positive integer, got "
                             f"{self.checkpoint_every!r}.")
        if not (isinstance(self.keep_bytes, int) and self.keep_bytes >= 0):
            raise ValueError("Adjoint(keep_bytes=...) must be a non-negative integer, got "
                             f"{self.keep_bytes!r}.")

    def kept_segments(self, n: int, dtype, max_steps: int) -> int:
        """S: how many whole checkpoint segments the forward pass keeps (`keep_bytes`)."""
        if self.interpolation != "hermite":
            return 0
        nodes = self.keep_bytes // ((2 * n + 1) * jnp.dtype(dtype).itemsize)
        return max(0, min((nodes - 1 - TrajectoryRecorder.MARGIN) // self.checkpoint_every,
                          -(-max_steps // self.checkpoint_every)))

    def recorders(self, state, yp0, max_steps: int) -> tuple:
        checkpoints = CheckpointRecorder.create(state, self.checkpoint_every, max_steps)
        recs: tuple = (checkpoints,)
        n, dtype = state.phi.shape[1], state.phi.dtype
        kept = self.kept_segments(n, dtype, max_steps)
        if kept:
            recs = recs + (TrajectoryRecorder.create(state, yp0, kept * self.checkpoint_every),)
        # The last segment's ring pays only past the kept steps.
        if SegmentRecorder.pays(state) and kept * self.checkpoint_every < max_steps:
            recs = recs + (SegmentRecorder.create(state, yp0, self.checkpoint_every,
                                                  hermite=self.interpolation == "hermite"),)
        return recs

    def backward(self, config, inputs, rec, ct, wanted):
        out, result, singular = backward(self, config, inputs, rec, ct, wanted)
        if not self.fallback and config.throw:
            # The reason, where it is known: raised instead of the generic message.
            out = eqx.error_if(out, singular & succeeded(rec.result), ADJOINT_SINGULAR_MESSAGE)
        return out, result


ADJOINT_SINGULAR_MESSAGE = (
    "adjoint_failed: the continuous adjoint has no consistent values: the matrix "
    "M = diag(d) F_y'ᵀ + diag(a) F_yᵀ (the transposed consistency matrix, a the algebraic "
    "directions) is singular, so the DAE is not index 1 in its algebraic variables — "
    "its algebraic block is rank-deficient (e.g. circuit nodes with no capacitance to "
    "ground; or a Hessenberg index-2 DAE: declare its index-2 variables with `index2=`). "
    "With `index2` the matrix is the one with the index-2 constraints replaced by their "
    "time derivatives, singular where the DAE is not index 2. "
    "sensitivity=DiscreteAdjoint() differentiates the computed solution without it.")


def _warn_fallback(fell_back, ok, singular, out_of_steps):
    """The warning of a continuous adjoint that fell back; under `vmap` the operands are
    the whole batch's: whether any member fell back, whether all that did got a
    gradient from the discrete adjoint, whether any of them had a singular M, whether
    any of them ran out of adjoint steps."""
    import warnings
    if not bool(fell_back):
        return
    how = ("the gradient comes from the discrete adjoint" if bool(ok) else
           "the discrete adjoint failed too")
    if bool(singular):
        why = (" because the DAE is not index 1 in its algebraic variables (the adjoint's "
               "consistency matrix M is singular: a rank-deficient algebraic block, e.g. "
               "circuit nodes with no capacitance to ground)")
    elif bool(out_of_steps):
        # The backward integration's step sequence is its own: it can need more steps
        # than the forward run (Robertson to t = 40: ~230 forward, 240–360 backward).
        why = (" because its backward integration took Adjoint(max_steps) steps between "
               "two observations (by default the forward solve's max_steps; the backward "
               "integration can need more steps than the forward one: raise "
               "Adjoint(max_steps=...) to use the continuous adjoint)")
    else:
        why = ""
    warnings.warn(f"daeadjoint: the continuous adjoint failed{why} where the forward solve "
                  f"succeeded; {how} (Adjoint(fallback=True)).", RuntimeWarning, stacklevel=2)


# ------------------------------------------------------------ the adjoint DAE (A)


class AdjointSolver(AbstractLinearSolver):
    """The adjoint Newton matrix [[cj I, F_yᵀ], [I, −F_y'ᵀ]] through the forward
    problem's linear solver transposed: δλ = J⁻ᵀ(r₁ − cj r₂), δμ = r₂ + F_y'ᵀ δλ, with
    F_y'ᵀ δλ by `jax.vjp` at the setup point. Works for every forward solver (dense,
    banded, sparse, Krylov with the transposed preconditioner). The unknowns are k
    directions (μ_i, λ_i) stacked: the matrix is block diagonal, one factorization."""

    inner: AbstractLinearSolver
    terms: "_Terms"                    # the forward problem's residual
    n: int = eqx.field(static=True)
    k: int = eqx.field(static=True, default=1)
    # The forward problem's index-2 variables (bool mask), or None: a matrix-based inner
    # solver then factors J D, D = cj on their columns (as the forward Newton does,
    # `_newton.newton_solve`), and J⁻ᵀ r = (J D)⁻ᵀ (D r) — the adjoint's index-2
    # constraints (the rows of those variables) scaled by cj, its index-2 variables (the
    # multipliers of the constraints) by 1/cj: Li & Petzold, DASPKADJOINT §6. Without
    # it J's pivots shrink like h.
    index2: Array | None = None

    def _scaled(self) -> bool:
        from .._newton import _builds_from_residual
        return self.index2 is not None and _builds_from_residual(self.inner)

    @property
    def stat_names(self) -> tuple:
        return self.inner.stat_names

    @property
    def residual(self) -> Callable:
        return self.terms.F

    def setup(self, residual, s, Z, Zs, cj, aargs):
        buf, _, p, t_r = aargs
        t = t_r - s
        y, yp = buf.evaluate(t)
        # The forward solver is set up with the forward residual and the args it was
        # configured for (a user Jacobian or preconditioner receives the user's args).
        if self._scaled():
            # J D: the Jacobian of w ↦ F(t, D w, D w') at w = D⁻¹ y.
            d = where(self.index2, cj, 1.0).astype(y.dtype)
            res = self.terms.residual
            inner = self.inner.setup(lambda t_, w_, wp_, a: res(t_, d * w_, d * wp_, a), t,
                                     y / d, yp / d, cj, self.terms.args(p))
        else:
            inner = self.inner.setup(self.terms.residual, t, y, yp, cj, self.terms.args(p))
        return inner, (t, y, yp, cj, p)

    def solve(self, state, g, *, transpose=False, weights=None, operator=None):
        inner_state, (t, y, yp, cj, args) = state
        n, k = self.n, self.k
        g = g.reshape(k, 2 * n)
        g1, g2 = g[:, :n], g[:, n:]
        r = g1 - cj * g2
        if self._scaled():
            r = r * where(self.index2, cj, 1.0).astype(r.dtype)   # (J D)⁻ᵀ (D r)
        op = None
        if self.inner.needs_operator:
            _, op = jax.linearize(lambda v: self.residual(t, y + v, yp + cj * v, args),
                                  jnp.zeros_like(y))
        if weights is None:
            lam, stats = jax.vmap(lambda r_: self.inner.solve(
                inner_state, r_, transpose=True, operator=op))(r)
        else:
            # The linear tolerance of an iterative inner solver is measured in the
            # weights of δλ (δμ = r₂ + F_y'ᵀδλ follows without a solve).
            lam, stats = jax.vmap(lambda r_, w_: self.inner.solve(
                inner_state, r_, transpose=True, weights=w_, operator=op))(
                    r, weights.reshape(k, 2 * n)[:, n:])
        _, fyp_vjp = jax.vjp(lambda v: self.residual(t, y, v, args), yp)
        fyp_lam = jax.vmap(lambda l_: fyp_vjp(l_)[0])(lam)
        stats = {name: jnp.sum(v, dtype=v.dtype) for name, v in stats.items()}
        return jnp.concatenate([g2 + fyp_lam, lam], axis=1).reshape(-1), stats

    def solve_failed(self, stats):
        return self.inner.solve_failed(stats)

    def is_singular(self, state):
        return self.inner.is_singular(state[0])


class _Terms(eqx.Module):
    """The forward problem's pieces the adjoint evaluates, with `args` split into the
    differentiated part (flat vector p) and the rest. The `*_t` helpers take k directions
    (leading axis) and linearize once."""

    residual: Callable
    quadrature: Callable | None
    static: object
    unravel: Callable
    npar: int = eqx.field(static=True)

    def args(self, p):
        """The forward problem's args with the differentiated part p."""
        return eqx.combine(self.unravel(p), self.static)

    def F(self, t, y, yp, p):
        return self.residual(t, y, yp, self.args(p))

    def Q(self, t, y, yp, p):
        return self.quadrature(t, y, yp, eqx.combine(self.unravel(p), self.static))

    def f_transpose(self, t, y, yp, p, lam):
        """(λᵢᵀF_y, λᵢᵀF_y', λᵢᵀF_p) for the rows λᵢ of lam (k, n)."""
        _, vjp = jax.vjp(lambda y_, yp_, p_: self.F(t, y_, yp_, p_), y, yp, p)
        return jax.vmap(vjp)(lam)

    def source(self, t, y, yp, w, p):
        """g = wᵢᵀq for the rows wᵢ of w (k, nq): (g_y, g_y', g_p), each with leading k."""
        k = w.shape[0]
        if self.quadrature is None:
            z = jnp.zeros((k,) + y.shape, y.dtype)
            return z, z, jnp.zeros((k,) + p.shape, p.dtype)
        _, vjp = jax.vjp(lambda y_, yp_, p_: self.Q(t, y_, yp_, p_), y, yp, p)
        return jax.vmap(vjp)(w)


def adjoint_problem(terms: _Terms, linear_solver, n, k, equations, buf, w, p, rtol, atol,
                    quad_error_control, s_stop, dtype, t_r, index2=None) -> Problem:
    """(A) for k cotangent directions in Z = (μ_i, λ_i)_i (flattened, 2nk), s = t_r − t, as a
    Problem for the BDF integrator; its quadrature is the parameter gradient
    ∫ (wᵢᵀq_p − λᵢᵀF_p) dt of every direction (k·npar)."""

    def residual(s, Z, Zs, aargs):
        buf_, w_, p_, t_r = aargs
        t = t_r - s
        y, yp = buf_.evaluate(t)
        Zk, Zsk = Z.reshape(k, 2 * n), Zs.reshape(k, 2 * n)
        mu, lam = Zk[:, :n], Zk[:, n:]
        fy_lam, fyp_lam, _ = terms.f_transpose(t, y, yp, p_, lam)
        gy, gyp, _ = terms.source(t, y, yp, w_, p_)
        return jnp.concatenate([Zsk[:, :n] + fy_lam - gy, mu - fyp_lam + gyp], axis=1).reshape(-1)

    def quadrature(s, Z, Zs, aargs):
        buf_, w_, p_, t_r = aargs
        t = t_r - s
        y, yp = buf_.evaluate(t)
        lam = Z.reshape(k, 2 * n)[:, n:]
        _, _, gp = terms.source(t, y, yp, w_, p_)
        _, _, fp_lam = terms.f_transpose(t, y, yp, p_, lam)
        return (gp - fp_lam).reshape(-1)

    npar = terms.npar
    # λ of algebraic equations follows the interpolated forward solution algebraically:
    # left out of the error test (see the module docstring). With `index2` these include
    # the multipliers of the index-2 constraints, the adjoint's index-2 variables, which
    # Li & Petzold (DASPKADJOINT §5.5) leave out of the test too.
    one = jnp.concatenate([jnp.ones((n,), dtype), where(equations, 0.0, 1.0).astype(dtype)])
    return Problem(
        residual=residual, quadrature=quadrature if npar else None,
        linear_solver=AdjointSolver(inner=linear_solver, terms=terms, n=n, k=k, index2=index2),
        args=(buf, w, p, t_r), rtol=rtol, atol=jnp.full((2 * n * k,), atol, dtype),
        error_mask=jnp.tile(one, k), quad_rtol=rtol, quad_atol=jnp.full((npar * k,), atol, dtype),
        quad_error_control=quad_error_control and npar > 0, tstop=s_stop,
        reset_newton_rate=True, fresh_matrix=fresh_matrix(linear_solver, n), error_groups=k)


def fresh_matrix(linear_solver, n: int) -> bool:
    """Whether (A)'s iteration matrix is set up at every attempt (unbatched;
    `Problem.fresh_matrix`), each attempt then taking one exact iteration, instead of
    reused while cj allows, its iterations tested from a rate of 100. Li & Petzold
    (DASPKADJOINT §5.3) name both remedies for a linear DAE's Newton test and chose the
    second because a Jacobian costs far more than a residual. Where the dense solver's
    inverse is unrolled (n ≤ UNROLLED_GAUSS_JORDAN_N = 3) a setup costs about an
    iteration (Robertson's gradient: 37 against 36 thunks), and one exact iteration
    per attempt replaces 1.8 (Robertson: 628 attempts, 628 iterations and setups
    instead of 708, 1280 and 120; the gradient 8–26 % faster, docs/performance.md).
    Where the inverse is a loop over the columns (4 ≤ n ≤ 8) it did not pay: the
    transistor amplifier (n = 8) 1.10x and Akzo Nobel (n = 6) 1.08x the CPU time of
    the reused matrix (medians of 15 and 21 interleaved rounds, load ~1.3)."""
    return isinstance(linear_solver, DenseLU) and n <= UNROLLED_GAUSS_JORDAN_N


# ------------------------------------------------------------ observation jumps


def m_factor(terms, solver, split, t, y, yp, p):
    """(solve, singular): M factored once at (t, y, y'), M the transposed consistency
    matrix, solve(rhs) the νᵢ of M νᵢ = rhsᵢ (k, n), and whether M is singular (the DAE
    is not index 1 in its algebraic variables at t: no consistent adjoint values exist,
    and ν is not finite). A restart's three solves (`jump`, `restart_values`) share the
    one factorization: one copy of it in the compiled program, not three. Not
    differentiable: JAX never differentiates the backward pass (its derivatives are the
    augmented DAE's, `autodiff.py`), so the solve skips `custom_linear_solve`'s
    matrix–vector products."""
    return consistency_factor(solver, lambda t_, y_, yp_, p_: terms.F(t_, y_, yp_, p_),
                              t, y, yp, p, split, transpose=True, differentiable=False)


def jump(terms: _Terms, m, split, t, y, yp, mu, yb, ypb, p):
    """The consistent jump at an observation (module docstring), for k directions
    (rows): returns μ(t⁻) and the parameter terms −F_pᵀνᵢ. `m`: M factored at
    (t, y, y') (`m_factor`); `split` (a `_consistency.Split`) gives the algebraic
    directions at t: a∘ȳ + d∘ȳp is Πᵀȳ + (I − Π)ᵀȳp. Also returns whether M is
    singular."""
    m_solve, singular = m
    nu = m_solve(split.alg_t(yb) + split.diff_t(ypb))
    fy_nu, _, fp_nu = terms.f_transpose(t, y, yp, p, nu)
    return mu + yb - fy_nu, -fp_nu, singular


def restart_values(terms: _Terms, m, split, t, mu, w, y, yp, p):
    """Consistent (Z, Z_s) of (A) at t for the weights w after a jump: μ_a = −g_y'a,
    λ from M λ = (a∘g_y + d∘(μ + g_y')), μ_s = g_y − F_yᵀλ, and λ_s from M λ_s = d∘μ_s
    (the s-derivative of the two relations with the coefficients frozen; only the
    starting predictor uses it, and the BDF corrects the rest). Rows: directions.
    With a general split, a∘v is Πᵀv and d∘v is (I − Π)ᵀv. `m`: M factored at
    (t, y, y') (`m_factor`)."""
    m_solve, _ = m
    gy, gyp, _ = terms.source(t, y, yp, w, p)
    mu = split.diff_t(mu) - split.alg_t(gyp)
    lam = m_solve(split.alg_t(gy) + split.diff_t(mu + gyp))
    fy_lam, _, _ = terms.f_transpose(t, y, yp, p, lam)
    mu_s = gy - fy_lam
    lam_s = m_solve(split.diff_t(mu_s))
    flat = lambda u, v: jnp.concatenate([u, v], axis=1).reshape(-1)  # noqa: E731
    return flat(mu, lam), flat(mu_s, lam_s)


# ------------------------------------- Hessenberg index 2 (Li & Petzold §4.2, §5.6)
#
# For x' = f(t, x, z, p), 0 = g(t, x, p) (`index2`; more generally F(t, y, y', p) = 0
# whose index-2 constraint rows C depend on neither y' nor an algebraic variable, with
# index-1 algebraic variables beside), (A) is itself Hessenberg index 2: μ_z = 0 makes
# its z rows the constraint F_zᵀλ = g_z on μ_x (for x' = f: −f_zᵀμ_x = g_z), and the
# multipliers λ_C of the constraints appear only through g_xᵀλ_C in dμ_x/dt — the
# adjoint's index-2 variables. The transposed consistency matrix M of index 1 is
# singular here (its λ_C columns are zero); every consistent value below comes instead
# from the transpose of the *hidden* consistency matrix
#
#     C_h = ∂(F_R, dF_C/dt)/∂(y'_d, y_a) = [[F_{R,y'_d}, F_{R,y_a}], [g_x, 0]],
#
# the matrix of the forward problem's index-2 initialization (`_index2.hidden_residual`;
# nonsingular exactly when g_x f_z is), through the configured linear solver.
#
# At an observation (ȳ, ȳ') the jump follows from the forward side: a consistent
# sensitivity s is fixed by its differential part and ṗ, s = S(s_d, ṗ) (the hidden
# system linearized: C_h u = −(R_y s_d + R_p ṗ), s = s_d + Π u, s' = (I − Π) u, R the
# hidden residual), so ȳᵀs + ȳ'ᵀs' = vᵀs_d + πᵀṗ with ω = C_h⁻ᵀ(Πȳ + (I − Π)ȳ'),
# v = (I − Π)(ȳ − R_yᵀω), π = −R_pᵀω (`index2_jump`). μ_d(t⁻) = μ_d(t⁺) + v is then made
# consistent for (A) by adding g_xᵀκ (which changes μ_dᵀs_d by −κᵀg_p ṗ only, as
# g_x s_d = −g_p ṗ), κ from C_hᵀ ν = Π g_y + (I − Π)(μ + g_y'), κ = −ν_C — the same
# solve gives λ on the other rows (`index2_restart_values`). So the observation adds
# π + g_pᵀκ to dL/dp: Li & Petzold's extra term for index-2 constraints that depend on
# p (§5.6: λ_1^a ḣ_p and λ_2^a h_p are the parts of π and g_pᵀκ), without which the
# gradient is wrong whenever g_p ≠ 0. A quadrature's weights enter the same way: its
# final condition μ_d = g_xᵀκ ≠ 0 (their λ^d, eq. (18)) comes out of the same κ.
#
# λ_C itself follows from the hidden constraint of (A), d/dt (F_aᵀλ − g_a) = 0 — with
# the row λ_R fixed by μ_d, a second solve C_hᵀ (λ'_R, −λ_C) = r of
#
#     r_d = (F_yᵀλ̂ − (dF_y'/dt)ᵀλ̂ − g_y + dg_y'/dt)_d,  r_a = (dg_y/dt − (dF_y/dt)ᵀλ̂)_a,
#
# λ̂ = (λ_R, 0), the total time derivatives along the interpolated forward solution by
# one `jax.jvp` each (DASPKADJOINT's hand-written GRES_ADY). This is (22): only the
# restart's starting values depend on it (λ_C is algebraic in (A), recomputed by every
# corrector; μ_s = g_y − F_yᵀλ and λ'_R start the predictor), not the gradient.


def hidden_factor_t(terms, solver, split, rows, t, y, yp, p):
    """(solve, singular): C_hᵀ factored once at (t, y, y'), solve(rhs) the xᵢ of
    C_hᵀ xᵢ = rhsᵢ (k, n), and whether C_h is singular; shared by a restart's three
    solves (`index2_jump`, `index2_restart_values`), as `m_factor`. Not
    differentiable, as `m_factor`."""
    from .._index2 import hidden_residual
    return consistency_factor(solver, hidden_residual(terms.F, rows), t, y, yp, p, split,
                              transpose=True, differentiable=False)


def index2_jump(terms, h, split, rows, t, y, yp, mu, yb, ypb, p):
    """μ_d(t⁻) before the consistency correction, μ_d(t⁺) + v, the parameter terms π and
    whether C_h is singular, for an observation (ȳ, ȳ') at t (k rows; see above). `h`:
    C_hᵀ factored at (t, y, y') (`hidden_factor_t`)."""
    from .._index2 import hidden_residual
    R = hidden_residual(terms.F, rows)
    h_solve, singular = h
    omega = h_solve(split.alg_t(yb) + split.diff_t(ypb))
    _, vjp = jax.vjp(lambda y_, p_: R(t, y_, yp, p_), y, p)
    ry, rp = jax.vmap(vjp)(omega)
    return split.diff_t(mu) + split.diff_t(yb - ry), -rp, singular


def index2_restart_values(terms, h, split, rows, t, mu, w, evaluate, p):
    """Consistent (Z, Z_s) of (A) at t for a Hessenberg index-2 DAE (see above) from the
    differential part of μ, the quadrature weights w and the forward solution
    `evaluate(t) = (y, y')`; with the parameter term g_pᵀκ of the correction of μ_d and
    whether C_h is singular. Rows: directions. `h`: C_hᵀ factored at (t, y, y')
    (`hidden_factor_t`)."""
    y, yp = evaluate(t)
    c = jnp.zeros(mu.shape[-1:], bool).at[jnp.asarray(rows)].set(True)
    gy, gyp, _ = terms.source(t, y, yp, w, p)
    h_solve, singular = h
    nu = h_solve(split.alg_t(gy) + split.diff_t(mu + gyp))
    fy_c, _, fp_c = terms.f_transpose(t, y, yp, p, where(c, nu, 0.0))
    mu = split.diff_t(mu - fy_c) - split.alg_t(gyp)        # μ_d + g_xᵀκ, κ = −ν_C
    lam_hat = where(c, 0.0, nu)

    def along(t_):
        y_, yp_ = evaluate(t_)
        fy, fyp, _ = terms.f_transpose(t_, y_, yp_, p, lam_hat)
        gy_, gyp_, _ = terms.source(t_, y_, yp_, w, p)
        return fy, fyp, gy_, gyp_

    (fy, _, gy, _), (dfy, dfyp, dgy, dgyp) = jax.jvp(along, (t,), (jnp.ones_like(t),))
    rhs = split.diff_t(fy - gy - dfyp + dgyp) + split.alg_t(dgy - dfy)
    nu2 = h_solve(rhs)
    lam = lam_hat - where(c, nu2, 0.0)
    fy_lam, _, _ = terms.f_transpose(t, y, yp, p, lam)
    mu_s = gy - fy_lam
    lam_s = -where(c, 0.0, nu2)      # d/ds = −d/dt; λ_C's rate only starts a predictor
    flat = lambda u, v: jnp.concatenate([u, v], axis=1).reshape(-1)  # noqa: E731
    return flat(mu, lam), flat(mu_s, lam_s), -fp_c, singular


def index2_at_t0(config, inputs, split, y0, yp0, sbar, spbar, w, pbar, unravel, pd, p_events):
    """The cotangents of the inputs at t0 for a Hessenberg index-2 DAE from those of the
    consistent initial sensitivity (sbar on s(t0): μ_d(t0⁺) plus an observation at t0;
    spbar on s'(t0)), through the transpose of the linear map (δt0, δy0, δp) ↦
    (s(t0), s'(t0)) of `_consistency.initial_sensitivities` (δy0's differential part
    moved onto the linearized constraints, the rest from the linearized index-reduced
    system), by `jax.vjp` — as the discrete adjoint does (`_index2_initial_value_tangents`)."""
    import dataclasses as dc

    from .._consistency import initial_sensitivities
    from .._core import Tangents
    p_flat = ravel_pytree(pd)[0]

    def sens(t0d, y0d, pdot):
        tan = Tangents(t0=t0d[None], y0=y0d[None],
                       args=jax.tree_util.tree_map(lambda x: x[None], unravel(pdot)))
        s0, sp0, _, _, _ = initial_sensitivities(config, inputs, y0, yp0, tan, 1)
        return s0[0], sp0[0]

    zeros = (jnp.zeros_like(inputs.t0), jnp.zeros_like(y0), jnp.zeros_like(p_flat))
    _, vjp0 = jax.vjp(sens, *zeros)
    t0bar, ybar0, pb0 = jax.vmap(vjp0)((sbar, spbar))
    # The shared tail adds −w·q(t0) to t̄0 (with a zero state cotangent its trajectory
    # shift term vanishes: that one is in t0bar already).
    out = reverse_tangents_at_t0(config, inputs, split, jnp.zeros_like(ybar0), y0, yp0, w,
                                 pbar + pb0, unravel, pd, p_events, y0_bar=ybar0,
                                 yp0_bar=jnp.zeros_like(ybar0))
    return dc.replace(out, t0=out.t0 + t0bar)


# ------------------------------------------------------------ the backward pass


# XLA's CPU runtime runs a loop body's operations one after another in the calling
# thread only while every buffer each of them reads or writes is at most this many bytes
# (the integrator's `LOOP_BYTES`); past it, every trip of the loop goes through its
# task-graph executor, several times slower per operation for small problems
# (`integrate`, docs/performance.md).
SEQUENTIAL_BUFFER_BYTES = LOOP_BYTES


def _empty_outputs(ts_dtype, n, nq):
    return Outputs.create(jnp.zeros((0,), ts_dtype), n, nq, 0, 0, ts_dtype)


def replay_segment(problem_fwd: Problem, ck, c, t_next, yp0, buf0, max_steps):
    """Replay forward segment c from its checkpoint `ck` to t_next, recording every step
    (node values for the interpolant, and the BDF histories). The factorization is
    rebuilt at the checkpoint's stored setup point, so the replay repeats the original
    steps bit for bit. It runs under the forward run's own `tstop`: t_next is where a
    forward step ended, and an exact replay ends there by itself, whereas stopping at
    t_next would shorten every attempt that overshot it — attempts the forward run made
    and, after an error-test failure, answered with another step size (the replay of
    the Test Set's NAND gate at rtol 1e-8 then left the forward steps 79 steps into a
    segment and overflowed its buffer). (The checkpoint is sliced outside any branch or
    loop: the whole checkpoint buffer is never an operand there, which XLA would copy.)"""
    prob = problem_fwd
    st = restore_linear_state(prob, ck)
    # y' at the checkpoint: the BDF interpolant there, or y'0 at the very start.
    _, yp_start = StepRecorder._node(st)
    yp_start = where(c == 0, yp0, yp_start)
    n, nq = st.phi.shape[1], st.phiq.shape[1]
    empty = _empty_outputs(st.phi.dtype, n, nq)
    rec = buf0.start(st, yp_start)
    # Given to `integrate` itself, the segment's buffer (2.6 kB at n = 3) is recorded by
    # its outer loop after every step, and that loop runs on XLA's thread pool (see
    # `SEQUENTIAL_BUFFER_BYTES`). Instead the step loop records into a stage of at most
    # that size, and `integrate` stops every `steps` accepted steps (`until`: the same
    # steps as one call) for the stage to be appended to the buffer. Not for a batch,
    # whose step loop is on the thread pool anyway and whose loop around the chunks would
    # select every member's carry on every trip.
    batched = prob.batched or is_batched((prob, st, t_next))
    stage = None if batched else rec.stage(SEQUENTIAL_BUFFER_BYTES)
    if stage is None:
        st, _, (rec,), _ = integrate(prob, st, empty, t_next, max_steps, (rec,))
    else:
        steps = stage.t.shape[0] - 1

        def cond(carry):
            s, _ = carry
            return (s.t < t_next) & (s.result == RESULTS.successful)

        def body(carry):
            s, rec = carry
            s, _, (staged,), _ = integrate(prob, s, empty, t_next, max_steps, (stage,),
                                           until=s.stats["num_steps"] + steps)
            return s, rec.append(staged)

        st, rec = packed_while_loop(cond, body, (st, rec), part=0)
    ok = (st.result == RESULTS.successful) & ~rec.overflowed()
    return rec, ok


class _Backward(eqx.Module):
    """What the pieces of the backward pass share: the adjoint DAE (A) for k cotangent
    directions (its terms, linear solver and tolerances) and the point observations
    (times `ts`, ascending, and their cotangents, rows = directions)."""

    adjoint: Adjoint
    terms: _Terms
    solver: AbstractLinearSolver
    p: jax.Array                 # the differentiated args, flattened
    algebraic: jax.Array
    auto_split: bool = eqx.field(static=True)
    ts: jax.Array
    breakpoints: jax.Array | None
    ybar: jax.Array              # (k, n_save, n)
    ypbar: jax.Array
    qbar: jax.Array              # (k, n_save, nq)
    rtol: jax.Array
    atol: jax.Array
    n: int = eqx.field(static=True)
    k: int = eqx.field(static=True)
    # The index-2 constraints (= variables) of a Hessenberg index-2 DAE (`Config.index2`).
    index2: tuple = eqx.field(static=True, default=())
    # The forward steps are a batch's (`vmap`): every member has its own (`_Nodes.of`).
    batched: bool = eqx.field(static=True, default=False)

    def index2_mask(self):
        return None if not self.index2 else jnp.zeros((self.n,), bool).at[
            jnp.asarray(self.index2)].set(True)

    def problem(self, buf, w, t_r, t_stop, equations) -> Problem:
        """(A) in s = t_r − t, integrated from the restart time t_r down to t_stop;
        `equations`: the algebraic equations (`Split.algebraic_equations`)."""
        return adjoint_problem(self.terms, self.solver, self.n, self.k, equations, buf,
                               w, self.p, self.rtol, self.atol, self.adjoint.quad_error_control,
                               t_r - t_stop, self.rtol.dtype, t_r, self.index2_mask())

    def split(self, t, y, yp) -> Split:
        """The algebraic directions at (t, y, y') (`_consistency.Split`)."""
        return split_at(self.auto_split, self.terms.F, t, y, yp, self.p, self.algebraic)

    def mu(self, adj):
        return adj.phi[0].reshape(self.k, 2 * self.n)[:, :self.n]

    def observed_at(self, idx, t):
        """Sum the cotangents of all outputs at time t (rows idx, idx − 1, ...):
        (index of the next earlier row, ȳ, ȳ', q̄)."""
        ts = self.ts

        def cond(c):
            i = c[0]
            return (i >= 0) & (ts[jnp.maximum(i, 0)] >= t)

        def body(c):
            i, yb, ypb, qb = c
            return i - 1, yb + self.ybar[:, i], ypb + self.ypbar[:, i], qb + self.qbar[:, i]

        dtype = self.rtol.dtype
        z = jnp.zeros((self.k, self.n), dtype)
        qz = jnp.zeros((self.k, self.qbar.shape[2]), dtype)
        return jax.lax.while_loop(cond, body, (idx, z, z, qz))

    def next_time(self, t_low, obs, t_cur):
        """Where the integration of (A) stops next: the next earlier observation, the
        next earlier breakpoint of the inputs, or the segment's start."""
        t = jnp.maximum(t_low, where(obs >= 0, self.ts[jnp.maximum(obs, 0)], -jnp.inf))
        if self.breakpoints is None:
            return t
        return jnp.maximum(t, jnp.max(where(self.breakpoints < t_cur, self.breakpoints,
                                                -jnp.inf)))

    def at_breakpoint(self, t):
        """(A) restarts at the inputs' breakpoints: its coefficients F_y, F_y' jump
        there with y' of the forward solution."""
        if self.breakpoints is None:
            return jnp.zeros((), bool)
        return jnp.any(self.breakpoints == t)


class _Sweep(NamedTuple):
    """The backward pass's loop carry."""

    segment: Array            # the forward segment being integrated through (−1: done)
    t_cur: Array              # the time reached
    t_low: Array              # the current segment's start
    obs: Array                # the next observation row
    adj: State                # the BDF state of (A)
    w: Array                  # the quadratures' weights (k, nq)
    pbar: Array               # the parameter gradient banked at restarts (k, npar)
    buf: StepRecorder         # the current segment's forward steps
    started: Array            # (A) has been started
    ok: Array
    adj_steps: Array          # steps of (A) before the latest restart
    t_r: Array                # the restart time of s = t_r − t
    equations: Array          # the algebraic equations of (A) (`Split.algebraic_equations`)
    singular: Array           # M was singular at a restart (the DAE is not index 1 there)


def observe(bw: _Backward, c: _Sweep) -> _Sweep:
    """At an observation (or the first time): jump μ (module docstring), add the
    quadrature weights, bank the parameter gradient and restart (A) from consistent
    values."""
    k, npar, dtype = bw.k, bw.terms.npar, bw.rtol.dtype
    obs, yb, ypb, qb = bw.observed_at(c.obs, c.t_cur)
    jumps = (jnp.any(yb != 0) | jnp.any(ypb != 0) | jnp.any(qb != 0) | ~c.started
             | bw.at_breakpoint(c.t_cur))
    adj_old = c.adj
    old = (adj_old, c.w, c.pbar, c.adj_steps, c.t_r, c.equations)

    def do_restart():
        t = c.t_cur
        mu = where(c.started, bw.mu(adj_old), 0.0)
        banked = where(c.started, adj_old.phiq[0].reshape(k, npar), 0.0)
        w = c.w + qb
        y, yp = c.buf.evaluate(t)
        split = bw.split(t, y, yp)
        if bw.index2:
            h = hidden_factor_t(bw.terms, bw.solver, split, bw.index2, t, y, yp, bw.p)
            mu, p_jump, singular = index2_jump(bw.terms, h, split, bw.index2, t, y, yp,
                                               mu, yb, ypb, bw.p)
            Z, Zs, p_fix, singular2 = index2_restart_values(
                bw.terms, h, split, bw.index2, t, mu, w, c.buf.evaluate, bw.p)
            p_jump, singular = p_jump + p_fix, singular | singular2
        else:
            m = m_factor(bw.terms, bw.solver, split, t, y, yp, bw.p)
            mu, p_jump, singular = jump(bw.terms, m, split, t, y, yp, mu, yb, ypb, bw.p)
            Z, Zs = restart_values(bw.terms, m, split, t, mu, w, y, yp, bw.p)
        t_next = bw.next_time(c.t_low, obs, t)
        equations = split.algebraic_equations
        prob = bw.problem(c.buf, w, t, t_next, equations)   # s = t_r − t restarts at 0
        s0 = jnp.zeros((), dtype)
        h0 = initial_step(prob, s0, Z, Zs, prob.quad(s0, Z, Zs), t - t_next)
        fresh = initial_state(prob, s0, Z, Zs, h0)
        steps = c.adj_steps + where(c.started, adj_old.stats["num_steps"], 0)
        new = (fresh, w, c.pbar + banked + p_jump, steps, t, equations, singular)
        return taken_where(jumps, new, old + (jnp.zeros((), bool),))

    adj, w, pbar, steps, t_r, equations, singular = jax.lax.cond(
        unvmap_any(jumps), do_restart, lambda: old + (jnp.zeros((), bool),))
    # A singular M: the adjoint has no consistent values here (an algebraic block of
    # the forward DAE that is rank-deficient, i.e. index > 1 along some directions).
    # Integrating from the non-finite ones would only end in a NaN or a collapsed step;
    # stop now and say why (`adjoint_failed`, the fallback's warning).
    return c._replace(obs=obs, adj=adj, w=w, pbar=pbar, adj_steps=steps, t_r=t_r,
                      equations=equations, ok=c.ok & ~singular,
                      singular=c.singular | singular)


def rebase(c: _Sweep) -> _Sweep:
    """Once t is nearer to 0 than to the restart time t_r, continue in s = −t: the
    forward solution's own fast transients (near t0, e.g. Robertson's) are resolvable in
    absolute time but not in s = t_r − t when t_r ≫ t. Only s and the setup point move:
    the BDF history is in step sizes."""
    t_r, adj = c.t_r, c.adj
    d = where(jnp.abs(c.t_cur) < t_r - c.t_cur, -t_r, 0.0).astype(adj.t.dtype)
    adj = eqx.tree_at(lambda a: (a.t, a.jac_point[0]), adj, (adj.t + d, adj.jac_point[0] + d))
    return c._replace(adj=adj, t_r=t_r + d)


class _Nodes(eqx.Module):
    """The Hermite nodes of a segment's `StepRecorder` (t, y, y'), split by rows into
    pieces of at most `SEQUENTIAL_BUFFER_BYTES` each, for the adjoint's step loop:
    its residual evaluates the forward solution every Newton iteration, and reading
    the whole buffer (109 × n values at the default `checkpoint_every`, 2.6 kB for
    n = 3) put every operation of (A)'s step loop on XLA's thread-pool executor. The
    pieces are separate arrays, so each read stays below the size. `evaluate` is
    `StepRecorder.evaluate` (Hermite), the same rows and the same arithmetic."""

    t: tuple
    y: tuple
    yp: tuple
    count: Array
    rows_t: int = eqx.field(static=True)
    rows_y: int = eqx.field(static=True)

    @staticmethod
    def of(buf: StepRecorder):
        """The split view of `buf`, or `buf` itself where splitting buys nothing: where
        (A)'s step loop is not sequential anyway (its history φ, NPHI rows of n values,
        is over the size: n ≥ 11 in float64, as `SegmentRecorder.pays`) or the whole
        buffer is small, or for the BDF interpolant (`interpolation="bdf"`, whose
        history rows are 6n values). Each read of the pieces is a chain of selects, one
        per piece, and every evaluation reads six rows: splitting by the size alone
        gave a 40-unknown DAE 109 pieces of one row (1308 reads in its gradient
        program) and more than doubled its compilation (21 → 47 s; tests/test_linear_solvers.py).
        Not used for a batch's steps (`integrate_segment`): each piece then holds every
        member's rows, over the size for all but tiny batches, and each of its reads is
        a gather of its own (a kernel XLA compiles; 56 of them in the Jacobian setups
        alone of Robertson's `vmap(grad)`)."""
        item = buf.y.dtype.itemsize
        rows, n = buf.y.shape
        rows_t = SEQUENTIAL_BUFFER_BYTES // item
        rows_y = SEQUENTIAL_BUFFER_BYTES // max(n * item, 1)
        sequential = NPHI * n * item <= SEQUENTIAL_BUFFER_BYTES
        if not buf.hermite or not sequential or rows <= min(rows_t, rows_y):
            return buf

        def split(x, r):
            return tuple(x[i:i + r] for i in range(0, rows, r))

        return _Nodes(t=split(buf.t, rows_t), y=split(buf.y, rows_y), yp=split(buf.yp, rows_y),
                      count=buf.count, rows_t=rows_t, rows_y=rows_y)

    @staticmethod
    def _row(pieces, r, j):
        """Row j of the pieces (rows r each) stacked."""
        out = jax.lax.dynamic_index_in_dim(pieces[0], jnp.minimum(j, r - 1), keepdims=False)
        for c, x in enumerate(pieces[1:], 1):
            row = jax.lax.dynamic_index_in_dim(x, jnp.clip(j - c * r, 0, x.shape[0] - 1),
                                               keepdims=False)
            out = where(j >= c * r, row, out)
        return out

    def evaluate(self, t):
        """y(t), y'(t): the cubic Hermite interpolant on the step [t_{i-1}, t_i] that
        contains t (`StepRecorder.evaluate`)."""
        # searchsorted (left) on the ascending node times (∞ past the count): the
        # number of nodes before t.
        i = sum(jnp.sum(x < t, dtype=jnp.int32) for x in self.t)
        i = jnp.clip(i, 1, jnp.maximum(self.count, 1))
        return hermite(t, self._row(self.t, self.rows_t, i - 1),
                       self._row(self.t, self.rows_t, i),
                       self._row(self.y, self.rows_y, i - 1), self._row(self.y, self.rows_y, i),
                       self._row(self.yp, self.rows_y, i - 1),
                       self._row(self.yp, self.rows_y, i))


def integrate_segment(bw: _Backward, c: _Sweep, max_steps: int) -> _Sweep:
    """Integrate (A) backward over the current segment (down to c.t_low), stopping
    at each observation in it to jump and restart. (A)'s step loop reads the forward
    steps through `_Nodes`."""
    empty = _empty_outputs(bw.rtol.dtype, 2 * bw.n * bw.k, bw.terms.npar * bw.k)

    def cond(c):
        return (c.t_cur > c.t_low) & c.ok

    def body(c):
        c = rebase(observe(bw, c))
        t_next = bw.next_time(c.t_low, c.obs, c.t_cur)
        t_r = c.t_r
        nodes = c.buf if bw.batched else _Nodes.of(c.buf)
        adj, _, _, _ = integrate(bw.problem(nodes, c.w, t_r, t_next, c.equations),
                                 c.adj, empty, t_r - t_next, max_steps)
        ok = c.ok & (adj.result == RESULTS.successful)
        # After a singular restart (c.ok already false) the attempt's result is dropped.
        # The body runs only where c.ok (the loop's predicate): a select only a batch needs.
        return c._replace(adj=taken_where(c.ok, adj, c.adj), started=jnp.ones((), bool),
                          t_cur=taken_where(c.ok, t_next, c.t_cur), ok=ok)

    return jax.lax.while_loop(cond, body, c)


def segment_steps(problem_fwd: Problem, rec, buf0: StepRecorder, c: _Sweep, i, yp0,
                  max_steps: int, replay_all=False):
    """The steps of forward segment i (from checkpoint i): the ones the forward run kept
    if it is its last segment, else replayed; the current buffer if the segment starts
    at or after the time reached. `replay_all`: replay every segment (the fallback's
    discrete pass, which needs the step sizes and orders only a replay records).
    Returns (buffer, replay ok, the segment's start)."""
    cks = rec.checkpoints
    n_ck, ck_cap = cks.count, cks.states.t.shape[0]
    t_low = cks.states.t[i]
    replay_all = jnp.asarray(replay_all, bool)
    need = (t_low < c.t_cur) | (i == 0) | replay_all
    ck = jax.tree_util.tree_map(lambda x: x[i], cks.states)
    # The last segment ends where the forward run did (t1, or the step holding a
    # terminal event).
    t_next = where(i + 1 >= n_ck, rec.t_final, cks.states.t[jnp.minimum(i + 1, ck_cap - 1)])
    kept = (need & (i == rec.segment.index) & ~replay_all if rec.segment is not None
            else jnp.zeros((), bool))
    every = cks.every
    traj = rec.log if isinstance(rec.log, TrajectoryRecorder) else None
    stored = (need & ~replay_all & traj.holds(i, every) if traj is not None
              else jnp.zeros((), bool))
    kept = kept & ~stored
    replay = need & ~kept & ~stored
    # One-trip loops, not conds: a cond returning the current buffer would copy it.
    buf, ok = maybe_update(
        replay,
        lambda: replay_segment(problem_fwd, ck, i, t_next, yp0, buf0, max_steps),
        (c.buf, jnp.ones((), bool)))
    if rec.segment is not None:
        buf = maybe_update(kept, lambda: rec.segment.buffer(buf0), buf)
    if traj is not None:
        buf = maybe_update(stored, lambda: traj.segment(i, every, buf0), buf)
    return buf, ok | ~replay, t_low


class _Discrete(NamedTuple):
    """The fallback's discrete pass in the backward loop (`backward`)."""

    on: Array                 # this pass is the discrete adjoint's
    bars: tuple               # (φ̄, φ̄_Q, p̄) at the start of the segments swept so far
    h1: Array                 # the run's first step size (from segment 0's replay)


def backward(adjoint: Adjoint, config, inputs, rec, ct, wanted):
    """The backward pass for k cotangent directions at once (they share the backward
    steps and the factorizations, as forward sensitivities share the forward ones):
    `ct` = (ȳd (k, n_save, order+1, n), q̄s (k, n_save, nq)). Segment by segment from the
    last (`segment_steps`), (A) is integrated backward through the observations in it
    (`integrate_segment`, `observe`); at t0 the initial-value cotangents follow
    (`at_t0`). Returns (Tangents with a leading axis k, restricted to `wanted`, result,
    whether M was singular).

    With `fallback`, where that fails on a successful forward run the same loop runs a
    second pass from the last segment as the discrete adjoint (`DiscreteAdjoint`'s
    reverse sweep, `discrete_segment`): each segment replayed from its checkpoint as
    before, now recording the step sizes and orders too, then its discrete VJP. The
    replay is the one the continuous pass runs, so the fallback needs no second forward
    run (nor a step log of the whole run) and differentiates the primal's own steps."""
    # Output rows and event roots as point observations, sorted by time.
    ts, yd_bar, qbar, p_events = observations(config, inputs, rec, ct)
    k = yd_bar.shape[0]
    y0, yp0 = rec.y0, rec.yp0
    dtype, n = y0.dtype, y0.shape[0]
    problem_fwd = build_problem(config, dataclasses.replace(inputs, y0=y0, yp0=yp0))
    pd, pst = eqx.partition(inputs.args, eqx.is_inexact_array)
    p, unravel = ravel_pytree(pd)
    terms = _Terms(residual=config.residual, quadrature=config.quadrature, static=pst,
                   unravel=unravel, npar=p.shape[0])
    bw = _Backward(
        adjoint=adjoint, terms=terms, solver=config.linear_solver, p=p,
        algebraic=inputs.algebraic, auto_split=config.auto_split, ts=ts,
        breakpoints=inputs.breakpoints,
        ybar=yd_bar[:, :, 0], ypbar=yd_bar[:, :, 1],
        qbar=qbar, n=n, k=k, index2=config.index2, batched=is_batched(rec),
        rtol=jnp.asarray(inputs.rtol if adjoint.rtol is None else adjoint.rtol, dtype),
        atol=jnp.asarray(jnp.max(inputs.atol) if adjoint.atol is None else adjoint.atol, dtype))

    fallback = adjoint.fallback
    buf0 = StepRecorder.create(segment_capacity(adjoint.checkpoint_every), n, dtype,
                               hermite=adjoint.interpolation == "hermite", per_step=False,
                               log=fallback)
    w0 = jnp.zeros((k, qbar.shape[2]), dtype)
    Z0 = jnp.zeros((2 * n * k,), dtype)
    adj0 = initial_state(bw.problem(buf0, w0, ts[-1], jnp.asarray(-jnp.inf, dtype),
                                    inputs.algebraic),
                         jnp.zeros((), dtype), Z0, Z0, jnp.ones((), dtype))
    max_adj = adjoint.max_steps or config.max_steps
    sw = (sweep_setup(DiscreteAdjoint(segment=adjoint.checkpoint_every), config, inputs, rec,
                      ts, yd_bar, qbar) if fallback else None)

    def outer_cond(carry):
        c, _ = carry
        return (c.segment >= 0) & c.ok

    def outer_body(carry):
        c, d = carry
        i = c.segment
        buf, ok, t_low = segment_steps(problem_fwd, rec, buf0, c, i, yp0,
                                       config.max_steps, False if d is None else d.on)
        c = c._replace(buf=buf, ok=c.ok & ok, t_low=t_low)
        if d is None:
            c = integrate_segment(bw, c, max_adj)
        else:
            # The discrete pass leaves (A) alone: an empty interval, no trip of its loop.
            c = integrate_segment(bw, c._replace(t_low=where(d.on, c.t_cur, t_low)),
                                  max_adj)
            ck = jax.tree_util.tree_map(lambda x: x[i], rec.checkpoints.states)
            steps = replayed_steps(sw, buf, i, rec.t_final)
            h1 = where(i == 0, buf.h_step[0], d.h1)
            bars = maybe_update(d.on & c.ok, lambda: discrete_segment(
                sw, inputs, rec, steps, ck, i == 0, h1, d.bars), d.bars)
            d = d._replace(bars=bars, h1=h1)
        return c._replace(segment=i - 1), d

    # A failed forward run has no trajectory to go back along: skip (its derivatives
    # are reported NaN by the caller), so one failed batch member costs nothing.
    carry0 = _Sweep(segment=where(succeeded(rec.result), rec.checkpoints.count - 1, -1),
                    t_cur=ts[-1], t_low=ts[-1], obs=jnp.asarray(ts.shape[0] - 1, jnp.int32),
                    adj=adj0, w=w0, pbar=jnp.zeros((k, terms.npar), dtype), buf=buf0,
                    started=jnp.zeros((), bool), ok=jnp.ones((), bool),
                    adj_steps=jnp.zeros((), jnp.int32), t_r=ts[-1], equations=inputs.algebraic,
                    singular=jnp.zeros((), bool))

    def finish(c):
        """The continuous pass's cotangents at t0, its result, and whether M was
        singular."""
        out, singular_t0 = at_t0(bw, config, inputs, c, unravel, pd, p_events)
        singular = c.singular | (c.ok & singular_t0)
        # Cotangents the continuous adjoint cannot take: on y' of algebraic components
        # and on higher derivatives of the dense output (third-order derivatives through
        # saveat). They are exactly zero unless such a derivative is asked for.
        unsupported = (jnp.any(where(inputs.algebraic, bw.ypbar, 0.0) != 0)
                       | jnp.any(yd_bar[:, :, 2:] != 0))
        result = RESULTS.where(~c.ok | singular, RESULTS.adjoint_failed,
                               RESULTS.where(unsupported, RESULTS.unsupported_cotangent,
                                             RESULTS.successful))
        return _restrict(out, wanted), result, singular

    if not fallback:
        c, _ = jax.lax.while_loop(outer_cond, outer_body, (carry0, None))
        return finish(c)

    def switch(carry):
        """Where the continuous pass has just ended (failed, or done with segment 0):
        did it fail on a successful forward run — then start the discrete pass from
        the last segment (every segment is replayed, `segment_steps`, so nothing else
        of the continuous pass's state matters) — and was M singular. Only the
        singularity test of `at_t0` is needed for that; its cotangents are computed
        once, after the loop (`finish`), where no discrete pass ran."""
        c, d, singular_c = carry
        ended = ~d.on & ~((c.segment >= 0) & c.ok)

        def check():
            singular = c.singular | (c.ok & singular_at_t0(bw, inputs, c))
            return (~c.ok | singular) & succeeded(rec.result), singular

        no = (jnp.zeros((), bool), singular_c)
        failed, singular = jax.lax.cond(unvmap_any(ended),
                                        lambda: taken_where(ended, check(), no), lambda: no)
        c = c._replace(segment=where(failed, carry0.segment, c.segment), ok=c.ok | failed)
        return c, d._replace(on=d.on | failed), singular

    # One loop over the segments for both passes (the continuous adjoint's, then where it
    # failed the discrete adjoint's), the switch at the end of a trip: a loop of passes
    # around the segment loop, with `finish` inside it, made XLA's while-loop passes
    # take several seconds more to compile the gradient (benchmarks/compile_profile.py).
    # (`at_t0` in the switch's branch, carried out of the loop, would drop the separate
    # singularity test: 24 kernels fewer in Robertson's `grad`, but XLA's while-loop
    # passes grew by about as much time, XLA's CPU seconds no lower; 2026-11-29.)
    d0 = _Discrete(on=jnp.zeros((), bool), bars=zero_bars(sw, k, n), h1=jnp.ones((), dtype))
    c, d, singular_c = jax.lax.while_loop(
        lambda carry: outer_cond((carry[0], carry[1])),
        lambda carry: switch(outer_body((carry[0], carry[1])) + (carry[2],)),
        (carry0, d0, jnp.zeros((), bool)))
    # The continuous pass's cotangents (its end state is c unless the discrete pass ran;
    # a forward run that failed makes no trip, and its cotangents are NaN'd by the caller).
    out, result, singular = finish(c)
    singular = where(d.on, singular_c, singular)

    def discrete():
        """The discrete pass's cotangents: through the initial history to the inputs
        (`initial_value_tangents`); its result: whether every replay succeeded."""
        out_d = _restrict(initial_value_tangents(sw, inputs, rec, d.h1, d.bars, p_events),
                          wanted)
        if runtime_errors_raise():    # a host callback: not under EQX_ON_ERROR=nan
            # Its operands reduced over the batch first: `jax.debug.callback` of batched
            # operands is unrolled into one callback per member (256 members: 256 host
            # calls and ~750 slicing kernels more in `vmap(grad)`'s program).
            # (A)'s last state keeps its failure: the discrete pass makes no trip of
            # (A)'s loop (`outer_body`).
            out_of_steps = d.on & (c.adj.result == RESULTS.max_steps_reached)
            jax.debug.callback(_warn_fallback, unvmap_any(d.on), unvmap_all(~d.on | c.ok),
                               unvmap_any(d.on & singular), unvmap_any(out_of_steps))
        return (taken_where(d.on, out_d, out),
                RESULTS.where(d.on, RESULTS.where(c.ok, RESULTS.successful,
                                                  RESULTS.adjoint_failed), result))

    out, result = jax.lax.cond(unvmap_any(d.on), discrete, lambda: (out, result))
    return out, result, singular


def singular_at_t0(bw: _Backward, inputs, c: _Sweep):
    """Whether M is singular at t0 (the singularity `at_t0`'s jump reports). With
    `index2` M is singular by construction and `at_t0` uses the hidden-constraint
    matrix instead (`index2_at_t0`), reporting no singularity: so does this test."""
    if bw.index2:
        return jnp.zeros((), bool)
    t0 = inputs.t0
    y_t0, yp_t0 = c.buf.evaluate(t0)
    split = bw.split(t0, y_t0, yp_t0)
    _, singular = m_factor(bw.terms, bw.solver, split, t0, y_t0, yp_t0, bw.p)
    return singular


def at_t0(bw: _Backward, config, inputs, c: _Sweep, unravel, pd, p_events):
    """At t0: the observations there, then the initial-value cotangents (`init`
    semantics) and the one of t0; the parameter gradient with everything banked.
    Returns (cotangents, whether M is singular at t0)."""
    k, npar, t0 = bw.k, bw.terms.npar, inputs.t0
    adj = c.adj
    mu = where(c.started, bw.mu(adj), 0.0)
    pbar = c.pbar + where(c.started, adj.phiq[0].reshape(k, npar), 0.0)
    _, yb, ypb, qb = bw.observed_at(c.obs, t0)
    y_t0, yp_t0 = c.buf.evaluate(t0)
    split = bw.split(t0, y_t0, yp_t0)
    if bw.index2:
        out = index2_at_t0(config, inputs, split, y_t0, yp_t0, split.diff_t(mu) + yb, ypb,
                           c.w + qb, pbar, unravel, pd, p_events)
        return out, jnp.zeros((), bool)
    mu, p_jump, singular = jump(bw.terms, m_factor(bw.terms, bw.solver, split, t0, y_t0,
                                                   yp_t0, bw.p),
                                split, t0, y_t0, yp_t0, mu, yb, ypb, bw.p)
    pbar = pbar + p_jump
    w = c.w + qb
    ybar0, ypbar0, pbar = initial_value_cotangents(config, bw.terms, bw.solver, split, t0,
                                                   y_t0, yp_t0, mu, pbar, bw.p)
    out = reverse_tangents_at_t0(config, inputs, split, mu, y_t0, yp_t0, w, pbar, unravel,
                                 pd, p_events, y0_bar=ybar0, yp0_bar=ypbar0)
    return out, singular


def initial_value_cotangents(config, terms, solver, split, t0, y, yp, mu, pbar, p):
    """The init semantics (DESIGN §1): what the initialization recomputes gets zero
    cotangent, the rest the consistent one. Rows: directions."""
    if config.init == "y":
        # y0 solves F(t0, y0, y'0, p) = 0 given y'0: δy0 = −F_y⁻¹(F_y' δy'0 + F_p δp).
        z, _ = consistency_solve(solver, lambda t_, y_, yp_, p_: terms.F(t_, y_, yp_, p_),
                                 t0, y, yp, p, jnp.ones_like(split.mask), mu, transpose=True,
                                 differentiable=False)
        _, fyp_z, fp_z = terms.f_transpose(t0, y, yp, p, z)
        return jnp.zeros_like(mu), -fyp_z, pbar - fp_z
    # The algebraic part of y0 and all of y'0 are determined by the differential part.
    return split.diff_t(mu), jnp.zeros_like(mu), pbar
