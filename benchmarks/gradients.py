"""Gradient benchmarks of daeadjoint's continuous adjoint; prints Markdown tables.

    python benchmarks/gradients.py [--quick]

1. Gradient time / forward time of the same jitted loss: Robertson G = ∫ y3 dt, and the
   R5 2-D heat equation (small grids) w.r.t. (p1, p2) and w.r.t. (p1, p2, u0).
2. Robertson dG/dp vs diffrax (ODE form, Kvaerno5) with RecursiveCheckpointAdjoint and
   BacksolveAdjoint.
3. R6 Barnes predator-prey least squares: gradient cost vs number of observations.
4. Compiled memory of the jitted gradient vs number of steps and checkpoint_every.

Timings: one warm-up call, then the median of the warm repeats, each
``block_until_ready`` (``peers._timed``); the functions compared in one table are timed
in interleaved rounds. Single-threaded OpenBLAS, as in ``run.py``. Every solver
call is guarded: a failure prints its error in the table.
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
# Single-threaded LAPACK, as in run.py (jaxlib's CPU LU calls scipy's OpenBLAS): on a
# busy 2-core machine its spinning threads made small LUs ~100x slower (docs/solving.md).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
import peers
import problems

jax.config.update("jax_enable_x64", True)

import daeadjoint as dae
import daeadjoint._solve as _dae_solve  # private: only to count adjoint steps

MAX_STEPS = 100_000
DISCRETE_MAX_STEPS = 2_000  # DiscreteAdjoint's replay scans max_steps slots: size it


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


def _ratio(a: dict, b: dict, spec: str = ".1f") -> str:
    """'median ratio (ratio of the minima)' of two timings, or n/a."""
    if not a or not b or "wall_s" not in a or "wall_s" not in b:
        return "n/a"
    return (f"{format(a['wall_s'] / b['wall_s'], spec)} "
            f"({format(a['min_s'] / b['min_s'], spec)})")


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
    output), aux (second output, e.g. the forward step count), adj_steps)}, or
    {name: {error}} if a call raises."""
    out, first = {}, {}
    for name, fn in fns.items():
        AdjointSteps.label = name
        try:
            first[name], res = peers._timed(lambda fn=fn: jax.block_until_ready(fn(arg)))
            out[name] = dict(value=_flat(res[0]), aux=int(res[1]), walls=[])
        except Exception as e:  # noqa: BLE001 - a failing solver must not stop the report
            print(f"<!-- {name} failed: {_error_line(e)} -->", flush=True)
            out[name] = dict(error=_error_line(e))
    for _ in range(repeats):
        for name, fn in fns.items():
            if "error" not in out[name]:
                out[name]["walls"].append(
                    peers._timed(lambda fn=fn: jax.block_until_ready(fn(arg)))[0])
    for name, r in out.items():
        r["adj_steps"] = AdjointSteps.counts.get(name)
        if "error" not in r:
            r["wall_s"] = statistics.median(r["walls"])
            r["min_s"] = min(r["walls"])
            r["compile_s"] = max(first[name] - r["wall_s"], 0.0)
    return out


class AdjointSteps:
    """Backward (adjoint) step counts of daeadjoint gradients, by label.

    ``daeadjoint`` computes ``stats['adjoint_steps']`` in its backward pass but does not
    return it. ``install()`` wraps the (private) ``daeadjoint._solve.backward`` with one
    ``jax.debug.callback`` that stores it under the label current when the gradient was
    traced (``time_jitted`` sets the label to the function's name): one host call per
    gradient, after the backward loop. If the private function is gone, counts stay
    empty and the tables say n/a."""

    label: str | None = None
    counts: dict = {}  # noqa: RUF012 - one registry shared by all gradients

    @classmethod
    def install(cls) -> None:
        orig = getattr(_dae_solve, "backward", None)
        if orig is None or getattr(orig, "_counted", False):
            return

        def backward(*a, **kw):
            out = orig(*a, **kw)
            label = cls.label
            jax.debug.callback(lambda s: cls.counts.__setitem__(label, int(s)),
                               out[-1]["adjoint_steps"])
            return out

        backward._counted = True
        _dae_solve.backward = backward


