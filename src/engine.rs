//! The engine: runs a communicator's calls in the order they were issued,
//! each under a deadline, on the communicator's own current-thread runtime.
//!
//! Whoever needs progress drives the runtime. A blocking call that finds
//! nothing queued runs inline on the caller's thread (no hand-off to another
//! thread, which on small messages costs as much as the network). Everything
//! else is queued for the progress thread, which drives the runtime while
//! there is queued work or a transfer in flight, and sleeps otherwise.
//!
//! Collectives run one at a time, in issue order. Point-to-point transfers run
//! in lanes, one per (peer, direction), so that a receive posted before a send
//! does not block the send (as with MPI's `irecv`); within a lane they keep
//! their order. A collective first waits for every transfer issued before it.
//!
//! While it waits for the network, the driving thread first polls without
//! sleeping for a short window ([`Polling`]): on small messages, sleeping in the
//! kernel and being woken costs more than the message itself.
//!
//! After any failure the communicator is broken: the rank that failed first
//! is recorded in the store (first writer wins), every peer is sent an abort
//! notice naming it (so that ranks waiting on a healthy peer learn the cause
//! at once, not at their deadline), the links are closed, and every later call
//! fails with [`Error::Broken`]. A rank that only sees a link close reads the
//! record, so it names the rank that failed rather than the messenger.

use std::{
    collections::{HashMap, VecDeque},
    future::Future,
    pin::{pin, Pin},
    sync::{
        atomic::{AtomicBool, AtomicUsize, Ordering},
        Arc, Condvar, Mutex, MutexGuard,
    },
    task::{Context, Poll},
    thread,
    time::{Duration, Instant},
};

use ccl_algorithms::{execute_within, Algorithm, Call, IoBuffers, Schedule, Spec};
use ccl_transport_shm::Board;

use crate::board::{announce, BoardCall};
use ccl_core::{
    frame::HEADER_LEN, poll_repolling, AbortNotice, AlignedBuf, CollectiveKind, DataType, Error,
    Fingerprint, FrameHeader, Link, Result, Spin, Store,
};
use futures::future::{select, Either};
use tokio::{runtime::Runtime, sync::mpsc, sync::Notify};

/// How long aborting may spend telling the peers.
const ABORT_NOTICE_DEADLINE: Duration = Duration::from_secs(2);
/// How long aborting may spend on the store record of the first failure.
const ABORT_RECORD_DEADLINE: Duration = Duration::from_secs(2);
/// Store key (under the communicator's prefix) of the first failure.
const ABORT_KEY: &str = "abort";

/// Polls a future without letting the runtime sleep for up to the spin
/// window after each real wake-up: while it is pending and inside the window
/// it wakes itself (yielding the core first if asked to), so the runtime
/// checks the sockets without blocking and polls again. Past the window it
/// returns `Pending` like any future and the thread sleeps.
struct Polling<F> {
    inner: F,
    spin: Spin,
    until: Instant,
    /// The last wake-up was our own.
    self_woken: bool,
}

impl<F: Future + Unpin> Polling<F> {
    fn new(inner: F, spin: Spin) -> Polling<F> {
        Polling {
            inner,
            spin,
            until: Instant::now(),
            self_woken: false,
        }
    }
}

impl<F: Future + Unpin> Future for Polling<F> {
    type Output = F::Output;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        if self.spin.window.is_zero() {
            return Pin::new(&mut self.inner).poll(cx);
        }
        if !self.self_woken {
            self.until = Instant::now() + self.spin.window;
        }
        self.self_woken = false;
        if self.spin.repoll {
            // Links in memory need no runtime to make progress: poll again
            // at once, a few times, before the trip through the runtime.
            for _ in 0..REPOLLS {
                let inner = &mut self.inner;
                if let Poll::Ready(v) = poll_repolling(|| Pin::new(inner).poll(cx)) {
                    return Poll::Ready(v);
                }
                if self.spin.yield_between {
                    thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
            }
        }
        match Pin::new(&mut self.inner).poll(cx) {
            Poll::Ready(v) => Poll::Ready(v),
            Poll::Pending => {
                if Instant::now() < self.until {
                    if self.spin.yield_between {
                        thread::yield_now();
                    }
                    self.self_woken = true;
                    cx.waker().wake_by_ref();
                }
                Poll::Pending
            }
        }
    }
}

/// How often [`Polling`] polls a future again at once (links in memory only)
/// before it goes through the runtime, which checks sockets and timers.
const REPOLLS: usize = 32;

