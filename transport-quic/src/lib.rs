//! ccl-transport-quic: [`Link`](ccl_core::Link)s over QUIC (quinn, rustls).
//!
//! [`QuicTransport`] can connect any pair; it is used only when forced
//! (`CCL_TRANSPORT=quic`): in `auto`, shared memory and TCP come first.
//!
//! Identity needs no CA: at start-up each rank makes a self-signed
//! certificate (rcgen) and publishes `address fingerprint mac` in the store
//! under `quic/{rank}`, where the fingerprint is the SHA-256 of the
//! certificate and the MAC (with a job secret) is an HMAC of the fingerprint
//! bound to the communicator id and the rank, so a rank of another job, or a
//! fingerprint replayed from an earlier job, is refused. TLS is mutual: the
//! dialling (higher) rank pins the fingerprint of the rank it dials, the
//! accepting rank accepts only the fingerprints of the ranks that dial it,
//! and a hello after TLS names communicator and ranks and is checked against
//! the certificate presented. Refused connections are logged with their
//! address and never reach a collective.
//!
//! Streams: see [`link`](crate::link) — each message goes on new
//! unidirectional streams, one per 1 MiB piece, accepted in order.
//!
//! Endpoints and connections run on a runtime of their own (one thread per
//! process), so that acknowledgements and keep-alives flow between calls;
//! the links' futures may be polled from any runtime (the communicator's).

mod cc;
mod identity;
mod link;
mod mesh;
mod pool;

use std::{
    net::{IpAddr, Ipv4Addr},
    sync::Arc,
    time::Duration,
};

use ccl_core::{
    Connector, Error, LinkClass, LinkFuture, PairResult, PeerInfo, RepollWhen, Result, Setup, Spin,
    Transport,
};
use ccl_rendezvous::{net::route_to, Config, Rendezvous};
use quinn::{congestion, IdleTimeout, TransportConfig, VarInt};

pub use identity::{
    decode_published, encode_published, fingerprint, fingerprint_mac, Identity, PinnedClients,
    PinnedServer,
};
pub use link::{PIECE, SEND_WINDOW};

/// The class of QUIC links: schedules pipeline in pieces of 1 MiB; the
/// links need a runtime to make progress.
pub const CLASS: LinkClass = LinkClass {
    name: "quic",
    piece_bytes: 1024 * 1024,
    repoll: RepollWhen::Never,
    progress_thread: true,
};

/// Congestion controller (`CCL_QUIC_CC`). BBR is the default: it does not
/// read random loss as congestion. Measured, 4 hosts at 1 Gbit/s with 0.5%
/// loss, 16 MiB ring allreduce: BBR 68% of the line, Cubic 54%, NewReno
/// 53% (TCP: 82%); on loopback, 256 MiB, BBR and Cubic alike. With 20 ms
/// of delay as well, Cubic did not finish a 64 MiB allreduce in 60 s (its
/// window stayed under 64 KB) where BBR held 47-52% of the line, and 57-62%
/// with its window capped (`cc`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CongestionControl {
    Cubic,
    NewReno,
    Bbr,
}

impl std::str::FromStr for CongestionControl {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "cubic" => Ok(CongestionControl::Cubic),
            "newreno" | "reno" => Ok(CongestionControl::NewReno),
            "bbr" => Ok(CongestionControl::Bbr),
            other => Err(format!(
                "CCL_QUIC_CC={other}: expected cubic, newreno or bbr"
            )),
        }
    }
}

/// How to build QUIC links.
#[derive(Clone, Debug)]
pub struct QuicOptions {
    /// Address to bind the UDP endpoint to (the route to `MASTER_ADDR`, or
    /// `127.0.0.1`).
    pub local_ip: IpAddr,
    /// Congestion controller.
    pub cc: CongestionControl,
    /// Receive window of every connection, in bytes (`CCL_QUIC_WINDOW`, at
    /// least [`MIN_WINDOW`]); `None`: on loopback, what the UDP socket's
    /// receive buffer holds (no datagram is lost to a full buffer), between
    /// hosts 64 MiB (see `mesh`).
    pub receive_window: Option<u32>,
}

