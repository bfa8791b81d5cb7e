"""Gradient benchmarks of daeadjoint's continuous adjoint; prints Markdown tables.

    python benchmarks/gradients.py [--quick]

1. Gradient time / forward time of the same jitted loss: Robertson G = ∫ y3 dt, and the
   R5 2-D heat equation (small grids) w.r.t. (p1, p2) and w.r.t. (p1, p2, u0).
2. Robertson dG/dp vs diffrax (ODE form, Kvaerno5) with RecursiveCheckpointAdjoint and
   BacksolveAdjoint.
3. R6 Barnes predator-prey least squares: gradient cost vs number of observations.
4. Compiled memory of the jitted gradient vs number of steps and checkpoint_every.

Timings: ``peers.measure`` (one warm-up call, then the median of the warm repeats, each
``block_until_ready``). Every daeadjoint call is guarded: a failure prints its error.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the working-tree daeadjoint

import diffrax
import jax
import jax.numpy as jnp
import numpy as np

import peers
import problems

jax.config.update("jax_enable_x64", True)

import daeadjoint as dae  # noqa: E402
import daeadjoint._solve as _dae_solve  # noqa: E402  (only to count adjoint steps)

MAX_STEPS = 100_000


# --------------------------------------------------------------------------- helpers
def _error_line(e: Exception) -> str:
    """One line: the equinox runtime message when there is one (under ``jax.jit`` it is
    buried in a callback traceback), else the first line of the exception."""
    text = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    for line in text:
        if "EquinoxRuntimeError:" in line:
            return "EquinoxRuntimeError: " + line.split("EquinoxRuntimeError:", 1)[1].strip()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:200]


def _fmt(x, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def _flat(tree) -> np.ndarray:
    return np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree_util.tree_leaves(tree)])


def _busy_s() -> float:
    """CPU seconds all processes on the machine spent busy so far (/proc/stat)."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return float("nan")
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait


class OtherLoad:
    """Average number of cores kept busy by *other* processes while inside ``with``
    (machine-wide busy CPU time from /proc/stat minus this process's CPU time)."""

    def __enter__(self):
        self._t, self._busy, self._own = time.perf_counter(), _busy_s(), sum(os.times()[:2])
        return self

    def __exit__(self, *exc):
        wall = time.perf_counter() - self._t
        own = sum(os.times()[:2]) - self._own
        self.cores = max((_busy_s() - self._busy - own) / wall, 0.0)


def time_jitted(fns: dict, arg, repeats: int) -> dict:
    """Time several jitted ``fn(arg) -> (value pytree, aux)`` on the same argument.

    Each gets one warm-up call (``peers._timed``; compile_s = first call − median, as in
    ``peers.measure``), then ``repeats`` rounds that call every fn once in turn, so that
    load from other processes hits all of them alike and their ratio stays meaningful.
    Returns {name: dict(compile_s, wall_s (median), min_s, value (flattened first
    output), aux (second output, e.g. the forward step count))} ({name: {error}} if a
    call raises)."""
    out, first = {}, {}
    for name, fn in fns.items():
        try:
            first[name], res = peers._timed(lambda: jax.block_until_ready(fn(arg)))
            out[name] = dict(value=_flat(res[0]), aux=int(res[1]), walls=[])
        except Exception as e:  # noqa: BLE001 - a failing solver must not stop the report
            print(f"<!-- {name} failed: {_error_line(e)} -->", flush=True)
            out[name] = dict(error=_error_line(e))
    for _ in range(repeats):
        for name, fn in fns.items():
            if "error" not in out[name]:
                out[name]["walls"].append(
                    peers._timed(lambda: jax.block_until_ready(fn(arg)))[0])
    for name, r in out.items():
        if "error" not in r:
            r["wall_s"] = statistics.median(r["walls"])
            r["min_s"] = min(r["walls"])
            r["compile_s"] = max(first[name] - r["wall_s"], 0.0)
    return out


