//! `ccl._ccl`: the extension module under the `ccl` Python package. It
//! turns Python arrays into memory that knows where it lives and calls the
//! one untyped call path of the Rust library; the package's Python modules
//! (`ccl`, `ccl.torch`, `ccl.train`) build on it.

mod comm;
mod device;
mod dlpack;
mod interpreter;
mod shared;
mod store;
mod work;

use ccl::{Error as CclError, ErrorCode};
use pyo3::{create_exception, exceptions::PyRuntimeError, exceptions::PyValueError, prelude::*};

create_exception!(
    ccl,
    Error,
    PyRuntimeError,
    "A ccl call failed; the message names the rank and the call."
);
create_exception!(
    ccl,
    TimeoutError,
    Error,
    "A deadline passed (the communicator's timeout, CCL_TIMEOUT)."
);
create_exception!(
    ccl,
    PeerLostError,
    Error,
    "A peer exited, its link dropped, or it reported its own failure."
);
create_exception!(ccl, MismatchError, Error, "Ranks made different calls.");
create_exception!(
    ccl,
    BrokenError,
    Error,
    "The communicator failed earlier (or was aborted) and can no longer be used."
);
create_exception!(ccl, StoreError, Error, "The rendezvous store failed.");
create_exception!(
    ccl,
    UnsupportedError,
    Error,
    "Something this machine cannot do (GPU memory without a CUDA driver)."
);

/// The Python exception of a ccl error: `ValueError` for bad arguments,
/// a subclass of `ccl.Error` for the rest.
pub(crate) fn to_py(e: CclError) -> PyErr {
    let msg = e.to_string();
    match e.code() {
        ErrorCode::InvalidArgument => PyValueError::new_err(msg),
        ErrorCode::Timeout => TimeoutError::new_err(msg),
        ErrorCode::PeerLost => PeerLostError::new_err(msg),
        ErrorCode::Mismatch => MismatchError::new_err(msg),
        ErrorCode::Broken => BrokenError::new_err(msg),
        ErrorCode::Store => StoreError::new_err(msg),
        ErrorCode::Unsupported => UnsupportedError::new_err(msg),
        _ => Error::new_err(msg),
    }
}

#[pymodule]
fn _ccl(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<comm::Communicator>()?;
    m.add_class::<work::Work>()?;
    m.add_class::<device::DeviceBuffer>()?;
    m.add_class::<shared::SharedBuffer>()?;
    m.add_function(wrap_pyfunction!(interpreter::_at_exit, m)?)?;
    m.add("Error", py.get_type::<Error>())?;
    m.add("TimeoutError", py.get_type::<TimeoutError>())?;
    m.add("PeerLostError", py.get_type::<PeerLostError>())?;
    m.add("MismatchError", py.get_type::<MismatchError>())?;
    m.add("BrokenError", py.get_type::<BrokenError>())?;
    m.add("StoreError", py.get_type::<StoreError>())?;
    m.add("UnsupportedError", py.get_type::<UnsupportedError>())?;
    Ok(())
}
