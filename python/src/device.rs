//! `ccl.DeviceBuffer`: memory of one GPU, as `cclMemAlloc` gives it to C
//! (memory that peers on this host can map through CUDA IPC), lent to
//! Python through DLPack and copied to and from host arrays. Torch tensors
//! and CuPy arrays on a GPU are taken by every call as they are; this is
//! for programs that have neither.

use std::{sync::Arc, time::Duration};

use ccl::{
    cuda::{Gpu, Stream},
    DataType, MemoryKind, Scratch,
};
use pyo3::{
    exceptions::{PyTypeError, PyValueError},
    prelude::*,
};

use crate::{
    dlpack::{array, lend, CUDA},
    to_py,
};

/// `count` elements of `dtype` ("float32", "int64", "bfloat16"...) in the
/// memory of GPU `device`. Calls take it as they take a CUDA tensor
/// (ordered on a stream); `copy_from` and `copy_to` move its contents from
/// and to host arrays, and `__dlpack__` lends it (to `torch.from_dlpack`).
#[pyclass(module = "ccl._ccl", frozen)]
pub struct DeviceBuffer {
    mem: Scratch,
    gpu: Arc<dyn Gpu>,
    dtype: DataType,
    count: usize,
}

/// The element type a numpy-style name gives.
pub(crate) fn dtype_named(name: &str) -> PyResult<DataType> {
    const NAMES: [(&str, DataType); 10] = [
        ("int8", DataType::I8),
        ("uint8", DataType::U8),
        ("int32", DataType::I32),
        ("uint32", DataType::U32),
        ("int64", DataType::I64),
        ("uint64", DataType::U64),
        ("float16", DataType::F16),
        ("bfloat16", DataType::Bf16),
        ("float32", DataType::F32),
        ("float64", DataType::F64),
    ];
    NAMES
        .iter()
        .find(|(n, _)| *n == name)
        .map(|&(_, d)| d)
        .ok_or_else(|| {
            let names: Vec<&str> = NAMES.iter().map(|(n, _)| *n).collect();
            PyTypeError::new_err(format!(
                "no element type is named {name:?} ({})",
                names.join(", ")
            ))
        })
}

pub(crate) fn dtype_name(d: DataType) -> &'static str {
    match d {
        DataType::I8 => "int8",
        DataType::U8 => "uint8",
        DataType::I32 => "int32",
        DataType::U32 => "uint32",
        DataType::I64 => "int64",
        DataType::U64 => "uint64",
        DataType::F16 => "float16",
        DataType::Bf16 => "bfloat16",
        DataType::F32 => "float32",
        DataType::F64 => "float64",
    }
}

impl DeviceBuffer {
    fn bytes(&self) -> usize {
        self.count * self.dtype.size()
    }

    /// Copies `len` bytes from `from` to `to` on a stream of the GPU, and
    /// waits (the GIL released).
    fn copy(&self, py: Python<'_>, to: usize, from: usize, len: usize) -> PyResult<()> {
        let gpu = self.gpu.clone();
        py.detach(|| {
            let stream = Stream::new(gpu.clone())?;
            // SAFETY: both ranges are valid for `len` bytes until the
            // stream is synchronized below (the caller holds them).
            unsafe { gpu.copy(stream.raw(), to as *mut u8, from as *const u8, len)? };
            match stream.synchronize(Some(Duration::from_secs(60)))? {
                true => Ok(()),
                false => Err(ccl::Error::Internal(format!(
                    "{}: a copy of {len} bytes did not finish in 60 s",
                    gpu.name()
                ))),
            }
        })
        .map_err(to_py)
    }

    /// A host array of this buffer's size and type (`what` names it).
    fn host_peer(&self, host: &Bound<'_, PyAny>, what: &str) -> PyResult<crate::dlpack::Array> {
        let a = array(host, what, None)?;
        if a.kind != MemoryKind::Host {
            return Err(PyValueError::new_err(format!(
                "{what} lies in {}: copy_from and copy_to take host arrays",
                a.kind
            )));
        }
        if a.dtype != self.dtype || a.bytes != self.bytes() {
            return Err(PyValueError::new_err(format!(
                "{what} holds {} {} elements; this buffer holds {} {}",
                a.len(),
                a.dtype,
                self.count,
                self.dtype
            )));
        }
        Ok(a)
    }
}

#[pymethods]
impl DeviceBuffer {
    #[new]
    #[pyo3(signature = (count, dtype="float32", device=0))]
    fn new(py: Python<'_>, count: usize, dtype: &str, device: u32) -> PyResult<DeviceBuffer> {
        let dtype = dtype_named(dtype)?;
        let bytes = count
            .checked_mul(dtype.size())
            .ok_or_else(|| PyValueError::new_err(format!("{count} {dtype} elements overflow")))?;
        let (gpu, mem) = py
            .detach(|| {
                let gpu = ccl::cuda::open(device)?;
                let mem = gpu.alloc_device(bytes)?;
                Ok((gpu, mem))
            })
            .map_err(to_py)?;
        Ok(DeviceBuffer {
            mem,
            gpu,
            dtype,
            count,
        })
    }

    /// Copies the host array `host` (of this buffer's size and type) in.
    fn copy_from(&self, py: Python<'_>, host: &Bound<'_, PyAny>) -> PyResult<()> {
        let a = self.host_peer(host, "the host array")?;
        let to = self.mem.buf().as_ptr() as usize;
        self.copy(py, to, a.ptr as usize, a.bytes)
    }

    /// Copies this buffer out into the writable host array `host`.
    fn copy_to(&self, py: Python<'_>, host: &Bound<'_, PyAny>) -> PyResult<()> {
        let a = self
            .host_peer(host, "the host array")?
            .writable("the host array")?;
        let from = self.mem.buf().as_ptr() as usize;
        self.copy(py, a.ptr as usize, from, a.bytes)
    }

    /// Its element type's name.
    #[getter]
    fn dtype(&self) -> &'static str {
        dtype_name(self.dtype)
    }

    /// The ordinal of its GPU.
    #[getter]
    fn device(&self) -> u32 {
        self.gpu.ordinal()
    }

    /// Its device address.
    #[getter]
    fn ptr(&self) -> usize {
        self.mem.buf().as_ptr() as usize
    }

    #[getter]
    fn nbytes(&self) -> usize {
        self.bytes()
    }

    fn __len__(&self) -> usize {
        self.count
    }

    fn __dlpack_device__(&self) -> (i32, i32) {
        (CUDA, self.gpu.ordinal() as i32)
    }

    /// Lends the buffer as a DLPack capsule (a one-dimensional CUDA
    /// tensor). Its contents change only through calls the caller orders,
    /// so no stream needs to wait: `stream` is accepted and not used.
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__(
        slf: &Bound<'_, Self>,
        stream: Option<&Bound<'_, PyAny>>,
        max_version: Option<&Bound<'_, PyAny>>,
        dl_device: Option<&Bound<'_, PyAny>>,
        copy: Option<bool>,
    ) -> PyResult<Py<PyAny>> {
        let _ = (stream, dl_device);
        let buf = slf.get();
        let data = buf.mem.buf().as_ptr().cast_mut().cast();
        let device = (CUDA, buf.gpu.ordinal() as i32);
        lend(
            slf.as_any(),
            data,
            device,
            buf.count,
            buf.dtype,
            max_version,
            copy,
        )
    }

    fn __repr__(&self) -> String {
        format!(
            "<ccl.DeviceBuffer {} {} on {}>",
            self.count,
            dtype_name(self.dtype),
            self.gpu.name()
        )
    }
}
