//! The [`Gpu`] of a real CUDA device, through the driver API that cudarc
//! loads at run time (`libcuda.so`). Nothing is called before [`load`] has
//! found the library and a driver new enough: cudarc panics on a missing
//! library or symbol, and no panic may cross ccl's API.

use std::{
    ffi::{c_int, c_uint, c_void, CStr},
    io, ptr,
    sync::OnceLock,
};

use std::collections::HashMap;

use ccl_core::{DataType, Error, MemoryKind, ReduceOp, Result, Scratch};
use cudarc::driver::sys::{self as cu, CUresult};

use crate::{
    gpu::{Exported, Gpu, RawEvent, RawStream},
    kernels::{self, MAX_INPUTS},
};

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
            let version = driver_version()?;
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

/// The driver's CUDA version (12040 for 12.4).
fn driver_version() -> Result<c_int> {
    let mut version: c_int = 0;
    // SAFETY: present in every driver; writes one int.
    check(unsafe { cu::cuDriverGetVersion(&mut version) }, || {
        "CUDA cuDriverGetVersion".into()
    })?;
    Ok(version)
}

/// Loads function `f` now if it is not yet: `cuFuncLoad` from driver 12.4;
/// before it, reading an attribute loads it.
fn func_load(version: c_int, f: cu::CUfunction) -> CUresult {
    // SAFETY: `f` is a function of a loaded module; out-parameters.
    unsafe {
        if version >= 12040 {
            return cu::cuFuncLoad(f);
        }
        let mut threads: c_int = 0;
        let max_threads = cu::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK;
        cu::cuFuncGetAttribute(&mut threads, max_threads, f)
    }
}

/// Whether this process uses CUDA: the calling thread has a current
/// context, or some device's primary context is active (the CUDA runtime
/// makes one at its first call, on whichever thread). Makes no context;
/// false without a driver.
pub(crate) fn in_use() -> bool {
    if load().is_err() {
        return false;
    }
    let mut current: cu::CUcontext = ptr::null_mut();
    // SAFETY: out-parameters throughout.
    unsafe {
        if cu::cuCtxGetCurrent(&mut current) == CUresult::CUDA_SUCCESS && !current.is_null() {
            return true;
        }
        let mut count: c_int = 0;
        if cu::cuDeviceGetCount(&mut count) != CUresult::CUDA_SUCCESS {
            return false;
        }
        (0..count).any(|ordinal| {
            let (mut device, mut flags, mut active): (cu::CUdevice, c_uint, c_int) = (0, 0, 0);
            cu::cuDeviceGet(&mut device, ordinal) == CUresult::CUDA_SUCCESS
                && cu::cuDevicePrimaryCtxGetState(device, &mut flags, &mut active)
                    == CUresult::CUDA_SUCCESS
                && active != 0
        })
    }
}

/// The device of the calling thread's current CUDA context (which the CUDA
/// runtime's `cudaSetDevice` makes), or device 0 where none is current.
pub(crate) fn current_device() -> Result<u32> {
    load()?;
    let mut device: cu::CUdevice = 0;
    // SAFETY: the driver is initialised; writes one int.
    match unsafe { cu::cuCtxGetDevice(&mut device) } {
        CUresult::CUDA_SUCCESS => Ok(device as u32),
        // No context current: device 0, the CUDA runtime's default too.
        CUresult::CUDA_ERROR_INVALID_CONTEXT => Ok(0),
        e => Err(cuda_error(e, "cuCtxGetDevice".into())),
    }
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
    device: cu::CUdevice,
    context: cu::CUcontext,
    name: String,
    /// The kernels, compiled at first use.
    kernels: OnceLock<Result<Kernels>>,
    /// A stream of ccl's own for reads and writes off the caller's streams.
    side: OnceLock<Result<RawStream>>,
}

/// The loaded kernels of one device.
struct Kernels {
    _module: cu::CUmodule,
    functions: HashMap<String, cu::CUfunction>,
    /// Blocks a launch needs at most to fill the device.
    max_blocks: u32,
}

