r"""Consistent initial values and consistent initial sensitivities, differentiable to
any order.

Both solve with the *consistency matrix* of the initialization mode,

    C = F_y diag(m) + F_y' diag(1 − m),

m_i = 1 where the unknown is y0_i (the algebraic components for `init="ya_ydp"` and for
`init=None`, all components for `init="y"`), and m_i = 0 where it is y'0_i (IDAS manual
§6.2.1: given y_d, compute y_a and y'_d; or given y', compute y).

- `consistent_values`: the nonlinear initialization (Newton with line search, in
  `_initialization.py`), wrapped so that its derivative is the implicit function
  theorem's, C δu = −(F_t δt0 + F_y δy_known + F_y' δy'_known + F_p δp), never the
  derivative of the Newton iterations.
- `initial_sensitivities`: s(t0), s'(t0) of k tangent directions consistent with the
  linearized DAE F_y s + F_y' s' + F_p ṗ = 0, from the given part of the initial data
  (IDAS manual eq. (6.11)). A moving start time enters as s_d(t0) = −y'_d(t0) δt0 (the
  given components stay put), and the quadratures start at −q(t0) δt0.

Every solve with C goes through `jax.lax.custom_linear_solve` with the configured linear
solver's `auxiliary()` as the solver and a `jax.jvp` of the residual as the matrix–vector
product, so JAX differentiates these solves (for Hessians) through the matrix–vector
product, not through the factorization.
"""

import dataclasses
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float

from ._initialization import SUCCESS, calc_ic
from ._jax_internals import unvmap_any
from ._linalg.linear_solver import masked_residual
from ._ops import where
from ._newton import tree_where


# Without an `algebraic` mask, up to this many unknowns the algebraic directions are found
# from F_y' itself (`Split`, below); above it the mask is the components whose y' the
# residual's program never reads (`_solve._structural_algebraic`), else all False.
AUTO_SPLIT_MAX_N = 200


class Split(eqx.Module):
    """Which directions of y a consistency condition treats as algebraic, at a point:
    a projector Π onto (a superset of) ker F_y'.

    - With an `algebraic` mask (semi-explicit DAEs, whose algebraic components are
      absent from y'): Π = diag(mask).
    - Without one (`projector` present): the orthogonal projector onto ker F_y'(t, y, y')
      from its singular value decomposition (zero when F_y' is nonsingular). This covers
      fully implicit index-1 DAEs whose singular F_y' mixes components — circuits with
      capacitors between two nodes, where each algebraic constraint is a sum of rows
      and no component is absent from y'.

    Every formula with the mask m carries over with m∘v → Πv and (1 − m)∘v → (I − Π)v:
    the consistency matrix C = F_y Π + F_y'(I − Π) is nonsingular exactly when the DAE
    is index 1 (if C v = 0, the left null vectors Q of F_y' give QᵀF_y Π v = 0, so
    Πv = 0 by index 1, and then F_y' v = 0 puts v in ker F_y' = range Π: v = 0); its
    transpose gives the adjoint's consistent jumps (`_derivatives/adjoint.py`)."""

    mask: Bool[Array, " n"]
    projector: Float[Array, "n n"] | None = None
    # The equations that carry the algebraic constraints: rows i with a nonzero row of
    # the projector onto ker F_y'ᵀ (the mask itself for semi-explicit DAEs, whose
    # algebraic equation i goes with component i). The adjoint's multipliers of these
    # equations are determined by the forward solution, not integrated (`_derivatives/adjoint.py`).
    equations: Bool[Array, " n"] | None = None

    @property
    def algebraic_equations(self):
        return self.mask if self.equations is None else self.equations

    def alg(self, v):
        """Π v (over the last axis)."""
        if self.projector is None:
            return where(self.mask, v, 0.0)
        return v @ self.projector.T

    def diff(self, v):
        """(I − Π) v."""
        return v - self.alg(v)

    def alg_t(self, w):
        """Πᵀ w."""
        if self.projector is None:
            return where(self.mask, w, 0.0)
        return w @ self.projector

    def diff_t(self, w):
        """(I − Π)ᵀ w."""
        return w - self.alg_t(w)


