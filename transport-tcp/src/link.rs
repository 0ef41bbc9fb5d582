//! The TCP link to one peer: one or more connected sockets.

use std::{
    future::Future,
    io::{self, IoSlice, IoSliceMut, Read},
    net::Shutdown,
    ops::Range,
    os::fd::{AsRawFd, BorrowedFd, RawFd},
    pin::Pin,
    sync::atomic::{AtomicBool, Ordering},
    task::{Context, Poll},
    time::Duration,
};

use ccl_core::{
    frame::{HEADER_LEN, MAX_ABORT_REASON},
    AbortNotice, AlignedBuf, BufMut, BufRef, Error, FrameHeader, FrameKind, Link, LinkFuture,
    Reduction, Repoll, Result,
};
use futures::future::try_join_all;
use socket2::SockRef;
use tokio::{
    io::AsyncWriteExt,
    net::{
        tcp::{OwnedReadHalf, OwnedWriteHalf},
        TcpStream,
    },
    sync::{Mutex, MutexGuard},
};

/// Messages of at least this many bytes are striped over all sockets of a link.
pub const STRIPE_MIN: usize = 64 * 1024;
/// Receive-and-reduce reads and reduces the payload in pieces of this many bytes.
pub const REDUCE_PIECE: usize = 256 * 1024;
/// Stripe and piece boundaries are multiples of this, so no element is split.
const ALIGN: usize = 64;
/// Header and payload are copied into one buffer and written at once up to this size.
const COALESCE_MAX: usize = 16 * 1024;
/// Reads of at most this many bytes ask the socket directly while the
/// runtime has not seen it readable (see [`Reader::read`]).
const DIRECT_READ_MAX: usize = 64 * 1024 + HEADER_LEN;
/// Frames of at most this many bytes are read together with up to this many
/// bytes that follow them on the socket (see [`Reader`]).
const READ_AHEAD: usize = 8 * 1024;
/// Bound on each step of an abort.
const ABORT_STEP: Duration = Duration::from_secs(1);
/// How long a failed send looks for an abort notice the peer left behind.
const PENDING_ABORT_WAIT: Duration = Duration::from_millis(200);

/// Writes `head`, then `data`, gathered into as few system calls as the
/// socket takes (`writev`): written one after the other, a large payload's
/// header left as a segment of its own, which the receiver may wake for
/// alone (2 ranks, 32 KiB allgather: two `sendto` per call).
async fn write_both(half: &mut OwnedWriteHalf, head: &[u8], data: &[u8]) -> io::Result<()> {
    let (mut head, mut data) = (head, data);
    while !head.is_empty() || !data.is_empty() {
        let n = half
            .write_vectored(&[IoSlice::new(head), IoSlice::new(data)])
            .await?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        let of_head = n.min(head.len());
        head = &head[of_head..];
        data = &data[n - of_head..];
    }
    Ok(())
}

struct ReadSide {
    reader: Reader,
    /// Where receive-and-reduce lands pieces; kept across calls.
    scratch: AlignedBuf,
}

struct WriteSide {
    half: OwnedWriteHalf,
    /// Header and payload of small messages, copied for a single write.
    coalesce: Vec<u8>,
}

struct Sock {
    rd: Mutex<ReadSide>,
    wr: Mutex<WriteSide>,
    /// The socket's descriptor, owned by the halves above; for shutting it down
    /// while a receive or send holds a half.
    fd: RawFd,
}

/// What [`TcpLink::write_now`] did with a frame.
enum WriteNow<'a> {
    /// The socket took the whole frame.
    Written,
    /// It took the first bytes (so many) of the frame held in the write
    /// side's coalesce buffer.
    Partly(MutexGuard<'a, WriteSide>, usize),
    /// Nothing: the frame is to be written the long way.
    Not,
}

/// The future of a send whose frame the socket took before the future was
/// made: it has no state, so boxing it allocates nothing.
struct Sent;

impl Future for Sent {
    type Output = Result<()>;

    fn poll(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Result<()>> {
        Poll::Ready(Ok(()))
    }
}

/// A link to one peer over `nsocks` TCP sockets.
pub(crate) struct TcpLink {
    rank: usize,
    peer: usize,
    comm: u64,
    socks: Vec<Sock>,
    /// Set while a send writes a frame; stays set if that send was dropped
    /// mid-frame, so that an abort does not write into the middle of a frame.
    mid_frame: AtomicBool,
    /// Set once this rank aborted the link.
    aborted: AtomicBool,
}

impl std::fmt::Debug for TcpLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "TcpLink({} -> {}, {} sockets)",
            self.rank,
            self.peer,
            self.socks.len()
        )
    }
}

/// The byte ranges of a `len`-byte payload that the `n` sockets of a link
/// carry: contiguous, in order, boundaries multiples of [`ALIGN`].
pub(crate) fn stripe_ranges(len: usize, n: usize) -> impl Iterator<Item = Range<usize>> {
    let chunk = len.div_ceil(n.max(1)).next_multiple_of(ALIGN);
    (0..n).map(move |i| {
        let start = i.saturating_mul(chunk).min(len);
        start..start.saturating_add(chunk).min(len)
    })
}

