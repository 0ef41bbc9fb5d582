//! One rank of the bucketer's multi-process tests: joins from the launcher's
//! variables, runs the bucketer scenario (seed from `argv[1]`, default 1), and
//! exits 0 only if every result matched.

use std::{process::exit, time::Instant};

use ccl::Communicator;

#[path = "../bucketer_scenario.rs"]
mod scenario;

fn main() {
    let seed: u64 = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(1);
    let started = Instant::now();
    let comm = match Communicator::from_env() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("init failed: {e}");
            exit(3);
        }
    };
    match scenario::all(&comm, seed) {
        Ok(checked) => {
            println!(
                "rank {}: bucketer ok, {checked} elements checked, {:?}",
                comm.rank(),
                started.elapsed()
            );
        }
        Err(e) => {
            println!("rank {}: bucketer FAILED: {e}", comm.rank());
            exit(1);
        }
    }
}
