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
    /// Something this build or this machine cannot do (memory of a kind no
    /// built-in transport handles, say).
    #[error("unsupported: {0}")]
    Unsupported(String),
}

/// A stable number for each kind of [`Error`], for callers that cannot hold
/// the error itself (the C ABI returns it; 0 is left for success). The
/// values never change; new kinds get new numbers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum ErrorCode {
    InvalidArgument = 1,
    Timeout = 2,
    PeerLost = 3,
    Mismatch = 4,
    Protocol = 5,
    Store = 6,
    Config = 7,
    Io = 8,
    Broken = 9,
    Internal = 10,
    Unsupported = 11,
}

impl ErrorCode {
    /// Every code, in numeric order.
    pub const ALL: [ErrorCode; 11] = [
        ErrorCode::InvalidArgument,
        ErrorCode::Timeout,
        ErrorCode::PeerLost,
        ErrorCode::Mismatch,
        ErrorCode::Protocol,
        ErrorCode::Store,
        ErrorCode::Config,
        ErrorCode::Io,
        ErrorCode::Broken,
        ErrorCode::Internal,
        ErrorCode::Unsupported,
    ];

    /// The code with this number, if any.
    pub fn from_i32(code: i32) -> Option<ErrorCode> {
        ErrorCode::ALL.into_iter().find(|c| *c as i32 == code)
    }

    /// A short description ("invalid argument", "peer lost", ...).
    pub const fn describe(self) -> &'static str {
        match self {
            ErrorCode::InvalidArgument => "invalid argument",
            ErrorCode::Timeout => "timed out",
            ErrorCode::PeerLost => "peer lost",
            ErrorCode::Mismatch => "mismatched calls across ranks",
            ErrorCode::Protocol => "protocol error",
            ErrorCode::Store => "rendezvous store error",
            ErrorCode::Config => "configuration error",
            ErrorCode::Io => "operating-system error",
            ErrorCode::Broken => "communicator broken by an earlier error",
            ErrorCode::Internal => "internal error",
            ErrorCode::Unsupported => "unsupported",
        }
    }
}

impl Error {
    /// An [`Error::Io`] with what was being done.
    pub fn io(context: impl Into<String>, source: io::Error) -> Error {
        Error::Io {
            context: context.into(),
            source: Arc::new(source),
        }
    }

    /// [`Error::PeerLost`] from the link between `rank` and `peer`, the call
    /// left for [`Error::in_call`]; `aborted_here` says that this rank had
    /// aborted the link, which then explains the loss.
    pub fn peer_lost(
        rank: usize,
        peer: usize,
        cause: impl Into<String>,
        aborted_here: bool,
    ) -> Error {
        let cause = cause.into();
        Error::PeerLost {
            rank,
            peer,
            call: String::new(),
            cause: if aborted_here {
                format!("{cause} (this rank aborted the link)")
            } else {
                cause
            },
        }
    }

    /// The error of a call that needed a link this rank closed itself (its
    /// communicator was dropped, or its process is exiting, and an exit hook
    /// closed the link): it blames this rank, not the peer, so that the
    /// failure recorded for the others names the rank that went away.
    pub fn closed_here(rank: usize, peer: usize) -> Error {
        Error::Broken {
            rank,
            cause: format!(
                "this rank closed its link to rank {peer} (its communicator was dropped \
                 or its process is exiting)"
            ),
        }
    }

    /// [`Error::Protocol`] from the link between `rank` and `peer`, the call
    /// left for [`Error::in_call`].
    pub fn protocol(rank: usize, peer: usize, msg: impl Into<String>) -> Error {
        Error::Protocol {
            rank,
            peer,
            call: String::new(),
            msg: msg.into(),
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

    /// The stable number of this kind of error.
    pub fn code(&self) -> ErrorCode {
        match self {
            Error::InvalidArgument(_) => ErrorCode::InvalidArgument,
            Error::Timeout { .. } => ErrorCode::Timeout,
            Error::PeerLost { .. } => ErrorCode::PeerLost,
            Error::Mismatch { .. } => ErrorCode::Mismatch,
            Error::Protocol { .. } => ErrorCode::Protocol,
            Error::Store { .. } => ErrorCode::Store,
            Error::Config(_) => ErrorCode::Config,
            Error::Io { .. } => ErrorCode::Io,
            Error::Broken { .. } => ErrorCode::Broken,
            Error::Internal(_) => ErrorCode::Internal,
            Error::Unsupported(_) => ErrorCode::Unsupported,
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The numbers are part of the C ABI: they must never change.
    #[test]
    fn codes_are_stable() {
        let numbers: Vec<i32> = ErrorCode::ALL.iter().map(|c| *c as i32).collect();
        assert_eq!(numbers, (1..=11).collect::<Vec<i32>>());
        assert_eq!(ErrorCode::from_i32(3), Some(ErrorCode::PeerLost));
        assert_eq!(ErrorCode::from_i32(0), None);
        assert_eq!(
            Error::Broken {
                rank: 0,
                cause: String::new()
            }
            .code() as i32,
            9
        );
        assert_eq!(Error::Unsupported(String::new()).code() as i32, 11);
    }
}
