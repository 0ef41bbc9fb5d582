//! ccl: a pure-Rust collective communication library.
//!
//! Build a [`Communicator`] from the environment (torchrun, OpenMPI, PMI or
//! Slurm conventions) or from a rank, a world size and a [`Store`], then call
//! collectives on it:
//!
//! ```no_run
//! use ccl::{Communicator, ReduceOp};
//! let comm = Communicator::from_env()?;
//! let mut grad = vec![1.0f32; 1024];
//! comm.allreduce(&mut grad, ReduceOp::Avg)?;
//! let work = comm.iallreduce(grad, ReduceOp::Sum); // runs in the background
//! let grad = work.wait()?;
//! # Ok::<(), ccl::Error>(())
//! ```
//!
//! The facade is split by job: `bootstrap` (how ranks meet), `transports`
//! (the registry that links each pair), `selection` (which algorithm a call
//! runs with), `engine` (running calls in order, under deadlines), `call`
//! (the one untyped call path: [`Communicator::run`] and friends, which the
//! C and Python bindings use too) and `api` (the typed methods over it).
//! [`train`] holds helpers for data-parallel training over a communicator.

mod api;
mod bootstrap;
mod bucketer;
mod call;
mod communicator;
#[cfg(feature = "cuda")]
mod device;
mod engine;
mod options;
mod selection;
pub mod train;
mod transports;

pub use bootstrap::rendezvous_store;
pub use bucketer::{Bucketer, Reduced, TensorId, DEFAULT_BUCKET_CAP_BYTES};
pub use ccl_algorithms::{Algorithm, Choice};
pub use ccl_core::{
    bf16, f16, BufMut, BufRef, Collective, CollectiveKind, DataType, Element, Error, ErrorCode,
    Event, JobSecret, MemoryKind, ReduceOp, Result, Scratch, Spin, Store, Transport, Work,
};
pub use ccl_rendezvous::{
    config, free_port, Config, FileStore, HashStore, Launcher, PrefixStore, Rendezvous, TcpStore,
    TcpStoreServer, TorchTcpStore,
};
#[cfg(feature = "shm")]
pub use ccl_transport_shm::SharedBuffer;
pub use communicator::Communicator;
pub use options::Options;
pub use transports::Transports;

/// GPUs: open one ([`cuda::open`]), wrap the caller's stream
/// ([`cuda::Stream::borrow_raw`]) and pass device memory to
/// [`Communicator::launch_on_stream`] (collectives) or
/// [`Communicator::launch_transfers_on_stream`] (send and receive); or hand
/// cudarc's slices and stream to [`Communicator::launch_in_place_on_cudarc`]
/// and its siblings, which are safe.
#[cfg(feature = "cuda")]
pub mod cuda {
    pub use crate::device::Transfer;
    pub use ccl_transport_cuda_ipc::cudarc;
    pub use ccl_transport_cuda_ipc::{
        current_device, gpu_in_use, open, Gpu, GpuEvent, RawStream, StandInGpu, Stream,
    };
}

/// Installs a `tracing` subscriber on stderr filtered by `filter` (`CCL_DEBUG`;
/// warnings and errors when unset), unless the program installed one already.
pub fn init_tracing(filter: Option<&str>) {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter.unwrap_or("warn")))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}
