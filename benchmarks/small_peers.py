"""Robertson against the native peers: one solve, one gradient, batches, compile times.

    OPENBLAS_NUM_THREADS=1 python benchmarks/small_peers.py            # batch 256, 5 repeats
    OPENBLAS_NUM_THREADS=1 python benchmarks/small_peers.py --quick    # batch 16, 2 repeats

Columns: daeadjoint, pydiffsol (diffsol's BDF from Python), diffsol-jax (diffsol inside a
jitted JAX program; ODE form), IDAS through sundials4py (SUNDIALS' official bindings:
Python callbacks for the residual and the exact Jacobian; run where it imports, i.e.
Python >= 3.12) and IDAS through casadi (gcc-compiled model).
All on `problems.robertson()`: 0 … 4e10, 12 outputs, rtol 1e-6, atol (1e-10, 1e-14, 1e-8)
(the diffsol peers in scaled unknowns, which reproduces IDAS's per-component atol
exactly; see `peers.ROBERTSON_DIFFSL`). Gradient: dG/dp of G = ∫_0^4e10 y3 dt, daeadjoint
by `Adjoint(atol=1e-8)` (as benchmarks/gradients.py), pydiffsol by its continuous adjoint
(adjoint atol 1e-8; forward atol 1e-10 for all components, see
`peers.prepare_pydiffsol_gradient`), IDAS by its adjoint (IDASolveF/IDASolveB, adjoint
atol 1e-8, `peers.prepare_sundials4py_gradient`). d y3(t1)/dp (3 parameters): daeadjoint
by `jax.grad` (its default, the continuous adjoint) and by `jax.jacfwd` (forward
sensitivities), pydiffsol by `solve_fwd_sens`, diffsol-jax by `jax.jacfwd`, IDAS by its
forward sensitivity analysis (`peers.prepare_sundials4py_fsa`).
Single solves are timed interleaved (`peers.measure_interleaved`: every solver called
once per round, median and fastest of the rounds), so that load changes fall on all alike.
Batches: p1 scaled by 10**linspace(-0.5, 0.5, N); `jit(vmap)` for the JAX solvers, a
Python loop of warm calls for the others. "first call" is the compile or build time (JAX:
first call minus a warm one; vmap: ahead-of-time compile; pydiffsol: building the model).
sundials4py needs Python >= 3.12: where it does not import its column says so.
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


def _ours_at_t1(prob, **options):
    """p -> daeadjoint's solution at t1 (`Solution`), with extra `solve` options."""
    import daeadjoint as dae

    res = problems.jax_residual(prob)
    y0, atol = jnp.asarray(prob.y0), jnp.asarray(prob.atol)
    return lambda p: dae.solve(res, prob.t0, prob.t1, y0, prob.yp0(p, problems.JAX), p,
                               saveat=jnp.reshape(prob.t1, (1,)), algebraic=prob.algebraic,
                               rtol=prob.rtol, atol=atol, max_steps=peers.MAX_STEPS, **options)


def gradient_G(prob):
    """p -> dG/dp, G = ∫ y3 dt, daeadjoint's continuous adjoint (atol 1e-8)."""
    import daeadjoint as dae

    sol = _ours_at_t1(prob, quadrature=lambda t, y, yp, p: y[2:3],
                      sensitivity=dae.Adjoint(atol=1e-8))
    return jax.grad(lambda p: sol(p).qs[-1, 0])


def y3_final(prob):
    """p -> y3(t1) by daeadjoint with its default sensitivity settings."""
    sol = _ours_at_t1(prob)
    return lambda p: sol(p).ys[-1, 2]


def _jax_prepared(label, fn, to_ys=lambda out: np.asarray(out)[None]):
    jitted = jax.jit(fn)
    return peers.Prepared(label, lambda a: jax.block_until_ready(jitted(jnp.asarray(a))),
                          lambda out, a: (to_ys(out), 0))


def _pydiffsol_fsa(prob):
    """pydiffsol's forward sensitivities: d y(t1)/dp, (3 parameters, 3 components)."""
    ode = peers._diffsol_ode(prob, "a1 * x, a2 * y, a3 * z")
    ode.sens_rtol, ode.sens_atol = prob.rtol, 1.0  # scaled unknowns: atol 1 = IDAS's atol
    t1 = np.array([prob.t1])
    return peers.Prepared("pydiffsol forward sensitivities",
                          lambda a: ode.solve_fwd_sens(np.asarray(a, float), t1),
                          lambda out, a: (np.stack([np.asarray(x)[:, -1] for x in out.sens]), 0))


