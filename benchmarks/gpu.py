"""The batched solve and its derivatives on an accelerator: correctness against the CPU in
the same process, and per-member throughput by batch size.

    OPENBLAS_NUM_THREADS=1 python benchmarks/gpu.py                  # every stage
    OPENBLAS_NUM_THREADS=1 python benchmarks/gpu.py --stage check    # one stage
    OPENBLAS_NUM_THREADS=1 python benchmarks/gpu.py --quick          # small sizes (a CPU run)

Runs on JAX's default backend (a GPU where one is present; on a machine without one it
runs on the CPU and the "check" stage compares the CPU with itself). Stages:

- ``check``: Robertson (`problems.robertson()`, 0 … 4e10, rtol 1e-6, IDAS's atol) on the
  default device against the same programs on the CPU device: one solve (also against
  the IDAS table R1 of REFERENCE_VALUES.md, whose run used rtol 1e-4: agreement to that
  tolerance's digits), `jit(vmap)` of 64 members, `grad` and `jacfwd` of a weighted sum of the outputs, and
  `vmap(grad)` of 16 members; the 2-D heat problem (`problems.heat(8)`, n = 64, the
  pure-JAX band kernel on an accelerator) forward and `grad`; `daeadjoint.ensemble`.
  Differences are reported relative to the CPU result (per component, against the
  solve's atol as a floor): the two backends run the same step sequence up to rounding,
  so agreement is expected to ~rtol or better, and a step-count difference is reported.
- ``throughput``: `jit(vmap(solve))` of Robertson at each ``--sizes`` (compile seconds,
  median wall of ``--repeats`` warm runs, ms per member, members per second) and
  `jit(vmap(grad))` at the first size; against a loop of IDAS calls (scikit-sundae, on
  this machine's CPU) where installed.
- ``queue``: a heterogeneous batch (step counts differing ~8x) against a homogeneous
  one, in one chunk and through `solve_ensemble`'s queue (``--queue members,slots,segment``).
- ``heat``: 64 heat problems at M = 20 (n = 400) in one `jit(vmap)` against 64 sequential
  IDAS calls (scikit-sundae, banded Jacobian) where installed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the working-tree daeadjoint

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_enable_x64", True)

import daeadjoint as dae  # noqa: E402
import problems  # noqa: E402
from problems import JAX, jax_residual  # noqa: E402

CPU = jax.devices("cpu")[0]
# R1 (IDAS idasRoberts_dns, rtol 1e-4): y at t = 4e1, 4e4, 4e10.
R1 = {4e1: (7.1579e-01, 9.1838e-06, 2.8420e-01), 4e4: (3.8992e-02, 1.6221e-07, 9.6101e-01),
      4e10: (4.8641e-08, 1.9456e-13, 1.0000e00)}


def _solver(prob, max_steps=100_000):
    residual = jax_residual(prob)
    y0, ts, atol = jnp.asarray(prob.y0), jnp.asarray(prob.ts), jnp.asarray(prob.atol)

    def solve(args):
        sol = dae.solve(residual, prob.t0, prob.t1, y0, prob.yp0(args, JAX), args,
                        saveat=ts, algebraic=prob.algebraic, rtol=prob.rtol, atol=atol,
                        max_steps=max_steps, throw=False)
        return sol.ys, sol.stats["num_steps"], sol.result == dae.RESULTS.successful

    return solve


def _median_wall(fn, repeats):
    walls = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        walls.append(time.perf_counter() - t)
    return statistics.median(walls)


def _on_both(fn, *args):
    """fn(*args) compiled and run on the default device and on the CPU; (default, cpu,
    compile+first-call seconds on the default device)."""
    t = time.perf_counter()
    out = jax.block_until_ready(jax.jit(fn)(*args))
    first = time.perf_counter() - t
    with jax.default_device(CPU):
        ref = jax.block_until_ready(jax.jit(fn)(*jax.device_put(args, CPU)))
    return jax.tree.map(np.asarray, out), jax.tree.map(np.asarray, ref), first


def _rel(a, b, floor):
    return float(np.max(np.abs(a - b) / (np.abs(b) + floor)))


def check(quick):
    prob = problems.robertson()
    solve = _solver(prob)
    floor = np.asarray(prob.atol) / prob.rtol
    args = jnp.asarray(prob.args)
    (ys, steps, status), (ys_c, steps_c, status_c), first = _on_both(solve, args)
    print(f"robertson solve: successful {bool(status)} / cpu {bool(status_c)}, steps {int(steps)}"
          f" / cpu {int(steps_c)}, max rel diff vs cpu {_rel(ys, ys_c, floor):.1e} "
          f"(first call {first:.1f} s)", flush=True)
    for t, ref in R1.items():
        i = int(np.argmin(np.abs(prob.ts - t)))
        print(f"  t = {t:.0e}: {np.array2string(ys[i], precision=5)}  IDAS R1 {ref}")

    nb = 16 if quick else 64
    pb = jnp.asarray(prob.batch_args(nb))
    (ys, steps, status), (ys_cb, steps_c, status_c), first = _on_both(jax.vmap(solve), pb)
    print(f"robertson jit(vmap) {nb}: all successful {bool(status.all())} / cpu "
          f"{bool(status_c.all())}, steps {steps.min()}-{steps.max()}, members "
          f"with other step counts than on cpu {int(np.sum(steps != steps_c))}, max rel diff "
          f"{_rel(ys, ys_cb, floor):.1e} (first call {first:.1f} s)", flush=True)

    def loss(a):
        return jnp.sum(solve(a)[0] * jnp.array([1.0, 1e4, 1.0]))  # every output time

    for name, fn in (("grad", jax.grad(loss)), ("jacfwd", jax.jacfwd(loss))):
        g, g_c, first = _on_both(fn, args)
        print(f"robertson {name}: {np.array2string(g, precision=6)}, max rel diff vs cpu "
              f"{_rel(g, g_c, 0.0):.1e} (first call {first:.1f} s)", flush=True)
    g, g_c, first = _on_both(jax.vmap(jax.grad(loss)), pb[:16])
    print(f"robertson vmap(grad) 16: max rel diff vs cpu {_rel(g, g_c, 0.0):.1e}, finite "
          f"{bool(np.all(np.isfinite(g)))} (first call {first:.1f} s)", flush=True)

    heat = problems.heat(8)
    hsolve = _solver(heat)
    ha = jnp.asarray(heat.args)
    (ys, steps, status), (ys_c, steps_c, _), first = _on_both(hsolve, ha)
    print(f"heat 8x8 solve: successful {bool(status)}, steps {int(steps)} / cpu {int(steps_c)}, "
          f"max rel diff {_rel(ys, ys_c, 1e-8 / 1e-6):.1e} (first call {first:.1f} s)",
          flush=True)
    g, g_c, first = _on_both(jax.grad(lambda a: jnp.sum(hsolve(a)[0])), ha)
    print(f"heat 8x8 grad: {g}, max rel diff vs cpu {_rel(g, g_c, 0.0):.1e} "
          f"(first call {first:.1f} s)", flush=True)

    out = dae.ensemble(lambda a: solve(a)[0], pb)
    print(f"ensemble ({jax.local_device_count()} device(s)) {nb}: max rel diff vs cpu "
          f"jit(vmap) {_rel(np.asarray(out), ys_cb, floor):.1e}", flush=True)


def _idas_loop(prob, pb):
    try:
        import peers
        prep = peers.prepare_sksundae(prob)
    except Exception as err:  # noqa: BLE001 - a missing peer is reported, not fatal
        print(f"  IDAS (scikit-sundae): unavailable ({type(err).__name__}: {err})")
        return None
    prep.run(np.asarray(pb[0]))
    t = time.perf_counter()
    for a in np.asarray(pb):
        prep.run(a)
    return time.perf_counter() - t


def _row(label, n, wall, compile_s=None):
    comp = "" if compile_s is None else f"{compile_s:9.1f}"
    print(f"{label:<40} {n:>6} {wall:10.3f} {1e3 * wall / n:11.4f} {n / wall:11.1f} {comp}",
          flush=True)


def throughput(sizes, repeats, grad=True, peers=True):
    prob = problems.robertson()
    solve = _solver(prob)
    print(f"{'':<40} {'n':>6} {'wall s':>10} {'ms/member':>11} {'members/s':>11} "
          f"{'compile s':>9}  (load {os.getloadavg()[0]:.1f})")
    for n in sizes:
        pb = jnp.asarray(prob.batch_args(n))
        t = time.perf_counter()
        fn = jax.jit(jax.vmap(solve)).lower(pb).compile()
        compile_s = time.perf_counter() - t
        _, steps, status = fn(pb)
        wall = _median_wall(lambda: fn(pb), repeats)
        _row(f"jit(vmap) [{jax.default_backend()}]", n, wall, compile_s)
        print(f"  steps {int(steps.min())}-{int(steps.max())}, all successful "
              f"{bool(np.all(status))}", flush=True)
    n = sizes[0]
    pb = jnp.asarray(prob.batch_args(n))
    if grad:
        _vmap_grad(solve, pb, repeats)
    wall = _idas_loop(prob, pb) if peers else None
    if wall is not None:
        _row("IDAS (scikit-sundae) loop [cpu]", n, wall)


def _vmap_grad(solve, pb, repeats):
    n = pb.shape[0]
    g = jax.grad(lambda a: jnp.sum(solve(a)[0][-1]))
    t = time.perf_counter()
    fn = jax.jit(jax.vmap(g)).lower(pb).compile()
    compile_s = time.perf_counter() - t
    wall = _median_wall(lambda: fn(pb), repeats)
    _row(f"jit(vmap(grad)) [{jax.default_backend()}]", n, wall, compile_s)


def queue(n, slots, segment, repeats):
    """A heterogeneous batch (p1 over four decades, t1 = 4 … 4e10 shuffled: step counts
    differing ~8x) against a homogeneous one (p1 over one decade, t1 = 4e6), in one
    `jit(vmap)` chunk and through `solve_ensemble`'s queue (`slots` members, `segment`
    steps between refills); cost per member-step, heterogeneous / homogeneous."""
    prob = problems.robertson()
    residual = jax_residual(prob)
    rng = np.random.default_rng(0)
    het = np.tile(prob.args, (n, 1))
    het[:, 0] *= 10.0 ** np.linspace(-2.0, 2.0, n)
    batches = {"homogeneous": (prob.batch_args(n), np.full(n, 4e6)),
               "heterogeneous": (het, rng.permutation(4.0 * 10.0 ** np.linspace(0, 10, n)))}
    kw = dict(algebraic=prob.algebraic, rtol=prob.rtol, atol=jnp.asarray(prob.atol),
              max_steps=100_000, batch=("t1", "yp0", "args"))
    paths = {"one chunk": dict(queue=False),
             f"queue {slots} x {segment}": dict(queue=True, chunk_size=slots,
                                                 segment=segment)}

    def run(name, path):
        args, t1 = batches[name]
        yp0 = np.stack([np.asarray(prob.yp0(a)) for a in args])
        return dae.solve_ensemble(residual, prob.t0, t1, jnp.asarray(prob.y0), yp0, args,
                                  **kw, **paths[path])

    steps, walls = {}, {}
    for name in batches:
        for path in paths:
            t = time.perf_counter()
            sol = run(name, path)                               # compiles
            print(f"  {name}, {path}: first call {time.perf_counter() - t:.1f} s",
                  flush=True)
            steps[name] = np.asarray(sol.stats["num_steps"])
    for _ in range(repeats):                                    # interleaved
        for name in batches:
            for path in paths:
                t = time.perf_counter()
                jax.block_until_ready(run(name, path).ys)
                walls.setdefault((name, path), []).append(time.perf_counter() - t)
    for path in paths:
        per = {name: statistics.median(walls[name, path]) / steps[name].sum()
               for name in batches}
        for name in batches:
            _row(f"{path}, {name}", n, statistics.median(walls[name, path]))
        print(f"  {path}: heterogeneous / homogeneous per member-step "
              f"{per['heterogeneous'] / per['homogeneous']:.2f} (steps "
              f"{steps['heterogeneous'].min()}-{steps['heterogeneous'].max()} vs "
              f"{steps['homogeneous'].min()}-{steps['homogeneous'].max()})", flush=True)


def heat_batch(repeats):
    prob = problems.heat(20)
    solve = _solver(prob)
    pb = jnp.asarray(prob.batch_args(64))
    t = time.perf_counter()
    fn = jax.jit(jax.vmap(solve)).lower(pb).compile()
    compile_s = time.perf_counter() - t
    ys, steps, status = fn(pb)
    wall = _median_wall(lambda: fn(pb), repeats)
    _row(f"heat M=20 jit(vmap) [{jax.default_backend()}]", 64, wall, compile_s)
    print(f"  steps {int(steps.min())}-{int(steps.max())}, all successful "
          f"{bool(np.all(status))}", flush=True)
    wall = _idas_loop(prob, pb)
    if wall is not None:
        _row("heat M=20 IDAS (scikit-sundae, band) loop", 64, wall)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stage", choices=("check", "throughput", "heat", "queue"), default=None)
    p.add_argument("--no-grad", action="store_true", help="throughput: no vmap(grad)")
    p.add_argument("--no-peers", action="store_true", help="throughput: no IDAS loop")
    p.add_argument("--queue", default="4096,1024,256",
                   help="queue stage: members, slots, steps per segment")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--sizes", default=None, help="comma-separated batch sizes")
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    sizes = ([int(s) for s in a.sizes.split(",")] if a.sizes
             else [16] if a.quick else [256, 1024, 4096, 16384])
    print(f"jax {jax.__version__}, backend {jax.default_backend()}: "
          f"{jax.devices()[0].device_kind}", flush=True)
    if a.stage in (None, "check"):
        check(a.quick)
    if a.stage in (None, "throughput"):
        throughput(sizes, 1 if a.quick else a.repeats, not a.no_grad, not a.no_peers)
    if a.stage in (None, "heat"):
        heat_batch(1 if a.quick else a.repeats)
    if a.stage == "queue" or (a.stage is None and not a.quick):
        n, slots, segment = (int(v) for v in a.queue.split(","))
        queue(n, slots, segment, 1 if a.quick else a.repeats)


if __name__ == "__main__":
    main()
