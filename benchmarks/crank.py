"""The slider crank of the Test Set for IVP Solvers (index 2) side by side with IDAS:
correct digits and steps at the Test Set's tolerances, from its start.

    python benchmarks/crank.py                        # rtol 1e-4 … 1e-8 (~3 min, 2 cores)
    python benchmarks/crank.py --rtols 1e-6 --first-step 1e-6

The problems are ``crank`` (the Test Set's 24 variables) and ``crank_reduced`` (the
accelerations eliminated) of ``tests/testset.py``; scored: ``mescd`` of the seven
positions against the Test Set's reference y(0.1), its own measure.

- daeadjoint: ``crank_reduced`` with ``index2`` (λ); ``crank`` with ``index2`` (λ) and
  ``suppress_algebraic_error=True`` (the accelerations out of the error test).
- IDAS via casadi on ``crank`` in its semi-explicit form x = (positions, velocities),
  z = (accelerations, λ), with ``suppress_algebraic`` (IDASetSuppressAlg: w and λ out of
  the error test), the same consistent start (IDACalcIC off). The algebraic equations
  are our JAX residual's, called through casadi callbacks with their dense Jacobian by
  ``jax.jacfwd`` — the same equations, not a second port; the callbacks make IDAS's
  times meaningless, so only digits and steps are compared.

A failed solve prints its status (ours) or IDAS's message and where it stopped.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(1, str(ROOT))     # the working-tree daeadjoint and the tests' helpers
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_enable_x64", True)

import daeadjoint as dae  # noqa: E402
from tests.testset import crank, crank_reduced, mescd  # noqa: E402


def score(pr, y, rtol):
    return mescd(pr.testset_values(np.asarray(y))[:7], pr.yref[:7], rtol, rtol)


def ours(pr, rtol, first_step, suppress):
    y0, yp0 = pr.initial(pr.p)
    sol = dae.solve(pr.residual, pr.t0, pr.t1, y0, yp0, pr.params(), algebraic=pr.algebraic,
                    index2=pr.index2, rtol=rtol, atol=rtol, first_step=first_step,
                    suppress_algebraic_error=suppress, max_steps=100_000, throw=False)
    steps = int(sol.stats["num_steps"])
    if sol.result == dae.RESULTS.successful:
        return f"{score(pr, sol.ys[-1], rtol):.2f} ({steps})"
    name = str(sol.result).split("<")[-1].split(":")[0]
    return f"{name} at t = {float(sol.stats['t_final']):.2g}"


def idas(rtol, first_step):
    """IDAS through casadi on the 24-variable form, suppress_algebraic."""
    import casadi as ca

    p = crank.params()

    def alg(x, z):
        return crank.residual(0.0, jnp.concatenate([x, z]), jnp.zeros(24), p)[14:]

    alg_j = jax.jit(alg)
    jac_j = jax.jit(jax.jacfwd(alg, (0, 1)))

    def args(arg):
        return np.asarray(arg[0]).ravel(), np.asarray(arg[1]).ravel()

    class Jacobian(ca.Callback):
        def __init__(self, name):
            ca.Callback.__init__(self)
            self.construct(name, {})

        def get_n_in(self):
            return 3

        def get_n_out(self):
            return 2

        def get_sparsity_in(self, i):
            return [ca.Sparsity.dense(14, 1), ca.Sparsity.dense(10, 1), ca.Sparsity(10, 1)][i]

        def get_sparsity_out(self, i):
            return ca.Sparsity.dense(10, 14 if i == 0 else 10)

        def eval(self, arg):
            return [ca.DM(np.asarray(j)) for j in jac_j(*args(arg))]

    class Algebraic(ca.Callback):
        def __init__(self, name):
            ca.Callback.__init__(self)
            self.construct(name, {})

        def get_n_in(self):
            return 2

        def get_n_out(self):
            return 1

        def get_sparsity_in(self, i):
            return ca.Sparsity.dense(14 if i == 0 else 10, 1)

        def get_sparsity_out(self, i):
            return ca.Sparsity.dense(10, 1)

        def has_jacobian(self):
            return True

        def get_jacobian(self, name, inames, onames, opts):
            self.jac = Jacobian(name)       # kept alive with the callback
            x, z = ca.MX.sym("x", 14), ca.MX.sym("z", 10)
            out = ca.MX.sym("out", ca.Sparsity(10, 1))
            return ca.Function(name, [x, z, out], self.jac(x, z, out), inames, onames, opts)

        def eval(self, arg):
            return [ca.DM(np.asarray(alg_j(*args(arg))))]

    g = Algebraic("alg")
    x, z = ca.MX.sym("x", 14), ca.MX.sym("z", 10)
    y0, yp0 = (np.asarray(v) for v in crank.initial(crank.p))
    opts = dict(reltol=rtol, abstol=rtol, suppress_algebraic=True, calc_ic=False,
                max_num_steps=100_000, init_xdot=list(yp0[:14]))
    if first_step is not None:
        opts["step0"] = first_step
    F = ca.integrator("F", "idas", dict(x=x, z=z, ode=ca.vertcat(x[7:], z[:7]), alg=g(x, z)),
                      crank.t0, [crank.t1], opts)
    try:
        out = F(x0=y0[:14], z0=y0[14:])
    except RuntimeError as e:
        return "failed: " + str(e).splitlines()[-1].split("returned")[-1].split(".")[0].strip()
    y = np.concatenate([np.asarray(out["xf"]).ravel(), np.asarray(out["zf"]).ravel()])
    return f"{score(crank, y, rtol):.2f} ({F.stats()['nsteps']})"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rtols", default="1e-4,1e-5,1e-6,1e-7,1e-8")
    parser.add_argument("--first-step", type=float, default=None)
    a = parser.parse_args()
    print(f"slider crank, mescd of the positions (steps); first step "
          f"{a.first_step or 'default'}\n")
    print("| rtol = atol | crank_reduced | crank, suppress_algebraic_error | IDAS (crank) |")
    print("|---|---|---|---|")
    for rtol in (float(r) for r in a.rtols.split(",")):
        row = [ours(crank_reduced, rtol, a.first_step, False),
               ours(crank, rtol, a.first_step, True), idas(rtol, a.first_step)]
        print(f"| {rtol:g} | " + " | ".join(row) + " |", flush=True)
    print(f"\nload average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
