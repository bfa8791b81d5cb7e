"""Where the time of a small solve goes: one BDF step by phase, and compile time by program.

    OPENBLAS_NUM_THREADS=1 python benchmarks/profile_step.py            # ~5-15 min
    OPENBLAS_NUM_THREADS=1 python benchmarks/profile_step.py --quick    # fewer repeats
    OPENBLAS_NUM_THREADS=1 python benchmarks/profile_step.py --hessian  # + jax.hessian (slow)

Problems: Robertson (n = 3, `problems.robertson()`: 0 … 4e10, rtol 1e-6, atol
(1e-10, 1e-14, 1e-8) of IDAS's idasRoberts_dns, 12 outputs) and the 2-D heat DAE on a 7×7
grid (n = 49, `problems.heat(7)`, 11 outputs), both with the default linear solver (DenseLU).
Gradient programs: G = ∫ y3 dt (Robertson), G = ∫ Σu dt (heat) by a quadrature with
`Adjoint(atol=1e-8)`.

What is measured and how
------------------------
1. **XLA operations per step (exact).** The optimized HLO of each compiled program
   (`jax.jit(f).lower(x).compile()`, `HloModule` proto) is parsed: every instruction of a
   computation that XLA's CPU runtime executes is one *thunk* (fusions count once; their
   fused bodies are not executed separately; parameter, constant, tuple,
   get-tuple-element and bitcast are free). The step loop is the `while` issued by
   `integrate`'s outer body; its body and condition run once per step attempt, the
   loops and conditionals nested in it (Newton iteration, one-trip `maybe_update`
   loops, ...) once per trip. Thunks are attributed to phases by the Python call stack
   XLA keeps for each instruction (the module's stack-frame index: file, function and
   line of every frame) — no annotation in the library is needed.
2. **µs per step (rough under load).** (a) The whole step: the fastest warm wall time of
   the jitted solve divided by its step attempts (accepted + failed). (b) The phases:
   each phase as an isolated jitted function of a realistic mid-solve state (integrated
   to t_mid by the library's own loop), called N times in a `lax.fori_loop` whose carry
   passes through `lax.optimization_barrier` (so nothing is hoisted out of the loop),
   minus the same loop with an empty phase; the fastest of the repeats. Isolated phases run in a
   loop of their own, so the sum of the phases is not the in-loop step (different
   buffer sizes can move XLA's CPU runtime between sequential and thread-pool
   execution, see docs/performance.md). (c) Sensitivity hook: µs per attempt of the
   `jacfwd` program minus that of the forward program. (d) Backward pass: the
   `jax.vjp` backward function timed alone; its replay and adjoint step attempts
   counted in a second compilation with a host callback at the end of every backward
   `integrate` call; an adjoint attempt's µs estimated by charging each replay attempt
   the recording forward's rate.
   Inside `jax.grad` / `jax.jacfwd` XLA's metadata carries only the derivative rule's
   call site, so the loops of those programs are listed by nesting (`loop_tree`), not
   attributed to phases.
3. **Compile time by program**, split as `jax.jit(f).trace(x)` (Python tracing),
   `.lower()` (to StableHLO) and `.compile()` (XLA), with the program's size: StableHLO
   ops before optimization, HLO instructions and thunks after.

Uses internal functions of daeadjoint (`_integrator`, `_newton`, `_bdf`) for the isolated
phases; when their names change this script follows them.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import functools
import os
import platform
import re
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))                     # the working-tree daeadjoint
sys.path.insert(1, str(ROOT / "benchmarks"))
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_enable_x64", True)
# Keep every frame of an instruction's Python stack in the HLO metadata (default: the
# innermost 10, which loses `attempt_step` under the derivative rules).
jax.config.update("jax_traceback_in_locations_limit", 1000)

import daeadjoint as dae  # noqa: E402
import problems  # noqa: E402
from daeadjoint import _bdf, _integrator, _newton  # noqa: E402
from daeadjoint._derivatives import adjoint as _adjoint_mod  # noqa: E402

MAX_STEPS = 100_000


# --------------------------------------------------------------------------- problems
class Case:
    """One problem: its residual, solve, loss G and a mid-solve state for the phases."""

    def __init__(self, name, prob, t_mid, quad):
        self.name, self.prob = name, prob
        self.res = problems.jax_residual(prob)
        self.y0 = jnp.asarray(prob.y0)
        self.ts = jnp.asarray(prob.ts)
        self.atol = jnp.asarray(np.broadcast_to(prob.atol, prob.y0.shape))
        self.args = jnp.asarray(prob.args, dtype=jnp.float64)
        self.t_mid = t_mid
        self.quad = quad

    def solve(self, a, saveat=None, **kw):
        saveat = self.ts if saveat is None else saveat
        return dae.solve(self.res, self.prob.t0, self.prob.t1, self.y0,
                         self.prob.yp0(a, problems.JAX), a, saveat=saveat,
                         algebraic=self.prob.algebraic, rtol=self.prob.rtol, atol=self.atol,
                         max_steps=MAX_STEPS, **kw)

    def forward(self, a):
        sol = self.solve(a)
        return sol.ys, sol.stats

    def G(self, a):
        sol = self.solve(a, saveat=jnp.reshape(self.prob.t1, (1,)), quadrature=self.quad,
                         sensitivity=dae.Adjoint(atol=1e-8))
        return sol.qs[-1, 0]

    def final(self, a):
        sol = self.solve(a)
        return sol.ys[-1], sol.stats


def robertson() -> Case:
    return Case("Robertson (n = 3)", problems.robertson(), 40.0,
                lambda t, y, yp, p: y[2:3])


def heat() -> Case:
    return Case("heat 7×7 (n = 49)", problems.heat(7), 0.32,
                lambda t, y, yp, p: jnp.sum(y)[None])


# --------------------------------------------------------------------------- HLO parsing
def _varint(b, i):
    r = s = 0
    while True:
        x = b[i]
        i += 1
        r |= (x & 0x7F) << s
        s += 7
        if x < 0x80:
            return r, i


def _fields(b):
    """Protobuf wire-format fields of a message: [(number, value)] (no schema needed)."""
    i, out = 0, []
    while i < len(b):
        key, i = _varint(b, i)
        f, w = key >> 3, key & 7
        if w == 0:
            v, i = _varint(b, i)
        elif w == 2:
            n, i = _varint(b, i)
            v, i = b[i:i + n], i + n
        elif w == 1:
            v, i = b[i:i + 8], i + 8
        elif w == 5:
            v, i = b[i:i + 4], i + 4
        else:
            raise ValueError(f"wire type {w}")
        out.append((f, v))
    return out


def stack_frames(proto: bytes) -> dict[int, list[tuple[str, str, int]]]:
    """stack_frame_id -> [(file, function, line)], innermost first, from the
    HloModuleProto's StackFrameIndexProto (field 17: file_names 1, function_names 2,
    file_locations 3 {file 1, function 2, line 3}, stack_frames 4 {location 1,
    parent 2}; ids 1-based)."""
    index = [v for f, v in _fields(proto) if f == 17]
    if not index:
        return {}
    sub = _fields(index[0])
    files = [v.decode() for f, v in sub if f == 1]
    funcs = [v.decode() for f, v in sub if f == 2]
    locs = []
    for f, v in sub:
        if f == 3:
            d = dict(_fields(v))
            locs.append((files[d.get(1, 1) - 1], funcs[d.get(2, 1) - 1], d.get(3, 0)))
    frames = [dict(_fields(v)) for f, v in sub if f == 4]
    out = {}
    for i in range(len(frames)):
        chain, j = [], i + 1
        while j:
            fr = frames[j - 1]
            chain.append(locs[fr.get(1, 1) - 1])
            j = fr.get(2, 0)
        out[i + 1] = chain
    return out


FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast"}
_INSTR = re.compile(r"^\s*(?:ROOT )?%(\S+) = ")


def _opcode(rest: str) -> tuple[str, str]:
    """(opcode, remainder) of an instruction's text after ' = ' (type, then op(...))."""
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                rest = rest[i + 1:].lstrip()
                break
    else:
        rest = rest.split(" ", 1)[1]
    op = rest.split("(", 1)[0]
    return op, rest


