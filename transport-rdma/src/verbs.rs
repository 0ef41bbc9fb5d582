//! The `Verbs` trait: the few verbs the protocol core needs, shaped after
//! libibverbs (`ibv_reg_mr`, `ibv_post_send` with `IBV_WR_RDMA_WRITE[_WITH_IMM]`,
//! `ibv_post_recv`, `ibv_poll_cq`). The ibverbs glue implements it on a real
//! NIC; the simulated fabric (`sim`) implements it for tests.

use std::{fmt, os::fd::AsRawFd};

/// A registered memory region: what the NIC may read (`lkey`) and what a
/// peer may write into (`rkey`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Region {
    pub addr: u64,
    pub len: usize,
    pub lkey: u32,
    pub rkey: u32,
}

impl Region {
    /// Whether `[addr, addr + len)` lies inside the region.
    pub fn covers(&self, addr: u64, len: usize) -> bool {
        addr >= self.addr && addr.saturating_add(len as u64) <= self.addr + self.len as u64
    }
}

/// Memory of a peer that this side may write into.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Remote {
    pub addr: u64,
    pub rkey: u32,
}

/// One RDMA write (`IBV_WR_RDMA_WRITE`, or `_WITH_IMM` when `imm` is set:
/// then it consumes a posted receive at the peer and completes there with
/// `imm` and the length). Always signaled.
#[derive(Clone, Copy, Debug)]
pub struct Write {
    /// Returned in the local completion.
    pub id: u64,
    /// Local source: address, length, and the `lkey` of its region (0 bytes: no region).
    pub addr: u64,
    pub len: usize,
    pub lkey: u32,
    pub remote: Remote,
    pub imm: Option<u32>,
}

/// How a work request ended (`ibv_wc_status`, the cases the protocol tells apart).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Status {
    Success,
    /// `IBV_WC_RETRY_EXC_ERR`: the peer's NIC stopped acknowledging.
    RetryExceeded,
    /// `IBV_WC_RNR_RETRY_EXC_ERR`: the peer had no receive posted.
    RnrRetryExceeded,
    /// `IBV_WC_REM_ACCESS_ERR`: the peer refused the key or the range.
    RemoteAccess,
    /// `IBV_WC_WR_FLUSH_ERR`: the queue pair went into error earlier.
    Flushed,
    /// Any other status, as the verbs library names it.
    Other(String),
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Status::Success => f.write_str("success"),
            Status::RetryExceeded => f.write_str("transport retry counter exceeded"),
            Status::RnrRetryExceeded => f.write_str("receiver-not-ready retry counter exceeded"),
            Status::RemoteAccess => f.write_str("remote access error"),
            Status::Flushed => f.write_str("work request flushed"),
            Status::Other(s) => f.write_str(s),
        }
    }
}

/// A work completion.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Completion {
    /// A posted write ended.
    Write { id: u64, status: Status },
    /// A peer's write with immediate consumed a posted receive.
    Recv {
        imm: u32,
        len: usize,
        status: Status,
    },
}

/// What two queue pairs exchange to connect (an RC QP's address and the
/// parameters of its path), carried through the authenticated store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Endpoint {
    pub qpn: u32,
    pub lid: u16,
    pub gid: [u8; 16],
    pub psn: u32,
    pub mtu: u32,
}

/// A NIC (a device context and protection domain): registers memory and
/// makes queue pairs. Shared by the links of a communicator.
pub trait Verbs: Send + Sync + 'static {
    /// One reliable-connected queue pair with its completion queue.
    type Qp: QueuePair;
    /// A completion channel, shared by the queue pairs made with it.
    type Channel: Channel;

    /// The device's name, for logs (`mlx5_0`, `sim`).
    fn name(&self) -> String;

    /// Registers `[addr, addr + len)` for local reads and remote writes
    /// (`ibv_reg_mr`; slow: the registration cache keeps them).
    fn register(&self, addr: u64, len: usize) -> Result<Region, String>;

    /// Whether GPU memory can be registered (GPUDirect RDMA), or why not.
    fn device_memory(&self) -> Result<(), String> {
        Err(format!("{} cannot register GPU memory", self.name()))
    }

    /// Registers `[addr, addr + len)` of GPU memory for local reads and
    /// remote writes, so that the NIC moves it without the host (GPUDirect
    /// RDMA); only where [`Verbs::device_memory`] says it can.
    fn register_device(&self, addr: u64, len: usize) -> Result<Region, String> {
        let _ = (addr, len);
        Err(self
            .device_memory()
            .err()
            .unwrap_or_else(|| format!("{} cannot register GPU memory", self.name())))
    }

    /// Releases a registration (`ibv_dereg_mr`): its `rkey` stops working.
    fn deregister(&self, region: &Region);

    /// A completion channel (`ibv_create_comp_channel`) for the queue pairs
    /// of one communicator.
    fn channel(&self) -> Result<Self::Channel, String>;

    /// A new queue pair, not yet connected, whose completion queue notifies
    /// `channel` when armed.
    fn queue_pair(&self, channel: &Self::Channel) -> Result<Self::Qp, String>;

    /// Whether a registration of host memory follows the process's address
    /// space (on-demand paging): memory freed and mapped again at the same
    /// addresses is reached through the old key. Where it does not (a
    /// pinned registration keeps the old pages), registrations of user
    /// buffers must not outlive the operation, since ccl cannot see a
    /// user's `free`. Registrations of GPU memory never do.
    fn follows_remaps(&self) -> bool;
}

/// One RC queue pair and its completion queue.
pub trait QueuePair: Send + 'static {
    /// What the peer needs to connect to this queue pair.
    fn endpoint(&self) -> Endpoint;

    /// Moves the queue pair to ready-to-send towards `remote` (INIT, RTR, RTS).
    fn connect(&mut self, remote: &Endpoint) -> Result<(), String>;

    /// Posts one write (`ibv_post_send`). An error here means the work
    /// request was not taken.
    fn post_write(&mut self, write: &Write) -> Result<(), String>;

    /// Posts one receive for a write with immediate (`ibv_post_recv`, no buffer).
    fn post_recv(&mut self) -> Result<(), String>;

    /// Appends the completions that are ready (`ibv_poll_cq`); never blocks.
    fn poll(&mut self, out: &mut Vec<Completion>);

    /// Asks for a notice on the channel at this queue's next completion
    /// (`ibv_req_notify_cq`). A completion that came in just before may
    /// give none, so the caller polls once more before it sleeps. False
    /// where a sleeper would not be woken: completions are on their way
    /// that only polling brings in (the simulated fabric's clock), or the
    /// request failed; the caller then keeps polling.
    fn arm(&mut self) -> bool;
}

/// A completion channel: its file descriptor turns readable once an armed
/// completion queue made with it has a new completion.
pub trait Channel: AsRawFd + Send + Sync + 'static {
    /// Takes the notices that made the descriptor readable (and
    /// acknowledges them: `ibv_get_cq_event`, `ibv_ack_cq_events`); never
    /// blocks.
    fn drain(&self);
}
