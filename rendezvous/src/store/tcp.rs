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
//! | 5 compare-set | key, `u8` has-expected, [expected], desired | ok value |
//! | 6 delete | key | ok `u8` existed |

use std::{
    collections::HashMap,
    fmt,
    io::{self, BufReader, Read, Write},
    net::{
        IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs,
    },
    os::fd::AsRawFd,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Condvar, Mutex, MutexGuard,
    },
    thread::{self, JoinHandle},
    time::{Duration, Instant},
};

use super::{hash::parse_counter, Store};
use crate::auth::{self, Acceptor, Answer};
use ccl_core::{Error, JobSecret, Result};

/// First four bytes each side sends.
const MAGIC: [u8; 4] = *b"CCLs";
/// Protocol version, sent after [`MAGIC`].
const VERSION: u32 = 1;

/// Longest key, in bytes.
const MAX_KEY: usize = 64 << 10;
/// Longest value, in bytes.
const MAX_VALUE: usize = 64 << 20;
/// Most keys in one `wait`.
const MAX_KEYS: usize = 65536;
/// Most key bytes in one `wait`, all keys together.
const MAX_WAIT_BYTES: usize = 64 << 20;
/// Longest wait the server honours; longer ones are cut to this.
const MAX_WAIT: Duration = Duration::from_secs(365 * 24 * 3600);

/// How long the server gives a new connection to authenticate and greet it.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the server blocks writing a reply to a client that does not read.
const SERVER_WRITE_TIMEOUT: Duration = Duration::from_secs(60);
/// Extra time a client gives the server to answer a `wait` after its deadline.
const WAIT_MARGIN: Duration = Duration::from_secs(10);
/// Shortest read/write timeout of client requests.
const MIN_OP_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest single TCP connect attempt (they are retried until the deadline).
const CONNECT_ATTEMPT: Duration = Duration::from_secs(5);
/// Shortest time a connect attempt and its greeting are given.
const MIN_ATTEMPT: Duration = Duration::from_millis(100);
/// Longest pause between connect attempts.
const MAX_BACKOFF: Duration = Duration::from_millis(200);
/// Stack of a server connection thread.
const CONN_STACK: usize = 256 << 10;

mod op {
    pub const SET: u8 = 1;
    pub const GET: u8 = 2;
    pub const WAIT: u8 = 3;
    pub const ADD: u8 = 4;
    pub const COMPARE_SET: u8 = 5;
    pub const DELETE: u8 = 6;
}

mod status {
    pub const OK: u8 = 0;
    pub const NOT_FOUND: u8 = 1;
    pub const TIMEOUT: u8 = 2;
    pub const INVALID: u8 = 3;
}

// ---------------------------------------------------------------------------
// Wire encoding, shared by server and client.

/// What reading the other side's bytes can fail with.
#[derive(Debug)]
enum WireError {
    Io(io::Error),
    /// Bytes that do not follow the protocol.
    Malformed(String),
    /// The server is shutting down (server side only).
    Stopped,
}

impl From<io::Error> for WireError {
    fn from(e: io::Error) -> WireError {
        WireError::Io(e)
    }
}

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WireError::Io(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
                f.write_str("connection closed mid-message")
            }
            WireError::Io(e) => write!(f, "{e}"),
            WireError::Malformed(m) => f.write_str(m),
            WireError::Stopped => f.write_str("server stopped"),
        }
    }
}

type Wire<T> = std::result::Result<T, WireError>;

fn greeting() -> [u8; 8] {
    let mut g = [0; 8];
    g[..4].copy_from_slice(&MAGIC);
    g[4..].copy_from_slice(&VERSION.to_be_bytes());
    g
}

fn read_array<const N: usize>(r: &mut impl Read) -> Wire<[u8; N]> {
    let mut b = [0; N];
    r.read_exact(&mut b)?;
    Ok(b)
}

fn read_u8(r: &mut impl Read) -> Wire<u8> {
    Ok(read_array::<1>(r)?[0])
}

fn read_u32(r: &mut impl Read) -> Wire<u32> {
    Ok(u32::from_be_bytes(read_array(r)?))
}

fn read_u64(r: &mut impl Read) -> Wire<u64> {
    Ok(u64::from_be_bytes(read_array(r)?))
}

/// A length-prefixed byte string of at most `max` bytes. Memory grows only
/// as bytes arrive, so a lying length cannot make us allocate it up front.
fn read_bytes(r: &mut impl Read, max: usize, what: &str) -> Wire<Vec<u8>> {
    let len = read_u32(r)? as usize;
    if len > max {
        return Err(WireError::Malformed(format!(
            "{what} length {len} exceeds the limit of {max} bytes"
        )));
    }
    let mut v = Vec::with_capacity(len.min(64 << 10));
    r.take(len as u64).read_to_end(&mut v)?;
    if v.len() != len {
        return Err(WireError::Io(io::ErrorKind::UnexpectedEof.into()));
    }
    Ok(v)
}

fn read_key(r: &mut impl Read) -> Wire<String> {
    String::from_utf8(read_bytes(r, MAX_KEY, "key")?)
        .map_err(|_| WireError::Malformed("key is not UTF-8".into()))
}

/// `n` keys, bounded in number and total size.
fn read_keys(r: &mut impl Read) -> Wire<Vec<String>> {
    let n = read_u32(r)? as usize;
    if n > MAX_KEYS {
        return Err(WireError::Malformed(format!(
            "{n} keys exceed the limit of {MAX_KEYS}"
        )));
    }
    let mut keys = Vec::with_capacity(n.min(1024));
    let mut total = 0;
    for _ in 0..n {
        let k = read_key(r)?;
        total += k.len();
        if total > MAX_WAIT_BYTES {
            return Err(WireError::Malformed(format!(
                "keys exceed the limit of {MAX_WAIT_BYTES} bytes"
            )));
        }
        keys.push(k);
    }
    Ok(keys)
}

fn put_u32(buf: &mut Vec<u8>, v: u32) {
    buf.extend_from_slice(&v.to_be_bytes());
}

/// Callers keep `b` within the limits, all far below `u32::MAX`.
fn put_bytes(buf: &mut Vec<u8>, b: &[u8]) {
    put_u32(buf, b.len() as u32);
    buf.extend_from_slice(b);
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// `[v6]` for IPv6 literals, for `host:port` strings.
fn bracketed(host: &str) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]")
    } else {
        host.to_string()
    }
}

fn unbracketed(host: &str) -> &str {
    host.strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host)
}

