"""The direct linear solvers for large DAEs: BandedLU, SparseLU (both backends) and the
default choice, against DenseLU on R1 (Robertson), R5 (2-D heat, small M) and a banded
index-1 reaction–diffusion DAE: solution, reverse-mode gradient (continuous adjoint),
forward mode (jacfwd), vmap; wrong bandwidths/patterns raise; nothing n×n is formed.

Tolerances. Every solver sees the same iteration matrix up to rounding (the coloured
jvps compute the same partial derivatives as `jax.jacfwd`), so the integrations take the
same steps and the results differ by rounding carried through the Newton iterations —
far below the solve's rtol. We compare at the solve's rtol (relative, plus atol·rtol
absolute for components near zero): a wrong matrix (a missed entry, a wrong transpose
in the adjoint) changes the Newton iterates by O(1) relative and the answer by far more
than rtol, or stalls Newton altogether.
"""

import functools
import gc
import os

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

import daeadjoint as dae
from daeadjoint._linalg.jacobian import detect_sparsity

from .problems import ROBERTSON_ALGEBRAIC, ROBERTSON_P, ROBERTSON_Y0, ROBERTSON_YP0, robertson

try:
    import klujax  # noqa: F401
    HAVE_KLU = True
except ImportError:
    HAVE_KLU = False

RTOL = ATOL = 1e-6

SOLVERS = {
    "dense": lambda band: dae.DenseLU(),
    "banded": lambda band: dae.BandedLU(*band),
    "sparse": lambda band: dae.SparseLU(),
    "sparse_jax": lambda band: dae.SparseLU(kernel="jax"),   # the GPU/multi-device kernel
    "klu": lambda band: dae.SparseLU(backend="klu"),
    # Matrix-free GMRES preconditioned by the sparse LU of the iteration matrix (exact at
    # setup, inexact as J drifts between setups; the Newton iteration's own rate test).
    "krylov": lambda band: dae.Krylov(preconditioner=dae.SparseLU()),
}
# The default suite's budget (~10 min on 2 cores): forward mode and vmap through the
# optional KLU backend, and forward mode and vmap through BandedLU (the same band
# kernels and forward-sensitivity code as SparseLU, whose runs stay in the default
# suite), run with --runslow. So does vmap with the pure-JAX band kernel: the default
# suite runs it through whole vmapped solves in test_sharded_batch_with_the_default_solver
# (several devices select it) and on its own in test_band_kernels_against_numpy[jax].
SLOW = pytest.mark.slow
NEW_FAST_FWD = [pytest.param("banded", marks=SLOW), "sparse", pytest.param(
    "klu", marks=[SLOW, pytest.mark.skipif(not HAVE_KLU, reason="klujax not installed")])]
NEW_FAST_VMAP = [pytest.param("banded", marks=SLOW), "sparse", pytest.param("sparse_jax", marks=SLOW), pytest.param(
    "klu", marks=[SLOW, pytest.mark.skipif(not HAVE_KLU, reason="klujax not installed")])]


def close(a, b, rtol=RTOL, atol=RTOL * ATOL):
    """|a − b| ≤ rtol·|b| + atol componentwise (see the module docstring)."""
    a, b = np.asarray(a), np.asarray(b)
    assert np.all(np.abs(a - b) <= rtol * np.abs(b) + atol), np.max(np.abs(a - b))


# ------------------------------------------------------------------ problems


def reaction_diffusion(t, y, yp, p):
    """1-D reaction–diffusion with an algebraic variable per node, unknowns interleaved
    y = (u_0, v_0, u_1, v_1, …) so J is banded with lower = 3 (v_i ← u_{i−1}) and
    upper = 2 (u_i ← u_{i+1}):
        u_i' = D (u_{i−1} − 2u_i + u_{i+1})/dx² − k u_i v_i      (u = 0 outside)
        0    = v_i − u_i / (1 + u_i) − c (u_{i+1} − u_{i−1})      (v algebraic, index 1)
    p = (D, k, c)."""
    u, v = y[0::2], y[1::2]
    dx = 1.0 / (u.shape[0] + 1)
    up = jnp.pad(u, 1)
    lap = (up[:-2] - 2 * u + up[2:]) / dx**2
    fu = yp[0::2] - p[0] * lap + p[1] * u * v
    fv = v - u / (1 + u) - p[2] * (up[2:] - up[:-2])
    return jnp.stack([fu, fv], axis=1).reshape(-1)


N_RD = 20                                   # 40 unknowns
RD_ALGEBRAIC = jnp.tile(jnp.array([False, True]), N_RD)
RD_P = jnp.array([0.05, 1.0, 0.1])
RD_U0 = jnp.sin(jnp.pi * jnp.linspace(0, 1, N_RD + 2)[1:-1])
RD_Y0 = jnp.stack([RD_U0, jnp.zeros(N_RD)], axis=1).reshape(-1)   # v0 found by init
RD_SAVEAT = jnp.array([0.3, 1.0])
RD_BAND = (3, 2)


def solve_rd(p, y0, linear_solver, sensitivity=None):
    return dae.solve(reaction_diffusion, 0.0, 1.0, y0, None, p, saveat=RD_SAVEAT,
                     algebraic=RD_ALGEBRAIC, rtol=RTOL, atol=ATOL,
                     linear_solver=linear_solver, sensitivity=sensitivity)


def objective_rd(p, y0, linear_solver, sensitivity=None):
    """Observations of differential and algebraic components at two times (the adjoint
    jumps there; the algebraic ones through the consistent-jump matrix)."""
    ys = solve_rd(p, y0, linear_solver, sensitivity).ys
    return jnp.sum(ys[:, 1::2] ** 2) + jnp.sum(ys[-1, ::2]), ys


M_HEAT = 6                                  # (M + 2)² = 64 unknowns


def heat(t, u, up, p):
    """R5 (Li & Petzold, DASPKADJOINT, §7.1.1): u_t = p1 u_xx + p2 u_yy, u_t = 0 on the
    boundary, as tests/test_heat_equation_gradient.py at a small M."""
    m = M_HEAT
    dx = 1.0 / (m + 1)
    g = u.reshape(m + 2, m + 2)
    uxx = (g[2:, 1:-1] - 2 * g[1:-1, 1:-1] + g[:-2, 1:-1]) / dx**2
    uyy = (g[1:-1, 2:] - 2 * g[1:-1, 1:-1] + g[1:-1, :-2]) / dx**2
    rhs = jnp.zeros_like(g).at[1:-1, 1:-1].set(p[0] * uxx + p[1] * uyy)
    return up - rhs.reshape(-1)


def heat_u0(m):
    x = np.linspace(0.0, 1.0, m + 2)
    X, Y = np.meshgrid(x, x, indexing="ij")
    return jnp.asarray((16 * X * (1 - X) * Y * (1 - Y)).reshape(-1))


