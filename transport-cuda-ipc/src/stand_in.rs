//! A [`Gpu`] made of host memory and threads, for machines without one.
//!
//! "Device memory" is host memory that this value hands out and tags as
//! the memory of GPU `ordinal` (so that it is never taken for host memory
//! by mistake, and a host pointer passed as device memory is caught as with
//! a real driver); each stream is a thread that runs its operations in
//! order, so copies are asynchronous as a copy engine's are, and waits on
//! events and words block only that stream. It exercises everything the
//! staging pipeline and the communicator do with a GPU except the device
//! itself. Chosen with `CCL_CUDA_STAND_IN=1` (see [`crate::open`]).
//!
//! A stream holds at most [`STREAM_QUEUE`] operations not yet run: queuing
//! onto a full one blocks, and holds up every other thread's queuing onto
//! any stream of the GPU meanwhile, as the driver did on an H200 (a rank
//! that queued hundreds of staged chunks hung so; see `staging::AHEAD`).

use std::{
    collections::{BTreeMap, HashMap},
    sync::{
        atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering},
        mpsc, Arc, Mutex, MutexGuard,
    },
    thread,
    time::Duration,
};

use std::os::fd::{AsRawFd, OwnedFd, RawFd};

use ccl_core::{kernels, DataType, Error, MemoryKind, ReduceOp, Result, Scratch};
use nix::sys::memfd::{memfd_create, MemFdCreateFlag};

use crate::gpu::{Exported, Gpu, RawEvent, RawStream};

type Op = Box<dyn FnOnce() + Send>;

/// Operations a stream holds before queuing onto it blocks.
pub const STREAM_QUEUE: usize = 256;

/// Device allocations: start address → length, the memfd's number, and a
/// serial number (so that a handle never names two allocations, as a memfd
/// number may once the first is freed).
type Allocations = Arc<Mutex<BTreeMap<usize, (usize, RawFd, u64)>>>;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The stand-in GPU.
pub struct StandInGpu {
    ordinal: u32,
    allocations: Allocations,
    streams: Mutex<HashMap<RawStream, mpsc::SyncSender<Op>>>,
    events: Mutex<HashMap<RawEvent, Arc<AtomicBool>>>,
    next_handle: AtomicU64,
}

impl StandInGpu {
    /// A stand-in for GPU `ordinal`, with its default stream (0).
    pub fn new(ordinal: u32) -> Result<StandInGpu> {
        let gpu = StandInGpu {
            ordinal,
            allocations: Arc::default(),
            streams: Mutex::default(),
            events: Mutex::default(),
            next_handle: AtomicU64::new(1),
        };
        gpu.spawn_stream(0)?;
        Ok(gpu)
    }

    fn spawn_stream(&self, id: RawStream) -> Result<()> {
        let (tx, rx) = mpsc::sync_channel::<Op>(STREAM_QUEUE);
        thread::Builder::new()
            .name(format!("gpu{}-stream{id}", self.ordinal))
            .spawn(move || rx.into_iter().for_each(|op| op()))
            .map_err(|e| Error::io("starting a stand-in GPU stream", e))?;
        lock(&self.streams).insert(id, tx);
        Ok(())
    }

    fn enqueue(&self, stream: RawStream, op: Op) -> Result<()> {
        // Held while a full stream blocks the send: the driver's way.
        let streams = lock(&self.streams);
        let tx = streams.get(&stream).ok_or_else(|| {
            Error::InvalidArgument(format!("{}: no stream {stream:#x}", self.name()))
        })?;
        tx.send(op)
            .map_err(|_| Error::Internal(format!("{}: stream {stream:#x} stopped", self.name())))
    }

    fn kind(&self) -> MemoryKind {
        MemoryKind::Device {
            ordinal: self.ordinal,
        }
    }

