"""A diode rectifier with an RC filter: an index-1 circuit DAE, a load sweep under
`jax.vmap`, and the sensitivities of the output voltage by `jax.vmap(jax.grad(...))`.

Circuit (modified nodal analysis; node voltages in V, currents in A, time in s):

    v_s(t) = V0 sin(2π f t) ──R_s── node 2 ──|>|── node 3 ──R_f── node 4
    (node 1)                        (diode)      │              │
                                                 C1            C2   R_L
                                                 │              │    │
                                                ground        ground ground

Unknowns y = (v1, v2, v3, v4):

    0 = v1 − v_s(t)                                   source node: algebraic
    0 = (v1 − v2)/R_s − i_D(v2 − v3)                  node 2 has no capacitor: algebraic
    v3' = (i_D(v2 − v3) − (v3 − v4)/R_f) / C1         differential
    v4' = ((v3 − v4)/R_f − v4/R_L) / C2               differential

with the Shockley diode i_D(v) = I_s (exp(v/(n V_T)) − 1). The DAE has index 1: the
algebraic equations determine (v1, v2) because ∂/∂v2 = −1/R_s − i_D' < 0.

The quantity of interest is the mean output voltage over the last period,
V̄ = (1/T) ∫ v4 dt (a quadrature). The script sweeps the load R_L, and computes the
normalized sensitivities (elasticities) ∂ln V̄/∂ln p of V̄ with respect to every circuit
parameter p, for every load at once, by the adjoint DAE.

Run:  python examples/rectifier_circuit.py [--quick] [--out rectifier_circuit.png]
"""

import argparse
import os
import time

# Small dense matrices: single-threaded LAPACK is faster (docs/performance.md).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax
import jax.numpy as jnp

jax.config.update("jax_enable_x64", True)

import daeadjoint as dae  # noqa: E402

V0 = 10.0            # source amplitude, V
FREQ = 50.0          # source frequency, Hz
PERIOD = 1.0 / FREQ
I_S = 1e-9           # diode saturation current, A
N_VT = 2 * 0.025852  # emission coefficient × thermal voltage at 300 K, V
# Parameters differentiated: R_s, C1, R_f, C2 (R_L is swept and differentiated too).
NAMES = ("R_s", "C1", "R_f", "C2", "R_L")
P_NOMINAL = {"R_s": 2.0, "C1": 100e-6, "R_f": 20.0, "C2": 220e-6}   # Ω, F, Ω, F
ALGEBRAIC = jnp.array([True, True, False, False])


def diode(v):
    return I_S * jnp.expm1(v / N_VT)


def residual(t, y, yp, log_p):
    """F(t, y, y', ln p) = 0; parameters enter through their logarithms so that the
    gradient is directly the elasticity ∂V̄/∂ln p."""
    r_s, c1, r_f, c2, r_l = jnp.exp(log_p)
    v1, v2, v3, v4 = y
    i_d = diode(v2 - v3)
    return jnp.stack([
        v1 - V0 * jnp.sin(2 * jnp.pi * FREQ * t),
        (v1 - v2) / r_s - i_d,
        yp[2] - (i_d - (v3 - v4) / r_f) / c1,
        yp[3] - ((v3 - v4) / r_f - v4 / r_l) / c2,
    ])


def solve(log_p, t1, saveat):
    # Start discharged; init="ya_ydp" computes the algebraic node voltages and v3', v4'
    # (not v1', v2': the algebraic components' y' are left at 0). The node voltages
    # follow the differential ones through the algebraic equations, so they are left out
    # of the local error test (IDAS's IDASetSuppressAlg): with them in, the first step
    # fails, since the predictor's v1' = 0 misses the source's 3 kV/s slope.
    return dae.solve(residual, 0.0, t1, jnp.zeros(4), args=log_p, saveat=saveat,
                     algebraic=ALGEBRAIC, init="ya_ydp", rtol=1e-6, atol=1e-6,
                     suppress_algebraic_error=True,
                     quadrature=lambda t, y, yp, log_p: y[3:4],
                     sensitivity=dae.Adjoint(atol=1e-6))


SAMPLES_PER_PERIOD = 50


def analysis(log_p, n_periods):
    """(V̄, waveforms): V̄ = (1/T) ∫_{t1−T}^{t1} v4 dt in V, and y on a time grid that
    contains t1 − T and t1 (only V̄ is differentiated; the waveforms ride along)."""
    t1 = n_periods * PERIOD
    grid = jnp.linspace(0.0, t1, n_periods * SAMPLES_PER_PERIOD + 1)
    sol = solve(log_p, t1, grid)
    v_mean = (sol.qs[-1, 0] - sol.qs[-1 - SAMPLES_PER_PERIOD, 0]) / PERIOD
    return v_mean, (grid, sol.ys)


