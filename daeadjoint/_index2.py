"""Hessenberg index-2 DAEs: the `index2=` mask and the check of the initial values.

A Hessenberg index-2 DAE is

    x' = f(t, x, z),    0 = g(t, x),    g_x f_z nonsingular,

(possibly with index-1 algebraic variables beside z): the index-2 variables z appear in
no constraint that could be solved for them, they are fixed by the *hidden* constraint
d/dt g = g_t + g_x x' = 0. `solve(..., index2=m)` declares them:

- `m[i]` True says y_i is an index-2 variable **and** equation i is an index-2
  constraint — the same mask for variables and equations (DASPK3.0 asks for both,
  `IEOPT`; writing the constraints at the indices of their variables, as most
  semi-explicit models do, makes one mask enough). The index-2 variables are algebraic:
  `m` must be a subset of `algebraic` when that is given, and is the `algebraic` mask
  when it is not.
- Checked at (t0, y0, y'0) before the solve (`index2_check`): each marked equation
  depends on y only through variables not marked algebraic (no y', no algebraic
  variable: the Hessenberg form), and y0, y'0 satisfy it and its hidden constraint,
  computed by `jax.jvp` of the residual (no user derivative code).

The tolerance of the consistency checks, per constraint i with gradient G_i = ∂F_i/∂y:
|F_i| ≤ Σ_j |G_ij| (rtol |y0_j| + atol_j) — the smallest change of y0 within its error
weights that could fix F_i — and |dF_i/dt| ≤ Σ_j |G_ij| (rtol |y'0_j| + atol_j/(t1 −
t0)) — an error of y' that moves y by at most its tolerance over the interval.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ._validation import _concrete

(OK, DEPENDS_ON_YP, DEPENDS_ON_ALGEBRAIC, NO_DEPENDENCE, VIOLATED, HIDDEN_VIOLATED,
 NOT_INDEX2) = range(7)
KINDS = 6
# Up to this many unknowns the index-reduced system's matrix is formed densely (n jvps,
# O(n³) LU) to check that the hidden constraints determine the index-2 variables.
DENSE_CHECK_MAX_N = 1000


def check_index2_mask(index2, algebraic, n: int, init, yp0_given: bool, breakpoints):
    """The index-2 mask as a concrete bool (n,) array, and the algebraic mask to use
    (`algebraic`, or the index-2 mask when None). Raises ValueError on bad input.
    (`init="ya_ydp"` or no yp0 ask for `project`.)"""
    m = _concrete(index2)
    if m is None:
        raise ValueError("daeadjoint: `index2` must be a concrete bool mask (not traced): "
                         "it fixes which equations are index-2 constraints.")
    if m.shape != (n,) or m.dtype != np.bool_:
        raise ValueError(f"daeadjoint: `index2` must be a bool array of shape ({n},) like "
                         f"y0, got dtype {m.dtype} and shape {m.shape}.")
    if init == "y":
        raise ValueError(
            "daeadjoint: init='y' (all of y0 from yp0) is for index ≤ 1; with `index2` "
            "give consistent y0 and yp0 (init=None), or init='ya_ydp' to project them.")
    if (init is not None or not yp0_given) and n > DENSE_CHECK_MAX_N:
        raise ValueError(
            f"daeadjoint: the projection of index-2 initial values (init='ya_ydp' or "
            f"yp0=None with `index2`) forms dense matrices, up to {DENSE_CHECK_MAX_N} "
            f"unknowns (here {n}): give consistent y0 and yp0 with init=None.")
    if breakpoints is not None:
        raise ValueError("daeadjoint: `breakpoints` with `index2` are not yet supported "
                         "(the restart at a breakpoint computes index-1 consistent values).")
    if algebraic is None:
        return m, jnp.asarray(m)
    a = _concrete(algebraic)
    if a is not None:
        a = np.broadcast_to(a, (n,)).astype(bool)
        outside = np.flatnonzero(m & ~a)
        if outside.size:
            raise ValueError(
                f"daeadjoint: index2[{outside[0]}] is True but algebraic[{outside[0]}] is "
                "False: an index-2 variable is algebraic (F does not depend on its y'); "
                "mark it in `algebraic` too, or leave `algebraic=None`.")
    return m, algebraic


@eqx.filter_jit
def _violations(residual, t0, t1, y0, yp0, args, rows, algebraic, rtol, atol):
    """(kind, position in `rows`, value) of the first failed check; kind OK when none."""
    n = y0.shape[0]
    r = 1.0 + jnp.mod(jnp.arange(n, dtype=y0.dtype) * 0.6180339887498949, 1.0)
    f = lambda t, y, yp: residual(t, y, yp, args)[rows]   # noqa: E731
    # Structure, by probes with distinct positive weights (a row vanishes only if all
    # its entries do, barring exact cancellation): no y', no algebraic variable.
    _, dyp = jax.jvp(lambda yp: f(t0, y0, yp), (yp0,), (r,))
    _, dya = jax.jvp(lambda y: f(t0, y, yp0), (y0,), (jnp.where(algebraic, r, 0.0),))
    g, vjp = jax.vjp(lambda y: f(t0, y, yp0), y0)
    grads = jax.vmap(lambda e: vjp(e)[0])(jnp.eye(rows.shape[0], dtype=y0.dtype))
    _, gdot = jax.jvp(lambda t, y: f(t, y, yp0), (t0, y0), (jnp.ones_like(t0), yp0))
    tol_y = jnp.abs(grads) @ (rtol * jnp.abs(y0) + atol)
    tol_yp = jnp.abs(grads) @ (rtol * jnp.abs(yp0) + atol / (t1 - t0))
    nonzero = lambda v: jnp.isfinite(v) & (v != 0)   # noqa: E731
    checks = [(DEPENDS_ON_YP, nonzero(dyp), dyp), (DEPENDS_ON_ALGEBRAIC, nonzero(dya), dya),
              (NO_DEPENDENCE, jnp.all(grads == 0, axis=1), g)]
    if n <= DENSE_CHECK_MAX_N:
        checks.append((NOT_INDEX2, _reduced_singular(residual, t0, y0, yp0, args, rows,
                                                     algebraic)[None], g[:1]))
    checks += [(VIOLATED, ~(jnp.abs(g) <= tol_y), g),
               (HIDDEN_VIOLATED, ~(jnp.abs(gdot) <= tol_yp), gdot)]
    kind, pos, value = jnp.int32(OK), jnp.int32(0), jnp.zeros((), y0.dtype)
    for k, bad, v in reversed(checks):   # the first kind in `checks` wins
        i = jnp.argmax(bad)
        hit = jnp.any(bad)
        kind = jnp.where(hit, k, kind)
        pos = jnp.where(hit, i, pos)
        value = jnp.where(hit, v[i], value)
    return kind, pos, value


def _reduced_singular(residual, t0, y0, yp0, args, rows, algebraic):
    """Whether the index-reduced system is singular at t0: the constraints replaced by
    their time derivatives dF_c/dt = ∂F_c/∂t + ∂F_c/∂y·y', as equations for the
    differential variables' y' and the algebraic variables' y (the matrix of
    `init="ya_ydp"` for it). Nonsingular is what makes the DAE index 2 (for
    x' = f(t, x, z), 0 = g(t, x): g_x f_z nonsingular); singular means a higher index
    (e.g. a position-level constraint of a mechanical system, index 3) or dependent
    constraints. Test: `DenseLU`'s on the equilibrated pivots."""
    from ._linalg.linear_solver import factor, factored_is_singular

    def reduced(u):
        y = jnp.where(algebraic, u, y0)
        yp = jnp.where(algebraic, yp0, u)
        f = residual(t0, y, yp, args)
        _, gdot = jax.jvp(lambda t, y_: residual(t, y_, yp, args)[rows], (t0, y),
                          (jnp.ones_like(t0), yp))
        return f.at[rows].set(gdot)

    u0 = jnp.where(algebraic, y0, yp0)
    return factored_is_singular(factor(jax.jacfwd(reduced)(u0)))


def _message(kind: int, i: int, value=None) -> str:
    val = "" if value is None else f" = {value:.3g}"
    where = (f"equation {i} (marked index-2: index2[{i}] is True, and the index-2 "
             "constraints are the equations at the index-2 variables' indices)")
    if kind == DEPENDS_ON_YP:
        return (f"daeadjoint: {where} depends on y': a Hessenberg index-2 constraint "
                "0 = g(t, y) has no y'. Order the equations so that the constraints sit "
                "at the indices of the index-2 variables.")
    if kind == DEPENDS_ON_ALGEBRAIC:
        return (f"daeadjoint: {where} depends on an algebraic variable: a Hessenberg "
                "index-2 constraint depends on the differential variables only (one that "
                "can be solved for an algebraic variable is index 1: do not mark it).")
    if kind == NOT_INDEX2:
        return ("daeadjoint: the DAE declared with `index2` is not index 2 at t0: with the "
                "marked constraints replaced by their time derivatives, the equations do "
                "not determine y' of the differential variables and the algebraic "
                "variables (for x' = f(x, z), 0 = g(x): g_x f_z is singular). A "
                "position-level constraint of a mechanical system is index 3: write its "
                "velocity constraint instead (index 2), or the stabilized (GGL) form.")
    if kind == NO_DEPENDENCE:
        return f"daeadjoint: {where} depends on no variable at t0."
    if kind == VIOLATED:
        return (f"daeadjoint: the initial values violate the index-2 constraint "
                f"{where}: F_{i}(t0, y0, yp0){val}, beyond the tolerances. Give y0 on the "
                "constraint (init= cannot compute index-2 initial values).")
    return (f"daeadjoint: the initial values violate the hidden constraint of {where}, "
            f"its time derivative dF_{i}/dt = ∂F_{i}/∂t + ∂F_{i}/∂y·yp0{val}, beyond the "
            "tolerances: yp0 must satisfy it too (for a velocity constraint of a "
            "mechanical system: the accelerations).")


def index2_check(residual, t0, t1, y0, yp0, args, index2: np.ndarray, algebraic, rtol, atol):
    """Raise a clear error if the marked equations are not Hessenberg index-2
    constraints at t0 or if (y0, y'0) violates one of them or its hidden constraint.
    Returns y0 (with the check attached under `jit`: `equinox.branched_error_if`)."""
    rows_np = np.flatnonzero(index2)
    if rows_np.size == 0:
        return y0
    rows = jnp.asarray(rows_np)
    kind, pos, value = _violations(residual, t0, t1, y0, yp0, args, rows,
                                   jnp.asarray(algebraic, bool), rtol,
                                   jnp.broadcast_to(atol, y0.shape))
    k, p, v = _concrete(kind), _concrete(pos), _concrete(value)
    if k is not None and p is not None and v is not None and np.ndim(k) == 0:
        if int(k) != OK:
            raise ValueError(_message(int(k), int(rows_np[int(p)]), float(v)))
        return y0
    msgs = [_message(kk, int(i)) for kk in range(1, KINDS + 1) for i in rows_np]
    index = (jnp.maximum(kind, 1) - 1) * rows_np.size + pos
    return eqx.branched_error_if(y0, kind != OK, index, msgs)


# Iterations of each projection stage: Newton's method for stage 2 (quadratic); stage 1
# converges linearly at a rate of the constraint's curvature times the change, small
# for the changes within a few tolerances it is meant for.
PROJECTION_ITERS = 10


@eqx.filter_jit
def _project(residual, t0, y0, yp0, args, rows, algebraic, rtol, atol):
    """The two stages of `project`."""
    differential = ~algebraic
    g = lambda y: residual(t0, y, yp0, args)[rows]   # noqa: E731
    # 1. y0's differential part onto g(t0, x) = 0, the least change in the error
    #    weights' norm: the optimality conditions y = y0 − D G(y)ᵀ μ, g(y) = 0
    #    (D = diag(1/W)², G = g_y) by linearizing g at the iterate and keeping y0 as the
    #    anchor: (G D Gᵀ) μ = g(y_k) + G (y0 − y_k), y_{k+1} = y0 − D Gᵀ μ.
    dscale = jnp.where(differential, rtol * jnp.abs(y0) + atol, 0.0) ** 2

    def onto_constraint(_, y):
        gy = jax.jacrev(g)(y)
        mu = jnp.linalg.solve((gy * dscale) @ gy.T, g(y) + gy @ (y0 - y))
        return y0 - dscale * (gy.T @ mu)

    y = jax.lax.fori_loop(0, PROJECTION_ITERS, onto_constraint, y0)

    # 2. With that x fixed, the index-reduced system (constraints replaced by their
    #    hidden constraints) for y' of the differential variables and the algebraic
    #    variables, by Newton's method.
    def split(u):
        return jnp.where(algebraic, u, y), jnp.where(algebraic, yp0, u)

    def reduced(u):
        y_, yp_ = split(u)
        f = residual(t0, y_, yp_, args)
        _, gdot = jax.jvp(lambda t, v: residual(t, v, yp_, args)[rows], (t0, y_),
                          (jnp.ones_like(t0), yp_))
        return f.at[rows].set(gdot)

    def newton(_, u):
        return u - jnp.linalg.solve(jax.jacfwd(reduced)(u), reduced(u))

    u = jax.lax.fori_loop(0, PROJECTION_ITERS, newton, jnp.where(algebraic, y, yp0))
    y_new, yp_new = split(u)
    return y_new, jnp.where(algebraic, 0.0, yp_new)


def project(residual, t0, y0, yp0, args, index2: np.ndarray, algebraic, rtol, atol):
    """Consistent (y0, y'0) for a Hessenberg index-2 DAE from a guess: y0's
    differential part moved the least (in the error weights' norm) onto the index-2
    constraints, then y' of the differential variables and the algebraic variables
    (index 1 and 2) solved from the other equations and the hidden constraints, y0's
    differential part held. y' of the algebraic variables is set to 0 (F does not
    depend on it). `index2_check` then verifies the result."""
    rows = jnp.asarray(np.flatnonzero(index2))
    return _project(residual, t0, y0, yp0, args, rows, jnp.asarray(algebraic, bool), rtol,
                    jnp.broadcast_to(atol, y0.shape))


# ------------------------------------------------- consistent initial sensitivities


def hidden_residual(residual, rows: tuple):
    """R(t, y, y', args): F with each index-2 constraint (the equations `rows`) replaced
    by its hidden constraint dF_i/dt = ∂F_i/∂t + ∂F_i/∂y·y' (one `jax.jvp`). For
    x' = f(t, x, z), 0 = g(t, x), its consistency matrix for the unknowns (x', z) is
    [[I, −f_z], [g_x, 0]] (with any index-1 rows beside): nonsingular exactly when
    g_x f_z is — the index-reduced system of `project` (stage 2)."""
    idx = jnp.asarray(rows)

    def R(t, y, yp, args):
        f = residual(t, y, yp, args)
        _, gdot = jax.jvp(lambda t_, y_: residual(t_, y_, yp, args)[idx], (t, y),
                          (jnp.ones_like(t), yp))
        return f.at[idx].set(gdot)

    return R


def index2_slopes(residual, rows: tuple, algebraic, t, y, yp, args):
    """y' at (t, y, y') with the index-2 variables' slopes replaced by the consistent ones.

    The BDF interpolant's slope of an index-2 variable is not error-controlled (the
    variable is out of the error test) and is an order less accurate than the variable
    itself; at an event it multiplies the event time's derivative (dy(t*)/dp = s(t*) +
    y'(t*) dt*/dp), so its error goes straight into the event state's derivative.
    Along the solution R(t, y, y') = 0 holds for the hidden-constraint form R
    (`hidden_residual`), so with the unknowns u = (x' on differential, z on algebraic
    components) its time derivative gives R_u u̇ = −(R_t + R_x x'): the algebraic rows of
    u̇ are the consistent z' (R_u is the consistency matrix of `project`, nonsingular for
    Hessenberg index 2). Dense (n × n): called once per recorded event root."""
    alg = jnp.asarray(algebraic, bool)
    R = hidden_residual(residual, rows)

    def of_u(u):
        return R(t, jnp.where(alg, u, y), jnp.where(alg, yp, u), args)

    matrix = jax.jacfwd(of_u)(jnp.where(alg, y, yp))
    _, drift = jax.jvp(lambda t_, y_: R(t_, y_, yp, args), (t, y),
                       (jnp.ones_like(t), jnp.where(alg, 0.0, yp)))
    u_dot = jnp.linalg.solve(matrix, -drift)
    index2 = jnp.zeros(y.shape, bool).at[jnp.asarray(rows)].set(True)
    return jnp.where(index2, u_dot, yp)


def onto_linearized_constraints(f_lin, rows: tuple, s, args_dot, y0, algebraic, rtol, atol):
    """The differential parts `s` (k, n) of k initial sensitivities moved onto the
    linearized index-2 constraints g_x s + g_p ṗ = 0 — the least change in the error
    weights' norm, the linearization of `project`'s stage 1 at a consistent point:

        s ← s − D Gᵀ (G D Gᵀ)⁻¹ (G s + g_p ṗ),    D = diag(differential) W⁻²,
        W⁻¹ = rtol |y0| + atol, G = g_x,

    so that a derivative with respect to y0 (with `init=None`) is the derivative of the
    solve from the projected y0 (`init="ya_ydp"`) and a parameter in g moves x(t0) with
    it. A direction already on the linearized constraints is left as it is (the map is
    a projection). `f_lin(s, s', ṗ)`: the residual's linearization at (t0, y0, y'0),
    whose rows `rows` are G s + g_p ṗ (a Hessenberg constraint has no y'); `args_dot`:
    the k directions' ṗ (leading axis k)."""
    idx = jnp.asarray(rows)
    zero = jnp.zeros_like(y0)
    c = jax.vmap(lambda s_, a: f_lin(s_, zero, a)[idx])(s, args_dot)
    zero_a = jax.tree_util.tree_map(lambda x: jnp.zeros_like(x[0]), args_dot)
    lin_y = lambda v: f_lin(v, zero, zero_a)[idx]   # noqa: E731
    # G (m, n) by m vector–Jacobian products of the constraint rows (G is linear in v).
    _, vjp = jax.vjp(lin_y, zero)
    G = jax.vmap(lambda e: vjp(e)[0])(jnp.eye(len(rows), dtype=y0.dtype))
    d = jax.lax.stop_gradient(jnp.where(algebraic, 0.0, rtol * jnp.abs(y0) + atol) ** 2)
    mu = jnp.linalg.solve((G * d) @ G.T, c.T).T          # (k, m)
    return s - (mu @ G) * d
