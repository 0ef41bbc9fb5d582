//! The store's wire protocol: message layout, op and status codes, limits,
//! and the readers and writers of requests and replies.

use std::{
    fmt,
    io::{self, Read},
    time::Duration,
};

/// Longest key, in bytes.
pub(super) const MAX_KEY: usize = 64 << 10;
/// Longest value, in bytes.
pub(super) const MAX_VALUE: usize = 64 << 20;
/// Most keys in one `wait`.
pub(super) const MAX_KEYS: usize = 65536;
/// Most key bytes in one `wait`, all keys together.
pub(super) const MAX_WAIT_BYTES: usize = 64 << 20;
/// Longest wait the server honours; longer ones are cut to this.
pub(super) const MAX_WAIT: Duration = Duration::from_secs(365 * 24 * 3600);

pub(super) mod op {
    pub const SET: u8 = 1;
    pub const GET: u8 = 2;
    pub const WAIT: u8 = 3;
    pub const ADD: u8 = 4;
    pub const COMPARE_SET: u8 = 5;
    pub const DELETE: u8 = 6;
}

pub(super) mod status {
    pub const OK: u8 = 0;
    pub const NOT_FOUND: u8 = 1;
    pub const TIMEOUT: u8 = 2;
    pub const INVALID: u8 = 3;
}

/// What reading the other side's bytes can fail with.
#[derive(Debug)]
pub(super) enum WireError {
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

pub(super) type Wire<T> = std::result::Result<T, WireError>;

pub(super) fn read_array<const N: usize>(r: &mut impl Read) -> Wire<[u8; N]> {
    let mut b = [0; N];
    r.read_exact(&mut b)?;
    Ok(b)
}

pub(super) fn read_u8(r: &mut impl Read) -> Wire<u8> {
    Ok(read_array::<1>(r)?[0])
}

fn read_u32(r: &mut impl Read) -> Wire<u32> {
    Ok(u32::from_be_bytes(read_array(r)?))
}

pub(super) fn read_u64(r: &mut impl Read) -> Wire<u64> {
    Ok(u64::from_be_bytes(read_array(r)?))
}

/// A length-prefixed byte string of at most `max` bytes. Memory grows only
/// as bytes arrive, so a lying length cannot make us allocate it up front.
pub(super) fn read_bytes(r: &mut impl Read, max: usize, what: &str) -> Wire<Vec<u8>> {
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

pub(super) fn read_key(r: &mut impl Read) -> Wire<String> {
    String::from_utf8(read_bytes(r, MAX_KEY, "key")?)
        .map_err(|_| WireError::Malformed("key is not UTF-8".into()))
}

/// `n` keys, bounded in number and total size.
pub(super) fn read_keys(r: &mut impl Read) -> Wire<Vec<String>> {
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

pub(super) fn put_u32(buf: &mut Vec<u8>, v: u32) {
    buf.extend_from_slice(&v.to_be_bytes());
}

/// Callers keep `b` within the limits, all far below `u32::MAX`.
pub(super) fn put_bytes(buf: &mut Vec<u8>, b: &[u8]) {
    put_u32(buf, b.len() as u32);
    buf.extend_from_slice(b);
}

/// A request as decoded by the server.
pub(super) enum Request {
    Set(String, Vec<u8>),
    Get(String),
    Wait(Vec<String>, Duration),
    Add(String, i64),
    CompareSet(String, Option<Vec<u8>>, Vec<u8>),
    Delete(String),
}

/// The next request, or `None` when the client closed the connection
/// between requests.
pub(super) fn read_request(r: &mut impl Read) -> Wire<Option<Request>> {
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

// Replies as the client decodes them, one parser per request.

pub(super) fn parse_set_reply(r: &mut impl Read) -> Wire<()> {
    match read_u8(r)? {
        status::OK => Ok(()),
        s => Err(WireError::Malformed(format!("status {s}"))),
    }
}

pub(super) fn parse_get_reply(r: &mut impl Read) -> Wire<Option<Vec<u8>>> {
    match read_u8(r)? {
        status::OK => Ok(Some(read_bytes(r, MAX_VALUE, "value")?)),
        status::NOT_FOUND => Ok(None),
        s => Err(WireError::Malformed(format!("status {s}"))),
    }
}

/// `None` when every key is there, else the missing keys.
pub(super) fn parse_wait_reply(r: &mut impl Read) -> Wire<Option<Vec<String>>> {
    match read_u8(r)? {
        status::OK => Ok(None),
        status::TIMEOUT => Ok(Some(read_keys(r)?)),
        s => Err(WireError::Malformed(format!("status {s}"))),
    }
}

/// The new value, or the server's message for a value that is no counter.
pub(super) fn parse_add_reply(r: &mut impl Read) -> Wire<std::result::Result<i64, Vec<u8>>> {
    match read_u8(r)? {
        status::OK => Ok(Ok(read_u64(r)? as i64)),
        status::INVALID => Ok(Err(read_bytes(r, MAX_VALUE, "message")?)),
        s => Err(WireError::Malformed(format!("status {s}"))),
    }
}

pub(super) fn parse_compare_set_reply(r: &mut impl Read) -> Wire<Vec<u8>> {
    match read_u8(r)? {
        status::OK => read_bytes(r, MAX_VALUE, "value"),
        s => Err(WireError::Malformed(format!("status {s}"))),
    }
}

pub(super) fn parse_delete_reply(r: &mut impl Read) -> Wire<bool> {
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
