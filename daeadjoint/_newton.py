"""Modified Newton iteration of one BDF step (IDAS manual §6.2.2.1).

Solves G(y_n) = F(t_n, y_(0) + e, y'_(0) + cj e) = 0 for the correction e to the
predictor, with the iteration matrix J = F_y + cj_old F_y' of the last setup:

- J is rebuilt ("lsetup") on the first step, when cj/cj_old leaves [3/5, 5/3], or after a
  convergence failure with a stale J (then the iteration restarts from e = 0, as the
  SUNDIALS Newton solver does);
- each update is scaled by 2/(1 + cj/cj_old), the IDAS correction for a J built with an
  older cj;
- convergence test (6.8): rate R = (δ_m/δ_1)^{1/(m−1)}, stop when S‖δ_m‖ ≤ 0.33 with
  S = R/(1−R); divergence when R > 0.9; at most 4 iterations; a first correction
  below 10⁻⁴·toldel is accepted outright;
- an iterative linear solve that misses its tolerance (`solve_failed`) is tolerated on
  the first iteration and fails the iteration on later ones (IDAS's treatment of
  SUNLS_RES_REDUCED: a recoverable failure); an iteration never converges on such a
  correction.
"""

import functools
from typing import Any, NamedTuple, cast

import equinox as eqx
import jax
import jax.numpy as jnp

from ._bdf import wrms
from ._jax_internals import unvmap_any
from ._ops import packed_while_loop, taken_where, tree_where, where

EPS_NEWT = 0.33           # IDAS epcon: Newton tolerance relative to the error test
TOLDEL = 1e-4 * EPS_NEWT  # IDAS toldel
RATE_MAX = 0.9
MAX_ITERS = 4

# Why an iteration failed (for the status reported after repeated failures).
FAIL_CONVERGENCE, FAIL_SINGULAR, FAIL_NONFINITE, FAIL_LINEAR = 0, 1, 2, 3


def maybe_update(pred, update, operand, pass_operand: bool = False, selects: bool = False):
    """`update()` where `pred`, else `operand` — as a loop of at most one trip, not a
    `lax.cond`: XLA gives a conditional's result its own buffer, so a cond whose other
    branch returns `operand` copies it whole each time it runs, while a loop passes its
    carry through in place. For the factorization in the Newton loop (O(n·b²), 2.4 MB
    at n = 1764) the copies cost a quarter of the forward solve. Under `vmap` the loop
    runs once if any member needs the update and the others keep `operand` by a
    select (`taken_where`: unbatched the trip runs only where `pred` holds, and there is
    no select): one shared predicate keeps it a real loop (with a batched predicate
    JAX's batched loop selects the whole carry on every trip, which slows vmapped
    solves).

    `update` may take the operand as its argument (`pass_operand`): reading it from the
    loop's carry rather than from a closure lets XLA update it in place (a value both
    carried and closed over is copied on every entry to the loop).

    `selects`: `update` itself returns the operand where not `pred` (the Newton
    iteration's `setup_where`, which factorizes only the members that need it and
    leaves the others' factors in place): no `where` here, which would copy them."""
    def body(c):
        new = update(c[1]) if pass_operand else update()
        return jnp.zeros_like(c[0]), new if selects else taken_where(pred, new, c[1])

    return jax.lax.while_loop(lambda c: c[0], body, (unvmap_any(pred), operand))[1]


class NewtonResult(eqx.Module):
    ee: jax.Array
    converged: jax.Array
    fail_kind: jax.Array
    lin_state: object
    jac_point: tuple      # (t, y, yp) of the last setup, for exact hot restarts
    cj_old: jax.Array
    ss: jax.Array
    num_residual_evals: jax.Array
    num_jacobian_evals: jax.Array
    num_iters: jax.Array
    linear_stats: dict    # the linear solver's `stat_names` counters
    mask_violated: jax.Array   # F_y' (a∘r) ≠ 0 at a setup (see `newton_solve`'s mask_probe)
    # With `iterations` (see `newton_solve`): the iteration neither converged nor failed
    # within them, and `carry` is where to resume it; None otherwise.
    pending: jax.Array | None = None
    carry: "_Iteration | None" = None