def parse_hlo(text: str) -> tuple[dict, str]:
    """{computation: [(opcode, attributes text, stack_frame_id)]}, entry name."""
    comps, entry, cur = {}, None, None
    for line in text.splitlines():
        if not line.startswith(" ") and line.rstrip().endswith("{") and "(" in line:
            head = line.split("(", 1)[0].split()
            name = head[-1].lstrip("%")
            if head[0] == "ENTRY":
                entry = name
            cur = comps.setdefault(name, [])
            continue
        m = _INSTR.match(line)
        if m and cur is not None:
            op, rest = _opcode(line[m.end():])
            sf = re.search(r"stack_frame_id=(\d+)", rest)
            cur.append((op, rest, int(sf.group(1)) if sf else 0))
    return comps, entry


def _called(op, rest):
    """Computations an instruction runs as thunk sequences of their own."""
    if op == "while":
        return re.findall(r"(?:condition|body)=%([\w.\-]+)", rest)
    if op == "conditional":
        m = re.search(r"branch_computations=\{([^}]*)\}", rest)
        if m:
            return [c.strip().lstrip("%") for c in m.group(1).split(",")]
        return re.findall(r"(?:true|false)_computation=%([\w.\-]+)", rest)
    if op == "call":
        return re.findall(r"to_apply=%([\w.\-]+)", rest)
    return []