class AdjointStepCounter:
    """Counts the backward (adjoint) steps of every gradient traced while active.

    ``daeadjoint`` computes ``stats['adjoint_steps']`` in its backward pass but does not
    return it; this wraps the (private) ``daeadjoint._solve.backward`` with one
    ``jax.debug.callback`` that reports it (one host call per gradient, after the
    backward loop; a few microseconds). Only functions traced inside ``with`` are
    affected."""

    def __init__(self):
        self.counts: list[int] = []

    def __enter__(self):
        self._orig = orig = _dae_solve.backward

        def backward(*a, **kw):
            out = orig(*a, **kw)
            jax.debug.callback(lambda s: self.counts.append(int(s)), out[-1]["adjoint_steps"])
            return out

        _dae_solve.backward = backward
        return self

    def __exit__(self, *exc):
        _dae_solve.backward = self._orig

    @property
    def last(self):
        return self.counts[-1] if self.counts else None


# --------------------------------------------------------------------------- problems
ROB = problems.robertson()
ROB_RES = problems.jax_residual(ROB)  # same residual as the forward benchmark
ROB_P = jnp.array([0.04, 1e4, 3e7])
ROB_Y0 = jnp.array([1.0, 0.0, 0.0])
ROB_YP0 = jnp.array([-0.04, 0.04, 0.0])
ROB_ALG = np.array([False, False, True])
ROB_ATOL = jnp.array([1e-8, 1e-14, 1e-6])  # idasRoberts_ASAi_dns, as in REFERENCE R1
ROB_T1 = 4e10
IDAS_DGDP = np.array([1.4879e06, -5.9470e00, 9.9117e-04])  # REFERENCE_VALUES R1 (ASA)


def robertson_G(p, t1=ROB_T1, checkpoint_every=50, max_steps=MAX_STEPS):
    """(G = ∫_0^t1 y3 dt, forward steps)."""
    sol = dae.solve(ROB_RES, 0.0, t1, ROB_Y0, ROB_YP0, p, saveat=jnp.reshape(t1, (1,)),
                    algebraic=ROB_ALG, rtol=1e-6, atol=ROB_ATOL,
                    quadrature=lambda t, y, yp, p: y[2:3], max_steps=max_steps,
                    sensitivity=dae.Adjoint(atol=1e-8, checkpoint_every=checkpoint_every))
    return sol.qs[-1, 0], sol.stats["num_steps"]


def heat_setup(M: int):
    """R5 on an (M+2)x(M+2) mesh (M x M interior), boundary nodes algebraic u = 0.

    u_t = p1 u_xx + p2 u_yy, u0 = 16x(1-x)y(1-y) at the interior nodes, T = 0.16."""
    N = M + 2
    inv_h2 = float((N - 1) ** 2)
    g = np.linspace(0.0, 1.0, N)
    X, Y = np.meshgrid(g, g, indexing="ij")  # X[i, j] = g[i]
    interior = np.zeros((N, N), bool)
    interior[1:-1, 1:-1] = True
    algebraic = ~interior.ravel()
    u0 = jnp.asarray((16 * X * (1 - X) * Y * (1 - Y))[1:-1, 1:-1])  # (M, M)

    def lap_xy(u):
        uxx = (u[2:, 1:-1] - 2 * u[1:-1, 1:-1] + u[:-2, 1:-1]) * inv_h2
        uyy = (u[1:-1, 2:] - 2 * u[1:-1, 1:-1] + u[1:-1, :-2]) * inv_h2
        return uxx, uyy

    def residual(t, y, yp, args):
        p1, p2 = args[0], args[1]
        u, up = y.reshape(N, N), yp.reshape(N, N)
        uxx, uyy = lap_xy(u)
        F = u  # boundary: u = 0
        F = F.at[1:-1, 1:-1].set(up[1:-1, 1:-1] - p1 * uxx - p2 * uyy)
        return F.ravel()

    def initial(p1, p2, u0_int):
        u = jnp.zeros((N, N), u0_int.dtype).at[1:-1, 1:-1].set(u0_int)
        uxx, uyy = lap_xy(u)
        up = jnp.zeros((N, N), u0_int.dtype).at[1:-1, 1:-1].set(p1 * uxx + p2 * uyy)
        return u.ravel(), up.ravel()  # consistent (y0, y'0)

    def solve(p1, p2, u0_int):
        y0, yp0 = initial(p1, p2, u0_int)
        return dae.solve(residual, 0.0, 0.16, y0, yp0, (p1, p2), saveat=jnp.array([0.16]),
                         algebraic=algebraic, rtol=1e-5, atol=1e-5, max_steps=MAX_STEPS,
                         sensitivity=dae.Adjoint())

    def loss_p(p):  # p = (p1, p2); u0 fixed
        sol = solve(p[0], p[1], u0)
        return jnp.sum(sol.ys[-1] ** 2), sol.stats["num_steps"]

    def loss_all(a):  # a = (p, u0): M^2 + 2 parameters
        sol = solve(a[0][0], a[0][1], a[1])
        return jnp.sum(sol.ys[-1] ** 2), sol.stats["num_steps"]

    def uut(p):  # Σ u u_t at T, for the time-scaling check
        sol = solve(p[0], p[1], u0)
        return jnp.sum(sol.ys[-1] * sol.yps[-1]), sol.stats["num_steps"]

    return dict(N=N, u0=u0, loss_p=loss_p, loss_all=loss_all, uut=uut)


