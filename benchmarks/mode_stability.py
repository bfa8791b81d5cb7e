"""The growing modes of a Test Set problem along its solution, and what the BDF formulas
of orders 1-5 do to them at a range of step sizes.

    PYTHONPATH=$PWD OPENBLAS_NUM_THREADS=1 python benchmarks/mode_stability.py twobit \
        --times 1,5,10,20,25.0005,30

The solution is IDA's (scikit-sundae, rtol = atol = 1e-6), whose step sequence stays on
the smooth solution, or with `--states daeadjoint` one `dae.solve` at rtol 1e-6 (`saveat`
the given times, t1 their largest unless given), which for the two-bit adder may leave
it (docs/real_models.md, "The two-bit adder at rtol 1e-6"). At each
time the linearized DAE F_y v + λ F_y' v = 0 is solved for its finite eigenvalues
(`scipy.linalg.eig` of the pencil (−F_y, F_y'); the infinite ones of the algebraic part
are dropped), and those with the largest real part are printed. For the one with the
largest real part, the table gives the largest modulus |ζ| of the roots of the k-step
BDF's characteristic equation Σ_j α_j ζ^(k−j) = hλ ζ^k at constant step size h: above
1 the formula amplifies the mode from step to step, below 1 it damps it. For an
eigenvalue with Re λ > 0 the exact solution itself grows like exp(Re λ · t); the BDF
formulas damp such a mode only for |hλ| large enough (for orders 1-2 earlier than for
3-5, which are not A-stable).
"""

import argparse
import os
import sys
from math import comb

import jax
import jax.numpy as jnp
import numpy as np
import scipy.linalg

jax.config.update("jax_enable_x64", True)
sys.path.insert(0, os.getcwd())

import daeadjoint as dae  # noqa: E402
from tests import testset  # noqa: E402


def bdf_root_modulus(k: int, hlam: complex) -> float:
    """max |ζ| over the roots of ρ_k(ζ) = hλ ζ^k, ρ_k(ζ) = Σ_{j=1}^k (1/j) ζ^(k−j) (ζ − 1)^j
    (the k-step BDF, backward-difference form, constant step)."""
    c = np.zeros(k + 1, complex)
    for j in range(1, k + 1):
        for i in range(j + 1):
            c[i] += (1.0 / j) * comb(j, i) * (-1) ** i
    c[0] -= hlam
    return float(np.max(np.abs(np.roots(c))))


def ida_states(pr, p, times):
    """(t, y, y') at `times` from IDA (scikit-sundae) at rtol = atol = 1e-6, exact
    Jacobian by `jax.jacfwd`: a step sequence that stays on the smooth solution."""
    from sksundae.ida import IDA

    res = jax.jit(lambda t, y, yp: pr.residual(t, y, yp, p))
    jacobian = jax.jit(lambda t, y, yp, cj: jax.jacfwd(pr.residual, 1)(t, y, yp, p)
                       + cj * jax.jacfwd(pr.residual, 2)(t, y, yp, p))

    def resfn(t, y, yp, out):
        out[:] = res(t, y, yp)

    def jacfn(t, y, yp, out, cj, jj):
        jj[:, :] = jacobian(t, y, yp, cj)

    y0, yp0 = (np.asarray(v) for v in pr.initial(p))
    alg = None if pr.algebraic is None else [int(i) for i in np.flatnonzero(pr.algebraic)]
    solver = IDA(resfn, rtol=1e-6, atol=1e-6, jacfn=jacfn, algebraic_idx=alg,
                 max_num_steps=1_000_000)
    sol = solver.solve(np.concatenate([[pr.t0], times]), y0, yp0)
    print(f"IDA: {sol.message}")
    return np.asarray(sol.t)[1:], np.asarray(sol.y)[1:], np.asarray(sol.yp)[1:]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("problem", choices=sorted(testset.PROBLEMS))
    ap.add_argument("--times", default="5,10,20,25.0005,30")
    ap.add_argument("--t1", type=float, default=None)
    ap.add_argument("--max-steps", type=int, default=100_000)
    ap.add_argument("--states", choices=("ida", "daeadjoint"), default="ida")
    ap.add_argument("--steps", default="1e-6,1e-5,2e-5,4e-5,7.5e-5,1.5e-4,3e-4,1e-3,1e-2")
    a = ap.parse_args()
    pr = testset.PROBLEMS[a.problem]
    times = np.array([float(x) for x in a.times.split(",")])
    t1 = float(times.max()) if a.t1 is None else a.t1
    p = pr.params()
    y0, yp0 = pr.initial(p)
    if a.states == "ida":
        ts_, ys, yps = ida_states(pr, p, times)
    else:
        alg = None if pr.algebraic is None else jnp.asarray(pr.algebraic)
        sol = dae.solve(pr.residual, pr.t0, t1, y0, yp0, args=p, algebraic=alg, rtol=1e-6,
                        atol=1e-6, saveat=jnp.asarray(times), max_steps=a.max_steps,
                        throw=False)
        # A solve that stopped early leaves the rows after t_final at inf (skipped below).
        print(f"solve to t1 = {t1:g}: {sol.result}, {int(sol.stats['num_steps'])} steps, "
              f"t_final = {float(sol.stats['t_final']):g}")
        ts_, ys, yps = times, np.asarray(sol.ys), np.asarray(sol.yps)
    jac = jax.jit(lambda t, y, yp: (jax.jacfwd(pr.residual, 1)(t, y, yp, p),
                                    jax.jacfwd(pr.residual, 2)(t, y, yp, p)))
    hs = [float(x) for x in a.steps.split(",")]
    for t, y, yp in zip(ts_, ys, yps):
        if not np.all(np.isfinite(y)):
            print(f"\nt = {t:g}: not reached")
            continue
        fy, fyp = (np.asarray(m) for m in jac(t, y, yp))
        alpha, beta = scipy.linalg.eig(-fy, fyp, right=False, homogeneous_eigvals=True)
        finite = np.abs(beta) > 1e-10 * np.abs(alpha)
        lam = alpha[finite] / beta[finite]
        lam = lam[np.argsort(-lam.real)]
        print(f"\nt = {t:g}: {lam.size} finite eigenvalues; largest real parts: "
              + ", ".join(f"{x:.4g}" for x in lam[:4]))
        top = lam[0]
        print(f"  BDF max |ζ| for λ = {top:.4g}:")
        for h in hs:
            row = " ".join(f"k{k}: {bdf_root_modulus(k, h * top):.3f}" for k in range(1, 6))
            print(f"    h = {h:.1e} (|hλ| = {abs(h * top):7.3f})  {row}")


if __name__ == "__main__":
    main()
