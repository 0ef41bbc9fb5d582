//! Links through memory for the schedule tests: one unbounded channel per
//! direction, optionally with rendezvous sends (complete once taken).

use std::sync::Arc;

use ccl_core::{AbortNotice, BufMut, BufRef, Error, FrameHeader, FrameKind, Link, LinkFuture};
use tokio::sync::{mpsc, oneshot, Mutex};

/// A frame, and on a rendezvous link the sender's wait for it to be taken.
type Frame = (FrameHeader, Vec<u8>, Option<oneshot::Sender<()>>);

/// A link through memory: one unbounded channel per direction.
pub(super) struct MemLink {
    rank: usize,
    peer: usize,
    /// Sends complete only once the peer has received the frame, as on
    /// shared memory for large messages: a schedule whose receives wait, in a
    /// cycle, for sends on the same pairs hangs here.
    rendezvous: bool,
    tx: mpsc::UnboundedSender<Frame>,
    rx: Mutex<mpsc::UnboundedReceiver<Frame>>,
}

impl MemLink {
    fn lost(&self) -> Error {
        Error::PeerLost {
            rank: self.rank,
            peer: self.peer,
            call: String::new(),
            cause: "channel closed".into(),
        }
    }
}

impl Link for MemLink {
    fn rank(&self) -> usize {
        self.rank
    }
    fn peer(&self) -> usize {
        self.peer
    }
    fn send<'a>(&'a self, header: FrameHeader, data: BufRef<'a>) -> LinkFuture<'a, ()> {
        Box::pin(async move {
            let data = data.host()?;
            assert_eq!(header.len as usize, data.len());
            let (taken_tx, taken) = if self.rendezvous {
                let (tx, rx) = oneshot::channel();
                (Some(tx), Some(rx))
            } else {
                (None, None)
            };
            self.tx
                .send((header, data.to_vec(), taken_tx))
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
                .recv()
                .await
                .ok_or_else(|| self.lost())?;
            if h.kind == FrameKind::Abort {
                return Err(AbortNotice::decode(&data)
                    .unwrap()
                    .into_error(self.rank, self.peer));
            }
            expect.check_received(&h, self.rank, self.peer)?;
            into.copy_from_slice(&data);
            if let Some(taken) = taken {
                let _ = taken.send(());
            }
            Ok(())
        })
    }
    fn abort<'a>(&'a self, notice: &'a AbortNotice) -> LinkFuture<'a, ()> {
        Box::pin(async move {
            let _ = self.tx.send((notice.header(0), notice.encode(), None));
            Ok(())
        })
    }
}

/// Links between `n` ranks, all through memory: `[rank][peer]`.
pub(super) fn mesh(n: usize, rendezvous: bool) -> Vec<Vec<Option<Arc<dyn Link>>>> {
    let mut links: Vec<Vec<Option<Arc<dyn Link>>>> =
        (0..n).map(|_| (0..n).map(|_| None).collect()).collect();
    for a in 0..n {
        for b in a + 1..n {
            let (ab_tx, ab_rx) = mpsc::unbounded_channel();
            let (ba_tx, ba_rx) = mpsc::unbounded_channel();
            links[a][b] = Some(Arc::new(MemLink {
                rank: a,
                peer: b,
                rendezvous,
                tx: ab_tx,
                rx: Mutex::new(ba_rx),
            }));
            links[b][a] = Some(Arc::new(MemLink {
                rank: b,
                peer: a,
                rendezvous,
                tx: ba_tx,
                rx: Mutex::new(ab_rx),
            }));
        }
    }
    links
}
