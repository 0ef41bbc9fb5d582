//! [`Bucketer`]: bucketed gradient fusion, what PyTorch DDP's reducer and
//! Horovod's tensor fusion do.

mod completion;
mod erased;

use std::{
    fmt,
    sync::{mpsc, Arc, Mutex},
};

use ccl_core::{work_pair, DataType, Element, Error, ReduceOp, Result, Work};

use crate::Communicator;
pub use completion::Reduced;
use completion::{complete_steps, Msg};
use erased::{range_err, typed, typed_mut, Boxed, Ops};

/// Default bucket capacity: 25 MiB, as PyTorch DDP's `bucket_cap_mb`.
pub const DEFAULT_BUCKET_CAP_BYTES: usize = 25 << 20;

/// A tensor registered with a [`Bucketer`]: its index in registration order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TensorId(pub usize);

impl fmt::Display for TensorId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "tensor {}", self.0)
    }
}

struct Tensor {
    dtype: DataType,
    len: usize,
    ops: &'static Ops,
    bucket: usize,
    /// Element offset in its bucket.
    offset: usize,
    /// Handed over in the current step.
    ready: bool,
}

struct Bucket {
    ops: &'static Ops,
    /// Elements in the bucket.
    len: usize,
    tensors: Vec<usize>,
    /// The packed buffer (or, for a single tensor, the no_sync accumulator).
    buf: Option<Boxed>,
    /// `buf` holds gradients accumulated by earlier no_sync steps.
    accumulated: bool,
    /// Tensors of this bucket not yet ready in the current step.
    missing: usize,
    /// The tensors' own buffers, held until the bucket is launched.
    held: Vec<(usize, Boxed)>,
    /// `buf` was launched and has not been taken back from the pool.
    out: bool,
}

impl Bucket {
    fn direct(&self) -> bool {
        self.tensors.len() == 1
    }
}

