//! Group algorithms: collectives on [`GroupMemory`], memory that every rank
//! of a communicator reads and writes (a shared-memory segment when all of
//! them run on one host). They move no messages: each rank posts its part
//! once per round and reads the others' in place. They run on the caller's
//! thread, without the executor or a runtime, and are tested like schedules,
//! for every world size, count and root, over group memory in this
//! process's heap (`tests::group`).
//!
//! [`run`] runs [`Algorithm::Board`] and [`Algorithm::BoardDirect`];
//! [`announce`] lets every rank check every other rank's call before a call
//! that goes over the links, so that mismatched calls fail as mismatches.

mod board;

#[cfg(test)]
pub(crate) use board::{GATHER_DIRECT_MAX, SHARED_DIRECT_MAX};

use std::time::Duration;

use ccl_core::{Call, Deadline, Error, FrameHeader, GroupMemory, Result};

use crate::{Algorithm, IoBuffers};

/// Runs `call` with the group algorithm `algorithm` on `mem`, reading
/// `io`'s input and writing its output, within `timeout`. Errors name the call.
pub fn run(
    algorithm: Algorithm,
    mem: &dyn GroupMemory,
    call: &Call,
    io: &IoBuffers<'_>,
    timeout: Duration,
) -> Result<()> {
    let direct = match algorithm {
        Algorithm::Board => false,
        Algorithm::BoardDirect => true,
        a => {
            return Err(Error::Internal(format!(
                "{} planned as {a}, which is not a group algorithm",
                call.name()
            )))
        }
    };
    board::BoardCall { call, direct }
        .run(mem, io, timeout)
        .map_err(|e| e.in_call(&call.name()))
}

/// Before a call that runs over the links on a communicator with group
/// memory: every rank posts the call's header and checks everybody else's,
/// so that ranks that made different calls (which may take different paths,
/// or wait on each other forever, as broadcasts with different roots do)
/// get [`Error::Mismatch`] instead of a timeout.
pub fn announce(mem: &dyn GroupMemory, call: &Call, timeout: Duration) -> Result<()> {
    let deadline = Deadline::after(timeout);
    let check = || {
        let round = Round::begin(mem, call.header(0, 0), &deadline)?;
        round.post(&[])?;
        for r in 0..call.world_size {
            round.read(r, 0)?;
        }
        Ok(())
    };
    check().map_err(|e: Error| e.in_call(&call.name()))
}

/// One round of this rank's on group memory, with the header of the call's
/// message it carries.
struct Round<'a> {
    mem: &'a dyn GroupMemory,
    number: u64,
    header: FrameHeader,
    deadline: &'a Deadline,
}

impl<'a> Round<'a> {
    /// Starts this rank's next round for the message `header` (its length is
    /// set by each post and read).
    fn begin(
        mem: &'a dyn GroupMemory,
        header: FrameHeader,
        deadline: &'a Deadline,
    ) -> Result<Round<'a>> {
        Ok(Round {
            mem,
            number: mem.begin(deadline)?,
            header,
            deadline,
        })
    }

    /// Posts `data` as this rank's payload.
    fn post(&self, data: &[u8]) -> Result<()> {
        self.post_at(data.len(), &[(0, data)])
    }

    /// Posts a payload of `len` bytes of which this rank writes `parts`.
    fn post_at(&self, len: usize, parts: &[(usize, &[u8])]) -> Result<()> {
        self.mem
            .post(self.number, &self.header, len, parts, self.deadline)
    }

    /// Rank `r`'s payload, which must be `len` bytes of this call.
    fn read(&self, r: usize, len: usize) -> Result<&'a [u8]> {
        self.mem
            .read(self.number, r, &self.header, len, self.deadline)
    }

    /// Publishes this rank's second phase: bytes `offset..offset + len` of
    /// its payload, which `write` fills.
    fn post_reduced(
        &self,
        offset: usize,
        len: usize,
        write: &mut dyn FnMut(&mut [u8]) -> Result<()>,
    ) -> Result<()> {
        self.mem
            .post_reduced(self.number, offset, len, write, self.deadline)
    }

    /// Bytes `offset..offset + len` of rank `r`'s second phase.
    fn read_reduced(&self, r: usize, offset: usize, len: usize) -> Result<&'a [u8]> {
        self.mem
            .read_reduced(self.number, r, offset, len, self.deadline)
    }
}