class Program:
    """A compiled program: its thunk tree and the call stack of each instruction."""

    def __init__(self, compiled):
        self.text = compiled.as_text()
        self.comps, self.entry = parse_hlo(self.text)
        try:
            proto = compiled.runtime_executable().hlo_modules()[0]
            self.frames = stack_frames(proto.as_serialized_hlo_module_proto())
        except Exception:  # noqa: BLE001 - attribution is optional
            self.frames = {}

    def size(self):
        instrs = sum(len(v) for v in self.comps.values())
        return instrs, self.thunks(self.entry)

    def thunks(self, comp, seen=None) -> int:
        """Thunks of a computation and everything it runs (each nested sequence once)."""
        total = 0
        for op, rest, _ in self.comps.get(comp, ()):
            if op in FREE:
                continue
            total += 1
            for c in _called(op, rest):
                total += self.thunks(c)
        return total

    def composition(self) -> Counter:
        """Non-free instructions of the whole module (fused bodies included) by region
        (`region_of`): what the compiler works through."""
        out = Counter()
        for instrs in self.comps.values():
            for op, _, sf in instrs:
                if op not in FREE:
                    out[region_of(self.funcs(sf))] += 1
        return out

    def funcs(self, sf):
        return self.frames.get(sf, [])

    def loops(self, comp=None, depth=0, path=()):
        """[(depth, while/conditional instr, stack, [direct body+cond comps])]."""
        comp = comp or self.entry
        out = []
        for op, rest, sf in self.comps.get(comp, ()):
            called = _called(op, rest)
            if op in ("while", "conditional") and called:
                out.append((depth, op, sf, called))
                for c in called:
                    out += self.loops(c, depth + 1)
            elif op == "call":
                for c in called:
                    out += self.loops(c, depth)
        return out

    def direct(self, comps):
        """Non-free instructions directly in these computations (nested runs excluded)."""
        return [(op, rest, sf) for c in comps for op, rest, sf in self.comps.get(c, ())
                if op not in FREE]

    def subtree(self, comps):
        """[(instr, nesting depth below comps)] over comps and all nested sequences."""
        out = []

        def walk(cs, d):
            for c in cs:
                for op, rest, sf in self.comps.get(c, ()):
                    if op in FREE:
                        continue
                    out.append(((op, rest, sf), d))
                    walk(_called(op, rest), d + 1)

        walk(comps, 0)
        return out


# --------------------------------------------------------------------------- attribution
def _is_lib(path: str) -> bool:
    return "/daeadjoint/" in path


@functools.cache
def _attempt_sections() -> list[tuple[int, str]]:
    """(first line, section) of `attempt_step_part` (which `attempt_step` calls, and
    the batched step loop directly), from its '# --- name' comments."""
    src = Path(_integrator.__file__).read_text().splitlines()
    tree = ast.parse("\n".join(src))
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)
              and n.name == "attempt_step_part")
    names = {"newton": "Newton (control)", "corrector": "Newton (control)",
             "quadratures": "quadratures",
             "forward sensitivities": "sensitivity hook", "local error test": "error test",
             "error test": "error test", "accepted": "step/order selection",
             "rejected": "failure handling", "assemble": "state assembly and select",
             "the two outcomes": "state assembly and select"}
    out = [(fn.lineno, "predictor")]
    for i in range(fn.lineno, fn.end_lineno or fn.lineno):
        m = re.match(r"\s*# --- (.+?)\s*-*\s*$", src[i - 1])
        if m:
            key = m.group(1).strip().lower()
            label = next((v for k, v in names.items() if key.startswith(k)), key)
            out.append((i, label))
    return out


# A step attempt's functions: `attempt_step`, or `attempt_step_part`, which it calls and
# which the batched step loop (`_integrate_flat`) calls directly. Matching the first
# alone put everything of a batched attempt outside the predictor and the Newton
# iteration under "loop control" (`_integrate_flat`'s).
ATTEMPT = {"attempt_step", "attempt_step_part"}


def _short(fn: str) -> str:
    """'integrate.<locals>.outer_body' -> 'outer_body'."""
    return fn.rsplit(".", 1)[-1]


