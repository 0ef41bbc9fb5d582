//! What ccl asks of a GPU: the [`Gpu`] trait, at the level of the CUDA
//! driver's handles, and the owning values built on it ([`Stream`],
//! [`GpuEvent`], [`Flags`]).
//!
//! Everything is stream-ordered as in CUDA: an operation enqueued on a
//! stream starts after the ones enqueued before it on that stream; events
//! mark a point of a stream; a stream can wait for another's event, and for
//! a 32-bit word of device-visible host memory to reach a value (the way a
//! host thread releases a stream without a round trip through the driver).

use std::{fmt, sync::Arc, time::Duration};

use ccl_core::{DataType, Event, MemoryKind, ReduceOp, Result, Scratch};

/// Device memory as another process maps it ([`Gpu::export`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Exported {
    /// What [`Gpu::import`] takes.
    pub handle: Vec<u8>,
    /// Bytes of the whole allocation.
    pub len: usize,
    /// Where the exported address lies in it.
    pub offset: usize,
}

/// A stream handle of a [`Gpu`] (a `CUstream` for CUDA; 0 is the default stream).
pub type RawStream = u64;
/// An event handle of a [`Gpu`] (a `CUevent` for CUDA).
pub type RawEvent = u64;

/// A GPU as ccl uses it. [`crate::cuda`] drives a real one through the CUDA
/// driver; [`crate::stand_in`] imitates one in host memory for tests on
/// machines without a GPU. Handles are plain numbers so that the trait
/// stays object-safe; [`Stream`], [`GpuEvent`] and [`Flags`] own them.
pub trait Gpu: Send + Sync + 'static {
    /// The device ordinal.
    fn ordinal(&self) -> u32;

    /// A readable name (`CUDA device 0 (NVIDIA H100 80GB HBM3)`).
    fn name(&self) -> String;

    /// The device's UUID, the same in every process: ranks with equal ones
    /// share a GPU.
    fn uuid(&self) -> Result<[u8; 16]>;

    /// Whether the work of several processes on this GPU runs side by side
    /// (`Some(true)`: under MPS, or the stand-in's threads), or by turns in
    /// time slices (`Some(false)`); `None` where the driver does not say.
    fn side_by_side(&self) -> Option<bool>;

    /// Where the memory at `ptr` lives, as the driver sees it: device
    /// memory of some GPU, or host memory (plain or pinned).
    fn kind_of(&self, ptr: *const u8) -> Result<MemoryKind>;

    /// Device memory of `len` bytes, freed when the `Scratch` drops.
    fn alloc_device(&self, len: usize) -> Result<Scratch>;

    /// Pinned host memory of `len` bytes that this GPU copies to and from
    /// and the CPU reads at full speed (not write-combined).
    fn alloc_staging(&self, len: usize) -> Result<Scratch>;

    /// Pinned host memory of `count` 32-bit words that streams can wait on
    /// and write; zeroed. Its device address is [`Gpu::device_address`].
    fn alloc_words(&self, count: usize) -> Result<Scratch>;

    /// The address through which the GPU reaches pinned host memory at `host`.
    fn device_address(&self, host: *const u8) -> Result<u64>;

    /// A new stream that does not synchronize with the default stream.
    fn create_stream(&self) -> Result<RawStream>;

    /// Destroys a stream from [`Gpu::create_stream`] (after its work).
    fn destroy_stream(&self, stream: RawStream);

    /// Enqueues a copy of `len` bytes from `from` to `to` on `stream`;
    /// either side may be device memory or pinned host memory.
    ///
    /// # Safety
    /// Both regions must stay valid, and `to` untouched by others, until
    /// the stream has passed the copy.
    unsafe fn copy(
        &self,
        stream: RawStream,
        to: *mut u8,
        from: *const u8,
        len: usize,
    ) -> Result<()>;

    /// A new event marking the work enqueued on `stream` so far.
    fn record(&self, stream: RawStream) -> Result<RawEvent>;

    /// Whether the stream has passed `event`.
    fn query(&self, event: RawEvent) -> Result<bool>;

    /// Destroys an event (it may still be pending).
    fn destroy_event(&self, event: RawEvent);

    /// Makes `stream` wait (without blocking the host) for `event`.
    fn wait_event(&self, stream: RawStream, event: RawEvent) -> Result<()>;

    /// Makes `stream` wait until the word at device address `word` reaches
    /// `value`, in wrapping order (`(word - value) as i32 >= 0`).
    fn wait_word(&self, stream: RawStream, word: u64, value: u32) -> Result<()>;

    /// Enqueues on `stream` a write of `value` to the word at device address `word`.
    fn write_word(&self, stream: RawStream, word: u64, value: u32) -> Result<()>;

    /// Reads the word at device address `word` now, off the caller's
    /// streams (to tell, after a timeout, which peer is behind).
    fn read_word(&self, word: u64) -> Result<u32>;

    /// Makes the writes a NIC made into this GPU's memory (GPUDirect RDMA)
    /// visible to the work queued on it from now on; blocks until they are.
    fn flush_remote_writes(&self) -> Result<()>;

    /// Writes the word at device address `word` now, off the caller's
    /// streams (to release streams that wait for a peer that failed).
    fn set_word(&self, word: u64, value: u32) -> Result<()>;

    /// Compiles and loads the kernels now, if not yet done. Loading may wait
    /// for the work queued on the device (CUDA loads lazily and implicitly
    /// synchronizes), so a caller whose streams will wait for its own later
    /// kernels prepares them first.
    fn prepare_kernels(&self) -> Result<()>;

    /// Enqueues on `stream` the elementwise reduction of `inputs` (device
    /// memory, `count` elements of `dtype` each, folded in order) into
    /// `out`: `Avg` divides by `inputs.len()`, `PreMulSum` sums (its inputs
    /// were scaled by [`Gpu::scale`]). At most [`crate::kernels::MAX_INPUTS`].
    ///
    /// # Safety
    /// As for [`Gpu::copy`], for every region.
    unsafe fn reduce(
        &self,
        stream: RawStream,
        op: ReduceOp,
        dtype: DataType,
        out: *mut u8,
        inputs: &[*const u8],
        count: usize,
    ) -> Result<()>;

    /// Enqueues on `stream` `out = input × scalar` for `PreMulSum(scalar)`
    /// (`count` elements of `dtype`; `out` may be `input`).
    ///
    /// # Safety
    /// As for [`Gpu::copy`].
    unsafe fn scale(
        &self,
        stream: RawStream,
        op: ReduceOp,
        dtype: DataType,
        out: *mut u8,
        input: *const u8,
        count: usize,
    ) -> Result<()>;

    /// The allocation of device memory that holds `at` (from
    /// [`Gpu::alloc_device`] or the driver's synchronous allocator), as
    /// other processes of this host map it: a handle, the allocation's
    /// length, and the offset of `at` in it.
    fn export(&self, at: *const u8) -> Result<Exported>;

    /// Maps `len` bytes of device memory that another process exported;
    /// unmapped when the `Scratch` drops.
    fn import(&self, handle: &[u8], len: usize) -> Result<Scratch>;
}

