//! Device memory from C, as NCCL takes it. A call with a stream (a
//! `cudaStream_t`, which is a `CUstream`) is queued on that stream, on the
//! GPU its buffers lie in, and returns once queued: work queued on the
//! stream afterwards sees the result. A call with a NULL stream whose
//! buffers the CUDA driver says are device memory is queued on the GPU's
//! default stream alike; with host buffers it runs on the host, as before.
//! Failures found after a call returned are reported by
//! `cclCommGetAsyncError` (and by `cclWorkWait` for a group ended with
//! `cclGroupEndAsync`).

use std::{
    collections::HashMap,
    ffi::c_void,
    sync::{Arc, Mutex, OnceLock},
    time::{Duration, Instant},
};

use ccl::{
    cuda::{self, Gpu, GpuEvent, RawStream, Stream},
    Error, MemoryKind, Result, Scratch, Work,
};

use crate::{
    comm::{lookup, out, CommState},
    errors::{entry, record},
    types::{cclComm_t, cclResult_t, cclSuccess, code},
};

/// Where a call runs.
pub(crate) enum Place {
    Host,
    /// On a GPU, ordered on a stream of its (0: the default stream).
    Device(Arc<dyn Gpu>, RawStream),
}

impl Place {
    /// The memory kind of the call's buffers.
    pub(crate) fn kind(&self) -> MemoryKind {
        match self {
            Place::Host => MemoryKind::Host,
            Place::Device(gpu, _) => MemoryKind::Device {
                ordinal: gpu.ordinal(),
            },
        }
    }

    /// The caller's stream.
    pub(crate) fn stream(&self) -> Option<Stream> {
        match self {
            Place::Host => None,
            // SAFETY: the caller's stream of that GPU, which NCCL's contract
            // (and ours) keeps alive until the work queued on it is done.
            Place::Device(gpu, raw) => Some(unsafe { Stream::borrow_raw(gpu.clone(), *raw) }),
        }
    }
}

/// A GPU to ask where memory lies, if this process can reach a CUDA driver
/// (or the stand-in): checked once.
fn driver() -> Option<&'static Arc<dyn Gpu>> {
    static GPU: OnceLock<Option<Arc<dyn Gpu>>> = OnceLock::new();
    GPU.get_or_init(|| cuda::current_device().and_then(cuda::open).ok())
        .as_ref()
}

/// Where a call on `state` with `stream` and `buffers` (pointer, bytes) runs.
pub(crate) fn place(
    state: &CommState,
    stream: *mut c_void,
    buffers: &[(*const c_void, usize)],
) -> Result<Place> {
    let used = || buffers.iter().filter(|(p, len)| *len > 0 && !p.is_null());
    if stream.is_null() {
        // A process that never touched CUDA (nor ccl's GPU calls) holds no
        // device memory: no context is made for it.
        if !cuda::gpu_in_use() {
            return Ok(Place::Host);
        }
        let Some(gpu) = driver() else {
            return Ok(Place::Host);
        };
        // Any buffer in device memory makes it a device call (where a host
        // buffer beside it is then refused, naming it).
        for &(ptr, _) in used() {
            if let MemoryKind::Device { ordinal } = gpu.kind_of(ptr.cast())? {
                return state.on_gpu(cuda::open(ordinal)?, 0);
            }
        }
        return Ok(Place::Host);
    }
    let gpu = driver().ok_or_else(|| match cuda::current_device() {
        Err(e) => e,
        Ok(_) => Error::Unsupported("a stream, but no GPU can be opened".into()),
    })?;
    // The GPU of the first buffer; for a call without any, the GPU of the
    // communicator's last device call (or the thread's current one).
    let ordinal = match used().next() {
        Some(&(ptr, _)) => match gpu.kind_of(ptr.cast())? {
            MemoryKind::Device { ordinal } => ordinal,
            // Refused with the driver's word when the call is checked.
            _ => gpu.ordinal(),
        },
        None => state.last_gpu().unwrap_or(gpu.ordinal()),
    };
    state.on_gpu(cuda::open(ordinal)?, stream as RawStream)
}

/// Device calls of a communicator that returned before they completed.
#[derive(Default)]
pub(crate) struct DeviceCalls {
    running: Vec<Work<()>>,
    /// The first failure of one that completed, for `cclCommGetAsyncError`.
    failed: Option<Error>,
    /// The GPU of the last device call.
    gpu: Option<u32>,
}

impl CommState {
    fn device(&self) -> std::sync::MutexGuard<'_, DeviceCalls> {
        self.device.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn last_gpu(&self) -> Option<u32> {
        self.device().gpu
    }

    fn on_gpu(&self, gpu: Arc<dyn Gpu>, raw: RawStream) -> Result<Place> {
        self.device().gpu = Some(gpu.ordinal());
        Ok(Place::Device(gpu, raw))
    }

    /// Keeps `work` (a device call that returned) until it completes; the
    /// error at once if it failed already.
    pub(crate) fn queued(&self, work: Work<()>) -> Result<()> {
        if work.is_completed() {
            return work.wait();
        }
        self.device().running.push(work);
        Ok(())
    }

    /// Settles the device calls that completed; the first failure so far.
    pub(crate) fn async_error(&self) -> Option<Error> {
        let mut calls = self.device();
        let mut running = Vec::new();
        for work in std::mem::take(&mut calls.running) {
            if !work.is_completed() {
                running.push(work);
            } else if let Err(e) = work.wait() {
                calls.failed.get_or_insert(e);
            }
        }
        calls.running = running;
        calls.failed.clone()
    }
}

impl Drop for DeviceCalls {
    /// A communicator going away first lets its device calls finish (their
    /// memory and streams are its), within one deadline for all.
    fn drop(&mut self) {
        let until = Instant::now() + Duration::from_secs(300);
        for mut work in self.running.drain(..) {
            let _ = work.wait_timeout(until.saturating_duration_since(Instant::now()));
        }
    }
}