/// The smallest receive window `CCL_QUIC_WINDOW` may set.
pub const MIN_WINDOW: u32 = 64 * 1024;

impl Default for QuicOptions {
    fn default() -> QuicOptions {
        QuicOptions {
            local_ip: IpAddr::V4(Ipv4Addr::LOCALHOST),
            cc: CongestionControl::Bbr,
            receive_window: None,
        }
    }
}

impl QuicOptions {
    /// The options `CCL_QUIC_CC` and `CCL_QUIC_WINDOW` set, bound to the route to the store's host.
    pub fn from_config(config: &Config) -> Result<QuicOptions> {
        let local_ip = match &config.rendezvous {
            Rendezvous::Tcp { host, port, .. } | Rendezvous::TorchAgent { host, port, .. } => {
                route_to(host, *port)
            }
            _ => None,
        };
        let cc = match config.knob("CCL_QUIC_CC") {
            Some(v) => v.parse().map_err(Error::Config)?,
            None => QuicOptions::default().cc,
        };
        const WINDOW: &str = "CCL_QUIC_WINDOW";
        let receive_window = config
            .knob(WINDOW)
            .map(|_| config.knob_number(WINDOW, 0, MIN_WINDOW as usize..=u32::MAX as usize))
            .transpose()?
            .map(|w| w as u32);
        Ok(QuicOptions {
            local_ip: local_ip.unwrap_or(QuicOptions::default().local_ip),
            cc,
            receive_window,
        })
    }
}

/// Largest UDP payload MTU discovery probes for.
const MTU_UPPER_BOUND: u16 = 65_000;
/// Largest interface MTU on which UDP segmentation offload is used.
const GSO_MAX_MTU: u32 = 9216;

