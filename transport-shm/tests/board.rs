//! Ranks as threads of one process sharing a board: posts and reads over many
//! rounds (every slot reused), and each way a round can fail.

use std::{
    path::Path,
    sync::{Arc, Barrier},
    thread,
    time::{Duration, Instant},
};

use ccl_core::{
    CollectiveKind, DataType, Deadline, Error, Fingerprint, FrameHeader, GroupMemory, Spin, Store,
};
use ccl_rendezvous::HashStore;
use ccl_transport_shm::{connect_board, Board, DirectReads, HEADS, INLINE, SHM_DIR, SMALL};

const SPIN: Spin = Spin {
    window: Duration::from_micros(20),
    yield_between: true,
    repoll: false,
};

fn header(seq: u64, count: usize) -> FrameHeader {
    let fp = Fingerprint::new(CollectiveKind::AllGather, DataType::U8, count);
    FrameHeader::data(7, seq, 0, 0, fp)
}

/// A deadline for one board call (leaked: the tests make a few hundred).
fn within(timeout: Duration) -> &'static Deadline {
    Box::leak(Box::new(Deadline::after(timeout)))
}

/// Runs `f(rank, board)` on `n` threads sharing one board.
fn ranks<T: Send + 'static>(
    n: usize,
    f: impl Fn(usize, Board) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let store: Arc<dyn Store> = Arc::new(HashStore::new());
    let f = Arc::new(f);
    let threads: Vec<_> = (0..n)
        .map(|rank| {
            let (store, f) = (store.clone(), f.clone());
            thread::spawn(move || {
                let board = connect_board(
                    rank,
                    n,
                    42,
                    &*store,
                    Path::new(SHM_DIR),
                    Duration::from_secs(20),
                    SPIN,
                    DirectReads::Timed,
                )
                .expect("store")
                .expect("board");
                f(rank, board)
            })
        })
        .collect();
    threads
        .into_iter()
        .map(|t| t.join().expect("rank thread"))
        .collect()
}

/// The two-phase calls of the split allreduce: each rank posts a payload,
/// overwrites its own block of it with a result, and everyone reads every
/// rank's result block; over many rounds, both slots reused.
#[test]
fn every_rank_reads_every_reduced_part_over_many_rounds() {
    for n in [2, 3, 4] {
        ranks(n, move |rank, board| {
            let len = board.slot_bytes();
            let block = len / n;
            for round in 0..200u64 {
                let mine = vec![(rank as u8) ^ round as u8; len];
                let (h, d) = (header(round, len), within(Duration::from_secs(10)));
                let b = board.begin(d).unwrap();
                board.post(b, &h, mine.len(), &[(0, &mine)], d).unwrap();
                // Phase 1: every rank's block `rank` of every payload.
                let mut sum = vec![0u8; block];
                for p in 0..n {
                    let got =
                        &board.read(b, p, &h, len, d).unwrap()[rank * block..(rank + 1) * block];
                    assert!(got.iter().all(|&b| b == (p as u8) ^ round as u8));
                    for (s, g) in sum.iter_mut().zip(got) {
                        *s = s.wrapping_add(*g);
                    }
                }
                board
                    .post_reduced(
                        b,
                        rank * block,
                        block,
                        &mut |part| {
                            part.copy_from_slice(&sum);
                            Ok(())
                        },
                        d,
                    )
                    .unwrap();
                // Phase 2: every rank's result.
                for p in 0..n {
                    let want: u8 = (0..n).fold(0u8, |a, q| a.wrapping_add((q as u8) ^ round as u8));
                    let got = board.read_reduced(b, p, p * block, block, d).unwrap();
                    assert!(
                        got.iter().all(|&b| b == want),
                        "rank {rank} round {round} from {p}"
                    );
                }
            }
        });
    }
}

#[test]
fn every_rank_reads_every_post_over_many_rounds() {
    for n in [2, 3, 5] {
        ranks(n, move |rank, board| {
            for round in 0..300u64 {
                // On the call-number line or after it in the head, or in a payload slot.
                let r = round as usize;
                let len = [(r * 7) % 100, SMALL - r % 64, SMALL + 1 + r][r % 3];
                let mine: Vec<u8> = (0..len)
                    .map(|i| (rank * 31 + i) as u8 ^ round as u8)
                    .collect();
                let (h, d) = (header(round, len), within(Duration::from_secs(10)));
                let b = board.begin(d).unwrap();
                board.post(b, &h, mine.len(), &[(0, &mine)], d).unwrap();
                for p in 0..n {
                    let got = board.read(b, p, &h, len, d).unwrap();
                    let want: Vec<u8> =
                        (0..len).map(|i| (p * 31 + i) as u8 ^ round as u8).collect();
                    assert_eq!(got, &want[..], "rank {rank} round {round} from {p}");
                }
            }
        });
    }
}

#[test]
fn different_calls_are_a_mismatch_on_both_sides() {
    let errors = ranks(2, |rank, board| {
        let (h, d) = (header(1, 4 + rank), within(Duration::from_secs(10)));
        let b = board.begin(d).unwrap();
        board
            .post(b, &h, 4 + rank, &[(0, &vec![0u8; 4 + rank])], d)
            .unwrap();
        board.read(b, 1 - rank, &h, 4 + rank, d).unwrap_err()
    });
    for (rank, e) in errors.iter().enumerate() {
        assert!(
            matches!(e, Error::Mismatch { peer, .. } if *peer == 1 - rank),
            "rank {rank}: {e}"
        );
    }
}

