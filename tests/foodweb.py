r"""The 2-D food web of Li & Petzold, DASPKADJOINT, §7.2.1 (index 1, M = 20: 800 unknowns).

One prey c¹ (differential) and one predator c² (algebraic) on the unit square:

    c¹_t = f₁(x, y, c) + d₁ (c¹_xx + c¹_yy),
    0    = f₂(x, y, c) + d₂ (c²_xx + c²_yy),      f_i = c^i (b_i + Σ_j a_ij c^j),

a₁₁ = a₂₂ = −1, a₁₂ = −0.5·10⁻⁶, a₂₁ = 10⁴, b₁ = −b₂ = 1 + α x y + β sin(4πx) sin(4πy),
d₁ = 1, d₂ = 0.05, homogeneous Neumann boundaries, central differences on an M×M mesh
(spacing 1/(M − 1), boundary points reflected, as in the DASPK/IDAS web examples),
α = 50, β = 100, t ∈ [0, 5], rtol = atol = 10⁻⁵. Initial values c¹₀ = 10 +
(16x(1 − x)y(1 − y))², c²₀ = 100, which do not satisfy the algebraic equations: the
paper computes consistent ones (here `init="ya_ydp"`). The functional is
g₁ = Σ_{i=1}^{NEQ} u_i² at T = 5; the paper's Table 3: dg₁/dα = 6467.12, dg₁/dβ = 3287.79
by its adjoint (6467.01, 3287.73 by finite differences).

Unknowns are ordered as in the SUNDIALS food-web examples: species fastest, then x,
then y, so index (j_y·M + j_x)·2 + s; the iteration matrix is then banded with
half-bandwidth 2M and its 2×2 diagonal blocks hold the reaction Jacobians.

The preconditioner is the block-diagonal part of J = F_c + cj F_c' (the SUNDIALS
examples' "reaction Jacobian per grid point" plus the diagonal of the diffusion stencil,
which keeps the prey block nonsingular where cj ≈ ∂f₁/∂c¹ on long steps).
"""

import jax
import jax.numpy as jnp
import numpy as np

import daeadjoint as dae

M = 20
NS = 2                                  # species per grid point: prey, predator
DIFF = np.array([1.0, 0.05])            # d₁, d₂
ALPHA, BETA = 50.0, 100.0
T_FINAL = 5.0
RTOL = ATOL = 1e-5
TABLE3_AD = (6467.12, 3287.79)          # Li & Petzold, Table 3, adjoint (dg1/dα, dg1/dβ)
TABLE3_FD = (6467.01, 3287.73)          # Table 3, finite differences


def grid(m=M):
    """NumPy constants (X[j_y, j_x] = x_{j_x}): the residual and the preconditioner close
    over them, and a closure over a JAX array created under `jit` would leak a tracer."""
    x = np.linspace(0.0, 1.0, m)
    return np.meshgrid(x, x, indexing="xy")


def algebraic_mask(m=M):
    return jnp.tile(jnp.array([False, True]), m * m)


def _b1(p, X, Y):
    alpha, beta = p[0], p[1]
    return 1.0 + alpha * X * Y + beta * jnp.sin(4 * jnp.pi * X) * jnp.sin(4 * jnp.pi * Y)


def reaction(c, b1):
    """f(c) at every grid point; c (..., 2), b1 (...)."""
    c1, c2 = c[..., 0], c[..., 1]
    f1 = c1 * (b1 - c1 - 0.5e-6 * c2)
    f2 = c2 * (-b1 + 1e4 * c1 - c2)
    return jnp.stack([f1, f2], axis=-1)


def diffusion(g, m):
    """d_s Δc^s with zero normal derivative (mirror points), g (m, m, 2)."""
    h2 = (1.0 / (m - 1)) ** 2
    pad = jnp.pad(g, ((1, 1), (1, 1), (0, 0)), mode="reflect")
    lap = (pad[2:, 1:-1] + pad[:-2, 1:-1] + pad[1:-1, 2:] + pad[1:-1, :-2] - 4 * g) / h2
    return DIFF * lap


def make_residual(m=M):
    X, Y = grid(m)

    def residual(t, c, cp, p):
        g = c.reshape(m, m, NS)
        rate = reaction(g, _b1(p, X, Y)) + diffusion(g, m)
        res = jnp.stack([cp.reshape(m, m, NS)[..., 0] - rate[..., 0], -rate[..., 1]], axis=-1)
        return res.reshape(-1)

    return residual


def initial_values(m=M):
    """The paper's (inconsistent) c₀ and c'₀ = (f₁ + d₁Δc¹, 0) for the prey guess."""
    X, Y = grid(m)
    c1 = 10.0 + (16 * X * (1 - X) * Y * (1 - Y)) ** 2
    c2 = jnp.full_like(c1, 100.0)
    c0 = jnp.stack([c1, c2], axis=-1).reshape(-1)
    cp0 = -make_residual(m)(0.0, c0, jnp.zeros_like(c0), jnp.array([ALPHA, BETA]))
    cp0 = jnp.where(algebraic_mask(m), 0.0, cp0)
    return c0, cp0


def block_preconditioner(m=M) -> dae.Preconditioner:
    """P = the 2×2 diagonal blocks of J = F_c + cj F_c' (block Jacobi), inverted in
    closed form; P⁻ᵀ for the adjoint uses the transposed inverses."""
    X, Y = grid(m)
    h2 = (1.0 / (m - 1)) ** 2
    stencil_diag = 4.0 * DIFF / h2            # −(diagonal of d_s Δ), per species (NumPy)

    def setup(t, c, cp, cj, p):
        g = c.reshape(m * m, NS)
        b1 = _b1(p, X, Y).reshape(-1)
        jac = jax.vmap(jax.jacfwd(reaction))(g, b1)                # (m², 2, 2) = ∂f/∂c
        blocks = -jac + jnp.diag(stencil_diag) + jnp.diag(jnp.array([cj, 0.0]))
        (a, b), (c_, d) = (blocks[:, 0, 0], blocks[:, 0, 1]), (blocks[:, 1, 0], blocks[:, 1, 1])
        det = a * d - b * c_
        inv = jnp.stack([jnp.stack([d, -b], -1), jnp.stack([-c_, a], -1)], -2) / det[:, None, None]
        return inv

    def solve(inv, r, transpose):
        rr = r.reshape(m * m, NS)
        z = (jnp.einsum("kji,kj->ki", inv, rr) if transpose
             else jnp.einsum("kij,kj->ki", inv, rr))
        return z.reshape(-1)

    return dae.Preconditioner(setup=setup, solve=solve)


def solve_foodweb(p, linear_solver, m=M, sensitivity=None, max_steps=5000):
    c0, cp0 = initial_values(m)
    return dae.solve(make_residual(m), 0.0, T_FINAL, c0, cp0, p, algebraic=algebraic_mask(m),
                     init="ya_ydp", rtol=RTOL, atol=ATOL, linear_solver=linear_solver,
                     max_steps=max_steps, sensitivity=sensitivity)


def g1(p, linear_solver, m=M, sensitivity=None):
    """g₁ = Σ_i u_i² at T (all 2M² unknowns)."""
    return jnp.sum(solve_foodweb(p, linear_solver, m, sensitivity).ys[-1] ** 2)
