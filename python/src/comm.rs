//! `ccl.Communicator` and `ccl.ReduceOp`: every collective and transfer on
//! arrays, blocking (the GIL released while it runs) or started
//! (`async_op=True`, returning a `ccl.Work`).

use std::{
    ptr::NonNull,
    sync::{Arc, Mutex},
    time::Duration,
};

use ccl::{
    cuda::Stream, BufMut, BufRef, Collective, CollectiveKind as K, Communicator as Comm, Config,
    DataType, MemoryKind, Options, ReduceOp as Op,
};
use pyo3::{
    exceptions::{PyTypeError, PyValueError},
    prelude::*,
};

use crate::{
    dlpack::{array, Array},
    store::PyStore,
    to_py,
    work::Work,
    BrokenError,
};

/// The op of a call: a name ("sum", "avg", "band", ...) or a
/// `ccl.ReduceOp` (which has `name` and, for "premulsum", `scalar`).
fn op_of(op: &Bound<'_, PyAny>) -> PyResult<Op> {
    let wrong = || PyTypeError::new_err("op must be a ccl.ReduceOp or its name");
    let (name, scalar): (String, Option<f64>) = match op.extract::<String>() {
        Ok(name) => (name, None),
        Err(_) => (
            op.getattr("name")
                .and_then(|n| n.extract())
                .map_err(|_| wrong())?,
            op.getattr("scalar")
                .and_then(|s| s.extract())
                .map_err(|_| wrong())?,
        ),
    };
    let name = name.to_ascii_lowercase();
    if name == "premulsum" {
        return scalar.map(Op::PreMulSum).ok_or_else(|| {
            PyValueError::new_err("premulsum needs its scalar: ReduceOp.premul_sum(scalar)")
        });
    }
    Op::ALL
        .into_iter()
        .find(|o| o.name() == name && !matches!(o, Op::PreMulSum(_)))
        .ok_or_else(|| {
            PyValueError::new_err(format!(
                "no reduction op is named {name:?} (sum, prod, min, max, avg, band, bor, bxor; \
                 ReduceOp.premul_sum(scalar))"
            ))
        })
}

/// A group of ranks that run collectives together.
///
/// `Communicator()` joins the job its environment describes (torchrun,
/// mpirun, srun, ccl-run; `MASTER_ADDR`/`MASTER_PORT`); `rank`,
/// `world_size` and `addr` ("host:port" of a TCP store that rank 0 serves)
/// set them explicitly; `store` meets through a store object instead (a
/// `torch.distributed.Store`, or anything with its `set`, `get`, `add`,
/// `check`, `compare_set` and `delete_key`). `timeout` (seconds) bounds
/// every wait. Calls on one communicator must come in the same order on
/// every rank: from one thread, or ordered by the program.
///
/// A call on arrays in GPU memory (CUDA tensors, `ccl.DeviceBuffer`) is
/// queued on `stream` (a `CUstream` handle such as
/// `torch.cuda.current_stream().cuda_stream`; the GPU's default stream if
/// None): it starts after the work queued there, and later work there sees
/// its result. Blocking, it returns once the stream has reached it; with
/// `async_op=True` at once, and its `Work` completes then. A rank that both
/// sends and receives on one stream deadlocks as with NCCL: use a stream
/// for each.
#[pyclass(module = "ccl._ccl", frozen)]
pub struct Communicator {
    comm: Mutex<Option<Comm>>,
}

/// Raw memory of a call, sent to the thread that runs it.
#[derive(Clone, Copy)]
struct Raw {
    kind: MemoryKind,
    ptr: usize,
    bytes: usize,
}

impl Raw {
    fn of(a: &Array) -> Raw {
        Raw {
            kind: a.kind,
            ptr: a.ptr as usize,
            bytes: a.bytes,
        }
    }

    const EMPTY: Raw = Raw {
        kind: MemoryKind::Host,
        ptr: 0,
        bytes: 0,
    };

    fn ptr(self) -> *mut u8 {
        if self.ptr == 0 {
            NonNull::dangling().as_ptr()
        } else {
            self.ptr as *mut u8
        }
    }