def depends_on_yp(residual, t, y, yp, args, v) -> jax.Array:
    """Whether F_y'(t, y, y') v has a finite nonzero entry (one `jax.jvp`)."""
    _, d = jax.jvp(lambda yp_: residual(t, y, yp_, args), (yp,), (v,))
    return jnp.any(jnp.isfinite(d) & (d != 0))


def _builds_from_residual(linear_solver) -> bool:
    """Whether `setup` forms J from the residual it is passed (so that it can be
    given the column-scaled one): not matrix-free, no user Jacobian, not a solver
    that substitutes a residual of its own (`SetupWithArgs`)."""
    from ._linalg.linear_solver import SetupWithArgs
    if linear_solver.matrix_free or isinstance(linear_solver, SetupWithArgs):
        return False
    return getattr(linear_solver, "jac", None) is None


class _Iteration(NamedTuple):
    """`newton_solve`'s loop carry."""

    ee: jax.Array              # the correction y − y_(0) so far
    m: jax.Array               # iterations since the last setup
    oldnrm: jax.Array          # ‖δ‖ of the first of them (the rate's base)
    ss: jax.Array              # the convergence-rate factor S
    lin: object                # the linear solver's state (J, factored)
    jac_point: tuple | None    # (t, y, y') where `lin` was set up (None in a stored carry)
    cj_old: jax.Array          # cj of that setup
    jcur: jax.Array            # J was set up in this call
    setup: jax.Array           # set J up before the next iteration
    status: jax.Array          # 0 running, 1 converged, 2 failed
    fail_kind: jax.Array
    lin_failed_any: jax.Array  # an inexact linear solve missed its tolerance
    mask: jax.Array            # F_y' (a∘r) ≠ 0 at a setup
    nre: jax.Array             # residual evaluations (= iterations), Jacobian setups
    nje: jax.Array
    lin_stats: dict


# Kept whole: the iteration body, its convergence test and the redo after a failure with
# an old Jacobian share the loop carry; its length is mostly that body (IDAS IDANls).
def setup_linear(linear_solver, residual, t, y, yp, cj, args, index2=None, where=None):
    """The linear solver's setup of J = F_y + cj F_y' at (t, y, y') — of J D, D = cj on
    the `index2` columns and 1 elsewhere, when the index-2 mask is given (the column
    scaling of `newton_solve`): the Jacobian of w ↦ F(t, D w, D w') at w = D⁻¹ y.
    `where` = (pred, state): set up where pred, else keep state (`setup_where`: under
    vmap a solver may factorize only the members that need it)."""
    setup = (linear_solver.setup if where is None
             else functools.partial(linear_solver.setup_where, *where))
    if index2 is None:
        return setup(residual, t, y, yp, cj, args)
    d = jnp.where(index2, cj, 1.0).astype(y.dtype)
    return setup(lambda t_, w, wp, a: residual(t_, d * w, d * wp, a), t, y / d, yp / d,
                 cj, args)


def idle_iteration(y, linear_solver) -> _Iteration:
    """A `newton_solve` carry with nothing to resume (status 1), for `resume`: its
    `lin` and `jac_point` are None (the caller keeps J with its step state)."""
    zero = jnp.zeros((), jnp.int32)
    return _Iteration(
        ee=jnp.zeros_like(y), m=zero, oldnrm=jnp.ones((), y.dtype), ss=jnp.ones((), y.dtype),
        lin=None, jac_point=None, cj_old=jnp.ones((), y.dtype), jcur=jnp.zeros((), bool),
        setup=jnp.zeros((), bool), status=jnp.ones((), jnp.int32), fail_kind=zero,
        lin_failed_any=jnp.zeros((), bool), mask=jnp.zeros((), bool), nre=zero, nje=zero,
        lin_stats={k: zero for k in linear_solver.stat_names})


