//! Schedules: a collective as plain data, built without I/O.
//!
//! A [`Schedule`] is the list of [`Op`]s one rank performs: sends, receives,
//! receive-and-reduce, local copies. Each op names the ops it must wait for
//! (`deps`); the [`Builder`] infers them from the buffer regions ops read and
//! write, so builders only state *what* moves, in order. Ops on one link
//! direction run in list order (links are FIFO); everything else may overlap,
//! which is what pipelines chunks.

use std::ops::Range;

/// Which buffer a region lives in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BufId {
    /// The caller's input (send buffer).
    Input,
    /// The caller's output (receive buffer); may be the same memory as the input.
    Output,
    /// Temporary memory owned by the executor, [`Schedule::scratch_elems`] long.
    Scratch,
}

/// Whether a call's input and output share memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Layout {
    /// Input and output are distinct memory.
    OutOfPlace,
    /// The input is (a part of) the output, or the output of the input, at
    /// the block the collective defines for in-place calls.
    InPlace,
}

/// A region of a buffer, in elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Region {
    pub buf: BufId,
    pub offset: usize,
    pub len: usize,
}

impl Region {
    /// `len` elements of `buf` from `offset`.
    pub const fn new(buf: BufId, offset: usize, len: usize) -> Region {
        Region { buf, offset, len }
    }

    /// The element range.
    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.len
    }

    /// A sub-region, relative to this one.
    pub fn sub(&self, offset: usize, len: usize) -> Region {
        debug_assert!(offset + len <= self.len);
        Region::new(self.buf, self.offset + offset, len)
    }

    /// Whether the two regions lie in one address space: scratch is one;
    /// input and output are one unless `layout` says they are distinct
    /// (in-place calls pass the same memory).
    fn shares_space(&self, other: &Region, layout: Layout) -> bool {
        match layout {
            Layout::OutOfPlace => self.buf == other.buf,
            Layout::InPlace => (self.buf == BufId::Scratch) == (other.buf == BufId::Scratch),
        }
    }

    /// True if the two regions may share memory.
    fn overlaps(&self, other: &Region, layout: Layout) -> bool {
        self.shares_space(other, layout)
            && self.len > 0
            && other.len > 0
            && self.offset < other.offset + other.len
            && other.offset < self.offset + self.len
    }

    fn covers(&self, other: &Region, layout: Layout) -> bool {
        self.shares_space(other, layout)
            && self.offset <= other.offset
            && other.offset + other.len <= self.offset + self.len
    }
}

/// What one op does.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Action {
    /// Send `src` to `peer`.
    Send { peer: usize, src: Region },
    /// Receive from `peer` into `dst`.
    Recv { peer: usize, dst: Region },
    /// Receive from `peer` and reduce: `dst = local ⊕ received` (`local` defaults to `dst`).
    RecvReduce {
        peer: usize,
        dst: Region,
        local: Option<Region>,
    },
    /// Copy `src` to `dst` (skipped when they are the same memory).
    Copy { src: Region, dst: Region },
    /// Apply the op's last step to a fully reduced region (divide for `Avg`).
    Finalize { dst: Region },
}

impl Action {
    fn reads(&self) -> [Option<Region>; 2] {
        match *self {
            Action::Send { src, .. } => [Some(src), None],
            Action::Recv { .. } => [None, None],
            Action::RecvReduce { dst, local, .. } => [Some(local.unwrap_or(dst)), None],
            Action::Copy { src, .. } => [Some(src), None],
            Action::Finalize { dst } => [Some(dst), None],
        }
    }

    fn writes(&self) -> Option<Region> {
        match *self {
            Action::Send { .. } => None,
            Action::Recv { dst, .. }
            | Action::RecvReduce { dst, .. }
            | Action::Copy { dst, .. }
            | Action::Finalize { dst } => Some(dst),
        }
    }

    /// The peer this op talks to, if any.
    pub fn peer(&self) -> Option<usize> {
        match *self {
            Action::Send { peer, .. }
            | Action::Recv { peer, .. }
            | Action::RecvReduce { peer, .. } => Some(peer),
            Action::Copy { .. } | Action::Finalize { .. } => None,
        }
    }
}

