"""Run every benchmark and print Markdown tables.

    python benchmarks/run.py [--quick] [--batch N]

Table 1: one solve at the nominal parameters per problem and solver.
Table 2: the same problem at a batch of parameter sets: casadi IDAS called
sequentially vs one ``jax.vmap``-ed, jitted solve (diffrax, daeadjoint).
The reference for ratios and differences is casadi IDAS.  ``daeadjoint`` rows are
guarded: while the package is missing or failing, they print 'n/a' and the error.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the working-tree daeadjoint
# Single-threaded LAPACK for every solver here (jaxlib's CPU LU calls scipy's OpenBLAS):
# on a busy 2-core machine its spinning threads made small LUs ~100x slower
# (docs/solving.md).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import casadi
import diffrax
import jax
import numpy as np
import sksundae

import peers
from problems import PROBLEMS, Problem


def _error_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:160]


def _guarded(label: str, fn, *a) -> dict:
    """fn(*a), or an error row carrying the exception's first line."""
    try:
        return fn(*a)
    except Exception as e:  # noqa: BLE001 - a failing solver must not stop the report
        return dict(label=label, error=_error_line(e))


def _fmt(x, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def single_rows(prob: Problem, repeats: int) -> tuple[list[dict], peers.Prepared]:
    """Table 1 rows for one problem; also returns the IDAS runner for the batch."""
    idas = peers.prepare_casadi(prob)
    ref = peers.measure(idas, prob.args, repeats)
    candidates = {
        "IDA (scikit-sundae)": lambda: peers.prepare_sksundae(prob),
        "diffrax Kvaerno5": lambda: peers.prepare_jax("diffrax Kvaerno5",
                                                      peers.diffrax_solve(prob)),
        "daeadjoint": lambda: peers.prepare_jax("daeadjoint", peers.daeadjoint_solve(prob)),
    }
    rows = [ref] + [_guarded(label, lambda m=make: peers.measure(m(), prob.args, repeats))
                    for label, make in candidates.items()]
    for r in rows:
        if "error" not in r:
            r["ratio"] = r["wall_median_s"] / ref["wall_median_s"]
            r["diff_final"] = peers.max_rel_diff(r["y_final"], ref["y_final"], prob.atol)
            r["diff_all"] = peers.max_rel_diff(r["ys"], ref["ys"], prob.atol)
    return rows, idas


def batch_rows(prob: Problem, idas: peers.Prepared, n: int, repeats: int) -> list[dict]:
    """Table 2 rows: n parameter sets, sequential IDAS vs vmapped JAX solvers."""
    args = prob.batch_args(n)
    ref = peers.batch_sequential(idas, args)
    solvers = {"diffrax Kvaerno5": peers.diffrax_solve, "daeadjoint": peers.daeadjoint_solve}
    rows = [ref] + [
        _guarded(f"{label} vmap",
                 lambda l=label, f=make: peers.batch_vmap(l, f(prob), args, repeats))
        for label, make in solvers.items()]
    for r in rows:
        if "error" not in r:
            r["throughput"] = ref["total_s"] / r["total_s"]
            r["diff_final"] = peers.max_rel_diff(r["y_final"], ref["y_final"], prob.atol)
    return rows


def print_single(results: list[tuple[Problem, list[dict]]]) -> None:
    print("| problem | solver | compile/setup s | median wall s | steps | wall / IDAS "
          "| max rel diff final y | max rel diff all saved y | note |")
    print("|---|---|---|---|---|---|---|---|---|")
    for prob, rows in results:
        for r in rows:
            print(f"| {prob.name} | {r['label']} | {_fmt(r.get('compile_or_setup_s'), '.3f')} "
                  f"| {_fmt(r.get('wall_median_s'), '.4f')} | {r.get('steps', 'n/a')} "
                  f"| {_fmt(r.get('ratio'), '.2f')} | {_fmt(r.get('diff_final'), '.1e')} "
                  f"| {_fmt(r.get('diff_all'), '.1e')} | {r.get('error', '')} |")


def print_batch(results: list[tuple[Problem, list[dict]]], n: int) -> None:
    print(f"| problem | solver (batch of {n}) | compile/setup s | total wall s | ms per solve "
          "| throughput vs IDAS sequential | max rel diff final y | note |")
    print("|---|---|---|---|---|---|---|---|")
    for prob, rows in results:
        for r in rows:
            total = r.get("total_s")
            print(f"| {prob.name} | {r['label']} | {_fmt(r.get('compile_or_setup_s'), '.3f')} "
                  f"| {_fmt(total, '.3f')} | {_fmt(total and 1e3 * total / n, '.2f')} "
                  f"| {_fmt(r.get('throughput'), '.3g')}{'x' * ('throughput' in r)} "
                  f"| {_fmt(r.get('diff_final'), '.1e')} "
                  f"| {r.get('error', '')} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 repeats, batch of 16")
    parser.add_argument("--batch", type=int, help="batch size (default 256, quick 16)")
    opts = parser.parse_args()
    repeats, n_batch, batch_repeats = (2, 16, 1) if opts.quick else (5, 256, 3)
    n_batch = opts.batch or n_batch

    print(f"# daeadjoint benchmarks ({'quick' if opts.quick else 'full'})\n")
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"jax {jax.__version__} ({jax.default_backend()}, x64), diffrax {diffrax.__version__}, "
          f"casadi {casadi.__version__}, scikit-sundae {sksundae.__version__}; "
          f"median of {repeats} warm runs; 1-min load average before start "
          f"{os.getloadavg()[0]:.2f} (other work on the machine skews the timings)\n")
    problems = [make() for make in PROBLEMS.values()]
    single, batch = [], []
    for prob in problems:
        rows, idas = single_rows(prob, repeats)
        single.append((prob, rows))
        batch.append((prob, batch_rows(prob, idas, n_batch, batch_repeats)))
    print_single(single)
    print()
    print_batch(batch, n_batch)


if __name__ == "__main__":
    main()
