"""Batches sharded over several devices: explicit axis types (the default of
`jax.make_mesh`) and auto ones, under `jax.jit(jax.vmap(...))` of a solve, `jax.grad` and
`jax.jacfwd`, and `daeadjoint.ensemble` over the devices. Several CPU devices need
`--xla_force_host_platform_device_count` before JAX starts, so each check runs
`sharded_batches.py` in its own process (4 devices) and reads what it prints.

Every member is compared with its own unbatched solve, relative to the member's largest
output. Tolerance 1e-9: the members' arithmetic is the same batched or not, but XLA
compiles the batched program differently (fusion, one member per device under
`ensemble`), and rounding differences pass through Newton's stopping test and Robertson's
stiffness (observed: 0 to 2.2e-16 under jit(vmap), 9.4e-13 under `ensemble`); that is
three orders below the solver's own error (rtol 1e-6), while a member given another
member's results (rate constants 15 % apart) would differ by more than 1e-3."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).with_name("sharded_batches.py")
ROOT = SCRIPT.parent.parent
TOL = 1e-9


def _run(mode, *transforms, timeout=1200):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OPENBLAS_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(SCRIPT), mode, *transforms], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["transform"] for r in rows] == list(transforms), proc.stdout
    return rows


def _check(rows, sharded=True):
    for r in rows:
        assert r["max_rel_diff"] <= TOL, r
        if sharded:
            # The output stays split over the 4 devices along the batch axis.
            assert r["devices"] == 4 and r["spec"].startswith("P('batch'"), r


def test_explicit_sharding_vmap_solve_and_ensemble():
    """jit(vmap(solve)) over a batch sharded with explicit axis types (which failed in
    tracing: a while_loop's carry created unsharded, updated with sharded values), and
    `ensemble` split over 4 devices in two chunks."""
    rows = _run("explicit", "solve", "ensemble")
    _check(rows[:1])
    _check(rows[1:], sharded=False)
    # Independent per-device loops: no cross-device operation inside the loops (the
    # solve's final status check, outside them, gathers the members' statuses).
    assert rows[0]["collectives"] == 0, rows[0]


@pytest.mark.slow
def test_explicit_sharding_grad_and_jacfwd():
    _check(_run("explicit", "grad", "jacfwd"))


@pytest.mark.slow
def test_explicit_sharding_without_a_mesh_context_is_a_clear_error():
    """The batch sharded with `device_put` on an explicit mesh, no `jax.set_mesh`: JAX
    cannot batch along the explicit axis without the mesh in context (a plain vmapped
    `while_loop` fails too), so `solve` says what to do."""
    (row,) = _run("explicit-nomesh", "solve")
    assert "jax.set_mesh(mesh)" in row["error"] and "('batch',)" in row["error"], row


@pytest.mark.slow
def test_auto_sharding():
    rows = _run("auto", "solve", "grad", "jacfwd")
    _check(rows)
    # XLA's partitioner runs one loop for all devices: its conditions are reduced
    # across them (measured: 10 cross-device operations in the forward solve's loops).
    assert rows[0]["collectives"] > 0, rows[0]
