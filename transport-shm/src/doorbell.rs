//! Doorbells: how a rank that found nothing to do sleeps, and how a peer wakes it.
//!
//! Every rank binds one datagram socket in the abstract Unix namespace (no
//! file, gone when the process is). A peer that changes what a sleeping rank
//! waits for sends it one byte; the sleeper waits for its socket to become
//! readable inside the tokio runtime, like for any other socket. Whether a
//! rank sleeps is a word in the shared segment, so a peer rings only then.

use std::{
    io,
    os::linux::net::SocketAddrExt,
    os::unix::net::{SocketAddr, UnixDatagram as StdDatagram},
    sync::atomic::{AtomicU64, Ordering},
};

use tokio::net::UnixDatagram;

/// This rank's doorbell.
pub(crate) struct Doorbell {
    socket: UnixDatagram,
    name: String,
}

/// Distinguishes the doorbells of several communicators in one process.
static NEXT: AtomicU64 = AtomicU64::new(0);

impl Doorbell {
    /// Binds a new doorbell (inside a tokio runtime).
    pub(crate) fn bind(comm: u64) -> io::Result<Doorbell> {
        let name = format!(
            "ccl-bell-{}-{comm:016x}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let socket = StdDatagram::bind_addr(&SocketAddr::from_abstract_name(name.as_bytes())?)?;
        socket.set_nonblocking(true)?;
        Ok(Doorbell {
            socket: UnixDatagram::from_std(socket)?,
            name,
        })
    }

    /// The name peers ring.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// Completes once a ring may have arrived since the last [`Doorbell::drain`].
    pub(crate) async fn rung(&self) {
        // An error here (none is expected on a bound datagram socket) is
        // treated as a ring: the waiter re-checks what it waits for anyway.
        let _ = self.socket.readable().await;
    }

    /// Discards the rings received so far.
    pub(crate) fn drain(&self) {
        let mut buf = [0u8; 64];
        while self.socket.try_recv(&mut buf).is_ok() {}
    }
}

/// A peer's doorbell, to ring.
pub(crate) struct Bell {
    to: SocketAddr,
    from: StdDatagram,
}

impl Bell {
    /// The doorbell a peer published under `name`.
    pub(crate) fn new(name: &str) -> io::Result<Bell> {
        let from = StdDatagram::unbound()?;
        from.set_nonblocking(true)?;
        Ok(Bell {
            to: SocketAddr::from_abstract_name(name.as_bytes())?,
            from,
        })
    }

    /// Wakes the peer. A full queue means rings are pending already, and a
    /// peer that is gone is noticed through its exit: both are ignored.
    pub(crate) fn ring(&self) {
        let _ = self.from.send_to_addr(&[1], &self.to);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn ring_wakes_and_drain_clears() {
        let bell = Doorbell::bind(7).unwrap();
        let peer = Bell::new(bell.name()).unwrap();
        for _ in 0..3 {
            peer.ring();
        }
        tokio::time::timeout(Duration::from_secs(5), bell.rung())
            .await
            .unwrap();
        bell.drain();
        let quiet = tokio::time::timeout(Duration::from_millis(50), bell.rung()).await;
        assert!(quiet.is_err(), "no ring after drain");
        peer.ring();
        tokio::time::timeout(Duration::from_secs(5), bell.rung())
            .await
            .unwrap();
    }
}
