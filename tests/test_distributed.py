"""Two processes on localhost with `jax.distributed` (CPU collectives over gloo, one
device each, loopback only): each integrates its half of a batch of 8 Robertson
sensitivity runs (`jax.jacfwd` of y(t) in the rate constants) sharded along an explicit
mesh axis, the results are gathered, and they must equal a one-process run of the whole
batch to rounding. `distributed_batch.py` is the program each process runs.

Tolerance 1e-12 relative to each member's largest value: each member's arithmetic is the
same in both runs, only XLA's compilation of the batched program differs (4 members per
process against 8 in one); observed 9e-16 for y and 7e-14 for the sensitivities, while
a member given another member's results (rate constants 15 % apart) differs by > 1e-3."""

import json
import os
import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest

SCRIPT = pathlib.Path(__file__).with_name("distributed_batch.py")
ROOT = SCRIPT.parent.parent


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _result(proc, timeout):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-4000:]
    lines = [line for line in out.splitlines() if line.startswith("{")]
    return json.loads(lines[0]) if lines else None


@pytest.mark.slow
def test_two_processes_equal_one():
    env = dict(os.environ, PYTHONPATH=str(ROOT), OPENBLAS_NUM_THREADS="1")
    env.pop("XLA_FLAGS", None)
    port = str(_free_port())
    start = lambda *a: subprocess.Popen(  # noqa: E731
        [sys.executable, str(SCRIPT), *a], env=env, cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    procs = [start(str(i), "2", port) for i in range(2)]
    single = start("single")
    try:
        two = _result(procs[0], 1500)
        _result(procs[1], 300)
        one = _result(single, 1500)
    finally:
        for p in procs + [single]:
            if p.poll() is None:
                p.kill()
    assert two["processes"] == 2 and two["devices"] == 2
    for key in ("ys", "jac"):
        a, b = np.array(two[key]), np.array(one[key])
        assert a.shape == b.shape == ((8, 2, 3) if key == "ys" else (8, 2, 3, 3))
        scale = np.max(np.abs(b), axis=tuple(range(1, b.ndim)), keepdims=True)
        assert np.max(np.abs(a - b) / scale) <= 1e-12, key
