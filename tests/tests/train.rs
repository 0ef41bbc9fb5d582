//! The training helpers (`ccl::train`) in real processes: `synchronize`
//! gives every rank the root's tensors and optimizer state, and
//! `DistributedOptimizer` + `Sgd` on per-rank shards of a linear regression
//! keeps every rank's parameters identical and equal to one process's run on
//! the whole data (`tests/src/bin/train_worker.rs` checks each rank).

use std::time::Duration;

use ccl_tests::{assert_all_ok, launch, launch_each, RankOutput};

const WORKER: &str = env!("CARGO_BIN_EXE_train_worker");

/// The rest of the line after `marker` that each rank printed, or a panic.
fn each_rank_s(out: &[RankOutput], marker: &str) -> Vec<String> {
    out.iter()
        .map(|o| {
            let line = o.stdout.lines().find_map(|l| l.split_once(marker));
            match line {
                Some((_, rest)) => rest.to_string(),
                None => panic!("rank {} printed no {marker:?}:\n{}", o.rank, o.text()),
            }
        })
        .collect()
}

/// Every rank holds the same tensors after `synchronize` and the same
/// parameters after training; `what` names the run.
fn assert_ranks_agree(out: &[RankOutput], what: &str) {
    assert_all_ok(out, what);
    for marker in ["checksum ", "params "] {
        let seen = each_rank_s(out, marker);
        assert!(
            seen.iter().all(|s| s == &seen[0]),
            "{what}: ranks differ after {marker:?}: {seen:#?}"
        );
    }
}

#[test]
fn ranks_synchronize_and_train_in_step() {
    for n in [1, 2, 3, 4] {
        let env = vec![("CCL_TIMEOUT", "60s".to_string())];
        let out = launch(WORKER, &[], n, &env, Duration::from_secs(240));
        let what = format!("{n} ranks");
        assert_ranks_agree(&out, &what);
        let places = each_rank_s(&out, "host_rank ");
        assert!(
            places
                .iter()
                .enumerate()
                .all(|(r, p)| *p == format!("{r}/{n}")),
            "{what}: {places:?}"
        );
    }
}

/// Two "hosts" of two ranks: shared memory within each, TCP between them.
#[test]
fn ranks_on_two_hosts_synchronize_and_train_in_step() {
    let out = launch_each(
        WORKER,
        &[],
        4,
        |rank| {
            vec![
                ("CCL_TIMEOUT", "60s".to_string()),
                ("CCL_HOST_ID", format!("host{}", rank / 2)),
            ]
        },
        Duration::from_secs(240),
    );
    assert_ranks_agree(&out, "4 ranks on 2 hosts");
    let places = each_rank_s(&out, "host_rank ");
    assert_eq!(places, ["0/2", "1/2", "0/2", "1/2"]);
}