# --------------------------------------------------------------------------- problems
ROB = problems.robertson()
ROB_RES = problems.jax_residual(ROB)  # same residual as the forward benchmark
ROB_P = jnp.array([0.04, 1e4, 3e7])
ROB_Y0 = jnp.array([1.0, 0.0, 0.0])
ROB_YP0 = jnp.array([-0.04, 0.04, 0.0])
ROB_ALG = np.array([False, False, True])
ROB_ATOL = jnp.array([1e-8, 1e-14, 1e-6])  # idasRoberts_ASAi_dns, as in REFERENCE R1
ROB_T1 = 4e10
IDAS_DGDP = np.array([1.4879e06, -5.9470e00, 9.9117e-04])  # IDAS idasRoberts_ASAi_dns (R1)


def robertson_G(p, t1=ROB_T1, checkpoint_every=50, max_steps=MAX_STEPS, sensitivity=None):
    """(G = ∫_0^t1 y3 dt, forward steps); default sensitivity Adjoint(atol=1e-8)."""
    if sensitivity is None:
        sensitivity = dae.Adjoint(atol=1e-8, checkpoint_every=checkpoint_every)
    sol = dae.solve(ROB_RES, 0.0, t1, ROB_Y0, ROB_YP0, p, saveat=jnp.reshape(t1, (1,)),
                    algebraic=ROB_ALG, rtol=1e-6, atol=ROB_ATOL,
                    quadrature=lambda t, y, yp, p: y[2:3], max_steps=max_steps,
                    sensitivity=sensitivity)
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

    def loss(a):  # a = ((p1, p2), u0 (M, M)): g1 = Σ u(T)², and the forward step count
        sol = solve(a[0][0], a[0][1], a[1])
        return jnp.sum(sol.ys[-1] ** 2), sol.stats["num_steps"]

    def uut(a):  # Σ u u_t at T, for the time-scaling check
        sol = solve(a[0][0], a[0][1], a[1])
        return jnp.sum(sol.ys[-1] * sol.yps[-1])

    return dict(N=N, args=(jnp.array([1.0, 1.0]), u0), loss=loss, uut=uut, solve=solve)


BARNES_Y0 = jnp.array([1.0, 0.3])
BARNES_T1 = 20.0


def barnes_f(y, p):
    return jnp.stack([p[0] * y[0] - p[1] * y[0] * y[1], p[1] * y[0] * y[1] - p[2] * y[1]])


def barnes_residual(t, y, yp, p):
    return yp - barnes_f(y, p)


def barnes_solve(p, ts, rtol=1e-6, atol=1e-8, sensitivity=None, max_steps=MAX_STEPS):
    return dae.solve(barnes_residual, 0.0, BARNES_T1, BARNES_Y0, barnes_f(BARNES_Y0, p), p,
                     saveat=ts, algebraic=np.array([False, False]), rtol=rtol, atol=atol,
                     max_steps=max_steps, sensitivity=sensitivity or dae.Adjoint())


# --------------------------------------------------------------------------- 1. ratios
def grad_of(loss, wrt=None):
    """jit of the gradient of ``loss(arg) -> (value, aux)``, w.r.t. all of ``arg`` or,
    with ``wrt = 0``, only w.r.t. ``arg[0]`` (the rest held fixed); returns (grad, aux)."""
    if wrt is None:
        return jax.jit(jax.grad(loss, has_aux=True))
    return jax.jit(lambda a: jax.grad(lambda a0: loss((a0,) + tuple(a[1:])), has_aux=True)(a[0]))


