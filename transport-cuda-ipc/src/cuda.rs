//! The [`Gpu`] of a real CUDA device, through the driver API that cudarc
//! loads at run time (`libcuda.so`). Nothing is called before [`load`] has
//! found the library and a driver new enough: cudarc panics on a missing
//! library or symbol, and no panic may cross ccl's API.

use std::{
    ffi::{c_int, c_uint, c_void, CStr},
    io, ptr,
    sync::OnceLock,
};

use ccl_core::{Error, MemoryKind, Result, Scratch};
use cudarc::driver::sys::{self as cu, CUresult};

use crate::gpu::{Gpu, RawEvent, RawStream};

/// The oldest driver ccl uses: 12.0 (stream memory operations, `_v2` calls).
const MIN_DRIVER: c_int = 12000;

/// Finds the driver library and initialises it, once per process.
pub(crate) fn load() -> Result<()> {
    static LOADED: OnceLock<Result<()>> = OnceLock::new();
    LOADED
        .get_or_init(|| {
            // SAFETY: only tries to open the library.
            if !unsafe { cu::is_culib_present() } {
                let mut tried = cudarc::get_lib_name_candidates("cuda");
                tried.sort();
                tried.dedup();
                return Err(Error::Unsupported(format!(
                    "CUDA is not available: the driver library libcuda.so was not found \
                     (tried {}; is there an NVIDIA driver, and is its directory in LD_LIBRARY_PATH?)",
                    tried.join(", ")
                )));
            }
            let mut version: c_int = 0;
            // SAFETY: present in every driver; writes one int.
            check(unsafe { cu::cuDriverGetVersion(&mut version) }, || {
                "CUDA cuDriverGetVersion".into()
            })?;
            if version < MIN_DRIVER {
                return Err(Error::Unsupported(format!(
                    "CUDA driver {}.{} is older than 12.0, which ccl needs",
                    version / 1000,
                    version % 1000 / 10
                )));
            }
            // SAFETY: the library is loaded and new enough.
            check(unsafe { cu::cuInit(0) }, || "CUDA cuInit".into())
        })
        .clone()
}

/// The error of a failed driver call, with the driver's name and text for it.
fn cuda_error(result: CUresult, what: String) -> Error {
    let text = |f: unsafe fn(CUresult, *mut *const std::ffi::c_char) -> CUresult| {
        let mut s = ptr::null();
        // SAFETY: the driver returns a static string or an error.
        match unsafe { f(result, &mut s) } {
            CUresult::CUDA_SUCCESS if !s.is_null() => {
                // SAFETY: a NUL-terminated static string.
                unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned()
            }
            _ => format!("{result:?}"),
        }
    };
    let message = format!(
        "{}: {}",
        text(cu::cuGetErrorName),
        text(cu::cuGetErrorString)
    );
    Error::io(what, io::Error::other(message))
}

fn check(result: CUresult, what: impl FnOnce() -> String) -> Result<()> {
    match result {
        CUresult::CUDA_SUCCESS => Ok(()),
        r => Err(cuda_error(r, what())),
    }
}

/// One CUDA device, through its primary context (the one torch and the
/// runtime API use, so that streams and memory are shared with them).
pub struct CudaGpu {
    ordinal: u32,
    context: cu::CUcontext,
    name: String,
}

// SAFETY: the driver API is thread-safe; the context is only made current.
unsafe impl Send for CudaGpu {}
unsafe impl Sync for CudaGpu {}

impl CudaGpu {
    /// Device `ordinal`, after [`load`].
    pub(crate) fn open(ordinal: u32) -> Result<CudaGpu> {
        load()?;
        let mut count: c_int = 0;
        // SAFETY: the driver is initialised; plain out-parameters below.
        check(unsafe { cu::cuDeviceGetCount(&mut count) }, || {
            "CUDA cuDeviceGetCount".into()
        })?;
        if ordinal as c_int >= count {
            return Err(Error::InvalidArgument(format!(
                "no CUDA device {ordinal}: this machine has {count}"
            )));
        }
        let mut device: cu::CUdevice = 0;
        check(
            unsafe { cu::cuDeviceGet(&mut device, ordinal as c_int) },
            || format!("CUDA cuDeviceGet({ordinal})"),
        )?;
        let mut raw_name = [0 as std::ffi::c_char; 128];
        check(
            unsafe { cu::cuDeviceGetName(raw_name.as_mut_ptr(), raw_name.len() as c_int, device) },
            || format!("CUDA cuDeviceGetName({ordinal})"),
        )?;
        // SAFETY: the driver wrote a NUL-terminated string into the array.
        let model = unsafe { CStr::from_ptr(raw_name.as_ptr()) }.to_string_lossy();
        let mut context = ptr::null_mut();
        check(
            unsafe { cu::cuDevicePrimaryCtxRetain(&mut context, device) },
            || format!("CUDA cuDevicePrimaryCtxRetain({ordinal})"),
        )?;
        Ok(CudaGpu {
            ordinal,
            context,
            name: format!("CUDA device {ordinal} ({model})"),
        })
    }

