"""The object `solve` returns."""

from typing import Any

import equinox as eqx
from jaxtyping import Array, Float


class Solution(eqx.Module):
    """Result of `daeadjoint.solve`.

    **Attributes:**

    - `ts`: (n_save,) output times (the `saveat` argument; default `[t1]`).
    - `ys`, `yps`: (n_save, n) y and y' at `ts`, from the BDF interpolating polynomial.
    - `qs`: (n_save, n_q) integrals ∫_{t0}^{ts[i]} q dt, or None without `quadrature`.
    - `stats`: dict of IDAS-style counters (`num_steps`, `num_residual_evals`,
      `num_jacobian_evals`, `num_nonlinear_iters`, `num_error_test_failures`,
      `num_nonlinear_convergence_failures`, `num_quadrature_evals`) and `t_final`, the
      last time reached (≥ t1 on success: the integrator may step past t1 unless `tstop`).
    - `result`: a `RESULTS` item; `RESULTS.successful` on success. On failure with
      `throw=False`, rows of `ys`/`yps`/`qs` at times the solver never reached are `inf`
      (never NaN), and `stats["t_final"]` says how far it got.
    """

    ts: Float[Array, " n_save"]
    ys: Float[Array, "n_save n"]
    yps: Float[Array, "n_save n"]
    qs: Float[Array, "n_save nq"] | None
    stats: dict[str, Any]
    result: Any
