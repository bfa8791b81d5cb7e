"""Status codes of a solve (`sol.result`)."""

import equinox as eqx


class RESULTS(eqx.Enumeration):
    """Why a solve stopped. `RESULTS.successful` is the only success.

    Each failure carries the message that `throw=True` raises; with `throw=False` the
    solution object still holds everything computed up to the failure.
    """

    successful = ""
    max_steps_reached = (
        "The maximum number of steps was reached before t1. Increase `max_steps`, or "
        "loosen the tolerances if the problem is stiff and being solved very accurately."
    )
    error_test_failures = (
        "The local error test failed 10 times in one step (IDAS IDA_ERR_FAIL): the "
        "solution may be singular here, or the tolerances cannot be met."
    )
    convergence_failures = (
        "The Newton iteration failed to converge 10 times in one step (IDAS "
        "IDA_CONV_FAIL): the residual may be badly scaled or non-smooth, or the "
        "initial conditions inconsistent."
    )
    singular_matrix = (
        "The iteration matrix dF/dy + cj dF/dy' is singular at every step size tried: "
        "the DAE has index > 1, or its algebraic equations are inconsistent or do not "
        "determine the algebraic variables."
    )
    nonfinite_residual = (
        "The residual returned NaN or inf at every step size tried (e.g. a log or sqrt "
        "of a negative state)."
    )
    step_size_too_small = (
        "The step size underflowed: t + h == t in floating point (IDAS 't + h = t')."
    )
    tolerance_too_small = (
        "The requested accuracy cannot be reached in this floating-point precision "
        "(IDAS IDA_TOO_MUCH_ACC): increase rtol/atol or use float64."
    )
    initialization_failed = (
        "Consistent initialization (`init=`) did not converge: the algebraic equations "
        "have no solution near the given guess, or the DAE is not index 1 in the "
        "variables marked `algebraic`."
    )
