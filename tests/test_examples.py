"""Smoke runs of every script in examples/: each runs to completion in a fresh Python
process (as a user runs it), in an empty working directory, and writes its figure there.

The new examples take `--quick` (a few seconds of compute; most of the wall time is JAX
compilation). The two oldest predate it and are run with their own small settings.
All smoke runs are marked slow (run them with `python -m pytest --runslow
tests/test_examples.py`); `.ci/run` runs them after the default suite, so CI smoke-runs
every example.
"""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"

# script -> (command-line arguments of the smoke run, figure it writes, slow?)
SMOKE_RUNS = {
    "rectifier_circuit.py": (["--quick"], "rectifier_circuit.png", False),
    # ~60 s (compiling vmap(jacfwd) through a terminal event on an algebraic unknown).
    "battery_discharge.py": (["--quick"], "battery_discharge.png", True),
    "batched_sensitivities.py": (["--quick"], "batched_sensitivities.png", False),
    # 35-37 s each on main at 214578d (2 cores, mostly compilation of L-BFGS's line
    # search / of vmap over an MLP-closure DAE): over the default suite's budget.
    "least_squares_barnes.py": (["--quick"], "least_squares_barnes.png", True),
    "neural_dae.py": (["--quick"], "neural_dae.png", True),
    # 68 s on a loaded 2-core machine (compiling vmap(jacrev) and value_and_grad through
    # a terminal event).
    "fit_event_time.py": (["--quick"], "fit_event_time.png", True),
    # ~2.5 min on a loaded 2-core machine, nearly all compilation (LM step with jacfwd
    # through solve, jax.jacfwd, jax.hessian, optax L-BFGS).
    "fit_least_squares_optimistix.py": (["--quick"], "fit_least_squares_optimistix.png", True),
    "fit_robertson.py": (["--iterations", "3"], "fit_robertson.png", False),
    # ~2–4 min on a loaded 2-core machine, nearly all compilation (grad of a delay solve,
    # L-BFGS's line search, jacfwd).
    "fit_kermack_mckendrick.py": (["--quick"], "fit_kermack_mckendrick.png", True),
    "robertson_forward.py": ([], "robertson_forward.png", False),
    # ~15 s (224 discharges in one compiled ensemble chunk).
    "sobol_battery.py": (["--quick"], "sobol_battery.png", False),
}


def test_every_example_has_a_smoke_run():
    scripts = sorted(p.name for p in EXAMPLES.glob("*.py"))
    assert scripts == sorted(SMOKE_RUNS), (
        "add new examples to SMOKE_RUNS in tests/test_examples.py (and remove deleted ones)")


def _params():
    for script, (argv, figure, slow) in sorted(SMOKE_RUNS.items()):
        # Every smoke run is slow-marked: `.ci/run` runs them all in its own
        # `pytest --runslow tests/test_examples.py` step, so every example runs on every
        # CI build while the default suite stays within its ~10 minute budget. (`slow`
        # above records which ones take over ~30 s.)
        del slow
        marks = [pytest.mark.slow]
        yield pytest.param(script, argv, figure, id=script.removesuffix(".py"), marks=marks)


@pytest.mark.parametrize("script, argv, figure", list(_params()))
def test_example_runs_and_writes_its_figure(script, argv, figure, tmp_path):
    env = dict(os.environ)
    # This checkout's package, whatever is installed; single-threaded BLAS; no display.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["OPENBLAS_NUM_THREADS"] = "1"
    env["MPLBACKEND"] = "Agg"
    # XLA's default compile options, as a user's run: not the faster ones conftest.py
    # adds for the suite (the caller's own XLA_FLAGS are kept).
    added = os.environ.get("DAEADJOINT_TEST_ADDED_XLA_FLAGS", "").split()
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split() if f not in added)
    proc = subprocess.run([sys.executable, str(EXAMPLES / script), *argv], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=600)
    output = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, f"{script} failed:\n{output}"
    png = tmp_path / figure
    assert png.is_file(), f"{script} did not write {figure}:\n{output}"
    # A PNG signature and more than an empty canvas (a blank 1-panel figure is ~5 kB).
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 20_000, f"{figure} is suspiciously small"