/// Bucketed gradient fusion: what PyTorch DDP's reducer and Horovod's tensor
/// fusion do.
///
/// A data-parallel training step produces many gradients of mixed sizes, one
/// after another, during the backward pass. Reducing each on its own costs one
/// collective's latency per tensor; reducing them all at the end wastes the
/// time the backward pass could have overlapped with communication. A
/// [`Bucketer`] packs the tensors into *buckets* of at most `cap` bytes and
/// starts a bucket's allreduce as soon as every tensor in it is ready.
///
/// # How to use it
///
/// 1. Register every tensor once, with its element type and length, in the
///    order its gradient is expected to become ready (for a backward pass: the
///    reverse of the forward order). [`Bucketer::register`] returns a
///    [`TensorId`]. Every rank must register the same tensors in the same order.
/// 2. Each step, hand every gradient over as an owned `Vec` with
///    [`Bucketer::ready`], in any order (ranks may differ in the order). When
///    a bucket is complete the bucketer launches its allreduce on the
///    communicator: when every rank runs on this host and the shared-memory
///    board carries allreduces of the bucket's size, on the `Vec`s where they
///    lie ([`Algorithm::BoardDirect`](crate::Algorithm::BoardDirect) reads and
///    writes each in place); otherwise it copies them into the bucket's
///    buffer first and back into the `Vec`s after.
/// 3. [`Bucketer::finish`] returns one [`Work`] for the whole set. It yields
///    [`Reduced`], from which [`Reduced::take`] gives back each original `Vec`
///    (same allocation) holding the reduced values.
///
/// ```no_run
/// use ccl::{Bucketer, Communicator, ReduceOp};
/// let comm = Communicator::from_env()?;
/// let mut b = Bucketer::new(&comm, ReduceOp::Avg);
/// let w = b.register::<f32>(1 << 20)?;
/// let bias = b.register::<f32>(256)?;
/// for _step in 0..3 {
///     // ... backward pass: gradients appear ...
///     b.ready(bias, vec![0.5f32; 256])?;
///     b.ready(w, vec![1.0f32; 1 << 20])?;
///     let mut out = b.finish().wait()?;
///     let w_grad: Vec<f32> = out.take(w)?;
///     let bias_grad: Vec<f32> = out.take(bias)?;
///     # let _ = (w_grad, bias_grad);
/// }
/// # Ok::<(), ccl::Error>(())
/// ```
///
/// # Buckets
///
/// Buckets are formed once, from the registration order alone, so every rank
/// builds the same buckets: tensors of one element type go into that type's
/// open bucket while it stays within `cap` bytes (default 25 MiB, as DDP);
/// the next tensor that does not fit closes it and opens a new one. A tensor
/// larger than `cap` gets a bucket of its own. Buckets are numbered in the
/// order they were opened, and bucket `i` is launched only after buckets
/// `0..i` were, so every rank issues the same allreduces in the same order
/// whatever order its gradients arrive in. A bucket holding a single tensor
/// reduces that tensor's `Vec` directly, without copying. [`Bucketer::with_buckets`]
/// sets the buckets explicitly instead.
///
/// # Zero copy: gradients written into the buckets
///
/// As DDP's `gradient_as_bucket_view`, a tensor can live in its bucket:
/// [`Bucketer::view_mut`] gives its place in the bucket to write the gradient
/// into, [`Bucketer::mark_ready`] hands it over without a copy, and after the
/// step's `Work` completed [`Bucketer::view`] reads the reduced values. Both
/// forms may be mixed within a step; every tensor is handed over once per
/// step, by one or the other.
///
/// # Accumulation without communication (`no_sync`)
///
/// After [`Bucketer::set_no_sync`]`(true)`, steps do not communicate: `ready`
/// adds each gradient into the bucketer's own accumulator and `finish` hands
/// the tensors back unchanged at once. The first step after
/// `set_no_sync(false)` reduces the sum of the gradients of every step since
/// the last synchronised one (as DDP's `no_sync()` context). A caller that
/// accumulates gradients itself can instead simply skip the bucketer in the
/// steps it does not want to synchronise.
///
/// # Rules
///
/// Between the first `ready` of a step and its `finish`, do not issue other
/// collectives on the communicator whose order could differ between ranks:
/// bucket launches interleave with them. Misuse (an unknown id, a tensor
/// marked twice in one step, a wrong length or element type, a bucket that
/// mixes element types, registering after the first step, finishing before
/// every tensor is ready) returns [`Error::InvalidArgument`] and leaves the
/// step as it was, so the caller can correct it. A rejected `ready` drops the
/// `Vec` it was given.
pub struct Bucketer {
    comm: Communicator,
    op: ReduceOp,
    cap: usize,
    tensors: Vec<Tensor>,
    buckets: Vec<Bucket>,
    /// Buckets formed (the first step began, or `with_buckets` was called).
    frozen: bool,
    no_sync: bool,
    /// A step is in progress: some tensor was handed over since the last finish.
    in_step: bool,
    /// Next bucket to launch in this step.
    next_launch: usize,
    /// Results a no_sync step hands back.
    unsynced: Vec<(usize, Boxed)>,
    /// Bucket buffers coming back from the completion thread, for reuse.
    pool: Arc<Mutex<Vec<Option<Boxed>>>>,
    tx: Option<mpsc::Sender<Msg>>,
    steps: u64,
}

impl fmt::Debug for Bucketer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Bucketer({} tensors, {} buckets, cap {} B, {}, {:?})",
            self.tensors.len(),
            self.buckets.len(),
            self.cap,
            self.op,
            self.comm
        )
    }
}

fn invalid(msg: String) -> Error {
    Error::InvalidArgument(format!("bucketer: {msg}"))
}

impl Bucketer {
    /// A bucketer that reduces with `op` on `comm` (a handle it keeps),
    /// buckets of at most [`DEFAULT_BUCKET_CAP_BYTES`].
    pub fn new(comm: &Communicator, op: ReduceOp) -> Bucketer {
        Bucketer {
            comm: comm.clone(),
            op,
            cap: DEFAULT_BUCKET_CAP_BYTES,
            tensors: Vec::new(),
            buckets: Vec::new(),
            frozen: false,
            no_sync: false,
            in_step: false,
            next_launch: 0,
            unsynced: Vec::new(),
            pool: Arc::new(Mutex::new(Vec::new())),
            tx: None,
            steps: 0,
        }
    }

