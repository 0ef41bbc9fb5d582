//! Building TCP links: listen and publish the address, then connect to
//! the lower peers and accept the higher ones.

use std::{
    fmt::Write as _,
    net::SocketAddr,
    sync::{Arc, Mutex, MutexGuard},
    time::{Duration, Instant},
};

use ccl_core::{cpu_mates, Error, JobSecret, Link, PeerInfo, Result, Setup};
use ccl_rendezvous::auth::{self, Acceptor, Answer, AuthError};
use futures::{future::try_join_all, stream::FuturesUnordered, StreamExt};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
    sync::Notify,
};

use crate::{
    link::TcpLink,
    socket::{accepted, listen, local_address, open, send_to_cpu_mate, watch_peer},
    Congestion, TcpOptions,
};

/// How long an accepted connection has to authenticate and send its hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(2);
const HELLO_MAGIC: [u8; 4] = *b"CCLH";
const HELLO_VERSION: u32 = 1;
const HELLO_LEN: usize = 28;
/// Handshake replies: accepted, or why not.
const ACK_OK: u8 = 0x06;
const REJECT_VERSION: u8 = 0x10;
const REJECT_COMM: u8 = 0x11;
const REJECT_RANK: u8 = 0x12;
const REJECT_NSOCKS: u8 = 0x13;
const REJECT_DUPLICATE: u8 = 0x14;
const CONTEXT: &str = "TCP mesh set-up";

/// The first bytes a connecting rank sends on each new socket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Hello {
    version: u32,
    comm: u64,
    from: u32,
    to: u32,
    index: u16,
    nsocks: u16,
}

impl Hello {
    fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[0..4].copy_from_slice(&HELLO_MAGIC);
        b[4..8].copy_from_slice(&self.version.to_le_bytes());
        b[8..16].copy_from_slice(&self.comm.to_le_bytes());
        b[16..20].copy_from_slice(&self.from.to_le_bytes());
        b[20..24].copy_from_slice(&self.to.to_le_bytes());
        b[24..26].copy_from_slice(&self.index.to_le_bytes());
        b[26..28].copy_from_slice(&self.nsocks.to_le_bytes());
        b
    }

    /// Decodes exactly [`HELLO_LEN`] bytes starting with the magic; anything
    /// else is an error (never a panic). Values are checked by the caller.
    fn decode(b: &[u8]) -> std::result::Result<Hello, String> {
        if b.len() != HELLO_LEN {
            return Err(format!(
                "handshake of {} bytes, expected {HELLO_LEN}",
                b.len()
            ));
        }
        if b[0..4] != HELLO_MAGIC {
            return Err(format!(
                "not a ccl handshake (first bytes {:02x?})",
                &b[0..4]
            ));
        }
        let u16_at = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let mut comm = [0u8; 8];
        comm.copy_from_slice(&b[8..16]);
        Ok(Hello {
            version: u32_at(4),
            comm: u64::from_le_bytes(comm),
            from: u32_at(16),
            to: u32_at(20),
            index: u16_at(24),
            nsocks: u16_at(26),
        })
    }
}

/// Decodes a hello from arbitrary bytes (for fuzzing).
#[doc(hidden)]
pub fn fuzz_decode(bytes: &[u8]) -> std::result::Result<(), String> {
    Hello::decode(bytes).map(|_| ())
}

/// Sockets connected so far, per peer and socket index.
struct Progress {
    socks: Vec<Vec<Option<TcpStream>>>,
    /// Why the last connection attempt to a lower rank failed.
    last_error: Vec<Option<String>>,
    /// Connections refused for failing authentication, and the last one's
    /// address and reason (named if the set-up times out).
    refused: usize,
    last_refused: Option<String>,
}

fn lock(p: &Mutex<Progress>) -> MutexGuard<'_, Progress> {
    p.lock().unwrap_or_else(|e| e.into_inner())
}

/// The first phase of a rank's TCP set-up: its listener is open, its
/// address published as `addr/{rank}`, and a task on the runtime accepts
/// and authenticates connections, so that peers (and strangers, who are
/// refused) are served while this rank still waits for the others.
pub(crate) struct Listening {
    setup: Setup,
    shared: Arc<Shared>,
    started: Instant,
    /// The accepting task, stopped when the set-up is over.
    _acceptor: AbortOnDrop,
}

