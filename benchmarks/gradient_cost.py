"""The cost of a gradient on Robertson (issue 21, build item 3); prints Markdown.

    OPENBLAS_NUM_THREADS=1 python benchmarks/gradient_cost.py [--rounds 30]
        [--baseline /path/to/other/checkout] [--loops] [--parts] [--keep-bytes 0,262144]
        [--problem robertson|heatM]

dG/dp of G = ∫_0^4e10 y3 dt (`problems.robertson()`, rtol 1e-6, `Adjoint(atol=1e-8)`, as
`small_peers.py`) against the forward solve (12 outputs) and pydiffsol's continuous
adjoint. Reported per version (this tree, and with `--baseline` another checkout's
`daeadjoint`, imported in the same process from a copy under another package name, so
that both are timed in interleaved rounds):

- wall and CPU ms (median and min over the rounds; CPU = this process's CPU time, all
  threads: less disturbed by other jobs on a busy machine than wall time);
- the recording forward alone (`jax.vjp` without its pullback, its records kept alive:
  `recording`) and the backward pass (gradient − recording forward), the backward
  pass's replayed and adjoint attempts (counted by wrapping `integrate` in the adjoint
  module), and the backward's µs per adjoint attempt (all of the backward pass divided
  by its adjoint attempts);
- `--loops`: every while loop of the compiled gradient with its thunks (operations the
  CPU runtime executes per trip, nested loops excluded) and the largest buffer one of
  them touches, nested loops included: XLA's CPU runtime runs a loop body sequentially
  in the calling thread when that is at most 512 bytes (or the body has at most 8
  thunks), else on its task-graph executor;
- `--parts`: the backward pass split into the replays of the forward segments, the
  integrations of the adjoint DAE (A) and the rest (restarts, each segment's setup, the
  loops around them, the start and end of the pass), by timing in the same rounds two
  more gradients of this tree whose backward pass runs every replay, or every
  integration of (A), twice (`extra_pass_gradient`): the difference to the gradient is
  the cost of that part.
- `--keep-bytes B1,B2,...`: time each version with `Adjoint(keep_bytes=B)` for every B
  given (interleaved in the same rounds), instead of with the version's default.
- `--problem heatM`: `problems.heat(M)` (M² unknowns, G = ∫ Σ y dt, same `Adjoint`)
  instead of Robertson; pydiffsol is then not timed.

Each version's first call of the jitted gradient (compile and one run) is also reported.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import importlib
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(1, str(HERE))
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_enable_x64", True)

import peers  # noqa: E402
import problems  # noqa: E402

PROB = problems.robertson()
P = jnp.asarray(PROB.args, float)


def _quadrature(t, y, yp, p):
    return y[2:3] if PROB.name == "robertson" else jnp.sum(y, keepdims=True)


def load(name: str, tree: Path, tmp: Path):
    """`tree/daeadjoint` imported as package `name` (its imports are relative)."""
    shutil.copytree(tree / "daeadjoint", tmp / name)
    if str(tmp) not in sys.path:
        sys.path.insert(0, str(tmp))
    return importlib.import_module(name)


def programs(dae, keep_bytes=None):
    res = problems.jax_residual(PROB)
    y0, atol, ts = jnp.asarray(PROB.y0), jnp.asarray(PROB.atol), jnp.asarray(PROB.ts)

    adjoint = (dae.Adjoint(atol=1e-8) if keep_bytes is None
               else dae.Adjoint(atol=1e-8, keep_bytes=keep_bytes))

    def G(p):
        sol = dae.solve(res, PROB.t0, PROB.t1, y0, PROB.yp0(p, problems.JAX), p,
                        saveat=jnp.reshape(PROB.t1, (1,)), algebraic=PROB.algebraic,
                        rtol=PROB.rtol, atol=atol, quadrature=_quadrature,
                        max_steps=peers.MAX_STEPS, sensitivity=adjoint)
        return sol.qs[-1, 0]

    def F(p):
        sol = dae.solve(res, PROB.t0, PROB.t1, y0, PROB.yp0(p, problems.JAX), p, saveat=ts,
                        algebraic=PROB.algebraic, rtol=PROB.rtol, atol=atol,
                        max_steps=peers.MAX_STEPS)
        return sol.ys

    return G, F


def recording(G, p):
    """G(p) by the recording forward run of jax.vjp, and a sum over everything it records
    for the pullback (checkpoints, kept steps): without a use of the records, XLA removes
    their recording as dead code, and `jax.vjp(G, p)[0]` costs as the plain forward
    (6.0 against 11.5 CPU ms fastest on Robertson, 2026-11-29). The sum reads the records
    once (0.68 MB on Robertson)."""
    g, pullback = jax.vjp(G, p)
    return g, sum(jnp.sum(x, dtype=jnp.float64) for x in jax.tree_util.tree_leaves(pullback)
                  if hasattr(x, "dtype"))


def attempts(dae, G) -> dict:
    """Attempts of the backward pass's integrations, by kind (replay / adjoint)."""
    mod = importlib.import_module(dae.__name__ + "._derivatives.adjoint")
    counts: collections.Counter = collections.Counter()
    orig = mod.integrate

    def counted(problem, state, *a, **k):
        out = orig(problem, state, *a, **k)
        kind = "adjoint" if isinstance(problem.linear_solver, mod.AdjointSolver) else "replay"
        d = {key: out[0].stats[key] - state.stats[key] for key in
             ("num_steps", "num_error_test_failures", "num_nonlinear_convergence_failures",
              "num_nonlinear_iters", "num_jacobian_evals")}
        jax.debug.callback(lambda d: counts.update(
            {(kind, key): int(v) for key, v in d.items()}), d)
        return out

    mod.integrate = counted
    try:
        jax.block_until_ready(jax.jit(jax.grad(G))(P))
        jax.effects_barrier()
    finally:
        mod.integrate = orig
    out = {}
    for kind in ("replay", "adjoint"):
        c = {key: v for (k, key), v in counts.items() if k == kind}
        out[kind] = dict(attempts=c.get("num_steps", 0) + c.get("num_error_test_failures", 0)
                         + c.get("num_nonlinear_convergence_failures", 0),
                         iterations=c.get("num_nonlinear_iters", 0),
                         jacobians=c.get("num_jacobian_evals", 0))
    return out