/// One op and the earlier ops it waits for.
#[derive(Clone, Debug, PartialEq)]
pub struct Op {
    pub action: Action,
    pub deps: Vec<u32>,
}

/// The ops of one rank for one collective call.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Schedule {
    pub(crate) ops: Vec<Op>,
    /// Elements of scratch memory the ops use.
    pub(crate) scratch_elems: usize,
    /// The ops of each lane, in list order: worked out once here, not on
    /// every call the schedule runs.
    pub(crate) lanes: Vec<(Lane, Vec<u32>)>,
}

/// A sequence of ops that run one after the other: the sends to one peer,
/// the receives from one peer (links are FIFO), or the local ops.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Lane {
    Local,
    SendTo(usize),
    RecvFrom(usize),
}

impl Action {
    /// The lane this op runs in.
    pub(crate) fn lane(&self) -> Lane {
        match *self {
            Action::Send { peer, .. } => Lane::SendTo(peer),
            Action::Recv { peer, .. } | Action::RecvReduce { peer, .. } => Lane::RecvFrom(peer),
            Action::Copy { .. } | Action::Finalize { .. } => Lane::Local,
        }
    }
}

impl Schedule {
    /// The ops, in the order they were pushed.
    pub fn ops(&self) -> &[Op] {
        &self.ops
    }

    /// Elements of scratch memory the ops use.
    pub fn scratch_elems(&self) -> usize {
        self.scratch_elems
    }
}

/// Builds a [`Schedule`], inferring dependencies from the regions ops touch:
/// an op waits for every earlier op that writes what it reads or writes, and
/// for every earlier op that reads what it writes.
pub struct Builder {
    schedule: Schedule,
    layout: Layout,
}

impl Default for Builder {
    fn default() -> Builder {
        Builder::new()
    }
}

impl Builder {
    /// An empty schedule that runs in place or out of place alike (input
    /// and output are taken as one memory).
    pub fn new() -> Builder {
        Builder::for_layout(Layout::InPlace)
    }

    /// An empty schedule for calls of `layout` only: out of place, ops on
    /// the input never wait for ops on the output.
    pub fn for_layout(layout: Layout) -> Builder {
        Builder {
            schedule: Schedule::default(),
            layout,
        }
    }

    /// Makes sure scratch has at least `elems` elements.
    pub fn scratch(&mut self, elems: usize) {
        self.schedule.scratch_elems = self.schedule.scratch_elems.max(elems);
    }

    /// Appends an op; returns its index.
    pub fn push(&mut self, action: Action) -> u32 {
        self.push_after(action, &[])
    }

    /// Appends an op that also waits for `extra` (for orderings no buffer shows,
    /// such as the rounds of a barrier).
    pub fn push_after(&mut self, action: Action, extra: &[u32]) -> u32 {
        let (reads, write, layout) = (action.reads(), action.writes(), self.layout);
        let mut deps: Vec<u32> = extra.to_vec();
        for (i, prev) in self.schedule.ops.iter().enumerate().rev() {
            let pw = prev.action.writes();
            let conflict = pw.is_some_and(|w| {
                reads.iter().flatten().any(|r| w.overlaps(r, layout))
                    || write.is_some_and(|x| w.overlaps(&x, layout))
            }) || write.is_some_and(|x| {
                prev.action
                    .reads()
                    .iter()
                    .flatten()
                    .any(|r| r.overlaps(&x, layout))
            });
            if conflict {
                deps.push(i as u32);
                // Everything earlier that conflicts with this op also conflicts
                // with `prev` (which writes all of this op's footprint), so
                // `prev` already waits for it.
                let footprint_covered = pw.is_some_and(|w| {
                    reads.iter().flatten().all(|r| w.covers(r, layout))
                        && write.is_none_or(|x| w.covers(&x, layout))
                });
                if footprint_covered {
                    break;
                }
            }
        }
        deps.sort_unstable();
        deps.dedup();
        self.schedule.ops.push(Op { action, deps });
        (self.schedule.ops.len() - 1) as u32
    }

