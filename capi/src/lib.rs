//! ccl's C ABI: the library `libcclrs` (shared and static) and its header
//! `include/ccl.h`, generated from this crate by cbindgen and checked to
//! match it by `cargo test`. The calls have NCCL's shape (`cclAllReduce`,
//! `cclCommInitRank` with a unique id, `cclGroupStart`/`cclGroupEnd`), and
//! add nothing to the library but conversion and the checks C needs: every
//! call goes through `ccl::Communicator`'s one untyped call path.
//!
//! What C can get wrong becomes a result code and a message, never
//! undefined behaviour: handles are looked up (a destroyed or made-up one is
//! found out), pointers and counts are checked, enum values are plain
//! integers checked on entry, no panic crosses the boundary, and a call on a
//! communicator while another thread is in one is refused. See
//! `capi/README.md` for the rules and an example.

// C names. The entry points are safe `extern "C"` functions that take C's
// pointers, checked (null, length, alignment) before use, with the caller's
// duties in the header; the crate builds no rlib, so no Rust code calls them.
#![allow(non_camel_case_types, non_upper_case_globals)]
#![allow(clippy::not_unsafe_ptr_arg_deref)]

mod calls;
mod comm;
mod device;
mod errors;
mod handles;
mod host;
mod types;
mod work;

use std::ffi::c_char;

pub use calls::*;
pub use comm::*;
pub use device::*;
pub use host::*;
pub use types::*;
pub use work::*;

/// A short description of a result code, as a string that lives forever.
/// Thread-safe.
#[no_mangle]
pub extern "C" fn cclGetErrorString(result: cclResult_t) -> *const c_char {
    errors::describe(result)
}

/// The message of the last failure on `comm` (naming ranks and calls), or,
/// for NULL or a dead handle, of the calling thread's last failure; an
/// empty string if none. It stays valid until the next failure on `comm`
/// (or of the thread) and until `comm` is destroyed.
#[no_mangle]
pub extern "C" fn cclGetLastError(comm: cclComm_t) -> *const c_char {
    errors::last_error(comm)
}