/// Where to connect to reach a server bound to `addr` from this machine.
fn loopback_of(addr: SocketAddr) -> SocketAddr {
    match addr.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => (Ipv4Addr::LOCALHOST, addr.port()).into(),
        IpAddr::V6(ip) if ip.is_unspecified() => (Ipv6Addr::LOCALHOST, addr.port()).into(),
        _ => addr,
    }
}

// ---------------------------------------------------------------------------
// Server.

/// A request as decoded by the server.
enum Request {
    Set(String, Vec<u8>),
    Get(String),
    Wait(Vec<String>, Duration),
    Add(String, i64),
    CompareSet(String, Option<Vec<u8>>, Vec<u8>),
    Delete(String),
}

/// The next request, or `None` when the client closed the connection
/// between requests.
fn read_request(r: &mut impl Read) -> Wire<Option<Request>> {
    let mut op = [0u8; 1];
    loop {
        match r.read(&mut op) {
            Ok(0) => return Ok(None),
            Ok(_) => break,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Ok(Some(match op[0] {
        op::SET => Request::Set(read_key(r)?, read_bytes(r, MAX_VALUE, "value")?),
        op::GET => Request::Get(read_key(r)?),
        op::WAIT => {
            let timeout = Duration::from_nanos(read_u64(r)?);
            Request::Wait(read_keys(r)?, timeout)
        }
        op::ADD => Request::Add(read_key(r)?, read_u64(r)? as i64),
        op::COMPARE_SET => {
            let key = read_key(r)?;
            let expected = match read_u8(r)? {
                0 => None,
                1 => Some(read_bytes(r, MAX_VALUE, "expected value")?),
                f => {
                    return Err(WireError::Malformed(format!(
                        "compare-set flag {f} is neither 0 nor 1"
                    )))
                }
            };
            Request::CompareSet(key, expected, read_bytes(r, MAX_VALUE, "value")?)
        }
        op::DELETE => Request::Delete(read_key(r)?),
        other => {
            return Err(WireError::Malformed(format!(
                "unknown request op {other:#04x}"
            )))
        }
    }))
}

/// A served connection: a clone of its socket to shut it down, and its thread.
struct ConnEntry {
    stream: TcpStream,
    thread: Option<JoinHandle<()>>,
}

/// What the server's threads share.
struct Shared {
    map: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
    /// Set (under `map`'s lock) when the server is dropped.
    stop: AtomicBool,
    conns: Mutex<HashMap<u64, ConnEntry>>,
    local: SocketAddr,
    /// The job secret clients must prove (`None`: unauthenticated).
    secret: Option<JobSecret>,
}

impl Shared {
    fn stopping(&self) -> bool {
        self.stop.load(Ordering::SeqCst)
    }

    /// Carries out `req`, appending the reply to `out`.
    fn handle(&self, req: Request, out: &mut Vec<u8>) -> Wire<()> {
        match req {
            Request::Set(key, value) => {
                lock(&self.map).insert(key, value);
                self.changed.notify_all();
                out.push(status::OK);
            }
            Request::Get(key) => match lock(&self.map).get(&key) {
                Some(v) => {
                    out.push(status::OK);
                    put_bytes(out, v);
                }
                None => out.push(status::NOT_FOUND),
            },
            Request::Wait(keys, timeout) => {
                let now = Instant::now();
                let deadline = now.checked_add(timeout.min(MAX_WAIT)).unwrap_or(now);
                let mut map = lock(&self.map);
                loop {
                    if self.stopping() {
                        return Err(WireError::Stopped);
                    }
                    let missing: Vec<&String> = keys
                        .iter()
                        .filter(|k| !map.contains_key(k.as_str()))
                        .collect();
                    if missing.is_empty() {
                        out.push(status::OK);
                        break;
                    }
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        out.push(status::TIMEOUT);
                        put_u32(out, missing.len() as u32);
                        for k in missing {
                            put_bytes(out, k.as_bytes());
                        }
                        break;
                    }
                    map = self
                        .changed
                        .wait_timeout(map, left)
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                }
            }
            Request::Add(key, delta) => {
                let mut map = lock(&self.map);
                let current = match map.get(&key) {
                    Some(v) => parse_counter(&key, v),
                    None => Ok(0),
                };
                match current {
                    Ok(c) => {
                        let now = c.wrapping_add(delta);
                        map.insert(key, now.to_string().into_bytes());
                        drop(map);
                        self.changed.notify_all();
                        out.push(status::OK);
                        out.extend_from_slice(&now.to_be_bytes());
                    }
                    Err(e) => {
                        let msg = match e {
                            Error::InvalidArgument(m) => m,
                            other => other.to_string(),
                        };
                        out.push(status::INVALID);
                        put_bytes(out, msg.as_bytes());
                    }
                }
            }
            Request::CompareSet(key, expected, desired) => {
                let mut map = lock(&self.map);
                out.push(status::OK);
                if map.get(&key).map(Vec::as_slice) == expected.as_deref() {
                    put_bytes(out, &desired);
                    map.insert(key, desired);
                    drop(map);
                    self.changed.notify_all();
                } else {
                    put_bytes(out, map.get(&key).map(Vec::as_slice).unwrap_or_default());
                }
            }
            Request::Delete(key) => {
                let existed = lock(&self.map).remove(&key).is_some();
                out.push(status::OK);
                out.push(existed as u8);
            }
        }
        Ok(())
    }
}

/// Serves a TCP store until dropped.
///
/// Dropping it stops accepting, closes every connection (clients see an
/// error, including those blocked in `wait`) and joins its threads.
pub struct TcpStoreServer {
    shared: Arc<Shared>,
    /// A handle on the listening socket, to wake the accept thread.
    listener: TcpListener,
    accept: Option<JoinHandle<()>>,
}

impl fmt::Debug for TcpStoreServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TcpStoreServer")
            .field("local_addr", &self.shared.local)
            .finish()
    }
}

/// A listening socket on `addr`; an unspecified IPv6 address is dual-stack.
fn listen_on(addr: SocketAddr) -> io::Result<TcpListener> {
    let SocketAddr::V6(v6) = addr else {
        return TcpListener::bind(addr);
    };
    use nix::sys::socket::{
        bind, listen, setsockopt, socket, sockopt, AddressFamily, Backlog, SockFlag, SockType,
        SockaddrIn6,
    };
    #[cfg(any(target_os = "linux", target_os = "android", target_os = "freebsd"))]
    let flags = SockFlag::SOCK_CLOEXEC;
    #[cfg(not(any(target_os = "linux", target_os = "android", target_os = "freebsd")))]
    let flags = SockFlag::empty();
    let fd = socket(AddressFamily::Inet6, SockType::Stream, flags, None)?;
    #[cfg(not(any(target_os = "linux", target_os = "android", target_os = "freebsd")))]
    nix::fcntl::fcntl(
        fd.as_raw_fd(),
        nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC),
    )?;
    setsockopt(&fd, sockopt::ReuseAddr, &true)?;
    if v6.ip().is_unspecified() {
        setsockopt(&fd, sockopt::Ipv6V6Only, &false)?;
    }
    bind(fd.as_raw_fd(), &SockaddrIn6::from(v6))?;
    listen(&fd, Backlog::MAXCONN)?;
    Ok(TcpListener::from(fd))
}

