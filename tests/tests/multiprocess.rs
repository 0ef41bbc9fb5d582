//! Real processes, real sockets: every collective across world sizes 1–8,
//! sub-communicators, point-to-point, and a dead rank (more failure cases
//! are in faults.rs).

use std::{
    process::Command,
    time::{Duration, Instant},
};

use ccl_tests::{assert_all_ok, ccl_run, launch, launch_each, launch_on, leftovers, Launched};

const WORKER: &str = env!("CARGO_BIN_EXE_ccl-test-worker");

fn env(timeout: &str) -> Vec<(&'static str, String)> {
    vec![("CCL_TIMEOUT", timeout.to_string())]
}

#[test]
fn every_collective_dtype_and_op_across_world_sizes() {
    for n in [1, 2, 3, 4, 5, 8] {
        let out = launch(
            WORKER,
            &["collectives"],
            n,
            &env("60s"),
            Duration::from_secs(240),
        );
        assert_all_ok(&out, &format!("collectives with {n} ranks"));
        for o in &out {
            assert!(o.stdout.contains(" 0 failures"), "{}", o.stdout);
        }
    }
}

#[test]
fn every_collective_over_tcp() {
    for n in [2, 3, 5] {
        let mut e = env("60s");
        e.push(("CCL_TRANSPORT", "tcp".into()));
        let out = launch(WORKER, &["collectives"], n, &e, Duration::from_secs(240));
        assert_all_ok(&out, &format!("collectives over TCP with {n} ranks"));
    }
}

/// Two "hosts" of two or three ranks: shared memory within, TCP between.
#[test]
fn mixed_shared_memory_and_tcp_pairs() {
    for n in [4, 5] {
        let out = launch_each(
            WORKER,
            &["collectives"],
            n,
            |rank| {
                let mut e = env("60s");
                e.push(("CCL_HOST_ID", format!("host{}", rank / 2)));
                e.push(("CCL_DEBUG", "info".into()));
                e
            },
            Duration::from_secs(240),
        );
        assert_all_ok(&out, &format!("collectives on two hosts, {n} ranks"));
        for o in &out {
            let local = (0..n)
                .filter(|&r| r / 2 == o.rank / 2 && r != o.rank)
                .count();
            let said = if local > 0 {
                o.stderr.contains(&format!("({local} through shm, "))
            } else {
                !o.stderr.contains("through shm")
            };
            assert!(
                said,
                "rank {} should share memory with {local} peers: {}",
                o.rank, o.stderr
            );
        }
    }
}

/// With a `/dev/shm` too small for a segment (a 16 KiB tmpfs in a private
/// mount namespace per rank, same host id), every pair falls back to TCP, says
/// so once, and the collectives still give the right results.
#[test]
fn a_full_dev_shm_falls_back_to_tcp() {
    let script = format!("mount -t tmpfs -o size=16k tmpfs /dev/shm && exec {WORKER} collectives");
    let out = launch_each(
        "unshare",
        &["--mount", "--propagation", "private", "sh", "-c", &script],
        3,
        |_| {
            let mut e = env("60s");
            e.push(("CCL_HOST_ID", "one-host".into()));
            e
        },
        Duration::from_secs(240),
    );
    assert_all_ok(&out, "collectives with a full /dev/shm");
    for o in &out {
        assert_eq!(
            o.stderr
                .matches("shm unavailable, trying the next transport")
                .count(),
            1,
            "rank {} must log the fallback once: {}",
            o.rank,
            o.stderr
        );
    }
}

#[test]
fn collectives_with_every_algorithm_forced() {
    for (n, algo) in [
        (3, "ring"),
        (5, "ring"),
        (6, "rd,alltoall=pairwise-steps"),
        (
            5,
            "allreduce=rabenseifner,reduce-scatter=rh,allgather=rd,broadcast=chain,reduce=chain",
        ),
        (6, "allreduce=dbtree"),
        (5, "allreduce=direct"),
        (3, "ring/4K"),
        (3, "board,allreduce=board-direct,reduce=board-direct"),
        (4, "board,allreduce=board-direct"),
        (5, "board"),
    ] {
        let mut e = env("60s");
        e.push(("CCL_ALGO", algo.into()));
        let out = launch(WORKER, &["collectives"], n, &e, Duration::from_secs(240));
        assert_all_ok(
            &out,
            &format!("collectives with {n} ranks, CCL_ALGO={algo}"),
        );
    }
}

