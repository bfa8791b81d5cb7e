r"""The delay adjoint's forward solution by checkpoint recomputation (`Adjoint(
checkpoint_every=K)` with `delays=`).

The backward solve (`adjoint.py`) reads the forward interpolant at t, at the lagged
times t − τᵢ and at the advanced times t + τᵢ (and t + τᵢ − τⱼ). Keeping every step's
polynomial costs max_steps·(6n + 9) numbers (`solve.py` `_forward_dense`). Instead:

1. Forward: the solve again, stopped every K accepted steps (`integrate(until=)`, which
   resumes exactly). Checkpoint c, before segment c = steps cK+1 … (c+1)K, is the whole
   BDF state (its factorization included) and the step-history ring (`DelayBuffer`, the
   last H = `history_steps` steps: it reaches back τ_max, or the solve would have
   stopped with `delay_history_lost`). A restart from it repeats the original steps bit
   for bit: the integrator's state and everything its residual reads are restored.
2. Backward, segment by segment from the last: backward segment c integrates the
   adjoint in reversed time s over the forward interval [t_c, t_{c+1}] (to the first
   step that passes s = T − t_c, as an uninterrupted integration steps), with the
   forward interpolant of a *window*: the ring of checkpoint c − 1, the recomputed
   segments c − 1 and c, and the first H steps after t_{c+1} (the "suffix", kept from
   the previous backward segments). H steps span at least τ_max (the ring's guarantee:
   a step is overwritten only once it ends τ_max before the newest), so the window
   covers [t_{c−1} − τ_max, t_{c+1} + τ_max]: every forward value backward segment c
   reads when no segment is shorter than a backward step (a backward trial step is at
   most τ_min long, so K ≥ H, whose segments last ≥ τ_max, suffices). A value outside
   the window is NaN, never an extrapolation: a trial step that would read one fails as
   on a NaN residual and is retried smaller, so the accepted steps only ever read the
   forward solution itself.

Result: the stored-trajectory adjoint's, bit for bit when no trial step leaves the
window (the same forward steps, read from the same polynomials by the same code, and
the same backward steps), else within the adjoint's tolerance (other backward steps of
the same continuous problem).

Memory (in step rows of ~6n + 9 numbers): (⌈max_steps/K⌉ + 1)(H + 1) for the
checkpoints, plus 4K + 3H for the segments, the suffix and the window — against
max_steps for the stored trajectory; `use_checkpoints` picks the smaller.
"""

import dataclasses
import inspect
import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from .._integrator import DenseRecorder, integrate
from .._results import RESULTS
from .buffer import DelayBuffer


def checkpoint_rows(every: int, max_steps: int, history_steps: int) -> int:
    """Step rows the checkpointed adjoint stores (module docstring)."""
    n_ck = math.ceil(max_steps / every) + 1
    return n_ck * (history_steps + 1) + 4 * every + 3 * history_steps


def use_checkpoints(every: int, max_steps: int, history_steps: int) -> bool:
    """Recompute from checkpoints when that stores fewer step rows than keeping every
    step's polynomial (max_steps rows): with the defaults (K = 100, H = 1000) never,
    since every checkpoint holds a ring of H steps; it pays for K well above H."""
    return checkpoint_rows(every, max_steps, history_steps) < max_steps


def configure(residual, t0, t1, y0, yp0, args, **kwargs):
    """(Config, core Inputs) of `solve(residual, t0, t1, y0, yp0, args, **kwargs)`: the
    program `solve` would run, to be driven a segment at a time."""
    from .._solve import _configure, _core_inputs, solve
    params = inspect.signature(_configure).parameters
    defaults = {k: p.default for k, p in inspect.signature(solve).parameters.items()
                if k in params and p.kind == p.KEYWORD_ONLY}
    config, inputs = _configure(residual, t0, t1, y0, yp0, args, **dict(defaults, **kwargs))
    return config, _core_inputs(inputs)


class Checkpoints(eqx.Module):
    """Checkpoint c (c < count): the BDF state before segment c and the step ring then
    (its breakpoints left out: the same for all); the forward run's end."""

    states: Any
    rings: Any
    count: Any
    final: Any            # the forward run's last state


def _slot(tree, i):
    return jax.tree_util.tree_map(lambda x: x[i], tree)


def _ring(buf: DelayBuffer) -> DelayBuffer:
    return dataclasses.replace(buf, breakpoints=None)