impl fmt::Debug for dyn Gpu {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name())
    }
}

/// A stream of a [`Gpu`]: one ccl created (destroyed on drop), or the
/// caller's own (a torch or cudarc stream, the default stream), borrowed.
pub struct Stream {
    gpu: Arc<dyn Gpu>,
    raw: RawStream,
    owned: bool,
}

impl Stream {
    /// A new stream of `gpu`.
    pub fn new(gpu: Arc<dyn Gpu>) -> Result<Stream> {
        let raw = gpu.create_stream()?;
        Ok(Stream {
            gpu,
            raw,
            owned: true,
        })
    }

    /// The caller's stream `raw` of `gpu` (0: the default stream).
    ///
    /// # Safety
    /// `raw` must be a stream of `gpu`'s context that outlives this value
    /// and the work ccl enqueues on it.
    pub unsafe fn borrow_raw(gpu: Arc<dyn Gpu>, raw: RawStream) -> Stream {
        Stream {
            gpu,
            raw,
            owned: false,
        }
    }

    /// The GPU.
    pub fn gpu(&self) -> &Arc<dyn Gpu> {
        &self.gpu
    }

    /// The handle.
    pub fn raw(&self) -> RawStream {
        self.raw
    }

    /// An event marking the work enqueued so far.
    pub fn record(&self) -> Result<GpuEvent> {
        let raw = self.gpu.record(self.raw)?;
        Ok(GpuEvent {
            gpu: self.gpu.clone(),
            raw,
        })
    }

