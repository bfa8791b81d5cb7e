"""Ensembles: one function of a single member (a solve, or a derivative of a per-member
loss) over a batch of members, in chunks of a fixed size, each chunk split over the local
devices with independent per-device integrations.

A chunk is `jax.vmap` of the function, so its members run in lock-step until the slowest
one finishes; between devices nothing is shared (`shard_map` over a one-axis mesh of the
devices: no collective operation per step, each device's loop ends when its own members
are done). Chunks run one after another through one compiled program: the last chunk is
padded to the chunk size with copies of its first member, whose results are dropped.
"""

import functools as ft
import math
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from ._solution import Solution

_AXIS = "ensemble"
# `solve_ensemble(queue=True)`'s default working set: 64 slots advanced 64 accepted steps
# a segment (benchmarks/ensembles.py, 256 Robertson members on the CPU).
QUEUE_SLOTS = 64
QUEUE_SEGMENT = 64
# `ensemble`'s default chunk on CPU devices: members per device. A vmapped Robertson
# solve holds ~2.4 KB of working memory per member (XLA's memory analysis), so 1024
# members keep the loop's state near a core's L2 cache (2 MiB here); past it every trip
# costs more per member. Measured (benchmarks/ensembles.py --chunks, 4096 members, CPU
# seconds): chunks of 512-1024 1.9-2.4 ms per member, one chunk of 4096 3.5-3.8 ms —
# which also waits on the slowest of 4096 members (1696 steps) instead of each chunk's
# own (1403 in 1024). Elsewhere (GPUs) the default stays the whole batch: a GPU's
# throughput rises with the batch (docs/ensembles.md, "GPUs").
CPU_CHUNK = 1024


def _batch_size(xs) -> int:
    leaves = [x for x in jax.tree_util.tree_leaves(xs) if eqx.is_array_like(x)]
    if not leaves:
        raise ValueError("daeadjoint.ensemble: the batched arguments contain no arrays; each "
                         "array leaf must have the batch (members) as its leading axis.")
    if any(np.ndim(x) == 0 for x in leaves):
        raise ValueError("daeadjoint.ensemble: a batched argument is a scalar; every array "
                         "leaf needs a leading batch axis (one entry per member).")
    sizes = {int(np.shape(x)[0]) for x in leaves}
    if len(sizes) != 1:
        raise ValueError("daeadjoint.ensemble: the batched arguments disagree on the number of "
                         f"members (leading axes {sorted(sizes)}).")
    return sizes.pop()


def _reporter(progress) -> Callable[[int, int, float], None] | None:
    if progress is False or progress is None:
        return None
    if callable(progress):
        return lambda done, total, elapsed: progress(done, total)

    def report(done, total, elapsed):
        eta = elapsed / done * (total - done) if done else float("nan")
        print(f"daeadjoint.ensemble: {done}/{total} members, {elapsed:.1f} s elapsed, "
              f"~{eta:.1f} s to go", file=sys.stderr, flush=True)
    return report