def objective_heat(p, u0, linear_solver, sensitivity=None):
    """R5's g1 = Σu(T)² and g2 = ∫Σu dt together."""
    up0 = -heat(0.0, u0, jnp.zeros_like(u0), p)
    sol = dae.solve(heat, 0.0, 0.16, u0, up0, p, rtol=RTOL, atol=ATOL,
                    linear_solver=linear_solver, sensitivity=sensitivity,
                    quadrature=lambda t, u, up, a: jnp.sum(u)[None])
    return jnp.sum(sol.ys[-1] ** 2) + sol.qs[-1, 0], sol.ys


def objective_robertson(p, y0, linear_solver, sensitivity=None):
    sol = dae.solve(robertson, 0.0, 40.0, y0, ROBERTSON_YP0, p, algebraic=ROBERTSON_ALGEBRAIC,
                    saveat=jnp.array([0.4, 40.0]), rtol=RTOL, atol=1e-10,
                    linear_solver=linear_solver, sensitivity=sensitivity)
    return jnp.sum(sol.ys[:, 2]) + sol.ys[-1, 0], sol.ys


PROBLEMS = {
    # name: (objective, p, y0, (lower, upper) of J)
    "robertson": (objective_robertson, ROBERTSON_P, ROBERTSON_Y0, (2, 2)),
    "heat": (objective_heat, jnp.array([1.0, 1.0]), heat_u0(M_HEAT), (M_HEAT + 2, M_HEAT + 2)),
    "reaction_diffusion": (objective_rd, RD_P, RD_Y0, RD_BAND),
}


# The DenseLU reference gradients are compiled without the adjoint's fallback to the
# discrete adjoint (a branch taken only when the backward integration fails; without it
# such a failure raises, and no reference is produced). It is a quarter of a gradient
# program's compilation (Robertson's gradient: 12.8-13.8 -> 9.7 XLA CPU s,
# docs/performance.md; this file's banded DAE reference: 62.7, 65.4 -> 45.7, 56.5 in
# two interleaved pairs of processes, load 2-5). The solvers under test compile without
# it too: the branch is never taken on these problems, so no assertion here saw its
# numbers, and it was 44% of SparseLU's gradient program on the banded DAE (XLA
# compile 32.3 -> 18.0 s, lowering 8.9 -> 4.9 s; 2026-11-30, load ~4). That the default
# `Adjoint()`'s program (with the fallback, as users compile it) still lowers with each
# solver is checked in test_solution_and_gradient_match_dense (lowered, not compiled:
# the fallback's tracing with the solver, without XLA's ~14 s); the fallback's numbers: tests/test_adjoint.py's
# test_fallback_equals_the_discrete_adjoint_of_the_same_steps and
# test_fallback_in_a_batch_only_where_the_continuous_adjoint_fails.
REFERENCE = dae.Adjoint(fallback=False)


def _value_and_grad_fn(problem, solver, sensitivity):
    objective, _, _, band = PROBLEMS[problem]
    ls = SOLVERS[solver](band)
    return jax.value_and_grad(lambda p, y0: objective(p, y0, ls, sensitivity),
                              argnums=(0, 1), has_aux=True)


@functools.lru_cache(maxsize=None)
def value_and_grad(problem, solver):
    """Compiled once per (problem, solver) and shared by the tests."""
    _, p, y0, _ = PROBLEMS[problem]
    return jax.jit(_value_and_grad_fn(problem, solver, REFERENCE))(p, y0)


# ------------------------------------------------------------------ the same answers


def _match_dense_cases():
    """problem × solver. The default suite runs SparseLU on the banded index-1 DAE
    (unequal bandwidths, algebraic observations: the consistent-jump matrix in the
    adjoint), against a DenseLU reference. Slow (--runslow):
    Robertson (n = 3: the banded/sparse machinery on a dense matrix; three more
    compilations of the whole solve + adjoint); all of R5 heat (a second DenseLU
    reference, ~80 s of compilation on CI): SparseLU keeps R5's pattern in its natural
    ordering (bandwidth 8, no better RCM ordering), so it runs the same steps as on the
    DAE — detection, colouring, the gathers, the band kernel and its transposed solve in
    the adjoint — and R5's quadrature does not involve the linear solver (quadratures
    through the adjoint: tests/test_adjoint.py's R1 and R4 tests); and KLU on
    the DAE (~80 s on CI): KLU's factorization runs by default inside whole solves
    (test_klu_vmap_of_whole_solves_matches_sequential), its solve and transposed solve
    (the adjoint's) with their derivatives against numpy in
    test_klu_solve_primitive_batching_and_derivatives, and SparseLU in the adjoint here;
    and BandedLU on the DAE (~100 s on CI, a third gradient program): SparseLU keeps the
    DAE's pattern in its natural ordering, the (3, 2) band, so its case here runs the
    same band kernel and transposed solve in the adjoint, and BandedLU's own setup (its
    coloured jvps on the bandwidths it is given) is checked against DenseLU by default
    in test_banded_solution_matches_dense."""
    cases = []
    for problem in ("robertson", "heat", "reaction_diffusion"):
        for solver in ("banded", "sparse", "klu"):
            marks = []
            if problem != "reaction_diffusion" or solver != "sparse":
                marks.append(SLOW)
            if solver == "klu":
                marks.append(pytest.mark.skipif(not HAVE_KLU, reason="klujax not installed"))
            cases.append(pytest.param(problem, solver, marks=marks,
                                      id=f"{problem}-{solver}"))
    return cases


@pytest.mark.parametrize(("problem", "solver"), _match_dense_cases())
def test_solution_and_gradient_match_dense(problem, solver):
    """Solution (every saved row) and the adjoint gradient w.r.t. parameters and y0; and
    the default `Adjoint()`'s gradient program (its fallback to the discrete adjoint
    included) lowers with the solver, to the same output shapes: traced to XLA's input,
    not compiled (the backward pass is a primitive traced at lowering, so
    `jax.eval_shape` would not reach it)."""
    _, p, y0, _ = PROBLEMS[problem]
    lowered = jax.jit(_value_and_grad_fn(problem, solver, None)).lower(p, y0)
    out = value_and_grad(problem, solver)
    assert jax.tree_util.tree_structure(lowered.out_info) == jax.tree_util.tree_structure(out)
    assert [(s.shape, s.dtype) for s in jax.tree_util.tree_leaves(lowered.out_info)] == [
        (a.shape, a.dtype) for a in jax.tree_util.tree_leaves(out)]
    (val, ys), (gp, gy0) = out
    (val_d, ys_d), (gp_d, gy0_d) = value_and_grad(problem, "dense")
    close(ys, ys_d)
    close(val, val_d)
    close(gp, gp_d)
    close(gy0, gy0_d)


