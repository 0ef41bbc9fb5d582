//! A TCP rendezvous store (like torch's `TCPStore`): rank 0 (or a standalone
//! process) serves a key-value map, every rank talks to it over one
//! connection.
//!
//! Blocking sockets and threads: the server runs an accept thread plus one
//! thread per connection around a shared map and condition variable; `wait`
//! is answered by the server when the keys exist or the request's deadline
//! passes. A client keeps one connection behind a mutex, so its requests are
//! serialized; every socket read and write has a timeout.
//!
//! Wire protocol (integers big-endian). The server first authenticates the
//! client and itself with the job secret, or says the job has none
//! ([`crate::auth`]: challenge, response, proof); a client that fails is
//! dropped and logged with its address. Then each side sends an 8-byte
//! greeting, [`MAGIC`] then the `u32` protocol version; anything else is
//! dropped. Then the client sends requests, an op byte followed by fields,
//! and the server answers each with a status byte followed by fields. Byte
//! strings are a `u32` length then the bytes; every length is bounded before
//! anything is allocated.
//!
//! | op | request fields | reply |
//! |----|----------------|-------|
//! | 1 set | key, value | ok |
//! | 2 get | key | ok value, or not-found |
//! | 3 wait | `u64` timeout ns, `u32` n, n keys | ok, or timeout `u32` n, n missing keys |
//! | 4 add | key, `i64` delta | ok `i64`, or invalid message |
//! | 5 compare-set | key, `u8` has-expected, `[expected]`, desired | ok value |
//! | 6 delete | key | ok `u8` existed |

mod client;
mod server;
mod wire;

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    sync::{Mutex, MutexGuard},
};

pub use client::TcpStore;
pub(crate) use client::{bracketed, unbracketed};
pub use server::TcpStoreServer;
pub use wire::fuzz;

/// First four bytes each side sends.
const MAGIC: [u8; 4] = *b"CCLs";
/// Protocol version, sent after [`MAGIC`].
const VERSION: u32 = 1;

fn greeting() -> [u8; 8] {
    let mut g = [0; 8];
    g[..4].copy_from_slice(&MAGIC);
    g[4..].copy_from_slice(&VERSION.to_be_bytes());
    g
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Where to connect to reach a server bound to `addr` from this machine.
fn loopback_of(addr: SocketAddr) -> SocketAddr {
    match addr.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => (Ipv4Addr::LOCALHOST, addr.port()).into(),
        IpAddr::V6(ip) if ip.is_unspecified() => (Ipv6Addr::LOCALHOST, addr.port()).into(),
        _ => addr,
    }
}

#[cfg(test)]
mod tests {
    use super::{wire::MAX_KEY, *};
    use crate::store::Store;
    use ccl_core::{Error, JobSecret};
    use std::{
        sync::{Arc, Barrier},
        thread,
        time::{Duration, Instant},
    };

    pub(super) const T: Duration = Duration::from_secs(5);

    pub(super) fn local_server() -> TcpStoreServer {
        TcpStoreServer::bind("127.0.0.1:0".parse().unwrap()).unwrap()
    }

    pub(super) fn client(server: &TcpStoreServer) -> TcpStore {
        let a = server.local_addr();
        TcpStore::connect(&a.ip().to_string(), a.port(), T).unwrap()
    }

    fn semantics(s: &TcpStore) {
        crate::store::conformance(s);
        let long = "k".repeat(MAX_KEY + 1);
        assert!(matches!(s.set(&long, b""), Err(Error::InvalidArgument(_))));
        assert_eq!(s.try_get("a").unwrap(), Some(vec![]));
    }

    #[test]
    fn semantics_ipv4() {
        let server = local_server();
        let s = client(&server);
        assert_eq!(s.server_addr(), server.local_addr());
        assert!(
            s.describe().starts_with("store tcp://127.0.0.1:"),
            "{}",
            s.describe()
        );
        semantics(&s);
        let s = Arc::new(s);
        let s2 = s.clone();
        let t = thread::spawn(move || s2.wait(&["late"], T));
        thread::sleep(Duration::from_millis(10));
        // Another client wakes the waiter; this one is busy waiting.
        client(&server).set("late", b"").unwrap();
        t.join().unwrap().unwrap();
    }

