import jax
import pytest

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