    /// Sets the bucket capacity in bytes (before the first step). A tensor
    /// larger than `cap` gets a bucket of its own; `cap` 0 gives every
    /// tensor its own bucket.
    pub fn with_cap_bytes(mut self, cap: usize) -> Bucketer {
        self.cap = cap;
        self
    }

    /// The bucket capacity in bytes.
    pub fn cap_bytes(&self) -> usize {
        self.cap
    }

    /// The reduction op.
    pub fn op(&self) -> ReduceOp {
        self.op
    }

    /// Registers a tensor of `len` elements of `T`. Every rank must register
    /// the same tensors in the same order. Fails after the first step (the
    /// buckets are fixed then) or if `op` is not defined for `T`.
    pub fn register<T: Element>(&mut self, len: usize) -> Result<TensorId> {
        if self.frozen {
            return Err(invalid(format!(
                "cannot register a tensor after the buckets were formed ({} tensors registered)",
                self.tensors.len()
            )));
        }
        self.op.validate(T::DTYPE)?;
        self.tensors.push(Tensor {
            dtype: T::DTYPE,
            len,
            ops: Ops::of::<T>(),
            bucket: 0,
            offset: 0,
            ready: false,
        });
        Ok(TensorId(self.tensors.len() - 1))
    }

    /// Sets the buckets explicitly instead of by capacity: `buckets[i]` lists
    /// the tensors of bucket `i` in packing order. Every registered tensor
    /// must appear exactly once, and a bucket must hold one element type.
    /// Call after registering every tensor; registration is then closed.
    pub fn with_buckets(&mut self, buckets: &[Vec<TensorId>]) -> Result<()> {
        if self.frozen {
            return Err(invalid("the buckets are already formed".into()));
        }
        let mut seen = vec![false; self.tensors.len()];
        for (b, ids) in buckets.iter().enumerate() {
            if ids.is_empty() {
                return Err(invalid(format!("bucket {b} is empty")));
            }
            for id in ids {
                let t = self.tensor(*id)?;
                if seen[id.0] {
                    return Err(invalid(format!("{id} appears in more than one bucket")));
                }
                seen[id.0] = true;
                let first = self.tensors[ids[0].0].dtype;
                if t.dtype != first {
                    return Err(invalid(format!(
                        "bucket {b} mixes element types: {} is {first}, {id} is {}",
                        ids[0], t.dtype
                    )));
                }
            }
        }
        if let Some(i) = seen.iter().position(|s| !s) {
            return Err(invalid(format!("tensor {i} is in no bucket")));
        }
        let layout: Vec<Vec<usize>> = buckets
            .iter()
            .map(|ids| ids.iter().map(|id| id.0).collect())
            .collect();
        self.form(layout);
        Ok(())
    }

    /// The buckets: the tensors of each, in launch order. Forms them (and
    /// closes registration) if no step has yet.
    pub fn buckets(&mut self) -> Vec<Vec<TensorId>> {
        self.freeze();
        self.buckets
            .iter()
            .map(|b| b.tensors.iter().map(|&t| TensorId(t)).collect())
            .collect()
    }

    /// Number of registered tensors.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// True when no tensor is registered.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// Steps finished so far (synchronised or not).
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Turns `no_sync` accumulation on or off, between steps. While on, steps
    /// only accumulate gradients locally; the first step after turning it off
    /// reduces the sum of every step's gradients since the last reduction.
    pub fn set_no_sync(&mut self, on: bool) -> Result<()> {
        if self.in_step {
            return Err(invalid(
                "set_no_sync in the middle of a step (finish it first)".into(),
            ));
        }
        self.no_sync = on;
        Ok(())
    }

    /// True while steps accumulate without communicating.
    pub fn no_sync(&self) -> bool {
        self.no_sync
    }

    fn tensor(&self, id: TensorId) -> Result<&Tensor> {
        self.tensors.get(id.0).ok_or_else(|| {
            invalid(format!(
                "unknown {id} (only {} tensors are registered)",
                self.tensors.len()
            ))
        })
    }

