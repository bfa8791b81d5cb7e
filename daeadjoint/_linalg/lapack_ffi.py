"""LAPACK's band LU as XLA FFI custom calls on the CPU, compiled by numba.

XLA runs a custom call in place, on the buffers of the program, with no Python and no
copies; a `jax.pure_callback` instead enters the interpreter and copies its operands on
every call (for `band_lapack.py`'s solve: the factors, n·(2l + u + 1) numbers, per
right-hand side). Through these custom calls a factorization and its solves cost what
LAPACK's dgbtrf and dgbtrs cost alone.

The handlers are written against XLA's FFI C API (`xla/ffi/api/c_api.h`, API version
0.x, whose structures only ever grow at the end): a handler receives one
`XLA_FFI_CallFrame*` and returns an `XLA_FFI_Error*` (NULL: success). We read the
argument and result buffers at their fixed offsets, answer XLA's metadata query (the
handler's API version) and call LAPACK's `?gbtrf`/`?gbtrs` through the function pointers
that scipy exports (`scipy.linalg.cython_lapack`): the same LAPACK that
`scipy.linalg.lapack` uses, so nothing is linked here. numba compiles the handlers to
machine code when the kernel is first used (about a second per dtype).

Targets, for dtype in {float32, float64} (`targets(dtype)`):

- factor: operands (params = [l, u, 0] int32, band (…, n, w)); results (lu (…, n, w),
  ipiv (…, n) int32, 1-based as LAPACK's). A matrix with a non-finite entry is not given
  to LAPACK: its factors are NaN (so the singularity test fails) and its pivots the
  identity (so a solve with them stays in bounds).
- solve: operands (params = [l, u, trans] int32, lu (B…, n, w), ipiv (B…, n), rhs);
  result x. The right-hand sides are rhs reshaped to (B, R, n): R of them per matrix
  (R = size(rhs) / (B·n)), solved by one gbtrs call per matrix.
"""

import ctypes
import functools
from collections.abc import Callable
from typing import NamedTuple

import numpy as np


# XLA_FFI_CallFrame (c_api.h), in 8-byte words: struct_size, extension_start, api, ctx,
# stage, args {struct_size, extension_start, size, types, args}, rets {…, rets}, …
_EXTENSION_START = 1
_ARGS = 9                  # call_frame->args.args: XLA_FFI_Buffer* per operand
_RETS = 14                 # call_frame->rets.rets: XLA_FFI_Buffer* per result
# XLA_FFI_Buffer: struct_size, extension_start, dtype, data, rank, dims (words 3, 4, 5)
_DATA, _RANK, _DIMS = 3, 4, 5
_METADATA_EXTENSION = 1    # XLA_FFI_Extension_Metadata
# The FFI API version the handlers declare (XLA accepts a handler of an older minor
# version of the same major version).
_API_MAJOR, _API_MINOR = 0, 1


class FFIUnavailable(RuntimeError):
    """The LAPACK custom calls cannot be built here (no numba, or XLA refused them)."""


def targets(dtype) -> tuple[str, str]:
    """Register (once) and return the (factor, solve) FFI target names for `dtype`.
    Raises `FFIUnavailable` naming why when numba or the registration fails."""
    dtype = np.dtype(dtype)
    if dtype not in (np.float32, np.float64):
        raise FFIUnavailable(f"LAPACK band kernels exist for float32 and float64, not {dtype}.")
    return _register(dtype.name)


@functools.cache
def _register(name: str) -> tuple[str, str]:
    dtype = np.dtype(name)
    try:
        import jax
        factor, solve = _compile(dtype.char)
        names = (f"daeadjoint_{dtype.name}_gbtrf", f"daeadjoint_{dtype.name}_gbtrs")
        for name, fn in zip(names, (factor, solve)):
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


class _CallFrame(NamedTuple):
    """numba functions that read XLA's FFI call frame (`xla/ffi/api/c_api.h`), inlined
    into the handlers: typed views of raw addresses, the metadata query, and the
    operand and result buffers."""

    pointer_to: Callable       # numba type -> intrinsic: int64 address -> typed pointer
    as_i64: Callable
    as_i32: Callable
    answer_metadata: Callable  # frame -> whether the call was XLA's metadata query
    buffer: Callable           # (frame, _ARGS or _RETS, k) -> (data, rank, dims address)
    matrix_operands: Callable  # frame -> (params, data, batch, n, w)


