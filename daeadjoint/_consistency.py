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

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ._initialization import SUCCESS, calc_ic
from ._linear_solver import masked_residual


def unknown_mask(mode, algebraic):
    """m: True where the initialization's unknown is y0_i (else y'0_i). `init=None`
    uses the `"ya_ydp"` split for its derivatives (y'0 and the algebraic y0 are
    determined by the differential y0)."""
    if mode == "y":
        return jnp.ones_like(algebraic)
    return algebraic


def consistency_solve(linear_solver, residual, t, y, yp, args, mask, rhs, transpose=False):
    """x with C x = rhs (or Cᵀ x = rhs) for each row of rhs (k, n), C the consistency
    matrix at (t, y, y'). Returns (x, singular). Differentiable in every argument."""
    m = mask.astype(y.dtype)
    fn = masked_residual(residual, y, yp, mask)
    zero = jnp.zeros_like(y)

    def matvec(v):
        return jax.jvp(lambda v_: fn(t, v_, None, args), (zero,), (v,))[1]

    def vecmat(w):
        return jax.vjp(lambda v_: fn(t, v_, None, args), zero)[1](w)[0]

    aux = linear_solver.auxiliary()
    state = jax.lax.stop_gradient(aux.setup(fn, t, zero, zero, jnp.zeros((), y.dtype), args))
    op = matvec if aux.needs_operator else None

    def solve(_, b):
        return aux.solve(state, b, operator=op)[0]

    def solve_t(_, b):
        return aux.solve(state, b, transpose=True, operator=op)[0]

    if transpose:
        one = lambda b: jax.lax.custom_linear_solve(vecmat, b, solve_t, solve)  # noqa: E731
    else:
        one = lambda b: jax.lax.custom_linear_solve(matvec, b, solve, solve_t)  # noqa: E731
    del m
    return jax.vmap(one)(rhs), aux.is_singular(state)


def _float0_like(x):
    return np.zeros(jnp.shape(x), dtype=jax.dtypes.float0)


def consistent_values(config, inputs):
    """(y0, y'0, ok, (reason, worst)) consistent for `config.init`; with `init=None` the
    inputs themselves. `reason` indexes `_initialization.REASONS` (0: converged) and
    `worst` is the component a failure message names (−1: none). Derivatives by the
    implicit function theorem (see the module docstring)."""
    if config.init is None:
        zero = jnp.zeros((), jnp.int32)
        return inputs.y0, inputs.yp0, jnp.ones((), bool), (zero, zero - 1)
    dyn, static = eqx.partition(inputs.args, eqx.is_inexact_array)
    config_dyn, config_static = eqx.partition(config, eqx.is_array)
    static_arrays, static = eqx.partition(static, eqx.is_array)   # e.g. int arrays in args
    # IDACalcIC measures the y' unknowns on the time scale of the first output time.
    t_out = jnp.min(jnp.where(inputs.saveat > inputs.t0, inputs.saveat, inputs.t1))
    fixed = (inputs.algebraic, inputs.rtol, inputs.atol, t_out, config_dyn, static_arrays,
             inputs.constraints)

    # Every array is an explicit argument (a closed-over tracer would leak); `fixed`
    # has no derivative.
    @jax.custom_jvp
    def solve_init(t0, y0, yp0, d, fixed):
        algebraic, rtol, atol, t_out, cdyn, sarr, constraints = fixed
        cfg = eqx.combine(cdyn, config_static)
        r = calc_ic(cfg.residual, t0, y0, yp0, eqx.combine(d, sarr, static), algebraic,
                    cfg.init, rtol, atol, cfg.linear_solver, constraints, tout=t_out)
        return r.y0, r.yp0, r.reason == SUCCESS, (r.reason, r.worst_component)

    @solve_init.defjvp
    def solve_init_jvp(primals, tangents):
        t0, y0, yp0, d, fixed = primals
        t0d, y0d, yp0d, dd, _ = tangents
        algebraic, _, _, _, cdyn, sarr, _ = fixed
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

    return solve_init(inputs.t0, inputs.y0, inputs.yp0, dyn, fixed)


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
    mask = unknown_mask(config.init, inputs.algebraic)
    m = mask.astype(dtype)
    dyn, static = eqx.partition(inputs.args, eqx.is_inexact_array)

    def F(y, yp, d):
        return config.residual(t0, y, yp, eqx.combine(d, static))

    def zeros(shape):
        return jnp.zeros((k,) + shape, dtype)

    y0d = zeros((n,)) if tangents.y0 is None else tangents.y0
    yp0d = zeros((n,)) if tangents.yp0 is None else tangents.yp0
    t0d = jnp.zeros((k,), dtype) if tangents.t0 is None else tangents.t0
    dd = (jax.tree_util.tree_map(lambda x: jnp.zeros((k,) + x.shape, x.dtype), dyn)
          if tangents.args is None else tangents.args)
    # The given components stay put while t0 moves: s_given = δy0 − y'(t0) δt0.
    s_known = (1 - m) * (y0d - yp0[None] * t0d[:, None])
    sp_known = m * yp0d
    _, f_lin = jax.linearize(F, y0, yp0, dyn)
    r0 = jax.vmap(f_lin)(s_known, sp_known, dd)
    u, singular = consistency_solve(config.linear_solver, lambda t, y, yp, a: F(y, yp, a),
                                    t0, y0, yp0, dyn, mask, -r0)
    s0 = s_known + m * u
    sp0 = (1 - m) * u + sp_known
    if config.quadrature is None:
        return s0, sp0, zeros((0,)), zeros((0,)), singular

    def q(y, yp, d):
        return jnp.asarray(config.quadrature(t0, y, yp, eqx.combine(d, static)), dtype)

    q0, q_lin = jax.linearize(q, y0, yp0, dyn)
    qsp0 = jax.vmap(q_lin)(s0, sp0, dd)
    qs0 = -t0d[:, None] * q0[None]
    return s0, sp0, qs0, qsp0, singular
