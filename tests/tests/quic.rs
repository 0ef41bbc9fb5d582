//! Real processes over QUIC (`CCL_TRANSPORT=quic`): on loopback, every
//! collective, large messages, point-to-point, with and without a job
//! secret; between two network namespaces, under packet loss, under 20 ms
//! of delay with loss, and in a job that takes shared memory within each
//! host and QUIC between them (`CCL_TRANSPORT=shm,quic`). The namespaces
//! need root, `ip`, `nft` and `iptables`.

use std::time::Duration;

use ccl_tests::{assert_all_ok, launch, launch_each, netns::TwoHosts, RankOutput};

const WORKER: &str = env!("CARGO_BIN_EXE_ccl-test-worker");
const NETDELAY: &str = env!("CARGO_BIN_EXE_ccl-netdelay");

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

/// Runs the worker's `scenario` on `n` ranks spread over two namespaces
/// (ranks `< n/2` on the first), with `transport`, and checks every result.
fn across_two_hosts(
    hosts: &TwoHosts,
    scenario: &str,
    n: usize,
    transport: &str,
) -> Vec<RankOutput> {
    let script = format!("exec ip netns exec \"$CCL_TEST_NS\" {WORKER} {scenario}");
    let per_host = n / 2;
    let out = launch_each(
        "sh",
        &["-c", &script],
        n,
        |rank| {
            vec![
                ("CCL_TEST_NS", hosts.ns[rank / per_host].clone()),
                // `ip netns exec` gives each process a mount namespace of
                // its own, which the detected host identity includes.
                ("CCL_HOST_ID", hosts.ns[rank / per_host].clone()),
                ("MASTER_ADDR", hosts.addr[0].clone()),
                ("LOCAL_RANK", (rank % per_host).to_string()),
                ("LOCAL_WORLD_SIZE", per_host.to_string()),
                ("CCL_TIMEOUT", "120s".into()),
                ("CCL_TRANSPORT", transport.into()),
                ("CCL_DEBUG", "info".into()),
            ]
        },
        Duration::from_secs(300),
    );
    assert_all_ok(&out, &format!("{scenario} on {n} ranks over {transport}"));
    for o in &out {
        assert!(o.stdout.contains(" 0 failures"), "{}", o.text());
    }
    out
}

#[test]
fn results_stay_right_when_two_percent_of_packets_are_lost() {
    let hosts = TwoHosts::new("qloss");
    hosts.lose(20);
    for scenario in ["collectives", "large"] {
        across_two_hosts(&hosts, scenario, 2, "quic");
    }
    let lost = hosts.lost();
    assert!(
        lost > 0,
        "no packet was dropped: the loss rule did not apply"
    );
    eprintln!("QUIC recovered from {lost} dropped packets");
}

#[test]
fn results_stay_right_under_20_ms_of_delay_and_half_a_percent_of_loss() {
    let mut hosts = TwoHosts::new("qdelay");
    hosts.lose(5);
    hosts.delay(NETDELAY, 20);
    for scenario in ["collectives", "large", "send-then-exit"] {
        across_two_hosts(&hosts, scenario, 2, "quic");
    }
    let lost = hosts.lost();
    let held = hosts.stop_delay();
    eprintln!("QUIC recovered from {lost} dropped packets; delay lines: {held:?}");
    assert!(
        lost > 0,
        "no packet was dropped: the loss rule did not apply"
    );
    for line in &held {
        // "held N packets, mean M ms, K overruns"
        let words: Vec<&str> = line.split_whitespace().collect();
        let (count, mean) = match words.as_slice() {
            ["held", n, "packets,", "mean", m, "ms,", ..] => (
                n.parse::<u64>().unwrap_or(0),
                m.parse::<f64>().unwrap_or(0.0),
            ),
            _ => panic!("unexpected delay line report: {line:?}"),
        };
        assert!(count > 0, "a delay line held no packet: {line}");
        assert!(mean >= 20.0, "packets were held less than 20 ms: {line}");
    }
}

#[test]
fn a_rank_that_exits_right_after_a_send_delivers_it_over_a_slow_link() {
    // 32 MiB at 64 Mbit/s take about 4 s to cross after rank 0 called exit:
    // its exit hook waits for the acknowledgements as long as that takes.
    let hosts = TwoHosts::new("qslow");
    hosts.limit_rate(0, "64mbit");
    across_two_hosts(&hosts, "send-then-exit", 2, "quic");
}

#[test]
fn a_mixed_job_takes_shared_memory_within_hosts_and_quic_between() {
    let hosts = TwoHosts::new("qmix");
    for o in across_two_hosts(&hosts, "collectives", 4, "shm,quic") {
        // One peer on the same host, two on the other.
        assert!(
            o.stderr.contains("1 through shm, 2 through quic"),
            "rank {}: expected shm within the host, QUIC between:\n{}",
            o.rank,
            o.stderr
        );
    }
}