#[test]
fn large_messages_by_reference_and_through_the_ring() {
    // By reference (cross-memory attach), and copied through the ring as
    // where the kernel refuses cross-memory attach (CCL_SHM_CMA=0).
    for cma in ["1", "0"] {
        let mut e = env("60s");
        e.push(("CCL_SHM_CMA", cma.into()));
        let out = launch(WORKER, &["large"], 3, &e, Duration::from_secs(120));
        assert_all_ok(&out, &format!("large messages, CCL_SHM_CMA={cma}"));
    }
}

/// Collectives on `ccl::SharedBuffer`s: every rank maps its peers' buffers
/// and copies their blocks itself (its debug log says so), and every result
/// is right, also with only some ranks' buffers shared and on buffers freed
/// and allocated again. Where the kernel refuses cross-memory attach
/// (`CCL_SHM_CMA=0`, no direct copies at all), the same results, and no
/// mapping. Where the kernel's copies are timed (`auto`), shared buffers
/// are mapped as where they are used, whatever the timing found; so they
/// are where only they are read directly (`mapped`, as where the timing
/// finds the kernel's copies slow), and own buffers go through posts.
#[test]
fn collectives_on_shared_buffers() {
    for (n, cma) in [
        (2, "1"),
        (3, "1"),
        (4, "1"),
        (2, "0"),
        (2, "auto"),
        (4, "auto"),
        (2, "mapped"),
        (3, "mapped"),
    ] {
        let mut e = env("60s");
        e.push(("CCL_TRANSPORT", "shm".into()));
        e.push(("CCL_SHM_CMA", cma.into()));
        e.push((
            "CCL_DEBUG",
            "info,ccl_transport_shm::region=debug,ccl_transport_shm::link=debug,ccl_algorithms::group::board=debug".into(),
        ));
        let what = format!("shared buffers, {n} ranks, CCL_SHM_CMA={cma}");
        let out = launch(WORKER, &["shared"], n, &e, Duration::from_secs(120));
        assert_all_ok(&out, &what);
        for o in &out {
            assert!(
                o.stdout.contains("shared buffers checked"),
                "{what}: {}",
                o.stdout
            );
            let mapped = o.stderr.matches("mapped shared buffer").count();
            let reduced = o.stderr.matches("straight out of shared buffers").count();
            let received = o.stderr.matches("through the mapping of rank").count();
            match cma {
                // At least one peer buffer per pass of the worker; the
                // three reductions of blocks larger than a board chunk in
                // the 7 passes where every buffer is shared; and there, the
                // receive of each block sent by reference.
                "1" | "auto" | "mapped" => {
                    assert!(mapped >= 10, "{what}: rank {} mapped {mapped}", o.rank);
                    assert_eq!(reduced, 21, "{what}: rank {}", o.rank);
                    assert!(received >= 7, "{what}: rank {} received {received}", o.rank);
                }
                _ => assert_eq!(mapped + reduced + received, 0, "{what}: rank {}", o.rank),
            }
        }
    }
}

#[test]
fn collectives_with_several_sockets_per_peer() {
    let mut e = env("60s");
    e.push(("CCL_NSOCKS", "3".into()));
    e.push(("CCL_TRANSPORT", "tcp".into()));
    let out = launch(WORKER, &["p2p"], 3, &e, Duration::from_secs(60));
    assert_all_ok(&out, "p2p with 3 sockets per peer");
}

#[test]
fn point_to_point_ring() {
    for n in [2, 3, 5] {
        assert_all_ok(
            &launch(WORKER, &["p2p"], n, &env("60s"), Duration::from_secs(60)),
            &format!("p2p with {n} ranks"),
        );
    }
}

#[test]
fn split_and_new_group() {
    for n in [1, 2, 3, 5, 8] {
        assert_all_ok(
            &launch(WORKER, &["split"], n, &env("60s"), Duration::from_secs(60)),
            &format!("split with {n} ranks"),
        );
    }
}

