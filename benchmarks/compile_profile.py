"""Where the compile time of a solve goes: by program, by phase of JAX and XLA, by piece.

    OPENBLAS_NUM_THREADS=1 python benchmarks/compile_profile.py              # ~3-6 min
    OPENBLAS_NUM_THREADS=1 python benchmarks/compile_profile.py --hessian    # + jax.hessian
    python benchmarks/compile_profile.py --programs grad grad_nofallback    # some programs
    python benchmarks/compile_profile.py --cache                            # + a second process
    python benchmarks/compile_profile.py --tree /tmp/old                    # another checkout
    python benchmarks/compile_profile.py --lower-only --programs vmap_grad  # JAX's part only
    python benchmarks/compile_profile.py --census --programs grad           # kernels by phase

Every program is compiled in a fresh Python process (nothing cached in memory or on
disk), as a user's first call: Robertson (`problems.robertson()`, 0 … 4e10, 12 outputs,
rtol 1e-6, IDAS's atol) as in `profile_step.py`; the gradient of G = ∫ y3 dt with
`Adjoint(atol=1e-8)`; batches of 16; the Hessian of the 6-parameter index-1 kinetics loss
of `derivatives.py` part b. For each program:

- **trace / lower / XLA** wall seconds: `jax.jit(f).trace(x)` (Python tracing),
  `.lower()` (to StableHLO; equinox's primitives trace their implementation again here)
  and `.compile()` (XLA), and the first call's wall time as a user sees it (all three
  plus the run);
- XLA's compile split from its own log (`TF_CPP_VMODULE`, timestamps of the main
  module's lines): **HLO passes** (the optimization pipeline: simplification, while-loop
  passes, fusion, ...), **emit** (thunks and each kernel's LLVM IR: the fusion emitters)
  and **LLVM** (machine code of the kernels), and the slowest HLO passes; and XLA's CPU
  seconds (all its threads), which other processes on the machine disturb far less
  than its wall time;
- the program's size: StableHLO operations, HLO instructions after optimization (fused
  bodies included) and its kernels (`fusion` instructions), and how often the model's
  residual was traced.

`--cache` also runs each program in a second pair of processes with JAX's persistent
compilation cache on (`jax_compilation_cache_dir` in a fresh temporary directory,
`jax_persistent_cache_min_compile_time_secs` 0, `EQX_ON_ERROR=nan`, see
docs/performance.md): the first fills the cache, the second's first call is timed (split
into tracing, lowering, XLA or the cache's read, and the run), and
the number of programs the second one compiled is counted (`jax_log_compiles`; zero means
every program came from the cache).

`--lower-only` stops after `.lower()` (no XLA) and reports, besides the trace and lower
seconds, how many jaxprs JAX batched (misses of its cache of batched jaxprs: each is one
more batching of a loop body, a branch or a primitive's rules under `vmap`) and how many
times a while loop's batching rule ran, in tracing and in lowering: the counts do not
depend on the machine's load.

`--census` compiles each program once more with the solver's pieces labelled (each
wrapped in a `jax.named_scope` by this script, which changes the program's metadata
only) and counts the optimized program's kernels (`fusion`s), thunks (the instructions
of the computations that are not fused bodies nor the scalar functions of reductions,
scatters and sorts: all but parameters, constants, tuples, get-tuple-elements and
bitcasts; the copies XLA inserts into loops among them) and HLO instructions (fused
bodies included) by phase. An instruction's phase is the path of labels in its
`op_name` (a fusion's is its root's): the second-order term it belongs to, if any
(`hessian_total`, `hessian`: the augmented DAE's solves), the outermost run (`forward`,
`tangent`, `fused`: the state with its sensitivities in one run, as under `jacfwd`,
`backward`, ...) then the innermost of the backward pass's pieces (`replay`,
`adjoint_steps`, `restart`, `at_t0`, `fallback` ...) and the innermost of the shared ones
(`newton`, `jac_setup`, `consistency`, `outputs`, `step`, `sens_corrector`); "(other)" is
what carries no label (XLA's copies, the code around the solve). The labels are listed
in `CENSUS`. With `DAE_CENSUS_DUMP=DIR` each program's optimized HLO text is written to
DIR/PROGRAM.hlo.txt, to read a piece's instructions by hand.

`--tree PATH` runs the same measurements on the daeadjoint of another checkout (e.g.
`git archive main | tar -x -C /tmp/old`), so that two versions can be compared with one
script; run both versions interleaved on a busy machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROGRAMS = ["forward", "grad", "grad_nofallback", "jacfwd", "vmap", "vmap_grad"]
SLOW = ["hessian"]
BATCH = 16

# --census: (module, function or Class.method, label). Outer phases, then the backward
# pass's pieces, then pieces shared by several phases. A label path is reported as
# "outer > piece > shared" (the innermost of each group).
CENSUS = [
    ("daeadjoint._core", "run_forward", "forward"),
    ("daeadjoint._core", "run_tangent", "tangent"),
    ("daeadjoint._core", "run", "fused"),
    ("daeadjoint._derivatives.autodiff", "_hessian_total_value", "hessian_total"),
    ("daeadjoint._derivatives.autodiff", "_hessian_value", "hessian"),
    ("daeadjoint._consistency", "consistent_values", "init"),
    ("daeadjoint._consistency", "initial_sensitivities", "init"),
    ("daeadjoint._derivatives.adjoint", "backward", "backward"),
    ("daeadjoint._derivatives.discrete_adjoint", "discrete_backward", "backward"),
    ("daeadjoint._derivatives.adjoint", "replay_segment", "replay"),
    ("daeadjoint._derivatives.adjoint", "integrate_segment", "adjoint_steps"),
    ("daeadjoint._derivatives.adjoint", "observe", "restart"),
    ("daeadjoint._derivatives.adjoint", "at_t0", "at_t0"),
    ("daeadjoint._derivatives.adjoint", "singular_at_t0", "at_t0_check"),
    ("daeadjoint._events", "observations", "observations"),
    ("daeadjoint._derivatives.discrete_adjoint", "sweep_setup", "fallback"),
    ("daeadjoint._derivatives.discrete_adjoint", "replayed_steps", "fallback"),
    ("daeadjoint._derivatives.discrete_adjoint", "discrete_segment", "fallback"),
    ("daeadjoint._derivatives.discrete_adjoint", "initial_value_tangents", "fallback"),
    ("daeadjoint._derivatives.discrete_adjoint", "zero_bars", "fallback"),
    ("daeadjoint._newton", "newton_solve", "newton"),
    ("daeadjoint._newton", "setup_linear", "jac_setup"),
    ("daeadjoint._consistency", "consistency_solve", "consistency"),
    ("daeadjoint._consistency", "split_at", "consistency"),
    ("daeadjoint._integrator", "attempt_step_part", "step"),
    ("daeadjoint._integrator", "correct_sensitivities", "sens_corrector"),
    ("daeadjoint._derivatives.forward_sensitivity", "sensitivity_corrector", "sens_corrector"),
    ("daeadjoint._derivatives.forward_sensitivity", "quadrature_sensitivities", "sens_quad"),
    ("daeadjoint._integrator", "write_outputs", "outputs"),
    ("daeadjoint._integrator", "write_output_rows", "outputs"),
]
# Second-order terms (forward over adjoint): a prefix to the rest of the path. `fused` is
# `_core.run` itself: the state with its sensitivities in one run (`jacfwd`), or inside
# `forward`/`tangent`, which name it.
SECOND = ["hessian_total", "hessian"]
OUTER = ["forward", "tangent", "fused", "init", "backward"]
PIECES = ["replay", "adjoint_steps", "restart", "at_t0", "at_t0_check", "observations",
          "fallback"]


def label_pieces():
    """Wrap each function of CENSUS in a `jax.named_scope` of its label, wherever the
    package refers to it (modules that imported it by name included)."""
    import functools
    import importlib

    import jax

    for mod_name, name, label in CENSUS:
        mod = importlib.import_module(mod_name)
        cls, _, meth = name.rpartition(".")
        owner = getattr(mod, cls) if cls else mod
        f = getattr(owner, meth, None)
        if f is None:          # a piece this version (`--tree`) does not have
            continue

        def scoped(*a, _f=f, _label=label, **kw):
            with jax.named_scope(f"DAE_{_label}"):
                return _f(*a, **kw)

        functools.update_wrapper(scoped, f)
        for m in list(sys.modules.values()):
            if getattr(m, "__name__", "").startswith("daeadjoint"):
                for k, v in list(vars(m).items()):
                    if v is f:
                        setattr(m, k, scoped)
        if cls:
            setattr(owner, meth, scoped)


def census(text: str) -> dict:
    """{phase: [kernels, thunks, HLO instructions]} of an optimized HLO module's text."""
    free = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast"}
    # Computations that run inside one thunk: fused bodies, and the scalar functions
    # of reductions, scatters and sorts.
    fused = set(re.findall(r"kind=k\w+, calls=(%[\w.\-]+)", text))
    fused |= set(re.findall(r"(?:to_apply|comparator)=(%[\w.\-]+)", text))
    out: dict = {}
    in_fused = False
    for ln in text.splitlines():
        head = re.match(r"^(ENTRY )?(%[\w.\-]+) .*\{$", ln)
        if head:
            in_fused = head[2] in fused
            continue
        m = re.match(r"\s*(ROOT )?%\S+ = .*?([a-z][a-z0-9\-]*)\(", ln)
        if not m or m[2] in free:
            continue
        name = re.search(r'op_name="([^"]*)"', ln)
        labels = re.findall(r"DAE_(\w+)", name[1]) if name else []
        outer = [x for x in labels if x in OUTER]
        piece = [x for x in labels if x in PIECES]
        second = [x for x in labels if x in SECOND]
        shared = [x for x in labels if x not in OUTER and x not in PIECES and x not in SECOND]
        key = " > ".join(second[:1] + [outer[0] if outer else "(other)"] + piece[-1:]
                         + shared[-1:])
        row = out.setdefault(key, [0, 0, 0])
        row[0] += m[2] == "fusion"
        row[1] += not in_fused
        row[2] += 1
    return out


