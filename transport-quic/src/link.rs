//! The QUIC link to one peer: one connection, a unidirectional stream per
//! piece of each message.
//!
//! A message of `len` payload bytes is cut into pieces of [`PIECE`] bytes;
//! piece 0 goes on a new unidirectional stream after the 56-byte
//! [`FrameHeader`], every further piece on a stream of its own. The sender
//! opens the streams of a message in order and writes up to
//! [`SEND_WINDOW`] of them at once, so that a lost packet delays only its
//! stream. The receiver accepts streams in order: quinn's `accept_uni`
//! yields the peer's streams in stream-id order (quinn-proto
//! `Streams::accept` hands out `next_reported_remote` and increments it by
//! one; a frame for a higher stream id opens all the lower ones), and a
//! sender opens them in the order it calls `open_uni`. So the n-th accepted
//! stream is the n-th opened one, and pieces land straight in the caller's
//! buffer at their offset.
//!
//! A send returns once quinn holds every piece (written and finished), as a
//! TCP send returns once the kernel holds the bytes: waiting for the peer's
//! acknowledgement cost a round trip per message, which at 40 ms of round
//! trip held a 64 MiB ring allreduce at 14% of a 1 Gbit/s line. Unlike the
//! kernel, quinn does not flush for a process that exits, so a task on the
//! QUIC runtime counts every stream until the peer acknowledged it (quinn's
//! `SendStream::stopped`), and what is unacknowledged is waited for when the
//! link is dropped and, through an `atexit` hook, when the process exits
//! without dropping its communicator: until the peer acknowledged it all or
//! the connection ended (a dead peer within QUIC's idle timeout), at most the
//! communicator's timeout, as the kernel delivers what a TCP socket holds to
//! a receiver that reads late. Receivers
//! acknowledge every ack-eliciting packet at once (the ack-frequency
//! extension, threshold 0, see `transport_config`), so that these waits are
//! short and a peer that exits right after reading has acknowledged already.
//! Streams received before a close can still be accepted and read (quinn's
//! `poll_accept`). An abort closes the connection with
//! [`ABORT_CODE`] and the encoded [`AbortNotice`] as the reason, which the
//! peer turns into [`Error::PeerLost`] naming the rank that failed first.

use std::sync::{
    atomic::{AtomicBool, Ordering},
    Arc, Condvar, Mutex as StdMutex, Weak,
};
use std::time::{Duration, Instant};

use ccl_core::{
    frame::HEADER_LEN, AbortNotice, BufMut, BufRef, Error, FrameHeader, FrameKind, Link,
    LinkFuture, Reduction, Result,
};
use futures::{stream::FuturesUnordered, StreamExt};
use quinn::{Connection, ConnectionError, Endpoint, ReadExactError, VarInt, WriteError};
use tokio::sync::Mutex;

use crate::pool::PiecePool;

/// Pieces of a message: each goes on its own unidirectional stream.
pub const PIECE: usize = 1024 * 1024;
/// Streams of one message a sender writes at once.
pub const SEND_WINDOW: usize = 16;
/// Streams of one message a receiver reads at once (at least `SEND_WINDOW`).
const RECV_WINDOW: usize = 32;
/// Send buffers a link keeps for reuse (see [`PiecePool`]): enough for the
/// pieces being written and those written and not yet acknowledged.
const KEEP_BUFFERS: usize = 2 * SEND_WINDOW;
/// A receive-and-reduce reads and reduces each piece in blocks of this many bytes.
const REDUCE_BLOCK: usize = 64 * 1024;
/// Application close code of an abort (the reason is the notice).
pub const ABORT_CODE: u32 = 0xCC1A;
/// Application close code of a link dropped at the end.
pub const DONE_CODE: u32 = 0;
/// Longest abort reason that fits a close frame.
const MAX_REASON: usize = 900;

pub(crate) struct QuicLink {
    rank: usize,
    peer: usize,
    comm: u64,
    conn: Connection,
    endpoint: Endpoint,
    runtime: tokio::runtime::Handle,
    sending: Mutex<()>,
    receiving: Mutex<()>,
    aborted: AtomicBool,
    /// Streams sent and not yet acknowledged.
    unacked: Arc<Unacked>,
    /// Buffers that hold what quinn sends until it is acknowledged.
    pool: Arc<PiecePool>,
    /// Keeps the accepting task (strangers are logged) as long as a link lives.
    _guard: std::sync::Arc<crate::mesh::AbortOnDrop>,
}

