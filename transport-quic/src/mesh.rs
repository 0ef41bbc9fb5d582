//! Building QUIC links: make a certificate, bind a UDP endpoint and publish
//! `address fingerprint mac` under `quic/{rank}`; then the higher rank of
//! each pair dials the lower with the lower's fingerprint pinned, both sides
//! present certificates, and a small hello on a bidirectional stream names
//! communicator and ranks.

use std::{
    collections::HashMap,
    net::{SocketAddr, UdpSocket},
    sync::{Arc, Mutex, OnceLock},
    time::{Duration, Instant},
};

use ccl_core::{Error, Link, Result, Setup};
use ccl_rendezvous::auth;
use futures::future::try_join_all;
use quinn::{Connection, Endpoint, EndpointConfig, Incoming};
use tokio::sync::{mpsc, Notify};

use crate::{
    identity::{self, Allowed, Fingerprint, Identity, PinnedClients, PinnedServer},
    link::QuicLink,
    transport_config, QuicOptions,
};

const HELLO_MAGIC: [u8; 4] = *b"CCLQ";
const HELLO_VERSION: u32 = 1;
const HELLO_LEN: usize = 24;
const ACK_OK: u8 = 0x06;
const REJECT: u8 = 0x15;
/// How long an incoming connection has for TLS and its hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);
const ALPN: &[u8] = b"ccl/1";
const CONTEXT: &str = "QUIC mesh set-up";
/// Largest UDP payload over IPv4.
const MAX_UDP_PAYLOAD: u16 = 65_527;
/// UDP socket buffer size asked for.
const UDP_BUFFER: usize = 16 * 1024 * 1024;
/// Smallest receive window on loopback (see [`bind_udp`]).
const MIN_RECEIVE_WINDOW: usize = 256 * 1024;
/// Receive window between hosts, and the largest on loopback.
const MAX_RECEIVE_WINDOW: usize = 64 * 1024 * 1024;

/// The runtime every QUIC endpoint and connection of this process runs on: a
/// thread of its own, so that packets (acknowledgements, keep-alives) are
/// handled between calls too, when the communicator's runtime is idle.
pub(crate) fn background() -> &'static tokio::runtime::Handle {
    static RUNTIME: OnceLock<tokio::runtime::Handle> = OnceLock::new();
    RUNTIME.get_or_init(|| {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("building the QUIC runtime");
        let handle = rt.handle().clone();
        std::thread::Builder::new()
            .name("ccl-quic".into())
            .spawn(move || rt.block_on(std::future::pending::<()>()))
            .expect("starting the QUIC thread");
        handle
    })
}

/// quinn's runtime glue, bound to [`background`] wherever it is called.
#[derive(Debug)]
struct Background;

impl quinn::Runtime for Background {
    fn new_timer(&self, i: std::time::Instant) -> std::pin::Pin<Box<dyn quinn::AsyncTimer>> {
        let _in = background().enter();
        quinn::TokioRuntime.new_timer(i)
    }

    fn spawn(&self, future: std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>) {
        background().spawn(future);
    }

    fn wrap_udp_socket(&self, t: UdpSocket) -> std::io::Result<Arc<dyn quinn::AsyncUdpSocket>> {
        let _in = background().enter();
        quinn::TokioRuntime.wrap_udp_socket(t)
    }
}

/// Stops a task when dropped.
pub(crate) struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Hello {
    comm: u64,
    from: u32,
    to: u32,
}

impl Hello {
    fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[0..4].copy_from_slice(&HELLO_MAGIC);
        b[4..8].copy_from_slice(&HELLO_VERSION.to_le_bytes());
        b[8..16].copy_from_slice(&self.comm.to_le_bytes());
        b[16..20].copy_from_slice(&self.from.to_le_bytes());
        b[20..24].copy_from_slice(&self.to.to_le_bytes());
        b
    }

    fn decode(b: &[u8; HELLO_LEN]) -> std::result::Result<Hello, String> {
        if b[0..4] != HELLO_MAGIC {
            return Err(format!(
                "not a ccl QUIC hello (first bytes {:02x?})",
                &b[0..4]
            ));
        }
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        if u32_at(4) != HELLO_VERSION {
            return Err(format!(
                "hello of version {}, expected {HELLO_VERSION}",
                u32_at(4)
            ));
        }
        let mut comm = [0u8; 8];
        comm.copy_from_slice(&b[8..16]);
        Ok(Hello {
            comm: u64::from_le_bytes(comm),
            from: u32_at(16),
            to: u32_at(20),
        })
    }
}

