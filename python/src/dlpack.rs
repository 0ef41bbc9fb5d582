//! Arrays from Python through DLPack (`__dlpack__`), which numpy and torch
//! both export and which the stable ABI can read (the buffer protocol is
//! not in the limited API before 3.11). The capsule is kept, not consumed,
//! so that the exporter's own deleter frees it once ccl lets go.

use std::ffi::{c_void, CStr};

use ccl::{DataType, MemoryKind};
use pyo3::{
    exceptions::{PyTypeError, PyValueError},
    ffi,
    prelude::*,
    types::PyDict,
};

#[repr(C)]
pub(crate) struct DlDevice {
    pub device_type: i32,
    pub device_id: i32,
}

#[repr(C)]
pub(crate) struct DlDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
pub(crate) struct DlTensor {
    pub data: *mut c_void,
    pub device: DlDevice,
    pub ndim: i32,
    pub dtype: DlDataType,
    pub shape: *const i64,
    pub strides: *const i64,
    pub byte_offset: u64,
}

/// DLPack before 1.0: the tensor comes first.
#[repr(C)]
struct DlManagedTensor {
    dl_tensor: DlTensor,
}

/// DLPack 1.0: a version, the manager's fields, flags, then the tensor.
#[repr(C)]
struct DlManagedTensorVersioned {
    major: u32,
    minor: u32,
    manager_ctx: *mut c_void,
    deleter: *mut c_void,
    flags: u64,
    dl_tensor: DlTensor,
}

const READ_ONLY: u64 = 1;
pub(crate) const CPU: i32 = 1;
pub(crate) const CUDA: i32 = 2;
const CUDA_HOST: i32 = 3;

/// A contiguous array lent by Python: its memory, its element type, and the
/// capsule that keeps it alive.
pub struct Array {
    pub ptr: *mut u8,
    pub bytes: usize,
    pub dtype: DataType,
    pub kind: MemoryKind,
    pub read_only: bool,
    pub keep: Py<PyAny>,
}

impl Array {
    /// Elements in the array.
    pub fn len(&self) -> usize {
        self.bytes / self.dtype.size()
    }

    /// The array, which must be writable (`what` names it in errors).
    pub fn writable(self, what: &str) -> PyResult<Array> {
        if self.read_only {
            return Err(PyValueError::new_err(format!(
                "{what} is read-only, and ccl writes into it"
            )));
        }
        Ok(self)
    }
}

/// The DLPack dtype of an element type.
fn dl_dtype(d: DataType) -> DlDataType {
    use DataType as D;
    let code = match d {
        D::I8 | D::I32 | D::I64 => 0,
        D::U8 | D::U32 | D::U64 => 1,
        D::F16 | D::F32 | D::F64 => 2,
        D::Bf16 => 4,
    };
    DlDataType {
        code,
        bits: (d.size() * 8) as u8,
        lanes: 1,
    }
}

/// What a lent buffer's DLPack tensor points to, kept alive with it.
struct Lent {
    shape: [i64; 1],
    _owner: Py<PyAny>,
}

/// DLPack's managed tensor (before 1.0): the tensor, its manager, its deleter.
#[repr(C)]
struct ManagedTensor {
    dl_tensor: DlTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut ManagedTensor)>,
}

/// DLPack 1.0's managed tensor, as lent: writable (no flags).
#[repr(C)]
struct ManagedVersioned {
    major: u32,
    minor: u32,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut ManagedVersioned)>,
    flags: u64,
    dl_tensor: DlTensor,
}

const DLTENSOR: &CStr = c"dltensor";
const DLTENSOR_VERSIONED: &CStr = c"dltensor_versioned";

unsafe extern "C" fn delete_managed(m: *mut ManagedTensor) {
    // SAFETY: made by `lend` from two boxes, deleted once.
    let m = Box::from_raw(m);
    drop(Box::from_raw(m.manager_ctx.cast::<Lent>()));
}

unsafe extern "C" fn delete_versioned(m: *mut ManagedVersioned) {
    // SAFETY: as above.
    let m = Box::from_raw(m);
    drop(Box::from_raw(m.manager_ctx.cast::<Lent>()));
}

/// A capsule nobody consumed (still named "dltensor" or
/// "dltensor_versioned") frees its tensor. A consumer that took it renamed
/// it ("used_dltensor"...) and owns the tensor. `PyCapsule_IsValid` sets
/// no exception, so one in flight is kept.
unsafe extern "C" fn drop_capsule(capsule: *mut ffi::PyObject) {
    if ffi::PyCapsule_IsValid(capsule, DLTENSOR.as_ptr()) == 1 {
        let m = ffi::PyCapsule_GetPointer(capsule, DLTENSOR.as_ptr()).cast::<ManagedTensor>();
        if !m.is_null() {
            delete_managed(m);
        }
    } else if ffi::PyCapsule_IsValid(capsule, DLTENSOR_VERSIONED.as_ptr()) == 1 {
        let m = ffi::PyCapsule_GetPointer(capsule, DLTENSOR_VERSIONED.as_ptr())
            .cast::<ManagedVersioned>();
        if !m.is_null() {
            delete_versioned(m);
        }
    }
}

