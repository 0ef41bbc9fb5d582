//! Group memory beyond results: mismatched calls, aborts, board-direct on
//! several buffers taken end to end, and large calls on a large slot.

use std::time::Duration;

use ccl_core::{Call, Collective, CollectiveKind, DataType, Error, HOST_KERNELS};

use super::{bytes, mem_group, outputs, run_members, sum_at, val, RankMemory, GROUP_SLOT_BYTES};
use crate::{group, Algorithm, IoBuffers, Layout};

/// Runs `each(rank, member)` on every rank of group memory for `n` ranks,
/// as threads; returns each rank's result.
fn on_group<T: Send>(n: usize, each: impl Fn(usize, &mem_group::MemGroup) -> T + Sync) -> Vec<T> {
    on_group_streaming(n, usize::MAX, each)
}

/// [`on_group`] on memory that streams outputs from `stream_min` bytes.
fn on_group_streaming<T: Send>(
    n: usize,
    stream_min: usize,
    each: impl Fn(usize, &mem_group::MemGroup) -> T + Sync,
) -> Vec<T> {
    on_slots(n, GROUP_SLOT_BYTES, stream_min, each)
}

/// [`on_group_streaming`] with slots of `slot_bytes`.
fn on_slots<T: Send>(
    n: usize,
    slot_bytes: usize,
    stream_min: usize,
    each: impl Fn(usize, &mem_group::MemGroup) -> T + Sync,
) -> Vec<T> {
    let members = mem_group::group(n, slot_bytes, None, false, stream_min, false);
    std::thread::scope(|s| {
        let each = &each;
        let running: Vec<_> = members
            .iter()
            .enumerate()
            .map(|(rank, m)| s.spawn(move || each(rank, m)))
            .collect();
        running.into_iter().map(|t| t.join().unwrap()).collect()
    })
}

/// Ranks that make different calls on group memory get a mismatch naming
/// both calls, whether the calls run there or only announce themselves (at
/// two ranks the reduction checks the headers, at three a pass before it).
#[test]
fn mismatched_calls_on_group_memory_are_reported() {
    for n in [2, 3] {
        let call = |rank: usize| Call {
            comm: 1,
            seq: 4,
            rank,
            world_size: n,
            coll: Collective::new(CollectiveKind::AllReduce, DataType::F32, 8 + rank),
        };
        let ran = on_group(n, |rank, m| {
            let mut buf = vec![0u8; (8 + rank) * 4];
            let io = IoBuffers::host_in_place(&mut buf);
            group::run(
                Algorithm::Board,
                m,
                &call(rank),
                &io,
                Duration::from_secs(20),
            )
        });
        let announced = on_group(n, |rank, m| {
            group::announce(m, &call(rank), Duration::from_secs(20))
        });
        for results in [ran, announced] {
            for (rank, r) in results.into_iter().enumerate() {
                match r {
                    Err(Error::Mismatch { rank: me, ours, .. }) => {
                        assert_eq!(me, rank);
                        assert!(ours.contains(&format!("f32×{}", 8 + rank)), "{ours}");
                    }
                    other => panic!("{n} ranks, rank {rank}: expected a mismatch, got {other:?}"),
                }
            }
        }
    }
}

/// A rank that gives up marks the memory: ranks waiting for it fail at once,
/// naming the rank it blamed (or, for the blamed rank, the one that gave up).
#[test]
fn an_abort_on_group_memory_ends_the_waits() {
    let results = on_group(3, |rank, m| {
        let call = Call {
            comm: 1,
            seq: 0,
            rank,
            world_size: 3,
            coll: Collective::new(CollectiveKind::Barrier, DataType::U8, 0),
        };
        if rank == 2 {
            std::thread::sleep(Duration::from_millis(50));
            ccl_core::GroupMemory::abort(m, 0);
            return Ok(());
        }
        let io = IoBuffers::host_in_place(&mut []);
        group::run(Algorithm::Board, m, &call, &io, Duration::from_secs(20))
    });
    for (r, blamed) in results[..2].iter().zip([2, 0]) {
        assert!(
            matches!(r, Err(Error::PeerLost { peer, ref call, .. }) if *peer == blamed && call.contains("barrier")),
            "{r:?}"
        );
    }
}

/// Board-direct allreduce in place on several buffers taken end to end (a
/// bucket's tensors where they lie) reduces them as one buffer, its output
/// written plainly or with streaming stores.
#[test]
fn board_direct_reduces_several_buffers_as_one() {
    for (n, stream_min) in [1, 2, 3, 5]
        .into_iter()
        .flat_map(|n| [(n, usize::MAX), (n, 1)])
    {
        let sizes = [1usize, 0, 37, 5, 64, 2];
        let total: usize = sizes.iter().sum();
        let outs = on_group_streaming(n, stream_min, |rank, m| {
            let mut bufs: Vec<Vec<u64>> = Vec::new();
            let mut at = 0;
            for &len in &sizes {
                bufs.push((at..at + len).map(|i| val(rank, i)).collect());
                at += len;
            }
            let pieces = bufs
                .iter_mut()
                .map(|b| (b.as_mut_ptr().cast::<u8>(), b.len() * 8))
                .collect();
            // SAFETY: the vectors outlive the call and nothing else touches them.
            let io = unsafe { IoBuffers::pieces_in_place(pieces, &HOST_KERNELS) };
            let call = Call {
                comm: 1,
                seq: 0,
                rank,
                world_size: n,
                coll: Collective::new(CollectiveKind::AllReduce, DataType::U64, total),
            };
            group::run(
                Algorithm::BoardDirect,
                m,
                &call,
                &io,
                Duration::from_secs(20),
            )
            .unwrap();
            bufs.concat()
        });
        let want: Vec<u64> = (0..total).map(|i| sum_at(n, i)).collect();
        for (rank, out) in outs.into_iter().enumerate() {
            assert_eq!(out, want, "n={n} rank {rank} streaming from {stream_min}");
        }
    }
}