def part1(repeats: int, grids: tuple[int, ...]) -> tuple[list[dict], dict]:
    rows = []
    # (a) Robertson
    rob = {"robertson fwd": jax.jit(robertson_G), "robertson grad": grad_of(robertson_G)}
    with OtherLoad() as load:
        r = time_jitted(rob, ROB_P, repeats)
    rows.append(dict(problem="Robertson G=∫y3 dt, t1=4e10", n=3, wrt="p (3)",
                     fwd=r["robertson fwd"], grad=r["robertson grad"], load=load.cores))
    # (b) heat: the same loss of a = ((p1, p2), u0); gradient w.r.t. (p1, p2) or all of a
    for M in grids:
        h = heat_setup(M)
        names = {f"heat{M} fwd": jax.jit(h["loss"]), f"heat{M} grad p": grad_of(h["loss"], 0),
                 f"heat{M} grad all": grad_of(h["loss"])}
        with OtherLoad() as load:
            r = time_jitted(names, h["args"], repeats)
        fwd, gp, ga = r[f"heat{M} fwd"], r[f"heat{M} grad p"], r[f"heat{M} grad all"]
        prob = f"heat R5, M={M} ({h['N']}x{h['N']} mesh)"
        rows.append(dict(problem=prob, n=h["N"] ** 2, wrt="(p1, p2)", fwd=fwd, grad=gp,
                         load=load.cores))
        row = dict(problem=prob, n=h["N"] ** 2, wrt=f"(p1, p2, u0): {M * M + 2}", fwd=fwd,
                   grad=ga, load=load.cores)
        if "error" not in ga and "error" not in fwd and "error" not in gp:
            row["vs_p"] = _ratio(ga, gp, ".2f")
            row["checks"] = heat_checks(h, fwd, gp, ga)
        rows.append(row)
    return rows, rob


def heat_checks(h, fwd, gp, ga) -> str:
    """Exact identities of this linear, symmetric problem (they hold for the semi-discrete
    system, so they test the adjoint, not the spatial grid): dg/dp1 = dg/dp2 (p1 = p2,
    symmetric u0); u0·∇_u0 g = 2g (g is quadratic in u0); p·∇_p g = T dg/dT =
    2T Σ u u_t (time scaling); and both gradients agree on dg/dp."""
    g = fwd["value"][0]
    grad = ga["value"]  # (dp1, dp2, du0...)
    sym = abs(grad[0] - grad[1]) / abs(grad[0])
    same = float(np.max(np.abs(grad[:2] - gp["value"])) / np.max(np.abs(gp["value"])))
    euler = float(np.dot(np.ravel(h["args"][1]), grad[2:]) / (2 * g) - 1)
    uut = float(jax.jit(h["uut"])(h["args"]))
    scale = float((grad[0] + grad[1]) / (2 * 0.16 * uut) - 1)
    return (f"dg/dp = ({grad[0]:.5f}, {grad[1]:.5f}); "
            f"checks: (dg/dp1−dg/dp2)/dg/dp1 {sym:.0e}, p-only vs full {same:.0e}, "
            f"u0·∇g/(2g)−1 {euler:.1e}, p·∇g/(2TΣu·u_t)−1 {scale:.1e}")