/// Stops a task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Listens on the address `opts` names, publishes it through the
/// communicator's store (a blocking store call) and starts accepting on the
/// current runtime.
pub(crate) fn listen_and_publish(setup: &Setup, opts: &TcpOptions) -> Result<Listening> {
    let (rank, world_size) = (setup.rank, setup.world_size);
    if rank >= world_size || world_size > u32::MAX as usize {
        return Err(Error::InvalidArgument(format!(
            "rank {rank} in a world of {world_size} ranks"
        )));
    }
    if opts.nsocks == 0 || opts.nsocks > u16::MAX as usize {
        return Err(Error::InvalidArgument(format!(
            "{} sockets per peer",
            opts.nsocks
        )));
    }
    if setup.secret.is_none() {
        auth::warn_unauthenticated();
    }
    let started = Instant::now();
    let bind = local_address(opts)?;
    let listener = listen(bind, world_size * opts.nsocks + 16, &opts.congestion)?;
    let addr = listener
        .local_addr()
        .map_err(|e| Error::io("reading the listening address", e))?;
    let listener =
        TcpListener::from_std(listener).map_err(|e| Error::io("registering the listener", e))?;
    let shared = Arc::new(Shared {
        rank,
        world_size,
        comm: setup.comm,
        nsocks: opts.nsocks,
        congestion: opts.congestion.clone(),
        progress: Mutex::new(Progress {
            socks: (0..world_size)
                .map(|_| (0..opts.nsocks).map(|_| None).collect())
                .collect(),
            last_error: vec![None; world_size],
            refused: 0,
            last_refused: None,
        }),
        admitted: Notify::new(),
        secret: setup.secret.clone(),
        context: auth::link_context(setup.comm),
    });
    let acceptor = AbortOnDrop(tokio::spawn(shared.clone().accept_forever(listener)));
    setup
        .store
        .set(&format!("addr/{rank}"), addr.to_string().as_bytes())?;
    tracing::debug!(rank, %addr, "listening");
    Ok(Listening {
        setup: setup.clone(),
        shared,
        started,
        _acceptor: acceptor,
    })
}

impl Listening {
    /// Connects to every rank of `peers` (each of which connects to this
    /// rank in turn): this rank connects to the lower ones and waits for the
    /// higher ones' sockets, `nsocks` each, all within the set-up's timeout
    /// counted from [`listen_and_publish`]. One link per peer, in order.
    /// `everyone` (what each rank published, or nothing) tells which peers
    /// take turns on this rank's CPUs: their sockets get smaller send buffers
    /// (see [`send_to_cpu_mate`]).
    pub(crate) async fn connect(
        self,
        peers: &[usize],
        everyone: &[PeerInfo],
    ) -> Result<Vec<Arc<dyn Link>>> {
        let (setup, shared) = (&self.setup, &*self.shared);
        let (rank, world_size, store) = (setup.rank, setup.world_size, &*setup.store);
        if let Some(&bad) = peers.iter().find(|&&p| p >= world_size || p == rank) {
            return Err(Error::InvalidArgument(format!(
                "rank {rank} of {world_size} cannot connect to rank {bad}"
            )));
        }
        if peers.is_empty() {
            return Ok(Vec::new());
        }
        // A timeout too large to add is as good as none.
        let started = self.started;
        let deadline = started
            .checked_add(setup.timeout)
            .unwrap_or_else(|| started + Duration::from_secs(1 << 30));

        // Learn the addresses of the lower peers, to connect to.
        let lower: Vec<usize> = peers.iter().copied().filter(|&p| p < rank).collect();
        let keys: Vec<String> = lower.iter().map(|p| format!("addr/{p}")).collect();
        let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        match store.wait(
            &key_refs,
            deadline.saturating_duration_since(Instant::now()),
        ) {
            Ok(()) => {}
            Err(Error::Timeout { .. }) => {
                let missing: Vec<usize> = lower
                    .iter()
                    .zip(&keys)
                    .filter(|(_, k)| !matches!(store.try_get(k), Ok(Some(_))))
                    .map(|(p, _)| *p)
                    .collect();
                return Err(Error::Timeout {
                    context: format!("rank {rank}: {CONTEXT}"),
                    what: format!(
                        "ranks {missing:?} to publish their addresses in {}",
                        store.describe()
                    ),
                    after: setup.timeout,
                });
            }
            Err(e) => return Err(e),
        }
        let mut addrs = Vec::with_capacity(lower.len());
        for (&p, key) in lower.iter().zip(&keys) {
            let value = store.get(key, deadline.saturating_duration_since(Instant::now()))?;
            let parsed = std::str::from_utf8(&value)
                .ok()
                .and_then(|s| s.parse::<SocketAddr>().ok());
            addrs.push((
                p,
                parsed.ok_or_else(|| Error::Store {
                    addr: store.describe(),
                    msg: format!(
                        "'{key}' holds {:?}, not a socket address",
                        String::from_utf8_lossy(&value)
                    ),
                })?,
            ));
        }

        // Connect down, and wait for the higher peers, concurrently.
        let mates = cpu_mates(everyone, rank);
        let higher: Vec<usize> = peers.iter().copied().filter(|&p| p > rank).collect();
        let both = async {
            tokio::try_join!(shared.connect_all(&addrs, &mates), async {
                shared.accepted_from(&higher).await;
                Ok(())
            })
        };
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, both).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => return Err(e),
            Err(_) => return Err(shared.timeout_error(peers, &addrs, setup.timeout)),
        }

        let mut progress = lock(&shared.progress);
        let mut links: Vec<Arc<dyn Link>> = Vec::with_capacity(peers.len());
        for &peer in peers {
            let streams: Option<Vec<TcpStream>> =
                progress.socks[peer].iter_mut().map(Option::take).collect();
            let streams = streams.ok_or_else(|| {
                Error::Internal(format!("rank {rank}: socket to rank {peer} missing"))
            })?;
            // The sockets to lower ranks had their buffers set before they
            // connected; those this rank accepted, from higher ones, did not.
            if peer > rank && mates.contains(&peer) {
                for s in &streams {
                    send_to_cpu_mate(&socket2::SockRef::from(s), rank, peer);
                }
            }
            links.push(Arc::new(TcpLink::new(rank, peer, setup.comm, streams)));
        }
        tracing::debug!(
            rank,
            world_size,
            nsocks = shared.nsocks,
            peers = peers.len(),
            "TCP links connected in {:?}",
            started.elapsed()
        );
        Ok(links)
    }
}