def phase_of(stack) -> str:
    """The phase of an instruction from its Python call stack (innermost first)."""
    funcs = [(Path(f).name, _short(fn), line) for f, fn, line in stack]
    names = {fn for _, fn, _ in funcs}
    files = {f for f, _, _ in funcs}
    paths = [f for f, _, _ in stack]
    if not stack:
        return "copies XLA inserted (no source)"
    if "_ops.py" in files and names & {"pack", "unpack"}:
        # `_ops.packed_while_loop`: the carry's scalars into and out of their vectors.
        return "packing the carry's scalars"
    if names & {"write_outputs", "write_output_rows"}:
        return "output writing"
    if "_events.py" in files:
        return "event hook"
    if "forward_sensitivity.py" in files:
        return "sensitivity hook"
    if names & {"_write_step", "_write_slot"} or (
            "record" in names and not names & ATTEMPT):
        return "recorders (checkpoints, step buffers)"
    if "restart_at_breakpoint" in names:
        return "breakpoint restart"
    if "newton_solve" in names:
        in_setup = "setup" in names or "maybe_update" in names
        user = not _is_lib(paths[0])   # the model's own code (jax's frames are dropped)
        linalg = any("/_linalg/" in p for p in paths)
        if in_setup and (user or linalg):
            return "Jacobian + LU (setup)"
        if linalg:
            return "linear solve"
        if user:
            return "residual evaluation"
        return "Newton (control)"
    if names & {"complete_history"}:
        return "history update"
    # The parts of an attempt by the function computing them (the sections of
    # `attempt_step` are coarser).
    in_attempt = bool(names & ATTEMPT)
    if in_attempt and names & {"error_test", "error_norm"}:
        return "error test"
    if in_attempt and "select_order_and_step" in names:
        return "step/order selection"
    if in_attempt and "handle_failure" in names:
        return "failure handling"
    if in_attempt and names & {"updated_stats", "status"}:
        return "counters and status"
    if in_attempt and "tree_where" in names:
        return "state assembly and select"
    if names & {"set_coefficients", "scale_history", "predict"}:
        return "predictor"
    for f, fn, line in stack:
        if _short(fn) in ATTEMPT and f.endswith("_integrator.py"):
            label = "predictor"
            for start, sec in _attempt_sections():
                if line >= start:
                    label = sec
            return label
    if "_integrate_flat" in names and names & {"tree_where", "stacked"}:
        # The batched loop's select of the attempt's state or the one it kept (members
        # done or with a Newton iteration pending), into which XLA fuses the attempt's
        # own select of the accepted or rejected state and most of what feeds it.
        return "state assembly and select"
    if "_closures.py" in files and "flat_fn" in names:
        # A function traced once and replayed from its jaxpr (`_closures._record`: the
        # residual): the stack is that of its first trace.
        return "residual evaluation"
    if "_step_status" in names:
        return "counters and status"
    if names & {"step_body", "step_cond", "_integrate_flat"}:
        return "loop control"
    return "other: " + next((_short(fn) for f, fn, _ in stack if _is_lib(f)), stack[0][1])


REGIONS = ["forward steps", "replay steps", "adjoint steps", "output writing",
           "initial values", "derivative set-up (outside steps)", "other", "no source"]


def region_of(stack) -> str:
    """The part of a program an instruction belongs to, from its call stack."""
    if not stack:
        return "no source"
    names = {_short(fn) for f, fn, _ in stack if _is_lib(f)}
    files = {Path(f).name for f, _, _ in stack if _is_lib(f)}
    if names & ATTEMPT:
        if "replay_segment" in names:
            return "replay steps"
        if "adjoint.py" in files or "discrete_adjoint.py" in files:
            return "adjoint steps"
        return "forward steps"
    if names & {"write_outputs", "write_output_rows"}:
        return "output writing"
    if files & {"_consistency.py", "_initialization.py"}:
        return "initial values"
    if files & {"adjoint.py", "discrete_adjoint.py", "autodiff.py", "tangents.py",
                "forward_sensitivity.py", "augmented.py", "batching.py"}:
        return "derivative set-up (outside steps)"
    return "other"


def model_copies(prog: Program) -> int:
    """Instructions whose innermost frame is the model's residual (copies of its trace,
    in every residual and Jacobian evaluation of the program)."""
    n = 0
    for instrs in prog.comps.values():
        for op, _, sf in instrs:
            st = prog.funcs(sf)
            if op not in FREE and st and not _is_lib(st[0][0]) and "problems.py" in st[0][0]:
                n += 1
    return n


def loop_name(prog: Program, sf) -> str:
    """A while/conditional named by the innermost daeadjoint function issuing it."""
    stack = prog.funcs(sf)
    # Not the frames of `_ops.packed_while_loop` / `packed_cond`, which issue the loops
    # for their callers.
    names = [_short(fn) for f, fn, _ in stack if _is_lib(f) and not f.endswith("_ops.py")]
    if not names:
        return "?"
    head = names[0]
    # The nested loops' outer loop, or the flat loop of a batched solve (`integrate`).
    if head in ("outer_body", "_integrate_flat") and "integrate" in names:
        if "replay_segment" in names:
            return "replay step loop"
        if "integrate_segment" in names:
            return "adjoint step loop"
        return "step loop"
    return head


def step_loops(prog: Program) -> list:
    """The step loops of a program: [(name, direct comps, instr)]."""
    out = []
    for _, op, sf, called in prog.loops():
        if op == "while":
            name = loop_name(prog, sf)
            if name.endswith("step loop"):
                out.append((name, called))
    return out


def loop_tree(prog: Program) -> list[str]:
    """Every while/conditional of a program with its thunks per run (directly, and with
    everything nested). Inside `jax.grad` / `jax.jacfwd` the instructions carry the stack
    of the derivative rule's call site only, so loops there are known by their nesting:
    a step loop holds the Newton loop, which holds the one-trip `maybe_update` loops."""
    lines = []
    for depth, op, sf, called in prog.loops():
        direct = len(prog.direct(called))
        total = sum(1 for _ in prog.subtree(called))
        lines.append(f"{'  ' * depth}- {op} `{loop_name(prog, sf)}`: {direct} thunks per run "
                     f"({total} with nested)")
    return lines


