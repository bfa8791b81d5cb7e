"""SUNDIALS IDA's IDACalcIC on the initialization test problems, via scikit-sundae.

Run `python tests/ida_initialization_reference.py` to regenerate the table `IDA_CASES` in
tests/test_initialization.py (it prints it). scikit-sundae's `init_step` calls IDACalcIC
with tout1 = t0 + calc_init_dt (our `tout`), IDA_YA_YDP_INIT for calc_initcond="yp0" and
IDA_Y_INIT for "y0", with its dense difference-quotient Jacobian and IDAS's default
IDACalcIC options; then IDAGetConsistentIC. A failure is recorded by IDA's message.

The residuals are written once for numpy (here) and jax.numpy (the tests) through `xp`.
"""

import os
import sys

import numpy as np

# Residuals F(xp, y, yp) -> list of entries; `xp` is numpy or jax.numpy.
PROBLEMS = {
    # Li & Petzold eq. (32) (R3 in `problems.py`): y2 algebraic; consistent y2 = y1 + 1,
    # y1' = -(y2 - 1).
    "mass_index1": lambda xp, y, yp: [y[1] * yp[0] + y[1] * (y[1] - 1.0), y[1] - y[0] - 1.0],
    # Robertson kinetics (R1 in `problems.py`), y3 algebraic.
    "robertson": lambda xp, y, yp: [
        yp[0] + 0.04 * y[0] - 1e4 * y[1] * y[2],
        yp[1] - 0.04 * y[0] + 1e4 * y[1] * y[2] + 3e7 * y[1] ** 2,
        y[0] + y[1] + y[2] - 1.0],
    # Two nonlinear algebraic equations: y2 + y2³ = y1 (y2 = 1 at y1 = 2) and
    # e^{y3} = 1 + y1 y2 (y3 = log 3); y1' = −y1 + y2 y3.
    "nonlinear_algebraic": lambda xp, y, yp: [
        yp[0] + y[0] - y[1] * y[2], y[1] + y[1] ** 3 - y[0], xp.exp(y[2]) - 1.0 - y[0] * y[1]],
    # Implicit ODE, no algebraic component (IDAS's sysindex = 0 scaling):
    # y1' + y1'³ = y1 (y1' = 1 at y1 = 2), y2' = y1.
    "implicit_ode": lambda xp, y, yp: [yp[0] + yp[0] ** 3 - y[0], yp[1] - y[0]],
    # Quasi-steady states for init="y" with y' = 0: (2, 4) and (1, 1, 2).
    "steady": lambda xp, y, yp: [yp[0] + y[0] ** 3 - 8.0, y[1] - y[0] ** 2],
    "qss": lambda xp, y, yp: [yp[0] - 1.0 + y[0] * y[1], yp[1] - y[0] + y[1] ** 2,
                              y[2] - y[0] - y[1]],
    # One algebraic equation with roots y2 = 2 and y2 = −2 (tanh) or −1 (quadratic),
    # for the constraint y2 > 0.
    "tanh_roots": lambda xp, y, yp: [yp[0] + y[0], xp.tanh(y[1] ** 2 - 4.0)],
    "quadratic_roots": lambda xp, y, yp: [yp[0] + y[0], y[1] ** 2 - y[1] - 2.0],
    # y2² + 1 = 0 has no real solution.
    "no_solution": lambda xp, y, yp: [yp[0] + y[0], y[1] ** 2 + 1.0],
}
ALGEBRAIC = {"mass_index1": [1], "robertson": [2], "nonlinear_algebraic": [1, 2],
             "implicit_ode": [], "steady": [1], "qss": [2], "tanh_roots": [1],
             "quadratic_roots": [1], "no_solution": [1]}
ROB_TOL = (1e-4, [1e-8, 1e-6, 1e-6])   # idasRoberts_dns tolerances

