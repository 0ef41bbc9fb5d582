//! [`TcpStore`]: a client's connection to the server (with retries while
//! it comes up, and the authentication of the server) and its [`Store`] impl.

use std::{
    fmt,
    io::{self, BufReader, Read, Write},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream, ToSocketAddrs},
    sync::Mutex,
    thread,
    time::{Duration, Instant},
};

use super::{
    greeting, lock, loopback_of,
    wire::{
        op, parse_add_reply, parse_compare_set_reply, parse_delete_reply, parse_get_reply,
        parse_set_reply, parse_wait_reply, put_bytes, put_u32, read_array, Wire, WireError,
        MAX_KEY, MAX_KEYS, MAX_VALUE, MAX_WAIT, MAX_WAIT_BYTES,
    },
    TcpStoreServer, MAGIC, VERSION,
};
use crate::{
    auth::{self, Answer},
    store::Store,
};
use ccl_core::{Error, JobSecret, Result};

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

/// `[v6]` for IPv6 literals, for `host:port` strings.
pub(crate) fn bracketed(host: &str) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]")
    } else {
        host.to_string()
    }
}

/// `host` without the brackets of an IPv6 literal.
pub(crate) fn unbracketed(host: &str) -> &str {
    host.strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host)
}

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
    use crate::store::tcp::tests::*;
    use std::net::TcpListener;

    fn free_port() -> u16 {
        crate::store::free_port().unwrap()
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
}
