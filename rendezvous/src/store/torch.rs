//! [`TorchTcpStore`]: a client of PyTorch's `TCPStore` server, the store
//! that torchrun's elastic agent serves its workers at
//! `MASTER_ADDR:MASTER_PORT` (and says so with
//! `TORCHELASTIC_USE_AGENT_STORE=True`).
//!
//! The protocol is the one torch's own client speaks
//! (`torch/csrc/distributed/c10d/TCPStore.cpp`) to either of its servers
//! (`store/TCPStoreLibUvBackend.cpp`, the default, and
//! `store/TCPStoreBackend.cpp`; framing in `Utils.hpp`), tested against
//! both servers of torch 2.15 (`tests/tests/torch_store.rs`). A new connection
//! first sends `VALIDATE` with the magic number, which has no reply; then
//! each query is its type byte and its fields. Integers are in the host's
//! byte order, as torch writes them; a key or value is a `u64` length and
//! its bytes. Torch's client puts `/` before every key, and so does this
//! one, so that Python's `store.get("k")` reads what `set("k", ..)` wrote
//! here and the reverse.
//!
//! | query | byte | fields | reply |
//! |---|---|---|---|
//! | VALIDATE | 0 | `u32` 0x3C85F7CE | none |
//! | SET | 1 | key, value | none |
//! | COMPARE_SET | 2 | key, expected, desired | value |
//! | GET | 3 | key | value |
//! | ADD | 4 | key, `i64` delta | `i64` new value |
//! | CHECK | 5 | `u64` n, n keys | `u8`: 0 all set, 1 not |
//! | WAIT | 6 | `u64` n, n keys | `u8` 0 (stop waiting) once all are set |
//! | DELETE_KEY | 8 | key | `i64` keys deleted |
//! | CANCEL_WAIT | 12 | none | `u8` 1 (canceled), after the 0 of a wait that ended first |
//!
//! Where torch's server differs from [`Store`]'s contract, this client
//! makes up the difference or documents it on the method: a GET of an unset
//! key answers an empty value (libuv server) or drops the connection (the
//! other), so [`Store::try_get`] asks CHECK first; SET has no reply, so
//! [`Store::set`] follows it with a CHECK that the server answers after it
//! stored the value. Keys over 8 KiB and values over 8 MiB make the libuv
//! server drop the connection, so they are refused here first.

use std::{
    io::{self, Read, Write},
    net::{SocketAddr, TcpStream, ToSocketAddrs},
    sync::Mutex,
    thread,
    time::{Duration, Instant},
};

use super::{
    tcp::{bracketed, unbracketed},
    Store,
};
use ccl_core::{Error, Result};

/// What `VALIDATE` carries (torch's `validationMagicNumber`).
const VALIDATE_MAGIC: u32 = 0x3C85_F7CE;

/// Query type bytes (torch's `QueryType`).
mod query {
    pub const VALIDATE: u8 = 0;
    pub const SET: u8 = 1;
    pub const COMPARE_SET: u8 = 2;
    pub const GET: u8 = 3;
    pub const ADD: u8 = 4;
    pub const CHECK: u8 = 5;
    pub const WAIT: u8 = 6;
    pub const DELETE_KEY: u8 = 8;
    pub const CANCEL_WAIT: u8 = 12;
}

/// CHECK's replies (torch's `CheckResponseType`).
const READY: u8 = 0;
const NOT_READY: u8 = 1;
/// WAIT's and CANCEL_WAIT's replies (torch's `WaitResponseType`).
const STOP_WAITING: u8 = 0;
const WAIT_CANCELED: u8 = 1;

