"""Large DAEs: R5 heat at n ≈ 10², 10³, 10⁴ with the banded/sparse linear solvers, side
by side with SUNDIALS IDAS in one process; prints Markdown tables.

    python benchmarks/large.py [--grids 10 40 100] [--repeats 3] [--batch 64] [--batch-grid 20]

Problem: R5 (Li & Petzold, DASPKADJOINT, §7.1.1, Table 1; `tests/problems.py` lists R1–R5):
u_t = p1 u_xx + p2 u_yy on the unit square, (M+2)² nodes, u_t = 0 on the boundary
nodes, u0 = 16x(1−x)y(1−y), T = 0.16, rtol = atol = 1e-5. g = Σ u(T)².

Table 1, per M: forward wall time (g) and gradient wall time (∇g w.r.t. p1, p2 and all
(M+2)² initial values, one reverse pass) for
  - IDAS through casadi (its sparse direct linear solver; forward with the residual
    C-compiled, the gradient by casadi's IDAS adjoint on the SX virtual machine, because
    compiling the adjoint's C code at M = 40 took gcc > 5 min and 16 GB),
  - IDA through scikit-sundae, banded (lband = uband = M + 2; forward only: it has no
    adjoint),
  - daeadjoint with BandedLU(M+2, M+2), SparseLU() (RCM + band LU; on one CPU device
    LAPACK's gbtrf as an XLA custom call), SparseLU(kernel="jax") (the pure-JAX band
    kernel used on GPUs and with several devices), SparseLU(backend="klu") and the
    default (linear_solver=None),
with ratios to IDAS (casadi) and gradient ÷ forward. Median of `repeats` warm runs after
one compile/warm-up call, solvers timed in interleaved rounds. Memory: XLA's compiled
temp + output bytes of the jitted function (`memory_analysis()`), for daeadjoint.

Table 2: a batch of `batch` heat problems at M = `batch_grid` (p1 = p2 = k, k in
linspace(0.5, 2)): one `jax.vmap`-ed solve per daeadjoint solver vs `batch` sequential
casadi IDAS calls, each g also against the exact g of the semi-discrete problem
(`exact_g`): at k = 2 g has decayed to 4e-4 of its start, u to ~100 atol, and both
solvers' global errors there are a few 1e-3 of g, so their difference from each other
is of that size too.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the working-tree daeadjoint
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")   # see benchmarks/run.py

import casadi as ca
import jax
import jax.numpy as jnp
import numpy as np
import scipy.sparse as sps
from sksundae.ida import IDA

jax.config.update("jax_enable_x64", True)

import daeadjoint as dae

T1, RTOL, ATOL = 0.16, 1e-5, 1e-5


# --------------------------------------------------------------------------- problem
def heat_residual(M: int):
    N, dx = M + 2, 1.0 / (M + 1)

    def residual(t, u, up, p):
        g = u.reshape(N, N)
        uxx = (g[2:, 1:-1] - 2 * g[1:-1, 1:-1] + g[:-2, 1:-1]) / dx**2
        uyy = (g[1:-1, 2:] - 2 * g[1:-1, 1:-1] + g[1:-1, :-2]) / dx**2
        rhs = jnp.zeros_like(g).at[1:-1, 1:-1].set(p[0] * uxx + p[1] * uyy)
        return up - rhs.reshape(-1)

    return residual


def heat_u0(M: int) -> np.ndarray:
    x = np.linspace(0.0, 1.0, M + 2)
    X, Y = np.meshgrid(x, x, indexing="ij")
    return (16 * X * (1 - X) * Y * (1 - Y)).reshape(-1)


def exact_g(M: int, k: float) -> float:
    """g = Σ u(T)² of the semi-discrete problem with p1 = p2 = k, exactly: the interior
    nodes evolve by u' = k (A ⊗ I + I ⊗ A) u with A the 1-D Dirichlet second difference,
    and u0 = f ⊗ f with f = 4x(1 − x), so u(T) = (e^{kTA} f) ⊗ (e^{kTA} f) and
    g = (Σ (e^{kTA} f)_i²)² (the boundary stays 0)."""
    import scipy.linalg as sl

    x = np.linspace(0.0, 1.0, M + 2)[1:-1]
    A = (np.diag(-2.0 * np.ones(M)) + np.diag(np.ones(M - 1), 1)
         + np.diag(np.ones(M - 1), -1)) * (M + 1) ** 2
    v = sl.expm(k * T1 * A) @ (4 * x * (1 - x))
    return float(np.sum(v ** 2) ** 2)


def second_differences(M: int):
    """Sparse (n, n) D_x, D_y with (D_x u) = u_xx at interior nodes, 0 on the boundary."""
    N, inv = M + 2, float((M + 1) ** 2)
    n = N * N
    interior = np.zeros((N, N), bool)
    interior[1:-1, 1:-1] = True
    k = np.flatnonzero(interior.ravel())
    ones = np.full(k.size, inv)

    def op(step):
        rows = np.concatenate([k, k, k])
        cols = np.concatenate([k - step, k, k + step])
        vals = np.concatenate([ones, -2 * ones, ones])
        return sps.csr_matrix((vals, (rows, cols)), shape=(n, n))

    return op(N), op(1)


# --------------------------------------------------------------------------- daeadjoint
def dae_functions(M: int, linear_solver):
    residual = heat_residual(M)

    def g(a):
        p, u0 = a
        up0 = -residual(0.0, u0, jnp.zeros_like(u0), p)
        sol = dae.solve(residual, 0.0, T1, u0, up0, p, rtol=RTOL, atol=ATOL,
                        max_steps=5000, linear_solver=linear_solver)
        return jnp.sum(sol.ys[-1] ** 2)

    return jax.jit(g), jax.jit(jax.grad(g))


def compiled_bytes(fn, *args) -> float | None:
    try:
        mem = fn.lower(*args).compile().memory_analysis()
        return (mem.temp_size_in_bytes + mem.output_size_in_bytes) / 2**20
    except Exception:  # noqa: BLE001 — not every backend reports it
        return None


# --------------------------------------------------------------------------- IDAS
def casadi_functions(M: int, jit: bool = True):
    """(forward, gradient) callables of a = (p, u0) through casadi IDAS."""
    n = (M + 2) ** 2
    Dx, Dy = second_differences(M)
    u = ca.SX.sym("u", n)
    p = ca.SX.sym("p", 2)
    ode = p[0] * ca.mtimes(ca.DM(Dx.tocsc()), u) + p[1] * ca.mtimes(ca.DM(Dy.tocsc()), u)
    opts = dict(reltol=RTOL, abstol=ATOL, max_num_steps=5000)
    dae_dict = dict(x=u, p=p, ode=ode)
    try:     # C-compile the residual as benchmarks/peers.py does
        if not jit:
            raise RuntimeError("jit off")
        with tempfile.TemporaryDirectory() as scratch, contextlib.chdir(scratch):
            F = ca.integrator("F", "idas", dae_dict, 0.0, T1,
                              dict(opts, jit=True, compiler="shell", jit_cleanup=False,
                                   jit_options=dict(flags=["-O2"], cleanup=False)))
        label = "IDAS (casadi, jit)"
    except RuntimeError:
        F = ca.integrator("F", "idas", dae_dict, 0.0, T1, opts)
        label = "IDAS (casadi, SX)"
    # The gradient through casadi's IDAS adjoint, SX virtual machine: C-compiling the
    # adjoint's functions at M = 40 ran gcc for > 5 min at 16 GB of memory.
    F_vm = ca.integrator("Fvm", "idas", dae_dict, 0.0, T1, opts)
    z = ca.MX.sym("z", n + 2)
    g = ca.sumsqr(F(x0=z[:n], p=z[n:])["xf"])
    g_vm = ca.sumsqr(F_vm(x0=z[:n], p=z[n:])["xf"])
    G = ca.Function("G", [z], [g])
    dG = ca.Function("dG", [z], [g_vm, ca.gradient(g_vm, z)])
    def fwd(a):
        return float(G(np.concatenate([a[1], a[0]])))

    def grad(a):
        _, d = dG(np.concatenate([a[1], a[0]]))
        d = np.asarray(d).ravel()
        return d[n:], d[:n]

    return label, fwd, grad


def sksundae_forward(M: int):
    """Forward g through scikit-sundae IDA with its banded linear solver."""
    n, N = (M + 2) ** 2, M + 2
    Dx, Dy = second_differences(M)

    def resfn(t, y, yp, res, args):
        res[:] = yp - args[0] * (Dx @ y) - args[1] * (Dy @ y)

    def fwd(a):
        p, u0 = a
        up0 = p[0] * (Dx @ u0) + p[1] * (Dy @ u0)
        solver = IDA(resfn, userdata=tuple(float(x) for x in p), rtol=RTOL, atol=ATOL,
                     linsolver="band", lband=N, uband=N, max_num_steps=5000)
        out = solver.solve(np.array([0.0, T1]), u0, up0)
        return float(np.sum(out.y[-1] ** 2))

    del n
    return fwd


# --------------------------------------------------------------------------- timing
def _time(fn, *a):
    t = time.perf_counter()
    out = jax.block_until_ready(fn(*a))
    return time.perf_counter() - t, out


def interleaved(fns: dict, arg, repeats: int) -> dict:
    """One warm-up call each, then `repeats` rounds calling every function once."""
    res = {}
    for name, fn in fns.items():
        try:
            first, out = _time(fn, arg)
            res[name] = dict(first=first, out=out, walls=[])
        except Exception as e:  # noqa: BLE001 — a failing solver must not stop the report
            res[name] = dict(error=f"{type(e).__name__}: {str(e).strip().splitlines()[0][:120]}")
    for _ in range(repeats):
        for name, fn in fns.items():
            if "error" not in res[name]:
                res[name]["walls"].append(_time(fn, arg)[0])
    for r in res.values():
        if "error" not in r:
            r["median"] = statistics.median(r["walls"]) if r["walls"] else r["first"]
    return res


def solvers_for(M: int, with_dense: bool):
    out = {"BandedLU": dae.BandedLU(M + 2, M + 2), "SparseLU": dae.SparseLU(),
           # the pure-JAX band kernel (GPUs, several devices) on the CPU, for comparison
           "SparseLU jax": dae.SparseLU(kernel="jax")}
    try:
        import klujax  # noqa: F401
        out["SparseLU klu"] = dae.SparseLU(backend="klu")
    except ImportError:
        pass
    out["default"] = None
    if with_dense:
        out["DenseLU"] = dae.DenseLU()
    return out


def table1(grids, repeats, dense_max, casadi_jit_max=40):
    rows = []
    for M in grids:
        n = (M + 2) ** 2
        a_np = (np.array([1.0, 1.0]), heat_u0(M))
        a = (jnp.asarray(a_np[0]), jnp.asarray(a_np[1]))
        label, c_fwd, c_grad = casadi_functions(M, jit=M <= casadi_jit_max)
        fwds = {label: c_fwd, "IDA (scikit-sundae, band)": sksundae_forward(M)}
        grads = {label: c_grad}
        mem = {}
        for name, ls in solvers_for(M, M <= dense_max).items():
            f, gr = dae_functions(M, ls)
            fwds["daeadjoint " + name] = lambda a_, f=f: f((jnp.asarray(a_[0]), jnp.asarray(a_[1])))
            grads["daeadjoint " + name] = lambda a_, gr=gr: gr((jnp.asarray(a_[0]), jnp.asarray(a_[1])))
            mem["daeadjoint " + name] = (compiled_bytes(f, a), compiled_bytes(gr, a))
        rf = interleaved(fwds, a_np, repeats)
        rg = interleaved(grads, a_np, repeats)
        ref_f = rf[label].get("median")
        ref_g = rg[label].get("median") if "error" not in rg[label] else None
        g_ref = rf[label].get("out")
        for name in fwds:
            f, g = rf[name], rg.get(name, {"error": "no adjoint"})
            row = dict(M=M, n=n, solver=name, fwd=f.get("median"), grad=g.get("median"),
                       error=f.get("error") or (g.get("error") if name in rg else "") or "",
                       compile=f.get("first"), mem=mem.get(name, (None, None)))
            if row["fwd"] and ref_f:
                row["fwd_ratio"] = row["fwd"] / ref_f
            if row["grad"] and ref_g:
                row["grad_ratio"] = row["grad"] / ref_g
            if row["fwd"] and row["grad"]:
                row["grad_per_fwd"] = row["grad"] / row["fwd"]
            if "out" in f and g_ref is not None:
                row["g_diff"] = abs(float(f["out"]) - g_ref) / abs(g_ref)
            if "out" in g and name != label and "out" in rg[label]:
                dp = np.asarray(g["out"][0])
                dp_ref = np.asarray(rg[label]["out"][0])
                row["dp_diff"] = float(np.max(np.abs(dp - dp_ref)) / np.max(np.abs(dp_ref)))
            rows.append(row)
            print_row(row, flush=True)
    return rows


def fmt(x, spec):
    return "n/a" if x is None else format(x, spec)


HEADER1 = ("| M | n | solver | fwd ms | fwd / IDAS | grad ms (all n+2 params) | grad / IDAS "
           "| grad ÷ fwd | XLA MiB fwd / grad | rel diff g vs IDAS | rel diff dg/dp vs IDAS "
           "| note |\n|---|---|---|---|---|---|---|---|---|---|---|---|")


def print_row(r, flush=False):
    mf, mg = r["mem"]
    print(f"| {r['M']} | {r['n']} | {r['solver']} | {fmt(r['fwd'] and 1e3 * r['fwd'], '.1f')} "
          f"| {fmt(r.get('fwd_ratio'), '.2f')} | {fmt(r['grad'] and 1e3 * r['grad'], '.1f')} "
          f"| {fmt(r.get('grad_ratio'), '.2f')} | {fmt(r.get('grad_per_fwd'), '.2f')} "
          f"| {fmt(mf, '.1f')} / {fmt(mg, '.1f')} | {fmt(r.get('g_diff'), '.1e')} "
          f"| {fmt(r.get('dp_diff'), '.1e')} | {r['error']} |", flush=flush)


def table2(M, batch, repeats, only=None):
    """The batch: the sequential IDAS loop and each solver's compiled `jit(vmap)` timed
    in interleaved rounds (`interleaved`: one warm-up call each — for JAX the compile —
    then `repeats` rounds), so that load from other processes hits them alike."""
    n = (M + 2) ** 2
    ks = np.linspace(0.5, 2.0, batch)
    u0 = heat_u0(M)
    label, c_fwd, _ = casadi_functions(M)
    exact = np.array([exact_g(M, k) for k in ks])
    fns = {f"{label}, {batch} sequential calls":
           lambda kk: np.array([c_fwd((np.array([k, k]), u0)) for k in np.asarray(kk)])}
    for name, ls in solvers_for(M, False).items():
        if only and name not in only:
            continue
        residual = heat_residual(M)

        def g(k, ls=ls, residual=residual):
            p = jnp.stack([k, k])
            u = jnp.asarray(u0)
            sol = dae.solve(residual, 0.0, T1, u, -residual(0.0, u, jnp.zeros_like(u), p), p,
                            rtol=RTOL, atol=ATOL, max_steps=5000, linear_solver=ls)
            return jnp.sum(sol.ys[-1] ** 2)

        fns[f"daeadjoint {name}, vmap of {batch}"] = jax.jit(jax.vmap(g))
    res = interleaved(fns, jnp.asarray(ks), repeats)
    seq_name = next(iter(fns))
    seq, ref = res[seq_name]["median"], np.asarray(res[seq_name]["out"])
    for name, r in res.items():
        if "error" in r:
            print(f"| {M} | {n} | {name} | n/a | n/a | n/a | {r['error']} | |", flush=True)
            continue
        out = np.asarray(r["out"])
        compile_s = "–" if name == seq_name else f"{r['first'] - r['median']:.1f}"
        print(f"| {M} | {n} | {name} | {1e3 * r['median']:.0f} | {r['median'] / seq:.2f} "
              f"| {compile_s} | {np.max(np.abs(out - ref) / np.abs(ref)):.1e} "
              f"| {np.max(np.abs(out - exact) / exact):.1e} |", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grids", type=int, nargs="+", default=[10, 40, 100])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--batch-grid", type=int, default=20)
    parser.add_argument("--dense-max", type=int, default=10,
                        help="also time DenseLU for M up to this")
    parser.add_argument("--skip-batch", action="store_true")
    parser.add_argument("--batch-only", action="store_true", help="table 2 only")
    parser.add_argument("--batch-solvers", nargs="+", default=None,
                        help="table 2 with only these daeadjoint solvers (names as printed, "
                             "e.g. default SparseLU)")
    parser.add_argument("--casadi-jit-max", type=int, default=40,
                        help="C-compile casadi's residual only up to this M (gcc time)")
    opts = parser.parse_args()
    # casadi's adjoint integrator C-compiles (jit) its functions lazily, into the cwd.
    scratch = tempfile.TemporaryDirectory()
    os.chdir(scratch.name)
    print(f"# Large DAEs: R5 heat ({datetime.date.today()})\n")
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, jax "
          f"{jax.__version__} ({jax.default_backend()}, x64), casadi {ca.__version__}; "
          f"median of {opts.repeats} warm runs, interleaved; 1-min load average at start "
          f"{os.getloadavg()[0]:.2f}\n")
    if not opts.batch_only:
        print(HEADER1)
        table1(opts.grids, opts.repeats, opts.dense_max, opts.casadi_jit_max)
    if not opts.skip_batch:
        print("\n| M | n | solver | total ms | wall / IDAS sequential | compile s "
              "| max rel diff g vs IDAS | max rel error g (exact) |\n"
              "|---|---|---|---|---|---|---|---|")
        table2(opts.batch_grid, opts.batch, opts.repeats, opts.batch_solvers)


if __name__ == "__main__":
    main()
