"""Delay equations: the Kermack–McKendrick model (Calver & Enright §3.2.2; REFERENCE_VALUES
R8) forward against jitcdde, side by side, and the cost of a gradient.

    OPENBLAS_NUM_THREADS=1 python benchmarks/delays.py [--repeats 7]

Problem: y(t) = (5, 0.1, 1) for t ≤ 0, τ = (1, 10), outputs at t = 5, 10, 20, 30, 40,
55; rtol = atol = tol. Error: the largest relative error (floor 1) against the method of
steps with scipy's DOP853 at 1e-13 (`tests/test_delays.km_reference`). Columns:

- daeadjoint: `jax.jit` of `solve(..., delays=...)` (variable-order BDF; breaking points
  t0 + Σkᵢτᵢ up to order 5 are step boundaries), warm median; its step count.
- jitcdde (Ansmann 2018; if installed): the model compiled to C, Bogacki–Shampine
  embedded RK with cubic Hermite history, `step_on_discontinuities()` (which integrates
  to just past the longest delay; outputs before that from its stored spline) then
  `integrate` at each later output time (first_step 1e-3, max_step 0.5), warm median
  (model build and C compilation excluded, reported once).
- gradient ÷ forward: `jax.grad` of the least-squares objective over the six outputs with
  respect to (a, b, c, τ1, τ2) (reverse mode by transposing one variational solve with
  five directions, docs/delays.md), warm, divided by the forward solve's time.
jitcdde has no parameter gradients; torchdde was not installed here.

    OPENBLAS_NUM_THREADS=1 python benchmarks/delays.py --gradient-scaling [--repeats 3]

The cost of the gradient of ½ Σ‖y(t_i) − ỹ_i‖² (noisy data, n_o equally spaced outputs on
(0, 55], rtol = atol = 1e-8) by the continuous adjoint (`sensitivity=Adjoint()`) and by
the variational system (`sensitivity=ForwardSensitivity()`), against n_o = 10, 100, 1000
(the five parameters) and against the number of parameters (n_o = 10; K extra
parameters θ enter y1' as Σ_j θ_j cos(j t / 10), with θ = 0, so the solution is the same
and every θ_j has a nonzero derivative). Reported: warm median ms, ÷ the forward solve,
and the backward solve's step count (adjoint) — load-independent.

    OPENBLAS_NUM_THREADS=1 python benchmarks/delays.py --checkpoint-memory [--repeats 3]

The continuous adjoint's forward solution stored (every step's polynomial, max_steps
rows) against recomputed from checkpoints (`Adjoint(checkpoint_every=K)`, each
checkpoint holding the step ring of `history_steps` = H steps): the same least-squares
gradient at n_o = 100 and 1000 outputs, rtol = atol = 1e-8, H = 600 (Kermack–McKendrick
takes 2043 steps, at most ~550 within τ2), K = 1000 (three segments), max_steps =
100 000 (the default). Reported: the compiled gradient program's memory (XLA's buffer
assignment, `memory_analysis()`: temporaries + arguments + outputs; load-independent),
the step rows the rule counts (`_delay/checkpoint.py`), compilation seconds and the warm
median (the two programs' runs interleaved), and whether the two gradients agree bit for
bit.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(1, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_enable_x64", True)

import daeadjoint as dae  # noqa: E402
from tests.test_delays import KM_P, KM_TS, km, km_lags, km_reference  # noqa: E402


def _median(fn, repeats):
    walls = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        walls.append(time.perf_counter() - t)
    return statistics.median(walls)


def _error(ys, ref):
    return float(np.max(np.abs(np.asarray(ys) - ref) / np.maximum(np.abs(ref), 1.0)))


def history_steps(tol):
    """The default ring (1000 steps) holds τ2 = 10 of steps at 1e-6; at 1e-9 the
    gradient's variational solve (five directions under error control) needs more."""
    return 1000 if tol >= 1e-6 else 4000


def ours(tol):
    def solve(p):
        sol = dae.solve(km, 0.0, 55.0, p[:3], args=p, delays=km_lags,
                        saveat=jnp.asarray(KM_TS), rtol=tol, atol=tol,
                        history_steps=history_steps(tol))
        return sol.ys, sol.stats["num_steps"]
    return jax.jit(solve)