impl TcpStoreServer {
    /// Binds `addr` (e.g. `0.0.0.0:29500`, `[::]:0`, `127.0.0.1:0`) and serves
    /// in background threads until dropped. `[::]` also accepts IPv4.
    /// Unauthenticated: any client that speaks the protocol is served.
    pub fn bind(addr: SocketAddr) -> Result<TcpStoreServer> {
        TcpStoreServer::bind_with_secret(addr, None)
    }

    /// [`TcpStoreServer::bind`], serving only clients that prove `secret`
    /// (and proving it to them); `None` serves anyone.
    pub fn bind_with_secret(
        addr: SocketAddr,
        secret: Option<&JobSecret>,
    ) -> Result<TcpStoreServer> {
        if secret.is_none() {
            auth::warn_unauthenticated();
        }
        let listener =
            listen_on(addr).map_err(|e| Error::io(format!("store server: binding {addr}"), e))?;
        let local = listener
            .local_addr()
            .map_err(|e| Error::io(format!("store server: address of {addr}"), e))?;
        let accepting = listener
            .try_clone()
            .map_err(|e| Error::io(format!("store server {local}"), e))?;
        let shared = Arc::new(Shared {
            map: Mutex::default(),
            changed: Condvar::new(),
            stop: AtomicBool::new(false),
            conns: Mutex::default(),
            local,
            secret: secret.cloned(),
        });
        let sh = shared.clone();
        let accept = thread::Builder::new()
            .name("ccl-store-accept".into())
            .spawn(move || accept_loop(accepting, sh))
            .map_err(|e| Error::io(format!("store server {local}: starting its thread"), e))?;
        tracing::debug!("store server listening on {local}");
        Ok(TcpStoreServer {
            shared,
            listener,
            accept: Some(accept),
        })
    }

    /// The address the server listens on (with the port picked, for port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.shared.local
    }
}