def profile_loop(prog: Program, called) -> dict:
    """Per-phase thunks of a step loop: run every attempt (body + condition), per Newton
    iteration, and in other nested sequences (run only when taken)."""
    per = defaultdict(lambda: Counter())
    nested = []

    def walk(comps, where):
        for c in comps:
            for op, rest, sf in prog.comps.get(c, ()):
                if op in FREE:
                    continue
                stack = prog.funcs(sf)
                # Instructions without a Python stack: XLA's copies, and fusions XLA
                # made of ops it created itself (e.g. a cumulative sum's reduce-window).
                phase = (phase_of(stack) if stack or op == "copy"
                         else "other XLA operations (no source)")
                per[phase][where] += 1
                sub = _called(op, rest)
                if sub:
                    name = loop_name(prog, sf)
                    if op == "while" and name == "newton_solve":
                        w = "per Newton iteration"
                    elif where == "per Newton iteration":
                        w = "per Newton iteration, when taken"
                    else:
                        w = "when taken"
                    nested.append((op, name, w, len(prog.direct(sub)),
                                   sum(1 for _ in prog.subtree(sub))))
                    walk(sub, w)

    walk(called, "every attempt")
    return dict(phases=per, nested=nested)


# --------------------------------------------------------------------------- timing
def _timed(fn, *a):
    t = time.perf_counter()
    out = fn(*a)
    return time.perf_counter() - t, out


def compile_program(fn, *x, compile=True):
    """(trace s, lower s, compile s, StableHLO ops, Program, compiled); with
    compile=False only traced and lowered (compile s and the HLO counts are None)."""
    jax.clear_caches()   # each program traced from scratch (inner jits are cached)
    jitted = jax.jit(fn)
    t_trace, traced = _timed(jitted.trace, *x)
    t_lower, lowered = _timed(traced.lower)
    shlo = sum(1 for line in lowered.as_text().splitlines()
               if re.search(r"\b(stablehlo|chlo|mhlo)\.\w+", line))
    if not compile:
        return dict(trace=t_trace, lower=t_lower, compile=None, stablehlo=shlo, regions={},
                    model=None), None, None
    t_comp, compiled = _timed(lowered.compile)
    prog = Program(compiled)
    return dict(trace=t_trace, lower=t_lower, compile=t_comp, stablehlo=shlo,
                regions=prog.composition(), model=model_copies(prog)), prog, compiled


def wall(compiled, *x, repeats=5):
    """Fastest of `repeats` warm calls: on a shared machine the minimum is the estimate
    least disturbed by other processes (medians moved 3x between runs here)."""
    jax.block_until_ready(compiled(*x))
    return min(_timed(lambda: jax.block_until_ready(compiled(*x)))[0] for _ in range(repeats))


def attempts(stats) -> int:
    return int(stats["num_steps"] + stats["num_error_test_failures"]
               + stats["num_nonlinear_convergence_failures"])


def per_call_us(phase, x, n_iter, repeats):
    """µs per call of `phase(x)` in a fori_loop, minus the empty loop (see docstring)."""
    def make(f):
        def loop(x):
            def body(i, c):
                xb, acc = c
                xb = jax.lax.optimization_barrier(xb)
                out = f(xb)
                # Every output feeds one reduction (XLA fuses it into one kernel), so
                # that nothing is dead code and the harness adds few thunks.
                flat = [jnp.ravel(v).astype(jnp.float64) for v in jax.tree_util.tree_leaves(out)
                        if jnp.issubdtype(jnp.result_type(v), jnp.number)]
                return xb, acc + jnp.sum(jnp.concatenate(flat))
            return jax.lax.fori_loop(0, n_iter, body, (x, jnp.zeros((), jnp.float64)))[1]
        return jax.jit(loop).lower(x).compile()

    full, empty = make(phase), make(lambda xb: jnp.zeros(()))
    t_full = wall(full, x, repeats=repeats)
    t_empty = wall(empty, x, repeats=repeats)
    return max(t_full - t_empty, 0.0) / n_iter * 1e6


def mid_state(case: Case):
    """(Problem, State) of the library's own loop, integrated from t0 to t_mid."""
    from daeadjoint._linalg.sparse import default_linear_solver
    p = case.args
    yp0 = case.prob.yp0(p, problems.JAX)
    ls = default_linear_solver(case.res, case.prob.t0, case.y0, yp0, p)
    n = case.y0.shape[0]
    dtype = case.y0.dtype
    problem = _integrator.Problem(
        residual=case.res, quadrature=None, linear_solver=ls, args=p,
        rtol=jnp.asarray(case.prob.rtol, dtype), atol=case.atol, error_mask=jnp.ones(n, dtype),
        quad_rtol=jnp.asarray(case.prob.rtol, dtype), quad_atol=jnp.zeros((0,), dtype),
        quad_error_control=False, tstop=jnp.asarray(jnp.inf, dtype))

    @jax.jit
    def run(p):
        prob = problem
        t_first = case.ts[0]
        h0 = _integrator.initial_step(prob, case.prob.t0, case.y0, yp0, jnp.zeros((0,), dtype),
                                      t_first)
        s = _integrator.initial_state(prob, case.prob.t0, case.y0, yp0, h0)
        out = _integrator.Outputs.create(jnp.zeros((0,), dtype), n, 0, 0, 2, dtype)
        s, _, _, _ = _integrator.integrate(prob, s, out, case.t_mid, MAX_STEPS)
        return s

    return problem, run(p)