def extra_pass_gradient(dae, G, kind: str):
    """jit(grad(G)) whose backward pass runs each replay (kind "replay") or each
    integration of (A) ("adjoint") twice, the second from the same inputs. Its result
    is kept alive by a test that is never true (a NaN time), so that XLA does not remove
    it as dead code; the gradient is unchanged. Compiled here, while `integrate` is
    wrapped."""
    mod = importlib.import_module(dae.__name__ + "._derivatives.adjoint")
    orig = mod.integrate

    def doubled(problem, state, *a, **k):
        out = orig(problem, state, *a, **k)
        if isinstance(problem.linear_solver, mod.AdjointSolver) != (kind == "adjoint"):
            return out
        again = orig(problem, state, *a, **k)
        s = out[0]
        s = dataclasses.replace(s, result=mod.RESULTS.where(
            jnp.isnan(again[0].t), mod.RESULTS.adjoint_failed, s.result))
        return (s,) + tuple(out[1:])

    g = jax.jit(jax.grad(G))
    mod.integrate = doubled
    try:
        out = np.asarray(g(P))
    finally:
        mod.integrate = orig
    return g, out


# ------------------------------------------------------------------ loop executors
_BYTES = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "pred": 1, "s8": 1,
          "u8": 1, "f16": 2, "bf16": 2, "s16": 2, "c128": 16, "c64": 8}
_NO_THUNK = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all",
             "opt-barrier"}
_ARRAY = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([0-9,]*)\]")


def _sizes(shape: str) -> list[int]:
    return [_BYTES[d] * int(np.prod([int(x) for x in s.split(",") if x] or [1]))
            for d, s in _ARRAY.findall(shape)]


