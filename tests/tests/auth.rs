//! The job secret with real processes and sockets on 127.0.0.1: strangers at
//! the store port and at link ports are refused and logged while the job goes
//! on with correct results; ranks whose secrets disagree fail set-up with a
//! clear error instead of hanging; a job without a secret says once that it
//! is unauthenticated; `ccl-run` hands its ranks a secret. Every wait is
//! bounded.

use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpStream},
    process::Command,
    thread,
    time::{Duration, Instant},
};

use ccl::{JobSecret, Store, TcpStore};
use ccl_core::{CollectiveKind, DataType, Fingerprint, FrameHeader};
use ccl_rendezvous::auth::{self, Answer, Challenge, Response};
use ccl_tests::{assert_all_ok, ccl_run, launch_each, RankOutput};
use rand::{Rng, RngCore};

const WORKER: &str = env!("CARGO_BIN_EXE_ccl-test-worker");
/// Bound on every job of these tests.
const JOB_LIMIT: Duration = Duration::from_secs(120);
/// Bound on every socket read of a stranger.
const READ_LIMIT: Duration = Duration::from_secs(5);

fn fresh_secret() -> String {
    let mut b = [0u8; 16];
    rand::thread_rng().fill_bytes(&mut b);
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Everything the other side sends until it hangs up (or READ_LIMIT).
fn until_closed(mut s: TcpStream) -> Vec<u8> {
    s.set_read_timeout(Some(READ_LIMIT)).unwrap();
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        match s.read(&mut chunk) {
            Ok(0) => return buf,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return buf,
            Err(e) => panic!("the acceptor neither answered nor hung up: {e}"),
        }
    }
}

/// Throws every kind of stranger at `addr`, an acceptor of a job with a
/// secret (store server or link listener), and checks that each is refused
/// after nothing but the challenge (or a refusal), at once. Returns how many came.
fn strangers(addr: SocketAddr) -> usize {
    let connect = || {
        let s = TcpStream::connect_timeout(&addr, READ_LIMIT).unwrap();
        s.set_write_timeout(Some(READ_LIMIT)).unwrap();
        s
    };
    // At least a response's worth, so that the acceptor need not wait for more.
    let mut junk = vec![0u8; rand::thread_rng().gen_range(auth::RESPONSE_LEN..4096)];
    rand::thread_rng().fill_bytes(&mut junk);
    let frame = FrameHeader::data(
        0,
        0,
        0,
        8,
        Fingerprint::new(CollectiveKind::AllReduce, DataType::F32, 2),
    );
    // A TCP hello: version 1, communicator 0, from rank 1 to rank 0, socket 0 of 1.
    let mut hello = Vec::from(*b"CCLH");
    hello.extend_from_slice(&1u32.to_le_bytes());
    hello.extend_from_slice(&0u64.to_le_bytes());
    hello.extend_from_slice(&1u32.to_le_bytes());
    hello.extend_from_slice(&0u32.to_le_bytes());
    hello.extend_from_slice(&0u16.to_le_bytes());
    hello.extend_from_slice(&1u16.to_le_bytes());
    let mut store_greeting = Vec::from(*b"CCLs");
    store_greeting.extend_from_slice(&1u32.to_be_bytes());
    store_greeting.extend_from_slice(&[2, 0, 0, 0, 1, b'k']);
    let raw: Vec<Vec<u8>> = vec![
        junk,
        [&frame.encode()[..], &[0u8; 8]].concat(),
        hello,
        store_greeting,
        Response {
            mac: [0x5a; auth::MAC_LEN],
            nonce: [0xa5; auth::NONCE_LEN],
        }
        .encode()
        .to_vec(),
    ];
    let mut n = 0;
    for bytes in &raw {
        let mut s = connect();
        let _ = s.write_all(bytes);
        let got = until_closed(s);
        assert!(got.len() >= auth::CHALLENGE_LEN, "{addr}: {got:02x?}");
        assert!(
            Challenge::decode(&got[..auth::CHALLENGE_LEN])
                .unwrap()
                .required
        );
        // At most a refusal follows: no store greeting, no acknowledgement.
        let rest = &got[auth::CHALLENGE_LEN..];
        assert!(
            rest.is_empty()
                || (rest.len() == auth::PROOF_LEN && !auth::Proof::decode(rest).unwrap().accepted),
            "{addr} answered a stranger: {rest:02x?}"
        );
        n += 1;
    }
    // The real protocol with a wrong secret, for the store's and for a link's context.
    let wrong = JobSecret::new("a wrong guess").unwrap();
    for context in [auth::STORE_CONTEXT.to_vec(), auth::link_context(0)] {
        let mut s = connect();
        s.set_read_timeout(Some(READ_LIMIT)).unwrap();
        let mut challenge = [0u8; auth::CHALLENGE_LEN];
        s.read_exact(&mut challenge).unwrap();
        let Answer::Respond { response, pending } =
            auth::answer(Some(&wrong), &context, &challenge).unwrap()
        else {
            panic!("{addr} did not ask for the secret")
        };
        s.write_all(&response).unwrap();
        let got = until_closed(s);
        assert_eq!(
            pending.verify(&got),
            Err(auth::AuthError::Refused),
            "{addr}"
        );
        n += 1;
    }
    n
}

