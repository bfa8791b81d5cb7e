"""Consistent initial conditions: the algorithm of `IDACalcIC` (IDAS manual §6.2.1, and
its source idas_ic.c; the method of Brown, Hindmarsh & Petzold, *Consistent initial
condition calculation for differential-algebraic systems*, SIAM J. Sci. Comput., 1998).

Both modes solve F(t0, y0, y'0) = 0 for n unknowns u, the other n initial values held:

- `"ya_ydp"`: u_i = y0_i where component i is algebraic, u_i = y'0_i where it is
  differential (given y0_d; semi-explicit and fully implicit index-1 systems);
- `"y"`: u = y0, given y'0 (e.g. y'0 = 0 for a quasi-steady-state start).

**Newton matrix.** C = F_y diag(m) + F_y' diag(1 − m) (m_i = 1 where u_i is a y) is the
exact Jacobian ∂F/∂u, set up by the project's linear solver (`setup_masked`), so dense,
sparse and matrix-free solvers all serve. IDAS instead uses its BDF iteration matrix
F_y + F_y'/h with an artificial step h, whose differential columns carry an O(h) error
F_y,d that it shrinks by retrying with h/10 (its `maxnh` loop); with the exact C that
error is gone, and h is kept only where IDAS keeps it in the norm (below).

**Scaled unknowns and norm.** IDAS measures the Newton correction of a y'_i unknown as
the change h·Δy'_i it causes in y_i over a step h, in y_i's weights
W_i = 1/(rtol|y_i| + atol_i): with x = C⁻¹F the correction in u, the scaled correction
is δ = D x, D_i = 1 for y unknowns and D_i = h for y' unknowns, where
h = min(0.001·|tout − t0|, 0.5/‖y'0‖_W). Without any algebraic component ("ya_ydp" on an
implicit ODE) IDAS rescales the norm by |tout − t0|/h (its `sysindex = 0`), i.e.
D_i = |tout − t0|. Converged when ‖δ‖_WRMS ≤ epiccon = 0.01·0.33.

**Iteration** (IDAS's IDANlsIC / IDANewtonIC / IDALineSrch):

- each *pass* sets C up at the current point and runs up to `maxnit` modified-Newton
  iterations with that C;
- each iteration is a backtracking line search on f(u) = ½‖D C⁻¹F(u)‖²_WRMS with C fixed
  (so every trial point is measured in the same norm): accept λ when
  f(u − λx) ≤ f(u) − 2·10⁻⁴·λ·f(u) (the α-condition, slope −2f), else halve λ; fail when
  λ < steptol/‖δ‖ (the minimum-step test) or after `maxbacks` halvings. A non-finite
  residual at a trial point fails the α-condition, so the search backs off it;
- a pass that ends converging slowly (last rate ‖δ_new‖/‖δ‖ ≤ 0.9, or ‖δ‖ below a tenth of
  its first value) refreshes C at the current point, up to `maxnj` setups; otherwise
  (line-search, constraint or convergence failure) mode "ya_ydp" restarts from the
  guess with h/10 (which only reweights the y' unknowns, see above), up to `maxnh`
  values of h;
- converged also when the Newton correction is within `ROUNDOFF_ULPS`·eps of the
  unknowns (a departure from IDAS: its test, in the weights of the guess, can ask for
  less than the spacing of the converged value's floating-point numbers at tight
  tolerances, e.g. atol 1e-14 with a guess 0 for an O(1) component);
- after convergence the weights are recomputed at the new y and the whole iteration is
  run once more from there (IDAS's `nwt` loop), so the test holds in the final weights.

Two departures from IDAS, both refreshing a stale C (one set up at an earlier
iterate) where IDAS keeps iterating with it or gives the pass up: when the line search
fails with a stale C, or an iteration with a stale C reduces the merit by less than the
rate 0.9 (measured in the stale C's norm, the step says little about the true problem),
the step is not taken and C is refreshed at the last iterate. KINSOL's modified Newton
retries with a fresh Jacobian in the same two situations (KINStop: step too small,
insufficient progress); without the second, a stale C can accept a step into a region
where the true C is singular (a far guess for y in e^y = c).

**Inequality constraints** (`constraints`, as IDASetConstraints: 0 none, 1 y ≥ 0,
2 y > 0, −1 y ≤ 0, −2 y < 0): the guess must satisfy them; a Newton step that would
violate one is shortened to 0.99 of the distance to the bound, over all violated
components, before the line search (IDALineSrch); a step shortened below steptol in
the WRMS norm is a constraint failure.

The function is a root finder only (pure, jit/vmap-compatible, fixed-size loops); the
caller differentiates the consistent values through the implicit function theorem.
"""