fn split_stripes_mut(mut buf: &mut [u8], n: usize) -> Vec<&mut [u8]> {
    let mut parts = Vec::with_capacity(n);
    for r in stripe_ranges(buf.len(), n) {
        let (part, rest) = std::mem::take(&mut buf).split_at_mut(r.len());
        parts.push(part);
        buf = rest;
    }
    parts
}

fn split_stripes(buf: &[u8], n: usize) -> Vec<&[u8]> {
    stripe_ranges(buf.len(), n).map(|r| &buf[r]).collect()
}

/// The read half of a socket and the bytes read from it past the frame
/// being received.
///
/// A read for a frame of at most [`READ_AHEAD`] bytes asks the socket for
/// up to [`READ_AHEAD`] bytes more, in a third buffer of the same `readv`:
/// where the sender is ahead (a broadcast's root, a pipeline), one system
/// call takes several frames, and the reads that follow take them from
/// memory. The bytes past the frame land in the buffers of the reads after
/// it in stream order, so every read on the socket goes through here.
struct Reader {
    half: OwnedReadHalf,
    ahead: Box<[u8]>,
    /// `ahead[start..end]` holds the bytes read ahead and not yet taken.
    start: usize,
    end: usize,
}

impl Reader {
    fn new(half: OwnedReadHalf) -> Reader {
        Reader {
            half,
            ahead: vec![0; READ_AHEAD].into_boxed_slice(),
            start: 0,
            end: 0,
        }
    }

    /// Fills a prefix of `a`, then of `b`, and returns how many bytes it
    /// wrote there (0: the peer closed the stream): from the bytes read
    /// ahead where there are some, else with one `readv`, waiting for the
    /// socket to become readable.
    ///
    /// On a repoll ([`Repoll`]: the caller polls again at once, without the
    /// runtime), a read of at most [`DIRECT_READ_MAX`] bytes asks the socket
    /// directly (one more `readv`) where the runtime has not seen it readable
    /// since a read found it empty: a small message is then seen as soon as
    /// it lands, not at the runtime's next look at the sockets. Larger reads
    /// wait for the runtime: polling the socket of a bulk transfer takes its
    /// lock from the kernel's delivery of the peer's segments.
    async fn read(&mut self, a: &mut [u8], b: &mut [u8]) -> io::Result<usize> {
        if self.start < self.end {
            let mut taken = 0;
            for to in [a, b] {
                let n = to.len().min(self.end - self.start);
                to[..n].copy_from_slice(&self.ahead[self.start..self.start + n]);
                self.start += n;
                taken += n;
            }
            return Ok(taken);
        }
        let want = a.len() + b.len();
        let ahead_len = if want <= READ_AHEAD {
            self.ahead.len()
        } else {
            0
        };
        let direct = want <= DIRECT_READ_MAX;
        let (half, ahead) = (&self.half, &mut self.ahead[..ahead_len]);
        let again = |e: &io::Error| {
            matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
            )
        };
        let got = std::future::poll_fn(|cx| loop {
            let mut bufs = [
                IoSliceMut::new(&mut *a),
                IoSliceMut::new(&mut *b),
                IoSliceMut::new(&mut *ahead),
            ];
            match half.try_read_vectored(&mut bufs) {
                Err(e) if again(&e) => {}
                r => return Poll::Ready(r),
            }
            if Repoll::is(cx) {
                if !direct {
                    return Poll::Pending;
                }
                // No readiness registered: the real poll that follows does that.
                return match (&*SockRef::from(half.as_ref())).read_vectored(&mut bufs) {
                    Err(e) if again(&e) => Poll::Pending,
                    r => Poll::Ready(r),
                };
            }
            match half.as_ref().poll_read_ready(cx) {
                Poll::Ready(Ok(())) => {}
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            }
        })
        .await?;
        self.start = 0;
        self.end = got.saturating_sub(want);
        Ok(got - self.end)
    }
}

fn eof() -> io::Error {
    io::Error::new(io::ErrorKind::UnexpectedEof, "connection closed")
}

impl TcpLink {
    /// A link over `streams` (socket `i` at index `i`), all connected to `peer`.
    pub(crate) fn new(rank: usize, peer: usize, comm: u64, streams: Vec<TcpStream>) -> TcpLink {
        assert!(!streams.is_empty(), "a link needs at least one socket");
        let socks = streams
            .into_iter()
            .map(|s| {
                let fd = s.as_raw_fd();
                let (rd, wr) = s.into_split();
                Sock {
                    rd: Mutex::new(ReadSide {
                        reader: Reader::new(rd),
                        scratch: AlignedBuf::zeroed(0),
                    }),
                    wr: Mutex::new(WriteSide {
                        half: wr,
                        coalesce: Vec::new(),
                    }),
                    fd,
                }
            })
            .collect();
        TcpLink {
            rank,
            peer,
            comm,
            socks,
            mid_frame: AtomicBool::new(false),
            aborted: AtomicBool::new(false),
        }
    }

