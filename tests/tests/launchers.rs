//! The data-parallel example under the real launchers, with no variables
//! of ccl's own: `torchrun --no-python` (ccl meets in the store that
//! torchrun's agent serves) and `mpirun` (ccl meets in a directory of the
//! job's own under the temp dir, removed when the job ends).
//!
//! torchrun comes from the virtual environment `CCL_TEST_VENV` names, mpirun
//! from `PATH`. Without them these tests fail under CI (`CI=true`) and are
//! skipped elsewhere.

use std::{path::Path, process::Command, time::Duration};

use ccl_tests::{
    assert_data_parallel_output, have_mpirun, is_root, run_bounded, torch_venv, Outcome,
};

const EXAMPLE: &str = env!("CARGO_BIN_EXE_data-parallel-example");
const DEADLINE: Duration = Duration::from_secs(180);

/// Launcher variables of the test's own environment, which the ranks must
/// not inherit (the launchers set theirs).
const INHERITED: [&str; 10] = [
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "CCL_STORE_PATH",
    "CCL_STORE_EXTERNAL",
    "TORCHELASTIC_USE_AGENT_STORE",
    "CCL_JOB_SECRET",
];

fn assert_ok(out: &Outcome, what: &str) {
    assert!(
        out.code == Some(0) && !out.timed_out,
        "{what}: exit {:?}{}\n{}",
        out.code,
        if out.timed_out {
            " (killed at the deadline)"
        } else {
            ""
        },
        out.text()
    );
}

/// `torchrun` of `venv` with `args`, the ranks logging at info level.
fn torchrun(venv: &Path, args: &[&str]) -> Command {
    let mut cmd = Command::new(venv.join("bin/torchrun"));
    cmd.args(args)
        .env("CCL_TIMEOUT", "60s")
        .env("CCL_DEBUG", "info");
    for k in INHERITED {
        cmd.env_remove(k);
    }
    cmd
}

/// The store each rank says it met the others through, in the order of
/// their log lines ("... rendezvous through STORE rank=R").
fn stores(out: &Outcome) -> Vec<&str> {
    out.stderr
        .lines()
        .filter_map(|l| {
            let (_, s) = l.split_once("rendezvous through ")?;
            Some(s.rsplit_once(" rank=")?.0)
        })
        .collect()
}

#[test]
fn torchrun_runs_the_example_through_its_agents_store() {
    let Some(venv) = torch_venv() else { return };
    // Static rendezvous at a port of our choosing, and torchrun's own
    // standalone (c10d) rendezvous at a port it picks.
    let port = ccl::free_port().unwrap().to_string();
    let static_args = ["--master-addr", "127.0.0.1", "--master-port", &port];
    // The first job with a secret and TCP links: torch's store knows no
    // secret, but ccl's links still prove it.
    for (n, rendezvous, secret) in [
        (2, &static_args[..], Some("s3cret")),
        (4, &["--standalone"][..], None),
    ] {
        let mut args = vec!["--nproc-per-node".to_string(), n.to_string()];
        args.extend(rendezvous.iter().map(|a| a.to_string()));
        args.extend(["--no-python".into(), EXAMPLE.into()]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let mut cmd = torchrun(&venv, &args);
        if let Some(secret) = secret {
            cmd.env("CCL_JOB_SECRET", secret)
                .env("CCL_TRANSPORT", "tcp");
        }
        let out = run_bounded(cmd, DEADLINE);
        let what = format!("torchrun {}", args.join(" "));
        assert_ok(&out, &what);
        assert_eq!(
            out.stderr.contains("this job is unauthenticated"),
            secret.is_none(),
            "{what}: {}",
            out.stderr
        );
        if secret.is_some() {
            let tcp = format!("connected to {} peers ({} through tcp)", n - 1, n - 1);
            assert_eq!(
                out.stderr.matches(&tcp).count(),
                n,
                "{what}: {}",
                out.stderr
            );
        }
        assert_data_parallel_output(&out.stdout, n);
        let stores = stores(&out);
        assert_eq!(stores.len(), n, "{what}: {}", out.stderr);
        for s in stores {
            assert!(
                s.starts_with("torch store tcp://")
                    && s.contains("(prefix 'ccl/")
                    && s.contains("/restart-0')"),
                "{what}: rank met through {s}"
            );
        }
    }
}

/// A rank fails in torchrun's first attempt, after the other wrote its
/// keys into the agent's store; the restarted job must meet under keys of
/// its own, not the first attempt's.
#[test]
fn a_job_that_torchrun_restarts_meets_afresh() {
    let Some(venv) = torch_venv() else { return };
    let port = ccl::free_port().unwrap().to_string();
    let fail_first = r#"if [ "$TORCHELASTIC_RESTART_COUNT" = 0 ] && [ "$RANK" = 1 ]; then sleep 1; exit 3; fi; exec "$0""#;
    let out = run_bounded(
        torchrun(
            &venv,
            &[
                "--nproc-per-node",
                "2",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                &port,
                "--max-restarts",
                "1",
                "--no-python",
                "sh",
                "-c",
                fail_first,
                EXAMPLE,
            ],
        ),
        DEADLINE,
    );
    assert_ok(&out, "torchrun --max-restarts 1");
    assert_data_parallel_output(&out.stdout, 2);
    let stores = stores(&out);
    assert!(
        stores[0].ends_with("/restart-0')"),
        "rank 0 of the first attempt: {}",
        out.stderr
    );
    assert_eq!(
        stores
            .iter()
            .filter(|s| s.ends_with("/restart-1')"))
            .count(),
        2,
        "{}",
        out.stderr
    );
}

#[test]
fn mpirun_runs_the_example_with_no_variables_of_ccls_own() {
    if !have_mpirun() {
        return;
    }
    // A temp dir of the test's own, to see that the job's directory goes;
    // removed when the test ends, passed or failed.
    struct TempDir(std::path::PathBuf);
    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let tmp =
        TempDir(std::env::temp_dir().join(format!("ccl-launchers-test-{}", std::process::id())));
    let tmp = &tmp.0;
    std::fs::create_dir_all(tmp).unwrap();
    for n in [2, 3, 4] {
        let mut cmd = Command::new("mpirun");
        cmd.args(["-n", &n.to_string(), "--oversubscribe"]);
        if is_root() {
            cmd.arg("--allow-run-as-root");
        }
        cmd.args(["--bind-to", "none", EXAMPLE])
            .env("TMPDIR", tmp)
            .env("CCL_DEBUG", "info")
            .env("CCL_TIMEOUT", "60s");
        for k in INHERITED {
            cmd.env_remove(k);
        }
        let out = run_bounded(cmd, DEADLINE);
        assert_ok(&out, &format!("mpirun -n {n}"));
        assert_data_parallel_output(&out.stdout, n);
        let stores = stores(&out);
        assert_eq!(stores.len(), n, "{}", out.stderr);
        let dir = stores[0];
        assert!(
            dir.starts_with(&format!("file://{}/ccl-openmpi-", tmp.display())),
            "{dir}"
        );
        assert!(stores.iter().all(|s| *s == dir), "{stores:?}");
        let left: Vec<_> = std::fs::read_dir(tmp)
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|f| f.starts_with("ccl-"))
            .collect();
        assert!(
            left.is_empty(),
            "mpirun -n {n} left {left:?} in {}",
            tmp.display()
        );
    }
}