def split_at(auto: bool, residual, t, y, yp, args, algebraic) -> Split:
    """The `Split` at (t, y, y'): the mask, or (`auto`) the projector onto ker F_y'.

    The rank decision: singular values of F_y' below 1000·n·eps of the largest are zero
    (structural zeros come out at ~eps; a capacitance 10⁻¹¹ times the largest would
    count as absent). Computed only when the LU of F_y' finds it singular, so ODEs in
    implicit form pay one small LU. Π is not differentiated: it fixes which unknowns
    are solved for, like the mask."""
    if not auto:
        return Split(mask=algebraic)
    from ._linalg.linear_solver import factor, factored_is_singular

    def compute(t, y, yp, args):
        E = jax.jacfwd(lambda v: residual(t, y, v, args))(yp)
        n = E.shape[0]
        eps = jnp.finfo(E.dtype).eps

        def projectors():
            u, sigma, vh = jnp.linalg.svd(E)
            null = where(sigma <= 1000.0 * n * eps * sigma[0], 1.0, 0.0)
            right = vh.T @ (null[:, None] * vh)
            left_diagonal = jnp.sum(u * u * null[None, :], axis=1)   # diag of U₀U₀ᵀ
            return right, left_diagonal > jnp.sqrt(eps)

        singular = factored_is_singular(factor(E)) | ~jnp.all(jnp.isfinite(E))
        none = (jnp.zeros_like(E), jnp.zeros((n,), bool))
        # unvmap_any: under vmap a batched predicate would run the SVD for every member
        # of every batch; this way a batch of ODEs never does.
        return jax.lax.cond(unvmap_any(singular),
                            lambda: tree_where(singular, projectors(), none), lambda: none)

    pi, equations = jax.lax.stop_gradient(compute(t, y, yp, args))
    return Split(mask=jnp.zeros_like(algebraic), projector=pi, equations=equations)


def unknown_split(mode, split: Split) -> Split:
    """The initialization's unknowns: all of y0 for `init="y"`, else the split's
    algebraic directions of y0 and the rest of y'0. `init=None` uses the `"ya_ydp"`
    split for its derivatives (y'0 and the algebraic y0 are determined by the
    differential y0)."""
    if mode == "y":
        return Split(mask=jnp.ones_like(split.mask))
    return split


def unknown_mask(mode, algebraic):
    """The componentwise form of `unknown_split` (for messages naming a component)."""
    if mode == "y":
        return jnp.ones_like(algebraic)
    return algebraic


def consistency_solve(linear_solver, residual, t, y, yp, args, split, rhs, transpose=False,
                      differentiable=True):
    """x with C x = rhs (or Cᵀ x = rhs) for each row of rhs (k, n), C the consistency
    matrix of `split` (a `Split`, or a bool mask) at (t, y, y'). Returns (x, singular).
    Differentiable in every argument. A dense projector (no mask) makes C dense: it is
    factored by `DenseLU` (n ≤ AUTO_SPLIT_MAX_N) whatever the configured solver.

    `differentiable=False` is for callers JAX never differentiates (the adjoint's
    backward pass, which runs inside a primitive whose derivative rules are its own):
    the same factorization and the same solve, called directly instead of through
    `custom_linear_solve`, whose matrix–vector products (a `jax.jvp` and a `jax.vjp` of
    the residual, traced and lowered with every solve) only its derivative rules use."""
    solve, singular = consistency_factor(linear_solver, residual, t, y, yp, args, split,
                                         transpose, differentiable)
    return solve(rhs), singular


def consistency_factor(linear_solver, residual, t, y, yp, args, split, transpose=False,
                       differentiable=True):
    """`consistency_solve` split in two: C (or Cᵀ) factored once, returned as
    (solve, singular) with solve(rhs) the x of every row of rhs (k, n) — for callers
    with several right-hand sides computed one from another's solution."""
    from ._linalg.linear_solver import DenseLU
    if not isinstance(split, Split):
        split = Split(mask=split)
    fn = masked_residual(residual, y, yp, split)
    zero = jnp.zeros_like(y)

    def matvec(v):
        return jax.jvp(lambda v_: fn(t, v_, None, args), (zero,), (v,))[1]

    def vecmat(w):
        return jax.vjp(lambda v_: fn(t, v_, None, args), zero)[1](w)[0]

    aux = linear_solver.auxiliary() if split.projector is None else DenseLU()
    state = jax.lax.stop_gradient(aux.setup(fn, t, zero, zero, jnp.zeros((), y.dtype), args))
    op = matvec if aux.needs_operator else None

    def solve(_, b):
        return aux.solve(state, b, operator=op)[0]

    def solve_t(_, b):
        return aux.solve(state, b, transpose=True, operator=op)[0]

    if not differentiable:
        one = solve_t if transpose else solve
        return (lambda rhs: jax.vmap(lambda b: one(None, b))(rhs)), aux.is_singular(state)
    if transpose:
        one = lambda b: jax.lax.custom_linear_solve(vecmat, b, solve_t, solve)  # noqa: E731
    else:
        one = lambda b: jax.lax.custom_linear_solve(matvec, b, solve, solve_t)  # noqa: E731
    return (lambda rhs: jax.vmap(one)(rhs)), aux.is_singular(state)