impl QuicLink {
    /// A link of communicator `comm`, whose operations time out after `timeout`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        rank: usize,
        peer: usize,
        comm: u64,
        timeout: Duration,
        conn: Connection,
        endpoint: Endpoint,
        runtime: tokio::runtime::Handle,
        guard: std::sync::Arc<crate::mesh::AbortOnDrop>,
    ) -> QuicLink {
        QuicLink {
            rank,
            peer,
            comm,
            conn,
            endpoint,
            runtime,
            sending: Mutex::new(()),
            receiving: Mutex::new(()),
            aborted: AtomicBool::new(false),
            unacked: Unacked::registered(timeout),
            pool: PiecePool::new(KEEP_BUFFERS),
            _guard: guard,
        }
    }

    /// The error for a connection that ended.
    fn lost(&self, e: &ConnectionError) -> Error {
        let cause = match e {
            ConnectionError::ApplicationClosed(c)
                if c.error_code == VarInt::from_u32(ABORT_CODE) =>
            {
                return match AbortNotice::decode(&c.reason) {
                    Ok(n) => n.into_error(self.rank, self.peer),
                    Err(m) => self.protocol(format!("malformed abort notice: {m}")),
                }
            }
            ConnectionError::ApplicationClosed(_) => "connection closed".to_string(),
            ConnectionError::TimedOut => "no packet from it within the idle timeout".to_string(),
            ConnectionError::LocallyClosed => "this rank closed the link".to_string(),
            other => other.to_string(),
        };
        let aborted = self.aborted.load(Ordering::Acquire);
        Error::peer_lost(self.rank, self.peer, cause, aborted)
    }

    fn protocol(&self, msg: String) -> Error {
        Error::protocol(self.rank, self.peer, msg)
    }

    fn write_error(&self, e: WriteError) -> Error {
        match e {
            WriteError::ConnectionLost(c) => self.lost(&c),
            other => self.protocol(format!("writing a stream: {other}")),
        }
    }

    fn read_error(&self, e: ReadExactError) -> Error {
        match e {
            ReadExactError::ReadError(quinn::ReadError::ConnectionLost(c)) => self.lost(&c),
            ReadExactError::FinishedEarly(usize::MAX) => {
                self.protocol("a stream carries more than its piece".into())
            }
            ReadExactError::FinishedEarly(n) => {
                self.protocol(format!("stream ended after {n} bytes of a piece"))
            }
            ReadExactError::ReadError(other) => self.protocol(format!("reading a stream: {other}")),
        }
    }

    /// Counts stream `s` as unacknowledged until the peer acknowledged all
    /// of it, or the connection ended (a task on the QUIC runtime).
    fn await_ack(&self, s: quinn::SendStream) {
        self.unacked.add();
        let unacked = Arc::clone(&self.unacked);
        let (rank, peer) = (self.rank, self.peer);
        self.runtime.spawn(async move {
            if let Ok(Some(code)) = s.stopped().await {
                // The peer dropped the stream unread: its own call fails and says why.
                tracing::debug!(rank, peer, %code, "peer stopped a QUIC stream");
            }
            unacked.done();
        });
    }

    /// The reason the connection ended, if it did (for errors that do not say).
    fn closed_error(&self) -> Option<Error> {
        self.conn.close_reason().map(|c| self.lost(&c))
    }

    async fn send_pieces<'a>(&'a self, header: FrameHeader, data: &'a [u8]) -> Result<()> {
        if header.len != data.len() as u64 {
            return Err(Error::Internal(format!(
                "header says {} bytes, payload has {}",
                header.len,
                data.len()
            )));
        }
        let _one = self.sending.lock().await;
        let head = header.encode();
        let mut pieces = data.chunks(PIECE);
        let first = pieces.next().unwrap_or(&[]);
        let mut writing = FuturesUnordered::new();
        let piece = |s: quinn::SendStream, prefix: Option<[u8; HEADER_LEN]>, bytes: &'a [u8]| async move {
            let s = send_piece(s, &self.pool, prefix, bytes)
                .await
                .map_err(|e| self.write_error(e))?;
            self.await_ack(s);
            Ok::<(), Error>(())
        };
        let open = |s: std::result::Result<quinn::SendStream, ConnectionError>| {
            s.map_err(|c| self.lost(&c))
        };
        writing.push(piece(open(self.conn.open_uni().await)?, Some(head), first));
        for bytes in pieces {
            while writing.len() >= SEND_WINDOW {
                if let Some(r) = writing.next().await {
                    r?;
                }
            }
            writing.push(piece(open(self.conn.open_uni().await)?, None, bytes));
        }
        while let Some(r) = writing.next().await {
            r?;
        }
        Ok(())
    }

    /// Receives a message into `into`, or, given a reduction, reduces it
    /// into `into`.
    async fn recv_pieces<'b>(
        &self,
        expect: FrameHeader,
        into: &'b mut [u8],
        reduce: Option<&Reduction<'_>>,
    ) -> Result<()> {
        if expect.len != into.len() as u64 {
            return Err(Error::Internal(format!(
                "expected header says {} bytes, the buffer has {}",
                expect.len,
                into.len()
            )));
        }
        let _one = self.receiving.lock().await;
        let accept = || async {
            match self.conn.accept_uni().await {
                Ok(s) => Ok(s),
                Err(c) => Err(self.lost(&c)),
            }
        };
        let mut first = accept().await?;
        let mut head = [0u8; HEADER_LEN];
        first
            .read_exact(&mut head)
            .await
            .map_err(|e| self.read_error(e))?;
        let got = FrameHeader::decode(&head).map_err(|m| self.protocol(m))?;
        if got.kind == FrameKind::Abort {
            return Err(self.protocol("abort frame on a data stream".into()));
        }
        expect.check_received(&got, self.rank, self.peer)?;
        let read = |s: quinn::RecvStream, at: usize, buf: &'b mut [u8]| async move {
            let r = match reduce {
                None => read_piece(s, buf).await,
                Some(reduction) => reduce_piece(s, buf, at, reduction).await,
            };
            r.map_err(|e| match e {
                PieceError::Read(e) => self.read_error(e),
                PieceError::Reduce(e) => e,
            })
        };
        let mut pieces = into.chunks_mut(PIECE).enumerate().peekable();
        let mut reading = FuturesUnordered::new();
        let (_, buf) = pieces.next().unwrap_or((0, &mut []));
        reading.push(read(first, 0, buf));
        // Accept the next stream while reading those accepted, never one
        // after the other: the sender gets to send more (on any stream, the
        // next one's first bytes included) only as the streams accepted are
        // read, so waiting for the next stream without reading deadlocks
        // once the connection's receive window is full.
        loop {
            let more = pieces.peek().is_some() && reading.len() < RECV_WINDOW;
            tokio::select! {
                biased;
                Some(r) = reading.next(), if !reading.is_empty() => r?,
                s = accept(), if more => {
                    if let Some((i, buf)) = pieces.next() {
                        reading.push(read(s?, i * PIECE, buf));
                    }
                }
                else => break,
            }
        }
        Ok(())
    }
}