    /// Forms the buckets from the registration order, once.
    fn freeze(&mut self) {
        if self.frozen {
            return;
        }
        // One open bucket per element type, DDP-style.
        let mut layout: Vec<Vec<usize>> = Vec::new();
        let mut open: Vec<(DataType, usize, usize)> = Vec::new(); // (dtype, bucket, bytes)
        for (i, t) in self.tensors.iter().enumerate() {
            let bytes = t.len * t.dtype.size();
            let slot = open.iter().position(|o| o.0 == t.dtype);
            match slot {
                Some(s) if open[s].2 + bytes <= self.cap => {
                    layout[open[s].1].push(i);
                    open[s].2 += bytes;
                }
                _ => {
                    layout.push(vec![i]);
                    let entry = (t.dtype, layout.len() - 1, bytes);
                    match slot {
                        Some(s) => open[s] = entry,
                        None => open.push(entry),
                    }
                }
            }
        }
        self.form(layout);
    }

    fn form(&mut self, layout: Vec<Vec<usize>>) {
        self.buckets = layout
            .into_iter()
            .enumerate()
            .map(|(b, ids)| {
                let mut len = 0;
                for &i in &ids {
                    let t = &mut self.tensors[i];
                    t.bucket = b;
                    t.offset = len;
                    len += t.len;
                }
                Bucket {
                    ops: self.tensors[ids[0]].ops,
                    len,
                    missing: ids.len(),
                    tensors: ids,
                    buf: None,
                    accumulated: false,
                    held: Vec::new(),
                    out: false,
                }
            })
            .collect();
        *self.pool.lock().unwrap_or_else(|p| p.into_inner()) =
            (0..self.buckets.len()).map(|_| None).collect();
        self.frozen = true;
    }

    /// Hands over tensor `id`'s gradient for this step. Launches every bucket
    /// that is now complete and whose predecessors were all launched.
    pub fn ready<T: Element>(&mut self, id: TensorId, grad: Vec<T>) -> Result<()> {
        let t = self.tensor(id)?;
        if t.dtype != T::DTYPE {
            return Err(invalid(format!(
                "{id} was registered as {} but handed over as {}",
                t.dtype,
                T::DTYPE
            )));
        }
        if grad.len() != t.len {
            return Err(invalid(format!(
                "{id} was registered with {} elements but handed over with {}",
                t.len,
                grad.len()
            )));
        }
        if t.ready {
            return Err(invalid(format!(
                "{id} was already marked ready in this step"
            )));
        }
        self.freeze();
        self.in_step = true;
        let (b, off) = (self.tensors[id.0].bucket, self.tensors[id.0].offset);
        let grad: Boxed = Box::new(grad);
        if self.no_sync {
            // Synchronised steps pack (if they must) when the bucket launches.
            let ops = self.buckets[b].ops;
            let add = self.buckets[b].accumulated;
            let buf = self.storage(b, false)?;
            (ops.pack)(buf, &grad, off, add)?;
        }
        self.tensors[id.0].ready = true;
        let bucket = &mut self.buckets[b];
        bucket.missing -= 1;
        if self.no_sync {
            self.unsynced.push((id.0, grad));
            return Ok(());
        }
        bucket.held.push((id.0, grad));
        self.launch_complete()
    }

    /// Bucket `b`'s buffer: its own, else the one back from its last
    /// reduction, else a new zeroed one, unless `wait_for_last` and the last
    /// reduction has not handed it back yet.
    fn storage(&mut self, b: usize, wait_for_last: bool) -> Result<&mut Boxed> {
        let bucket = &mut self.buckets[b];
        if bucket.buf.is_none() {
            let back = self.pool.lock().unwrap_or_else(|p| p.into_inner())[b].take();
            let buf = match back {
                Some(buf) => buf,
                None if bucket.out && wait_for_last => {
                    return Err(invalid(format!(
                        "bucket {b} is still being reduced: wait for the step's Work first"
                    )))
                }
                None => (bucket.ops.alloc)(bucket.len),
            };
            bucket.out = false;
            bucket.buf = Some(buf);
        }
        bucket
            .buf
            .as_mut()
            .ok_or_else(|| Error::Internal("bucketer: a bucket lost its buffer".into()))
    }