    fn event(&self, event: RawEvent) -> Result<Arc<AtomicBool>> {
        lock(&self.events)
            .get(&event)
            .cloned()
            .ok_or_else(|| Error::InvalidArgument(format!("{}: no event {event:#x}", self.name())))
    }
}

/// Waits as a stream waits: without a deadline (the host that enqueued the
/// wait releases it), politely.
fn wait_until(done: impl Fn() -> bool) {
    let mut spins = 0u32;
    while !done() {
        spins += 1;
        if spins < 1000 {
            std::hint::spin_loop();
        } else if spins < 5000 {
            thread::yield_now();
        } else {
            thread::sleep(Duration::from_micros(50));
        }
    }
}

/// Shared memory mapped into this process: device memory of the stand-in
/// (a memfd, which other processes map through `/proc/PID/fd/FD`, as CUDA
/// IPC maps device memory), unmapped when dropped.
struct Mapping {
    ptr: *mut u8,
    len: usize,
    /// The memfd of memory allocated here (imports close theirs at once).
    _fd: Option<OwnedFd>,
    /// Allocations here are registered, to tell device from host memory.
    registered: Option<Allocations>,
}

// SAFETY: owns its mapping, like a Vec.
unsafe impl Send for Mapping {}

impl Drop for Mapping {
    fn drop(&mut self) {
        if let Some(a) = &self.registered {
            lock(a).remove(&(self.ptr as usize));
        }
        // SAFETY: mapped by `map`, unmapped once.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// Maps `len` bytes of the shared memory `fd`.
fn map(fd: &OwnedFd, len: usize) -> Result<*mut u8> {
    // SAFETY: a fresh shared mapping of a file this process holds open.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(Error::io(
            "mapping stand-in device memory",
            std::io::Error::last_os_error(),
        ));
    }
    Ok(ptr.cast())
}

/// The stand-in's kernels: the CPU kernels, on a copy (inputs may alias `out`).
fn host_reduce(op: ReduceOp, dtype: DataType, out: usize, inputs: &[usize], bytes: usize) {
    // SAFETY (all below): device memory of the stand-in that the enqueuer
    // keeps valid until the stream passes this operation.
    let view = |at: usize| unsafe { std::slice::from_raw_parts(at as *const u8, bytes) };
    let mut acc = view(inputs[0]).to_vec();
    let fold = if matches!(op, ReduceOp::PreMulSum(_)) {
        ReduceOp::Sum
    } else {
        op
    };
    for &input in &inputs[1..] {
        kernels::reduce(fold, dtype, &mut acc, None, view(input)).expect("checked arguments");
    }
    kernels::finalize(fold, dtype, &mut acc, inputs.len()).expect("checked arguments");
    unsafe { std::ptr::copy(acc.as_ptr(), out as *mut u8, bytes) };
}

impl Gpu for StandInGpu {
    fn ordinal(&self) -> u32 {
        self.ordinal
    }

    fn name(&self) -> String {
        format!("stand-in GPU {} (host memory)", self.ordinal)
    }

    fn uuid(&self) -> Result<[u8; 16]> {
        let mut uuid = *b"ccl-stand-in-gpu";
        uuid[12..].copy_from_slice(&self.ordinal.to_le_bytes());
        Ok(uuid)
    }

    fn side_by_side(&self) -> Option<bool> {
        Some(true)
    }

    fn prepare_kernels(&self) -> Result<()> {
        Ok(())
    }

    fn kind_of(&self, ptr: *const u8) -> Result<MemoryKind> {
        let at = ptr as usize;
        let allocations = lock(&self.allocations);
        Ok(match allocations.range(..=at).next_back() {
            Some((&start, &(len, _, _))) if at < start + len.max(1) => self.kind(),
            _ => MemoryKind::Host,
        })
    }

