//! A transport added from outside the library: the tests' loopback
//! transport (`ccl_tests::loopback`), registered with one line, carries every
//! collective and the point-to-point transfers between ranks that are
//! threads of this process, and sub-communicators built from them.

use std::sync::Arc;

use ccl::{Options, ReduceOp, Transports};
use ccl_tests::{loopback::Loopback, with_ranks};

fn options() -> Options {
    Options {
        // The one registration line.
        transports: Some(
            Transports::builtin()
                .unwrap()
                .with_first(Arc::new(Loopback)),
        ),
        ..Options::default()
    }
}

#[test]
fn every_collective_runs_over_a_transport_registered_from_outside() {
    for n in [1, 2, 3, 5] {
        let results = with_ranks(n, options(), move |comm| {
            let r = comm.rank() as u64;
            let used = comm.transports_used().to_vec();
            let mut sum = vec![r + 1; 1000];
            comm.allreduce(&mut sum, ReduceOp::Sum).unwrap();
            let mut all = vec![0u64; 3 * n];
            comm.allgather_into(&[r; 3], &mut all).unwrap();
            let mut bc = vec![r; 7];
            comm.broadcast(&mut bc, n - 1).unwrap();
            let mut mine = vec![0u64; 2];
            comm.reduce_scatter_into(&vec![r; 2 * n], &mut mine, ReduceOp::Max)
                .unwrap();
            let swapped = comm
                .ialltoall((0..n as u64).map(|p| 10 * r + p).collect())
                .wait()
                .unwrap();
            if n > 1 {
                let next = (comm.rank() + 1) % n;
                let prev = (comm.rank() + n - 1) % n;
                let out = comm.isend(vec![r; 5], next);
                let mut got = [0u64; 5];
                comm.recv(&mut got, prev).unwrap();
                out.wait().unwrap();
                assert_eq!(got, [prev as u64; 5]);
            }
            let half = comm
                .split(Some(comm.rank() as u32 % 2), 0)
                .unwrap()
                .unwrap();
            let mut h = [1u32];
            half.allreduce(&mut h, ReduceOp::Sum).unwrap();
            comm.barrier().unwrap();
            (
                used,
                sum[0],
                all,
                bc,
                mine,
                swapped,
                h[0],
                half.transports_used().to_vec(),
            )
        });
        let total: u64 = (1..=n as u64).sum();
        for (rank, (used, sum, all, bc, mine, swapped, h, half_used)) in
            results.into_iter().enumerate()
        {
            let want_used = if n > 1 {
                vec![("loopback", n - 1)]
            } else {
                vec![]
            };
            assert_eq!(used, want_used, "n={n} rank {rank}");
            assert_eq!(sum, total);
            let want_all: Vec<u64> = (0..n as u64).flat_map(|p| [p; 3]).collect();
            assert_eq!(all, want_all);
            assert_eq!(bc, vec![n as u64 - 1; 7]);
            assert_eq!(mine, vec![n as u64 - 1; 2]);
            let want_swapped: Vec<u64> = (0..n as u64).map(|p| 10 * p + rank as u64).collect();
            assert_eq!(swapped, want_swapped);
            let half_size = (0..n).filter(|r| r % 2 == rank % 2).count();
            assert_eq!(h as usize, half_size);
            assert!(
                half_used.iter().all(|(name, _)| *name == "loopback"),
                "{half_used:?}"
            );
        }
    }
}

/// `CCL_TRANSPORT` (here `Options::transport`) can name it too; a name no
/// transport has is a clear error.
#[test]
fn a_registered_transport_can_be_forced_by_name() {
    let forced = Options {
        transport: Some("loopback".into()),
        ..options()
    };
    let used = with_ranks(3, forced, |comm| comm.transports_used().to_vec());
    assert!(used.iter().all(|u| u == &vec![("loopback", 2)]), "{used:?}");
    let unknown = Options {
        transport: Some("carrier-pigeon".into()),
        ..options()
    };
    let store: Arc<dyn ccl::Store> = Arc::new(ccl::HashStore::new());
    let e = ccl::Communicator::new(0, 2, store, unknown).unwrap_err();
    assert!(
        e.to_string().contains("carrier-pigeon")
            && e.to_string().contains("loopback, shm, rdma, tcp, quic"),
        "{e}"
    );
}