import functools
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from ._bdf import error_weights, wrms
from ._linalg.linear_solver import AbstractLinearSolver, DenseLU, setup_masked

# The modes of consistent initialization (`solve(init=...)`; the module docstring).
InitMode = Literal["ya_ydp", "y"]

ICRATEMAX = 0.9       # IDAS: the largest Newton rate still called slow convergence
ALPHALS = 1e-4        # IDAS: α of the line search's sufficient-decrease condition
CONSTRAINT_MARGIN = 0.99   # IDAS: fraction of the distance to a bound a step may take
ROUNDOFF_ULPS = 4          # a Newton correction this many eps·|u| or less has converged


class CalcICOptions(eqx.Module):
    """The IDAS optional inputs of IDACalcIC, with their IDAS defaults.

    - `maxnh`: values of the artificial step h tried in mode "ya_ydp" (IDASetMaxNumStepsIC);
    - `maxnj`: Jacobian setups per value of h (IDASetMaxNumJacsIC);
    - `maxnit`: Newton iterations per setup (IDASetMaxNumItersIC);
    - `maxbacks`: line-search halvings per iteration (IDASetMaxBacksIC);
    - `epiccon`: the convergence test ‖δ‖_WRMS ≤ epiccon (IDASetNonlinConvCoefIC);
    - `steptol`: the minimum scaled step; None means unit roundoff^(2/3) of the working
      dtype (IDASetStepToleranceIC);
    - `lsoff`: take full Newton steps, no line search (IDASetLineSearchOffIC).
    """

    maxnh: int = eqx.field(static=True, default=5)
    maxnj: int = eqx.field(static=True, default=4)
    maxnit: int = eqx.field(static=True, default=10)
    maxbacks: int = eqx.field(static=True, default=100)
    epiccon: float = eqx.field(static=True, default=0.01 * 0.33)
    steptol: float | None = eqx.field(static=True, default=None)
    lsoff: bool = eqx.field(static=True, default=False)


# Why the initialization failed (`InitResult.reason`); 0 is success.
SUCCESS, CONV_FAIL, LINESEARCH_FAIL, CONSTR_FAIL, SINGULAR, NONFINITE, GUESS_VIOLATES = range(7)
REASONS = (
    "",
    "the Newton iteration did not converge within its limits (IDAS IDA_CONV_FAIL); the "
    "equations may have no solution near the guess",
    "the line search could not reduce the Newton correction: the step became too small "
    "or needed too many halvings (IDAS IDA_LINESEARCH_FAIL); the algebraic equations "
    "probably have no solution near the guess",
    "the inequality `constraints` could not be met: the step they allow became "
    "negligible (IDAS IDA_CONSTR_FAIL)",
    "the Jacobian of the residual with respect to the unknowns is singular: the DAE is "
    "not index 1 in the variables marked `algebraic`, or its algebraic equations do not "
    "determine them",
    "the residual is NaN or inf at the initial guess",
    "the initial guess violates `constraints`",
)
# Components named individually in failure messages; higher ones share one message.
NAMED_COMPONENTS = 64


