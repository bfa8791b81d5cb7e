"""The numba-compiled XLA FFI handlers of `lapack_ffi.py` (imported only when the LAPACK
band kernel is first used: importing this module compiles the handlers, or loads them
from numba's on-disk cache).

Every function here is defined at module level and compiled with `cache=True`, so a
second Python process loads the machine code instead of recompiling it (numba's
compilation dominates the first use of the kernel: ~1 s on a quiet core). numba caches
only functions without process-specific constants, so LAPACK is not called through a
ctypes pointer (an address, frozen into the code) but through an external symbol,
`daeadjoint_?gbtrf`, that this module binds to scipy's `scipy.linalg.cython_lapack`
routine in the process's symbol table before any handler is compiled or loaded.

Handlers (`lapack_ffi.py` documents their operands and results): `factor_f64`,
`solve_f64`, `factor_where_f64`, `solve_where_f64` and their `_f32` twins, each `intp(intp)`: frame
address -> 0.
"""

import llvmlite.binding as llvm
import numba
import numpy as np
from numba import carray, types
from numba.extending import get_cython_function_address, intrinsic

# XLA_FFI_CallFrame (xla/ffi/api/c_api.h), in 8-byte words: struct_size, extension_start,
# api, ctx, stage, args {struct_size, extension_start, size, types, args}, rets {…, rets}.
_EXTENSION_START = 1
_ARGS = 9                  # call_frame->args.args: XLA_FFI_Buffer* per operand
_RETS = 14                 # call_frame->rets.rets: XLA_FFI_Buffer* per result
# XLA_FFI_Buffer: struct_size, extension_start, dtype, data, rank, dims (words 3, 4, 5)
_DATA, _RANK, _DIMS = 3, 4, 5
_METADATA_EXTENSION = 1    # XLA_FFI_Extension_Metadata
# The FFI API version the handlers declare (XLA accepts a handler of an older minor
# version of the same major version).
_API_MAJOR, _API_MINOR = 0, 1


def _external(name: str, lapack_name: str, nargs: int):
    """scipy's LAPACK routine `lapack_name` as the external symbol `name` (every argument
    by address, as Fortran passes them)."""
    llvm.add_symbol(name, get_cython_function_address("scipy.linalg.cython_lapack", lapack_name))
    return types.ExternalFunction(name, types.void(*[types.voidptr] * nargs))


_dgbtrf = _external("daeadjoint_dgbtrf", "dgbtrf", 8)
_sgbtrf = _external("daeadjoint_sgbtrf", "sgbtrf", 8)
_dgbtrs = _external("daeadjoint_dgbtrs", "dgbtrs", 11)
_sgbtrs = _external("daeadjoint_sgbtrs", "sgbtrs", 11)


def _pointer_to(t):
    @intrinsic
    def to_pointer(typingctx, address):
        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(signature.return_type))
        return types.CPointer(t)(address), codegen
    return to_pointer


_as_i64 = _pointer_to(types.int64)
_as_i32 = _pointer_to(types.int32)
_as_f64 = _pointer_to(types.float64)
_as_f32 = _pointer_to(types.float32)
_inline = numba.njit(inline="always", cache=True)


@_inline
def _answer_metadata(frame):
    """XLA asks for the handler's API version with a metadata extension."""
    ext = _as_i64(frame)[_EXTENSION_START]
    if ext != 0 and _as_i32(ext)[2] == _METADATA_EXTENSION:
        metadata = _as_i64(ext)[3]
        _as_i32(metadata)[6] = _API_MAJOR     # metadata->api_version.major_version
        _as_i32(metadata)[7] = _API_MINOR
        _as_i32(metadata)[8] = 0              # traits
        _as_i64(metadata)[5] = 0              # state_type_id: XLA_FFI_UNKNOWN_TYPE_ID
        return True
    return False


@_inline
def _buffer(frame, which, k):
    """(data, rank, dims address) of operand (`_ARGS`) or result (`_RETS`) k."""
    b = _as_i64(_as_i64(frame)[which])[k]
    words = _as_i64(b)
    return words[_DATA], words[_RANK], words[_DIMS]


@_inline
def _matrix_operands(frame):
    """The operands both handlers start with: the params [l, u, trans] and a batch of
    (…, n, w) band matrices, as (params, data address, batch size, n, w)."""
    params = _as_i32(_buffer(frame, _ARGS, 0)[0])
    data, rank, dims_address = _buffer(frame, _ARGS, 1)
    dims = _as_i64(dims_address)
    batch = 1
    for k in range(rank - 2):
        batch *= dims[k]
    return params, data, batch, dims[rank - 2], dims[rank - 1]