/// Connects `setup.rank` to every other rank of its communicator (a full
/// mesh): both phases of the set-up at once. Returns one entry per rank:
/// `None` at index `rank`, a link elsewhere.
pub async fn connect_mesh(setup: &Setup, opts: &TcpOptions) -> Result<Vec<Option<Arc<dyn Link>>>> {
    if setup.world_size == 1 && setup.rank == 0 {
        return Ok(vec![None]);
    }
    let listening = listen_and_publish(setup, opts)?;
    let peers: Vec<usize> = (0..setup.world_size).filter(|&p| p != setup.rank).collect();
    let links = listening.connect(&peers, &[]).await?;
    let mut all: Vec<Option<Arc<dyn Link>>> = vec![None; setup.world_size];
    for (p, link) in peers.into_iter().zip(links) {
        all[p] = Some(link);
    }
    Ok(all)
}

/// What the connect and accept halves of the set-up share.
struct Shared {
    rank: usize,
    world_size: usize,
    comm: u64,
    nsocks: usize,
    /// The congestion control of every socket.
    congestion: Congestion,
    progress: Mutex<Progress>,
    /// Wakes the connect half when a socket was admitted.
    admitted: Notify,
    /// The job secret every socket proves, both ways (`None`: unauthenticated).
    secret: Option<JobSecret>,
    /// What the proofs are bound to: the links of this communicator.
    context: Vec<u8>,
}

/// Why an accepted connection was dropped before its hello was checked.
enum Dropped {
    /// It failed authentication (counted and named on a set-up timeout).
    Unauthenticated(String),
    /// It sent no (complete) handshake.
    NoHandshake(String),
}

