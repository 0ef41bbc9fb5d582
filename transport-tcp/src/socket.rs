//! The sockets of TCP links: which address to listen on, large buffers,
//! keepalive and user timeouts so that a vanished peer is noticed, and
//! listening and connecting with them.

use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr},
    sync::OnceLock,
    time::Duration,
};

use ccl_core::{Error, Result};
use ccl_rendezvous::net::interface_address;
use socket2::{Domain, Protocol, Socket, Type};
use tokio::net::{TcpSocket, TcpStream};

use crate::TcpOptions;

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

/// Large send and receive buffers (set before connect or listen, so that the
/// window scale covers them).
fn set_buffers(s: &socket2::SockRef<'_>) -> std::io::Result<()> {
    if !large_buffers_granted() {
        return Ok(());
    }
    s.set_send_buffer_size(SOCKET_BUFFER)?;
    s.set_recv_buffer_size(SOCKET_BUFFER)
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

/// A non-blocking listener on `addr` (port 0: any), sockets it accepts
/// inheriting large buffers.
pub(crate) fn listen(addr: SocketAddr, backlog: usize) -> Result<std::net::TcpListener> {
    let ctx = |e| Error::io(format!("listening on {addr}"), e);
    let socket =
        Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP)).map_err(ctx)?;
    if addr.is_ipv6() {
        socket.set_only_v6(true).map_err(ctx)?;
    }
    set_buffers(&(&socket).into()).map_err(ctx)?;
    socket.set_nodelay(true).map_err(ctx)?;
    socket.bind(&addr.into()).map_err(ctx)?;
    socket
        .listen(backlog.min(i32::MAX as usize) as i32)
        .map_err(ctx)?;
    socket.set_nonblocking(true).map_err(ctx)?;
    Ok(socket.into())
}

/// A socket with large buffers connected to `addr`.
pub(crate) async fn open(addr: SocketAddr) -> std::io::Result<TcpStream> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    set_buffers(&socket2::SockRef::from(&socket))?;
    socket.set_nodelay(true)?;
    watch_peer(&socket2::SockRef::from(&socket))?;
    socket.connect(addr).await
}