class InitResult(NamedTuple):
    """The outcome of `calc_ic`.

    `reason` is an index into `REASONS` (0: converged). `worst_component` is −1 on
    success; on failure it is the component whose unknown has the largest scaled Newton
    correction |δ_i|·W_i where the iteration stopped (for a constraint failure: the
    component whose bound stopped the step; for `NONFINITE`: the first non-finite
    residual entry; for `GUESS_VIOLATES`: the first violated constraint; for `SINGULAR`:
    −1). `h` is the artificial step of the last pass; the counters are totals."""

    y0: Float[Array, " n"]
    yp0: Float[Array, " n"]
    reason: Int[Array, ""]
    worst_component: Int[Array, ""]
    h: Float[Array, ""]
    num_setups: Int[Array, ""]
    num_iterations: Int[Array, ""]
    num_backtracks: Int[Array, ""]
    linear_stats: dict


def unknown_mask(mode, algebraic, n):
    """Bool (n,): True where u_i is y0_i, False where u_i is y'0_i."""
    if mode == "y":
        return jnp.ones((n,), bool)
    return algebraic


def violated(constraints, y):
    """IDAS N_VConstrMask: True where y_i breaks its constraint c_i (|c| = 2 strict)."""
    c = constraints.astype(y.dtype)
    return ((jnp.abs(c) > 1.5) & (y * c <= 0)) | ((jnp.abs(c) > 0.5) & (y * c < 0))


def _first_true(mask):
    return jnp.argmax(mask).astype(jnp.int32)


def _worst(x, weights):
    """Index of the largest |x_i| W_i; a non-finite entry counts as the largest."""
    v = jnp.abs(x) * weights
    return jnp.argmax(jnp.where(jnp.isnan(v), jnp.inf, v)).astype(jnp.int32)


# Outcomes of one pass (one Jacobian setup and its Newton iterations).
_RUNNING, _CONVERGED, _SLOW, _FAILED = 0, 1, 2, 3


class _System(NamedTuple):
    """What stays fixed during one `calc_ic`: the equations, the unknowns' mask and the
    iteration's settings (closed over by the loops, never carried)."""

    residual: Callable
    t0: Array
    args: Any
    m: Array               # True where the unknown u_i is y_i, False where it is y'_i
    mf: Array              # m as 0/1 in the working dtype
    linear_solver: AbstractLinearSolver
    aux: Any               # linear_solver.auxiliary(): factors C
    constraints: Array | None
    options: CalcICOptions
    steptol: Any
    zero_stats: dict       # the linear solver's counters, zero


def _add_stats(a: dict, b: dict) -> dict:
    return {k: a[k] + b[k] for k in a}


def _newton_vector(sys_: _System, lin, y, yp, wx):
    """IDAS `IDAfnorm`: the Newton correction x = C⁻¹F(t0, y, y') with C of the last
    setup, and ‖x‖ in the scaled WRMS norm (inf when anything is not finite)."""
    if sys_.aux.matrix_free:
        mf = sys_.mf
        f, op = jax.linearize(
            lambda v: sys_.residual(sys_.t0, y + mf * v, yp + (1 - mf) * v, sys_.args),
            jnp.zeros_like(y))
    else:
        f, op = sys_.residual(sys_.t0, y, yp, sys_.args), None
    x, stats = sys_.aux.solve(lin, f, weights=wx, operator=op)
    fnorm = wrms(x, wx)
    finite = jnp.all(jnp.isfinite(f)) & jnp.isfinite(fnorm)
    return x, jnp.where(finite, fnorm, jnp.inf), stats


class _Search(NamedTuple):
    """The line search's loop carry, and its result."""

    lam: Array             # the step fraction λ being tried
    nbacks: Int[Array, ""]
    status: Int[Array, ""]
    y: Array               # the last trial point, and the Newton vector there
    yp: Array
    x: Array
    fnorm: Array
    stats: dict


class LineSearch(NamedTuple):
    """The outcome of `_line_search`."""

    ok: Bool[Array, ""]
    constraint_failed: Bool[Array, ""]
    constraint_limited: Bool[Array, ""]   # a bound shortened the step
    blocking: Int[Array, ""]     # the component whose bound did (−1: none)
    y: Array                     # the point reached, the Newton vector there, its norm
    yp: Array
    x: Array
    fnorm: Array
    nbacks: Int[Array, ""]
    stats: dict