fn count(o: &RankOutput, what: &str) -> usize {
    o.stderr.matches(what).count()
}

#[test]
fn strangers_at_the_store_and_link_ports_are_refused_and_the_job_goes_on() {
    let secret = fresh_secret();
    let port = ccl::free_port().unwrap();
    // Rank 2 starts once the test has created `go` (or after a minute):
    // meanwhile ranks 0 and 1 sit in set-up with their link ports open, and
    // the strangers come.
    let go = std::env::temp_dir().join(format!("ccl-strangers-go-{}", std::process::id()));
    let _ = std::fs::remove_file(&go);
    let script = format!(
        r#"if [ "$RANK" = 2 ]; then i=0; while [ ! -e '{}' ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done; fi; exec {WORKER} collectives"#,
        go.display()
    );
    let env = {
        let secret = secret.clone();
        move |_rank: usize| {
            vec![
                ("MASTER_PORT", port.to_string()),
                ("CCL_JOB_SECRET", secret.clone()),
                ("CCL_TRANSPORT", "tcp".to_string()),
                ("CCL_TIMEOUT", "60s".to_string()),
            ]
        }
    };
    let job = thread::spawn(move || launch_each("sh", &["-c", &script], 3, env, JOB_LIMIT));

    // The test knows the secret: it reads the link addresses from the store.
    let js = JobSecret::new(&secret).unwrap();
    let store =
        TcpStore::connect_with_secret("127.0.0.1", port, Duration::from_secs(30), Some(&js))
            .unwrap();
    // Ranks 0 and 1 go on to build their links only once every rank has
    // checked in (the facade's membership check, where it exists): check
    // rank 2 in ahead of time, as it will check in itself, so that their link
    // ports open and wait for it while it sleeps.
    store.set("ccl/member/2/world", b"3").unwrap();
    let link = |rank: usize| -> SocketAddr {
        let v = store
            .get(&format!("ccl/addr/{rank}"), Duration::from_secs(30))
            .unwrap();
        String::from_utf8(v).unwrap().parse().unwrap()
    };
    let (link0, link1) = (link(0), link(1));
    let store_addr: SocketAddr = ([127, 0, 0, 1], port).into();
    // Silent strangers hold connections open all along.
    let silent: Vec<TcpStream> = [store_addr, link0, link1]
        .iter()
        .map(|a| TcpStream::connect_timeout(a, READ_LIMIT).unwrap())
        .collect();
    let at_store = strangers(store_addr);
    let at_links = strangers(link0) + strangers(link1);
    // A stranger client library without the secret gets a clear error.
    let e = TcpStore::connect("127.0.0.1", port, Duration::from_secs(5)).unwrap_err();
    assert!(e.to_string().contains("requires a job secret"), "{e}");
    drop(store);
    std::fs::write(&go, b"").unwrap();

    let out = job.join().unwrap();
    let _ = std::fs::remove_file(&go);
    drop(silent);
    assert_all_ok(&out, "collectives with strangers at the doors");
    for o in &out {
        assert!(o.stdout.contains(" 0 failures"), "{}", o.stdout);
        assert_eq!(count(o, "unauthenticated"), 0, "{}", o.stderr);
        assert!(!o.text().contains("panicked"), "{}", o.text());
    }
    // Each refusal is logged with the stranger's address by the rank that saw it.
    let store_drops = count(
        &out[0],
        &format!("store server 0.0.0.0:{port}: dropping connection from 127.0.0.1:"),
    );
    assert!(
        store_drops >= at_store,
        "rank 0 logged {store_drops} store refusals for {at_store} strangers:\n{}",
        out[0].stderr
    );
    for rank in [0, 1] {
        let drops = count(&out[rank], "dropping connection from 127.0.0.1:");
        assert!(
            drops >= at_links / 2,
            "rank {rank} logged {drops} refusals:\n{}",
            out[rank].stderr
        );
    }
}

