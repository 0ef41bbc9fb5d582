//! ccl-core: the vocabulary shared by every ccl crate.
//!
//! Data types and reduction kernels ([`DataType`], [`Element`], [`ReduceOp`],
//! [`op`]), the wire frame ([`FrameHeader`]), the [`Link`] trait transports
//! implement, the [`Work`] handle, rendezvous [`store`]s, [`Error`], and
//! [`Config`] read from the environment. It depends on no other ccl crate.

pub mod auth;
mod buf;
pub mod config;
mod dtype;
mod error;
pub mod frame;
mod link;
pub mod op;
pub mod store;
mod work;

pub use auth::JobSecret;
pub use buf::AlignedBuf;
pub use config::{Config, Launcher, Rendezvous, TransportChoice};
pub use dtype::{DataType, Element};
pub use error::{Error, Result};
pub use frame::{AbortNotice, CollectiveKind, Fingerprint, FrameHeader, FrameKind};
pub use link::{allowed_cpus, poll_repolling, repolling, Link, LinkFuture, Reduction, Spin};
pub use op::ReduceOp;
pub use store::{free_port, FileStore, HashStore, PrefixStore, Store, TcpStore, TcpStoreServer};
pub use work::{work_pair, Completer, Work};

pub use half::{bf16, f16};
