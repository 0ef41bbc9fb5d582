//! `ccl.SharedBuffer`: host memory that the other ranks of this host map
//! and copy directly (`ccl::SharedBuffer`), lent to numpy and torch through
//! DLPack, so that calls on the arrays made of it take that path.

use ccl::DataType;
use pyo3::{exceptions::PyValueError, prelude::*};

use crate::{
    device::{dtype_name, dtype_named},
    dlpack::{lend, CPU},
    to_py,
};

/// `count` elements of `dtype` ("float32", "int64", "bfloat16"...) of zeroed
/// host memory that the other ranks of this host map and copy with their
/// own loads and stores, where other memory is copied by the kernel:
/// allgather, all-to-all, broadcast, gather and scatter over shared memory
/// move its large blocks about twice as fast. Make arrays of it with
/// `numpy.from_dlpack(buf)` or `torch.from_dlpack(buf)` and pass those to
/// the calls; the arrays keep it alive.
#[pyclass(module = "ccl._ccl", frozen)]
pub struct SharedBuffer {
    buf: ccl::SharedBuffer,
    dtype: DataType,
    count: usize,
}

#[pymethods]
impl SharedBuffer {
    #[new]
    #[pyo3(signature = (count, dtype="float32"))]
    fn new(count: usize, dtype: &str) -> PyResult<SharedBuffer> {
        let dtype = dtype_named(dtype)?;
        let bytes = count
            .checked_mul(dtype.size())
            .filter(|&b| b > 0)
            .ok_or_else(|| {
                PyValueError::new_err(format!(
                    "a shared buffer holds at least 1 element, and fewer than {} bytes ({count} {dtype})",
                    usize::MAX
                ))
            })?;
        let buf = ccl::SharedBuffer::new(bytes).map_err(to_py)?;
        Ok(SharedBuffer { buf, dtype, count })
    }

    /// Its element type's name.
    #[getter]
    fn dtype(&self) -> &'static str {
        dtype_name(self.dtype)
    }

    /// Its address.
    #[getter]
    fn ptr(&self) -> usize {
        self.buf.ptr() as usize
    }

    #[getter]
    fn nbytes(&self) -> usize {
        self.count * self.dtype.size()
    }

    fn __len__(&self) -> usize {
        self.count
    }

    fn __dlpack_device__(&self) -> (i32, i32) {
        (CPU, 0)
    }

    /// Lends the buffer as a DLPack capsule (a one-dimensional CPU tensor).
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
        let data = buf.buf.ptr().cast();
        let device = (CPU, 0);
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
            "<ccl.SharedBuffer {} {}>",
            self.count,
            dtype_name(self.dtype)
        )
    }
}