/// Longest key on the wire (with its `/`) that torch's libuv server takes.
const MAX_KEY: usize = 8 << 10;
/// Longest value torch's libuv server takes or sends.
const MAX_VALUE: usize = 8 << 20;
/// Most keys in one CHECK or WAIT.
const MAX_KEYS: usize = 128 << 10;
/// Shortest deadline for a reply.
const MIN_OP_TIMEOUT: Duration = Duration::from_secs(5);
/// Shortest time one connection attempt is given.
const MIN_ATTEMPT: Duration = Duration::from_millis(100);
/// Longest pause between connection attempts.
const MAX_BACKOFF: Duration = Duration::from_millis(200);
/// Longest wait honoured; longer ones are cut to this.
const MAX_WAIT: Duration = Duration::from_secs(365 * 24 * 3600);

/// A client of a torch `TCPStore` server (see the module docs). `Send +
/// Sync`: threads that share it take turns on its one connection. After a
/// failed request the connection is dropped, and the next request opens a
/// new one (the failed request is not retried).
///
/// Torch's store does not authenticate its clients: anyone who reaches the
/// port can read and write keys. `CCL_JOB_SECRET` still guards ccl's TCP links.
#[derive(Debug)]
pub struct TorchTcpStore {
    conn: Mutex<Option<TcpStream>>,
    addr: SocketAddr,
    desc: String,
    /// Deadline of every reply but WAIT's.
    op_timeout: Duration,
}

/// A query being written: its type byte, then its fields.
struct Query(Vec<u8>);

impl Query {
    fn new(kind: u8) -> Query {
        Query(vec![kind])
    }

    fn u32(mut self, v: u32) -> Query {
        self.0.extend_from_slice(&v.to_ne_bytes());
        self
    }

    fn u64(mut self, v: u64) -> Query {
        self.0.extend_from_slice(&v.to_ne_bytes());
        self
    }

    fn i64(mut self, v: i64) -> Query {
        self.0.extend_from_slice(&v.to_ne_bytes());
        self
    }

    fn bytes(self, b: &[u8]) -> Query {
        let mut q = self.u64(b.len() as u64);
        q.0.extend_from_slice(b);
        q
    }

    /// `key` as torch's client sends it: `/` then the key.
    fn key(self, key: &str) -> Query {
        let mut q = self.u64(key.len() as u64 + 1);
        q.0.push(b'/');
        q.0.extend_from_slice(key.as_bytes());
        q
    }

    fn send(&self, mut stream: &TcpStream) -> io::Result<()> {
        stream.write_all(&self.0)
    }
}

/// Reads from a stream until a deadline, each read given the time left;
/// past it, reads fail with `TimedOut`.
struct Until<'a> {
    stream: &'a TcpStream,
    deadline: Instant,
}

impl<'a> Until<'a> {
    fn after(stream: &'a TcpStream, timeout: Duration) -> Until<'a> {
        Until {
            stream,
            deadline: Instant::now() + timeout.min(MAX_WAIT),
        }
    }
}

impl Read for Until<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        self.stream.set_read_timeout(Some(left))?;
        let mut stream = self.stream;
        stream.read(buf)
    }
}

