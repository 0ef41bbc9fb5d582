//! The rendezvous [`Store`] trait: a small key-value service the ranks of a
//! job share. Its implementations live in `ccl-rendezvous`.

use std::time::Duration;

use crate::{Error, Result};

/// A key-value store for rendezvous. Every blocking call has a deadline.
pub trait Store: Send + Sync {
    /// Sets `key` to `value`, replacing any value.
    fn set(&self, key: &str, value: &[u8]) -> Result<()>;

    /// The value of `key`, or `None` if it is not set.
    fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>>;

    /// Waits until every key in `keys` is set; [`Error::Timeout`] after `timeout`.
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()>;

    /// Adds `delta` to the integer at `key` (0 if unset) and returns the new value.
    fn add(&self, key: &str, delta: i64) -> Result<i64>;

    /// Sets `key` to `desired` if its value is `expected` (`None`: the key is
    /// unset). Returns the value the key holds afterwards.
    fn compare_set(&self, key: &str, expected: Option<&[u8]>, desired: &[u8]) -> Result<Vec<u8>>;

    /// Deletes `key`; true if it existed.
    fn delete(&self, key: &str) -> Result<bool>;

    /// A short description for error messages ("tcp://host:port", "file:///dir").
    fn describe(&self) -> String;

    /// Whether this process serves the store, so that the store is gone once
    /// the process is (a TCP store that this process serves).
    fn served_here(&self) -> bool {
        false
    }

    /// Waits for `key`, then returns its value.
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.wait(&[key], timeout)?;
        self.try_get(key)?.ok_or_else(|| Error::Store {
            addr: self.describe(),
            msg: format!("key '{key}' vanished between wait and get"),
        })
    }
}
