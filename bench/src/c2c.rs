//! How fast two CPUs hand each other a cache line: the round trip of a
//! counter passed back and forth between two threads, one pinned to each.
//! CPUs that share a cache do it in tens of nanoseconds; across sockets or
//! core complexes it takes hundreds. A VM whose vCPUs the host moves shows
//! both within minutes, and shared-memory results follow (the board's posts
//! are read out of the other CPU's cache; README, "Two speeds of one VM"),
//! so `ccl-bench` and `compare` print the round trip next to their times.

use std::{
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use serde::{Deserialize, Serialize};

use crate::membw::pin_current_thread;

/// Round trips timed, after as many untimed ones.
const ROUND_TRIPS: u64 = 20_000;
/// A wait of the probe gives up after this long (a CPU taken by something else).
const LIMIT: Duration = Duration::from_millis(200);

/// A word alone on its cache line.
#[repr(align(128))]
#[derive(Default)]
struct Line(AtomicU64);

#[derive(Default)]
struct Lines {
    ping: Line,
    pong: Line,
    /// Set by either side when it gives up; the other then stops too.
    stop: Line,
}

/// The two CPUs a run's round trip is measured between: those of ranks 0
/// and 1 (the first two of the CPUs the ranks are placed on in turn), or
/// `None` with fewer than two.
pub fn pair(cpus: &[usize]) -> Option<(usize, usize)> {
    match cpus {
        [a, b, ..] => Some((*a, *b)),
        _ => None,
    }
}

/// The mean round trip between CPUs `a` and `b` in nanoseconds, or `None`
/// if a thread cannot be pinned there or the probe ran out of time.
pub fn round_trip_ns(a: usize, b: usize) -> Option<f64> {
    let lines = Arc::new(Lines::default());
    let echo = {
        let lines = lines.clone();
        std::thread::spawn(move || {
            if !pin(b) {
                lines.stop.0.store(1, Ordering::Release);
                return;
            }
            for i in 1..=2 * ROUND_TRIPS {
                if !wait_for(&lines.ping.0, i, &lines.stop.0) {
                    return;
                }
                lines.pong.0.store(i, Ordering::Release);
            }
        })
    };
    let lead = {
        let lines = lines.clone();
        std::thread::spawn(move || -> Option<f64> {
            if !pin(a) {
                lines.stop.0.store(1, Ordering::Release);
                return None;
            }
            let mut t0 = Instant::now();
            for i in 1..=2 * ROUND_TRIPS {
                if i == ROUND_TRIPS + 1 {
                    t0 = Instant::now();
                }
                lines.ping.0.store(i, Ordering::Release);
                if !wait_for(&lines.pong.0, i, &lines.stop.0) {
                    return None;
                }
            }
            Some(t0.elapsed().as_nanos() as f64 / ROUND_TRIPS as f64)
        })
    };
    let ns = lead.join().ok().flatten();
    let _ = echo.join();
    ns
}

/// Pins this thread to `cpu`; false if that did not take.
fn pin(cpu: usize) -> bool {
    pin_current_thread(cpu);
    nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0))
        .is_ok_and(|set| set.is_set(cpu).unwrap_or(false) && set_count(&set) == 1)
}

fn set_count(set: &nix::sched::CpuSet) -> usize {
    (0..nix::sched::CpuSet::count())
        .filter(|&c| set.is_set(c).unwrap_or(false))
        .count()
}

/// Spins until `word` reaches `value`; false once `stop` is set or the
/// wait outlasts [`LIMIT`] (and then sets `stop` for the other side). The
/// clock is read only once a wait has spun a while, so that a round trip
/// does not time clock reads.
fn wait_for(word: &AtomicU64, value: u64, stop: &AtomicU64) -> bool {
    let mut started: Option<Instant> = None;
    let mut spins = 0u32;
    while word.load(Ordering::Acquire) != value {
        std::hint::spin_loop();
        spins = spins.wrapping_add(1);
        if spins % 4096 == 0 {
            if stop.load(Ordering::Acquire) != 0 {
                return false;
            }
            if started.get_or_insert_with(Instant::now).elapsed() > LIMIT {
                stop.store(1, Ordering::Release);
                return false;
            }
        }
    }
    true
}