def _line_search(sys_: _System, lin, y, yp, x, fnorm, wx) -> LineSearch:
    """IDAS `IDALineSrch` from (y, y') along −x: with C fixed, backtrack on the merit
    f(u) = ½‖D C⁻¹F(u)‖²_WRMS, accepting λ when f(u − λx) ≤ f(u) + α λ f'(u),
    f'(u) = −2f(u) the slope along −x and α = `ALPHALS` (halving λ otherwise); fail when
    λ < steptol/‖δ‖ or after `maxbacks` halvings. A non-finite residual at a trial point
    fails the α-condition. With `constraints`, a step that would violate one is first
    shortened to 0.99 of the distance to the nearest bound; shortened below steptol it is
    a constraint failure."""
    dtype, int_ = y.dtype, jnp.int32
    m, mf, options = sys_.m, sys_.mf, sys_.options
    ratio = jnp.ones((), dtype)
    constr_fail = limited = jnp.zeros((), bool)
    blocking = jnp.full((), -1, int_)
    if sys_.constraints is not None:
        # Only y unknowns move y; y'-unknown entries of x never touch a bound.
        breaking = violated(sys_.constraints, y - mf * x) & m
        step = jnp.where(breaking, x, 0.0)
        quot = jnp.where(step != 0, y / jnp.where(step != 0, step, 1.0), jnp.inf)
        any_breaking = limited = jnp.any(breaking)
        ratio = jnp.where(any_breaking, CONSTRAINT_MARGIN * jnp.min(quot), 1.0).astype(dtype)
        constr_fail = any_breaking & (fnorm * ratio <= sys_.steptol)
        blocking = jnp.where(any_breaking, jnp.argmin(quot), -1).astype(int_)
        x = x * ratio
    delnorm = fnorm * ratio
    f1norm = 0.5 * fnorm ** 2
    slope = -2.0 * f1norm * ratio
    minlam = sys_.steptol / delnorm

    def cond(c: _Search):
        return c.status == _RUNNING

    def body(c: _Search) -> _Search:
        lam = c.lam
        y_t = y - lam * mf * x
        yp_t = yp - lam * (1 - mf) * x
        x_t, fnorm_t, stats = _newton_vector(sys_, lin, y_t, yp_t, wx)
        finite = jnp.isfinite(fnorm_t)
        decrease = 0.5 * fnorm_t ** 2 <= f1norm + ALPHALS * slope * lam
        accept = finite & (True if options.lsoff else decrease)
        nbacks = c.nbacks + (~accept).astype(int_)
        fail = ~accept & ((lam < minlam) | (nbacks >= options.maxbacks))
        status = jnp.where(accept, _CONVERGED, jnp.where(fail, _FAILED, _RUNNING))
        return _Search(lam=jnp.where(accept, lam, 0.5 * lam), nbacks=nbacks,
                       status=status.astype(int_), y=y_t, yp=yp_t, x=x_t, fnorm=fnorm_t,
                       stats=_add_stats(c.stats, stats))

    init = _Search(lam=jnp.ones((), dtype), nbacks=jnp.zeros((), int_),
                   status=jnp.where(constr_fail, _FAILED, _RUNNING).astype(int_),
                   y=y, yp=yp, x=x, fnorm=fnorm, stats=sys_.zero_stats)
    out = jax.lax.while_loop(cond, body, init)
    return LineSearch(ok=out.status == _CONVERGED, constraint_failed=constr_fail,
                      constraint_limited=limited, blocking=blocking, y=out.y, yp=out.yp,
                      x=out.x, fnorm=out.fnorm, nbacks=out.nbacks, stats=out.stats)


def _converged_at(sys_: _System, fnorm, x, y, yp):
    """IDAS's test ‖δ‖ ≤ epiccon, or a Newton correction x below the resolution of
    the unknowns (|x_i| ≤ ROUNDOFF_ULPS·eps·|u_i|): no iteration can improve on
    that, and with weights from a guess far smaller than the solution (a guess
    z = 0 gives W_z = 1/atol) IDAS's test alone can ask for less than one spacing
    of the converged value's floating-point numbers (atol 1e-14: |δz| ≤ 5e-17 at
    z ≈ 0.75, where the spacing is 1.1e-16), and the line search then fails at the
    rounding floor."""
    u = jnp.where(sys_.m, y, yp)
    uround = jnp.finfo(y.dtype).eps
    return ((fnorm <= sys_.options.epiccon)
            | jnp.all(jnp.abs(x) <= ROUNDOFF_ULPS * uround * jnp.abs(u)))