/// The acceptor's side of a new socket: challenge, with a secret check the
/// response and prove the secret in turn, then read the hello.
async fn accept_handshake(
    stream: &mut TcpStream,
    secret: Option<&JobSecret>,
    context: &[u8],
) -> std::result::Result<[u8; HELLO_LEN], Dropped> {
    let io = |what: &str, e: std::io::Error| Dropped::NoHandshake(format!("{what} ({e})"));
    let acceptor =
        Acceptor::new(secret, context).map_err(|e| Dropped::NoHandshake(e.to_string()))?;
    stream
        .write_all(&acceptor.challenge())
        .await
        .map_err(|e| io("sending the challenge", e))?;
    if acceptor.expects_response() {
        let unauth = |m: String| Dropped::Unauthenticated(format!("not authenticated: {m}"));
        let mut response = [0u8; auth::RESPONSE_LEN];
        stream
            .read_exact(&mut response[..auth::MAGIC_LEN])
            .await
            .map_err(|e| unauth(format!("no response to the challenge ({e})")))?;
        if response[..auth::MAGIC_LEN] != auth::RESPONSE_MAGIC {
            return Err(unauth(format!(
                "sent {:02x?} instead of a response to the challenge (no CCL_JOB_SECRET, or not ccl)",
                &response[..auth::MAGIC_LEN]
            )));
        }
        stream
            .read_exact(&mut response[auth::MAGIC_LEN..])
            .await
            .map_err(|e| unauth(format!("truncated response ({e})")))?;
        match acceptor.check(&response) {
            Ok(proof) => stream
                .write_all(&proof)
                .await
                .map_err(|e| io("sending the proof", e))?,
            Err((e, refusal)) => {
                if let Some(refusal) = refusal {
                    let _ = stream.write_all(&refusal).await;
                }
                return Err(unauth(e.to_string()));
            }
        }
    }
    let mut hello = [0u8; HELLO_LEN];
    stream
        .read_exact(&mut hello)
        .await
        .map_err(|e| io("no handshake", e))?;
    Ok(hello)
}

