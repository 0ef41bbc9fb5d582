//! Real processes, real sockets: every collective across world sizes 1–8,
//! sub-communicators, point-to-point, and the failure cases.

use std::time::Duration;

use ccl_tests::{assert_all_ok, launch};

const WORKER: &str = env!("CARGO_BIN_EXE_ccl-test-worker");

fn env(timeout: &str) -> Vec<(&'static str, String)> {
    vec![("CCL_TIMEOUT", timeout.to_string())]
}

#[test]
fn every_collective_dtype_and_op_across_world_sizes() {
    for n in [1, 2, 3, 4, 5, 8] {
        let out = launch(
            WORKER,
            &["collectives"],
            n,
            &env("60s"),
            Duration::from_secs(240),
        );
        assert_all_ok(&out, &format!("collectives with {n} ranks"));
        for o in &out {
            assert!(o.stdout.contains(" 0 failures"), "{}", o.stdout);
        }
    }
}

#[test]
fn collectives_with_every_algorithm_forced() {
    for (n, algo) in [(3, "ring"), (5, "ring"), (6, "rd")] {
        let mut e = env("60s");
        e.push(("CCL_ALGO", algo.into()));
        let out = launch(WORKER, &["collectives"], n, &e, Duration::from_secs(240));
        assert_all_ok(
            &out,
            &format!("collectives with {n} ranks, CCL_ALGO={algo}"),
        );
    }
}

#[test]
fn collectives_with_several_sockets_per_peer() {
    let mut e = env("60s");
    e.push(("CCL_NSOCKS", "3".into()));
    let out = launch(WORKER, &["p2p"], 3, &e, Duration::from_secs(60));
    assert_all_ok(&out, "p2p with 3 sockets per peer");
}

#[test]
fn point_to_point_ring() {
    for n in [2, 3, 5] {
        assert_all_ok(
            &launch(WORKER, &["p2p"], n, &env("60s"), Duration::from_secs(60)),
            &format!("p2p with {n} ranks"),
        );
    }
}

#[test]
fn split_and_new_group() {
    for n in [1, 2, 3, 5, 8] {
        assert_all_ok(
            &launch(WORKER, &["split"], n, &env("60s"), Duration::from_secs(60)),
            &format!("split with {n} ranks"),
        );
    }
}

#[test]
fn mismatched_counts_fail_on_every_rank() {
    for n in [2, 4] {
        let out = launch(
            WORKER,
            &["mismatch"],
            n,
            &env("20s"),
            Duration::from_secs(40),
        );
        assert_all_ok(&out, "mismatch scenario");
        for o in &out {
            assert!(o.stdout.contains("error:"), "rank {}: {}", o.rank, o.stdout);
            assert!(
                o.stdout.contains("mismatch"),
                "rank {} does not name the mismatch: {}",
                o.rank,
                o.stdout
            );
            assert!(
                o.elapsed < Duration::from_secs(15),
                "rank {} took {:?}",
                o.rank,
                o.elapsed
            );
        }
    }
}

#[test]
fn a_dead_rank_is_named_by_every_survivor() {
    for (n, victim) in [(2, 1), (4, 2), (5, 0)] {
        let out = launch(
            WORKER,
            &["die", &victim.to_string()],
            n,
            &env("30s"),
            Duration::from_secs(60),
        );
        for o in &out {
            if o.rank == victim {
                assert_eq!(o.code, Some(7));
                continue;
            }
            assert_eq!(o.code, Some(0), "survivor {}: {}", o.rank, o.text());
            assert!(
                o.stdout.contains(&format!("lost rank {victim}")),
                "survivor {} does not name rank {victim}: {}",
                o.rank,
                o.text()
            );
            assert!(
                o.elapsed < Duration::from_secs(25),
                "survivor {} took {:?}",
                o.rank,
                o.elapsed
            );
        }
    }
}