    /// Makes this stream wait for `event`.
    pub fn wait(&self, event: &GpuEvent) -> Result<()> {
        self.gpu.wait_event(self.raw, event.raw)
    }

    /// Blocks until everything enqueued so far is done, or `timeout` passes
    /// (`Ok(false)`).
    pub fn synchronize(&self, timeout: Option<Duration>) -> Result<bool> {
        self.record()?.synchronize(timeout)
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if self.owned {
            self.gpu.destroy_stream(self.raw);
        }
    }
}

impl fmt::Debug for Stream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Stream({:#x} of {})", self.raw, self.gpu.name())
    }
}

/// A point of a stream; a [`Work`](ccl_core::Work) can wait for it.
pub struct GpuEvent {
    gpu: Arc<dyn Gpu>,
    raw: RawEvent,
}

impl Event for GpuEvent {
    fn query(&self) -> Result<bool> {
        self.gpu.query(self.raw)
    }

    fn synchronize(&self, timeout: Option<Duration>) -> Result<bool> {
        // Poll rather than block in the driver, so that a timeout holds:
        // spin briefly (copies of a chunk take microseconds), then sleep.
        let start = std::time::Instant::now();
        let mut spins = 0u32;
        loop {
            if self.gpu.query(self.raw)? {
                return Ok(true);
            }
            let waited = start.elapsed();
            if timeout.is_some_and(|t| waited >= t) {
                return Ok(false);
            }
            spins += 1;
            if spins < 2000 {
                std::hint::spin_loop();
            } else if waited < Duration::from_millis(10) {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(100));
            }
        }
    }
}

impl Drop for GpuEvent {
    fn drop(&mut self) {
        self.gpu.destroy_event(self.raw);
    }
}

/// 32-bit words of pinned host memory that streams wait on and write, and
/// the host reads and writes.
pub struct Flags {
    mem: Scratch,
    device: u64,
}

impl Flags {
    /// `count` zeroed words of `gpu`.
    pub fn new(gpu: &dyn Gpu, count: usize) -> Result<Flags> {
        let mem = gpu.alloc_words(count)?;
        let device = gpu.device_address(mem.buf().as_ptr())?;
        Ok(Flags { mem, device })
    }

    /// The device address of word `i`.
    pub fn device_address(&self, i: usize) -> u64 {
        assert!(i * 4 < self.mem.len(), "flag {i} out of range");
        self.device + 4 * i as u64
    }

    /// The host's view of word `i`.
    pub fn word(&self, i: usize) -> &std::sync::atomic::AtomicU32 {
        assert!(i * 4 < self.mem.len(), "flag {i} out of range");
        // SAFETY: aligned (allocations are 64-byte or page aligned), in range and
        // owned by `mem`; the GPU writes it whole, with a memory barrier.
        unsafe {
            &*self
                .mem
                .buf()
                .as_ptr()
                .cast::<std::sync::atomic::AtomicU32>()
                .add(i)
        }
    }
}
