//! The sockets of TCP links: which address to listen on, large buffers,
//! keepalive and user timeouts so that a vanished peer is noticed, and
//! listening and connecting with them.

use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr},
    sync::OnceLock,
    time::Duration,
};

use ccl_core::{Error, Result};
use ccl_rendezvous::net::{interface_address, is_local_address};
use socket2::{Domain, Protocol, Socket, Type};
use tokio::net::{TcpSocket, TcpStream};

use crate::{Congestion, TcpOptions};

/// Send and receive buffer size of every socket.
const SOCKET_BUFFER: usize = 4 << 20;

/// The address to listen on: the interface's, else `local_ip`, else loopback.
pub(crate) fn local_address(opts: &TcpOptions) -> Result<SocketAddr> {
    if let Some(name) = &opts.interface {
        return interface_address(name);
    }
    Ok(SocketAddr::new(
        opts.local_ip.unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST)),
        0,
    ))
}

/// Whether the kernel grants [`SOCKET_BUFFER`]-byte buffers. Where it caps
/// them lower (`net.core.rmem_max`/`wmem_max`, 208 KiB by default), an explicit
/// size would be cut down and would also switch off the kernel's buffer
/// auto-tuning, which grows past it; buffers are then left to the kernel.
fn large_buffers_granted() -> bool {
    static GRANTED: OnceLock<bool> = OnceLock::new();
    *GRANTED.get_or_init(|| {
        let max = |name: &str| {
            std::fs::read_to_string(format!("/proc/sys/net/core/{name}")).ok().and_then(|s| s.trim().parse::<usize>().ok())
        };
        let granted = [max("rmem_max"), max("wmem_max")].iter().all(|m| m.is_none_or(|m| m >= SOCKET_BUFFER));
        if !granted {
            tracing::debug!("net.core.rmem_max/wmem_max below {SOCKET_BUFFER} bytes: leaving TCP buffers to auto-tuning");
        }
        granted
    })
}

/// Send buffer size of a socket to a rank that takes turns on this rank's
/// CPU ([`ccl_core::cpu_mates`]); the kernel doubles it. What one of the two
/// writes into the socket the other reads on the same CPU after a context
/// switch: with a send buffer of [`SOCKET_BUFFER`] it has left that CPU's
/// caches by then. On a 2-CPU VM (1 MiB of L2 per core; 4 ranks over TCP,
/// bound round-robin) the six collectives at 128 MiB took 0.59–0.89 of
/// their time with it (3 alternating runs); as the size of both buffers,
/// 256 KiB did no better than 512 KiB, 1 MiB and 2 MiB worse.
const MATE_BUFFER: usize = 512 << 10;

/// The buffers of a socket about to listen or connect, where the kernel
/// grants large ones (else the kernel's auto-tuning stays): a send buffer of
/// [`MATE_BUFFER`] bytes to a CPU mate (`mate`), else [`SOCKET_BUFFER`], and
/// a receive buffer of [`SOCKET_BUFFER`] either way. A smaller receive buffer
/// fills up when a sender runs ahead of a reader that waits for its CPU (a
/// broadcast's root sending one small message after another): the kernel
/// offers a window sized by the payload its recent packets brought per byte
/// of memory, small packets take more memory than that, and it drops what it
/// offered room for; with 1 MiB, a 4-rank 8 KiB tree broadcast over TCP
/// waited for a retransmission timeout once in a thousand calls (0.4 ms a
/// call on average instead of 0.017). Set before the handshake, so that the
/// window scale covers them; sockets a listener accepts inherit them.
fn set_buffers(s: &socket2::SockRef<'_>, mate: bool) -> std::io::Result<()> {
    if !large_buffers_granted() {
        return Ok(());
    }
    s.set_send_buffer_size(if mate { MATE_BUFFER } else { SOCKET_BUFFER })?;
    s.set_recv_buffer_size(SOCKET_BUFFER)
}

/// Gives a connected socket to a CPU mate a [`MATE_BUFFER`]-byte send
/// buffer, on the accepting side, whose socket took the listener's buffers
/// (the connecting side set its own before connecting). A socket that
/// refuses keeps its buffer: a slower link, not a failure.
pub(crate) fn send_to_cpu_mate(s: &socket2::SockRef<'_>, rank: usize, peer: usize) {
    if !large_buffers_granted() {
        return;
    }
    if let Err(e) = s.set_send_buffer_size(MATE_BUFFER) {
        tracing::debug!(
            rank,
            peer,
            "keeping the send buffer of a socket to a CPU mate: {e}"
        );
    }
}