    /// Sends `src` to `peer` in pieces of at most `piece` elements.
    pub fn send_pieces(&mut self, peer: usize, src: Region, piece: usize) {
        for src in pieces(src, piece) {
            self.push(Action::Send { peer, src });
        }
    }

    /// Receives `dst` from `peer` in pieces of at most `piece` elements.
    pub fn recv_pieces(&mut self, peer: usize, dst: Region, piece: usize) {
        for dst in pieces(dst, piece) {
            self.push(Action::Recv { peer, dst });
        }
    }

    /// Receives from `peer` and reduces in pieces of at most `piece` elements:
    /// `dst = local ⊕ received`, where `local` (as long as `dst`) defaults to `dst`.
    pub fn recv_reduce_pieces(
        &mut self,
        peer: usize,
        dst: Region,
        local: Option<Region>,
        piece: usize,
    ) {
        debug_assert!(local.is_none_or(|l| l.len == dst.len));
        let start = dst.offset;
        for dst in pieces(dst, piece) {
            let local = local.map(|l| l.sub(dst.offset - start, dst.len));
            self.push(Action::RecvReduce { peer, dst, local });
        }
    }

    /// Finalizes `dst` (the op's last step) in pieces of at most `piece` elements.
    pub fn finalize_pieces(&mut self, dst: Region, piece: usize) {
        for dst in pieces(dst, piece) {
            self.push(Action::Finalize { dst });
        }
    }

    /// The finished schedule.
    pub fn finish(mut self) -> Schedule {
        let mut lanes: Vec<(Lane, Vec<u32>)> = Vec::new();
        for (i, op) in self.schedule.ops.iter().enumerate() {
            let lane = op.action.lane();
            match lanes.iter_mut().find(|(l, _)| *l == lane) {
                Some((_, ops)) => ops.push(i as u32),
                None => lanes.push((lane, vec![i as u32])),
            }
        }
        lanes.sort_by_key(|(l, _)| *l);
        self.schedule.lanes = lanes;
        self.schedule
    }
}

impl Schedule {
    /// The same schedule with every peer `p` replaced by `to[p]`: a
    /// schedule written for ranks numbered in another order, run among the
    /// real ones. `to` must be a permutation of the world's ranks.
    pub(crate) fn relabel(mut self, to: &[usize]) -> Schedule {
        for op in &mut self.ops {
            match &mut op.action {
                Action::Send { peer, .. }
                | Action::Recv { peer, .. }
                | Action::RecvReduce { peer, .. } => *peer = to[*peer],
                Action::Copy { .. } | Action::Finalize { .. } => {}
            }
        }
        for (lane, _) in &mut self.lanes {
            *lane = match *lane {
                Lane::SendTo(p) => Lane::SendTo(to[p]),
                Lane::RecvFrom(p) => Lane::RecvFrom(to[p]),
                Lane::Local => Lane::Local,
            };
        }
        self.lanes.sort_by_key(|(l, _)| *l);
        self
    }
}

/// Splits `len` elements into `parts` contiguous ranges whose lengths differ by at most one.
pub fn split_even(len: usize, parts: usize) -> Vec<Range<usize>> {
    (0..parts)
        .map(|i| (len * i / parts)..(len * (i + 1) / parts))
        .collect()
}

