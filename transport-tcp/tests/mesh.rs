//! Meshes of ranks on loopback: each rank is a thread with its own
//! current-thread runtime (as the facade runs them), rendezvous through a
//! `HashStore`.

use std::{
    future::Future,
    io::{Read, Write},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, TcpStream},
    sync::Arc,
    time::{Duration, Instant},
};

use ccl_core::{
    AbortNotice, AlignedBuf, BufMut, BufRef, CollectiveKind, DataType, Error, Fingerprint,
    FrameHeader, Link, ReduceOp, Reduction, Setup, Store, HOST_KERNELS,
};
use ccl_rendezvous::HashStore;
use ccl_transport_tcp::{connect_mesh, TcpOptions, REDUCE_PIECE};
use futures::future::join_all;

type Links = Vec<Option<Arc<dyn Link>>>;

const COMM: u64 = 0xc0ff_ee00;
/// Bound on every rank of every test.
const LIMIT: Duration = Duration::from_secs(20);

fn opts(nsocks: usize) -> TcpOptions {
    TcpOptions {
        nsocks,
        ..TcpOptions::default()
    }
}

/// A fresh rendezvous store.
fn new_store() -> Arc<HashStore> {
    Arc::new(HashStore::new())
}

/// Rank 0's set-up in a `world_size`-rank communicator through `store`,
/// with a 10 s deadline and no secret (other ranks differ only in `rank`).
fn setup(world_size: usize, store: &Arc<HashStore>) -> Setup {
    Setup {
        rank: 0,
        world_size,
        comm: COMM,
        store: store.clone(),
        timeout: Duration::from_secs(10),
        secret: None,
    }
}

/// `base` for rank `rank`.
fn as_rank(base: &Setup, rank: usize) -> Setup {
    Setup {
        rank,
        ..base.clone()
    }
}

/// Shows this crate's warnings (and more with `RUST_LOG`) in test output.
fn logs() {
    let filter = std::env::var("RUST_LOG").unwrap_or_else(|_| "ccl_transport_tcp=warn".into());
    let _ = tracing_subscriber::fmt()
        .with_test_writer()
        .with_env_filter(filter)
        .try_init();
}