/// How long an idle link waits before it probes its peer, then between
/// probes, and how many probes may go unanswered: a peer whose host vanished
/// (a cut cable, a dead veth) is noticed after about 5 s of silence.
const KEEPALIVE: (Duration, Duration, u32) = (Duration::from_secs(2), Duration::from_secs(1), 3);
/// Sent data left unacknowledged this long fails the link (`TCP_USER_TIMEOUT`).
const UNACKED_LIMIT: Duration = Duration::from_secs(10);

/// Makes a link socket notice a vanished peer within seconds even while it
/// only waits (keepalive probes) or only sends (`TCP_USER_TIMEOUT`), instead
/// of at the call's deadline.
pub(crate) fn watch_peer(s: &socket2::SockRef<'_>) -> std::io::Result<()> {
    let (idle, interval, probes) = KEEPALIVE;
    s.set_tcp_keepalive(
        &socket2::TcpKeepalive::new()
            .with_time(idle)
            .with_interval(interval)
            .with_retries(probes),
    )?;
    s.set_tcp_user_timeout(Some(UNACKED_LIMIT))
}

/// The congestion control [`Congestion::Auto`] gives links within one host,
/// in order of preference.
const WITHIN_HOST: [&str; 2] = ["cubic", "reno"];

/// Sets the congestion control of a socket, before it listens or connects,
/// as `congestion` says for a socket that stays on this host (`within_host`)
/// or not. Set later, the system's default would already have started, and
/// BBR, a common default, leaves the socket paced whatever follows it. A
/// failure leaves the system's default, logged: a named algorithm was
/// checked when the options were read ([`check_congestion`]).
fn set_congestion(sock: &socket2::SockRef<'_>, congestion: &Congestion, within_host: bool) {
    let names: &[&str] = match congestion {
        Congestion::System => return,
        Congestion::Auto if !within_host => return,
        Congestion::Auto => &WITHIN_HOST,
        Congestion::Named(name) => &[name.as_str()],
    };
    let mut refused = Vec::new();
    for name in names {
        match sock.set_tcp_congestion(name.as_bytes()) {
            Ok(()) => return,
            Err(e) => refused.push(format!("{name}: {e}")),
        }
    }
    tracing::debug!(
        "keeping the system's congestion control on a link socket ({})",
        refused.join("; ")
    );
}

/// Gives an accepted socket from another host the system's default
/// congestion control where [`Congestion::Auto`] gave the listener, and so
/// the socket, the one for sockets within the host. Switching to the default
/// starts it as it would have started at the handshake (only switching away
/// from a pacing algorithm leaves the socket paced).
pub(crate) fn accepted(stream: &TcpStream, congestion: &Congestion) {
    if *congestion != Congestion::Auto {
        return;
    }
    let Ok(peer) = stream.peer_addr() else {
        return;
    };
    if is_local_address(peer.ip()) {
        return;
    }
    let default = system_default();
    if let Err(e) = socket2::SockRef::from(stream).set_tcp_congestion(default.as_bytes()) {
        tracing::debug!("restoring the system's congestion control on a socket from {peer}: {e}");
    }
}

/// The kernel's default congestion control (of this network namespace).
pub(crate) fn system_default() -> String {
    std::fs::read_to_string("/proc/sys/net/ipv4/tcp_congestion_control")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|e| format!("unknown ({e})"))
}

/// What [`Congestion::Auto`] gives sockets within the host here: the first
/// of [`WITHIN_HOST`] the kernel lets this process set (a privileged process
/// may set any the kernel has, not only those of
/// `net.ipv4.tcp_allowed_congestion_control`), else the system's default,
/// which such sockets then keep.
pub(crate) fn within_host_choice() -> String {
    WITHIN_HOST
        .into_iter()
        .find(|n| check_congestion(n).is_ok())
        .map_or_else(system_default, str::to_string)
}

/// Whether the kernel lets this process set congestion control `name` (on a
/// socket that is never connected).
pub(crate) fn check_congestion(name: &str) -> std::io::Result<()> {
    Socket::new(Domain::IPV4, Type::STREAM, Some(Protocol::TCP))?
        .set_tcp_congestion(name.as_bytes())
}

/// The algorithms an unprivileged process may set, as the kernel lists them.
pub(crate) fn allowed_congestion() -> String {
    std::fs::read_to_string("/proc/sys/net/ipv4/tcp_allowed_congestion_control")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|e| format!("unknown ({e})"))
}