    fn striped(&self, len: usize) -> bool {
        self.socks.len() > 1 && len >= STRIPE_MIN
    }

    /// The error for a failed read or write on an established socket.
    fn lost(&self, e: io::Error) -> Error {
        let what = match e.kind() {
            io::ErrorKind::UnexpectedEof => "connection closed".to_string(),
            _ => e.to_string(),
        };
        let aborted = self.aborted.load(Ordering::Acquire);
        Error::peer_lost(self.rank, self.peer, what, aborted)
    }

    fn protocol(&self, msg: String) -> Error {
        Error::protocol(self.rank, self.peer, msg)
    }

    /// Reads a frame header, landing any payload bytes that arrive with it in
    /// `first` (at most `first.len()`: never past the expected frame), and
    /// checks it against `expect`. Returns how many bytes of `first` hold payload.
    async fn read_head(
        &self,
        rd: &mut Reader,
        expect: &FrameHeader,
        first: &mut [u8],
    ) -> Result<usize> {
        let mut head = [0u8; HEADER_LEN];
        let mut have = 0;
        let extra = loop {
            let n = rd
                .read(&mut head[have..], &mut *first)
                .await
                .map_err(|e| self.lost(e))?;
            if n == 0 {
                return Err(self.lost(eof()));
            }
            if have + n >= HEADER_LEN {
                break have + n - HEADER_LEN;
            }
            have += n;
        };
        let got = FrameHeader::decode(&head).map_err(|m| self.protocol(m))?;
        if got.kind == FrameKind::Abort {
            return Err(self.read_abort(rd, &got, &first[..extra]).await);
        }
        expect.check_received(&got, self.rank, self.peer)?;
        Ok(extra)
    }

    /// Reads the rest of an abort frame whose payload starts with `already`.
    async fn read_abort(&self, rd: &mut Reader, got: &FrameHeader, already: &[u8]) -> Error {
        let limit = MAX_ABORT_REASON + 4;
        if got.len > limit as u64 {
            return self.protocol(format!(
                "abort frame of {} bytes (at most {limit})",
                got.len
            ));
        }
        let len = got.len as usize;
        let mut payload = vec![0u8; len];
        let have = already.len().min(len);
        payload[..have].copy_from_slice(&already[..have]);
        let mut filled = have;
        while filled < len {
            match rd.read(&mut payload[filled..], &mut []).await {
                Ok(0) => return self.lost(eof()),
                Ok(n) => filled += n,
                Err(e) => return self.lost(e),
            }
        }
        match AbortNotice::decode(&payload) {
            Ok(notice) => notice.into_error(self.rank, self.peer),
            Err(m) => self.protocol(m),
        }
    }

    /// After a failed send: the peer may have said why it left before closing.
    /// Reads an abort notice waiting on socket 0, unless a receive holds it or
    /// what waits there is not an abort frame; otherwise returns `fallback`.
    async fn pending_abort(&self, fallback: Error) -> Error {
        let Ok(mut guard) = self.socks[0].rd.try_lock() else {
            return fallback;
        };
        let rd = &mut guard.reader;
        let read = async {
            let mut head = [0u8; HEADER_LEN];
            let mut have = 0;
            while have < HEADER_LEN {
                match rd.read(&mut head[have..], &mut []).await {
                    Ok(n) if n > 0 => have += n,
                    _ => return None,
                }
            }
            let got = FrameHeader::decode(&head)
                .ok()
                .filter(|h| h.kind == FrameKind::Abort)?;
            Some(self.read_abort(rd, &got, &[]).await)
        };
        match tokio::time::timeout(PENDING_ABORT_WAIT, read).await {
            Ok(Some(e @ Error::PeerLost { .. })) => e,
            _ => fallback,
        }
    }

    async fn send_frame(&self, header: FrameHeader, data: &[u8]) -> Result<()> {
        self.told_why(self.write_frame(header, data).await).await
    }

    /// A send's result, with the peer's own reason where it was lost and
    /// left one ([`Self::pending_abort`]).
    async fn told_why(&self, sent: Result<()>) -> Result<()> {
        match sent {
            Err(e @ Error::PeerLost { .. }) => Err(self.pending_abort(e).await),
            r => r,
        }
    }

