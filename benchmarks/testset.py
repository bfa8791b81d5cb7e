"""Problems of the Test Set for IVP Solvers (Mazzia & Magherini, University of Bari):
forward accuracy and cost, and gradients compared with central differences.

    python benchmarks/testset.py                     # everything (~1.5 h on 2 cores)
    python benchmarks/testset.py --problems transistor,akzo --no-gradients
    python benchmarks/testset.py --problems nand --nand-t1 10,15 --rtols 1e-6
    python benchmarks/testset.py --vs-ida            # the side-by-side table (1 h, busy 2 cores)

The problems are those of ``tests/testset.py`` (residuals with the physical parameters
in a dict, the Test Set's reference solutions and accuracy measures), including the
transistor amplifier rewritten in semi-explicit form (``transistor_semi_explicit``).

1. Forward: per problem, end time and tolerance (atol = rtol, as the Test Set's runs),
   and for ``--suppress-problems`` also with ``suppress_algebraic_error=True``: the
   status, IDAS's counters (steps, error-test and Newton convergence failures), the
   Test Set's ``scd`` (relative error over its scored components) and ``mescd`` (mixed
   error over all components) at t1, and the wall time: the median of ``--repeats``
   calls after one warm-up call (compilation), each ``block_until_ready``. The NAND
   gate at t1 = 10 and 15 has no published reference: there it is a segmented solve at
   rtol 1e-11 restarted at every input kink (checked against the published y(80)).
2. Gradients of one output component y_k(t1) with respect to 2–3 physical parameters,
   printed as p·∂y_k/∂p: ``jax.grad`` with the default (continuous adjoint),
   ``Adjoint(checkpoint_every=100000)`` (no recomputation from checkpoints),
   ``DiscreteAdjoint()`` (its ``max_steps`` sized to the forward solve's steps), and
   ``jax.jacfwd`` (forward sensitivities); against central differences of forward
   solves at ``FD_RTOL`` (each perturbed problem with its own consistent initial
   values): fourth order, (8(y(+h) − y(−h)) − (y(+2h) − y(−2h)))/(12h) in the relative
   step h, for two steps h (their difference is the differences' own uncertainty);
   second order with one step for the two-bit adder, whose solves are expensive. A
   method that fails prints the solver's status (``throw=True``; ``jax.jacfwd`` reports
   the forward status instead, since it returns NaN without raising). Compiled programs
   are dropped after each case (``jax.clear_caches``).
3. ``--vs-ida``: side by side with SUNDIALS IDA (scikit-sundae) on the same residual,
   initial values and tolerances, for the forward solve and the gradient (see
   ``versus_ida``); only this table is produced.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(1, str(ROOT))     # the working-tree daeadjoint and the tests' helpers
# Single-threaded LAPACK, as the other benchmarks (docs/solving.md).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_enable_x64", True)

import daeadjoint as dae  # noqa: E402
from tests import testset as ts  # noqa: E402  (the problems; this script is `testset` too)

STATUS = {int(v._value): k for k, v in dae.RESULTS._name_to_item.items()}

# (output component, parameters) of the gradient study, per problem.
GRADIENTS = {
    "transistor": (7, ("beta", "r0", "c5")),            # U8: the amplifier's output
    "transistor_semi_explicit": (7, ("beta", "r0", "c5")),
    "nand": (4, ("BETA_dep", "BETA_enh", "VT0_enh")),    # y5: the gate's output node
    "akzo": (0, ("k1", "k2", "klA")),
    "twobit": (223, ("BETA_enh", "COUT", "CGS")),       # node 49: the sum bit S0
}
# Before t = 20 the enhancement transistors carry no current (V2 is low; their
# derivatives are exactly 0) and at t = 15 y5 sits at V_DD (sensitivities ~1e-12): there
# the study looks at y10, the node between the two enhancement transistors, which the
# input V1 drives through the capacitances (the gate capacitance CGS, the junction
# capacitance CBD and the node capacitance C9).
NAND_CASE_AT = {10.0: (9, ("CGS", "CBD", "C9")), 15.0: (9, ("CGS", "CBD", "C9"))}


def error_line(e: Exception) -> str:
    text = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    for line in text:
        if "EquinoxRuntimeError:" in line:
            return line.split("EquinoxRuntimeError:", 1)[1].strip().split(":")[0]
    return f"{type(e).__name__}: {text[0] if text else ''}"[:160]


def timed(fn, repeats: int):
    """(first call s, median of the repeats s, output)."""
    t = time.perf_counter()
    out = jax.block_until_ready(fn())
    first = time.perf_counter() - t
    walls = []
    for _ in range(repeats):
        t = time.perf_counter()
        out = jax.block_until_ready(fn())
        walls.append(time.perf_counter() - t)
    return first, (statistics.median(walls) if walls else float("nan")), out


# Forward tolerance of the central differences, per problem: the transistor amplifier
# at rtol 1e-10 does not reach t1 in 10^6 steps (and takes 481 497 steps at 1e-9).
FD_RTOL = {"transistor": 1e-8, "transistor_semi_explicit": 1e-8, "nand": 1e-10,
           "akzo": 1e-10, "twobit": 1e-5}


def solver_kwargs(pr: ts.Problem, rtol: float, suppress: bool = False) -> dict:
    return dict(rtol=rtol, atol=rtol, suppress_algebraic_error=suppress,
                algebraic=None if pr.algebraic is None else jnp.asarray(pr.algebraic))


def forward_fn(pr: ts.Problem, t1: float, rtol: float, max_steps: int, suppress: bool):
    @eqx.filter_jit
    def run(p):
        y0, yp0 = pr.initial(p)
        sol = dae.solve(pr.residual, pr.t0, t1, y0, yp0, args=p, throw=False,
                        max_steps=max_steps, **solver_kwargs(pr, rtol, suppress))
        return sol.ys[-1], sol.result._value, sol.stats
    return run


def segmented_reference(pr: ts.Problem, t1: float, rtol: float = 1e-11):
    """y(t1) by solves restarted at every breakpoint < t1 (tstop at each), y'
    recomputed consistently after each kink (index 0: C(y)⁻¹ f(t⁺, y))."""
    p = pr.params()
    y, yp = pr.initial(p)
    edges = [pr.t0, *[b for b in pr.breakpoints if b < t1], t1]
    for a, b in zip(edges[:-1], edges[1:]):
        if a > pr.t0:       # the input derivative right after the kink
            tr = a + 1e-9 * (b - a)
            C = jax.jacfwd(lambda v: pr.residual(tr, y, v, p))(jnp.zeros_like(yp))
            yp = jnp.linalg.solve(C, -pr.residual(tr, y, jnp.zeros_like(yp), p))
        sol = dae.solve(pr.residual, a, b, y, yp, args=p, tstop=b, rtol=rtol, atol=rtol,
                        max_steps=1_000_000)
        y, yp = sol.ys[-1], sol.yps[-1]
    return np.asarray(y)


# ------------------------------------------------------------------------ forward


def forward_table(cases, repeats: int, max_steps: int):
    print("\n## Forward solves (atol = rtol)\n")
    print("| problem | t1 | rtol | suppress alg. | status | steps | err-test fails | "
          "conv fails | scd | mescd | wall s (median) | first call s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for pr, t1, rtol, yref, suppress in cases:
        run = forward_fn(pr, t1, rtol, max_steps, suppress)
        p = pr.params()
        try:
            first, wall, (y, res, stats) = timed(lambda: run(p), repeats)
        except Exception as e:   # noqa: BLE001 - report and go on
            print(f"| {pr.name} | {t1:g} | {rtol:g} | {suppress} | {error_line(e)} "
                  "| | | | | | | |")
            continue
        status = STATUS.get(int(res), int(res))
        ok = status == "successful"
        scd = f"{pr.scd(y, yref):.2f}" if ok else "–"
        mescd = f"{pr.mescd(y, rtol, rtol, yref):.2f}" if ok else "–"
        tf = "" if ok else f" at t = {float(stats['t_final']):.6g}"
        jax.clear_caches()      # see main()
        print(f"| {pr.name} | {t1:g} | {rtol:g} | {suppress} | {status}{tf} | "
              f"{int(stats['num_steps'])} | "
              f"{int(stats['num_error_test_failures'])} | "
              f"{int(stats['num_nonlinear_convergence_failures'])} | {scd} | {mescd} | "
              f"{wall:.3g} | {first:.3g} |", flush=True)


# ------------------------------------------------------------------------ gradients


def gradient_case(pr: ts.Problem, t1: float, rtol: float, fd_rtol: float, fd_steps,
                  fd_order: int, repeats: int, methods):
    comp, keys = GRADIENTS[pr.name]
    if pr.name == "nand":
        comp, keys = NAND_CASE_AT.get(t1, (comp, keys))
    p0 = pr.params()
    theta0 = jnp.stack([p0[k] for k in keys])
    kw = solver_kwargs(pr, rtol)

    def output(theta, sensitivity=None, throw=True, max_steps=100_000, rt=rtol):
        p = dict(p0)
        p.update({k: theta[i] for i, k in enumerate(keys)})
        y0, yp0 = pr.initial(p)
        sol = dae.solve(pr.residual, pr.t0, t1, y0, yp0, args=p, sensitivity=sensitivity,
                        throw=throw, max_steps=max_steps,
                        **{**kw, "rtol": rt, "atol": rt})
        return sol.ys[-1, comp], (sol.result._value, sol.stats["num_steps"])

    start = time.perf_counter()

    def log(what):              # progress on stderr: the two-bit adder's cases take long
        print(f"  [{time.perf_counter() - start:7.1f} s] {pr.name} t1={t1:g}: {what}",
              file=sys.stderr, flush=True)

    log("forward")
    # forward step count (sizes DiscreteAdjoint's step log)
    _, (res, steps) = eqx.filter_jit(lambda th: output(th, throw=False))(theta0)
    steps = int(steps)
    rows = {}

    # central differences of tight forward solves: fourth order,
    # (8 (y(+h) − y(−h)) − (y(+2h) − y(−2h))) / (12 h) in the relative step h, or second
    # order (y(+h) − y(−h)) / (2h)
    fwd = eqx.filter_jit(lambda th: output(th, throw=False, max_steps=1_000_000, rt=fd_rtol))
    fd = {}
    for h in fd_steps:
        log(f"central differences, h = {h:g}")
        bad = None

        def at(i, step):
            nonlocal bad
            y, (r, _) = fwd(theta0.at[i].multiply(1.0 + step))
            if STATUS.get(int(r)) != "successful":
                bad = STATUS.get(int(r), int(r))
            return float(y)

        if fd_order == 4:
            fd[h] = np.array([(8.0 * (at(i, h) - at(i, -h)) - (at(i, 2 * h) - at(i, -2 * h)))
                              / (12.0 * h) for i in range(len(keys))])
        else:
            fd[h] = np.array([(at(i, h) - at(i, -h)) / (2.0 * h) for i in range(len(keys))])
        rows[f"FD{fd_order} h={h:g} (rtol {fd_rtol:g})"] = (fd[h], bad or "successful",
                                                           None, None)
    refs = [fd[h] for h in fd_steps]

    sens = {"adjoint (default)": dae.Adjoint(),
            "Adjoint(checkpoint_every=100000)": dae.Adjoint(checkpoint_every=100_000),
            "DiscreteAdjoint()": dae.DiscreteAdjoint()}
    for name in methods:
        log(name)
        if name == "jacfwd":
            fn = eqx.filter_jit(jax.jacfwd(lambda th: output(th, throw=False), has_aux=True))
        else:
            ms = int(1.25 * steps) + 100 if name == "DiscreteAdjoint()" else 100_000
            s = sens[name]
            fn = eqx.filter_jit(jax.grad(lambda th, s=s, ms=ms: output(th, s, max_steps=ms),
                                         has_aux=True))
        try:
            first, wall, (g, (r, _)) = timed(lambda fn=fn: fn(theta0), repeats)
        except Exception as e:   # noqa: BLE001
            rows[name] = (None, error_line(e), None, None)
            continue
        g = np.asarray(g) * np.asarray(theta0)
        status = STATUS.get(int(r), int(r))
        if np.any(~np.isfinite(g)):
            status += " (NaN in the result)"
        rows[name] = (g, status, wall, first)

    print(f"\n### {pr.name}: p·∂y{comp + 1}(t1 = {t1:g})/∂p, rtol = atol = {rtol:g} "
          f"(forward: {STATUS.get(int(res))}, {steps} steps)\n")
    print("| method | " + " | ".join(keys) + " | max rel. diff vs FD "
          + ", ".join(f"h={h:g}" for h in fd_steps) + " | status | wall s | first call s |")
    print("|---|" + "---|" * len(keys) + "---|---|---|---|")
    for name, (g, status, wall, first) in rows.items():
        vals = " | ".join(f"{x:.7g}" for x in g) if g is not None else \
            " | ".join("–" for _ in keys)
        diff = (", ".join(f"{np.max(np.abs(g - ref) / np.maximum(np.abs(ref), 1e-300)):.1e}"
                          for ref in refs)
                if g is not None and np.all(np.isfinite(g)) else "–")
        print(f"| {name} | {vals} | {diff} | {status} | "
              f"{'' if wall is None else f'{wall:.3g}'} | "
              f"{'' if first is None else f'{first:.3g}'} |", flush=True)


# ------------------------------------------------------------------------ vs IDA
#
# Forward: y(t1) by daeadjoint (`jax.jit` of the solve, p and rtol traced) and by
# SUNDIALS IDA through scikit-sundae on the same residual, initial values and rtol = atol.
# IDA's residual is the same JAX function compiled by `jax.jit` and called from IDA's C
# code through Python, its Jacobian F_y + c_j F_y' by `jax.jacfwd` (also compiled): IDA's
# own difference-quotient Jacobian would cost n more residual calls per Jacobian
# through Python. Neither solver is told the inputs' breakpoints (IDA's runs go through
# the NAND gate's kinks as daeadjoint's do).
#
# Gradient: p·∂y_k(t1)/∂p for the cases of `tests/testset.py` (GRADIENT_CASES), scored
# against their stored fourth-order central differences of tight forward solves.
# scikit-sundae has no sensitivity analysis, so IDA's column is what a user of it would
# do: second-order central differences of 2·(number of parameters) IDA solves at the
# same rtol, relative step h = rtol^(1/3) (balances the truncation error ~h² against the
# solves' noise ~rtol/h).

VS_IDA_CASES = {"transistor": "transistor", "nand": "nand", "akzo": "akzo"}


def _flat_params(pr: ts.Problem):
    keys = tuple(pr.p)
    p0 = pr.params()
    return keys, jnp.stack([p0[k] for k in keys])


def ida_forward(pr: ts.Problem, t1: float, keys, max_steps: int = 1_000_000):
    """pv, rtol ↦ (y(t1), steps) by IDA (scikit-sundae); pv: all parameters, flat."""
    from sksundae.ida import IDA

    def res(t, y, yp, pv):
        return pr.residual(t, y, yp, dict(zip(keys, pv)))

    F = jax.jit(res)
    J = jax.jit(lambda t, y, yp, pv, cj: jax.jacfwd(res, 1)(t, y, yp, pv)
                + cj * jax.jacfwd(res, 2)(t, y, yp, pv))
    init = jax.jit(lambda pv: pr.initial(dict(zip(keys, pv))))
    alg = None if pr.algebraic is None else [int(i) for i in np.flatnonzero(pr.algebraic)]

    def run(pv, rtol):
        y0, yp0 = (np.asarray(v) for v in init(pv))

        def resfn(t, y, yp, out):
            out[:] = F(t, y, yp, pv)

        def jacfn(t, y, yp, out, cj, JJ):
            JJ[:, :] = J(t, y, yp, pv, cj)

        solver = IDA(resfn, rtol=rtol, atol=rtol, jacfn=jacfn, algebraic_idx=alg,
                     max_num_steps=max_steps)
        sol = solver.solve(np.array([pr.t0, t1]), y0, yp0)
        if not sol.success:
            raise RuntimeError(f"IDA: {sol.message}")
        return np.asarray(sol.y[-1]), len(sol.t) - 1
    return run


def ours_forward(pr: ts.Problem, t1: float, keys, max_steps: int = 1_000_000):
    alg = None if pr.algebraic is None else jnp.asarray(pr.algebraic)

    @jax.jit
    def run(pv, rtol):
        p = dict(zip(keys, pv))
        y0, yp0 = pr.initial(p)
        sol = dae.solve(pr.residual, pr.t0, t1, y0, yp0, args=p, algebraic=alg, rtol=rtol,
                        atol=rtol, max_steps=max_steps)
        return sol.ys[-1], sol.stats["num_steps"], sol.result._value
    return run


def ours_gradient(pr: ts.Problem, case: ts.GradientCase, keys, method: str):
    """pv, rtol ↦ θ·∂y_k(t1)/∂θ, θ = the case's parameters (entries of pv)."""
    alg = None if pr.algebraic is None else jnp.asarray(pr.algebraic)
    idx = jnp.asarray([keys.index(k) for k in case.keys])
    sens = dae.DiscreteAdjoint() if method == "DiscreteAdjoint()" else None

    def output(theta, pv, rtol):
        p = dict(zip(keys, pv.at[idx].set(theta)))
        y0, yp0 = pr.initial(p)
        sol = dae.solve(pr.residual, pr.t0, case.t1, y0, yp0, args=p, algebraic=alg,
                        rtol=rtol, atol=rtol, sensitivity=sens, max_steps=1_000_000)
        return sol.ys[-1, case.comp]

    d = jax.jacfwd(output) if method == "jacfwd" else jax.grad(output)
    return jax.jit(lambda pv, rtol: pv[idx] * d(pv[idx], pv, rtol))


