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
    pin::pin,
    sync::{
        atomic::{AtomicBool, AtomicUsize, Ordering},
        Arc, Condvar, Mutex, MutexGuard,
    },
    task::Poll,
    thread,
    time::{Duration, Instant},
};

use ccl_algorithms::{execute, group, Algorithm, IoBuffers, Layout, Schedule};
use ccl_core::{
    frame::HEADER_LEN, Call, Collective, CollectiveKind, DataType, Error, Event, FrameHeader,
    GroupMemory, Link, Repoll, Result, Scratch, Spin, SpinWindow, Store,
};
use futures::future::{select, Either};
use tokio::{runtime::Runtime, sync::mpsc, sync::Notify};

mod failure;
mod polling;

use polling::Polling;

/// How a job runs.
pub(crate) enum Plan {
    /// A schedule, run by the executor over the links.
    Schedule(Arc<Schedule>),
    /// A group algorithm, run by the driving thread on group memory.
    Group(Algorithm),
}

/// What a job waits for before it touches its memory (a GPU's copy into
/// its host buffers, say), polled without blocking the runtime, and a step
/// to run then; see [`Job::before`].
pub(crate) struct Before {
    /// Happens when the job may start.
    pub gate: Arc<dyn Event>,
    /// What the job waits for, for the error at its deadline.
    pub what: &'static str,
    /// Runs once the gate has happened.
    pub then: Option<Box<dyn FnOnce() -> Result<()> + Send>>,
}

impl Before {
    /// Waits (yielding to the runtime's other tasks) for the gate, within
    /// `deadline`, then runs the step.
    async fn wait(self, rank: usize, deadline: Duration) -> Result<()> {
        let start = Instant::now();
        while !self.gate.query()? {
            let waited = start.elapsed();
            if waited >= deadline {
                return Err(Error::Timeout {
                    context: format!("rank {rank}"),
                    what: self.what.into(),
                    after: deadline,
                });
            }
            // Copies take microseconds to milliseconds: poll at first, then
            // let the timer wake this task.
            if waited < Duration::from_millis(1) {
                tokio::task::yield_now().await;
            } else {
                tokio::time::sleep(Duration::from_micros(100)).await;
            }
        }
        self.then.map_or(Ok(()), |step| step())
    }
}

/// One call, ready to run.
pub(crate) struct Job {
    pub plan: Plan,
    pub call: Call,
    pub io: IoBuffers<'static>,
    pub deadline: Duration,
    /// For point-to-point transfers: the peer and whether this rank sends.
    pub lane: Option<(usize, bool)>,
    /// Waited for (within the job's deadline) before the job touches `io`.
    /// Its error is the job's.
    pub before: Option<Before>,
    /// Receives the result once the schedule no longer touches `io`.
    pub done: Done,
}

/// What receives a job's result.
pub(crate) type Done = Box<dyn FnOnce(Result<()>) + Send>;

/// What waits to run, and whether some thread is driving the runtime.
#[derive(Default)]
struct Queue {
    jobs: VecDeque<Job>,
    /// A thread (the caller inline, or the progress thread) is driving the runtime.
    driving: bool,
    closed: bool,
}

