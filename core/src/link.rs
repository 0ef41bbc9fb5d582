//! The `Link` trait: a reliable, ordered, framed channel to one peer.

use std::{future::Future, pin::Pin};

use crate::{AbortNotice, BufMut, BufRef, DataType, FrameHeader, Kernels, ReduceOp, Result};

/// A boxed future returned by [`Link`] methods.
pub type LinkFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T>> + Send + 'a>>;

/// What to reduce a received payload with: `into = local ⊕ received`
/// (`local` defaults to `into` itself), by the kernels of the call's memory.
#[derive(Clone, Copy)]
pub struct Reduction<'a> {
    pub op: ReduceOp,
    pub dtype: DataType,
    pub local: Option<BufRef<'a>>,
    pub kernels: &'a dyn Kernels,
}

impl Reduction<'_> {
    /// `into = local ⊕ received`, where `into` and `received` may be pieces
    /// of the whole and `local` is then the same piece of it, `at` bytes in.
    pub fn apply(&self, into: BufMut<'_>, at: usize, received: BufRef<'_>) -> Result<()> {
        let local = match self.local {
            None => None,
            Some(l) => Some(l.slice(at, into.len()).ok_or_else(|| {
                crate::Error::Internal(format!(
                    "reduction of bytes {at}..{} of a {}-byte local operand",
                    at + into.len(),
                    l.len()
                ))
            })?),
        };
        self.kernels
            .reduce(self.op, self.dtype, into, local, received)
    }

    /// Checks what the kernels would reject before any byte is read, so
    /// that a bad buffer fails without leaving a stream in the middle of a
    /// frame: `into` (and `local`, of the same length) must be whole,
    /// aligned elements. `peer` names the sender in the error.
    pub fn check_host(&self, into: &[u8], local: Option<&[u8]>, peer: usize) -> Result<()> {
        let size = self.dtype.size();
        let misaligned = |b: &[u8]| !b.is_empty() && b.as_ptr() as usize % size != 0;
        if into.len() % size != 0
            || misaligned(into)
            || local.is_some_and(|l| l.len() != into.len() || misaligned(l))
        {
            return Err(crate::Error::Internal(format!(
                "receive-and-reduce from rank {peer}: {} buffers of {} bytes (local: {:?}) are not whole, aligned {} elements",
                self.dtype,
                into.len(),
                local.map(<[u8]>::len),
                self.dtype
            )));
        }
        Ok(())
    }
}

impl std::fmt::Debug for Reduction<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Reduction({} on {} in {})",
            self.op,
            self.dtype,
            self.kernels.kind()
        )
    }
}

/// A reliable, ordered, bidirectional channel between this rank and one peer.
///
/// One `send` and one receive may be in flight at the same time (from the same
/// task, joined); two concurrent sends, or two concurrent receives, on one
/// link are not allowed. A receive names the header it expects and checks the
/// header that arrives against it (see [`FrameHeader::check_received`]); an
/// abort frame from the peer turns into [`crate::Error::PeerLost`] naming the
/// rank that failed first. Errors leave `call` empty; the caller fills it in.
///
/// Buffers carry where they live: a link that moves host memory only takes
/// their bytes with [`BufRef::host`], which refuses other memory clearly.
pub trait Link: Send + Sync {
    /// This rank.
    fn rank(&self) -> usize;

    /// The rank at the other end.
    fn peer(&self) -> usize;

    /// Sends one frame: `header` (whose `len` must equal `data.len()`) and `data`.
    fn send<'a>(&'a self, header: FrameHeader, data: BufRef<'a>) -> LinkFuture<'a, ()>;

    /// Receives one frame whose header must match `expect`, payload straight into `into`.
    fn recv<'a>(&'a self, expect: FrameHeader, into: BufMut<'a>) -> LinkFuture<'a, ()>;

    /// Receives one frame and reduces it into `into`.
    ///
    /// The default receives into scratch memory of `into`'s kind, then
    /// reduces; transports that can read the payload in place (shared
    /// memory) or in pieces (TCP) override it.
    fn recv_reduce<'a>(
        &'a self,
        expect: FrameHeader,
        mut into: BufMut<'a>,
        reduction: Reduction<'a>,
    ) -> LinkFuture<'a, ()> {
        Box::pin(async move {
            let mut scratch = reduction.kernels.alloc(into.len())?;
            self.recv(expect, scratch.buf_mut()).await?;
            reduction.apply(into.reborrow(), 0, scratch.buf())
        })
    }

    /// Whether [`Link::send`] and [`Link::recv`] take GPU memory as it is
    /// (GPUDirect RDMA, agreed by both ends at set-up): then a device
    /// transfer goes straight through the link instead of through pinned
    /// host memory. Both ends of a link answer alike.
    fn takes_device_memory(&self) -> bool {
        false
    }

    /// Best effort, bounded in time: tells the peer that this rank gives up and
    /// why, then closes the link so that nothing waits on it any more.
    fn abort<'a>(&'a self, notice: &'a AbortNotice) -> LinkFuture<'a, ()>;
}

impl std::fmt::Debug for dyn Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Link({} -> {})", self.rank(), self.peer())
    }
}