@_inline
def _factor(values, index, lu, ipiv, b, nnz, n, w, kl, ku, double):
    """lu, ipiv of member b = gbtrf(band), the band assembled here from its nonzeros
    (`values[b, k]` at flat position `index[k]` of the (n, w) storage, zeros elsewhere):
    in the member's own block, while it is in the cache, instead of a zero fill and a
    scatter of the whole batch in XLA. A matrix with a non-finite entry is not given to
    LAPACK: NaN factors (the singularity test fails) and identity pivots (a solve with
    them stays in bounds)."""
    ints = np.empty(6, np.int32)    # m, n, kl, ku, ldab, info: LAPACK takes pointers
    ints[0] = n
    ints[1] = n
    ints[2] = kl
    ints[3] = ku
    ints[4] = w
    start, finite = b * n * w, True
    lu[start:start + n * w] = 0.0
    for k in range(nnz):
        v = values[b * nnz + k]
        lu[start + index[k]] = v
        finite = finite and np.isfinite(v)
    if not finite:
        lu[start:start + n * w] = np.nan
        for i in range(n):
            ipiv[b * n + i] = i + 1
        return
    args = (ints[0:].ctypes, ints[1:].ctypes, ints[2:].ctypes, ints[3:].ctypes,
            lu[start:].ctypes, ints[4:].ctypes, ipiv[b * n:].ctypes, ints[5:].ctypes)
    if double:
        _dgbtrf(*args)
    else:
        _sgbtrf(*args)


@_inline
def _solve(lu, ipiv, rhs, x, batch, n, w, kl, ku, transpose, double, pred, masked):
    """x = rhs solved with the factors, nrhs = size(rhs) / (batch n) per matrix; if
    `masked`, only with the matrices b where pred[b] ≠ 0 (elsewhere x = rhs)."""
    x[:] = rhs
    nrhs = rhs.size // (batch * n)
    ints = np.empty(7, np.int32)    # n, kl, ku, nrhs, ldab, ldb, info
    ints[0] = n
    ints[1] = kl
    ints[2] = ku
    ints[3] = nrhs
    ints[4] = w
    ints[5] = n
    trans = np.empty(1, np.uint8)
    trans[0] = 84 if transpose else 78                        # 'T' or 'N'
    for b in range(batch):
        if masked and pred[b] == 0:
            continue
        # gbtrs swaps x(j) with x(ipiv(j)) unchecked: pivots out of 1..n (factors never
        # computed, as a batch member that failed before its first setup carries: zeros)
        # would read and write the neighbouring member's right-hand sides, or outside the
        # buffer. Such a member's solution is NaN instead.
        valid = True
        for i in range(n):
            p = ipiv[b * n + i]
            valid = valid and 1 <= p <= n
        if not valid:
            x[b * nrhs * n:(b + 1) * nrhs * n] = np.nan
            continue
        args = (trans.ctypes, ints[0:].ctypes, ints[1:].ctypes, ints[2:].ctypes,
                ints[3:].ctypes, lu[b * n * w:].ctypes, ints[4:].ctypes,
                ipiv[b * n:].ctypes, x[b * nrhs * n:].ctypes, ints[5:].ctypes,
                ints[6:].ctypes)
        if double:
            _dgbtrs(*args)
        else:
            _sgbtrs(*args)


@_inline
def _rhs_size(frame):
    rhs_data, rhs_rank, rhs_dims = _buffer(frame, _ARGS, 3)
    size = 1
    for k in range(rhs_rank):
        size *= _as_i64(rhs_dims)[k]
    return rhs_data, size


_handler = numba.cfunc(types.intp(types.intp), nopython=True, cache=True)


@_inline
def _factor_operands(frame):
    """(params, values address, batch, nnz, index address, lu address, n, w, ipiv
    address) of a factor call: operands params, values (…, nnz), index (nnz) (or with
    leading unit axes); results lu (…, n, w), ipiv (…, n)."""
    params = _as_i32(_buffer(frame, _ARGS, 0)[0])
    values, rank, dims_address = _buffer(frame, _ARGS, 1)
    dims = _as_i64(dims_address)
    batch = 1
    for k in range(rank - 1):
        batch *= dims[k]
    nnz = dims[rank - 1]
    index = _buffer(frame, _ARGS, 2)[0]
    lu, lu_rank, lu_dims = _buffer(frame, _RETS, 0)
    n, w = _as_i64(lu_dims)[lu_rank - 2], _as_i64(lu_dims)[lu_rank - 1]
    return params, values, batch, nnz, index, lu, n, w, _buffer(frame, _RETS, 1)[0]


@_handler
def factor_f64(frame):
    if _answer_metadata(frame):
        return 0
    params, values, batch, nnz, index, lu, n, w, ipiv = _factor_operands(frame)
    for b in range(batch):
        _factor(carray(_as_f64(values), (batch * nnz,)), carray(_as_i32(index), (nnz,)),
                carray(_as_f64(lu), (batch * n * w,)), carray(_as_i32(ipiv), (batch * n,)),
                b, nnz, n, w, params[0], params[1], True)
    return 0