/// State shared by the engine handle, the progress thread and the lanes.
pub(super) struct Shared {
    rank: usize,
    links: Vec<Option<Arc<dyn Link>>>,
    store: Arc<dyn Store>,
    /// The rank whose process serves the store, if one does.
    store_host: Option<usize>,
    broken: Mutex<Option<Error>>,
    /// Whether `broken` holds an error: read on every call, without a lock.
    is_broken: AtomicBool,
    queue: Mutex<Queue>,
    /// Wakes the progress thread when it sleeps outside the runtime.
    wake_thread: Condvar,
    /// Wakes the progress thread when it waits inside the runtime.
    wake_task: Notify,
    /// Point-to-point transfers queued or running.
    transfers: AtomicUsize,
    transfers_done: Notify,
    /// Scratch memory of collectives (one runs at a time).
    scratch: Mutex<Option<Scratch>>,
    /// How the driving thread polls before it sleeps.
    spin: Spin,
    /// How long it polls, adapted to how its waits end.
    window: SpinWindow,
    /// Memory shared by every rank, when a transport offers it.
    group: Option<Arc<dyn GroupMemory>>,
    /// Check every collective's arguments across ranks first (`CCL_DEBUG_CHECKS`).
    debug_checks: bool,
    /// `Communicator::abort` was called: running calls stop, queued ones fail.
    abort_requested: AtomicBool,
    /// Wakes running calls when an abort is requested.
    cancel: Notify,
}

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Nothing under these locks can be left half-updated by a panic.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Shared {
    fn broken(&self) -> Option<Error> {
        match self.is_broken.load(Ordering::Acquire) {
            true => lock(&self.broken).clone(),
            false => None,
        }
    }

    /// Breaks the communicator with `e` unless it is already; whether this
    /// was the first failure.
    fn set_broken(&self, e: &Error) -> bool {
        let mut b = lock(&self.broken);
        let first = b.is_none();
        if first {
            *b = Some(e.clone());
            self.is_broken.store(true, Ordering::Release);
        }
        first
    }

    /// The error of a call made on a broken or dropped communicator.
    fn broken_error(&self) -> Error {
        let cause = match self.broken() {
            None => "the communicator was dropped".into(),
            // A call failed with Broken already: keep its cause, not a nested message.
            Some(Error::Broken { cause, .. }) => cause,
            Some(e) => e.to_string(),
        };
        Error::Broken {
            rank: self.rank,
            cause,
        }
    }

    fn fail_broken(&self, job: Job) {
        (job.done)(Err(self.broken_error()));
    }

    /// Runs one job to completion (or failure), breaking the communicator
    /// on error, and hands the result to the job's `done`.
    async fn run(&self, mut job: Job, scratch: &mut Option<Scratch>) {
        let done = std::mem::replace(&mut job.done, Box::new(|_| ()));
        done(self.outcome(job, scratch).await);
    }

    /// Runs one job to completion (or failure), breaking the communicator
    /// on error; its result (the job's `done` is not called).
    async fn outcome(&self, mut job: Job, scratch: &mut Option<Scratch>) -> Result<()> {
        if self.is_broken.load(Ordering::Acquire) {
            return Err(self.broken_error());
        }
        if let Some(before) = job.before.take() {
            if let Err(e) = before.wait(self.rank, job.deadline).await {
                let e = e.in_call(&format!("{} on rank {}", job.call.name(), self.rank));
                return self.settle(Err(e)).await;
            }
        }
        let schedule = match &job.plan {
            Plan::Schedule(s) => s,
            Plan::Group(algorithm) => {
                let result = self.run_group(*algorithm, &job);
                return self.settle(result).await;
            }
        };
        if job.lane.is_none() {
            let checked = match &self.group {
                Some(mem) => group::announce(&**mem, &job.call, job.deadline),
                None if self.debug_checks => self.check_calls(&job.call, job.deadline).await,
                None => Ok(()),
            };
            if let Err(e) = checked {
                return self.settle(Err(e)).await;
            }
        }
        let execution = execute(
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
        self.settle(result).await
    }

    /// `CCL_DEBUG_CHECKS` over links: every rank allgathers every rank's
    /// frame header of the call (a schedule of its own, under the same
    /// sequence number) and compares it with its own.
    async fn check_calls(&self, call: &Call, deadline: Duration) -> Result<()> {
        let n = call.world_size;
        let mine = call.header(0, 0);
        let check = Call {
            coll: Collective::new(CollectiveKind::AllGather, DataType::U8, HEADER_LEN),
            ..*call
        };
        let schedule = Algorithm::Ring
            .schedule(&check.coll, self.rank, n, HEADER_LEN, Layout::OutOfPlace)
            .map_err(Error::Internal)?;
        let input = mine.encode();
        let mut all = vec![0u8; n * HEADER_LEN];
        let io = IoBuffers::host(&input, &mut all);
        execute(
            &schedule,
            io,
            &self.links,
            &check,
            &mut None,
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

    /// Resolves once an abort is requested. A repoll ([`Repoll`]) only looks
    /// at the flag: registering for the notice takes the notifier's lock,
    /// which the real poll that follows does.
    async fn cancelled(&self) {
        // Made before the flag is read, it sees every notice sent after.
        let mut notified = pin!(self.cancel.notified());
        std::future::poll_fn(|cx| {
            if self.abort_requested.load(Ordering::Acquire) {
                return Poll::Ready(());
            }
            if Repoll::is(cx) {
                return Poll::Pending;
            }
            notified.as_mut().poll(cx)
        })
        .await
    }

    fn aborted_error(&self) -> Error {
        Error::Broken {
            rank: self.rank,
            cause: "Communicator::abort was called".into(),
        }
    }

    /// Runs a job planned as a group algorithm.
    fn run_group(&self, algorithm: Algorithm, job: &Job) -> Result<()> {
        let Some(mem) = &self.group else {
            return Err(Error::Internal(format!(
                "rank {}: {} planned on group memory this communicator lacks",
                self.rank,
                job.call.name()
            )));
        };
        group::run(algorithm, &**mem, &job.call, &job.io, job.deadline)
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
        group: Option<Arc<dyn GroupMemory>>,
        debug_checks: bool,
    ) -> Result<Engine> {
        let shared = Arc::new(Shared {
            rank,
            links,
            store,
            store_host,
            broken: Mutex::new(None),
            is_broken: AtomicBool::new(false),
            queue: Mutex::new(Queue::default()),
            wake_thread: Condvar::new(),
            wake_task: Notify::new(),
            transfers: AtomicUsize::new(0),
            transfers_done: Notify::new(),
            scratch: Mutex::new(None),
            spin,
            window: SpinWindow::new(spin.window),
            group,
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

    /// Queues the job `make` makes, for the progress thread. `make` runs
    /// under the queue lock, so that the sequence numbers it takes follow
    /// the order in which jobs queue and run.
    pub fn submit(&self, make: impl FnOnce() -> Job) {
        {
            let mut q = lock(&self.shared.queue);
            let job = make();
            if q.closed || self.shared.is_broken.load(Ordering::Acquire) {
                drop(q);
                return self.shared.fail_broken(job);
            }
            if job.lane.is_some() {
                self.shared.transfers.fetch_add(1, Ordering::AcqRel);
            }
            q.jobs.push_back(job);
        }
        self.shared.wake_thread.notify_one();
        self.shared.wake_task.notify_one();
    }

    /// Runs the collective `make` makes on this thread, when nothing is
    /// queued or running, and returns its result: no hand-off to another
    /// thread and no `Work`. `make` gets a `done` that does nothing (the
    /// result is returned instead) and runs under the queue lock, as for
    /// [`Engine::submit`]. Otherwise it hands `make` back untouched, for
    /// [`Engine::submit`].
    pub fn run_now<F: FnOnce(Done) -> Job>(&self, make: F) -> std::result::Result<Result<()>, F> {
        // Driving the runtime from inside another runtime would panic.
        if tokio::runtime::Handle::try_current().is_ok() {
            return Err(make);
        }
        let job = {
            let mut q = lock(&self.shared.queue);
            if q.closed || q.driving || !q.jobs.is_empty() {
                return Err(make);
            }
            let job = make(Box::new(|_| ()));
            if self.shared.is_broken.load(Ordering::Acquire) {
                return Ok(Err(self.shared.broken_error()));
            }
            q.driving = true;
            job
        };
        let result = {
            let mut scratch = lock(&self.shared.scratch);
            let mut run = pin!(self.shared.outcome(job, &mut scratch));
            let spin = self.shared.spin;
            let entered = self.runtime.enter();
            let now = match spin.repoll {
                true => polling::repoll(&mut run, spin),
                false => polling::try_once(&mut run, spin),
            };
            drop(entered);
            match now {
                Some(result) => result,
                None => self
                    .runtime
                    .block_on(Polling::new(run, spin, &self.shared.window)),
            }
        };
        self.stop_driving();
        Ok(result)
    }

    /// Runs a group algorithm on this thread when nothing is queued or
    /// running, without a job, a `Work` or the runtime (unless it fails).
    /// `call` makes the call, taking its sequence number, only then. `None`:
    /// nothing was taken or run, and the call must go through [`Engine::submit`].
    ///
    /// The queue stays locked while the call runs (one lock for the call,
    /// which matters at a fraction of a microsecond per call): meanwhile
    /// other threads' calls wait to queue, as they would wait for this one
    /// to run, and the progress thread, with nothing queued, sleeps. An
    /// abort from another thread waits until the board sees it and the
    /// call fails.
    #[inline]
    pub fn run_group_now(
        &self,
        algorithm: Algorithm,
        call: impl FnOnce() -> Call,
        io: &IoBuffers<'_>,
        timeout: Duration,
    ) -> Option<Result<()>> {
        let mem = self.shared.group.as_ref()?;
        let mut q = lock(&self.shared.queue);
        if q.closed || q.driving || !q.jobs.is_empty() {
            return None;
        }
        let call = call();
        if self.shared.is_broken.load(Ordering::Acquire) {
            drop(q);
            return Some(Err(self.shared.broken_error()));
        }
        match group::run(algorithm, &**mem, &call, io, timeout) {
            Ok(()) => Some(Ok(())),
            Err(e) => {
                // Settling drives the runtime: as the driver, unlocked.
                q.driving = true;
                drop(q);
                let result = self.settle_here(Err(e));
                self.stop_driving();
                Some(result)
            }
        }
    }

    /// [`Shared::settle`] on this thread, driving the runtime; from inside
    /// another runtime (where driving it would panic), on a helper thread.
    fn settle_here(&self, result: Result<()>) -> Result<()> {
        if tokio::runtime::Handle::try_current().is_err() {
            return self.runtime.block_on(self.shared.settle(result));
        }
        thread::scope(|s| {
            s.spawn(|| self.runtime.block_on(self.shared.settle(result)))
                .join()
                .unwrap_or_else(|_| {
                    Err(Error::Internal(
                        "settling a failed call panicked".to_string(),
                    ))
                })
        })
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
        if let Some(group) = &self.shared.group {
            group.abort(self.shared.rank);
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
        let first = self.shared.set_broken(&e);
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
        runtime.block_on(Polling::new(driving, shared.spin, &shared.window));
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
            let mut scratch = lock(&shared.scratch).take();
            shared.run(job, &mut scratch).await;
            *lock(&shared.scratch) = scratch;
            continue;
        };
        let tx = lanes.entry(lane).or_insert_with(|| {
            let (tx, mut rx) = mpsc::unbounded_channel::<Job>();
            let shared = shared.clone();
            tokio::spawn(async move {
                let mut scratch = None;
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
