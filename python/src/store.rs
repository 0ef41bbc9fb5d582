//! A Python store object (torch.distributed's `Store`: `TCPStore`,
//! `FileStore`, `PrefixStore`, or anything with their methods) as ccl's
//! [`Store`], so that a communicator meets its peers wherever the framework
//! already does.

use std::time::{Duration, Instant};

use ccl::{Error, Result, Store};

use crate::interpreter;
use pyo3::{
    prelude::*,
    types::{PyBytes, PyTuple},
};

/// A Python store, called with the interpreter attached.
pub struct PyStore {
    store: Py<PyAny>,
    name: String,
}

impl PyStore {
    pub fn new(store: Bound<'_, PyAny>) -> PyStore {
        let name = store
            .get_type()
            .name()
            .map_or_else(|_| "store".into(), |n| n.to_string());
        PyStore {
            store: store.unbind(),
            name: format!("python {name}"),
        }
    }

    /// Calls `method` on the store; a Python exception becomes a store error.
    fn call<T>(
        &self,
        method: &str,
        args: impl for<'py> FnOnce(Python<'py>) -> PyResult<Bound<'py, PyTuple>>,
        out: impl for<'py> FnOnce(&Bound<'py, PyAny>) -> PyResult<T>,
    ) -> Result<T> {
        let error = |msg: String| Error::Store {
            addr: self.name.clone(),
            msg: format!("{method}: {msg}"),
        };
        interpreter::attach(|py| {
            let result = args(py).and_then(|a| self.store.bind(py).call_method1(method, a));
            result
                .and_then(|r| out(&r))
                .map_err(|e| error(e.to_string()))
        })
        .unwrap_or_else(|| Err(error("the Python interpreter is exiting".into())))
    }
}

fn bytes(v: &Bound<'_, PyAny>) -> PyResult<Vec<u8>> {
    v.extract::<Vec<u8>>()
}

impl Store for PyStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.call(
            "set",
            |py| (key, PyBytes::new(py, value)).into_pyobject(py),
            |_| Ok(()),
        )
    }

    fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        // torch's get waits for the key: ask first whether it is there.
        if !self.call(
            "check",
            |py| (vec![key],).into_pyobject(py),
            |r| r.extract::<bool>(),
        )? {
            return Ok(None);
        }
        self.call("get", |py| (key,).into_pyobject(py), bytes)
            .map(Some)
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        // Polled with `check`, so that the deadline is ccl's whatever the
        // store's own timeout is.
        let deadline = Instant::now() + timeout;
        let mut pause = Duration::from_micros(200);
        loop {
            let set = self.call(
                "check",
                |py| (keys.to_vec(),).into_pyobject(py),
                |r| r.extract::<bool>(),
            )?;
            if set {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(Error::Timeout {
                    context: self.name.clone(),
                    what: format!("keys {keys:?}"),
                    after: timeout,
                });
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(20));
        }
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.call(
            "add",
            |py| (key, delta).into_pyobject(py),
            |r| r.extract::<i64>(),
        )
    }

    fn compare_set(&self, key: &str, expected: Option<&[u8]>, desired: &[u8]) -> Result<Vec<u8>> {
        // torch's compare_set: an empty expected value matches an unset key.
        self.call(
            "compare_set",
            |py| {
                (
                    key,
                    PyBytes::new(py, expected.unwrap_or_default()),
                    PyBytes::new(py, desired),
                )
                    .into_pyobject(py)
            },
            bytes,
        )
    }

    fn delete(&self, key: &str) -> Result<bool> {
        self.call(
            "delete_key",
            |py| (key,).into_pyobject(py),
            |r| r.extract::<bool>(),
        )
    }

    fn describe(&self) -> String {
        self.name.clone()
    }
}