/// One probe, as the reports carry it.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Probe {
    /// The two CPUs (those of ranks 0 and 1).
    pub cpus: (usize, usize),
    /// Mean round trip in ns; `None` where the probe could not run.
    pub round_trip_ns: Option<f64>,
}

impl Probe {
    /// Measures the round trip between `cpus` now.
    pub fn measure(cpus: (usize, usize)) -> Probe {
        Probe {
            cpus,
            round_trip_ns: round_trip_ns(cpus.0, cpus.1),
        }
    }

    /// The form passed to the ranks in [`crate::spawn::CORE_TO_CORE_VAR`]: "0 1 104.3", "0 1 -".
    pub fn to_env(self) -> String {
        let ns = self
            .round_trip_ns
            .map_or("-".into(), |ns| format!("{ns:.1}"));
        format!("{} {} {ns}", self.cpus.0, self.cpus.1)
    }

    /// Reads [`Probe::to_env`]'s form back.
    pub fn from_env(s: &str) -> Option<Probe> {
        let mut w = s.split_whitespace();
        let a = w.next()?.parse().ok()?;
        let b = w.next()?.parse().ok()?;
        let ns = match w.next()? {
            "-" => None,
            v => Some(v.parse().ok()?),
        };
        w.next().is_none().then_some(Probe {
            cpus: (a, b),
            round_trip_ns: ns,
        })
    }

    /// "CPUs 0 and 1: 104 ns", or why there is no figure.
    pub fn describe(self) -> String {
        let (a, b) = self.cpus;
        match self.round_trip_ns {
            Some(ns) => format!("CPUs {a} and {b}: {ns:.0} ns"),
            None => format!("CPUs {a} and {b}: not measured (a probe thread could not run there)"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pair_takes_the_first_two_cpus() {
        assert_eq!(pair(&[3, 5, 3, 5]), Some((3, 5)));
        assert_eq!(pair(&[0]), None);
        assert_eq!(pair(&[]), None);
    }

    #[test]
    fn a_round_trip_between_two_cpus_takes_some_nanoseconds() {
        let cpus = ccl_run::allowed_cpus().expect("the CPUs this test may use");
        let (a, b) = pair(&cpus).expect("this test needs two CPUs");
        let ns = round_trip_ns(a, b).expect("a round trip between two allowed CPUs");
        // A cache line between two cores: from tens of ns (shared cache) to
        // a few µs (a VM whose vCPU was descheduled now and then).
        assert!(ns > 5.0 && ns < 100_000.0, "{ns} ns");
    }

    #[test]
    fn a_probe_passes_through_the_environment_unchanged() {
        for p in [
            Probe {
                cpus: (0, 1),
                round_trip_ns: Some(104.3),
            },
            Probe {
                cpus: (2, 7),
                round_trip_ns: None,
            },
        ] {
            assert_eq!(Probe::from_env(&p.to_env()), Some(p));
        }
        assert_eq!(Probe::from_env("0 1"), None);
        assert_eq!(Probe::from_env("0 1 x"), None);
        assert_eq!(Probe::from_env("0 1 5 6"), None);
    }

    #[test]
    fn a_cpu_out_of_reach_gives_no_figure() {
        let cpus = ccl_run::allowed_cpus().expect("the CPUs this test may use");
        let missing = (0..nix::sched::CpuSet::count())
            .find(|c| !cpus.contains(c))
            .expect("a CPU this process may not use");
        assert_eq!(round_trip_ns(cpus[0], missing), None);
        assert_eq!(round_trip_ns(missing, cpus[0]), None);
    }
}
