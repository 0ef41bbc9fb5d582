//! A link cut mid-collective: two ranks in separate network namespaces (two
//! "hosts" joined by a veth pair), the veth brought down while they repeat
//! allreduces. Both must fail naming the other within seconds (keepalive
//! probes and TCP_USER_TIMEOUT), not at the deadline. Needs root and `ip`,
//! which the test suite's set-up provides; without them this test fails.

use std::{
    process::Command,
    thread,
    time::{Duration, Instant},
};

use ccl_tests::launch_each;

const WORKER: &str = env!("CARGO_BIN_EXE_ccl-test-worker");

fn ip(args: &[&str]) {
    let out = Command::new("ip")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running ip {args:?} (iproute2 and root are needed): {e}"));
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Two namespaces joined by a veth pair; removed on drop.
struct TwoHosts {
    ns: [String; 2],
    dev: [String; 2],
    addr: [String; 2],
}

impl TwoHosts {
    fn new() -> TwoHosts {
        let id = std::process::id() % 100_000;
        let h = TwoHosts {
            ns: [format!("ccl-cut{id}-a"), format!("ccl-cut{id}-b")],
            dev: [format!("ccut{id}a"), format!("ccut{id}b")],
            addr: [
                format!("10.91.{}.1", id % 250),
                format!("10.91.{}.2", id % 250),
            ],
        };
        for ns in &h.ns {
            ip(&["netns", "add", ns]);
            ip(&["-n", ns, "link", "set", "lo", "up"]);
        }
        ip(&[
            "link", "add", &h.dev[0], "type", "veth", "peer", "name", &h.dev[1],
        ]);
        for i in 0..2 {
            ip(&["link", "set", &h.dev[i], "netns", &h.ns[i]]);
            ip(&[
                "-n",
                &h.ns[i],
                "addr",
                "add",
                &format!("{}/24", h.addr[i]),
                "dev",
                &h.dev[i],
            ]);
            ip(&["-n", &h.ns[i], "link", "set", &h.dev[i], "up"]);
        }
        h
    }
}

impl Drop for TwoHosts {
    fn drop(&mut self) {
        for ns in &self.ns {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}

#[test]
fn a_cut_link_fails_both_sides_within_seconds() {
    let hosts = TwoHosts::new();
    let (ns, master) = (hosts.ns.clone(), hosts.addr[0].clone());
    let cutter = {
        let (ns, dev) = (hosts.ns[0].clone(), hosts.dev[0].clone());
        thread::spawn(move || {
            thread::sleep(Duration::from_millis(1500));
            ip(&["-n", &ns, "link", "set", &dev, "down"]);
            Instant::now()
        })
    };
    let launched = Instant::now();
    let script = format!("exec ip netns exec \"$CCL_TEST_NS\" {WORKER} repeat");
    let out = launch_each(
        "sh",
        &["-c", &script],
        2,
        |rank| {
            vec![
                ("CCL_TEST_NS", ns[rank].clone()),
                ("MASTER_ADDR", master.clone()),
                ("CCL_TIMEOUT", "60s".into()),
            ]
        },
        Duration::from_secs(90),
    );
    let cut_at = cutter.join().expect("cutter").duration_since(launched);
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
        eprintln!("rank {}: error {after:?} after the cut", o.rank);
        assert!(
            after < Duration::from_secs(25),
            "rank {} took {after:?} after the cut:\n{}",
            o.rank,
            o.text()
        );
    }
}