/// Lends `count` elements of `dtype` at `data` on `device` (DLPack's
/// device type and id) as a DLPack capsule (a one-dimensional, writable
/// tensor), which keeps `owner`, the memory's owner, alive for as long as
/// a consumer holds the tensor: of DLPack 1.0 where the consumer's
/// `max_version` takes it (numpy makes arrays of older capsules
/// read-only), else of the layout before. A `copy` asked for is refused.
pub(crate) fn lend(
    owner: &Bound<'_, PyAny>,
    data: *mut c_void,
    (device_type, device_id): (i32, i32),
    count: usize,
    dtype: DataType,
    max_version: Option<&Bound<'_, PyAny>>,
    copy: Option<bool>,
) -> PyResult<Py<PyAny>> {
    let py = owner.py();
    if copy == Some(true) {
        return Err(PyValueError::new_err(format!(
            "a {} lends its memory; it does not copy it",
            type_name(owner)
        )));
    }
    let device = DlDevice {
        device_type,
        device_id,
    };
    let versioned = max_version
        .and_then(|v| v.extract::<(u32, u32)>().ok())
        .is_some_and(|(major, _)| major >= 1);
    let lent = Box::into_raw(Box::new(Lent {
        shape: [count as i64],
        _owner: owner.clone().unbind(),
    }));
    let dl_tensor = DlTensor {
        data,
        device,
        ndim: 1,
        dtype: dl_dtype(dtype),
        // SAFETY: `lent` lives as long as the managed tensor.
        shape: unsafe { (*lent).shape.as_ptr() },
        strides: std::ptr::null(),
        byte_offset: 0,
    };
    // SAFETY: a capsule over the managed tensor, freed by `drop_capsule`
    // unless a consumer takes it (and then calls its deleter).
    unsafe {
        let (capsule, undo): (_, Box<dyn FnOnce()>) = if versioned {
            let raw = Box::into_raw(Box::new(ManagedVersioned {
                major: 1,
                minor: 0,
                manager_ctx: lent.cast(),
                deleter: Some(delete_versioned),
                flags: 0,
                dl_tensor,
            }));
            let capsule =
                ffi::PyCapsule_New(raw.cast(), DLTENSOR_VERSIONED.as_ptr(), Some(drop_capsule));
            (capsule, Box::new(move || delete_versioned(raw)))
        } else {
            let raw = Box::into_raw(Box::new(ManagedTensor {
                dl_tensor,
                manager_ctx: lent.cast(),
                deleter: Some(delete_managed),
            }));
            let capsule = ffi::PyCapsule_New(raw.cast(), DLTENSOR.as_ptr(), Some(drop_capsule));
            (capsule, Box::new(move || delete_managed(raw)))
        };
        if capsule.is_null() {
            undo();
            return Err(PyErr::fetch(py));
        }
        Ok(Py::from_owned_ptr(py, capsule))
    }
}

/// The element type of a DLPack dtype.
fn dtype_of(t: &DlDataType, what: &str) -> PyResult<DataType> {
    use DataType as D;
    let d = match (t.code, t.bits, t.lanes) {
        (0, 8, 1) => D::I8,
        (1, 8, 1) => D::U8,
        (0, 32, 1) => D::I32,
        (1, 32, 1) => D::U32,
        (0, 64, 1) => D::I64,
        (1, 64, 1) => D::U64,
        (2, 16, 1) => D::F16,
        (2, 32, 1) => D::F32,
        (2, 64, 1) => D::F64,
        (4, 16, 1) => D::Bf16,
        (6, ..) => {
            return Err(PyTypeError::new_err(format!(
                "{what} holds booleans: pass a uint8 view of it"
            )))
        }
        (code, bits, lanes) => {
            return Err(PyTypeError::new_err(format!(
                "{what} has an element type ccl does not move (DLPack code {code}, \
                 {bits} bits, {lanes} lanes); ccl takes int8, uint8, int32, uint32, \
                 int64, uint64, float16, bfloat16, float32 and float64"
            )))
        }
    };
    Ok(d)
}

