//! ccl-core: the vocabulary shared by every ccl crate.
//!
//! Data types and reduction ops ([`DataType`], [`Element`], [`ReduceOp`]) and
//! the host [`kernels`]; memory that knows where it lives ([`BufRef`],
//! [`BufMut`], [`MemoryKind`]) and the [`Kernels`] each kind brings; one
//! call untyped ([`Collective`], [`Call`]); the wire frame ([`FrameHeader`]);
//! the [`Link`] and [`Transport`] traits transports implement and the
//! [`GroupMemory`] some of them offer, and [`loopback`] links through this
//! process's memory; the [`Work`] handle; how waiting
//! threads poll ([`Spin`], [`SpinWindow`], [`Repoll`], [`yield_once`]); the rendezvous [`Store`] trait; the
//! [`JobSecret`] and [`Error`]. It depends on no other ccl crate.

mod buf;
mod call;
mod dtype;
mod error;
pub mod frame;
mod group;
pub mod kernels;
mod link;
pub mod loopback;
mod memory;
pub mod op;
mod repoll;
pub mod secret;
mod spin;
mod store;
mod transport;
mod turn;
mod window;
mod work;

pub use buf::AlignedBuf;
pub use call::{Call, Collective};
pub use dtype::{DataType, Element};
pub use error::{Error, ErrorCode, Result};
pub use frame::{AbortNotice, CollectiveKind, Fingerprint, FrameHeader, FrameKind};
pub use group::{Deadline, GroupMemory, Region, Remote};
pub use link::{Link, LinkFuture, Reduction};
pub use memory::{BufMut, BufRef, HostKernels, Kernels, MemoryKind, Scratch, HOST_KERNELS};
pub use op::ReduceOp;
pub use repoll::Repoll;
pub use secret::JobSecret;
pub use spin::{allowed_cpus, Spin};
pub use store::Store;
pub use transport::{
    cpu_mates, Connector, LinkClass, PairResult, PeerInfo, RepollWhen, Setup, Transport,
};
pub use turn::{take_yield, yield_once};
pub use window::SpinWindow;
pub use work::{work_pair, Completer, Event, Work};

pub use half::{bf16, f16};

/// Default deadline of every wait (collectives, connects, store calls): 10 minutes.
pub const DEFAULT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(600);
