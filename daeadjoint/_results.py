"""Status codes of a solve (`sol.result`)."""

import os

import equinox as eqx


class RESULTS(eqx.Enumeration):
    """Why a solve stopped. `RESULTS.successful` is the only success.

    Each failure carries the message that `throw=True` raises (it starts with the item's
    name, so `repr(sol.result)` is readable); with `throw=False` the solution object
    still holds everything computed up to the failure.
    """

    successful = "successful"
    event = "event: a terminal event stopped the solve (a success: see sol.event_t)."
    max_steps_reached = (
        "max_steps_reached: the maximum number of steps was reached before t1. Increase "
        "`max_steps`, or loosen the tolerances if the problem is stiff and being solved "
        "very accurately."
    )
    error_test_failures = (
        "error_test_failures: the local error test failed 10 times in one step (IDAS "
        "IDA_ERR_FAIL): the solution may be singular here, or the tolerances cannot be met."
    )
    convergence_failures = (
        "convergence_failures: the Newton iteration failed to converge 10 times in one step "
        "(IDAS IDA_CONV_FAIL): the residual may be badly scaled or non-smooth."
    )
    linear_solver_failures = (
        "linear_solver_failures: the Newton iteration failed to converge 10 times in one "
        "step because the iterative linear solver (Krylov/GMRES) did not reach its "
        "tolerance (IDAS counts these in IDAGetNumLinConvFails): give a better "
        "preconditioner, or raise Krylov(maxl=...) or Krylov(max_restarts=...)."
    )
    constraint_failures = (
        "constraint_failures: the inequality `constraints` could not be met: the step was "
        "reduced 10 times (or reached min_step) with the corrected y still violating them "
        "(IDAS IDA_CONSTR_FAIL), or 10 steps in a row had to be projected back onto a "
        "bound that the DAE drives the solution across (its y' points out of the "
        "constrained set there: the constraint is inconsistent with the DAE)."
    )
    singular_matrix = (
        "singular_matrix: the iteration matrix dF/dy + cj dF/dy' is singular at every step "
        "size tried: the DAE has index > 1, its algebraic equations are inconsistent or do "
        "not determine the algebraic variables, or its Jacobian is not finite there. A "
        "Hessenberg index-2 DAE: declare its index-2 variables with `index2=`."
    )
    singular_unscaled_index2 = (
        "singular_unscaled_index2: with `index2` and the matrix-free `Krylov` solver, the "
        "preconditioner is set up from the iteration matrix with its index-2 columns "
        "unscaled (matrix-based solvers scale them by cj: docs/index2.md), whose pivots "
        "of the index-2 variables shrink like the step size; at the step sizes tried it is "
        "singular. Use a matrix-based solver (DenseLU, SparseLU, BandedLU) or a larger "
        "`first_step`."
    )
    nonfinite_residual = (
        "nonfinite_residual: the residual returned NaN or inf at every step size tried, or "
        "the step size collapsed at the edge of its domain (between NaN residuals beyond "
        "it and a Jacobian not finite on it): the solution left the residual's domain "
        "(e.g. the log or sqrt of a state that went negative) or blew up; look at "
        "sol.stats['t_final'] and the partial solution."
    )
    step_size_too_small = (
        "step_size_too_small: the step size underflowed, t + h == t in floating point "
        "(IDAS 't + h = t'): the solution is likely singular (blowing up) here."
    )
    time_not_resolved = (
        "time_not_resolved: the step size this solution needs is below the spacing of "
        "floating-point numbers at t (t + h == t), with t far from 0 compared to the "
        "time elapsed since t0: t0 is large for the time scale of the solution (e.g. "
        "t0 = 1.7e9 for a process of microseconds). Shift the time origin: solve in "
        "tau = t - t0 (residual F(t0 + tau, y, y', args), or better one written in tau), "
        "so that t stays small and its floating-point numbers dense."
    )
    tolerance_too_small = (
        "tolerance_too_small: the requested accuracy cannot be reached in this "
        "floating-point precision (IDAS IDA_TOO_MUCH_ACC): increase rtol/atol or use float64."
    )
    wrong_algebraic_mask = (
        "wrong_algebraic_mask: the residual depends on y'_i for a component i marked "
        "`algebraic` (column i of dF/dy' is not zero): the mask must be True exactly where "
        "F does not depend on y'_i. Check it with jax.jacfwd(residual, argnums=2)(t, y, "
        "yp, args)."
    )
    initialization_failed = (
        "initialization_failed: consistent initialization (`init=`) did not converge: the "
        "algebraic equations have no solution near the given guess, or the DAE is not "
        "index 1 in the variables marked `algebraic`."
    )
    inconsistent_initial_conditions = (
        "inconsistent_initial_conditions: the first step failed and (y0, yp0) does not "
        "satisfy F(t0, y0, yp0) = 0 to the tolerances: pass init='ya_ydp' (given the "
        "differential part of y0, or yp0=None), or init='y' (given yp0) to compute "
        "consistent values."
    )
    nonfinite_initial_residual = (
        "nonfinite_initial_residual: the residual is NaN or inf at t0 for the initial "
        "values (y0, yp0): they lie outside the residual's domain (e.g. sqrt or log of a "
        "negative number)."
    )
    initial_values_violate_constraints = (
        "initial_values_violate_constraints: y0 does not satisfy `constraints` (IDAS "
        "rejects such a start; with init=, the initialization enforces them)."
    )
    nonfinite_input = (
        "nonfinite_input: t0, t1, saveat, y0 or yp0 contains NaN or inf (checked at run "
        "time because they were traced)."
    )
    invalid_interval = (
        "invalid_interval: t1 <= t0 (checked at run time because they were traced). To "
        "integrate backward, substitute s = -t: residual F(-s, y, -y', args)."
    )
    invalid_saveat = (
        "invalid_saveat: a `saveat` time lies outside [t0, t1], or the times are not sorted "
        "(checked at run time because they were traced)."
    )
    invalid_tolerance = (
        "invalid_tolerance: rtol/atol are negative, not finite, or both zero (checked at "
        "run time because they were traced)."
    )
    invalid_tstop = "invalid_tstop: tstop < t1 (checked at run time because they were traced)."
    singular_initial_sensitivity = (
        "singular_initial_sensitivity: consistent initial sensitivities need the matrix "
        "F_y diag(a) + F_y' diag(1 - a) (a: the algebraic mask) to be nonsingular; it is "
        "singular, so the DAE is not index 1 in the variables marked `algebraic` (with "
        "no mask: the algebraic block, along ker F_y', is rank-deficient — e.g. circuit "
        "nodes with no capacitance to ground, whose voltages the charges see only through "
        "differences). Forward sensitivities and the continuous adjoint need index 1; "
        "sensitivity=DiscreteAdjoint() differentiates the computed solution without it."
    )
    adjoint_failed = (
        "adjoint_failed: the backward (adjoint) integration failed; try looser adjoint "
        "tolerances (Adjoint(rtol=..., atol=...)), more adjoint steps (Adjoint(max_steps="
        "...), by default the forward solve's max_steps; the backward integration can "
        "need more steps than the forward one), or sensitivity=DiscreteAdjoint()."
    )
    delay_history_lost = (
        "delay_history_lost: the step history kept for the lagged values y(t - tau) "
        "(`history_steps` steps) no longer reaches back by the longest delay: more steps "
        "than that were taken within one delay. Raise `history_steps=`.")
    delay_recompute_failed = (
        "delay_recompute_failed: the continuous adjoint of a delay DAE recomputes the forward "
        "solution segment by segment from its checkpoints (Adjoint(checkpoint_every=...)), "
        "and a recomputed segment did not repeat the forward run's steps (it failed, or "
        "ended elsewhere or after another number of steps). Report it; meanwhile a "
        "checkpoint_every at least max_steps keeps the whole forward trajectory instead.")
    invalid_delay = (
        "invalid_delay: a delay tau is not positive and finite (checked at run time "
        "because the delays were traced); vanishing delays are not supported.")
    unsupported_cotangent = (
        "unsupported_cotangent: the continuous adjoint cannot take cotangents on y' of "
        "algebraic components (sol.yps[:, algebraic]) or third-order derivatives through "
        "saveat; use sensitivity=DiscreteAdjoint() or forward mode (jax.jacfwd)."
    )


def runtime_errors_raise() -> bool:
    """Whether compiled programs raise at run time (`EQX_ON_ERROR=raise`, equinox's
    default): the errors of `throw=True` and the fallback's warning are then host
    callbacks. With `EQX_ON_ERROR=nan` (or `off`) no program holds a host callback, which
    is what JAX's persistent compilation cache requires to store it."""
    return os.environ.get("EQX_ON_ERROR", "raise") == "raise"


def succeeded(result):
    """The solve did what was asked: reached t1, or stopped at a terminal event."""
    return (result == RESULTS.successful) | (result == RESULTS.event)
