//! Rendezvous stores: a small key-value service the ranks of a job share.
//!
//! [`TcpStore`] is served by rank 0 (or a standalone process) over TCP;
//! [`TorchTcpStore`] is a client of PyTorch's `TCPStore` server (torchrun's
//! agent serves one);
//! [`FileStore`] keeps keys as files in a directory on a shared filesystem;
//! [`HashStore`] lives in one process's memory (ranks as threads);
//! [`PrefixStore`] scopes keys for sub-communicators.

mod file;
mod hash;
mod tcp;
mod torch;

use std::{sync::Arc, time::Duration};

pub use file::FileStore;
pub use hash::HashStore;
#[doc(hidden)]
pub use tcp::fuzz as tcp_fuzz;
pub use tcp::{TcpStore, TcpStoreServer};
pub use torch::TorchTcpStore;

pub use ccl_core::Store;

#[cfg(test)]
use ccl_core::Error;
use ccl_core::Result;

/// Lowest and highest+1 port [`free_port`] picks from: below the usual
/// ephemeral range (Linux: 32768–60999), where the kernel takes source ports
/// for outgoing connections.
const FREE_PORTS: std::ops::Range<u16> = 20000..32000;

/// The ports [`free_port`] handed out in this process: never again, so that
/// two launches of one process (tests in parallel) cannot both take a port
/// in the moment before the first one's server binds it.
static HANDED_OUT: std::sync::Mutex<std::collections::BTreeSet<u16>> =
    std::sync::Mutex::new(std::collections::BTreeSet::new());

/// A TCP port free on every interface right now, for a store server to bind
/// (`MASTER_PORT` of a local launch). Picked at random below the ephemeral
/// range, so that no outgoing connection takes it in the moment before the
/// server binds it (a port from binding port 0 often is taken that way),
/// and never one this process was given before.
pub fn free_port() -> std::io::Result<u16> {
    use std::hash::{BuildHasher, Hasher};
    let random = std::collections::hash_map::RandomState::new();
    let mut given = HANDED_OUT.lock().unwrap_or_else(|e| e.into_inner());
    if given.len() >= usize::from(FREE_PORTS.end - FREE_PORTS.start) / 2 {
        // Long since bound or given up: the range must not run dry.
        given.clear();
    }
    for attempt in 0u64..1000 {
        let mut h = random.build_hasher();
        h.write_u64(attempt);
        let span = u64::from(FREE_PORTS.end - FREE_PORTS.start);
        let port = FREE_PORTS.start + (h.finish() % span) as u16;
        if !given.contains(&port)
            && std::net::TcpListener::bind((std::net::Ipv4Addr::UNSPECIFIED, port)).is_ok()
        {
            given.insert(port);
            return Ok(port);
        }
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::AddrInUse,
        format!("no free TCP port in {FREE_PORTS:?}"),
    ))
}

/// A view of another store with every key prefixed, for sub-communicators.
#[derive(Clone)]
pub struct PrefixStore {
    inner: Arc<dyn Store>,
    prefix: String,
}

impl PrefixStore {
    /// Keys `k` become `"{prefix}/{k}"` in `inner`.
    pub fn new(inner: Arc<dyn Store>, prefix: impl Into<String>) -> PrefixStore {
        PrefixStore {
            inner,
            prefix: prefix.into(),
        }
    }

    /// The prefix, without the trailing separator.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    fn key(&self, k: &str) -> String {
        format!("{}/{k}", self.prefix)
    }
}

impl Store for PrefixStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.inner.set(&self.key(key), value)
    }
    fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        self.inner.try_get(&self.key(key))
    }
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let full: Vec<String> = keys.iter().map(|k| self.key(k)).collect();
        let refs: Vec<&str> = full.iter().map(String::as_str).collect();
        self.inner.wait(&refs, timeout)
    }
    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.inner.add(&self.key(key), delta)
    }
    fn compare_set(&self, key: &str, expected: Option<&[u8]>, desired: &[u8]) -> Result<Vec<u8>> {
        self.inner.compare_set(&self.key(key), expected, desired)
    }
    fn delete(&self, key: &str) -> Result<bool> {
        self.inner.delete(&self.key(key))
    }
    fn describe(&self) -> String {
        format!("{} (prefix '{}')", self.inner.describe(), self.prefix)
    }
    fn served_here(&self) -> bool {
        self.inner.served_here()
    }
}

#[test]
fn a_process_is_never_given_the_same_port_twice() {
    // 1000 of 12000 ports: picked at random alone, two would match almost
    // surely (the birthday bound).
    let ports: std::collections::BTreeSet<u16> = (0..1000)
        .map(|_| free_port().expect("a free port"))
        .collect();
    assert_eq!(ports.len(), 1000);
    assert!(ports.iter().all(|p| FREE_PORTS.contains(p)));
}

/// The behaviour every [`Store`] must show; each store's tests run it.
#[cfg(test)]
pub(crate) fn conformance(s: &dyn Store) {
    assert_eq!(s.try_get("a").unwrap(), None);
    s.set("a", b"1").unwrap();
    assert_eq!(s.get("a", Duration::from_secs(1)).unwrap(), b"1");
    s.set("a", b"").unwrap();
    assert_eq!(s.try_get("a").unwrap(), Some(vec![]));
    assert_eq!(s.add("n", 5).unwrap(), 5);
    assert_eq!(s.add("n", -2).unwrap(), 3);
    assert_eq!(s.try_get("n").unwrap().unwrap(), b"3");
    assert_eq!(s.add("m", i64::MAX).unwrap(), i64::MAX);
    assert_eq!(s.add("m", 1).unwrap(), i64::MIN);
    s.set("x", b"not a number").unwrap();
    let e = s.add("x", 1).unwrap_err();
    assert!(
        matches!(e, Error::InvalidArgument(ref m) if m.contains("'x'")),
        "{e}"
    );
    assert_eq!(s.compare_set("c", None, b"v").unwrap(), b"v");
    assert_eq!(s.compare_set("c", None, b"w").unwrap(), b"v");
    assert_eq!(s.compare_set("c", Some(b"w"), b"z").unwrap(), b"v");
    assert_eq!(s.compare_set("c", Some(b"v"), b"z").unwrap(), b"z");
    assert_eq!(s.compare_set("unset", Some(b"v"), b"z").unwrap(), b"");
    assert_eq!(s.try_get("unset").unwrap(), None);
    assert!(s.delete("c").unwrap());
    assert!(!s.delete("c").unwrap());
    assert_eq!(s.try_get("c").unwrap(), None);
    let big = vec![7u8; 3 << 20];
    s.set("big", &big).unwrap();
    assert_eq!(s.try_get("big").unwrap().unwrap(), big);
    s.set("ключ/../\u{0}", b"odd key").unwrap();
    assert_eq!(s.try_get("ключ/../\u{0}").unwrap().unwrap(), b"odd key");
    s.wait(&[], Duration::ZERO).unwrap();
    s.wait(&["a", "n"], Duration::ZERO).unwrap();
    let e = s
        .wait(&["a", "never", "nor"], Duration::from_millis(20))
        .unwrap_err();
    match &e {
        Error::Timeout { what, after, .. } => {
            assert_eq!(what, r#"keys ["never", "nor"]"#);
            assert_eq!(*after, Duration::from_millis(20));
        }
        _ => panic!("{e}"),
    }
    // Still usable after errors.
    assert_eq!(s.try_get("a").unwrap(), Some(vec![]));
}
