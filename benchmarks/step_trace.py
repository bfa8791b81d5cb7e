"""Every step attempt of a Test Set forward solve: (t, h, k, accepted, error-test
failures in the step, next h and k) and, for accepted steps, the components with the
largest weighted correction |y_n − y_pred|/(rtol|y| + atol) — where a step-size
collapse comes from. Diagnostic (a host callback per attempt; minutes for the two-bit
adder).

    PYTHONPATH=$PWD python benchmarks/step_trace.py twobit 1e-6 --max-steps 40000 \
        --out twobit.npz [--t1 30]

The trace is saved as arrays (t, h, k, passed, nef, h_next, k_next, top, top_value)."""

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

jax.config.update("jax_enable_x64", True)
sys.path.insert(0, os.getcwd())

import daeadjoint as dae  # noqa: E402
from daeadjoint import _integrator  # noqa: E402
from tests import testset  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("problem", choices=sorted(testset.PROBLEMS))
    ap.add_argument("rtol", type=float)
    ap.add_argument("--max-steps", type=int, default=100_000)
    ap.add_argument("--t1", type=float, default=None)
    ap.add_argument("--out", default="step_trace.npz")
    a = ap.parse_args()
    pr = testset.PROBLEMS[a.problem]
    rows, tops = [], []

    def record(t, h, k, passed, nef, h_next, k_next, top, top_value):
        rows.append((float(t), float(h), int(k), bool(passed), int(nef), float(h_next),
                     int(k_next)))
        tops.append((np.asarray(top), np.asarray(top_value)))

    attempt = _integrator.attempt_step

    def traced(problem, s):
        s2, passed = attempt(problem, s)
        # After an accepted step φ_{k+1} holds its correction (IDAS IDACompleteStep).
        ee = s2.phi[jnp.minimum(jnp.where(passed, s2.k_used, s.k) + 1, 5)]
        w = jnp.abs(ee) / (problem.rtol * jnp.abs(s2.phi[0]) + problem.atol)
        top_value, top = jax.lax.top_k(w, 5)
        jax.debug.callback(record, s.t, s.h, s.k, passed, s2.nef, s2.h, s2.k, top, top_value)
        return s2, passed

    _integrator.attempt_step = traced
    alg = None if pr.algebraic is None else jnp.asarray(pr.algebraic)
    t1 = pr.t1 if a.t1 is None else a.t1

    @jax.jit
    def run(p, rtol):
        y0, yp0 = pr.initial(p)
        sol = dae.solve(pr.residual, pr.t0, t1, y0, yp0, args=p, algebraic=alg, rtol=rtol,
                        atol=rtol, max_steps=a.max_steps, throw=False)
        return sol.ys[-1], sol.stats, sol.result

    y, stats, result = run(pr.params(), a.rtol)
    print(result, {k: int(v) for k, v in stats.items()})
    if t1 == pr.t1 and np.all(np.isfinite(np.asarray(y))):
        print(f"scd {pr.scd(np.asarray(y)):.2f}  mescd {pr.mescd(np.asarray(y), a.rtol, a.rtol):.2f}")
    r = np.array(rows)
    np.savez(a.out, t=r[:, 0], h=r[:, 1], k=r[:, 2], passed=r[:, 3], nef=r[:, 4],
             h_next=r[:, 5], k_next=r[:, 6], top=np.array([x[0] for x in tops]),
             top_value=np.array([x[1] for x in tops]))


if __name__ == "__main__":
    main()
