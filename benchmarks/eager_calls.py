"""Repeated calls of `dae.solve` *without* `jax.jit`, as in a notebook.

    python benchmarks/eager_calls.py

`solve` compiles its work through an `equinox.filter_jit` keyed on the residual function,
the static options and the shapes/dtypes of the inputs, so the first call compiles and
every later call with the same residual and shapes reuses the compiled program — also
with new parameter values, initial values and tolerances (they are traced). A new Python
function object (e.g. a fresh `lambda` per call) is a new key and compiles again.

Prints the wall time of the first call, the median of repeated identical calls, of calls
with new parameter values, and of calls with a new lambda each time. Single-threaded
OpenBLAS as in the other benchmarks.
"""

import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the working-tree daeadjoint
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

jax.config.update("jax_enable_x64", True)

import daeadjoint as dae  # noqa: E402


def decay(t, y, yp, k):
    return yp + k * y


def robertson(t, y, yp, k):
    return jnp.stack([yp[0] + k[0] * y[0] - k[1] * y[1] * y[2],
                      yp[1] - k[0] * y[0] + k[1] * y[1] * y[2] + k[2] * y[1] ** 2,
                      y[0] + y[1] + y[2] - 1.0])


K = jnp.array([0.04, 1e4, 3e7])


def readme_example(k):
    """The README's forward solve (Robertson, IDAS's output table)."""
    return dae.solve(robertson, 0.0, 4e10, jnp.array([1.0, 0.0, 0.0]), args=k,
                     saveat=jnp.array([0.4, 40.0, 4e4, 4e10]),
                     algebraic=jnp.array([False, False, True]), init="ya_ydp",
                     rtol=1e-4, atol=jnp.array([1e-8, 1e-6, 1e-6]))


def one_state(k):
    return dae.solve(decay, 0.0, 1.0, jnp.ones(1), args=k)


def _time(fn, *args):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args).ys)
    return time.perf_counter() - start


def main(repeats=7):
    print(f"# Eager (un-jitted) calls of dae.solve — {time.strftime('%Y-%m-%d')}, "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"jax {jax.__version__}\n")
    print("| problem | first call | same call again (median) | new parameter values "
          "(median) | new lambda each call (median) |")
    print("|---|---|---|---|---|")
    for name, fn, p in [("1-state decay y' = −k y", one_state, 0.5),
                        ("README example (Robertson, 4 outputs)", readme_example, K)]:
        first = _time(fn, p)
        same = statistics.median(_time(fn, p) for _ in range(repeats))
        new = statistics.median(_time(fn, p * (1 + 0.01 * i)) for i in range(1, repeats + 1))
        if name.startswith("1-state"):
            fresh = statistics.median(
                _time(lambda k: dae.solve(lambda t, y, yp, k: yp + k * y, 0.0, 1.0,
                                          jnp.ones(1), args=k), p) for _ in range(3))
            fresh_s = f"{fresh:.2f} s"
        else:
            fresh_s = "—"
        print(f"| {name} | {first:.2f} s | {same * 1e3:.1f} ms | {new * 1e3:.1f} ms | {fresh_s} |")


if __name__ == "__main__":
    main()
