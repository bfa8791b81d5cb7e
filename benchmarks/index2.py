"""The Fekete problem (index 2, n = 160) side by side with IDAS: forward solves and the
sensitivities of the potential w.r.t. the start's eight parameters.

    python benchmarks/index2.py                      # rtol 1e-6 and 1e-8 (~5 min, 2 cores)
    python benchmarks/index2.py --rtols 1e-6 --repeats 3

The problem is the Test Set for IVP Solvers' Fekete problem as in ``tests/testset.py``:
20 points on the unit sphere, y = (positions, velocities, λ, μ), λ and μ of index 2,
t ∈ [0, 1000], the Test Set's start, parametrized by α1…α8 as in Li & Petzold,
DASPKADJOINT §7.3. Scored: ``scd`` of the positions against the Test Set's reference.

- daeadjoint: ``solve(..., index2=mask)`` (the index-2 variables out of the error test,
  their columns scaled by cj), under ``jax.jit``; the gradient of log V(x(T)),
  V = Π_{i<j} ‖x_i − x_j‖, w.r.t. α by forward sensitivities (``jax.jacfwd``) and by
  ``jax.grad`` with its default (the continuous adjoint, with its index-2 final
  conditions) and with ``sensitivity=DiscreteAdjoint()``.
- IDAS via casadi (SX residual, exact sparse Jacobian, C-compiled with gcc when available)
  on the semi-explicit form x = (positions, velocities), z = (λ, μ), with
  ``suppress_algebraic`` (IDASetSuppressAlg: the algebraic variables out of the error
  test — all of them are index 2 here, so this is the same error test as ours) and the
  same consistent start (IDACalcIC off). IDAS has no index-2 adjoint, so only its forward
  solve is timed. Li & Petzold's Table 4 says the sensitivities are ~0 (the final
  configuration is a maximum of V, whatever the start): the printed max |∂ log V/∂α_i|
  measures each method's error.

Times: median of ``--repeats`` calls after the first (compilation), the two solvers
interleaved call by call; load average printed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(1, str(ROOT))     # the working-tree daeadjoint and the tests' helpers
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_enable_x64", True)

import daeadjoint as dae  # noqa: E402
from tests.testset import FEKETE_ALPHA, fekete  # noqa: E402

N = 20   # points


def log_potential(pos):
    """log V(x) = Σ_{i<j} log ‖x_i − x_j‖ of the 20 positions (60 values)."""
    x = pos.reshape(N, 3)
    d2 = jnp.sum((x[:, None, :] - x[None, :, :]) ** 2, axis=-1)
    iu = jnp.triu_indices(N, 1)
    return 0.5 * jnp.sum(jnp.log(d2[iu]))


def ours(rtol: float):
    def solve(alpha, sensitivity=None):
        y0, yp0 = fekete.initial(fekete.p, alpha)
        return dae.solve(fekete.residual, fekete.t0, fekete.t1, y0, yp0, fekete.params(),
                         algebraic=fekete.algebraic, index2=fekete.index2, rtol=rtol,
                         atol=rtol, max_steps=100_000, sensitivity=sensitivity)

    forward = jax.jit(lambda a: (lambda s: (s.ys[-1], s.stats["num_steps"]))(solve(a)))
    loss = lambda a: log_potential(solve(a).ys[-1, :60])   # noqa: E731
    loss_d = lambda a: log_potential(solve(a, dae.DiscreteAdjoint()).ys[-1, :60])   # noqa: E731
    return (forward, jax.jit(jax.jacfwd(loss)), jax.jit(jax.grad(loss)),
            jax.jit(jax.grad(loss_d)))


def casadi_idas(rtol: float):
    """Fekete's semi-explicit form in casadi SX, integrated by IDAS from the same start."""
    import casadi as ca

    x = ca.SX.sym("x", 120)
    z = ca.SX.sym("z", 40)
    alpha = float(fekete.p["alpha"])
    pos = [x[3 * i:3 * i + 3] for i in range(N)]
    vel = [x[60 + 3 * i:60 + 3 * i + 3] for i in range(N)]
    lam, mu = z[:N], z[N:]
    dpos, dvel, phi, gpq = [], [], [], []
    for i in range(N):
        force = ca.SX.zeros(3)
        for j in range(N):
            if j != i:
                d = pos[i] - pos[j]
                force += d / ca.dot(d, d)
        dpos.append(vel[i] + 2 * mu[i] * pos[i])
        dvel.append(-alpha * vel[i] + 2 * lam[i] * pos[i] + force)
        phi.append(ca.dot(pos[i], pos[i]) - 1)
        gpq.append(2 * ca.dot(pos[i], vel[i]))
    dae_ = dict(x=x, z=z, ode=ca.vertcat(*dpos, *dvel), alg=ca.vertcat(*phi, *gpq))
    opts = dict(reltol=rtol, abstol=rtol, suppress_algebraic=True, calc_ic=False,
                max_num_steps=100_000)
    y0, yp0 = (np.asarray(v) for v in fekete.initial(fekete.p, FEKETE_ALPHA))
    opts["init_xdot"] = list(yp0[:120])
    label = "IDAS (casadi, jit)"
    try:
        with tempfile.TemporaryDirectory() as scratch, contextlib.chdir(scratch):
            F = ca.integrator("F", "idas", dae_, fekete.t0, [fekete.t1],
                              dict(opts, jit=True, compiler="shell", jit_cleanup=False,
                                   jit_options=dict(flags=["-O2"], cleanup=False)))
    except RuntimeError as e:
        print(f"casadi jit unavailable, using SX: {str(e).splitlines()[-1]}")
        F, label = ca.integrator("F", "idas", dae_, fekete.t0, [fekete.t1], opts), \
            "IDAS (casadi, SX)"

    def run():
        out = F(x0=y0[:120], z0=y0[120:])
        return np.concatenate([np.asarray(out["xf"]).ravel(), np.asarray(out["zf"]).ravel()])
    return label, run, lambda: F.stats()["nsteps"]


