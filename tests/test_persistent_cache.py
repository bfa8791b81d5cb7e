"""JAX's persistent compilation cache stores every program of a solve, and a second
Python process reuses them (docs/performance.md, "Reusing compiled programs across
processes").

JAX refuses to store a program that holds a host callback; with `EQX_ON_ERROR=nan` the
solver's programs hold none — not the errors of `throw=True`, not the adjoint fallback's
warning, not the custom calls of the LAPACK band kernel (XLA FFI targets, whose numba
machine code numba caches on disk in turn). Each process runs `_CHILD`: a forward solve
through `BandedLU(kernel="lapack")` and a gradient through the continuous adjoint, both
under `jax.jit`, counting the cache's hits and misses through `jax.monitoring`.
"""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

_CHILD = textwrap.dedent("""
    import json, sys, time
    import jax, jax.numpy as jnp
    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_compilation_cache_dir", sys.argv[1])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    events = {"hits": 0, "misses": 0}
    def listen(name, **kwargs):
        if name == "/jax/compilation_cache/cache_hits":
            events["hits"] += 1
        elif name == "/jax/compilation_cache/cache_misses":
            events["misses"] += 1
    jax.monitoring.register_event_listener(listen)
    import daeadjoint as dae

    def heat(t, y, yp, k):                     # a 1-D heat equation, tridiagonal J
        lap = jnp.concatenate([y[1:2] - y[:1], y[2:] - 2 * y[1:-1] + y[:-2],
                               y[-2:-1] - y[-1:]])
        return yp - k[0] * 64.0 * lap + k[1] * y

    def robertson(t, y, yp, k):
        return jnp.stack([yp[0] + k[0] * y[0] - k[1] * y[1] * y[2],
                          yp[1] - k[0] * y[0] + k[1] * y[1] * y[2] + k[2] * y[1] ** 2,
                          y[0] + y[1] + y[2] - 1.0])

    y0 = jnp.sin(jnp.linspace(0.0, 3.0, 8))
    forward = jax.jit(lambda k: dae.solve(
        heat, 0.0, 1.0, y0, args=k, rtol=1e-6, atol=1e-8,
        linear_solver=dae.BandedLU(lower=1, upper=1, kernel="lapack")).ys[-1])
    gradient = jax.jit(jax.grad(lambda k: dae.solve(
        robertson, 0.0, 40.0, jnp.array([1.0, 0.0, 0.0]), args=k,
        algebraic=jnp.array([False, False, True]), rtol=1e-6, atol=1e-8).ys[-1, 0]))
    start = time.perf_counter()
    y = forward(jnp.array([1.0, 0.5])).block_until_ready()
    g = gradient(jnp.array([0.04, 1e4, 3e7])).block_until_ready()
    print(json.dumps({"y": y.tolist(), "g": g.tolist(), "seconds": time.perf_counter() - start,
                      **events}))
""")


@pytest.mark.slow
def test_second_process_reuses_every_program(tmp_path):
    env = dict(os.environ, EQX_ON_ERROR="nan", OPENBLAS_NUM_THREADS="1",
               NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    # This checkout's package, whether or not it is installed.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    script = tmp_path / "child.py"
    script.write_text(_CHILD)

    def run():
        out = subprocess.run([sys.executable, str(script), str(tmp_path / "jax")], env=env,
                             capture_output=True, text=True, timeout=900)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    first = run()
    assert first["misses"] > 0 and first["hits"] == 0
    # numba stored the band kernel's handlers (an index file per handler).
    assert any(name.endswith(".nbi") for _, _, files in os.walk(tmp_path / "numba")
               for name in files)
    second = run()
    # Every program came from the cache: nothing was compiled again.
    assert second["misses"] == 0 and second["hits"] == first["misses"]
    # The same programs: the same numbers, to the bit.
    np.testing.assert_array_equal(second["y"], first["y"])
    np.testing.assert_array_equal(second["g"], first["g"])
