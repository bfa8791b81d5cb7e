"""Benchmark problems, each defined once and handed to every solver in its own form.

Problems
--------
robertson
    SUNDIALS ``idasRoberts_dns``. y = (y1, y2, y3), y3 algebraic:
        F1 = y1' + p1 y1 - p2 y2 y3
        F2 = y2' - p1 y1 + p2 y2 y3 + p3 y2^2
        F3 = y1 + y2 + y3 - 1
    p = (0.04, 1e4, 3e7), y0 = (1, 0, 0), yp0 consistent (= (-p1, p1, 0)),
    t in [0, 4e10], output at 0.4 * 10^k, k = 0..11.
    Tolerances (shared by ALL solvers): rtol = 1e-6, atol = (1e-10, 1e-14, 1e-8).
    (The IDAS example itself uses rtol 1e-4, atol (1e-8, 1e-14, 1e-6); we tighten
    rtol to 1e-6 and keep the per-component scaling: y2 is O(1e-5) and decays to
    O(1e-13), hence its tiny atol.)
    ODE form (diffrax): y3 = 1 - y1 - y2 eliminated, 2 states.
    Batch: p1 scaled by 10**linspace(-0.5, 0.5, n).

heat
    SUNDIALS ``idasHeat2D`` generalised: u_t = k (u_xx + u_yy) on the unit square,
    M x M grid (default M = 12 -> 144 unknowns, spacing 1/(M-1)), boundary nodes
    algebraic (F = u), interior F = u' - k * (5-point Laplacian of u).
    u0 = 16 x(1-x) y(1-y) inside, 0 on the boundary; yp0 consistent
    (= k * Laplacian(u0) inside, 0 on the boundary).
    t in [0, 10.24], output at 0.01 * 2^k, k = 0..10. rtol = 1e-6, atol = 1e-8.
    args = (k,), default k = 1. ODE form (diffrax): interior nodes only.
    Batch: k in linspace(0.5, 2, n).

How "defined once" works
------------------------
Every problem is a semi-explicit index-1 DAE  x' = f(t, x, z, p), 0 = g(t, x, z, p)
with x = y[diff_idx], z = y[alg_idx].  ``Problem.model`` computes (f, g) using only
indexing, arithmetic and the two operations of a small ``Backend`` (stack scalars,
sparse-matrix times vector), so the same function yields numpy values
(scikit-sundae), jnp values (daeadjoint, diffrax) and casadi SX expressions
(IDAS).  The fully implicit residual is F[diff] = y'[diff] - f, F[alg] = g.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import scipy.sparse as sp

try:
    import casadi as ca
except ImportError:  # a machine with only some of the peers installed (an accelerator's)
    ca = None

jax.config.update("jax_enable_x64", True)


# --------------------------------------------------------------------------- backends
@dataclasses.dataclass(frozen=True)
class Backend:
    """The few array operations a model may use, for one array library."""

    name: str
    stack: Callable[[list], Any]  # list of scalars -> vector
    matvec: Callable[[Any, Any], Any]  # (converted matrix, vector) -> vector
    convert: Callable[[sp.spmatrix], Any]  # scipy sparse constant -> backend matrix
    xp: Any = None  # numpy-like module (None for casadi)


NUMPY = Backend("numpy", np.stack, lambda A, v: A @ v, lambda S: S.tocsr(), np)
JAX = Backend("jax", jnp.stack, lambda A, v: A @ v, lambda S: jnp.asarray(S.toarray()), jnp)
CASADI = Backend("casadi", lambda xs: ca.vertcat(*xs), lambda A, v: ca.mtimes(A, v),
                 lambda S: ca.DM(S.tocsc()))


# --------------------------------------------------------------------------- problem
@dataclasses.dataclass(frozen=True, eq=False)
class Problem:
    """A semi-explicit index-1 DAE plus everything a benchmark run needs."""

    name: str
    model: Callable  # (t, x, z, p, be, C) -> (f, g)
    solve_alg: Callable  # (x, p, be, C) -> z with g(x, z) = 0  (ODE form only)
    diff_idx: np.ndarray
    alg_idx: np.ndarray
    y0: np.ndarray
    args: np.ndarray  # nominal parameter vector
    batch_args: Callable[[int], np.ndarray]  # n -> (n, len(args))
    t0: float
    ts: np.ndarray  # output times; ts[-1] = t1
    rtol: float
    atol: np.ndarray  # per component of y
    consts: dict = dataclasses.field(default_factory=dict)  # scipy sparse constants
    bandwidth: int | None = None  # Jacobian half-bandwidth, for banded linear solvers

    @property
    def n(self) -> int:
        return len(self.y0)

    @property
    def t1(self) -> float:
        return float(self.ts[-1])

    @property
    def ts_with_t0(self) -> np.ndarray:
        return np.concatenate([[self.t0], self.ts])

    @property
    def algebraic(self) -> np.ndarray:
        """Boolean mask, True for algebraic components of y."""
        mask = np.zeros(self.n, bool)
        mask[self.alg_idx] = True
        return mask

    def constants(self, be: Backend) -> dict:
        return {k: be.convert(v) for k, v in self.consts.items()}

    def assemble(self, a, b, xp):
        """Full vector from its differential part ``a`` and algebraic part ``b``."""
        inv = np.argsort(np.concatenate([self.diff_idx, self.alg_idx]))
        return xp.concatenate([a, b])[inv]

    def yp0(self, args, be: Backend = NUMPY):
        """Consistent initial derivative: f(t0, x0, z0) and 0 for algebraic parts."""
        x0, z0 = self.y0[self.diff_idx], self.y0[self.alg_idx]
        x0, z0 = be.xp.asarray(x0), be.xp.asarray(z0)
        f, _ = self.model(self.t0, x0, z0, args, be, self.constants(be))
        return self.assemble(f, be.xp.zeros(len(self.alg_idx)), be.xp)


# --------------------------------------------------------------------------- forms per peer
def jax_residual(prob: Problem) -> Callable:
    """F(t, y, yp, args) as a jnp function (daeadjoint)."""
    C = prob.constants(JAX)

    def residual(t, y, yp, args):
        f, g = prob.model(t, y[prob.diff_idx], y[prob.alg_idx], args, JAX, C)
        return prob.assemble(yp[prob.diff_idx] - f, g, jnp)

    return residual


def numpy_residual(prob: Problem) -> Callable:
    """resfn(t, y, yp, res, args) filling ``res`` in place (scikit-sundae, userdata=args)."""
    C = prob.constants(NUMPY)

    def resfn(t, y, yp, res, args):
        f, g = prob.model(t, y[prob.diff_idx], y[prob.alg_idx], args, NUMPY, C)
        res[prob.diff_idx] = yp[prob.diff_idx] - f
        res[prob.alg_idx] = g

    return resfn


def casadi_dae(prob: Problem) -> dict:
    """Semi-explicit DAE dict {x, z, p, ode, alg} of casadi SX (casadi IDAS)."""
    x = ca.SX.sym("x", len(prob.diff_idx))
    z = ca.SX.sym("z", len(prob.alg_idx))
    p = ca.SX.sym("p", len(prob.args))
    f, g = prob.model(0.0, x, z, p, CASADI, prob.constants(CASADI))
    return dict(x=x, z=z, p=p, ode=f, alg=g)


def jax_ode(prob: Problem) -> tuple[Callable, Callable]:
    """(vector_field(t, x, args), to_full(x, args)) for the ODE form (diffrax).

    Algebraic variables are eliminated with ``prob.solve_alg``; ``to_full`` rebuilds y.
    """
    C = prob.constants(JAX)

    def vector_field(t, x, args):
        z = prob.solve_alg(x, args, JAX, C)
        return prob.model(t, x, z, args, JAX, C)[0]

    def to_full(x, args):
        return prob.assemble(x, prob.solve_alg(x, args, JAX, C), jnp)

    return vector_field, to_full


# --------------------------------------------------------------------------- Robertson
def _robertson_model(t, x, z, p, be, C):
    y1, y2, y3 = x[0], x[1], z[0]
    r1, r2, r3 = p[0] * y1, p[1] * y2 * y3, p[2] * y2 * y2
    return be.stack([-r1 + r2, r1 - r2 - r3]), be.stack([y1 + y2 + y3 - 1.0])


def _robertson_solve_alg(x, p, be, C):
    return be.stack([1.0 - x[0] - x[1]])


def robertson() -> Problem:
    """Robertson kinetics as an index-1 DAE (SUNDIALS idasRoberts_dns)."""
    args = np.array([0.04, 1e4, 3e7])

    def batch_args(n):
        out = np.tile(args, (n, 1))
        out[:, 0] *= 10.0 ** np.linspace(-0.5, 0.5, n)
        return out

    return Problem(
        name="robertson",
        model=_robertson_model,
        solve_alg=_robertson_solve_alg,
        diff_idx=np.array([0, 1]),
        alg_idx=np.array([2]),
        y0=np.array([1.0, 0.0, 0.0]),
        args=args,
        batch_args=batch_args,
        t0=0.0,
        ts=0.4 * 10.0 ** np.arange(12),
        rtol=1e-6,
        atol=np.array([1e-10, 1e-14, 1e-8]),
    )


# --------------------------------------------------------------------------- heat 2D
def _laplacian(M: int) -> sp.csr_matrix:
    """5-point Laplacian on an M x M unit-square grid; rows of boundary nodes are zero."""
    inv_dx2 = (M - 1) ** 2
    L = sp.lil_matrix((M * M, M * M))
    for j in range(1, M - 1):
        for i in range(1, M - 1):
            k = i + j * M  # same node numbering as idasHeat2D
            L[k, k] = -4.0 * inv_dx2
            for nb in (k - 1, k + 1, k - M, k + M):
                L[k, nb] = inv_dx2
    return L.tocsr()


def _heat_model(t, x, z, p, be, C):
    return p[0] * (be.matvec(C["Lx"], x) + be.matvec(C["Lz"], z)), z


def _heat_solve_alg(x, p, be, C):
    return be.xp.zeros(C["Lz"].shape[1], dtype=x.dtype)


def heat(M: int = 12) -> Problem:
    """2-D heat equation, boundary as algebraic u = 0 (SUNDIALS idasHeat2D), M^2 unknowns."""
    g = np.linspace(0.0, 1.0, M)
    X, Y = np.meshgrid(g, g, indexing="xy")  # X[j, i] = g[i]: flat index i + j*M
    boundary = ((X == 0) | (X == 1) | (Y == 0) | (Y == 1)).ravel()
    diff_idx, alg_idx = np.flatnonzero(~boundary), np.flatnonzero(boundary)
    L = _laplacian(M)[diff_idx]
    u0 = np.where(boundary, 0.0, (16 * X * (1 - X) * Y * (1 - Y)).ravel())
    return Problem(
        name=f"heat{M}x{M}",
        model=_heat_model,
        solve_alg=_heat_solve_alg,
        diff_idx=diff_idx,
        alg_idx=alg_idx,
        y0=u0,
        args=np.array([1.0]),
        batch_args=lambda n: np.linspace(0.5, 2.0, n)[:, None],
        t0=0.0,
        ts=0.01 * 2.0 ** np.arange(11),
        rtol=1e-6,
        atol=np.full(M * M, 1e-8),
        consts={"Lx": L[:, diff_idx], "Lz": L[:, alg_idx]},
        bandwidth=M,
    )


PROBLEMS = {"robertson": robertson, "heat": heat}