/// Splits a region into pieces of at most `piece` elements; an empty region
/// gives one empty piece, so that every step still exchanges a frame.
pub fn pieces(region: Region, piece: usize) -> Vec<Region> {
    let piece = piece.max(1);
    if region.len == 0 {
        return vec![region];
    }
    (0..region.len.div_ceil(piece))
        .map(|i| region.sub(i * piece, piece.min(region.len - i * piece)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const IN: BufId = BufId::Input;
    const OUT: BufId = BufId::Output;

    #[test]
    fn dependencies_follow_data() {
        let mut b = Builder::new();
        let r0 = b.push(Action::Recv {
            peer: 1,
            dst: Region::new(OUT, 0, 4),
        });
        let s0 = b.push(Action::Send {
            peer: 2,
            src: Region::new(OUT, 0, 4),
        });
        let s1 = b.push(Action::Send {
            peer: 2,
            src: Region::new(OUT, 4, 4),
        });
        let r1 = b.push(Action::Recv {
            peer: 1,
            dst: Region::new(OUT, 2, 4),
        });
        let s = b.finish();
        assert_eq!(s.ops[s0 as usize].deps, vec![r0]);
        assert!(s.ops[s1 as usize].deps.is_empty());
        // writes [2,6): after the write of [0,4) and the reads of [0,4) and [4,8)
        assert_eq!(s.ops[r1 as usize].deps, vec![r0, s0, s1]);
    }

    #[test]
    fn lanes_hold_each_op_once_in_its_direction_and_in_list_order() {
        use crate::Algorithm;
        use ccl_core::{Collective, CollectiveKind, DataType};
        let coll = Collective::new(CollectiveKind::AllReduce, DataType::F32, 1000);
        for algorithm in [Algorithm::Ring, Algorithm::RecursiveDoubling] {
            for n in [2, 3, 5] {
                let s = algorithm
                    .schedule(&coll, 1, n, 64, Layout::OutOfPlace)
                    .unwrap();
                let mut seen = vec![false; s.ops.len()];
                for (lane, ops) in &s.lanes {
                    assert!(ops.windows(2).all(|w| w[0] < w[1]), "{lane:?}: {ops:?}");
                    for &i in ops {
                        assert_eq!(s.ops[i as usize].action.lane(), *lane);
                        assert!(!std::mem::replace(&mut seen[i as usize], true));
                    }
                }
                assert!(seen.iter().all(|&s| s), "{algorithm:?} at {n} ranks");
                let peers = |f: fn(usize) -> Lane| {
                    (0..n)
                        .filter(|&p| s.lanes.iter().any(|(l, _)| *l == f(p)))
                        .count()
                };
                assert!(peers(Lane::SendTo) > 0 && peers(Lane::RecvFrom) > 0);
            }
        }
    }

    #[test]
    fn input_and_output_may_alias() {
        let mut b = Builder::new();
        let s = b.push(Action::Send {
            peer: 1,
            src: Region::new(IN, 0, 4),
        });
        let r = b.push(Action::Recv {
            peer: 1,
            dst: Region::new(OUT, 0, 4),
        });
        let x = b.push(Action::Recv {
            peer: 1,
            dst: Region::new(BufId::Scratch, 0, 4),
        });
        let sch = b.finish();
        assert_eq!(sch.ops[r as usize].deps, vec![s]);
        assert!(sch.ops[x as usize].deps.is_empty());
    }

    /// Out of place, input and output are distinct memory: a receive into
    /// the output does not wait for a send of the same offsets of the input.
    #[test]
    fn out_of_place_input_and_output_do_not_conflict() {
        let mut b = Builder::for_layout(Layout::OutOfPlace);
        b.push(Action::Send {
            peer: 1,
            src: Region::new(IN, 0, 4),
        });
        let r = b.push(Action::Recv {
            peer: 1,
            dst: Region::new(OUT, 0, 4),
        });
        let c = b.push(Action::Copy {
            src: Region::new(OUT, 2, 2),
            dst: Region::new(IN, 2, 2),
        });
        let sch = b.finish();
        assert!(sch.ops[r as usize].deps.is_empty());
        // Within one buffer the data still orders the ops.
        assert_eq!(sch.ops[c as usize].deps, vec![0, r]);
    }

    #[test]
    fn splitting() {
        assert_eq!(split_even(10, 3), vec![0..3, 3..6, 6..10]);
        assert_eq!(split_even(2, 4), vec![0..0, 0..1, 1..1, 1..2]);
        let p = pieces(Region::new(OUT, 5, 10), 4);
        assert_eq!(
            p.iter().map(|r| (r.offset, r.len)).collect::<Vec<_>>(),
            vec![(5, 4), (9, 4), (13, 2)]
        );
        assert_eq!(pieces(Region::new(OUT, 3, 0), 4).len(), 1);
    }
}