def test_banded_solution_matches_dense():
    """BandedLU's solve of the banded index-1 DAE (its iteration matrix from coloured
    jvps on the given bandwidths, the band kernel) against DenseLU's: one forward
    program, against the primal solution of the DenseLU reference gradient above (the
    same steps as a plain forward solve), compared as in the module docstring. Its
    gradient runs with --runslow (test_solution_and_gradient_match_dense)."""
    ls = SOLVERS["banded"](RD_BAND)
    ys = jax.jit(lambda p, y0: solve_rd(p, y0, ls).ys)(RD_P, RD_Y0)
    (_, ys_d), _ = value_and_grad("reaction_diffusion", "dense")
    close(ys, ys_d)


@pytest.mark.parametrize("solver", NEW_FAST_FWD)
def test_forward_mode_matches_dense(solver):
    """jax.jacfwd through solve (forward sensitivities, the staggered corrector with the
    same iteration matrix) on the banded index-1 DAE."""
    def jac(name):
        ls = SOLVERS[name](RD_BAND)
        return jax.jit(jax.jacfwd(lambda p: solve_rd(p, RD_Y0, ls).ys))(RD_P)

    close(jac(solver), jac("dense"))


@pytest.mark.parametrize("solver", NEW_FAST_VMAP)
def test_vmap_matches_sequential(solver):
    """A batch of three parameter sets under vmap gives each member's own solve (the
    solvers' state is batched: per-member band factors, per-member KLU values)."""
    ls = SOLVERS[solver](RD_BAND)
    batch = RD_P[None] * jnp.array([[1.0], [1.5], [0.7]])
    fn = jax.jit(lambda p: solve_rd(p, RD_Y0, ls).ys)
    batched = jax.vmap(fn)(batch)
    for i in range(batch.shape[0]):
        close(batched[i], fn(batch[i]))


KLU = pytest.mark.skipif(not HAVE_KLU, reason="klujax not installed")


@KLU
def test_klu_vmap_of_whole_solves_matches_sequential():
    """jit(vmap(solve)) of R5 with KLU, three parameter sets, against each member's own
    solve. On this problem a batched `lax.cond` batches every operand of its branches;
    when those included KLU's pattern arrays, klujax refused them ("Ai cannot be
    vectorized"). Each member takes its own steps inside the batch (per-member step
    sizes, masked updates), so they agree to the rounding of the Newton iterations —
    the suite's rtol comparison (module docstring)."""
    ls = dae.SparseLU(backend="klu")
    u0 = heat_u0(M_HEAT)

    def g(k):
        p = jnp.stack([k, k])
        return dae.solve(heat, 0.0, 0.16, u0, -heat(0.0, u0, jnp.zeros_like(u0), p), p,
                         rtol=RTOL, atol=ATOL, linear_solver=ls).ys[-1]

    ks = jnp.array([0.5, 1.0, 2.0])
    batched = jax.jit(jax.vmap(g))(ks)
    one = jax.jit(g)
    for i in range(ks.shape[0]):
        close(batched[i], one(ks[i]))


def random_band_systems(n, lower, upper, batch, nrhs, seed):
    """`batch` random matrices on the band pattern (diagonal +4: well conditioned), each
    with `nrhs` right-hand sides, and numpy's dense solves of them (J or Jᵀ) — the
    reference of the solve-primitive tests."""
    pattern = dae.Sparsity.banded(n, lower, upper)
    rng = np.random.default_rng(seed)
    values = rng.normal(size=(batch, pattern.nnz))
    values[:, pattern.rows == pattern.cols] += 4.0
    rhs = rng.normal(size=(batch, nrhs, n))

    def dense(v):
        a = np.zeros((n, n))
        a[pattern.rows, pattern.cols] = v
        return a

    def reference(transpose):
        return np.stack([[np.linalg.solve(dense(v).T if transpose else dense(v), b)
                          for b in rs] for v, rs in zip(values, rhs)])

    return pattern, values, rhs, dense, reference


@KLU
def test_klu_solve_primitive_batching_and_derivatives():
    """The KLU solve primitive against numpy's dense solve: J x = b and Jᵀ x = b, a
    batch of matrices each with several right-hand sides (nested vmap), inside a batched
    `lax.cond` (which batches every operand), and its JVP/VJP by finite differences.
    A well-conditioned J (diagonal +4): the solves agree to ~10 ulp, we allow 1e-12."""
    from jax.test_util import check_grads

    from daeadjoint._linalg.klu import klu_solve
    from daeadjoint._linalg.sparse import _plan

    pattern, values, rhs, _, reference = random_band_systems(6, 1, 2, 3, 4, seed=0)
    plan = _plan(pattern, "klu")
    for transpose in (False, True):
        ref = reference(transpose)
        f = functools.partial(klu_solve, plan, transpose=transpose)
        nested = jax.jit(jax.vmap(jax.vmap(f, (None, 0))))(values, rhs)
        np.testing.assert_allclose(nested, ref, rtol=0, atol=1e-12)
        take = jnp.array([True, False, True])
        in_cond = jax.jit(jax.vmap(lambda v, r, c, f=f: jax.lax.cond(
            c, lambda: jax.vmap(f, (None, 0))(v, r), lambda: r)))(values, rhs, take)
        np.testing.assert_allclose(np.asarray(in_cond)[[0, 2]], ref[[0, 2]], rtol=0, atol=1e-12)
        np.testing.assert_array_equal(np.asarray(in_cond)[1], rhs[1])
        check_grads(f, (values[0], rhs[0, 0]), order=1, modes=("fwd", "rev"))


@KLU
def test_klu_solve_with_a_member_never_set_up_leaves_the_others_alone():
    """Under `vmap`, a member whose KLU state was never set up (the zero state a batched
    step loop carries for a member whose initialization failed) still runs the batch's
    solves: KLU stops the whole program on a zero matrix ("klu_factor failed"), so such
    a member solves with the identity and the others get their own solutions, bit for
    bit (each member is one KLU call on its own values)."""
    pattern, values, rhs, _, reference = random_band_systems(6, 1, 2, 3, 4, seed=1)
    ls = dae.SparseLU(pattern, backend="klu")
    set_up = np.array([True, False, True])
    blank = np.where(set_up[:, None], values, 0.0)

    def solved(v, b):
        return jax.vmap(lambda r: ls.solve((v, jnp.zeros((), bool)), r)[0])(b)

    x = np.asarray(jax.jit(jax.vmap(solved))(blank, rhs))
    own = np.asarray(jax.jit(jax.vmap(solved))(values, rhs))
    assert np.array_equal(x[set_up], own[set_up])
    np.testing.assert_allclose(own, reference(False), rtol=0, atol=1e-12)
    np.testing.assert_array_equal(x[~set_up], rhs[~set_up])