def _float0_like(x):
    return np.zeros(jnp.shape(x), dtype=jax.dtypes.float0)


def consistent_values(config, inputs, known=None):
    """(y0, y'0, ok, (reason, worst)) consistent for `config.init`; with `init=None` the
    inputs themselves. `reason` indexes `_initialization.REASONS` (0: converged) and
    `worst` is the component a failure message names (−1: none). Derivatives by the
    implicit function theorem (see the module docstring).

    `known`: the (y0, y'0) this initialization gave before for the same config and
    inputs (a recorded run's), returned as they are (ok, reason 0, worst −1) with the
    same derivatives, instead of a second Newton iteration, which XLA would compile once
    more (where the derivative is all that is needed: `DiscreteAdjoint`'s cotangents at
    t0, the augmented DAE of second-order derivatives). Ignored where the initialization
    runs in rotated coordinates (no mask, `auto_split`)."""
    if config.init is None:
        zero = jnp.zeros((), jnp.int32)
        return inputs.y0, inputs.yp0, jnp.ones((), bool), (zero, zero - 1)
    y0, yp0, algebraic, atol = inputs.y0, inputs.yp0, inputs.algebraic, inputs.atol
    # No mask: initialize in the coordinates z = Vᵀy of F_y''s right singular vectors at
    # the guess (V = I when F_y' is nonsingular), where the null-space coordinates are
    # absent from z' — semi-explicit, with the mask `null`. The given part of y0 is then
    # (I − Π)y0 with Π = V₀V₀ᵀ, as in every other use of the split (`Split`).
    rotate = config.auto_split and config.init == "ya_ydp" and inputs.constraints is None
    if rotate:
        known = None   # the Newton iteration's unknowns are z = Vᵀy there
        V, algebraic = _null_space_basis(config.residual, inputs.t0, y0, yp0, inputs.args)
        config = dataclasses.replace(config, residual=_Rotated(config.residual, V))
        y0, yp0 = y0 @ V, yp0 @ V
        atol = jnp.full_like(atol, jnp.min(atol))   # per-component weights do not rotate
    dyn, static = eqx.partition(inputs.args, eqx.is_inexact_array)
    config_dyn, config_static = eqx.partition(config, eqx.is_array)
    static_arrays, static = eqx.partition(static, eqx.is_array)   # e.g. int arrays in args
    # IDACalcIC measures the y' unknowns on the time scale of the first output time.
    t_out = jnp.min(where(inputs.saveat > inputs.t0, inputs.saveat, inputs.t1))
    fixed = (algebraic, inputs.rtol, atol, t_out, config_dyn, static_arrays,
             inputs.constraints, known)

    # Every array is an explicit argument (a closed-over tracer would leak); `fixed`
    # has no derivative.
    @jax.custom_jvp
    def solve_init(t0, y0, yp0, d, fixed):
        algebraic, rtol, atol, t_out, cdyn, sarr, constraints, known = fixed
        if known is not None:
            zero = jnp.zeros((), jnp.int32)
            return known[0], known[1], jnp.ones((), bool), (zero, zero - 1)
        cfg = eqx.combine(cdyn, config_static)
        r = calc_ic(cfg.residual, t0, y0, yp0, eqx.combine(d, sarr, static), algebraic,
                    cfg.init, rtol, atol, cfg.linear_solver, constraints, tout=t_out)
        return r.y0, r.yp0, r.reason == SUCCESS, (r.reason, r.worst_component)

    @solve_init.defjvp
    def solve_init_jvp(primals, tangents):
        t0, y0, yp0, d, fixed = primals
        t0d, y0d, yp0d, dd, _ = tangents
        algebraic, _, _, _, cdyn, sarr, _, _ = fixed
        cfg = eqx.combine(cdyn, config_static)
        m = unknown_mask(cfg.init, algebraic).astype(y0.dtype)
        y, yp, ok, worst = solve_init(t0, y0, yp0, d, fixed)

        def F(t, y_, yp_, d_):
            return cfg.residual(t, y_, yp_, eqx.combine(d_, sarr, static))

        known = (t0d, (1 - m) * y0d, m * yp0d, dd)
        _, r0 = jax.jvp(F, (t0, y, yp, d), known)
        du, _ = consistency_solve(cfg.linear_solver, F, t0, y, yp, d, m > 0, -r0[None])
        du = du[0]
        y_dot = (1 - m) * y0d + m * du
        yp_dot = (1 - m) * du + m * yp0d
        info_dot = tuple(_float0_like(w) for w in worst)
        return (y, yp, ok, worst), (y_dot, yp_dot, _float0_like(ok), info_dot)

    y, yp, ok, (reason, worst) = solve_init(inputs.t0, y0, yp0, dyn, fixed)
    if rotate:   # back to y; a failure names no component of z
        return V @ y, V @ yp, ok, (reason, jnp.full_like(worst, -1))
    return y, yp, ok, (reason, worst)


