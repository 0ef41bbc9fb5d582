//! ccl-transport-tcp: [`Link`](ccl_core::Link)s over TCP, built with tokio.
//!
//! [`TcpTransport`] is the transport's entry in a communicator's list; it
//! can connect any pair. In its first phase each rank binds a listener and
//! publishes its address in the rendezvous [`Store`](ccl_core::Store) under
//! `addr/{rank}`; in the second, the higher rank of every pair it was given
//! connects to the lower one, `nsocks` sockets per pair ([`connect_mesh`]
//! does both for every pair at once). Every new socket starts with the job-secret challenge-response
//! ([`ccl_rendezvous::auth`]; the acceptor challenges, both sides prove the secret)
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
//! Sockets within one host use a congestion control that does not pace
//! ([`Congestion`]); sockets between hosts keep the system's default.
//!
//! Links use tokio types registered with the runtime in whose context they
//! were connected; drive them from that runtime.

mod link;
mod mesh;
mod socket;

use std::net::IpAddr;

use ccl_core::{
    Connector, LinkClass, LinkFuture, PairResult, PeerInfo, RepollWhen, Result, Setup, Spin,
    Transport,
};
use ccl_rendezvous::{net::route_to, Config, Rendezvous};

pub use link::{REDUCE_PIECE, STRIPE_MIN};
pub use mesh::connect_mesh;
#[doc(hidden)]
pub use mesh::fuzz_decode as fuzz_decode_handshake;

/// The class of TCP links: messages of a schedule are pipelined in pieces
/// of 512 KiB; large reads need the runtime's reactor, small ones ask the
/// socket directly, so a rank with a CPU of its own polls again at once.
pub const CLASS: LinkClass = LinkClass {
    name: "tcp",
    piece_bytes: 512 * 1024,
    repoll: RepollWhen::OwnCpu,
    progress_thread: false,
};

/// How to build TCP links.
#[derive(Clone, Debug)]
pub struct TcpOptions {
    /// Sockets per peer (`CCL_NSOCKS`); large messages are striped over them.
    pub nsocks: usize,
    /// Network interface (`CCL_SOCKET_IFNAME`) whose address to listen on:
    /// its IPv4 address if it has one, else its IPv6 address.
    pub interface: Option<String>,
    /// Address to listen on when no interface is named (the route to
    /// `MASTER_ADDR`, from a config); `127.0.0.1` when neither is given.
    pub local_ip: Option<IpAddr>,
    /// The congestion control of the link sockets (`CCL_TCP_CONGESTION`).
    pub congestion: Congestion,
}

impl Default for TcpOptions {
    fn default() -> TcpOptions {
        TcpOptions {
            nsocks: 1,
            interface: None,
            local_ip: None,
            congestion: Congestion::Auto,
        }
    }
}

/// Which congestion control the link sockets use (`CCL_TCP_CONGESTION`:
/// unset or `auto`, `system`, or an algorithm's name such as `cubic`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Congestion {
    /// Links between hosts keep the system's default; links within one host
    /// (to a loopback address, or to an address of one of this host's
    /// interfaces) use `cubic`, else `reno`. The path of such a link has no queue to protect, and a
    /// pacing algorithm (BBR, a common default) spends CPU time on timers and
    /// holds data back: on a 2-vCPU VM, a 4-rank 1 MiB broadcast took 0.92 ms
    /// under BBR against 0.49 ms under cubic.
    Auto,
    /// Every link keeps the system's default (`net.ipv4.tcp_congestion_control`).
    System,
    /// Every link uses this algorithm.
    Named(String),
}

impl Congestion {
    /// The setting `CCL_TCP_CONGESTION` names; a named algorithm must be one
    /// the kernel lets this process set.
    pub fn parse(value: Option<&str>) -> Result<Congestion> {
        let congestion = match value.map(str::trim) {
            None | Some("auto") => Congestion::Auto,
            Some("system") => Congestion::System,
            Some(name) => Congestion::Named(name.to_string()),
        };
        if let Congestion::Named(name) = &congestion {
            socket::check_congestion(name).map_err(|e| {
                ccl_core::Error::Config(format!(
                    "CCL_TCP_CONGESTION={name}: the kernel refuses it ({e}); \
                     it allows: {}",
                    socket::allowed_congestion()
                ))
            })?;
        }
        Ok(congestion)
    }

    /// The algorithm a link socket within this host gets with this setting
    /// (as far as the kernel allows it).
    pub fn within_host(&self) -> String {
        match self {
            Congestion::Auto => socket::within_host_choice(),
            Congestion::System => socket::system_default(),
            Congestion::Named(name) => name.clone(),
        }
    }
}

impl TcpOptions {
    /// The options `CCL_NSOCKS` (1 to 64), `CCL_SOCKET_IFNAME` and
    /// `CCL_TCP_CONGESTION` set, with the local address of the route to the
    /// TCP store's host.
    pub fn from_config(config: &Config) -> Result<TcpOptions> {
        let local_ip = match &config.rendezvous {
            Rendezvous::Tcp { host, port, .. } | Rendezvous::TorchAgent { host, port, .. } => {
                route_to(host, *port)
            }
            _ => None,
        };
        Ok(TcpOptions {
            nsocks: config.knob_number("CCL_NSOCKS", 1, 1..=64)?,
            interface: config.knob("CCL_SOCKET_IFNAME").map(str::to_string),
            local_ip,
            congestion: Congestion::parse(config.knob("CCL_TCP_CONGESTION"))?,
        })
    }
}

/// TCP links between any two ranks (see the crate docs).
#[derive(Clone, Debug, Default)]
pub struct TcpTransport {
    options: TcpOptions,
}

impl TcpTransport {
    /// The transport with these options.
    pub fn new(options: TcpOptions) -> TcpTransport {
        TcpTransport { options }
    }

    /// The transport with the options `config` sets ([`TcpOptions::from_config`]).
    pub fn from_config(config: &Config) -> Result<TcpTransport> {
        Ok(TcpTransport::new(TcpOptions::from_config(config)?))
    }
}

impl Transport for TcpTransport {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn class(&self) -> LinkClass {
        CLASS
    }

    fn can_connect(&self, _: &PeerInfo, _: &PeerInfo) -> bool {
        true
    }

    fn prepare(&self, setup: &Setup) -> Result<Box<dyn Connector>> {
        Ok(Box::new(mesh::listen_and_publish(setup, &self.options)?))
    }
}

impl Connector for mesh::Listening {
    fn connect<'a>(
        self: Box<Self>,
        peers: &'a [usize],
        everyone: &'a [PeerInfo],
        _: Spin,
    ) -> LinkFuture<'a, Vec<PairResult>> {
        Box::pin(async move {
            let links = (*self).connect(peers, everyone).await?;
            Ok(links.into_iter().map(Ok).collect())
        })
    }
}
