"""Work–precision diagrams: error against wall time over rtol = 1e-3 … 1e-10.

    python benchmarks/work_precision.py            # full: 8 tolerances, 5 repeats (~15 min)
    python benchmarks/work_precision.py --quick    # 3 tolerances, 2 repeats, small heat grid

Problems: Robertson and the 2-D heat equation of ``problems.py``, and the chemical Akzo
Nobel problem (defined here). Solvers, all on the same tolerances:

- forward: daeadjoint, casadi IDAS (C-compiled residual and exact sparse Jacobian),
  scikit-sundae IDA, diffrax Kvaerno5 (on the ODE form, algebraic variables eliminated);
- gradient of G(ln p) = Σ_i Σ_j w_j y_j(t_i) (every output time and component, w_j =
  1/max|y_j|) with respect to the logarithms of all parameters: daeadjoint
  ``jax.grad`` with ``Adjoint()`` and ``DiscreteAdjoint()``, diffrax ``jax.grad``
  (RecursiveCheckpointAdjoint); Robertson and Akzo Nobel only (the heat problem's diffrax gradient alone would take
  most of the budget).

Per problem and tolerance, atol_i = rtol · (atol_i/rtol at the problem's nominal
setting), i.e. the per-component scaling is kept. Wall time: the median of the repeats
after one warm-up call (JAX: after compilation; compilation is not in the diagrams).
Error: max over all output times and components of |y − y_ref| / scale_j, scale_j the
largest |y_ref,j| over the outputs (floored by the nominal atol_j), for solutions;
‖g − g_ref‖_∞ / ‖g_ref‖_∞ for gradients.
References: the exact solution (matrix exponential) for the linear heat problem; else
casadi IDAS at rtol 1e-12 (atol scaled alike), checked against
scikit-sundae IDA at the same tolerance (the printed "reference spread"); the Akzo
Nobel reference is also compared with the Test Set's published solution at t = 180.
Reference gradients: fourth-order central differences of those IDAS solves
(``reference_gradient``; casadi's IDAS sensitivities fail on these problems).

Writes docs/work_precision_<problem>.png (forward and gradient panels) and
docs/benchmarks.md-ready lines (machine, date) to stdout. Needs the `bench` extra.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the working-tree daeadjoint
# Single-threaded LAPACK for every solver (jaxlib's CPU LU calls scipy's OpenBLAS).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import casadi as ca  # noqa: E402
import diffrax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_enable_x64", True)

import daeadjoint as dae  # noqa: E402
import peers  # noqa: E402
from problems import JAX, Problem, casadi_dae, heat, jax_ode, jax_residual, robertson  # noqa: E402

DOCS = Path(__file__).resolve().parents[1] / "docs"
REF_RTOL = 1e-12


# --------------------------------------------------------------------------- Akzo Nobel
# The "chemical Akzo Nobel problem" of the Test Set for IVP solvers (Lioen & de Swart,
# CWI 1999; later Mazzia & Magherini): M y' = f(y), M = diag(1, 1, 1, 1, 1, 0),
# t ∈ [0, 180], y ∈ ℝ⁶, index 1 (y6 algebraic):
#   r1 = k1 y1⁴ √y2,  r2 = k2 y3 y4,  r3 = (k2/K) y1 y5,  r4 = k3 y1 y4²,
#   r5 = k4 y6² √y2,  F_in = klA (pCO2/H − y2)
#   y1' = −2 r1 + r2 − r3 − r4        y2' = −r1/2 − r4 − r5/2 + F_in
#   y3' =  r1 − r2 + r3               y4' = −r2 + r3 − 2 r4
#   y5' =  r2 − r3 + r5               0   = Ks y1 y4 − y6
# k1 = 18.7, k2 = 0.58, k3 = 0.09, k4 = 0.42, K = 34.4, klA = 3.3, Ks = 115.83,
# pCO2 = 0.9, H = 737; y(0) = (0.444, 0.00123, 0, 0.007, 0, Ks·0.444·0.007).
AKZO_P = np.array([18.7, 0.58, 0.09, 0.42, 34.4, 3.3, 115.83, 0.9, 737.0])
# The Test Set's reference solution at t = 180 (its published digits).
AKZO_TESTSET_Y180 = np.array([0.11507949206617e+0, 0.12038314715677e-2, 0.16115628874079e+0,
                              0.36561564212492e-3, 0.17080108852644e-1, 0.48735313103074e-2])


def _akzo_model(t, x, z, p, be, C):
    k1, k2, k3, k4, K, kla, ks, pco2, H = (p[i] for i in range(9))
    y1, y2, y3, y4, y5, y6 = x[0], x[1], x[2], x[3], x[4], z[0]
    sq = y2 ** 0.5
    r1 = k1 * y1 ** 4 * sq
    r2 = k2 * y3 * y4
    r3 = k2 / K * y1 * y5
    r4 = k3 * y1 * y4 ** 2
    r5 = k4 * y6 ** 2 * sq
    fin = kla * (pco2 / H - y2)
    f = be.stack([-2.0 * r1 + r2 - r3 - r4, -0.5 * r1 - r4 - 0.5 * r5 + fin,
                  r1 - r2 + r3, -r2 + r3 - 2.0 * r4, r2 - r3 + r5])
    return f, be.stack([ks * y1 * y4 - y6])


def _akzo_solve_alg(x, p, be, C):
    return be.stack([p[6] * x[0] * x[3]])


def akzo() -> Problem:
    y0 = np.array([0.444, 0.00123, 0.0, 0.007, 0.0, 115.83 * 0.444 * 0.007])
    return Problem(
        name="akzo", model=_akzo_model, solve_alg=_akzo_solve_alg,
        diff_idx=np.arange(5), alg_idx=np.array([5]), y0=y0, args=AKZO_P,
        batch_args=lambda n: np.tile(AKZO_P, (n, 1)), t0=0.0,
        ts=np.array([1.0, 5.0, 20.0, 60.0, 120.0, 180.0]),
        # The smallest components are O(1e-4) (y4) … O(1e-3): atol three decades below rtol.
        rtol=1e-6, atol=np.full(6, 1e-9),
    )


def heat_exact(prob: Problem) -> np.ndarray:
    import scipy.linalg
    A = prob.args[0] * prob.consts["Lx"].toarray()
    x0 = prob.y0[prob.diff_idx]
    zeros = np.zeros(len(prob.alg_idx))
    return np.stack([prob.assemble(scipy.linalg.expm(A * t) @ x0, zeros, np) for t in prob.ts])


# --------------------------------------------------------------------------- helpers
def at_rtol(prob: Problem, rtol: float) -> Problem:
    """The problem at another rtol, keeping atol_i / rtol."""
    return dataclasses.replace(prob, rtol=rtol, atol=prob.atol * (rtol / prob.rtol))


def median_wall(fn, repeats: int):
    out = fn()                                    # warm-up (compilation for JAX)
    walls = []
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        walls.append(time.perf_counter() - t)
    return statistics.median(walls), out


def sol_error(ys, ref, prob: Problem) -> float:
    """max over output times and components of |y − y_ref| / scale_j, with scale_j the
    component's largest magnitude over the outputs (floored by its nominal atol): the
    error relative to each component's own size. (Relative errors of components that
    decay far below atol — Robertson's y1, y2 at t = 4e10, the heat solution at
    t = 10.24 — measure nothing but the atol floor.)"""
    scale = np.maximum(np.max(np.abs(ref), axis=0), prob.atol)
    return float(np.max(np.abs(np.asarray(ys) - ref) / scale))


def grad_error(g, ref) -> float:
    return float(np.max(np.abs(np.asarray(g) - ref)) / np.max(np.abs(ref)))


def machine() -> str:
    try:
        model = next(line.split(":", 1)[1].strip() for line in
                     subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
                     if line.startswith("Model name"))
    except (StopIteration, OSError):
        model = platform.processor() or platform.machine()
    return f"{model}, {os.cpu_count()} cores"


def package_commit() -> str:
    """The git commit of the daeadjoint being measured (its checkout), if known."""
    where = Path(dae.__file__).resolve().parent
    out = subprocess.run(["git", "-C", str(where), "log", "-1", "--format=%h"],
                         capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(where), "status", "--porcelain", "--", "."],
                           capture_output=True, text=True).stdout.strip()
    return (out.stdout.strip() or "(unknown commit)") + (" + local changes" if dirty else "")


# --------------------------------------------------------------------------- solvers
def casadi_forward(prob: Problem, jit: bool):
    prep = peers.prepare_casadi(prob, jit=jit)
    return lambda: prep.result(prep.run(prob.args), prob.args)[0]


def reference_gradient(prob: Problem, weights: np.ndarray, h: float = 1e-3) -> np.ndarray:
    """dG/d(ln p) by fourth-order central differences of IDAS (casadi) solves at rtol
    1e-12: truncation O(h⁴) ~ 1e-12 relative, solver noise ~ 1e-12/h ~ 1e-9 relative.
    (casadi's own IDAS sensitivities fail on these problems: its adjoint with
    IDA_ERR_FAIL because G observes an algebraic component, its forward sensitivities
    in IDACalcIC with IDA_ILL_INPUT.)"""
    prep = peers.prepare_casadi(prob, jit=False)

    def G(logp):
        p = np.exp(logp)
        return float(np.sum(prep.result(prep.run(p), p)[0] * weights))

    logp0 = np.log(prob.args)
    g = np.zeros(len(logp0))
    for j in range(len(logp0)):
        e = np.zeros_like(logp0)
        e[j] = h
        g[j] = (-G(logp0 + 2 * e) + 8 * G(logp0 + e) - 8 * G(logp0 - e) + G(logp0 - 2 * e)) / (12 * h)
    return g


def jax_gradients(prob: Problem, weights: np.ndarray):
    """{label: (jitted grad of G(ln p) taking (ln p, rtol, atol))} for the JAX solvers;
    tolerances are traced, so each compiles once per problem."""
    residual = jax_residual(prob)
    y0, ts, w = jnp.asarray(prob.y0), jnp.asarray(prob.ts), jnp.asarray(weights)

    def dae_G(sensitivity, max_steps):
        def G(logp, rtol, atol):
            p = jnp.exp(logp)
            sol = dae.solve(residual, prob.t0, prob.t1, y0, prob.yp0(p, JAX), p, saveat=ts,
                            algebraic=prob.algebraic, rtol=rtol, atol=atol,
                            max_steps=max_steps, sensitivity=sensitivity)
            return jnp.sum(sol.ys * w)
        return jax.jit(jax.grad(G))

    vector_field, to_full = jax_ode(prob)

    def diffrax_G(logp, rtol, atol):
        p = jnp.exp(logp)
        controller = diffrax.PIDController(rtol=rtol, atol=atol[prob.diff_idx])
        sol = diffrax.diffeqsolve(diffrax.ODETerm(vector_field), diffrax.Kvaerno5(), prob.t0,
                                  prob.t1, None, y0[prob.diff_idx], args=p,
                                  saveat=diffrax.SaveAt(ts=ts), stepsize_controller=controller,
                                  max_steps=peers.MAX_STEPS)
        return jnp.sum(jax.vmap(to_full, (0, None))(sol.ys, p) * w)

    return {
        "daeadjoint Adjoint": dae_G(dae.Adjoint(), peers.MAX_STEPS),
        # DiscreteAdjoint's memory and replay scale with max_steps: size it to the problem.
        "daeadjoint DiscreteAdjoint": dae_G(dae.DiscreteAdjoint(), 20_000),
        "diffrax Kvaerno5": jax.jit(jax.grad(diffrax_G)),
    }


def jax_forwards(prob: Problem):
    residual = jax_residual(prob)
    y0, ts = jnp.asarray(prob.y0), jnp.asarray(prob.ts)
    p = jnp.asarray(prob.args)
    vector_field, to_full = jax_ode(prob)

    @jax.jit
    def dae_solve(rtol, atol):
        return dae.solve(residual, prob.t0, prob.t1, y0, prob.yp0(p, JAX), p, saveat=ts,
                         algebraic=prob.algebraic, rtol=rtol, atol=atol,
                         max_steps=peers.MAX_STEPS).ys

    @jax.jit
    def diffrax_solve(rtol, atol):
        controller = diffrax.PIDController(rtol=rtol, atol=atol[prob.diff_idx])
        sol = diffrax.diffeqsolve(diffrax.ODETerm(vector_field), diffrax.Kvaerno5(), prob.t0,
                                  prob.t1, None, y0[prob.diff_idx], args=p,
                                  saveat=diffrax.SaveAt(ts=ts), stepsize_controller=controller,
                                  max_steps=peers.MAX_STEPS)
        return jax.vmap(to_full, (0, None))(sol.ys, p)

    return {"daeadjoint": dae_solve, "diffrax Kvaerno5": diffrax_solve}


# --------------------------------------------------------------------------- one problem
def guarded(fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - one failing point must not stop the sweep
        return e


def run_problem(prob: Problem, rtols, repeats: int, gradients: bool) -> dict:
    print(f"\n## {prob.name} (n = {prob.n})")
    ref_prob = at_rtol(prob, REF_RTOL)
    ref = casadi_forward(ref_prob, jit=False)()
    if prob.name.startswith("heat"):
        # The semi-discrete heat equation is linear, x' = k Lx x (boundary z = 0): its
        # exact solution expm(k Lx t) x0 is the reference.
        exact = heat_exact(prob)
        print(f"heat: reference = expm of the semi-discrete system; IDAS at rtol "
              f"{REF_RTOL:g} differs from it by {sol_error(ref, exact, prob):.1e}")
        ref = exact
    ref_ida = guarded(lambda: peers.prepare_sksundae(ref_prob))
    if not isinstance(ref_ida, Exception):
        ys_ida = ref_ida.run(prob.args)
        spread = sol_error(ys_ida.y[1:], ref, prob)
        print(f"reference: IDAS rtol {REF_RTOL:g}; reference spread vs scikit-sundae IDA at "
              f"the same tolerance: {spread:.1e}")
    if prob.name == "akzo":
        dev = np.max(np.abs(ref[-1] - AKZO_TESTSET_Y180) / np.abs(AKZO_TESTSET_Y180))
        print(f"reference vs the Test Set's published y(180): max relative difference {dev:.1e}")
    weights = 1.0 / np.maximum(np.max(np.abs(ref), axis=0), prob.atol)
    fwd = {name: [] for name in ("daeadjoint", "IDAS (casadi, jit)", "IDA (scikit-sundae)",
                                 "diffrax Kvaerno5")}
    jf = jax_forwards(prob)
    for rtol in rtols:
        pr = at_rtol(prob, rtol)
        atol = jnp.asarray(pr.atol)
        runs = {
            "daeadjoint": lambda: np.asarray(jax.block_until_ready(jf["daeadjoint"](rtol, atol))),
            "diffrax Kvaerno5": lambda: np.asarray(
                jax.block_until_ready(jf["diffrax Kvaerno5"](rtol, atol))),
        }
        idas = guarded(lambda: casadi_forward(pr, jit=True))
        if not isinstance(idas, Exception):
            runs["IDAS (casadi, jit)"] = idas
        ida = guarded(lambda: peers.prepare_sksundae(pr))
        if not isinstance(ida, Exception):
            runs["IDA (scikit-sundae)"] = lambda: ida.run(pr.args).y[1:]
        for name, fn in runs.items():
            res = guarded(lambda: median_wall(fn, repeats))
            if isinstance(res, Exception):
                print(f"  rtol {rtol:.0e} {name}: failed ({type(res).__name__}: "
                      f"{str(res).splitlines()[0][:100] if str(res) else ''})")
                continue
            wall, ys = res
            err = sol_error(ys, ref, prob)
            fwd[name].append((rtol, wall, err))
            print(f"  rtol {rtol:.0e} {name:24s} wall {wall:9.5f} s  error {err:.2e}")

    grads = {}
    if gradients:
        g_ref = reference_gradient(ref_prob, weights)
        print(f"gradient reference (4th-order central differences of IDAS at rtol "
              f"{REF_RTOL:g}): {np.array2string(g_ref, precision=8)}")
        jg = jax_gradients(prob, weights)
        logp = jnp.log(jnp.asarray(prob.args))
        grads = {name: [] for name in jg}
        for rtol in rtols:
            pr = at_rtol(prob, rtol)
            atol = jnp.asarray(pr.atol)
            runs = {name: (lambda f=f: np.asarray(jax.block_until_ready(f(logp, rtol, atol))))
                    for name, f in jg.items()}
            for name, fn in runs.items():
                res = guarded(lambda: median_wall(fn, repeats))
                if isinstance(res, Exception):
                    print(f"  rtol {rtol:.0e} grad {name}: failed ({type(res).__name__}: "
                          f"{str(res).splitlines()[0][:100] if str(res) else ''})")
                    continue
                wall, g = res
                err = grad_error(g, g_ref)
                grads[name].append((rtol, wall, err))
                print(f"  rtol {rtol:.0e} grad {name:28s} wall {wall:9.5f} s  error {err:.2e}")
    return dict(forward=fwd, gradient=grads)


# --------------------------------------------------------------------------- plotting
STYLE = {"daeadjoint": ("C0", "o"), "daeadjoint Adjoint": ("C0", "o"),
         "daeadjoint DiscreteAdjoint": ("C4", "D"), "IDAS (casadi, jit)": ("C1", "s"),
         "IDAS (casadi, forward sens.)": ("C1", "s"), "IDA (scikit-sundae)": ("C2", "^"),
         "diffrax Kvaerno5": ("C3", "v")}


def plot(prob: Problem, result: dict, stamp: str, out: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("forward solve", result["forward"])]
    if result["gradient"]:
        panels.append(("gradient of G(ln p)", result["gradient"]))
    fig, axes = plt.subplots(1, len(panels), figsize=(max(6.2 * len(panels), 8.0), 4.8),
                             squeeze=False)
    for ax, (title, series) in zip(axes[0], panels):
        for name, pts in series.items():
            if not pts:
                continue
            rt, wall, err = map(np.asarray, zip(*pts))
            color, marker = STYLE.get(name, ("k", "x"))
            ax.loglog(wall, err, marker=marker, color=color, label=name)
            for r, w, e in zip(rt, wall, err):
                if r in (rt.max(), rt.min()):
                    ax.annotate(f"{r:.0e}", (w, e), textcoords="offset points", xytext=(4, 3),
                                fontsize=7, color=color)
        ax.set_xlabel("wall time per call, median after compilation (s)")
        ax.set_ylabel("max relative error vs reference (1)" if title.startswith("forward")
                      else r"$\|g - g_{ref}\|_\infty / \|g_{ref}\|_\infty$ (1)")
        ax.set_title(f"{prob.name}: {title}")
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Work–precision, rtol 1e-3 … 1e-10 (point labels: rtol)\n{stamp}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--problems", default="robertson,heat,akzo")
    parser.add_argument("--out-dir", default=str(DOCS))
    args = parser.parse_args()
    rtols = [1e-4, 1e-6, 1e-8] if args.quick else [10.0 ** -k for k in range(3, 11)]
    repeats = 2 if args.quick else 5
    stamp = (f"Measured {datetime.date.today().isoformat()} on {machine()}, "
             f"daeadjoint {package_commit()}, jax {jax.__version__}, casadi {ca.__version__}, "
             f"diffrax {diffrax.__version__}"
             f"{' (--quick)' if args.quick else ''}")
    print(stamp)
    makers = {"robertson": (robertson, True), "heat": (lambda: heat(8 if args.quick else 12), False),
              "akzo": (akzo, True)}
    start = time.perf_counter()
    for name in args.problems.split(","):
        make, gradients = makers[name]
        prob = make()
        result = run_problem(prob, rtols, repeats, gradients)
        plot(prob, result, stamp, Path(args.out_dir) / f"work_precision_{name}.png")
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
