//! Send buffers that are reused rather than allocated for every piece.
//!
//! quinn holds what a stream sends until the peer acknowledged it, as
//! [`Bytes`]. Written from a slice, each piece was copied into a fresh 1 MiB
//! allocation, which glibc serves with `mmap`: every page of every piece was
//! faulted in and zeroed by the kernel before the copy (on loopback, 280 MiB
//! of page faults per 256 MiB allreduce on each rank). A pool keeps the
//! buffers quinn hands back and copies the next piece into one of them.

use std::sync::{Arc, Mutex};

use bytes::Bytes;

/// The buffers a link's sends reuse: at most `keep` are kept while unused.
pub(crate) struct PiecePool {
    free: Mutex<Vec<Vec<u8>>>,
    keep: usize,
}

impl PiecePool {
    pub(crate) fn new(keep: usize) -> Arc<PiecePool> {
        Arc::new(PiecePool {
            free: Mutex::new(Vec::new()),
            keep,
        })
    }

    /// `parts` one after another in a buffer of the pool, which returns to
    /// the pool when quinn drops the last of the bytes.
    pub(crate) fn bytes(self: &Arc<PiecePool>, parts: &[&[u8]]) -> Bytes {
        let mut buf = self
            .free
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop()
            .unwrap_or_default();
        buf.clear();
        for part in parts {
            buf.extend_from_slice(part);
        }
        Bytes::from_owner(Pooled {
            buf,
            pool: Arc::clone(self),
        })
    }
}

/// A buffer of a pool that goes back to it when dropped.
struct Pooled {
    buf: Vec<u8>,
    pool: Arc<PiecePool>,
}

impl AsRef<[u8]> for Pooled {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        let mut free = self.pool.free.lock().unwrap_or_else(|e| e.into_inner());
        if free.len() < self.pool.keep {
            free.push(std::mem::take(&mut self.buf));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_reused_up_to_keep() {
        let pool = PiecePool::new(1);
        let a = pool.bytes(&[b"head", b"data"]);
        assert_eq!(&a[..], b"headdata");
        let at = a.as_ptr();
        let b = pool.bytes(&[b"other"]);
        drop(a);
        drop(b);
        assert_eq!(pool.free.lock().unwrap().len(), 1);
        let c = pool.bytes(&[b"xy"]);
        assert_eq!(&c[..], b"xy");
        // The buffer kept is the first one returned (the second was not
        // kept: the pool was full).
        assert_eq!(c.as_ptr(), at);
        // A slice keeps the buffer out of the pool until it is dropped too.
        let tail = c.slice(1..);
        drop(c);
        assert!(pool.free.lock().unwrap().is_empty());
        drop(tail);
        assert_eq!(pool.free.lock().unwrap().len(), 1);
    }
}
