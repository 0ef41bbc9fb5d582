//! The C vocabulary: result codes, element types and reduction ops as
//! plain integers (a value C passes that names nothing is an error, never
//! undefined behaviour), opaque handles, the unique id.

use std::ffi::{c_char, c_int};

use ccl::{DataType, Error, ErrorCode, ReduceOp, Result};

/// What every call returns: `cclSuccess`, or the kind of failure;
/// `cclGetLastError` has the message. The numbers never change.
pub type cclResult_t = c_int;
/// The call succeeded.
pub const cclSuccess: cclResult_t = 0;
/// Bad arguments (a null pointer, a count out of range, a foreign or
/// destroyed handle, a call from a second thread), detected before anything
/// was sent.
pub const cclInvalidArgument: cclResult_t = 1;
/// A deadline passed (`cclCommSetTimeout`, `CCL_TIMEOUT`).
pub const cclTimeout: cclResult_t = 2;
/// A peer exited, its link dropped, or it reported its own failure.
pub const cclPeerLost: cclResult_t = 3;
/// Ranks made different calls.
pub const cclMismatch: cclResult_t = 4;
/// Bytes from a peer broke the protocol.
pub const cclProtocolError: cclResult_t = 5;
/// The rendezvous store failed.
pub const cclStoreError: cclResult_t = 6;
/// The configuration (environment variables, addresses) is missing or wrong.
pub const cclConfigError: cclResult_t = 7;
/// An operating-system call failed.
pub const cclSystemError: cclResult_t = 8;
/// The communicator failed earlier (or was aborted) and can no longer be used.
pub const cclBroken: cclResult_t = 9;
/// A bug in ccl.
pub const cclInternalError: cclResult_t = 10;
/// Something this build cannot do (device memory without GPU support).
pub const cclUnsupported: cclResult_t = 11;

/// An element type.
pub type cclDataType_t = c_int;
pub const cclInt8: cclDataType_t = 0;
pub const cclUint8: cclDataType_t = 1;
pub const cclInt32: cclDataType_t = 2;
pub const cclUint32: cclDataType_t = 3;
pub const cclInt64: cclDataType_t = 4;
pub const cclUint64: cclDataType_t = 5;
pub const cclFloat16: cclDataType_t = 6;
pub const cclFloat32: cclDataType_t = 7;
pub const cclFloat64: cclDataType_t = 8;
pub const cclBfloat16: cclDataType_t = 9;

/// A reduction op: one of the constants, or an op made by
/// `cclRedOpCreatePreMulSum` on a communicator.
pub type cclRedOp_t = c_int;
pub const cclSum: cclRedOp_t = 0;
pub const cclProd: cclRedOp_t = 1;
pub const cclMax: cclRedOp_t = 2;
pub const cclMin: cclRedOp_t = 3;
/// Sum divided by the number of ranks (integer division for integers).
pub const cclAvg: cclRedOp_t = 4;
/// Bitwise and, or, xor (integer types only).
pub const cclBand: cclRedOp_t = 5;
pub const cclBor: cclRedOp_t = 6;
pub const cclBxor: cclRedOp_t = 7;
/// The first number of the ops `cclRedOpCreatePreMulSum` makes.
pub const CCL_FIRST_CREATED_OP: cclRedOp_t = 0x1000;

/// Where the scalar of `cclRedOpCreatePreMulSum` lies.
pub type cclScalarResidence_t = c_int;
/// In host memory, read when the op is created.
pub const cclScalarHostImmediate: cclScalarResidence_t = 0;
/// In device memory (needs GPU support: unsupported in this build).
pub const cclScalarDevice: cclScalarResidence_t = 1;

/// `cclCommSplit`'s color of a rank that joins no new communicator.
pub const CCL_SPLIT_NOCOLOR: c_int = -1;

/// Bytes of a `cclUniqueId`.
pub const CCL_UNIQUE_ID_BYTES: usize = 256;

/// What `cclGetUniqueId` makes on one rank and the program hands to every
/// rank by its own means (`MPI_Bcast`, a file): the address of a rendezvous
/// and the secret of the job. Treat it as a secret.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct cclUniqueId {
    pub internal: [c_char; CCL_UNIQUE_ID_BYTES],
}

/// A communicator (opaque).
pub struct cclComm {
    _opaque: [u8; 0],
}

/// A handle on a communicator.
pub type cclComm_t = *mut cclComm;

/// An asynchronous call in progress (opaque).
pub struct cclWork {
    _opaque: [u8; 0],
}

/// A handle on an asynchronous call.
pub type cclWork_t = *mut cclWork;

/// The element type a C value names.
pub(crate) fn dtype(v: cclDataType_t) -> Result<DataType> {
    Ok(match v {
        cclInt8 => DataType::I8,
        cclUint8 => DataType::U8,
        cclInt32 => DataType::I32,
        cclUint32 => DataType::U32,
        cclInt64 => DataType::I64,
        cclUint64 => DataType::U64,
        cclFloat16 => DataType::F16,
        cclFloat32 => DataType::F32,
        cclFloat64 => DataType::F64,
        cclBfloat16 => DataType::Bf16,
        _ => return Err(Error::InvalidArgument(format!("{v} is no cclDataType_t"))),
    })
}

/// The op a fixed C value names; `None` for values of created ops.
pub(crate) fn fixed_op(v: cclRedOp_t) -> Option<ReduceOp> {
    const OPS: [ReduceOp; 8] = [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Max,
        ReduceOp::Min,
        ReduceOp::Avg,
        ReduceOp::BitAnd,
        ReduceOp::BitOr,
        ReduceOp::BitXor,
    ];
    usize::try_from(v).ok().and_then(|i| OPS.get(i).copied())
}

/// The C code of an error.
pub(crate) fn code(e: &Error) -> cclResult_t {
    e.code() as cclResult_t
}

/// The error code a C value names.
pub(crate) fn error_code(v: cclResult_t) -> Option<ErrorCode> {
    ErrorCode::from_i32(v)
}
