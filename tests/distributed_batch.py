"""One process of a two-process `jax.distributed` run on localhost (CPU collectives over
gloo, one CPU device per process), started by `test_distributed.py`:

    python tests/distributed_batch.py PROCESS_ID NUM_PROCESSES PORT
    python tests/distributed_batch.py single          # the one-process reference

A batch of 8 Robertson sensitivity runs (`jax.jacfwd` of y(t) with respect to the rate
constants) is sharded over the processes' devices along an explicit mesh axis; each
process integrates its own members (`jax.jit(jax.vmap(...))` under `jax.set_mesh`),
the results are gathered to every process (`process_allgather`), and process 0 prints
them as JSON. `single` prints the same batch computed by one process alone.
"""

import json
import os
import sys

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax
import jax.numpy as jnp
import numpy as np

jax.config.update("jax_enable_x64", True)

if sys.argv[1] != "single":
    # Before anything starts JAX's backend — importing daeadjoint does (module-level
    # arrays).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{sys.argv[3]}",
                               num_processes=int(sys.argv[2]), process_id=int(sys.argv[1]),
                               local_device_ids=[0])

import daeadjoint as dae  # noqa: E402

ALGEBRAIC = np.array([False, False, True])
B = 8
K = np.array([0.04, 1e4, 3e7]) * (1.0 + 0.15 * np.arange(B))[:, None]


def robertson(t, y, yp, k):
    return jnp.stack([
        yp[0] + k[0] * y[0] - k[1] * y[1] * y[2],
        yp[1] - k[0] * y[0] + k[1] * y[1] * y[2] + k[2] * y[1] ** 2,
        y[0] + y[1] + y[2] - 1.0,
    ])


def output(k):
    sol = dae.solve(robertson, 0.0, 1.0, jnp.array([1.0, 0.0, 0.0]), args=k,
                    saveat=jnp.array([0.5, 1.0]), algebraic=ALGEBRAIC, init="ya_ydp",
                    rtol=1e-6, atol=1e-9, throw=False)
    return sol.ys, jax.jacfwd(lambda k_: dae.solve(
        robertson, 0.0, 1.0, jnp.array([1.0, 0.0, 0.0]), args=k_,
        saveat=jnp.array([0.5, 1.0]), algebraic=ALGEBRAIC, init="ya_ydp", rtol=1e-6,
        atol=1e-9, throw=False).ys)(k)


def main():
    if sys.argv[1] == "single":
        ys, jac = jax.jit(jax.vmap(output))(K)
        print(json.dumps({"ys": np.asarray(ys).tolist(), "jac": np.asarray(jac).tolist()}))
        return
    pid, nproc = int(sys.argv[1]), int(sys.argv[2])
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((jax.device_count(),), ("batch",))
    sharding = NamedSharding(mesh, P("batch"))
    per = B // nproc
    local = K[pid * per:(pid + 1) * per]          # this process's members only
    k = jax.make_array_from_process_local_data(sharding, local, (B, 3))
    with jax.set_mesh(mesh):
        ys, jac = jax.jit(jax.vmap(output))(k)
    ys, jac = multihost_utils.process_allgather((ys, jac), tiled=True)
    if pid == 0:
        print(json.dumps({"ys": np.asarray(ys).tolist(), "jac": np.asarray(jac).tolist(),
                          "devices": jax.device_count(), "processes": jax.process_count()}))
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
