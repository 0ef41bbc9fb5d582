//! ccl-core: the vocabulary shared by every ccl crate.
//!
//! Data types and reduction kernels ([`DataType`], [`Element`], [`ReduceOp`],
//! [`op`]), the wire frame ([`FrameHeader`]), the [`Link`] trait transports
//! implement, the [`Work`] handle, the rendezvous [`Store`] trait, the
//! [`JobSecret`] and [`Error`]. It depends on no other ccl crate.

mod buf;
mod dtype;
mod error;
pub mod frame;
mod link;
pub mod op;
pub mod secret;
mod store;
mod work;

pub use buf::AlignedBuf;
pub use dtype::{DataType, Element};
pub use error::{Error, Result};
pub use frame::{AbortNotice, CollectiveKind, Fingerprint, FrameHeader, FrameKind};
pub use link::{allowed_cpus, poll_repolling, repolling, Link, LinkFuture, Reduction, Spin};
pub use op::ReduceOp;
pub use secret::JobSecret;
pub use store::Store;
pub use work::{work_pair, Completer, Work};

pub use half::{bf16, f16};

/// Default deadline of every wait (collectives, connects, store calls): 10 minutes.
pub const DEFAULT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(600);
