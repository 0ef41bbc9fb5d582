//! The frame header every link message starts with, and the call fingerprint.
//!
//! A header is [`HEADER_LEN`] bytes, little-endian. The receiver always knows
//! what it expects (same communicator, sequence number, step, length and call),
//! so it compares instead of trusting: a header from a rank that made another
//! call becomes [`Error::Mismatch`]; anything malformed becomes
//! [`Error::Protocol`]. Lengths are never used to allocate.

use std::fmt;

use crate::{DataType, Error, ReduceOp, Result};

/// Size of an encoded header in bytes.
pub const HEADER_LEN: usize = 56;
const MAGIC: u32 = u32::from_le_bytes(*b"CCLF");
const VERSION: u8 = 1;
/// Longest reason an abort frame carries.
pub const MAX_ABORT_REASON: usize = 4096;

/// What a collective call is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum CollectiveKind {
    AllReduce = 1,
    Broadcast = 2,
    Reduce = 3,
    AllGather = 4,
    ReduceScatter = 5,
    AllToAll = 6,
    Gather = 7,
    Scatter = 8,
    Barrier = 9,
    /// Point-to-point send/recv.
    SendRecv = 10,
}

impl CollectiveKind {
    /// Every kind.
    pub const ALL: [CollectiveKind; 10] = [
        CollectiveKind::AllReduce,
        CollectiveKind::Broadcast,
        CollectiveKind::Reduce,
        CollectiveKind::AllGather,
        CollectiveKind::ReduceScatter,
        CollectiveKind::AllToAll,
        CollectiveKind::Gather,
        CollectiveKind::Scatter,
        CollectiveKind::Barrier,
        CollectiveKind::SendRecv,
    ];

    /// Lower-case name ("allreduce", "reduce-scatter", ...).
    pub const fn name(self) -> &'static str {
        match self {
            CollectiveKind::AllReduce => "allreduce",
            CollectiveKind::Broadcast => "broadcast",
            CollectiveKind::Reduce => "reduce",
            CollectiveKind::AllGather => "allgather",
            CollectiveKind::ReduceScatter => "reduce-scatter",
            CollectiveKind::AllToAll => "alltoall",
            CollectiveKind::Gather => "gather",
            CollectiveKind::Scatter => "scatter",
            CollectiveKind::Barrier => "barrier",
            CollectiveKind::SendRecv => "sendrecv",
        }
    }

    fn from_u8(tag: u8) -> Option<CollectiveKind> {
        CollectiveKind::ALL.into_iter().find(|k| *k as u8 == tag)
    }
}

impl std::str::FromStr for CollectiveKind {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let norm = s.to_ascii_lowercase().replace('_', "-");
        let norm = match norm.as_str() {
            "reducescatter" => "reduce-scatter",
            "all-reduce" => "allreduce",
            "all-gather" => "allgather",
            "all-to-all" | "all2all" => "alltoall",
            other => other,
        }
        .to_string();
        CollectiveKind::ALL
            .into_iter()
            .find(|k| k.name() == norm)
            .ok_or_else(|| format!("unknown collective '{s}'"))
    }
}

impl fmt::Display for CollectiveKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The arguments of a call that every rank must agree on.
///
/// `count` is the per-rank element count as the collective defines it (for
/// allgather, the count each rank contributes). `op` is [`ReduceOp::tag`] or 0,
/// `root` is the root rank or 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Fingerprint {
    pub kind: CollectiveKind,
    pub dtype: DataType,
    pub op: u8,
    pub root: u32,
    pub count: u64,
}

impl Fingerprint {
    /// A fingerprint without op or root.
    pub fn new(kind: CollectiveKind, dtype: DataType, count: usize) -> Fingerprint {
        Fingerprint {
            kind,
            dtype,
            op: 0,
            root: 0,
            count: count as u64,
        }
    }

    /// With a reduction op.
    #[inline]
    pub fn with_op(mut self, op: ReduceOp) -> Fingerprint {
        self.op = op.tag();
        self
    }

    /// With a root rank.
    #[inline]
    pub fn with_root(mut self, root: usize) -> Fingerprint {
        self.root = root as u32;
        self
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}({}×{}", self.kind, self.dtype, self.count)?;
        if let Some(op) = ReduceOp::ALL.iter().find(|o| o.tag() == self.op) {
            write!(f, ", {}", op.name())?;
        }
        if matches!(
            self.kind,
            CollectiveKind::Broadcast
                | CollectiveKind::Reduce
                | CollectiveKind::Gather
                | CollectiveKind::Scatter
        ) {
            write!(f, ", root {}", self.root)?;
        }
        f.write_str(")")
    }
}

