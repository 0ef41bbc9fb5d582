//! The one error type of ccl. Messages name the rank, the peer and the call.

use std::{io, sync::Arc, time::Duration};

/// Result with ccl's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in ccl.
///
/// `call` fields read like `allreduce#12(f32×1024, sum)`: the collective, its
/// sequence number on the communicator, and its arguments.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// Bad arguments, detected before anything was sent.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A deadline passed.
    #[error("{context}: timed out after {after:?} waiting for {what}")]
    Timeout {
        context: String,
        what: String,
        after: Duration,
    },
    /// A peer exited, its link dropped, or it reported its own failure.
    #[error("rank {rank}: {call}: lost rank {peer}: {cause}")]
    PeerLost {
        rank: usize,
        peer: usize,
        call: String,
        cause: String,
    },
    /// Two ranks made different calls.
    #[error("rank {rank}: mismatched calls: this rank called {ours}, rank {peer} called {theirs}")]
    Mismatch {
        rank: usize,
        peer: usize,
        ours: String,
        theirs: String,
    },
    /// Bytes from a peer that do not follow the protocol.
    #[error("rank {rank}: {call}: protocol error from rank {peer}: {msg}")]
    Protocol {
        rank: usize,
        peer: usize,
        call: String,
        msg: String,
    },
    /// The rendezvous store failed or answered something unexpected.
    #[error("store {addr}: {msg}")]
    Store { addr: String, msg: String },
    /// Configuration (environment variables, addresses) is missing or wrong.
    #[error("configuration: {0}")]
    Config(String),
    /// An operating-system error, with what was being done.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: Arc<io::Error>,
    },
    /// The communicator failed earlier and can no longer be used.
    #[error("rank {rank}: communicator is broken by an earlier error: {cause}")]
    Broken { rank: usize, cause: String },
    /// A bug in ccl: please report it.
    #[error("internal error: {0}")]
    Internal(String),
}

impl Error {
    /// An [`Error::Io`] with what was being done.
    pub fn io(context: impl Into<String>, source: io::Error) -> Error {
        Error::Io {
            context: context.into(),
            source: Arc::new(source),
        }
    }

    /// Fills in the call of errors raised below the level that knows it
    /// (transports report `call` as empty).
    pub fn in_call(mut self, name: &str) -> Error {
        match &mut self {
            Error::PeerLost { call, .. } | Error::Protocol { call, .. } if call.is_empty() => {
                *call = name.to_string();
            }
            Error::Timeout { context, .. } | Error::Io { context, .. }
                if !context.contains(name) =>
            {
                *context = format!("{context} in {name}");
            }
            _ => {}
        }
        self
    }

    /// The rank this error blames, when it blames one.
    pub fn failed_rank(&self) -> Option<usize> {
        match self {
            Error::PeerLost { peer, .. }
            | Error::Protocol { peer, .. }
            | Error::Mismatch { peer, .. } => Some(*peer),
            _ => None,
        }
    }
}