/// Calls whose outputs reach `stream_min` chunk otherwise than smaller ones
/// where the slot is larger than other calls' chunks (board-direct fills
/// it, as on the shared-memory board): every rank must chunk alike, also
/// the ranks of a reduce that have no output.
#[test]
fn large_calls_chunk_alike_on_every_rank() {
    let (n, count) = (3, 300_000);
    for (kind, root) in [
        (CollectiveKind::AllReduce, 0),
        (CollectiveKind::Reduce, 0),
        (CollectiveKind::Reduce, 1),
    ] {
        let outs = on_slots(n, 1 << 20, 1, |rank, m| {
            let input: Vec<u64> = (0..count).map(|i| val(rank, i)).collect();
            let wants = kind == CollectiveKind::AllReduce || rank == root;
            let mut output = vec![0u64; if wants { count } else { 0 }];
            let io = IoBuffers::host(
                bytemuck::cast_slice(&input),
                bytemuck::cast_slice_mut(&mut output),
            );
            let mut coll = Collective::new(kind, DataType::U64, count);
            coll.root = root;
            let call = Call {
                comm: 1,
                seq: 0,
                rank,
                world_size: n,
                coll,
            };
            let run = group::run(
                Algorithm::BoardDirect,
                m,
                &call,
                &io,
                Duration::from_secs(20),
            );
            run.map(|()| output)
        });
        let want: Vec<u64> = (0..count).map(|i| sum_at(n, i)).collect();
        for (rank, out) in outs.into_iter().enumerate() {
            let out = out.unwrap_or_else(|e| panic!("{kind} root {root}, rank {rank}: {e}"));
            if kind == CollectiveKind::AllReduce || rank == root {
                assert_eq!(out, want, "{kind} root {root}, rank {rank}");
            }
        }
    }
}

/// Which buffers of a call count as lying in shared regions.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Sharing {
    Nothing,
    Inputs,
    Everything,
}

/// Moving calls whose blocks are too large to read straight out of own
/// buffers (a gather of more than two ranks beyond `GATHER_DIRECT_MAX`, an
/// allgather or broadcast beyond `SHARED_DIRECT_MAX`) read them straight
/// out of shared buffers, whether the kernel's copies pay or not: the
/// ranks then post little more than addresses. Where only the inputs are
/// shared and the kernel's copies do not pay, no rank writes a share into
/// another's output (the memory refuses such writes).
#[test]
fn shared_blocks_beyond_the_direct_limits_are_read_directly() {
    let n = 3;
    // Slots as large as the board's chunks, so that posts take few rounds.
    let slot_bytes = 256 << 10;
    for (kind, part) in [
        (CollectiveKind::Gather, group::GATHER_DIRECT_MAX + 64),
        (CollectiveKind::AllGather, group::SHARED_DIRECT_MAX + 64),
        (CollectiveKind::Broadcast, group::SHARED_DIRECT_MAX + 64),
    ] {
        let coll = Collective::new(kind, DataType::U64, part / 8).with_root(1);
        let inputs: Vec<Vec<u8>> = (0..n)
            .map(|r| {
                let elems = coll.buffer_elems(r, n).0;
                bytes(&(0..elems).map(|i| val(r, i)).collect::<Vec<_>>())
            })
            .collect();
        // Each rank's output and the bytes it posted.
        let run = |direct_min: Option<usize>, kernel: bool, sharing: Sharing| {
            let mut memory: Vec<RankMemory> = (0..n)
                .map(|r| RankMemory::new(&coll, r, n, Layout::OutOfPlace, &inputs[r]))
                .collect();
            let members = mem_group::group(n, slot_bytes, direct_min, kernel, usize::MAX, false);
            for m in memory.iter_mut() {
                let base = m.mem.as_mut_slice().as_mut_ptr();
                let mut shared = vec![m.input];
                if sharing == Sharing::Everything {
                    shared.push(m.output);
                }
                for (at, len) in shared.into_iter().filter(|_| sharing != Sharing::Nothing) {
                    // SAFETY: the range lies inside the rank's memory.
                    members[0].share(unsafe { base.add(at) }, len);
                }
            }
            let what = format!("{kind} of {part}-byte blocks, {sharing:?} shared, the kernel's copies pay: {kernel}");
            let call = |rank: usize| Call {
                comm: 3,
                seq: 1,
                rank,
                world_size: n,
                coll,
            };
            let limit = Duration::from_secs(60);
            let results = run_members(Algorithm::Board, &members, &mut memory, &call, limit);
            let posted: Vec<u64> = members.iter().map(|m| m.posted_bytes()).collect();
            (outputs(&what, results, &memory), posted, what)
        };
        let (expected, through_posts, _) = run(None, false, Sharing::Nothing);
        assert!(
            through_posts.iter().any(|&b| b >= part as u64),
            "{kind}: posts of {through_posts:?} bytes"
        );
        for kernel in [true, false] {
            for sharing in [Sharing::Inputs, Sharing::Everything] {
                let (got, posted, what) = run(Some(16 << 10), kernel, sharing);
                assert!(got == expected, "{what}: wrong results");
                assert!(
                    posted.iter().all(|&b| b < 1024),
                    "{what}: posted {posted:?} bytes"
                );
            }
        }
    }
}