def underdetermined(t, y, yp, args):
    """tests/test_failure_paths.py's singular DAE: y1 − y2 = t leaves y3 undetermined,
    so F_y + cj F_y' is singular for every step size (exactly: row 3 = (row 1 − row 2)/cj)."""
    return jnp.stack([yp[0] - y[2], yp[1] - y[2], y[0] - y[1] - t])


# DenseLU's case is tests/test_failure_paths.py::test_singular_iteration_matrix (the
# default solver at n = 3, the same DAE and checks): --runslow here.
@pytest.mark.parametrize("solver", [pytest.param("dense", marks=SLOW), "sparse",
                                    pytest.param("klu", marks=KLU)])
def test_singular_iteration_matrix_status(solver):
    """A singular iteration matrix gives RESULTS.singular_matrix (and, with throw, an
    error naming it) with every direct solver. KLU itself would stop the program with a
    runtime error on this matrix; SparseLU(backend="klu") tests J first."""
    ls = SOLVERS[solver](None)
    kwargs = {"algebraic": jnp.array([False, False, True]), "linear_solver": ls}
    sol = dae.solve(underdetermined, 0.0, 1.0, jnp.zeros(3), jnp.zeros(3), throw=False,
                    **kwargs)
    assert sol.result == dae.RESULTS.singular_matrix
    with pytest.raises(Exception, match="singular"):
        dae.solve(underdetermined, 0.0, 1.0, jnp.zeros(3), jnp.zeros(3), **kwargs)


@pytest.mark.parametrize("kernel", ["lapack", "jax"])
def test_band_kernels_against_numpy(kernel):
    """Both band LU kernels (`BandedLU(kernel=...)`) on their own, against numpy's dense
    solve: J x = b and Jᵀ x = b for a band with l ≠ u, narrower than the pure-JAX
    kernel's smallest block and n not a multiple of it (padding); a batch of matrices
    each with several right-hand sides (nested vmap); JVP and VJP by finite differences
    (`check_grads`, JAX's own step and tolerance); and the singularity test (exactly
    singular, numerically singular — a row proportional to another up to rounding — and
    non-finite); the same solves in float32. Well-conditioned J (diagonal +4): the solves
    agree to ~10 ulp; we allow 1e-12."""
    from jax.test_util import check_grads

    from daeadjoint._linalg.banded import band_singular, factor_band, solve_band

    pattern, values, rhs, dense, reference = random_band_systems(37, 3, 1, 2, 3, seed=1)

    def solve(v, b, transpose):
        return solve_band(factor_band(v, pattern, kernel), b, pattern, kernel, transpose)

    for transpose in (False, True):
        ref = reference(transpose)
        f = jax.jit(functools.partial(solve, transpose=transpose))
        nested = jax.jit(jax.vmap(jax.vmap(f, (None, 0))))(values, rhs)
        np.testing.assert_allclose(nested, ref, rtol=0, atol=1e-12)
        check_grads(f, (values[0], rhs[0, 0]), order=1, modes=("fwd", "rev"))
        # float32 (sgbtrf/sgbtrs for "lapack"): the user's dtype is kept, and the error
        # is rounding of float32 (~2e-7 relative measured; 10 ulp allowed, as above)
        x32 = jax.vmap(jax.vmap(f, (None, 0)))(values.astype(jnp.float32),
                                               rhs.astype(jnp.float32))
        assert x32.dtype == jnp.float32
        np.testing.assert_allclose(x32, ref, rtol=0,
                                   atol=10 * np.finfo(np.float32).eps * np.abs(ref).max())

    def singular(a):
        return bool(band_singular(factor_band(jnp.asarray(a[pattern.rows, pattern.cols]),
                                              pattern, kernel), kernel))

    base = dense(values[0])
    base[30, 27] = 0.0               # row 30 then fits row 31's band (cols 28…32)
    exact = base.copy()
    exact[10] = 0.0
    numeric = base.copy()            # row 31 = row 30 / 3, proportional up to rounding:
    numeric[31] = base[30] / 3.0     # last pivot ~1e-16 relative (DenseLU agrees)
    nonfinite = base.copy()
    nonfinite[5, 5] = np.nan
    assert [singular(a) for a in (base, exact, numeric, nonfinite)] == [
        False, True, True, True]


@pytest.mark.parametrize("kernel", ["lapack", "jax"])
def test_band_solve_where_solves_the_members_asked(kernel):
    """`solve_band_where` (the batched Newton iteration's solve) under vmap: where pred
    its result is `solve_band`'s bit for bit (the same LAPACK call per member), for J
    and Jᵀ, float64 and float32, several right-hand sides per member (the batching rule's
    repeated matrices) and one unbatched member; its JVP and gradient w.r.t. the
    right-hand side and J's nonzeros are `solve_band`'s (they are exact linear algebra of
    the same factors: compared to 1e-12 relative, the float64 rounding of the
    derivative rules' two extra solves with a well-conditioned J)."""
    from daeadjoint._linalg.banded import factor_band, solve_band, solve_band_where

    pattern, values, rhs, _, _ = random_band_systems(37, 3, 1, 5, 2, seed=4)
    pred = np.array([True, False, False, True, True])

    def solved(where, p, v, b, transpose):
        state = factor_band(v, pattern, kernel)
        if where:
            return jax.vmap(lambda r: solve_band_where(p, state, r, pattern, kernel,
                                                       transpose))(b)
        return jax.vmap(lambda r: solve_band(state, r, pattern, kernel, transpose))(b)

    @jax.jit
    def all_solves(p, v, b):
        """For J and Jᵀ: the batch with and without `where`, and member 0 unbatched with
        `where`, in one compiled program per dtype instead of six."""
        return [(jax.vmap(functools.partial(solved, True, transpose=transpose))(p, v, b),
                 jax.vmap(functools.partial(solved, False, transpose=transpose))(p, v, b),
                 solved(True, p[0], v[0], b[0], transpose))
                for transpose in (False, True)]

    for dtype in (jnp.float64, jnp.float32):
        results = all_solves(pred, values.astype(dtype), rhs.astype(dtype))
        for x_where, x, x_one in results:
            assert x_where.dtype == dtype
            assert np.array_equal(np.asarray(x_where)[pred], np.asarray(x)[pred])
            assert np.array_equal(x_one, np.asarray(x)[0])

    def loss(where, v, b):
        x = jax.vmap(functools.partial(solved, where, transpose=False))(pred, v, b)
        return jnp.sum(jnp.where(pred[:, None, None], x, 0.0) ** 2)

    tangents = (jnp.asarray(np.cos(values)), jnp.asarray(np.sin(rhs)))

    @jax.jit
    def derivatives(v, b, tangents):
        """The JVP and the gradient with and without `where`: one program (eagerly, the
        band kernel's loops compile one by one)."""
        return [(jax.jvp(functools.partial(loss, w), (v, b), tangents)[1],
                 jax.grad(functools.partial(loss, w), argnums=(0, 1))(v, b))
                for w in (True, False)]

    with_where, without = derivatives(values, rhs, tangents)
    for a, b in zip(jax.tree_util.tree_leaves(with_where), jax.tree_util.tree_leaves(without)):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=0)