/// The first phase done: endpoint bound and identity published; a task
/// accepts connections (and logs refused ones) on the background runtime.
pub(crate) struct Listening {
    setup: Setup,
    options: QuicOptions,
    identity: Arc<Identity>,
    endpoint: Endpoint,
    allowed: Allowed,
    /// Expected fingerprint per rank, for the accepting task.
    expected: Arc<Mutex<HashMap<usize, Fingerprint>>>,
    /// Fingerprints known: the accepting task may check hellos.
    ready: Arc<Notify>,
    admitted: Option<mpsc::UnboundedReceiver<(usize, Connection)>>,
    acceptor: Arc<AbortOnDrop>,
    started: Instant,
    /// Receive window of every connection (see [`bind_udp`]).
    receive_window: u32,
}

fn config_error(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Internal(format!("QUIC {what}: {e}"))
}

/// Binds, publishes and starts accepting.
pub(crate) fn listen_and_publish(setup: &Setup, options: &QuicOptions) -> Result<Listening> {
    let (rank, world_size) = (setup.rank, setup.world_size);
    if rank >= world_size || world_size > u32::MAX as usize {
        return Err(Error::InvalidArgument(format!(
            "rank {rank} in a world of {world_size} ranks"
        )));
    }
    if setup.secret.is_none() {
        auth::warn_unauthenticated();
    }
    let started = Instant::now();
    let identity = Arc::new(Identity::generate()?);
    let provider = identity::provider();
    let allowed: Allowed = Default::default();
    let tls = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| config_error("TLS versions", e))?
        .with_client_cert_verifier(Arc::new(PinnedClients {
            allowed: allowed.clone(),
            provider: provider.clone(),
        }))
        .with_single_cert(vec![identity.cert.clone()], identity.key())
        .map_err(|e| config_error("server certificate", e))?;
    let mut tls = tls;
    tls.alpn_protocols = vec![ALPN.to_vec()];
    let crypto = quinn::crypto::rustls::QuicServerConfig::try_from(tls)
        .map_err(|e| config_error("server TLS config", e))?;
    let bind = SocketAddr::new(options.local_ip, 0);
    let (socket, receive_window) = bind_udp(bind, rank, options.receive_window)?;
    let mut server = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    server.transport_config(transport_config(options, setup.timeout, receive_window));
    // Accept datagrams up to UDP's limit, so MTU discovery can use them.
    let mut endpoint_config = EndpointConfig::default();
    endpoint_config
        .max_udp_payload_size(MAX_UDP_PAYLOAD)
        .map_err(|e| config_error("UDP payload limit", e))?;
    let endpoint = Endpoint::new(endpoint_config, Some(server), socket, Arc::new(Background))
        .map_err(|e| Error::io("starting the QUIC endpoint", e))?;
    let addr = endpoint
        .local_addr()
        .map_err(|e| Error::io("reading the UDP address", e))?;
    let expected: Arc<Mutex<HashMap<usize, Fingerprint>>> = Default::default();
    let ready = Arc::new(Notify::new());
    let (tx, admitted) = mpsc::unbounded_channel();
    let acceptor = Arc::new(AbortOnDrop(background().spawn(accept_forever(
        endpoint.clone(),
        rank,
        world_size,
        setup.comm,
        expected.clone(),
        ready.clone(),
        tx,
    ))));
    setup.store.set(
        &format!("quic/{rank}"),
        identity::encode_published(
            &addr.to_string(),
            &identity.fingerprint,
            setup.secret.as_ref(),
            setup.comm,
            rank,
        )
        .as_bytes(),
    )?;
    tracing::debug!(rank, %addr, fingerprint = %identity::hex(&identity.fingerprint), "QUIC endpoint listening");
    Ok(Listening {
        setup: setup.clone(),
        options: options.clone(),
        identity,
        endpoint,
        allowed,
        expected,
        ready,
        admitted: Some(admitted),
        acceptor,
        started,
        receive_window,
    })
}