/// A count of streams sent and not yet acknowledged.
struct Unacked {
    count: StdMutex<usize>,
    zero: Condvar,
    /// The longest a link waits for its count to drain: the communicator's timeout.
    limit: Duration,
}

/// The [`Unacked`] counts of every link of this process, for the exit hook.
static EVERY_LINK: StdMutex<Vec<Weak<Unacked>>> = StdMutex::new(Vec::new());

/// At process exit: waits until every link's peer acknowledged what it was
/// sent, each link as [`Unacked::drain`] does, counted from the hook's start.
/// The QUIC runtime's thread still runs while exit hooks do.
extern "C" fn flush_at_exit() {
    let links: Vec<Arc<Unacked>> = EVERY_LINK
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .filter_map(Weak::upgrade)
        .collect();
    let start = Instant::now();
    for unacked in links {
        unacked.drain(start);
    }
}

impl Unacked {
    /// A count of a new link, known to the exit hook (registered with the first).
    fn registered(limit: Duration) -> Arc<Unacked> {
        static AT_EXIT: std::sync::Once = std::sync::Once::new();
        // SAFETY: registers a function that takes nothing and returns
        // nothing, as atexit expects.
        AT_EXIT.call_once(|| unsafe {
            libc::atexit(flush_at_exit);
        });
        let unacked = Arc::new(Unacked {
            count: StdMutex::new(0),
            zero: Condvar::new(),
            limit,
        });
        let mut all = EVERY_LINK.lock().unwrap_or_else(|e| e.into_inner());
        all.retain(|w| w.strong_count() > 0);
        all.push(Arc::downgrade(&unacked));
        unacked
    }

