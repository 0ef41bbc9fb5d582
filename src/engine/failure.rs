//! What a failure does: the communicator breaks, the first failure is
//! recorded in the store (first writer wins), every peer is told, and the
//! links close. A rank that only sees a link close reads the record, so it
//! names the rank that failed rather than the messenger.

use std::{sync::atomic::Ordering, time::Duration};

use ccl_core::{AbortNotice, Error, Result};

use super::Shared;

/// How long aborting may spend telling the peers.
const ABORT_NOTICE_DEADLINE: Duration = Duration::from_secs(2);
/// How long aborting may spend on the store record of the first failure.
const ABORT_RECORD_DEADLINE: Duration = Duration::from_secs(2);
/// Store key (under the communicator's prefix) of the first failure.
const ABORT_KEY: &str = "abort";

impl Shared {
    /// The result a call reports: a failure first breaks the communicator
    /// (recorded in the store, every peer told).
    pub(super) async fn settle(&self, result: Result<()>) -> Result<()> {
        let rank = self.rank;
        let result = match result {
            Err(_) if self.abort_requested.load(Ordering::Acquire) => Err(self.aborted_error()),
            Err(e) => Err(self.attribute(e).await),
            ok => ok,
        };
        if let Err(e) = &result {
            let first = self.set_broken(e);
            if first {
                tracing::error!(rank, "{e}");
                self.abort_links(e).await;
            }
        }
        result
    }

    /// Records the first failure of the communicator in the store, or, if
    /// another rank recorded one (in the store, or as the lost peer's blame
    /// in the group's shared memory) and `e` only says that a link closed,
    /// blames the recorded rank instead of the messenger. If the store is gone and
    /// a rank's process served it, the error says so: that rank may be the
    /// one that failed first (or it gave up and exited since).
    async fn attribute(&self, e: Error) -> Error {
        // A peer that gave up left who it blamed in the group's shared
        // memory, readable after it exited and whether or not the store is.
        if let (
            Error::PeerLost {
                rank,
                peer,
                call,
                cause,
            },
            Some(group),
        ) = (&e, &self.group)
        {
            if let Some(first) = group.blame_of(*peer).filter(|b| b != peer && b != rank) {
                return Error::PeerLost {
                    rank: *rank,
                    peer: first,
                    call: call.clone(),
                    cause: format!("rank {peer} gave up because of it (seen here as: {cause})"),
                };
            }
        }
        let notice = AbortNotice {
            failed_rank: e.failed_rank().unwrap_or(self.rank) as u32,
            reason: e.to_string(),
        };
        let store = self.store.clone();
        let encoded = notice.encode();
        let record =
            tokio::task::spawn_blocking(move || store.compare_set(ABORT_KEY, None, &encoded));
        let recorded = match tokio::time::timeout(ABORT_RECORD_DEADLINE, record).await {
            Ok(Ok(Ok(bytes))) => AbortNotice::decode(&bytes).ok(),
            Ok(Ok(Err(Error::Store { .. }))) => {
                return match (e, self.store_host) {
                    (
                        Error::PeerLost {
                            rank,
                            peer,
                            call,
                            cause,
                        },
                        Some(host),
                    ) if host != peer && host != rank => Error::PeerLost {
                        rank,
                        peer,
                        call,
                        cause: format!(
                            "{cause} (the store, served by rank {host}'s process, is gone too: \
                             rank {host} may have failed first)"
                        ),
                    },
                    (e, _) => e,
                };
            }
            _ => None,
        };
        match (e, recorded) {
            (
                Error::PeerLost {
                    rank,
                    peer,
                    call,
                    cause,
                },
                Some(first),
            ) if first.failed_rank as usize != peer && first.failed_rank as usize != rank => {
                Error::PeerLost {
                    rank,
                    peer: first.failed_rank as usize,
                    call,
                    cause: format!(
                        "{} (seen here as: link to rank {peer}: {cause})",
                        first.reason
                    ),
                }
            }
            (e, _) => e,
        }
    }

    /// Tells every peer that this rank gives up and why, then closes the links.
    pub(super) async fn abort_links(&self, cause: &Error) {
        let notice = AbortNotice {
            failed_rank: cause.failed_rank().unwrap_or(self.rank) as u32,
            reason: cause.to_string(),
        };
        if let Some(group) = &self.group {
            group.abort(notice.failed_rank as usize);
        }
        let all = futures::future::join_all(self.links.iter().flatten().map(|l| l.abort(&notice)));
        let _ = tokio::time::timeout(ABORT_NOTICE_DEADLINE, all).await;
    }
}