/// How a job runs.
pub(crate) enum Plan {
    /// A schedule, run by the executor over the links.
    Schedule(Arc<Schedule>),
    /// A small collective on the shared-memory board, run by the driving thread.
    Board(BoardCall),
    /// A board-direct allreduce in place on several buffers taken end to
    /// end (the job's `io` is unused).
    BoardOn(BoardCall, Buffers),
}

/// Buffers of a [`Plan::BoardOn`] job: `(address, bytes)`.
pub(crate) struct Buffers(pub Vec<(*mut u8, usize)>);

// SAFETY: like `IoBuffers`, memory handed to one execution at a time, kept
// alive and untouched by its owner (the job's completion) until it is done.
unsafe impl Send for Buffers {}

/// One call, ready to run.
pub(crate) struct Job {
    pub plan: Plan,
    pub call: Call,
    pub io: IoBuffers<'static>,
    pub deadline: Duration,
    /// For point-to-point transfers: the peer and whether this rank sends.
    pub lane: Option<(usize, bool)>,
    /// Receives the result once the schedule no longer touches `io`.
    pub done: Box<dyn FnOnce(Result<()>) + Send>,
}

/// What waits to run, and whether some thread is driving the runtime.
#[derive(Default)]
struct Queue {
    jobs: VecDeque<Job>,
    /// A thread (the caller inline, or the progress thread) is driving the runtime.
    driving: bool,
    closed: bool,
}

