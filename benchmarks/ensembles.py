"""Ensembles of Robertson problems: per-member throughput of `jax.jit(jax.vmap)`,
`daeadjoint.ensemble` (chunked, split over the local devices) and `vmap(grad)`, against a
loop of compiled IDAS calls (casadi) and diffsol-jax's vmap where installed; and a
heterogeneous batch (p1 over four decades) against a homogeneous one, and in chunks
as given or sorted by cost (`ensemble(cost=...)`).

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
    return p.parse_args()


ARGS = _parse()
if ARGS.host_devices:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={ARGS.host_devices}")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the working-tree daeadjoint

import functools  # noqa: E402
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
    hetero = np.tile(prob.args, (n, 1))
    hetero[:, 0] *= 10.0 ** np.linspace(-2.0, 2.0, n)
    print(f"backend {jax.default_backend()}, {jax.device_count()} device(s): "
          f"{jax.devices()[0].device_kind}; {n} members; jax {jax.__version__}")
    print(f"{'':<50} {'n':>6} {'wall s':>10} {'ms/member':>12} {'members/s':>12} "
          f"{'compile s':>9}")

    # jit(vmap(solve)), one device.
    t = time.perf_counter()
    vm = jax.jit(jax.vmap(solve)).lower(pb).compile()
    compile_s = time.perf_counter() - t
    ys, steps = vm(pb)
    wall = wall_vm = _median_wall(lambda: vm(pb), repeats)
    _row("daeadjoint jit(vmap)", n, wall, compile_s,
         f"steps {int(np.min(steps))}-{int(np.max(steps))}")

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

    # Heterogeneous batch: p1 over four decades, vs the homogeneous batch per step.
    hs = jax.block_until_ready(vm(hetero))[1]
    wall_h = _median_wall(lambda: vm(hetero), repeats)
    steps_h, steps_u = np.asarray(hs), np.asarray(steps)
    _row("daeadjoint jit(vmap), p1 over 4 decades", n, wall_h, None,
         f"steps {steps_h.min()}-{steps_h.max()}")
    per_step_h = wall_h / steps_h.sum()
    per_step_u = wall_vm / steps_u.sum()
    print(f"  heterogeneous / homogeneous cost per member-step: {per_step_h / per_step_u:.2f} "
          f"(lock-step bound: max/mean steps {steps_h.max() / steps_h.mean():.2f})")

    # The same heterogeneous batch in chunks of n/4, in the given order and sorted by
    # cost (here each member's own step count, a perfect pilot).
    q = max(n // 4, 1)
    dae.ensemble(solve, hetero, chunk_size=q)       # compile
    for label, cost in (("as given", None), ("sorted by steps", steps_h)):
        run = functools.partial(dae.ensemble, solve, hetero, chunk_size=q, cost=cost)
        _row(f"ensemble, chunks of {q}, p1/4 decades, {label}", n, _median_wall(run, repeats))

    if not ARGS.no_grad:
        g = jax.grad(lambda a: jnp.sum(solve(a)[0][-1]))
        t = time.perf_counter()
        vg = jax.jit(jax.vmap(g)).lower(pb).compile()
        compile_s = time.perf_counter() - t
        wall = _median_wall(lambda: vg(pb), repeats)
        _row("daeadjoint jit(vmap(grad))", n, wall, compile_s)

    # Peers (CPU): a loop of compiled IDAS calls; diffsol-jax's vmap.
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


if __name__ == "__main__":
    main()
