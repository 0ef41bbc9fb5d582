//! The README's example: `ccl-run -n 4` runs the data-parallel training step,
//! and every rank prints the same decreasing loss.

use std::process::Command;

use ccl_tests::ccl_run;

#[test]
fn ccl_run_runs_the_data_parallel_example() {
    let out = Command::new(ccl_run(env!("CARGO_BIN_EXE_data-parallel-example")))
        .args(["-n", "4", "--", env!("CARGO_BIN_EXE_data-parallel-example")])
        .env("CCL_TIMEOUT", "60s")
        .output()
        .expect("run ccl-run");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "ccl-run failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Lines look like "[rank 2] rank 2/4 step  10 loss 0.001234".
    let mut losses: Vec<Vec<(usize, f64)>> = vec![Vec::new(); 4];
    for line in stdout.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        if let [_, _, "rank", who, "step", step, "loss", loss] = words[..] {
            let rank: usize = who.split('/').next().unwrap().parse().unwrap();
            losses[rank].push((step.parse().unwrap(), loss.parse().unwrap()));
        }
    }
    assert!(losses[0].len() >= 5, "too few loss lines: {stdout}");
    for r in 1..4 {
        assert_eq!(
            losses[r], losses[0],
            "rank {r} saw other losses than rank 0"
        );
    }
    let first = losses[0].first().unwrap().1;
    let last = losses[0].last().unwrap().1;
    assert!(
        last < first / 100.0,
        "loss did not decrease: {first} -> {last}"
    );
}
