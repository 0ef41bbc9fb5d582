//! The engine: one progress thread per communicator that runs its calls in
//! the order they were issued, each under a deadline.
//!
//! Collectives run one at a time, in issue order. Point-to-point transfers run
//! in lanes, one per (peer, direction), so that a receive posted before a send
//! does not block the send (as with MPI's `irecv`); within a lane they keep
//! their order. A collective first waits for every transfer issued before it.
//!
//! After any failure the communicator is broken: the rank that failed first
//! is recorded in the store (first writer wins), every peer is sent an abort
//! notice naming it (so that ranks waiting on a healthy peer learn the cause
//! at once, not at their deadline), the links are closed, and every later call
//! fails with [`Error::Broken`]. A rank that only sees a link close reads the
//! record, so it names the rank that failed rather than the messenger.

use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc, Mutex,
    },
    thread,
    time::Duration,
};

use ccl_algorithms::{execute, Call, IoBuffers, Schedule};
use ccl_core::{AbortNotice, AlignedBuf, Error, Link, Result, Store};
use tokio::sync::{mpsc, Notify};

/// How long aborting may spend telling the peers.
const ABORT_NOTICE_DEADLINE: Duration = Duration::from_secs(2);
/// How long aborting may spend on the store record of the first failure.
const ABORT_RECORD_DEADLINE: Duration = Duration::from_secs(2);
/// Store key (under the communicator's prefix) of the first failure.
const ABORT_KEY: &str = "abort";

/// One call, ready to run.
pub(crate) struct Job {
    pub schedule: Arc<Schedule>,
    pub call: Call,
    pub io: IoBuffers<'static>,
    pub deadline: Duration,
    /// For point-to-point transfers: the peer and whether this rank sends.
    pub lane: Option<(usize, bool)>,
    /// Receives the result once the schedule no longer touches `io`.
    pub done: Box<dyn FnOnce(Result<()>) + Send>,
}

/// State the progress thread shares with its lanes and with submitters.
struct Shared {
    rank: usize,
    links: Vec<Option<Arc<dyn Link>>>,
    store: Arc<dyn Store>,
    broken: Mutex<Option<Error>>,
    /// Point-to-point transfers queued or running.
    transfers: AtomicUsize,
    transfers_done: Notify,
}