@pytest.mark.parametrize("kernel", ["lapack", "jax"])
def test_band_refresh_where_factorizes_only_the_members_asked(kernel):
    """`factor_band_where` (the Newton iteration's refresh, `setup_where`) under vmap:
    the members with pred get the factors of their new matrix, the others keep their
    old factors. Checked by solving with the result against numpy's dense solve of the
    matrix each member should hold (new or old), for J and Jᵀ, float64 and float32, and
    unbatched with pred True and False. Well-conditioned J (diagonal +4): ~10 ulp; we
    allow 1e-12 (float64) and 10 float32 ulp of the largest |x| (float32), as in
    test_band_kernels_against_numpy."""
    from daeadjoint._linalg.banded import factor_band, factor_band_where, solve_band

    pattern, old, rhs, dense, _ = random_band_systems(37, 3, 1, 5, 2, seed=2)
    new = random_band_systems(37, 3, 1, 5, 2, seed=3)[1]
    pred = np.array([True, False, False, True, False])

    def reference(transpose):     # the matrix each member should hold, solved densely
        held = np.where(pred[:, None], new, old)
        return np.stack([[np.linalg.solve(dense(v).T if transpose else dense(v), b)
                          for b in rs] for v, rs in zip(held, rhs)])

    def refresh(p, v_old, v_new, b, transpose):
        state = factor_band_where(p, factor_band(v_old, pattern, kernel), v_new, pattern,
                                  kernel)
        return jax.vmap(lambda r: solve_band(state, r, pattern, kernel, transpose))(b)

    @jax.jit
    def all_refreshes(p, v_old, v_new, b):
        """For J and Jᵀ: the batch, and members 0 and 1 unbatched (pred True and False),
        in one compiled program per dtype instead of four."""
        return [(jax.vmap(functools.partial(refresh, transpose=transpose))(p, v_old, v_new, b),
                 [refresh(p[m], v_old[m], v_new[m], b[m], transpose) for m in (0, 1)])
                for transpose in (False, True)]

    for dtype, tol in ((jnp.float64, None), (jnp.float32, 10 * np.finfo(np.float32).eps)):
        results = all_refreshes(pred, old.astype(dtype), new.astype(dtype), rhs.astype(dtype))
        for transpose, (x, unbatched) in zip((False, True), results):
            assert x.dtype == dtype
            expected = reference(transpose)
            atol = 1e-12 if tol is None else tol * np.abs(expected).max()
            np.testing.assert_allclose(x, expected, rtol=0, atol=atol)
            for member, x1 in zip((0, 1), unbatched):     # unbatched: pred True and False
                np.testing.assert_allclose(x1, expected[member], rtol=0, atol=atol)


@KLU
def test_klu_singularity_test_agrees_with_dense():
    """`is_singular` of the KLU backend against DenseLU's on the same matrices: a
    nonsingular one, an exactly singular one (a repeated row), a numerically singular
    one (row 3 = row 1 + row 2 in floating point: rank deficient up to rounding), a
    non-finite one, and one with a zero column (an unknown that no equation contains)."""
    n = 5
    base = np.diag(np.arange(1.0, n + 1)) + np.diag(np.full(n - 1, 0.5), 1)
    exact = base.copy()
    exact[3] = exact[1]
    numeric = base.copy()
    numeric[3] = 0.3 * base[1] + 0.7 * base[2]
    nonfinite = base.copy()
    nonfinite[0, 0] = np.inf
    zero_column = base.copy()
    zero_column[:, 2] = 0.0
    cases = {"nonsingular": (base, False), "exact": (exact, True),
             "numeric": (numeric, True), "nonfinite": (nonfinite, True),
             "zero_column": (zero_column, True)}
    for name, (a, expected) in cases.items():
        a = jnp.asarray(a)

        def residual(t, y, yp, args, a=a):      # J = a (cj = 0)
            return a @ y

        y = jnp.zeros(n)
        states = {s: ls.setup(residual, 0.0, y, y, 0.0, None) for s, ls in (
            ("dense", dae.DenseLU()),
            ("klu", dae.SparseLU(dae.Sparsity.from_dense(a != 0), backend="klu",
                                 check=False)))}
        assert bool(dae.DenseLU().is_singular(states["dense"])) == expected, name
        klu = dae.SparseLU(dae.Sparsity.from_dense(a != 0), backend="klu", check=False)
        assert bool(klu.is_singular(states["klu"])) == expected, name


# ------------------------------------------------------------------ wrong input


def test_unknown_band_kernel_is_a_clear_error():
    for make in (lambda: dae.BandedLU(1, 1, kernel="lu"),
                 lambda: dae.SparseLU(kernel="lu")):
        with pytest.raises(ValueError, match=r"kernel.*'auto', 'lapack', 'jax'"):
            make()


def test_lapack_kernel_unavailable(monkeypatch):
    """Where the LAPACK custom calls cannot be built (no numba, or XLA refuses them),
    "auto" uses the pure-JAX kernel and an explicit "lapack" raises naming why."""
    from daeadjoint._linalg import banded as _banded, lapack_ffi as _lapack_ffi

    assert _lapack_ffi.available() is None          # here they build
    monkeypatch.setattr(_lapack_ffi, "available", lambda: "ImportError: no numba")
    assert _banded.resolve_kernel("auto") == "jax"
    with pytest.raises(ValueError, match=r"kernel='lapack' is unavailable here \(ImportError: no numba\)"):
        _banded.resolve_kernel("lapack")


SHARDED_SCRIPT = """
import sys
import jax, jax.numpy as jnp, numpy as np
jax.config.update("jax_enable_x64", True)
import daeadjoint as dae
from jax.sharding import NamedSharding, PartitionSpec as P
assert jax.device_count() == 4
m = 10                                   # R5 heat, (m + 2)² = 144 unknowns
dx = 1.0 / (m + 1)
def heat(t, u, up, p):
    g = u.reshape(m + 2, m + 2)
    uxx = (g[2:, 1:-1] - 2 * g[1:-1, 1:-1] + g[:-2, 1:-1]) / dx**2
    uyy = (g[1:-1, 2:] - 2 * g[1:-1, 1:-1] + g[1:-1, :-2]) / dx**2
    return up - jnp.zeros_like(g).at[1:-1, 1:-1].set(p[0] * uxx + p[1] * uyy).reshape(-1)
x = np.linspace(0.0, 1.0, m + 2)
u0 = jnp.asarray(np.outer(16 * x * (1 - x), x * (1 - x)).reshape(-1))
ls = None if sys.argv[1] == "default" else dae.SparseLU(kernel=sys.argv[1])
def g(k):
    p = jnp.stack([k, k])
    sol = dae.solve(heat, 0.0, 0.16, u0, -heat(0.0, u0, 0 * u0, p), p, rtol=1e-5,
                    atol=1e-5, linear_solver=ls)
    return jnp.sum(sol.ys[-1] ** 2)
ks = jnp.linspace(0.5, 2.0, 8)
mesh = jax.make_mesh((4,), ("b",), axis_types=(jax.sharding.AxisType.Auto,))
sharded = jax.device_put(ks, NamedSharding(mesh, P("b")))
f = jax.jit(jax.vmap(g))
a, b = f(ks), f(sharded)
assert len(b.sharding.device_set) == 4
np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-12, atol=0)
print("ok")
"""