@_handler
def factor_f32(frame):
    if _answer_metadata(frame):
        return 0
    params, values, batch, nnz, index, lu, n, w, ipiv = _factor_operands(frame)
    for b in range(batch):
        _factor(carray(_as_f32(values), (batch * nnz,)), carray(_as_i32(index), (nnz,)),
                carray(_as_f32(lu), (batch * n * w,)), carray(_as_i32(ipiv), (batch * n,)),
                b, nnz, n, w, params[0], params[1], False)
    return 0


@_handler
def factor_where_f64(frame):
    if _answer_metadata(frame):
        return 0
    params, values, batch, nnz, index, lu, n, w, ipiv = _factor_operands(frame)
    pred = carray(_as_i32(_buffer(frame, _ARGS, 3)[0]), (batch,))
    for b in range(batch):
        if pred[b] != 0:     # the others keep their factors: lu, ipiv alias the old ones
            _factor(carray(_as_f64(values), (batch * nnz,)), carray(_as_i32(index), (nnz,)),
                    carray(_as_f64(lu), (batch * n * w,)),
                    carray(_as_i32(ipiv), (batch * n,)),
                    b, nnz, n, w, params[0], params[1], True)
    return 0


@_handler
def factor_where_f32(frame):
    if _answer_metadata(frame):
        return 0
    params, values, batch, nnz, index, lu, n, w, ipiv = _factor_operands(frame)
    pred = carray(_as_i32(_buffer(frame, _ARGS, 3)[0]), (batch,))
    for b in range(batch):
        if pred[b] != 0:
            _factor(carray(_as_f32(values), (batch * nnz,)), carray(_as_i32(index), (nnz,)),
                    carray(_as_f32(lu), (batch * n * w,)),
                    carray(_as_i32(ipiv), (batch * n,)),
                    b, nnz, n, w, params[0], params[1], False)
    return 0


@_handler
def solve_f64(frame):
    if _answer_metadata(frame):
        return 0
    params, data, batch, n, w = _matrix_operands(frame)
    rhs_data, size = _rhs_size(frame)
    _solve(carray(_as_f64(data), (batch * n * w,)),
           carray(_as_i32(_buffer(frame, _ARGS, 2)[0]), (batch * n,)),
           carray(_as_f64(rhs_data), (size,)),
           carray(_as_f64(_buffer(frame, _RETS, 0)[0]), (size,)),
           batch, n, w, params[0], params[1], params[2] != 0, True,
           carray(_as_i32(_buffer(frame, _ARGS, 2)[0]), (1,)), False)
    return 0


@_handler
def solve_where_f64(frame):
    if _answer_metadata(frame):
        return 0
    params, data, batch, n, w = _matrix_operands(frame)
    rhs_data, size = _rhs_size(frame)
    _solve(carray(_as_f64(data), (batch * n * w,)),
           carray(_as_i32(_buffer(frame, _ARGS, 2)[0]), (batch * n,)),
           carray(_as_f64(rhs_data), (size,)),
           carray(_as_f64(_buffer(frame, _RETS, 0)[0]), (size,)),
           batch, n, w, params[0], params[1], params[2] != 0, True,
           carray(_as_i32(_buffer(frame, _ARGS, 4)[0]), (batch,)), True)
    return 0


@_handler
def solve_f32(frame):
    if _answer_metadata(frame):
        return 0
    params, data, batch, n, w = _matrix_operands(frame)
    rhs_data, size = _rhs_size(frame)
    _solve(carray(_as_f32(data), (batch * n * w,)),
           carray(_as_i32(_buffer(frame, _ARGS, 2)[0]), (batch * n,)),
           carray(_as_f32(rhs_data), (size,)),
           carray(_as_f32(_buffer(frame, _RETS, 0)[0]), (size,)),
           batch, n, w, params[0], params[1], params[2] != 0, False,
           carray(_as_i32(_buffer(frame, _ARGS, 2)[0]), (1,)), False)
    return 0


@_handler
def solve_where_f32(frame):
    if _answer_metadata(frame):
        return 0
    params, data, batch, n, w = _matrix_operands(frame)
    rhs_data, size = _rhs_size(frame)
    _solve(carray(_as_f32(data), (batch * n * w,)),
           carray(_as_i32(_buffer(frame, _ARGS, 2)[0]), (batch * n,)),
           carray(_as_f32(rhs_data), (size,)),
           carray(_as_f32(_buffer(frame, _RETS, 0)[0]), (size,)),
           batch, n, w, params[0], params[1], params[2] != 0, False,
           carray(_as_i32(_buffer(frame, _ARGS, 4)[0]), (batch,)), True)
    return 0
