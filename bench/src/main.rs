//! ccl-bench: nccl-tests-style benchmarks of ccl's collectives.
//!
//! `ccl-bench allreduce --size 256MB` starts local ranks (or joins a launcher's
//! job), times the collective, and prints a table of time, algorithm and bus
//! bandwidth per size; `ccl-bench compare allreduce ...` runs OpenMPI, MPICH,
//! oneCCL and Gloo interleaved with ccl on the same sizes, ranks and links
//! (`compare-mpi`: OpenMPI alone, shared memory and TCP). See bench/README.md.

mod args;
mod bucketer;
mod c2c;
mod coll;
mod compare;
mod data;
mod device;
mod membw;
mod mpi;
mod peers;
mod plot;
mod report;
mod size;
mod spawn;
mod tcpbw;
mod tune;
mod worker;

use std::{ffi::OsString, time::SystemTime};

use ccl::{Config, Launcher};
use clap::{
    error::{ContextKind, ContextValue, ErrorKind},
    Parser,
};

use crate::{
    args::{BenchArgs, Cli},
    coll::Coll,
};

/// Exit status for bad arguments.
const EXIT_USAGE: i32 = 2;

fn main() {
    let started = SystemTime::now();
    // Like other command-line tools, end quietly when the reader of stdout
    // goes away (`ccl-bench ... | head`) instead of panicking on EPIPE.
    // SAFETY: no other thread exists yet; SIG_DFL is a valid disposition.
    unsafe {
        let _ = nix::sys::signal::signal(
            nix::sys::signal::Signal::SIGPIPE,
            nix::sys::signal::SigHandler::SigDfl,
        );
    }
    let code = run(started);
    std::process::exit(code);
}

/// True in a launched rank other than 0 (which stays quiet about usage errors
/// that every rank finds).
fn quiet_rank() -> bool {
    Config::from_env().is_ok_and(|c| c.launcher != Launcher::None && c.rank != 0)
}

fn usage(msg: &str) -> i32 {
    if !quiet_rank() {
        eprintln!("ccl-bench: {msg}");
    }
    EXIT_USAGE
}

/// A clap error as one line.
fn one_line(e: &clap::Error) -> String {
    let text = e.to_string();
    let first = text.lines().next().unwrap_or("bad arguments").trim();
    let mut line = first.strip_prefix("error: ").unwrap_or(first).to_string();
    match e.kind() {
        ErrorKind::InvalidSubcommand => {
            let names: Vec<&str> = Coll::ALL.iter().map(|c| c.name()).collect();
            line += &format!(
                " (expected a collective: {}, compare, compare-mpi, bucketer or tune)",
                names.join(", ")
            );
        }
        ErrorKind::InvalidValue => {
            if let Some(ContextValue::Strings(v)) = e.get(ContextKind::ValidValue) {
                line += &format!(" (expected one of: {})", v.join(", "));
            }
        }
        _ => {}
    }
    line + " (see ccl-bench --help)"
}

fn run(started: SystemTime) -> i32 {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            return match e.kind() {
                ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => {
                    let _ = e.print();
                    0
                }
                ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
                    let _ = e.print();
                    EXIT_USAGE
                }
                _ => usage(&one_line(&e)),
            }
        }
    };
    match cli.cmd.bench() {
        Ok((coll, args)) => bench(coll, &args, started),
        Err(args::Other::Compare(a)) => compare::main(*a),
        Err(args::Other::CompareMpi(compare)) => mpi::compare(*compare),
        Err(args::Other::Bucketer(args)) => bucketer::main(args, started),
        Err(args::Other::Tune(args)) => tune::tune(*args),
    }
}

fn bench(coll: Coll, args: &BenchArgs, started: SystemTime) -> i32 {
    let plan = match args::plan(coll, args) {
        Ok(p) => p,
        Err(m) => return usage(&m),
    };
    let config = match Config::from_env() {
        Ok(c) => c,
        Err(e) => return usage(&e.to_string()),
    };
    if config.launcher != Launcher::None {
        // One rank of a launched job.
        let n = config.world_size;
        if let Some(r) = plan.ranks.filter(|&r| r != n) {
            return usage(&format!(
                "--ranks {r} does not match the launcher's world size {n}"
            ));
        }
        if let Err(m) = plan.check_world(n) {
            return usage(&m);
        }
        return worker::run(&plan, &config, started);
    }
    // Local mode: start the ranks.
    let n = plan.ranks.unwrap_or_else(args::default_ranks);
    if let Err(m) = plan.check_world(n) {
        return usage(&m);
    }
    // The ranks' configuration must hold before any is started.
    let env = spawn::rank_env(0, n, 1, started);
    let process_env = std::env::vars_os()
        .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)));
    // The ranks' own variables win over this process's.
    let ranks_config = Config::from_vars(process_env.chain(env))
        .and_then(|c| ccl::Options::from_config(&c).map(|_| c));
    if let Err(e) = ranks_config {
        return usage(&e.to_string());
    }
    let args: Vec<OsString> = std::env::args_os().skip(1).collect();
    spawn::run_local(n, &args, plan.bind, started)
}
