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

mod board;
mod bucketer;
mod communicator;
mod engine;

pub use bucketer::{Bucketer, Reduced, TensorId, DEFAULT_BUCKET_CAP_BYTES};
pub use ccl_algorithms::{Algorithm, Choice};
pub use ccl_core::{
    bf16, f16, CollectiveKind, DataType, Element, Error, JobSecret, ReduceOp, Result, Spin, Store,
    Work,
};
pub use ccl_rendezvous::{
    config, config::TransportChoice, free_port, Config, FileStore, HashStore, Launcher,
    PrefixStore, Rendezvous, TcpStore, TcpStoreServer,
};
pub use communicator::{rendezvous_store, Communicator, Options};

/// Installs a `tracing` subscriber on stderr filtered by `filter` (`CCL_DEBUG`;
/// warnings and errors when unset), unless the program installed one already.
pub fn init_tracing(filter: Option<&str>) {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter.unwrap_or("warn")))
        .with_writer(std::io::stderr)
        .try_init();
}