/// A reduction kernel's inputs, passed by value.
#[repr(C)]
struct Inputs([*const c_void; MAX_INPUTS]);

/// Threads of a block of every kernel.
const BLOCK: u32 = 256;

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
            device,
            context,
            name: format!("CUDA device {ordinal} ({model})"),
            kernels: OnceLock::new(),
            side: OnceLock::new(),
        })
    }

    fn attribute(&self, attribute: cu::CUdevice_attribute) -> Result<c_int> {
        let mut v: c_int = 0;
        // SAFETY: out-parameter.
        check(
            unsafe { cu::cuDeviceGetAttribute(&mut v, attribute, self.device) },
            || format!("CUDA cuDeviceGetAttribute({attribute:?}) on {}", self.name),
        )?;
        Ok(v)
    }

    /// Compiles (NVRTC, for this device's architecture) and loads the kernels.
    fn load_kernels(&self) -> Result<Kernels> {
        use cu::CUdevice_attribute as A;
        let major = self.attribute(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = self.attribute(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        let sms = self.attribute(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        let ptx = kernels::compile((major * 10 + minor) as u32)?;
        let version = driver_version()?;
        let _bound = self.bind()?;
        let mut module = ptr::null_mut();
        // SAFETY: NUL-terminated PTX; the module lives as long as the device value.
        check(
            unsafe { cu::cuModuleLoadData(&mut module, ptx.as_ptr().cast()) },
            || format!("CUDA cuModuleLoadData (ccl's kernels) on {}", self.name),
        )?;
        let mut functions = HashMap::new();
        for name in kernels::names() {
            let c = std::ffi::CString::new(name.as_str()).expect("no NUL in kernel names");
            let mut f = ptr::null_mut();
            // SAFETY: out-parameter; a function of the module loaded above.
            check(
                unsafe { cu::cuModuleGetFunction(&mut f, module, c.as_ptr()) },
                || format!("CUDA cuModuleGetFunction({name})"),
            )?;
            // Under lazy loading (the default since CUDA 12.2) a function
            // is loaded at its first launch, and loading may wait for the
            // context's streams: a staged reduction's launch would then
            // wait for streams that wait for it. Load each one now.
            check(func_load(version, f), || format!("CUDA cuFuncLoad({name})"))?;
            functions.insert(name, f);
        }
        Ok(Kernels {
            _module: module,
            functions,
            max_blocks: sms as u32 * 8,
        })
    }

    /// The kernels, compiled and loaded at the first call.
    fn kernels(&self) -> Result<&Kernels> {
        match self.kernels.get_or_init(|| self.load_kernels()) {
            Ok(k) => Ok(k),
            Err(e) => Err(e.clone()),
        }
    }

    /// Launches kernel `name` over `count` elements with `params` on `stream`.
    ///
    /// # Safety
    /// `params` must match the kernel's parameters.
    unsafe fn launch(
        &self,
        stream: RawStream,
        name: &str,
        count: usize,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        let kernels = self.kernels()?;
        let f = *kernels
            .functions
            .get(name)
            .ok_or_else(|| Error::Internal(format!("no kernel {name}")))?;
        if count == 0 {
            return Ok(());
        }
        let blocks = (count as u64)
            .div_ceil(BLOCK as u64)
            .min(kernels.max_blocks as u64) as u32;
        let _bound = self.bind()?;
        check(
            cu::cuLaunchKernel(
                f,
                blocks,
                1,
                1,
                BLOCK,
                1,
                1,
                0,
                stream as cu::CUstream,
                params.as_mut_ptr(),
                ptr::null_mut(),
            ),
            || {
                format!(
                    "CUDA cuLaunchKernel({name}, {count} elements) on {}",
                    self.name
                )
            },
        )
    }

    /// Launches the reduction kernel `name` over `count` units.
    ///
    /// # Safety
    /// As for [`Gpu::reduce`].
    unsafe fn launch_reduce(
        &self,
        stream: RawStream,
        name: &str,
        out: *mut u8,
        inputs: &[*const u8],
        count: usize,
    ) -> Result<()> {
        let mut ptrs = Inputs([ptr::null(); MAX_INPUTS]);
        for (slot, &p) in ptrs.0.iter_mut().zip(inputs) {
            *slot = p.cast();
        }
        let (mut out, mut nin, mut n) = (out.cast::<c_void>(), inputs.len() as c_int, count as u64);
        let mut divisor = nin;
        let mut params = [
            (&mut out as *mut *mut c_void).cast(),
            (&mut ptrs as *mut Inputs).cast(),
            (&mut nin as *mut c_int).cast(),
            (&mut n as *mut u64).cast(),
            (&mut divisor as *mut c_int).cast(),
        ];
        self.launch(stream, name, count, &mut params)
    }

    /// ccl's own stream, for reads and writes off the caller's streams.
    fn side_stream(&self) -> Result<RawStream> {
        self.side.get_or_init(|| self.create_stream()).clone()
    }

    /// Makes the device's context current on this thread until the value
    /// returned is dropped, which makes the caller's current again: a
    /// program that works on another GPU from this thread keeps it.
    fn bind(&self) -> Result<Bound> {
        let mut current: cu::CUcontext = ptr::null_mut();
        // SAFETY: out-parameter.
        check(unsafe { cu::cuCtxGetCurrent(&mut current) }, || {
            "CUDA cuCtxGetCurrent".into()
        })?;
        if current == self.context {
            return Ok(Bound { previous: None });
        }
        // SAFETY: a context retained by `open`, released only in `drop`.
        check(unsafe { cu::cuCtxSetCurrent(self.context) }, || {
            format!("CUDA cuCtxSetCurrent on {}", self.name)
        })?;
        Ok(Bound {
            previous: Some(current),
        })
    }

    fn host_alloc(&self, len: usize, flags: c_uint) -> Result<Scratch> {
        let _bound = self.bind()?;
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

/// A context made current by [`CudaGpu::bind`]; the one before it (none,
/// perhaps) is made current again on drop.
struct Bound {
    previous: Option<cu::CUcontext>,
}

impl Drop for Bound {
    fn drop(&mut self) {
        if let Some(previous) = self.previous {
            // SAFETY: the context that was current (or null: none) before.
            unsafe { cu::cuCtxSetCurrent(previous) };
        }
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
/// Another process's device memory, from `cuIpcOpenMemHandle`.
struct IpcMapping(cu::CUdeviceptr);

// SAFETY: an address only.
unsafe impl Send for IpcMapping {}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        // SAFETY: opened by cuIpcOpenMemHandle, closed once.
        unsafe { cu::cuIpcCloseMemHandle(self.0) };
    }
}

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
    fn read_word(&self, word: u64) -> Result<u32> {
        let side = self.side_stream()?;
        let mut value: u32 = 0;
        // SAFETY: a word of device memory; synchronized before `value` is read.
        unsafe {
            check(
                cu::cuMemcpyDtoHAsync_v2(
                    (&mut value as *mut u32).cast(),
                    word,
                    4,
                    side as cu::CUstream,
                ),
                || format!("CUDA cuMemcpyDtoHAsync(word {word:#x})"),
            )?;
            check(cu::cuStreamSynchronize(side as cu::CUstream), || {
                "CUDA cuStreamSynchronize (ccl's side stream)".into()
            })?;
        }
        Ok(value)
    }

    fn flush_remote_writes(&self) -> Result<()> {
        let _bound = self.bind()?;
        // SAFETY: no pointers; the context is current (bound above).
        check(
            unsafe {
                cu::cuFlushGPUDirectRDMAWrites(
                    cu::CUflushGPUDirectRDMAWritesTarget_enum::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX,
                    cu::CUflushGPUDirectRDMAWritesScope_enum::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER,
                )
            },
            || "CUDA cuFlushGPUDirectRDMAWrites".into(),
        )
    }

    fn set_word(&self, word: u64, value: u32) -> Result<()> {
        let side = self.side_stream()?;
        // SAFETY: a word of device memory.
        unsafe {
            check(
                cu::cuMemsetD32Async(word, value, 1, side as cu::CUstream),
                || format!("CUDA cuMemsetD32Async(word {word:#x})"),
            )?;
            check(cu::cuStreamSynchronize(side as cu::CUstream), || {
                "CUDA cuStreamSynchronize (ccl's side stream)".into()
            })
        }
    }

    unsafe fn reduce(
        &self,
        stream: RawStream,
        op: ReduceOp,
        dtype: DataType,
        out: *mut u8,
        inputs: &[*const u8],
        count: usize,
    ) -> Result<()> {
        if inputs.is_empty() || inputs.len() > MAX_INPUTS {
            return Err(Error::Internal(format!(
                "a reduction of {} inputs",
                inputs.len()
            )));
        }
        // The 16-byte units with vector loads where every pointer allows,
        // the rest element by element.
        let size = dtype.size();
        let aligned = std::iter::once(out.cast_const())
            .chain(inputs.iter().copied())
            .all(|p| p as usize % 16 == 0);
        let units = if aligned { count * size / 16 } else { 0 };
        let name = kernels::reduce_name(dtype, op);
        let vector_elems = units * 16 / size;
        let vector = kernels::vector_name(dtype, op);
        self.launch_reduce(stream, &vector, out, inputs, units)?;
        let tail: Vec<*const u8> = inputs.iter().map(|p| p.add(vector_elems * size)).collect();
        self.launch_reduce(
            stream,
            &name,
            out.add(vector_elems * size),
            &tail,
            count - vector_elems,
        )
    }

    unsafe fn scale(
        &self,
        stream: RawStream,
        op: ReduceOp,
        dtype: DataType,
        out: *mut u8,
        input: *const u8,
        count: usize,
    ) -> Result<()> {
        let ReduceOp::PreMulSum(scalar) = op else {
            return Err(Error::Internal(format!("scaling for {op}")));
        };
        // Integers multiply by the scalar modulo 2^64, as the CPU kernels do.
        let mut k: u64 = if scalar.abs() < 2f64.powi(127) {
            scalar as i128 as u64
        } else {
            0
        };
        let (mut out, mut input, mut s, mut n) = (
            out.cast::<c_void>(),
            input.cast::<c_void>(),
            scalar,
            count as u64,
        );
        let mut params = [
            (&mut out as *mut *mut c_void).cast(),
            (&mut input as *mut *const c_void).cast(),
            (&mut k as *mut u64).cast(),
            (&mut s as *mut f64).cast(),
            (&mut n as *mut u64).cast(),
        ];
        self.launch(stream, &kernels::scale_name(dtype), count, &mut params)
    }

    fn export(&self, at: *const u8) -> Result<Exported> {
        let _bound = self.bind()?;
        let (mut base, mut len): (cu::CUdeviceptr, usize) = (0, 0);
        // SAFETY: out-parameters; `at` is only looked up.
        check(
            unsafe { cu::cuMemGetAddressRange_v2(&mut base, &mut len, at as cu::CUdeviceptr) },
            || format!("CUDA cuMemGetAddressRange({at:p}) on {}", self.name),
        )?;
        let mut handle = cu::CUipcMemHandle { reserved: [0; 64] };
        // SAFETY: the base of an allocation of this device.
        check(unsafe { cu::cuIpcGetMemHandle(&mut handle, base) }, || {
            format!(
                "CUDA cuIpcGetMemHandle({at:p}; memory of the stream-ordered allocator cannot be \
                 exported) on {}",
                self.name
            )
        })?;
        Ok(Exported {
            handle: handle.reserved.iter().map(|&b| b as u8).collect(),
            len,
            offset: at as usize - base as usize,
        })
    }

    fn import(&self, handle: &[u8], len: usize) -> Result<Scratch> {
        let mut h = cu::CUipcMemHandle { reserved: [0; 64] };
        if handle.len() != h.reserved.len() {
            return Err(Error::Internal(format!(
                "a CUDA IPC handle of {} bytes",
                handle.len()
            )));
        }
        for (d, &b) in h.reserved.iter_mut().zip(handle) {
            *d = b as std::ffi::c_char;
        }
        let _bound = self.bind()?;
        let mut d: cu::CUdeviceptr = 0;
        let lazy = cu::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as c_uint;
        // SAFETY: out-parameter; closed by `IpcMapping`.
        check(
            unsafe { cu::cuIpcOpenMemHandle_v2(&mut d, h, lazy) },
            || format!("CUDA cuIpcOpenMemHandle on {}", self.name),
        )?;
        let kind = MemoryKind::Device {
            ordinal: self.ordinal,
        };
        // SAFETY: the peer's memory, mapped until `IpcMapping` drops.
        Ok(unsafe { Scratch::from_raw(kind, d as *mut u8, len, Box::new(IpcMapping(d))) })
    }

    fn ordinal(&self) -> u32 {
        self.ordinal
    }

    fn name(&self) -> String {
        self.name.clone()
    }

    fn uuid(&self) -> Result<[u8; 16]> {
        let mut uuid = cu::CUuuid { bytes: [0; 16] };
        // SAFETY: out-parameter.
        check(
            unsafe { cu::cuDeviceGetUuid_v2(&mut uuid, self.device) },
            || format!("CUDA cuDeviceGetUuid_v2 on {}", self.name),
        )?;
        Ok(uuid.bytes.map(|b| b as u8))
    }

    fn prepare_kernels(&self) -> Result<()> {
        self.kernels().map(drop)
    }

    fn side_by_side(&self) -> Option<bool> {
        // Drivers before CUDA 12.4's do not know the attribute.
        self.attribute(cu::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MPS_ENABLED)
            .ok()
            .map(|on| on != 0)
    }

    fn kind_of(&self, at: *const u8) -> Result<MemoryKind> {
        let _bound = self.bind()?;
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
        let _bound = self.bind()?;
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
        let _bound = self.bind()?;
        let mut d: cu::CUdeviceptr = 0;
        // SAFETY: `host` is mapped pinned memory of `alloc_words`.
        check(
            unsafe { cu::cuMemHostGetDevicePointer_v2(&mut d, host.cast_mut().cast(), 0) },
            || format!("CUDA cuMemHostGetDevicePointer({host:p})"),
        )?;
        Ok(d)
    }

    fn create_stream(&self) -> Result<RawStream> {
        let _bound = self.bind()?;
        let mut s: cu::CUstream = ptr::null_mut();
        let flags = cu::CUstream_flags::CU_STREAM_NON_BLOCKING as c_uint;
        // SAFETY: out-parameter.
        check(unsafe { cu::cuStreamCreate(&mut s, flags) }, || {
            format!("CUDA cuStreamCreate on {}", self.name)
        })?;
        Ok(s as RawStream)
    }

    fn destroy_stream(&self, stream: RawStream) {
        if let Ok(_bound) = self.bind() {
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
        let _bound = self.bind()?;
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
        let _bound = self.bind()?;
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
        let _bound = self.bind()?;
        // SAFETY: a stream and an event of this context.
        check(
            unsafe { cu::cuStreamWaitEvent(stream as cu::CUstream, event as cu::CUevent, 0) },
            || format!("CUDA cuStreamWaitEvent on stream {stream:#x}"),
        )
    }

    fn wait_word(&self, stream: RawStream, word: u64, value: u32) -> Result<()> {
        let _bound = self.bind()?;
        let geq = cu::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as c_uint;
        // SAFETY: `word` is the device address of mapped pinned memory.
        check(
            unsafe { cu::cuStreamWaitValue32_v2(stream as cu::CUstream, word, value, geq) },
            || format!("CUDA cuStreamWaitValue32 on stream {stream:#x}"),
        )
    }

    fn write_word(&self, stream: RawStream, word: u64, value: u32) -> Result<()> {
        let _bound = self.bind()?;
        // SAFETY: as in `wait_word`.
        check(
            unsafe { cu::cuStreamWriteValue32_v2(stream as cu::CUstream, word, value, 0) },
            || format!("CUDA cuStreamWriteValue32 on stream {stream:#x}"),
        )
    }
}