def ensemble(fn: Callable, *batched: Any, chunk_size: int | None = None,
             memory_limit: int | None = None, devices: Sequence[Any] | None = None,
             cost: Any = None, progress: bool | Callable[[int, int], Any] = False) -> Any:
    r"""`fn` applied to every member of a batch: out[i] = fn(x₁[i], x₂[i], …).

    For ensembles too large for one `jax.vmap` (memory), spread over several devices, or
    worth a progress report. `fn` is one member's computation — a solve, or a derivative
    of a per-member loss (`jax.grad(loss)`, `jax.jacfwd(f)`, `jax.jacrev(f)`,
    `jax.value_and_grad(loss)`) — and is compiled once, as `jax.vmap(fn)` over a chunk
    (and reused by later calls with the same function object and chunk shape: make
    `jax.grad(loss)` once, not in each call). Call it outside `jax.jit`: it moves each
    chunk's results to the host.
    Each member gets the result of its own unbatched call to within the solver's
    tolerance (a vmapped solve takes the batch's expensive branches, e.g. a Jacobian
    refresh, whenever any member needs them, which moves a member's Newton iterates
    within their convergence test: results depend slightly on the chunk's and devices'
    composition). Call `solve` inside `fn` with `throw=False` so that a failing member
    reports its status (`sol.result`; derivatives NaN) instead of stopping the ensemble
    with an error; `solve_ensemble` does this for a plain solve.

    **Arguments:**

    - `fn`: the function of one member; its outputs a pytree of arrays.
    - `*batched`: its arguments, pytrees whose array leaves all have the members as
      their leading axis (close over what is shared: `lambda p: f(p, data)`).
    - `chunk_size`: members per compiled call (default: 1024 per device on CPU devices,
      where larger chunks cost more per member (the loop's state leaves the cache), and
      all at once elsewhere). It bounds memory:
      a vmapped solve holds every member's state, Jacobian and (for derivatives)
      checkpoints at once, so the peak memory grows linearly with the chunk. Rounded up
      to a multiple of the number of devices; the last chunk is padded to it (one
      compiled program for all chunks).
    - `memory_limit`: bytes per device the chunk may use; the chunk is made no larger
      than what XLA's memory analysis of a one-member-per-device program says fits
      (that program's arguments, outputs and temporaries counted for every member: an
      overestimate). One extra compilation.
    - `devices`: where to run (default `jax.local_devices()`). With several, each chunk
      is split evenly over them (`shard_map`: every device integrates its own members in
      its own loop, no communication per step); a chunk smaller than the number of
      devices is padded.
    - `cost`: a predicted cost per member (e.g. `sol.stats["num_steps"]` of a cheap
      pilot run at a loose tolerance). The members are then run in order of cost, so
      that each chunk, and each device's share of it, holds members of similar cost and
      its lock-step loop wastes little on waiting for its slowest member; the results
      come back in the original order.
    - `progress`: True prints the members done, time elapsed and an estimate of the time
      left (to stderr) after each chunk; a callable is called as `progress(done, total)`.

    **Returns:** `fn`'s outputs stacked along a new leading axis of the batch size (as
    `jax.vmap(fn)(*batched)`), on the host's default device.
    """
    # Array leaves carry the members; any other leaf (e.g. a static int in `args`) is
    # shared by all of them.
    dyn, static = eqx.partition(batched, eqx.is_array)
    total = _batch_size(dyn)
    order = None
    if cost is not None:
        cost = np.asarray(cost)
        if cost.shape != (total,):
            raise ValueError(f"daeadjoint.ensemble: `cost` must have one entry per member "
                             f"({total},), got shape {cost.shape}.")
        order = np.argsort(cost, kind="stable")
        dyn = jax.tree_util.tree_map(lambda x: np.asarray(x)[order], dyn)
    devices = list(jax.local_devices() if devices is None else devices)
    if not devices:
        raise ValueError("daeadjoint.ensemble: `devices` is empty.")
    ndev = len(devices)
    if chunk_size is None:
        cpu = all(d.platform == "cpu" for d in devices)
        chunk_size = min(total, CPU_CHUNK * ndev) if cpu else total
    if not isinstance(chunk_size, (int, np.integer)) or chunk_size < 1:
        raise ValueError(f"daeadjoint.ensemble: chunk_size must be a positive integer, got "
                         f"{chunk_size!r}.")
    function, leading, place = _compiled(fn, static, devices)
    if memory_limit is not None:
        per_device = _members_in(memory_limit, function, leading, place, dyn, ndev)
        chunk_size = min(chunk_size, per_device * ndev)
    chunk = ndev * math.ceil(min(int(chunk_size), total) / ndev)
    report = _reporter(progress)

    outs = []
    start = time.perf_counter()
    for lo in range(0, total, chunk):
        hi = min(lo + chunk, total)
        rows = slice(lo, hi)
        part = jax.tree_util.tree_map(ft.partial(_padded, rows=rows, size=chunk), dyn)
        out_dyn, out_static = eqx.partition(function(*leading, place(part)), eqx.is_array)
        # To the host: device memory holds one chunk at a time.
        outs.append(jax.tree_util.tree_map(ft.partial(_first, n=hi - lo), out_dyn))
        if report is not None:
            report(hi, total, time.perf_counter() - start)
    stacked = jax.tree_util.tree_map(lambda *o: np.concatenate(o), *outs)
    if order is not None:      # back to the caller's order
        inverse = np.empty_like(order)
        inverse[order] = np.arange(total)
        stacked = jax.tree_util.tree_map(lambda o: o[inverse], stacked)
    return eqx.combine(jax.tree_util.tree_map(jnp.asarray, stacked), out_static)


