"""Where the time of a batched step goes: Robertson in one `jax.jit(jax.vmap(solve))`,
per phase of the step, against the unbatched solve.

    OPENBLAS_NUM_THREADS=1 python benchmarks/profile_batch.py            # 256 members
    OPENBLAS_NUM_THREADS=1 python benchmarks/profile_batch.py -n 64 --top 30
    OPENBLAS_NUM_THREADS=1 python benchmarks/profile_batch.py --problem heat -n 64

Problem: `problems.robertson()` (0 … 4e10, 12 outputs, rtol 1e-6, IDAS's atol), p1 scaled
by 10**linspace(-0.5, 0.5, n) (the batch of `benchmarks/ensembles.py`).

What is measured and how
------------------------
1. **Thunks per step-loop trip (exact)**: the optimized HLO's step loop, by phase, with
   `profile_step.py`'s attribution (every attempt / per Newton iteration / when taken).
2. **Trips**: a vmapped `while_loop` runs its body until its last member is done, so the
   batch's step loop runs as many trips as its slowest member's step attempts (a
   batched solve steps its members in one flat loop; the nested loops of an unbatched
   solve, batched, made them wait for each other at every output time as well).
   Counted from a trace of one run (`jax.profiler`): XLA's CPU runtime records one
   event per executed thunk, named by its HLO instruction, so the events of the step
   loop's `while` and of the Newton loop's give their trips.
3. **Time per phase (rough)**: the same trace's thunk events summed by phase. The
   profiler adds ~0.2–1 µs to every event (on this 2-core machine under load), so
   phases of many cheap thunks look dearer than they are; the ranking of single
   expensive thunks (the `--top` list, with their HLO) is what it is for. Beside
   it, each phase's operations per trip (`element_operations`: a thunk's result
   values times the operations fused into it, weighted by its runs): static, so
   steadier than the profiled µs, and it shows what XLA recomputes (values fused into
   several consumers count in each) — but operations differ in cost.
   The whole
   run's wall and process (CPU) time are measured without the profiler, median of
   `--repeats` runs.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))                     # the working-tree daeadjoint
sys.path.insert(1, str(ROOT / "benchmarks"))
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_traceback_in_locations_limit", 1000)

import peers  # noqa: E402
import problems  # noqa: E402
import profile_step as ps  # noqa: E402

NESTED = ("while", "conditional", "call")


# Instructions of a fused computation that compute nothing per value (index arithmetic
# or data movement the fusion's loop folds into its reads).
_INDEXING = {"broadcast", "iota", "slice", "reshape", "copy", "transpose", "bitcast",
             "parameter", "constant", "get-tuple-element", "tuple"}
_ARRAY = re.compile(r"^\s*(?:ROOT )?%(\S+) = \w+\[([\d,]*)\]")


def element_operations(prog: ps.Program) -> dict:
    """HLO instruction name -> the operations it computes per run: its result's values
    times the computing instructions of its fused computation (a loop fusion evaluates
    its whole expression for each value of its result: what XLA fused into several
    consumers is computed by each, for each of their values). Static and exact, unlike
    the profiled µs; on the batched trip, whose time grows with the members (~0.2 µs
    per 256-value fusion when idle, ~0.7 µs more per member), its best measure of work.
    Rough where a fusion concatenates: each value computes one operand's expression,
    counted here as all of them. Not a time: per operation, fusions differ by 20x
    (Robertson, 256 members, profiled: the Gauss–Jordan setup's index compares and
    selects over (256, 3, 6), ~110 000 operations in ~3 µs; the Newton iteration's
    select of its (256, 3) iterate with the boolean logic of its status fused in,
    ~50 000 in ~9 µs). Instructions with a tuple result (multi-output fusions) are
    left out."""
    fused = {}
    for comp, instrs in prog.comps.items():
        fused[comp] = sum(op not in _INDEXING for op, _, _ in instrs)
    out = {}
    for line in prog.text.splitlines():
        m = _ARRAY.match(line)
        if not m:
            continue
        values = int(np.prod([int(d) for d in m.group(2).split(",") if d]))
        op, rest = ps._opcode(line[line.index(" = ") + 3:])
        if op in _INDEXING or op in NESTED:
            continue
        called = re.search(r"calls=%([\w.\-]+)", rest)
        out[m.group(1)] = values * (fused.get(called.group(1), 1) if called else 1)
    return out


def instruction_phases(prog: ps.Program) -> dict:
    """HLO instruction name -> (opcode, phase, text)."""
    out = {}
    for line in prog.text.splitlines():
        m = ps._INSTR.match(line)
        if not m:
            continue
        op, rest = ps._opcode(line[m.end():])
        sf = re.search(r"stack_frame_id=(\d+)", rest)
        stack = prog.funcs(int(sf.group(1))) if sf else []
        phase = ps.phase_of(stack) if stack or op == "copy" else "other XLA operations (no source)"
        out[m.group(1)] = (op, phase, rest, stack)
    return out


def where(stack, frames: int = 2) -> str:
    """The innermost `frames` daeadjoint source lines of a call stack (file:line)."""
    ours = [f"{Path(f).name}:{line}" for f, _, line in stack if "daeadjoint" in f
            and "benchmarks" not in f]
    return " < ".join(ours[:frames]) or "no source"


def loop_instructions(prog: ps.Program) -> dict:
    """The `while` instructions whose executions count the trips of the step loop and of
    the Newton loop: a trace records one event per execution of a `while` (not per
    iteration), so the step loop's trips are the executions of the Newton loop (issued
    once per attempt) and the Newton iterations those of the loops nested directly in
    its body (`maybe_update`, once per iteration; XLA may split it in several)."""
    def whiles_in(comps):
        return [name for c in comps for name, op, _ in _named(prog, c) if op == "while"]

    out = {}
    for name, called in ps.step_loops(prog):
        if name != "step loop":
            continue
        newton = whiles_in(called)
        out["step loop"] = newton
        bodies = [c for line in prog.text.splitlines()
                  if (m := ps._INSTR.match(line)) and m.group(1) in newton
                  for c in ps._called(*ps._opcode(line[m.end():]))]
        out["newton_solve"] = whiles_in(bodies)
        # The body's own instructions run once per trip (the condition's once more):
        # with a straight-line Newton iteration there is no Newton loop to count.
        out["trip"] = [name for c in called for name, op, _ in _named(prog, c)
                       if op not in NESTED and op not in ps.FREE]
    return out


def _named(prog: ps.Program, comp: str):
    """[(instruction name, opcode, text)] of one computation."""
    out, inside = [], False
    for line in prog.text.splitlines():
        if not line.startswith(" ") and line.rstrip().endswith("{") and "(" in line:
            inside = line.split("(", 1)[0].split()[-1].lstrip("%") == comp
            continue
        m = ps._INSTR.match(line)
        if inside and m:
            op, rest = ps._opcode(line[m.end():])
            out.append((m.group(1), op, rest))
    return out


def trace_events(compiled, x):
    """[(instruction name, duration ns)] of one traced run's thunks."""
    d = tempfile.mkdtemp(prefix="profile_batch_")
    try:
        with jax.profiler.trace(d):
            jax.block_until_ready(compiled(x))
        pd = jax.profiler.ProfileData.from_file(
            glob.glob(d + "/**/*.xplane.pb", recursive=True)[0])
        return [(ev.name, ev.duration_ns) for plane in pd.planes for line in plane.lines
                for ev in line.events]
    finally:
        shutil.rmtree(d, ignore_errors=True)