    /// Makes the device's context current on this thread.
    fn bind(&self) -> Result<()> {
        // SAFETY: a context retained by `open`, released only in `drop`.
        check(unsafe { cu::cuCtxSetCurrent(self.context) }, || {
            format!("CUDA cuCtxSetCurrent on {}", self.name)
        })
    }

    fn host_alloc(&self, len: usize, flags: c_uint) -> Result<Scratch> {
        self.bind()?;
        let mut p: *mut c_void = ptr::null_mut();
        // SAFETY: out-parameter; the memory is freed by `PinnedHost`.
        check(
            unsafe { cu::cuMemHostAlloc(&mut p, len.max(1), flags) },
            || format!("CUDA cuMemHostAlloc({len} bytes) for {}", self.name),
        )?;
        // SAFETY: fresh pinned memory of `len` bytes, owned by the Scratch.
        unsafe { ptr::write_bytes(p.cast::<u8>(), 0, len) };
        let owner = PinnedHost(p);
        Ok(unsafe { Scratch::from_raw(MemoryKind::Host, p.cast(), len, Box::new(owner)) })
    }
}

impl Drop for CudaGpu {
    fn drop(&mut self) {
        let mut device: cu::CUdevice = 0;
        // SAFETY: releases the retain of `open`.
        unsafe {
            if cu::cuDeviceGet(&mut device, self.ordinal as c_int) == CUresult::CUDA_SUCCESS {
                cu::cuDevicePrimaryCtxRelease_v2(device);
            }
        }
    }
}

/// Device memory from `cuMemAlloc`, freed with the Scratch that owns it.
struct DeviceMem(cu::CUdeviceptr);
/// Pinned host memory from `cuMemHostAlloc`.
struct PinnedHost(*mut c_void);

// SAFETY: addresses only; the driver frees them from any thread.
unsafe impl Send for DeviceMem {}
unsafe impl Send for PinnedHost {}

impl Drop for DeviceMem {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemAlloc, freed once.
        unsafe { cu::cuMemFree_v2(self.0) };
    }
}

impl Drop for PinnedHost {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemHostAlloc, freed once.
        unsafe { cu::cuMemFreeHost(self.0) };
    }
}

impl Gpu for CudaGpu {
    fn ordinal(&self) -> u32 {
        self.ordinal
    }

    fn name(&self) -> String {
        self.name.clone()
    }

    fn kind_of(&self, at: *const u8) -> Result<MemoryKind> {
        self.bind()?;
        let mut kind: c_uint = 0;
        // SAFETY: out-parameter of the attribute's size (an unsigned int).
        let r = unsafe {
            cu::cuPointerGetAttribute(
                (&mut kind as *mut c_uint).cast(),
                cu::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                at as cu::CUdeviceptr,
            )
        };
        match r {
            // Memory the driver does not know: plain host memory.
            CUresult::CUDA_ERROR_INVALID_VALUE => return Ok(MemoryKind::Host),
            r => check(r, || format!("CUDA cuPointerGetAttribute({at:p})"))?,
        }
        if kind == cu::CUmemorytype::CU_MEMORYTYPE_HOST as c_uint {
            return Ok(MemoryKind::Host);
        }
        let mut ordinal: c_int = 0;
        check(
            // SAFETY: as above; the attribute is an int.
            unsafe {
                cu::cuPointerGetAttribute(
                    (&mut ordinal as *mut c_int).cast(),
                    cu::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                    at as cu::CUdeviceptr,
                )
            },
            || format!("CUDA cuPointerGetAttribute({at:p}, device ordinal)"),
        )?;
        Ok(MemoryKind::Device {
            ordinal: ordinal as u32,
        })
    }

    fn alloc_device(&self, len: usize) -> Result<Scratch> {
        self.bind()?;
        let mut p: cu::CUdeviceptr = 0;
        // SAFETY: out-parameter; freed by `DeviceMem`. The synchronous
        // allocator's memory can be exported for IPC (the pool's cannot).
        check(unsafe { cu::cuMemAlloc_v2(&mut p, len.max(1)) }, || {
            format!("CUDA cuMemAlloc({len} bytes) on {}", self.name)
        })?;
        let kind = MemoryKind::Device {
            ordinal: self.ordinal,
        };
        // SAFETY: fresh device memory of `len` bytes, owned by the Scratch.
        Ok(unsafe { Scratch::from_raw(kind, p as *mut u8, len, Box::new(DeviceMem(p))) })
    }

