"""Ensembles of Robertson problems: per-member throughput of `jax.jit(jax.vmap)`,
`daeadjoint.ensemble` (chunked, split over the local devices) and `vmap(grad)`, against a
loop of compiled IDAS calls (casadi) and diffsol-jax's vmap where installed; and a
heterogeneous batch (p1 over four decades) against a homogeneous one, and in chunks
as given or sorted by cost (`ensemble(cost=...)`), and through `solve_ensemble`'s queue
(a refilled working set); a loop of pydiffsol calls.

    OPENBLAS_NUM_THREADS=1 python benchmarks/ensembles.py --quick           # 16 members
    OPENBLAS_NUM_THREADS=1 python benchmarks/ensembles.py -n 256 --host-devices 4

Runs unchanged on a GPU (JAX's default backend; the peers run on the CPU).
`--host-devices N` forces N CPU devices (`--xla_force_host_platform_device_count`, set
before JAX starts; on a 2-core machine more devices only add overhead). Problem:
`problems.robertson()` (0 … 4e10, 12 outputs, rtol 1e-6, atol (1e-10, 1e-14, 1e-8)),
p1 scaled by 10**linspace(-0.5, 0.5, n) (the heterogeneous batch: linspace(-2, 2, n)).
Times are medians of warm runs after compilation; "per member" is the batch's wall time
divided by its size. Compile times are separate (ahead-of-time `lower().compile()`).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def _parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="16 members, 1 repeat")
    p.add_argument("-n", type=int, default=256, help="members (default 256)")
    p.add_argument("--chunk", type=int, default=None, help="ensemble chunk size (default n)")
    p.add_argument("--host-devices", type=int, default=None,
                   help="force this many CPU devices (before JAX starts)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-grad", action="store_true", help="skip vmap(grad) (long compile)")
    p.add_argument("--chunks", type=int, nargs="*", default=None,
                   help="only `ensemble` at these chunk sizes (and the whole batch), "
                        "interleaved rounds, CPU and wall seconds: e.g. -n 4096 --chunks "
                        "256 512 1024 2048")
    p.add_argument("--vmap-only", action="store_true",
                   help="jit(vmap) and the peers only (no ensemble, queue, batches of "
                        "other spreads or grad: for large n)")
    return p.parse_args()


ARGS = _parse()
if ARGS.host_devices:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={ARGS.host_devices}")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the working-tree daeadjoint

import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_enable_x64", True)

import daeadjoint as dae  # noqa: E402
import peers  # noqa: E402
import problems  # noqa: E402


def _median_wall(fn, repeats):
    walls = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        walls.append(time.perf_counter() - t)
    return statistics.median(walls)


def _row(label, n, wall, compile_s=None, note=""):
    comp = "" if compile_s is None else f"{compile_s:8.1f}"
    print(f"{label:<50} {n:>6} {wall:10.3f} {1e3 * wall / n:12.3f} {n / wall:12.1f} "
          f"{comp:>9}  {note}", flush=True)


def main():
    n = 16 if ARGS.quick else ARGS.n
    repeats = 1 if ARGS.quick else ARGS.repeats
    prob = problems.robertson()
    solve = peers.daeadjoint_solve(prob)          # args -> (ys, num_steps)
    pb = prob.batch_args(n)
    print(f"backend {jax.default_backend()}, {jax.device_count()} device(s): "
          f"{jax.devices()[0].device_kind}; {n} members; jax {jax.__version__}")
    print(f"{'':<50} {'n':>6} {'wall s':>10} {'ms/member':>12} {'members/s':>12} "
          f"{'compile s':>9}")

    if ARGS.chunks is not None:
        chunk_sweep(solve, pb, n, repeats)
        return

    # jit(vmap(solve)), one device.
    t = time.perf_counter()
    vm = jax.jit(jax.vmap(solve)).lower(pb).compile()
    compile_s = time.perf_counter() - t
    ys, steps = vm(pb)
    wall = _median_wall(lambda: vm(pb), repeats)
    _row("daeadjoint jit(vmap)", n, wall, compile_s,
         f"steps {int(np.min(steps))}-{int(np.max(steps))}")

    if not ARGS.vmap_only:
        extras(prob, solve, pb, n, repeats, ys)
    peer_rows(prob, pb, n, repeats)


def extras(prob, solve, pb, n, repeats, ys):
    """`ensemble`, the queue, batches of other spreads and `vmap(grad)`."""
    # ensemble over all local devices (compiles inside the first call).
    chunk = ARGS.chunk or n
    ens = lambda: dae.ensemble(solve, pb, chunk_size=chunk)  # noqa: E731
    t = time.perf_counter()
    ens()
    first = time.perf_counter() - t
    wall = _median_wall(ens, repeats)
    ys_e, _ = ens()
    diff = float(np.max(np.abs(np.asarray(ys_e) - np.asarray(ys))))
    _row(f"daeadjoint ensemble ({jax.local_device_count()} dev, chunk {chunk})", n, wall,
         max(first - wall, 0.0), f"max |diff| vs vmap {diff:.1e}")

    # solve_ensemble's queue on the same batch (64 slots refilled).
    residual = peers.jax_residual(prob)
    yp0s = np.stack([np.asarray(prob.yp0(a, peers.JAX)) for a in pb])
    q = lambda: dae.solve_ensemble(  # noqa: E731
        residual, prob.t0, prob.t1, jnp.asarray(prob.y0), yp0s, pb, batch=("yp0", "args"),
        saveat=jnp.asarray(prob.ts), algebraic=prob.algebraic, rtol=prob.rtol,
        atol=jnp.asarray(prob.atol), max_steps=peers.MAX_STEPS, queue=True).ys
    t = time.perf_counter()
    q()
    first = time.perf_counter() - t
    wall = _median_wall(q, repeats)
    diff = float(np.max(np.abs(np.asarray(q()) - np.asarray(ys))))
    _row("daeadjoint solve_ensemble (queue, 64 slots)", n, wall, max(first - wall, 0.0),
         f"max |diff| vs vmap {diff:.1e}")

    # Heterogeneous vs homogeneous batches through `solve_ensemble`, one chunk (all
    # members in one lock-step vmap: the path before the queue) and the queue (64 slots
    # refilled, segments of 64 steps), runs interleaved.
    hetero_vs_homogeneous(prob, n, repeats)

    if not ARGS.no_grad:
        g = jax.grad(lambda a: jnp.sum(solve(a)[0][-1]))
        t = time.perf_counter()
        vg = jax.jit(jax.vmap(g)).lower(pb).compile()
        compile_s = time.perf_counter() - t
        wall = _median_wall(lambda: vg(pb), repeats)
        _row("daeadjoint jit(vmap(grad))", n, wall, compile_s)


def chunk_sweep(solve, pb, n, repeats):
    """`ensemble` of the batch in chunks of each size of --chunks and in one chunk (the
    whole batch), timed in interleaved rounds: the process's CPU seconds (all threads;
    less disturbed by other work on the machine than the wall time) and wall seconds,
    medians over the rounds; with the largest step count of the chunks' slowest members
    (a chunk runs until its slowest member is done)."""
    sizes = sorted(set(ARGS.chunks) | {n})
    runs = {c: (lambda c=c: dae.ensemble(solve, pb, chunk_size=c)) for c in sizes}
    steps = {}
    for c, run in runs.items():                          # compile and warm up
        _, s = run()
        s = np.asarray(s)
        steps[c] = [int(s[i:i + c].max()) for i in range(0, n, c)]
    cpu = {c: [] for c in sizes}
    wall = {c: [] for c in sizes}
    for _ in range(repeats):
        for c, run in runs.items():
            t, w = time.process_time(), time.perf_counter()
            jax.block_until_ready(run())
            cpu[c].append(time.process_time() - t)
            wall[c].append(time.perf_counter() - w)
    print(f"{'chunk':>6} {'CPU ms/member':>14} {'wall ms/member':>15} {'slowest member steps':>22}")
    for c in sizes:
        print(f"{c:>6} {1e3 * statistics.median(cpu[c]) / n:14.3f} "
              f"{1e3 * statistics.median(wall[c]) / n:15.3f} "
              f"{min(steps[c]):>10}-{max(steps[c])}")
    print(f"load average {os.getloadavg()}")


def peer_rows(prob, pb, n, repeats):
    # Peers (CPU): a loop of compiled IDAS calls; diffsol-jax's vmap; a pydiffsol loop.
    try:
        casadi = peers.prepare_casadi(prob)
        casadi.run(pb[0])
        res = peers.batch_sequential(casadi, pb)
        _row(f"{casadi.label} loop", n, res["total_s"], res["compile_or_setup_s"])
    except Exception as err:  # noqa: BLE001 - a missing peer is reported, not fatal
        print(f"IDAS (casadi): unavailable ({type(err).__name__}: {err})")
    if jax.default_backend() == "cpu":
        try:
            dj, setup = peers.diffsol_jax_solve(prob)
            res = peers.batch_vmap("diffsol-jax", dj, pb, repeats)
            _row("diffsol-jax vmap", n, res["total_s"], res["compile_or_setup_s"] + setup)
        except Exception as err:  # noqa: BLE001
            print(f"diffsol-jax: unavailable ({type(err).__name__}: {err})")
    else:
        print("diffsol-jax: CPU only (an XLA custom call), skipped on this backend")
    try:
        pds = peers.prepare_pydiffsol(prob)
        pds.run(pb[0])
        res = peers.batch_sequential(pds, pb)
        _row(f"{pds.label} loop", n, res["total_s"], res["compile_or_setup_s"])
    except Exception as err:  # noqa: BLE001
        print(f"pydiffsol: unavailable ({type(err).__name__}: {err})")


def hetero_vs_homogeneous(prob, n, repeats):
    """Cost per member-step of a heterogeneous batch (p1 over four decades and the end
    time over ten, t1 = 4 ... 4e10 shuffled: step counts differing ~8x; p1 alone moves
    them by less than 1.6x) against a homogeneous one (p1 over one decade, t1 = 4e6),
    each in one lock-step chunk and through the queue."""
    residual = peers.jax_residual(prob)
    rng = np.random.default_rng(0)
    het = np.tile(prob.args, (n, 1))
    het[:, 0] *= 10.0 ** np.linspace(-2.0, 2.0, n)
    batches = {"homogeneous": (prob.batch_args(n), np.full(n, 4e6)),
               "heterogeneous": (het, rng.permutation(4.0 * 10.0 ** np.linspace(0, 10, n)))}
    yp0 = {k: np.stack([np.asarray(prob.yp0(a, peers.JAX)) for a in v[0]])
           for k, v in batches.items()}
    kw = dict(algebraic=prob.algebraic, rtol=prob.rtol, atol=jnp.asarray(prob.atol),
              max_steps=peers.MAX_STEPS, batch=("t1", "yp0", "args"))
    paths = {"one chunk (lock-step)": dict(queue=False, chunk_size=n),
             "queue, 64 slots": dict(queue=True)}

    def run(name, path):
        args, t1 = batches[name]
        return dae.solve_ensemble(residual, prob.t0, t1, jnp.asarray(prob.y0), yp0[name],
                                  args, **kw, **paths[path])

    steps, walls, ys = {}, {}, {}
    for name in batches:
        for path in paths:
            sol = run(name, path)                       # compile
            steps[name] = np.asarray(sol.stats["num_steps"])
            ys[name, path] = np.asarray(sol.ys)
    for _ in range(repeats):                            # interleaved
        for name in batches:
            for path in paths:
                t = time.perf_counter()
                jax.block_until_ready(run(name, path).ys)
                walls.setdefault((name, path), []).append(time.perf_counter() - t)
    print(f"  heterogeneous vs homogeneous ({os.getloadavg()[0]:.1f} load): steps "
          f"{steps['heterogeneous'].min()}-{steps['heterogeneous'].max()} "
          f"(total {steps['heterogeneous'].sum()}) vs "
          f"{steps['homogeneous'].min()}-{steps['homogeneous'].max()} "
          f"(total {steps['homogeneous'].sum()})")
    for path in paths:
        per = {}
        for name in batches:
            wall = statistics.median(walls[name, path])
            per[name] = wall / steps[name].sum()
            _row(f"solve_ensemble {path}, {name}", n, wall)
        diff = float(np.max(np.abs(ys["heterogeneous", path]
                                   - ys["heterogeneous", "one chunk (lock-step)"])))
        print(f"  {path}: heterogeneous / homogeneous cost per member-step "
              f"{per['heterogeneous'] / per['homogeneous']:.2f}; max |diff| vs one chunk "
              f"{diff:.1e}")


if __name__ == "__main__":
    main()