def phase_timings(case: Case, n_iter: int, repeats: int) -> dict:
    problem, s = mid_state(case)
    dtype = s.phi.dtype
    ls, res, args = problem.linear_solver, problem.residual, problem.args

    def coefficients(s):
        return _bdf.set_coefficients(s.psi, s.h, s.k, s.k_used, s.h_used, s.ns, dtype)

    def predictor(s):
        co = coefficients(s)
        hist = _bdf.scale_history(s.phi, co.beta, co.ns, s.k)
        return _bdf.predict(hist, co.gamma, s.k), hist, co

    def newton_inputs(s):
        (y, yp), hist, co = predictor(s)
        ewt = _bdf.error_weights(s.phi[0], problem.rtol, problem.atol)
        return y, yp, co.cj, ewt, hist, co

    def newton(s, setup=False):
        y, yp, cj, ewt, _, _ = newton_inputs(s)
        return _newton.newton_solve(res, args, ls, s.t + s.h, y, yp, cj, ewt, s.lin_state,
                                    s.jac_point, s.cj_old, s.ss, jnp.asarray(setup))

    def error_test(s):
        y, _, _, ewt, hist, co = newton_inputs(s)
        ee = jnp.full_like(y, 1e-9)
        k = s.k
        e = [_bdf.wrms(ee, ewt)]
        d1 = _bdf.history_row(hist, k) + ee
        d2 = d1 + _bdf.history_row(hist, k - 1)
        e += [_bdf.wrms(d1, ewt), _bdf.wrms(d2, ewt),
              _bdf.wrms(ee - _bdf.history_row(hist, k + 1), ewt)]
        return jnp.stack(e) * co.sigma[jnp.clip(k, 0, 5)]

    def history(s):
        y, _, _, _, hist, _ = newton_inputs(s)
        return _bdf.complete_history(hist, jnp.full_like(y, 1e-9), s.k)

    y_p, yp_p, cj_p, ewt_p = jax.jit(lambda s: newton_inputs(s)[:4])(s)
    g_p = jax.jit(res)(s.t + s.h, y_p, yp_p, args)
    outputs = _integrator.Outputs.create(jnp.full((4,), jnp.inf, dtype), s.phi.shape[1], 0, 0,
                                         2, dtype)
    phases = {
        "predictor (coefficients, rescale, predict)": (predictor, s),
        "residual evaluation (1 call)": (lambda x: res(x[0], x[1], x[2], args),
                                         (s.t + s.h, y_p, yp_p)),
        "Jacobian + LU (setup, 1 call)": (lambda x: ls.setup(res, x[0], x[1], x[2], x[3], args),
                                           (s.t + s.h, y_p, yp_p, cj_p)),
        "linear solve (1 call)": (lambda x: ls.solve(x[0], -x[1], weights=x[2])[0],
                                  (s.lin_state, g_p, ewt_p)),
        "Newton iteration, whole (no setup)": (newton, s),
        "Newton with J setup": (lambda s: newton(s, True), s),
        "error test (4 norms)": (error_test, s),
        "history update": (history, s),
        "output check (nothing due)": (lambda x: _integrator.write_outputs(x[0], x[1]),
                                       (s, outputs)),
        "whole attempt (attempt_step)": (lambda s: _integrator.attempt_step(problem, s), s),
    }
    out = {}
    for name, (f, x) in phases.items():
        out[name] = per_call_us(f, x, n_iter, repeats)
    nw = jax.jit(newton)(s)
    out["_newton_iters"] = int(nw.num_iters)
    return out


# --------------------------------------------------------------------------- backward
class BackwardCounter:
    """Counts the replay and adjoint step attempts of a backward pass through a host
    callback at the end of every `integrate` call in it (a separate compilation: the
    callbacks are not in the timed program)."""

    def __init__(self):
        self.counts = Counter()
        self.orig = _adjoint_mod.integrate

    def __enter__(self):
        orig, counts = self.orig, self.counts

        def host(kind, n):
            counts["adjoint" if int(kind) else "replay"] += int(n)

        def counting(problem, state, outputs, t_end, max_steps, recorders=(), events=None,
                     until=None):
            out = orig(problem, state, outputs, t_end, max_steps, recorders, events, until)
            s = out[0]
            n = sum(s.stats[k] - state.stats[k] for k in
                    ("num_steps", "num_error_test_failures",
                     "num_nonlinear_convergence_failures"))
            # The adjoint DAE is the problem solved with a fresh Newton rate each step.
            jax.debug.callback(host, int(problem.reset_newton_rate), n)
            return out

        _adjoint_mod.integrate = counting
        return self

    def __exit__(self, *exc):
        _adjoint_mod.integrate = self.orig