fn garbage(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

fn read_u8(r: &mut impl Read) -> io::Result<u8> {
    let mut b = [0; 1];
    r.read_exact(&mut b)?;
    Ok(b[0])
}

fn read_i64(r: &mut impl Read) -> io::Result<i64> {
    let mut b = [0; 8];
    r.read_exact(&mut b)?;
    Ok(i64::from_ne_bytes(b))
}

/// A length-prefixed value. Memory grows only as bytes arrive, so a lying
/// length cannot make us allocate it.
fn read_value(r: &mut impl Read) -> io::Result<Vec<u8>> {
    let mut b = [0; 8];
    r.read_exact(&mut b)?;
    let len = u64::from_ne_bytes(b);
    if len > MAX_VALUE as u64 {
        return Err(garbage(format!(
            "a value of {len} bytes, over the {MAX_VALUE} torch's server sends"
        )));
    }
    let mut v = Vec::with_capacity((len as usize).min(64 << 10));
    r.take(len).read_to_end(&mut v)?;
    if v.len() as u64 != len {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    Ok(v)
}

/// CHECK's reply: whether every key is set.
fn read_ready(r: &mut impl Read) -> io::Result<bool> {
    match read_u8(r)? {
        READY => Ok(true),
        NOT_READY => Ok(false),
        b => Err(garbage(format!("{b:#04x} in reply to CHECK (not 0 or 1)"))),
    }
}

/// One connection attempt: TCP, VALIDATE, and a CHECK whose reply shows
/// that a torch store answers (VALIDATE has none). `InvalidData`: something
/// else answered.
fn open(addr: SocketAddr, timeout: Duration, op_timeout: Duration) -> io::Result<TcpStream> {
    let stream = TcpStream::connect_timeout(&addr, timeout.max(MIN_ATTEMPT))?;
    // A port nobody listens on can connect the socket to itself (TCP
    // simultaneous open); it would then read its own queries.
    if stream.local_addr()? == addr {
        return Err(io::Error::other("connected to itself"));
    }
    stream.set_nodelay(true)?;
    stream.set_write_timeout(Some(op_timeout))?;
    Query::new(query::VALIDATE)
        .u32(VALIDATE_MAGIC)
        .send(&stream)?;
    Query::new(query::CHECK).u64(1).key("").send(&stream)?;
    match read_u8(&mut Until::after(&stream, timeout.max(MIN_ATTEMPT)))? {
        READY | NOT_READY => Ok(stream),
        b => Err(garbage(format!(
            "answered {b:#04x} to CHECK: not a torch TCPStore server"
        ))),
    }
}

impl TorchTcpStore {
    /// Connects to the torch store at `host:port`, retrying (with short
    /// backoff) while it comes up, for at most `timeout`. `host` is a name
    /// or an IP address (IPv6 with or without brackets). Every reply then
    /// has `timeout` (at least 5 s) to arrive, but a `wait`'s, which has
    /// the wait's own.
    pub fn connect(host: &str, port: u16, timeout: Duration) -> Result<TorchTcpStore> {
        let h = unbracketed(host);
        let desc = format!("torch store tcp://{}:{port}", bracketed(h));
        let op_timeout = timeout.max(MIN_OP_TIMEOUT);
        let deadline = Instant::now() + timeout.min(MAX_WAIT);
        let mut backoff = Duration::from_millis(5);
        let mut last = String::from("no address");
        loop {
            match (h, port).to_socket_addrs() {
                Ok(addrs) => {
                    for addr in addrs {
                        let left = deadline.saturating_duration_since(Instant::now());
                        match open(addr, left.min(op_timeout), op_timeout) {
                            Ok(stream) => {
                                return Ok(TorchTcpStore {
                                    conn: Mutex::new(Some(stream)),
                                    addr,
                                    desc,
                                    op_timeout,
                                })
                            }
                            Err(e) if e.kind() == io::ErrorKind::InvalidData => {
                                return Err(Error::Store {
                                    addr: desc,
                                    msg: format!("{addr} {e}"),
                                })
                            }
                            Err(e) => last = format!("{addr}: {e}"),
                        }
                    }
                }
                Err(e) => last = format!("resolving: {e}"),
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::Timeout {
                    context: format!("connecting to {desc}"),
                    what: format!("the store server (last error: {last})"),
                    after: timeout,
                });
            }
            thread::sleep(backoff.min(left));
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    }

    /// The server address this client talks to.
    pub fn server_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Runs `exchange` on the connection, opening one if the last was
    /// dropped; a connection whose exchange failed is dropped. `what` names
    /// the request in errors.
    fn call<T>(
        &self,
        what: impl Fn() -> String,
        exchange: impl FnOnce(&TcpStream) -> io::Result<T>,
    ) -> Result<T> {
        let mut slot = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        let stream = match slot.take() {
            Some(s) => s,
            None => {
                open(self.addr, self.op_timeout, self.op_timeout).map_err(|e| Error::Store {
                    addr: self.desc.clone(),
                    msg: format!("{}: reconnecting: {e}", what()),
                })?
            }
        };
        match exchange(&stream) {
            Ok(v) => {
                *slot = Some(stream);
                Ok(v)
            }
            Err(e) => Err(self.error(e, &what())),
        }
    }

    /// A reader of the next reply, due within the request deadline.
    fn reply<'a>(&self, stream: &'a TcpStream) -> Until<'a> {
        Until::after(stream, self.op_timeout)
    }

    fn error(&self, e: io::Error, what: &str) -> Error {
        let addr = self.desc.clone();
        match e.kind() {
            _ if is_timeout(&e) => Error::Timeout {
                context: self.desc.clone(),
                what: format!("the server's reply to {what}"),
                after: self.op_timeout,
            },
            io::ErrorKind::UnexpectedEof => Error::Store {
                addr,
                msg: format!("{what}: the server closed the connection"),
            },
            io::ErrorKind::InvalidData => Error::Store {
                addr,
                msg: format!("{what}: malformed reply: {e}"),
            },
            _ => Error::Store {
                addr,
                msg: format!("{what}: {e}"),
            },
        }
    }

    fn check_key(&self, key: &str) -> Result<()> {
        if key.len() + 1 > MAX_KEY {
            return Err(Error::InvalidArgument(format!(
                "{}: key of {} bytes exceeds torch's limit of {}",
                self.desc,
                key.len(),
                MAX_KEY - 1
            )));
        }
        Ok(())
    }

    fn check_value(&self, key: &str, value: &[u8]) -> Result<()> {
        if value.len() > MAX_VALUE {
            return Err(Error::InvalidArgument(format!(
                "{}: value of {} bytes for key '{key}' exceeds torch's limit of {MAX_VALUE}",
                self.desc,
                value.len()
            )));
        }
        Ok(())
    }

    /// A CHECK or WAIT query for `keys`.
    fn keys_query(&self, kind: u8, keys: &[&str]) -> Result<Query> {
        if keys.len() > MAX_KEYS {
            return Err(Error::InvalidArgument(format!(
                "{}: {} keys at once exceed torch's limit of {MAX_KEYS}",
                self.desc,
                keys.len()
            )));
        }
        let mut q = Query::new(kind).u64(keys.len() as u64);
        for k in keys {
            self.check_key(k)?;
            q = q.key(k);
        }
        Ok(q)
    }

    /// Whether `key` is set.
    fn is_set(&self, key: &str) -> Result<bool> {
        let check = self.keys_query(query::CHECK, &[key])?;
        self.call(
            || format!("check('{key}')"),
            |s| {
                check.send(s)?;
                read_ready(&mut self.reply(s))
            },
        )
    }
}