def jitcdde_runner():
    try:
        from jitcdde import jitcdde, t, y
    except ImportError:
        return None, None
    tau1, tau2 = KM_P[3], KM_P[4]
    f = [-y(0) * y(1, t - tau1) + y(1, t - tau2), y(0) * y(1, t - tau1) - y(1),
         y(1) - y(1, t - tau2)]
    start = time.perf_counter()
    model = jitcdde(f, verbose=False)
    model.compile_C(verbose=False)
    build = time.perf_counter() - start

    def run(tol):
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")      # "the spline already contains points"
            model.constant_past(list(KM_P[:3]), time=0.0)
            model.set_integration_parameters(rtol=tol, atol=tol, first_step=1e-3,
                                             max_step=0.5)
            model.step_on_discontinuities()
            # It has integrated past the longest delay (to t = 11): earlier outputs come
            # from its stored Hermite spline, later ones from `integrate`.
            past = model.get_state()
            return np.array([past.get_state(T) if T <= model.t else model.integrate(T)
                             for T in KM_TS])
    return run, build


def km_extra(t, y, yp, y_lag, p):
    """Kermack–McKendrick with the extra parameters p[5:] as a forcing of y1'."""
    k = p.shape[0] - 5
    forcing = jnp.sum(p[5:] * jnp.cos(jnp.arange(1, k + 1) * t / 10.0)) if k else 0.0
    return km(t, y, yp, y_lag, p) - jnp.array([forcing, 0.0, 0.0])