class _Iteration(NamedTuple):
    """The Newton pass's loop carry."""

    y: Array                  # the iterate, its Newton vector and that vector's norm
    yp: Array
    x: Array
    fnorm: Array
    fnorm0: Array             # the norm at the pass's start
    it: Int[Array, ""]
    status: Int[Array, ""]
    reason: Int[Array, ""]
    blocking: Int[Array, ""]
    nbacks: Int[Array, ""]
    stats: dict


class NewtonPass(NamedTuple):
    """The outcome of `_newton_pass`."""

    status: Int[Array, ""]    # _CONVERGED, _SLOW (refresh C) or _FAILED
    reason: Int[Array, ""]
    worst: Int[Array, ""]
    y: Array
    yp: Array
    iterations: Int[Array, ""]
    nbacks: Int[Array, ""]
    stats: dict


def _newton_pass(sys_: _System, y, yp, wx) -> NewtonPass:
    """IDAS `IDAnlsIC` and `IDANewtonIC`: set C = F_y diag(m) + F_y' diag(1 − m) up at
    (y, y') and iterate u ← u − λ C⁻¹F(u) with that C (`_line_search` chooses λ) until
    `_converged_at`, for up to `maxnit` iterations. A pass ending with a last rate
    ‖δ_new‖/‖δ‖ ≤ 0.9, or ‖δ‖ below a tenth of its first value, is slow (the caller
    refreshes C); so is, departing from IDAS, a failed line search or a rate above 0.9
    with a stale C (module docstring)."""
    int_ = jnp.int32
    aux, options = sys_.aux, sys_.options
    _, lin, _ = setup_masked(sys_.linear_solver, sys_.residual, sys_.t0, y, yp, sys_.args,
                             sys_.m)
    singular = aux.is_singular(lin)
    x, fnorm, stats = _newton_vector(sys_, lin, y, yp, wx)
    start = jnp.where(singular, _FAILED,
                      jnp.where(_converged_at(sys_, fnorm, x, y, yp), _CONVERGED,
                                _RUNNING)).astype(int_)

    def cond(c: _Iteration):
        return c.status == _RUNNING

    def body(c: _Iteration) -> _Iteration:
        search = _line_search(sys_, lin, c.y, c.yp, c.x, c.fnorm, wx)
        ok, cfail, limited = search.ok, search.constraint_failed, search.constraint_limited
        stale = c.it > 0
        rate = search.fnorm / c.fnorm
        it = c.it + 1
        converged = ok & _converged_at(sys_, search.fnorm, search.x, search.y, search.yp)
        # With a stale C, a failed line search or a step that barely reduced the
        # merit (rate > 0.9) is not taken: C is refreshed at the last iterate
        # (departures from IDAS, module docstring).
        stalled = ok & ~converged & stale & (rate > ICRATEMAX)
        slow_now = stale & ~ok & ~cfail | stalled
        out_of_iters = ok & ~converged & ~slow_now & (it >= options.maxnit)
        slow_end = out_of_iters & ((rate <= ICRATEMAX) | (search.fnorm < 0.1 * c.fnorm0))
        failed = ~ok & ~slow_now | out_of_iters & ~slow_end
        # A pass that ends slowly while the bounds shorten its steps is reported as
        # a constraint failure.
        reason = jnp.where(cfail | ok & limited, CONSTR_FAIL,
                           jnp.where(~ok, LINESEARCH_FAIL, CONV_FAIL)).astype(int_)
        status = jnp.where(converged, _CONVERGED,
                           jnp.where(slow_now | slow_end, _SLOW,
                                     jnp.where(failed, _FAILED, _RUNNING)))
        keep = ok & ~stalled
        return _Iteration(
            y=jnp.where(keep, search.y, c.y), yp=jnp.where(keep, search.yp, c.yp),
            x=jnp.where(keep, search.x, c.x), fnorm=jnp.where(keep, search.fnorm, c.fnorm),
            fnorm0=c.fnorm0, it=it, status=status.astype(int_),
            reason=jnp.where(failed | slow_now | slow_end, reason, c.reason).astype(int_),
            blocking=jnp.where(cfail | limited, search.blocking, c.blocking),
            nbacks=c.nbacks + search.nbacks, stats=_add_stats(c.stats, search.stats))

    init = _Iteration(y=y, yp=yp, x=x, fnorm=fnorm, fnorm0=fnorm, it=jnp.zeros((), int_),
                      status=start, reason=jnp.where(singular, SINGULAR, SUCCESS).astype(int_),
                      blocking=jnp.full((), -1, int_), nbacks=jnp.zeros((), int_),
                      stats=stats)
    out = jax.lax.while_loop(cond, body, init)
    worst = jnp.where(out.reason == CONSTR_FAIL, out.blocking, _worst(out.x, wx))
    worst = jnp.where(out.reason == SINGULAR, -1, worst).astype(int_)
    return NewtonPass(status=out.status, reason=out.reason, worst=worst, y=out.y, yp=out.yp,
                      iterations=out.it, nbacks=out.nbacks, stats=out.stats)