# (problem, mode, y0, yp0, tout, rtol, atol, constraints)
CASES = (
    [("mass_index1", "ya_ydp", [1.0, g], [0.0, 0.0], dt, 1e-6, 1e-6, None)
     for g in (3.0, 5.0, 20.0, 100.0, 0.5, -3.0) for dt in (0.01, 1.0)]
    + [("robertson", "ya_ydp", [1.0, 0.0, g], [0.0] * 3, 0.4, *ROB_TOL, None)
       for g in (0.5, 3.0, -2.0)]
    + [("robertson", "ya_ydp", [0.5, 1e-5, 0.7], [0.0] * 3, 0.4, *ROB_TOL, None)]
    + [("nonlinear_algebraic", "ya_ydp", [2.0, g1, g2], [0.0] * 3, 1.0, 1e-6, 1e-6, None)
       for g1 in (10.0, -10.0, 0.1) for g2 in (5.0, -5.0, 0.0)]
    + [("implicit_ode", "ya_ydp", [2.0, 0.0], [g, 0.0], 1.0, 1e-6, 1e-6, None)
       for g in (5.0, -3.0, 0.0)]
    + [("steady", "y", list(g), [0.0, 0.0], 1.0, 1e-6, 1e-6, None)
       for g in ((1.0, 1.0), (3.0, 0.0), (0.5, 10.0), (-1.0, 0.0))]
    + [("qss", "y", list(g), [0.0] * 3, 1.0, 1e-6, 1e-6, None)
       for g in ((3.0, 3.0, 0.0), (0.2, 0.2, 0.0), (10.0, 0.1, 5.0), (0.5, 2.0, 0.0))]
    + [("tanh_roots", "ya_ydp", [1.0, g], [0.0, 0.0], 1.0, 1e-6, 1e-6, c)
       for g in (0.1, 0.6, 3.0) for c in (None, [0, 2])]
    + [("quadratic_roots", "ya_ydp", [1.0, g], [0.0, 0.0], 1.0, 1e-6, 1e-6, c)
       for g in (0.4, 0.6) for c in (None, [0, 2])]
    + [("no_solution", "ya_ydp", [1.0, 0.5], [0.0, 0.0], 1.0, 1e-6, 1e-6, None)]
)


def ida_calc_ic(case):
    """IDA's consistent (y0, y'0) for one case, or its failure message."""
    import warnings

    from sksundae.ida import IDA

    name, mode, y0, yp0, tout, rtol, atol, constraints = case
    f = PROBLEMS[name]

    def resfn(t, y, yp, res):
        res[:] = np.array(f(np, y, yp))

    options = dict(algebraic_idx=ALGEBRAIC[name] or None,
                   calc_initcond="yp0" if mode == "ya_ydp" else "y0",
                   calc_init_dt=tout, rtol=rtol,
                   atol=np.asarray(atol, float) if np.ndim(atol) else float(atol))
    if constraints is not None:
        idx = [i for i, c in enumerate(constraints) if c != 0]
        options.update(constraints_idx=idx, constraints_type=[constraints[i] for i in idx])
    solver = IDA(resfn, **options)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)   # overflow in trial points
            r = solver.init_step(0.0, np.array(y0, float), np.array(yp0, float))
    except RuntimeError as e:
        return str(e).strip().splitlines()[-1]
    return [float(v) for v in r.y], [float(v) for v in r.yp]


def main():
    import sksundae

    # IDAS prints its failure messages on the C stdout: silence it while solving.
    sys.stdout.flush()
    saved, devnull = os.dup(1), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    try:
        results = [ida_calc_ic(case) for case in CASES]
    finally:
        os.dup2(saved, 1)
    print(f"# SUNDIALS {sksundae.SUNDIALS_VERSION} via scikit-sundae {sksundae.__version__}")
    print("IDA_CASES = [")
    for case, result in zip(CASES, results):
        print(f"    ({case!r},\n     {result!r}),")
    print("]")


if __name__ == "__main__":
    main()
