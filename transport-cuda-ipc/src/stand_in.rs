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

use std::{
    collections::{BTreeMap, HashMap},
    sync::{
        atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering},
        mpsc, Arc, Mutex, MutexGuard,
    },
    thread,
    time::Duration,
};

use ccl_core::{AlignedBuf, Error, MemoryKind, Result, Scratch};

use crate::gpu::{Gpu, RawEvent, RawStream};

type Op = Box<dyn FnOnce() + Send>;

/// Device allocations: start address → length.
type Allocations = Arc<Mutex<BTreeMap<usize, usize>>>;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The stand-in GPU.
pub struct StandInGpu {
    ordinal: u32,
    allocations: Allocations,
    streams: Mutex<HashMap<RawStream, mpsc::Sender<Op>>>,
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
        let (tx, rx) = mpsc::channel::<Op>();
        thread::Builder::new()
            .name(format!("gpu{}-stream{id}", self.ordinal))
            .spawn(move || rx.into_iter().for_each(|op| op()))
            .map_err(|e| Error::io("starting a stand-in GPU stream", e))?;
        lock(&self.streams).insert(id, tx);
        Ok(())
    }

    fn enqueue(&self, stream: RawStream, op: Op) -> Result<()> {
        let streams = lock(&self.streams);
        let tx = streams.get(&stream).ok_or_else(|| {
            Error::InvalidArgument(format!("{}: no stream {stream:#x}", self.name()))
        })?;
        tx.send(op)
            .map_err(|_| Error::Internal(format!("{}: stream {stream:#x} stopped", self.name())))
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

/// Device memory of the stand-in: host memory, unregistered when dropped.
struct DeviceAllocation {
    _mem: AlignedBuf,
    start: usize,
    allocations: Allocations,
}

impl Drop for DeviceAllocation {
    fn drop(&mut self) {
        lock(&self.allocations).remove(&self.start);
    }
}

impl Gpu for StandInGpu {
    fn ordinal(&self) -> u32 {
        self.ordinal
    }

    fn name(&self) -> String {
        format!("stand-in GPU {} (host memory)", self.ordinal)
    }

    fn kind_of(&self, ptr: *const u8) -> Result<MemoryKind> {
        let at = ptr as usize;
        let allocations = lock(&self.allocations);
        Ok(match allocations.range(..=at).next_back() {
            Some((&start, &len)) if at < start + len.max(1) => MemoryKind::Device {
                ordinal: self.ordinal,
            },
            _ => MemoryKind::Host,
        })
    }

    fn alloc_device(&self, len: usize) -> Result<Scratch> {
        let mut mem = AlignedBuf::zeroed(len.max(1));
        let ptr = mem.as_mut_slice().as_mut_ptr();
        let start = ptr as usize;
        lock(&self.allocations).insert(start, len);
        let owner = DeviceAllocation {
            _mem: mem,
            start,
            allocations: self.allocations.clone(),
        };
        let kind = MemoryKind::Device {
            ordinal: self.ordinal,
        };
        // SAFETY: `owner` holds the allocation, which does not move with it.
        Ok(unsafe { Scratch::from_raw(kind, ptr, len, Box::new(owner)) })
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