class _Round(NamedTuple):
    """`calc_ic`'s loop carry: one Newton pass per trip."""

    y: Array                  # where the next pass starts
    yp: Array
    y_start: Array            # where this round (weights w) started
    yp_start: Array
    w: Array                  # error weights 1/(rtol |y| + atol) of the round
    h: Array                  # the artificial step
    nwt: Int[Array, ""]       # 1, then 2 for the round in the converged point's weights
    nh: Int[Array, ""]        # values of h tried in this round
    nj: Int[Array, ""]        # setups at this h
    done: Bool[Array, ""]
    reason: Int[Array, ""]
    worst: Int[Array, ""]
    setups: Int[Array, ""]
    iters: Int[Array, ""]
    nbacks: Int[Array, ""]
    stats: dict


def calc_ic(residual, t0, y0, yp0, args, algebraic, mode, rtol, atol,
            linear_solver: AbstractLinearSolver = DenseLU(), constraints=None, *,
            tout=None, options: CalcICOptions = CalcICOptions()) -> InitResult:
    """Consistent (y0, y'0) by IDACalcIC's algorithm; see the module docstring.
    IDACalcIC's loops: `_newton_pass` (IDAnlsIC) from the current point; a slow pass
    refreshes C (up to `maxnj` setups), a failed one restarts with h/10 (up to `maxnh`
    values); after convergence, one more round in the weights of the converged point
    (`nwt`).

    **Arguments:** `residual(t, y, yp, args)`; the guess `y0`, `yp0` (their dtype is the
    working precision); `algebraic` (bool (n,), needed for "ya_ydp"); `mode` "ya_ydp" or
    "y" (static); `rtol`, `atol` (scalar or (n,)) define the weights; `linear_solver`
    whose `auxiliary()` factors C; `constraints` (int (n,) or None); `tout`: the first
    output time (IDACalcIC's tout1), which sets the time scale of the y' unknowns
    (None, or tout = t0: a unit time scale); `options`: `CalcICOptions`.
    """
    if mode not in ("ya_ydp", "y"):
        raise ValueError(f"mode must be 'ya_ydp' or 'y', got {mode!r}")
    y0 = jnp.asarray(y0)
    dtype, n = y0.dtype, y0.shape[0]
    yp0 = jnp.asarray(yp0, dtype)
    int_ = jnp.int32
    m = unknown_mask(mode, jnp.asarray(algebraic), n)
    rtol = jnp.asarray(rtol, dtype)
    atol = jnp.broadcast_to(jnp.asarray(atol, dtype), (n,))
    t0 = jnp.asarray(t0, dtype)
    tdist = jnp.ones((), dtype) if tout is None else jnp.abs(jnp.asarray(tout, dtype) - t0)
    tdist = jnp.where(tdist > 0, tdist, 1.0)   # IDAS rejects tout = t0; use a unit scale
    aux = linear_solver.auxiliary()
    sys_ = _System(
        residual=residual, t0=t0, args=args, m=m, mf=m.astype(dtype),
        linear_solver=linear_solver, aux=aux,
        constraints=None if constraints is None else jnp.asarray(constraints),
        options=options,
        steptol=(jnp.finfo(dtype).eps ** (2.0 / 3.0) if options.steptol is None
                 else options.steptol),
        zero_stats={k: jnp.zeros((), int_) for k in aux.stat_names})
    maxnh = options.maxnh if mode == "ya_ydp" else 1
    # IDAS: h = 0.001·tdist, unless y'0 is so large that h·‖y'0‖ > 0.5.
    w_start = error_weights(y0, rtol, atol)
    ypnorm = wrms(yp0, w_start)
    h0 = 0.001 * tdist
    h0 = jnp.where(ypnorm > 0.5 / h0, 0.5 / jnp.where(ypnorm > 0, ypnorm, 1.0), h0)
    has_algebraic = jnp.any(m)

    def scale(h):
        """D: 1 for y unknowns, h (or tdist when no unknown is a y) for y' unknowns."""
        return jnp.where(m, 1.0, jnp.where(has_algebraic, h, tdist)).astype(dtype)

    def cond(c: _Round):
        return ~c.done

    def body(c: _Round) -> _Round:
        h = c.h
        newton = _newton_pass(sys_, c.y, c.yp, c.w * scale(h))
        conv, slow = newton.status == _CONVERGED, newton.status == _SLOW
        # IDACalcIC's nwt loop: after convergence, new weights and one more round.
        second = conv & (c.nwt == 1)
        finished = conv & (c.nwt == 2)
        refresh = slow & (c.nj < options.maxnj)
        failed_pass = ~conv & ~refresh
        # C does not depend on h: restarting where it was singular cannot help.
        at_start = jnp.all(c.y == c.y_start) & jnp.all(c.yp == c.yp_start)
        retry_h = failed_pass & (c.nh < maxnh) & ~((newton.reason == SINGULAR) & at_start)
        give_up = failed_pass & ~retry_h
        # On a retry with h/10, restart from this round's start unless it was slow.
        restart = retry_h & ~slow
        y, yp = newton.y, newton.yp
        return _Round(
            y=jnp.where(restart, c.y_start, y), yp=jnp.where(restart, c.yp_start, yp),
            y_start=jnp.where(second, y, c.y_start),
            yp_start=jnp.where(second, yp, c.yp_start),
            w=jnp.where(second, error_weights(y, rtol, atol), c.w),
            h=jnp.where(retry_h, 0.1 * h, h),
            nwt=c.nwt + second.astype(int_),
            nh=jnp.where(second, 1, c.nh + retry_h.astype(int_)).astype(int_),
            nj=jnp.where(refresh, c.nj + 1, 1).astype(int_),
            done=finished | give_up,
            reason=jnp.where(give_up, newton.reason, SUCCESS).astype(int_),
            worst=jnp.where(give_up, newton.worst, -1).astype(int_),
            setups=c.setups + 1, iters=c.iters + newton.iterations,
            nbacks=c.nbacks + newton.nbacks, stats=_add_stats(c.stats, newton.stats),
        )

    # Checks IDAS makes before iterating: the guess satisfies the constraints
    # (IDAInitialSetup) and the residual is finite there (IDA_FIRST_RES_FAIL).
    f_start = residual(t0, y0, yp0, args)
    bad_f = ~jnp.isfinite(f_start)
    reason0 = jnp.where(jnp.any(bad_f), NONFINITE, SUCCESS)
    worst0 = jnp.where(jnp.any(bad_f), _first_true(bad_f), -1)
    if sys_.constraints is not None:
        bad_c = violated(sys_.constraints, y0)
        reason0 = jnp.where(jnp.any(bad_c), GUESS_VIOLATES, reason0)
        worst0 = jnp.where(jnp.any(bad_c), _first_true(bad_c), worst0)
    zero = jnp.zeros((), int_)
    one = jnp.ones((), int_)
    init = _Round(y=y0, yp=yp0, y_start=y0, yp_start=yp0, w=w_start, h=h0.astype(dtype),
                  nwt=one, nh=one, nj=one, done=reason0 != SUCCESS,
                  reason=reason0.astype(int_), worst=worst0.astype(int_), setups=zero,
                  iters=zero, nbacks=zero, stats=sys_.zero_stats)
    out = jax.lax.while_loop(cond, body, init)
    return InitResult(y0=out.y, yp0=out.yp, reason=out.reason, worst_component=out.worst,
                      h=out.h, num_setups=out.setups, num_iterations=out.iters,
                      num_backtracks=out.nbacks, linear_stats=out.stats)