# ------------------------------------------------------------------- the child process
def child(program: str, tree: str, out: str, cache: str | None, lower_only: bool = False,
          census_run: bool = False):
    sys.path.insert(0, tree)                     # the daeadjoint to measure
    sys.path.insert(1, str(HERE))                # problems.py
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    import jax
    import jax.numpy as jnp
    import numpy as np

    jax.config.update("jax_enable_x64", True)
    if cache:
        jax.config.update("jax_compilation_cache_dir", cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    t_import = time.perf_counter()
    import daeadjoint as dae
    import problems

    if census_run:
        label_pieces()

    prob = problems.robertson()
    res_user = problems.jax_residual(prob)
    traced = [0]

    def res(t, y, yp, p):
        traced[0] += 1
        return res_user(t, y, yp, p)

    y0, ts = jnp.asarray(prob.y0), jnp.asarray(prob.ts)
    atol = jnp.asarray(np.broadcast_to(prob.atol, prob.y0.shape))
    a = jnp.asarray(prob.args, dtype=jnp.float64)

    def solve(p, **kw):
        kw.setdefault("saveat", ts)
        return dae.solve(res, prob.t0, prob.t1, y0, prob.yp0(p, problems.JAX), p,
                         algebraic=prob.algebraic, rtol=prob.rtol, atol=atol,
                         max_steps=100_000, **kw)

    def forward(p):
        return solve(p).ys

    def G(p, **adj):
        sol = solve(p, saveat=jnp.reshape(prob.t1, (1,)), quadrature=lambda t, y, yp, p: y[2:3],
                    sensitivity=dae.Adjoint(atol=1e-8, **adj))
        return sol.qs[-1, 0]

    def kinetics(t, y, yp, p):
        traced[0] += 1
        return jnp.stack([yp[0] + p[0] * y[0] - p[1] * y[1] * y[2],
                          yp[1] - p[0] * y[0] + p[1] * y[1] * y[2] + p[2] * y[1],
                          y[2] ** 3 + y[2] - y[0] - p[3] * y[1]])

    kin_ts = jnp.array([0.5, 1.0, 2.0, 3.0])
    kin_w = jnp.array([[1.0, -0.5, 2.0], [0.3, 0.0, -1.0], [0.0, 1.5, 0.7], [-0.4, 0.2, 1.0]])

    def kinetics_loss(theta):
        # derivatives.py part b: index 1, y3 from a cubic; θ = (p1..p4, y1(0), y2(0)).
        p, y0d = theta[:4], theta[4:]
        sol = dae.solve(kinetics, 0.0, 3.0, jnp.concatenate([y0d, jnp.zeros(1)]), jnp.zeros(3),
                        p, saveat=kin_ts, algebraic=jnp.array([False, False, True]),
                        init="ya_ydp", quadrature=lambda t, y, yp, p: y[2:3] ** 2,
                        quad_error_control=True, rtol=1e-6, atol=1e-6)
        return (jnp.sum(kin_w * sol.ys) + jnp.sum(jnp.sin(sol.ys[:, 2]))
                + 0.7 * sol.yps[1, 0] + sol.qs[-1, 0])

    batch = a * jnp.linspace(0.9, 1.1, BATCH)[:, None]
    fn, x = {
        "forward": (forward, a),
        "grad": (jax.grad(G), a),
        "grad_nofallback": (jax.grad(lambda p: G(p, fallback=False)), a),
        "jacfwd": (jax.jacfwd(lambda p: solve(p).ys[-1]), a),
        "vmap": (jax.vmap(forward), batch),
        "vmap_grad": (jax.vmap(jax.grad(G)), batch),
        "hessian": (jax.hessian(kinetics_loss), jnp.array([0.9, 1.3, 0.4, 0.6, 1.0, 0.5])),
    }[program]
    r = dict(program=program, import_s=time.perf_counter() - t_import)
    if cache:
        # A user's first call, nothing else: the cache decides what XLA compiles. JAX
        # reports each program it hands to the backend (read from the cache or
        # compiled; a program with a host callback is never looked up) and each hit.
        events = {"compiles": 0, "hits": 0}

        def listen(name, duration, **kw):
            if name == "/jax/core/compile/backend_compile_duration":
                events["compiles"] += 1

        def hit(name, **kw):
            if name == "/jax/compilation_cache/cache_hits":
                events["hits"] += 1

        jax.monitoring.register_event_duration_secs_listener(listen)
        jax.monitoring.register_event_listener(hit)
        # The first call in its steps (what `jax.jit(fn)(x)` does): tracing and lowering,
        # which every process repeats; XLA's compile or the cache's read; the run.
        t0 = time.perf_counter()
        traced_fn = jax.jit(fn).trace(x)
        t1 = time.perf_counter()
        lowered = traced_fn.lower()
        t2 = time.perf_counter()
        compiled = lowered.compile()
        t3 = time.perf_counter()
        jax.block_until_ready(compiled(x))
        t4 = time.perf_counter()
        r.update(first_call=t4 - t0, trace=t1 - t0, lower=t2 - t1, load=t3 - t2, run=t4 - t3,
                 programs=events["compiles"], compiled=events["compiles"] - events["hits"],
                 hits=events["hits"])
        Path(out).write_text(json.dumps(r))
        return
    # How often JAX batched a jaxpr (`vmap` of a loop body or a primitive's rules: each
    # miss of its cache is one more tracing of that body) and ran a while loop's batching
    # rule, in tracing and in lowering.
    from jax._src.interpreters import batching as _batching
    from jax._src.lax.control_flow import loops as _loops
    bja = _batching._batch_jaxpr_axes
    while_rule = _batching.fancy_primitive_batchers[_loops.while_p]
    while_calls = [0]

    def counted_rule(*args, **kw):
        while_calls[0] += 1
        return while_rule(*args, **kw)

    _batching.fancy_primitive_batchers[_loops.while_p] = counted_rule
    jitted = jax.jit(fn)
    t0 = time.perf_counter()
    traced_fn = jitted.trace(x)
    t1 = time.perf_counter()
    m1, w1 = bja.cache_info().misses, while_calls[0]
    lowered = traced_fn.lower()
    t2 = time.perf_counter()
    r.update(batch_trace=m1, batch_lower=bja.cache_info().misses - m1,
             while_rules=(w1, while_calls[0] - w1))
    if lower_only:
        r.update(trace=t1 - t0, lower=t2 - t1, residual_traces=traced[0],
                 stablehlo=len(re.findall(r"^\s*(%\S+ = )?\"?(stablehlo|func|chlo)\.",
                                          lowered.as_text(), re.M)))
        Path(out).write_text(json.dumps(r))
        return
    if census_run:
        compiled = lowered.compile()
        text = compiled.as_text()
        if os.environ.get("DAE_CENSUS_DUMP"):      # the optimized HLO, to read by hand
            Path(os.environ["DAE_CENSUS_DUMP"], f"{program}.hlo.txt").write_text(text)
        r.update(census=census(text))
        Path(out).write_text(json.dumps(r))
        return
    print("@@XLA-START", flush=True)
    print("@@XLA-START", file=sys.stderr, flush=True)
    c2 = time.process_time()
    compiled = lowered.compile()
    t3 = time.perf_counter()
    xla_cpu = time.process_time() - c2
    jax.block_until_ready(compiled(x))
    t4 = time.perf_counter()
    text = compiled.as_text()
    body = [ln for ln in text.splitlines() if re.match(r"\s*(ROOT )?%\S+ = ", ln)]
    ops = [re.search(r" = .*?([a-z][a-z0-9\-]*)\(", ln) for ln in body]
    ops = [m.group(1) for m in ops if m]
    free = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast"}
    r.update(trace=t1 - t0, lower=t2 - t1, xla=t3 - t2, first_call=t4 - t0, xla_cpu=xla_cpu,
             stablehlo=len(re.findall(r"^\s*(%\S+ = )?\"?(stablehlo|func|chlo)\.",
                                      lowered.as_text(), re.M)),
             hlo=sum(o not in free for o in ops), kernels=ops.count("fusion"),
             whiles=ops.count("while"), residual_traces=traced[0])
    Path(out).write_text(json.dumps(r))


# ------------------------------------------------------------------- XLA's log
_TS = re.compile(r"^I\d{4} (\d\d):(\d\d):(\d\d\.\d+)")


def _secs(line):
    m = _TS.match(line)
    return None if m is None else int(m[1]) * 3600 + int(m[2]) * 60 + float(m[3])


def _dur(v, unit):
    return float(v) * {"us": 1e-6, "ms": 1e-3, "s": 1.0, "min": 60.0}[unit]


def xla_phases(log: str) -> dict:
    """HLO passes / emission / LLVM of the largest module compiled after the marker."""
    lines = log.split("@@XLA-START", 1)[-1].splitlines()
    passes, calls, per_module = {}, {}, {}
    for ln in lines:
        m = re.search(r"Running HLO passes on \[(\S+)\] for CPU time: ([\d.]+) (\w+) \(", ln)
        if m:
            per_module[m[1]] = _dur(m[2], m[3])
    if not per_module:
        return {}
    main = max(per_module, key=per_module.get)
    start = verify = end = None
    mod = None
    for ln in lines:
        m = re.search(r"Running HLO pass pipeline on module (\S+):", ln)
        if m:
            mod = m[1]
        m = re.search(r"HLO pass: (\S+) time: ([\d.]+) (\w+) \(", ln)
        if m and mod == main and m[1] != "simplification":   # a nested pipeline's total
            passes[m[1]] = passes.get(m[1], 0.0) + _dur(m[2], m[3])
            calls[m[1]] = calls.get(m[1], 0) + 1
        if f"Compiling: {main}" in ln:
            start = _secs(ln)
        elif start is not None and verify is None and "LLVM verifier" in ln:
            verify = _secs(ln)
        elif start is not None and end is None and "Compilation finished" in ln:
            end = _secs(ln)
    top = sorted(passes.items(), key=lambda kv: -kv[1])[:4]
    out = dict(module=main, hlo_passes=per_module[main],
               top_passes=", ".join(f"{k} {v:.1f} ({calls[k]}x)" for k, v in top))
    if start is not None and verify is not None and end is not None:
        out.update(emit=verify - start, llvm=end - verify)
    return out


def run_child(program, tree, cache=None, env_extra=None, lower_only=False,
              census_run=False) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r.json")
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1", **(env_extra or {}))
        if cache is None:
            env.update(TF_CPP_MIN_LOG_LEVEL="0",
                       TF_CPP_VMODULE="cpu_compiler=1,hlo_pass_pipeline=1")
        else:
            env.update(EQX_ON_ERROR="nan")
        cmd = [sys.executable, __file__, "--child", program, "--tree", tree, "--out", out]
        if cache:
            cmd += ["--cache-dir", cache]
        if lower_only:
            cmd += ["--lower-only"]
        if census_run:
            cmd += ["--census"]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if p.returncode != 0 or not os.path.exists(out):
            return dict(program=program, error=p.stderr.strip().splitlines()[-1:])
        r = json.loads(Path(out).read_text())
        if cache is None and not lower_only and not census_run:
            r.update(xla_phases(p.stderr))
        return r


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--programs", nargs="*", default=None, choices=PROGRAMS + SLOW)
    ap.add_argument("--hessian", action="store_true", help="also jax.hessian (minutes)")
    ap.add_argument("--cache", action="store_true",
                    help="also the first call of a second process with the persistent cache")
    ap.add_argument("--tree", default=str(HERE.parent), help="checkout whose daeadjoint to run")
    ap.add_argument("--repeats", type=int, default=1, help="fresh processes per program")
    ap.add_argument("--lower-only", action="store_true",
                    help="trace and lower only (no XLA): seconds and batch_jaxpr counts")
    ap.add_argument("--census", action="store_true",
                    help="kernels, thunks and HLO instructions by phase of the solver")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--cache-dir", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a.child, a.tree, a.out, a.cache_dir, a.lower_only, a.census)
    progs = a.programs or (PROGRAMS + (SLOW if a.hessian else []))
    print(f"# Compile profile — {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC\n")
    import jax
    print(f"{platform.machine()} {os.cpu_count()} CPUs, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; jax {jax.__version__}; "
          f"daeadjoint from {a.tree}\n")
    if a.census:
        for prog in progs:
            r = run_child(prog, a.tree, census_run=True)
            if "error" in r:
                print(f"| {prog} | error: {r['error']} |")
                continue
            rows = sorted(r["census"].items(), key=lambda kv: -kv[1][0])
            total = [sum(v[j] for _, v in rows) for j in range(3)]
            print(f"\n{prog}: kernels, thunks and HLO instructions by phase "
                  "(outer > backward piece > shared piece)\n")
            print("| phase | kernels | thunks | HLO instr. |")
            print("|---|---|---|---|")
            for key, (kern, thunks, instr) in rows:
                print(f"| {key} | {kern} | {thunks} | {instr} |")
            print(f"| **total** | {total[0]} | {total[1]} | {total[2]} |", flush=True)
        return
    if a.lower_only:
        print("| program | trace s | lower s | bodies batched: trace / lower | while "
              "batching rules: trace / lower | StableHLO | residual traced |")
        print("|---" * 7 + "|")
        for _ in range(a.repeats):
            for prog in progs:
                r = run_child(prog, a.tree, lower_only=True)
                if "error" in r:
                    print(f"| {prog} | error: {r['error']} |")
                    continue
                print(f"| {prog} | {r['trace']:.2f} | {r['lower']:.2f} | {r['batch_trace']} / "
                      f"{r['batch_lower']} | {r['while_rules'][0]} / {r['while_rules'][1]} | "
                      f"{r['stablehlo']} | {r['residual_traces']} |", flush=True)
        return
    print("| program | first call s | trace | lower | XLA | HLO passes | emit | LLVM | "
          "StableHLO | HLO instr. | kernels | whiles | residual traced | slowest passes (s) | "
          "XLA CPU s |")
    print("|---" * 16 + "|")
    for _ in range(a.repeats):
        for prog in progs:
            r = run_child(prog, a.tree)
            if "error" in r:
                print(f"| {prog} | error: {r['error']} |")
                continue
            f = lambda k, r=r: f"{r[k]:.2f}" if isinstance(r.get(k), float) else "–"  # noqa: E731
            print(f"| {prog} | {f('first_call')} | {f('trace')} | {f('lower')} | {f('xla')} | "
                  f"{f('hlo_passes')} | {f('emit')} | {f('llvm')} | {r['stablehlo']} | "
                  f"{r['hlo']} | {r['kernels']} | {r['whiles']} | {r['residual_traces']} | "
                  f"{r.get('top_passes', '')} | {f('xla_cpu')} |", flush=True)
    if not a.cache:
        return
    print("\nPersistent compilation cache: first call of a process that fills it and of a "
          "second one that reads it (s), and the programs the second one compiled\n")
    print("| program | first process | second process | of which trace | lower | XLA or "
          "cache read | run | programs XLA compiled / read from the cache in the second |")
    print("|---|---|---|---|---|---|---|---|")
    for prog in progs:
        with tempfile.TemporaryDirectory() as cache:
            r1 = run_child(prog, a.tree, cache=cache)
            r2 = run_child(prog, a.tree, cache=cache)
        if "error" in r1 or "error" in r2:
            print(f"| {prog} | error: {r1.get('error') or r2.get('error')} |")
            continue
        print(f"| {prog} | {r1['first_call']:.2f} | {r2['first_call']:.2f} | {r2['trace']:.2f} | "
              f"{r2['lower']:.2f} | {r2['load']:.2f} | {r2['run']:.3f} | "
              f"{r2['compiled']} / {r2['hits']} |", flush=True)


if __name__ == "__main__":
    main()