    /// Writes a small frame at once, on the caller's thread, where the
    /// write side is free and the socket takes it: without the future of
    /// [`Self::send_frame`], its allocation and the async mutex's
    /// acquisition. Where the socket took part of it, the rest is the
    /// caller's to write ([`Self::write_rest`]).
    fn write_now(&self, header: &FrameHeader, data: &[u8]) -> WriteNow<'_> {
        if header.len != data.len() as u64
            || HEADER_LEN + data.len() > COALESCE_MAX
            || self.striped(data.len())
        {
            return WriteNow::Not;
        }
        let Ok(mut guard) = self.socks[0].wr.try_lock() else {
            return WriteNow::Not;
        };
        let WriteSide { half, coalesce } = &mut *guard;
        coalesce.clear();
        coalesce.extend_from_slice(&header.encode());
        coalesce.extend_from_slice(data);
        // Nothing written (a full socket, or an error, which the long way
        // meets again and reports) leaves the frame to the long way.
        match half.try_write(coalesce) {
            Ok(n) if n == coalesce.len() => {
                self.mid_frame.store(false, Ordering::Release);
                WriteNow::Written
            }
            Ok(n) if n > 0 => {
                self.mid_frame.store(true, Ordering::Release);
                WriteNow::Partly(guard, n)
            }
            _ => WriteNow::Not,
        }
    }

    /// Writes the rest of the frame in `guard`'s coalesce buffer, of which
    /// the socket took the first `written` bytes ([`Self::write_now`]).
    async fn write_rest(&self, mut guard: MutexGuard<'_, WriteSide>, written: usize) -> Result<()> {
        let WriteSide { half, coalesce } = &mut *guard;
        half.write_all(&coalesce[written..])
            .await
            .map_err(|e| self.lost(e))?;
        self.mid_frame.store(false, Ordering::Release);
        Ok(())
    }

    async fn write_frame(&self, header: FrameHeader, data: &[u8]) -> Result<()> {
        if header.len != data.len() as u64 {
            return Err(Error::Internal(format!(
                "send to rank {}: header says {} bytes, payload has {}",
                self.peer,
                header.len,
                data.len()
            )));
        }
        let head = header.encode();
        if !self.striped(data.len()) {
            let mut guard = self.socks[0].wr.lock().await;
            let WriteSide { half, coalesce } = &mut *guard;
            self.mid_frame.store(true, Ordering::Release);
            let written = if HEADER_LEN + data.len() <= COALESCE_MAX {
                coalesce.clear();
                coalesce.extend_from_slice(&head);
                coalesce.extend_from_slice(data);
                half.write_all(coalesce).await
            } else {
                write_both(half, &head, data).await
            };
            written.map_err(|e| self.lost(e))?;
            self.mid_frame.store(false, Ordering::Release);
            return Ok(());
        }
        let mut guards = Vec::with_capacity(self.socks.len());
        for s in &self.socks {
            guards.push(s.wr.lock().await);
        }
        self.mid_frame.store(true, Ordering::Release);
        let head = &head;
        try_join_all(
            guards
                .iter_mut()
                .zip(split_stripes(data, self.socks.len()))
                .map(|(g, part)| write_both(&mut g.half, head, part)),
        )
        .await
        .map_err(|e| self.lost(e))?;
        self.mid_frame.store(false, Ordering::Release);
        Ok(())
    }

    fn check_len(&self, expect: &FrameHeader, len: usize) -> Result<()> {
        if expect.len != len as u64 {
            return Err(Error::Internal(format!(
                "receive from rank {}: expected header says {} bytes, buffer has {len}",
                self.peer, expect.len
            )));
        }
        Ok(())
    }

    async fn recv_frame(&self, expect: FrameHeader, into: &mut [u8]) -> Result<()> {
        self.check_len(&expect, into.len())?;
        if !self.striped(into.len()) {
            return self.recv_stripe(0, &expect, into).await;
        }
        let expect = &expect;
        try_join_all(
            split_stripes_mut(into, self.socks.len())
                .into_iter()
                .enumerate()
                .map(|(i, part)| self.recv_stripe(i, expect, part)),
        )
        .await?;
        Ok(())
    }

    async fn recv_stripe(&self, i: usize, expect: &FrameHeader, part: &mut [u8]) -> Result<()> {
        let mut guard = self.socks[i].rd.lock().await;
        let rd = &mut guard.reader;
        let n = self.read_head(rd, expect, part).await?;
        let mut filled = n;
        while filled < part.len() {
            match rd.read(&mut part[filled..], &mut []).await {
                Ok(0) => return Err(self.lost(eof())),
                Ok(n) => filled += n,
                Err(e) => return Err(self.lost(e)),
            }
        }
        Ok(())
    }

    async fn recv_reduce_frame(
        &self,
        expect: FrameHeader,
        into: &mut [u8],
        reduction: Reduction<'_>,
    ) -> Result<()> {
        self.check_len(&expect, into.len())?;
        let local = reduction.local.map(BufRef::host).transpose()?;
        reduction.check_host(into, local, self.peer)?;
        if !self.striped(into.len()) {
            return self
                .reduce_stripe(0, &expect, into, local, &reduction)
                .await;
        }
        let n = self.socks.len();
        let locals: Vec<Option<&[u8]>> = match local {
            Some(l) => split_stripes(l, n).into_iter().map(Some).collect(),
            None => vec![None; n],
        };
        let (expect, reduction) = (&expect, &reduction);
        try_join_all(
            split_stripes_mut(into, n)
                .into_iter()
                .zip(locals)
                .enumerate()
                .map(|(i, (part, local))| self.reduce_stripe(i, expect, part, local, reduction)),
        )
        .await?;
        Ok(())
    }

    async fn reduce_stripe(
        &self,
        i: usize,
        expect: &FrameHeader,
        part: &mut [u8],
        local: Option<&[u8]>,
        reduction: &Reduction<'_>,
    ) -> Result<()> {
        let mut guard = self.socks[i].rd.lock().await;
        let ReadSide { reader, scratch } = &mut *guard;
        let first = part.len().min(REDUCE_PIECE);
        scratch.reserve_len(first);
        let scratch = scratch.as_mut_slice();
        let mut filled = self
            .read_head(reader, expect, &mut scratch[..first])
            .await?;
        let mut off = 0;
        while off < part.len() {
            let piece = (part.len() - off).min(REDUCE_PIECE);
            while filled < piece {
                match reader.read(&mut scratch[filled..piece], &mut []).await {
                    Ok(0) => return Err(self.lost(eof())),
                    Ok(n) => filled += n,
                    Err(e) => return Err(self.lost(e)),
                }
            }
            let r = off..off + piece;
            reduction.kernels.reduce(
                reduction.op,
                reduction.dtype,
                BufMut::from_host(&mut part[r.clone()]),
                local.map(|l| BufRef::from_host(&l[r])),
                BufRef::from_host(&scratch[..piece]),
            )?;
            off += piece;
            filled = 0;
        }
        Ok(())
    }

    async fn abort_link(&self, notice: &AbortNotice) -> Result<()> {
        if self.aborted.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        let mut frame = notice.header(self.comm).encode().to_vec();
        frame.extend_from_slice(&notice.encode());
        let told = tokio::time::timeout(ABORT_STEP, async {
            let mut guard = self.socks[0].wr.lock().await;
            if self.mid_frame.load(Ordering::Acquire) {
                return false;
            }
            guard.half.write_all(&frame).await.is_ok()
        })
        .await
        .unwrap_or(false);
        tracing::debug!(rank = self.rank, peer = self.peer, told, "aborting link");
        self.shutdown();
        Ok(())
    }

    /// Shuts every socket down in both directions: the peer and any local
    /// task blocked on the link see end-of-stream.
    fn shutdown(&self) {
        for s in &self.socks {
            // SAFETY: `s.fd` belongs to the stream whose halves `s` owns; they
            // live as long as `self`, so the descriptor is open here.
            let fd = unsafe { BorrowedFd::borrow_raw(s.fd) };
            let _ = socket2::SockRef::from(&fd).shutdown(Shutdown::Both);
        }
    }
}

