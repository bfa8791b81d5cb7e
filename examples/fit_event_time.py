"""Fit a draining tank to the times at which it empties: parameters learned from *event
times* only, through the derivative of a terminal event's time.

Model (an index-1 DAE; level h in m, outflow q in m³/s, time in s):

    A h' = q_in − q          mass balance of the tank (differential)
    0    = q − k √h          Torricelli outflow through the valve (algebraic)

with cross-section A = 1 m², an unknown valve coefficient k (m^2.5/s) and an unknown
constant inflow q_in (m³/s). The experiment: fill the tank to h0, open the valve and
record the time t* at which the level reaches the cut-off h_min — a terminal event
`dae.Event(lambda t, y, yp, p: y[:1] - H_MIN, direction=-1)`. Nothing else is measured.

The fit is Gauss–Newton on the residuals r_i = t*(h0_i; k, q_in) − t*_obs,i: it needs the
Jacobian ∂t*/∂p, which daeadjoint gets from the implicit function theorem on
h(t*; p) = h_min (never from the root search's iterations) — here by `jax.jacfwd`, i.e.
forward sensitivities, under `jax.vmap` over the experiments. (k and q_in are strongly
correlated in these data: a first-order method such as Adam crawls along the valley,
Gauss–Newton converges in a few iterations.)

A check in closed form: with s = √h the model integrates to

    t*(h0) = (2A/k) [ (√h0 − √h_min) + (q_in/k) ln((k√h0 − q_in)/(k√h_min − q_in)) ],

so the script compares the solver's event times and their gradient with this formula,
and the fitted (k, q_in) with a least-squares fit of the formula itself (scipy).

Run:  python examples/fit_event_time.py [--quick] [--out fit_event_time.png]
"""

import argparse
import os
import time

# Small dense matrices: single-threaded LAPACK is faster (docs/performance.md).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax
import jax.numpy as jnp
import numpy as np

jax.config.update("jax_enable_x64", True)

import daeadjoint as dae  # noqa: E402

AREA = 1.0                 # m²
H_MIN = 0.25               # m, the cut-off level
TRUE = {"k": 0.05, "q_in": 0.01}        # m^2.5/s, m³/s (k √h_min > q_in: it does drain)
H0 = jnp.array([0.6, 1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0])   # m, one experiment each
NOISE = 0.3                # s, standard deviation of the recorded times
T_MAX = 500.0              # s, longer than any drain time: the event ends every solve


def residual(t, y, yp, log_p):
    """F(t, y, y', ln p) = 0 with y = (h, q); parameters by their logarithms (positive,
    and of comparable scale for the optimizer)."""
    k, q_in = jnp.exp(log_p)
    h, q = y
    return jnp.stack([AREA * yp[0] - (q_in - q), q - k * jnp.sqrt(h)])


DRAINED = dae.Event(lambda t, y, yp, log_p: y[:1] - H_MIN, terminal=True, direction=-1)


def drain_time(log_p, h0):
    """t* at which the level falls to H_MIN, starting full at h0 (consistent initial
    outflow and y'(0) by `init`: only h0 is given)."""
    k = jnp.exp(log_p[0])
    y0 = jnp.stack([h0, k * jnp.sqrt(h0)])
    sol = dae.solve(residual, 0.0, T_MAX, y0, None, log_p, algebraic=jnp.array([False, True]),
                    init="ya_ydp", rtol=1e-8, atol=1e-10, event=DRAINED)
    return sol.event_t


drain_times = jax.jit(jax.vmap(drain_time, in_axes=(None, 0)))


def closed_form(log_p, h0):
    k, q_in = jnp.exp(log_p)
    s0, s_min = jnp.sqrt(h0), jnp.sqrt(H_MIN)
    return (2 * AREA / k) * ((s0 - s_min)
                             + (q_in / k) * jnp.log((k * s0 - q_in) / (k * s_min - q_in)))