/// What a frame carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum FrameKind {
    /// Collective or point-to-point payload.
    Data = 1,
    /// The sender gave up; the payload is an encoded [`AbortNotice`].
    Abort = 2,
}

/// The header in front of every message on a link.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    pub kind: FrameKind,
    /// Communicator id (a hash of its store prefix).
    pub comm: u64,
    /// Collective sequence number on the communicator (per-peer counter for send/recv).
    pub seq: u64,
    /// Index of this message among the messages of this call on this link direction.
    pub step: u32,
    /// Payload length in bytes.
    pub len: u64,
    pub fingerprint: Fingerprint,
}

impl FrameHeader {
    /// A data frame header.
    #[inline]
    pub fn data(
        comm: u64,
        seq: u64,
        step: u32,
        len: usize,
        fingerprint: Fingerprint,
    ) -> FrameHeader {
        FrameHeader {
            kind: FrameKind::Data,
            comm,
            seq,
            step,
            len: len as u64,
            fingerprint,
        }
    }

    /// Encodes to the wire format.
    #[inline]
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4] = VERSION;
        b[5] = self.kind as u8;
        b[6] = self.fingerprint.kind as u8;
        b[7] = self.fingerprint.dtype as u8;
        b[8] = self.fingerprint.op;
        b[12..16].copy_from_slice(&self.fingerprint.root.to_le_bytes());
        b[16..24].copy_from_slice(&self.comm.to_le_bytes());
        b[24..32].copy_from_slice(&self.seq.to_le_bytes());
        b[32..36].copy_from_slice(&self.step.to_le_bytes());
        b[40..48].copy_from_slice(&self.fingerprint.count.to_le_bytes());
        b[48..56].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Decodes a header; any malformed input is an error message (never a panic).
    pub fn decode(b: &[u8]) -> std::result::Result<FrameHeader, String> {
        if b.len() != HEADER_LEN {
            return Err(format!(
                "header is {} bytes, expected {HEADER_LEN}",
                b.len()
            ));
        }
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut x = [0u8; 8];
            x.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(x)
        };
        if u32_at(0) != MAGIC {
            return Err(format!("bad magic {:#010x} (not a ccl frame)", u32_at(0)));
        }
        if b[4] != VERSION {
            return Err(format!("unsupported frame version {}", b[4]));
        }
        let kind = match b[5] {
            1 => FrameKind::Data,
            2 => FrameKind::Abort,
            k => return Err(format!("unknown frame kind {k}")),
        };
        let ckind = CollectiveKind::from_u8(b[6])
            .ok_or_else(|| format!("unknown collective kind {}", b[6]))?;
        let dtype = DataType::from_u8(b[7]).ok_or_else(|| format!("unknown data type {}", b[7]))?;
        if b[9..12] != [0, 0, 0] || b[36..40] != [0, 0, 0, 0] {
            return Err("reserved header bytes are not zero".into());
        }
        Ok(FrameHeader {
            kind,
            comm: u64_at(16),
            seq: u64_at(24),
            step: u32_at(32),
            len: u64_at(48),
            fingerprint: Fingerprint {
                kind: ckind,
                dtype,
                op: b[8],
                root: u32_at(12),
                count: u64_at(40),
            },
        })
    }

    /// The call this header belongs to, as error messages show it.
    pub fn call_name(&self) -> String {
        format!("{}#{}", self.fingerprint, self.seq)
    }

    /// Compares a received header with the expected one, on `rank` receiving from `peer`.
    ///
    /// An abort frame is not checked here: see [`AbortNotice`].
    pub fn check_received(&self, got: &FrameHeader, rank: usize, peer: usize) -> Result<()> {
        if got.comm != self.comm || got.seq != self.seq || got.fingerprint != self.fingerprint {
            let theirs = if got.comm != self.comm {
                format!(
                    "{} on another communicator ({:#x})",
                    got.call_name(),
                    got.comm
                )
            } else {
                got.call_name()
            };
            return Err(Error::Mismatch {
                rank,
                peer,
                ours: self.call_name(),
                theirs,
            });
        }
        if got.step != self.step || got.len != self.len {
            return Err(Error::Protocol {
                rank,
                peer,
                call: self.call_name(),
                msg: format!(
                    "expected message {} of {} bytes, got message {} of {} bytes",
                    self.step, self.len, got.step, got.len
                ),
            });
        }
        Ok(())
    }
}

