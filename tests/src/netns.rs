//! Two "hosts" on one machine: network namespaces joined by a veth pair,
//! for tests of links between hosts (a cut, packet loss, delay). Needs root,
//! `ip`, for loss `nft`, and for delay `iptables`; the test suite's set-up
//! provides them, and without them these tests fail.

use std::{
    io::{BufRead, BufReader, Read},
    process::{Child, Command, Stdio},
};

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
    /// The delay lines of [`TwoHosts::delay`], one per namespace.
    delay_lines: Vec<Child>,
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
            delay_lines: Vec::new(),
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

    /// Limits what host `i` sends to `rate` (as `tc` spells it, e.g.
    /// `64mbit`): a token bucket on its veth end.
    pub fn limit_rate(&self, i: usize, rate: &str) {
        ip(&[
            "netns",
            "exec",
            &self.ns[i],
            "tc",
            "qdisc",
            "add",
            "dev",
            &self.dev[i],
            "root",
            "tbf",
            "rate",
            rate,
            "burst",
            "64kb",
            "latency",
            "400ms",
        ]);
    }

    /// Delays every packet that arrives at either host by `ms` milliseconds:
    /// `netdelay` (the `ccl-netdelay` binary, a delay line on NFQUEUE, since
    /// this kernel has no `tc netem`) holds what an iptables rule on the
    /// veth's input hands it. [`TwoHosts::stop_delay`] reports what it held.
    pub fn delay(&mut self, netdelay: &str, ms: u32) {
        for i in 0..2 {
            let mut line = Command::new("ip")
                .args(["netns", "exec", &self.ns[i], netdelay, "--queue", "0"])
                .args(["--delay-ms", &ms.to_string()])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap_or_else(|e| panic!("running {netdelay}: {e}"));
            let mut first = String::new();
            let stdout = line.stdout.as_mut().expect("piped stdout");
            // The line is printed once the queue is bound; the rule may go in then.
            let _ = BufReader::new(stdout).read_line(&mut first);
            if first.trim() != "ready" {
                let _ = line.kill();
                let mut err = String::new();
                let _ = line.stderr.take().expect("piped").read_to_string(&mut err);
                panic!("{netdelay} did not start in {}: {err}", self.ns[i]);
            }
            self.delay_lines.push(line);
            ip(&[
                "netns",
                "exec",
                &self.ns[i],
                "iptables",
                "-A",
                "INPUT",
                "-i",
                &self.dev[i],
                "-j",
                "NFQUEUE",
                "--queue-num",
                "0",
            ]);
        }
    }

    /// Stops the delay lines and returns what each printed: the packets it
    /// held and their mean hold time.
    pub fn stop_delay(&mut self) -> Vec<String> {
        self.delay_lines
            .drain(..)
            .map(|line| {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(line.id() as i32),
                    nix::sys::signal::Signal::SIGTERM,
                );
                let out = line.wait_with_output().expect("waiting for a delay line");
                String::from_utf8_lossy(&out.stdout).trim().to_string()
            })
            .collect()
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
        for line in &mut self.delay_lines {
            let _ = line.kill();
            let _ = line.wait();
        }
        for ns in &self.ns {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}