    /// # Safety
    /// The memory is valid for reads until the call that uses it completes.
    unsafe fn input<'a>(self) -> BufRef<'a> {
        BufRef::from_raw(self.kind, self.ptr(), self.bytes)
    }

    /// # Safety
    /// The memory is valid for writes until the call that uses it completes.
    unsafe fn output<'a>(self) -> BufMut<'a> {
        BufMut::from_raw(self.kind, self.ptr(), self.bytes)
    }
}

fn seconds(t: f64) -> PyResult<Duration> {
    if t.is_finite() && t > 0.0 {
        Ok(Duration::from_secs_f64(t))
    } else {
        Err(PyValueError::new_err(format!(
            "timeout {t} is not a positive number of seconds"
        )))
    }
}

impl Communicator {
    fn wrap(comm: Comm) -> Communicator {
        Communicator {
            comm: Mutex::new(Some(comm)),
        }
    }

    /// A handle on the communicator (a clone: it is an `Arc` inside).
    fn get(&self) -> PyResult<Comm> {
        self.comm
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(|| BrokenError::new_err("the communicator was closed"))
    }

    /// Runs or starts `coll` on `input` and `output`, keeping both alive
    /// for as long as the call uses them.
    fn start(
        &self,
        py: Python<'_>,
        coll: Collective,
        input: Option<Array>,
        output: Option<Array>,
        async_op: bool,
        stream: Option<u64>,
    ) -> PyResult<Option<Work>> {
        let comm = self.get()?;
        let o = output.as_ref().map_or(Raw::EMPTY, Raw::of);
        // No input: the call reads its output (in place; or a role without input).
        let i = input.as_ref().map_or(o, Raw::of);
        if let Some(stream) = stream_for(&[input.as_ref(), output.as_ref()], stream)? {
            // SAFETY: waited for here, or the Work keeps the arrays alive.
            let work = py
                .detach(|| unsafe { comm.launch_on_stream(&coll, i.input(), o.output(), &stream) });
            let keep = input.into_iter().chain(output).map(|a| a.keep).collect();
            return finish(py, work, keep, async_op);
        }
        if !async_op {
            // SAFETY: the arrays (`input`, `output`) outlive this blocking call.
            let result = py.detach(|| unsafe { comm.run(&coll, i.input(), o.output()) });
            drop((input, output));
            return result.map(|()| None).map_err(to_py);
        }
        // SAFETY: the Work keeps the arrays alive until the call is done.
        let work = py.detach(|| unsafe { comm.launch(&coll, i.input(), o.output()) });
        let keep = input.into_iter().chain(output).map(|a| a.keep).collect();
        Ok(Some(Work::new(work, keep)))
    }

    /// One side of a transfer.
    fn transfer(
        &self,
        py: Python<'_>,
        buf: Array,
        peer: usize,
        send: bool,
        async_op: bool,
        stream: Option<u64>,
    ) -> PyResult<Option<Work>> {
        let comm = self.get()?;
        let (raw, dtype) = (Raw::of(&buf), buf.dtype);
        let on = stream_for(&[Some(&buf)], stream)?;
        // SAFETY: as in `start`: waited for here, or the Work keeps `buf`.
        let work = py.detach(|| unsafe {
            match (send, &on) {
                (true, None) => comm.launch_send(dtype, peer, raw.input()),
                (false, None) => comm.launch_recv(dtype, peer, raw.output()),
                (true, Some(s)) => comm.launch_send_on_stream(dtype, peer, raw.input(), s),
                (false, Some(s)) => comm.launch_recv_on_stream(dtype, peer, raw.output(), s),
            }
        });
        finish(py, work, vec![buf.keep], async_op)
    }
}

/// A started call's result: its `Work` (which keeps the arrays' owners
/// alive), or, blocking, what it ends with once waited for.
fn finish(
    py: Python<'_>,
    work: ccl::Work<()>,
    keep: Vec<Py<PyAny>>,
    async_op: bool,
) -> PyResult<Option<Work>> {
    if async_op {
        return Ok(Some(Work::new(work, keep)));
    }
    let result = py.detach(|| work.wait());
    drop(keep);
    result.map(|()| None).map_err(to_py)
}

