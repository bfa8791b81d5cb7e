"""Food web (Li & Petzold, DASPKADJOINT, §7.2.1; 800 unknowns): forward and gradient wall
time of daeadjoint's matrix-free Krylov solver, against IDA (scikit-sundae) with its
banded direct solver and with unpreconditioned GMRES on the same residual.

    OPENBLAS_NUM_THREADS=1 python benchmarks/krylov.py [--repeats 5]

daeadjoint: `jax.jit` functions, compile time = first call − median, median of warm
repeats. Forward = consistent initialization (init="ya_ydp") + integration to T = 5 at
rtol = atol = 1e-5; gradient = jax.grad of g1 = Σu(T)² w.r.t. (α, β) (forward pass with
checkpoints + continuous adjoint). IDA: scikit-sundae (SUNDIALS IDA, Python residual
in NumPy, the same equations, the same IC correction), one `solve` per repeat; IDA has
no adjoint in scikit-sundae, so its gradient column is n/a.
"""

import argparse
import os
import pathlib
import statistics
import sys
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))   # the working-tree daeadjoint, and its tests' helpers

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_enable_x64", True)

import daeadjoint as dae  # noqa: E402
from tests import foodweb as fw  # noqa: E402


def timed(fn, repeats):
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn())
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    return out, first - med, med


def daeadjoint_rows(repeats):
    p = jnp.array([fw.ALPHA, fw.BETA])
    rows = []
    configs = {
        "Krylov(block-diag user P)": dae.Krylov(preconditioner=fw.block_preconditioner()),
        "Krylov(block-diag P, maxl=10)": dae.Krylov(preconditioner=fw.block_preconditioner(),
                                                    maxl=10),
        "DenseLU": dae.DenseLU(),
    }
    for name, ls in configs.items():
        fwd = jax.jit(lambda p, ls=ls: fw.solve_foodweb(p, ls))
        grad = jax.jit(jax.grad(lambda p, ls=ls: fw.g1(p, ls)))
        sol, c_f, t_f = timed(lambda: fwd(p), repeats)
        g, c_g, t_g = timed(lambda: grad(p), repeats)
        st = {k: int(v) for k, v in sol.stats.items() if k.startswith("num")}
        rows.append(dict(solver=f"daeadjoint {name}", compile=c_f + c_g, fwd=t_f, grad=t_g,
                         steps=st["num_steps"], nli=st.get("num_linear_iters", "-"),
                         npe=st["num_jacobian_evals"],
                         g1=float(jnp.sum(sol.ys[-1] ** 2)),
                         dg=f"{float(g[0]):.2f}, {float(g[1]):.2f}"))
    return rows


