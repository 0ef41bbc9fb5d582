//! Rank environment and output tagging of `ccl-run`, checked with real
//! `sh -c` children.

mod common;

use std::collections::{HashMap, HashSet};

use common::{ccl_run, run};

const ENV_SCRIPT: &str = "echo \"$RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $GROUP_RANK \
                          $MASTER_ADDR $MASTER_PORT $CCL_JOB_SECRET\"";

/// Parses `[rank R] rest` into `(R, rest)`.
fn split_tag(line: &str) -> (usize, &str) {
    let rest = line
        .strip_prefix("[rank ")
        .unwrap_or_else(|| panic!("untagged line: {line:?}"));
    let (rank, rest) = rest
        .split_once("] ")
        .unwrap_or_else(|| panic!("bad tag: {line:?}"));
    (rank.parse().unwrap(), rest)
}

/// Runs ENV_SCRIPT in `n` ranks and returns, per rank, the echoed fields.
fn env_by_rank(extra: &[&str], secret: Option<&str>, n: usize) -> HashMap<usize, Vec<String>> {
    let mut cmd = ccl_run();
    cmd.arg("-n").arg(n.to_string()).args(extra);
    cmd.args(["--", "sh", "-c", ENV_SCRIPT]);
    if let Some(s) = secret {
        cmd.env("CCL_JOB_SECRET", s);
    }
    let done = run(cmd);
    assert_eq!(done.code(), Some(0), "stderr: {}", done.stderr);
    let mut by_rank = HashMap::new();
    for line in done.stdout.lines() {
        let (rank, rest) = split_tag(line);
        let fields: Vec<String> = rest.split(' ').map(str::to_string).collect();
        assert!(by_rank.insert(rank, fields).is_none(), "rank {rank} twice");
    }
    assert_eq!(by_rank.len(), n, "stdout: {}", done.stdout);
    by_rank
}

#[test]
fn sets_torchrun_variables_per_rank() {
    let by_rank = env_by_rank(&[], None, 4);
    let first = &by_rank[&0];
    let port: u16 = first[6].parse().expect("MASTER_PORT is a port number");
    assert!(port > 0);
    let secret = &first[7];
    assert_eq!(secret.len(), 64, "secret {secret:?}");
    assert!(secret.bytes().all(|b| b.is_ascii_hexdigit()));
    for (rank, f) in &by_rank {
        let r = rank.to_string();
        let expected = [&r, "4", &r, "4", "0", "127.0.0.1", &first[6], secret];
        assert_eq!(f, &expected, "rank {rank}");
    }

    // A new launch gets a new secret.
    let again = env_by_rank(&[], None, 1);
    assert_ne!(&again[&0][7], secret);
}

#[test]
fn honours_master_addr_port_and_inherited_secret() {
    let by_rank = env_by_rank(
        &["--master-addr", "10.1.2.3", "--master-port", "29511"],
        Some("presetsecret"),
        2,
    );
    for f in by_rank.values() {
        assert_eq!(&f[5..], ["10.1.2.3", "29511", "presetsecret"]);
    }
}

#[test]
fn tags_stdout_and_stderr_lines_without_interleaving() {
    const LINES: usize = 300;
    let script = format!(
        "i=0; while [ $i -lt {LINES} ]; do echo \"out $RANK $i\"; echo \"err $RANK $i\" >&2; \
         i=$((i+1)); done; printf \"tail $RANK\"; printf \"etail $RANK\" >&2"
    );
    let mut cmd = ccl_run();
    cmd.args(["-n", "3", "sh", "-c", &script]);
    let done = run(cmd);
    assert_eq!(done.code(), Some(0), "stderr: {}", done.stderr);

    for (text, kind, tail) in [
        (&done.stdout, "out", "tail"),
        (&done.stderr, "err", "etail"),
    ] {
        assert!(text.ends_with('\n'));
        let mut next: HashMap<usize, usize> = HashMap::new();
        let mut tails = HashSet::new();
        for line in text.lines() {
            let (rank, rest) = split_tag(line);
            if rest == format!("{tail} {rank}") {
                assert!(tails.insert(rank));
                assert_eq!(next.get(&rank), Some(&LINES), "tail before the last line");
                continue;
            }
            let i = next.entry(rank).or_insert(0);
            assert_eq!(rest, format!("{kind} {rank} {i}"), "line {line:?}");
            *i += 1;
        }
        assert_eq!(tails.len(), 3, "{kind}: {text}");
    }
}

#[test]
fn no_tag_output_passes_output_through() {
    let mut cmd = ccl_run();
    cmd.args(["-n", "2", "--no-tag-output", "sh", "-c", "echo plain $RANK"]);
    let done = run(cmd);
    assert_eq!(done.code(), Some(0));
    let mut lines: Vec<&str> = done.stdout.lines().collect();
    lines.sort();
    assert_eq!(lines, ["plain 0", "plain 1"]);
}

#[test]
fn passes_hyphenated_arguments_to_the_program() {
    let mut cmd = ccl_run();
    cmd.args(["-n", "1", "echo", "-x", "--grace", "-n"]);
    let done = run(cmd);
    assert_eq!(done.code(), Some(0), "stderr: {}", done.stderr);
    assert_eq!(done.stdout, "[rank 0] -x --grace -n\n");
}
