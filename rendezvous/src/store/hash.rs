//! An in-process store (like torch's `HashStore`), for ranks that are threads
//! of one process.

use std::{
    collections::HashMap,
    sync::{Condvar, Mutex, MutexGuard},
    time::{Duration, Instant},
};

use super::Store;
use ccl_core::{Error, Result};

/// A store held in this process's memory.
#[derive(Default)]
pub struct HashStore {
    map: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
}

impl HashStore {
    /// An empty store.
    pub fn new() -> HashStore {
        HashStore::default()
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, Vec<u8>>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Parses the decimal integer that `add` keeps under a key.
pub(crate) fn parse_counter(key: &str, value: &[u8]) -> Result<i64> {
    std::str::from_utf8(value)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| {
            Error::InvalidArgument(format!("store key '{key}' does not hold an integer"))
        })
}

impl Store for HashStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.lock().insert(key.to_string(), value.to_vec());
        self.changed.notify_all();
        Ok(())
    }

    fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        Ok(self.lock().get(key).cloned())
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let mut map = self.lock();
        loop {
            let missing: Vec<&str> = keys
                .iter()
                .copied()
                .filter(|k| !map.contains_key(*k))
                .collect();
            if missing.is_empty() {
                return Ok(());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::Timeout {
                    context: self.describe(),
                    what: format!("keys {missing:?}"),
                    after: timeout,
                });
            }
            map = self
                .changed
                .wait_timeout(map, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let mut map = self.lock();
        let now = match map.get(key) {
            Some(v) => parse_counter(key, v)?,
            None => 0,
        }
        .wrapping_add(delta);
        map.insert(key.to_string(), now.to_string().into_bytes());
        self.changed.notify_all();
        Ok(now)
    }

    fn compare_set(&self, key: &str, expected: Option<&[u8]>, desired: &[u8]) -> Result<Vec<u8>> {
        let mut map = self.lock();
        if map.get(key).map(Vec::as_slice) == expected {
            map.insert(key.to_string(), desired.to_vec());
            self.changed.notify_all();
            return Ok(desired.to_vec());
        }
        Ok(map.get(key).cloned().unwrap_or_default())
    }

    fn delete(&self, key: &str) -> Result<bool> {
        Ok(self.lock().remove(key).is_some())
    }

    fn describe(&self) -> String {
        "hash store".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn semantics() {
        let s = Arc::new(HashStore::new());
        super::super::conformance(&*s);
        let s2 = s.clone();
        let t = std::thread::spawn(move || s2.wait(&["late"], Duration::from_secs(5)));
        std::thread::sleep(Duration::from_millis(10));
        s.set("late", b"").unwrap();
        t.join().unwrap().unwrap();
    }
}
