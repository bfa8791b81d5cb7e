import os

# Single-threaded LAPACK (jaxlib's CPU LU calls scipy's OpenBLAS): the solver's
# matrices are small, and on a loaded 2-core machine (CI) OpenBLAS's spinning threads
# made a 144x144 LU 100x slower (80 ms vs 0.7 ms). Must be set before scipy loads.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

# Nearly all of the suite's time is XLA compiling the integrator's programs. One of XLA
# CPU's own options cuts that by about a third: the older elemental kernel emitters
# instead of the fusion emitters (Robertson's gradient: XLA's CPU seconds 29.4 -> 20.6,
# its forward solve 5.7 -> 2.7; docs/performance.md "Compile once"). It changes how XLA
# generates machine code, not what it computes, and costs no run time measurably; but
# roundings differ in the last bits, which an adaptive solve carries into a slightly
# different step sequence: results move within the solver's tolerance (Robertson's
# y1(4e10) by 4e-4 relative at rtol 1e-6, atol 1e-10 on y1 ~ 5e-8), as under any
# rounding perturbation, so every test's tolerance holds under it; the comparisons the
# tests make bit for bit (batched against unbatched, one program against another) are
# between programs compiled with the same option. (LLVM without optimization,
# `--xla_backend_optimization_level=0`, would halve the compile time but made two
# programs that do the same arithmetic round differently, and runs 2-3x slower.) It is
# put first so that the caller's XLA_FLAGS win. DAEADJOINT_TEST_XLA_DEFAULTS=1 runs the
# suite with XLA's defaults, as users compile; the example scripts always run so
# (tests/test_examples.py removes the options listed in DAEADJOINT_TEST_ADDED_XLA_FLAGS),
# and .ci/run also runs tests/test_forward.py with the defaults.
if os.environ.get("DAEADJOINT_TEST_XLA_DEFAULTS") != "1":
    _added = "--xla_cpu_use_fusion_emitters=false"
    os.environ["DAEADJOINT_TEST_ADDED_XLA_FLAGS"] = _added
    os.environ["XLA_FLAGS"] = f"{_added} {os.environ.get('XLA_FLAGS', '')}".strip()

import jax  # noqa: E402
import pytest  # noqa: E402

# float64 is the working precision for stiff DAEs (the tests of float32 handling
# construct float32 inputs explicitly).
jax.config.update("jax_enable_x64", True)


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run slow tests")


# Rough seconds of each file's default tests in one process on an idle core, nearly all
# of it XLA compiling the integrator's programs (from single-file `--durations` runs and
# CI logs, 2026-11, at different loads: only the order and rough proportions matter —
# most are a CI log's per-file sums divided by its load factor of ~2.4; those of
# test_testset.py, test_linear_solvers.py and test_krylov.py are the process's CPU
# seconds in a single-file `-n 0` run on a 2-core machine on 2026-11-29, at load 5-16,
# where the wall-clock time was 6-8x that, and those of test_singular_mass_matrix.py,
# test_right_answer_or_clear_failure.py and test_index2.py the older figures scaled by
# the same day's before/after runs of those files; update when a file's share changes a lot).
# test_transformations.py, test_adjoint.py, test_events.py and test_breakpoints.py: CPU
# seconds of single-file `-n 0` runs on 2026-11-29 at load ~4. test_linear_solvers.py,
# test_krylov.py and test_random_dae.py: scaled by the same day's before/after runs of
# their changes to the suite's budget (CPU s 382 -> 265, 168 -> 128, 119 -> 97; load 2-7);
# test_transformations.py less the 43 CPU s its changed test lost (load ~5).
# test_adjoint.py: the CPU seconds of a single-file `-n 0` run on 2026-11-29 at load 2-3,
# after R1's jacfwd-of-G and HVP tests moved in from test_transformations.py, which
# lost them (193 CPU s in the same conditions).
# test_linear_solvers.py, test_krylov.py, test_adjoint.py and test_random_dae.py: scaled
# by the CPU seconds of single-file `-n 0` runs before and after the adjoint's node pieces
# were limited to n <= 10 and those files' continuous-adjoint checks dropped the fallback
# (2026-11-30, load 3-5: 284 -> 224, 113 -> 99, 360 -> 270, 87 -> 64); test_transformations.py
# kept its figure (its run's CPU seconds moved within the noise, 203 -> 214, load ~4).
# test_linear_solvers.py: less the ~12 s its banded-DAE gradient test lost (the SparseLU
# program without the untaken fallback, only lowered with it; 70 -> 58 s at load ~3.5,
# 39.9 -> 31.2 s at load ~2.5; the whole file 208 s wall at load 2-3.4 after it).
# test_testset.py: scaled by its single-file `-n 0` wall time before/after the Gauss–Jordan
# loop for 4 <= n <= 8 (2026-11-30, load ~3: 190.9 -> 132.7 s).
# test_delays.py and test_events.py: scaled by the process's CPU seconds in single-file
# `-n 0` runs before/after the delay residual was traced once per program and the
# falling-body event checks dropped the untaken fallback (2026-11-30, load 2-5:
# 102.1 -> 85.3, 142.7 -> 134.7).
# Files not listed (a few seconds each, or only slow tests) count as 0 and run last.
FILE_SECONDS = {
    "test_transformations.py": 190, "test_testset.py": 135, "test_linear_solvers.py": 245,
    "test_adjoint.py": 190, "test_krylov.py": 160, "test_singular_mass_matrix.py": 180,
    "test_right_answer_or_clear_failure.py": 185, "test_index2.py": 180,
    "test_random_dae.py": 105, "test_breakpoints.py": 50, "test_events.py": 123,
    "test_closures.py": 155, "test_user_inputs_and_messages.py": 150,
    "test_initialization.py": 120, "test_ensemble.py": 120, "test_forward.py": 105,
    "test_delays.py": 67, "test_sharding.py": 50, "test_failure_paths.py": 45,
    "test_ensemble_queue.py": 25, "test_configuration.py": 15, "test_bdf.py": 10,
    "test_heat_equation_gradient.py": 5, "test_gpu_lowering.py": 5,
    "test_jax_internals.py": 5,
}


def pytest_configure(config):
    # pytest-xdist (`--dist loadfile`) would order the files by their number of tests,
    # skipped slow ones included; keep the order of `pytest_collection_modifyitems`.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    # Longest files first (longest-processing-time-first scheduling): each worker takes
    # the next file when it runs out, so the two finish within about the shortest file
    # of each other instead of one waiting on a long file handed out last. The sort is
    # stable: each file's tests keep their order (shared compiled functions are built
    # by the first test that needs them).
    items.sort(key=lambda item: -FILE_SECONDS.get(item.path.name, 0))
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop JAX's compiled programs after each test module. The suite compiles hundreds
    of large programs (every one a BDF integrator, some nested several deep); kept all
    at once they exhausted the process's memory mappings (vm.max_map_count, 65530 by
    default) and XLA crashed with a segmentation fault while compiling in a late module
    (measured: up to ~21k mappings in one module, back to ~750 after clearing).
    Modules share no compiled functions with each other, so nothing is recompiled."""
    yield
    jax.clear_caches()