    #[test]
    fn semantics_ipv6() {
        let server = match TcpStoreServer::bind("[::1]:0".parse().unwrap()) {
            Ok(s) => s,
            Err(e) => return eprintln!("no IPv6 loopback, skipped: {e}"),
        };
        let s = TcpStore::connect("::1", server.local_addr().port(), T).unwrap();
        assert!(s.server_addr().is_ipv6());
        assert!(s.describe().contains("[::1]"));
        semantics(&s);
        let s2 = TcpStore::connect("[::1]", server.local_addr().port(), T).unwrap();
        assert_eq!(s2.try_get("a").unwrap(), Some(vec![]));
    }

    #[test]
    fn serve_and_dual_stack() {
        let s = TcpStore::serve("127.0.0.1", 0, T).unwrap();
        let port = s.server_addr().port();
        assert_ne!(port, 0);
        s.set("k", b"v").unwrap();
        let c = TcpStore::connect("localhost", port, T).unwrap();
        assert_eq!(c.try_get("k").unwrap().unwrap(), b"v");

        let s6 = match TcpStore::serve("::1", 0, T) {
            Ok(s) => s,
            Err(e) => return eprintln!("no IPv6, skipped: {e}"),
        };
        let port = s6.server_addr().port();
        s6.set("k6", b"v6").unwrap();
        // [::] is dual-stack: IPv4 clients reach it too.
        let c4 = TcpStore::connect("127.0.0.1", port, T).unwrap();
        assert_eq!(c4.try_get("k6").unwrap().unwrap(), b"v6");
        let c6 = TcpStore::connect("::1", port, T).unwrap();
        assert_eq!(c6.try_get("k6").unwrap().unwrap(), b"v6");
    }

    #[test]
    fn concurrent_clients() {
        const N: usize = 16;
        const ROUNDS: i64 = 25;
        let server = local_server();
        let port = server.local_addr().port();
        let barrier = Arc::new(Barrier::new(N));
        let threads: Vec<_> = (0..N)
            .map(|i| {
                let barrier = barrier.clone();
                thread::spawn(move || {
                    let s = TcpStore::connect("127.0.0.1", port, T).unwrap();
                    barrier.wait();
                    for r in 0..ROUNDS {
                        s.set(&format!("k{i}/{r}"), format!("{i}:{r}").as_bytes())
                            .unwrap();
                        s.add("counter", i as i64 + r).unwrap();
                        // Wait for the next rank's key of this round.
                        let next = format!("k{}/{r}", (i + 1) % N);
                        assert_eq!(
                            s.get(&next, T).unwrap(),
                            format!("{}:{r}", (i + 1) % N).as_bytes()
                        );
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let s = client(&server);
        let want: i64 = (0..N as i64)
            .map(|i| (0..ROUNDS).map(|r| i + r).sum::<i64>())
            .sum();
        assert_eq!(s.add("counter", 0).unwrap(), want);
    }

    #[test]
    fn shared_client_between_threads() {
        let server = local_server();
        let s: Arc<dyn Store> = Arc::new(client(&server));
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let s = s.clone();
                thread::spawn(move || {
                    for _ in 0..50 {
                        s.add("n", 1).unwrap();
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(s.add("n", 0).unwrap(), 400);
    }

    #[test]
    fn wait_timeout_is_prompt() {
        let server = local_server();
        let s = client(&server);
        let start = Instant::now();
        let e = s.wait(&["never"], Duration::from_millis(100)).unwrap_err();
        let took = start.elapsed();
        assert!(matches!(e, Error::Timeout { .. }), "{e}");
        assert!(
            took >= Duration::from_millis(100) && took < Duration::from_secs(1),
            "{took:?}"
        );
    }

    pub(super) fn secret(s: &str) -> JobSecret {
        JobSecret::new(s).unwrap()
    }

    #[test]
    fn send_sync() {
        fn check<T: Send + Sync>() {}
        check::<TcpStore>();
        check::<TcpStoreServer>();
    }
}
