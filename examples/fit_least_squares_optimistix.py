"""Levenberg–Marquardt through `solve` (optimistix), with parameter standard errors:
the Barnes predator–prey fit of least_squares_barnes.py, done as a least-squares problem.

    x' = p1 x − p2 x y          (prey)
    y' = p2 x y − p3 y          (predator),     t ∈ [0, 20]

Unknowns θ = (ln p1, ln p2, ln p3, ln x0, ln y0) (positive by construction); data: both
populations at n_o equally spaced times with noise σ·N(0, 1), σ = 0.01, generated from
p = (1, 1, 1), (x0, y0) = (1, 0.3) — the R6 problem of Calver & Enright, *Numerical
methods for computing sensitivities for ODEs and DDEs*; same model, data and tolerances
as least_squares_barnes.py.

Residuals r(θ) = y(t_i; θ) − data_i ∈ R^m, m = 2 n_o; S(θ) = ½‖r‖².

- **Fit.** `optimistix.LevenbergMarquardt` minimises S from the residual function alone.
  It builds J = ∂r/∂θ (m × 5) in forward mode (`jax.linearize`), which through
  `dae.solve` is one forward-sensitivity solve with 5 directions (the staggered
  corrector: the state's factorization, one linear solve per direction and step) —
  the cheap direction here, 5 parameters against m = 800 residuals.
- **Standard errors.** Near the minimum θ̂, with independent N(0, σ²) noise,
  cov(θ̂) ≈ σ̂² (JᵀJ)⁻¹ with σ̂² = ‖r(θ̂)‖² / (m − 5) (the Gauss–Newton approximation),
  or σ̂² H⁻¹ with H = ∇²S(θ̂) = JᵀJ + Σ r_i ∇²r_i, here from `jax.hessian(S)` (forward
  over the adjoint, through `solve`). The two agree when the residuals are small.
  SEs of p = exp(θ) by the delta method: SE(p) = p · SE(ln p).
- **Checks.** The fitted values are compared with an L-BFGS fit of the same S (optax,
  reverse-mode gradients: the default `sensitivity`, the discrete adjoint for this many
  observations, as in least_squares_barnes.py); the true parameters should lie within
  ~2 SE of θ̂; and (full run) the spread of LM fits over fresh noise realizations
  should match the SEs.

Run:  python examples/fit_least_squares_optimistix.py [--quick] [--observations 400]
          [--replicates 20] [--out fit_least_squares_optimistix.png]
"""

import argparse
import os
import time

# Small dense matrices: single-threaded LAPACK is faster (docs/performance.md).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

jax.config.update("jax_enable_x64", True)

import optax  # noqa: E402
import optimistix as optx  # noqa: E402

import daeadjoint as dae  # noqa: E402

T1 = 20.0
P_TRUE = np.array([1.0, 1.0, 1.0])
Y0_TRUE = np.array([1.0, 0.3])
THETA_TRUE = jnp.log(jnp.concatenate([jnp.asarray(P_TRUE), jnp.asarray(Y0_TRUE)]))
THETA0 = jnp.log(jnp.array([1.2, 0.85, 0.9, 0.9, 0.35]))   # least_squares_barnes's start
NOISE = 0.01
NAMES = ["p1", "p2", "p3", "x0", "y0"]


def residual(t, y, yp, p):
    return yp - jnp.stack([p[0] * y[0] - p[1] * y[0] * y[1], p[1] * y[0] * y[1] - p[2] * y[1]])


def simulate(theta, ts):
    """Both populations at ts, (len(ts), 2). Default `sensitivity`; y'(0) from y0."""
    sol = dae.solve(residual, 0.0, T1, jnp.exp(theta[3:]), args=jnp.exp(theta[:3]),
                    saveat=ts, rtol=1e-7, atol=1e-9, max_steps=4000)
    return sol.ys


def make_data(ts, seed):
    clean = jax.jit(simulate)(THETA_TRUE, ts)
    return clean + NOISE * jax.random.normal(jax.random.PRNGKey(seed), clean.shape)


def residuals(theta, args):
    """optimistix's fn(y, args) -> (residual vector, aux); args = (ts, data)."""
    ts, data = args
    return jnp.ravel(simulate(theta, ts) - data), None


