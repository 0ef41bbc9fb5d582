//! A link cut mid-collective: two ranks in separate network namespaces (two
//! "hosts" joined by a veth pair), the veth brought down while they repeat
//! allreduces. Both must fail naming the other within seconds, not at the
//! deadline: over TCP by keepalive probes and TCP_USER_TIMEOUT, over QUIC by
//! its idle timeout. Needs root and `ip`, which the test suite's set-up
//! provides; without them these tests fail.

use std::{
    thread,
    time::{Duration, Instant},
};

use ccl_tests::{launch_each, netns::TwoHosts};

const WORKER: &str = env!("CARGO_BIN_EXE_ccl-test-worker");

/// Cuts the link of a job of repeated allreduces over `transport` 300 ms
/// after the first one succeeded (however long set-up took) and checks how
/// both ranks fail.
fn cut_mid_call(transport: &str, tag: &str) {
    let hosts = TwoHosts::new(tag);
    let (ns, master) = (hosts.ns.clone(), hosts.addr[0].clone());
    let dir = std::env::temp_dir().join(format!("ccl-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a directory for the ready file");
    let launched = Instant::now();
    let cut_at = thread::scope(|s| {
        let cutter = s.spawn(|| {
            let until = Instant::now() + Duration::from_secs(60);
            while !dir.join("ready").exists() && Instant::now() < until {
                thread::sleep(Duration::from_millis(5));
            }
            thread::sleep(Duration::from_millis(300));
            hosts.cut(0);
            Instant::now()
        });
        let script = format!(
            "exec ip netns exec \"$CCL_TEST_NS\" {WORKER} repeat {}",
            dir.display()
        );
        let out = launch_each(
            "sh",
            &["-c", &script],
            2,
            |rank| {
                vec![
                    ("CCL_TEST_NS", ns[rank].clone()),
                    ("MASTER_ADDR", master.clone()),
                    ("CCL_TIMEOUT", "60s".into()),
                    ("CCL_TRANSPORT", transport.into()),
                ]
            },
            Duration::from_secs(90),
        );
        let cut_at = cutter.join().expect("cutter").duration_since(launched);
        (out, cut_at)
    });
    let (out, cut_at) = cut_at;
    let _ = std::fs::remove_dir_all(&dir);
    for o in &out {
        assert_eq!(o.code, Some(0), "rank {}:\n{}", o.rank, o.text());
        assert!(
            o.stdout.contains(&format!("rank {}", 1 - o.rank)),
            "rank {} does not name rank {}:\n{}",
            o.rank,
            1 - o.rank,
            o.text()
        );
        let after = o.elapsed.saturating_sub(cut_at);
        eprintln!(
            "{transport}: rank {}: error {after:?} after the cut",
            o.rank
        );
        assert!(
            after < Duration::from_secs(25),
            "rank {} took {after:?} after the cut:\n{}",
            o.rank,
            o.text()
        );
    }
}

#[test]
fn a_cut_tcp_link_fails_both_sides_within_seconds() {
    cut_mid_call("tcp", "cut");
}

#[test]
fn a_cut_quic_link_fails_both_sides_within_seconds() {
    cut_mid_call("quic", "qcut");
}