def ida_gradient(run, case: ts.GradientCase, keys, rtol: float):
    """θ·∂y_k/∂θ by second-order central differences of IDA solves (relative step
    rtol^(1/3)): 2 solves per parameter."""
    h = rtol ** (1.0 / 3.0)
    pv = _flat_params(case.problem)[1]
    out = []
    for k in case.keys:
        i = keys.index(k)
        yp_ = run(pv.at[i].multiply(1.0 + h), rtol)[0][case.comp]
        ym_ = run(pv.at[i].multiply(1.0 - h), rtol)[0][case.comp]
        out.append((yp_ - ym_) / (2.0 * h))
    return np.array(out)


def interleaved(fns, repeats: int):
    """First call of each (compilation for JAX), then `repeats` rounds calling each in
    turn: (first-call s, median s, output) per function."""
    firsts, outs = [], []
    for fn in fns:
        t = time.perf_counter()
        try:
            outs.append(jax.block_until_ready(fn()))
        except Exception as e:   # noqa: BLE001 - a failed method is a row of the table
            outs.append(e)
        firsts.append(time.perf_counter() - t)
    walls = [[] for _ in fns]
    for _ in range(repeats):
        for w, fn, o in zip(walls, fns, outs):
            if isinstance(o, Exception):
                w.append(float("nan"))
                continue
            t = time.perf_counter()
            jax.block_until_ready(fn())
            w.append(time.perf_counter() - t)
    return [(f, statistics.median(w), o) for f, w, o in zip(firsts, walls, outs)]