    fn alloc_device(&self, len: usize) -> Result<Scratch> {
        let io = |e: nix::Error| Error::io("allocating stand-in device memory", e.into());
        let fd = memfd_create(c"ccl-stand-in-gpu", MemFdCreateFlag::MFD_CLOEXEC).map_err(io)?;
        let size = len.max(1);
        nix::unistd::ftruncate(&fd, size as i64).map_err(io)?;
        let ptr = map(&fd, size)?;
        let serial = self.next_handle.fetch_add(1, Ordering::Relaxed);
        lock(&self.allocations).insert(ptr as usize, (len, fd.as_raw_fd(), serial));
        let owner = Mapping {
            ptr,
            len: size,
            _fd: Some(fd),
            registered: Some(self.allocations.clone()),
        };
        // SAFETY: `owner` holds the mapping, which does not move with it.
        Ok(unsafe { Scratch::from_raw(self.kind(), ptr, len, Box::new(owner)) })
    }

    fn alloc_staging(&self, len: usize) -> Result<Scratch> {
        Ok(Scratch::host(len))
    }

    fn alloc_words(&self, count: usize) -> Result<Scratch> {
        Ok(Scratch::host(count * 4))
    }

    fn device_address(&self, host: *const u8) -> Result<u64> {
        Ok(host as u64)
    }

    fn create_stream(&self) -> Result<RawStream> {
        let id = self.next_handle.fetch_add(1, Ordering::Relaxed);
        self.spawn_stream(id)?;
        Ok(id)
    }

    fn destroy_stream(&self, stream: RawStream) {
        // The thread finishes what was enqueued, then ends.
        lock(&self.streams).remove(&stream);
    }

    unsafe fn copy(
        &self,
        stream: RawStream,
        to: *mut u8,
        from: *const u8,
        len: usize,
    ) -> Result<()> {
        let (to, from) = (to as usize, from as usize);
        self.enqueue(
            stream,
            Box::new(move || {
                // SAFETY: the caller keeps both regions valid until the
                // stream has passed this copy (the trait's contract).
                unsafe { std::ptr::copy(from as *const u8, to as *mut u8, len) }
            }),
        )
    }

    fn record(&self, stream: RawStream) -> Result<RawEvent> {
        let id = self.next_handle.fetch_add(1, Ordering::Relaxed);
        let done = Arc::new(AtomicBool::new(false));
        lock(&self.events).insert(id, done.clone());
        let mark = done.clone();
        if let Err(e) = self.enqueue(
            stream,
            Box::new(move || mark.store(true, Ordering::Release)),
        ) {
            lock(&self.events).remove(&id);
            return Err(e);
        }
        Ok(id)
    }

    fn query(&self, event: RawEvent) -> Result<bool> {
        Ok(self.event(event)?.load(Ordering::Acquire))
    }

    fn destroy_event(&self, event: RawEvent) {
        lock(&self.events).remove(&event);
    }

    fn wait_event(&self, stream: RawStream, event: RawEvent) -> Result<()> {
        let done = self.event(event)?;
        self.enqueue(
            stream,
            Box::new(move || wait_until(|| done.load(Ordering::Acquire))),
        )
    }

    fn wait_word(&self, stream: RawStream, word: u64, value: u32) -> Result<()> {
        self.enqueue(
            stream,
            Box::new(move || {
                // SAFETY: a word of `alloc_words` memory, which the caller
                // keeps alive while streams may wait on it.
                let w = unsafe { &*(word as *const AtomicU32) };
                wait_until(|| (w.load(Ordering::Acquire).wrapping_sub(value) as i32) >= 0)
            }),
        )
    }

    fn read_word(&self, word: u64) -> Result<u32> {
        // SAFETY: a word of memory the caller keeps mapped.
        Ok(unsafe { &*(word as *const AtomicU32) }.load(Ordering::Acquire))
    }

    /// Host memory: what another process wrote is visible already.
    fn flush_remote_writes(&self) -> Result<()> {
        Ok(())
    }