    fn view_check<T: Element>(&mut self, id: TensorId) -> Result<(usize, usize, usize)> {
        self.tensor(id)?;
        self.freeze(); // before reading the tensor's place
        let t = self.tensor(id)?;
        if t.dtype != T::DTYPE {
            return Err(invalid(format!(
                "{id} was registered as {}, not {}",
                t.dtype,
                T::DTYPE
            )));
        }
        Ok((t.bucket, t.offset, t.len))
    }

    /// Zero-copy form (DDP's `gradient_as_bucket_view`): tensor `id`'s place
    /// in its bucket, to write the gradient into before [`Bucketer::mark_ready`].
    /// After a synchronised step's `Work` completed it holds the reduced
    /// values; in `no_sync` steps it holds the sum so far, so add to it. Fails
    /// while the tensor's bucket is being reduced, and for a tensor marked
    /// ready in the current step.
    pub fn view_mut<T: Element>(&mut self, id: TensorId) -> Result<&mut [T]> {
        let (b, off, len) = self.view_check::<T>(id)?;
        if self.tensors[id.0].ready {
            return Err(invalid(format!(
                "{id} was already marked ready in this step"
            )));
        }
        let v = typed_mut::<T>(self.storage(b, true)?)?;
        v.get_mut(off..off + len).ok_or_else(|| range_err("view"))
    }

    /// Tensor `id`'s place in its bucket, to read: after a synchronised
    /// step's `Work` completed, the reduced values of a tensor marked ready
    /// in place ([`Bucketer::mark_ready`]). A tensor handed over as a `Vec`
    /// ([`Bucketer::ready`]) comes back through [`Reduced`]; its place may
    /// hold older values, as a bucket whose tensors were all handed over is
    /// reduced where the `Vec`s lie when every rank runs on this host.
    pub fn view<T: Element>(&mut self, id: TensorId) -> Result<&[T]> {
        let (b, off, len) = self.view_check::<T>(id)?;
        let v = typed::<T>(self.storage(b, true)?)?;
        v.get(off..off + len).ok_or_else(|| range_err("view"))
    }

    /// Marks tensor `id` ready in place: its gradient was written through
    /// [`Bucketer::view_mut`]. Launches the buckets that are now complete, as
    /// [`Bucketer::ready`] does. The step's [`Reduced`] holds no `Vec` for it;
    /// read the result with [`Bucketer::view`].
    pub fn mark_ready(&mut self, id: TensorId) -> Result<()> {
        self.tensor(id)?;
        self.freeze(); // before reading the tensor's place
        let t = self.tensor(id)?;
        if t.ready {
            return Err(invalid(format!(
                "{id} was already marked ready in this step"
            )));
        }
        let b = t.bucket;
        self.storage(b, true)?;
        self.in_step = true;
        self.tensors[id.0].ready = true;
        self.buckets[b].missing -= 1;
        self.launch_complete()
    }

    /// Launches, in order, every bucket whose tensors are all ready and
    /// whose predecessors were launched.
    fn launch_complete(&mut self) -> Result<()> {
        if self.no_sync {
            return Ok(());
        }
        while self.next_launch < self.buckets.len() && self.buckets[self.next_launch].missing == 0 {
            self.launch(self.next_launch)?;
            self.next_launch += 1;
        }
        Ok(())
    }

    fn sender(&mut self) -> Result<&mpsc::Sender<Msg>> {
        if self.tx.is_none() {
            let (tx, rx) = mpsc::channel();
            let pool = self.pool.clone();
            let n = self.tensors.len();
            std::thread::Builder::new()
                .name(format!("ccl-bucketer-r{}", self.comm.rank()))
                .spawn(move || complete_steps(rx, pool, n))
                .map_err(|e| Error::io("bucketer: spawning its completion thread", e))?;
            self.tx = Some(tx);
        }
        Ok(self.tx.as_ref().expect("set above"))
    }