/// A non-blocking listener on `addr` (port 0: any), sockets it accepts
/// inheriting large buffers and the congestion control `congestion` gives
/// sockets within the host ([`accepted`] restores the system's default on
/// the others).
pub(crate) fn listen(
    addr: SocketAddr,
    backlog: usize,
    congestion: &Congestion,
) -> Result<std::net::TcpListener> {
    let ctx = |e| Error::io(format!("listening on {addr}"), e);
    let socket =
        Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP)).map_err(ctx)?;
    if addr.is_ipv6() {
        socket.set_only_v6(true).map_err(ctx)?;
    }
    set_buffers(&(&socket).into(), false).map_err(ctx)?;
    set_congestion(&(&socket).into(), congestion, true);
    socket.set_nodelay(true).map_err(ctx)?;
    socket.bind(&addr.into()).map_err(ctx)?;
    socket
        .listen(backlog.min(i32::MAX as usize) as i32)
        .map_err(ctx)?;
    socket.set_nonblocking(true).map_err(ctx)?;
    Ok(socket.into())
}

/// A socket connected to `addr`, with the buffers [`set_buffers`] gives it
/// (for a CPU mate: `mate`) and the congestion control `congestion` gives it.
pub(crate) async fn open(
    addr: SocketAddr,
    congestion: &Congestion,
    mate: bool,
) -> std::io::Result<TcpStream> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    set_buffers(&socket2::SockRef::from(&socket), mate)?;
    set_congestion(
        &socket2::SockRef::from(&socket),
        congestion,
        is_local_address(addr.ip()),
    );
    socket.set_nodelay(true)?;
    watch_peer(&socket2::SockRef::from(&socket))?;
    socket.connect(addr).await
}

#[cfg(test)]
mod tests {
    use ccl_rendezvous::net::advertised_ip;
    use tokio::net::TcpListener;

    use super::*;

    fn algorithm(stream: &TcpStream) -> String {
        let name = socket2::SockRef::from(stream)
            .tcp_congestion()
            .expect("TCP_CONGESTION");
        String::from_utf8_lossy(&name)
            .trim_end_matches('\0')
            .to_string()
    }

    /// Connects a socket to a listener on `ip`, both with `congestion`, and
    /// returns the algorithms of the connecting and the accepted end.
    fn pair(ip: IpAddr, congestion: &Congestion) -> (String, String) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async {
            let listener = listen(SocketAddr::new(ip, 0), 4, congestion).expect("listener");
            let listener = TcpListener::from_std(listener).expect("registered");
            let addr = listener.local_addr().expect("address");
            let (client, server) = tokio::join!(open(addr, congestion, false), listener.accept());
            let (client, (server, _)) = (client.expect("connected"), server.expect("accepted"));
            accepted(&server, congestion);
            (algorithm(&client), algorithm(&server))
        })
    }

    #[test]
    fn sockets_within_the_host_avoid_the_systems_pacing_default() {
        let want = within_host_choice();
        let both = (want.clone(), want);
        assert_eq!(pair(Ipv4Addr::LOCALHOST.into(), &Congestion::Auto), both);
        // Over the host's own address too (where it has one besides loopback).
        let own = advertised_ip(None).expect("an address");
        assert_eq!(pair(own, &Congestion::Auto), both, "over {own}");
    }

    #[test]
    fn system_keeps_the_default_and_a_name_is_used_everywhere() {
        let default = system_default();
        let lo = IpAddr::V4(Ipv4Addr::LOCALHOST);
        assert_eq!(pair(lo, &Congestion::System), (default.clone(), default));
        let reno = Congestion::Named("reno".into());
        assert_eq!(pair(lo, &reno), ("reno".into(), "reno".into()));
    }

    #[test]
    fn the_setting_is_read_and_a_refused_name_is_a_clear_error() {
        assert_eq!(Congestion::parse(None).unwrap(), Congestion::Auto);
        assert_eq!(Congestion::parse(Some("auto")).unwrap(), Congestion::Auto);
        assert_eq!(
            Congestion::parse(Some("system")).unwrap(),
            Congestion::System
        );
        assert_eq!(
            Congestion::parse(Some(" reno ")).unwrap(),
            Congestion::Named("reno".into())
        );
        match Congestion::parse(Some("no-such-cc")) {
            Err(Error::Config(msg)) => {
                assert!(msg.contains("CCL_TCP_CONGESTION=no-such-cc"), "{msg}");
                assert!(msg.contains("reno"), "{msg}");
            }
            other => panic!("no-such-cc: {other:?}"),
        }
    }
}
