"""Forward mode, Hessians and the default gradient through daeadjoint; prints Markdown tables.

    python benchmarks/derivatives.py [--quick]

a. **jacfwd vs jacrev vs the number of parameters k**, fixed outputs (m of them).
   `jax.jacfwd` is one forward solve carrying k sensitivity directions (staggered
   corrector: per step, one batched residual JVP and k solves with the state's
   factorization); `jax.jacrev` is one backward (adjoint) solve carrying m cotangents.
   Robertson (t1 = 4e10, y at the 12 output times of `problems.robertson`, m = 36;
   parameters: p (3), then p and y0 (6) — all it has) and the R5 heat problem of
   `gradients.py` (M = 10: 12×12 mesh, 144 unknowns, T = 0.16, rtol = atol = 1e-5;
   outputs u(T) on the 10 interior nodes of the middle row, m = 10; parameters: the
   diffusion coefficients (p1, p2) then the first k − 2 interior initial values).
   The crossover is the k where jacfwd / jacrev passes 1.
b. **Hessian-vector product ÷ gradient** of a scalar loss: `jax.jvp(jax.grad(L), (θ,),
   (v,))` (forward over adjoint: one solve of the DAE augmented with one sensitivity
   direction and its adjoint) vs `jax.grad(L)`; goal ≤ 3. Robertson with t1 = 40
   (L = Σ of y at t = 0.4, 4, 40, weighted, + ∫y3 dt; θ = p) and the index-1 kinetics
   DAE of `tests/test_adjoint.py` (y3 from a cubic; L observes every component at 4
   times, a y', and ∫y3² dt; θ = (p1..p4, y1(0), y2(0))). Also the full Hessian
   (`jax.hessian`, one HVP per parameter, vmapped) ÷ gradient.
c. **Forward-sensitivity cost per direction ÷ forward cost** on Robertson (t1 = 4e10,
   12 outputs): (t(jvp with k directions) − t(forward)) / k / t(forward), directions
   batched by `jax.vmap` of `jax.jvp` (random directions in p-space); full and partial
   error control (`ForwardSensitivity(error_control=...)`); goal ≤ 0.5. The peer:
   casadi's IDAS, forward directional derivatives along the same directions (casadi
   integrates them as one augmented DAE, every component in the error test), divided
   by casadi's own forward.
d. **The default gradient vs the number of observations** on R6 Barnes (as in
   `gradients.py` part 3, but `sensitivity=None`, the default: the continuous `Adjoint()`
   up to 32 output times, `DiscreteAdjoint()` above): t(grad, n_o = 2400) ÷
   t(grad, n_o = 10), goal ≤ 1.5, at the default max_steps = 100000 and at
   max_steps = 2000 (the discrete adjoint replays max_steps slots).
e. **Peers in the same process**, Robertson: casadi IDAS forward sensitivities (the
   Jacobian of its integrator's outputs w.r.t. p; IDAS FSA) vs daeadjoint `jax.jacfwd`
   (setting of c.); diffrax on the ODE form (Kvaerno5, y3 = 1 − y1 − y2 eliminated):
   `jax.jacfwd` and `jax.hessian` with its default `RecursiveCheckpointAdjoint`, with
   `ForwardMode()` (forward only) and `DirectAdjoint()`; failures print their error.

Timing as in `gradients.py`: every function `jax.jit`ted, one warm-up call, then the
median of the warm repeats (`peers._timed`, `jax.block_until_ready`); functions compared
in one table are timed in interleaved rounds so that load from other processes hits them
alike; ratios print as `median (ratio of the fastest runs)`. Single-threaded OpenBLAS.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the working-tree daeadjoint
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import casadi as ca
import diffrax
import jax
import jax.numpy as jnp
import numpy as np
import peers
import problems
from gradients import (BARNES_T1, MAX_STEPS, OtherLoad, _error_line, _fmt, _ratio, barnes_f,
                       barnes_residual, heat_setup, time_jitted)

jax.config.update("jax_enable_x64", True)

import daeadjoint as dae

ROB = problems.robertson()
ROB_RES = problems.jax_residual(ROB)
ROB_P = jnp.asarray(ROB.args)
ROB_Y0 = jnp.asarray(ROB.y0)
ROB_YP0 = jnp.array([-0.04, 0.04, 0.0])
ROB_ALG = np.array([False, False, True])
ROB_ATOL = jnp.asarray(ROB.atol)            # (1e-10, 1e-14, 1e-8), rtol 1e-6: problems.py
ROB_TS = jnp.asarray(ROB.ts)                # 0.4·10^k, k = 0..11


def _aux0(f):
    """fn -> fn returning (value, 0): time_jitted wants (value, aux)."""
    return lambda x: (f(x), 0)


# --------------------------------------------------------------------------- a. jacfwd/jacrev
def robertson_outputs(theta, sensitivity=None, forward_sensitivity=None):
    """y at the 12 output times (36 values); θ = p (3) or (p, y0) (6); y'0 consistent."""
    p = theta[:3]
    y0 = theta[3:] if theta.shape[0] == 6 else ROB_Y0
    sol = dae.solve(ROB_RES, 0.0, ROB_TS[-1], y0, None, p, saveat=ROB_TS, algebraic=ROB_ALG,
                    rtol=1e-6, atol=ROB_ATOL, sensitivity=sensitivity,
                    forward_sensitivity=forward_sensitivity)
    return jnp.ravel(sol.ys)