impl Link for TcpLink {
    fn rank(&self) -> usize {
        self.rank
    }

    fn peer(&self) -> usize {
        self.peer
    }

    fn send<'a>(&'a self, header: FrameHeader, data: BufRef<'a>) -> LinkFuture<'a, ()> {
        match data.host() {
            Ok(data) => {
                match self.write_now(&header, data) {
                    WriteNow::Written => Box::pin(Sent),
                    WriteNow::Partly(guard, written) => Box::pin(async move {
                        self.told_why(self.write_rest(guard, written).await).await
                    }),
                    WriteNow::Not => Box::pin(self.send_frame(header, data)),
                }
            }
            Err(e) => Box::pin(std::future::ready(Err(e))),
        }
    }

    fn recv<'a>(&'a self, expect: FrameHeader, into: BufMut<'a>) -> LinkFuture<'a, ()> {
        match into.host() {
            Ok(into) => Box::pin(self.recv_frame(expect, into)),
            Err(e) => Box::pin(std::future::ready(Err(e))),
        }
    }

    fn recv_reduce<'a>(
        &'a self,
        expect: FrameHeader,
        into: BufMut<'a>,
        reduction: Reduction<'a>,
    ) -> LinkFuture<'a, ()> {
        match into.host() {
            Ok(into) => Box::pin(self.recv_reduce_frame(expect, into, reduction)),
            Err(e) => Box::pin(std::future::ready(Err(e))),
        }
    }

    fn abort<'a>(&'a self, notice: &'a AbortNotice) -> LinkFuture<'a, ()> {
        Box::pin(self.abort_link(notice))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ccl_core::{CollectiveKind, DataType, Fingerprint, ReduceOp, HOST_KERNELS};
    use tokio::{io::AsyncWriteExt, net::TcpListener};

    #[test]
    fn stripes_cover_payload_in_aligned_order() {
        for n in 1..=5 {
            for len in [
                0,
                1,
                63,
                64,
                65,
                4096,
                65536,
                65537,
                1 << 20,
                (4 << 20) + 13,
            ] {
                let rs: Vec<_> = stripe_ranges(len, n).collect();
                assert_eq!(rs.len(), n);
                let mut at = 0;
                for r in &rs {
                    assert_eq!(r.start, at);
                    assert!(r.start % ALIGN == 0 || r.start == len);
                    at = r.end;
                }
                assert_eq!(at, len);
            }
        }
    }

    /// A link on one end of a loopback connection and the raw stream at the other.
    async fn raw_pair() -> (TcpLink, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (a, b) = tokio::join!(TcpStream::connect(addr), listener.accept());
        (TcpLink::new(0, 1, 5, vec![a.unwrap()]), b.unwrap().0)
    }

    fn header(len: usize) -> FrameHeader {
        FrameHeader::data(
            5,
            0,
            0,
            len,
            Fingerprint::new(CollectiveKind::SendRecv, DataType::U8, len),
        )
    }

    /// A small message that lands between polls is read on a repoll, which
    /// asks the socket itself: the runtime never looks at the sockets here.
    #[tokio::test]
    async fn a_repoll_reads_a_small_message_without_the_runtime() {
        use std::{io::Write, task::Context};
        let (link, raw) = raw_pair().await;
        let mut into = [0u8; 8];
        let mut recv = link.recv(header(8), BufMut::from_host(&mut into));
        let waker = futures::task::noop_waker();
        let mut real = Context::from_waker(&waker);
        assert!(recv.as_mut().poll(&mut real).is_pending());
        let mut frame = header(8).encode().to_vec();
        frame.extend_from_slice(&[7; 8]);
        (&*SockRef::from(&raw)).write_all(&frame).unwrap();
        let repoll = Repoll::waker();
        let mut again = Context::from_waker(&repoll);
        let mut polls = 0;
        while recv.as_mut().poll(&mut again).is_pending() {
            polls += 1;
            assert!(polls < 2000, "no data after {polls} repolls");
            std::thread::sleep(Duration::from_millis(1));
        }
        drop(recv);
        assert_eq!(into, [7; 8]);
    }

    /// A payload far above what the socket takes at once goes out in many
    /// partial writes of header and payload gathered together: the other
    /// end reads the header, then every byte in order.
    #[tokio::test]
    async fn a_large_frame_survives_partial_writes() {
        tokio::time::timeout(Duration::from_secs(20), async {
            let (link, mut raw) = raw_pair().await;
            let len = (3 << 20) + 7;
            let data: Vec<u8> = (0..len).map(|i| (i % 253) as u8).collect();
            let reader = async {
                use tokio::io::AsyncReadExt;
                let mut got = Vec::with_capacity(HEADER_LEN + len);
                let mut piece = vec![0u8; 4096];
                while got.len() < HEADER_LEN + len {
                    let n = raw.read(&mut piece).await.unwrap();
                    assert!(n > 0, "EOF after {} bytes", got.len());
                    got.extend_from_slice(&piece[..n]);
                    if got.len() % 64 == 0 {
                        tokio::task::yield_now().await;
                    }
                }
                got
            };
            let (sent, got) =
                tokio::join!(link.send(header(len), BufRef::from_host(&data)), reader);
            sent.unwrap();
            assert_eq!(got[..HEADER_LEN], header(len).encode());
            assert!(got[HEADER_LEN..] == data[..], "the payload arrived changed");
        })
        .await
        .unwrap();
    }

    /// A small frame on an idle link is on the wire when `send` returns,
    /// before its future is polled, and that future holds nothing (boxing
    /// it allocated nothing).
    #[tokio::test]
    async fn a_small_send_on_an_idle_link_is_written_at_once() {
        use std::io::Read;
        let (link, raw) = raw_pair().await;
        let data = [9u8; 24];
        let sent = link.send(header(24), BufRef::from_host(&data));
        assert_eq!(
            std::mem::size_of_val(&*sent),
            0,
            "the send took the long way"
        );
        let mut got = [0u8; HEADER_LEN + 24];
        let mut raw = raw.into_std().unwrap();
        raw.set_nonblocking(false).unwrap();
        raw.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        raw.read_exact(&mut got).unwrap();
        assert_eq!(got[..HEADER_LEN], header(24).encode());
        assert_eq!(got[HEADER_LEN..], data);
        sent.await.unwrap();
    }

    /// Small frames sent back to back while the other end reads slowly
    /// fill the socket: some are written at once, some in part at once and
    /// the rest later, some the long way. All arrive whole and in order.
    #[tokio::test]
    async fn small_frames_through_a_full_socket_arrive_whole() {
        tokio::time::timeout(Duration::from_secs(20), async {
            let (link, mut raw) = raw_pair().await;
            let len = COALESCE_MAX - HEADER_LEN - 3;
            let frames = 400;
            let payload =
                |f: usize| -> Vec<u8> { (0..len).map(|i| ((f * 7 + i) % 251) as u8).collect() };
            let writer = async {
                for f in 0..frames {
                    let data = payload(f);
                    link.send(header(len), BufRef::from_host(&data))
                        .await
                        .unwrap();
                }
            };
            let reader = async {
                use tokio::io::AsyncReadExt;
                let total = frames * (HEADER_LEN + len);
                let mut got = Vec::with_capacity(total);
                let mut piece = vec![0u8; 4096];
                tokio::time::sleep(Duration::from_millis(50)).await;
                while got.len() < total {
                    let n = raw.read(&mut piece).await.unwrap();
                    assert!(n > 0, "EOF after {} bytes", got.len());
                    got.extend_from_slice(&piece[..n]);
                    tokio::task::yield_now().await;
                }
                got
            };
            let ((), got) = tokio::join!(writer, reader);
            for (f, frame) in got.chunks(HEADER_LEN + len).enumerate() {
                assert_eq!(
                    frame[..HEADER_LEN],
                    header(len).encode(),
                    "frame {f}'s header"
                );
                assert!(
                    frame[HEADER_LEN..] == payload(f)[..],
                    "frame {f}'s payload changed"
                );
            }
        })
        .await
        .unwrap();
    }

    /// Frames written back to back, cut into writes at arbitrary places,
    /// arrive whole and in order through receives and receive-and-reduces
    /// of sizes around the read-ahead buffer's: what one read takes past its
    /// frame begins the next.
    #[tokio::test]
    async fn frames_read_ahead_arrive_whole_and_in_order() {
        tokio::time::timeout(Duration::from_secs(20), async {
            let (link, mut raw) = raw_pair().await;
            let mut seed = 0x2545_f491_4f6c_dd1du64;
            let mut next = move |m: usize| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                (seed % m as u64) as usize
            };
            let floats = [16, READ_AHEAD / 4 + 16, 3 * READ_AHEAD / 4];
            let counts: Vec<usize> = (0..300).map(|i| next(floats[i % 3])).collect();
            let head = |seq: usize, count: usize| {
                FrameHeader::data(
                    5,
                    seq as u64,
                    0,
                    4 * count,
                    Fingerprint::new(CollectiveKind::SendRecv, DataType::F32, count),
                )
            };
            let payload = |seq: usize, count: usize| -> Vec<u8> {
                (0..count)
                    .flat_map(|i| (((seq + i) % 1000) as f32).to_le_bytes())
                    .collect()
            };
            let mut stream = Vec::new();
            for (seq, &count) in counts.iter().enumerate() {
                stream.extend_from_slice(&head(seq, count).encode());
                stream.extend_from_slice(&payload(seq, count));
            }
            let cuts: Vec<usize> = (0..stream.len())
                .map(|_| 1 + next(3 * READ_AHEAD))
                .collect();
            let writer = async {
                let mut at = 0;
                for cut in cuts {
                    let end = (at + cut).min(stream.len());
                    raw.write_all(&stream[at..end]).await.unwrap();
                    tokio::task::yield_now().await;
                    at = end;
                    if at == stream.len() {
                        break;
                    }
                }
            };
            let reader = async {
                for (seq, &count) in counts.iter().enumerate() {
                    let mut into = AlignedBuf::zeroed(4 * count);
                    let want = payload(seq, count);
                    if seq % 2 == 1 {
                        let into = &mut into.as_mut_slice()[..4 * count];
                        link.recv(head(seq, count), BufMut::from_host(into))
                            .await
                            .unwrap();
                        assert!(*into == want[..], "frame {seq} of {count} floats changed");
                        continue;
                    }
                    let into = &mut into.as_mut_slice()[..4 * count];
                    into.copy_from_slice(&[1f32.to_le_bytes(); 1].repeat(count).concat());
                    let red = Reduction {
                        op: ReduceOp::Sum,
                        dtype: DataType::F32,
                        local: None,
                        kernels: &HOST_KERNELS,
                    };
                    link.recv_reduce(head(seq, count), BufMut::from_host(into), red)
                        .await
                        .unwrap();
                    for (i, (got, sent)) in into.chunks(4).zip(want.chunks(4)).enumerate() {
                        let (got, sent) = (
                            f32::from_le_bytes(got.try_into().unwrap()),
                            f32::from_le_bytes(sent.try_into().unwrap()),
                        );
                        assert_eq!(got, sent + 1.0, "frame {seq}, element {i}");
                    }
                }
            };
            tokio::join!(writer, reader);
        })
        .await
        .unwrap();
    }

    /// An abort notice read ahead with a frame ends the next receive, with
    /// the notice's reason.
    #[tokio::test]
    async fn an_abort_notice_read_ahead_ends_the_next_receive() {
        tokio::time::timeout(Duration::from_secs(5), async {
            let (link, mut raw) = raw_pair().await;
            let notice = AbortNotice {
                failed_rank: 1,
                reason: "out of memory".into(),
            };
            let mut bytes = header(8).encode().to_vec();
            bytes.extend_from_slice(&[3; 8]);
            bytes.extend_from_slice(&notice.header(5).encode());
            bytes.extend_from_slice(&notice.encode());
            raw.write_all(&bytes).await.unwrap();
            let mut into = [0u8; 8];
            link.recv(header(8), BufMut::from_host(&mut into))
                .await
                .unwrap();
            assert_eq!(into, [3; 8]);
            {
                let side = link.socks[0].rd.try_lock().unwrap();
                let held = side.reader.end - side.reader.start;
                assert_eq!(held, bytes.len() - HEADER_LEN - 8, "the notice was not read ahead");
            }
            let e = link
                .recv(header(8), BufMut::from_host(&mut into))
                .await
                .unwrap_err();
            assert!(
                matches!(&e, Error::PeerLost { peer: 1, cause, .. } if cause.contains("out of memory")),
                "{e}"
            );
        })
        .await
        .unwrap();
    }

    #[tokio::test]
    async fn garbage_is_a_protocol_error() {
        tokio::time::timeout(Duration::from_secs(5), async {
            let (link, mut raw) = raw_pair().await;
            raw.write_all(&[0xab; HEADER_LEN + 8]).await.unwrap();
            let mut into = [0u8; 8];
            let e = link
                .recv(header(8), BufMut::from_host(&mut into))
                .await
                .unwrap_err();
            assert!(
                matches!(
                    e,
                    Error::Protocol {
                        rank: 0,
                        peer: 1,
                        ..
                    }
                ),
                "{e}"
            );
        })
        .await
        .unwrap();
    }

    #[tokio::test]
    async fn oversized_abort_frame_is_refused_before_reading() {
        tokio::time::timeout(Duration::from_secs(5), async {
            let (link, mut raw) = raw_pair().await;
            let notice = AbortNotice {
                failed_rank: 1,
                reason: "x".into(),
            };
            let mut h = notice.header(5);
            h.len = 1 << 40;
            raw.write_all(&h.encode()).await.unwrap();
            let e = link
                .recv(header(0), BufMut::from_host(&mut []))
                .await
                .unwrap_err();
            assert!(matches!(e, Error::Protocol { .. }), "{e}");
        })
        .await
        .unwrap();
    }

    #[tokio::test]
    async fn eof_mid_frame_is_peer_lost() {
        tokio::time::timeout(Duration::from_secs(5), async {
            let (link, mut raw) = raw_pair().await;
            raw.write_all(&header(1000).encode()).await.unwrap();
            raw.write_all(&[1; 10]).await.unwrap();
            drop(raw);
            let mut into = vec![0u8; 1000];
            let e = link.recv(header(1000), BufMut::from_host(&mut into)).await.unwrap_err();
            assert!(matches!(&e, Error::PeerLost { peer: 1, cause, .. } if cause == "connection closed"), "{e}");
        })
        .await
        .unwrap();
    }

    #[tokio::test]
    async fn wrong_lengths_are_internal_errors() {
        let (link, _raw) = raw_pair().await;
        assert!(matches!(
            link.send(header(3), BufRef::from_host(&[1, 2])).await,
            Err(Error::Internal(_))
        ));
        assert!(matches!(
            link.recv(header(3), BufMut::from_host(&mut [0; 2])).await,
            Err(Error::Internal(_))
        ));
        let mut buf = AlignedBuf::zeroed(64);
        let red = Reduction {
            op: ReduceOp::Sum,
            dtype: DataType::F32,
            local: None,
            kernels: &HOST_KERNELS,
        };
        let mut h = header(6);
        h.fingerprint.dtype = DataType::F32;
        let e = link
            .recv_reduce(h, BufMut::from_host(&mut buf.as_mut_slice()[..6]), red)
            .await
            .unwrap_err();
        assert!(matches!(e, Error::Internal(_)), "{e}");
    }

    /// The future of each link op stays under 1 KiB: glibc serves larger
    /// requests from its large bins, and the first such request after small
    /// frees sorts its fast bins first (`malloc_consolidate`), which took
    /// 1–2 % of the CPU of a 2-rank 8 B allreduce over TCP while the future
    /// of `recv_reduce` was 1080 bytes.
    #[tokio::test]
    async fn link_op_futures_stay_small_allocations() {
        let (link, _raw) = raw_pair().await;
        let (data, mut into) = ([0u8; 8], [0u8; 8]);
        let red = Reduction {
            op: ReduceOp::Sum,
            dtype: DataType::F32,
            local: Some(BufRef::from_host(&data)),
            kernels: &HOST_KERNELS,
        };
        // With the write side held, a send takes the long way.
        let held = link.socks[0].wr.try_lock().unwrap();
        let send = std::mem::size_of_val(&*link.send(header(8), BufRef::from_host(&data)));
        drop(held);
        let recv = std::mem::size_of_val(&*link.recv(header(8), BufMut::from_host(&mut into)));
        let reduce = link.recv_reduce(header(8), BufMut::from_host(&mut into), red);
        let sizes = [
            ("send", send),
            ("recv", recv),
            ("recv_reduce", std::mem::size_of_val(&*reduce)),
        ];
        for (op, size) in sizes {
            assert!(size < 1000, "the future of {op} takes {size} bytes");
        }
    }
}
