//! ccl-transport-tcp: [`Link`](ccl_core::Link)s over TCP, built with tokio.
//!
//! [`connect_mesh`] connects one rank to every other rank of a communicator
//! (a full mesh): each rank binds a listener, publishes its address in the
//! rendezvous [`Store`](ccl_core::Store) under `addr/{rank}`, and then the
//! higher rank of every pair connects to the lower one, `nsocks` sockets per
//! pair. Every new socket starts with the job-secret challenge-response
//! ([`ccl_core::auth`]; the acceptor challenges, both sides prove the secret)
//! and then a small handshake (magic, version, communicator id, ranks, socket
//! index), so that strangers and connections of other communicators are turned
//! away, and logged with their address, without disturbing the job.
//!
//! A link sends a message as a [`FrameHeader`](ccl_core::FrameHeader) and its
//! payload. Small messages go on socket 0 in one write; messages of
//! [`STRIPE_MIN`] bytes or more are striped over all sockets of the pair, each
//! socket carrying the header and a contiguous share of the payload.
//! Receives read straight into the caller's buffer; receive-and-reduce reads
//! in pieces of [`REDUCE_PIECE`] bytes and reduces each piece as it arrives.
//!
//! Links use tokio types registered with the runtime in whose context
//! [`connect_mesh`] ran; drive them from that runtime.

mod link;
mod mesh;

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, ToSocketAddrs, UdpSocket},
    time::Duration,
};

pub use link::{REDUCE_PIECE, STRIPE_MIN};
pub use mesh::connect_mesh;
#[doc(hidden)]
pub use mesh::fuzz_decode as fuzz_decode_handshake;

/// How to build TCP links.
#[derive(Clone, Debug)]
pub struct TcpOptions {
    /// Sockets per peer (`CCL_NSOCKS`); large messages are striped over them.
    pub nsocks: usize,
    /// Network interface (`CCL_SOCKET_IFNAME`) whose address to listen on:
    /// its IPv4 address if it has one, else its IPv6 address.
    pub interface: Option<String>,
    /// Address to listen on when no interface is named (the facade passes the
    /// route to `MASTER_ADDR`); `127.0.0.1` when neither is given.
    pub local_ip: Option<IpAddr>,
    /// Deadline for the whole mesh set-up (store rendezvous and connections).
    pub timeout: Duration,
    /// The job secret (`CCL_JOB_SECRET`) every socket proves, both ways,
    /// before anything else; `None`: unauthenticated (logged once).
    pub secret: Option<ccl_core::JobSecret>,
}

impl Default for TcpOptions {
    fn default() -> TcpOptions {
        TcpOptions {
            nsocks: 1,
            interface: None,
            local_ip: None,
            timeout: Duration::from_secs(60),
            secret: None,
        }
    }
}

/// The local address the OS would use to reach `host:port` (a UDP socket is
/// connected, which sends nothing). `None` if `host` does not resolve or no
/// route leads there. `host` may be a name or an address (IPv6 with or without brackets).
pub fn route_to(host: &str, port: u16) -> Option<IpAddr> {
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    // Connecting a UDP socket to port 0 is refused; any port finds the same route.
    let port = if port == 0 { 9 } else { port };
    let targets = (host, port).to_socket_addrs().ok()?;
    for target in targets {
        let unspecified: SocketAddr = match target {
            SocketAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
            SocketAddr::V6(_) => (Ipv6Addr::UNSPECIFIED, 0).into(),
        };
        let Ok(socket) = UdpSocket::bind(unspecified) else {
            continue;
        };
        if socket.connect(target).is_err() {
            continue;
        }
        match socket.local_addr() {
            Ok(local) if !local.ip().is_unspecified() => return Some(local.ip()),
            _ => continue,
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn route_to_loopback() {
        assert_eq!(
            route_to("127.0.0.1", 29500),
            Some(IpAddr::V4(Ipv4Addr::LOCALHOST))
        );
        assert_eq!(
            route_to("127.0.0.1", 0),
            Some(IpAddr::V4(Ipv4Addr::LOCALHOST))
        );
        assert!(route_to("localhost", 29500).is_some_and(|ip| ip.is_loopback()));
        if std::net::TcpListener::bind("[::1]:0").is_ok() {
            assert_eq!(route_to("[::1]", 1), Some(IpAddr::V6(Ipv6Addr::LOCALHOST)));
            assert_eq!(route_to("::1", 1), Some(IpAddr::V6(Ipv6Addr::LOCALHOST)));
        }
    }
}