def _available(preps):
    """Split {name: Prepared or error dict} into the runnable ones and the errors."""
    ok = {k: v for k, v in preps.items() if isinstance(v, peers.Prepared)}
    return ok, {k: v for k, v in preps.items() if not isinstance(v, peers.Prepared)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 15)")
    opt = ap.parse_args()
    rounds = opt.rounds or (3 if opt.quick else 15)
    repeats = 2 if opt.quick else 5
    nb = opt.batch or (16 if opt.quick else 256)
    prob = problems.robertson()
    p = np.asarray(prob.args, float)
    pb = prob.batch_args(nb)
    names = ["daeadjoint", "pydiffsol", "diffsol-jax", "IDAS (sundials4py)", "IDAS (casadi)"]

    # one forward solve
    dj = _guard("diffsol-jax", peers.diffsol_jax_solve, prob)
    fwd_preps = {
        "daeadjoint": peers.prepare_jax("daeadjoint", peers.daeadjoint_solve(prob)),
        "pydiffsol": _guard("pydiffsol", peers.prepare_pydiffsol, prob),
        "diffsol-jax": dj if isinstance(dj, dict) else
        peers.Prepared("diffsol-jax", (lambda f: lambda a: jax.block_until_ready(f(a)))(
            jax.jit(dj[0])), lambda out, a: (np.asarray(out[0]), 0), dj[1]),
        "IDAS (sundials4py)": _guard("sundials4py", peers.prepare_sundials4py, prob),
        "IDAS (casadi)": _guard("casadi", peers.prepare_casadi, prob),
    }
    ok, fwd = _available(fwd_preps)
    fwd.update(peers.measure_interleaved(ok, p, rounds))
    ref = fwd.get("IDAS (casadi)") or fwd.get("IDAS (sundials4py)")

    # gradient of G = ∫ y3 dt
    grad_preps = {
        "daeadjoint": _jax_prepared("daeadjoint grad", gradient_G(prob)),
        "pydiffsol": _guard("pydiffsol", peers.prepare_pydiffsol_gradient, prob),
        "IDAS (sundials4py)": _guard("sundials4py", peers.prepare_sundials4py_gradient, prob),
    }
    ok, grads = _available(grad_preps)
    grads.update(peers.measure_interleaved(ok, p, rounds))

    # d y3(t1)/dp, 3 parameters
    y3 = y3_final(prob)
    sens_preps = {
        "daeadjoint": _jax_prepared("daeadjoint grad", jax.grad(y3)),
        "daeadjoint jacfwd": _jax_prepared("daeadjoint jacfwd", jax.jacfwd(y3)),
        "pydiffsol": _guard("pydiffsol", _pydiffsol_fsa, prob),
        "IDAS (sundials4py)": _guard("sundials4py", peers.prepare_sundials4py_fsa, prob),
    }
    if not isinstance(dj, dict):
        sens_preps["diffsol-jax"] = _jax_prepared(
            "diffsol-jax jacfwd", jax.jacfwd(lambda a: dj[0](a)[0][-1, 2]))
    ok, sens = _available(sens_preps)
    sens.update(peers.measure_interleaved(ok, p, rounds))

    # batches
    batch, bgrad = {}, {}
    batch["daeadjoint"] = peers.batch_vmap("daeadjoint", peers.daeadjoint_solve(prob), pb, repeats)
    if not isinstance(dj, dict):
        batch["diffsol-jax"] = peers.batch_vmap("diffsol-jax", dj[0], pb, repeats)
    for n in ("pydiffsol", "IDAS (sundials4py)", "IDAS (casadi)"):
        if isinstance(fwd_preps[n], peers.Prepared):
            batch[n] = peers.batch_sequential(fwd_preps[n], pb)
    grad_fn = gradient_G(prob)
    bgrad["daeadjoint"] = peers.batch_vmap("daeadjoint grad", lambda a: (grad_fn(a), 0), pb,
                                           repeats)
    for n in ("pydiffsol", "IDAS (sundials4py)"):
        if isinstance(grad_preps[n], peers.Prepared):
            bgrad[n] = peers.batch_sequential(grad_preps[n], pb)

    def cell(d, key, scale, spec):
        if d is None:
            return "–"
        if "error" in d:
            return "n/a (" + d["error"] + ")"
        return format(d[key] * scale, spec)

    def per_member(d):
        text = cell(d, "total_s", 1e3 / nb, ".3f")
        return text + (f" ({d['failed']} failed)" if d and d.get("failed") else "")

    def timing(d, scale=1e3):
        if d is None or "error" in d:
            return cell(d, "wall_median_s", scale, ".2f")
        return f"{d['wall_median_s'] * scale:.2f} ({d['wall_min_s'] * scale:.2f})"

    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"# Robertson against native peers — {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M}"
          f" UTC\n\n{platform.machine()}, {os.cpu_count()} CPUs, Python "
          f"{platform.python_version()}, jax {jax.__version__}; load average at the end {load}; "
          f"single solves: median (fastest) of {rounds} interleaved rounds; batch {nb}, median "
          f"of {repeats} runs (vmap) or one warm loop\n")
    print("| | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    print("| forward, ms | " + " | ".join(timing(fwd.get(n)) for n in names) + " |")
    print("| forward steps | " + " | ".join(
        "–" if fwd.get(n) is None or "error" in fwd[n] or not fwd[n]["steps"]
        else str(fwd[n]["steps"]) for n in names) + " |")
    print("| forward max rel diff to IDAS (all outputs) | " + " | ".join(
        "–" if fwd.get(n) is None or "error" in fwd[n] or ref is None else
        f"{peers.max_rel_diff(fwd[n]['ys'], ref['ys'], prob.atol):.1e}" for n in names) + " |")
    print("| gradient dG/dp (adjoint, atol 1e-8), ms | " + " | ".join(
        timing(grads.get(n)) for n in names) + " |")
    jf = sens.get("daeadjoint jacfwd")
    print("| d y3(t1)/dp, 3 parameters, ms | " + " | ".join(
        (timing(sens.get(n)) + " grad, " + timing(jf) + " jacfwd") if n == "daeadjoint"
        else timing(sens.get(n)) for n in names) + " |")
    print(f"| batch of {nb}, forward, ms per member | " + " | ".join(
        per_member(batch.get(n)) for n in names) + " |")
    print(f"| batch of {nb}, gradient, ms per member | " + " | ".join(
        per_member(bgrad.get(n)) for n in names) + " |")
    print("| first call (compile/build), forward, s | " + " | ".join(
        cell(fwd.get(n), "compile_or_setup_s", 1, ".2f") for n in names) + " |")
    print("| first call, gradient, s | " + " | ".join(
        cell(grads.get(n), "compile_or_setup_s", 1, ".2f") for n in names) + " |")
    print("| first call, d y3/dp, s | " + " | ".join(
        (cell(sens.get(n), "compile_or_setup_s", 1, ".2f") + " grad, "
         + cell(jf, "compile_or_setup_s", 1, ".2f") + " jacfwd") if n == "daeadjoint"
        else cell(sens.get(n), "compile_or_setup_s", 1, ".2f") for n in names) + " |")
    print(f"| compile, vmap forward ({nb}), s | " + " | ".join(
        cell(batch.get(n), "compile_or_setup_s", 1, ".2f") if n in ("daeadjoint", "diffsol-jax")
        else "–" for n in names) + " |")
    print(f"| compile, vmap(grad) ({nb}), s | " + " | ".join(
        cell(bgrad.get(n), "compile_or_setup_s", 1, ".2f") if n == "daeadjoint" else "–"
        for n in names) + " |")

    print("\nValues (each against daeadjoint's, max relative difference):")
    g0 = grads["daeadjoint"]["ys"][0]
    for n in names[1:]:
        if grads.get(n) and "error" not in grads[n]:
            g = grads[n]["ys"][0]
            print(f"- dG/dp {n}: {g} ({np.max(np.abs(g - g0) / np.abs(g0)):.1e})")
    s0 = sens["daeadjoint jacfwd"]["ys"][0]
    print(f"- d y3(t1)/dp daeadjoint: jacfwd {s0}, grad {sens['daeadjoint']['ys'][0]}")
    for n in names[1:]:
        if sens.get(n) and "error" not in sens[n]:
            ys = np.asarray(sens[n]["ys"])
            v = ys[:, 2] if ys.ndim == 2 and ys.shape == (3, 3) else ys.ravel()[:3]
            print(f"- d y3(t1)/dp {n}: {v} ({np.max(np.abs(v - s0) / np.abs(s0)):.1e})")


if __name__ == "__main__":
    main()
