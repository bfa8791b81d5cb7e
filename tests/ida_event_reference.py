"""SUNDIALS IDA's rootfinding on Robertson (R1 in `problems.py`) stopped at y3 = 0.5,
via scikit-sundae: the event time t* at tight tolerance, and dt*/dp by central
differences of IDA's event times (relative step 1e-4 in each rate constant).

Run `python tests/ida_event_reference.py` to regenerate `IDA_ROBERTSON_EVENT` in
tests/test_events.py (it prints it). Error budget of the differences: IDA's t* at rtol
1e-10 carries a relative error ~1e-9 (its global error, and its root-finding tolerance
100·U·|t| ~ 1e-12 relative); divided by the relative step 1e-4 that is ~1e-5 relative in
the derivative, and the truncation of the central difference is ~(1e-4)² ~ 1e-8.
"""

import numpy as np

P = np.array([0.04, 1e4, 3e7])
RTOL = 1e-10
ATOL = np.array([1e-14, 1e-18, 1e-14])
LEVEL = 0.5
STEP = 1e-4


def ida_event_time(p):
    from sksundae.ida import IDA

    def resfn(t, y, yp, res):
        res[0] = yp[0] + p[0] * y[0] - p[1] * y[1] * y[2]
        res[1] = yp[1] - p[0] * y[0] + p[1] * y[1] * y[2] + p[2] * y[1] ** 2
        res[2] = y[0] + y[1] + y[2] - 1.0

    def eventsfn(t, y, yp, events):
        events[0] = y[2] - LEVEL

    eventsfn.terminal = [True]
    eventsfn.direction = [0]
    solver = IDA(resfn, algebraic_idx=[2], rtol=RTOL, atol=ATOL, eventsfn=eventsfn,
                 num_events=1, max_num_steps=100000)
    y0 = np.array([1.0, 0.0, 0.0])
    yp0 = np.array([-p[0], p[0], 0.0])
    sol = solver.solve(np.array([0.0, 1e6]), y0, yp0)
    return float(sol.t_events[0])


def main():
    t_star = ida_event_time(P)
    grad = []
    for i in range(3):
        dp = np.zeros(3)
        dp[i] = STEP * P[i]
        grad.append((ida_event_time(P + dp) - ida_event_time(P - dp)) / (2 * dp[i]))
    print("IDA_ROBERTSON_EVENT = dict(")
    print(f"    t_star={t_star!r},")
    print(f"    dt_dp=({grad[0]!r}, {grad[1]!r}, {grad[2]!r}),")
    print(")")


if __name__ == "__main__":
    main()