def print_part1(rows: list[dict]) -> None:
    print("## 1. Gradient time ÷ forward time (same jitted loss)\n")
    print("| problem | unknowns | gradient w.r.t. | fwd steps | adjoint steps | fwd compile s "
          "| grad compile s | fwd wall s | grad wall s | grad / fwd | grad / grad(p only) "
          "| other cores busy | note |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        f, g = r["fwd"], r["grad"]
        note = g.get("error") or f.get("error") or r.get("checks", "")
        if r["problem"].startswith("Robertson") and "value" in g:
            note = ("dG/dp = (" + ", ".join(f"{v:.4e}" for v in g["value"]) + "), rel. diff vs "
                    "IDAS ASA (" + ", ".join(f"{v:.0e}" for v in np.abs(g["value"] / IDAS_DGDP - 1))
                    + ")")
        print(f"| {r['problem']} | {r['n']} | {r['wrt']} | {f.get('aux', 'n/a')} "
              f"| {_fmt(g.get('adj_steps'), 'd')} | {_fmt(f.get('compile_s'), '.1f')} "
              f"| {_fmt(g.get('compile_s'), '.1f')} | {_fmt(f.get('wall_s'), '.4f')} "
              f"| {_fmt(g.get('wall_s'), '.4f')} | {_ratio(g, f)} "
              f"| {r.get('vs_p', 'n/a')} | {r['load']:.2f} | {note} |")
    print()


# --------------------------------------------------------------------------- 2. diffrax
DIFFRAX_ATOL = jnp.array([1e-8, 1e-14, 1e-6])  # (y1, y2, z): daeadjoint's atol on (y1, y2, y3)


def diffrax_G(adjoint):
    """p -> (G, steps) on the ODE form of Robertson plus z' = y3 (z(t1) = G)."""
    vector_field, _ = problems.jax_ode(ROB)

    def vf(t, x, p):
        return jnp.concatenate([vector_field(t, x[:2], p), (1.0 - x[0] - x[1])[None]])

    controller = diffrax.PIDController(rtol=1e-6, atol=DIFFRAX_ATOL)

    def G(p):
        sol = diffrax.diffeqsolve(diffrax.ODETerm(vf), diffrax.Kvaerno5(), 0.0, ROB_T1, None,
                                  jnp.array([1.0, 0.0, 0.0]), args=p,
                                  saveat=diffrax.SaveAt(t1=True), stepsize_controller=controller,
                                  max_steps=MAX_STEPS, adjoint=adjoint)
        return sol.ys[-1, 2], sol.stats["num_steps"]

    return G


def part2(repeats: int, rob: dict, compile_s=None) -> list[tuple[str, dict, dict, float]]:
    """Every gradient timed in the same interleaved rounds (daeadjoint's jitted gradient
    from part 1 is reused, already compiled)."""
    fns = {"daeadjoint fwd": rob["robertson fwd"], "daeadjoint grad": rob["robertson grad"]}
    labels = {"daeadjoint": "daeadjoint Adjoint (BDF, checkpoint_every=50)",
              "discrete": f"daeadjoint DiscreteAdjoint (max_steps={DISCRETE_MAX_STEPS})"}
    fns["discrete grad"] = grad_of(lambda p: robertson_G(
        p, max_steps=DISCRETE_MAX_STEPS, sensitivity=dae.DiscreteAdjoint()))
    for key, label, adjoint in (
            ("recursive", "diffrax Kvaerno5, RecursiveCheckpointAdjoint (default)",
             diffrax.RecursiveCheckpointAdjoint()),
            ("backsolve", "diffrax Kvaerno5, BacksolveAdjoint", diffrax.BacksolveAdjoint())):
        G = diffrax_G(adjoint)
        if key == "recursive":  # the forward pass does not depend on `adjoint`: time it once
            fns[f"{key} fwd"] = jax.jit(G)
        fns[f"{key} grad"] = grad_of(G)
        labels[key] = label
    with OtherLoad() as load:
        r = time_jitted(fns, ROB_P, repeats)
    if compile_s is not None and "error" not in r["daeadjoint grad"]:
        r["daeadjoint grad"]["compile_s"] = compile_s  # compiled in part 1
    fwd = {k: r.get(f"{k} fwd", {}) for k in labels}
    fwd["discrete"] = r["daeadjoint fwd"]  # the same forward solve
    return [(labels[k], fwd[k], r[f"{k} grad"], load.cores) for k in labels]


def print_part2(rows) -> None:
    print("## 2. Robertson dG/dp, G = ∫_0^{4e10} y3 dt: daeadjoint vs diffrax (ODE form)\n")
    print("diffrax: Kvaerno5 + PIDController(rtol=1e-6, atol=(1e-8, 1e-14, 1e-6)) on "
          "(y1, y2, z), y3 = 1 - y1 - y2 eliminated, z' = y3, G = z(t1); max_steps = 100000. "
          "The DiscreteAdjoint row shares the Adjoint row's forward.\n")
    print(f"IDAS ASA reference dG/dp = (1.4879e+06, -5.9470e+00, 9.9117e-04). Other cores busy "
          f"during these runs: {rows[0][3]:.2f}.\n")
    print("| solver | fwd steps | fwd wall s | grad compile s | grad wall s | grad / fwd "
          "| grad: daeadjoint / this | dG/dp1 | dG/dp2 | dG/dp3 | max rel diff vs IDAS | note |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    ref = rows[0][2]
    for label, f, g, _ in rows:
        if "error" in g:
            print(f"| {label} | {f.get('aux', 'as above')} | {_fmt(f.get('wall_s'), '.4f')} | n/a "
                  f"| n/a | n/a | n/a | n/a | n/a | n/a | n/a | fails: {g['error']} |")
            continue
        v = g["value"]
        diff = float(np.max(np.abs(v / IDAS_DGDP - 1)))
        bad = not np.all(np.isfinite(v)) or diff > 1e-2
        print(f"| {label} | {f.get('aux', 'n/a')} | {_fmt(f.get('wall_s'), '.4f')} "
              f"| {g['compile_s']:.1f} | {g['wall_s']:.4f} "
              f"| {_ratio(g, f)} | {_ratio(ref, g, '.3f')} "
              f"| {v[0]:.5e} | {v[1]:.5e} | {v[2]:.5e} | {diff:.1e} "
              f"| {'gradient wrong' if bad else ''} |")
    print()


# --------------------------------------------------------------------------- 3. Barnes
BARNES_P_TRUE = jnp.array([1.0, 1.0, 1.0])
BARNES_P = jnp.array([1.1, 0.9, 1.05])


def part3(repeats: int, n_obs: tuple[int, ...]) -> list[dict]:
    """Per n_o: forward, continuous `Adjoint` and `DiscreteAdjoint` gradients of the same
    S(p), timed in interleaved rounds; central-FD check at the smallest and largest n_o;
    at the largest n_o also DiscreteAdjoint with max_steps = 100_000 (its cost grows with
    max_steps)."""
    rows = []
    for n_o in n_obs:
        rng = np.random.default_rng(n_o)  # the data of one n_o never depend on the others
        ts = jnp.linspace(BARNES_T1 / n_o, BARNES_T1, n_o)
        clean = jax.jit(lambda q, ts=ts: barnes_solve(q, ts).ys)(BARNES_P_TRUE)
        data = clean + 0.01 * jnp.asarray(rng.standard_normal(clean.shape))  # fixed noise

        def S(q, ts=ts, data=data, sensitivity=None, max_steps=MAX_STEPS):
            sol = barnes_solve(q, ts, sensitivity=sensitivity, max_steps=max_steps)
            return 0.5 * jnp.sum((data - sol.ys) ** 2), sol.stats["num_steps"]

        def S_discrete(q, max_steps=DISCRETE_MAX_STEPS):
            return S(q, sensitivity=dae.DiscreteAdjoint(), max_steps=max_steps)

        fns = {f"barnes{n_o} fwd": jax.jit(S), f"barnes{n_o} grad": grad_of(S),
               f"barnes{n_o} discrete": grad_of(S_discrete)}
        if n_o == n_obs[-1]:
            fns[f"barnes{n_o} discrete100k"] = grad_of(
                lambda q: S_discrete(q, max_steps=MAX_STEPS))
        with OtherLoad() as load:
            r = time_jitted(fns, BARNES_P, repeats)
        row = dict(n_o=n_o, fwd=r[f"barnes{n_o} fwd"], grad=r[f"barnes{n_o} grad"],
                   discrete=r[f"barnes{n_o} discrete"],
                   discrete100k=r.get(f"barnes{n_o} discrete100k"), load=load.cores)
        if n_o in (n_obs[0], n_obs[-1]):
            row["fd"] = barnes_fd(ts, data)
        rows.append(row)
    return rows


def barnes_fd(ts, data) -> np.ndarray:
    """Central differences (h = 1e-5) of an rtol-1e-10 forward solve."""
    S = jax.jit(lambda q: 0.5 * jnp.sum((data - barnes_solve(q, ts, 1e-10, 1e-12).ys) ** 2))
    return np.array([(S(BARNES_P + e) - S(BARNES_P - e)) / 2e-5 for e in 1e-5 * jnp.eye(3)])


def _fd_note(g: dict, fd) -> str:
    if fd is None or "value" not in g:
        return ""
    return f"max rel diff vs FD {np.max(np.abs(g['value'] / fd - 1)):.0e}"


def print_part3(rows: list[dict]) -> None:
    print("## 3. R6 Barnes least squares: cost vs number of observations n_o\n")
    print("FD: central differences (h = 1e-5) of an rtol-1e-10 forward solve, compared per "
          "component. Other cores busy: " + ", ".join(f"{r['load']:.2f}" for r in rows) + ".\n")
    print("Continuous adjoint (`dae.Adjoint()`, the default):\n")
    print("| n_o | fwd steps | adjoint steps | fwd wall s | grad wall s | grad / fwd "
          "| grad / grad(n_o=10) | fwd / fwd(n_o=10) | grad compile s | dS/dp | note |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    base = rows[0]
    for r in rows:
        f, g = r["fwd"], r["grad"]
        ok = "error" not in f and "error" not in g
        note = g.get("error") or f.get("error") or _fd_note(g, r.get("fd"))
        print(f"| {r['n_o']} | {f.get('aux', 'n/a')} | {_fmt(g.get('adj_steps'), 'd')} "
              f"| {_fmt(f.get('wall_s'), '.4f')} | {_fmt(g.get('wall_s'), '.4f')} "
              f"| {_ratio(g, f)} | {_ratio(g, base['grad'], '.2f')} "
              f"| {_ratio(f, base['fwd'], '.2f')} "
              f"| {_fmt(g.get('compile_s'), '.1f')} "
              f"| {'(' + ', '.join(f'{v:.5g}' for v in g['value']) + ')' if ok else 'n/a'} "
              f"| {note} |")
    print()
    print(f"`dae.DiscreteAdjoint()` (max_steps = {DISCRETE_MAX_STEPS}; last row 100000), same "
          "S(p), timed in the same rounds:\n")
    print("| n_o | max_steps | grad wall s | grad / fwd | grad / grad(n_o=10) "
          "| continuous / discrete grad time | grad compile s "
          "| max rel diff vs continuous gradient | note |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        for key, ms in (("discrete", DISCRETE_MAX_STEPS), ("discrete100k", MAX_STEPS)):
            d = r.get(key)
            if d is None:
                continue
            if "error" in d:
                print(f"| {r['n_o']} | {ms} | n/a | n/a | n/a | n/a | n/a | n/a | {d['error']} |")
                continue
            g = r["grad"]
            diff = (f"{np.max(np.abs(d['value'] / g['value'] - 1)):.0e}" if "value" in g
                    else "n/a")
            print(f"| {r['n_o']} | {ms} | {d['wall_s']:.4f} | {_ratio(d, r['fwd'])} "
                  f"| {_ratio(d, base['discrete'], '.2f')} | {_ratio(g, d)} "
                  f"| {d['compile_s']:.1f} | {diff} | {_fd_note(d, r.get('fd'))} |")
    print()


# --------------------------------------------------------------------------- 4. memory
def part4(t1s: tuple[float, ...], everys: tuple[int, ...], max_steps: int) -> dict:
    """One compiled gradient per sensitivity setting with (p, t1) traced arguments, so the
    very same executable (same buffer plan) runs every t1; plus the forward-only loss."""
    steps_fn = jax.jit(lambda p, t1: robertson_G(p, t1, max_steps=max_steps)[1])
    steps = {t1: int(steps_fn(ROB_P, t1)) for t1 in t1s}
    fwd_mem = jax.jit(lambda p, t1: robertson_G(p, t1, max_steps=max_steps)[0]).lower(
        ROB_P, t1s[0]).compile().memory_analysis()
    configs = [(f"Adjoint(checkpoint_every={e})", e, None) for e in everys]
    configs.append(("DiscreteAdjoint()", None, dae.DiscreteAdjoint()))
    rows = []
    for label, every, sens in configs:
        g = jax.grad(lambda p, t1, every=every or 50, sens=sens:
                     robertson_G(p, t1, every, max_steps, sens)[0])
        try:
            t = time.perf_counter()
            compiled = jax.jit(g).lower(ROB_P, t1s[0]).compile()
            compile_s = time.perf_counter() - t
            runs = {}
            for t1 in t1s:
                jax.block_until_ready(compiled(ROB_P, t1))
                runs[t1] = statistics.median(
                    peers._timed(lambda c=compiled, t1=t1: jax.block_until_ready(c(ROB_P, t1)))[0]
                    for _ in range(3))
            rows.append(dict(label=label, every=every, mem=compiled.memory_analysis(),
                             compile_s=compile_s, runs=runs))
        except Exception as e:  # noqa: BLE001 - a failing solver must not stop the report
            print(f"<!-- memory {label} failed: {_error_line(e)} -->")
            rows.append(dict(label=label, every=every, error=_error_line(e)))
    return dict(steps=steps, fwd_mem=fwd_mem, rows=rows, max_steps=max_steps)


def print_part4(res: dict) -> None:
    KiB = 1024.0
    ms, t1s = res["max_steps"], list(res["steps"])
    print(f"## 4. Compiled memory of the jitted Robertson gradient vs steps (max_steps = {ms})\n")
    print("`jax.jit(jax.grad(G)).lower(p, t1).compile().memory_analysis()` with (p, t1) traced, "
          "so one executable (one buffer plan) runs every t1; G as in part 1. Forward steps "
          "per t1: " + ", ".join(f"t1={t1:.0e}: {n}" for t1, n in res["steps"].items())
          + ". Forward-only loss (no checkpoints): temp "
          f"{res['fwd_mem'].temp_size_in_bytes / KiB:.0f} KiB. grad s: median of 3.\n")
    print("| sensitivity | checkpoint slots (max_steps/every) | temp KiB | argument B "
          "| output B | grad compile s | "
          + " | ".join(f"grad s, t1={t1:.0e}" for t1 in t1s) + " | note |")
    print("|---|---|---|---|---|---|" + "---|" * len(t1s) + "---|")
    for r in res["rows"]:
        slots = ms // r["every"] if r["every"] else "n/a"
        if "error" in r:
            print(f"| {r['label']} | {slots} | n/a | n/a | n/a | n/a | "
                  + " | ".join("n/a" for _ in t1s) + f" | {r['error']} |")
            continue
        m = r["mem"]
        print(f"| {r['label']} | {slots} | {m.temp_size_in_bytes / KiB:.0f} "
              f"| {m.argument_size_in_bytes} | {m.output_size_in_bytes} | {r['compile_s']:.1f} | "
              + " | ".join(f"{r['runs'][t1]:.3f}" for t1 in t1s) + " | |")
    print()


# --------------------------------------------------------------------------- main
def _revision() -> str:
    """The checkout's commit (read-only git call), '+changes' if the package differs."""
    import subprocess
    root = Path(__file__).resolve().parents[1]
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root,
                             capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "daeadjoint"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown commit"
    return rev + (" +uncommitted changes" if dirty else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="3 repeats, heat M=10 only, n_o in (10, 2400), 2 checkpoint_every")
    opts = parser.parse_args()
    if opts.quick:
        repeats, grids, n_obs, everys = 3, (10,), (10, 2400), (25, 100)
    else:
        repeats, grids, n_obs, everys = 5, (10, 20), (10, 100, 400, 2400), (25, 100, 400)
    AdjointSteps.install()
    t_start = time.perf_counter()
    print(f"# daeadjoint gradient benchmarks ({'quick' if opts.quick else 'full'})\n")
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"jax {jax.__version__} ({jax.default_backend()}, x64), diffrax {diffrax.__version__}; "
          f"median of {repeats} warm runs after one warm-up, the functions compared in a "
          f"table timed in interleaved rounds; ratios: median (ratio of the fastest runs); "
          f"1-min load average before start {os.getloadavg()[0]:.2f}; "
          f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS')}; "
          f"daeadjoint at {_revision()}. 'other cores busy': average number of cores other "
          f"processes kept busy meanwhile (timings are only comparable where it is ~0).\n",
          flush=True)
    rows1, rob = part1(repeats, grids)
    print_part1(rows1)
    sys.stdout.flush()
    print_part2(part2(repeats, rob, rows1[0]["grad"].get("compile_s")))
    sys.stdout.flush()
    print_part3(part3(repeats, n_obs))
    sys.stdout.flush()
    print_part4(part4((4e2, 4e5, 4e8, 4e10), everys, 20_000))
    print(f"Total {time.perf_counter() - t_start:.0f} s.")


if __name__ == "__main__":
    main()
