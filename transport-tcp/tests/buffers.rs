//! Socket buffers of real TCP links on loopback: links between ranks that
//! take turns on one CPU get smaller send buffers than the others, at both
//! ends, and keep the large receive buffers. Each rank is a
//! thread; `ss` reads the sockets while the links are up. Large buffers are
//! only set where the kernel grants them (`net.core.rmem_max`/`wmem_max` of
//! 4 MiB and more): this test raises both for its run where they are lower
//! (root is needed, as the test suite's set-up has) and puts them back.

use std::{
    net::SocketAddr,
    process::Command,
    sync::{Arc, Barrier},
    time::Duration,
};

use ccl_core::{PeerInfo, Setup, Spin, Store, Transport};
use ccl_rendezvous::HashStore;
use ccl_transport_tcp::{TcpOptions, TcpTransport};

/// The buffer size ccl asks for where the kernel grants it.
const LARGE: usize = 4 << 20;

/// Raises `net.core.{rmem,wmem}_max` to [`LARGE`] where lower, until dropped.
struct LargeBuffersGranted(Vec<(String, String)>);

impl LargeBuffersGranted {
    fn new() -> LargeBuffersGranted {
        let mut raised = Vec::new();
        for name in ["rmem_max", "wmem_max"] {
            let path = format!("/proc/sys/net/core/{name}");
            let was = std::fs::read_to_string(&path).expect("reading a socket buffer limit");
            if was.trim().parse::<usize>().expect("a number") < LARGE {
                std::fs::write(&path, LARGE.to_string())
                    .expect("raising a socket buffer limit (root is needed)");
                raised.push((path, was));
            }
        }
        LargeBuffersGranted(raised)
    }
}

impl Drop for LargeBuffersGranted {
    fn drop(&mut self) {
        for (path, was) in &self.0 {
            let _ = std::fs::write(path, was.trim());
        }
    }
}

/// A socket `ss` shows: its two ends and its buffer sizes.
#[derive(Debug)]
struct Socket {
    ends: [SocketAddr; 2],
    send_buffer: usize,
    recv_buffer: usize,
}

/// The established TCP sockets of this network namespace, from `ss -tmnH`
/// (a socket's line, then its `skmem:(r..,rb..,t..,tb..,...)` line).
fn sockets() -> Vec<Socket> {
    let out = Command::new("ss")
        .args(["-tmnH", "state", "established"])
        .output()
        .expect("running ss");
    assert!(
        out.status.success(),
        "ss: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let mut found = Vec::new();
    let mut ends = None;
    for line in text.lines() {
        if let Some(mem) = line.trim().strip_prefix("skmem:(") {
            let field = |key: &str| -> usize {
                mem.trim_end_matches(')')
                    .split(',')
                    .find_map(|f| f.strip_prefix(key).and_then(|v| v.parse().ok()))
                    .unwrap_or_else(|| panic!("no {key} in {line:?}"))
            };
            if let Some(ends) = ends.take() {
                found.push(Socket {
                    ends,
                    recv_buffer: field("rb"),
                    send_buffer: field("tb"),
                });
            }
        } else {
            let addrs: Vec<SocketAddr> = line
                .split_whitespace()
                .filter_map(|w| w.parse().ok())
                .collect();
            ends = (addrs.len() == 2).then(|| [addrs[0], addrs[1]]);
        }
    }
    found
}

#[test]
fn sockets_between_cpu_mates_get_smaller_send_buffers() {
    let _granted = LargeBuffersGranted::new();
    // Rank 0 alone on CPU 0, ranks 1 and 2 pinned together to CPU 1.
    let cpus = [0, 1, 1];
    let everyone: Vec<PeerInfo> = cpus
        .iter()
        .map(|&c| PeerInfo {
            host: "this host".into(),
            pid: std::process::id(),
            cpus: vec![c],
        })
        .collect();
    let store = Arc::new(HashStore::new());
    let (connected, read) = (Barrier::new(4), Barrier::new(4));
    let found = std::thread::scope(|s| {
        for rank in 0..3 {
            let (store, everyone) = (store.clone(), &everyone);
            let (connected, read) = (&connected, &read);
            s.spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("runtime");
                let _in = rt.enter();
                let setup = Setup {
                    rank,
                    world_size: 3,
                    comm: 11,
                    store,
                    timeout: Duration::from_secs(10),
                    secret: None,
                };
                let connector = TcpTransport::new(TcpOptions::default())
                    .prepare(&setup)
                    .expect("listening");
                let peers: Vec<usize> = (0..3).filter(|&p| p != rank).collect();
                let spin = Spin::for_host(3, 2, None);
                let links = rt
                    .block_on(connector.connect(&peers, everyone, spin))
                    .expect("links");
                assert!(links.iter().all(Result::is_ok));
                connected.wait();
                read.wait();
                drop(links);
            });
        }
        connected.wait();
        let found = sockets();
        read.wait();
        found
    });
    let listening = |r: usize| -> SocketAddr {
        let addr = store
            .get(&format!("addr/{r}"), Duration::from_secs(1))
            .expect("address");
        String::from_utf8(addr)
            .expect("text")
            .parse()
            .expect("a socket address")
    };
    let at = |addr: SocketAddr| -> Vec<&Socket> {
        found.iter().filter(|s| s.ends.contains(&addr)).collect()
    };
    // Rank 1 accepts only rank 2's socket; rank 0 accepts ranks 1's and 2's.
    let (l0, l1) = (listening(0), listening(1));
    let (mates, others) = (at(l1), at(l0));
    assert_eq!(mates.len(), 2, "both ends of the link 2-1 in {found:?}");
    assert_eq!(
        others.len(),
        4,
        "both ends of the links 1-0 and 2-0 in {found:?}"
    );
    for s in &others {
        assert!(s.send_buffer >= LARGE && s.recv_buffer >= LARGE, "{s:?}");
    }
    // Both ends send through a smaller buffer (the connecting end, rank 2,
    // set it before connecting; the accepting end after the handshake) and
    // receive through a large one: a small receive buffer overflows when the
    // mate runs ahead with small messages (see `set_buffers`).
    for s in &mates {
        assert!(s.send_buffer < LARGE && s.send_buffer >= 256 << 10, "{s:?}");
        assert!(s.recv_buffer >= LARGE, "{s:?}");
    }
}