/// Checks that two arrays of one call hold the same element type.
fn same_dtype(a: &Array, b: &Array) -> PyResult<DataType> {
    if a.dtype != b.dtype {
        return Err(PyTypeError::new_err(format!(
            "the input holds {} and the output {}: they must match",
            a.dtype, b.dtype
        )));
    }
    Ok(a.dtype)
}

fn input(obj: &Bound<'_, PyAny>, stream: Option<u64>) -> PyResult<Array> {
    array(obj, "the input", stream)
}

fn output(obj: &Bound<'_, PyAny>, stream: Option<u64>) -> PyResult<Array> {
    array(obj, "the output", stream)?.writable("the output")
}

/// The arrays of an in-place-capable call: `tensor` and `out`, or `tensor`
/// alone (None for the input: the call reads and writes the output).
fn in_place_or(
    tensor: &Bound<'_, PyAny>,
    out: Option<&Bound<'_, PyAny>>,
    stream: Option<u64>,
) -> PyResult<(Option<Array>, Array)> {
    match out {
        Some(out) => {
            let (i, o) = (input(tensor, stream)?, output(out, stream)?);
            same_dtype(&i, &o)?;
            Ok((Some(i), o))
        }
        None => Ok((
            None,
            array(tensor, "the tensor", stream)?.writable("the tensor (in place)")?,
        )),
    }
}

/// The stream a call on `arrays` runs on: for GPU memory, the caller's
/// `stream` (a `CUstream` handle, as `torch.cuda.Stream.cuda_stream`) or
/// the GPU's default stream; for host memory none (and a stream is an
/// error).
fn stream_for(arrays: &[Option<&Array>], stream: Option<u64>) -> PyResult<Option<Stream>> {
    let ordinal = arrays.iter().flatten().find_map(|a| match a.kind {
        MemoryKind::Device { ordinal } => Some(ordinal),
        MemoryKind::Host => None,
    });
    match (ordinal, stream) {
        (None, None) => Ok(None),
        (None, Some(s)) => Err(PyValueError::new_err(format!(
            "stream {s:#x} was given, but the arrays are in host memory (streams order \
             calls on GPU memory)"
        ))),
        (Some(ordinal), s) => {
            let gpu = ccl::cuda::open(ordinal).map_err(to_py)?;
            // SAFETY: the caller's stream of that GPU, which it keeps alive
            // until the work queued on it is done (NCCL's contract too).
            Ok(Some(unsafe { Stream::borrow_raw(gpu, s.unwrap_or(0)) }))
        }
    }
}

#[pymethods]
impl Communicator {
    #[new]
    #[pyo3(signature = (rank=None, world_size=None, *, addr=None, store=None, timeout=None))]
    fn new(
        py: Python<'_>,
        rank: Option<usize>,
        world_size: Option<usize>,
        addr: Option<String>,
        store: Option<Bound<'_, PyAny>>,
        timeout: Option<f64>,
    ) -> PyResult<Communicator> {
        let timeout = timeout.map(seconds).transpose()?;
        if let Some(store) = store {
            let (Some(rank), Some(world_size)) = (rank, world_size) else {
                return Err(PyValueError::new_err(
                    "a communicator on a store needs rank and world_size",
                ));
            };
            // As `from_config` does for the other ways in: CCL_DEBUG's logs
            // (torch's backend comes this way).
            let debug = std::env::var("CCL_DEBUG").ok().filter(|s| !s.is_empty());
            ccl::init_tracing(debug.as_deref());
            let mut options = Options::from_env().map_err(to_py)?;
            if let Some(t) = timeout {
                options.timeout = t;
            }
            let store = Arc::new(PyStore::new(store));
            let comm = py.detach(|| Comm::new(rank, world_size, store, options));
            return comm.map(Communicator::wrap).map_err(to_py);
        }
        let mut extra: Vec<(&str, String)> = Vec::new();
        match (rank, world_size) {
            (Some(r), Some(n)) => {
                extra.push(("RANK", r.to_string()));
                extra.push(("WORLD_SIZE", n.to_string()));
            }
            (None, None) => {}
            _ => {
                return Err(PyValueError::new_err(
                    "give both rank and world_size, or neither (to read them from the environment)",
                ))
            }
        }
        if let Some(addr) = addr {
            let (host, port) = addr
                .rsplit_once(':')
                .ok_or_else(|| PyValueError::new_err(format!("addr {addr:?} is not host:port")))?;
            extra.push(("MASTER_ADDR", host.trim_matches(['[', ']']).to_string()));
            extra.push(("MASTER_PORT", port.to_string()));
        }
        if let Some(t) = timeout {
            extra.push(("CCL_TIMEOUT", format!("{}ms", t.as_millis().max(1))));
        }
        let config = Config::from_env_with(&extra).map_err(to_py)?;
        let comm = py.detach(|| Comm::from_config(&config));
        comm.map(Communicator::wrap).map_err(to_py)
    }

