//! [`Options`]: how a communicator connects and behaves, beyond rank, size
//! and store.

use std::time::Duration;

use ccl_core::{JobSecret, Result};
use ccl_rendezvous::Config;

use crate::Transports;

/// Default bytes of a chunk of a device call staged through host memory.
pub const DEFAULT_CUDA_CHUNK: usize = 4 << 20;

/// Default bytes of each rank's CUDA IPC slot.
pub const DEFAULT_CUDA_IPC_CHUNK: usize = 64 << 20;

/// Default size from which allreduces through CUDA IPC go between the
/// ranks' own buffers (below, the host round trip that maps them costs more
/// than the copies into the slots).
pub const DEFAULT_CUDA_IPC_DIRECT: usize = 1 << 20;

/// How a communicator connects and behaves, beyond rank, size and store.
#[derive(Clone, Debug)]
pub struct Options {
    /// Deadline of every wait (set-up and each call), `CCL_TIMEOUT`.
    pub timeout: Duration,
    /// Algorithm overrides, as `CCL_ALGO` spells them: `ring`, or
    /// `allreduce=rd,broadcast=tree`. `None`: chosen by the tuner.
    pub algo: Option<String>,
    /// How long a thread waiting for a peer polls before it sleeps
    /// (`CCL_SPIN_US`). Polling saves the kernel's wake-up on small messages
    /// but takes a CPU. `None`: [`ccl_core::Spin::OWN_CPU_WINDOW`] when this
    /// host's ranks have a CPU each (counted over the CPUs they may run on,
    /// so ranks pinned one to a core count as such),
    /// [`ccl_core::Spin::SHARED_CPU_WINDOW`] when they outnumber them, and
    /// then they also yield between polls.
    pub spin_window: Option<Duration>,
    /// The one transport every pair must use, by name (`CCL_TRANSPORT`:
    /// `tcp`, `shm`, `quic`), or the candidates in order (`shm,quic`: each
    /// pair takes the first of them that connects it); `None`: each pair
    /// takes the first of `transports` that can connect it.
    pub transport: Option<String>,
    /// The transports, most preferred first, each with its own options;
    /// `None`: those this build carries, with their default options.
    pub transports: Option<Transports>,
    /// Ranks with equal host ids may share memory (`None`: detected).
    pub host_id: Option<String>,
    /// The job secret (`CCL_JOB_SECRET`): TCP links prove it to each other
    /// and it goes into the communicator id. `None`: unauthenticated.
    pub secret: Option<JobSecret>,
    /// Check every collective's arguments across ranks first (`CCL_DEBUG_CHECKS`).
    pub debug_checks: bool,
    /// Bytes of a chunk of a device call staged through host memory
    /// (`CCL_CUDA_CHUNK`); every rank must use the same.
    pub cuda_chunk: usize,
    /// Device calls among ranks of one host read each other's GPU memory
    /// through CUDA IPC (`CCL_CUDA_IPC`, default on; `0` stages them).
    pub cuda_ipc: bool,
    /// Bytes of each rank's IPC slot, the most a chunk of an IPC call
    /// moves (`CCL_CUDA_IPC_CHUNK`); every rank must use the same.
    pub cuda_ipc_chunk: usize,
    /// Allreduces of at least this many bytes through CUDA IPC read and
    /// write the ranks' own buffers, without the slots' copies
    /// (`CCL_CUDA_IPC_DIRECT`); every rank must use the same.
    pub cuda_ipc_direct: usize,
    /// Staged reductions reduce on the GPU, the hosts only moving data
    /// (`CCL_CUDA_STAGED_GPU_REDUCE`, default on; `0`: the host collective
    /// reduces); every rank must use the same.
    pub cuda_staged_gpu_reduce: bool,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            timeout: ccl_core::DEFAULT_TIMEOUT,
            algo: None,
            spin_window: None,
            transport: None,
            transports: None,
            host_id: None,
            secret: None,
            debug_checks: false,
            cuda_chunk: DEFAULT_CUDA_CHUNK,
            cuda_ipc: true,
            cuda_ipc_chunk: DEFAULT_CUDA_IPC_CHUNK,
            cuda_ipc_direct: DEFAULT_CUDA_IPC_DIRECT,
            cuda_staged_gpu_reduce: true,
        }
    }
}

impl Options {
    /// The options the `CCL_*` variables of this process set, for a
    /// communicator whose rank, size and store come from elsewhere (a store
    /// object a framework hands over).
    pub fn from_env() -> Result<Options> {
        // One rank needs no rendezvous variables: only the knobs are read.
        let knobs_only = [("RANK", "0".into()), ("WORLD_SIZE", "1".into())];
        Options::from_config(&Config::from_env_with(&knobs_only)?)
    }

    /// The options a [`Config`] read from the environment sets, the
    /// transports' own knobs (`CCL_NSOCKS`, `CCL_SHM_BYTES`, ...) included.
    pub fn from_config(config: &Config) -> Result<Options> {
        Ok(Options {
            timeout: config.timeout,
            algo: config.algo.clone(),
            spin_window: config.spin,
            transport: config.transport.clone(),
            transports: Some(Transports::from_config(config)?),
            host_id: config.host_id.clone(),
            secret: config.job_secret.clone(),
            debug_checks: config.debug_checks,
            cuda_chunk: config.knob_number("CCL_CUDA_CHUNK", DEFAULT_CUDA_CHUNK, 256..=1 << 30)?,
            cuda_ipc: config.knob_number("CCL_CUDA_IPC", 1, 0..=1)? == 1,
            cuda_ipc_chunk: config.knob_number(
                "CCL_CUDA_IPC_CHUNK",
                DEFAULT_CUDA_IPC_CHUNK,
                256..=1 << 32,
            )?,
            cuda_ipc_direct: config.knob_number(
                "CCL_CUDA_IPC_DIRECT",
                DEFAULT_CUDA_IPC_DIRECT,
                0..=usize::MAX,
            )?,
            cuda_staged_gpu_reduce: config.knob_number("CCL_CUDA_STAGED_GPU_REDUCE", 1, 0..=1)?
                == 1,
        })
    }
}