def forward(config, inputs, every: int) -> tuple[Any, Checkpoints, Any]:
    """The forward run, checkpointed every `every` steps: (problem, Checkpoints,
    outputs template for replays)."""
    from .._core import begin
    problem, carry, _ = begin(config, inputs, progress=False)
    state, outputs, recs, _ = carry
    n_ck = math.ceil(config.max_steps / every) + 1
    store = jax.tree_util.tree_map(lambda x: jnp.zeros((n_ck,) + jnp.shape(x), jnp.result_type(x)),
                                   (state, _ring(recs[-1])))

    def cond(c):
        (s, _, _, _), _, i = c
        return (s.t < inputs.t1) & (s.result == RESULTS.successful) & (i < n_ck)

    def body(c):
        (s, out, recs, ev), store, i = c
        store = jax.tree_util.tree_map(lambda b, v: b.at[i].set(v), store, (s, _ring(recs[-1])))
        carry = integrate(problem, s, out, inputs.t1, config.max_steps, recs, ev,
                          until=s.stats["num_steps"] + every)
        return carry, store, i + 1

    carry, store, count = jax.lax.while_loop(cond, body, (carry, store, jnp.zeros((), jnp.int32)))
    n_save = outputs.ts.shape[0]
    replay_out = dataclasses.replace(outputs, index=jnp.asarray(n_save, jnp.int32))
    return problem, Checkpoints(states=store[0], rings=store[1], count=count,
                                final=carry[0]), replay_out


def recompute(problem, config, inputs, cks: Checkpoints, replay_out, c, every: int):
    """Segment c again from its checkpoint: (its steps as a DenseRecorder of `every`
    rows, whether it repeated the original run: it ends where checkpoint c + 1 starts,
    or where the run ended, after the same number of steps and successfully)."""
    s = _slot(cks.states, c)
    ring = dataclasses.replace(_slot(cks.rings, c), breakpoints=problem.args.buffer.breakpoints)
    rec = DenseRecorder.create(s, every, True)
    end, _, (rec, _), _ = integrate(problem, s, replay_out, inputs.t1, config.max_steps,
                                    (rec, ring), None, until=s.stats["num_steps"] + every)
    last = c + 1 >= cks.count
    nxt = _slot(cks.states, jnp.minimum(c + 1, cks.states.t.shape[0] - 1))
    want_t = jnp.where(last, cks.final.t, nxt.t)
    want_n = jnp.where(last, cks.final.stats["num_steps"], nxt.stats["num_steps"])
    ok = ((end.t == want_t) & (end.stats["num_steps"] == want_n)
          & (end.result == RESULTS.successful))
    return rec, ok


# ------------------------------------------------------------ the forward window


class Steps(eqx.Module):
    """A run of consecutive forward steps [t_left, t_right] with their interpolants;
    `valid` marks the rows that hold one (the others are padding)."""

    t_left: Any
    t_right: Any
    phi: Any
    psi: Any
    k_used: Any
    valid: Any

    @classmethod
    def of_segment(cls, rec: DenseRecorder, live=True):
        rows = rec.phi.shape[0]
        valid = (jnp.arange(rows) < rec.count) & live
        return cls(t_left=rec.t[:-1], t_right=rec.t[1:], phi=rec.phi, psi=rec.psi,
                   k_used=rec.k_used, valid=valid)

    @classmethod
    def of_ring(cls, buf: DelayBuffer, live=True):
        """The ring's steps in the order they were taken (the oldest slot first)."""
        C = buf.capacity
        filled = jnp.minimum(buf.count, C)
        start = jnp.where(buf.count >= C, jnp.mod(buf.count, C), 0)
        idx = jnp.mod(start + jnp.arange(C), C)
        return cls(t_left=buf.t_left[idx], t_right=buf.t_right[idx], phi=buf.phi[idx],
                   psi=buf.psi[idx], k_used=buf.k_used[idx],
                   valid=(jnp.arange(C) < filled) & live)

    @classmethod
    def empty_like(cls, other: "Steps", rows: int):
        def pad(x):
            return jnp.zeros((rows,) + x.shape[1:], x.dtype)
        return cls(t_left=pad(other.t_left), t_right=pad(other.t_right), phi=pad(other.phi),
                   psi=jnp.ones((rows,) + other.psi.shape[1:], other.psi.dtype),
                   k_used=jnp.ones((rows,), other.k_used.dtype), valid=jnp.zeros((rows,), bool))

    def then(self, other: "Steps", rows: int | None = None) -> "Steps":
        """self's valid rows followed by other's, packed at the front (padding after),
        the first `rows` of them (default all)."""
        cat = jax.tree_util.tree_map(lambda a, b: jnp.concatenate([a, b]), self, other)
        L = cat.valid.shape[0]
        pos = jnp.where(cat.valid, jnp.cumsum(cat.valid) - 1, L)

        def pack(x, fill):
            base = jnp.full((L + 1,) + x.shape[1:], fill, x.dtype)
            return base.at[pos].set(x)[:L if rows is None else rows]

        return Steps(t_left=pack(cat.t_left, 0), t_right=pack(cat.t_right, 0),
                     phi=pack(cat.phi, 0), psi=pack(cat.psi, 1), k_used=pack(cat.k_used, 1),
                     valid=pack(cat.valid, False))