def gradient_scaling(repeats):
    tol = 1e-8
    print(f"# gradient cost, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load "
          f"average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; medians of {repeats} "
          "warm runs")
    print("| n_o | parameters | forward ms | adjoint ms (÷ fwd) | variational ms (÷ fwd) |")
    print("|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    for n_obs, extra in ((10, 0), (10, 20), (10, 60), (100, 0), (1000, 0)):
        ts = jnp.linspace(55.0 / n_obs, 55.0, n_obs)
        p = jnp.concatenate([jnp.asarray(KM_P), jnp.zeros(extra)])

        def run(q, sens=None, ts=ts):
            return dae.solve(km_extra, 0.0, 55.0, q[:3], args=q, delays=lambda q: q[3:5],
                             saveat=ts, rtol=tol, atol=tol, history_steps=4000,
                             sensitivity=sens).ys

        base = jax.jit(run)(p)
        data = base + 0.05 * rng.standard_normal(base.shape)
        fwd = jax.jit(run)
        jax.block_until_ready(fwd(p))
        cols = [_median(lambda: fwd(p), repeats)]
        for sens in (dae.Adjoint(), dae.ForwardSensitivity()):
            g = jax.jit(jax.grad(lambda q, sens=sens: 0.5 * jnp.sum((run(q, sens) - data) ** 2)))
            jax.block_until_ready(g(p))
            cols.append(_median(lambda g=g: g(p), repeats))
        f0, a, v = cols
        print(f"| {n_obs} | {5 + extra} | {1e3 * f0:.0f} | {1e3 * a:.0f} ({a / f0:.1f}) | "
              f"{1e3 * v:.0f} ({v / f0:.1f}) |", flush=True)


def checkpoint_memory(repeats):
    from daeadjoint._delay.checkpoint import checkpoint_rows
    tol, H, K, max_steps = 1e-8, 600, 1000, 100_000
    print(f"# stored vs checkpointed adjoint, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; medians of {repeats} "
          "warm runs")
    print("| n_o | forward solution | step rows | program MiB | compile s | gradient ms | "
          "equal |")
    print("|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    p = jnp.asarray(KM_P)
    for n_obs in (100, 1000):
        ts = jnp.linspace(55.0 / n_obs, 55.0, n_obs)

        def run(q, every, ts=ts):
            return dae.solve(km, 0.0, 55.0, q[:3], args=q, delays=km_lags, saveat=ts,
                             rtol=tol, atol=tol, history_steps=H, max_steps=max_steps,
                             sensitivity=dae.Adjoint(checkpoint_every=every)).ys

        base = jax.jit(lambda q: run(q, max_steps))(p)
        data = base + 0.05 * rng.standard_normal(base.shape)
        rows_of = {"stored": max_steps, f"checkpoints every {K}": checkpoint_rows(K, max_steps, H)}
        compiled, info = {}, {}
        for label, every in (("stored", max_steps), (f"checkpoints every {K}", K)):
            g = jax.jit(jax.grad(lambda q, every=every, data=data:
                                 0.5 * jnp.sum((run(q, every) - data) ** 2)))
            t = time.perf_counter()
            compiled[label] = g.lower(p).compile()
            mem = compiled[label].memory_analysis()
            info[label] = (time.perf_counter() - t,
                           (mem.temp_size_in_bytes + mem.argument_size_in_bytes
                            + mem.output_size_in_bytes) / 2**20,
                           np.asarray(compiled[label](p)))
        # Timed runs interleaved (stored, checkpointed, stored, ...): the load drifts.
        walls: dict = {label: [] for label in compiled}
        for _ in range(repeats):
            for label, fn in compiled.items():
                t = time.perf_counter()
                jax.block_until_ready(fn(p))
                walls[label].append(time.perf_counter() - t)
        g_st, g_ck = (info[label][2] for label in compiled)
        same = "yes" if np.array_equal(g_st, g_ck) else f"no ({np.max(np.abs(g_st - g_ck)):.1e})"
        for label in compiled:
            compile_s, mib, _ = info[label]
            print(f"| {n_obs} | {label} | {rows_of[label]} | {mib:.1f} | {compile_s:.0f} | "
                  f"{1e3 * statistics.median(walls[label]):.0f} | "
                  f"{same if label != 'stored' else ''} |", flush=True)
    print(f"# load average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--gradient-scaling", action="store_true")
    ap.add_argument("--checkpoint-memory", action="store_true")
    args = ap.parse_args()
    if args.gradient_scaling:
        gradient_scaling(args.repeats)
        return
    if args.checkpoint_memory:
        checkpoint_memory(args.repeats)
        return
    ref = km_reference()
    p = jnp.asarray(KM_P)
    run_jitcdde, build = jitcdde_runner()
    print(f"# Kermack–McKendrick, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load "
          f"average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; jax {jax.__version__}; "
          f"medians of {args.repeats} warm runs")
    if build is not None:
        print(f"jitcdde model build + C compilation: {build:.1f} s")
    print("| tol | daeadjoint ms | steps | error | jitcdde ms | error | ratio (ours/jitcdde) "
          "| compile s | grad ms | grad ÷ forward |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for tol in (1e-6, 1e-9):
        fn = ours(tol)
        t = time.perf_counter()
        ys, steps = jax.block_until_ready(fn(p))
        compile_s = time.perf_counter() - t
        wall = _median(lambda fn=fn: fn(p), args.repeats)
        err = _error(ys, ref)

        def loss(q, tol=tol):
            sol = dae.solve(km, 0.0, 55.0, q[:3], args=q, delays=km_lags,
                            saveat=jnp.asarray(KM_TS), rtol=tol, atol=tol,
                            history_steps=history_steps(tol))
            return 0.5 * jnp.sum((sol.ys - jnp.asarray(ref)) ** 2)

        g = jax.jit(jax.grad(loss))
        jax.block_until_ready(g(p))
        wall_g = _median(lambda g=g: g(p), args.repeats)
        if run_jitcdde is not None:
            yj = run_jitcdde(tol)
            wall_j = statistics.median(
                [(lambda s: (run_jitcdde(tol), time.perf_counter() - s)[1])(time.perf_counter())
                 for _ in range(args.repeats)])
            jcols = f"{1e3 * wall_j:.2f} | {_error(yj, ref):.1e} | {wall / wall_j:.2f}"
        else:
            jcols = "– | – | –"
        print(f"| {tol:g} | {1e3 * wall:.2f} | {int(steps)} | {err:.1e} | {jcols} | "
              f"{compile_s:.1f} | {1e3 * wall_g:.1f} | {wall_g / wall:.1f} |", flush=True)


if __name__ == "__main__":
    main()
