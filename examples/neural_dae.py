"""A neural DAE: learn an unknown rate law inside a physical index-1 DAE, with an
`equinox` MLP passed straight to `dae.solve` as `args`, trained by optax.

The physics (known): a batch reactor where A and B interconvert so fast that they are
always in equilibrium, c_B = K c_A, and B is consumed by a slow reaction B → C:

    s'   = −r(c_B)              s = c_A + c_B, the lumped A+B concentration
    c_C' =  r(c_B)
    0    =  c_A + c_B − s       algebraic
    0    =  c_B − K c_A         algebraic (fast equilibrium)

Unknowns y = (s, c_C, c_A, c_B) in mol/L, time in h. The algebraic equations determine
(c_A, c_B) from s (index 1). The rate law r(c_B) (mol/L/h) is *unknown*: the truth used to
make the data is a saturating law r = k c_B² / (1 + c_B/c_sat), and the model replaces it
by a small MLP, r_θ(c_B) = softplus(MLP(c_B)) ≥ 0, trained on noisy measurements of s and
c_C from a few experiments with different initial loads. Gradients with respect to all
MLP weights come from the adjoint DAE.

Run:  python examples/neural_dae.py [--quick] [--steps 600] [--out neural_dae.png]
"""

import argparse
import os
import time

# Small dense matrices: single-threaded LAPACK is faster (docs/performance.md).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import equinox as eqx
import jax
import jax.numpy as jnp

jax.config.update("jax_enable_x64", True)

import optax  # noqa: E402

import daeadjoint as dae  # noqa: E402

K_EQ = 2.0                      # c_B / c_A at equilibrium (1)
K_TRUE, C_SAT = 1.5, 0.5        # true rate law: L/mol/h, mol/L
T1 = 4.0                        # h
T_OBS = jnp.linspace(0.2, T1, 20)
S0 = jnp.array([0.5, 1.0, 1.5, 2.0])     # initial A+B load of each experiment, mol/L
ALGEBRAIC = jnp.array([False, False, True, True])
NOISE = 0.01                    # mol/L


def true_rate(c_b):
    return K_TRUE * c_b ** 2 / (1.0 + c_b / C_SAT)


class RateLaw(eqx.Module):
    """r_θ(c_B) = softplus(MLP(c_B)): non-negative, smooth."""

    mlp: eqx.nn.MLP

    def __init__(self, key):
        self.mlp = eqx.nn.MLP(1, 1, width_size=16, depth=2, activation=jnp.tanh, key=key)

    def __call__(self, c_b):
        return jax.nn.softplus(self.mlp(jnp.atleast_1d(c_b))[0])


def reactor(t, y, yp, rate):
    """The physical DAE; `rate` is any callable c_B ↦ r (the truth or the network)."""
    s, _c_c, c_a, c_b = y
    r = rate(c_b)
    return jnp.stack([yp[0] + r, yp[1] - r, c_a + c_b - s, c_b - K_EQ * c_a])


def simulate(rate, s0):
    """Concentrations at T_OBS of one experiment started with s(0) = s0, no C."""
    y0 = jnp.stack([s0, 0.0, 0.0, 0.0])      # init="ya_ydp" computes c_A, c_B and y'
    sol = dae.solve(reactor, 0.0, T1, y0, args=rate, saveat=T_OBS, algebraic=ALGEBRAIC,
                    init="ya_ydp", rtol=1e-6, atol=1e-8,
                    sensitivity=dae.Adjoint(atol=1e-8))
    return sol.ys


def loss_fn(model, data):
    # The MLP goes in as `args`: solve differentiates its floating-point arrays (the
    # weights) and treats the rest (activations, sizes) as static.
    pred = jax.vmap(lambda s0: simulate(model, s0))(S0)
    return jnp.mean((pred[:, :, :2] - data) ** 2)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="CI smoke run: 3 training steps")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--out", default="neural_dae.png")
    args = parser.parse_args()
    steps = 3 if args.quick else args.steps

    key_data, key_model = jax.random.split(jax.random.PRNGKey(0))
    clean = jax.jit(jax.vmap(lambda s0: simulate(true_rate, s0)))(S0)[:, :, :2]
    data = clean + NOISE * jax.random.normal(key_data, clean.shape)

    model = RateLaw(key_model)
    optimizer = optax.adam(optax.exponential_decay(2e-2, steps, 0.1))
    opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_jit
    def train_step(model, opt_state, data):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, data)
        updates, opt_state = optimizer.update(grads, opt_state, model)
        return eqx.apply_updates(model, updates), opt_state, loss

    start = time.perf_counter()
    losses = []
    for step in range(steps):
        model, opt_state, loss = train_step(model, opt_state, data)
        losses.append(float(loss))
        if step == 0:
            print(f"(compiled the training step in {time.perf_counter() - start:.1f} s)")
        if step % 50 == 0 or step == steps - 1:
            print(f"step {step:4d}  mean squared error {float(loss):.3e} (mol/L)²")
    print(f"{steps} steps in {time.perf_counter() - start:.1f} s; noise variance "
          f"{NOISE ** 2:.1e} (mol/L)²")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c_grid = jnp.linspace(0.0, K_EQ / (1 + K_EQ) * float(S0.max()), 100)
    learned = jax.vmap(model)(c_grid)
    pred = jax.jit(jax.vmap(lambda s0: simulate(model, s0)))(S0)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    for i, s0 in enumerate(S0):
        line, = ax.plot(T_OBS, data[i, :, 1], "o", ms=3)
        ax.plot(T_OBS, pred[i, :, 1], "-", color=line.get_color(),
                label=f"$s_0$ = {float(s0):g} mol/L")
    ax.set_xlabel("time t (h)")
    ax.set_ylabel("product $c_C$ (mol/L)")
    ax.set_title("Data (dots) and the neural DAE (lines)")
    ax.legend(fontsize=8)

    ax = axes[1]
    ax.plot(c_grid, true_rate(c_grid), "k--", label="true rate law")
    ax.plot(c_grid, learned, label="learned $r_θ$ (MLP)")
    c_seen = pred[:, :, 3].ravel()
    ax.plot(c_seen, jnp.zeros_like(c_seen), "|", color="0.5", ms=10,
            label="$c_B$ visited by the data")
    ax.set_xlabel("$c_B$ (mol/L)")
    ax.set_ylabel("rate r (mol/L/h)")
    ax.set_title("The closure term")
    ax.legend(fontsize=8)

    ax = axes[2]
    ax.semilogy(losses)
    ax.axhline(NOISE ** 2, color="0.5", ls="--", label="noise variance")
    ax.set_xlabel("Adam step")
    ax.set_ylabel("mean squared error ((mol/L)²)")
    ax.set_title("Training (gradients by the adjoint DAE)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
