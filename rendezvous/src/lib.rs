//! ccl-rendezvous: how the ranks of a job meet.
//!
//! Rendezvous [`store`]s (a TCP store served by rank 0 or by a standalone
//! server, a client of torch's `TCPStore`, a file store on a shared
//! filesystem, an in-process store, and a prefixed view for
//! sub-communicators), the job secret's challenge-response
//! that every TCP connection of a job opens with ([`auth`]), and the
//! [`Config`] read from the environment conventions of torchrun, OpenMPI,
//! PMI and Slurm, and the addresses a rank advertises ([`net`]). It depends
//! on `ccl-core` alone.

pub mod auth;
pub mod config;
pub mod net;
pub mod store;

pub use ccl_core::{JobSecret, Store};
pub use config::{Config, Launcher, Rendezvous};
pub use store::{
    free_port, FileStore, HashStore, PrefixStore, TcpStore, TcpStoreServer, TorchTcpStore,
};