/// Writes to `async_error` the result of `comm`'s device calls that
/// returned before they completed: `cclSuccess`, or the code of the first
/// that failed (its message in `cclGetLastError(comm)`). As
/// `ncclCommGetAsyncError`; thread-safe.
#[no_mangle]
pub extern "C" fn cclCommGetAsyncError(
    comm: cclComm_t,
    async_error: *mut cclResult_t,
) -> cclResult_t {
    entry(comm, || {
        let result = out(async_error, "async_error")?;
        let state = lookup(comm)?;
        *result = match state.async_error() {
            Some(e) => {
                record(Some(&state), &e);
                code(&e)
            }
            None => cclSuccess,
        };
        Ok(())
    })
}

/// Device memory of `cclMemAlloc`, by address.
static ALLOCATIONS: Mutex<Vec<Scratch>> = Mutex::new(Vec::new());

fn allocations() -> std::sync::MutexGuard<'static, Vec<Scratch>> {
    ALLOCATIONS.lock().unwrap_or_else(|p| p.into_inner())
}

/// Allocates `size` bytes of device memory on the calling thread's current
/// GPU (`cudaSetDevice`'s; device 0 if none) and writes its address to
/// `ptr`: memory that peers on this host can map through CUDA IPC, which
/// memory of CUDA's stream-ordered allocator cannot be. As `ncclMemAlloc`;
/// free it with `cclMemFree`. `cclUnsupported` without a CUDA driver.
#[no_mangle]
pub extern "C" fn cclMemAlloc(ptr: *mut *mut c_void, size: usize) -> cclResult_t {
    entry(std::ptr::null_mut(), || {
        let ptr = out(ptr, "ptr")?;
        *ptr = std::ptr::null_mut();
        let gpu = cuda::open(cuda::current_device()?)?;
        let mem = gpu.alloc_device(size)?;
        *ptr = mem.buf().as_ptr().cast_mut().cast();
        allocations().push(mem);
        Ok(())
    })
}

/// Frees memory of `cclMemAlloc` (NULL: nothing). The calls that use it
/// must have completed.
#[no_mangle]
pub extern "C" fn cclMemFree(ptr: *mut c_void) -> cclResult_t {
    entry(std::ptr::null_mut(), || {
        if ptr.is_null() {
            return Ok(());
        }
        let mut all = allocations();
        let at = all
            .iter()
            .position(|m| m.buf().as_ptr() == ptr.cast_const().cast())
            .ok_or_else(|| {
                Error::InvalidArgument(format!("{ptr:p} is no memory of cclMemAlloc's"))
            })?;
        drop(all.swap_remove(at));
        Ok(())
    })
}

/// What a grouped device transfer needs until the group ends.
pub(crate) struct GroupedTransfer {
    pub comm: cclComm_t,
    pub state: Arc<CommState>,
    pub place: Place,
    pub dtype: ccl::DataType,
    pub peer: usize,
    pub send: bool,
    pub ptr: *mut u8,
    pub len: usize,
}

/// Queues a group's device transfers: those of one communicator on one
/// stream together, and every batch on a stream after one event recorded
/// there first (none waits for another, as in an NCCL group); the
/// handles of their works, in order.
pub(crate) fn launch_transfers(
    transfers: Vec<GroupedTransfer>,
) -> Vec<(cclComm_t, Arc<CommState>, Work<()>)> {
    let mut batches: HashMap<(usize, u32, RawStream), Vec<GroupedTransfer>> = HashMap::new();
    let mut order = Vec::new();
    for t in transfers {
        let Place::Device(gpu, raw) = &t.place else {
            continue;
        };
        let key = (t.comm as usize, gpu.ordinal(), *raw);
        if !batches.contains_key(&key) {
            order.push(key);
        }
        batches.entry(key).or_default().push(t);
    }
    // One start per stream, recorded before any batch's wait is queued there.
    let mut starts: HashMap<(u32, RawStream), Result<GpuEvent>> = HashMap::new();
    for batch in batches.values() {
        let Some(stream) = batch.first().and_then(|t| t.place.stream()) else {
            continue;
        };
        let key = (stream.gpu().ordinal(), stream.raw());
        starts.entry(key).or_insert_with(|| stream.record());
    }
    let mut works = Vec::new();
    for key in order {
        let batch = batches.remove(&key).unwrap_or_default();
        let Some(first) = batch.first() else { continue };
        let (comm, state) = (first.comm, first.state.clone());
        let Some(stream) = first.place.stream() else {
            continue;
        };
        let kind = first.place.kind();
        let start = match &starts[&(stream.gpu().ordinal(), stream.raw())] {
            Ok(start) => start,
            Err(e) => {
                for _ in &batch {
                    works.push((comm, state.clone(), Work::ready(Err(e.clone()))));
                }
                continue;
            }
        };
        let list = batch
            .iter()
            .map(|t| {
                // SAFETY: the caller's device memory, valid until its work
                // completes (NCCL's contract, and ours).
                unsafe {
                    match t.send {
                        true => {
                            let data = ccl::BufRef::from_raw(kind, t.ptr, t.len);
                            cuda::Transfer::send(t.dtype, t.peer, data)
                        }
                        false => {
                            let into = ccl::BufMut::from_raw(kind, t.ptr, t.len);
                            cuda::Transfer::recv(t.dtype, t.peer, into)
                        }
                    }
                }
            })
            .collect();
        // SAFETY: as above.
        for work in unsafe { state.comm.launch_transfers_after(list, start, &stream) } {
            works.push((comm, state.clone(), work));
        }
    }
    works
}
