"""GPU readiness without a GPU: `jax.export` lowers a program for a platform that is not
present, so the batched solve and its derivatives are lowered for CUDA here, and the
lowered module must contain no custom call other than GPU ones (a CPU-only kernel — the
LAPACK band LU's or KLU's FFI calls — would fail to lower or show up here).

Robertson (n = 3: the solver's explicit small-system elimination, no LAPACK call).
`vmap(grad)` is lowered with `Adjoint(fallback=False)`: the fallback's warning is a host
callback (`jax.debug.callback`), which runs on a GPU but which cross-platform export
cannot lower without that backend."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import daeadjoint as dae

ALGEBRAIC = np.array([False, False, True])


def robertson(t, y, yp, k):
    return jnp.stack([
        yp[0] + k[0] * y[0] - k[1] * y[1] * y[2],
        yp[1] - k[0] * y[0] + k[1] * y[1] * y[2] + k[2] * y[1] ** 2,
        y[0] + y[1] + y[2] - 1.0,
    ])


def y1(k):
    return dae.solve(robertson, 0.0, 1.0, jnp.array([1.0, 0.0, 0.0]), args=k,
                     algebraic=ALGEBRAIC, init="ya_ydp", rtol=1e-6, atol=1e-9, throw=False,
                     sensitivity=dae.Adjoint(fallback=False)).ys[-1, 0]


def _custom_calls(fn):
    exp = export.export(jax.jit(fn), platforms=["cuda"])(jax.ShapeDtypeStruct((4, 3), jnp.float64))
    assert exp.platforms == ("cuda",)
    text = exp.mlir_module()
    return set(re.findall(r"stablehlo\.custom_call @([\w.\-]+)", text)) | set(
        re.findall(r'call_target_name = "([^"]+)"', text))


def _gpu_only(calls):
    # GPU kernels JAX itself registers (cuSOLVER/cuBLAS, XLA's own markers).
    allowed = re.compile(r"^(cu|cusolver|cublas|hipsolver|Sharding|SPMDFullToShardShape|"
                         r"SPMDShardToFullShape|annotate_device_placement|xla\.|mhlo\.)")
    return {c for c in calls if not allowed.match(c)}


def test_vmap_solve_lowers_for_cuda():
    assert _gpu_only(_custom_calls(jax.vmap(y1))) == set()


@pytest.mark.slow
@pytest.mark.parametrize("transform", [jax.grad, jax.jacfwd])
def test_vmap_derivatives_lower_for_cuda(transform):
    assert _gpu_only(_custom_calls(jax.vmap(transform(y1)))) == set()