class LM:
    """optimistix's LM stepped from Python (its documented interactive API: init, step,
    terminate), so that each iteration can print; one compilation serves every data set."""

    def __init__(self, theta0, args):
        self.solver = optx.LevenbergMarquardt(rtol=1e-6, atol=1e-6)
        kw = dict(fn=residuals, options={}, tags=frozenset())
        self.step = eqx.filter_jit(eqx.Partial(self.solver.step, **kw))
        self.terminate = eqx.filter_jit(eqx.Partial(self.solver.terminate, **kw))
        f_struct = jax.ShapeDtypeStruct((args[1].size,), args[1].dtype)
        # The initial state holds no data (its Jacobian is a zero-filled placeholder), and
        # its static part keys filter_jit's cache: build it once, so that one compilation
        # serves every fit.
        self.state0 = self.solver.init(residuals, theta0, args, {}, f_struct, None, frozenset())

    def fit(self, theta0, args, max_steps=60, log=None):
        state = eqx.tree_at(lambda s: s.y_eval, self.state0, theta0)
        theta, history = theta0, []
        for it in range(max_steps):
            done, result = self.terminate(y=theta, args=args, state=state)
            if bool(done):
                break
            theta, state, _ = self.step(y=theta, args=args, state=state)
            if log is not None:
                history.append(log(it, theta))
        return theta, history, it, result