def _padded(x, rows: slice, size: int):
    """x[rows] padded to `size` rows with copies of its first row."""
    x = np.asarray(x)[rows]
    if x.shape[0] == size:
        return x
    return np.concatenate([x, np.repeat(x[:1], size - x.shape[0], axis=0)])


def _first(x, n: int):
    return np.asarray(x)[:n]


def _member_batch(fn, static):
    return jax.vmap(lambda *d: fn(*eqx.combine(d, static)))


# Module-level compiled functions, `fn`, `static` and the mesh as static arguments: a
# second `ensemble` call with the same function reuses the compiled chunk.
@eqx.filter_jit
def _chunk_on_one_device(fn, static, part):
    return _member_batch(fn, static)(*part)


@eqx.filter_jit
def _chunk_sharded(fn, static, mesh, part):
    rest = []

    def local(*d):   # shard_map returns arrays only: keep the rest aside
        out, out_static = eqx.partition(_member_batch(fn, static)(*d), eqx.is_array)
        rest.append(out_static)
        return out

    spec = PartitionSpec(_AXIS)
    # Inside shard_map the axis is manual: each device vmaps its own members, and the
    # solver's loops see no sharded axis (no collective per step).
    out = jax.shard_map(local, mesh=mesh, in_specs=spec, out_specs=spec,
                        check_vma=False)(*part)
    return eqx.combine(out, rest[0])


def _compiled(fn, static, devices):
    """(compiled function, its leading static arguments, placement of a chunk's inputs):
    `function(*leading, place(part))` gives fn's outputs for the chunk's members."""
    if len(devices) == 1:
        dev = devices[0]
        return _chunk_on_one_device, (fn, static), lambda part: jax.device_put(part, dev)
    mesh = jax.sharding.Mesh(np.asarray(devices), (_AXIS,), axis_types=(AxisType.Explicit,))
    sharding = NamedSharding(mesh, PartitionSpec(_AXIS))
    return _chunk_sharded, (fn, static, mesh), lambda part: jax.device_put(part, sharding)


def _members_in(memory_limit: int, function, leading, place, dyn, ndev: int) -> int:
    """Members per device that fit `memory_limit` bytes per device: XLA's memory
    analysis (arguments, outputs, temporaries) of the program for one member per device,
    taken as the cost of each member (an overestimate: it includes what the members
    share)."""
    probe = jax.tree_util.tree_map(ft.partial(_padded, rows=slice(0, ndev), size=ndev), dyn)
    stats = function.lower(*leading, place(probe)).compile().compiled.memory_analysis()
    per_member = (stats.argument_size_in_bytes + stats.output_size_in_bytes
                  + stats.temp_size_in_bytes)
    fit = int(memory_limit) // max(per_member, 1)
    if fit < 1:
        raise ValueError(f"daeadjoint.ensemble: memory_limit={memory_limit} bytes is less "
                         f"than one member needs ({per_member} bytes per device).")
    return fit