@functools.cache
def _call_frame() -> _CallFrame:
    """Build (once) the call-frame readers shared by every handler and dtype."""
    import numba
    from numba import types
    from numba.extending import intrinsic

    def pointer_to(t):
        @intrinsic
        def to_pointer(typingctx, address):
            def codegen(context, builder, signature, args):
                return builder.inttoptr(args[0], context.get_value_type(signature.return_type))
            return types.CPointer(t)(address), codegen
        return to_pointer

    as_i64, as_i32 = pointer_to(types.int64), pointer_to(types.int32)
    jit = numba.njit(inline="always")

    @jit
    def answer_metadata(frame):
        """XLA asks for the handler's API version with a metadata extension."""
        ext = as_i64(frame)[_EXTENSION_START]
        if ext != 0 and as_i32(ext)[2] == _METADATA_EXTENSION:
            metadata = as_i64(ext)[3]
            as_i32(metadata)[6] = _API_MAJOR     # metadata->api_version.major_version
            as_i32(metadata)[7] = _API_MINOR
            as_i32(metadata)[8] = 0              # traits
            as_i64(metadata)[5] = 0              # state_type_id: XLA_FFI_UNKNOWN_TYPE_ID
            return True
        return False

    @jit
    def buffer(frame, which, k):
        b = as_i64(as_i64(frame)[which])[k]
        words = as_i64(b)
        return words[_DATA], words[_RANK], words[_DIMS]

    @jit
    def matrix_operands(frame):
        """The operands both handlers start with: the params [l, u, trans] and a batch of
        (…, n, w) band matrices, as (params, data address, batch size, n, w)."""
        params = as_i32(buffer(frame, _ARGS, 0)[0])
        data, rank, dims_address = buffer(frame, _ARGS, 1)
        dims = as_i64(dims_address)
        batch = 1
        for k in range(rank - 2):
            batch *= dims[k]
        return params, data, batch, dims[rank - 2], dims[rank - 1]

    return _CallFrame(pointer_to=pointer_to, as_i64=as_i64, as_i32=as_i32,
                      answer_metadata=answer_metadata, buffer=buffer,
                      matrix_operands=matrix_operands)


def _lapack_routines(prefix: str):
    """scipy's LAPACK `?gbtrf` and `?gbtrs` for precision `prefix` ('d', 's') as ctypes
    function pointers (every argument by address)."""
    from numba.extending import get_cython_function_address

    vp = ctypes.c_void_p
    gbtrf = ctypes.CFUNCTYPE(None, *[vp] * 8)(
        get_cython_function_address("scipy.linalg.cython_lapack", prefix + "gbtrf"))
    gbtrs = ctypes.CFUNCTYPE(None, *[vp] * 11)(
        get_cython_function_address("scipy.linalg.cython_lapack", prefix + "gbtrs"))
    return gbtrf, gbtrs


def _compile(char: str):
    """numba-compile the factor and solve handlers for LAPACK precision `char` ('d', 'f'):
    each decodes its call frame (`_call_frame`) and calls LAPACK (`_lapack_routines`)."""
    import numba
    from numba import carray, types

    real = {"d": types.float64, "f": types.float32}[char]
    gbtrf, gbtrs = _lapack_routines({"d": "d", "f": "s"}[char])
    frame_api = _call_frame()
    # Locals, not attribute lookups: numba freezes a handler's free variables.
    answer_metadata, buffer = frame_api.answer_metadata, frame_api.buffer
    matrix_operands, as_i32 = frame_api.matrix_operands, frame_api.as_i32
    as_i64, as_real = frame_api.as_i64, frame_api.pointer_to(real)

    @numba.cfunc(types.intp(types.intp), nopython=True)
    def factor(frame):
        if answer_metadata(frame):
            return 0
        params, band_data, batch, n, w = matrix_operands(frame)
        band = carray(as_real(band_data), (batch * n * w,))
        lu = carray(as_real(buffer(frame, _RETS, 0)[0]), (batch * n * w,))
        ipiv = carray(as_i32(buffer(frame, _RETS, 1)[0]), (batch * n,))
        ints = np.empty(6, np.int32)    # m, n, kl, ku, ldab, info: LAPACK takes pointers
        ints[0] = n
        ints[1] = n
        ints[2] = params[0]
        ints[3] = params[1]
        ints[4] = w
        for b in range(batch):
            start, finite = b * n * w, True
            for k in range(start, start + n * w):
                v = band[k]
                lu[k] = v
                finite = finite and np.isfinite(v)
            if not finite:
                lu[start:start + n * w] = np.nan
                for i in range(n):
                    ipiv[b * n + i] = i + 1
                continue
            gbtrf(ints[0:].ctypes, ints[1:].ctypes, ints[2:].ctypes, ints[3:].ctypes,
                  lu[start:].ctypes, ints[4:].ctypes, ipiv[b * n:].ctypes, ints[5:].ctypes)
        return 0

    @numba.cfunc(types.intp(types.intp), nopython=True)
    def solve(frame):
        if answer_metadata(frame):
            return 0
        params, lu_data, batch, n, w = matrix_operands(frame)
        rhs_data, rhs_rank, rhs_dims = buffer(frame, _ARGS, 3)
        size = 1
        for k in range(rhs_rank):
            size *= as_i64(rhs_dims)[k]
        lu = carray(as_real(lu_data), (batch * n * w,))
        ipiv = carray(as_i32(buffer(frame, _ARGS, 2)[0]), (batch * n,))
        rhs = carray(as_real(rhs_data), (size,))
        x = carray(as_real(buffer(frame, _RETS, 0)[0]), (size,))
        x[:] = rhs
        nrhs = size // (batch * n)
        ints = np.empty(7, np.int32)    # n, kl, ku, nrhs, ldab, ldb, info
        ints[0] = n
        ints[1] = params[0]
        ints[2] = params[1]
        ints[3] = nrhs
        ints[4] = w
        ints[5] = n
        trans = np.empty(1, np.uint8)
        trans[0] = 84 if params[2] else 78                        # 'T' or 'N'
        for b in range(batch):
            gbtrs(trans.ctypes, ints[0:].ctypes, ints[1:].ctypes, ints[2:].ctypes,
                  ints[3:].ctypes, lu[b * n * w:].ctypes, ints[4:].ctypes,
                  ipiv[b * n:].ctypes, x[b * nrhs * n:].ctypes, ints[5:].ctypes,
                  ints[6:].ctypes)
        return 0

    return factor, solve