def fmt(v, spec=".4f"):
    return "(" + ", ".join(format(float(x), spec) for x in v) + ")"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="CI smoke run: 50 observations, 3 replicates, 5 L-BFGS steps")
    parser.add_argument("--observations", type=int, default=400)
    parser.add_argument("--replicates", type=int, default=20,
                        help="noise realizations refitted to check the standard errors")
    parser.add_argument("--out", default="fit_least_squares_optimistix.png")
    args = parser.parse_args()
    n_obs, reps, lbfgs_its = (50, 3, 5) if args.quick else (args.observations,
                                                           args.replicates, 60)
    ts = jnp.linspace(T1 / n_obs, T1, n_obs)
    data = make_data(ts, 0)
    m = data.size
    S = jax.jit(lambda th, data: 0.5 * jnp.sum((simulate(th, ts) - data) ** 2))

    # ---- Levenberg–Marquardt (forward-mode Jacobians through solve)
    lm = LM(THETA0, (ts, data))

    def log(it, theta):
        value = float(S(theta, data))
        print(f"LM step {it:2d}  S = {value:.6e}  p, y0 = {fmt(jnp.exp(theta))}", flush=True)
        return value

    print(f"Barnes predator-prey, {n_obs} observations per species (m = {m} residuals)")
    start = time.perf_counter()
    theta_lm, lm_hist, n_lm, result = lm.fit(THETA0, (ts, data), log=log)
    status = "converged" if result == optx.RESULTS.successful else "NOT converged"
    print(f"LM: {status} after {n_lm} steps in {time.perf_counter() - start:.1f} s "
          f"(compilation included)")

    # ---- standard errors: Gauss–Newton JᵀJ and the Hessian of S
    r = residuals(theta_lm, (ts, data))[0]
    sigma2 = float(jnp.sum(r ** 2) / (m - 5))
    start = time.perf_counter()
    J = jax.jit(jax.jacfwd(lambda th: residuals(th, (ts, data))[0]))(theta_lm)
    t_J = time.perf_counter() - start
    start = time.perf_counter()
    H = jax.jit(jax.hessian(S))(theta_lm, data)
    t_H = time.perf_counter() - start
    cov_J = sigma2 * jnp.linalg.inv(J.T @ J)
    cov_H = sigma2 * jnp.linalg.inv(H)
    est = jnp.exp(theta_lm)
    se_J = est * jnp.sqrt(jnp.diag(cov_J))      # delta method: SE(e^θ) = e^θ SE(θ)
    se_H = est * jnp.sqrt(jnp.diag(cov_H))
    print(f"σ̂ = {np.sqrt(sigma2):.5f} (noise σ = {NOISE}); J ({J.shape[0]}×{J.shape[1]}) by "
          f"jax.jacfwd in {t_J:.1f} s, H by jax.hessian in {t_H:.1f} s (compilation "
          f"included); ‖H − JᵀJ‖/‖JᵀJ‖ = "
          f"{float(jnp.linalg.norm(H - J.T @ J) / jnp.linalg.norm(J.T @ J)):.1e}")
    corr = cov_J / jnp.sqrt(jnp.outer(jnp.diag(cov_J), jnp.diag(cov_J)))
    print("correlation of ln θ̂ (JᵀJ): largest off-diagonal "
          f"{float(jnp.max(jnp.abs(corr - jnp.eye(5)))):.2f}")

    # ---- the optax fit (L-BFGS on S, reverse-mode gradients), same data and start
    optimizer = optax.lbfgs()
    loss = lambda th: S(th, data)  # noqa: E731
    value_and_grad = optax.value_and_grad_from_state(loss)

    @jax.jit
    def lbfgs_step(theta, state):
        value, grad = value_and_grad(theta, state=state)
        updates, state = optimizer.update(grad, state, theta, value=value, grad=grad,
                                          value_fn=loss)
        return optax.apply_updates(theta, updates), state, optax.tree_utils.tree_norm(grad)

    start = time.perf_counter()
    theta_ox, state, ox_hist = THETA0, optimizer.init(THETA0), []
    for it in range(lbfgs_its):  # noqa: B007 (read after the loop: the step count)
        theta_ox, state, grad_norm = lbfgs_step(theta_ox, state)
        ox_hist.append(float(S(theta_ox, data)))
        if grad_norm < 1e-7:
            break
    print(f"optax L-BFGS: {it + 1} steps in {time.perf_counter() - start:.1f} s, "
          f"S = {ox_hist[-1]:.6e} (LM: {float(S(theta_lm, data)):.6e})")
    ox = jnp.exp(theta_ox)

    truth = np.concatenate([P_TRUE, Y0_TRUE])
    print("\n| parameter | true | LM (optimistix) | L-BFGS (optax) | SE from JᵀJ | SE from "
          "Hessian | (LM − true) / SE |")
    print("|---|---|---|---|---|---|---|")
    for j, name in enumerate(NAMES):
        print(f"| {name} | {truth[j]:g} | {float(est[j]):.5f} | {float(ox[j]):.5f} "
              f"| {float(se_J[j]):.5f} | {float(se_H[j]):.5f} "
              f"| {float((est[j] - truth[j]) / se_J[j]):+.2f} |")
    print(f"\nLM − L-BFGS, relative to the SE: {fmt((est - ox) / se_J, '+.2e')}")

    # ---- SEs against the spread of fits to fresh noise realizations
    fits = []
    if reps:
        start = time.perf_counter()
        for seed in range(1, reps + 1):
            th, _, _, _ = lm.fit(THETA0, (ts, make_data(ts, seed)))
            fits.append(np.exp(np.asarray(th)))
        fits = np.array(fits)
        print(f"\n{reps} more noise realizations refitted by LM in "
              f"{time.perf_counter() - start:.1f} s:")
        print(f"  std of the fits     {fmt(fits.std(axis=0, ddof=1), '.5f')}")
        print(f"  SE (JᵀJ), seed 0    {fmt(se_J, '.5f')}")
        if reps >= 10:
            print(f"  (a std from {reps} fits is itself uncertain by "
                  f"~{100 / np.sqrt(2 * (reps - 1)):.0f}%)")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fine = jnp.linspace(0.0, T1, 400)
    fitted = jax.jit(simulate)(theta_lm, fine)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    for i, name in enumerate(["prey x", "predator y"]):
        ax.plot(ts, data[:, i], ".", ms=3, alpha=0.6, label=f"data, {name}")
        ax.plot(fine, fitted[:, i], "-", color=ax.lines[-1].get_color(),
                label=f"LM fit, {name}")
    ax.set_xlabel("time t (model units)")
    ax.set_ylabel("population (model units)")
    ax.set_title(f"Barnes predator–prey: {n_obs} observations per species")
    ax.set_ylim(0.0, 1.35 * float(jnp.max(data)))
    ax.legend(fontsize=7, ncol=2, loc="upper center")

    ax = axes[1]
    ax.semilogy(np.arange(1, len(lm_hist) + 1), lm_hist, "o-", ms=3,
                label="Levenberg–Marquardt (optimistix, jacfwd)")
    ax.semilogy(np.arange(1, len(ox_hist) + 1), ox_hist, "s-", ms=3,
                label="L-BFGS (optax, adjoint gradients)")
    ax.axhline(NOISE ** 2 * (m - 5) / 2, color="0.5", ls="--", label="noise level σ²(m−5)/2")
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss S (model units²)")
    ax.set_title("Convergence from the same start")
    ax.legend(fontsize=8)

    ax = axes[2]
    x = np.arange(5)
    ax.errorbar(x - 0.15, est / truth, yerr=2 * se_J / truth, fmt="o", capsize=3,
                label="LM fit ± 2 SE (JᵀJ)")
    ax.errorbar(x, est / truth, yerr=2 * se_H / truth, fmt="none", capsize=3, ecolor="C2",
                label="± 2 SE (Hessian)")
    ax.plot(x + 0.15, ox / truth, "s", label="L-BFGS fit")
    if len(fits):
        ax.plot(np.ravel(np.repeat(x[None] + 0.3, len(fits), 0)), np.ravel(fits / truth),
                ".", color="0.5", ms=3, label=f"LM fits, {len(fits)} other noise draws")
    ax.axhline(1.0, color="0.5", ls="--")
    ax.set_xticks(x, [f"${n[0]}_{n[1]}$" for n in NAMES])
    ax.set_xlabel("parameter")
    ax.set_ylabel("estimate / true value (1)")
    ax.set_title("Estimates and standard errors")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
