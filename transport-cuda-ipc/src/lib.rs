//! ccl-transport-cuda-ipc: GPU buffers for ccl.
//!
//! A [`Gpu`] is what ccl asks of a device (streams, events, copies, pinned
//! host memory, words streams wait on). [`open`] gives CUDA device `n`
//! through the driver API that cudarc loads at run time, so that ccl builds
//! and runs where there is no CUDA at all (asking for a GPU there is an
//! error naming the missing library), or, with `CCL_CUDA_STAND_IN=1`, a
//! stand-in made of host memory and threads that lets every test of the
//! data path run without a GPU. [`staging`] runs collectives on device
//! memory as pipelines of host collectives over any link.
//!
//! [`ipc`] runs them among the GPUs of one host straight from each other's
//! memory, on the caller's stream, with the reduction [`kernels`] compiled
//! by NVRTC.

mod cuda;
mod gpu;
pub mod ipc;
pub mod kernels;
pub mod staging;
mod stand_in;

use std::{
    collections::BTreeMap,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex,
    },
};

/// The cudarc this crate is built on, for callers that hold its slices and
/// streams.
pub use cudarc;
pub use gpu::{Exported, Flags, Gpu, GpuEvent, RawEvent, RawStream, Stream};
pub use stand_in::StandInGpu;

use ccl_core::Result;

/// Whether `CCL_CUDA_STAND_IN` asks for the host stand-in instead of CUDA.
pub fn stand_in_requested() -> bool {
    std::env::var("CCL_CUDA_STAND_IN").is_ok_and(|v| v == "1")
}

/// The GPUs opened in this process.
static OPEN: Mutex<BTreeMap<u32, Arc<dyn Gpu>>> = Mutex::new(BTreeMap::new());

/// Whether this process may hold GPU memory: with the stand-in, once ccl
/// opened a GPU here, or where CUDA is in use (a current context on this
/// thread, or an active primary context: the CUDA runtime makes one at its
/// first call). A program that never touched CUDA gets false without a
/// context being made for it.
pub fn gpu_in_use() -> bool {
    // Once in use, always: later calls (host calls from C ask on each) skip the driver.
    static SEEN: AtomicBool = AtomicBool::new(false);
    if SEEN.load(Ordering::Relaxed) {
        return true;
    }
    let in_use = stand_in_requested()
        || !OPEN.lock().unwrap_or_else(|p| p.into_inner()).is_empty()
        || cuda::in_use();
    if in_use {
        SEEN.store(true, Ordering::Relaxed);
    }
    in_use
}

/// GPU `ordinal`: the CUDA device, or the host stand-in when
/// `CCL_CUDA_STAND_IN=1`; one value per ordinal and process, so that
/// memory one caller allocates is known to the next (the stand-in's).
/// Without a CUDA driver this is an
/// [`Error::Unsupported`](ccl_core::Error::Unsupported) that names the
/// library it looked for.
pub fn open(ordinal: u32) -> Result<Arc<dyn Gpu>> {
    let mut open = OPEN.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(gpu) = open.get(&ordinal) {
        return Ok(gpu.clone());
    }
    let gpu: Arc<dyn Gpu> = if stand_in_requested() {
        Arc::new(StandInGpu::new(ordinal)?)
    } else {
        Arc::new(cuda::CudaGpu::open(ordinal)?)
    };
    open.insert(ordinal, gpu.clone());
    Ok(gpu)
}

/// The GPU the calling thread works on: the device of its current CUDA
/// context (as the CUDA runtime's `cudaSetDevice` sets it), 0 where none is
/// current or with the stand-in. An error without a CUDA driver.
pub fn current_device() -> Result<u32> {
    if stand_in_requested() {
        return Ok(0);
    }
    cuda::current_device()
}
