//! Fault injection with real processes: ranks killed with SIGKILL at seeded
//! points, a slow rank, mismatched calls, broken launches, and a store lost
//! before, during and after the rendezvous. Every case bounds the time from
//! the fault to the error on every surviving rank, checks that no process
//! hangs or panics, and that nothing is left in `/dev/shm`; a store that
//! outlives a failed job serves the next jobs.

use std::{
    io::{BufRead, BufReader},
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use ccl_tests::{assert_all_ok, launch, launch_each, leftovers, no_panic, RankOutput};

const WORKER: &str = env!("CARGO_BIN_EXE_ccl-test-worker");

fn env(timeout: &str) -> Vec<(&'static str, String)> {
    vec![("CCL_TIMEOUT", timeout.to_string())]
}

#[test]
fn a_rank_killed_at_a_seeded_point_is_named_by_every_survivor() {
    let mut worst = Duration::ZERO;
    for seed in 0..20u64 {
        let n = 2 + (seed as usize % 7);
        let out = launch(
            WORKER,
            &["killed", &seed.to_string()],
            n,
            &env("30s"),
            Duration::from_secs(90),
        );
        let what = out[0].stdout.lines().next().unwrap_or("").to_string();
        let killed: Vec<&RankOutput> = out.iter().filter(|o| o.code.is_none()).collect();
        assert_eq!(killed.len(), 1, "seed {seed} ({what}): {out:#?}");
        let victim = killed[0];
        no_panic(&out);
        assert!(
            leftovers(&out).is_empty(),
            "seed {seed}: {:?}",
            leftovers(&out)
        );
        for o in out.iter().filter(|o| o.rank != victim.rank) {
            assert_eq!(
                o.code,
                Some(0),
                "seed {seed} ({what}) survivor {}:\n{}",
                o.rank,
                o.text()
            );
            assert!(
                o.stdout.contains(&format!("rank {}", victim.rank)),
                "seed {seed} ({what}): survivor {} does not name rank {}:\n{}",
                o.rank,
                victim.rank,
                o.text()
            );
            let after = o.elapsed.saturating_sub(victim.elapsed);
            assert!(
                after < Duration::from_secs(10),
                "seed {seed}: survivor {} took {after:?}",
                o.rank
            );
            worst = worst.max(after);
        }
    }
    eprintln!("longest time from the kill to a survivor's exit: {worst:?}");
}

#[test]
fn a_slow_rank_within_the_deadline_changes_nothing() {
    for n in [2, 4] {
        let out = launch(WORKER, &["slow"], n, &env("30s"), Duration::from_secs(60));
        for o in &out {
            assert_eq!(o.code, Some(0), "rank {}:\n{}", o.rank, o.text());
        }
    }
}

/// Runs the worker's mismatch scenario (`what` differs on rank 0) on `n`
/// ranks: every rank must report the mismatch within the bound, but for a
/// broadcast's root among ranks that made another call ("kind"): it reads
/// nothing of theirs, and fails (in its call, or in the next where it
/// completed) because they gave up on its call.
fn every_rank_names_the_mismatch(what: &str, size: &str, n: usize, env: &[(&str, String)]) {
    let out = launch(
        WORKER,
        &["mismatch", what, size],
        n,
        env,
        Duration::from_secs(40),
    );
    no_panic(&out);
    for o in &out {
        assert_eq!(
            o.code,
            Some(0),
            "{what} {size}, rank {}:\n{}",
            o.rank,
            o.text()
        );
        let root_alone = what == "kind" && o.rank == 0;
        let named = o.stdout.contains("mismatch")
            || root_alone && o.stdout.contains("because of this rank");
        assert!(
            named,
            "{what} {size}, rank {} does not name the mismatch:\n{}",
            o.rank,
            o.text()
        );
        assert!(
            o.elapsed < Duration::from_secs(15),
            "{what} {size}: rank {} took {:?}",
            o.rank,
            o.elapsed
        );
    }
}

#[test]
fn every_kind_of_mismatch_fails_on_every_rank() {
    let cases = [
        ("count", "small"),
        ("dtype", "small"),
        ("op", "small"),
        ("root", "small"),
        ("kind", "small"),
        ("count", "large"),
        ("dtype", "large"),
        ("op", "large"),
        ("kind", "large"),
    ];
    for (what, size) in cases {
        for n in [2, 3] {
            every_rank_names_the_mismatch(what, size, n, &env("20s"));
        }
    }
}

/// Launches 3 ranks whose environment `bad` spoils; every rank must fail
/// (no rank may hang or succeed) within the bound, saying `expect`.
fn broken_launch(what: &str, bad: impl Fn(usize) -> Vec<(&'static str, String)>, expect: &str) {
    let out = launch_each(
        WORKER,
        &["collectives"],
        3,
        |rank| {
            let mut e = env("5s");
            e.extend(bad(rank));
            e
        },
        Duration::from_secs(40),
    );
    no_panic(&out);
    for o in &out {
        assert!(
            o.code.is_some_and(|c| c != 0),
            "{what}: rank {} exited {:?}:\n{}",
            o.rank,
            o.code,
            o.text()
        );
        assert!(
            o.elapsed < Duration::from_secs(25),
            "{what}: rank {} took {:?}",
            o.rank,
            o.elapsed
        );
    }
    assert!(
        out.iter().any(|o| o.text().contains(expect)),
        "{what}: no rank says {expect:?}:\n{out:#?}"
    );
}

#[test]
fn broken_launches_fail_clearly_before_any_collective() {
    broken_launch(
        "rank 2 believes in 4 ranks",
        |r| {
            if r == 2 {
                vec![("WORLD_SIZE", "4".into())]
            } else {
                vec![]
            }
        },
        "world size",
    );
    broken_launch(
        "two processes claim rank 1",
        |r| {
            if r == 2 {
                vec![("RANK", "1".into()), ("LOCAL_RANK", "1".into())]
            } else {
                vec![]
            }
        },
        "rank 1",
    );
    broken_launch(
        "rank 5 of 3",
        |r| {
            if r == 2 {
                vec![("RANK", "5".into())]
            } else {
                vec![]
            }
        },
        "rank 5",
    );
    broken_launch(
        "MASTER_ADDR nobody answers at",
        |_| vec![("MASTER_ADDR", "10.255.255.1".into())],
        "10.255.255.1",
    );
}

#[test]
fn a_taken_store_port_fails_clearly() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("a port");
    let port = taken.local_addr().unwrap().port().to_string();
    broken_launch(
        "the store port is taken",
        move |_| vec![("MASTER_PORT", port.clone())],
        &taken.local_addr().unwrap().port().to_string(),
    );
}

#[test]
fn debug_checks_catch_what_links_alone_cannot() {
    // Over TCP, broadcasts with different roots wait on each other until the
    // deadline; CCL_DEBUG_CHECKS=1 compares the calls first.
    for (what, size) in [("root", "large"), ("root", "small"), ("op", "large")] {
        let mut e = env("20s");
        e.push(("CCL_TRANSPORT", "tcp".into()));
        e.push(("CCL_DEBUG_CHECKS", "1".into()));
        every_rank_names_the_mismatch(what, size, 3, &e);
    }
}

/// Launches 3 ranks through `sh -c script` (`$W` is the worker); every rank
/// but rank 0, which hosts the store, must fail with an error naming the
/// store within the bound.
fn store_lost(what: &str, script: &str) {
    let script = format!("W={WORKER}; {script}");
    let out = launch_each(
        "sh",
        &["-c", &script],
        3,
        |_| env("5s"),
        Duration::from_secs(60),
    );
    no_panic(&out);
    for o in out.iter().filter(|o| o.rank != 0) {
        assert!(
            o.code.is_some_and(|c| c != 0),
            "{what}: rank {} exited {:?}:\n{}",
            o.rank,
            o.code,
            o.text()
        );
        assert!(
            o.text().contains("store") || o.text().contains("rank 0"),
            "{what}: rank {} names neither the store nor rank 0:\n{}",
            o.rank,
            o.text()
        );
        assert!(
            o.elapsed < Duration::from_secs(25),
            "{what}: rank {} took {:?}",
            o.rank,
            o.elapsed
        );
    }
}

#[test]
fn a_lost_store_fails_every_rank_clearly() {
    // Rank 0, which serves the store, never starts.
    store_lost(
        "store never up",
        r#"if [ "$RANK" = 0 ]; then exit 9; fi; exec $W collectives"#,
    );
    // Rank 0 is killed while it waits in the rendezvous for rank 2, which starts late.
    store_lost(
        "store killed during the rendezvous",
        r#"case "$RANK" in 0) exec timeout -s KILL 0.5 $W collectives;; 2) sleep 1.5;; esac; exec $W collectives"#,
    );
}

/// A store that outlives jobs (`ccl-test-worker serve-store`) on a free
/// port, which the ranks reach with `CCL_STORE_EXTERNAL=1`; killed on drop.
struct LongLivedStore {
    child: Child,
    port: String,
}

impl LongLivedStore {
    fn start() -> LongLivedStore {
        let port = ccl::free_port().expect("a free port").to_string();
        let mut child = Command::new(WORKER)
            .arg("serve-store")
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", &port)
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn the store");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .expect("the store's first line");
        assert_eq!(line.trim(), "serving");
        LongLivedStore { child, port }
    }

    /// What ranks need to meet at this store.
    fn env(&self) -> Vec<(&'static str, String)> {
        let mut e = env("30s");
        e.push(("MASTER_PORT", self.port.clone()));
        e.push(("CCL_STORE_EXTERNAL", "1".into()));
        e
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for LongLivedStore {
    fn drop(&mut self) {
        self.kill();
    }
}

#[test]
fn a_store_killed_after_the_rendezvous_stops_nothing_and_deaths_are_still_named() {
    let mut store = LongLivedStore::start();
    let env = store.env();
    let dir = std::env::temp_dir().join(format!("ccl-store-gone-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let killer = {
        let dir = dir.clone();
        thread::spawn(move || {
            let until = Instant::now() + Duration::from_secs(60);
            while !dir.join("ready").exists() && Instant::now() < until {
                thread::sleep(Duration::from_millis(5));
            }
            store.kill();
            std::fs::write(dir.join("killed"), b"").unwrap();
        })
    };
    let out = launch(
        WORKER,
        &["store-gone", dir.to_str().unwrap()],
        3,
        &env,
        Duration::from_secs(90),
    );
    killer.join().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    no_panic(&out);
    assert!(leftovers(&out).is_empty(), "{:?}", leftovers(&out));
    assert_eq!(out[2].code, Some(7), "the last rank:\n{}", out[2].text());
    for o in &out[..2] {
        assert_eq!(o.code, Some(0), "rank {}:\n{}", o.rank, o.text());
        assert!(
            o.stdout.contains("rank 2"),
            "rank {} does not name rank 2:\n{}",
            o.rank,
            o.text()
        );
        let after = o.elapsed.saturating_sub(out[2].elapsed);
        assert!(
            after < Duration::from_secs(10),
            "rank {} took {after:?}",
            o.rank
        );
    }
}

#[test]
fn the_next_jobs_on_a_long_lived_store_meet_nothing_stale() {
    let store = LongLivedStore::start();
    let env = store.env();
    // A job whose rank is SIGKILLed mid-collective...
    let out = launch(WORKER, &["killed", "3"], 3, &env, Duration::from_secs(90));
    no_panic(&out);
    assert_eq!(
        out.iter().filter(|o| o.code.is_none()).count(),
        1,
        "{out:#?}"
    );
    for o in out.iter().filter(|o| o.code.is_some()) {
        assert_eq!(o.code, Some(0), "rank {}:\n{}", o.rank, o.text());
    }
    // ...then new jobs on the same store, of the same and of another size.
    for n in [3, 2] {
        let out = launch(WORKER, &["collectives"], n, &env, Duration::from_secs(240));
        assert_all_ok(&out, &format!("a later job of {n} ranks on the same store"));
    }
}