def solve_ensemble(residual: Callable, t0, t1, y0, yp0=None, args: Any = None, *,
                   batch: Sequence[str] = ("y0", "args"), chunk_size: int | None = None,
                   memory_limit: int | None = None, devices: Sequence[Any] | None = None,
                   cost: Any = None, progress: bool | Callable[[int, int], Any] = False,
                   queue: bool | None = None, segment: int = QUEUE_SEGMENT,
                   **solve_kwargs: Any) -> Solution:
    r"""`solve` for every member of a batch of initial values and/or parameters, with
    per-member statuses (`ensemble` of `solve`, `throw=False` by default).

    **Arguments:**

    - `residual`, `t0`, `t1`, `y0`, `yp0`, `args`: as for `solve`, except that the
      inputs named in `batch` carry the members along a leading axis: `y0` (and `yp0`)
      of shape (members, n), every array leaf of `args` with the members first.
    - `batch`: which of `"t0"`, `"t1"`, `"y0"`, `"yp0"`, `"args"` are batched
      (default `("y0", "args")`; a `y0` of shape (n,) or `args=None` is then shared by
      all members). The others are shared.
    - `queue`: run the members through a refilled working set (default None: off, the
      chunks; see docs/ensembles.md for when it pays). `chunk_size` slots (default 64) are advanced `segment` accepted
      steps at a time by one compiled program; between segments the members that are
      done (successful or failed) are collected and their slots given to the next
      members. A vmapped loop runs until its slowest member is done, so a chunk costs
      its size times its slowest member's steps; the queue costs about the members'
      own steps, plus up to a segment per member spent waiting. Each member takes the
      steps of its own solve (the integration resumes exactly between segments). With
      `cost=` the queue runs the most expensive members first (so that the last
      members to start are short ones). One device; not with `throw=True` or delays.
      False: chunks as in `ensemble`.
    - `segment`: accepted steps per member between refills (default 64).
    - `chunk_size`, `memory_limit`, `devices`, `cost`, `progress`: as for `ensemble`
      (with the queue, `chunk_size` is the number of slots, and progress is reported
      after each segment in which members finished).
    - `**solve_kwargs`: every other option of `solve` (`saveat`, `rtol`, `atol`,
      `algebraic`, `sensitivity`, ...), shared by all members. `throw` defaults to False:
      a failed member keeps its status in `result` and its partial solution (`inf` where
      not reached), the others are unaffected.

    **Returns:** a `Solution` whose arrays (`ys`, `yps`, `qs`, `stats`, `result`, ...)
    have the members as their leading axis; `sol.result[i]` is member i's status
    (`daeadjoint.RESULTS`), e.g. `sol.result == dae.RESULTS.successful`.
    """
    allowed = ("t0", "t1", "y0", "yp0", "args")
    unknown = [b for b in batch if b not in allowed]
    if unknown:
        raise ValueError(f"daeadjoint.solve_ensemble: `batch` names {unknown}; allowed: "
                         f"{list(allowed)}.")
    from ._solve import solve
    values = dict(t0=t0, t1=t1, y0=y0, yp0=yp0, args=args)
    # A batched y0/yp0 is 2-D; a 1-D one (or args=None) is shared although named.
    names = [b for b in batch if values[b] is not None
             and not (b in ("y0", "yp0") and np.ndim(values[b]) == 1)]
    if not names:
        raise ValueError("daeadjoint.solve_ensemble: nothing is batched: pass `y0` of shape "
                         "(members, n) or `args` whose array leaves have the members first "
                         "(and name them in `batch`).")
    shared = {k: v for k, v in values.items() if k not in names}
    solve_kwargs.setdefault("throw", False)

    def member(*xs):
        kw = dict(shared, **dict(zip(names, xs)))
        return solve(residual, kw.pop("t0"), kw.pop("t1"), kw.pop("y0"), kw.pop("yp0"),
                     kw.pop("args"), **solve_kwargs)

    # The same problem and options give the same `member` function, so that a repeated
    # call reuses the compiled chunk (it bakes the shared values in as constants).
    key = _key((residual, tuple(names), shared, solve_kwargs))
    if key is not None:
        member = _MEMBERS.setdefault(key, member)
        if len(_MEMBERS) > 32:
            _MEMBERS.pop(next(iter(_MEMBERS)))
    batched = [values[b] for b in names]
    dyn, static = eqx.partition(batched, eqx.is_array)
    total = _batch_size(dyn)
    devices = list(jax.local_devices() if devices is None else devices)
    slots = chunk_size or QUEUE_SLOTS
    if queue is None:
        # Not the default: on the CPU (benchmarks/ensembles.py) the segments' overhead
        # costs a homogeneous batch 35-80 % more than its chunks and a heterogeneous one
        # about what the chunks' lock-step wastes (docs/ensembles.md).
        queue = False
    if queue and (len(devices) != 1 or solve_kwargs.get("throw")
                  or solve_kwargs.get("delays") is not None
                  or solve_kwargs.get("history") is not None):
        raise ValueError("daeadjoint.solve_ensemble: queue=True runs on one device, with "
                         "throw=False and without delays; use queue=False (chunks).")
    if queue:
        if not isinstance(slots, (int, np.integer)) or slots < 1:
            raise ValueError(f"daeadjoint.solve_ensemble: chunk_size must be a positive "
                             f"integer, got {chunk_size!r}.")
        if not isinstance(segment, (int, np.integer)) or segment < 1:
            raise ValueError(f"daeadjoint.solve_ensemble: segment must be a positive "
                             f"integer, got {segment!r}.")
        if memory_limit is not None:
            function, leading, place = _compiled(member, static, devices)
            slots = min(slots, _members_in(memory_limit, function, leading, place, dyn, 1))
        parts = _Member(residual, names, shared, solve_kwargs)
        if key is not None:    # a repeated call reuses the compiled queue programs
            parts = _PARTS.setdefault(key, parts)
            if len(_PARTS) > 32:
                _PARTS.pop(next(iter(_PARTS)))
        order = np.arange(total)
        if cost is not None:    # longest first: the last members to start are short
            cost = np.asarray(cost)
            if cost.shape != (total,):
                raise ValueError(f"daeadjoint.solve_ensemble: `cost` must have one entry per "
                                 f"member ({total},), got shape {cost.shape}.")
            order = np.argsort(-cost, kind="stable")
        return _queue(parts, dyn, total, int(slots), int(segment), devices[0], order,
                      _reporter(progress))
    return ensemble(member, *batched, chunk_size=chunk_size,
                    memory_limit=memory_limit, devices=devices, cost=cost, progress=progress)