def interleaved(fns, repeats: int):
    """(first-call s, median s, output) of each function, called in turn `repeats` times."""
    firsts, outs = [], []
    for fn in fns:
        t = time.perf_counter()
        outs.append(jax.block_until_ready(fn()))
        firsts.append(time.perf_counter() - t)
    walls: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for w, fn in zip(walls, fns):
            t = time.perf_counter()
            jax.block_until_ready(fn())
            w.append(time.perf_counter() - t)
    return [(f, statistics.median(w), o) for f, w, o in zip(firsts, walls, outs)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rtols", default="1e-6,1e-8")
    parser.add_argument("--repeats", type=int, default=5)
    a = parser.parse_args()
    alpha = jnp.asarray(FEKETE_ALPHA)
    rows_f, rows_g = [], []
    for rtol in (float(r) for r in a.rtols.split(",")):
        forward, jacfwd, grad, grad_d = ours(rtol)
        label, ida, ida_steps = casadi_idas(rtol)
        (f0, w0, (y, steps)), (_, w1, y1) = interleaved(
            [lambda f=forward: f(alpha), ida], a.repeats)
        rows_f.append(f"| {rtol:g} | {int(steps)} | {fekete.scd(np.asarray(y)):.2f} | "
                      f"{w0 * 1e3:.1f} | {f0:.1f} | {ida_steps()} | {fekete.scd(y1):.2f} | "
                      f"{w1 * 1e3:.1f} | {w0 / w1:.2f} |")
        res = interleaved([lambda f=jacfwd: f(alpha), lambda f=grad: f(alpha),
                           lambda f=grad_d: f(alpha)], a.repeats)
        for name, (f, w, g) in zip(("jax.jacfwd (forward sensitivities)",
                                    "jax.grad (default: Adjoint())",
                                    "jax.grad, DiscreteAdjoint()"), res):
            rows_g.append(f"| {rtol:g} | {name} | {float(jnp.max(jnp.abs(g))):.1e} | "
                          f"{w * 1e3:.1f} | {w / w0:.2f} | {w / w1:.2f} | {f:.1f} |")
        print(f"rtol {rtol:g} done (load {os.getloadavg()[0]:.1f})", file=sys.stderr,
              flush=True)
        jax.clear_caches()
    print(f"\nFekete (n = 160, t ∈ [0, 1000]), {label}; load average "
          f"{os.getloadavg()[0]:.1f}\n")
    print("| rtol = atol | steps | scd | ms (median) | first call s | IDAS steps | IDAS scd "
          "| IDAS ms | time / IDAS's |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows_f))
    print("\n∂ log V(x(T))/∂α1…α8 (Li & Petzold Table 4: ~0; the column is the error)\n")
    print("| rtol | method | max abs | ms (median) | / own forward | / IDAS forward "
          "| first call s |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows_g))


if __name__ == "__main__":
    main()