class Window(eqx.Module):
    """The forward interpolant on a window of consecutive steps: `evaluate` as the
    stored trajectory's (`DenseRecorder.evaluate`, the same code on the same steps),
    NaN outside the window (module docstring)."""

    dense: DenseRecorder
    t0: Any

    @classmethod
    def of(cls, steps: Steps, t0):
        count = jnp.sum(steps.valid, dtype=jnp.int32)
        inf = jnp.asarray(jnp.inf, steps.t_right.dtype)
        t = jnp.concatenate([steps.t_left[:1], jnp.where(steps.valid, steps.t_right, inf)])
        rec = DenseRecorder(interpolant=True, t=t, y=jnp.zeros((0,) + steps.phi.shape[2:],
                                                               steps.phi.dtype),
                            phi=steps.phi, psi=steps.psi, k_used=steps.k_used, count=count)
        return cls(dense=rec, t0=t0)

    def inside(self, t):
        """Whether t lies on the window's steps (or at/before t0 when the window starts
        there)."""
        d = self.dense
        lo, hi = d.t[0], d.t[jnp.maximum(d.count, 1)]
        return ((t > lo) | (lo <= self.t0)) & (t <= hi) & (d.count > 0)

    def evaluate(self, t, order: int = 0):
        return jnp.where(self.inside(t), self.dense.evaluate(t, order), jnp.nan)


# ------------------------------------------------------------ the backward driver


def backward(fwd_config, fwd_inputs, every, setup, with_window, T):
    """The backward solve driven segment by segment over the recomputed forward
    solution. `setup(window)`: the backward solve's (Config, core Inputs) reading the
    forward `window`; `with_window(inputs, window)`: those inputs reading another.
    Returns (the backward Core, status of the forward and its recomputation)."""
    from .._core import begin, build_problem, end
    problem, cks, replay_out = forward(fwd_config, fwd_inputs, every)
    H = problem.args.buffer.capacity
    t0 = fwd_inputs.t0
    last = jnp.maximum(cks.count - 1, 0)

    def seg(c):
        return recompute(problem, fwd_config, fwd_inputs, cks, replay_out, c, every)

    def seg_or_none(c):
        # Segment c if it exists (a branch: the first segment has no predecessor, and a
        # forward run that failed at its start has no checkpoint to restart from).
        rec, ok = jax.lax.cond((c >= 0) & (c < cks.count), lambda: seg(jnp.maximum(c, 0)),
                               lambda: (DenseRecorder.create(_slot(cks.states, 0), every, True),
                                        jnp.ones((), bool)))
        return rec, ok

    def window(c, prev, cur, suffix):
        ring = Steps.of_ring(_slot(cks.rings, jnp.maximum(c - 1, 0)), c >= 1)
        steps = ring.then(Steps.of_segment(prev, c >= 1)).then(Steps.of_segment(cur))
        return Window.of(steps.then(suffix), t0)

    cur, ok_cur = seg_or_none(last)
    prev, ok_prev = seg_or_none(last - 1)
    suffix0 = Steps.empty_like(Steps.of_segment(cur), H)
    w0 = window(last, prev, cur, suffix0)
    bw_config, inputs0 = setup(w0)
    _, bw_carry, start = begin(bw_config, inputs0, progress=False)
    span = inputs0.t1

    def cond(c):
        return c[0] >= 0

    def body(c):
        i, carry, prev, cur, suffix, ok = c
        w = window(i, prev, cur, suffix)
        problem_bw = build_problem(bw_config, with_window(inputs0, w))
        s_end = jnp.where(i >= 1, T - _slot(cks.states, i).t, span)
        carry = integrate(problem_bw, carry[0], carry[1], s_end, bw_config.max_steps,
                          carry[2], carry[3])
        suffix = Steps.of_segment(cur).then(suffix, H)
        nxt, ok_n = seg_or_none(i - 2)
        return i - 1, carry, nxt, prev, suffix, ok & ok_n

    init = (jnp.where(cks.count > 0, last, -1), bw_carry, prev, cur, suffix0, ok_cur & ok_prev)
    _, bw_carry, _, _, _, ok = jax.lax.while_loop(cond, body, init)
    core = end(bw_config, inputs0, bw_carry, start)[0]
    fwd_result = cks.final.result
    status = RESULTS.where(fwd_result != RESULTS.successful, fwd_result,
                           RESULTS.where(ok, RESULTS.successful,
                                         RESULTS.delay_recompute_failed))
    return core, status
