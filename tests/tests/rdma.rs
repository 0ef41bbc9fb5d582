//! The RDMA transport across real processes. No machine of this project has
//! an RDMA device, so these run over the simulated fabric
//! (`ccl_transport_rdma::sim`, chosen by `CCL_RDMA_SIM`), a test double that
//! moves bytes between the processes' registered memory the way a NIC
//! would and injects the faults hardware has. The one test that needs a
//! real device says so and returns where there is none.

use std::{path::PathBuf, time::Duration};

use ccl_tests::{assert_all_ok, launch, launch_each, no_panic, RankOutput};

const WORKER: &str = env!("CARGO_BIN_EXE_ccl-test-worker");

/// A directory for one job's simulated fabric, removed on drop.
struct Fabric(PathBuf);

impl Fabric {
    fn new(name: &str) -> Fabric {
        let dir = std::env::temp_dir().join(format!("ccl-rdma-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("fabric directory");
        Fabric(dir)
    }

    /// The variables that put a job on this fabric, with `extra`.
    fn env(&self, extra: &[(&'static str, &str)]) -> Vec<(&'static str, String)> {
        let mut e = vec![
            ("CCL_TIMEOUT", "60s".to_string()),
            ("CCL_TRANSPORT", "rdma".to_string()),
            ("CCL_RDMA_SIM", self.0.display().to_string()),
        ];
        e.extend(extra.iter().map(|&(k, v)| (k, v.to_string())));
        e
    }
}

impl Drop for Fabric {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `(eager, zero-copy sent, zero-copy received)` bytes a rank reported.
fn counters(o: &RankOutput) -> (u64, u64, u64) {
    let n = all_counters(o);
    (n[0], n[1], n[2])
}

/// Every byte count of a rank's `rdma:` line (the three of [`counters`],
/// then the zero-copy bytes of GPU memory).
fn all_counters(o: &RankOutput) -> Vec<u64> {
    let line = o
        .stdout
        .lines()
        .find(|l| l.starts_with("rdma: "))
        .unwrap_or_else(|| panic!("rank {} printed no counters: {}", o.rank, o.text()));
    line.split(' ').filter_map(|w| w.parse().ok()).collect()
}

#[test]
fn every_collective_runs_over_the_simulated_fabric() {
    let fabric = Fabric::new("all");
    for n in [2, 3, 5] {
        let out = launch(
            WORKER,
            &["collectives"],
            n,
            &fabric.env(&[]),
            Duration::from_secs(240),
        );
        assert_all_ok(&out, &format!("collectives over rdma with {n} ranks"));
        for o in &out {
            assert!(o.stdout.contains(" 0 failures"), "{}", o.stdout);
            let (eager, _, _) = counters(o);
            assert!(eager > 0, "rank {} sent nothing over rdma", o.rank);
        }
    }
}

/// Point-to-point messages of up to 8 MB: every byte above the eager limit
/// moves without a copy on either side (the counters of the protocol core).
#[test]
fn large_messages_move_with_zero_copies_on_both_sides() {
    let fabric = Fabric::new("zero-copy");
    let out = launch(
        WORKER,
        &["p2p"],
        3,
        &fabric.env(&[]),
        Duration::from_secs(120),
    );
    assert_all_ok(&out, "p2p over rdma");
    for o in &out {
        let (_, sent, received) = counters(o);
        // Each rank sends and receives the 2,000,003-element (u32) message twice.
        let large = 2 * 2_000_003 * 4;
        assert_eq!((sent, received), (large, large), "rank {}", o.rank);
    }
}

/// GPUDirect RDMA: device sends and receives (ccl's CUDA stand-in, host
/// memory posing as a GPU's) go through the NIC from and into the callers'
/// GPU memory, one message each, without pinned host staging; with
/// `CCL_RDMA_GPUDIRECT=0` they are staged as over any link. Every device
/// collective, staged, passes either way.
#[test]
fn device_transfers_move_gpu_memory_through_the_nic() {
    let fabric = Fabric::new("gpudirect");
    // What a middle rank of the worker's device ring exchanges: counts 0, 1,
    // 1031 and 300007 of u32, i8 and f64, sent and received.
    let ring: u64 = (1 + 1031 + 300_007) * (4 + 1 + 8);
    for gpudirect in ["1", "0"] {
        let env = fabric.env(&[
            ("CCL_RDMA_GPUDIRECT", gpudirect),
            ("CCL_CUDA_STAND_IN", "1"),
            ("CCL_CUDA_IPC", "0"),
            ("CCL_CUDA_CHUNK", "65536"),
        ]);
        let out = launch(WORKER, &["device"], 3, &env, Duration::from_secs(240));
        let what = format!("device calls over rdma, CCL_RDMA_GPUDIRECT={gpudirect}");
        assert_all_ok(&out, &what);
        for o in &out {
            assert!(o.stdout.contains(" 0 failures"), "{what}: {}", o.stdout);
            let device = all_counters(o)[3];
            let expect = match (gpudirect, o.rank) {
                ("0", _) => 0,
                (_, 1) => 2 * ring,
                // Rank 0 also sends to rank 2, which receives it.
                _ => 3 * ring,
            };
            assert_eq!(device, expect, "{what}: rank {}", o.rank);
        }
    }
}

/// Ranks that send and exit at once, without dropping their communicators
/// (their exit hook says bye): what they sent still arrives, the credits
/// the receiver returns afterwards fail without failing anything, and a
/// receive that still needs a rank that left fails at once, saying so.
#[test]
fn ranks_that_exit_right_after_sending_leave_cleanly() {
    let fabric = Fabric::new("leave");
    let out = launch(
        WORKER,
        &["leave"],
        3,
        &fabric.env(&[]),
        Duration::from_secs(60),
    );
    assert_all_ok(&out, "ranks leaving early over rdma");
    assert!(out[2].stdout.contains(" 0 failures"), "{}", out[2].text());
}

/// Completions reordered and delayed, and a ring of two slots, so that
/// senders run out of credits all the time: the results are still right.
/// A rank that waits long for its peer sleeps on the completion channel
/// and is woken by the peer's first message, instead of napping between
/// polls all along: the worker's `slow` scenario holds rank 1 back 1.5 s
/// before each of two allreduces.
#[test]
fn a_long_wait_sleeps_on_the_completion_channel() {
    let fabric = Fabric::new("sleep");
    let out = launch(
        WORKER,
        &["slow"],
        2,
        &fabric.env(&[]),
        Duration::from_secs(60),
    );
    assert_all_ok(&out, "slow allreduces over rdma");
    // eager, zero-copy sent and received, GPU bytes, then the waits.
    let n = all_counters(&out[0]);
    let (slept, woken, napped) = (n[4], n[5], n[6]);
    eprintln!("rank 0 slept {slept} times, woken {woken}, napped {napped}");
    assert!(
        woken >= 2,
        "a message woke rank 0 {woken} times, not at each call"
    );
    assert!(slept >= woken, "{slept} sleeps, {woken} wake-ups");
    // Naps of at most 1 ms through 3 s of waiting would be about 3,000.
    assert!(
        napped < 1000,
        "rank 0 napped {napped} times while it waited"
    );
}

#[test]
fn reordered_delayed_completions_and_scarce_credits_still_give_right_results() {
    let fabric = Fabric::new("faults");
    let out = launch(
        WORKER,
        &["collectives"],
        4,
        &fabric.env(&[
            ("CCL_RDMA_SIM_FAULTS", "reorder,delay=3"),
            ("CCL_RDMA_SLOTS", "2"),
            ("CCL_RDMA_SLOT_BYTES", "4096"),
        ]),
        Duration::from_secs(240),
    );
    assert_all_ok(&out, "collectives over a faulty fabric");
}

/// A remote access error on rank 1's NIC fails rank 1 with a protocol
/// error naming its peer, and every other rank fails too, in bounded time.
#[test]
fn a_remote_access_error_fails_every_rank_with_the_peer_named() {
    let fabric = Fabric::new("access");
    let out = launch_each(
        WORKER,
        &["collectives"],
        3,
        |rank| {
            let faults = if rank == 1 {
                "access-error-after=60"
            } else {
                ""
            };
            fabric.env(&[("CCL_RDMA_SIM_FAULTS", faults)])
        },
        Duration::from_secs(120),
    );
    no_panic(&out);
    for o in &out {
        assert_eq!(
            o.code,
            Some(1),
            "rank {} should fail cleanly: {}",
            o.rank,
            o.text()
        );
    }
    let culprit = out[1].text();
    assert!(
        culprit.contains("remote access error") && culprit.contains("protocol error from rank"),
        "rank 1 does not report the access error; every rank:\n{}",
        out.iter().map(|o| o.text()).collect::<Vec<_>>().join("\n")
    );
}

/// A rank that dies in the middle of a large allreduce is named by every
/// survivor, within seconds (the keepalive's retry-exceeded, or the abort
/// notices of those who saw it first): whether it crashes, or calls `exit`,
/// whose hook closes its links while its call still runs (that call's
/// failure must then blame the victim, not the peer it closed on).
#[test]
fn a_lost_peer_is_named_by_every_survivor() {
    let victim = 1;
    for how in ["crash", "exit"] {
        let fabric = Fabric::new(&format!("die-{how}"));
        let out = launch(
            WORKER,
            &["die", &victim.to_string(), "large", how],
            3,
            &fabric.env(&[]),
            Duration::from_secs(90),
        );
        survivors_name(&out, victim, how);
    }
}

/// Asserts that the victim ended with its code and that every survivor
/// failed naming it, in time.
fn survivors_name(out: &[RankOutput], victim: usize, how: &str) {
    for o in out {
        if o.rank == victim {
            assert_eq!(o.code, Some(7));
            continue;
        }
        assert_eq!(o.code, Some(0), "survivor {}: {}", o.rank, o.text());
        assert!(
            o.stdout.contains(&format!("lost rank {victim}")),
            "victim's end {how}: survivor {} does not name rank {victim}: {}\nevery rank:\n{}",
            o.rank,
            o.text(),
            out.iter().map(|o| o.text()).collect::<Vec<_>>().join("\n")
        );
        assert!(o.elapsed < Duration::from_secs(30), "{:?}", o.elapsed);
    }
}

/// `CCL_TRANSPORT=rdma` on a machine without a device fails at once with
/// "no RDMA device" and what was checked.
#[test]
fn forcing_rdma_without_a_device_says_what_was_checked() {
    if ccl_transport_rdma::probe(
        std::path::Path::new(ccl_transport_rdma::SYSFS_DEVICES),
        None,
    )
    .is_ok()
    {
        eprintln!("this machine has an RDMA device: nothing to refuse");
        return;
    }
    let out = launch(
        WORKER,
        &["collectives"],
        2,
        &[
            ("CCL_TRANSPORT", "rdma".into()),
            ("CCL_TIMEOUT", "20s".into()),
        ],
        Duration::from_secs(60),
    );
    // Rank 0 serves the store and fails at once; a rank that had not read
    // the store yet may find it gone instead.
    for o in &out {
        assert_eq!(o.code, Some(3), "{}", o.text());
        let named = o
            .stderr
            .contains("no RDMA device (checked /sys/class/infiniband");
        assert!(
            named || (o.rank > 0 && o.stderr.contains("store tcp://")),
            "{}",
            o.stderr
        );
    }
}

/// On a real device (`ibv_devices` lists one), every collective over it.
/// Here there is none, and the test says so: the one skip of this suite.
#[test]
fn every_collective_runs_over_a_real_rdma_device() {
    let sysfs = std::path::Path::new(ccl_transport_rdma::SYSFS_DEVICES);
    if let Err(checked) = ccl_transport_rdma::probe(sysfs, None) {
        eprintln!("SKIPPED every_collective_runs_over_a_real_rdma_device: {checked}");
        return;
    }
    let out = launch(
        WORKER,
        &["collectives"],
        2,
        &[
            ("CCL_TRANSPORT", "rdma".into()),
            ("CCL_TIMEOUT", "60s".into()),
        ],
        Duration::from_secs(240),
    );
    assert_all_ok(&out, "collectives over a real RDMA device");
}

/// The modelled line rate of a 64 MiB ring allreduce over 4 ranks on the
/// simulated fabric's model (100 Gbit/s, 2 µs, see `sim`), timed by the
/// model's clock, not the wall clock, in bus bandwidth (2(n−1)/n · bytes /
/// time, as nccl-tests count it), held to issue 23's target of 90% and
/// never above the line. The processes' clocks are kept consistent (see
/// `sim`), so the figure is the protocol's alone, whatever the schedule of
/// the processes on the machine: 95.4% in every run so far. What costs the
/// rest is the rendezvous per 1 MiB piece (docs/DESIGN.md).
#[test]
fn a_64_mib_ring_allreduce_keeps_90_percent_of_the_modelled_line() {
    let fabric = Fabric::new("model");
    let (n, count) = (4usize, 16usize << 20);
    let out = launch(
        WORKER,
        &["modelled-allreduce", &count.to_string()],
        n,
        &fabric.env(&[("CCL_ALGO", "allreduce=ring")]),
        Duration::from_secs(300),
    );
    assert_all_ok(&out, "modelled allreduce");
    let ends: Vec<(u64, u64)> = out
        .iter()
        .map(|o| {
            let l = o
                .stdout
                .lines()
                .find(|l| l.starts_with("modelled "))
                .unwrap();
            let v: Vec<u64> = l.split(' ').skip(1).map(|x| x.parse().unwrap()).collect();
            (v[0], v[1])
        })
        .collect();
    let start = ends.iter().map(|e| e.0).min().unwrap();
    let end = ends.iter().map(|e| e.1).max().unwrap();
    let bytes = (count * 4) as f64;
    let bus = 2.0 * (n - 1) as f64 / n as f64 * bytes / (end - start) as f64;
    let share = bus / ccl_transport_rdma::sim::LINE_BYTES_PER_NS;
    println!(
        "modelled 64 MiB ring allreduce, 4 ranks: {:.1} µs, bus bandwidth {:.2} GB/s = {:.1}% of 12.5 GB/s",
        (end - start) as f64 / 1e3,
        bus,
        share * 100.0
    );
    assert!(
        (0.9..=1.0).contains(&share),
        "{:.1}% of the modelled line rate (target: at least 90%, at most the line)",
        share * 100.0
    );
}