def test_sharded_batch_with_the_default_solver():
    """A vmapped solve of R5 heat (M = 10) whose batch of 8 is sharded over four
    (host-platform) CPU devices, with the default linear solver (SparseLU), equals the
    unsharded one (1e-12: the same program per member, up to the partitioner's
    reassociation). With several devices the band LU uses its pure-JAX kernel: XLA's
    partitioner cannot split the LAPACK kernel's custom call and runs it replicated (the
    whole batch on every device; `SHARDED_SCRIPT lapack` gives the same numbers, with a
    warning). A subprocess, because the device count is fixed when JAX
    starts; the timeout turns any other hang into a failure. The subprocess keeps the
    suite's XLA options (tests/conftest.py: replacing XLA_FLAGS dropped them, and its two
    programs compiled a third slower) and adds the device count."""
    import subprocess
    import sys

    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4"
    env = dict(os.environ, XLA_FLAGS=flags.strip(), OPENBLAS_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", SHARDED_SCRIPT, "default"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_too_small_bandwidth_raises():
    """The interleaved DAE needs lower = 3, upper = 2; (2, 2) would fold the missing
    entries into wrong ones — the per-setup J·v check names the bandwidth instead."""
    with pytest.raises(Exception, match=r"BandedLU\(lower=2, upper=2\).*outside this band"):
        solve_rd(RD_P, RD_Y0, dae.BandedLU(2, 2)).ys.block_until_ready()


@pytest.mark.parametrize("backend", ["banded", pytest.param("klu", marks=pytest.mark.skipif(
    not HAVE_KLU, reason="klujax not installed"))])
def test_wrong_sparsity_pattern_raises(backend):
    """A user pattern that misses nonzeros (here the band (2, 2) of a (3, 2)-banded J)
    is caught by the same check."""
    wrong = dae.Sparsity.banded(2 * N_RD, 2, 2)
    with pytest.raises(Exception, match="outside the given sparsity"):
        solve_rd(RD_P, RD_Y0, dae.SparseLU(wrong, backend=backend)).ys.block_until_ready()


def test_undetectable_residual_asks_for_the_pattern():
    """A primitive the detector has no rule for (here an FFT) hides the residual's
    structure: SparseLU() raises naming the remedy (before anything is compiled); the
    default falls back to DenseLU with a warning."""
    def spectral(t, y, yp, p):
        return yp + jnp.fft.irfft(jnp.fft.rfft(y) * 0.5, n=y.shape[0])

    y0 = jnp.ones(200)
    with pytest.raises(dae.SparsityDetectionError, match="Pass it yourself"):
        dae.solve(spectral, 0.0, 0.1, y0, -y0, linear_solver=dae.SparseLU())
    with pytest.warns(UserWarning, match="DenseLU"):
        assert isinstance(dae.default_linear_solver(spectral, 0.0, y0, y0, None), dae.DenseLU)


def test_pattern_size_mismatch_raises():
    with pytest.raises(ValueError, match="pattern is 5"):
        solve_rd(RD_P, RD_Y0, dae.SparseLU(dae.Sparsity.banded(5, 1, 1)))


# ------------------------------------------------------------------ detection, default


def test_detected_pattern_is_exact_and_conservative():
    """The detected pattern of the DAE is exactly its band (every J entry that can be
    nonzero, nothing more), also with tracers (under jit) and closures over tracers."""
    n = 2 * N_RD
    found = detect_sparsity(reaction_diffusion, 0.0, RD_Y0, RD_Y0, RD_P)
    dense = jax.jacfwd(lambda v: reaction_diffusion(0.0, RD_Y0 + v, RD_Y0 + 2 * v,
                                                    RD_P + 0.3))(jnp.zeros(n))
    nz = np.abs(np.asarray(dense)) > 0
    assert found == dae.Sparsity.from_dense(nz | np.eye(n, dtype=bool))
    assert (found.lower, found.upper) == RD_BAND

    @jax.jit
    def traced(y, p):
        inner = lambda t, y_, yp_, a: reaction_diffusion(t, y_ * y, yp_, p)   # noqa: E731
        assert detect_sparsity(inner, 0.0, y, y, None) == found
        return y

    traced(RD_Y0, RD_P)



def _shift_pattern(n, k):
    """The pattern of F_i = y'_i − y_{(i+k) mod n}: the diagonal and one cyclic
    off-diagonal at offset k."""
    i = np.arange(n)
    dense = np.eye(n, dtype=bool)
    dense[i, (i + k) % n] = True
    return dae.Sparsity.from_dense(dense)


def test_detected_patterns_never_alias_another_function(monkeypatch):
    """The cache of detected patterns never returns one function's pattern for another.
    Closures made in a loop (one code object, different captured offsets k; each deleted
    before the next is made), and one residual whose static argument (an unhashable
    dict holding k) is rebuilt for every call — with `id` made to return the same number
    for every object in the module, the worst case of CPython reusing a freed object's
    address: each gets its own pattern, checked against the exact one."""
    from daeadjoint._linalg import jacobian
    monkeypatch.setattr(jacobian, "id", lambda x: 0, raising=False)
    n = 6
    y = jnp.zeros(n)

    def make(k):
        def residual(t, y_, yp_, args):
            return yp_ - jnp.roll(y_, -k)
        return residual

    for k in (1, 2, 3):
        residual = make(k)
        assert detect_sparsity(residual, 0.0, y, y, None) == _shift_pattern(n, k), k
        del residual
        gc.collect()

    def by_args(t, y_, yp_, args):
        return yp_ - args["scale"] * jnp.roll(y_, -args["k"])

    for k in (1, 2, 3, 1):
        args = {"scale": jnp.ones(()), "k": k}   # static part: {"scale": None, "k": k}
        assert detect_sparsity(by_args, 0.0, y, y, args) == _shift_pattern(n, k), k
        del args
        gc.collect()

def test_default_linear_solver():
    """DenseLU up to 100 unknowns (small problems unchanged); above, SparseLU with the
    detected pattern (whether the natural ordering is banded or only a reordering is);
    decided from shapes and structure, so also under jit with traced y0."""
    assert isinstance(dae.default_linear_solver(heat, 0.0, heat_u0(M_HEAT), heat_u0(M_HEAT),
                                                jnp.ones(2)), dae.DenseLU)

    n = 400
    perm = np.random.default_rng(0).permutation(n)

    def chain(t, y, yp, p):                    # 1-D diffusion, natural order: band 1
        return yp - (jnp.pad(y, 1)[:-2] - 2 * y + jnp.pad(y, 1)[2:])

    def shuffled(t, y, yp, p):                 # the same chain, unknowns and equations
        return chain(t, y[perm], yp[perm], p)[np.argsort(perm)]   # shuffled alike

    y = jnp.ones(n)

    @jax.jit
    def choose(y):
        assert dae.default_linear_solver(chain, 0.0, y, y, None) == dae.SparseLU(
            dae.Sparsity.banded(n, 1, 1))
        shuffled_choice = dae.default_linear_solver(shuffled, 0.0, y, y, None)
        assert isinstance(shuffled_choice, dae.SparseLU)
        assert shuffled_choice.sparsity.lower > 100    # banded only after reordering
        return y

    choose(y)


def test_nothing_n_by_n():
    """No array of the forward solve and its gradient with BandedLU / SparseLU has two
    axes of length n (n = 300: larger than any other axis of the program), i.e. nothing
    n×n is formed — the LU state is O(n·(l + u)), checkpoints O(#checkpoints · n)."""
    n = 300

    def chain(t, y, yp, p):
        return yp - p[0] * (jnp.pad(y, 1)[:-2] - 2 * y + jnp.pad(y, 1)[2:])

    y0 = jnp.sin(jnp.linspace(0, 3, n))

    def loss(p, ls):
        return jnp.sum(dae.solve(chain, 0.0, 1.0, y0, chain(0.0, y0, 0 * y0, p), p,
                                 max_steps=200, linear_solver=ls).ys ** 2)

    def square_shapes(jaxpr):
        found = []
        for eqn in jaxpr.eqns:
            for var in eqn.outvars:
                shape = getattr(var.aval, "shape", ())
                if sum(s == n for s in shape) >= 2:
                    found.append((eqn.primitive.name, shape))
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                found += square_shapes(sub)
        return found

    for ls in (dae.BandedLU(1, 1), dae.SparseLU()):
        jaxpr = jax.make_jaxpr(jax.grad(lambda p: loss(p, ls)))(jnp.array([1.0]))
        assert square_shapes(jaxpr.jaxpr) == [], type(ls).__name__
    dense = jax.make_jaxpr(jax.grad(lambda p: loss(p, dae.DenseLU())))(jnp.array([1.0]))
    assert square_shapes(dense.jaxpr) != []     # the check can see an n×n array


# ------------------------------------------------------------------ R5 at full size


@pytest.mark.slow
@pytest.mark.parametrize("solver", ["banded", "sparse", "krylov", pytest.param(
    "klu", marks=pytest.mark.skipif(not HAVE_KLU, reason="klujax not installed"))])
def test_heat_r5_1766_parameters(solver):
    """R5 at M = 40 (1764 unknowns), the gradient w.r.t. all 1766 parameters (p1, p2 and
    u0) from one adjoint solve with each new solver, against the paper's Table 1 (Li &
    Petzold, DASPKADJOINT, §7.1.1) as in tests/test_heat_equation_gradient.py: d(Σu²(T))/dp1 = −2.72675
    and d(∫Σu dt)/dp1 = −15.2178 at 1e-4 relative, solved at rtol = atol = 1e-6 (why
    not the paper's 1e-5: tests/test_heat_equation_gradient.py), and Euler's identity
    ∇g·u0 = (degree)·g for all 1764 initial-value sensitivities (100·rtol: both sides
    carry the global error)."""
    m = 40
    dx = 1.0 / (m + 1)

    def heat40(t, u, up, args):
        g = u.reshape(m + 2, m + 2)
        uxx = (g[2:, 1:-1] - 2 * g[1:-1, 1:-1] + g[:-2, 1:-1]) / dx**2
        uyy = (g[1:-1, 2:] - 2 * g[1:-1, 1:-1] + g[1:-1, :-2]) / dx**2
        rhs = jnp.zeros_like(g).at[1:-1, 1:-1].set(args[0] * uxx + args[1] * uyy)
        return up - rhs.reshape(-1)

    ls = SOLVERS[solver]((m + 2, m + 2))

    def both(p, u0):
        up0 = -heat40(0.0, u0, jnp.zeros_like(u0), p)
        sol = dae.solve(heat40, 0.0, 0.16, u0, up0, p, rtol=1e-6, atol=1e-6, max_steps=2000,
                        linear_solver=ls, quadrature=lambda t, u, up, a: jnp.sum(u)[None])
        return jnp.stack([jnp.sum(sol.ys[-1] ** 2), sol.qs[-1, 0]])

    p, u0 = jnp.array([1.0, 1.0]), heat_u0(m)
    g, (dp, du0) = jax.jit(lambda p, u0: (both(p, u0), jax.jacrev(both, argnums=(0, 1))(p, u0)))(p, u0)
    assert abs(float(dp[0, 0]) + 2.72675) <= 1e-4 * 2.72675
    assert abs(float(dp[1, 0]) + 15.2178) <= 1e-4 * 15.2178
    assert abs(float(dp[1, 1] - dp[1, 0])) <= 1e-4 * 15.2178      # x ↔ y symmetry
    assert abs(float(du0[0] @ u0) - 2 * float(g[0])) <= 100 * 1e-6 * 2 * float(g[0])
    assert abs(float(du0[1] @ u0) - float(g[1])) <= 100 * 1e-6 * float(g[1])


def test_band_solve_with_a_member_never_factorized_leaves_the_others_alone():
    """Under `vmap`, a member whose band factors were never computed (the zeros a batched
    step loop carries for a member whose initialization failed: pivot indices 0) solves
    to NaN, and the other members' solutions are their own, bit for bit. gbtrs swaps
    x(j) with x(ipiv(j)) unchecked: with pivot 0 it read and wrote the previous member's
    right-hand side (or memory before the buffer)."""
    from daeadjoint._linalg.banded import factor_band, solve_band, solve_band_where

    pattern, values, rhs, _, _ = random_band_systems(37, 3, 1, 5, 2, seed=5)
    factored = np.array([True, True, False, True, True])

    def solved(where, ok, v, b):
        state = factor_band(v, pattern, "lapack")
        state = jax.tree_util.tree_map(lambda a: jnp.where(ok, a, jnp.zeros_like(a)), state)
        if where:
            return jax.vmap(lambda r: solve_band_where(True, state, r, pattern, "lapack"))(b)
        return jax.vmap(lambda r: solve_band(state, r, pattern, "lapack"))(b)

    own = jax.jit(jax.vmap(functools.partial(solved, False)))(
        np.ones_like(factored), values, rhs)
    for where in (False, True):
        x = np.asarray(jax.jit(jax.vmap(functools.partial(solved, where)))(
            factored, values, rhs))
        assert np.array_equal(x[factored], np.asarray(own)[factored])
        assert np.all(np.isnan(x[~factored]))


def _heat_1d(t, y, yp, p):
    """u' = p₀ u_xx − p₁ u² on (0, 1), u = 0 at both ends, 8 interior nodes: J
    tridiagonal. p₀ = NaN makes the consistent initialization fail."""
    up = jnp.pad(y, 1)
    return yp - p[0] * (up[:-2] - 2 * y + up[2:]) * (y.shape[0] + 1) ** 2 + p[1] * y**2


# vmap(jacfwd) and vmap(grad) run with --runslow (the default suite's budget: the two
# gradient programs of [sparse-grad] were ~55 CPU s). By default the batched Newton
# solves with the never-factorized member run in [sparse-solve] here (the same batched
# forward integration as vmap(grad)'s forward pass, without its adjoint), the band
# solve with such a member in
# test_band_solve_with_a_member_never_factorized_leaves_the_others_alone, and vmap(grad)
# and vmap(jacfwd) with a failed member (NaN derivatives for it, exact ones for the
# others; DenseLU) in test_events.py::test_failed_batch_member_gets_nan_derivatives.
@pytest.mark.parametrize("derivative", [pytest.param("jacfwd", marks=SLOW),
                                        pytest.param("grad", marks=SLOW), "solve"])
@pytest.mark.parametrize("solver", [pytest.param("banded", marks=SLOW), "sparse",
                                    pytest.param("klu", marks=[SLOW, KLU])])
def test_vmap_with_a_nan_member_keeps_the_other_members_derivatives(solver, derivative):
    """jit(vmap(jacfwd)), jit(vmap(grad)) and jit(vmap(solve)) (derivative "solve": the
    solution itself) over a batch with a member whose parameter
    is NaN (its initialization fails: it never sets up J, its band factors stay the
    zeros the batched step loop starts from): every other member's derivatives are its
    own unbatched ones, the NaN member's are NaN (its solution: inf, the rows never
    reached). The healthy members take the same
    steps batched as alone, so they agree to rounding; 1e-9 relative is far above that
    (and far below the O(1) of a member contaminated by its neighbour: NaN, before
    the band solve checked its pivot indices)."""
    ls = SOLVERS[solver]((1, 1))
    u0 = jnp.sin(jnp.pi * jnp.linspace(0, 1, 10)[1:-1])

    def ys(p, sensitivity=None):
        return dae.solve(_heat_1d, 0.0, 0.5, u0, None, p, saveat=jnp.array([0.2, 0.5]),
                         rtol=1e-8, atol=1e-10, linear_solver=ls, throw=False,
                         sensitivity=sensitivity).ys

    def objective(p, sensitivity=None):
        y = ys(p, sensitivity)
        return jnp.sum(y[0] ** 2) + jnp.sum(y[-1])

    batch = jnp.array([[0.1, 1.0], [0.2, 0.5], [jnp.nan, 1.0], [0.05, 2.0]])
    healthy = np.array([True, True, False, True])
    # The unbatched reference gradient without the fallback branch (REFERENCE above: the
    # same continuous adjoint, a quarter less compilation; a failed backward integration
    # gives NaN here, throw=False, which fails the comparison).
    mode = derivative
    derivative, reference = {
        "jacfwd": (jax.jacfwd(ys), jax.jacfwd(ys)),
        "grad": (jax.grad(objective), jax.grad(lambda p: objective(p, REFERENCE))),
        "solve": (ys, ys)}[derivative]
    batched = np.asarray(jax.jit(jax.vmap(derivative))(batch))
    alone = jax.jit(reference)
    for i in np.flatnonzero(healthy):
        np.testing.assert_allclose(batched[i], alone(batch[i]), rtol=1e-9, atol=0)
    # A failed member's derivatives are NaN; its solution's rows, never reached, are inf
    # (`_core.run`'s docstring).
    failed = np.isinf if mode == "solve" else np.isnan
    assert np.all(failed(batched[~healthy]))


def _gauss_jordan_argmax(a):
    """The Gauss–Jordan inverse with its pivot found by `jnp.argmax` and read by a
    gather (the form before the unrolled selects), as the reference for the pivots."""
    n = a.shape[0]
    m = jnp.concatenate([a, jnp.eye(n, dtype=a.dtype)], axis=1)
    rows = jnp.arange(n)
    at = rows[:, None]
    pivots = []
    for j in range(n):
        p = jnp.argmax(jnp.where(rows >= j, jnp.abs(m[:, j]), -1.0))
        rj, rp = m[j], m[p]
        piv = rp[j]
        pivots.append(piv)
        m = jnp.where(at == j, rp / piv, jnp.where(at == p, rj, m))
        m = m - jnp.where(rows == j, 0.0, m[:, j])[:, None] * m[j][None, :]
    return m[:, n:], jnp.stack(pivots)


@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_gauss_jordan_unrolled_pivots_match_argmax(n):
    """The small-n inverse picks its pivot row by unrolled selects (under `vmap`, fewer
    operations than an argmax and a gather): the same pivot as `jnp.argmax` — the first
    of equal magnitudes, a NaN before any number — so the same inverse and pivots bit
    for bit, batched and not, on matrices with ties (rounded entries, equal rows), NaN,
    inf and all-zero columns."""
    from daeadjoint._linalg.linear_solver import _gauss_jordan_inverse

    rng = np.random.default_rng(n)
    a = rng.normal(size=(400, n, n))
    a[:80] = np.round(a[:80])
    a[80:100, 0, 0] = np.nan
    a[100:120, :, n - 1] = np.nan
    a[120:140] = 0.0
    a[140:180, n - 1] = a[140:180, 0]
    a[180:200, :, 0] = np.inf
    got = jax.jit(jax.vmap(_gauss_jordan_inverse))(a)
    want = jax.jit(jax.vmap(_gauss_jordan_argmax))(a)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    # And the inverse itself, against LAPACK's (numpy) on the finite, unrounded
    # matrices: both backward stable, so they agree to cond(a)·ε up to a modest
    # factor (100, for the dimension and the two algorithms' differing roundings).
    inv, fin = np.asarray(got[0][200:]), a[200:]
    ref = np.linalg.inv(fin)
    err = np.linalg.norm(inv - ref, axis=(1, 2)) / np.linalg.norm(ref, axis=(1, 2))
    assert np.all(err <= 100 * np.linalg.cond(fin) * np.finfo(float).eps)
    for i in (5, 85, 110, 130, 150, 190):
        for g, w in zip(jax.jit(_gauss_jordan_inverse)(a[i]), jax.jit(_gauss_jordan_argmax)(a[i])):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
