"""Robertson against the native peers: one solve, one gradient, batches, compile times.

    OPENBLAS_NUM_THREADS=1 python benchmarks/small_peers.py            # batch 256, 5 repeats
    OPENBLAS_NUM_THREADS=1 python benchmarks/small_peers.py --quick    # batch 16, 2 repeats

Columns: daeadjoint, pydiffsol (diffsol's BDF from Python), diffsol-jax (diffsol inside a
jitted JAX program; ODE form, forward only here) and IDAS (casadi, gcc-compiled model).
All on `problems.robertson()`: 0 … 4e10, 12 outputs, rtol 1e-6, atol (1e-10, 1e-14, 1e-8)
(the diffsol peers in scaled unknowns, which reproduces IDAS's per-component atol
exactly; see `peers.ROBERTSON_DIFFSL`). Gradient: dG/dp of G = ∫_0^4e10 y3 dt, daeadjoint
by `Adjoint(atol=1e-8)` (as benchmarks/gradients.py), pydiffsol by its continuous adjoint
(adjoint atol 1e-8; forward atol 1e-10 for all components, see
`peers.prepare_pydiffsol_gradient`).
Batches: p1 scaled by 10**linspace(-0.5, 0.5, N); `jit(vmap)` for the JAX solvers, a
Python loop of warm calls for the others. "first call" is the compile or build time (JAX:
first call minus a warm one; vmap: ahead-of-time compile; pydiffsol: building the model).
sundials4py (IDAS's official bindings) needs Python >= 3.12 and is not run here.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the working-tree daeadjoint
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax
import jax.numpy as jnp
import numpy as np

import peers
import problems


def _guard(label, fn, *a):
    try:
        return fn(*a)
    except Exception as e:  # noqa: BLE001 - one missing peer must not stop the table
        return dict(label=label, error=f"{type(e).__name__}: {str(e).splitlines()[0][:120]}")


def gradient_G(prob):
    """p -> dG/dp, G = ∫ y3 dt, daeadjoint's continuous adjoint (atol 1e-8)."""
    import daeadjoint as dae

    res = problems.jax_residual(prob)
    y0, atol = jnp.asarray(prob.y0), jnp.asarray(prob.atol)

    def G(p):
        sol = dae.solve(res, prob.t0, prob.t1, y0, prob.yp0(p, problems.JAX), p,
                        saveat=jnp.reshape(prob.t1, (1,)), algebraic=prob.algebraic,
                        rtol=prob.rtol, atol=atol, quadrature=lambda t, y, yp, p: y[2:3],
                        max_steps=peers.MAX_STEPS, sensitivity=dae.Adjoint(atol=1e-8))
        return sol.qs[-1, 0]

    return jax.grad(G)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--batch", type=int, default=None)
    opt = ap.parse_args()
    repeats = 2 if opt.quick else 5
    nb = opt.batch or (16 if opt.quick else 256)
    prob = problems.robertson()
    p = np.asarray(prob.args, float)
    pb = prob.batch_args(nb)

    idas = peers.prepare_casadi(prob)
    ref = peers.measure(idas, p, repeats)
    grad_fn = gradient_G(prob)
    dj = _guard("diffsol-jax", peers.diffsol_jax_solve, prob)
    cols = {
        "daeadjoint": peers.prepare_jax("daeadjoint", peers.daeadjoint_solve(prob)),
        "pydiffsol": _guard("pydiffsol", peers.prepare_pydiffsol, prob),
        "diffsol-jax": dj if isinstance(dj, dict) else
        peers.Prepared("diffsol-jax", (lambda f: lambda a: jax.block_until_ready(f(a)))(
            jax.jit(dj[0])), lambda out, a: (np.asarray(out[0]), 0), dj[1]),
    }
    fwd = {"IDAS (casadi)": ref}
    for name, prep in cols.items():
        fwd[name] = prep if isinstance(prep, dict) else _guard(name, peers.measure, prep, p,
                                                               repeats)
    # gradients
    grads = {}
    ours = peers.Prepared("daeadjoint grad", lambda a: jax.block_until_ready(
        grad_jit(jnp.asarray(a))), lambda out, a: (np.asarray(out)[None], 0))
    grad_jit = jax.jit(grad_fn)
    grads["daeadjoint"] = peers.measure(ours, p, repeats)
    pg = _guard("pydiffsol", peers.prepare_pydiffsol_gradient, prob)
    grads["pydiffsol"] = pg if isinstance(pg, dict) else _guard("pydiffsol", peers.measure, pg,
                                                                 p, repeats)
    # batches
    batch = {"IDAS (casadi)": peers.batch_sequential(idas, pb)}
    batch["daeadjoint"] = peers.batch_vmap("daeadjoint", peers.daeadjoint_solve(prob), pb, repeats)
    if not isinstance(cols["pydiffsol"], dict):
        batch["pydiffsol"] = peers.batch_sequential(cols["pydiffsol"], pb)
    if not isinstance(dj, dict):
        batch["diffsol-jax"] = peers.batch_vmap("diffsol-jax", dj[0], pb, repeats)
    bgrad = {}
    bgrad["daeadjoint"] = peers.batch_vmap("daeadjoint grad", lambda a: (grad_fn(a), 0), pb,
                                           repeats)
    if not isinstance(pg, dict):
        bgrad["pydiffsol"] = peers.batch_sequential(pg, pb)

    names = ["daeadjoint", "pydiffsol", "diffsol-jax", "IDAS (casadi)"]

    def cell(d, key, scale, spec):
        if d is None:
            return "–"
        if "error" in d:
            return "n/a (" + d["error"] + ")"
        return format(d[key] * scale, spec)

    print(f"# Robertson against native peers — {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M}"
          f" UTC\n\n{platform.machine()}, {os.cpu_count()} CPUs, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; jax {jax.__version__}; "
          f"batch {nb}; medians of {repeats} warm runs\n")
    print("| | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    print("| forward, ms | " + " | ".join(cell(fwd.get(n), "wall_median_s", 1e3, ".2f")
                                         for n in names) + " |")
    print("| forward steps | " + " | ".join(
        "–" if fwd.get(n) is None or "error" in fwd[n] or not fwd[n]["steps"]
        else str(fwd[n]["steps"]) for n in names) + " |")
    print("| forward max rel diff to IDAS (all outputs) | " + " | ".join(
        "–" if fwd.get(n) is None or "error" in fwd[n] else
        f"{peers.max_rel_diff(fwd[n]['ys'], ref['ys'], prob.atol):.1e}" for n in names) + " |")
    print("| gradient dG/dp, ms | " + " | ".join(cell(grads.get(n), "wall_median_s", 1e3, ".2f")
                                                for n in names) + " |")
    print(f"| batch of {nb}, forward, ms per member | " + " | ".join(
        cell(batch.get(n), "total_s", 1e3 / nb, ".3f") for n in names) + " |")
    print(f"| batch of {nb}, gradient, ms per member | " + " | ".join(
        cell(bgrad.get(n), "total_s", 1e3 / nb, ".3f") for n in names) + " |")
    print("| first call (compile/build), forward, s | " + " | ".join(
        cell(fwd.get(n), "compile_or_setup_s", 1, ".2f") for n in names) + " |")
    print("| first call, gradient, s | " + " | ".join(
        cell(grads.get(n), "compile_or_setup_s", 1, ".2f") for n in names) + " |")
    print(f"| compile, vmap forward ({nb}), s | " + " | ".join(
        cell(batch.get(n), "compile_or_setup_s", 1, ".2f") if n in ("daeadjoint", "diffsol-jax")
        else "–" for n in names) + " |")
    print(f"| compile, vmap(grad) ({nb}), s | " + " | ".join(
        cell(bgrad.get(n), "compile_or_setup_s", 1, ".2f") if n == "daeadjoint" else "–"
        for n in names) + " |")
    if "error" not in grads["pydiffsol"]:
        g0, g1 = grads["daeadjoint"]["ys"][0], grads["pydiffsol"]["ys"][0]
        print(f"\ndG/dp: daeadjoint {g0}, pydiffsol {g1}; max rel diff "
              f"{np.max(np.abs(g1 - g0) / np.abs(g0)):.1e}")


if __name__ == "__main__":
    main()