_MEMBERS: dict = {}
_PARTS: dict = {}


def _key(tree):
    """A hashable fingerprint of a pytree (arrays by shape, dtype and bytes), or None."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    out = []
    for x in leaves:
        if isinstance(x, (np.ndarray, jax.Array, np.generic)):
            x = np.asarray(x)
            out.append(("array", x.shape, x.dtype.str, x.tobytes()))
        else:
            try:
                hash(x)
            except TypeError:
                return None
            out.append(x)
    return treedef, tuple(out)


# ------------------------------------------------------------------ refilled working set
#
# A vmapped `while_loop` runs until its slowest member is done, so a chunk costs its size
# times its slowest member's steps. The queue keeps a working set of `slots` members on
# the device and runs them a segment (at most `segment` accepted steps each) at a time
# through one compiled program; between segments the host collects the members that are
# done (success or failure) and gives their slots to the next members of the queue. A
# batch then costs about its members' own steps (plus at most a segment per member
# spent waiting), not its size times the slowest member's.
#
# The integration's carry resumes (`integrate(..., until=)`), so each member takes the
# steps of its own uninterrupted solve.


class _Member:
    """One member's solve in pieces (configure → begin → integrate a segment → end),
    each a function of the member's batched inputs `xs` (traced under `vmap`). Hashed by
    identity: the static argument of the compiled queue programs, cached per problem
    like `solve_ensemble`'s member function."""

    def __init__(self, residual, names, shared, solve_kwargs):
        import inspect

        from ._solve import _configure, solve
        params = inspect.signature(_configure).parameters
        defaults = {k: p.default for k, p in inspect.signature(solve).parameters.items()
                    if k in params and p.kind == p.KEYWORD_ONLY}
        self.residual, self.names, self.shared = residual, tuple(names), shared
        self.options = dict(defaults, **solve_kwargs)
        self._configure = _configure
        self.shapes: dict = {}      # the carry's shapes per working set (`_queue`)

    def configure(self, xs):
        from ._solve import _core_inputs
        kw = dict(self.shared, **dict(zip(self.names, xs)))
        config, inputs = self._configure(self.residual, kw["t0"], kw["t1"], kw["y0"],
                                         kw["yp0"], kw["args"], **self.options)
        return config, inputs, _core_inputs(inputs)

    def begin(self, xs):
        from ._core import begin
        config, _, inputs = self.configure(xs)
        _, carry, start = begin(config, inputs)
        return carry, start

    def advance(self, xs, carry, start, segment: int):
        """(carry, start, done) after at most `segment` more accepted steps."""
        from ._core import _with_progress, build_problem
        from ._integrator import integrate
        from ._results import RESULTS
        config, _, inputs = self.configure(xs)
        problem = _with_progress(build_problem(config, inputs), config)
        state, outputs, recorders, events = carry
        carry = integrate(problem, state, outputs, inputs.t1, config.max_steps, recorders,
                          events, until=state.stats["num_steps"] + segment)
        state = carry[0]
        done = ~((state.t < inputs.t1) & (state.result == RESULTS.successful))
        return carry, start, done

    def end(self, xs, carry, start) -> Solution:
        from ._core import end
        from ._solve import _solution
        config, inputs, core_inputs = self.configure(xs)
        core, _, _ = end(config, core_inputs, carry, start)
        return _solution(config, inputs, core)[0]