    /// This process's rank.
    #[getter]
    fn rank(&self) -> PyResult<usize> {
        Ok(self.get()?.rank())
    }

    /// The number of ranks.
    #[getter]
    fn world_size(&self) -> PyResult<usize> {
        Ok(self.get()?.world_size())
    }

    /// This rank's index among the ranks of this communicator on its host
    /// (torch's LOCAL_RANK: which GPU to take).
    #[getter]
    fn host_rank(&self) -> PyResult<usize> {
        Ok(self.get()?.host_rank())
    }

    /// How many ranks of this communicator run on this rank's host.
    #[getter]
    fn host_size(&self) -> PyResult<usize> {
        Ok(self.get()?.host_size())
    }

    /// Seconds every wait may take before it fails with `ccl.TimeoutError`.
    #[getter]
    fn get_timeout(&self) -> PyResult<f64> {
        Ok(self.get()?.timeout().as_secs_f64())
    }

    #[setter]
    fn set_timeout(&self, t: f64) -> PyResult<()> {
        self.get()?.set_timeout(seconds(t)?);
        Ok(())
    }

    /// The transports of this rank's links: `[(name, peers)]`.
    #[getter]
    fn transports(&self) -> PyResult<Vec<(&'static str, usize)>> {
        Ok(self.get()?.transports_used().to_vec())
    }

    /// Sums (or reduces by `op`) `tensor` across ranks into `out`, or into
    /// `tensor` itself when `out` is None.
    #[pyo3(signature = (tensor, out=None, op=None, *, async_op=false, stream=None))]
    fn allreduce(
        &self,
        py: Python<'_>,
        tensor: &Bound<'_, PyAny>,
        out: Option<&Bound<'_, PyAny>>,
        op: Option<&Bound<'_, PyAny>>,
        async_op: bool,
        stream: Option<u64>,
    ) -> PyResult<Option<Work>> {
        let (i, o) = in_place_or(tensor, out, stream)?;
        let coll = Collective::new(K::AllReduce, o.dtype, o.len()).with_op(op_or_sum(op)?);
        self.start(py, coll, i, Some(o), async_op, stream)
    }

    /// Copies `tensor` of rank `root` into `tensor` on every rank.
    #[pyo3(signature = (tensor, root=0, *, async_op=false, stream=None))]
    fn broadcast(
        &self,
        py: Python<'_>,
        tensor: &Bound<'_, PyAny>,
        root: usize,
        async_op: bool,
        stream: Option<u64>,
    ) -> PyResult<Option<Work>> {
        let (i, o) = in_place_or(tensor, None, stream)?;
        let coll = Collective::new(K::Broadcast, o.dtype, o.len()).with_root(root);
        self.start(py, coll, i, Some(o), async_op, stream)
    }