def timed(compiled, x, repeats):
    jax.block_until_ready(compiled(x))
    walls, cpus = [], []
    for _ in range(repeats):
        t, c = time.perf_counter(), time.process_time()
        jax.block_until_ready(compiled(x))
        walls.append(time.perf_counter() - t)
        cpus.append(time.process_time() - c)
    return statistics.median(walls), statistics.median(cpus)


def profile(label, fn, x, repeats, top):
    compiled = jax.jit(fn).lower(x).compile()
    prog = ps.Program(compiled)
    phases = instruction_phases(prog)
    loops = loop_instructions(prog)
    _, steps = compiled(x)
    steps = np.atleast_1d(np.asarray(steps))
    wall, cpu = timed(compiled, x, repeats)
    events = trace_events(compiled, x)
    runs = Counter(n for n, _ in events)
    trips = {k: max((runs[n] for n in v), default=0) for k, v in loops.items()}
    trips["step loop"] = min((runs[n] for n in loops.get("trip", ()) if runs[n]), default=0)
    work = element_operations(prog)
    by_phase, count, per_instr, ops = Counter(), Counter(), Counter(), Counter()
    for name, dur in events:
        if name not in phases or phases[name][0] in NESTED:
            continue
        by_phase[phases[name][1]] += dur
        count[phases[name][1]] += 1
        per_instr[name] += dur
        ops[phases[name][1]] += work.get(name, 0)
    ynn = sum(1 for op, _, rest, _ in phases.values() if "__ynn_fusion" in rest)
    st = trips.get("step loop", 0)
    print(f"\n## {label}\n")
    newton = (f"Newton iterations {trips['newton_solve']} "
              f"({trips['newton_solve'] / max(st, 1):.2f} per trip)"
              if trips.get("newton_solve") else
              "Newton iterations straight-line in the step (no Newton loop)")
    print(f"steps per member {steps.min()}–{steps.max()} (total {steps.sum()}); step-loop "
          f"trips {st}, {newton}; program "
          f"{prog.size()[0]} HLO instructions, {prog.size()[1]} thunks; YNNPACK fusions {ynn}")
    print(f"without the profiler: wall {1e3 * wall:.1f} ms, process time {1e3 * cpu:.1f} ms "
          f"→ {1e6 * cpu / max(st, 1):.1f} µs (CPU) per trip, "
          f"{1e6 * cpu / steps.sum():.2f} µs per member-step (load "
          f"{os.getloadavg()[0]:.1f})")
    for name, called in ps.step_loops(prog):
        if name != "step loop":
            continue
        tot = Counter()
        for c in ps.profile_loop(prog, called)["phases"].values():
            tot.update(c)
        print(f"step-loop thunks: {tot['every attempt']} every trip, "
              f"{tot['per Newton iteration']} per Newton iteration, "
              f"{tot['when taken'] + tot['per Newton iteration, when taken']} when taken")
    total = sum(by_phase.values())
    total_ops = sum(ops.values())
    print("\n| phase | thunks run per trip | µs per trip (profiled) | share | "
          "operations per trip (`element_operations`) | share |")
    print("|---|---|---|---|---|---|")
    for k, v in by_phase.most_common():
        if v < 0.002 * total:
            continue
        print(f"| {k} | {count[k] / max(st, 1):.1f} | {v / 1e3 / max(st, 1):.1f} | "
              f"{100 * v / total:.0f} % | {ops[k] / max(st, 1):.0f} | "
              f"{100 * ops[k] / max(total_ops, 1):.0f} % |")
    if top:
        print(f"\nthe {top} dearest thunks (µs per run, profiled):\n")
        for name, v in per_instr.most_common(top):
            _, phase, rest, stack = phases[name]
            print(f"- {name} ({phase}; {where(stack)}): {v / 1e3 / runs[name]:.2f} µs × "
                  f"{runs[name]}, {work.get(name, 0)} operations — {rest[:80]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=256, help="members (default 256)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--top", type=int, default=12, help="list the dearest thunks")
    ap.add_argument("--problem", choices=("robertson", "heat"), default="robertson",
                    help="heat: `large.py`'s batch row (R5 at M = 20, n = 484, one output, "
                         "the default linear solver, k in linspace(0.5, 2, n))")
    a = ap.parse_args()
    print(f"# Batched step profile — jax {jax.__version__}, {os.cpu_count()} CPUs, load "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if a.problem == "heat":
        solve, one, batch = heat_problem(a.n)
    else:
        prob = problems.robertson()
        solve = peers.daeadjoint_solve(prob)
        one, batch = jnp.asarray(prob.args), jnp.asarray(prob.batch_args(a.n))
    profile(f"unbatched solve ({a.problem})", solve, one, a.repeats, a.top)
    profile(f"jit(vmap(solve)), {a.n} members", jax.vmap(solve), batch, a.repeats, a.top)


def heat_problem(n: int):
    """`large.py`'s batch: R5 heat at M = 20 with p1 = p2 = k, the default solver."""
    import daeadjoint as dae
    import large

    M = 20
    residual, u0 = large.heat_residual(M), jnp.asarray(large.heat_u0(M))

    def solve(k):
        p = jnp.stack([k, k])
        sol = dae.solve(residual, 0.0, large.T1, u0,
                        -residual(0.0, u0, jnp.zeros_like(u0), p), p,
                        rtol=large.RTOL, atol=large.ATOL, max_steps=5000)
        return jnp.sum(sol.ys[-1] ** 2), sol.stats["num_steps"]

    return solve, jnp.asarray(1.0), jnp.linspace(0.5, 2.0, n)


if __name__ == "__main__":
    main()