#[test]
fn ranks_with_another_secret_or_none_fail_set_up_clearly() {
    for (odd, words) in [
        (Some("not the job's secret"), "CCL_JOB_SECRET differs"),
        (None, "requires a job secret"),
    ] {
        let secret = fresh_secret();
        let started = Instant::now();
        let out = launch_each(
            WORKER,
            &["collectives"],
            3,
            |rank| {
                let s = match (rank, odd) {
                    (2, Some(o)) => o.to_string(),
                    (2, None) => String::new(),
                    _ => secret.clone(),
                };
                vec![
                    ("CCL_JOB_SECRET", s),
                    ("CCL_TRANSPORT", "tcp".to_string()),
                    ("CCL_TIMEOUT", "5s".to_string()),
                ]
            },
            Duration::from_secs(60),
        );
        let took = started.elapsed();
        for o in &out {
            assert_eq!(
                o.code,
                Some(3),
                "rank {} must fail init: {}",
                o.rank,
                o.text()
            );
            assert!(!o.text().contains("panicked"), "{}", o.text());
        }
        // The odd rank fails at once, naming the cause.
        let odd_rank = &out[2];
        assert!(odd_rank.stderr.contains(words), "{}", odd_rank.stderr);
        assert!(
            odd_rank.elapsed < Duration::from_secs(4),
            "{:?}",
            odd_rank.elapsed
        );
        // Rank 0 at its deadline; rank 1 then, or when rank 0's store goes.
        assert!(out[0].stderr.contains("timed out"), "{}", out[0].stderr);
        assert!(
            out[1].stderr.contains("timed out") || out[1].stderr.contains("closed"),
            "{}",
            out[1].stderr
        );
        assert!(took < Duration::from_secs(20), "{took:?}");
    }
}

#[test]
fn without_a_secret_a_job_works_and_says_once_it_is_unauthenticated() {
    let out = launch_each(
        WORKER,
        &["collectives"],
        2,
        |_| {
            vec![
                ("CCL_JOB_SECRET", String::new()),
                ("CCL_TRANSPORT", "tcp".to_string()),
                ("CCL_TIMEOUT", "60s".to_string()),
            ]
        },
        JOB_LIMIT,
    );
    assert_all_ok(&out, "collectives without a secret");
    for o in &out {
        assert_eq!(count(o, "unauthenticated"), 1, "{}", o.stderr);
    }
}

#[test]
fn ccl_run_gives_its_ranks_a_secret() {
    let out = Command::new(ccl_run(WORKER))
        .args(["-n", "3", "--", WORKER, "collectives"])
        .env_remove("CCL_JOB_SECRET")
        .env("CCL_TRANSPORT", "tcp")
        .env("CCL_TIMEOUT", "60s")
        .output()
        .expect("run ccl-run");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert_eq!(stdout.matches(" 0 failures").count(), 3, "{stdout}");
    assert!(!stderr.contains("unauthenticated"), "{stderr}");
}