BARNES_Y0 = jnp.array([1.0, 0.3])
BARNES_T1 = 20.0


def barnes_f(y, p):
    return jnp.stack([p[0] * y[0] - p[1] * y[0] * y[1], p[1] * y[0] * y[1] - p[2] * y[1]])


def barnes_residual(t, y, yp, p):
    return yp - barnes_f(y, p)


def barnes_solve(p, ts, rtol=1e-6, atol=1e-8):
    return dae.solve(barnes_residual, 0.0, BARNES_T1, BARNES_Y0, barnes_f(BARNES_Y0, p), p,
                     saveat=ts, algebraic=np.array([False, False]), rtol=rtol, atol=atol,
                     max_steps=MAX_STEPS, sensitivity=dae.Adjoint())


# --------------------------------------------------------------------------- 1. ratios
def part1(repeats: int, grids: tuple[int, ...]) -> list[dict]:
    rows = []
    # (a) Robertson
    f = jax.jit(robertson_G)
    g = jax.jit(jax.grad(robertson_G, has_aux=True))
    fwd = guarded("robertson fwd", time_jitted, "fwd", f, ROB_P, repeats)
    with AdjointStepCounter() as cnt:
        grd = guarded("robertson grad", time_jitted, "grad", g, ROB_P, repeats)
    rows.append(dict(problem="Robertson G=∫y3, t1=4e10", n=3, wrt="p (3)", npar=3, fwd=fwd,
                     grad=grd, adj_steps=cnt.last))
    # (b) heat
    for M in grids:
        h = heat_setup(M)
        p = jnp.array([1.0, 1.0])
        fwd = guarded(f"heat{M} fwd", time_jitted, "fwd", jax.jit(h["loss_p"]), p, repeats)
        for wrt, fn, arg, npar in (
                ("(p1, p2)", h["loss_p"], p, 2),
                (f"(p1, p2, u0) ({M * M + 2})", h["loss_all"], (p, h["u0"]), M * M + 2)):
            with AdjointStepCounter() as cnt:
                grd = guarded(f"heat{M} grad {wrt}", time_jitted, "grad",
                              jax.jit(jax.grad(fn, has_aux=True)), arg, repeats)
            row = dict(problem=f"heat R5, M={M} ({h['N']}x{h['N']} mesh)", n=h["N"] ** 2,
                       wrt=wrt, npar=npar, fwd=fwd, grad=grd, adj_steps=cnt.last)
            if npar > 2 and "error" not in grd and "error" not in fwd:
                row["checks"] = heat_checks(h, fwd, grd, M)
            rows.append(row)
    return rows


def heat_checks(h, fwd, grd, M) -> str:
    """Exact identities of this linear, symmetric problem (independent of the solver's
    discretisation of time): dg/dp1 = dg/dp2 (p1 = p2, symmetric u0); u0·∇_u0 g = 2g
    (g is quadratic in u0); p·∇_p g = T dg/dT = 2T Σ u u_t (time scaling)."""
    g = fwd["value"][0]
    grad = grd["value"]  # (dp1, dp2, du0...)
    sym = abs(grad[0] - grad[1]) / abs(grad[0])
    euler = float(np.dot(np.ravel(h["u0"]), grad[2:]) / (2 * g) - 1)
    uut = float(jax.jit(h["uut"])(jnp.array([1.0, 1.0]))[0])
    scale = float((grad[0] + grad[1]) / (2 * 0.16 * uut) - 1)
    return (f"dg/dp1 = {grad[0]:.5f}, |dg/dp1−dg/dp2|/|dg/dp1| = {sym:.1e}; "
            f"u0·∇g/(2g) − 1 = {euler:.1e}; p·∇g/(2TΣu·u_t) − 1 = {scale:.1e}")


