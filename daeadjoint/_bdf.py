"""The variable-order BDF of IDAS in fixed-leading-coefficient form (IDAS manual §6.2.2).

The solution history is kept as modified divided differences φ_0 … φ_5 (rows of `phi`),
with ψ_i = t_n − t_{n−i−1} the step-size history. Everything here is a pure function on
those arrays; loops over the order are vectorized (cumulative sums and products) so the
traced step does not grow with the maximum order.

Notation follows IDAS: k is the order of the step being attempted, k_used the order of
the last successful step, h_used its size, ns the number of steps taken at constant
step size and order.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from ._ops import row, where

MAXORD = 5
NPHI = MAXORD + 1
_ORDERS = jnp.arange(NPHI)


class Coefficients(NamedTuple):
    """The BDF coefficients of one step (`set_coefficients`)."""

    psi: Float[Array, "6"]      # ψ after the step
    alpha: Float[Array, "6"]
    beta: Float[Array, "6"]     # the history's rescaling to the new step
    sigma: Float[Array, "6"]    # the error estimates' factors
    gamma: Float[Array, "6"]    # the predictor's y' weights
    cj: Float[Array, ""]        # the leading coefficient: y'_n ≈ y'_(0) + cj (y_n − y_(0))
    ck: Float[Array, ""]        # the error constant of the local error test (6.9)
    ns: Int[Array, ""]


def _prefix(x, op):
    """[x_0, x_0 ∘ x_1, (x_0 ∘ x_1) ∘ x_2, …] of a 6-vector, unrolled: elementwise
    operations that XLA fuses with their neighbours, where `jnp.cumprod`/`jnp.cumsum`
    become a reduce-window, an operation of its own in every step. The same products
    (sums) in the same order as the reduce-window's, which starts from the identity:
    1·x_0 = x_0 (and 0 + x_0 = x_0 for the positive terms it is used on)."""
    out = [x[0]]
    for i in range(1, x.shape[0]):
        out.append(op(out[-1], x[i]))
    return jnp.stack(out)


@functools.cache
def _alpha_s_sums(dtype) -> np.ndarray:
    """Σ_{i<k} 1/(i+1) for k = 0..6 in `dtype`, summed in the order of the reduction it
    replaces (0 + 1/1 + 1/2 + …, one rounding per term, XLA's CPU reduction being a
    sequential loop): a constant row that `set_coefficients` picks by k, where the
    reduction over the orders was a kernel of its own in every step."""
    terms = [np.asarray(1.0, dtype) / np.asarray(i + 1, dtype) for i in range(NPHI)]
    sums, total = [np.asarray(0.0, dtype)], np.asarray(0.0, dtype)
    for term in terms:
        total = (total + term).astype(dtype)
        sums.append(total)
    return np.stack(sums).astype(dtype)


def set_coefficients(psi_old, h, k, k_used, h_used, ns_old, dtype) -> Coefficients:
    """IDAS `IDASetCoeffs`: the BDF coefficients for a step of size h at order k.

    With ψ'_0 = h, ψ'_i = ψ_{i−1} + h (i = 1..k):
        α_i = h/ψ'_i,  β_i = Π_{j≤i} ψ'_{j−1}/ψ_{j−1},  σ_i = i! Π_{j≤i} α_j,
        γ_i = Σ_{j<i} α_j / h,
    cj = −α_s/h with α_s = −Σ_{i<k} 1/(i+1) (the fixed leading coefficient of (6.3)), and
    the error constant ck = max(|α_k + α_s − α_0|, α_k) of the local error test (6.9).
    ns counts the steps taken at constant h and k (capped at k_used + 2); IDAS skips the
    recomputation when ns > k + 1 because the formulas then reproduce the previous
    values, so computing them every step (as here) gives the same coefficients.
    """
    i = _ORDERS
    fi = i.astype(dtype)
    ns = where((h != h_used) | (k != k_used), 0, ns_old)
    ns = jnp.minimum(ns + 1, k_used + 2)
    active = i <= k
    psi_shift = jnp.concatenate([jnp.zeros((1,), dtype), psi_old[:-1]])
    psi_new = where(active, psi_shift + h, psi_old)
    safe_old = where(psi_shift == 0, 1.0, psi_shift)
    # β_i = Π_{1≤j≤i} ψ'_{j−1}/ψ_{j−1}; roll(psi_new)[i] = ψ'_{i−1}, psi_shift[i] = ψ_{i−1}.
    ratio = where((i >= 1) & active, jnp.roll(psi_new, 1) / safe_old, 1.0)
    beta = _prefix(ratio, jnp.multiply)
    alpha = where(i == 0, 1.0, where(active, h / where(active, psi_new, 1.0), 0.0))
    sigma = _prefix(where((i >= 1) & active, fi * alpha, 1.0), jnp.multiply)
    gamma = jnp.concatenate([jnp.zeros((1,), dtype), _prefix(alpha[:-1], jnp.add) / h])
    alpha_s = -row(_alpha_s_sums(dtype), k)
    alpha_0 = -jnp.sum(where(i < k, alpha, 0.0))
    alpha_k = row(alpha, k)
    ck = jnp.maximum(jnp.abs(alpha_k + alpha_s - alpha_0), alpha_k)
    cj = -alpha_s / h
    return Coefficients(psi=psi_new, alpha=alpha, beta=beta, sigma=sigma, gamma=gamma,
                        cj=cj, ck=ck, ns=ns)


def _rows(weights, like):
    """Weights over the 6 history rows, shaped to broadcast against `like` (6, ...)."""
    return weights.reshape((NPHI,) + (1,) * (like.ndim - 1))


# A history is either one array (6, ...) or a tuple of its 6 rows. XLA's CPU runtime
# runs a loop body's operations one after another only while every buffer they touch is
# at most 512 bytes, and otherwise as a dataflow graph on its thread pool, at about
# twice the cost per step for small systems. A forward-sensitivity history (6, k, n)
# crosses that at k·n > 10 (Robertson with 4 directions), its rows only at k·n > 64; in
# between it is kept as rows (`history_layout`). Otherwise one array is cheaper: one
# operation instead of six.
SEQUENTIAL_BYTES = 512


def history_layout(phi):
    """`phi` (6, ...) as rows where only that keeps it under `SEQUENTIAL_BYTES`."""
    row_bytes = phi[0].size * phi.dtype.itemsize
    return tuple(phi) if row_bytes * NPHI > SEQUENTIAL_BYTES >= row_bytes else phi


def history_row(phi, i):
    """φ_i for a traced i (clipped to 0..5)."""
    if isinstance(phi, tuple):
        return jax.lax.select_n(jnp.clip(i, 0, NPHI - 1), *phi)
    return row(phi, i)


def update_row(phi, i: int, fn):
    """The history with row i (static) replaced by fn(φ_i)."""
    if isinstance(phi, tuple):
        return phi[:i] + (fn(phi[i]),) + phi[i + 1:]
    return phi.at[i].set(fn(phi[i]))


def stacked(phi):
    """The history as one (6, ...) array."""
    return jnp.stack(phi) if isinstance(phi, tuple) else phi


def scale_history(phi, beta, ns, k):
    """φ_i ← β_i φ_i for ns ≤ i ≤ k: the divided differences re-expressed for the new
    step size (IDAS's φ*). `phi` is (6, ...): the state's (6, n), or the sensitivities'
    (6, k_dir, n), either one array or a tuple of its rows (`history_layout`)."""
    scale = where((_ORDERS >= ns) & (_ORDERS <= k), beta, 1.0)
    if isinstance(phi, tuple):
        return tuple(scale[i] * row for i, row in enumerate(phi))
    return phi * _rows(scale, phi)


def small_rows(phi) -> bool:
    """Whether sums over φ's six rows are unrolled (`_row_sum`): for rows of at most
    `SEQUENTIAL_BYTES` (or φ already kept as rows), where the unrolled sum fuses with its
    neighbours and a reduction or a dot would be an operation of its own."""
    return isinstance(phi, tuple) or phi[0].size * phi.dtype.itemsize <= SEQUENTIAL_BYTES


def predict(phi, gamma, k):
    """Predictor: y_(0) = Σ_{j≤k} φ_j,  y'_(0) = Σ_{1≤j≤k} γ_j φ_j."""
    w_y = (_ORDERS <= k).astype(gamma.dtype)
    w_yp = where((_ORDERS >= 1) & (_ORDERS <= k), gamma, 0.0)
    if small_rows(phi):
        rows = tuple(phi)
        return _row_sum(w_y, rows), _row_sum(w_yp, rows)
    return jnp.sum(_rows(w_y, phi) * phi, axis=0), jnp.sum(_rows(w_yp, phi) * phi, axis=0)


def _row_sum(w, rows):
    """Σ_i w_i φ_i over the six rows, unrolled: ((w_0 φ_0 + w_1 φ_1) + …) + w_5 φ_5, the
    order of the reduction it replaces (which starts from 0 + w_0 φ_0), so an unbatched
    solve computes the same numbers. Not `jnp.sum(w[:, None] * phi, axis=0)`: under
    `vmap` that is a reduction over the middle axis of a (batch, 6, n) array, which XLA's
    CPU backend hands to its YNNPACK reduce kernel — for Robertson with 256 members
    22.6 µs CPU per predictor against 3.8 µs unrolled (docs/performance.md, "Batches").
    Used for small rows only (`predict`): for long ones (the heat DAE at n = 484, 64
    members) the reduce kernel was the faster, by 10–15 % of the batched solve."""
    total = w[0] * rows[0]
    for i in range(1, NPHI):
        total = total + w[i] * rows[i]
    return total


def complete_history(phi, ee, k_used):
    """IDAS `IDACompleteStep` history update after an accepted step with correction ee:
    φ_{k+1} ← ee (kept for the order-raise estimate), φ_k ← φ_k + ee, then
    φ_j ← φ_j + φ_{j+1} for j = k−1..0 (a reverse cumulative sum over rows 0..k)."""
    if isinstance(phi, tuple):
        rows = [row + where(i == k_used, ee, 0.0) for i, row in enumerate(phi)]
        total, out = 0.0, [None] * NPHI
        for i in reversed(range(NPHI)):
            total = total + where(i <= k_used, rows[i], 0.0)
            out[i] = where(i <= k_used, total, rows[i])
        return tuple(where((i == k_used + 1) & (k_used < MAXORD), ee, row)
                     for i, row in enumerate(out))
    rows = _rows(_ORDERS, phi)
    phi = phi + where(rows == k_used, ee[None], 0.0)
    low = where(rows <= k_used, phi, 0.0)
    # Unrolled (`_prefix`): `jnp.cumsum` becomes a reduce-window, under `vmap` the
    # dearest single operation of a batched step (Robertson, 256 members: ~16 µs of a
    # ~200 µs trip, profiled); the same sums in the same order (the reduce-window's
    # leading 0 + φ_5 is φ_5 but for the sign of a zero).
    cumulative = jnp.flip(_prefix(jnp.flip(low, 0), jnp.add), 0)
    phi = where(rows <= k_used, cumulative, phi)
    return where((rows == k_used + 1) & (k_used < MAXORD), ee[None], phi)


def derivative_weights(t, t_n, psi, k_used, order: int) -> Float[Array, "order+1 6"]:
    """Weights W with y^(m)(t) = Σ_j W[m, j] φ_j, m = 0..order, for the interpolating
    polynomial of the last step (order k_used, at least 1; IDAS `IDAGetSolution` and
    `IDAGetDky`), valid for t_n − h_used ≤ t ≤ t_n (and mild extrapolation).

    With Δ = t − t_n the weight of φ_j is the product c_j(Δ) = Π_{i<j} g_i(Δ) of the
    linear factors g_i = (Δ + ψ_{i−1})/ψ_i (ψ_{−1} = 0), so by Leibniz's rule for a
    linear factor c_j^(m) = c_{j−1}^(m) g_{j−1} + m c_{j−1}^(m−1)/ψ_{j−1}. The polynomial
    has degree k_used ≤ 5: derivatives above it are exactly zero. (Unrolled over the six
    rows: it runs inside the step loop, where a nested loop costs more than the
    arithmetic.)
    """
    delta = t - t_n
    m = np.arange(order + 1, dtype=psi.dtype)
    # The factors g_1..g_5 and the rows in use as one vector each (the same values as
    # row by row): under `vmap` every scalar-per-member operation of its own is an
    # operation of the batched step loop.
    psi_prev = jnp.concatenate([jnp.zeros((1,), psi.dtype), psi[:NPHI - 2]])
    g = (delta + psi_prev) / psi[:NPHI - 1]
    used = _ORDERS <= jnp.maximum(k_used, 1)
    prev = np.eye(1, order + 1, dtype=psi.dtype)[0]   # [1, 0, …]: c_0 = 1
    rows = [prev]
    for j in range(1, NPHI):
        lower = jnp.concatenate([jnp.zeros((1,), prev.dtype), prev[:-1]])
        prev = prev * g[j - 1] + m * lower / psi[j - 1]
        rows.append(where(used[j], prev, 0.0))
    return jnp.stack(rows, axis=1)


def interpolation_weights(t, t_n, psi, k_used):
    """(c, d): the weights of y(t) and y'(t) (`derivative_weights` of order 1)."""
    w = derivative_weights(t, t_n, psi, k_used, 1)
    return w[0], w[1]


def node_values_at_tn(t_n, phi, psi, k_used):
    """`node_values(phi, *interpolation_weights(t_n, t_n, psi, k_used))`: y and y' of the
    interpolating polynomial at the step's own end, which a step recorder writes after
    every accepted step. At Δ = 0 the factors of `derivative_weights` are g_0 = 0 and
    g_i = ψ_{i−1}/ψ_i, so c = (1, 0, …) (y = φ_0) and d_1 = 1/ψ_0, d_j = d_{j−1} g_{j−1}
    — the same operations on the same values as the general weights, whose other terms
    are exact zeros here (0·g + 0/ψ), so the same numbers for a finite history; without
    the general weights' other half, which a recording run computed every step."""
    if not small_rows(phi):
        return node_values(phi, *interpolation_weights(t_n, t_n, psi, k_used))
    g = psi[:NPHI - 2] / psi[1:NPHI - 1]
    used = _ORDERS <= jnp.maximum(k_used, 1)
    prev = 1.0 / psi[0]
    d = [jnp.zeros((), psi.dtype), prev]
    for j in range(2, NPHI):
        prev = prev * g[j - 2]
        d.append(prev)
    d = where(used, jnp.stack(d), 0.0)
    return phi[0], _row_sum(d, tuple(phi))


def interpolate(phi, c, d):
    return jnp.tensordot(c, phi, 1), jnp.tensordot(d, phi, 1)


def node_values(phi, c, d):
    """`interpolate` for the node a step recorder writes after every accepted step:
    for small rows (as in `predict`) the sums Σ c_j φ_j, Σ d_j φ_j unrolled over the six
    rows, which XLA fuses with their neighbours, instead of two dots, each an operation
    of its own in every step of a recording run (Robertson's kept-step stage: 2 of its
    25 operations a step). On the problems measured (Robertson's gradient, batched and
    not, kept and replayed; the heat gradient at n = 49) the numbers are those of the
    dots bit for bit."""
    if small_rows(phi):
        rows = tuple(phi)
        return _row_sum(c, rows), _row_sum(d, rows)
    return interpolate(phi, c, d)


def wrms(v: Float[Array, " n"], weights: Float[Array, " n"]) -> Float[Array, ""]:
    """Weighted root-mean-square norm (IDAS manual eq. (6.5)); length n even where weights
    are zero (IDAS's masked norm for suppressed algebraic components)."""
    if v.shape[0] == 0:
        return jnp.zeros((), v.dtype)
    return jnp.sqrt(jnp.mean((v * weights) ** 2))


def grouped_wrms(v: Float[Array, " n"], weights: Float[Array, " n"],
                 groups: int) -> Float[Array, ""]:
    """The largest `wrms` over `groups` equal consecutive blocks of v: the norm of k
    problems integrated as one (the adjoint's k cotangent directions), so that each is
    held to its own tolerance — IDAS's norm over sensitivities is the same maximum."""
    if groups == 1 or v.shape[0] == 0:
        return wrms(v, weights)
    return jnp.max(jnp.sqrt(jnp.mean((v * weights).reshape(groups, -1) ** 2, axis=1)))


def error_weights(y, rtol, atol):
    """W_i = 1/(rtol |y_i| + atol_i), IDAS manual eq. (6.5)."""
    return 1.0 / (rtol * jnp.abs(y) + atol)


__all__ = ["MAXORD", "NPHI", "Coefficients", "set_coefficients", "scale_history", "predict",
           "complete_history", "derivative_weights", "interpolation_weights", "interpolate",
           "wrms", "grouped_wrms", "error_weights"]
