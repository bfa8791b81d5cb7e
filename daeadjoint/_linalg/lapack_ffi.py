"""LAPACK's band LU as XLA FFI custom calls on the CPU, compiled by numba.

XLA runs a custom call in place, on the buffers of the program, with no Python and no
copies; a `jax.pure_callback` instead enters the interpreter and copies its operands on
every call (for `band_lapack.py`'s solve: the factors, n·(2l + u + 1) numbers, per
right-hand side). Through these custom calls a factorization and its solves cost what
LAPACK's dgbtrf and dgbtrs cost alone.

The handlers (`_lapack_kernels.py`) are written against XLA's FFI C API
(`xla/ffi/api/c_api.h`, API version 0.x, whose structures only ever grow at the end): a
handler receives one `XLA_FFI_CallFrame*` and returns an `XLA_FFI_Error*` (NULL:
success). They read the argument and result buffers at their fixed offsets, answer XLA's
metadata query (the handler's API version) and call LAPACK's `?gbtrf`/`?gbtrs` exported by
scipy (`scipy.linalg.cython_lapack`): the same LAPACK that `scipy.linalg.lapack` uses, so
nothing is linked here. numba compiles the handlers when the kernel is first used (about
a second) and caches the machine code on disk, so later processes load it; the programs
that call them hold only the target names, so JAX's persistent compilation cache can
store them.

Targets, for dtype in {float32, float64} (`targets(dtype)`):

- factor: operands (params = [l, u, 0] int32, values (…, nnz), index (nnz,) int32: the
  flat position of each nonzero in the (n, w) band storage); results (lu (…, n, w),
  ipiv (…, n) int32, 1-based as LAPACK's). The handler assembles each member's band
  (zeros, then the nonzeros) in its result block and factorizes it there. A matrix
  with a non-finite entry is not given to LAPACK: its factors are NaN (so the
  singularity test fails) and its pivots the identity (so a solve with them stays in
  bounds).
- factor_where: operands (params, values, index as for factor — each broadcast to the
  batch, of which the handler reads the first —, pred (…) int32, lu (…, n, w),
  ipiv (…, n)); results (lu, ipiv), aliased to the operands lu and ipiv: only the
  members with pred ≠ 0 are assembled and factorized, the others keep their factors
  untouched (under `vmap`, the members of a batch that need a new Jacobian).
- solve: operands (params = [l, u, trans] int32, lu (B…, n, w), ipiv (B…, n), rhs);
  result x. The right-hand sides are rhs reshaped to (B, R, n): R of them per matrix
  (R = size(rhs) / (B·n)), solved by one gbtrs call per matrix.
- solve_where: operands (params, lu, ipiv, rhs as for solve, pred (B…) int32); result x:
  solved with the matrices b where pred[b] ≠ 0 only, x = rhs for the others (under
  `vmap`, the members of a batch whose Newton iteration is still running).
"""

import ctypes
import functools

import numpy as np


class FFIUnavailable(RuntimeError):
    """The LAPACK custom calls cannot be built here (no numba, or XLA refused them)."""


def targets(dtype) -> tuple[str, str, str, str]:
    """Register (once) and return the (factor, solve, factor_where, solve_where) FFI
    target names for `dtype`.
    Raises `FFIUnavailable` naming why when numba or the registration fails."""
    dtype = np.dtype(dtype)
    if dtype not in (np.float32, np.float64):
        raise FFIUnavailable(f"LAPACK band kernels exist for float32 and float64, not {dtype}.")
    return _register(dtype.name)


@functools.cache
def _register(name: str) -> tuple[str, str, str, str]:
    dtype = np.dtype(name)
    try:
        import jax
        from . import _lapack_kernels as kernels
        handlers = {"float64": (kernels.factor_f64, kernels.solve_f64,
                                kernels.factor_where_f64, kernels.solve_where_f64),
                    "float32": (kernels.factor_f32, kernels.solve_f32,
                                kernels.factor_where_f32, kernels.solve_where_f32)}[dtype.name]
        names = (f"daeadjoint_{dtype.name}_gbtrf", f"daeadjoint_{dtype.name}_gbtrs",
                 f"daeadjoint_{dtype.name}_gbtrf_where", f"daeadjoint_{dtype.name}_gbtrs_where")
        for name, fn in zip(names, handlers):
            capsule = jax.ffi.pycapsule(ctypes.cast(fn.address, ctypes.CFUNCTYPE(None)))
            jax.ffi.register_ffi_target(name, capsule, platform="cpu")
    except Exception as e:  # any failure means: use the pure-JAX kernel
        raise FFIUnavailable(f"{type(e).__name__}: {e}") from e
    return names


@functools.lru_cache(maxsize=1)
def available() -> str | None:
    """None when the float64 kernels build and register here, else why not."""
    try:
        targets(np.float64)
    except FFIUnavailable as e:
        return str(e)
    return None