impl Shared {
    /// Accepts connections until stopped: sockets with a valid hello from a
    /// higher rank are kept for [`Listening::connect`]; the rest are dropped
    /// (with a warning). Each hello is awaited concurrently, so a silent
    /// stranger stalls nothing.
    async fn accept_forever(self: Arc<Self>, listener: TcpListener) {
        let mut hellos = FuturesUnordered::new();
        loop {
            tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok((stream, from)) => {
                        let (secret, context) = (self.secret.as_ref(), &self.context[..]);
                        hellos.push(async move {
                            let mut stream = stream;
                            let r = tokio::time::timeout(
                                HELLO_TIMEOUT,
                                accept_handshake(&mut stream, secret, context),
                            )
                            .await;
                            (stream, from, r)
                        })
                    }
                    Err(e) => {
                        tracing::warn!(rank = self.rank, "accepting a connection failed: {e}");
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                },
                Some((stream, from, read)) = hellos.next(), if !hellos.is_empty() => {
                    let bytes = match read {
                        Ok(Ok(b)) => b,
                        Ok(Err(Dropped::Unauthenticated(why))) => {
                            tracing::warn!(rank = self.rank, "dropping connection from {from}: {why}");
                            let mut p = lock(&self.progress);
                            p.refused += 1;
                            p.last_refused = Some(format!("{from}: {why}"));
                            continue;
                        }
                        Ok(Err(Dropped::NoHandshake(why))) => {
                            tracing::warn!(rank = self.rank, "dropping connection from {from}: {why}");
                            continue;
                        }
                        Err(_) => {
                            tracing::warn!(rank = self.rank, "dropping connection from {from}: no handshake within {HELLO_TIMEOUT:?}");
                            continue;
                        }
                    };
                    if self.admit(stream, from, &bytes) {
                        self.admitted.notify_waiters();
                    }
                }
            }
        }
    }

    /// Resolves once every socket of every rank of `higher` was admitted.
    async fn accepted_from(&self, higher: &[usize]) {
        loop {
            let mut notified = std::pin::pin!(self.admitted.notified());
            notified.as_mut().enable();
            let all = {
                let p = lock(&self.progress);
                higher
                    .iter()
                    .all(|&r| p.socks[r].iter().all(Option::is_some))
            };
            if all {
                return;
            }
            notified.await;
        }
    }

    /// Checks a hello; replies and keeps the socket if it is wanted.
    fn admit(&self, stream: TcpStream, from: SocketAddr, bytes: &[u8; HELLO_LEN]) -> bool {
        let h = match Hello::decode(bytes) {
            Ok(h) => h,
            Err(why) => {
                tracing::warn!(rank = self.rank, "dropping connection from {from}: {why}");
                return false;
            }
        };
        let me = self.rank;
        let reject = |code: u8, why: String| {
            tracing::warn!(rank = me, "dropping connection from {from}: {why}");
            let _ = stream.try_write(&[code]);
            false
        };
        if h.version != HELLO_VERSION {
            return reject(
                REJECT_VERSION,
                format!(
                    "handshake version {} (this rank speaks {HELLO_VERSION})",
                    h.version
                ),
            );
        }
        if h.comm != self.comm {
            return reject(
                REJECT_COMM,
                format!("communicator {:#x}, not {:#x}", h.comm, self.comm),
            );
        }
        let from_rank = h.from as usize;
        if h.to as usize != me || from_rank <= me || from_rank >= self.world_size {
            return reject(
                REJECT_RANK,
                format!(
                    "rank {} connecting to rank {} (this is rank {me} of {})",
                    h.from, h.to, self.world_size
                ),
            );
        }
        if h.nsocks as usize != self.nsocks || h.index >= h.nsocks {
            return reject(
                REJECT_NSOCKS,
                format!(
                    "rank {from_rank} uses {} sockets per peer (socket {}), this rank {}",
                    h.nsocks, h.index, self.nsocks
                ),
            );
        }
        let mut progress = lock(&self.progress);
        let slot = &mut progress.socks[from_rank][h.index as usize];
        if slot.is_some() {
            drop(progress);
            return reject(
                REJECT_DUPLICATE,
                format!("second socket {} from rank {from_rank}", h.index),
            );
        }
        // A fresh socket's send buffer is empty: this one-byte write completes at once.
        match stream.try_write(&[ACK_OK]) {
            Ok(1) => {}
            r => {
                tracing::warn!(rank = me, "dropping connection from {from} (rank {from_rank}): acknowledging failed: {r:?}");
                return false;
            }
        }
        if let Err(e) = stream.set_nodelay(true) {
            tracing::debug!(
                rank = me,
                "TCP_NODELAY on socket from rank {from_rank}: {e}"
            );
        }
        if let Err(e) = watch_peer(&socket2::SockRef::from(&stream)) {
            tracing::debug!(rank = me, "keepalive on socket from rank {from_rank}: {e}");
        }
        accepted(&stream, &self.congestion);
        tracing::trace!(rank = me, peer = from_rank, index = h.index, "accepted");
        *slot = Some(stream);
        true
    }

    /// Opens `nsocks` sockets to each of the wanted lower ranks, at `addrs`;
    /// those to `mates` ([`cpu_mates`]) with the send buffer for a CPU mate.
    async fn connect_all(&self, addrs: &[(usize, SocketAddr)], mates: &[usize]) -> Result<()> {
        let attempts = addrs
            .iter()
            .flat_map(|&(p, addr)| (0..self.nsocks).map(move |i| (p, addr, i)))
            .map(|(p, addr, i)| self.connect_one(p, addr, i, mates.contains(&p)));
        try_join_all(attempts).await?;
        Ok(())
    }

    async fn connect_one(
        &self,
        peer: usize,
        addr: SocketAddr,
        index: usize,
        mate: bool,
    ) -> Result<()> {
        let mut backoff = Duration::from_millis(5);
        let mut stream = loop {
            match open(addr, &self.congestion, mate).await {
                Ok(s) => break s,
                Err(e) => {
                    tracing::debug!(
                        rank = self.rank,
                        peer,
                        "connecting to {addr}: {e}; retrying"
                    );
                    lock(&self.progress).last_error[peer] =
                        Some(format!("connecting to {addr}: {e}"));
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_millis(500));
                }
            }
        };
        let hello = Hello {
            version: HELLO_VERSION,
            comm: self.comm,
            from: self.rank as u32,
            to: peer as u32,
            index: index as u16,
            nsocks: self.nsocks as u16,
        };
        let fail = |msg: String| Error::Protocol {
            rank: self.rank,
            peer,
            call: CONTEXT.into(),
            msg,
        };
        self.authenticate(&mut stream, peer, addr).await?;
        let mut ack = [0u8; 1];
        let exchanged = async {
            stream.write_all(&hello.encode()).await?;
            stream.read_exact(&mut ack).await
        }
        .await;
        if let Err(e) = exchanged {
            return Err(fail(format!(
                "handshake with {addr} failed ({e}): is that rank still there, in this job?"
            )));
        }
        let config = |what: &str| {
            Error::Config(format!(
                "rank {} at {addr} refused rank {} ({what})",
                peer, self.rank
            ))
        };
        match ack[0] {
            ACK_OK => {}
            REJECT_VERSION => return Err(config("another version of ccl")),
            REJECT_COMM => {
                return Err(config(
                    "another communicator: a stale address in the store?",
                ))
            }
            REJECT_NSOCKS => {
                return Err(config(&format!(
                "different number of sockets per peer; this rank uses {} (CCL_NSOCKS must agree)",
                self.nsocks
            )))
            }
            REJECT_RANK => {
                return Err(config(
                    "it is not that rank of this job: a stale address in the store?",
                ))
            }
            REJECT_DUPLICATE => return Err(fail(format!("socket {index} refused as a duplicate"))),
            other => return Err(fail(format!("unexpected handshake reply {other:#04x}"))),
        }
        tracing::trace!(rank = self.rank, peer, index, "connected");
        lock(&self.progress).socks[peer][index] = Some(stream);
        Ok(())
    }

    /// The connector's side of the authentication on a new socket to `peer`.
    async fn authenticate(
        &self,
        stream: &mut TcpStream,
        peer: usize,
        addr: SocketAddr,
    ) -> Result<()> {
        let fail = |msg: String| Error::Protocol {
            rank: self.rank,
            peer,
            call: CONTEXT.into(),
            msg,
        };
        let refused = |e: AuthError| {
            Error::Config(format!(
                "rank {}: authenticating with rank {peer} at {addr} failed: {e}",
                self.rank
            ))
        };
        let mut challenge = [0u8; auth::CHALLENGE_LEN];
        stream.read_exact(&mut challenge).await.map_err(|e| {
            fail(format!(
                "no authentication challenge from {addr} ({e}): is that rank still there, in this job?"
            ))
        })?;
        match auth::answer(self.secret.as_ref(), &self.context, &challenge) {
            Ok(Answer::Open) => Ok(()),
            Ok(Answer::Respond { response, pending }) => {
                let mut proof = [0u8; auth::PROOF_LEN];
                let exchanged = async {
                    stream.write_all(&response).await?;
                    stream.read_exact(&mut proof).await
                }
                .await;
                if let Err(e) = exchanged {
                    return Err(refused_io(self.rank, peer, addr, e));
                }
                pending.verify(&proof).map_err(refused)
            }
            Err(e @ AuthError::NotCcl(_)) => Err(fail(format!("{addr}: {e}"))),
            Err(e) => Err(refused(e)),
        }
    }

    /// The set-up deadline passed: name the ranks of `peers` that are not connected.
    fn timeout_error(
        &self,
        peers: &[usize],
        addrs: &[(usize, SocketAddr)],
        after: Duration,
    ) -> Error {
        let progress = lock(&self.progress);
        let mut missing = Vec::new();
        let mut detail = String::new();
        for &peer in peers {
            let socks = &progress.socks[peer];
            let absent = socks.iter().filter(|s| s.is_none()).count();
            if absent == 0 {
                continue;
            }
            missing.push(peer);
            let addr = addrs.iter().find(|(p, _)| *p == peer).map(|(_, a)| a);
            let _ = match (addr, &progress.last_error[peer]) {
                (Some(addr), Some(err)) => write!(detail, "; rank {peer} at {addr}: {err}"),
                (Some(addr), None) => write!(detail, "; rank {peer} at {addr} did not answer"),
                (None, _) => write!(
                    detail,
                    "; rank {peer}: {absent} of {} sockets did not connect",
                    self.nsocks
                ),
            };
        }
        if progress.refused > 0 {
            let _ = write!(
                detail,
                "; refused {} connection(s) that failed authentication, the last from {} \
                 (do all ranks have the same CCL_JOB_SECRET?)",
                progress.refused,
                progress.last_refused.as_deref().unwrap_or("?")
            );
        }
        Error::Timeout {
            context: format!("rank {}: {CONTEXT}", self.rank),
            what: format!("TCP connections with ranks {missing:?}{detail}"),
            after,
        }
    }
}

/// The acceptor closed the socket during authentication: it refused this
/// rank's proof without saying so, or is gone.
fn refused_io(rank: usize, peer: usize, addr: SocketAddr, e: std::io::Error) -> Error {
    Error::Config(format!(
        "rank {rank}: rank {peer} at {addr} closed the connection during authentication ({e}): \
         does it use another CCL_JOB_SECRET?"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hello_round_trip_and_garbage() {
        let h = Hello {
            version: HELLO_VERSION,
            comm: 0xdead_beef_0123,
            from: 3,
            to: 1,
            index: 2,
            nsocks: 4,
        };
        assert_eq!(Hello::decode(&h.encode()), Ok(h));
        assert!(Hello::decode(&[0xff; HELLO_LEN]).is_err());
        assert!(Hello::decode(&h.encode()[..10]).is_err());
        assert!(fuzz_decode(&[]).is_err());
    }
}