def print_part1(rows: list[dict]) -> None:
    print("## 1. Gradient time ÷ forward time (same jitted loss)\n")
    print("| problem | unknowns | gradient w.r.t. | fwd steps | adjoint steps | fwd compile s "
          "| grad compile s | fwd wall s | grad wall s | grad / fwd | note |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        f, g = r["fwd"], r["grad"]
        ratio = None if "error" in f or "error" in g else g["wall_s"] / f["wall_s"]
        note = g.get("error") or f.get("error") or r.get("checks", "")
        if r["problem"].startswith("Robertson") and "value" in g:
            note = ("dG/dp = (" + ", ".join(f"{v:.4e}" for v in g["value"]) + "); rel. diff vs "
                    "IDAS ASA " + ", ".join(f"{v:.1e}" for v in np.abs(g["value"] / IDAS_DGDP - 1)))
        print(f"| {r['problem']} | {r['n']} | {r['wrt']} | {f.get('aux', 'n/a')} "
              f"| {_fmt(r['adj_steps'], 'd')} | {_fmt(f.get('compile_s'), '.1f')} "
              f"| {_fmt(g.get('compile_s'), '.1f')} | {_fmt(f.get('wall_s'), '.4f')} "
              f"| {_fmt(g.get('wall_s'), '.4f')} | {_fmt(ratio, '.1f')} | {note} |")
    print()


# --------------------------------------------------------------------------- 2. diffrax
def diffrax_G(adjoint):
    """p -> (G, steps) on the ODE form of Robertson plus z' = y3 (z(t1) = G)."""
    vector_field, _ = problems.jax_ode(ROB)

    def vf(t, x, p):
        return jnp.concatenate([vector_field(t, x[:2], p), (1.0 - x[0] - x[1])[None]])

    controller = diffrax.PIDController(rtol=1e-6, atol=jnp.array([1e-8, 1e-14, 1e-6]))

    def G(p):
        sol = diffrax.diffeqsolve(diffrax.ODETerm(vf), diffrax.Kvaerno5(), 0.0, ROB_T1, None,
                                  jnp.array([1.0, 0.0, 0.0]), args=p,
                                  saveat=diffrax.SaveAt(t1=True), stepsize_controller=controller,
                                  max_steps=MAX_STEPS, adjoint=adjoint)
        return sol.ys[-1, 2], sol.stats["num_steps"]

    return G


def part2(repeats: int, dae_row: dict) -> list[dict]:
    rows = [dict(label="daeadjoint Adjoint (BDF, checkpoint_every=50)", grad=dae_row["grad"],
                 fwd=dae_row["fwd"])]
    for label, adjoint in (("diffrax Kvaerno5 RecursiveCheckpointAdjoint", diffrax.RecursiveCheckpointAdjoint()),
                           ("diffrax Kvaerno5 BacksolveAdjoint", diffrax.BacksolveAdjoint())):
        G = diffrax_G(adjoint)
        fwd = guarded(label + " fwd", time_jitted, "fwd", jax.jit(G), ROB_P, repeats)
        grd = guarded(label + " grad", time_jitted, "grad", jax.jit(jax.grad(G, has_aux=True)),
                      ROB_P, repeats)
        rows.append(dict(label=label, fwd=fwd, grad=grd))
    return rows


def print_part2(rows: list[dict]) -> None:
    print("## 2. Robertson dG/dp, G = ∫_0^{4e10} y3 dt: daeadjoint vs diffrax (ODE form)\n")
    print("IDAS ASA reference dG/dp = (1.4879e+06, -5.9470e+00, 9.9117e-04).\n")
    print("| solver | fwd steps | grad compile s | grad wall s | daeadjoint / this "
          "| dG/dp1 | dG/dp2 | dG/dp3 | max rel diff vs IDAS | note |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    ref = rows[0]["grad"].get("wall_s")
    for r in rows:
        g = r["grad"]
        if "error" in g:
            print(f"| {r['label']} | {r['fwd'].get('aux', 'n/a')} | n/a | n/a | n/a | n/a | n/a "
                  f"| n/a | n/a | {g['error']} |")
            continue
        v = g["value"]
        diff = float(np.max(np.abs(v / IDAS_DGDP - 1)))
        finite = bool(np.all(np.isfinite(v)))
        print(f"| {r['label']} | {r['fwd'].get('aux', 'n/a')} | {g['compile_s']:.1f} "
              f"| {g['wall_s']:.4f} | {_fmt(ref and ref / g['wall_s'], '.2f')} "
              f"| {v[0]:.5e} | {v[1]:.5e} | {v[2]:.5e} | {diff:.1e} "
              f"| {'' if finite and diff < 1e-2 else 'gradient wrong'} |")
    print()


# --------------------------------------------------------------------------- 3. Barnes
def part3(repeats: int, n_obs: tuple[int, ...]) -> list[dict]:
    p_true = jnp.array([1.0, 1.0, 1.0])
    p = jnp.array([1.1, 0.9, 1.05])
    rng = np.random.default_rng(0)
    rows = []
    for n_o in n_obs:
        ts = jnp.linspace(BARNES_T1 / n_o, BARNES_T1, n_o)
        clean = jax.jit(lambda q: barnes_solve(q, ts).ys)(p_true)
        data = clean + 0.01 * jnp.asarray(rng.standard_normal(clean.shape))  # fixed noise

        def S(q, ts=ts, data=data):
            sol = barnes_solve(q, ts)
            return 0.5 * jnp.sum((data - sol.ys) ** 2), sol.stats["num_steps"]

        fwd = guarded(f"barnes {n_o} fwd", time_jitted, "fwd", jax.jit(S), p, repeats)
        with AdjointStepCounter() as cnt:
            grd = guarded(f"barnes {n_o} grad", time_jitted, "grad",
                          jax.jit(jax.grad(S, has_aux=True)), p, repeats)
        row = dict(n_o=n_o, fwd=fwd, grad=grd, adj_steps=cnt.last)
        if n_o == n_obs[0] and "error" not in grd:
            row["fd"] = barnes_fd(p, ts, data, grd["value"])
        rows.append(row)
    return rows


def barnes_fd(p, ts, data, grad) -> float:
    """max rel diff of the gradient vs central differences of a rtol-1e-10 forward."""
    S = jax.jit(lambda q: 0.5 * jnp.sum((data - barnes_solve(q, ts, 1e-10, 1e-12).ys) ** 2))
    fd = []
    for i in range(3):
        e = jnp.zeros(3).at[i].set(1e-5)
        fd.append((S(p + e) - S(p - e)) / 2e-5)
    fd = np.asarray(fd)
    return float(np.max(np.abs(grad - fd)) / np.max(np.abs(fd)))


def print_part3(rows: list[dict]) -> None:
    print("## 3. R6 Barnes least squares: cost vs number of observations n_o\n")
    print("| n_o | fwd steps | adjoint steps | fwd wall s | grad wall s | grad / fwd "
          "| grad / grad(n_o=10) | fwd / fwd(n_o=10) | grad compile s | dS/dp | note |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    base = rows[0]
    for r in rows:
        f, g = r["fwd"], r["grad"]
        ok = "error" not in f and "error" not in g
        note = g.get("error") or f.get("error") or ""
        if "fd" in r:
            note = f"max rel diff vs central FD (rtol 1e-10 forward) {r['fd']:.1e}"
        gb, fb = base["grad"].get("wall_s"), base["fwd"].get("wall_s")
        print(f"| {r['n_o']} | {f.get('aux', 'n/a')} | {_fmt(r['adj_steps'], 'd')} "
              f"| {_fmt(f.get('wall_s'), '.4f')} | {_fmt(g.get('wall_s'), '.4f')} "
              f"| {_fmt(ok and g['wall_s'] / f['wall_s'] or None, '.1f')} "
              f"| {_fmt(ok and gb and g['wall_s'] / gb or None, '.2f')} "
              f"| {_fmt(ok and fb and f['wall_s'] / fb or None, '.2f')} "
              f"| {_fmt(g.get('compile_s'), '.1f')} "
              f"| {'(' + ', '.join(f'{v:.5g}' for v in g['value']) + ')' if ok else 'n/a'} "
              f"| {note} |")
    print()


# --------------------------------------------------------------------------- 4. memory
def part4(t1s: tuple[float, ...], everys: tuple[int, ...], max_steps: int) -> dict:
    """One compiled gradient per checkpoint_every with t1 a traced argument, so the very
    same executable (same buffer plan) runs every t1; plus the forward-only loss."""
    steps = {}
    fwd = jax.jit(lambda t1: robertson_G(ROB_P, t1, max_steps=max_steps)[1])
    for t1 in t1s:
        steps[t1] = int(fwd(jnp.asarray(t1)))
    lowered_fwd = jax.jit(lambda p, t1: robertson_G(p, t1, max_steps=max_steps)[0])
    mem_fwd = lowered_fwd.lower(ROB_P, jnp.asarray(t1s[0])).compile().memory_analysis()
    rows = []
    for every in everys:
        g = jax.grad(lambda p, t1: robertson_G(p, t1, every, max_steps)[0])
        try:
            t = time.perf_counter()
            compiled = jax.jit(g).lower(ROB_P, jnp.asarray(t1s[0])).compile()
            compile_s = time.perf_counter() - t
            mem = compiled.memory_analysis()
            runs = {}
            for t1 in t1s:
                t = time.perf_counter()
                val = jax.block_until_ready(compiled(ROB_P, jnp.asarray(t1)))
                runs[t1] = (time.perf_counter() - t, np.asarray(val))
            rows.append(dict(every=every, mem=mem, compile_s=compile_s, runs=runs))
        except Exception as e:  # noqa: BLE001
            rows.append(dict(every=every, error=_error_line(e)))
    return dict(steps=steps, mem_fwd=mem_fwd, rows=rows, max_steps=max_steps)


def print_part4(res: dict) -> None:
    MiB = 2.0 ** 20
    ms = res["max_steps"]
    print(f"## 4. Compiled memory of the jitted Robertson gradient (max_steps = {ms})\n")
    print("`jax.jit(grad).lower(p, t1).compile().memory_analysis()`; t1 is a traced argument, "
          "so one executable runs every t1 below. Forward-only loss (no checkpoints): temp "
          f"{res['mem_fwd'].temp_size_in_bytes / MiB:.3f} MiB.\n")
    t1s = list(res["steps"])
    print("| checkpoint_every | checkpoints (max_steps/every) | temp MiB | argument B | output B "
          "| compile s | " + " | ".join(f"t1={t1:.0e}: steps / grad s" for t1 in t1s) + " | note |")
    print("|---|---|---|---|---|---|" + "---|" * len(t1s) + "---|")
    for r in res["rows"]:
        if "error" in r:
            print(f"| {r['every']} | | n/a | | | | " + " | " * len(t1s) + f"{r['error']} |")
            continue
        m = r["mem"]
        cells = []
        for t1 in t1s:
            wall, val = r["runs"][t1]
            cells.append(f"{res['steps'][t1]} / {wall:.3f}")
        print(f"| {r['every']} | {ms // r['every']} | {m.temp_size_in_bytes / MiB:.3f} "
              f"| {m.argument_size_in_bytes} | {m.output_size_in_bytes} | {r['compile_s']:.1f} "
              f"| " + " | ".join(cells) + " | |")
    print()


# --------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="3 repeats, heat M=10 only, fewer n_o / checkpoint_every")
    opts = parser.parse_args()
    if opts.quick:
        repeats, grids, n_obs, everys = 3, (10,), (10, 2400), (25, 100)
    else:
        repeats, grids, n_obs, everys = 5, (10, 20), (10, 100, 400, 2400), (25, 50, 100, 400)
    t_start = time.perf_counter()
    print(f"# daeadjoint gradient benchmarks ({'quick' if opts.quick else 'full'})\n")
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"jax {jax.__version__} ({jax.default_backend()}, x64), diffrax {diffrax.__version__}; "
          f"median of {repeats} warm runs after one warm-up; 1-min load average before start "
          f"{os.getloadavg()[0]:.2f}\n", flush=True)
    rows1 = part1(repeats, grids)
    print_part1(rows1)
    sys.stdout.flush()
    print_part2(part2(repeats, rows1[0]))
    sys.stdout.flush()
    print_part3(part3(repeats, n_obs))
    sys.stdout.flush()
    print_part4(part4((4e2, 4e5, 4e8, 4e10), everys, 20_000))
    print(f"Total {time.perf_counter() - t_start:.0f} s.")


if __name__ == "__main__":
    main()
