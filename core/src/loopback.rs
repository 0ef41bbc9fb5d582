//! Links through this process's memory: one channel per direction. They
//! serve ranks that are threads of one process (a loopback transport), and
//! tests of anything that runs over links; with `rendezvous`, a send
//! completes only once the peer took the frame, as large messages over
//! shared memory do, so that a schedule whose receives wait in a cycle for
//! sends on the same pairs hangs instead of passing by luck.

use std::sync::Arc;

use futures::{
    channel::{mpsc, oneshot},
    lock::Mutex,
    StreamExt,
};

use crate::{AbortNotice, BufMut, BufRef, Error, FrameHeader, FrameKind, Link, LinkFuture};

/// A frame, and on a rendezvous link the sender's wait for it to be taken.
type Frame = (FrameHeader, Vec<u8>, Option<oneshot::Sender<()>>);

/// One end of a link through memory.
struct LoopbackLink {
    rank: usize,
    peer: usize,
    rendezvous: bool,
    tx: mpsc::UnboundedSender<Frame>,
    rx: Mutex<mpsc::UnboundedReceiver<Frame>>,
}

impl LoopbackLink {
    fn lost(&self) -> Error {
        let cause = "its end of the loopback link is gone";
        Error::peer_lost(self.rank, self.peer, cause, false)
    }

    fn protocol(&self, msg: String) -> Error {
        Error::protocol(self.rank, self.peer, msg)
    }
}

impl Link for LoopbackLink {
    fn rank(&self) -> usize {
        self.rank
    }

    fn peer(&self) -> usize {
        self.peer
    }

    fn send<'a>(&'a self, header: FrameHeader, data: BufRef<'a>) -> LinkFuture<'a, ()> {
        Box::pin(async move {
            let data = data.host()?;
            if header.len != data.len() as u64 {
                return Err(Error::Internal(format!(
                    "a header of {} bytes for {} bytes of data",
                    header.len,
                    data.len()
                )));
            }
            let (taken_tx, taken) = if self.rendezvous {
                let (tx, rx) = oneshot::channel();
                (Some(tx), Some(rx))
            } else {
                (None, None)
            };
            self.tx
                .unbounded_send((header, data.to_vec(), taken_tx))
                .map_err(|_| self.lost())?;
            if let Some(taken) = taken {
                taken.await.map_err(|_| self.lost())?;
            }
            Ok(())
        })
    }

    fn recv<'a>(&'a self, expect: FrameHeader, into: BufMut<'a>) -> LinkFuture<'a, ()> {
        Box::pin(async move {
            let into = into.host()?;
            let (h, data, taken) = self
                .rx
                .lock()
                .await
                .next()
                .await
                .ok_or_else(|| self.lost())?;
            if h.kind == FrameKind::Abort {
                let notice = AbortNotice::decode(&data).map_err(|m| self.protocol(m))?;
                return Err(notice.into_error(self.rank, self.peer));
            }
            expect.check_received(&h, self.rank, self.peer)?;
            if data.len() != into.len() {
                return Err(self.protocol(format!(
                    "{} bytes for a {}-byte receive",
                    data.len(),
                    into.len()
                )));
            }
            into.copy_from_slice(&data);
            if let Some(taken) = taken {
                let _ = taken.send(());
            }
            Ok(())
        })
    }

    fn abort<'a>(&'a self, notice: &'a AbortNotice) -> LinkFuture<'a, ()> {
        Box::pin(async move {
            let _ = self
                .tx
                .unbounded_send((notice.header(0), notice.encode(), None));
            self.tx.close_channel();
            Ok(())
        })
    }
}

/// A link between ranks `a` and `b`: `a`'s end and `b`'s end.
pub fn pair(a: usize, b: usize, rendezvous: bool) -> (Arc<dyn Link>, Arc<dyn Link>) {
    let (ab_tx, ab_rx) = mpsc::unbounded();
    let (ba_tx, ba_rx) = mpsc::unbounded();
    let end = |rank, peer, tx, rx| -> Arc<dyn Link> {
        Arc::new(LoopbackLink {
            rank,
            peer,
            rendezvous,
            tx,
            rx: Mutex::new(rx),
        })
    };
    (end(a, b, ab_tx, ba_rx), end(b, a, ba_tx, ab_rx))
}

/// Links between `n` ranks, every pair through memory: `[rank][peer]`
/// (`None` where rank and peer are the same).
pub fn mesh(n: usize, rendezvous: bool) -> Vec<Vec<Option<Arc<dyn Link>>>> {
    let mut links: Vec<Vec<Option<Arc<dyn Link>>>> = vec![vec![None; n]; n];
    for (a, b) in (0..n).flat_map(|a| (a + 1..n).map(move |b| (a, b))) {
        let (ab, ba) = pair(a, b, rendezvous);
        links[a][b] = Some(ab);
        links[b][a] = Some(ba);
    }
    links
}