def log_params(r_load):
    p = jnp.array([P_NOMINAL["R_s"], P_NOMINAL["C1"], P_NOMINAL["R_f"], P_NOMINAL["C2"]])
    return jnp.log(jnp.concatenate([p, jnp.atleast_1d(r_load)]))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="CI smoke run: 4 loads, 2 periods")
    parser.add_argument("--out", default="rectifier_circuit.png")
    args = parser.parse_args()
    n_loads, n_periods = (4, 2) if args.quick else (48, 8)

    r_loads = jnp.logspace(1.5, 4.0, n_loads)            # 32 Ω … 10 kΩ
    log_p = jax.vmap(log_params)(r_loads)                 # (n_loads, 5)

    # One compiled program for the whole sweep: V̄, the waveforms and all elasticities
    # ∂V̄/∂ln p, for every load at once.
    sweep = jax.jit(jax.vmap(jax.value_and_grad(lambda lp: analysis(lp, n_periods),
                                                has_aux=True)))
    start = time.perf_counter()
    (v_mean, (t_plot, waves)), dv = jax.block_until_ready(sweep(log_p))
    print(f"{n_loads} loads: V̄ and its gradient in one jax.vmap(jax.value_and_grad(...)): "
          f"{time.perf_counter() - start:.1f} s including compilation")
    start = time.perf_counter()
    jax.block_until_ready(sweep(log_p))
    print(f"again, compiled: {time.perf_counter() - start:.2f} s")
    t_plot = t_plot[0]
    elast = dv / v_mean[:, None]                          # ∂ln V̄/∂ln p

    i = n_loads // 2
    print(f"R_L = {float(r_loads[i]):.0f} Ω: V̄ = {float(v_mean[i]):.4f} V")
    if not args.quick:
        # Check one gradient against central differences: h = 1e-4 in ln p gives an O(h²)
        # ~ 1e-8 relative truncation error; the FD solves use rtol 1e-10 so that their
        # noise, ~ rtol/h = 1e-6 relative, stays below the adjoint's own ~ rtol error.
        fine = jax.jit(lambda lp: dae.solve(
            residual, 0.0, n_periods * PERIOD, jnp.zeros(4), args=lp,
            saveat=jnp.array([(n_periods - 1) * PERIOD, n_periods * PERIOD]),
            algebraic=ALGEBRAIC, init="ya_ydp", rtol=1e-10, atol=1e-10,
            suppress_algebraic_error=True, quadrature=lambda t, y, yp, lp: y[3:4]).qs)
        h = 1e-4
        for j, name in enumerate(NAMES):
            e = jnp.zeros(5).at[j].set(h)
            qp, qm = fine(log_p[i] + e), fine(log_p[i] - e)
            fd = ((qp[1, 0] - qp[0, 0]) - (qm[1, 0] - qm[0, 0])) / (2 * h * PERIOD)
            print(f"  ∂V̄/∂ln {name:4s} adjoint {float(dv[i, j]):+.6e}   "
                  f"central differences {float(fd):+.6e}")
    picks = [0, n_loads // 2, n_loads - 1]

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    ax.plot(1e3 * t_plot, waves[0, :, 0], color="0.6", lw=1, label="source $v_1$")
    for j in picks:
        ax.plot(1e3 * t_plot, waves[j, :, 3], label=f"output $v_4$, $R_L$ = {float(r_loads[j]):.0f} Ω")
    ax.set_xlabel("time t (ms)")
    ax.set_ylabel("voltage (V)")
    ax.set_title("Rectifier waveforms")
    ax.legend(fontsize=8, loc="lower right")

    ax = axes[1]
    ax.semilogx(r_loads, v_mean, "o-", ms=3)
    ax.set_xlabel("load resistance $R_L$ (Ω)")
    ax.set_ylabel(r"mean output $\bar V$ over the last period (V)")
    ax.set_title(f"Load sweep: {n_loads} solves in one jax.vmap")

    ax = axes[2]
    for j, name in enumerate(NAMES):
        ax.semilogx(r_loads, elast[:, j], label=f"$p$ = {name}")
    ax.axhline(0.0, color="0.8", lw=0.8)
    ax.set_xlabel("load resistance $R_L$ (Ω)")
    ax.set_ylabel(r"elasticity $\partial \ln \bar V / \partial \ln p$ (1)")
    ax.set_title("Sensitivities: jax.vmap(jax.grad) by the adjoint DAE")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
