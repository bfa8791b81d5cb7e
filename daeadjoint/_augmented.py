r"""The DAE together with one forward-sensitivity direction, as a DAE in its own right.

Derivatives of derivatives (Hessians, `jvp` of `grad`, `jacfwd` of `jacfwd`) need the
derivative of the sensitivity map x ↦ s(x) = (∂y/∂x) ẋ. It is the solution of

    G((y, s), (y', s'), (args, ṗ)) = [ F(t, y, y', args)
                                       F_y s + F_y' s' + F_p ṗ ] = 0,            (G)

a DAE of size 2n (IDAS manual eq. (6.11) appended to (6.2)), which `solve`'s own machinery
can integrate — with its own error control — and differentiate again: forward over it
gives second-order forward sensitivities, reverse over it the second-order adjoint
(IDAS manual §6.2.8, "forward over adjoint"; here for index-1 DAEs, with the consistent
final conditions of the adjoint of (G)).

The iteration matrix of (G) is block lower triangular, [[J, 0], [B, J]] with
J = F_y + cj F_y' and B the derivative of the second block with respect to y.
`AugmentedSolver` solves with it through the user's linear solver for J (two solves) and
B·v from the current-iterate operator, so the structure (banded, sparse, matrix-free) of
J carries over and nothing of size (2n)² is formed.
"""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp

from ._linear_solver import AbstractLinearSolver


def augmented_residual(residual: Callable, n: int) -> Callable:
    """(G): `(t, Y, Y', (args, ṗ)) ↦ [F; F_y s + F_y' s' + F_p ṗ]` with Y = (y, s)."""

    def G(t, Y, Yp, args_aug):
        args, pdot = args_aug
        dyn, static = eqx.partition(args, eqx.is_inexact_array)

        def f(y, yp, d):
            return residual(t, y, yp, eqx.combine(d, static))

        val, tan = jax.jvp(f, (Y[:n], Yp[:n], dyn), (Y[n:], Yp[n:], pdot))
        return jnp.concatenate([val, tan])

    return G


def augmented_quadrature(quadrature: Callable | None, n: int) -> Callable | None:
    """[q; q_y s + q_y' s' + q_p ṗ] (IDAS manual §6.2.6.4)."""
    if quadrature is None:
        return None

    def Q(t, Y, Yp, args_aug):
        args, pdot = args_aug
        dyn, static = eqx.partition(args, eqx.is_inexact_array)

        def q(y, yp, d):
            return jnp.asarray(quadrature(t, y, yp, eqx.combine(d, static)), Y.dtype)

        val, tan = jax.jvp(q, (Y[:n], Yp[:n], dyn), (Y[n:], Yp[n:], pdot))
        return jnp.concatenate([val, tan])

    return Q


class AugmentedSolver(AbstractLinearSolver):
    """Block lower triangular solves for (G) (and for its consistency matrices, which
    have the same structure) with the inner solver for the diagonal blocks:

        J x₁ = r₁,  J x₂ = r₂ − B x₁;      transposed:  Jᵀ x₂ = r₂,  Jᵀ x₁ = r₁ − Bᵀ x₂,

    where B x₁ (Bᵀ x₂) is the second half of the operator applied to (x₁, 0) (the first
    half of its transpose applied to (0, x₂)). The diagonal block is set up from the
    first half of whatever residual `setup` receives — that half does not depend on s.
    """

    inner: AbstractLinearSolver
    n: int = eqx.field(static=True)
    # The solver of (G)'s iteration matrix gets (G)'s args (args, ṗ) and sets `inner`
    # up with F's args, which a user Jacobian or preconditioner expects; the auxiliary
    # solvers get whatever args their caller's residual takes and pass them on.
    split_args: bool = eqx.field(static=True, default=True)

    @property
    def matrix_free(self) -> bool:
        return self.inner.matrix_free

    @property
    def needs_operator(self) -> bool:
        return True

    @property
    def stat_names(self) -> tuple:
        return self.inner.stat_names

    def setup(self, residual, t, y, yp, cj, args):
        n = self.n
        s, sp = y[n:], yp[n:]

        def first_half(t_, y_, yp_, args_):
            Y, Yp = jnp.concatenate([y_, s]), jnp.concatenate([yp_, sp])
            return residual(t_, Y, Yp, args_)[:n]

        if not self.split_args:
            return self.inner.setup(first_half, t, y[:n], yp[:n], cj, args)
        args, pdot = args
        return self.inner.setup(lambda t_, y_, yp_, a: first_half(t_, y_, yp_, (a, pdot)),
                                t, y[:n], yp[:n], cj, args)

    def solve(self, state, rhs, *, transpose=False, weights=None, operator=None):
        n = self.n
        zero = jnp.zeros((n,), rhs.dtype)
        w1 = w2 = None
        if weights is not None:
            w1, w2 = weights[:n], weights[n:]
        if not transpose:
            op1 = None if operator is None else (lambda v: operator(jnp.concatenate([v, zero]))[:n])
            x1, st1 = self.inner.solve(state, rhs[:n], weights=w1, operator=op1)
            b_x1 = operator(jnp.concatenate([x1, zero]))[n:]
            x2, st2 = self.inner.solve(state, rhs[n:] - b_x1, weights=w2, operator=op1)
        else:
            op1 = None if operator is None else (lambda v: operator(jnp.concatenate([v, zero]))[:n])
            x2, st2 = self.inner.solve(state, rhs[n:], transpose=True, weights=w2, operator=op1)
            vecmat = jax.linear_transpose(operator, jnp.zeros((2 * n,), rhs.dtype))
            bt_x2 = vecmat(jnp.concatenate([zero, x2]))[0][:n]
            x1, st1 = self.inner.solve(state, rhs[:n] - bt_x2, transpose=True, weights=w1,
                                       operator=op1)
        stats = {k: st1[k] + st2[k] for k in st1}
        return jnp.concatenate([x1, x2]), stats

    def solve_failed(self, stats):
        return self.inner.solve_failed(stats)

    def is_singular(self, state):
        return self.inner.is_singular(state)

    def auxiliary(self) -> "AugmentedSolver":
        return AugmentedSolver(self.inner.auxiliary(), self.n, split_args=False)