def _rows(mask, new, old):
    return jnp.where(mask.reshape(mask.shape + (1,) * (jnp.ndim(old) - 1)), new, old)


@eqx.filter_jit
def _queue_segment(member: _Member, xs, carry, start, new_xs, refill, segment: int):
    """The working set after giving the `refill` slots the members `new_xs` (their
    initialization) and advancing every slot by at most `segment` steps:
    (xs, carry, start, done)."""
    def refilled():
        fresh = jax.vmap(member.begin)(new_xs)
        return jax.tree_util.tree_map(ft.partial(_rows, refill), fresh, (carry, start))

    # Unbatched predicate: the initialization runs only in segments that refill a slot.
    carry, start = jax.lax.cond(jnp.any(refill), refilled, lambda: (carry, start))
    xs = jax.tree_util.tree_map(ft.partial(_rows, refill), new_xs, xs)
    carry, start, done = jax.vmap(ft.partial(member.advance, segment=segment))(xs, carry, start)
    return xs, carry, start, done


@eqx.filter_jit
def _queue_end(member: _Member, xs, carry, start):
    return jax.vmap(member.end)(xs, carry, start)


def _queue(member: _Member, dyn, total: int, slots: int, segment: int, device, order,
           report) -> Any:
    """Every member's Solution through a refilled working set of `slots` members, in the
    queue's `order` (indices into the batch); returned in the batch's order."""
    slots = min(slots, total)
    take = lambda rows: jax.device_put(  # noqa: E731
        jax.tree_util.tree_map(lambda x: np.asarray(x)[rows], dyn), device)
    queue = list(order)
    xs = take(np.asarray(queue[:1] * slots))
    # A placeholder carry for the first segment, whose slots are all refilled (its
    # shapes traced once per problem and working-set size: tracing `begin` costs more
    # than a segment of a small problem).
    shape_key = tuple((np.shape(x), x.dtype.str) for x in jax.tree_util.tree_leaves(xs))
    shapes = member.shapes.get(shape_key)
    if shapes is None:
        shapes = member.shapes[shape_key] = eqx.filter_eval_shape(jax.vmap(member.begin), xs)
    carry, start = jax.tree_util.tree_map(
        lambda s: jnp.zeros(s.shape, s.dtype) if isinstance(s, jax.ShapeDtypeStruct) else s,
        shapes)
    owner = np.full(slots, -1)             # the member in each slot, -1: none
    results: list | None = None             # one array per output leaf, a row per member
    out_static = treedef = None
    done_count, nxt, t_start = 0, 0, time.perf_counter()
    while True:
        free = np.flatnonzero(owner < 0)[:total - nxt]
        refill = np.zeros(slots, bool)
        refill[free] = True
        pick = np.zeros(slots, int)
        pick[free] = queue[nxt:nxt + len(free)]
        owner[free] = pick[free]
        nxt += len(free)
        if not (owner >= 0).any():
            break
        xs, carry, start, done = _queue_segment(member, xs, carry, start, take(pick),
                                                jnp.asarray(refill), segment)
        finished = np.flatnonzero(np.asarray(done) & (owner >= 0))
        if finished.size:
            out_dyn, out_static = eqx.partition(_queue_end(member, xs, carry, start),
                                                eqx.is_array)
            leaves, treedef = jax.tree_util.tree_flatten(out_dyn)
            if results is None:
                results = [np.empty((total,) + x.shape[1:], x.dtype) for x in leaves]
            for r, x in zip(results, leaves):
                r[owner[finished]] = np.asarray(x)[finished]
            owner[finished] = -1
            done_count += finished.size
            if report is not None:
                report(done_count, total, time.perf_counter() - t_start)
    assert results is not None and treedef is not None
    stacked = jax.tree_util.tree_unflatten(treedef, [jnp.asarray(r) for r in results])
    return eqx.combine(stacked, out_static)