/// Binds the endpoint's UDP socket with large buffers, and returns it with
/// the receive window its connections open: `window` if set; else, on
/// loopback, what the kernel lets the socket hold, and elsewhere
/// [`MAX_RECEIVE_WINDOW`].
///
/// The socket buffer is asked for [`UDP_BUFFER`] (capped by
/// `net.core.rmem_max`/`wmem_max`). A datagram that arrives while the buffer
/// is full is dropped, and the sender reads that as loss: it sends again, and
/// congestion control slows down. On loopback, with a 64 MiB window and
/// `rmem_max` at 4 MiB, a fifth of the packets of a 256 MiB allreduce were
/// lost that way. A peer never has more unread data in flight than the
/// window, so a window no larger than the buffer loses nothing there, and
/// loopback's bandwidth-delay product is tiny. Linux reports twice the size
/// granted (the other half is its bookkeeping), so the size granted is half
/// the size reported. Between hosts the window must cover the path's
/// bandwidth-delay product (5 MB at 1 Gbit/s and 40 ms), which the default
/// `rmem_max` (208 KiB) would cap at a few percent of the line: there the
/// window stays large, and loss to a full buffer is left to congestion
/// control (a larger `rmem_max` avoids it).
fn bind_udp(bind: SocketAddr, rank: usize, window: Option<u32>) -> Result<(UdpSocket, u32)> {
    let socket = UdpSocket::bind(bind).map_err(|e| Error::io(format!("binding UDP {bind}"), e))?;
    let sock = socket2::SockRef::from(&socket);
    let _ = sock.set_recv_buffer_size(UDP_BUFFER);
    let _ = sock.set_send_buffer_size(UDP_BUFFER);
    let granted = sock
        .recv_buffer_size()
        .map_err(|e| Error::io("reading the UDP receive buffer size", e))?
        / 2;
    let window = window.unwrap_or(if bind.ip().is_loopback() {
        granted.clamp(MIN_RECEIVE_WINDOW, MAX_RECEIVE_WINDOW) as u32
    } else {
        MAX_RECEIVE_WINDOW as u32
    });
    tracing::debug!(
        rank,
        recv = granted,
        send = ?sock.send_buffer_size(),
        window,
        "UDP socket buffers and QUIC receive window"
    );
    Ok((socket, window))
}

/// Accepts connections until stopped; once the fingerprints are known, each
/// one that passes TLS (the client verifier pins them) and sends a valid hello
/// from a higher rank with that rank's certificate is handed over; others are
/// refused and logged with their address.
async fn accept_forever(
    endpoint: Endpoint,
    rank: usize,
    world_size: usize,
    comm: u64,
    expected: Arc<Mutex<HashMap<usize, Fingerprint>>>,
    ready: Arc<Notify>,
    admitted: mpsc::UnboundedSender<(usize, Connection)>,
) {
    // Incoming connections wait in quinn's queue until the fingerprints are known.
    ready.notified().await;
    while let Some(incoming) = endpoint.accept().await {
        let (expected, admitted) = (expected.clone(), admitted.clone());
        tokio::spawn(async move {
            let from = incoming.remote_address();
            let r = tokio::time::timeout(
                HELLO_TIMEOUT,
                admit(incoming, rank, world_size, comm, &expected),
            )
            .await;
            match r {
                Ok(Ok((peer, conn))) => {
                    let _ = admitted.send((peer, conn));
                }
                Ok(Err(why)) => {
                    tracing::warn!(rank, "refusing QUIC connection from {from}: {why}")
                }
                Err(_) => tracing::warn!(
                    rank,
                    "refusing QUIC connection from {from}: no handshake within {HELLO_TIMEOUT:?}"
                ),
            }
        });
    }
}

fn peer_fingerprint(conn: &Connection) -> Option<Fingerprint> {
    let certs = conn
        .peer_identity()?
        .downcast::<Vec<rustls::pki_types::CertificateDer<'static>>>()
        .ok()?;
    certs.first().map(|c| identity::fingerprint(c))
}

