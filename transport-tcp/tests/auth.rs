//! The job secret on TCP links: ranks that share it connect, strangers and
//! ranks with another secret are refused (and logged), and the mesh goes on.
//! Everything on 127.0.0.1, every wait bounded.

use std::{
    io::{Read, Write},
    net::TcpStream,
    sync::Arc,
    time::{Duration, Instant},
};

use ccl_core::{
    BufMut, BufRef, CollectiveKind, DataType, Error, Fingerprint, FrameHeader, JobSecret, Link,
    Setup, Store,
};
use ccl_rendezvous::{
    auth::{self, Challenge, Proof, Response},
    HashStore,
};
use ccl_transport_tcp::{connect_mesh, TcpOptions};

type Links = Vec<Option<Arc<dyn Link>>>;

const COMM: u64 = 0x5ec2_e700;
const LIMIT: Duration = Duration::from_secs(20);

fn runtime() -> tokio::runtime::Runtime {
    let filter = std::env::var("RUST_LOG").unwrap_or_else(|_| "ccl_transport_tcp=warn".into());
    let _ = tracing_subscriber::fmt()
        .with_test_writer()
        .with_env_filter(filter)
        .try_init();
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn secret(s: &str) -> JobSecret {
    JobSecret::new(s).unwrap()
}

/// What a rank brings to set-up besides its rank: its TCP options, and the
/// deadline and secret of its [`Setup`].
struct Opts {
    tcp: TcpOptions,
    timeout: Duration,
    secret: Option<JobSecret>,
}

fn opts(nsocks: usize, secret: Option<JobSecret>, timeout: Duration) -> Opts {
    Opts {
        tcp: TcpOptions {
            nsocks,
            ..TcpOptions::default()
        },
        timeout,
        secret,
    }
}

/// A fresh rendezvous store.
fn new_store() -> Arc<HashStore> {
    Arc::new(HashStore::new())
}

fn header(seq: u64, len: usize) -> FrameHeader {
    FrameHeader::data(
        COMM,
        seq,
        0,
        len,
        Fingerprint::new(CollectiveKind::SendRecv, DataType::U8, len),
    )
}

/// Rank `rank`'s set-up; then, if it worked, every rank sends its number to
/// every other rank and checks what it gets. Returns how long set-up took.
fn run_rank(
    rank: usize,
    world: usize,
    store: &Arc<HashStore>,
    o: &Opts,
) -> Result<Duration, Error> {
    let setup = Setup {
        rank,
        world_size: world,
        comm: COMM,
        store: store.clone(),
        timeout: o.timeout,
        secret: o.secret.clone(),
    };
    runtime().block_on(async {
        tokio::time::timeout(LIMIT, async {
            let started = Instant::now();
            let links: Links = connect_mesh(&setup, &o.tcp).await?;
            let took = started.elapsed();
            let mine = (rank as u64).to_le_bytes();
            for (p, l) in links.iter().enumerate() {
                let Some(l) = l else { continue };
                let mut got = [0u8; 8];
                let (s, r) = futures::join!(
                    l.send(header(0, 8), BufRef::from_host(&mine)),
                    l.recv(header(0, 8), BufMut::from_host(&mut got))
                );
                s.unwrap();
                r.unwrap();
                assert_eq!(u64::from_le_bytes(got), p as u64);
            }
            Ok(took)
        })
        .await
        .unwrap_or_else(|_| panic!("rank {rank} did not finish within {LIMIT:?}"))
    })
}

#[test]
fn ranks_sharing_the_secret_connect_and_exchange() {
    let store = new_store();
    let o = opts(2, Some(secret("shared")), Duration::from_secs(10));
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..3)
            .map(|rank| {
                let (store, o) = (&store, &o);
                s.spawn(move || run_rank(rank, 3, store, o).unwrap())
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
    });
}

/// Reads until EOF (or 3 s): what the acceptor sent a stranger before hanging up.
fn until_closed(mut s: TcpStream) -> Vec<u8> {
    s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    let mut buf = Vec::new();
    match s.read_to_end(&mut buf) {
        Ok(_) => {}
        Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{e}"),
    }
    buf
}

fn hello_bytes(comm: u64, from: u32, to: u32, nsocks: u16) -> Vec<u8> {
    let mut hello = Vec::from(*b"CCLH");
    hello.extend_from_slice(&1u32.to_le_bytes());
    hello.extend_from_slice(&comm.to_le_bytes());
    hello.extend_from_slice(&from.to_le_bytes());
    hello.extend_from_slice(&to.to_le_bytes());
    hello.extend_from_slice(&0u16.to_le_bytes());
    hello.extend_from_slice(&nsocks.to_le_bytes());
    hello
}

