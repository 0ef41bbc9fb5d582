//! Two "hosts" on one machine: network namespaces joined by a veth pair,
//! for tests of links between hosts (a cut, packet loss). Needs root, `ip`
//! and, for loss, `nft`; the test suite's set-up provides them, and without
//! them these tests fail.

use std::process::Command;

/// Runs `ip args`, panicking with its error output if it fails.
pub fn ip(args: &[&str]) {
    let program = "ip";
    let out = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| {
            panic!("running {program} {args:?} (root and {program} are needed): {e}")
        });
    assert!(
        out.status.success(),
        "{program} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Two namespaces joined by a veth pair, each with one address; removed on drop.
pub struct TwoHosts {
    /// The namespaces' names.
    pub ns: [String; 2],
    /// The veth ends, one in each namespace.
    pub dev: [String; 2],
    /// The addresses of the veth ends.
    pub addr: [String; 2],
}

impl TwoHosts {
    /// Makes the namespaces; `tag` keeps names of concurrent tests apart.
    pub fn new(tag: &str) -> TwoHosts {
        let id = std::process::id() % 100_000;
        let h = TwoHosts {
            ns: [format!("ccl-{tag}{id}-a"), format!("ccl-{tag}{id}-b")],
            dev: [format!("c{tag}{id}a"), format!("c{tag}{id}b")],
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
            let cidr = format!("{}/24", h.addr[i]);
            ip(&["-n", &h.ns[i], "addr", "add", &cidr, "dev", &h.dev[i]]);
            ip(&["-n", &h.ns[i], "link", "set", &h.dev[i], "up"]);
        }
        h
    }

    /// Drops each packet that arrives at either host with probability
    /// `permille`/1000 (an nftables rule on the veth's ingress).
    pub fn lose(&self, permille: u32) {
        for i in 0..2 {
            let nft = |args: &[&str]| {
                let mut all = vec!["netns", "exec", &self.ns[i], "nft"];
                all.extend_from_slice(args);
                ip(&all);
            };
            let hook = format!(
                "{{ type filter hook ingress device \"{}\" priority 0; }}",
                self.dev[i]
            );
            let rate = permille.to_string();
            nft(&["add", "table", "netdev", "ccl_loss"]);
            nft(&["add", "chain", "netdev", "ccl_loss", "ingress", &hook]);
            nft(&[
                "add", "rule", "netdev", "ccl_loss", "ingress", "numgen", "random", "mod", "1000",
                "lt", &rate, "counter", "drop",
            ]);
        }
    }

    /// Packets the rules of [`TwoHosts::lose`] dropped so far.
    pub fn lost(&self) -> u64 {
        self.ns
            .iter()
            .map(|ns| {
                let out = Command::new("ip")
                    .args([
                        "netns", "exec", ns, "nft", "list", "table", "netdev", "ccl_loss",
                    ])
                    .output()
                    .expect("running nft");
                let text = String::from_utf8_lossy(&out.stdout);
                text.split("counter packets ")
                    .skip(1)
                    .filter_map(|rest| rest.split_whitespace().next()?.parse::<u64>().ok())
                    .sum::<u64>()
            })
            .sum()
    }

    /// Brings host `i`'s end of the veth down: every packet between them is lost.
    pub fn cut(&self, i: usize) {
        ip(&["-n", &self.ns[i], "link", "set", &self.dev[i], "down"]);
    }
}

impl Drop for TwoHosts {
    fn drop(&mut self) {
        for ns in &self.ns {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}