def consistent_initial_conditions(residual, t0, y0, yp0, args, algebraic, mode, rtol, atol,
                                  linear_solver: AbstractLinearSolver = DenseLU(),
                                  constraints=None, *, tout=None,
                                  options: CalcICOptions = CalcICOptions()):
    """`calc_ic` reduced to (y0, y'0, ok, worst_component): the consistent values (on
    failure, the last iterate: finite, never NaN), whether they converged, and the
    int32 component to name in a failure message (−1 on success; see `InitResult`)."""
    r = calc_ic(residual, t0, y0, yp0, args, algebraic, mode, rtol, atol, linear_solver,
                constraints, tout=tout, options=options)
    return r.y0, r.yp0, r.reason == SUCCESS, r.worst_component


def _component_phrase(mode, reason, i, is_y):
    if reason == NONFINITE:
        where = f"residual[{i}]" if i is not None else f"a residual entry >= {NAMED_COMPONENTS}"
        return f" (first non-finite entry: {where})"
    if reason == GUESS_VIOLATES:
        where = f"y0[{i}]" if i is not None else f"a component >= {NAMED_COMPONENTS}"
        return f" (first violated: {where})"
    name = "y0" if is_y else "y'0"
    which = f"{name}[{i}]" if i is not None else f"{name}[i] for some i >= {NAMED_COMPONENTS}"
    if reason == CONSTR_FAIL:
        return f" (the bound that stopped the step: {which})"
    return f" (the unknown with the largest scaled Newton correction: {which})"