#[test]
fn strangers_without_the_secret_are_refused_and_the_mesh_goes_on() {
    let store = new_store();
    let job = secret("the job");
    let o = opts(1, Some(job.clone()), Duration::from_secs(10));
    std::thread::scope(|s| {
        let rank0 = s.spawn(|| run_rank(0, 2, &store, &o).unwrap());
        let addr = String::from_utf8(store.get("addr/0", LIMIT).unwrap()).unwrap();
        let connect = || TcpStream::connect(&addr).unwrap();

        // Silence (held open during the whole set-up).
        let silent = connect();
        // Random bytes.
        let mut garbage = connect();
        let junk: Vec<u8> = (0..500u32).map(|i| (i * 7919 % 251) as u8).collect();
        garbage.write_all(&junk).unwrap();
        let garbage_reply = until_closed(garbage);
        // A well-formed hello of this very communicator, without the secret.
        let mut hello = connect();
        hello.write_all(&hello_bytes(COMM, 1, 0, 1)).unwrap();
        let hello_reply = until_closed(hello);
        // A well-formed response with a made-up MAC.
        let mut forged = connect();
        let mut challenge = [0u8; auth::CHALLENGE_LEN];
        forged
            .set_read_timeout(Some(Duration::from_secs(3)))
            .unwrap();
        forged.read_exact(&mut challenge).unwrap();
        assert!(Challenge::decode(&challenge).unwrap().required);
        let response = Response {
            mac: [0x11; auth::MAC_LEN],
            nonce: [0x22; auth::NONCE_LEN],
        };
        forged.write_all(&response.encode()).unwrap();
        // The acceptor may hang up before this arrives.
        let _ = forged.write_all(&hello_bytes(COMM, 1, 0, 1));
        let forged_reply = until_closed(forged);

        for reply in [&garbage_reply, &hello_reply] {
            // The challenge, then nothing: no acknowledgement of any hello.
            assert_eq!(reply.len(), auth::CHALLENGE_LEN, "{reply:02x?}");
            assert!(Challenge::decode(reply).unwrap().required);
        }
        // The forged response is told it is refused, and nothing more.
        assert_eq!(forged_reply.len(), auth::PROOF_LEN, "{forged_reply:02x?}");
        assert!(!Proof::decode(&forged_reply).unwrap().accepted);

        // The real rank 1 still gets in, and the link works.
        let rank1 = s.spawn(|| run_rank(1, 2, &store, &o).unwrap());
        rank1.join().unwrap();
        let took = rank0.join().unwrap();
        assert!(took < Duration::from_secs(5), "set-up took {took:?}");
        // The silent stranger got the challenge and was dropped (at the
        // latest when set-up ended).
        let got = until_closed(silent);
        assert_eq!(got.len(), auth::CHALLENGE_LEN, "{got:02x?}");
    });
}

#[test]
fn a_rank_with_another_secret_fails_set_up_clearly() {
    let store = new_store();
    let o0 = opts(1, Some(secret("right")), Duration::from_millis(1500));
    let o1 = opts(1, Some(secret("wrong")), Duration::from_secs(10));
    std::thread::scope(|s| {
        let r0 = s.spawn(|| run_rank(0, 2, &store, &o0));
        let started = Instant::now();
        let e = run_rank(1, 2, &store, &o1).unwrap_err();
        assert!(
            matches!(&e, Error::Config(m) if m.contains("CCL_JOB_SECRET differs") && m.contains("rank 1") && m.contains("rank 0 at 127.0.0.1:")),
            "{e}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "{:?}",
            started.elapsed()
        );
        // Rank 0 keeps waiting for the real rank 1 until its deadline, and
        // then says a connection failed authentication.
        let e0 = r0.join().unwrap().unwrap_err();
        assert!(
            matches!(&e0, Error::Timeout { what, .. } if what.contains("[1]") && what.contains("failed authentication") && what.contains("wrong job secret")),
            "{e0}"
        );
    });
}

#[test]
fn a_secret_on_one_side_only_fails_set_up_clearly() {
    for (s0, s1, words) in [
        (Some(secret("s")), None, "requires a job secret"),
        (None, Some(secret("s")), "runs without a job secret"),
    ] {
        let store = new_store();
        let o0 = opts(1, s0, Duration::from_millis(800));
        let o1 = opts(1, s1, Duration::from_secs(10));
        std::thread::scope(|s| {
            let r0 = s.spawn(|| run_rank(0, 2, &store, &o0));
            let started = Instant::now();
            let e = run_rank(1, 2, &store, &o1).unwrap_err();
            assert!(matches!(&e, Error::Config(m) if m.contains(words)), "{e}");
            assert!(started.elapsed() < Duration::from_secs(1));
            assert!(matches!(r0.join().unwrap(), Err(Error::Timeout { .. })));
        });
    }
}
