//! The congestion control of real TCP links: within a host they avoid the
//! system's default (a pacing algorithm such as BBR halves throughput over
//! loopback); between hosts, two network namespaces joined by a veth pair,
//! they keep it. Each rank is a thread that entered its namespace; `ss`
//! reads the sockets while the links are up. Needs root, `ip` and `ss`,
//! which the test suite's set-up provides; without them this test fails.

use std::{
    fs::File,
    net::IpAddr,
    process::Command,
    sync::{Arc, Barrier},
    time::Duration,
};

use ccl_core::Setup;
use ccl_rendezvous::HashStore;
use ccl_tests::netns::{ip, TwoHosts};
use ccl_transport_tcp::{connect_mesh, TcpOptions};
use nix::sched::{setns, CloneFlags};

/// The default each namespace is given, so that a link that keeps the
/// default and one that uses what ccl picks within a host (cubic) differ.
const NAMESPACE_DEFAULT: &str = "reno";

/// Connects two ranks, rank r in namespace `ns[r]` listening on `addr[r]`,
/// and returns, per rank, the congestion control `ss` shows on each of its
/// established sockets whose peer is the other rank's address.
fn link_algorithms(ns: [&str; 2], addr: [&str; 2]) -> Vec<Vec<String>> {
    let store = Arc::new(HashStore::new());
    let connected = Barrier::new(3);
    let read = Barrier::new(3);
    std::thread::scope(|s| {
        for rank in 0..2 {
            let (store, connected, read) = (store.clone(), &connected, &read);
            s.spawn(move || {
                let file = File::open(format!("/var/run/netns/{}", ns[rank])).expect("namespace");
                setns(file, CloneFlags::CLONE_NEWNET).expect("entering the namespace");
                let setup = Setup {
                    rank,
                    world_size: 2,
                    comm: 7,
                    store,
                    timeout: Duration::from_secs(10),
                    secret: None,
                };
                let opts = TcpOptions {
                    local_ip: Some(addr[rank].parse::<IpAddr>().expect("address")),
                    ..TcpOptions::default()
                };
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("runtime");
                let links = rt.block_on(connect_mesh(&setup, &opts)).expect("links");
                connected.wait();
                read.wait();
                drop(links);
            });
        }
        connected.wait();
        let algorithms = (0..2)
            .map(|rank| sockets_to(ns[rank], addr[1 - rank]))
            .collect();
        read.wait();
        algorithms
    })
}

/// The congestion control of each established socket in namespace `ns`
/// whose peer is at `peer`.
fn sockets_to(ns: &str, peer: &str) -> Vec<String> {
    let out = Command::new("ip")
        .args(["netns", "exec", ns, "ss", "-tinH", "state", "established"])
        .output()
        .expect("running ss (root, ip and ss are needed)");
    assert!(
        out.status.success(),
        "ss: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    // Each socket takes two lines: addresses, then its TCP details.
    let lines: Vec<&str> = text.lines().collect();
    lines
        .chunks(2)
        .filter(|s| {
            s[0].split_whitespace()
                .nth(3)
                .is_some_and(|p| p.starts_with(&format!("{peer}:")))
        })
        .map(|s| {
            s.get(1)
                .and_then(|d| {
                    d.split_whitespace()
                        .find(|w| ["cubic", "reno", "bbr"].contains(w))
                })
                .unwrap_or_else(|| panic!("no congestion control in {s:?}"))
                .to_string()
        })
        .collect()
}

fn set_default(ns: &str, name: &str) {
    ip(&[
        "netns",
        "exec",
        ns,
        "sysctl",
        "-q",
        "-w",
        &format!("net.ipv4.tcp_congestion_control={name}"),
    ]);
}

#[test]
fn links_within_a_host_avoid_the_default_and_links_between_hosts_keep_it() {
    let hosts = TwoHosts::new("cc");
    for ns in &hosts.ns {
        set_default(ns, NAMESPACE_DEFAULT);
    }
    let [a, b] = [hosts.ns[0].as_str(), hosts.ns[1].as_str()];
    let [addr_a, addr_b] = [hosts.addr[0].as_str(), hosts.addr[1].as_str()];

    let between = link_algorithms([a, b], [addr_a, addr_b]);
    for (rank, names) in between.iter().enumerate() {
        assert_eq!(
            names,
            &vec![NAMESPACE_DEFAULT.to_string()],
            "rank {rank} between hosts"
        );
    }

    // Both ranks in namespace a: one over loopback, one over the veth's
    // address, which is this host's own.
    for at in ["127.0.0.1", addr_a] {
        let within = link_algorithms([a, a], [at, at]);
        for (rank, names) in within.iter().enumerate() {
            // Each rank sees both ends of the one link (both are its host's).
            assert_eq!(
                names,
                &vec!["cubic".to_string(); 2],
                "rank {rank} within a host at {at}"
            );
        }
    }
}
