//! How a thread that waits for a peer behaves before it sleeps in the kernel.

use std::time::Duration;

/// How a thread waiting for a peer behaves before it sleeps in the kernel.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Spin {
    /// How long to keep polling (zero: sleep at once).
    pub window: Duration,
    /// Yield the core between polls, for when the ranks outnumber the cores.
    pub yield_between: bool,
    /// Poll again at once, without the runtime, while spinning: for when
    /// every link lives in memory and needs no socket readiness.
    pub repoll: bool,
}

impl Spin {
    /// Polling window when every rank of a host has a CPU of its own. A
    /// rank that sleeps gives its CPU up, and on a virtual machine the
    /// hypervisor may not run it again for milliseconds after the peer's
    /// wake-up; polling this long catches a peer delayed by an interrupt or
    /// by the hypervisor before that happens.
    pub const OWN_CPU_WINDOW: Duration = Duration::from_millis(1);
    /// Polling window when a host's ranks outnumber its CPUs: the others
    /// need the CPU.
    pub const SHARED_CPU_WINDOW: Duration = Duration::from_micros(50);

    /// How a waiting thread of one of `ranks` ranks of a host polls when the
    /// host's ranks may run on `cpus` CPUs between them: it yields between
    /// polls, and stops sooner, when they outnumber the CPUs. `window`, when
    /// given, replaces the default window.
    pub fn for_host(ranks: usize, cpus: usize, window: Option<Duration>) -> Spin {
        let shared = ranks > cpus;
        Spin {
            window: window.unwrap_or(if shared {
                Spin::SHARED_CPU_WINDOW
            } else {
                Spin::OWN_CPU_WINDOW
            }),
            yield_between: shared,
            repoll: false,
        }
    }
}

/// The CPUs this process may run on (its affinity mask), in increasing order.
pub fn allowed_cpus() -> std::io::Result<Vec<usize>> {
    use nix::sched::{sched_getaffinity, CpuSet};
    let set = sched_getaffinity(nix::unistd::Pid::from_raw(0))?;
    Ok((0..CpuSet::count())
        .filter(|&c| set.is_set(c).unwrap_or(false))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_that_outnumber_their_cpus_yield_and_poll_briefly() {
        let own = Spin::for_host(2, 2, None);
        assert_eq!(
            (own.window, own.yield_between),
            (Spin::OWN_CPU_WINDOW, false)
        );
        let shared = Spin::for_host(4, 2, None);
        assert_eq!(
            (shared.window, shared.yield_between),
            (Spin::SHARED_CPU_WINDOW, true)
        );
        let set = Spin::for_host(4, 2, Some(Duration::from_micros(7)));
        assert_eq!(
            (set.window, set.yield_between),
            (Duration::from_micros(7), true)
        );
        assert!(!allowed_cpus().expect("sched_getaffinity").is_empty());
    }
}
