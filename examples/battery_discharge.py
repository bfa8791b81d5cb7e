"""A battery discharged at constant power to a cut-off voltage: an index-1 equivalent-
circuit model, a terminal event on an *algebraic* unknown, and the sensitivities of the
run time to every cell parameter, for a sweep of discharge powers at once.

Model (Thevenin equivalent circuit; z state of charge, v1 the RC-pair voltage in V,
V the terminal voltage in V, I the current in A, time in s):

    z'  = −I / (3600 Q)                          charge balance, Q the capacity in Ah
    v1' = −v1 / (R1 C1) + I / C1                 polarization (RC pair)
    0   = V − (U(z) − v1 − R0 I)                 terminal voltage: open-circuit voltage
                                                 minus the overpotentials (algebraic)
    0   = V I − P                                constant-power load (algebraic)

with the open-circuit voltage U(z) of a lithium-ion-like cell. V and I are algebraic
(the Jacobian of the last two equations with respect to (V, I) is [[1, R0], [I, V]],
nonsingular while V > R0 I, i.e. away from the maximum-power point): index 1. Only z and
v1 are given at t = 0; `init="ya_ydp"` computes the consistent V, I and y'(0).

The discharge stops when V reaches the cut-off V_cut — `dae.Event` on the algebraic V,
terminal, direction −1. The run time t* is the quantity of interest; its elasticities
∂ln t*/∂ln θ with respect to θ = (Q, R0, R1, C1, P) come from `jax.jacfwd` (forward
sensitivities plus the implicit function theorem at t*: never the root search's
iterations), for all powers by one `jax.vmap`; one of them is checked against central
differences. The script plots the voltage curves, the run time against power (a Ragone
curve) and the elasticities.

Run:  python examples/battery_discharge.py [--quick] [--out battery_discharge.png]
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

NAMES = ("Q", "R0", "R1", "C1", "P")
UNITS = ("Ah", "Ω", "Ω", "F", "W")
THETA = jnp.array([3.0, 0.03, 0.02, 2000.0, 10.0])   # a 3 Ah cell discharged at 10 W
V_CUT = 3.0                                          # V
ALGEBRAIC = jnp.array([False, False, True, True])
T_MAX = 12 * 3600.0                                  # s: beyond every run time here


def open_circuit_voltage(z):
    """U(z) in V: a smooth lithium-ion-like curve, 3.0 V empty to 4.2 V full, steep
    at both ends."""
    return 3.55 + 0.55 * z + 0.08 * jnp.log(z / (1.0 - z + 1e-3)) - 0.1 * jnp.exp(-30 * z)


def residual(t, y, yp, log_theta):
    """F(t, y, y', ln θ) = 0 with y = (z, v1, V, I); parameters by their logarithms."""
    q, r0, r1, c1, p = jnp.exp(log_theta)
    z, v1, v, i = y
    return jnp.stack([
        yp[0] + i / (3600.0 * q),
        yp[1] + v1 / (r1 * c1) - i / c1,
        v - (open_circuit_voltage(z) - v1 - r0 * i),
        v * i - p,
    ])


CUT_OFF = dae.Event(lambda t, y, yp, log_theta: y[2:3] - V_CUT, terminal=True, direction=-1)


def y0_guess(log_theta):
    """Full and relaxed (z = 0.98, v1 = 0); V, I are guesses the initialization corrects."""
    p = jnp.exp(log_theta[4])
    u = open_circuit_voltage(0.98)
    return jnp.array([0.98, 0.0, u, p / u])


def discharge(log_theta, saveat=None):
    return dae.solve(residual, 0.0, T_MAX, y0_guess(log_theta), None, log_theta,
                     algebraic=ALGEBRAIC, init="ya_ydp", saveat=saveat,
                     rtol=1e-8, atol=1e-10, event=CUT_OFF)


def run_time(log_theta):
    return discharge(log_theta).event_t


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer powers (smoke test)")
    parser.add_argument("--out", default="battery_discharge.png")
    opts = parser.parse_args()

    powers = jnp.geomspace(2.0, 40.0, 4 if opts.quick else 16)     # W
    log_thetas = jnp.log(jnp.stack([THETA.at[4].set(p) for p in powers]))

    start = time.perf_counter()
    times, elasticities = jax.jit(jax.vmap(
        lambda lt: (run_time(lt), jax.jacfwd(lambda x: jnp.log(run_time(x)))(lt))))(log_thetas)
    times, elasticities = np.asarray(times), np.asarray(elasticities)
    print(f"{len(powers)} discharges and their run-time elasticities in one vmap(jacfwd): "
          f"{time.perf_counter() - start:.1f} s (including compilation)")
    for p, t, e in zip(np.asarray(powers), times, elasticities):
        print(f"  P = {p:5.1f} W: run time {t / 60:7.2f} min,  ∂ln t*/∂ln θ = "
              + ", ".join(f"{n} {v:+.3f}" for n, v in zip(NAMES, e)))

    # Check one column against central differences of the run time itself.
    k, j = len(powers) // 2, 1                    # R0 at a middle power
    h = 1e-4
    lt = log_thetas[k]
    fd = (np.log(float(run_time(lt.at[j].add(h)))) - np.log(float(run_time(lt.at[j].add(-h))))) / (2 * h)
    print(f"check: ∂ln t*/∂ln R0 at {float(powers[k]):.1f} W: jacfwd {elasticities[k, j]:+.6f}, "
          f"central differences {fd:+.6f}")
    # Doubling the capacity doubles the run time (z' ∝ 1/Q, nothing else depends on Q
    # except the RC relaxation, negligible over hours): the Q elasticity is close to 1.
    print(f"Q elasticity range: {elasticities[:, 0].min():.4f} … {elasticities[:, 0].max():.4f}")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4.2))
    cmap = plt.get_cmap("viridis")
    for idx in range(0, len(powers), max(1, len(powers) // 5)):
        ts = jnp.linspace(0.0, float(times[idx]) * 1.05, 200)
        sol = discharge(log_thetas[idx], saveat=ts)
        ok = np.isfinite(np.asarray(sol.ys[:, 2]))
        color = cmap(idx / max(1, len(powers) - 1))
        ax1.plot(np.asarray(ts)[ok] / 60, np.asarray(sol.ys[ok, 2]), color=color,
                 label=f"{float(powers[idx]):.1f} W")
        ax1.plot(float(sol.event_t) / 60, V_CUT, "o", color="tab:red", ms=4)
    ax1.axhline(V_CUT, color="k", ls=":", lw=1)
    ax1.set(xlabel="time (min)", ylabel="terminal voltage V (V)",
            title="constant-power discharges to the cut-off")
    ax1.legend(fontsize=8)
    ax2.loglog(np.asarray(powers), times / 3600, "o-")
    ax2.set(xlabel="discharge power P (W)", ylabel="run time t* (h)",
            title="run time against power (Ragone)")
    for j, name in enumerate(NAMES):
        ax3.semilogx(np.asarray(powers), elasticities[:, j], label=f"{name} ({UNITS[j]})")
    ax3.axhline(0, color="k", lw=0.5)
    ax3.set(xlabel="discharge power P (W)", ylabel="∂ln t* / ∂ln θ",
            title="run-time elasticities (jax.jacfwd)")
    ax3.legend(fontsize=8)
    ticks = [2, 5, 10, 20, 40]
    for ax in (ax2, ax3):
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
    ax2.set_yticks([0.2, 0.5, 1, 2, 5], ["0.2", "0.5", "1", "2", "5"])
    fig.tight_layout()
    fig.savefig(opts.out, dpi=110)
    print(f"wrote {opts.out}")


if __name__ == "__main__":
    main()