def ida_rows(repeats):
    try:
        from sksundae.ida import IDA
    except Exception as e:    # noqa: BLE001
        return [dict(solver="IDA (scikit-sundae)", note=f"n/a: {e}")]
    m = fw.M
    residual = fw.make_residual(m)
    c0, cp0 = (np.asarray(v) for v in fw.initial_values(m))
    # IDACalcIC through scikit-sundae fails from the paper's c² = 100 guess ("couldn't
    # recover from a resfn or linsolver error"), so IDA starts from the consistent
    # values daeadjoint's initialization computes (its IC time is then not included).
    c0_dae, cp0_dae = (np.asarray(v) for v in fw.initial_values(m))
    init = dae.solve(residual, 0.0, 1e-6, jnp.asarray(c0_dae), jnp.asarray(cp0_dae),
                     jnp.array([fw.ALPHA, fw.BETA]),
                     algebraic=fw.algebraic_mask(m), init="ya_ydp", rtol=fw.RTOL,
                     atol=fw.ATOL, saveat=jnp.array([0.0]), max_steps=100,
                     linear_solver=dae.Krylov(preconditioner=fw.block_preconditioner()))
    c0, cp0 = np.asarray(init.ys[0]), np.asarray(init.yps[0])
    pnp = np.array([fw.ALPHA, fw.BETA])
    res_jit = jax.jit(lambda t, y, yp: residual(t, y, yp, pnp))
    X, Y = fw.grid(m)
    b1 = 1.0 + fw.ALPHA * X * Y + fw.BETA * np.sin(4 * np.pi * X) * np.sin(4 * np.pi * Y)
    h2 = (1.0 / (m - 1)) ** 2

    def resfn(t, y, yp, res):
        # NumPy twin of tests/foodweb.py's residual (no JAX dispatch per call).
        g = y.reshape(m, m, 2)
        c1, c2 = g[..., 0], g[..., 1]
        f1 = c1 * (b1 - c1 - 0.5e-6 * c2)
        f2 = c2 * (-b1 + 1e4 * c1 - c2)
        pad = np.pad(g, ((1, 1), (1, 1), (0, 0)), mode="reflect")
        lap = (pad[2:, 1:-1] + pad[:-2, 1:-1] + pad[1:-1, 2:] + pad[1:-1, :-2] - 4 * g) / h2
        rate = np.stack([f1, f2], -1) + fw.DIFF * lap
        r = np.stack([yp.reshape(m, m, 2)[..., 0] - rate[..., 0], -rate[..., 1]], -1)
        res[:] = r.reshape(-1)

    # The NumPy residual must be the JAX one.
    chk = np.empty(2 * m * m)
    resfn(0.0, c0, cp0, chk)
    assert np.allclose(chk, np.asarray(res_jit(0.0, c0, cp0)), rtol=1e-12, atol=1e-9)
    alg = np.where(np.asarray(fw.algebraic_mask(m)))[0]
    rows = []
    for name, opts in {"band (lband = uband = 2M)": dict(linsolver="band", lband=2 * m,
                                                           uband=2 * m),
                       "gmres (no preconditioner)": dict(linsolver="gmres", krylov_dim=5)}.items():
        solver = IDA(resfn, rtol=fw.RTOL, atol=fw.ATOL, algebraic_idx=alg,
                     max_num_steps=20000, **opts)
        times, sol = [], None
        try:
            for _ in range(repeats + 1):
                t0 = time.perf_counter()
                sol = solver.solve(np.array([0.0, fw.T_FINAL]), c0.copy(), cp0.copy())
                times.append(time.perf_counter() - t0)
        except Exception as e:    # noqa: BLE001
            rows.append(dict(solver=f"IDA (scikit-sundae) {name}", note=f"failed: {e}"))
            continue
        ok = bool(sol.success)
        g1 = float(np.sum(sol.y[-1] ** 2)) if ok else float("nan")
        rows.append(dict(solver=f"IDA (scikit-sundae) {name}", compile=0.0,
                         fwd=statistics.median(times[1:]), grad=None,
                         steps="-", nli="-", npe="-", g1=g1,
                         dg="n/a", note="" if ok else sol.message))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    rows = ida_rows(args.repeats) + daeadjoint_rows(args.repeats)
    print("| solver | compile s | forward s | gradient s | grad/fwd | steps | lin. iters | "
          "P setups | g1 | dg1/dα, dg1/dβ |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "fwd" not in r:
            print(f"| {r['solver']} | {r['note']} |")
            continue
        grad = f"{r['grad']:.3f}" if r["grad"] is not None else "n/a"
        ratio = f"{r['grad'] / r['fwd']:.1f}" if r["grad"] is not None else "n/a"
        print(f"| {r['solver']} | {r['compile']:.1f} | {r['fwd']:.3f} | {grad} | {ratio} | "
              f"{r['steps']} | {r['nli']} | {r['npe']} | {r['g1']:.6g} | {r['dg']} |"
              + (f" {r['note']}" if r.get("note") else ""))
    print(f"\nLi & Petzold Table 3: dg1/dα = {fw.TABLE3_AD[0]} (adjoint), {fw.TABLE3_FD[0]} (FD); "
          f"dg1/dβ = {fw.TABLE3_AD[1]}, {fw.TABLE3_FD[1]}")


if __name__ == "__main__":
    main()