/// The capsule `obj.__dlpack__()` returns, versioned where the exporter
/// can. For memory of a GPU, `stream` is the stream the call will run on
/// (DLPack's numbering: 1 is the legacy default stream), which the
/// exporter makes wait for its own work on the memory.
fn capsule<'py>(
    obj: &Bound<'py, PyAny>,
    what: &str,
    stream: Option<u64>,
) -> PyResult<Bound<'py, PyAny>> {
    let py = obj.py();
    if !obj.hasattr("__dlpack__")? {
        // bytearray, array.array, memoryview...: through numpy, which shares
        // the memory and exports it.
        let no_memory = || {
            PyTypeError::new_err(format!(
                "{what} ({}) has no __dlpack__ and no buffer: pass a numpy array or a torch \
                 tensor (ccl reads and writes the memory of what it is given, never a copy)",
                type_name(obj)
            ))
        };
        let view = py
            .import("builtins")?
            .call_method1("memoryview", (obj,))
            .map_err(|_| no_memory())?;
        let np = py.import("numpy").map_err(|_| no_memory())?;
        // A view of the object's own memory, not a copy.
        let array = np.call_method1("asarray", (view,))?;
        return capsule(&array, what, None);
    }
    let kwargs = PyDict::new(py);
    if obj.hasattr("__dlpack_device__")? {
        let (device_type, _): (i32, i32) = obj.call_method0("__dlpack_device__")?.extract()?;
        if device_type == CUDA {
            kwargs.set_item("stream", stream.filter(|&s| s != 0).unwrap_or(1))?;
        }
    }
    let versioned = kwargs.copy()?;
    versioned.set_item("max_version", (1, 0))?;
    // Exporters older than DLPack 1.0 take no max_version.
    let result = match obj.call_method("__dlpack__", (), Some(&versioned)) {
        Err(e) if e.is_instance_of::<PyTypeError>(py) => {
            obj.call_method("__dlpack__", (), Some(&kwargs))
        }
        other => other,
    };
    result.map_err(|e| {
        PyValueError::new_err(format!(
            "{what} ({}) cannot lend its memory to ccl: {e}",
            type_name(obj)
        ))
    })
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map_or_else(|_| "?".into(), |n| n.to_string())
}

/// The memory of `obj` (a numpy array, a torch tensor, anything with
/// `__dlpack__` or the buffer protocol), which must be contiguous; a GPU's
/// memory is made ready for `stream` (the call's; None: the default).
pub fn array(obj: &Bound<'_, PyAny>, what: &str, stream: Option<u64>) -> PyResult<Array> {
    let cap = capsule(obj, what, stream)?;
    // SAFETY: a capsule from __dlpack__ holds a DLManagedTensor(Versioned)
    // under the name that says which; both stay valid while it lives, and
    // we keep it alive (`keep`) as long as the memory is used.
    unsafe {
        let raw = cap.as_ptr();
        let name = ffi::PyCapsule_GetName(raw);
        if name.is_null() {
            return Err(PyErr::fetch(obj.py()));
        }
        let name_str = CStr::from_ptr(name);
        let (tensor, read_only) = match name_str.to_bytes() {
            b"dltensor_versioned" => {
                let m = ffi::PyCapsule_GetPointer(raw, name) as *const DlManagedTensorVersioned;
                if m.is_null() {
                    return Err(PyErr::fetch(obj.py()));
                }
                if (*m).major != 1 {
                    return Err(PyTypeError::new_err(format!(
                        "{what}: DLPack version {}.{} is not understood",
                        (*m).major,
                        (*m).minor
                    )));
                }
                (&(*m).dl_tensor, (*m).flags & READ_ONLY != 0)
            }
            b"dltensor" => {
                let m = ffi::PyCapsule_GetPointer(raw, name) as *const DlManagedTensor;
                if m.is_null() {
                    return Err(PyErr::fetch(obj.py()));
                }
                (&(*m).dl_tensor, false)
            }
            other => {
                return Err(PyTypeError::new_err(format!(
                    "{what}: __dlpack__ returned a capsule named {:?}",
                    String::from_utf8_lossy(other)
                )))
            }
        };
        let kind = match tensor.device.device_type {
            CPU | CUDA_HOST => MemoryKind::Host,
            CUDA => MemoryKind::Device {
                ordinal: tensor.device.device_id.max(0) as u32,
            },
            other => {
                return Err(PyTypeError::new_err(format!(
                    "{what} lives on a device ccl does not know (DLPack device type {other})"
                )))
            }
        };
        let dtype = dtype_of(&tensor.dtype, what)?;
        let ndim = usize::try_from(tensor.ndim).unwrap_or(0);
        let shape: &[i64] = if ndim == 0 {
            &[]
        } else {
            std::slice::from_raw_parts(tensor.shape, ndim)
        };
        let elems = shape.iter().try_fold(1usize, |acc, &d| {
            usize::try_from(d).ok().and_then(|d| acc.checked_mul(d))
        });
        let elems = elems.ok_or_else(|| PyValueError::new_err(format!("{what}: bad shape")))?;
        if !tensor.strides.is_null() && elems > 1 {
            let strides = std::slice::from_raw_parts(tensor.strides, ndim);
            let mut expected = 1i64;
            for (&dim, &stride) in shape.iter().zip(strides).rev() {
                if dim != 1 && stride != expected {
                    return Err(PyValueError::new_err(format!(
                        "{what} is not contiguous (shape {shape:?}, strides {strides:?} in \
                         elements): pass a contiguous copy (numpy.ascontiguousarray, \
                         tensor.contiguous())"
                    )));
                }
                expected *= dim;
            }
        }
        let ptr = (tensor.data as *mut u8).wrapping_add(tensor.byte_offset as usize);
        Ok(Array {
            ptr,
            bytes: elems * dtype.size(),
            dtype,
            kind,
            read_only,
            keep: cap.unbind(),
        })
    }
}