impl Shared {
    fn broken(&self) -> Option<Error> {
        self.broken
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Runs one job to completion (or failure), breaking the communicator on error.
    async fn run(&self, job: Job, scratch: &mut AlignedBuf) {
        if let Some(cause) = self.broken() {
            return (job.done)(Err(Error::Broken {
                rank: self.rank,
                cause: cause.to_string(),
            }));
        }
        let rank = self.rank;
        let result = match tokio::time::timeout(
            job.deadline,
            execute(&job.schedule, job.io, &self.links, &job.call, scratch),
        )
        .await
        {
            Ok(r) => r,
            Err(_) => Err(Error::Timeout {
                context: format!("rank {rank}: {}", job.call.name()),
                what: "the other ranks (a rank did not make this call, or is stuck)".into(),
                after: job.deadline,
            }),
        };
        let result = match result {
            Err(e) => Err(self.attribute(e).await),
            ok => ok,
        };
        if let Err(e) = &result {
            let first = {
                let mut b = self.broken.lock().unwrap_or_else(|p| p.into_inner());
                let first = b.is_none();
                if first {
                    *b = Some(e.clone());
                }
                first
            };
            if first {
                tracing::error!(rank, "{e}");
                self.abort_links(e).await;
            }
        }
        (job.done)(result);
    }

    /// Records the first failure of the communicator in the store, or, if
    /// another rank recorded one and `e` only says that a link closed, blames
    /// the recorded rank instead of the messenger.
    async fn attribute(&self, e: Error) -> Error {
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
    async fn abort_links(&self, cause: &Error) {
        let notice = AbortNotice {
            failed_rank: cause.failed_rank().unwrap_or(self.rank) as u32,
            reason: cause.to_string(),
        };
        let all = futures::future::join_all(self.links.iter().flatten().map(|l| l.abort(&notice)));
        let _ = tokio::time::timeout(ABORT_NOTICE_DEADLINE, all).await;
    }

    async fn wait_for_transfers(&self) {
        loop {
            let notified = self.transfers_done.notified();
            let mut notified = std::pin::pin!(notified);
            notified.as_mut().enable();
            if self.transfers.load(Ordering::Acquire) == 0 {
                return;
            }
            notified.await;
        }
    }
}

/// The submitting side of a communicator's progress thread.
pub(crate) struct Engine {
    shared: Arc<Shared>,
    jobs: mpsc::UnboundedSender<Job>,
}

impl Engine {
    /// Starts the progress thread, which owns `runtime` and drives `links`.
    /// `store` is the communicator's own (prefixed) store.
    pub fn start(
        rank: usize,
        runtime: tokio::runtime::Runtime,
        links: Vec<Option<Arc<dyn Link>>>,
        store: Arc<dyn Store>,
    ) -> Result<Engine> {
        let (jobs, rx) = mpsc::unbounded_channel();
        let shared = Arc::new(Shared {
            rank,
            links,
            store,
            broken: Mutex::new(None),
            transfers: AtomicUsize::new(0),
            transfers_done: Notify::new(),
        });
        let state = shared.clone();
        thread::Builder::new()
            .name(format!("ccl-rank{rank}"))
            .spawn(move || runtime.block_on(progress(state, rx)))
            .map_err(|e| Error::io("starting the progress thread", e))?;
        Ok(Engine { shared, jobs })
    }

    /// Queues a job; it fails at once if the communicator is broken.
    pub fn submit(&self, job: Job) {
        let rank = self.shared.rank;
        if let Some(cause) = self.shared.broken() {
            return (job.done)(Err(Error::Broken {
                rank,
                cause: cause.to_string(),
            }));
        }
        if job.lane.is_some() {
            self.shared.transfers.fetch_add(1, Ordering::AcqRel);
        }
        if let Err(mpsc::error::SendError(job)) = self.jobs.send(job) {
            (job.done)(Err(Error::Broken {
                rank,
                cause: "the progress thread has stopped".into(),
            }));
        }
    }

    /// The error that broke the communicator, if any.
    pub fn broken_cause(&self) -> Option<Error> {
        self.shared.broken()
    }
}

async fn progress(shared: Arc<Shared>, mut jobs: mpsc::UnboundedReceiver<Job>) {
    let mut scratch = AlignedBuf::zeroed(0);
    let mut lanes: HashMap<(usize, bool), mpsc::UnboundedSender<Job>> = HashMap::new();
    while let Some(job) = jobs.recv().await {
        let Some(lane) = job.lane else {
            shared.wait_for_transfers().await;
            shared.run(job, &mut scratch).await;
            continue;
        };
        let tx = lanes.entry(lane).or_insert_with(|| {
            let (tx, mut rx) = mpsc::unbounded_channel::<Job>();
            let shared = shared.clone();
            tokio::spawn(async move {
                let mut scratch = AlignedBuf::zeroed(0);
                while let Some(job) = rx.recv().await {
                    shared.run(job, &mut scratch).await;
                    shared.transfers.fetch_sub(1, Ordering::AcqRel);
                    shared.transfers_done.notify_waiters();
                }
            });
            tx
        });
        if let Err(mpsc::error::SendError(job)) = tx.send(job) {
            (job.done)(Err(Error::Internal("a transfer lane stopped".into())));
            shared.transfers.fetch_sub(1, Ordering::AcqRel);
            shared.transfers_done.notify_waiters();
        }
    }
    // The communicator is gone: let queued transfers finish before the runtime stops.
    drop(lanes);
    shared.wait_for_transfers().await;
}