# --------------------------------------------------------------------------- report
def fmt_us(x):
    return f"{x:.2f}" if x < 10 else f"{x:.1f}" if x < 100 else f"{x:.0f}"


def profile_case(case: Case, args_ns) -> dict:
    a = case.args
    out = dict(name=case.name, programs={})
    batch = 16 if args_ns.quick else 256
    reps = 3 if args_ns.quick else 7
    # forward
    ct, prog_f, comp_f = compile_program(case.forward, a)
    out["programs"]["forward"] = (ct, prog_f.size())
    _, stats = comp_f(a)
    out["stats"] = {k: int(v) for k, v in stats.items() if k != "t_final"}
    out["fwd_ms"] = wall(comp_f, a, repeats=reps) * 1e3
    out["fwd_attempts"] = attempts(stats)
    out["fwd_loops"] = {name: profile_loop(prog_f, called) for name, called in step_loops(prog_f)}
    # the backward pass alone: vjp's forward (recording) part and its backward function
    ct, prog_r, comp_r = compile_program(lambda p: jax.vjp(case.G, p), a)
    out["programs"]["grad: forward part (records)"] = (ct, prog_r.size())
    val, vjp_fn = comp_r(a)
    one = jnp.ones_like(val)
    ct, prog_b, comp_b = compile_program(lambda f, c: f(c), vjp_fn, one)
    out["programs"]["grad: backward part (replay + adjoint)"] = (ct, prog_b.size())
    out["rec_ms"] = wall(comp_r, a, repeats=reps) * 1e3
    out["bwd_ms"] = wall(comp_b, vjp_fn, one, repeats=reps) * 1e3
    out["bwd_loops"] = {name: profile_loop(prog_b, called) for name, called in step_loops(prog_b)}
    out["bwd_tree"] = loop_tree(prog_b)
    with BackwardCounter() as counter:
        jax.clear_caches()
        jax.block_until_ready(jax.jit(lambda f, c: f(c))(vjp_fn, one))
        out["bwd_counts"] = dict(counter.counts)
    # the whole gradient, jacfwd (the sensitivity hook), vmap, vmap(grad)
    ct, prog_g, comp_g = compile_program(jax.grad(case.G), a)
    out["programs"]["grad"] = (ct, prog_g.size())
    out["grad_ms"] = wall(comp_g, a, repeats=reps) * 1e3
    ct, prog_j, comp_j = compile_program(jax.jacfwd(case.final, has_aux=True), a)
    out["programs"]["jacfwd (forward sensitivities)"] = (ct, prog_j.size())
    _, jstats = comp_j(a)
    out["jac_ms"] = wall(comp_j, a, repeats=reps) * 1e3
    out["jac_attempts"] = attempts(jstats)
    out["jac_loops"] = {name: profile_loop(prog_j, called) for name, called in step_loops(prog_j)}
    out["jac_tree"] = loop_tree(prog_j)
    ab = jnp.broadcast_to(a, (batch,) + a.shape) * jnp.linspace(0.9, 1.1, batch)[:, None]
    ct, prog_v, _ = compile_program(jax.vmap(case.forward), ab)
    out["programs"][f"vmap (batch {batch})"] = (ct, prog_v.size())
    ct, prog_vg, _ = compile_program(jax.vmap(jax.grad(case.G)), ab)
    out["programs"][f"vmap(grad) (batch {batch})"] = (ct, prog_vg.size())
    # jax.hessian: traced and lowered always, compiled (minutes) with --hessian
    ct, prog_h, _ = compile_program(jax.hessian(case.G), a, compile=args_ns.hessian)
    out["programs"]["hessian"] = (ct, prog_h.size() if prog_h else (None, None))
    # isolated phases
    out["phases_us"] = phase_timings(case, 200 if args_ns.quick else 500, reps)
    return out


PHASE_ORDER = ["predictor", "residual evaluation", "Jacobian + LU (setup)", "linear solve",
               "Newton (control)", "sensitivity hook", "quadratures", "error test",
               "step/order selection", "failure handling", "counters and status",
               "history update", "state assembly and select", "output writing", "event hook",
               "recorders (checkpoints, step buffers)", "loop control"]