/// The MTU of the interface that holds `ip`, if one does.
fn interface_mtu(ip: IpAddr) -> Option<u32> {
    let name = nix::ifaddrs::getifaddrs()
        .ok()?
        .find(|a| {
            let addr = a.address.as_ref();
            let v4 = addr
                .and_then(|s| s.as_sockaddr_in())
                .map(|s| IpAddr::V4(s.ip()));
            let v6 = addr
                .and_then(|s| s.as_sockaddr_in6())
                .map(|s| IpAddr::V6(s.ip()));
            v4.or(v6) == Some(ip)
        })?
        .interface_name;
    std::fs::read_to_string(format!("/sys/class/net/{name}/mtu"))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// Transport parameters: the connection's receive window (see `mesh`),
/// 4 MiB per stream, many uni streams, and an idle
/// timeout of min(timeout, 10 s) with keep-alives at a third of it, so a
/// vanished peer fails a call within seconds.
pub(crate) fn transport_config(
    options: &QuicOptions,
    timeout: Duration,
    receive_window: u32,
) -> Arc<TransportConfig> {
    let mut t = TransportConfig::default();
    t.max_concurrent_uni_streams(VarInt::from_u32(1024))
        .max_concurrent_bidi_streams(VarInt::from_u32(4))
        .stream_receive_window(VarInt::from_u32(4 * 1024 * 1024))
        .receive_window(VarInt::from_u32(receive_window))
        .send_window(64 * 1024 * 1024)
        // Send the streams of a message one after the other, not round-robin:
        // a packet then carries one stream's bytes, which the receiver takes
        // in fewer, longer chunks. A lost packet still delays only its stream.
        .send_fairness(false);
    // Datagrams as large as the interface carries: MTU discovery probes up
    // to its MTU (65 536 on loopback; the endpoint accepts up to 65 527
    // bytes, see `mesh`). Per-packet work, not encryption, bounds QUIC on
    // few cores, so larger datagrams, or else batches of them sent in one
    // system call (UDP segmentation offload), are what make it fast. The
    // two do not mix: with offload, bursts of datagrams above some 32 KB
    // were lost on loopback, quinn took that for a black hole and fell back
    // to 1 200-byte packets for good. Measured, 4 hosts at 1 Gbit/s, MTU
    // 1500: 62% of the line with offload, 19% without; loopback, 256 MiB:
    // 0.8-1.2 GB/s without offload and 65 000-byte datagrams, 0.25 with.
    let link_mtu = interface_mtu(options.local_ip).unwrap_or(1500);
    let headers = if options.local_ip.is_ipv4() { 28 } else { 48 };
    let mut mtu = quinn::MtuDiscoveryConfig::default();
    mtu.upper_bound(
        u16::try_from(link_mtu.saturating_sub(headers))
            .unwrap_or(MTU_UPPER_BOUND)
            .clamp(1200, MTU_UPPER_BOUND),
    );
    t.mtu_discovery_config(Some(mtu));
    t.enable_segmentation_offload(link_mtu <= GSO_MAX_MTU);
    // Acknowledge every ack-eliciting packet at once (see `link`).
    let mut acks = quinn::AckFrequencyConfig::default();
    acks.ack_eliciting_threshold(VarInt::from_u32(0));
    t.ack_frequency_config(Some(acks));
    let idle = timeout
        .min(Duration::from_secs(10))
        .max(Duration::from_millis(300));
    t.max_idle_timeout(IdleTimeout::try_from(idle).ok())
        .keep_alive_interval(Some(idle / 3));
    match options.cc {
        CongestionControl::Cubic => {
            t.congestion_controller_factory(Arc::new(congestion::CubicConfig::default()))
        }
        CongestionControl::NewReno => {
            t.congestion_controller_factory(Arc::new(congestion::NewRenoConfig::default()))
        }
        CongestionControl::Bbr => t.congestion_controller_factory(Arc::new(cc::CappedBbrConfig(
            Arc::new(congestion::BbrConfig::default()),
        ))),
    };
    Arc::new(t)
}

/// QUIC links between any two ranks (see the crate docs).
#[derive(Clone, Debug, Default)]
pub struct QuicTransport {
    options: QuicOptions,
}

impl QuicTransport {
    /// The transport with these options.
    pub fn new(options: QuicOptions) -> QuicTransport {
        QuicTransport { options }
    }

    /// The transport with the options `config` sets ([`QuicOptions::from_config`]).
    pub fn from_config(config: &Config) -> Result<QuicTransport> {
        Ok(QuicTransport::new(QuicOptions::from_config(config)?))
    }
}

impl Transport for QuicTransport {
    fn name(&self) -> &'static str {
        "quic"
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

/// Connects `setup.rank` to every other rank (both phases at once): `None`
/// at index `rank`, a link elsewhere. Call inside a tokio runtime.
pub async fn connect_mesh(
    setup: &Setup,
    options: &QuicOptions,
) -> Result<Vec<Option<Arc<dyn ccl_core::Link>>>> {
    let listening = mesh::listen_and_publish(setup, options)?;
    let peers: Vec<usize> = (0..setup.world_size).filter(|&p| p != setup.rank).collect();
    let links = listening.connect(&peers).await?;
    let mut all: Vec<Option<Arc<dyn ccl_core::Link>>> = vec![None; setup.world_size];
    for (p, link) in peers.into_iter().zip(links) {
        all[p] = Some(link);
    }
    Ok(all)
}

impl Connector for mesh::Listening {
    fn connect<'a>(
        self: Box<Self>,
        peers: &'a [usize],
        _: &'a [PeerInfo],
        _: Spin,
    ) -> LinkFuture<'a, Vec<PairResult>> {
        Box::pin(async move { Ok((*self).connect(peers).await?.into_iter().map(Ok).collect()) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(vars: &[(&str, &str)]) -> Result<QuicOptions> {
        QuicOptions::from_config(&Config::from_vars(vars.iter().copied())?)
    }

    #[test]
    fn the_window_knob_is_bytes_within_bounds() {
        assert_eq!(options(&[]).unwrap().receive_window, None);
        let w = options(&[("CCL_QUIC_WINDOW", "1048576")]).unwrap();
        assert_eq!(w.receive_window, Some(1 << 20));
        for bad in ["1000", "16M", "5000000000"] {
            let e = options(&[("CCL_QUIC_WINDOW", bad)])
                .unwrap_err()
                .to_string();
            assert!(e.contains("CCL_QUIC_WINDOW"), "{bad}: {e}");
        }
    }
}
