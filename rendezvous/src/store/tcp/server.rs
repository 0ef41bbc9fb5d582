//! [`TcpStoreServer`]: the accept thread, one thread per connection, and
//! the authentication of clients.

use std::{
    collections::HashMap,
    fmt,
    io::{self, BufReader, Read, Write},
    net::{Shutdown, SocketAddr, TcpListener, TcpStream},
    os::fd::AsRawFd,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Condvar, Mutex,
    },
    thread::{self, JoinHandle},
    time::{Duration, Instant},
};

use super::{
    greeting, lock, loopback_of,
    wire::{
        put_bytes, put_u32, read_array, read_request, status, Request, Wire, WireError, MAX_WAIT,
    },
    MAGIC, VERSION,
};
use crate::{
    auth::{self, Acceptor},
    store::hash::parse_counter,
};
use ccl_core::{Error, JobSecret, Result};

/// How long the server gives a new connection to authenticate and greet it.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the server blocks writing a reply to a client that does not read.
const SERVER_WRITE_TIMEOUT: Duration = Duration::from_secs(60);
/// Stack of a server connection thread.
const CONN_STACK: usize = 256 << 10;

/// A served connection: a clone of its socket to shut it down, and its thread.
struct ConnEntry {
    stream: TcpStream,
    thread: Option<JoinHandle<()>>,
}

/// The keys and values, and which keys were changed by a request whose
/// reply is not yet out.
#[derive(Default)]
struct Table {
    values: HashMap<String, Vec<u8>>,
    /// Key: changes of it whose reply the server has not yet sent.
    unheard: HashMap<String, usize>,
}

impl Table {
    /// Sets `key`, unheard until [`Shared::heard`].
    fn change(&mut self, key: String, value: Vec<u8>) {
        *self.unheard.entry(key.clone()).or_default() += 1;
        self.values.insert(key, value);
    }

    /// Whether `key` is there, for a waiter: not while the client that
    /// set it has yet to hear so. A waiter that runs on (a rank 0 that
    /// exits, with the server in its process) must never leave a setter
    /// without its reply.
    fn settled(&self, key: &str) -> bool {
        self.values.contains_key(key) && !self.unheard.contains_key(key)
    }
}

/// What the server's threads share.
struct Shared {
    map: Mutex<Table>,
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

    /// The reply to a change of `key` is out (or will never be): wakes
    /// its waiters.
    fn heard(&self, key: &str) {
        let mut map = lock(&self.map);
        if let Some(count) = map.unheard.get_mut(key) {
            *count -= 1;
            if *count == 0 {
                map.unheard.remove(key);
            }
        }
        drop(map);
        self.changed.notify_all();
    }

    /// Carries out `req`, appending the reply to `out`; returns the key it
    /// changed, if any, for [`Shared::heard`] once the reply is sent.
    fn handle(&self, req: Request, out: &mut Vec<u8>) -> Wire<Option<String>> {
        match req {
            Request::Set(key, value) => {
                lock(&self.map).change(key.clone(), value);
                out.push(status::OK);
                return Ok(Some(key));
            }
            Request::Get(key) => match lock(&self.map).values.get(&key) {
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
                    let missing: Vec<&String> = keys.iter().filter(|k| !map.settled(k)).collect();
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
                let current = match map.values.get(&key) {
                    Some(v) => parse_counter(&key, v),
                    None => Ok(0),
                };
                match current {
                    Ok(c) => {
                        let now = c.wrapping_add(delta);
                        map.change(key.clone(), now.to_string().into_bytes());
                        out.push(status::OK);
                        out.extend_from_slice(&now.to_be_bytes());
                        return Ok(Some(key));
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
                if map.values.get(&key).map(Vec::as_slice) == expected.as_deref() {
                    put_bytes(out, &desired);
                    map.change(key.clone(), desired);
                    return Ok(Some(key));
                }
                put_bytes(
                    out,
                    map.values.get(&key).map(Vec::as_slice).unwrap_or_default(),
                );
            }
            Request::Delete(key) => {
                let existed = lock(&self.map).values.remove(&key).is_some();
                out.push(status::OK);
                out.push(existed as u8);
            }
        }
        Ok(None)
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
        let changed = shared.handle(req, &mut out)?;
        let sent = send(&r, &out);
        if let Some(key) = changed {
            shared.heard(&key);
        }
        sent?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{
        tcp::{
            tests::*,
            wire::{op, MAX_VALUE},
        },
        Store, TcpStore,
    };

    /// A waiter is released by a set (or add) only once the setter's reply
    /// is out: rank 0, whose process serves the store, may exit as soon as
    /// its wait returns, and must not cut off a setter still owed its reply.
    #[test]
    fn a_waiter_sees_a_change_only_after_its_reply() {
        let shared = Shared {
            map: Mutex::default(),
            changed: Condvar::new(),
            stop: AtomicBool::new(false),
            conns: Mutex::default(),
            local: "127.0.0.1:0".parse().unwrap(),
            secret: None,
        };
        let ask = |req: Request| {
            let mut out = Vec::new();
            let changed = shared.handle(req, &mut out).unwrap();
            (out[0], changed)
        };
        let wait =
            |key: &str, ms: u64| ask(Request::Wait(vec![key.into()], Duration::from_millis(ms))).0;
        for (key, change) in [
            ("set", Request::Set("set".into(), b"v".to_vec())),
            ("add", Request::Add("add".into(), 1)),
            (
                "cas",
                Request::CompareSet("cas".into(), None, b"v".to_vec()),
            ),
        ] {
            assert_eq!(ask(change), (status::OK, Some(key.to_string())));
            // Readers see it at once; waiters not before the reply.
            assert_eq!(ask(Request::Get(key.into())).0, status::OK);
            assert_eq!(wait(key, 30), status::TIMEOUT);
            thread::scope(|s| {
                let waiter = s.spawn(|| wait(key, 10_000));
                thread::sleep(Duration::from_millis(20));
                shared.heard(key);
                assert_eq!(waiter.join().unwrap(), status::OK);
            });
        }
        // Nothing changed, nothing owed.
        assert_eq!(ask(Request::Get("set".into())).1, None);
        assert_eq!(ask(Request::Delete("set".into())).1, None);
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
}
