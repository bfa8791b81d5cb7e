"""Peak memory of a large ensemble: 10⁵ Robertson parameter sets in one
`daeadjoint.solve_ensemble` call, chunked, against the memory of one chunk.

    OPENBLAS_NUM_THREADS=1 python benchmarks/ensemble_memory.py                # 100 000 members
    OPENBLAS_NUM_THREADS=1 python benchmarks/ensemble_memory.py -n 20000 --chunk 2048

Problem: `problems.robertson()` (0 … 4e10, rtol 1e-6, IDAS's atol), the final state only
(`saveat=[t1]`), p1 scaled by 10**uniform(−0.5, 0.5). Peak RSS is the process's
high-water mark (`resource.getrusage`, Linux: KiB), read after importing JAX, after the
first chunk (compilation included) and after the whole ensemble: the ensemble's cost
beyond one chunk is its results (members × n numbers and statistics) — the solver's
working memory is that of one chunk, whatever the number of members. A JAX-only run with
`memory_limit` instead of `chunk_size` picks the chunk from XLA's memory analysis.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the working-tree daeadjoint

import jax
import jax.numpy as jnp
import numpy as np

jax.config.update("jax_enable_x64", True)

import daeadjoint as dae  # noqa: E402
import problems  # noqa: E402


def robertson(t, y, yp, p):
    """Robertson's kinetics, y3 algebraic (SUNDIALS idasRoberts_dns; = problems.robertson)."""
    r1, r2, r3 = p[0] * y[0], p[1] * y[1] * y[2], p[2] * y[1] ** 2
    return jnp.stack([yp[0] + r1 - r2, yp[1] - r1 + r2 + r3, y[0] + y[1] + y[2] - 1.0])


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=100_000, help="members (default 100 000)")
    ap.add_argument("--chunk", type=int, default=4096, help="chunk size (default 4096)")
    ap.add_argument("--memory-limit-mib", type=float, default=None,
                    help="choose the chunk by XLA's memory analysis instead of --chunk")
    args = ap.parse_args()

    prob = problems.robertson()
    rss_import = peak_rss_mib()
    rng = np.random.default_rng(0)
    ps = np.tile(prob.args, (args.n, 1))
    ps[:, 0] *= 10.0 ** rng.uniform(-0.5, 0.5, args.n)
    y0 = jnp.asarray(prob.y0)
    t1 = float(prob.ts[-1])
    alg = np.zeros(3, bool)
    alg[prob.alg_idx] = True
    kw = dict(saveat=jnp.array([t1]), rtol=prob.rtol, atol=jnp.asarray(prob.atol),
              algebraic=jnp.asarray(alg))
    if args.memory_limit_mib is not None:
        size = dict(memory_limit=int(args.memory_limit_mib * 2**20))
        label = f"memory_limit {args.memory_limit_mib:g} MiB"
    else:
        size = dict(chunk_size=args.chunk)
        label = f"chunk {args.chunk}"

    first = min(args.n, args.chunk)
    t = time.perf_counter()
    sol1 = dae.solve_ensemble(robertson, prob.t0, t1, y0, args=jnp.asarray(ps[:first]),
                              **kw, **size)
    jax.block_until_ready(sol1.ys)
    t_first = time.perf_counter() - t
    rss_chunk = peak_rss_mib()

    t = time.perf_counter()
    sol = dae.solve_ensemble(robertson, prob.t0, t1, y0, args=jnp.asarray(ps), **kw,
                             **size, progress=True)
    jax.block_until_ready(sol.ys)
    wall = time.perf_counter() - t
    rss_all = peak_rss_mib()
    ok = np.asarray(sol.result == dae.RESULTS.successful)
    steps = np.asarray(sol.stats["num_steps"])
    results = sum(np.asarray(x).nbytes for x in jax.tree_util.tree_leaves(sol)) / 2**20

    print(f"# Ensemble memory, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; jax "
          f"{jax.__version__}, {jax.device_count()} device(s)")
    print(f"members {args.n}, {label}; {int(ok.sum())} successful; steps "
          f"{steps.min()}–{steps.max()} (mean {steps.mean():.0f})")
    print(f"first chunk of {first} (compilation included): {t_first:.1f} s")
    print(f"whole ensemble: {wall:.1f} s = {1e3 * wall / args.n:.3f} ms per member")
    print(f"peak RSS: after import {rss_import:.0f} MiB, after one chunk {rss_chunk:.0f} MiB, "
          f"after the ensemble {rss_all:.0f} MiB (results {results:.1f} MiB)")
    if not ok.all():
        print(f"WARNING: {int((~ok).sum())} members failed", file=sys.stderr)


if __name__ == "__main__":
    main()