fn runtime() -> tokio::runtime::Runtime {
    logs();
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Runs `body` on every rank of the mesh `base` describes (`base.rank`
/// aside), each rank a thread with its own runtime; returns what each rank
/// returned.
fn run_ranks<T, F, Fut>(base: &Setup, opts: &TcpOptions, body: F) -> Vec<T>
where
    T: Send,
    F: Fn(usize, Links) -> Fut + Sync,
    Fut: Future<Output = T>,
{
    let world = base.world_size;
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let body = &body;
                let setup = as_rank(base, rank);
                s.spawn(move || {
                    runtime().block_on(async {
                        tokio::time::timeout(LIMIT, async {
                            let links = connect_mesh(&setup, opts).await.expect("mesh set-up");
                            assert_eq!(links.len(), world);
                            for (p, l) in links.iter().enumerate() {
                                assert_eq!(l.is_none(), p == rank);
                                if let Some(l) = l {
                                    assert_eq!((l.rank(), l.peer()), (rank, p));
                                }
                            }
                            body(rank, links).await
                        })
                        .await
                        .unwrap_or_else(|_| panic!("rank {rank} did not finish within {LIMIT:?}"))
                    })
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank panicked"))
            .collect()
    })
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

fn pattern(src: usize, dst: usize, k: usize, len: usize) -> Vec<u8> {
    let salt = src * 7 + dst * 13 + k * 3;
    (0..len).map(|i| ((i + salt) % 251) as u8).collect()
}

fn peers(links: &Links) -> impl Iterator<Item = (usize, Arc<dyn Link>)> + '_ {
    links
        .iter()
        .enumerate()
        .filter_map(|(p, l)| l.clone().map(|l| (p, l)))
}

/// Every rank sends every size to every peer while receiving from all of them.
async fn exchange_all(rank: usize, links: Links, sizes: &[usize]) {
    join_all(peers(&links).map(|(p, l)| async move {
        let send = async {
            for (k, &n) in sizes.iter().enumerate() {
                l.send(
                    header(k as u64, n),
                    BufRef::from_host(&pattern(rank, p, k, n)),
                )
                .await
                .unwrap();
            }
        };
        let recv = async {
            for (k, &n) in sizes.iter().enumerate() {
                let mut got = vec![0xeeu8; n];
                l.recv(header(k as u64, n), BufMut::from_host(&mut got))
                    .await
                    .unwrap();
                assert!(
                    got == pattern(p, rank, k, n),
                    "rank {rank}: message {k} ({n} bytes) from rank {p} corrupted"
                );
            }
        };
        futures::join!(send, recv);
    }))
    .await;
}

const SIZES: [usize; 5] = [0, 1, 63, 64 * 1024 + 1, (4 << 20) + 13];

#[test]
fn mesh_of_four_exchanges_all_sizes_one_socket() {
    run_ranks(&setup(4, &new_store()), &opts(1), |rank, links| {
        exchange_all(rank, links, &SIZES)
    });
}

#[test]
fn mesh_of_four_exchanges_all_sizes_three_sockets() {
    run_ranks(&setup(4, &new_store()), &opts(3), |rank, links| {
        exchange_all(rank, links, &SIZES)
    });
}

#[test]
fn single_rank_needs_no_links() {
    let links = runtime()
        .block_on(connect_mesh(&setup(1, &new_store()), &opts(1)))
        .unwrap();
    assert!(links.len() == 1 && links[0].is_none());
    let e = runtime()
        .block_on(connect_mesh(&as_rank(&setup(2, &new_store()), 2), &opts(1)))
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
}

fn f32_bytes(values: impl Iterator<Item = f32>, count: usize) -> AlignedBuf {
    let mut b = AlignedBuf::zeroed(count * 4);
    for (chunk, v) in b.as_mut_slice().chunks_exact_mut(4).zip(values) {
        chunk.copy_from_slice(&v.to_ne_bytes());
    }
    b
}

fn f32_values(b: &AlignedBuf) -> Vec<f32> {
    b.as_slice()
        .chunks_exact(4)
        .map(|c| f32::from_ne_bytes(c.try_into().unwrap()))
        .collect()
}

fn recv_reduce_sums(nsocks: usize) {
    // Counts include one above the piece size and not a multiple of it.
    let counts = [0, 1, 7, 16 * 1024, REDUCE_PIECE / 4 + 5, 200_003];
    run_ranks(
        &setup(2, &new_store()),
        &opts(nsocks),
        |rank, links| async move {
            let sent = |i: usize| i as f32 * 0.5;
            let mine = |i: usize| (i % 100) as f32;
            let local = |i: usize| (i % 7) as f32 - 3.0;
            let mut seq = 0;
            for &n in &counts {
                for with_local in [false, true] {
                    seq += 1;
                    let h = FrameHeader::data(
                        COMM,
                        seq,
                        0,
                        n * 4,
                        Fingerprint::new(CollectiveKind::AllReduce, DataType::F32, n)
                            .with_op(ReduceOp::Sum),
                    );
                    if rank == 0 {
                        let data = f32_bytes((0..n).map(sent), n);
                        links[1]
                            .as_ref()
                            .unwrap()
                            .send(h, BufRef::from_host(data.as_slice()))
                            .await
                            .unwrap();
                        continue;
                    }
                    let link = links[0].as_ref().unwrap();
                    let mut into = f32_bytes((0..n).map(mine), n);
                    let loc = f32_bytes((0..n).map(local), n);
                    let reduction = Reduction {
                        op: ReduceOp::Sum,
                        dtype: DataType::F32,
                        local: with_local.then(|| BufRef::from_host(loc.as_slice())),
                        kernels: &HOST_KERNELS,
                    };
                    link.recv_reduce(h, BufMut::from_host(into.as_mut_slice()), reduction)
                        .await
                        .unwrap();
                    let got = f32_values(&into);
                    for (i, v) in got.iter().enumerate() {
                        let want = sent(i) + if with_local { local(i) } else { mine(i) };
                        assert_eq!(*v, want, "count {n}, local {with_local}, element {i}");
                    }
                }
            }
        },
    );
}

#[test]
fn recv_reduce_sums_f32_one_socket() {
    recv_reduce_sums(1);
}

#[test]
fn recv_reduce_sums_f32_two_sockets() {
    recv_reduce_sums(2);
}

#[test]
fn mismatched_header_is_a_mismatch() {
    // (An unbounded set-up deadline works too.)
    let base = Setup {
        timeout: Duration::MAX,
        ..setup(2, &new_store())
    };
    run_ranks(&base, &opts(2), |rank, links| async move {
        if rank == 0 {
            links[1]
                .as_ref()
                .unwrap()
                .send(header(4, 10), BufRef::from_host(&[1; 10]))
                .await
                .unwrap();
            return;
        }
        let mut into = [0u8; 10];
        let mut expect = header(4, 10);
        expect.fingerprint.kind = CollectiveKind::Broadcast;
        let e = links[0]
            .as_ref()
            .unwrap()
            .recv(expect, BufMut::from_host(&mut into))
            .await
            .unwrap_err();
        assert!(
            matches!(
                e,
                Error::Mismatch {
                    rank: 1,
                    peer: 0,
                    ..
                }
            ),
            "{e}"
        );
    });
}

#[test]
fn abort_reaches_a_pending_receive() {
    run_ranks(
        &setup(2, &new_store()),
        &opts(2),
        |rank, links| async move {
            let link = peers(&links).next().unwrap().1;
            if rank == 0 {
                tokio::time::sleep(Duration::from_millis(50)).await;
                let notice = AbortNotice {
                    failed_rank: 7,
                    reason: "rank 7 ran out of memory".into(),
                };
                link.abort(&notice).await.unwrap();
                link.abort(&notice).await.unwrap(); // idempotent
                                                    // Our own side is closed too.
                let started = Instant::now();
                let e = link
                    .recv(header(0, 3), BufMut::from_host(&mut [0; 3]))
                    .await
                    .unwrap_err();
                assert!(matches!(e, Error::PeerLost { .. }), "{e}");
                assert!(started.elapsed() < Duration::from_secs(1));
                return;
            }
            // A striped receive: the abort frame arrives on socket 0 only.
            let mut into = vec![0u8; 1 << 20];
            let e = link
                .recv(header(0, 1 << 20), BufMut::from_host(&mut into))
                .await
                .unwrap_err();
            match &e {
                Error::PeerLost {
                    rank: 1,
                    peer: 7,
                    cause,
                    ..
                } => assert!(cause.contains("out of memory"), "{e}"),
                _ => panic!("expected PeerLost naming rank 7, got {e}"),
            }
        },
    );
}

#[test]
fn abort_after_a_dropped_send_does_not_write_mid_frame() {
    run_ranks(
        &setup(2, &new_store()),
        &opts(1),
        |rank, links| async move {
            let link = peers(&links).next().unwrap().1;
            let big = 64 << 20;
            if rank == 0 {
                // The peer does not read yet: the send blocks, then is dropped mid-frame.
                let data = vec![1u8; big];
                let r = tokio::time::timeout(
                    Duration::from_millis(200),
                    link.send(header(0, big), BufRef::from_host(&data)),
                )
                .await;
                assert!(r.is_err(), "a 64 MiB send completed without a reader");
                let notice = AbortNotice {
                    failed_rank: 0,
                    reason: "gave up".into(),
                };
                let started = Instant::now();
                link.abort(&notice).await.unwrap();
                assert!(started.elapsed() < Duration::from_millis(500));
                return;
            }
            tokio::time::sleep(Duration::from_millis(400)).await;
            let mut into = vec![0u8; big];
            let e = link
                .recv(header(0, big), BufMut::from_host(&mut into))
                .await
                .unwrap_err();
            assert!(
                matches!(
                    e,
                    Error::PeerLost {
                        rank: 1,
                        peer: 0,
                        ..
                    }
                ),
                "{e}"
            );
        },
    );
}

#[test]
fn dropped_peer_is_peer_lost_quickly() {
    run_ranks(
        &setup(2, &new_store()),
        &opts(2),
        |rank, links| async move {
            if rank == 0 {
                tokio::time::sleep(Duration::from_millis(50)).await;
                drop(links);
                return;
            }
            let link = peers(&links).next().unwrap().1;
            let started = Instant::now();
            let e = link
                .recv(header(0, 100), BufMut::from_host(&mut [0; 100]))
                .await
                .unwrap_err();
            assert!(
                matches!(
                    e,
                    Error::PeerLost {
                        rank: 1,
                        peer: 0,
                        ..
                    }
                ),
                "{e}"
            );
            assert!(
                started.elapsed() < Duration::from_secs(2),
                "took {:?}",
                started.elapsed()
            );
            // Sending to the lost peer fails as well (at the latest once the reset arrives).
            let mut failed = false;
            for _ in 0..50 {
                if link
                    .send(header(1, 1000), BufRef::from_host(&[0; 1000]))
                    .await
                    .is_err()
                {
                    failed = true;
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            assert!(failed, "sending to a closed peer kept succeeding");
        },
    );
}

#[test]
fn strangers_do_not_break_the_mesh() {
    let store = new_store();
    let base = setup(2, &store);
    let o = opts(2);
    std::thread::scope(|s| {
        let rank0 = s.spawn(|| {
            runtime().block_on(async {
                let started = Instant::now();
                let links = tokio::time::timeout(LIMIT, connect_mesh(&base, &o))
                    .await
                    .unwrap()
                    .unwrap();
                let took = started.elapsed();
                let mut got = [0u8; 5];
                links[1]
                    .as_ref()
                    .unwrap()
                    .recv(header(0, 5), BufMut::from_host(&mut got))
                    .await
                    .unwrap();
                assert_eq!(&got, b"hello");
                took
            })
        });
        let addr = String::from_utf8(store.get("addr/0", LIMIT).unwrap()).unwrap();
        // Garbage, silence, half a hello, and a well-formed hello for another communicator.
        let mut garbage = TcpStream::connect(&addr).unwrap();
        garbage.write_all(&[0x5a; 200]).unwrap();
        let silent = TcpStream::connect(&addr).unwrap();
        let mut half = TcpStream::connect(&addr).unwrap();
        half.write_all(b"CCLH\x01\x00").unwrap();
        let mut other = TcpStream::connect(&addr).unwrap();
        let mut hello = Vec::from(*b"CCLH");
        hello.extend_from_slice(&1u32.to_le_bytes());
        hello.extend_from_slice(&(COMM + 1).to_le_bytes());
        hello.extend_from_slice(&1u32.to_le_bytes());
        hello.extend_from_slice(&0u32.to_le_bytes());
        hello.extend_from_slice(&0u16.to_le_bytes());
        hello.extend_from_slice(&2u16.to_le_bytes());
        other.write_all(&hello).unwrap();
        other
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        // Without a secret the acceptor opens with a challenge asking for none.
        let mut challenge = [0u8; ccl_rendezvous::auth::CHALLENGE_LEN];
        other.read_exact(&mut challenge).unwrap();
        assert!(
            !ccl_rendezvous::auth::Challenge::decode(&challenge)
                .unwrap()
                .required
        );
        let mut reply = [0u8; 1];
        other.read_exact(&mut reply).unwrap();
        assert_ne!(
            reply[0], 0x06,
            "a hello for another communicator was accepted"
        );
        let rank1 = s.spawn(|| {
            runtime().block_on(async {
                let links = tokio::time::timeout(LIMIT, connect_mesh(&as_rank(&base, 1), &o))
                    .await
                    .unwrap()
                    .unwrap();
                links[0]
                    .as_ref()
                    .unwrap()
                    .send(header(0, 5), BufRef::from_host(b"hello"))
                    .await
                    .unwrap();
            })
        });
        rank1.join().unwrap();
        let took = rank0.join().unwrap();
        // The silent stranger would hold a serial accept loop for its 2 s hello timeout.
        assert!(took < Duration::from_millis(1500), "mesh took {took:?}");
        drop((garbage, silent, half));
    });
}

#[test]
fn ipv6_mesh_on_loopback() {
    if std::net::TcpListener::bind("[::1]:0").is_err() {
        // CI's machines have ::1: there a missing one is a failure, not a skip.
        assert!(
            std::env::var_os("CI").is_none(),
            "no IPv6 loopback (::1) on this CI machine"
        );
        eprintln!("skipping: no IPv6 loopback here");
        return;
    }
    let o = TcpOptions {
        local_ip: Some(IpAddr::V6(Ipv6Addr::LOCALHOST)),
        ..opts(2)
    };
    let store = new_store();
    run_ranks(&setup(3, &store), &o, |rank, links| {
        exchange_all(rank, links, &[0, 5, 100_000])
    });
    let published = String::from_utf8(store.try_get("addr/0").unwrap().unwrap()).unwrap();
    assert!(published.starts_with("[::1]:"), "{published}");
}

#[test]
fn interface_by_name() {
    let o = TcpOptions {
        interface: Some("lo".into()),
        local_ip: Some(IpAddr::V4(Ipv4Addr::new(10, 255, 255, 1))), // the interface wins
        ..opts(1)
    };
    let store = new_store();
    run_ranks(&setup(2, &store), &o, |rank, links| {
        exchange_all(rank, links, &[3])
    });
    let published = String::from_utf8(store.try_get("addr/1").unwrap().unwrap()).unwrap();
    assert!(published.starts_with("127."), "{published}");
    let bad = TcpOptions {
        interface: Some("no-such-if0".into()),
        ..opts(1)
    };
    let e = runtime()
        .block_on(connect_mesh(&setup(2, &new_store()), &bad))
        .unwrap_err();
    assert!(matches!(e, Error::Config(_)), "{e}");
}

fn assert_timeout_naming(e: &Error, rank: usize, started: Instant, timeout: Duration) {
    let took = started.elapsed();
    match e {
        Error::Timeout { what, .. } => assert!(what.contains(&format!("[{rank}]")), "{e}"),
        _ => panic!("expected a timeout, got {e}"),
    }
    assert!(
        took >= timeout && took < timeout + Duration::from_secs(1),
        "took {took:?}"
    );
}

#[test]
fn set_up_deadline_names_missing_ranks() {
    let timeout = Duration::from_millis(300);
    let within = |rank: usize, store: &Arc<HashStore>| Setup {
        rank,
        timeout,
        ..setup(2, store)
    };
    let o = opts(1);
    // Rank 0 alone: nobody connects.
    let started = Instant::now();
    let e = runtime()
        .block_on(connect_mesh(&within(0, &new_store()), &o))
        .unwrap_err();
    assert_timeout_naming(&e, 1, started, timeout);
    // Rank 1 alone: rank 0 never publishes its address.
    let started = Instant::now();
    let e = runtime()
        .block_on(connect_mesh(&within(1, &new_store()), &o))
        .unwrap_err();
    assert_timeout_naming(&e, 0, started, timeout);
    // Rank 1, whose rank 0 listens but never answers the handshake.
    let mute = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let store = new_store();
    store
        .set("addr/0", mute.local_addr().unwrap().to_string().as_bytes())
        .unwrap();
    let started = Instant::now();
    let e = runtime()
        .block_on(connect_mesh(&within(1, &store), &o))
        .unwrap_err();
    assert_timeout_naming(&e, 0, started, timeout);
}

#[test]
fn disagreeing_socket_counts_fail_clearly() {
    let base = setup(2, &new_store());
    let s0 = Setup {
        timeout: Duration::from_millis(1500),
        ..base.clone()
    };
    std::thread::scope(|s| {
        let r0 = s.spawn(|| runtime().block_on(connect_mesh(&s0, &opts(1))).map(|_| ()));
        let started = Instant::now();
        let e = runtime()
            .block_on(connect_mesh(&as_rank(&base, 1), &opts(2)))
            .unwrap_err();
        assert!(
            matches!(&e, Error::Config(m) if m.contains("CCL_NSOCKS")),
            "{e}"
        );
        assert!(started.elapsed() < Duration::from_secs(1));
        assert!(matches!(r0.join().unwrap(), Err(Error::Timeout { .. })));
    });
}

#[test]
fn connect_mesh_future_is_send() {
    fn assert_send<T: Send>(_: T) {}
    let s = setup(1, &new_store());
    let o = opts(1);
    assert_send(connect_mesh(&s, &o));
}
