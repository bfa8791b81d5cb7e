"""The tangents of the differentiable inputs (t0, y0, yp0 and the inexact leaves of args):
which inputs carry one, zeros for the absent parts, and the restriction of a result to
the parts asked for. Shared by the primitives (`autodiff.py`) and the reverse passes
(`adjoint.py`, `discrete_adjoint.py`); the `Tangents` container itself is `_core`'s."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._core import Inputs, Tangents

# ------------------------------------------------------------------------- utilities


def _is_symbolic_zero(x) -> bool:
    return isinstance(x, jax.custom_derivatives.SymbolicZero)


def _zero_tangent(x):
    if jnp.issubdtype(jnp.result_type(x), jnp.inexact):
        return jnp.zeros_like(x)
    return np.zeros(jnp.shape(x), dtype=jax.dtypes.float0)


def _differentiable_part(inputs: Inputs):
    """(t0, y0, yp0, inexact leaves of args) — what derivatives are taken with respect to."""
    return (inputs.t0, inputs.y0, inputs.yp0, eqx.filter(inputs.args, eqx.is_inexact_array))


def _with_differentiable(inputs: Inputs, xd) -> Inputs:
    t0, y0, yp0, dyn = xd
    static = eqx.filter(inputs.args, eqx.is_inexact_array, inverse=True)
    return dataclasses.replace(inputs, t0=t0, y0=y0, yp0=yp0, args=eqx.combine(dyn, static))


_NON_DIFF_NAMES = {
    "t1": "t1 (its effect on the outputs, through the default saveat = [t1], is "
          "differentiated outside the core)",
    "saveat": "saveat", "rtol": "rtol", "atol": "atol", "quad_rtol": "quad_rtol",
    "quad_atol": "quad_atol", "tstop": "tstop",
}


def input_tangents(inputs: Inputs, tangents) -> Tangents | None:
    """Tangents of the differentiable inputs from a pytree like `inputs` (None or
    SymbolicZero leaves for zero tangents); a clear error for a tangent on anything that
    cannot be differentiated. None when no input has a tangent."""

    def present(x):
        return x is not None and not _is_symbolic_zero(x)

    def nonzero_float(x):
        return present(x) and getattr(x, "dtype", None) != jax.dtypes.float0

    for name in _NON_DIFF_NAMES:
        leaves = jax.tree_util.tree_leaves(getattr(tangents, name), is_leaf=_is_symbolic_zero)
        if any(nonzero_float(x) for x in leaves):
            raise ValueError(
                f"daeadjoint: `solve` is not differentiable with respect to "
                f"{_NON_DIFF_NAMES[name]}: the continuous solution does not depend on it. "
                "Wrap it in jax.lax.stop_gradient, or differentiate with respect to the "
                "problem's data (args, y0, yp0, t0, t1, saveat) only.")
    t0 = tangents.t0 if present(tangents.t0) else None
    y0 = tangents.y0 if present(tangents.y0) else None
    yp0 = tangents.yp0 if present(tangents.yp0) else None
    leaves_p, tree = jax.tree_util.tree_flatten(eqx.filter(inputs.args, eqx.is_inexact_array))
    leaves_t = _match_args_tangents(inputs.args, tangents.args)
    args = None
    if any(present(t) for t in leaves_t):
        args = jax.tree_util.tree_unflatten(
            tree, [t if present(t) else jnp.zeros_like(p) for p, t in zip(leaves_p, leaves_t)])
    if t0 is None and y0 is None and yp0 is None and args is None:
        return None
    return Tangents(t0=t0, y0=y0, yp0=yp0, args=args)


def _match_args_tangents(args, args_tangents):
    """The tangents of the inexact-array leaves of `args`, in the order of
    `jax.tree_util.tree_leaves(eqx.filter(args, eqx.is_inexact_array))` (None where the
    tangent is absent)."""
    flat_p = jax.tree_util.tree_leaves(args, is_leaf=lambda x: x is None)
    flat_t = jax.tree_util.tree_leaves(args_tangents, is_leaf=lambda x: x is None or _is_symbolic_zero(x))
    if len(flat_p) != len(flat_t):   # tangents of non-array leaves were dropped
        flat_t = flat_t + [None] * (len(flat_p) - len(flat_t))
    return [t for p, t in zip(flat_p, flat_t) if eqx.is_inexact_array(p)]


def _is_inexact(x) -> bool:
    """An inexact array, also as an abstract value (inside abstract evaluation)."""
    if isinstance(x, jax.core.ShapedArray):
        return jnp.issubdtype(x.dtype, jnp.inexact)
    return eqx.is_inexact_array(x)


def _full(inputs: Inputs, t: Tangents | None, lead=()) -> Tangents:
    """`t` with zeros for every absent part (for the augmented system)."""
    t = Tangents() if t is None else t
    dyn = eqx.filter(inputs.args, _is_inexact)
    z = lambda x: jnp.zeros(lead + jnp.shape(x), jnp.result_type(x))  # noqa: E731
    # Absent parts may be a whole field or single leaves of args (a symbolic zero).
    args = (jax.tree_util.tree_map(z, dyn) if t.args is None else
            jax.tree_util.tree_map(lambda p, d: z(p) if d is None else d, dyn, t.args))
    return Tangents(
        t0=z(inputs.t0) if t.t0 is None else t.t0,
        y0=z(inputs.y0) if t.y0 is None else t.y0,
        yp0=z(inputs.yp0) if t.yp0 is None else t.yp0,
        args=args)


def _nones_like(x):
    """A pytree like x with None at every leaf (no cotangent)."""
    return jax.tree_util.tree_map(lambda _: None, x)


def _restrict(t: Tangents, wanted: Tangents) -> Tangents:
    return Tangents(**{f: (getattr(t, f) if getattr(wanted, f) is not None else None)
                       for f in ("t0", "y0", "yp0", "args")})


def _wanted(t: Tangents) -> Tangents:
    """A static marker of which parts of a Tangents are present."""
    return Tangents(**{f: (True if getattr(t, f) is not None else None)
                       for f in ("t0", "y0", "yp0", "args")})


def reverse_tangents_at_t0(config, inputs: Inputs, split, state_bar, y0, yp0, w, pbar,
                           unravel, pd, p_events, *, y0_bar, yp0_bar) -> Tangents:
    """The tail both reverse passes (`adjoint.py`, `discrete_adjoint.py`) share: from
    the cotangents at t0, those of every differentiable input, for k directions (rows).

    Moving t0 with the given initial values fixed shifts the trajectory by −δt0 y'(t0)
    and drops q(t0) δt0 from the quadratures ∫_{t0} q: t̄0 = −(P_d s̄)·y'(t0) − w·q(t0),
    with s̄ the cotangent on the state at t0 (`state_bar`), P_d its differential part
    (`split.diff_t`) and w the quadratures' total cotangent. The flat parameter
    cotangent `pbar` (k, npar) goes back into the args' pytree (`unravel`; zeros shaped
    like `pd` when nothing is differentiable), plus the events' direct cotangent
    `p_events`. `y0_bar`, `yp0_bar`: the initial values' cotangents after the `init`
    semantics (DESIGN §1)."""
    t0bar = -(split.diff_t(state_bar) @ yp0)
    if config.quadrature is not None:
        t0bar = t0bar - w @ config.quadrature(inputs.t0, y0, yp0, inputs.args)
    k, npar = pbar.shape
    args_bar = jax.vmap(unravel)(pbar) if npar else jax.tree_util.tree_map(
        lambda x: jnp.zeros((k,) + x.shape, x.dtype), pd)
    if p_events is not None:
        args_bar = jax.tree_util.tree_map(jnp.add, args_bar, p_events)
    return Tangents(t0=t0bar, y0=y0_bar, yp0=yp0_bar, args=args_bar)
