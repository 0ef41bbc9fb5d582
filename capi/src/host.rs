//! Host memory that the other ranks of a host copy directly (`cclHostAlloc`).

use std::{ffi::c_void, sync::Mutex};

use ccl::{Error, SharedBuffer};

use crate::{comm::out, errors::entry, types::cclResult_t};

/// The buffers of `cclHostAlloc`, until `cclHostFree`.
static BUFFERS: Mutex<Vec<SharedBuffer>> = Mutex::new(Vec::new());

fn buffers() -> std::sync::MutexGuard<'static, Vec<SharedBuffer>> {
    BUFFERS.lock().unwrap_or_else(|p| p.into_inner())
}

/// Allocates `size` bytes (at least 1) of zeroed host memory and writes its
/// address to `ptr`. The other ranks of this host map it and copy a
/// collective's blocks out of it (and into it) with their own loads and
/// stores, where other memory is copied by the kernel: allgather,
/// all-to-all, broadcast, gather and scatter over shared memory move large
/// blocks about twice as fast. Peers keep their mapping after
/// `cclHostFree` until their communicator is destroyed or maps many other
/// buffers; the memory returns to the system then. Thread-safe.
#[no_mangle]
pub extern "C" fn cclHostAlloc(ptr: *mut *mut c_void, size: usize) -> cclResult_t {
    entry(std::ptr::null_mut(), || {
        let ptr = out(ptr, "ptr")?;
        *ptr = std::ptr::null_mut();
        let mut buf = SharedBuffer::new(size)?;
        *ptr = buf.as_bytes_mut().as_mut_ptr().cast();
        buffers().push(buf);
        Ok(())
    })
}

/// Frees memory of `cclHostAlloc` (NULL: nothing). The calls that use it
/// must have completed. Thread-safe.
#[no_mangle]
pub extern "C" fn cclHostFree(ptr: *mut c_void) -> cclResult_t {
    entry(std::ptr::null_mut(), || {
        if ptr.is_null() {
            return Ok(());
        }
        let mut all = buffers();
        let at = all
            .iter()
            .position(|b| b.as_bytes().as_ptr() == ptr.cast_const().cast())
            .ok_or_else(|| {
                Error::InvalidArgument(format!("{ptr:p} is no memory of cclHostAlloc's"))
            })?;
        drop(all.swap_remove(at));
        Ok(())
    })
}