def _all_finite(g) -> jax.Array:
    """`jnp.all(jnp.isfinite(g))`; for a short vector as the `&` of its entries, which
    XLA fuses into the operations that read it, where the reduction was an operation of
    its own in every Newton iteration."""
    if g.ndim != 1 or not 0 < g.shape[0] <= 8:
        return jnp.all(jnp.isfinite(g))
    return functools.reduce(jnp.logical_and, [jnp.isfinite(g[i]) for i in range(g.shape[0])])


def _compact(t, cj, linear_solver, keep_mask: bool):
    """(pack, unpack) of the unbatched Newton loop's carry, without what follows from
    the rest and the start. Each scalar a loop carries is an entry of a packed vector
    (`_ops.packed_while_loop`), and each vector costs an iteration its concatenate and
    a copy (Robertson's iteration carried three, f64, int32 and bool; now two), and
    each value set up before the loop for it alone an operation of the step. From a
    start with e = 0 (no `resume`):

    - `setup` (set J up before the next iteration) is the start's before the first
      iteration and, after it, a retry's, which alone sets m back to 0;
    - `jcur` (J set up in this call) is whether a setup was counted (`nje` > 0): a
      retry clears `jcur` but sets `setup`, which sets it again at once;
    - `cj_old` and the setup's t are this call's cj and t once J has been set up in it,
      the start's before;
    - `mask` stays False without a `mask_probe`, `lin_failed_any` without a linear
      solver whose solves can fail (`solve_failed` not overridden).

    The start's `setup` (as an int32, with the other counters), `cj_old` and t are
    carried unchanged: `pack(c, start)` takes them from the packed carry `start` (the
    iteration's input), or from `c` itself (None: the loop's initial carry).
    `unpack(pack(c, ·))` is `c` for every carry the iteration reaches, so the iterates
    are the same bit for bit."""
    from ._linalg.linear_solver import AbstractLinearSolver
    keep_lin_failed = type(linear_solver).solve_failed is not AbstractLinearSolver.solve_failed
    false = jnp.zeros((), bool)

    def pack(c: Any, start: Any) -> Any:
        if start is None:
            setup0 = jnp.asarray(c.setup).astype(jnp.int32)
            cj_old0, t0 = c.cj_old, c.jac_point[0]
        else:
            setup0, cj_old0, t0 = start.setup, start.cj_old, start.jac_point[0]
        return c._replace(setup=setup0, jcur=None, cj_old=cj_old0,
                          jac_point=(t0,) + tuple(c.jac_point[1:]),
                          mask=c.mask if keep_mask else None,
                          lin_failed_any=c.lin_failed_any if keep_lin_failed else None)

    def unpack(c: Any) -> Any:
        had = c.nje > 0
        return c._replace(setup=(c.m == 0) & ((c.nre > 0) | (c.setup != 0)), jcur=had,
                          cj_old=where(had, cj, c.cj_old),
                          jac_point=(where(had, t, c.jac_point[0]),) + tuple(c.jac_point[1:]),
                          mask=c.mask if keep_mask else false,
                          lin_failed_any=c.lin_failed_any if keep_lin_failed else false)

    return pack, unpack


