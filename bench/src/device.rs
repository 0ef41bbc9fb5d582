//! `--device cuda`: the benchmark's buffers in GPU memory, each call ordered
//! on a stream (`Communicator::launch_*_on_stream`) and timed until its
//! `Work` completes, that is until the result is back in device memory.
//! With `--check`, buffers are filled and read back around every timed
//! call, and the expected values are computed on the host as for host runs.

use std::{sync::Arc, time::Duration, time::Instant};

use ccl::{
    cuda::{Gpu, Stream, Transfer},
    BufMut, BufRef, Collective, Communicator, Element, MemoryKind, Scratch,
};

use crate::{
    args::Plan,
    coll::Coll,
    data::{Case, Val},
};

type BoxError = Box<dyn std::error::Error>;

/// The GPU of this rank and the stream its calls are ordered on.
pub struct OnGpu {
    gpu: Arc<dyn Gpu>,
    stream: Stream,
}

/// A case's buffers in device memory.
pub struct DeviceCase {
    input: Scratch,
    output: Scratch,
}

impl OnGpu {
    /// GPU `ordinal` (the CUDA device, or the stand-in with `CCL_CUDA_STAND_IN=1`).
    pub fn open(ordinal: u32) -> Result<OnGpu, BoxError> {
        let gpu = ccl::cuda::open(ordinal)?;
        let stream = Stream::new(gpu.clone())?;
        Ok(OnGpu { gpu, stream })
    }

    /// The GPU's name.
    pub fn name(&self) -> String {
        self.gpu.name()
    }

    /// Waits until the stream has done everything queued on it.
    fn sync(&self) -> Result<(), BoxError> {
        if self.stream.synchronize(Some(Duration::from_secs(60)))? {
            Ok(())
        } else {
            Err(format!("{}: the stream did not drain in 60 s", self.name()).into())
        }
    }

    /// Device-to-device copy bandwidth, counting bytes read and written, of
    /// copies of `bytes` (best of a few), measured now.
    pub fn copy_bandwidth(&self, bytes: usize) -> Result<f64, BoxError> {
        let (a, b) = (self.gpu.alloc_device(bytes)?, self.gpu.alloc_device(bytes)?);
        let mut best = f64::INFINITY;
        for _ in 0..5 {
            let start = Instant::now();
            for _ in 0..4 {
                // SAFETY: both buffers outlive the synchronization below.
                unsafe {
                    self.gpu.copy(
                        self.stream.raw(),
                        b.buf().as_ptr().cast_mut(),
                        a.buf().as_ptr(),
                        bytes,
                    )?
                };
            }
            self.sync()?;
            best = best.min(start.elapsed().as_secs_f64() / 4.0);
        }
        Ok(2.0 * bytes as f64 / best / 1e9)
    }

    /// Device memory for `case`'s buffers, holding their contents.
    pub fn case<T: Val>(&self, case: &Case<T>) -> Result<DeviceCase, BoxError> {
        let dev = DeviceCase {
            input: self
                .gpu
                .alloc_device(std::mem::size_of_val(&case.input[..]))?,
            output: self
                .gpu
                .alloc_device(std::mem::size_of_val(&case.output[..]))?,
        };
        self.upload(&dev, case)?;
        Ok(dev)
    }

    /// Copies `case`'s buffers into `dev`.
    pub fn upload<T: Val>(&self, dev: &DeviceCase, case: &Case<T>) -> Result<(), BoxError> {
        for (to, from) in [(&dev.input, &case.input), (&dev.output, &case.output)] {
            let bytes: &[u8] = bytemuck::cast_slice(from);
            // SAFETY: both outlive the synchronization below.
            unsafe {
                self.gpu.copy(
                    self.stream.raw(),
                    to.buf().as_ptr().cast_mut(),
                    bytes.as_ptr(),
                    bytes.len(),
                )?
            };
        }
        self.sync()
    }

    /// Copies `dev`'s output back into `case`'s.
    pub fn download<T: Val>(&self, dev: &DeviceCase, case: &mut Case<T>) -> Result<(), BoxError> {
        let bytes = std::mem::size_of_val(&case.output[..]);
        let to = case.output.as_mut_ptr().cast::<u8>();
        // SAFETY: both outlive the synchronization below.
        unsafe {
            self.gpu
                .copy(self.stream.raw(), to, dev.output.buf().as_ptr(), bytes)?
        };
        self.sync()
    }

    /// Runs one call of `plan`'s collective on `dev` and waits for it.
    pub fn run_once<T: Element>(
        &self,
        comm: &Communicator,
        plan: &Plan,
        dev: &DeviceCase,
    ) -> Result<(), ccl::Error> {
        let mut template = Collective::new(plan.coll.kind(), T::DTYPE, 0);
        if plan.coll.has_op() {
            template = template.with_op(plan.op);
        }
        if plan.coll.has_root() {
            template = template.with_root(plan.root);
        }
        let kind = MemoryKind::Device {
            ordinal: self.gpu.ordinal(),
        };
        let (input, output) = (dev.input.buf(), dev.output.buf());
        if plan.coll == Coll::Sendrecv {
            // The ring exchange: both sides queued together on the stream.
            let n = comm.world_size();
            let (next, prev) = ((comm.rank() + 1) % n, (comm.rank() + n - 1) % n);
            // SAFETY: device memory of `dev`, which outlives the waits.
            let works = unsafe {
                let data = BufRef::from_raw(kind, input.as_ptr(), input.len());
                let into = BufMut::from_raw(kind, output.as_ptr().cast_mut(), output.len());
                let both = vec![
                    Transfer::send(T::DTYPE, next, data),
                    Transfer::recv(T::DTYPE, prev, into),
                ];
                comm.launch_transfers_on_stream(both, &self.stream)
            };
            let results: Vec<_> = works.into_iter().map(|w| w.wait()).collect();
            return results.into_iter().collect();
        }
        // SAFETY: device memory of `dev`, which outlives the wait.
        let work = unsafe {
            let output = BufMut::from_raw(kind, output.as_ptr().cast_mut(), output.len());
            if plan.inplace {
                comm.launch_in_place_on_stream(template, output, &self.stream)
            } else {
                let input = BufRef::from_raw(kind, input.as_ptr(), input.len());
                comm.launch_out_of_place_on_stream(template, input, output, &self.stream)
            }
        };
        work.wait()
    }
}