    /// Reduces `tensor` across ranks into `out` (or `tensor`) on `root`.
    #[pyo3(signature = (tensor, out=None, op=None, root=0, *, async_op=false, stream=None))]
    // The arguments are the Python signature's.
    #[allow(clippy::too_many_arguments)]
    fn reduce(
        &self,
        py: Python<'_>,
        tensor: &Bound<'_, PyAny>,
        out: Option<&Bound<'_, PyAny>>,
        op: Option<&Bound<'_, PyAny>>,
        root: usize,
        async_op: bool,
        stream: Option<u64>,
    ) -> PyResult<Option<Work>> {
        let (i, o) = in_place_or(tensor, out, stream)?;
        let coll = Collective::new(K::Reduce, o.dtype, o.len())
            .with_op(op_or_sum(op)?)
            .with_root(root);
        self.start(py, coll, i, Some(o), async_op, stream)
    }

    /// Concatenates every rank's `tensor` into `out` (world_size times as
    /// long), in rank order.
    #[pyo3(signature = (tensor, out, *, async_op=false, stream=None))]
    fn allgather(
        &self,
        py: Python<'_>,
        tensor: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        async_op: bool,
        stream: Option<u64>,
    ) -> PyResult<Option<Work>> {
        let (i, o) = (input(tensor, stream)?, output(out, stream)?);
        let coll = Collective::new(K::AllGather, same_dtype(&i, &o)?, i.len());
        self.start(py, coll, Some(i), Some(o), async_op, stream)
    }

    /// Reduces `tensor` (world_size blocks) across ranks; rank r gets block
    /// r in `out`.
    #[pyo3(signature = (tensor, out, op=None, *, async_op=false, stream=None))]
    fn reduce_scatter(
        &self,
        py: Python<'_>,
        tensor: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        op: Option<&Bound<'_, PyAny>>,
        async_op: bool,
        stream: Option<u64>,
    ) -> PyResult<Option<Work>> {
        let (i, o) = (input(tensor, stream)?, output(out, stream)?);
        let coll =
            Collective::new(K::ReduceScatter, same_dtype(&i, &o)?, o.len()).with_op(op_or_sum(op)?);
        self.start(py, coll, Some(i), Some(o), async_op, stream)
    }

    /// Block j of `tensor` (world_size equal blocks) goes to rank j, which
    /// puts it at block r of its `out`.
    #[pyo3(signature = (tensor, out, *, async_op=false, stream=None))]
    fn alltoall(
        &self,
        py: Python<'_>,
        tensor: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        async_op: bool,
        stream: Option<u64>,
    ) -> PyResult<Option<Work>> {
        let (i, o) = (input(tensor, stream)?, output(out, stream)?);
        let n = self.get()?.world_size();
        if i.len() % n != 0 {
            return Err(PyValueError::new_err(format!(
                "alltoall: the input's {} elements do not split into {n} equal blocks",
                i.len()
            )));
        }
        let coll = Collective::new(K::AllToAll, same_dtype(&i, &o)?, i.len() / n);
        self.start(py, coll, Some(i), Some(o), async_op, stream)
    }

    /// Concatenates every rank's `tensor` into `out` on `root` (other
    /// ranks may pass None).
    #[pyo3(signature = (tensor, out=None, root=0, *, async_op=false, stream=None))]
    fn gather(
        &self,
        py: Python<'_>,
        tensor: &Bound<'_, PyAny>,
        out: Option<&Bound<'_, PyAny>>,
        root: usize,
        async_op: bool,
        stream: Option<u64>,
    ) -> PyResult<Option<Work>> {
        let i = input(tensor, stream)?;
        let o = out.map(|o| output(o, stream)).transpose()?;
        let dtype = match &o {
            Some(o) => same_dtype(&i, o)?,
            None => i.dtype,
        };
        let coll = Collective::new(K::Gather, dtype, i.len()).with_root(root);
        self.start(py, coll, Some(i), o, async_op, stream)
    }