impl Store for TorchTcpStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.check_value(key, value)?;
        let set = Query::new(query::SET).key(key).bytes(value);
        let check = self.keys_query(query::CHECK, &[key])?;
        self.call(
            || format!("set('{key}')"),
            |s| {
                set.send(s)?;
                // Answered once the server has handled the SET before it.
                check.send(s)?;
                read_ready(&mut self.reply(s)).map(drop)
            },
        )
    }

    fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        let check = self.keys_query(query::CHECK, &[key])?;
        let get = Query::new(query::GET).key(key);
        self.call(
            || format!("get('{key}')"),
            |s| {
                check.send(s)?;
                if !read_ready(&mut self.reply(s))? {
                    return Ok(None);
                }
                get.send(s)?;
                read_value(&mut self.reply(s)).map(Some)
            },
        )
    }

    /// Sends WAIT and reads its reply until `timeout`; past it, withdraws
    /// the wait with CANCEL_WAIT. This is how torch's own client waits, so
    /// both servers serve it in every torch job; the server answers the
    /// moment the last key is set, and costs nothing while it waits, where
    /// polling with CHECK from every rank of a large job would keep the
    /// single-threaded server busy and answer late. The CANCEL_WAIT reply
    /// has the request deadline, so a silent server still ends in an
    /// error. On a timeout, a CHECK per key names those still missing.
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        if keys.is_empty() {
            return Ok(());
        }
        let wait = self.keys_query(query::WAIT, keys)?;
        let all_set = self.call(
            || format!("wait({keys:?})"),
            |s| {
                wait.send(s)?;
                match read_u8(&mut Until::after(s, timeout)) {
                    Ok(STOP_WAITING) => return Ok(true),
                    Ok(b) => return Err(garbage(format!("{b:#04x} in reply to WAIT"))),
                    Err(e) if is_timeout(&e) => {}
                    Err(e) => return Err(e),
                }
                Query::new(query::CANCEL_WAIT).send(s)?;
                let mut r = self.reply(s);
                let (first, canceled) = match read_u8(&mut r)? {
                    STOP_WAITING => (true, read_u8(&mut r)?),
                    b => (false, b),
                };
                if canceled != WAIT_CANCELED {
                    return Err(garbage(format!("{canceled:#04x} in reply to CANCEL_WAIT")));
                }
                Ok(first)
            },
        )?;
        if all_set {
            return Ok(());
        }
        let mut missing = Vec::new();
        for &k in keys {
            if !self.is_set(k)? {
                missing.push(k);
            }
        }
        if missing.is_empty() {
            return Ok(());
        }
        Err(Error::Timeout {
            context: self.describe(),
            what: format!("keys {missing:?}"),
            after: timeout,
        })
    }

    /// Torch's server drops the connection when the key holds something
    /// that is not an integer; that reads as an [`Error::Store`] here.
    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.check_key(key)?;
        let add = Query::new(query::ADD).key(key).i64(delta);
        self.call(
            || format!("add('{key}', {delta})"),
            |s| {
                add.send(s)?;
                read_i64(&mut self.reply(s))
            },
        )
    }

    /// Torch's server takes an empty `expected` for "unset or empty", so
    /// `None` and `Some(b"")` both also match a key that holds an empty
    /// value. For an unset key and any other `expected` it answers
    /// `expected` itself; that is turned back into the empty value here.
    fn compare_set(&self, key: &str, expected: Option<&[u8]>, desired: &[u8]) -> Result<Vec<u8>> {
        self.check_key(key)?;
        self.check_value(key, desired)?;
        let expected = expected.unwrap_or_default();
        self.check_value(key, expected)?;
        let compare_set = Query::new(query::COMPARE_SET)
            .key(key)
            .bytes(expected)
            .bytes(desired);
        let now = self.call(
            || format!("compare_set('{key}')"),
            |s| {
                compare_set.send(s)?;
                read_value(&mut self.reply(s))
            },
        )?;
        // A key that held `expected` now holds `desired`: an answer of
        // `expected` means the key is unset, unless the two are equal.
        if !expected.is_empty() && now == expected && (desired != expected || !self.is_set(key)?) {
            return Ok(Vec::new());
        }
        Ok(now)
    }

    fn delete(&self, key: &str) -> Result<bool> {
        self.check_key(key)?;
        let delete = Query::new(query::DELETE_KEY).key(key);
        self.call(
            || format!("delete('{key}')"),
            |s| {
                delete.send(s)?;
                match read_i64(&mut self.reply(s))? {
                    0 => Ok(false),
                    1 => Ok(true),
                    n => Err(garbage(format!("{n} keys deleted"))),
                }
            },
        )
    }

    fn describe(&self) -> String {
        self.desc.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use std::net::TcpListener;

    const T: Duration = Duration::from_secs(5);
    /// The reply deadline of test clients.
    const REPLY: Duration = Duration::from_millis(300);

    /// `parts` end to end.
    fn cat(parts: &[&[u8]]) -> Vec<u8> {
        parts.concat()
    }

    /// A key or value as torch frames it: its length (`u64`, little-endian
    /// on the machines these tests run on), then its bytes.
    fn framed(b: &[u8]) -> Vec<u8> {
        cat(&[&(b.len() as u64).to_le_bytes(), b])
    }

    /// What a client sends on connecting: VALIDATE, then CHECK of `/`.
    fn hello() -> Vec<u8> {
        cat(&[
            &[0, 0xCE, 0xF7, 0x85, 0x3C],
            &[5],
            &1u64.to_le_bytes(),
            &framed(b"/"),
        ])
    }

    fn expect(s: &mut TcpStream, want: &[u8]) {
        let mut got = vec![0; want.len()];
        s.read_exact(&mut got).unwrap();
        assert_eq!(got, want);
    }

    /// A fake server: takes one connection, answers its greeting, then runs
    /// `script` on it.
    fn fake(script: impl FnOnce(TcpStream) + Send + 'static) -> (u16, thread::JoinHandle<()>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let t = thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            s.set_read_timeout(Some(T)).unwrap();
            expect(&mut s, &hello());
            s.write_all(&[NOT_READY]).unwrap();
            script(s);
        });
        (port, t)
    }

    fn client(port: u16) -> TorchTcpStore {
        let mut c = TorchTcpStore::connect("127.0.0.1", port, T).unwrap();
        c.op_timeout = REPLY;
        c
    }

    #[test]
    fn queries_are_framed_as_torch_frames_them() {
        let (port, server) = fake(|mut s| {
            // set("k", "v"): SET, then a CHECK that acknowledges it.
            expect(&mut s, &cat(&[&[1], &framed(b"/k"), &framed(b"v")]));
            expect(&mut s, &cat(&[&[5], &1u64.to_le_bytes(), &framed(b"/k")]));
            s.write_all(&[0]).unwrap();
            // try_get("k"): CHECK, then GET.
            expect(&mut s, &cat(&[&[5], &1u64.to_le_bytes(), &framed(b"/k")]));
            s.write_all(&[0]).unwrap();
            expect(&mut s, &cat(&[&[3], &framed(b"/k")]));
            s.write_all(&framed(b"abc")).unwrap();
            // try_get("gone"): CHECK only.
            expect(
                &mut s,
                &cat(&[&[5], &1u64.to_le_bytes(), &framed(b"/gone")]),
            );
            s.write_all(&[1]).unwrap();
            // add("n", -2)
            expect(
                &mut s,
                &cat(&[&[4], &framed(b"/n"), &(-2i64).to_le_bytes()]),
            );
            s.write_all(&5i64.to_le_bytes()).unwrap();
            // compare_set("c", Some("x"), "y") of an unset key: torch
            // answers the expected value.
            expect(
                &mut s,
                &cat(&[&[2], &framed(b"/c"), &framed(b"x"), &framed(b"y")]),
            );
            s.write_all(&framed(b"x")).unwrap();
            // compare_set("c", None, "y")
            expect(
                &mut s,
                &cat(&[&[2], &framed(b"/c"), &framed(b""), &framed(b"y")]),
            );
            s.write_all(&framed(b"y")).unwrap();
            // delete("k")
            expect(&mut s, &cat(&[&[8], &framed(b"/k")]));
            s.write_all(&1i64.to_le_bytes()).unwrap();
            // wait(["a", "w"]) that times out: WAIT, no answer, CANCEL_WAIT,
            // then a CHECK per key.
            expect(
                &mut s,
                &cat(&[&[6], &2u64.to_le_bytes(), &framed(b"/a"), &framed(b"/w")]),
            );
            expect(&mut s, &[12]);
            s.write_all(&[1]).unwrap();
            expect(&mut s, &cat(&[&[5], &1u64.to_le_bytes(), &framed(b"/a")]));
            s.write_all(&[0]).unwrap();
            expect(&mut s, &cat(&[&[5], &1u64.to_le_bytes(), &framed(b"/w")]));
            s.write_all(&[1]).unwrap();
            // wait(["a"]) whose keys come as it is withdrawn.
            expect(&mut s, &cat(&[&[6], &1u64.to_le_bytes(), &framed(b"/a")]));
            expect(&mut s, &[12]);
            s.write_all(&[0, 1]).unwrap();
            // wait(["a"]) answered at once.
            expect(&mut s, &cat(&[&[6], &1u64.to_le_bytes(), &framed(b"/a")]));
            s.write_all(&[0]).unwrap();
        });
        let c = client(port);
        c.set("k", b"v").unwrap();
        assert_eq!(c.try_get("k").unwrap().unwrap(), b"abc");
        assert_eq!(c.try_get("gone").unwrap(), None);
        assert_eq!(c.add("n", -2).unwrap(), 5);
        assert_eq!(c.compare_set("c", Some(b"x"), b"y").unwrap(), b"");
        assert_eq!(c.compare_set("c", None, b"y").unwrap(), b"y");
        assert!(c.delete("k").unwrap());
        let e = c.wait(&["a", "w"], Duration::from_millis(50)).unwrap_err();
        match &e {
            Error::Timeout { what, after, .. } => {
                assert_eq!(what, r#"keys ["w"]"#);
                assert_eq!(*after, Duration::from_millis(50));
            }
            _ => panic!("{e}"),
        }
        c.wait(&["a"], Duration::ZERO).unwrap();
        c.wait(&["a"], T).unwrap();
        c.wait(&[], Duration::ZERO).unwrap();
        server.join().unwrap();
    }

    /// What a client call does when the server answers its query with
    /// `junk` and then keeps the connection open until the client closes it.
    fn against(junk: &'static [u8], call: impl FnOnce(&TorchTcpStore) -> Result<()>) -> Error {
        let (port, server) = fake(move |mut s| {
            s.write_all(junk).unwrap();
            let _ = io::copy(&mut s, &mut io::sink());
        });
        let c = client(port);
        let start = Instant::now();
        let e = call(&c).unwrap_err();
        assert!(start.elapsed() < REPLY * 3, "{:?}: {e}", start.elapsed());
        server.join().unwrap();
        e
    }

    fn store_error(e: &Error, says: &str) {
        assert!(
            matches!(e, Error::Store { msg, addr } if msg.contains(says) && addr.contains("127.0.0.1")),
            "{e}"
        );
    }

    #[test]
    fn junk_replies_are_errors() {
        let get = |c: &TorchTcpStore| c.try_get("k").map(drop);
        store_error(&against(&[7], get), "0x07 in reply to CHECK");
        // A value "longer" than torch ever sends, never allocated.
        let huge: &[u8] = &[0, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF];
        store_error(&against(huge, get), "over the 8388608");
        // Ten bytes promised, three sent: a timeout, not a hang.
        let short: &[u8] = &[0, 10, 0, 0, 0, 0, 0, 0, 0, 1, 2, 3];
        assert!(matches!(against(short, get), Error::Timeout { .. }));
        // Silence.
        let e = against(&[], get);
        assert!(
            matches!(&e, Error::Timeout { context, what, after }
                if context.contains("127.0.0.1") && what.contains("get('k')") && *after == REPLY),
            "{e}"
        );
        store_error(
            &against(&[7, 0, 0, 0, 0, 0, 0, 0], |c| c.delete("k").map(drop)),
            "7 keys deleted",
        );
        store_error(
            &against(&[9], |c| c.wait(&["k"], T)),
            "0x09 in reply to WAIT",
        );
        // The wait ends, and the server answers its CANCEL_WAIT with junk.
        let (port, server) = fake(|mut s| {
            expect(&mut s, &cat(&[&[6], &1u64.to_le_bytes(), &framed(b"/k")]));
            expect(&mut s, &[12]);
            s.write_all(&[5]).unwrap();
        });
        let e = client(port)
            .wait(&["k"], Duration::from_millis(10))
            .unwrap_err();
        store_error(&e, "0x05 in reply to CANCEL_WAIT");
        server.join().unwrap();
        // Nor does it answer CANCEL_WAIT at all.
        assert!(matches!(
            against(&[], |c| c.wait(&["k"], Duration::from_millis(10))),
            Error::Timeout { .. }
        ));
    }

    #[test]
    fn a_closed_connection_is_an_error_and_the_next_call_reconnects() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let server = thread::spawn(move || {
            for reply in [None, Some(NOT_READY)] {
                let (mut s, _) = l.accept().unwrap();
                expect(&mut s, &hello());
                s.write_all(&[NOT_READY]).unwrap();
                expect(&mut s, &cat(&[&[5], &1u64.to_le_bytes(), &framed(b"/k")]));
                match reply {
                    None => drop(s),
                    Some(r) => s.write_all(&[r]).unwrap(),
                }
            }
        });
        let c = client(port);
        let e = c.try_get("k").unwrap_err();
        store_error(&e, "get('k'): the server closed the connection");
        assert_eq!(c.try_get("k").unwrap(), None);
        server.join().unwrap();
    }

    #[test]
    fn random_replies_give_errors_or_values_never_a_panic_or_a_hang() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(22);
        for round in 0..200 {
            let len = rng.gen_range(0..24);
            // Small bytes are likelier to look like replies.
            let junk: Vec<u8> = (0..len)
                .map(|_| {
                    if rng.gen_bool(0.7) {
                        rng.gen_range(0..3)
                    } else {
                        rng.gen()
                    }
                })
                .collect();
            let (port, server) = fake(move |mut s| {
                let _ = s.write_all(&junk);
            });
            let c = client(port);
            let start = Instant::now();
            let _ = match round % 6 {
                0 => c.try_get("k").map(drop),
                1 => c.set("k", b"v"),
                2 => c.add("k", 1).map(drop),
                3 => c.compare_set("k", Some(b"e"), b"d").map(drop),
                4 => c.delete("k").map(drop),
                _ => c.wait(&["k", "l"], Duration::from_millis(20)),
            };
            assert!(
                start.elapsed() < REPLY * 4,
                "round {round}: {:?}",
                start.elapsed()
            );
            server.join().unwrap();
        }
    }

    #[test]
    fn refuses_a_server_that_is_not_torch() {
        let ccl = crate::store::TcpStoreServer::bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let start = Instant::now();
        let e = TorchTcpStore::connect("127.0.0.1", ccl.local_addr().port(), T).unwrap_err();
        store_error(&e, "not a torch TCPStore server");
        assert!(start.elapsed() < Duration::from_secs(1));
    }

    #[test]
    fn connect_gives_up_on_its_deadline() {
        let port = crate::store::free_port().unwrap();
        let start = Instant::now();
        let e = TorchTcpStore::connect("127.0.0.1", port, Duration::from_millis(150)).unwrap_err();
        assert!(
            matches!(&e, Error::Timeout { context, .. } if context.contains(&format!("tcp://127.0.0.1:{port}"))),
            "{e}"
        );
        assert!(start.elapsed() < Duration::from_secs(1));
    }

    #[test]
    fn keys_and_values_past_torchs_limits_are_refused_here() {
        let (port, server) = fake(|_| {});
        let c = client(port);
        let long = "k".repeat(MAX_KEY);
        assert!(matches!(c.set(&long, b""), Err(Error::InvalidArgument(_))));
        assert!(matches!(
            c.wait(&[&long], T),
            Err(Error::InvalidArgument(_))
        ));
        let big = vec![0; MAX_VALUE + 1];
        assert!(matches!(c.set("k", &big), Err(Error::InvalidArgument(_))));
        assert!(matches!(
            c.compare_set("k", Some(&big), b""),
            Err(Error::InvalidArgument(_))
        ));
        server.join().unwrap();
    }
}