def heat_outputs(M: int, k: int):
    """θ (k) -> u(T) on the middle row's M interior nodes; θ = (p1, p2, u0[:k-2])."""
    h = heat_setup(M)
    N = h["N"]
    (p, u0) = h["args"]
    solve = h["solve"]  # the R5 setup of gradients.py (sensitivity=Adjoint())

    def out(theta):
        u0_k = jnp.ravel(u0).at[:k - 2].set(theta[2:]).reshape(u0.shape)
        sol = solve(theta[0], theta[1], u0_k)
        return sol.ys[-1].reshape(N, N)[N // 2, 1:-1]

    theta = jnp.concatenate([p, jnp.ravel(u0)[:k - 2]])
    return out, theta


def part_a(repeats: int, heat_ks, rob_ks) -> list[dict]:
    rows = []
    cases = [("Robertson, t1 = 4e10", k, robertson_outputs,
              ROB_P if k == 3 else jnp.concatenate([ROB_P, ROB_Y0])) for k in rob_ks]
    for k in heat_ks:
        f, theta = heat_outputs(10, k)
        cases.append(("heat R5, M = 10 (144 unknowns)", k, f, theta))
    for name, k, f, theta in cases:
        fns = {"fwd": jax.jit(_aux0(f)), "jacfwd": jax.jit(_aux0(jax.jacfwd(f))),
               "jacrev": jax.jit(_aux0(jax.jacrev(f)))}
        with OtherLoad() as load:
            r = time_jitted(fns, theta, repeats)
        m = int(np.size(r["fwd"].get("value", [])))
        diff = "n/a"
        if "error" not in r["jacfwd"] and "error" not in r["jacrev"]:
            a, b = r["jacfwd"]["value"], r["jacrev"]["value"]
            diff = f"{np.max(np.abs(a - b)) / np.max(np.abs(b)):.0e}"
        rows.append(dict(problem=name, k=k, m=m, load=load.cores, diff=diff, **r))
        print(f"<!-- a: {name} k={k} done -->", flush=True)
    return rows


def print_part_a(rows) -> None:
    print("## a. jax.jacfwd vs jax.jacrev vs the number of parameters k\n")
    print("| problem | k parameters | m outputs | fwd s | jacfwd s | jacrev s | jacfwd / fwd "
          "| jacrev / fwd | **jacfwd / jacrev** | jacfwd vs jacrev (rel.) | other cores busy |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        f, jf, jr = r["fwd"], r["jacfwd"], r["jacrev"]
        print(f"| {r['problem']} | {r['k']} | {r['m']} | {_fmt(f.get('wall_s'), '.4f')} "
              f"| {_fmt(jf.get('wall_s'), '.4f') if 'error' not in jf else jf['error']} "
              f"| {_fmt(jr.get('wall_s'), '.4f') if 'error' not in jr else jr['error']} "
              f"| {_ratio(jf, f)} | {_ratio(jr, f)} | **{_ratio(jf, jr, '.2f')}** "
              f"| {r['diff']} | {r['load']:.2f} |")
    print()


# --------------------------------------------------------------------------- b. HVP / grad
ROB40_TS = jnp.array([0.4, 4.0, 40.0])
ROB40_W = jnp.array([[1.0, 1e4, 0.5], [0.3, -2e4, 1.0], [-0.2, 5e3, 2.0]])


def robertson40_loss(p):
    sol = dae.solve(ROB_RES, 0.0, 40.0, ROB_Y0, ROB_YP0, p, saveat=ROB40_TS, algebraic=ROB_ALG,
                    rtol=1e-6, atol=ROB_ATOL, quadrature=lambda t, y, yp, p: y[2:3])
    return jnp.sum(ROB40_W * sol.ys) + sol.qs[-1, 0]


def kinetics(t, y, yp, p):
    """Semi-explicit index 1: y3 solves the cubic y3³ + y3 = y1 + p4 y2 (tests/test_adjoint)."""
    return jnp.stack([
        yp[0] + p[0] * y[0] - p[1] * y[1] * y[2],
        yp[1] - p[0] * y[0] + p[1] * y[1] * y[2] + p[2] * y[1],
        y[2] ** 3 + y[2] - y[0] - p[3] * y[1],
    ])


KIN_TS = jnp.array([0.5, 1.0, 2.0, 3.0])
KIN_W = jnp.array([[1.0, -0.5, 2.0], [0.3, 0.0, -1.0], [0.0, 1.5, 0.7], [-0.4, 0.2, 1.0]])
KIN_THETA = jnp.array([0.9, 1.3, 0.4, 0.6, 1.0, 0.5])


def kinetics_loss(theta, rtol=1e-6):
    p, y0d = theta[:4], theta[4:]
    y0 = jnp.concatenate([y0d, jnp.zeros(1)])
    sol = dae.solve(kinetics, 0.0, 3.0, y0, jnp.zeros(3), p, saveat=KIN_TS,
                    algebraic=jnp.array([False, False, True]), init="ya_ydp",
                    quadrature=lambda t, y, yp, p: y[2:3] ** 2, quad_error_control=True,
                    rtol=rtol, atol=rtol)
    return (jnp.sum(KIN_W * sol.ys) + jnp.sum(jnp.sin(sol.ys[:, 2]))
            + 0.7 * sol.yps[1, 0] + sol.qs[-1, 0])


def part_b(repeats: int, full_hessian: bool) -> list[dict]:
    rows = []
    for name, L, theta in (("Robertson, t1 = 40", robertson40_loss, ROB_P),
                           ("kinetics index 1, t1 = 3", kinetics_loss, KIN_THETA)):
        v = jnp.asarray(np.random.default_rng(0).standard_normal(theta.shape)) * theta
        fns = {"fwd": jax.jit(_aux0(L)), "grad": jax.jit(_aux0(jax.grad(L))),
               "hvp": jax.jit(_aux0(lambda th: jax.jvp(jax.grad(L), (th,), (v,))[1]))}
        if full_hessian:
            fns["hessian"] = jax.jit(_aux0(jax.hessian(L)))
        with OtherLoad() as load:
            r = time_jitted(fns, theta, repeats)
        check = "n/a"
        if "hessian" in r and "error" not in r["hessian"] and "error" not in r["hvp"]:
            H = r["hessian"]["value"].reshape(theta.size, theta.size)
            Hv = H @ np.asarray(v)
            check = (f"‖Hv − hessian·v‖/‖Hv‖ {np.linalg.norm(r['hvp']['value'] - Hv) / np.linalg.norm(Hv):.0e}, "
                     f"asymmetry {np.max(np.abs(H - H.T)) / np.max(np.abs(H)):.0e}")
        rows.append(dict(problem=name, k=theta.size, load=load.cores, check=check, **r))
        print(f"<!-- b: {name} done -->", flush=True)
    return rows


def print_part_b(rows) -> None:
    print("## b. Hessian-vector product ÷ gradient (goal ≤ 3)\n")
    print("| problem | k | fwd s | grad s | HVP s | hessian s | grad / fwd | **HVP / grad** "
          "| hessian / grad | HVP compile s | check | other cores busy |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        f, g, h = r["fwd"], r["grad"], r["hvp"]
        H = r.get("hessian", {})
        print(f"| {r['problem']} | {r['k']} | {_fmt(f.get('wall_s'), '.4f')} "
              f"| {_fmt(g.get('wall_s'), '.4f')} | {h.get('error') or _fmt(h.get('wall_s'), '.4f')} "
              f"| {H.get('error') or _fmt(H.get('wall_s'), '.4f')} | {_ratio(g, f)} "
              f"| **{_ratio(h, g, '.2f')}** | {_ratio(H, g, '.2f')} "
              f"| {_fmt(h.get('compile_s'), '.1f')} | {r['check']} | {r['load']:.2f} |")
    print()


# --------------------------------------------------------------------------- c. FSA per dir.
def part_c(repeats: int, ks) -> list[dict]:
    rows = []
    for ec in (True, False):
        fs = dae.ForwardSensitivity(error_control=ec)
        f = lambda p, fs=fs: robertson_outputs(p, forward_sensitivity=fs)  # noqa: E731
        fns = {"fwd": jax.jit(_aux0(f))}
        for k in ks:
            fns[k] = jax.jit(_aux0(lambda p, V=_directions(k), f=f: jax.vmap(
                lambda v: jax.jvp(f, (p,), (v,))[1])(V)))
        with OtherLoad() as load:
            r = time_jitted(fns, ROB_P, repeats)
        for k in ks:
            rows.append(dict(solver="daeadjoint", ec=ec, k=k, fwd=r["fwd"], jvp=r[k],
                             load=load.cores))
        print(f"<!-- c: error_control={ec} done -->", flush=True)
    # The peer: casadi's IDAS, same directions, its own forward as the reference.
    fns, failed = {"fwd": casadi_directional(None)}, {}
    for k in ks:
        try:
            fns[k] = casadi_directional(_directions(k))
        except Exception as e:  # noqa: BLE001 - a failing peer must not stop the report
            # casadi's own message ends its chain of call sites
            failed[k] = dict(error=str(e).strip().splitlines()[-1].split(". ")[0])
    with OtherLoad() as load:
        r = time_jitted(fns, ROB_P, repeats)
    for k in ks:
        rows.append(dict(solver="casadi IDAS", ec=True, k=k, fwd=r["fwd"],
                         jvp=failed.get(k) or r[k], load=load.cores))
    return rows


def _directions(k: int):
    """k random directions in p-space, scaled by p (relative perturbations)."""
    return jnp.asarray(np.random.default_rng(k).standard_normal((k, 3))) * ROB_P


def print_part_c(rows) -> None:
    print("## c. Forward-sensitivity cost per direction ÷ forward cost, Robertson t1 = 4e10 "
          "(goal ≤ 0.5)\n")
    print("| solver | error control | k directions | fwd s | jvp (k directions) s | jvp / fwd "
          "| **(jvp − fwd) / k / fwd** | other cores busy |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        f, j = r["fwd"], r["jvp"]
        if "error" in j or "error" in f:
            per = j.get("error") or f.get("error")
        else:
            per = (f"{(j['wall_s'] - f['wall_s']) / r['k'] / f['wall_s']:.2f} "
                   f"({(j['min_s'] - f['min_s']) / r['k'] / f['min_s']:.2f})")
        print(f"| {r['solver']} | {'full' if r['ec'] else 'partial'} | {r['k']} "
              f"| {_fmt(f.get('wall_s'), '.4f')} | {_fmt(j.get('wall_s'), '.4f')} "
              f"| {_ratio(j, f)} | **{per}** | {r['load']:.2f} |")
    print()


# --------------------------------------------------------------------------- d. Barnes default
def part_d(repeats: int, n_obs) -> list[dict]:
    p_true, p = jnp.array([1.0, 1.0, 1.0]), jnp.array([1.1, 0.9, 1.05])
    y0 = jnp.array([1.0, 0.3])
    fns = {}
    for n_o in n_obs:
        ts = jnp.linspace(BARNES_T1 / n_o, BARNES_T1, n_o)
        rng = np.random.default_rng(n_o)

        def ys(q, ts=ts, max_steps=MAX_STEPS):
            return dae.solve(barnes_residual, 0.0, BARNES_T1, y0, barnes_f(y0, q), q,
                             saveat=ts, rtol=1e-6, atol=1e-8, max_steps=max_steps).ys

        clean = jax.jit(ys)(p_true)
        data = clean + 0.01 * jnp.asarray(rng.standard_normal(clean.shape))
        for max_steps in (MAX_STEPS, 2000):
            S = lambda q, ys=ys, data=data, ms=max_steps: 0.5 * jnp.sum(  # noqa: E731
                (ys(q, max_steps=ms) - data) ** 2)
            fns[(n_o, max_steps, "fwd")] = jax.jit(_aux0(S))
            fns[(n_o, max_steps, "grad")] = jax.jit(_aux0(jax.grad(S)))
    with OtherLoad() as load:
        r = time_jitted(fns, p, repeats)
    rows = []
    for (n_o, ms, kind), res in r.items():
        if kind == "grad":
            rows.append(dict(n_o=n_o, max_steps=ms, fwd=r[(n_o, ms, "fwd")], grad=res,
                             base=r[(n_obs[0], ms, "grad")], load=load.cores))
    return rows


def print_part_d(rows) -> None:
    print("## d. R6 Barnes, the default gradient (`sensitivity=None`) vs n_o (goal ≤ 1.5)\n")
    print("| n_o | chosen reverse mode | max_steps | fwd s | grad s | grad / fwd "
          "| **grad / grad(n_o = 10)** | dS/dp | other cores busy |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        g = r["grad"]
        mode = "Adjoint()" if r["n_o"] <= 32 else "DiscreteAdjoint()"
        val = "(" + ", ".join(f"{v:.5g}" for v in g["value"]) + ")" if "value" in g else g.get("error")
        print(f"| {r['n_o']} | {mode} | {r['max_steps']} | {_fmt(r['fwd'].get('wall_s'), '.4f')} "
              f"| {_fmt(g.get('wall_s'), '.4f')} | {_ratio(g, r['fwd'])} "
              f"| **{_ratio(g, r['base'], '.2f')}** | {val} | {r['load']:.2f} |")
    print()


# --------------------------------------------------------------------------- e. peers
def _casadi_integrator(directions=None):
    """casadi's IDAS integrator of Robertson; with `directions` (k, 3) in p-space, set up
    for k forward directional derivatives. casadi integrates those as an augmented DAE
    (state and k sensitivity copies) which needs its own consistent x'(0) and atol: with
    s(0) = 0, s_i'(0) = (∂f/∂p) v_i at y0 = (1, 0, 0), i.e. (−v_i1, v_i1); the state's
    atol repeated for each direction."""
    opts = dict(reltol=ROB.rtol, abstolv=list(np.asarray(ROB.atol)), max_num_steps=MAX_STEPS,
                init_xdot=list(ROB.yp0(ROB.args)[ROB.diff_idx]))
    if directions is not None:
        k = len(directions)
        aug_xdot = opts["init_xdot"] + [c for v in directions for c in (-v[0], v[0])]
        atol_x, atol_z = list(np.asarray(ROB.atol)[:2]), list(np.asarray(ROB.atol)[2:])
        opts["augmented_options"] = dict(init_xdot=aug_xdot,
                                         abstolv=atol_x * (k + 1) + atol_z * (k + 1))
    F = ca.integrator("F", "idas", problems.casadi_dae(ROB), ROB.t0, ROB.ts, opts)
    p = ca.MX.sym("p", 3)
    out = F(x0=ROB.y0[ROB.diff_idx], z0=ROB.y0[ROB.alg_idx], p=p)
    return p, ca.vec(ca.vertcat(out["xf"], out["zf"]))  # y1, y2, y3 at the 12 outputs


def casadi_jacobian():
    """IDAS forward sensitivities through casadi: d(outputs)/dp of its integrator."""
    p, ys = _casadi_integrator(np.eye(3))
    J = ca.Function("J", [p], [ca.jacobian(ys, p)])
    return lambda: np.asarray(J(ROB.args))


def casadi_directional(V):
    """casadi IDAS: p -> (outputs, or with V (k, 3) their k directional derivatives)."""
    p, ys = _casadi_integrator(None if V is None else np.asarray(V))
    out = ys if V is None else ca.jtimes(ys, p, ca.DM(np.asarray(V).T))
    f = ca.Function("f", [p], [out])
    return lambda _: (np.asarray(f(ROB.args)), 0)


def diffrax_fns(t1, ts, max_steps):
    """Robertson ODE form: p -> y at ts (y3 = 1 − y1 − y2), for several adjoints."""
    vf, to_full = problems.jax_ode(ROB)
    term = diffrax.ODETerm(vf)
    ctrl = diffrax.PIDController(rtol=1e-6, atol=ROB_ATOL[:2])

    def make(adjoint):
        def ys(p):
            sol = diffrax.diffeqsolve(term, diffrax.Kvaerno5(), 0.0, t1, None, ROB_Y0[:2],
                                      args=p, saveat=diffrax.SaveAt(ts=ts),
                                      stepsize_controller=ctrl, max_steps=max_steps,
                                      adjoint=adjoint)
            return jax.vmap(lambda x: to_full(x, p))(sol.ys)
        return ys
    return make


def part_e(repeats: int, hessian_too: bool) -> dict:
    out = {}
    # 1. Jacobian of the 36 outputs (setting of c.): casadi IDAS FSA, daeadjoint, diffrax
    fns = {"daeadjoint jacfwd": jax.jit(_aux0(jax.jacfwd(robertson_outputs)))}
    make = diffrax_fns(ROB_TS[-1], ROB_TS, MAX_STEPS)
    for label, adj in (("diffrax jacfwd, RecursiveCheckpointAdjoint (default)",
                        diffrax.RecursiveCheckpointAdjoint()),
                       ("diffrax jacfwd, ForwardMode()", diffrax.ForwardMode())):
        fns[label] = jax.jit(_aux0(jax.jacfwd(lambda p, f=make(adj): jnp.ravel(f(p)))))
    with OtherLoad() as load:
        r = time_jitted(fns, ROB_P, repeats)
    ref = r["daeadjoint jacfwd"].get("value")
    try:
        Jc = casadi_jacobian()
        t_first, val = peers._timed(Jc)
        walls = [peers._timed(Jc)[0] for _ in range(repeats)]
        r["casadi IDAS, jacobian (forward sensitivities)"] = dict(
            value=np.ravel(val), wall_s=float(np.median(walls)),
            min_s=min(walls), compile_s=max(t_first - float(np.median(walls)), 0.0))
    except Exception as e:  # noqa: BLE001
        r["casadi IDAS, jacobian (forward sensitivities)"] = dict(error=_error_line(e))
    out["jac"] = (r, ref, load.cores)
    print("<!-- e: jacobians done -->", flush=True)
    if hessian_too:
        # 2. Hessian of a scalar at t1 = 40: daeadjoint vs diffrax (default, DirectAdjoint)
        make40 = diffrax_fns(40.0, ROB40_TS, 4096)
        fns = {"daeadjoint hessian": jax.jit(_aux0(jax.hessian(robertson40_loss)))}
        for label, adj in (("diffrax hessian, RecursiveCheckpointAdjoint (default)",
                            diffrax.RecursiveCheckpointAdjoint()),
                           ("diffrax hessian, DirectAdjoint()", diffrax.DirectAdjoint())):
            def L(p, f=make40(adj)):
                sol = f(p)
                return jnp.sum(ROB40_W * sol)  # no ∫y3: diffrax rows compare the Σ part
            fns[label] = jax.jit(_aux0(jax.hessian(L)))
        with OtherLoad() as load:
            r2 = time_jitted(fns, ROB_P, repeats)
        out["hess"] = (r2, load.cores)
    return out


def print_part_e(out) -> None:
    r, ref, load = out["jac"]
    print("## e. Peers, same process: Robertson Jacobian d y(t_i)/dp (t1 = 4e10, 36 × 3)\n")
    print(f"Other cores busy: {load:.2f}.\n")
    print("| solver | compile / setup s | wall s | daeadjoint / this | max rel diff vs "
          "daeadjoint (entries ≥ 1e-3 of max per output) | note |")
    print("|---|---|---|---|---|---|")
    d = r["daeadjoint jacfwd"]
    for label, x in r.items():
        if "error" in x:
            print(f"| {label} | n/a | n/a | n/a | n/a | fails: {x['error']} |")
            continue
        diff = "n/a"
        if ref is not None:
            a, b = np.asarray(x["value"]).reshape(-1, 3), np.asarray(ref).reshape(-1, 3)
            big = np.abs(b) >= 1e-3 * np.max(np.abs(b), axis=1, keepdims=True)
            diff = f"{np.max(np.abs(a - b)[big] / np.abs(b)[big]):.1e}"
        print(f"| {label} | {_fmt(x.get('compile_s'), '.1f')} | {x['wall_s']:.4f} "
              f"| {_ratio(d, x, '.3f')} | {diff} | |")
    print()
    if "hess" in out:
        r2, load = out["hess"]
        print("Hessian of a scalar of y at t = 0.4, 4, 40 (diffrax rows: without the ∫y3 term), "
              f"3 × 3. Other cores busy: {load:.2f}.\n")
        print("| solver | compile s | wall s | note |")
        print("|---|---|---|---|")
        for label, x in r2.items():
            note = ("fails: " + x["error"]) if "error" in x else ""
            print(f"| {label} | {_fmt(x.get('compile_s'), '.1f')} | {_fmt(x.get('wall_s'), '.4f')} "
                  f"| {note} |")
        print()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="2 repeats, fewer sizes, no full Hessians or diffrax Hessians")
    parser.add_argument("--parts", default="abcde")
    parser.add_argument("--repeats", type=int, default=None,
                        help="warm repeats per function (default 5, --quick 2)")
    args = parser.parse_args()
    repeats = args.repeats or (2 if args.quick else 5)
    start = time.perf_counter()
    print(f"<!-- {time.strftime('%Y-%m-%d %H:%M')}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, jax {jax.__version__}, diffrax {diffrax.__version__}, "
          f"casadi {ca.__version__}, OPENBLAS_NUM_THREADS={os.environ['OPENBLAS_NUM_THREADS']} -->\n")
    if "a" in args.parts:
        print_part_a(part_a(repeats, (2, 10, 30) if args.quick else (2, 3, 10, 30, 102),
                            (3,) if args.quick else (3, 6)))
    if "b" in args.parts:
        print_part_b(part_b(repeats, not args.quick))
    if "c" in args.parts:
        print_part_c(part_c(repeats, (1, 3, 10) if args.quick else (1, 3, 10, 30)))
    if "d" in args.parts:
        print_part_d(part_d(repeats, (10, 2400) if args.quick else (10, 100, 2400)))
    if "e" in args.parts:
        print_part_e(part_e(repeats, not args.quick))
    print(f"<!-- total {time.perf_counter() - start:.0f} s -->")


if __name__ == "__main__":
    main()