class _Rows(list):
    """Table rows, each also written to stderr at once (a long run's partial results)."""

    def append(self, row):
        print(row, file=sys.stderr, flush=True)
        super().append(row)


def versus_ida(names, rtols, repeats: int, methods, gradients: bool = True):
    fwd_rows, grad_rows = _Rows(), _Rows()
    for name in names:
        pr = ts.PROBLEMS[name]
        keys, pv = _flat_params(pr)
        ours, ida = ours_forward(pr, pr.t1, keys), ida_forward(pr, pr.t1, keys)
        # rtol is traced: one compilation per problem and function serves all rtols
        grads = ({m: ours_gradient(pr, ts.GRADIENT_CASES[VS_IDA_CASES[name]], keys, m)
                  for m in methods} if gradients and name in VS_IDA_CASES else {})
        for rtol in rtols:
            print(f"  {name} rtol {rtol:g}: forward", file=sys.stderr, flush=True)
            (f0, w0, (y0, s0, r0)), (_, w1, (y1, s1)) = interleaved(
                [lambda: ours(pv, rtol), lambda: ida(pv, rtol)], repeats)
            status = STATUS.get(int(r0), int(r0))
            fwd_rows.append(
                f"| {name} | {pr.n} | {rtol:g} | {int(s0)} | {pr.scd(y0):.2f} | "
                f"{pr.mescd(y0, rtol, rtol):.2f} | {w0:.3g} | {f0:.3g} | {s1} | "
                f"{pr.scd(y1):.2f} | {pr.mescd(y1, rtol, rtol):.2f} | {w1:.3g} | "
                f"{w0 / w1:.2f} |" + ("" if status == "successful" else f" {status}"))
            if not gradients or name not in VS_IDA_CASES:
                continue
            case = ts.GRADIENT_CASES[VS_IDA_CASES[name]]
            scale = np.abs(case.fd)

            def err(g):
                g = np.asarray(g)
                return np.max(np.abs(g - case.fd) / scale) if np.all(np.isfinite(g)) \
                    else float("nan")

            print(f"  {name} rtol {rtol:g}: gradients {', '.join(grads)}", file=sys.stderr,
                  flush=True)
            fns = [lambda g=g: g(pv, rtol) for g in grads.values()]
            fns.append(lambda: ida_gradient(ida, case, keys, rtol))
            res = interleaved(fns, repeats)
            ida_g = res[-1]
            for m, (f, w, g) in zip(grads, res[:-1]):
                if isinstance(g, Exception):
                    grad_rows.append(f"| {name} | {rtol:g} | daeadjoint {m} | "
                                     f"{len(case.keys)} | {error_line(g)} | | | | |")
                    continue
                grad_rows.append(
                    f"| {name} | {rtol:g} | daeadjoint {m} | {len(case.keys)} | {err(g):.1e} | "
                    f"{w:.3g} | {w / w0:.2f} | {f:.3g} | {w / ida_g[1]:.2f} |")
            grad_rows.append(
                f"| {name} | {rtol:g} | IDA, central differences ({2 * len(case.keys)} "
                f"solves) | {len(case.keys)} | {err(ida_g[2]):.1e} | {ida_g[1]:.3g} | "
                f"{ida_g[1] / w1:.2f} | – | 1 |")
        jax.clear_caches()      # see main()

    print("\n## Forward solves: daeadjoint and IDA side by side (rtol = atol)\n")
    print("| problem | n | rtol | steps | scd | mescd | s (median) | first call s | "
          "IDA steps | IDA scd | IDA mescd | IDA s (median) | time / IDA's |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(fwd_rows))
    if grad_rows:
        print("\n## Gradients p·∂y_k(t1)/∂p\n")
        print("| problem | rtol | method | parameters | max rel. error vs reference | "
              "s (median) | / own forward s | first call s | time / IDA's |")
        print("|---|---|---|---|---|---|---|---|---|")
        print("\n".join(grad_rows))


# ------------------------------------------------------------------------ main


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--problems",
                        default="transistor,transistor_semi_explicit,nand,akzo,twobit")
    parser.add_argument("--rtols", default="1e-6,1e-8")
    parser.add_argument("--twobit-rtols", default="1e-4,1e-6,1e-8",
                        help="the two-bit adder's tolerances (its Test Set runs start at 1e-4)")
    parser.add_argument("--nand-t1", default="80,10,15")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=100_000)
    parser.add_argument("--no-forward", action="store_true")
    parser.add_argument("--no-gradients", action="store_true")
    parser.add_argument("--grad-rtol", type=float, default=1e-6)
    parser.add_argument("--twobit-grad-rtol", type=float, default=1e-4)
    parser.add_argument("--fd-rtol", type=float, default=None,
                        help="forward rtol of the central differences (default: FD_RTOL)")
    parser.add_argument("--fd-steps", default="2e-2,1e-2",
                        help="relative steps of the fourth-order central differences")
    parser.add_argument("--twobit-fd-steps", default="1e-2",
                        help="the two-bit adder's (second-order differences: its solves "
                        "are expensive)")
    parser.add_argument("--suppress-problems", default="transistor_semi_explicit,twobit",
                        help="also run these with suppress_algebraic_error=True")
    parser.add_argument("--methods", default="adjoint (default),Adjoint(checkpoint_every="
                        "100000),DiscreteAdjoint(),jacfwd")
    parser.add_argument("--vs-ida", action="store_true",
                        help="only the side-by-side table with IDA (problems transistor, "
                        "nand, akzo unless --problems is given; gradient methods "
                        "'adjoint (default)' and 'jacfwd' unless --methods is given)")
    args = parser.parse_args()
    names = args.problems.split(",")
    rtols = [float(x) for x in args.rtols.split(",")]
    nand_t1 = [float(x) for x in args.nand_t1.split(",")]
    print(f"jax {jax.__version__}, {os.cpu_count()} cores, repeats {args.repeats}, "
          f"load average {os.getloadavg()[0]:.2f}")
    if args.vs_ida:
        import sksundae
        print(f"scikit-sundae {sksundae.__version__}")
        explicit = {a.split("=")[0] for a in sys.argv[1:]}
        versus_ida(names if "--problems" in explicit else list(VS_IDA_CASES), rtols,
                   args.repeats, methods=(args.methods.split(",") if "--methods" in explicit
                                          else ["adjoint (default)", "jacfwd"]),
                   gradients=not args.no_gradients)
        print(f"\nload average at the end {os.getloadavg()[0]:.2f}")
        return

    refs = {}
    if "nand" in names:
        for t1 in nand_t1:
            if t1 != ts.nand.t1:
                refs[t1] = segmented_reference(ts.nand, t1)
        if any(t1 != ts.nand.t1 for t1 in nand_t1):
            own = segmented_reference(ts.nand, ts.nand.t1)
            print(f"segmented rtol-1e-11 reference at t = 80 vs the published y(80): "
                  f"scd {ts.nand.scd(own):.2f}, mescd {ts.nand.mescd(own, 1.0, 1.0):.2f} "
                  "(mixed error with atol/rtol = 1)")

    if not args.no_forward:
        cases = []
        for name in names:
            pr = ts.PROBLEMS[name]
            for t1 in (nand_t1 if name == "nand" else [pr.t1]):
                yref = pr.yref if t1 == pr.t1 else refs[t1]
                rt = ([float(x) for x in args.twobit_rtols.split(",")] if name == "twobit"
                      else rtols)
                sup = [False, True] if name in args.suppress_problems.split(",") else [False]
                cases += [(pr, t1, r, yref, s) for r in rt for s in sup]
        forward_table(cases, args.repeats, args.max_steps)

    if not args.no_gradients:
        print("\n## Gradients\n")
        methods = args.methods.split(",")
        for name in names:
            pr = ts.PROBLEMS[name]
            tw = name == "twobit"
            for t1 in (nand_t1 if name == "nand" else [pr.t1]):
                steps = [float(x) for x in (args.twobit_fd_steps if tw else
                                            args.fd_steps).split(",")]
                gradient_case(pr, t1, args.twobit_grad_rtol if tw else args.grad_rtol,
                              args.fd_rtol or FD_RTOL[name], steps, 2 if tw else 4,
                              args.repeats, methods)
                # Drop the compiled programs: kept all at once they exhaust the process's
                # memory mappings (LLVM "Unable to allocate section memory").
                jax.clear_caches()


if __name__ == "__main__":
    main()