def print_loop(title, prof):
    per = prof["phases"]
    cols = ["every attempt", "per Newton iteration", "when taken",
            "per Newton iteration, when taken"]
    print(f"\n{title}: thunks by phase\n")
    print("| phase | every attempt | per Newton iteration | in nested runs when taken |")
    print("|---|---|---|---|")
    keys = [k for k in PHASE_ORDER if k in per] + sorted(k for k in per if k not in PHASE_ORDER)
    tot = Counter()
    for k in keys:
        c = per[k]
        tot.update(c)
        print(f"| {k} | {c[cols[0]]} | {c[cols[1]]} | {c[cols[2]] + c[cols[3]]} |")
    print(f"| **total** | **{tot[cols[0]]}** | **{tot[cols[1]]}** | "
          f"**{tot[cols[2]] + tot[cols[3]]}** |")
    print("\nnested sequences (op, issued by, runs, thunks directly / with their own nested):")
    for op, name, where, d, total in prof["nested"]:
        print(f"- {op} `{name}` ({where}): {d} / {total}")


def report(results, args_ns):
    print(f"# Per-step profile — {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC\n")
    print(f"{platform.machine()} {os.cpu_count()} CPUs, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; jax {jax.__version__}; "
          f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS')}\n")
    for r in results:
        st = r["stats"]
        print(f"\n## {r['name']}\n")
        print(f"forward: {r['fwd_ms']:.2f} ms, {st['num_steps']} steps, {r['fwd_attempts']} "
              f"attempts, {st['num_residual_evals']} residual evals, "
              f"{st['num_jacobian_evals']} Jacobians → "
              f"**{r['fwd_ms'] * 1e3 / r['fwd_attempts']:.2f} µs per attempt**")
        print(f"jacfwd ({r['jac_attempts']} attempts): {r['jac_ms']:.2f} ms → "
              f"{r['jac_ms'] * 1e3 / r['jac_attempts']:.2f} µs per attempt; sensitivity hook "
              f"≈ {r['jac_ms'] * 1e3 / r['jac_attempts'] - r['fwd_ms'] * 1e3 / r['fwd_attempts']:.2f}"
              " µs per attempt")
        nr, na = r["bwd_counts"].get("replay", 0), r["bwd_counts"].get("adjoint", 0)
        rec_us = r["rec_ms"] * 1e3 / r["fwd_attempts"]
        adj_us = (r["bwd_ms"] * 1e3 - nr * rec_us) / max(na, 1)
        print(f"gradient: {r['grad_ms']:.2f} ms = recording forward {r['rec_ms']:.2f} ms "
              f"({rec_us:.2f} µs per attempt) + backward {r['bwd_ms']:.2f} ms: {nr} replay "
              f"attempts, {na} adjoint attempts → {r['bwd_ms'] * 1e3 / max(nr + na, 1):.2f} µs "
              f"per backward attempt; taking a replay attempt to cost a recording one, "
              f"**~{adj_us:.1f} µs per adjoint attempt**")
        ph = r["phases_us"]
        print("\nisolated phases, µs per call at a mid-solve state "
              f"(the Newton iteration took {ph['_newton_iters']} iterations there):\n")
        print("| phase | µs |")
        print("|---|---|")
        for k, v in ph.items():
            if not k.startswith("_"):
                print(f"| {k} | {fmt_us(v)} |")
        for title, loops in (("forward", r["fwd_loops"]), ("jacfwd", r["jac_loops"]),
                             ("backward", r["bwd_loops"])):
            for name, prof in loops.items():
                print_loop(f"{title} — {name}", prof)
        for title, key in (("jacfwd", "jac_tree"), ("backward pass of grad", "bwd_tree")):
            print(f"\nloops of the {title} program:\n")
            print("\n".join(r[key]))
        print("\ncompile time by program (s) and size:\n")
        print("| program | trace | lower | XLA compile | total | StableHLO ops | "
              "HLO instructions | thunks |")
        print("|---|---|---|---|---|---|---|---|")
        for name, (ct, (instrs, thunks)) in r["programs"].items():
            if ct["compile"] is None:
                print(f"| {name} | {ct['trace']:.2f} | {ct['lower']:.2f} | not compiled "
                      f"(--hessian) | – | {ct['stablehlo']} | – | – |")
                continue
            total = ct["trace"] + ct["lower"] + ct["compile"]
            print(f"| {name} | {ct['trace']:.2f} | {ct['lower']:.2f} | {ct['compile']:.2f} | "
                  f"{total:.2f} | {ct['stablehlo']} | {instrs} | {thunks} |")
        print("\nHLO instructions by region (fused bodies included; 'model' = instructions "
              "of the model's residual, all its copies):\n")
        print("| program | " + " | ".join(REGIONS) + " | model |")
        print("|---" * (len(REGIONS) + 2) + "|")
        for name, (ct, _) in r["programs"].items():
            reg = ct["regions"]
            if ct["model"] is None:
                continue
            print(f"| {name} | " + " | ".join(str(reg.get(k, 0)) for k in REGIONS)
                  + f" | {ct['model']} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats, batch 16")
    ap.add_argument("--hessian", action="store_true", help="also compile jax.hessian(G)")
    ap.add_argument("--only", choices=["robertson", "heat"], default=None)
    a = ap.parse_args()
    cases = [c() for name, c in (("robertson", robertson), ("heat", heat))
             if a.only in (None, name)]
    report([profile_case(c, a) for c in cases], a)


if __name__ == "__main__":
    main()