@jax.jit
def residuals_and_jacobian(log_p, t_obs):
    """r = t*(p) − t_obs and ∂r/∂ln p (8 × 2) by forward sensitivities."""
    def times(lp):
        return drain_times(lp, H0)

    return times(log_p) - t_obs, jax.jacfwd(times)(log_p)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short fit (smoke test)")
    parser.add_argument("--out", default="fit_event_time.png")
    opts = parser.parse_args()

    true = jnp.log(jnp.array([TRUE["k"], TRUE["q_in"]]))
    rng = np.random.default_rng(0)
    t_obs = closed_form(true, H0) + NOISE * jnp.asarray(rng.standard_normal(H0.shape))

    # 1. The solver against the closed form: event times and their Jacobian.
    r, J = residuals_and_jacobian(true, t_obs)
    t_exact = closed_form(true, H0)
    J_exact = jax.jacfwd(lambda lp: closed_form(lp, H0))(true)
    print(f"event times vs closed form: max rel. error "
          f"{float(jnp.max(jnp.abs(r + t_obs - t_exact) / t_exact)):.1e} (rtol 1e-8)")
    print(f"dt*/d ln p vs closed form:  max rel. error "
          f"{float(jnp.max(jnp.abs(J - J_exact)) / jnp.max(jnp.abs(J_exact))):.1e}")

    # 2. The fit: damped Gauss–Newton on the log-parameters from a guess a factor 2 off.
    log_p = jnp.log(jnp.array([0.1, 0.004]))
    guess = log_p
    iterations = 6 if opts.quick else 20
    start = time.perf_counter()
    history = []
    r, J = residuals_and_jacobian(log_p, t_obs)
    for it in range(iterations):
        cost = float(jnp.mean(r**2))
        history.append(cost)
        k, q = np.exp(np.asarray(log_p))
        print(f"iter {it:3d}  mean squared error {cost:12.6f} s²  k {k:.6f}  q_in {q:.6f}  "
              f"({time.perf_counter() - start:.1f} s)")
        if it > 0 and history[-2] - cost <= 1e-10 * cost:
            print("converged: the error no longer decreases")
            break
        step = -jnp.linalg.lstsq(J, r)[0]
        for _ in range(20):               # halve the step until the error decreases
            r_new, J_new = residuals_and_jacobian(log_p + step, t_obs)
            if float(jnp.mean(r_new**2)) < cost:
                break
            step = step / 2
        else:
            print("no decrease along the Gauss-Newton step: converged")
            break
        log_p, r, J = log_p + step, r_new, J_new

    # 3. The same least-squares problem solved with the closed form (scipy), as a check.
    from scipy.optimize import least_squares
    ref = least_squares(lambda lp: np.asarray(closed_form(jnp.asarray(lp), H0) - t_obs),
                        np.asarray(guess)).x
    k, q = np.exp(np.asarray(log_p))
    print(f"fitted      k = {k:.7f}, q_in = {q:.7f}")
    print(f"closed-form k = {np.exp(ref[0]):.7f}, q_in = {np.exp(ref[1]):.7f} "
          f"(least squares of the formula)")
    print(f"true        k = {TRUE['k']:.7f}, q_in = {TRUE['q_in']:.7f}")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4.2))
    ts = jnp.linspace(0.0, float(jnp.max(t_obs)) * 1.1, 300)
    for h0 in H0:
        kk = jnp.exp(log_p[0])
        y0 = jnp.stack([h0, kk * jnp.sqrt(h0)])
        sol = dae.solve(residual, 0.0, float(ts[-1]), y0, None, log_p, saveat=ts,
                        algebraic=jnp.array([False, True]), init="ya_ydp", rtol=1e-8,
                        atol=1e-10, event=DRAINED)
        reached = jnp.isfinite(sol.ys[:, 0])
        ax1.plot(ts[reached], sol.ys[reached, 0], color="tab:blue", lw=1)
        ax1.plot(sol.event_t, H_MIN, "o", color="tab:red", ms=4)
    ax1.axhline(H_MIN, color="k", ls=":", lw=1, label="cut-off $h_{min}$")
    ax1.set(xlabel="time t (s)", ylabel="level h (m)", title="fitted model: drains to the cut-off")
    ax1.legend()
    hh = jnp.linspace(float(H0[0]) * 0.9, float(H0[-1]) * 1.05, 100)
    ax2.plot(H0, t_obs, "ko", label="recorded drain times")
    ax2.plot(hh, closed_form(guess, hh), "--", color="gray", label="initial guess")
    ax2.plot(hh, closed_form(log_p, hh), color="tab:blue", label="fitted (daeadjoint)")
    ax2.plot(hh, closed_form(true, hh), ":", color="tab:green", label="true")
    ax2.set(xlabel="initial level $h_0$ (m)", ylabel="drain time $t^*$ (s)",
            title="event times: data and fit")
    ax2.legend()
    ax3.semilogy(history)
    ax3.set(xlabel="Gauss-Newton iteration", ylabel="mean squared time error (s²)",
            title="loss")
    fig.tight_layout()
    fig.savefig(opts.out, dpi=110)
    print(f"wrote {opts.out}")


if __name__ == "__main__":
    main()