/// State shared by the engine handle, the progress thread and the lanes.
struct Shared {
    rank: usize,
    links: Vec<Option<Arc<dyn Link>>>,
    store: Arc<dyn Store>,
    /// The rank whose process serves the store, if one does.
    store_host: Option<usize>,
    broken: Mutex<Option<Error>>,
    queue: Mutex<Queue>,
    /// Wakes the progress thread when it sleeps outside the runtime.
    wake_thread: Condvar,
    /// Wakes the progress thread when it waits inside the runtime.
    wake_task: Notify,
    /// Point-to-point transfers queued or running.
    transfers: AtomicUsize,
    transfers_done: Notify,
    /// Scratch memory of collectives (one runs at a time).
    scratch: Mutex<AlignedBuf>,
    /// How the driving thread polls before it sleeps.
    spin: Spin,
    /// The board, when every rank runs on this host.
    board: Option<Arc<Board>>,
    /// Check every collective's arguments across ranks first (`CCL_DEBUG_CHECKS`).
    debug_checks: bool,
    /// `Communicator::abort` was called: running calls stop, queued ones fail.
    abort_requested: AtomicBool,
    /// Wakes running calls when an abort is requested.
    cancel: Notify,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Nothing under these locks can be left half-updated by a panic.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Shared {
    fn broken(&self) -> Option<Error> {
        lock(&self.broken).clone()
    }

    /// The error of a call made on a broken or dropped communicator.
    fn broken_error(&self) -> Error {
        let cause = self
            .broken()
            .map_or_else(|| "the communicator was dropped".into(), |e| e.to_string());
        Error::Broken {
            rank: self.rank,
            cause,
        }
    }

    fn fail_broken(&self, job: Job) {
        (job.done)(Err(self.broken_error()));
    }

    /// Runs one job to completion (or failure), breaking the communicator on error.
    async fn run(&self, job: Job, scratch: &mut AlignedBuf) {
        if self.broken().is_some() {
            return self.fail_broken(job);
        }
        let schedule = match &job.plan {
            Plan::Schedule(s) => s,
            Plan::Board(_) | Plan::BoardOn(..) => {
                let result = self.run_board(&job);
                return self.finish(job.done, result).await;
            }
        };
        if job.lane.is_none() {
            let checked = match &self.board {
                Some(board) => announce(board, &job.call, job.deadline),
                None if self.debug_checks => self.check_calls(&job.call, job.deadline).await,
                None => Ok(()),
            };
            if let Err(e) = checked {
                return self.finish(job.done, Err(e)).await;
            }
        }
        let execution = execute_within(
            schedule,
            job.io,
            &self.links,
            &job.call,
            scratch,
            Some(job.deadline),
        );
        let result = match select(pin!(execution), pin!(self.cancelled())).await {
            Either::Left((r, _)) => r,
            Either::Right(((), _)) => Err(self.aborted_error()),
        };
        self.finish(job.done, result).await;
    }

    /// `CCL_DEBUG_CHECKS` over links: every rank allgathers every rank's
    /// frame header of the call (a schedule of its own, under the same
    /// sequence number) and compares it with its own.
    async fn check_calls(&self, call: &Call, deadline: Duration) -> Result<()> {
        let n = call.world_size;
        let mine = FrameHeader::data(call.comm, call.seq, 0, 0, call.fingerprint);
        let spec = Spec {
            kind: CollectiveKind::AllGather,
            rank: self.rank,
            world_size: n,
            count: HEADER_LEN,
            root: 0,
            finalize: false,
            piece_elems: HEADER_LEN,
        };
        let schedule = spec.build(Algorithm::Ring).map_err(Error::Internal)?;
        let check = Call {
            fingerprint: Fingerprint::new(CollectiveKind::AllGather, DataType::U8, HEADER_LEN),
            ..*call
        };
        let input = mine.encode();
        let mut all = vec![0u8; n * HEADER_LEN];
        let mut scratch = AlignedBuf::zeroed(0);
        let io = IoBuffers::separate(&input, &mut all);
        execute_within(
            &schedule,
            io,
            &self.links,
            &check,
            &mut scratch,
            Some(deadline),
        )
        .await
        .map_err(|e| e.in_call(&format!("{} (CCL_DEBUG_CHECKS)", call.name())))?;
        for (r, theirs) in all.chunks(HEADER_LEN).enumerate() {
            let got = FrameHeader::decode(theirs).map_err(|msg| Error::Protocol {
                rank: self.rank,
                peer: r,
                call: call.name(),
                msg,
            })?;
            mine.check_received(&got, self.rank, r)?;
        }
        Ok(())
    }

    /// Resolves once an abort is requested.
    async fn cancelled(&self) {
        loop {
            let mut notified = pin!(self.cancel.notified());
            notified.as_mut().enable();
            if self.abort_requested.load(Ordering::Acquire) {
                return;
            }
            notified.await;
        }
    }

    fn aborted_error(&self) -> Error {
        Error::Broken {
            rank: self.rank,
            cause: "Communicator::abort was called".into(),
        }
    }

    fn run_board(&self, job: &Job) -> Result<()> {
        let Some(board) = &self.board else {
            return Err(Error::Internal(format!(
                "rank {}: {} planned on a board this communicator lacks",
                self.rank,
                job.call.name()
            )));
        };
        match &job.plan {
            Plan::Board(call) => call.run(board, &job.call, &job.io, job.deadline),
            // SAFETY: the buffers stay alive and untouched until the job's
            // completion runs, after this returns (see `Buffers`).
            Plan::BoardOn(call, buffers) => unsafe {
                call.run_in_place_on(board, &job.call, &buffers.0, job.deadline)
            },
            Plan::Schedule(_) => Err(Error::Internal(format!(
                "rank {}: {} is a schedule, not a board call",
                self.rank,
                job.call.name()
            ))),
        }
    }

    /// Hands `result` to `done`; a failure first breaks the communicator
    /// (recorded in the store, every peer told).
    async fn finish(&self, done: Box<dyn FnOnce(Result<()>) + Send>, result: Result<()>) {
        done(self.settle(result).await);
    }

    /// The result a call reports: a failure first breaks the communicator
    /// (recorded in the store, every peer told).
    async fn settle(&self, result: Result<()>) -> Result<()> {
        let rank = self.rank;
        let result = match result {
            Err(_) if self.abort_requested.load(Ordering::Acquire) => Err(self.aborted_error()),
            Err(e) => Err(self.attribute(e).await),
            ok => ok,
        };
        if let Err(e) = &result {
            let first = {
                let mut b = lock(&self.broken);
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
        result
    }

    /// Records the first failure of the communicator in the store, or, if
    /// another rank recorded one and `e` only says that a link closed, blames
    /// the recorded rank instead of the messenger. If the store is gone and
    /// a rank's process served it, the error says so: that rank may be the
    /// one that failed first (or it gave up and exited since).
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
    async fn abort_links(&self, cause: &Error) {
        let notice = AbortNotice {
            failed_rank: cause.failed_rank().unwrap_or(self.rank) as u32,
            reason: cause.to_string(),
        };
        if let Some(board) = &self.board {
            board.abort(notice.failed_rank as usize);
        }
        let all = futures::future::join_all(self.links.iter().flatten().map(|l| l.abort(&notice)));
        let _ = tokio::time::timeout(ABORT_NOTICE_DEADLINE, all).await;
    }

    async fn wait_for_transfers(&self) {
        loop {
            let mut notified = std::pin::pin!(self.transfers_done.notified());
            notified.as_mut().enable();
            if self.transfers.load(Ordering::Acquire) == 0 {
                return;
            }
            notified.await;
        }
    }

    fn transfer_finished(&self) {
        self.transfers.fetch_sub(1, Ordering::AcqRel);
        self.transfers_done.notify_waiters();
        self.wake_task.notify_one();
    }
}

/// The submitting side of a communicator's engine.
pub(crate) struct Engine {
    shared: Arc<Shared>,
    runtime: Arc<Runtime>,
}

impl Engine {
    /// Starts the progress thread for `links` on `runtime`. `store` is the
    /// communicator's own (prefixed) store and the rank that serves it, if
    /// one does; `spin` how long a waiting thread polls before it sleeps.
    pub fn start(
        rank: usize,
        runtime: Runtime,
        links: Vec<Option<Arc<dyn Link>>>,
        (store, store_host): (Arc<dyn Store>, Option<usize>),
        spin: Spin,
        board: Option<Board>,
        debug_checks: bool,
    ) -> Result<Engine> {
        let shared = Arc::new(Shared {
            rank,
            links,
            store,
            store_host,
            broken: Mutex::new(None),
            queue: Mutex::new(Queue::default()),
            wake_thread: Condvar::new(),
            wake_task: Notify::new(),
            transfers: AtomicUsize::new(0),
            transfers_done: Notify::new(),
            scratch: Mutex::new(AlignedBuf::zeroed(0)),
            spin,
            board: board.map(Arc::new),
            debug_checks,
            abort_requested: AtomicBool::new(false),
            cancel: Notify::new(),
        });
        let runtime = Arc::new(runtime);
        let (state, rt) = (shared.clone(), runtime.clone());
        thread::Builder::new()
            .name(format!("ccl-rank{rank}"))
            .spawn(move || progress_thread(state, rt))
            .map_err(|e| Error::io("starting the progress thread", e))?;
        Ok(Engine { shared, runtime })
    }

    /// Runs or queues a job. With `inline`, a collective that finds nothing
    /// queued runs on this thread before `submit` returns.
    pub fn submit(&self, job: Job, inline: bool) {
        if self.shared.broken().is_some() {
            return self.shared.fail_broken(job);
        }
        // Driving the runtime from inside another runtime would panic.
        let inline = inline && job.lane.is_none() && tokio::runtime::Handle::try_current().is_err();
        let job = {
            let mut q = lock(&self.shared.queue);
            if q.closed {
                drop(q);
                return self.shared.fail_broken(job);
            }
            if inline && !q.driving && q.jobs.is_empty() {
                q.driving = true;
                Some(job)
            } else {
                if job.lane.is_some() {
                    self.shared.transfers.fetch_add(1, Ordering::AcqRel);
                }
                q.jobs.push_back(job);
                None
            }
        };
        match job {
            Some(job) => {
                let mut scratch = lock(&self.shared.scratch);
                {
                    let run = std::pin::pin!(self.shared.run(job, &mut scratch));
                    self.runtime.block_on(Polling::new(run, self.shared.spin));
                }
                drop(scratch);
                self.stop_driving();
            }
            None => {
                self.shared.wake_thread.notify_one();
                self.shared.wake_task.notify_one();
            }
        }
    }

    /// Runs a board call on this thread when nothing is queued or running,
    /// without a job, a `Work` or the runtime (unless it fails). `call` makes
    /// the call, taking its sequence number, only then. `None`: nothing was
    /// taken or run, and the call must go through [`Engine::submit`].
    pub fn run_board_now(
        &self,
        board_call: &BoardCall,
        call: impl FnOnce() -> Call,
        io: &IoBuffers<'_>,
        timeout: Duration,
    ) -> Option<Result<()>> {
        let board = self.shared.board.as_ref()?;
        // A failure drives the runtime, which would panic inside another one.
        if tokio::runtime::Handle::try_current().is_ok() {
            return None;
        }
        {
            let mut q = lock(&self.shared.queue);
            if q.closed || q.driving || !q.jobs.is_empty() {
                return None;
            }
            q.driving = true;
        }
        let call = call();
        let result = if self.shared.broken().is_some() {
            Err(self.shared.broken_error())
        } else {
            match board_call.run(board, &call, io, timeout) {
                Ok(()) => Ok(()),
                Err(e) => self.runtime.block_on(self.shared.settle(Err(e))),
            }
        };
        self.stop_driving();
        Some(result)
    }

    /// Gives up driving after an inline job; wakes the progress thread if
    /// work was queued meanwhile.
    fn stop_driving(&self) {
        let mut q = lock(&self.shared.queue);
        q.driving = false;
        if !q.jobs.is_empty() {
            self.shared.wake_thread.notify_one();
        }
    }

    /// Stops everything (like `ncclCommAbort`): running calls fail at once,
    /// queued and later ones fail with [`Error::Broken`], and every peer is
    /// told that this rank gave up, so that their calls fail too instead of
    /// waiting for it. Safe from any thread, also while another thread waits
    /// in a call of this communicator; calling it again does nothing.
    pub fn abort(&self) {
        if self.shared.abort_requested.swap(true, Ordering::AcqRel) {
            return;
        }
        if let Some(board) = &self.shared.board {
            board.abort(self.shared.rank);
        }
        self.shared.cancel.notify_waiters();
        // A running call fails, and its failure breaks the communicator and
        // tells the peers. With none running, this thread does that itself.
        let idle = {
            let mut q = lock(&self.shared.queue);
            let idle = !q.driving;
            if idle {
                q.driving = true;
            }
            idle
        };
        if !idle {
            return;
        }
        let e = self.shared.aborted_error();
        let first = {
            let mut b = lock(&self.shared.broken);
            let first = b.is_none();
            if first {
                *b = Some(e.clone());
            }
            first
        };
        if first {
            tracing::warn!(rank = self.shared.rank, "{e}");
            if tokio::runtime::Handle::try_current().is_err() {
                self.runtime.block_on(self.shared.abort_links(&e));
            } else {
                // Inside someone's runtime: a helper thread drives ours.
                let (shared, rt) = (self.shared.clone(), self.runtime.clone());
                let _ = thread::Builder::new()
                    .name("ccl-abort".into())
                    .spawn(move || rt.block_on(shared.abort_links(&e)));
            }
        }
        self.stop_driving();
    }

    /// Whether small collectives can run on the shared-memory board.
    /// Whether this communicator has a board (every rank on this host).
    pub fn has_board(&self) -> bool {
        self.shared.board.is_some()
    }

    /// The error that broke the communicator, if any.
    pub fn broken_cause(&self) -> Option<Error> {
        self.shared.broken()
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        // The progress thread finishes what is queued, then exits.
        lock(&self.shared.queue).closed = true;
        self.shared.wake_thread.notify_one();
        self.shared.wake_task.notify_one();
    }
}

/// Sleeps until there is queued work and nobody drives the runtime, then
/// drives it until the queue is empty and no transfer is in flight.
fn progress_thread(shared: Arc<Shared>, runtime: Arc<Runtime>) {
    let mut lanes: HashMap<(usize, bool), mpsc::UnboundedSender<Job>> = HashMap::new();
    loop {
        {
            let mut q = lock(&shared.queue);
            while (q.jobs.is_empty() || q.driving) && !(q.closed && q.jobs.is_empty() && !q.driving)
            {
                q = shared
                    .wake_thread
                    .wait(q)
                    .unwrap_or_else(|p| p.into_inner());
            }
            if q.closed && q.jobs.is_empty() {
                break;
            }
            q.driving = true;
        }
        let driving = std::pin::pin!(drive(&shared, &mut lanes));
        runtime.block_on(Polling::new(driving, shared.spin));
    }
    // Let transfers still in their lanes finish before the runtime goes away.
    drop(lanes);
    runtime.block_on(shared.wait_for_transfers());
}

/// Runs queued jobs until none is left and no transfer is in flight; then
/// gives up driving (under the queue lock, so no job is missed).
async fn drive(
    shared: &Arc<Shared>,
    lanes: &mut HashMap<(usize, bool), mpsc::UnboundedSender<Job>>,
) {
    loop {
        let next = {
            let mut q = lock(&shared.queue);
            match q.jobs.pop_front() {
                Some(job) => Some(job),
                None if shared.transfers.load(Ordering::Acquire) == 0 => {
                    q.driving = false;
                    return;
                }
                None => None,
            }
        };
        let Some(job) = next else {
            // Transfers are running: wait for one to finish or for new work.
            shared.wake_task.notified().await;
            continue;
        };
        let Some(lane) = job.lane else {
            shared.wait_for_transfers().await;
            let mut scratch = std::mem::replace(&mut *lock(&shared.scratch), AlignedBuf::zeroed(0));
            shared.run(job, &mut scratch).await;
            *lock(&shared.scratch) = scratch;
            continue;
        };
        let tx = lanes.entry(lane).or_insert_with(|| {
            let (tx, mut rx) = mpsc::unbounded_channel::<Job>();
            let shared = shared.clone();
            tokio::spawn(async move {
                let mut scratch = AlignedBuf::zeroed(0);
                while let Some(job) = rx.recv().await {
                    shared.run(job, &mut scratch).await;
                    shared.transfer_finished();
                }
            });
            tx
        });
        if let Err(mpsc::error::SendError(job)) = tx.send(job) {
            (job.done)(Err(Error::Internal("a transfer lane stopped".into())));
            shared.transfer_finished();
        }
    }
}