    fn set_word(&self, word: u64, value: u32) -> Result<()> {
        // SAFETY: as in `read_word`.
        unsafe { &*(word as *const AtomicU32) }.store(value, Ordering::Release);
        Ok(())
    }

    unsafe fn reduce(
        &self,
        stream: RawStream,
        op: ReduceOp,
        dtype: DataType,
        out: *mut u8,
        inputs: &[*const u8],
        count: usize,
    ) -> Result<()> {
        if inputs.is_empty() || inputs.len() > crate::kernels::MAX_INPUTS {
            return Err(Error::Internal(format!(
                "a reduction of {} inputs",
                inputs.len()
            )));
        }
        op.validate(dtype)?;
        let (out, inputs) = (
            out as usize,
            inputs.iter().map(|&p| p as usize).collect::<Vec<_>>(),
        );
        let bytes = count * dtype.size();
        self.enqueue(
            stream,
            Box::new(move || host_reduce(op, dtype, out, &inputs, bytes)),
        )
    }

    unsafe fn scale(
        &self,
        stream: RawStream,
        op: ReduceOp,
        dtype: DataType,
        out: *mut u8,
        input: *const u8,
        count: usize,
    ) -> Result<()> {
        let (out, input, bytes) = (out as usize, input as usize, count * dtype.size());
        self.enqueue(
            stream,
            Box::new(move || {
                // SAFETY: as in `host_reduce`.
                let mut copy =
                    unsafe { std::slice::from_raw_parts(input as *const u8, bytes) }.to_vec();
                kernels::prescale(op, dtype, &mut copy).expect("checked arguments");
                unsafe { std::ptr::copy(copy.as_ptr(), out as *mut u8, bytes) };
            }),
        )
    }

    fn export(&self, at: *const u8) -> Result<Exported> {
        let at = at as usize;
        let allocations = lock(&self.allocations);
        let Some((&start, &(len, fd, serial))) = allocations
            .range(..=at)
            .next_back()
            .filter(|(&start, &(len, _, _))| at < start + len.max(1))
        else {
            return Err(Error::InvalidArgument(format!(
                "{}: {at:#x} is not device memory it allocated",
                self.name()
            )));
        };
        let mut handle = Vec::with_capacity(16);
        handle.extend_from_slice(&std::process::id().to_le_bytes());
        handle.extend_from_slice(&fd.to_le_bytes());
        handle.extend_from_slice(&serial.to_le_bytes());
        Ok(Exported {
            handle,
            len,
            offset: at - start,
        })
    }

    fn import(&self, handle: &[u8], len: usize) -> Result<Scratch> {
        let bad = || Error::Protocol {
            rank: 0,
            peer: 0,
            call: String::new(),
            msg: format!("a stand-in memory handle of {} bytes", handle.len()),
        };
        if handle.len() != 16 {
            return Err(bad());
        }
        let word = |i: usize| [handle[i], handle[i + 1], handle[i + 2], handle[i + 3]];
        let (pid, fd) = (u32::from_le_bytes(word(0)), i32::from_le_bytes(word(4)));
        let path = format!("/proc/{pid}/fd/{fd}");
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| Error::io(format!("opening {path} (stand-in IPC)"), e))?;
        let fd = OwnedFd::from(file);
        let size = len.max(1);
        let ptr = map(&fd, size)?;
        let owner = Mapping {
            ptr,
            len: size,
            _fd: None,
            registered: None,
        };
        // SAFETY: `owner` holds the mapping.
        Ok(unsafe { Scratch::from_raw(self.kind(), ptr, len, Box::new(owner)) })
    }

    fn write_word(&self, stream: RawStream, word: u64, value: u32) -> Result<()> {
        self.enqueue(
            stream,
            Box::new(move || {
                // SAFETY: as in `wait_word`.
                let w = unsafe { &*(word as *const AtomicU32) };
                w.store(value, Ordering::Release)
            }),
        )
    }
}