async fn admit(
    incoming: Incoming,
    rank: usize,
    world_size: usize,
    comm: u64,
    expected: &Mutex<HashMap<usize, Fingerprint>>,
) -> std::result::Result<(usize, Connection), String> {
    let conn = incoming
        .await
        .map_err(|e| format!("TLS handshake failed: {e}"))?;
    let (mut tx, mut rx) = conn
        .accept_bi()
        .await
        .map_err(|e| format!("no hello stream: {e}"))?;
    let mut b = [0u8; HELLO_LEN];
    rx.read_exact(&mut b)
        .await
        .map_err(|e| format!("no hello: {e}"))?;
    let refuse = |why: String| {
        conn.close(quinn::VarInt::from_u32(1), why.as_bytes());
        why
    };
    let hello = Hello::decode(&b).map_err(refuse)?;
    let from = hello.from as usize;
    let why = if hello.comm != comm {
        Some(format!(
            "hello for communicator {:#x}, this is {comm:#x}",
            hello.comm
        ))
    } else if hello.to as usize != rank || from >= world_size || from <= rank {
        Some(format!(
            "hello from rank {} to rank {}: not a peer that dials rank {rank} of {world_size}",
            hello.from, hello.to
        ))
    } else {
        let want = expected
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&from)
            .copied();
        match (want, peer_fingerprint(&conn)) {
            (Some(w), Some(g)) if w == g => None,
            (_, g) => Some(format!(
                "claims rank {from} but presented certificate {} (rank {from} published {})",
                g.map(|g| identity::hex(&g))
                    .unwrap_or_else(|| "none".into()),
                want.map(|w| identity::hex(&w))
                    .unwrap_or_else(|| "nothing".into())
            )),
        }
    };
    if let Some(why) = why {
        let _ = tx.write_all(&[REJECT]).await;
        return Err(refuse(why));
    }
    tx.write_all(&[ACK_OK])
        .await
        .map_err(|e| format!("sending the acknowledgement: {e}"))?;
    // The link exists only once the dialler has the acknowledgement: a link
    // closed (aborted) at once must not leave it waiting for it.
    let _ = tx.finish();
    tx.stopped()
        .await
        .map_err(|e| format!("the acknowledgement was not received: {e}"))?;
    Ok((from, conn))
}