    fn launch(&mut self, b: usize) -> Result<()> {
        let op = self.op;
        let comm = &self.comm.clone(); // launches below borrow `self` mutably
        let bucket = &mut self.buckets[b];
        let ops = bucket.ops;
        let mut held = std::mem::take(&mut bucket.held);
        let accumulated = std::mem::replace(&mut bucket.accumulated, false);
        let dtype = bucket.tensors.first().map(|&t| self.tensors[t].dtype);
        let mut in_place = Vec::new();
        let (pending, tensors, direct) =
            if bucket.direct() && !held.is_empty() {
                let (id, mut grad) = held.into_iter().next().ok_or_else(|| {
                    Error::Internal("bucketer: a launched bucket is empty".into())
                })?;
                if let (true, Some(acc)) = (accumulated, &bucket.buf) {
                    // The gradients of the no_sync steps join this one's.
                    (ops.pack)(&mut grad, acc, 0, true)?;
                }
                ((ops.launch)(comm, grad, op), Vec::new(), Some(id))
            } else if !accumulated
                && held.len() == bucket.tensors.len()
                && dtype.is_some_and(|d| comm.allreduces_on_group(bucket.len, d))
            {
                // Every tensor was handed over: reduce them where they lie, in
                // the bucket's order (the same on every rank), without packing.
                held.sort_by_key(|(id, _)| self.tensors[*id].offset);
                let (ids, grads): (Vec<usize>, Vec<Boxed>) = held.into_iter().unzip();
                in_place = ids;
                ((ops.launch_on)(comm, grads, op), Vec::new(), None)
            } else {
                let offsets: Vec<usize> = held
                    .iter()
                    .map(|(id, _)| self.tensors[*id].offset)
                    .collect();
                let buf = self.storage(b, false)?;
                for ((_, grad), off) in held.iter().zip(offsets) {
                    (ops.pack)(buf, grad, off, accumulated)?;
                }
                let bucket = &mut self.buckets[b];
                let buf = bucket.buf.take().ok_or_else(|| {
                    Error::Internal("bucketer: a full bucket has no buffer".into())
                })?;
                bucket.out = true;
                let tensors = held
                    .into_iter()
                    .map(|(id, g)| (id, g, self.tensors[id].offset))
                    .collect();
                ((ops.launch)(comm, buf, op), tensors, None)
            };
        self.sender()?
            .send(Msg::Launched {
                bucket: b,
                pending,
                ops,
                tensors,
                direct,
                in_place,
            })
            .map_err(|_| Error::Internal("bucketer: its completion thread is gone".into()))
    }

    /// Ends the step: a [`Work`] that completes once every bucket is reduced
    /// and unpacked. Fails at once (leaving the step open) if a tensor was
    /// not handed over. In a no_sync step the work is complete at once and
    /// gives the tensors back unchanged.
    pub fn finish(&mut self) -> Work<Reduced> {
        let missing: Vec<usize> = (0..self.tensors.len())
            .filter(|&i| !self.tensors[i].ready)
            .collect();
        if !missing.is_empty() {
            let shown: Vec<String> = missing.iter().take(8).map(|i| i.to_string()).collect();
            return Work::ready(Err(invalid(format!(
                "finish with {} tensors not ready (tensors {}{})",
                missing.len(),
                shown.join(", "),
                if missing.len() > 8 { ", ..." } else { "" }
            ))));
        }
        self.freeze();
        for t in &mut self.tensors {
            t.ready = false;
        }
        for b in &mut self.buckets {
            b.missing = b.tensors.len();
            // Later steps add to what this no_sync step packed.
            b.accumulated |= self.no_sync;
        }
        self.in_step = false;
        self.next_launch = 0;
        self.steps += 1;
        if self.no_sync {
            let mut out = Reduced::new(&self.tensors);
            for (id, g) in self.unsynced.drain(..) {
                out.slots[id] = Some(g);
            }
            return Work::ready(Ok(out));
        }
        if self.tensors.is_empty() {
            return Work::ready(Ok(Reduced::new(&self.tensors)));
        }
        let (work, completer) = work_pair();
        match self.sender() {
            Ok(tx) => {
                // If the thread is gone, the dropped completer fails the work.
                let _ = tx.send(Msg::Finish(completer));
            }
            Err(e) => completer.complete(Err(e)),
        }
        work
    }
}
