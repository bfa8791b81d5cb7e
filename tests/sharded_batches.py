"""Sharded batches on several CPU devices, run as a script in its own process (the device
count, `--xla_force_host_platform_device_count`, must be set before JAX starts, and the
rest of the test suite runs on one device): `test_sharding.py` starts it.

    python tests/sharded_batches.py MODE TRANSFORM [TRANSFORM ...]

MODE is `explicit` (the default axis type of `jax.make_mesh`), `auto`, or
`explicit-nomesh` (explicit axis types, the batch sharded with `jax.device_put` but no
`jax.set_mesh` context: a clear error, printed); TRANSFORM one of `solve`, `grad`, `jacfwd` (a batch of 8
Robertson problems, rate constants and y1(0) varying, sharded over 4 devices under
`jax.jit(jax.vmap(...))`), or `ensemble` (the solve by `daeadjoint.ensemble` over the 4
devices in chunks of 4: one member per device per chunk; MODE is then ignored). Every
member is compared with its own unbatched solve. Prints one JSON line per transform: the largest difference relative
to the member's scale, the largest difference between a member's result and the same
compiled program's result for a batch of 8 copies of that member (`isolation_diff`; None
under `ensemble`), the output's sharding, the number of devices its shards sit on and
the number of cross-device operations in the compiled program.
"""

import json
import os
import re
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=4")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

jax.config.update("jax_enable_x64", True)

import daeadjoint as dae  # noqa: E402

ALGEBRAIC = np.array([False, False, True])


def robertson(t, y, yp, k):
    return jnp.stack([
        yp[0] + k[0] * y[0] - k[1] * y[1] * y[2],
        yp[1] - k[0] * y[0] + k[1] * y[1] * y[2] + k[2] * y[1] ** 2,
        y[0] + y[1] + y[2] - 1.0,
    ])


def output(k, y10):
    """y'(t0), then y(t) at t0 and two later times; y0 = (y10, 0, 1 − y10) made
    consistent by `init`. (y'(t0) is the differentiated DAE's, solved outside the
    integrations' shard_map; `jacfwd` differentiates it too.)"""
    # (Not jnp.stack([y10, 0.0, 1 - y10]): under an explicitly sharded vmap, JAX 0.10
    # cannot stack a batched value with an unbatched one — user code, outside the solver.)
    y0 = jnp.array([0.0, 0.0, 1.0]) + y10 * jnp.array([1.0, 0.0, -1.0])
    sol = dae.solve(robertson, 0.0, 1.0, y0, args=k, saveat=jnp.array([0.0, 0.5, 1.0]),
                    algebraic=ALGEBRAIC, init="ya_ydp", rtol=1e-6, atol=1e-9)
    return jnp.concatenate([sol.yps[:1], sol.ys])


_COLLECTIVE = re.compile(r" (?:all-reduce|all-gather|collective-permute|all-to-all|"
                         r"reduce-scatter)(?:-start)?\(")
_CALLS = re.compile(r"(?:body|condition|calls|to_apply|branch_computations)=\{?([%\w.\-, ]+)\}?")


def loop_collectives(hlo: str) -> int:
    """The cross-device operations in the loops of an optimized HLO module: in every
    computation a `while` runs as its body or condition, and in everything those call."""
    blocks = {}
    for block in re.split(r"\n(?=(?:ENTRY )?%[\w.\-]+ )", hlo):
        name = re.match(r"(?:ENTRY )?%([\w.\-]+)", block.strip())
        if name:
            blocks[name.group(1)] = block
    todo = [n for b in blocks.values()
            for m in re.finditer(r"condition=%([\w.\-]+), body=%([\w.\-]+)", b)
            for n in m.groups()]
    seen = set()
    while todo:
        name = todo.pop()
        if name in seen or name not in blocks:
            continue
        seen.add(name)
        for m in _CALLS.finditer(blocks[name]):
            todo += [r.strip().lstrip("%") for r in m.group(1).split(",")]
    return sum(len(_COLLECTIVE.findall(blocks[n])) for n in seen)


TRANSFORMS = {
    "solve": output,
    # ∂ y1(1)/∂k by the adjoint, and ∂ y(t)/∂(k, y10) by forward sensitivities.
    "grad": jax.grad(lambda k, y10: output(k, y10)[-1, 0], argnums=(0, 1)),
    "jacfwd": jax.jacfwd(output, argnums=(0, 1)),
}


def main():
    mode, names = sys.argv[1], sys.argv[2:]
    b = 8
    k = np.array([0.04, 1e4, 3e7]) * (1.0 + 0.15 * np.arange(b))[:, None]
    y10 = 1.0 - 0.01 * np.arange(b)
    axis_type = AxisType.Auto if mode == "auto" else AxisType.Explicit
    mesh = jax.make_mesh((4,), ("batch",), axis_types=(axis_type,))
    sharding = NamedSharding(mesh, P("batch"))
    k_s, y10_s = jax.device_put(k, sharding), jax.device_put(y10, sharding)
    for name in names:
        fn = TRANSFORMS.get(name, output)
        collectives = isolation = None
        batched = jax.jit(jax.vmap(fn))
        if name == "ensemble":
            out = dae.ensemble(output, k, y10, chunk_size=4)
        elif mode == "explicit-nomesh":
            try:
                batched(k_s, y10_s)
            except ValueError as err:
                print(json.dumps({"mode": mode, "transform": name, "error": str(err)}))
                continue
            raise AssertionError("no error without a mesh in context")
        else:
            with jax.set_mesh(mesh):
                compiled = batched.lower(k_s, y10_s).compile()
                out = compiled(k_s, y10_s)
                # Each member alone: the same compiled program on a batch of 8 copies
                # of member i (other neighbours, other devices, no other member in
                # the batch-wide loop conditions).
                alone = [compiled(jax.device_put(k[[i] * b], sharding),
                                  jax.device_put(y10[[i] * b], sharding)) for i in range(b)]
            # Cross-device operations inside the program's loops (explicit axes:
            # none, each device runs its own loops; auto: the loops' conditions are
            # reduced across devices).
            collectives = loop_collectives(compiled.as_text())
            isolation = 0.0
            for i in range(b):
                for o, a in zip(jax.tree_util.tree_leaves(out),
                                jax.tree_util.tree_leaves(alone[i])):
                    o, a = np.asarray(o)[i], np.asarray(a)
                    isolation = max(isolation, float(np.max(np.abs(a - o[None]))
                                                     / np.max(np.abs(o))))
        single = jax.jit(fn)
        worst = 0.0
        for i in range(b):
            ref = single(jnp.asarray(k[i]), jnp.asarray(y10[i]))
            for o, r in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(ref)):
                o, r = np.asarray(o)[i], np.asarray(r)
                scale = np.max(np.abs(r))
                worst = max(worst, float(np.max(np.abs(o - r)) / scale))
        leaf = jax.tree_util.tree_leaves(out)[0]
        spec = getattr(leaf.sharding, "spec", None)
        print(json.dumps({"mode": mode, "transform": name, "max_rel_diff": worst,
                          "isolation_diff": isolation,
                          "spec": str(spec), "collectives": collectives,
                          "devices": len({s.device for s in leaf.addressable_shards})}),
              flush=True)


if __name__ == "__main__":
    main()