    fn alloc_staging(&self, len: usize) -> Result<Scratch> {
        // Portable, not write-combined: the CPU reads it at full speed.
        self.host_alloc(len, cu::CU_MEMHOSTALLOC_PORTABLE)
    }

    fn alloc_words(&self, count: usize) -> Result<Scratch> {
        self.host_alloc(
            count * 4,
            cu::CU_MEMHOSTALLOC_PORTABLE | cu::CU_MEMHOSTALLOC_DEVICEMAP,
        )
    }

    fn device_address(&self, host: *const u8) -> Result<u64> {
        self.bind()?;
        let mut d: cu::CUdeviceptr = 0;
        // SAFETY: `host` is mapped pinned memory of `alloc_words`.
        check(
            unsafe { cu::cuMemHostGetDevicePointer_v2(&mut d, host.cast_mut().cast(), 0) },
            || format!("CUDA cuMemHostGetDevicePointer({host:p})"),
        )?;
        Ok(d)
    }

    fn create_stream(&self) -> Result<RawStream> {
        self.bind()?;
        let mut s: cu::CUstream = ptr::null_mut();
        let flags = cu::CUstream_flags::CU_STREAM_NON_BLOCKING as c_uint;
        // SAFETY: out-parameter.
        check(unsafe { cu::cuStreamCreate(&mut s, flags) }, || {
            format!("CUDA cuStreamCreate on {}", self.name)
        })?;
        Ok(s as RawStream)
    }

    fn destroy_stream(&self, stream: RawStream) {
        if self.bind().is_ok() {
            // SAFETY: a stream of `create_stream`, destroyed once.
            unsafe { cu::cuStreamDestroy_v2(stream as cu::CUstream) };
        }
    }

    unsafe fn copy(
        &self,
        stream: RawStream,
        to: *mut u8,
        from: *const u8,
        len: usize,
    ) -> Result<()> {
        self.bind()?;
        // Unified addressing: the driver tells device from pinned host memory.
        check(
            cu::cuMemcpyAsync(
                to as cu::CUdeviceptr,
                from as cu::CUdeviceptr,
                len,
                stream as cu::CUstream,
            ),
            || format!("CUDA cuMemcpyAsync({len} bytes, {from:p} to {to:p})"),
        )
    }

    fn record(&self, stream: RawStream) -> Result<RawEvent> {
        self.bind()?;
        let mut e: cu::CUevent = ptr::null_mut();
        let flags = cu::CUevent_flags::CU_EVENT_DISABLE_TIMING as c_uint;
        // SAFETY: out-parameter; then an event of this context on a stream of it.
        check(unsafe { cu::cuEventCreate(&mut e, flags) }, || {
            "CUDA cuEventCreate".into()
        })?;
        if let Err(err) = check(
            unsafe { cu::cuEventRecord(e, stream as cu::CUstream) },
            || format!("CUDA cuEventRecord on stream {stream:#x}"),
        ) {
            unsafe { cu::cuEventDestroy_v2(e) };
            return Err(err);
        }
        Ok(e as RawEvent)
    }

    fn query(&self, event: RawEvent) -> Result<bool> {
        // SAFETY: an event of `record`.
        match unsafe { cu::cuEventQuery(event as cu::CUevent) } {
            CUresult::CUDA_SUCCESS => Ok(true),
            CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            r => Err(cuda_error(r, "CUDA cuEventQuery".into())),
        }
    }

    fn destroy_event(&self, event: RawEvent) {
        // SAFETY: an event of `record`, destroyed once (the driver defers
        // the release until the event has completed).
        unsafe { cu::cuEventDestroy_v2(event as cu::CUevent) };
    }

    fn wait_event(&self, stream: RawStream, event: RawEvent) -> Result<()> {
        self.bind()?;
        // SAFETY: a stream and an event of this context.
        check(
            unsafe { cu::cuStreamWaitEvent(stream as cu::CUstream, event as cu::CUevent, 0) },
            || format!("CUDA cuStreamWaitEvent on stream {stream:#x}"),
        )
    }

    fn wait_word(&self, stream: RawStream, word: u64, value: u32) -> Result<()> {
        self.bind()?;
        let geq = cu::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as c_uint;
        // SAFETY: `word` is the device address of mapped pinned memory.
        check(
            unsafe { cu::cuStreamWaitValue32_v2(stream as cu::CUstream, word, value, geq) },
            || format!("CUDA cuStreamWaitValue32 on stream {stream:#x}"),
        )
    }

    fn write_word(&self, stream: RawStream, word: u64, value: u32) -> Result<()> {
        self.bind()?;
        // SAFETY: as in `wait_word`.
        check(
            unsafe { cu::cuStreamWriteValue32_v2(stream as cu::CUstream, word, value, 0) },
            || format!("CUDA cuStreamWriteValue32 on stream {stream:#x}"),
        )
    }
}