    /// Block r of `tensor` on `root` (world_size blocks; other ranks may
    /// pass None) goes to `out` on rank r.
    #[pyo3(signature = (tensor, out, root=0, *, async_op=false, stream=None))]
    fn scatter(
        &self,
        py: Python<'_>,
        tensor: Option<&Bound<'_, PyAny>>,
        out: &Bound<'_, PyAny>,
        root: usize,
        async_op: bool,
        stream: Option<u64>,
    ) -> PyResult<Option<Work>> {
        let o = output(out, stream)?;
        let i = tensor.map(|t| input(t, stream)).transpose()?;
        let dtype = match &i {
            Some(i) => same_dtype(i, &o)?,
            None => o.dtype,
        };
        let coll = Collective::new(K::Scatter, dtype, o.len()).with_root(root);
        self.start(py, coll, i, Some(o), async_op, stream)
    }

    /// Returns once every rank has called it.
    #[pyo3(signature = (*, async_op=false))]
    fn barrier(&self, py: Python<'_>, async_op: bool) -> PyResult<Option<Work>> {
        let coll = Collective::new(K::Barrier, DataType::U8, 0);
        self.start(py, coll, None, None, async_op, None)
    }

    /// Sends `tensor` to rank `peer`, which receives it with `recv`.
    #[pyo3(signature = (tensor, peer, *, async_op=false, stream=None))]
    fn send(
        &self,
        py: Python<'_>,
        tensor: &Bound<'_, PyAny>,
        peer: usize,
        async_op: bool,
        stream: Option<u64>,
    ) -> PyResult<Option<Work>> {
        self.transfer(py, input(tensor, stream)?, peer, true, async_op, stream)
    }

    /// Receives into `tensor` what rank `peer` sends.
    #[pyo3(signature = (tensor, peer, *, async_op=false, stream=None))]
    fn recv(
        &self,
        py: Python<'_>,
        tensor: &Bound<'_, PyAny>,
        peer: usize,
        async_op: bool,
        stream: Option<u64>,
    ) -> PyResult<Option<Work>> {
        self.transfer(py, output(tensor, stream)?, peer, false, async_op, stream)
    }

    /// Splits the ranks (`MPI_Comm_split`): ranks with equal `color` form a
    /// new communicator, ordered by `key` then rank; `color=None` joins
    /// none and returns None. Every rank calls it.
    #[pyo3(signature = (color, key=0))]
    fn split(
        &self,
        py: Python<'_>,
        color: Option<u32>,
        key: i64,
    ) -> PyResult<Option<Communicator>> {
        let comm = self.get()?;
        let sub = py.detach(|| comm.split(color, key)).map_err(to_py)?;
        Ok(sub.map(Communicator::wrap))
    }

    /// Fails the calls in flight at once and tells the other ranks; the
    /// communicator is broken afterwards. Safe from any thread.
    fn abort(&self) -> PyResult<()> {
        self.get()?.abort();
        Ok(())
    }

    /// Releases the communicator (its links and threads); later calls raise
    /// `ccl.BrokenError`.
    fn close(&self, py: Python<'_>) {
        let comm = self.comm.lock().unwrap_or_else(|p| p.into_inner()).take();
        py.detach(|| drop(comm));
    }

    fn __enter__(slf: Bound<'_, Self>) -> Bound<'_, Self> {
        slf
    }

    fn __exit__(
        &self,
        py: Python<'_>,
        _t: Option<&Bound<'_, PyAny>>,
        _v: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) {
        self.close(py);
    }

    fn __repr__(&self) -> String {
        match self.get() {
            Ok(c) => format!("<ccl.Communicator rank {} of {}>", c.rank(), c.world_size()),
            Err(_) => "<ccl.Communicator closed>".into(),
        }
    }
}

fn op_or_sum(op: Option<&Bound<'_, PyAny>>) -> PyResult<Op> {
    op.map_or(Ok(Op::Sum), op_of)
}

impl Drop for Communicator {
    fn drop(&mut self) {
        // The engine's threads may need the interpreter (a Python store):
        // release it while they stop.
        let comm = self
            .comm
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if comm.is_some() {
            Python::attach(|py| py.detach(|| drop(comm)));
        }
    }
}
