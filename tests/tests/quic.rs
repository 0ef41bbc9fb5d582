//! Real processes over QUIC (`CCL_TRANSPORT=quic`) on loopback: every
//! collective, large messages, point-to-point, with and without a job secret.

use std::time::Duration;

use ccl_tests::{assert_all_ok, launch};

const WORKER: &str = env!("CARGO_BIN_EXE_ccl-test-worker");

fn env() -> Vec<(&'static str, String)> {
    vec![
        ("CCL_TIMEOUT", "60s".to_string()),
        ("CCL_TRANSPORT", "quic".to_string()),
        ("CCL_DEBUG", "info".to_string()),
    ]
}

#[test]
fn every_collective_over_quic() {
    for n in [2, 4] {
        let out = launch(
            WORKER,
            &["collectives"],
            n,
            &env(),
            Duration::from_secs(240),
        );
        assert_all_ok(&out, &format!("collectives over QUIC with {n} ranks"));
        for o in &out {
            assert!(o.stdout.contains(" 0 failures"), "{}", o.stdout);
            assert!(
                o.stderr.contains(&format!("({} through quic", n - 1)),
                "rank {} should link every peer through quic: {}",
                o.rank,
                o.stderr
            );
        }
    }
}

#[test]
fn large_messages_and_point_to_point_over_quic_with_a_job_secret() {
    let mut e = env();
    e.push(("CCL_JOB_SECRET", "quic-test-secret-0123456789".into()));
    for mode in ["large", "p2p"] {
        let out = launch(WORKER, &[mode], 2, &e, Duration::from_secs(180));
        assert_all_ok(&out, &format!("{mode} over QUIC with a job secret"));
    }
}