/// A rank that reads nobody's posts (a broadcast's root) makes `HEADS − 1`
/// calls of up to `SMALL` bytes while the others have not started any, and no more; the
/// others then read every one of them. A large payload waits for the others
/// to reach the call before.
#[test]
fn a_rank_that_reads_nobody_runs_ahead_as_far_as_the_heads_allow() {
    let go = Arc::new(Barrier::new(3));
    ranks(3, move |rank, board| {
        let ahead = HEADS as u64 - 1;
        // Payloads on the call-number line and after the head's lines.
        let len = |round: u64| if round % 2 == 0 { INLINE } else { SMALL };
        let small = |round: u64| vec![round as u8; len(round)];
        if rank == 0 {
            for round in 1..=ahead {
                let (h, d) = (header(round, len(round)), within(Duration::from_secs(10)));
                let b = board.begin(d).unwrap();
                board
                    .post(b, &h, len(round), &[(0, &small(round))], d)
                    .unwrap();
            }
            let short = within(Duration::from_millis(200));
            match board.begin(short) {
                Err(Error::Timeout { .. }) => {}
                other => panic!(
                    "call {} began before the others began call 2: {other:?}",
                    ahead + 1
                ),
            }
            go.wait();
            return;
        }
        go.wait();
        for round in 1..=ahead {
            let (h, d) = (header(round, len(round)), within(Duration::from_secs(10)));
            let b = board.begin(d).unwrap();
            board.post(b, &h, 0, &[], d).unwrap();
            let got = board.read(b, 0, &h, len(round), d).unwrap();
            assert_eq!(got, &small(round)[..], "rank {rank} call {round}");
        }
    });
    // A payload beyond the head: call 2's waits for the others' call 1.
    let go = Arc::new(Barrier::new(2));
    ranks(2, move |rank, board| {
        let big = vec![7u8; SMALL + 1];
        let d = within(Duration::from_secs(10));
        if rank == 0 {
            for round in 1..=2 {
                let b = board.begin(d).unwrap();
                let wait = within(Duration::from_millis(200));
                let posted =
                    board.post(b, &header(round, big.len()), big.len(), &[(0, &big)], wait);
                match round {
                    1 => posted.unwrap(),
                    _ => assert!(matches!(posted, Err(Error::Timeout { .. })), "{posted:?}"),
                }
            }
        }
        go.wait();
    });
}

/// Two ranks that read nothing of each other in a call do not see that
/// their calls differ there; the next call in which one reads the other's
/// post reports it, on the reader.
#[test]
fn an_unread_mismatch_is_reported_at_the_next_read() {
    let errors = ranks(2, |rank, board| {
        let d = within(Duration::from_secs(10));
        let b = board.begin(d).unwrap();
        board.post(b, &header(1, 4 + rank), 0, &[], d).unwrap();
        let b = board.begin(d).unwrap();
        let h = header(2, 4);
        board.post(b, &h, 0, &[], d).unwrap();
        board.read(b, 1 - rank, &h, 0, d).unwrap_err()
    });
    for (rank, e) in errors.iter().enumerate() {
        assert!(
            matches!(e, Error::Mismatch { peer, theirs, .. } if *peer == 1 - rank && theirs.contains("earlier call")),
            "rank {rank}: {e}"
        );
    }
}

/// Rank 1 waits for rank 0, which does `leave` after 100 ms instead of posting.
fn waiter_sees(leave: impl Fn(Board) + Send + Sync + 'static) -> (Error, Duration) {
    let go = Arc::new(Barrier::new(2));
    let out = ranks(2, move |rank, board| {
        go.wait();
        if rank == 0 {
            thread::sleep(Duration::from_millis(100));
            leave(board);
            return None;
        }
        let started = Instant::now();
        let (h, d) = (header(1, 0), within(Duration::from_secs(10)));
        let b = board.begin(d).unwrap();
        board.post(b, &h, 0, &[], d).unwrap();
        let e = board.read(b, 0, &h, 0, d).unwrap_err();
        Some((e, started.elapsed()))
    });
    out.into_iter().flatten().next().expect("rank 1 result")
}

#[test]
fn an_abort_wakes_the_waiters() {
    let (e, took) = waiter_sees(|board| {
        board.abort(0);
        thread::sleep(Duration::from_millis(500));
    });
    assert!(
        matches!(&e, Error::PeerLost { peer: 0, cause, .. } if cause.contains("aborted")),
        "{e}"
    );
    assert!(took < Duration::from_secs(2), "took {took:?}");
}

#[test]
fn a_dropped_board_wakes_the_waiters() {
    let (e, took) = waiter_sees(drop);
    assert!(
        matches!(&e, Error::PeerLost { peer: 0, cause, .. } if cause.contains("dropped")),
        "{e}"
    );
    assert!(took < Duration::from_secs(2), "took {took:?}");
}

#[test]
fn a_silent_peer_is_a_timeout() {
    let out = ranks(2, |rank, board| {
        if rank == 0 {
            thread::sleep(Duration::from_millis(800));
            return None;
        }
        let started = Instant::now();
        let (h, d) = (header(1, 0), within(Duration::from_millis(300)));
        let b = board.begin(d).unwrap();
        board.post(b, &h, 0, &[], d).unwrap();
        Some((board.read(b, 0, &h, 0, d).unwrap_err(), started.elapsed()))
    });
    let (e, took) = out.into_iter().flatten().next().unwrap();
    assert!(matches!(e, Error::Timeout { .. }), "{e}");
    assert!(e.to_string().contains("rank 0"), "{e}");
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_secs(2),
        "took {took:?}"
    );
}