impl Drop for TcpStoreServer {
    fn drop(&mut self) {
        {
            let _map = lock(&self.shared.map);
            self.shared.stop.store(true, Ordering::SeqCst);
            self.shared.changed.notify_all();
        }
        // Shutting a listening socket down wakes a blocked accept on Linux;
        // connecting to ourselves does elsewhere (and is refused after it).
        let _ =
            nix::sys::socket::shutdown(self.listener.as_raw_fd(), nix::sys::socket::Shutdown::Both);
        let _ =
            TcpStream::connect_timeout(&loopback_of(self.shared.local), Duration::from_millis(200));
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
        // The accept thread is gone, so no connection registers after this.
        let conns = std::mem::take(&mut *lock(&self.shared.conns));
        for c in conns.values() {
            let _ = c.stream.shutdown(Shutdown::Both);
        }
        for (_, c) in conns {
            if let Some(t) = c.thread {
                let _ = t.join();
            }
        }
        tracing::debug!("store server on {} stopped", self.shared.local);
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    let mut next_id = 0u64;
    loop {
        let accepted = listener.accept();
        if shared.stopping() {
            return;
        }
        match accepted {
            Ok((stream, peer)) => {
                next_id += 1;
                spawn_conn(&shared, stream, peer, next_id);
            }
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::Interrupted
                        | io::ErrorKind::ConnectionAborted
                        | io::ErrorKind::ConnectionReset
                ) => {}
            Err(e) => {
                // Out of descriptors, typically: let connections close.
                tracing::warn!("store server {}: accept failed: {e}", shared.local);
                thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

fn spawn_conn(shared: &Arc<Shared>, stream: TcpStream, peer: SocketAddr, id: u64) {
    let local = shared.local;
    let handle = match stream.try_clone() {
        Ok(h) => h,
        Err(e) => {
            tracing::warn!("store server {local}: dropping connection from {peer}: {e}");
            return;
        }
    };
    lock(&shared.conns).insert(
        id,
        ConnEntry {
            stream: handle,
            thread: None,
        },
    );
    let sh = shared.clone();
    let spawned = thread::Builder::new()
        .name("ccl-store-conn".into())
        .stack_size(CONN_STACK)
        .spawn(move || {
            serve_conn(&sh, stream, peer);
            lock(&sh.conns).remove(&id);
        });
    match spawned {
        Ok(t) => {
            if let Some(e) = lock(&shared.conns).get_mut(&id) {
                e.thread = Some(t);
            }
        }
        Err(e) => {
            tracing::warn!(
                "store server {local}: dropping connection from {peer}: no thread for it: {e}"
            );
            lock(&shared.conns).remove(&id);
        }
    }
}

fn serve_conn(shared: &Shared, stream: TcpStream, peer: SocketAddr) {
    let local = shared.local;
    match serve_requests(shared, stream) {
        Ok(()) => tracing::debug!("store server {local}: {peer} disconnected"),
        Err(_) if shared.stopping() => {}
        Err(e) => tracing::warn!("store server {local}: dropping connection from {peer}: {e}"),
    }
}

fn send(r: &BufReader<TcpStream>, bytes: &[u8]) -> io::Result<()> {
    let mut s: &TcpStream = r.get_ref();
    s.write_all(bytes)
}

/// The server's side of the authentication: challenge, and with a secret,
/// check the client's response and prove the secret in turn.
fn authenticate_client(shared: &Shared, r: &mut BufReader<TcpStream>) -> Wire<()> {
    let acceptor = Acceptor::new(shared.secret.as_ref(), auth::STORE_CONTEXT)
        .map_err(|e| WireError::Malformed(e.to_string()))?;
    send(r, &acceptor.challenge())?;
    if !acceptor.expects_response() {
        return Ok(());
    }
    let unauthenticated = |why: String| WireError::Malformed(format!("not authenticated: {why}"));
    let head: [u8; auth::MAGIC_LEN] = read_array(r).map_err(|e| match e {
        WireError::Io(e) => unauthenticated(format!("no response to the challenge ({e})")),
        e => e,
    })?;
    if head != auth::RESPONSE_MAGIC {
        return Err(unauthenticated(format!(
            "sent {head:02x?} instead of a response to the challenge (no CCL_JOB_SECRET, or not ccl)"
        )));
    }
    let mut response = [0u8; auth::RESPONSE_LEN];
    response[..auth::MAGIC_LEN].copy_from_slice(&head);
    r.read_exact(&mut response[auth::MAGIC_LEN..])
        .map_err(|e| unauthenticated(format!("truncated response ({e})")))?;
    match acceptor.check(&response) {
        Ok(proof) => {
            send(r, &proof)?;
            Ok(())
        }
        Err((e, refusal)) => {
            if let Some(refusal) = refusal {
                let _ = send(r, &refusal);
            }
            Err(unauthenticated(e.to_string()))
        }
    }
}

fn serve_requests(shared: &Shared, stream: TcpStream) -> Wire<()> {
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
    stream.set_write_timeout(Some(SERVER_WRITE_TIMEOUT))?;
    let mut r = BufReader::with_capacity(64 << 10, stream);
    authenticate_client(shared, &mut r)?;
    let hello: [u8; 8] = read_array(&mut r).map_err(|e| match e {
        WireError::Io(e) => WireError::Malformed(format!("no greeting: {e}")),
        e => e,
    })?;
    if hello[..4] != MAGIC {
        return Err(WireError::Malformed(format!(
            "not a ccl store client (greeting {hello:02x?})"
        )));
    }
    send(&r, &greeting())?;
    let version = u32::from_be_bytes([hello[4], hello[5], hello[6], hello[7]]);
    if version != VERSION {
        return Err(WireError::Malformed(format!(
            "client speaks store protocol version {version}, not {VERSION}"
        )));
    }
    // Clients may sit idle for the whole job.
    r.get_ref().set_read_timeout(None)?;
    let mut out = Vec::new();
    while let Some(req) = read_request(&mut r)? {
        if shared.stopping() {
            return Err(WireError::Stopped);
        }
        out.clear();
        shared.handle(req, &mut out)?;
        send(&r, &out)?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Client.

/// A client's connection to the server.
struct Conn {
    r: BufReader<TcpStream>,
    read_timeout: Duration,
}

/// Why a connection attempt failed: worth retrying, or not.
enum ConnectError {
    Retry(String),
    Fatal(String),
}

/// One connection attempt to `addr`: TCP connect, authentication and greetings.
fn open_conn(
    addr: SocketAddr,
    timeout: Duration,
    op_timeout: Duration,
    secret: Option<&JobSecret>,
) -> std::result::Result<Conn, ConnectError> {
    let retry = |e: io::Error| ConnectError::Retry(format!("{addr}: {e}"));
    let timeout = timeout.max(MIN_ATTEMPT);
    let s = TcpStream::connect_timeout(&addr, timeout.min(CONNECT_ATTEMPT)).map_err(retry)?;
    // Connecting to a port nobody listens on can connect the socket to
    // itself (TCP simultaneous open, when the kernel picks that very port as
    // the local one); that would talk to itself, greeting included.
    if s.local_addr().ok() == Some(addr) {
        return Err(ConnectError::Retry(format!("{addr}: connected to itself")));
    }
    s.set_nodelay(true).map_err(retry)?;
    s.set_read_timeout(Some(timeout)).map_err(retry)?;
    s.set_write_timeout(Some(timeout)).map_err(retry)?;
    let mut r = BufReader::new(s);
    authenticate_server(addr, &mut r, secret)?;
    r.get_mut().write_all(&greeting()).map_err(retry)?;
    let hello: [u8; 8] =
        read_array(&mut r).map_err(|e| ConnectError::Retry(format!("{addr}: no greeting: {e}")))?;
    if hello[..4] != MAGIC {
        return Err(ConnectError::Fatal(format!(
            "{addr} is not a ccl store server (greeting {hello:02x?})"
        )));
    }
    let version = u32::from_be_bytes([hello[4], hello[5], hello[6], hello[7]]);
    if version != VERSION {
        return Err(ConnectError::Fatal(format!(
            "{addr} speaks store protocol version {version}, not {VERSION}"
        )));
    }
    r.get_ref()
        .set_write_timeout(Some(op_timeout))
        .map_err(retry)?;
    Ok(Conn {
        r,
        read_timeout: timeout,
    })
}

/// The client's side of the authentication (see [`crate::auth`]).
fn authenticate_server(
    addr: SocketAddr,
    r: &mut BufReader<TcpStream>,
    secret: Option<&JobSecret>,
) -> std::result::Result<(), ConnectError> {
    let mut challenge = [0u8; auth::CHALLENGE_LEN];
    r.read_exact(&mut challenge[..auth::MAGIC_LEN])
        .map_err(|e| ConnectError::Retry(format!("{addr}: no challenge: {e}")))?;
    if !auth::is_challenge_magic(&challenge) {
        return Err(ConnectError::Fatal(format!(
            "{addr} is not a ccl store server (greeting {:02x?})",
            &challenge[..auth::MAGIC_LEN]
        )));
    }
    r.read_exact(&mut challenge[auth::MAGIC_LEN..])
        .map_err(|e| ConnectError::Retry(format!("{addr}: truncated challenge: {e}")))?;
    let fatal = |e: auth::AuthError| {
        ConnectError::Fatal(format!("{addr}: authentication with the store failed: {e}"))
    };
    match auth::answer(secret, auth::STORE_CONTEXT, &challenge).map_err(fatal)? {
        Answer::Open => Ok(()),
        Answer::Respond { response, pending } => {
            r.get_mut()
                .write_all(&response)
                .map_err(|e| ConnectError::Retry(format!("{addr}: sending the response: {e}")))?;
            let mut proof = [0u8; auth::PROOF_LEN];
            r.read_exact(&mut proof).map_err(|e| {
                ConnectError::Fatal(format!(
                    "{addr}: the store closed the connection during authentication ({e}): \
                     does it use another CCL_JOB_SECRET?"
                ))
            })?;
            pending.verify(&proof).map_err(fatal)
        }
    }
}

/// A client of a [`TcpStoreServer`]. `Send + Sync`: share it between threads;
/// their requests take turns on its one connection.
///
/// After a failed request the connection is closed and the next request
/// opens a new one (the failed request is not retried).
pub struct TcpStore {
    conn: Mutex<Option<Conn>>,
    addr: SocketAddr,
    desc: String,
    /// Read/write timeout of requests other than `wait`.
    op_timeout: Duration,
    /// The server, when this client serves it (rank 0). Dropped after `conn`.
    server: Option<TcpStoreServer>,
    /// The job secret, proved on every (re)connection.
    secret: Option<JobSecret>,
}

impl fmt::Debug for TcpStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TcpStore")
            .field("server", &self.desc)
            .field("addr", &self.addr)
            .field("serving", &self.server.is_some())
            .finish()
    }
}

impl TcpStore {
    /// Connects to `host:port`, retrying (with short backoff) while the
    /// server comes up, for at most `timeout`. `host` is a name or an IP
    /// address (IPv6 with or without brackets). Requests then time out after
    /// `timeout` (at least 5 s) without an answer; `wait` after its own
    /// timeout plus a margin.
    /// Unauthenticated: see [`TcpStore::connect_with_secret`].
    pub fn connect(host: &str, port: u16, timeout: Duration) -> Result<TcpStore> {
        TcpStore::connect_with_secret(host, port, timeout, None)
    }

    /// [`TcpStore::connect`] to a server that requires `secret` (`None`: to
    /// one that requires none); each side proves the secret to the other.
    pub fn connect_with_secret(
        host: &str,
        port: u16,
        timeout: Duration,
        secret: Option<&JobSecret>,
    ) -> Result<TcpStore> {
        if secret.is_none() {
            auth::warn_unauthenticated();
        }
        let h = unbracketed(host);
        let desc = format!("tcp://{}:{port}", bracketed(h));
        connect_with(desc, timeout, secret, || {
            (h, port).to_socket_addrs().map(Iterator::collect)
        })
    }

    /// Rank 0's form: binds a server on all interfaces at `port` (`[::]`,
    /// dual-stack, if `host` is or resolves to IPv6; else `0.0.0.0`), keeps
    /// it alive inside the returned client, and connects to it over
    /// loopback. Port 0 picks a free port (see [`TcpStore::server_addr`]).
    pub fn serve(host: &str, port: u16, timeout: Duration) -> Result<TcpStore> {
        TcpStore::serve_with_secret(host, port, timeout, None)
    }

    /// [`TcpStore::serve`] with a server that requires `secret` of its clients.
    pub fn serve_with_secret(
        host: &str,
        port: u16,
        timeout: Duration,
        secret: Option<&JobSecret>,
    ) -> Result<TcpStore> {
        let h = unbracketed(host);
        let v6 = match h.parse::<IpAddr>() {
            Ok(ip) => ip.is_ipv6(),
            Err(_) => (h, port)
                .to_socket_addrs()
                .ok()
                .and_then(|mut a| a.next())
                .is_some_and(|a| a.is_ipv6()),
        };
        let bind: SocketAddr = if v6 {
            (Ipv6Addr::UNSPECIFIED, port).into()
        } else {
            (Ipv4Addr::UNSPECIFIED, port).into()
        };
        let server = TcpStoreServer::bind_with_secret(bind, secret)?;
        let port = server.local_addr().port();
        let mut targets = vec![loopback_of(server.local_addr())];
        if v6 {
            targets.push((Ipv4Addr::LOCALHOST, port).into());
        }
        let desc = format!("tcp://{}:{port}", bracketed(h));
        let mut store = connect_with(desc, timeout, secret, || Ok(targets.clone()))?;
        store.server = Some(server);
        Ok(store)
    }

    /// The server address this client talks to.
    pub fn server_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Sends `req` and parses the reply with `parse`; `what` names the
    /// request in errors.
    fn call<T>(
        &self,
        what: impl Fn() -> String,
        req: &[u8],
        read_timeout: Duration,
        parse: impl FnOnce(&mut BufReader<TcpStream>) -> Wire<T>,
    ) -> Result<T> {
        // The connection is out of its slot during the request, so one cut
        // short (by an error or a panic) is never used again mid-reply.
        let mut slot = lock(&self.conn);
        let mut conn = match slot.take() {
            Some(c) => c,
            None => open_conn(
                self.addr,
                self.op_timeout.min(CONNECT_ATTEMPT),
                self.op_timeout,
                self.secret.as_ref(),
            )
            .map_err(|e| {
                let (ConnectError::Retry(m) | ConnectError::Fatal(m)) = e;
                Error::Store {
                    addr: self.desc.clone(),
                    msg: format!("{}: reconnecting: {m}", what()),
                }
            })?,
        };
        let exchange = || {
            if conn.read_timeout != read_timeout {
                conn.r.get_ref().set_read_timeout(Some(read_timeout))?;
                conn.read_timeout = read_timeout;
            }
            conn.r.get_mut().write_all(req)?;
            parse(&mut conn.r)
        };
        match exchange() {
            Ok(v) => {
                *slot = Some(conn);
                Ok(v)
            }
            Err(e) => Err(self.error(e, &what(), read_timeout)),
        }
    }

    fn error(&self, e: WireError, what: &str, after: Duration) -> Error {
        let addr = self.desc.clone();
        match e {
            WireError::Io(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                Error::Timeout {
                    context: format!("store {addr}"),
                    what: format!("the server's reply to {what}"),
                    after,
                }
            }
            WireError::Io(e) if e.kind() == io::ErrorKind::UnexpectedEof => Error::Store {
                addr,
                msg: format!("{what}: the server closed the connection"),
            },
            WireError::Io(e) => Error::Store {
                addr,
                msg: format!("{what}: {e}"),
            },
            WireError::Malformed(m) => Error::Store {
                addr,
                msg: format!("{what}: malformed reply: {m}"),
            },
            WireError::Stopped => Error::Store {
                addr,
                msg: format!("{what}: server stopped"),
            },
        }
    }

    fn check_key(&self, key: &str) -> Result<()> {
        if key.len() > MAX_KEY {
            return Err(Error::InvalidArgument(format!(
                "store {}: key of {} bytes exceeds the limit of {MAX_KEY}",
                self.desc,
                key.len()
            )));
        }
        Ok(())
    }

    fn check_value(&self, key: &str, value: &[u8]) -> Result<()> {
        if value.len() > MAX_VALUE {
            return Err(Error::InvalidArgument(format!(
                "store {}: value of {} bytes for key '{key}' exceeds the limit of {MAX_VALUE}",
                self.desc,
                value.len()
            )));
        }
        Ok(())
    }

    /// A request: op byte and key.
    fn request(&self, op: u8, key: &str, extra: usize) -> Result<Vec<u8>> {
        self.check_key(key)?;
        let mut req = Vec::with_capacity(1 + 4 + key.len() + extra);
        req.push(op);
        put_bytes(&mut req, key.as_bytes());
        Ok(req)
    }
}

/// Connects, retrying every address from `resolve` until `timeout`.
fn connect_with(
    desc: String,
    timeout: Duration,
    secret: Option<&JobSecret>,
    resolve: impl Fn() -> io::Result<Vec<SocketAddr>>,
) -> Result<TcpStore> {
    let start = Instant::now();
    let deadline = start.checked_add(timeout);
    let left = || {
        deadline.map_or(Duration::MAX, |d| {
            d.saturating_duration_since(Instant::now())
        })
    };
    let op_timeout = timeout.max(MIN_OP_TIMEOUT);
    let mut backoff = Duration::from_millis(5);
    let mut last = String::from("no address");
    loop {
        match resolve() {
            Ok(addrs) => {
                for addr in addrs {
                    match open_conn(addr, left(), op_timeout, secret) {
                        Ok(conn) => {
                            tracing::debug!(
                                "store {desc}: connected to {addr} after {:?}",
                                start.elapsed()
                            );
                            return Ok(TcpStore {
                                conn: Mutex::new(Some(conn)),
                                addr,
                                desc,
                                op_timeout,
                                server: None,
                                secret: secret.cloned(),
                            });
                        }
                        Err(ConnectError::Fatal(msg)) => {
                            return Err(Error::Store { addr: desc, msg })
                        }
                        Err(ConnectError::Retry(msg)) => last = msg,
                    }
                }
            }
            Err(e) => last = format!("resolving: {e}"),
        }
        let left = left();
        if left.is_zero() {
            return Err(Error::Timeout {
                context: format!("connecting to store {desc}"),
                what: format!("the store server (last error: {last})"),
                after: timeout,
            });
        }
        thread::sleep(backoff.min(left));
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

// Replies as the client decodes them, one parser per request.

fn parse_set_reply(r: &mut impl Read) -> Wire<()> {
    match read_u8(r)? {
        status::OK => Ok(()),
        s => Err(WireError::Malformed(format!("status {s}"))),
    }
}

fn parse_get_reply(r: &mut impl Read) -> Wire<Option<Vec<u8>>> {
    match read_u8(r)? {
        status::OK => Ok(Some(read_bytes(r, MAX_VALUE, "value")?)),
        status::NOT_FOUND => Ok(None),
        s => Err(WireError::Malformed(format!("status {s}"))),
    }
}

/// `None` when every key is there, else the missing keys.
fn parse_wait_reply(r: &mut impl Read) -> Wire<Option<Vec<String>>> {
    match read_u8(r)? {
        status::OK => Ok(None),
        status::TIMEOUT => Ok(Some(read_keys(r)?)),
        s => Err(WireError::Malformed(format!("status {s}"))),
    }
}

/// The new value, or the server's message for a value that is no counter.
fn parse_add_reply(r: &mut impl Read) -> Wire<std::result::Result<i64, Vec<u8>>> {
    match read_u8(r)? {
        status::OK => Ok(Ok(read_u64(r)? as i64)),
        status::INVALID => Ok(Err(read_bytes(r, MAX_VALUE, "message")?)),
        s => Err(WireError::Malformed(format!("status {s}"))),
    }
}

fn parse_compare_set_reply(r: &mut impl Read) -> Wire<Vec<u8>> {
    match read_u8(r)? {
        status::OK => read_bytes(r, MAX_VALUE, "value"),
        s => Err(WireError::Malformed(format!("status {s}"))),
    }
}

fn parse_delete_reply(r: &mut impl Read) -> Wire<bool> {
    match read_u8(r)? {
        status::OK => match read_u8(r)? {
            0 => Ok(false),
            1 => Ok(true),
            b => Err(WireError::Malformed(format!("delete flag {b}"))),
        },
        s => Err(WireError::Malformed(format!("status {s}"))),
    }
}

/// Entry points for fuzzing the store's decoders with arbitrary bytes: each
/// returns whether the bytes decoded, and must never panic.
#[doc(hidden)]
pub mod fuzz {
    use super::*;

    fn done<T>(r: Wire<T>, rest: &[u8]) -> std::result::Result<(), String> {
        r.map(|_| ()).map_err(|e| e.to_string())?;
        if rest.is_empty() {
            Ok(())
        } else {
            Err(format!("{} bytes left over", rest.len()))
        }
    }

    /// One request as the server decodes it (the bytes after the greeting).
    pub fn request(bytes: &[u8]) -> std::result::Result<(), String> {
        let mut r = bytes;
        match read_request(&mut r) {
            Ok(None) => Err("no request".into()),
            other => done(other, r),
        }
    }

    /// One reply as the client decodes it: the first byte picks the request
    /// (1 set, 2 get, 3 wait, 4 add, 5 compare-set, 6 delete), the rest is the reply.
    pub fn reply(bytes: &[u8]) -> std::result::Result<(), String> {
        let Some((&which, mut r)) = bytes.split_first() else {
            return Err("empty".into());
        };
        let res = match which {
            op::SET => parse_set_reply(&mut r).map(|_| ()),
            op::GET => parse_get_reply(&mut r).map(|_| ()),
            op::WAIT => parse_wait_reply(&mut r).map(|_| ()),
            op::ADD => parse_add_reply(&mut r).map(|_| ()),
            op::COMPARE_SET => parse_compare_set_reply(&mut r).map(|_| ()),
            op::DELETE => parse_delete_reply(&mut r).map(|_| ()),
            other => return Err(format!("no request {other}")),
        };
        done(res, r)
    }
}

impl Store for TcpStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.check_value(key, value)?;
        let mut req = self.request(op::SET, key, 4 + value.len())?;
        put_bytes(&mut req, value);
        self.call(
            || format!("set('{key}')"),
            &req,
            self.op_timeout,
            parse_set_reply,
        )
    }

    fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        let req = self.request(op::GET, key, 0)?;
        self.call(
            || format!("get('{key}')"),
            &req,
            self.op_timeout,
            parse_get_reply,
        )
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        if keys.len() > MAX_KEYS {
            return Err(Error::InvalidArgument(format!(
                "store {}: wait for {} keys exceeds the limit of {MAX_KEYS}",
                self.desc,
                keys.len()
            )));
        }
        let total: usize = keys.iter().map(|k| k.len()).sum();
        if total > MAX_WAIT_BYTES {
            return Err(Error::InvalidArgument(format!(
                "store {}: wait for keys of {total} bytes exceeds the limit of {MAX_WAIT_BYTES}",
                self.desc
            )));
        }
        let mut req = Vec::with_capacity(1 + 8 + 4 + total + 4 * keys.len());
        req.push(op::WAIT);
        req.extend_from_slice(
            &u64::try_from(timeout.as_nanos())
                .unwrap_or(u64::MAX)
                .to_be_bytes(),
        );
        put_u32(&mut req, keys.len() as u32);
        for k in keys {
            self.check_key(k)?;
            put_bytes(&mut req, k.as_bytes());
        }
        let missing = self.call(
            || format!("wait({keys:?})"),
            &req,
            timeout.min(MAX_WAIT) + WAIT_MARGIN,
            parse_wait_reply,
        )?;
        match missing {
            None => Ok(()),
            Some(missing) => Err(Error::Timeout {
                context: self.describe(),
                what: format!("keys {missing:?}"),
                after: timeout,
            }),
        }
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let mut req = self.request(op::ADD, key, 8)?;
        req.extend_from_slice(&delta.to_be_bytes());
        let reply = self.call(
            || format!("add('{key}', {delta})"),
            &req,
            self.op_timeout,
            parse_add_reply,
        )?;
        reply.map_err(|msg| Error::InvalidArgument(String::from_utf8_lossy(&msg).into_owned()))
    }

    fn compare_set(&self, key: &str, expected: Option<&[u8]>, desired: &[u8]) -> Result<Vec<u8>> {
        self.check_value(key, desired)?;
        if let Some(e) = expected {
            self.check_value(key, e)?;
        }
        let mut req = self.request(
            op::COMPARE_SET,
            key,
            9 + expected.map_or(0, <[u8]>::len) + desired.len(),
        )?;
        match expected {
            None => req.push(0),
            Some(e) => {
                req.push(1);
                put_bytes(&mut req, e);
            }
        }
        put_bytes(&mut req, desired);
        self.call(
            || format!("compare_set('{key}')"),
            &req,
            self.op_timeout,
            parse_compare_set_reply,
        )
    }

    fn delete(&self, key: &str) -> Result<bool> {
        let req = self.request(op::DELETE, key, 0)?;
        self.call(
            || format!("delete('{key}')"),
            &req,
            self.op_timeout,
            parse_delete_reply,
        )
    }

    fn describe(&self) -> String {
        format!("store {}", self.desc)
    }

    fn served_here(&self) -> bool {
        self.server.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Barrier;

    const T: Duration = Duration::from_secs(5);

    fn local_server() -> TcpStoreServer {
        TcpStoreServer::bind("127.0.0.1:0".parse().unwrap()).unwrap()
    }

    fn client(server: &TcpStoreServer) -> TcpStore {
        let a = server.local_addr();
        TcpStore::connect(&a.ip().to_string(), a.port(), T).unwrap()
    }

    fn semantics(s: &TcpStore) {
        super::super::conformance(s);
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

    fn free_port() -> u16 {
        super::super::free_port().unwrap()
    }

    #[test]
    fn client_before_server() {
        let port = free_port();
        let starter = thread::spawn(move || {
            thread::sleep(Duration::from_millis(200));
            TcpStoreServer::bind((Ipv4Addr::LOCALHOST, port).into()).unwrap()
        });
        let start = Instant::now();
        let s = TcpStore::connect("127.0.0.1", port, T).unwrap();
        assert!(start.elapsed() >= Duration::from_millis(150));
        let _server = starter.join().unwrap();
        s.set("k", b"v").unwrap();
        assert_eq!(s.try_get("k").unwrap().unwrap(), b"v");
    }

    #[test]
    fn connect_gives_up() {
        let port = free_port();
        let start = Instant::now();
        let e = TcpStore::connect("127.0.0.1", port, Duration::from_millis(150)).unwrap_err();
        assert!(matches!(e, Error::Timeout { .. }), "{e}");
        assert!(start.elapsed() < Duration::from_secs(1));
    }

    #[test]
    fn server_dropped_while_waiting() {
        let server = local_server();
        let s = client(&server);
        let other = client(&server);
        let waiter = thread::spawn(move || {
            let start = Instant::now();
            (s.wait(&["never"], Duration::from_secs(60)), start.elapsed())
        });
        thread::sleep(Duration::from_millis(50));
        let start = Instant::now();
        drop(server);
        assert!(
            start.elapsed() < Duration::from_secs(1),
            "drop took {:?}",
            start.elapsed()
        );
        let (res, took) = waiter.join().unwrap();
        let e = res.unwrap_err();
        assert!(matches!(e, Error::Store { .. }), "{e}");
        assert!(took < Duration::from_secs(3), "{took:?}");
        // Idle clients fail too, promptly, and keep failing.
        assert!(other.try_get("k").is_err());
        assert!(other.set("k", b"").is_err());
    }

    #[test]
    fn strangers_are_dropped() {
        let server = local_server();
        let addr = server.local_addr();
        let good = client(&server);
        good.set("k", b"v").unwrap();

        let expect_closed = |mut s: TcpStream| {
            s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
            let mut buf = Vec::new();
            // The server closes: EOF (or a reset), never a timeout.
            match s.read_to_end(&mut buf) {
                Ok(_) => {}
                Err(e) => assert_eq!(e.kind(), io::ErrorKind::ConnectionReset, "{e}"),
            }
            buf
        };
        let raw = || TcpStream::connect(addr).unwrap();

        // Without a secret the server opens with a challenge that asks for none.
        let open = auth::Challenge {
            required: false,
            nonce: [0; auth::NONCE_LEN],
        }
        .encode();

        // Speaks HTTP.
        let mut s = raw();
        s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        assert_eq!(expect_closed(s), open);

        // Random garbage.
        use rand::RngCore;
        let mut junk = vec![0u8; 4096];
        rand::thread_rng().fill_bytes(&mut junk);
        let mut s = raw();
        let _ = s.write_all(&junk);
        let _ = expect_closed(s);

        // Wrong version: answered with our greeting, then dropped.
        let mut s = raw();
        s.write_all(&[&MAGIC[..], &99u32.to_be_bytes()].concat())
            .unwrap();
        assert_eq!(expect_closed(s), [&open[..], &greeting()].concat());

        // Valid greeting, then absurd lengths, unknown ops, bad flags, bad UTF-8.
        let bad_requests: Vec<Vec<u8>> = vec![
            [&[op::SET][..], &u32::MAX.to_be_bytes()].concat(),
            [
                &[op::SET][..],
                &1u32.to_be_bytes(),
                b"k",
                &(MAX_VALUE as u32 + 1).to_be_bytes(),
            ]
            .concat(),
            [
                &[op::WAIT][..],
                &0u64.to_be_bytes(),
                &u32::MAX.to_be_bytes(),
            ]
            .concat(),
            [&[op::COMPARE_SET][..], &1u32.to_be_bytes(), b"k", &[7]].concat(),
            [&[op::GET][..], &2u32.to_be_bytes(), &[0xff, 0xfe]].concat(),
            vec![0x42, 1, 2, 3],
            // Truncated: promises 100 bytes, sends 3, closes its side.
            [&[op::SET][..], &100u32.to_be_bytes(), b"abc"].concat(),
        ];
        for req in bad_requests {
            let mut s = raw();
            s.write_all(&[&greeting()[..], &req].concat()).unwrap();
            s.shutdown(Shutdown::Write).unwrap();
            assert_eq!(expect_closed(s), [&open[..], &greeting()].concat());
        }

        // A good request on a raw connection works.
        let mut s = raw();
        s.write_all(&[&greeting()[..], &[op::GET], &1u32.to_be_bytes(), b"k"].concat())
            .unwrap();
        s.shutdown(Shutdown::Write).unwrap();
        let reply = expect_closed(s);
        assert_eq!(
            reply,
            [
                &open[..],
                &greeting(),
                &[status::OK],
                &1u32.to_be_bytes(),
                b"v"
            ]
            .concat()
        );

        // The well-behaved client never noticed.
        assert_eq!(good.try_get("k").unwrap().unwrap(), b"v");
        assert_eq!(client(&server).add("n", 2).unwrap(), 2);
    }

    #[test]
    fn client_refuses_a_stranger_server() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let t = thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let _ = s.write_all(b"SSH-2.0-OpenSSH\r\n");
            thread::sleep(Duration::from_millis(100));
        });
        let e = TcpStore::connect("127.0.0.1", port, T).unwrap_err();
        assert!(
            matches!(e, Error::Store { ref msg, .. } if msg.contains("not a ccl store server")),
            "{e}"
        );
        t.join().unwrap();
    }

    fn secret(s: &str) -> JobSecret {
        JobSecret::new(s).unwrap()
    }

    #[test]
    fn with_a_secret_only_the_job_gets_in() {
        let job = secret("the job's secret");
        let server =
            TcpStoreServer::bind_with_secret("127.0.0.1:0".parse().unwrap(), Some(&job)).unwrap();
        let addr = server.local_addr();
        let good = TcpStore::connect_with_secret("127.0.0.1", addr.port(), T, Some(&job)).unwrap();
        good.set("k", b"v").unwrap();

        // A silent stranger holds a connection open meanwhile.
        let silent = TcpStream::connect(addr).unwrap();
        let silent_since = Instant::now();

        // Wrong secret, no secret: refused at once with a clear error.
        let start = Instant::now();
        let e = TcpStore::connect_with_secret("127.0.0.1", addr.port(), T, Some(&secret("guess")))
            .unwrap_err();
        assert!(e.to_string().contains("CCL_JOB_SECRET differs"), "{e}");
        let e = TcpStore::connect("127.0.0.1", addr.port(), T).unwrap_err();
        assert!(e.to_string().contains("requires a job secret"), "{e}");
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "{:?}",
            start.elapsed()
        );

        // Raw strangers: a well-formed greeting and request without the
        // secret, garbage, and a forged response. Each gets the challenge
        // (and a refusal for the forged response), then the server hangs up.
        let expect_closed = |mut s: TcpStream| {
            s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
            let mut buf = Vec::new();
            match s.read_to_end(&mut buf) {
                Ok(_) => {}
                Err(e) => assert_eq!(e.kind(), io::ErrorKind::ConnectionReset, "{e}"),
            }
            buf
        };
        let strangers: Vec<Vec<u8>> = vec![
            [&greeting()[..], &[op::GET], &1u32.to_be_bytes(), b"k"].concat(),
            vec![0xa5; 1000],
            auth::Response {
                mac: [0; auth::MAC_LEN],
                nonce: [1; auth::NONCE_LEN],
            }
            .encode()
            .to_vec(),
        ];
        for bytes in strangers {
            let mut s = TcpStream::connect(addr).unwrap();
            let _ = s.write_all(&bytes);
            let got = expect_closed(s);
            let challenge = auth::Challenge::decode(&got[..auth::CHALLENGE_LEN]).unwrap();
            assert!(challenge.required);
            // Nothing of the store leaks: no greeting, no value.
            assert!(!got.windows(4).any(|w| w == MAGIC), "{got:02x?}");
            assert!(got.len() <= auth::CHALLENGE_LEN + auth::PROOF_LEN);
        }

        // The job never noticed.
        assert_eq!(good.try_get("k").unwrap().unwrap(), b"v");
        let again = TcpStore::connect_with_secret("127.0.0.1", addr.port(), T, Some(&job)).unwrap();
        assert_eq!(again.add("n", 1).unwrap(), 1);
        // The silent stranger got the challenge, then was dropped at the
        // handshake deadline.
        let mut silent = silent;
        silent
            .set_read_timeout(Some(HANDSHAKE_TIMEOUT + Duration::from_secs(3)))
            .unwrap();
        let mut got = Vec::new();
        silent.read_to_end(&mut got).unwrap();
        let waited = silent_since.elapsed();
        assert_eq!(got.len(), auth::CHALLENGE_LEN);
        assert!(
            waited >= HANDSHAKE_TIMEOUT - Duration::from_millis(100)
                && waited < HANDSHAKE_TIMEOUT + Duration::from_secs(2),
            "{waited:?}"
        );
    }

    #[test]
    fn a_client_with_a_secret_refuses_an_open_server() {
        let server = local_server();
        let port = server.local_addr().port();
        let e =
            TcpStore::connect_with_secret("127.0.0.1", port, T, Some(&secret("s"))).unwrap_err();
        assert!(e.to_string().contains("runs without a job secret"), "{e}");
    }

    #[test]
    fn a_client_refuses_a_server_that_cannot_prove_the_secret() {
        // A fake server: challenges, then answers any response with a proof
        // it cannot have computed.
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let t = thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let c = auth::Challenge {
                required: true,
                nonce: [3; auth::NONCE_LEN],
            };
            s.write_all(&c.encode()).unwrap();
            let mut r = [0u8; auth::RESPONSE_LEN];
            s.read_exact(&mut r).unwrap();
            let p = auth::Proof {
                accepted: true,
                mac: [4; auth::MAC_LEN],
            };
            let _ = s.write_all(&p.encode());
            thread::sleep(Duration::from_millis(200));
        });
        let e =
            TcpStore::connect_with_secret("127.0.0.1", port, T, Some(&secret("s"))).unwrap_err();
        assert!(
            e.to_string().contains("could not prove the job secret"),
            "{e}"
        );
        t.join().unwrap();
    }

    #[test]
    fn send_sync() {
        fn check<T: Send + Sync>() {}
        check::<TcpStore>();
        check::<TcpStoreServer>();
    }
}