_SLOTS = 1 + 2 * (NAMED_COMPONENTS + 1)


@functools.cache
def failure_messages(mode: str) -> tuple[str, ...]:
    """The static messages `message_index` selects from (for `eqx.branched_error_if`):
    for each reason, one naming no component, then for each component below
    NAMED_COMPONENTS and one shared by all higher components, a message naming its
    y0 and one naming its y'0 unknown."""
    msgs = []
    for reason, text in enumerate(REASONS):
        head = f"Consistent initialization (init={mode!r}) failed: {text}"
        msgs.append(head + ".")
        for i in list(range(NAMED_COMPONENTS)) + [None]:
            for is_y in (False, True):
                msgs.append(head + _component_phrase(mode, reason, i, is_y) + ".")
    return tuple(msgs)


def message_index(reason, worst_component, worst_is_y):
    """Index into `failure_messages(mode)`: the reason, the component (−1: none) and
    whether its unknown is y0 (else y'0)."""
    slot = jnp.where(worst_component < 0, 0,
                     1 + 2 * jnp.minimum(worst_component, NAMED_COMPONENTS)
                     + jnp.asarray(worst_is_y, jnp.int32))
    return (reason * _SLOTS + slot).astype(jnp.int32)


def error_if_failed(x, result: InitResult, mode: str, algebraic):
    """`x`, or (under jit too) the error naming why `result` failed and at which
    unknown; `algebraic` is the mask given to `calc_ic`."""
    n = result.y0.shape[0]
    is_y = unknown_mask(mode, jnp.asarray(algebraic), n)[jnp.clip(result.worst_component, 0, n - 1)]
    return eqx.branched_error_if(x, result.reason != SUCCESS,
                                 message_index(result.reason, result.worst_component, is_y),
                                 failure_messages(mode))