/// The payload of an abort frame: the rank whose failure stopped the sender,
/// and why, so that failures propagate with the original culprit named.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AbortNotice {
    /// The rank that failed first (or the sender itself if it failed on its own).
    pub failed_rank: u32,
    pub reason: String,
}

impl AbortNotice {
    /// Encodes as `failed_rank` (u32 LE) followed by UTF-8 text, truncated to [`MAX_ABORT_REASON`].
    pub fn encode(&self) -> Vec<u8> {
        let mut end = self.reason.len().min(MAX_ABORT_REASON);
        while !self.reason.is_char_boundary(end) {
            end -= 1;
        }
        let mut v = self.failed_rank.to_le_bytes().to_vec();
        v.extend_from_slice(&self.reason.as_bytes()[..end]);
        v
    }

    /// Decodes; rejects short, over-long or non-UTF-8 payloads.
    pub fn decode(b: &[u8]) -> std::result::Result<AbortNotice, String> {
        if b.len() < 4 || b.len() > 4 + MAX_ABORT_REASON {
            return Err(format!("abort payload of {} bytes", b.len()));
        }
        let failed_rank = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        let reason = std::str::from_utf8(&b[4..])
            .map_err(|_| "abort reason is not UTF-8".to_string())?
            .to_string();
        Ok(AbortNotice {
            failed_rank,
            reason,
        })
    }

    /// The header of an abort frame carrying this notice.
    pub fn header(&self, comm: u64) -> FrameHeader {
        FrameHeader {
            kind: FrameKind::Abort,
            comm,
            seq: 0,
            step: 0,
            len: self.encode().len() as u64,
            fingerprint: Fingerprint::new(CollectiveKind::Barrier, DataType::U8, 0),
        }
    }

    /// The error a receiver reports on `rank` after reading this notice from `peer`.
    pub fn into_error(self, rank: usize, peer: usize) -> Error {
        Error::PeerLost {
            rank,
            peer: self.failed_rank as usize,
            call: String::new(),
            cause: if self.failed_rank as usize == peer {
                format!("rank {peer} aborted: {}", self.reason)
            } else {
                format!("reported by rank {peer}: {}", self.reason)
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample() -> FrameHeader {
        FrameHeader::data(
            0xfeed,
            42,
            3,
            4096,
            Fingerprint::new(CollectiveKind::AllReduce, DataType::F32, 1024).with_op(ReduceOp::Sum),
        )
    }

    #[test]
    fn round_trip() {
        let h = sample();
        assert_eq!(FrameHeader::decode(&h.encode()).unwrap(), h);
        assert_eq!(h.call_name(), "allreduce(f32×1024, sum)#42");
    }

    #[test]
    fn mismatch_names_both_calls() {
        let ours = sample();
        let mut theirs = ours;
        theirs.fingerprint.count = 1000;
        let e = ours.check_received(&theirs, 0, 1).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("f32×1024") && msg.contains("f32×1000") && msg.contains("rank 1"),
            "{msg}"
        );
        let mut other_len = ours;
        other_len.len = 1;
        assert!(matches!(
            ours.check_received(&other_len, 0, 1),
            Err(Error::Protocol { .. })
        ));
        assert!(ours.check_received(&ours, 0, 1).is_ok());
    }

    #[test]
    fn abort_notice_round_trip() {
        let n = AbortNotice {
            failed_rank: 7,
            reason: "é".repeat(MAX_ABORT_REASON),
        };
        let enc = n.encode();
        assert!(enc.len() <= 4 + MAX_ABORT_REASON);
        let d = AbortNotice::decode(&enc).unwrap();
        assert_eq!(d.failed_rank, 7);
        assert!(AbortNotice::decode(&[1, 2]).is_err());
        assert!(matches!(
            d.into_error(0, 3),
            Error::PeerLost { peer: 7, .. }
        ));
    }

    proptest! {
        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..80)) {
            let _ = FrameHeader::decode(&bytes);
            let _ = AbortNotice::decode(&bytes);
        }

        #[test]
        fn decode_of_corrupted_header_is_error_or_different(i in 0usize..HEADER_LEN, x in 1u8..=255) {
            let h = sample();
            let mut b = h.encode();
            b[i] ^= x;
            if let Ok(d) = FrameHeader::decode(&b) { prop_assert_ne!(d, h) }
        }
    }
}