#[test]
fn a_dead_rank_is_named_by_every_survivor() {
    for (n, victim, transport, size) in [
        (2, 1, "shm", "large"),
        (4, 2, "auto", "large"),
        (5, 0, "tcp", "large"),
        (3, 0, "shm", "large"),
        (3, 1, "shm", "small"),
        (4, 0, "auto", "small"),
    ] {
        let mut e = env("30s");
        e.push(("CCL_TRANSPORT", transport.into()));
        let out = launch(
            WORKER,
            &["die", &victim.to_string(), size],
            n,
            &e,
            Duration::from_secs(60),
        );
        let left = leftovers(&out);
        assert!(left.is_empty(), "segments left in /dev/shm: {left:?}");
        for o in &out {
            if o.rank == victim {
                assert_eq!(o.code, Some(7));
                continue;
            }
            assert_eq!(
                o.code,
                Some(0),
                "{n} ranks over {transport}, {size} message, rank {victim} dies: survivor {}: {}",
                o.rank,
                o.text()
            );
            // Rank 0 serves the store: when it dies, the store goes with it,
            // and a survivor whose first sign is another survivor closing its
            // link can only point at rank 0 through the lost store.
            let named = o.stdout.contains(&format!("lost rank {victim}"))
                || (victim == 0 && o.stdout.contains("served by rank 0's process, is gone too"));
            assert!(
                named,
                "survivor {} does not name rank {victim}: {}",
                o.rank,
                o.text()
            );
            assert!(
                o.elapsed < Duration::from_secs(25),
                "survivor {} took {:?}",
                o.rank,
                o.elapsed
            );
        }
    }
}

/// Ranks pinned one to a CPU (`ccl-run --bind core`, or mpirun's default)
/// count as having a CPU each and poll before they sleep; one rank more than
/// CPUs makes them share, and they yield between polls. ccl-run itself is
/// held to (at most) two CPUs so that the case is the same on any machine.
#[test]
fn pinned_ranks_are_counted_over_the_cpus_they_may_use() {
    let cpus: Vec<String> = ccl_core::allowed_cpus()
        .expect("sched_getaffinity")
        .iter()
        .take(2)
        .map(usize::to_string)
        .collect();
    let k = cpus.len();
    for (n, expect) in [(k, "a CPU each"), (k + 1, "they share CPUs")] {
        let out = Command::new("taskset")
            .args(["-c", &cpus.join(",")])
            .arg(ccl_run(WORKER))
            .args(["--bind", "core", "-n", &n.to_string(), "--", WORKER, "p2p"])
            .env("CCL_DEBUG", "info")
            .env("CCL_TIMEOUT", "60s")
            .output()
            .expect("run taskset ccl-run");
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        assert!(out.status.success(), "{stdout}\n{stderr}");
        assert_eq!(stdout.matches(" 0 failures").count(), n, "{stdout}");
        let line = format!("{n} ranks on this host, on {k} CPUs between them: {expect}");
        assert_eq!(stderr.matches(&line).count(), n, "{line:?} in {stderr}");
    }
}

/// Where another process took the store port before rank 0 bound it, the
/// harness sees it from rank 0's error and ends the job at once (to start
/// it again on another port), instead of leaving the other ranks talking
/// to the stranger until the deadline.
#[test]
fn a_store_port_taken_before_rank_0_binds_it_ends_the_job_at_once() {
    let port = ccl::free_port().expect("a free port");
    let _stranger = std::net::TcpListener::bind(("0.0.0.0", port)).expect("bind the port");
    let start = Instant::now();
    let got = launch_on(
        port,
        WORKER,
        &["p2p"],
        3,
        &|_| env("60s"),
        Duration::from_secs(60),
    );
    let Launched::PortTaken(out) = got else {
        panic!("rank 0 bound a port another socket listens on: {got:?}");
    };
    assert!(
        out[0].text().contains("Address already in use"),
        "{}",
        out[0].text()
    );
    assert!(out[1..].iter().all(|o| o.code.is_none()), "killed: {out:?}");
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "{:?}",
        start.elapsed()
    );
}
