"""The object `solve` returns."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float


class EventRoots(eqx.Module):
    """The roots of an `Event`'s condition recorded by a solve (`Solution.events`), up to
    `Event.max_roots` of them in time order; unused rows have t = `inf`.

    **Attributes:**

    - `ts`: (R,) root times t*.
    - `ys`, `yps`: (R, n) y(t*) and y'(t*).
    - `masks`: (R, n_ev) which components of `cond` crossed zero at each root.

    Times and states are differentiable (the implicit function theorem on cond = 0).
    Under `jax.vmap` every array gains the batch axes in front.
    """

    ts: Float[Array, "*batch R"]
    ys: Float[Array, "*batch R n"]
    yps: Float[Array, "*batch R n"]
    masks: Bool[Array, "*batch R n_ev"]


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
    - `result`: a `RESULTS` item; `RESULTS.successful` on success (`RESULTS.event` when a
      terminal event stopped the solve, also a success). On failure with `throw=False`,
      rows of `ys`/`yps`/`qs` at times the solver never reached are `inf` (never NaN),
      `stats["t_final"]` says how far it got, and derivatives are NaN.
    - `events`: with `event=`, the recorded roots of its condition (`EventRoots`: `ts`,
      `ys`, `yps`, `masks`); None without an event. The first root is also
      `event_t`, `event_y`, `event_yp`, `event_mask`: t* (`inf` if none), y(t*), y'(t*)
      and which components of `cond` crossed zero there; all differentiable (the
      implicit function theorem on cond = 0). `event_ts`, `event_ys`, `event_yps`,
      `event_masks` are `events.ts`, … (every recorded root, `Event.max_roots`).
    - `step_ts`, `step_ys` (with `steps=True` or `dense=True`): the accepted step
      sequence (t_n, y_n), n = 0 … num_steps, then inf; and `evaluate(t)` (with
      `dense=True`): the solution anywhere in [t0, t_final] from the stored interpolating
      polynomials. These depend on step-size decisions, so they are not differentiable
      (differentiating them raises); differentiate `ys` at `saveat` instead.
    """

    ts: Float[Array, " n_save"]
    ys: Float[Array, "n_save n"]
    yps: Float[Array, "n_save n"]
    qs: Float[Array, "n_save nq"] | None
    stats: dict[str, Any]
    result: Any
    events: EventRoots | None = None
    dense: Any = None
    # 0·Σ(differentiable inputs), set with `dense`/`steps`: its tangent is
    # nonzero-structured exactly when the solve is being differentiated, which the
    # step-data accessors refuse (`_no_derivative`). Private: not an output.
    _sentinel: Any = None

    # The first root (index 0 of the root axis, after any batch axes of jax.vmap) and
    # every root, by the names of DESIGN.md and of earlier releases.
    @property
    def event_t(self) -> Float[Array, "*batch"] | None:
        return None if self.events is None else self.events.ts[..., 0]

    @property
    def event_y(self) -> Float[Array, "*batch n"] | None:
        return None if self.events is None else self.events.ys[..., 0, :]

    @property
    def event_yp(self) -> Float[Array, "*batch n"] | None:
        return None if self.events is None else self.events.yps[..., 0, :]

    @property
    def event_mask(self) -> Bool[Array, "*batch n_ev"] | None:
        return None if self.events is None else self.events.masks[..., 0, :]

    @property
    def event_ts(self) -> Float[Array, "*batch R"] | None:
        return None if self.events is None else self.events.ts

    @property
    def event_ys(self) -> Float[Array, "*batch R n"] | None:
        return None if self.events is None else self.events.ys

    @property
    def event_yps(self) -> Float[Array, "*batch R n"] | None:
        return None if self.events is None else self.events.yps

    @property
    def event_masks(self) -> Bool[Array, "*batch R n_ev"] | None:
        return None if self.events is None else self.events.masks

    @property
    def step_ts(self):
        return None if self.dense is None else self._guard(self.dense.t, "sol.step_ts")

    @property
    def step_ys(self):
        return None if self.dense is None else self._guard(self.dense.y, "sol.step_ys")

    def _guard(self, x, what):
        return _no_derivative(x, self._sentinel, what)

    def evaluate(self, t: ArrayLike, derivative: int = 0):
        """y(t) (or y^(derivative)(t), derivative ≤ 5) for t in [t0, t_final], from the
        stored interpolants (needs `solve(..., dense=True)`); t may be an array.

        Outside [t0, t_final] there is no solution to evaluate (the interpolants would
        extrapolate): a `ValueError` when t and the solution are concrete; under
        `jax.jit` an `equinox` run-time error, and NaN at those times where errors are
        turned off (`EQX_ON_ERROR=nan` or `off`)."""
        if self.dense is None or not self.dense.interpolant:
            raise ValueError("Solution.evaluate needs solve(..., dense=True).")
        dense = self._guard(self.dense, "Solution.evaluate")
        t = jnp.asarray(t, dense.t.dtype)
        t_lo = dense.t[..., 0]
        t_hi = jnp.take_along_axis(dense.t, jnp.asarray(dense.count)[..., None], axis=-1)[..., 0]
        outside = (t < t_lo) | (t > t_hi)
        try:
            bad = np.asarray(outside)
        except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
            bad = None
        if bad is not None and np.any(bad):
            raise ValueError(
                f"Solution.evaluate: t = {np.asarray(t)[bad].reshape(-1)[:4].tolist()} lies "
                f"outside the solved interval [t0, t_final] = [{float(np.min(t_lo))}, "
                f"{float(np.max(t_hi))}]: there is no solution there to evaluate.")
        fn = lambda tau: dense.evaluate(tau, derivative)  # noqa: E731
        y = fn(t) if t.ndim == 0 else jax.vmap(fn)(t.reshape(-1)).reshape(t.shape + (-1,))
        y = jnp.where(outside[..., None], jnp.nan, y)
        if bad is None:
            y = eqx.error_if(y, jnp.any(outside),
                             "Solution.evaluate: t lies outside the solved interval [t0, "
                             "t_final]: there is no solution there to evaluate.")
        return y

    def __repr__(self):
        def shape(x):
            return None if x is None else tuple(np.shape(x))

        try:
            result = repr(self.result).split("<")[-1].split(":")[0].rstrip(">")
            steps = int(self.stats["num_steps"])
            t_final = float(self.stats["t_final"])
            extra = f", num_steps={steps}, t_final={t_final:.6g}"
        except Exception:   # noqa: BLE001 - traced or batched: shapes only
            result, extra = "traced", ""
        parts = [f"result={result}{extra}", f"ts={shape(self.ts)}", f"ys={shape(self.ys)}"]
        if self.qs is not None:
            parts.append(f"qs={shape(self.qs)}")
        if self.events is not None:
            parts.append(f"events.ts={shape(self.events.ts)}")
        return "Solution(" + ", ".join(parts) + ")"


def _no_derivative(x, sentinel, what: str):
    """x itself; raises if `sentinel` (`Solution._sentinel`) carries a tangent, i.e.
    the solve is being differentiated: step data depend on the step sizes, whose
    derivatives the solver never takes, and a zero derivative would be silently wrong."""

    @jax.custom_jvp
    def guard(s):
        return s

    @guard.defjvp
    def guard_jvp(primals, tangents):
        raise ValueError(
            f"daeadjoint: {what} is not differentiable (it depends on the step sizes, "
            "which are never differentiated); differentiate sol.ys at `saveat` times.")

    if sentinel is not None:
        guard(sentinel)
    return x