def newton_solve(residual, args, linear_solver, t, y_pred, yp_pred, cj, ewt,
                 lin_state, jac_point, cj_old, ss, force_setup, linear: bool = False,
                 mask_probe=None, index2=None, iterations: int | None = None,
                 resume: _Iteration | None = None, active=None,
                 fresh: bool = False) -> NewtonResult:
    """Run the modified Newton iteration from e = 0. See the module docstring.

    `iterations`: run at most this many iterations, unrolled (straight-line code, no
    loop), and report an iteration that has neither converged nor failed by then as
    `pending`, with its `carry`; `resume` is such a carry (`lin` and `jac_point` None:
    `lin_state` and `jac_point` are then those the carry had), from which the
    iteration continues where its status is 0 — the same iterates, in the same order,
    as one uninterrupted call (the predictor and cj must be those of the interrupted
    call). Why: under `vmap` a loop runs until its slowest member is done, so a batch
    whose members need 1–4 iterations each pays 3 of them at almost every step
    (Robertson, 256 members: 2.93 iterations per step-loop trip against 1.2 per
    attempt unbatched). A batched step loop (`_integrator._integrate_flat`) instead
    runs a fixed number per trip and lets the members that need more finish theirs
    in the next trips, whose predictor recomputes the same y_(0) from the unchanged
    step state.

    `active`: bool or None (all). Where False, J is never set up: the caller drops
    that member's result and keeps the state it passed (a finished member of a batched
    step loop), so its factors come back as they went in, untouched by the in-place
    setup (`setup_where`), and need no select to be kept.

    `mask_probe`: a∘r (a the algebraic mask, r distinct positive weights) or None. With
    it, each Jacobian setup also checks that F_y' (a∘r) = Σ_{i algebraic} r_i F_y'e_i is
    zero — that F does not depend on y' of a component marked algebraic — by one
    `jax.jvp` (only where J is formed, not every iteration); `mask_violated` says it was
    not.

    `linear`: the residual is linear in y (the adjoint DAE). With J set up at this t and
    cj, one iteration is then exact (Li & Petzold, DASPKADJOINT §5.3), and the rate test
    would only measure roundoff — which, for badly conditioned J, can look like
    divergence — so the first such iteration is accepted.

    `fresh` (with `linear`, unbatched: neither `iterations` nor `active`): set J up at
    this t and cj on every call and take that one exact iteration, straight-line —
    the other of Li & Petzold's two remedies (§5.3: a Jacobian at every step, or the
    rate re-estimated at every step), cheaper where a setup costs about an iteration
    (small n: `_derivatives.adjoint.fresh_matrix`).

    `index2`: bool mask of the index-2 variables (Hessenberg index 2), or None. A
    matrix-based solver then factors J D, D = diag(cj on index-2 columns, 1 elsewhere),
    and the correction is x = D w from (J D) w = −G. Why: for x' = f(x, z), 0 = g(x)
    the Schur complement of J for z is g_x (cj I − f_x)⁻¹ f_z ≈ g_x f_z / cj, so J's
    smallest pivot shrinks like h and falls below the singularity test as h → 0 (the
    water tube at h = 10⁻⁸); with the columns scaled it stays O(1). This is DASPK3.0's
    remedy (Li & Petzold, DASPKADJOINT §6: index-2 constraints scaled by CJ — which,
    since our LU equilibrates rows, is equivalent to scaling the index-2 columns). The
    Newton iterates, their convergence norm (all components, as in IDAS) and the
    solution are unchanged: only the conditioning of the factored matrix is. Solvers
    that do not build J from the residual they are given (matrix-free ones, a user
    `jac`) use J unscaled."""
    int_ = jnp.int32
    scale_cols = index2 is not None and _builds_from_residual(linear_solver)

    def cond(c: _Iteration):
        return c.status == 0

    def body(c: _Iteration, solving=None) -> _Iteration:
        # `solving`: the members whose iteration counts (None: all); the others' linear
        # solve may be skipped (`solve_where`), their result being dropped.
        ee = c.ee
        do_setup = c.setup if active is None else c.setup & active

        def refresh(lin_old, mask_old):
            # J set up at the current iterate (where `do_setup`: `setup_where`), whether
            # it is singular, the point (y, y') of the setup and the mask's probe.
            y_s, yp_s = y_pred + ee, yp_pred + cj * ee
            lin_new = setup_linear(linear_solver, residual, t, y_s, yp_s, cj, args,
                                   index2 if scale_cols else None,
                                   where=(do_setup, lin_old))
            new = (linear_solver.is_singular(lin_new), (y_s, yp_s))
            if mask_probe is not None:
                new = new + (mask_old | depends_on_yp(residual, t, y_s, yp_s, args,
                                                      mask_probe),)
            return lin_new, new

        def setup(operand):
            # Where not `do_setup` (other members of a batch) every part is `operand`'s:
            # the factors by `setup_where`, the rest selected here.
            lin_new, new = refresh(operand[0], None if mask_probe is None else operand[-1])
            return (lin_new,) + taken_where(do_setup, new, operand[1:])

        # Everything that changes only with a setup is computed in its one-trip loop
        # (not selected on every iteration: each select is an operation of the
        # iteration, and so is each copy XLA makes of a value the loop carries; hence
        # the mask only where it is probed). `do_setup` stands in for the singularity
        # flag without a setup, where it is False. The setup's t is this call's t, so
        # it is selected rather than carried through the loop.
        jac_t, *jac_yy_old = cast(tuple, c.jac_point)
        extra = () if mask_probe is None else (c.mask,)
        operand = (c.lin, do_setup, tuple(jac_yy_old)) + extra
        if fresh:
            # Set up on every call: straight-line, no one-trip loop.
            lin, singular, jac_yy, *probed = setup(operand)
        else:
            lin, singular, jac_yy, *probed = maybe_update(do_setup, setup, operand,
                                                          pass_operand=True, selects=True)
        jac_point = (where(do_setup, t, jac_t),) + tuple(jac_yy)
        mask = probed[0] if probed else c.mask
        singular = do_setup & singular
        cj_old_ = where(do_setup, cj, c.cj_old)
        ss_ = where(do_setup, 20.0, c.ss)
        jcur = c.jcur | do_setup

        y_it, yp_it = y_pred + ee, yp_pred + cj * ee
        if linear_solver.needs_operator:
            g, operator = jax.linearize(lambda v: residual(t, y_it + v, yp_it + cj * v, args),
                                        jnp.zeros_like(ee))
        else:
            g, operator = residual(t, y_it, yp_it, args), None
        # A matrix-based J was built with cj_old: IDAS rescales the update by
        # 2/(1 + cj/cj_old). Matrix-free solvers apply J at the current iterate and cj
        # (inexact Newton), so their update is not rescaled.
        scale = 1.0 if linear_solver.matrix_free else 2.0 / (1.0 + cj / cj_old_)
        finite = _all_finite(g)
        if solving is None:
            x, lin_stats = linear_solver.solve(lin, -g, weights=ewt, operator=operator)
        else:
            x, lin_stats = linear_solver.solve_where(solving, lin, -g, weights=ewt,
                                                     operator=operator)
        if scale_cols:
            x = x * where(index2, cj_old_, 1.0)   # x = D w, D of the setup (cj_old)
        delta = x * scale
        ee_new = ee + delta
        delnrm = wrms(delta, ewt)
        m = c.m
        first = m == 0
        rate = (delnrm / where(first, 1.0, c.oldnrm)) ** (1.0 / jnp.maximum(m, 1))
        diverging = ~first & (rate > RATE_MAX)
        ss_ = where(first, ss_, rate / (1.0 - rate))
        converged = (first & (delnrm <= 1e-4 * TOLDEL)) | (~diverging & (ss_ * delnrm <= EPS_NEWT))
        bad = singular | ~finite | ~jnp.isfinite(delnrm)
        lin_failed = linear_solver.solve_failed(lin_stats)
        # A Newton iteration that fails after an inexact linear solve (a stalled
        # correction, or a divergence it caused) is reported as the linear solver's.
        lin_failed_any = c.lin_failed_any | lin_failed
        converged = converged & ~lin_failed
        failed = bad | diverging | (~converged & (m + 1 >= MAX_ITERS)) | (lin_failed & ~first)
        if linear:
            converged = converged | (do_setup & (cj_old_ == cj) & ~lin_failed)
            failed = failed & ~converged
        converged = converged & ~bad
        retry = failed & ~jcur
        # A NaN residual usually also poisons J (whose factorization then looks
        # singular): report the cause, not the symptom.
        fail_kind = where(~finite, FAIL_NONFINITE,
                              where(singular, FAIL_SINGULAR,
                                        where(lin_failed_any, FAIL_LINEAR,
                                                  FAIL_CONVERGENCE)))
        # A wrong algebraic mask ends the iteration (the step reports it).
        status = where(mask, 2, where(converged, 1, where(failed & ~retry, 2, 0)))
        status = status.astype(int_)
        return _Iteration(
            ee=where(retry, 0.0, ee_new),
            m=where(retry, 0, m + 1).astype(int_),
            oldnrm=where(first, delnrm, c.oldnrm),
            ss=ss_, lin=lin, jac_point=jac_point, cj_old=cj_old_, jcur=jcur & ~retry, setup=retry,
            status=status, fail_kind=fail_kind.astype(int_), lin_failed_any=lin_failed_any,
            mask=mask,
            nre=c.nre + 1, nje=c.nje + do_setup.astype(int_),
            lin_stats={k: c.lin_stats[k] + lin_stats[k] for k in c.lin_stats},
        )

    zero = jnp.zeros((), int_)
    init = _Iteration(
        ee=jnp.zeros_like(y_pred), m=zero, oldnrm=jnp.ones((), y_pred.dtype), ss=ss,
        lin=lin_state, jac_point=jac_point, cj_old=cj_old, jcur=jnp.zeros((), bool), setup=force_setup,
        status=zero, fail_kind=zero, lin_failed_any=jnp.zeros((), bool),
        mask=jnp.zeros((), bool), nre=zero, nje=zero,
        lin_stats={k: zero for k in linear_solver.stat_names},
    )
    pending = carry = None
    if resume is not None:
        go_on = resume.status == 0
        init = init._replace(**{f: tree_where(go_on, getattr(resume, f), getattr(init, f))
                                for f in _Iteration._fields if f not in ("lin", "jac_point")})
    if fresh:
        # J set up at t and cj, then one iteration, which converges (or fails: singular,
        # not finite), straight-line: no loop, nothing to retry.
        out = body(init._replace(setup=jnp.ones((), bool)))
    elif iterations is None:
        pack, unpack = _compact(t, cj, linear_solver, keep_mask=mask_probe is not None)
        out = unpack(packed_while_loop(lambda c: cond(unpack(c)),
                                       lambda c: pack(body(unpack(c)), c), pack(init, None)))
    else:
        # Every member starts running (status 0: a fresh start or a resumed one), so
        # the first iteration needs no select; later ones keep the finished members —
        # all but their J, which a member that is not running does not set up (its
        # `setup` flag is cleared for the iteration), so that the factors are left where
        # they are instead of being selected (under `vmap`: a copy of the whole batch's
        # factors per iteration).
        # A member's linear solve is skipped where its result is dropped (not running,
        # or not `active`).
        out = body(init, active)
        for _ in range(iterations - 1):
            run = out.status == 0
            nxt = body(out._replace(setup=out.setup & run),
                       run if active is None else run & active)
            out = tree_where(run, nxt._replace(lin=None, jac_point=None),
                             out._replace(lin=None, jac_point=None)
                             )._replace(lin=nxt.lin, jac_point=nxt.jac_point)
        pending = out.status == 0
        carry = out._replace(lin=None, jac_point=None)
    return NewtonResult(
        ee=out.ee, converged=out.status == 1, fail_kind=out.fail_kind,
        lin_state=out.lin, jac_point=cast(tuple, out.jac_point), cj_old=out.cj_old, ss=out.ss,
        num_residual_evals=out.nre, num_jacobian_evals=out.nje, num_iters=out.nre,
        linear_stats=out.lin_stats, mask_violated=out.mask, pending=pending, carry=carry,
    )
