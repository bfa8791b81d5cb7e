import os

# Single-threaded LAPACK (jaxlib's CPU LU calls scipy's OpenBLAS): the solver's
# matrices are small, and on a loaded 2-core machine (CI) OpenBLAS's spinning threads
# made a 144x144 LU 100x slower (80 ms vs 0.7 ms). Must be set before scipy loads.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax  # noqa: E402
import pytest  # noqa: E402

# float64 is the working precision for stiff DAEs (the tests of float32 handling
# construct float32 inputs explicitly).
jax.config.update("jax_enable_x64", True)


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run slow tests")


def pytest_collection_modifyitems(config, items):
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