class _Rotated(eqx.Module):
    """F(t, V z, V z', args): the residual in the coordinates z = Vᵀy (V orthogonal)."""

    residual: Callable
    V: Float[Array, "n n"]

    def __call__(self, t, z, zp, args):
        return self.residual(t, self.V @ z, self.V @ zp, args)


def _null_space_basis(residual, t, y, yp, args):
    """(V, null): the right singular vectors of F_y'(t, y, y') as columns and which of
    them span its null space (the rank decision of `split_at`); V = I, no null space,
    when F_y' is nonsingular. Not differentiated."""
    from ._linalg.linear_solver import factor, factored_is_singular
    E = jax.lax.stop_gradient(jax.jacfwd(lambda v: residual(t, y, v, args))(yp))
    n = E.shape[0]

    def basis():
        _, sigma, vh = jnp.linalg.svd(E)
        return vh.T, sigma <= 1000.0 * n * jnp.finfo(E.dtype).eps * sigma[0]

    singular = factored_is_singular(factor(E)) | ~jnp.all(jnp.isfinite(E))
    return jax.lax.cond(singular, basis, lambda: (jnp.eye(n, dtype=E.dtype),
                                                   jnp.zeros((n,), bool)))


def initial_sensitivities(config, inputs, y0, yp0, tangents, k: int):
    """(s0, s'0) (k, n), the quadrature sensitivities' start values and rates (k, nq),
    and whether C was singular, for the k directions in `tangents` (`_core.Tangents`)."""
    dtype = y0.dtype
    n = y0.shape[0]
    t0 = inputs.t0
    if config.init == "y" and tangents.t0 is not None:
        raise ValueError(
            "daeadjoint: derivatives with respect to t0 are not available with init='y' "
            "(they need y''(t0) of the quasi-steady start); give y0 consistent and use "
            "init=None, or do not differentiate t0.")
    dyn, static = eqx.partition(inputs.args, eqx.is_inexact_array)

    def F(y, yp, d):
        return config.residual(t0, y, yp, eqx.combine(d, static))

    split = unknown_split(config.init, split_at(config.auto_split, lambda t, y, yp, d: F(y, yp, d),
                                                t0, y0, yp0, dyn, inputs.algebraic))

    def zeros(shape):
        return jnp.zeros((k,) + shape, dtype)

    y0d = zeros((n,)) if tangents.y0 is None else tangents.y0
    yp0d = zeros((n,)) if tangents.yp0 is None else tangents.yp0
    t0d = jnp.zeros((k,), dtype) if tangents.t0 is None else tangents.t0
    dd = (jax.tree_util.tree_map(lambda x: jnp.zeros((k,) + x.shape, x.dtype), dyn)
          if tangents.args is None else tangents.args)
    # The given components stay put while t0 moves: s_given = δy0 − y'(t0) δt0.
    s_known = split.diff(y0d - yp0[None] * t0d[:, None])
    sp_known = split.alg(yp0d)
    _, f_lin = jax.linearize(F, y0, yp0, dyn)
    solve_F = F
    if config.index2:
        # Hessenberg index 2: the given part is first moved onto the linearized
        # constraints, and the rest solves the linearized DAE with each constraint
        # replaced by its hidden constraint (whose consistency matrix is nonsingular;
        # the plain C has zero rows there). As `_index2.project` does for the state.
        from ._index2 import hidden_residual, onto_linearized_constraints
        s_known = onto_linearized_constraints(f_lin, config.index2, s_known, dd,
                                              y0, inputs.algebraic, inputs.rtol,
                                              jnp.broadcast_to(inputs.atol, (n,)))
        R = hidden_residual(lambda t, y, yp, d: config.residual(t, y, yp, eqx.combine(d, static)),
                            config.index2)
        solve_F = lambda y, yp, d: R(t0, y, yp, d)   # noqa: E731
        _, f_lin = jax.linearize(solve_F, y0, yp0, dyn)
    r0 = jax.vmap(f_lin)(s_known, sp_known, dd)
    u, singular = consistency_solve(config.linear_solver, lambda t, y, yp, a: solve_F(y, yp, a),
                                    t0, y0, yp0, dyn, split, -r0)
    s0 = s_known + split.alg(u)
    sp0 = split.diff(u) + sp_known
    if config.quadrature is None:
        return s0, sp0, zeros((0,)), zeros((0,)), singular

    def q(y, yp, d):
        return jnp.asarray(config.quadrature(t0, y, yp, eqx.combine(d, static)), dtype)

    q0, q_lin = jax.linearize(q, y0, yp0, dyn)
    qsp0 = jax.vmap(q_lin)(s0, sp0, dd)
    qs0 = -t0d[:, None] * q0[None]
    return s0, sp0, qs0, qsp0, singular