impl Listening {
    fn client_config(&self, expected: Fingerprint) -> Result<quinn::ClientConfig> {
        let provider = identity::provider();
        let mut tls = rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| config_error("TLS versions", e))?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(PinnedServer { expected, provider }))
            .with_client_auth_cert(vec![self.identity.cert.clone()], self.identity.key())
            .map_err(|e| config_error("client certificate", e))?;
        tls.alpn_protocols = vec![ALPN.to_vec()];
        let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(tls)
            .map_err(|e| config_error("client TLS config", e))?;
        let mut config = quinn::ClientConfig::new(Arc::new(crypto));
        config.transport_config(transport_config(
            &self.options,
            self.setup.timeout,
            self.receive_window,
        ));
        Ok(config)
    }

    /// Dials `peer` at `addr` until the deadline, and says hello.
    async fn dial(
        &self,
        peer: usize,
        addr: SocketAddr,
        fp: Fingerprint,
        deadline: Instant,
    ) -> Result<Connection> {
        let config = self.client_config(fp)?;
        let rank = self.setup.rank;
        loop {
            let attempt = async {
                let conn = self
                    .endpoint
                    .connect_with(config.clone(), addr, "ccl")
                    .map_err(|e| e.to_string())?
                    .await
                    .map_err(|e| format!("TLS handshake failed: {e}"))?;
                let (mut tx, mut rx) = conn.open_bi().await.map_err(|e| e.to_string())?;
                let hello = Hello {
                    comm: self.setup.comm,
                    from: rank as u32,
                    to: peer as u32,
                };
                tx.write_all(&hello.encode())
                    .await
                    .map_err(|e| e.to_string())?;
                let mut ack = [0u8; 1];
                rx.read_exact(&mut ack)
                    .await
                    .map_err(|e| format!("no acknowledgement: {e}"))?;
                if ack[0] != ACK_OK {
                    return Err(format!("refused the hello ({:#x})", ack[0]));
                }
                Ok(conn)
            };
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left.min(HELLO_TIMEOUT), attempt).await {
                Ok(Ok(conn)) => return Ok(conn),
                Ok(Err(why)) => {
                    if Instant::now() + Duration::from_millis(100) >= deadline {
                        return Err(Error::Timeout {
                            context: format!("rank {rank}: {CONTEXT}"),
                            what: format!("a QUIC link to rank {peer} at {addr} (last: {why})"),
                            after: self.setup.timeout,
                        });
                    }
                    tracing::debug!(rank, peer, %addr, "QUIC dial failed, retrying: {why}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(_) if Instant::now() < deadline => {}
                Err(_) => {
                    return Err(Error::Timeout {
                        context: format!("rank {rank}: {CONTEXT}"),
                        what: format!("a QUIC link to rank {peer} at {addr}"),
                        after: self.setup.timeout,
                    })
                }
            }
        }
    }

    /// Connects to every rank of `peers`: dials the lower ones, waits for the
    /// higher ones. One link per peer, in order.
    pub(crate) async fn connect(mut self, peers: &[usize]) -> Result<Vec<Arc<dyn Link>>> {
        let (rank, world_size) = (self.setup.rank, self.setup.world_size);
        if let Some(&bad) = peers.iter().find(|&&p| p >= world_size || p == rank) {
            return Err(Error::InvalidArgument(format!(
                "rank {rank} of {world_size} cannot connect to rank {bad}"
            )));
        }
        if peers.is_empty() {
            return Ok(Vec::new());
        }
        let deadline = self
            .started
            .checked_add(self.setup.timeout)
            .unwrap_or_else(|| self.started + Duration::from_secs(1 << 30));
        let store = self.setup.store.clone();
        let keys: Vec<String> = peers.iter().map(|p| format!("quic/{p}")).collect();
        let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        store.wait(
            &key_refs,
            deadline.saturating_duration_since(Instant::now()),
        )?;
        let mut known = HashMap::new();
        for (&p, key) in peers.iter().zip(&keys) {
            let value = store.get(key, deadline.saturating_duration_since(Instant::now()))?;
            let (addr, fp) =
                identity::decode_published(&value, self.setup.secret.as_ref(), self.setup.comm, p)
                    .map_err(|m| {
                        Error::Config(format!("rank {rank}: QUIC identity of rank {p}: {m}"))
                    })?;
            known.insert(p, (addr, fp));
        }
        {
            let mut allowed = self.allowed.write().unwrap_or_else(|e| e.into_inner());
            let mut expected = self.expected.lock().unwrap_or_else(|e| e.into_inner());
            for (&p, &(_, fp)) in known.iter().filter(|(&p, _)| p > rank) {
                allowed.insert(fp);
                expected.insert(p, fp);
            }
        }
        self.ready.notify_one();

        let lower: Vec<usize> = peers.iter().copied().filter(|&p| p < rank).collect();
        let higher: Vec<usize> = peers.iter().copied().filter(|&p| p > rank).collect();
        let mut admitted = self
            .admitted
            .take()
            .ok_or_else(|| Error::Internal("QUIC connect called twice".into()))?;
        let this = &self;
        let dials = try_join_all(lower.iter().map(|&p| {
            let (addr, fp) = known[&p];
            async move { Ok::<_, Error>((p, this.dial(p, addr, fp, deadline).await?)) }
        }));
        let mut conns: HashMap<usize, Connection> = HashMap::new();
        let waits = async {
            let mut got = HashMap::new();
            while higher.iter().any(|p| !got.contains_key(p)) {
                match admitted.recv().await {
                    Some((p, c)) => {
                        if let Some(old) = got.insert(p, c) {
                            old.close(quinn::VarInt::from_u32(1), b"duplicate");
                        }
                    }
                    None => break,
                }
            }
            got
        };
        let left = deadline.saturating_duration_since(Instant::now());
        let both = async { tokio::join!(dials, waits) };
        match tokio::time::timeout(left, both).await {
            Ok((dialled, accepted)) => {
                conns.extend(dialled?);
                conns.extend(accepted);
            }
            Err(_) => {
                return Err(Error::Timeout {
                    context: format!("rank {rank}: {CONTEXT}"),
                    what: format!("QUIC links to ranks {peers:?}"),
                    after: self.setup.timeout,
                })
            }
        }
        let mut links: Vec<Arc<dyn Link>> = Vec::with_capacity(peers.len());
        for &p in peers {
            let conn = conns.remove(&p).ok_or_else(|| Error::Timeout {
                context: format!("rank {rank}: {CONTEXT}"),
                what: format!("rank {p} to dial this rank over QUIC"),
                after: self.setup.timeout,
            })?;
            links.push(Arc::new(QuicLink::new(
                rank,
                p,
                self.setup.comm,
                self.setup.timeout,
                conn,
                self.endpoint.clone(),
                background().clone(),
                self.acceptor.clone(),
            )));
        }
        tracing::debug!(
            rank,
            peers = peers.len(),
            "QUIC links connected in {:?}",
            self.started.elapsed()
        );
        Ok(links)
    }
}