def loop_table(hlo: str) -> list[tuple]:
    """(depth, thunks, largest buffer touched, sequential) of every while loop."""
    comps: dict = {}
    cur = None
    for line in hlo.splitlines():
        m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if m and not line.startswith(" "):
            cur = m.group(1)
            comps[cur] = []
            continue
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (.*?) ([\w\-]+)\((.*)$", line) if cur else None
        if m:
            comps[cur].append(dict(name=m.group(1), shape=m.group(2), op=m.group(3),
                                   rest=m.group(4)))
    shapes = {c: {i["name"]: i["shape"] for i in ins} for c, ins in comps.items()}
    memo: dict = {}

    def called(i) -> list[str]:
        names = re.findall(r"(?:body|condition|to_apply|true_computation|false_computation)"
                           r"=%?([\w.\-]+)", i["rest"])
        for b in re.findall(r"branch_computations=\{([^}]*)\}", i["rest"]):
            names += [x.strip().lstrip("%") for x in b.split(",")]
        return [x for x in names if x in comps]

    def uses(c):
        """(largest buffer touched, thunks) of computation c, nested control flow included
        in the first (XLA's while/conditional thunks report their bodies' buffers)."""
        if c in memo:
            return memo[c]
        memo[c] = (0, 0)
        worst, thunks = 0, 0
        for i in comps.get(c, []):
            if i["op"] in _NO_THUNK:
                continue
            thunks += 1
            if i["op"] in ("while", "conditional", "call"):
                worst = max([worst] + [uses(x)[0] for x in called(i)])
                continue
            ops = re.findall(r"%([\w.\-]+)", i["rest"].split(")")[0])
            worst = max([worst] + _sizes(i["shape"])
                        + [b for o in ops for b in _sizes(shapes[c].get(o, ""))])
        memo[c] = (worst, thunks)
        return memo[c]

    rows: list[tuple] = []

    def walk(c, depth):
        for i in comps.get(c, []):
            if i["op"] == "while":
                body = re.search(r"body=%?([\w.\-]+)", i["rest"]).group(1)
                cond = re.search(r"condition=%?([\w.\-]+)", i["rest"]).group(1)
                (wb, nb), (wc, _) = uses(body), uses(cond)
                rows.append((depth, nb, max(wb, wc), max(wb, wc) <= 512 or nb <= 8))
                walk(body, depth + 1)
            elif i["op"] in ("conditional", "call"):
                for x in called(i):
                    walk(x, depth)

    entry = next(line.split()[1].lstrip("%") for line in hlo.splitlines()
                 if line.startswith("ENTRY"))
    walk(entry, 0)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--baseline", type=Path, default=None)
    ap.add_argument("--loops", action="store_true")
    ap.add_argument("--parts", action="store_true")
    ap.add_argument("--keep-bytes", type=str, default=None,
                    help="comma-separated Adjoint(keep_bytes=...) values to compare")
    ap.add_argument("--problem", default="robertson", help="robertson or heatM")
    opt = ap.parse_args()
    global PROB, P
    if opt.problem != "robertson":
        PROB = problems.heat(int(opt.problem.removeprefix("heat")))
        P = jnp.asarray(PROB.args, float)
    tmp = Path(tempfile.mkdtemp(prefix="gradient_cost_"))
    trees = {"this tree": HERE.parent}
    if opt.baseline is not None:
        trees = {"baseline": opt.baseline, **trees}
    keeps = [None] if opt.keep_bytes is None else [int(b) for b in opt.keep_bytes.split(",")]
    fns, info = {}, {}
    versions = {}
    for k, (name, tree) in enumerate(trees.items()):
        dae = load(f"_dae_version{k}", tree, tmp)
        for kb in keeps:
            label = name if kb is None else f"{name}, keep_bytes={kb}"
            versions[label] = (name, dae, kb)
    for label, (name, dae, kb) in versions.items():
        G, F = programs(dae, kb)
        f, g, r = jax.jit(F), jax.jit(jax.grad(G)), jax.jit(lambda p, G=G: recording(G, p))
        fns[(label, "forward")] = lambda f=f: jax.block_until_ready(f(P))
        fns[(label, "gradient")] = lambda g=g: jax.block_until_ready(g(P))
        fns[(label, "recording forward")] = lambda r=r: jax.block_until_ready(r(P))
        t = time.perf_counter()
        info[label] = dict(grad=np.asarray(g(P)))
        info[label]["first call"] = time.perf_counter() - t
        info[label]["counts"] = attempts(dae, G)
        if opt.parts and name == "this tree":
            for kind in ("replay", "adjoint"):
                gx, out = extra_pass_gradient(dae, programs(dae, kb)[0], kind)
                assert np.array_equal(out, info[label]["grad"]), (kind, out)
                fns[(label, f"gradient, every {kind} twice")] = (
                    lambda gx=gx: jax.block_until_ready(gx(P)))
        if opt.loops:
            info[label]["loops"] = loop_table(jax.jit(jax.grad(G)).lower(P).compile().as_text())
    try:
        if PROB.name != "robertson":
            raise LookupError(f"not timed on {PROB.name}")
        pg = peers.prepare_pydiffsol_gradient(PROB)
        fns[("pydiffsol", "adjoint")] = lambda: pg.run(np.asarray(P))
    except Exception as e:  # noqa: BLE001 - an absent peer must not stop the table
        print(f"pydiffsol: {type(e).__name__}: {e}")
    for fn in fns.values():
        fn()
    wall: dict = {k: [] for k in fns}
    cpu: dict = {k: [] for k in fns}
    load0 = os.getloadavg()
    for _ in range(opt.rounds):
        for key, fn in fns.items():
            t, c = time.perf_counter(), time.process_time()
            fn()
            wall[key].append(time.perf_counter() - t)
            cpu[key].append(time.process_time() - c)
    load1 = os.getloadavg()
    med = {k: 1e3 * statistics.median(v) for k, v in wall.items()}
    cmed = {k: 1e3 * statistics.median(v) for k, v in cpu.items()}
    print(f"{PROB.name} (n = {PROB.n}): {opt.rounds} interleaved rounds; load average before {load0[0]:.1f}, after "
          f"{load1[0]:.1f}; jax {jax.__version__}\n")
    print("| version | run | wall ms median (min) | CPU ms median (min) |")
    print("|---|---|---|---|")
    for key in fns:
        print(f"| {key[0]} | {key[1]} | {med[key]:.2f} ({1e3 * min(wall[key]):.2f}) | "
              f"{cmed[key]:.2f} ({1e3 * min(cpu[key]):.2f}) |")
    print("\n| version | gradient ÷ forward, wall (CPU) | backward, CPU ms | replay attempts "
          "| adjoint attempts (iterations, Jacobians) | backward µs per adjoint attempt, CPU |")
    print("|---|---|---|---|---|---|")
    for label in versions:
        backward = cmed[(label, "gradient")] - cmed[(label, "recording forward")]
        c = info[label]["counts"]
        print(f"| {label} | {med[(label, 'gradient')] / med[(label, 'forward')]:.2f} "
              f"({cmed[(label, 'gradient')] / cmed[(label, 'forward')]:.2f}) | {backward:.2f} | "
              f"{c['replay']['attempts']} | {c['adjoint']['attempts']} "
              f"({c['adjoint']['iterations']}, {c['adjoint']['jacobians']}) | "
              f"{1e3 * backward / max(c['adjoint']['attempts'], 1):.1f} |")
    for label in (v for v in versions if versions[v][0] == "this tree" and opt.parts):
        print(f"\n| CPU ms ({label}), of (median, fastest) | backward pass | replays "
              "| integrations of (A) | rest |")
        print("|---|---|---|---|---|")
        for how, stat in (("median", statistics.median), ("fastest", min)):
            m = {key: 1e3 * stat(cpu[(label, key)]) for key in
                 ("gradient", "recording forward", "gradient, every replay twice",
                  "gradient, every adjoint twice")}
            backward = m["gradient"] - m["recording forward"]
            parts = {kind: m[f"gradient, every {kind} twice"] - m["gradient"]
                     for kind in ("replay", "adjoint")}
            print(f"| {how} | {backward:.2f} | {parts['replay']:.2f} | {parts['adjoint']:.2f} | "
                  f"{backward - parts['replay'] - parts['adjoint']:.2f} |")
    labels = list(versions)
    if ("pydiffsol", "adjoint") in fns:
        mine = labels[-1]
        print(f"\npydiffsol adjoint ÷ {mine}'s gradient, wall: "
              f"{med[('pydiffsol', 'adjoint')] / med[(mine, 'gradient')]:.2f}, CPU: "
              f"{cmed[('pydiffsol', 'adjoint')] / cmed[(mine, 'gradient')]:.2f}")
    for label in versions:
        print(f"\nFirst call of jit(grad) ({label}): {info[label]['first call']:.2f} s")
    for label in versions:
        print(f"\ndG/dp ({label}): {info[label]['grad']!r}")
    for other in labels[1:]:
        a, b = info[labels[0]]["grad"], info[other]["grad"]
        print(f"{other} vs {labels[0]}: bit-identical: {np.array_equal(a, b)}; max relative "
              f"difference {np.max(np.abs(b / a - 1)):.2e}")
    if opt.loops:
        for label in versions:
            print(f"\nWhile loops of the compiled gradient ({label}): depth, thunks, largest "
                  "buffer touched (bytes), executor")
            for depth, thunks, worst, seq in info[label]["loops"]:
                print(f"{'  ' * depth}- {thunks} thunks, {worst} B, "
                      f"{'sequential' if seq else 'task graph'}")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