# ------------------------------------------------------------ restarts at breakpoints


def after(t):
    """t moved 4 ulps forward: past a corner at t, however the model's pieces meet."""
    return t + 4 * jnp.finfo(t.dtype).eps * jnp.maximum(jnp.abs(t), jnp.finfo(t.dtype).tiny)


def before(t):
    """t moved 4 ulps back: short of a corner at t (`after`'s mirror)."""
    return t - 4 * jnp.finfo(t.dtype).eps * jnp.maximum(jnp.abs(t), jnp.finfo(t.dtype).tiny)


def restart_point(residual, linear_solver, split: Split, t, y, yp, args, iters: int = 2):
    """(y, y') consistent at a restart of the integration at t (a breakpoint of the
    inputs, where y' may jump): Newton on F(t, y + Πu, y' + (I − Π)u) = 0 from u = 0 —
    IDACalcIC's YA_YDP, with the differential part of y kept and y' of the last step
    as the guess. `iters` iterations with the consistency matrix at the start (the
    residual is linear in y' for most DAEs, and y_a moves only by the rounding of the
    last step's corrector, so two iterations converge). Differentiable.

    F is evaluated a few ulps after t (`after`): models commonly give the value of the
    piece before a corner at the corner itself (the Test Set's pulses do), and the
    restart needs the slopes that hold after it."""
    t = after(t)
    for _ in range(iters):
        f = residual(t, y, yp, args)
        u, _ = consistency_solve(linear_solver, residual, t, y, yp, args, split, -f[None])
        y, yp = y + split.alg(u[0]), yp + split.diff(u[0])
    return y, yp


def restart_sensitivities(residual, linear_solver, split: Split, t, y, yp, args, s, sp,
                          args_dot):
    """(s, s') of k directions (rows) consistent with the linearized DAE at a restart
    point (t, y, y'), from the last step's values: the differential part of s and the
    algebraic part of s' are kept (as `restart_point` keeps y's), the rest solves
    F_y s + F_y' s' + F_p ṗ = 0 (IDAS manual eq. (6.11))."""
    dyn, static = eqx.partition(args, eqx.is_inexact_array)
    t = after(t)

    def f(y_, yp_, d_):
        return residual(t, y_, yp_, eqx.combine(d_, static))

    _, f_lin = jax.linearize(f, y, yp, dyn)
    s_known, sp_known = split.diff(s), split.alg(sp)
    if args_dot is None:
        zero = jax.tree_util.tree_map(jnp.zeros_like, dyn)
        r = jax.vmap(lambda a, b: f_lin(a, b, zero))(s_known, sp_known)
    else:
        r = jax.vmap(f_lin)(s_known, sp_known, args_dot)
    v, _ = consistency_solve(linear_solver, lambda t_, y_, yp_, d_: f(y_, yp_, d_), t, y, yp,
                             dyn, split, -r)
    return s_known + split.alg(v), split.diff(v) + sp_known