    fn add(&self) {
        *self.count.lock().unwrap_or_else(|e| e.into_inner()) += 1;
    }

    fn done(&self) {
        let mut n = self.count.lock().unwrap_or_else(|e| e.into_inner());
        *n = n.saturating_sub(1);
        if *n == 0 {
            self.zero.notify_all();
        }
    }

    /// Waits (blocking) until the count is zero or `limit` after `start`
    /// passed; whether it is zero. Every stream counts until its peer
    /// acknowledged it or the connection ended, so a slow reader is waited
    /// for and a dead peer only until QUIC's idle timeout.
    fn drain(&self, start: Instant) -> bool {
        let left = start.checked_add(self.limit).map_or(self.limit, |end| {
            end.saturating_duration_since(Instant::now())
        });
        let n = self.count.lock().unwrap_or_else(|e| e.into_inner());
        let (n, _) = self
            .zero
            .wait_timeout_while(n, left, |n| *n > 0)
            .unwrap_or_else(|e| e.into_inner());
        *n == 0
    }
}

/// Writes one piece (after `prefix`, if any), copied into a buffer of
/// `pool`, and finishes its stream.
async fn send_piece(
    mut s: quinn::SendStream,
    pool: &Arc<PiecePool>,
    prefix: Option<[u8; HEADER_LEN]>,
    bytes: &[u8],
) -> std::result::Result<quinn::SendStream, WriteError> {
    let chunk = match &prefix {
        Some(p) => pool.bytes(&[p, bytes]),
        None => pool.bytes(&[bytes]),
    };
    s.write_chunk(chunk).await?;
    let _ = s.finish();
    Ok(s)
}

/// Why reading a piece failed.
enum PieceError {
    Read(ReadExactError),
    Reduce(Error),
}

impl From<ReadExactError> for PieceError {
    fn from(e: ReadExactError) -> PieceError {
        PieceError::Read(e)
    }
}

/// Reads one piece and the end of its stream (a stream dropped before its
/// end would tell the sender to stop).
async fn read_piece(
    mut s: quinn::RecvStream,
    buf: &mut [u8],
) -> std::result::Result<(), PieceError> {
    s.read_exact(buf).await?;
    read_end(s).await
}

/// Reads the end of a stream whose piece was read.
async fn read_end(mut s: quinn::RecvStream) -> std::result::Result<(), PieceError> {
    match s.read(&mut [0u8; 1]).await {
        Ok(None) => Ok(()),
        Ok(Some(_)) => Err(ReadExactError::FinishedEarly(usize::MAX).into()),
        Err(e) => Err(ReadExactError::ReadError(e).into()),
    }
}

/// Reads one piece in blocks of [`REDUCE_BLOCK`] bytes, each into a small
/// scratch buffer (aligned for every element type, and still in cache when
/// it is reduced), and reduces each into `into`, which lies `at` bytes into
/// the message; then the end of its stream.
async fn reduce_piece(
    mut s: quinn::RecvStream,
    into: &mut [u8],
    at: usize,
    reduction: &Reduction<'_>,
) -> std::result::Result<(), PieceError> {
    let mut scratch = vec![0u64; REDUCE_BLOCK.min(into.len()).div_ceil(8)];
    let scratch: &mut [u8] = bytemuck::cast_slice_mut(&mut scratch);
    let mut off = 0;
    while off < into.len() {
        let n = (into.len() - off).min(REDUCE_BLOCK);
        s.read_exact(&mut scratch[..n]).await?;
        reduction
            .apply(
                BufMut::from_host(&mut into[off..off + n]),
                at + off,
                BufRef::from_host(&scratch[..n]),
            )
            .map_err(PieceError::Reduce)?;
        off += n;
    }
    read_end(s).await
}

impl Link for QuicLink {
    fn rank(&self) -> usize {
        self.rank
    }

    fn peer(&self) -> usize {
        self.peer
    }

    fn send<'a>(&'a self, header: FrameHeader, data: BufRef<'a>) -> LinkFuture<'a, ()> {
        Box::pin(async move {
            let r = self.send_pieces(header, data.host()?).await;
            match r {
                Err(Error::Protocol { .. }) => {
                    Err(self.closed_error().unwrap_or_else(|| r.unwrap_err()))
                }
                r => r,
            }
        })
    }

