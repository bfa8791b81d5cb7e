"""Batches sharded over several devices: explicit axis types (the default of
`jax.make_mesh`) and auto ones, under `jax.jit(jax.vmap(...))` of a solve, `jax.grad` and
`jax.jacfwd`, and `daeadjoint.ensemble` over the devices. Several CPU devices need
`--xla_force_host_platform_device_count` before JAX starts, so each check runs
`sharded_batches.py` in its own process (4 devices) and reads what it prints.

Two checks per transform (a batch of 8 Robertson members, rate constants 15 % apart):

- Isolation, exact: the same compiled program run on 8 copies of member i gives, bit for
  bit, member i's result in the mixed batch (`isolation_diff` 0). The lanes of a batched
  program do the same arithmetic on the same inputs whatever the other lanes hold, and
  members that finished are masked in the batch-wide loops; any difference would be a
  member's arithmetic influenced by another member (a batch-wide redo, error test, step
  decision or factorization refresh). Measured: 0.0 in every mode and transform.

- Against each member's unbatched run, relative to the member's largest output. TOL =
  1e-9 for `solve` and `grad`: the arithmetic is the same, but XLA compiles the batched
  program differently (fusion, one member per device under `ensemble`), and rounding
  differences pass through Newton's stopping test and Robertson's stiffness (measured:
  solve 5.6e-13 auto, 6.2e-13 explicit; grad 2.1e-10, 1.7e-10; 9.4e-13 under
  `ensemble`); three orders below the solver's error (rtol 1e-6), while a member given
  another member's results would differ by more than 1e-3.
  `jacfwd`: TOL_JACFWD = 2 rtol = 2e-6. Forward sensitivities under full error control
  choose their own step sequence (they enter the error test), and for member 1 (k scaled
  by 1.15) that sequence is not stable under rounding: changing its rate constants by
  one ulp (2e-16 relative) takes its unbatched run from 137 to 143 steps and moves its
  derivatives by up to 1.0e-7 (each direction alone, or k alone, keeps its step count
  under such changes; ∂/∂k0 and ∂/∂y10 together do not: 134 to 138 steps; with partial
  error control, `ForwardSensitivity(error_control=False)`, batched and unbatched agree
  within 5.2e-13 for every member). The batched programs' rounding (the solve's 1e-13 above)
  does the same: 3.7e-8 auto, 5.4e-8 explicit (its per-device program batches 2
  members; a plain `jax.jit(jax.vmap(...))` on one device: 3.7e-8 with 8 members,
  5.4e-8 with 2), member 1 only (the others 1.3e-13 or less). Two runs on different
  step sequences differ by at most the sum of their global errors, each at the scale of
  rtol: measured against `jacfwd` at rtol 1e-10 (which agrees with central differences
  of rtol-1e-11 solves within 5e-8), 7.0e-8, 5.5e-8 (unbatched) / 9.2e-8 (batched) and
  4.5e-7 for members 0, 1 and 7. Hence 2 rtol, still 500 times below a member given
  another member's results; the isolation check above is the exact one."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).with_name("sharded_batches.py")
ROOT = SCRIPT.parent.parent
TOL = 1e-9
RTOL = 1e-6   # the solves' rtol in sharded_batches.py
TOL_JACFWD = 2 * RTOL


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
        assert r["max_rel_diff"] <= (TOL_JACFWD if r["transform"] == "jacfwd" else TOL), r
        if r["isolation_diff"] is not None:   # (None: `ensemble`, no batched program)
            assert r["isolation_diff"] == 0.0, r
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