    fn recv<'a>(&'a self, expect: FrameHeader, into: BufMut<'a>) -> LinkFuture<'a, ()> {
        Box::pin(async move { self.recv_pieces(expect, into.host()?, None).await })
    }

    /// Reduces each piece as it arrives, through a small scratch buffer,
    /// rather than receiving the whole message into scratch memory first.
    fn recv_reduce<'a>(
        &'a self,
        expect: FrameHeader,
        into: BufMut<'a>,
        reduction: Reduction<'a>,
    ) -> LinkFuture<'a, ()> {
        Box::pin(async move {
            let local = reduction.local.map(BufRef::host).transpose()?;
            let into = into.host()?;
            reduction.check_host(into, local, self.peer)?;
            self.recv_pieces(expect, into, Some(&reduction)).await
        })
    }

    fn abort<'a>(&'a self, notice: &'a AbortNotice) -> LinkFuture<'a, ()> {
        Box::pin(async move {
            if self.aborted.swap(true, Ordering::AcqRel) {
                return Ok(());
            }
            let mut reason = notice.clone();
            let mut end = reason.reason.len().min(MAX_REASON);
            while !reason.reason.is_char_boundary(end) {
                end -= 1;
            }
            reason.reason.truncate(end);
            tracing::debug!(rank = self.rank, peer = self.peer, "aborting QUIC link");
            self.conn
                .close(VarInt::from_u32(ABORT_CODE), &reason.encode());
            Ok(())
        })
    }
}

impl Drop for QuicLink {
    /// Waits (blocking, see [`Unacked::drain`]) until the peer acknowledged
    /// everything this link sent, then closes the connection; the peer can
    /// still read what it received. Never called on the QUIC runtime's thread.
    fn drop(&mut self) {
        if !self.aborted.load(Ordering::Acquire) && !self.unacked.drain(Instant::now()) {
            tracing::debug!(
                rank = self.rank,
                peer = self.peer,
                "closing a QUIC link with data not acknowledged within the timeout"
            );
        }
        let stats = self.conn.stats();
        tracing::debug!(
            rank = self.rank,
            peer = self.peer,
            mtu = stats.path.current_mtu,
            sent_packets = stats.path.sent_packets,
            lost_packets = stats.path.lost_packets,
            window = stats.path.cwnd,
            congestion_events = stats.path.congestion_events,
            rtt = ?stats.path.rtt,
            "QUIC link closing"
        );
        self.conn.close(VarInt::from_u32(DONE_CODE), b"done");
        let _ = (&self.endpoint, self.comm);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn count(n: usize, limit: Duration) -> Arc<Unacked> {
        let unacked = Unacked::registered(limit);
        for _ in 0..n {
            unacked.add();
        }
        unacked
    }

    #[test]
    fn drain_waits_for_a_peer_that_reads_late() {
        // Nothing for 2.5 s (the receiver computes), then every ack at once:
        // longer than the 2 s the exit hook used to wait.
        let unacked = count(6, Duration::from_secs(30));
        let acks = Arc::clone(&unacked);
        let peer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(2500));
            for _ in 0..6 {
                acks.done();
            }
        });
        let start = Instant::now();
        assert!(unacked.drain(start));
        assert!(start.elapsed() >= Duration::from_millis(2500));
        peer.join().unwrap();
    }

    #[test]
    fn drain_stops_at_the_timeout() {
        let unacked = count(100, Duration::from_millis(900));
        let acks = Arc::clone(&unacked);
        let peer = std::thread::spawn(move || {
            for _ in 0..10 {
                std::thread::sleep(Duration::from_millis(200));
                acks.done();
            }
        });
        let start = Instant::now();
        assert!(!unacked.drain(start));
        let took = start.elapsed();
        assert!(
            took >= Duration::from_millis(900) && took < Duration::from_millis(1900),
            "{took:?}"
        );
        peer.join().unwrap();
    }

    #[test]
    fn drain_counts_the_timeout_from_the_start_it_is_given() {
        let unacked = count(1, Duration::from_millis(300));
        std::thread::sleep(Duration::from_millis(400));
        let at = Instant::now();
        assert!(!unacked.drain(at - Duration::from_millis(400)));
        assert!(at.elapsed() < Duration::from_millis(200));
    }
}
