//! QUIC meshes on loopback: each rank a thread with its own current-thread
//! runtime (as the facade runs them), rendezvous through a `HashStore`.

use std::{future::Future, sync::Arc, time::Duration};

use ccl_core::{
    AbortNotice, BufMut, BufRef, CollectiveKind, DataType, Error, Fingerprint, FrameHeader, Link,
    ReduceOp, Reduction, Setup, Store, HOST_KERNELS,
};
use ccl_rendezvous::HashStore;
use ccl_transport_quic::{
    connect_mesh, decode_published, Identity, PinnedServer, QuicOptions, MIN_WINDOW,
};

type Links = Vec<Option<Arc<dyn Link>>>;

const COMM: u64 = 0x9_1c00;
/// Bound on every rank of every test.
const LIMIT: Duration = Duration::from_secs(30);

fn runtime() -> tokio::runtime::Runtime {
    let filter = std::env::var("RUST_LOG").unwrap_or_else(|_| "ccl_transport_quic=warn".into());
    let _ = tracing_subscriber::fmt()
        .with_test_writer()
        .with_env_filter(filter)
        .try_init();
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn setup(world_size: usize, store: &Arc<HashStore>, rank: usize) -> Setup {
    Setup {
        rank,
        world_size,
        comm: COMM,
        store: store.clone(),
        timeout: Duration::from_secs(10),
        secret: Some(ccl_core::JobSecret::new("a-test-secret-of-this-job").unwrap()),
    }
}

fn run_ranks<T, F, Fut>(world: usize, store: &Arc<HashStore>, body: F) -> Vec<T>
where
    T: Send,
    F: Fn(usize, Links) -> Fut + Sync,
    Fut: Future<Output = T>,
{
    run_ranks_with(world, store, &QuicOptions::default(), body)
}

fn run_ranks_with<T, F, Fut>(
    world: usize,
    store: &Arc<HashStore>,
    options: &QuicOptions,
    body: F,
) -> Vec<T>
where
    T: Send,
    F: Fn(usize, Links) -> Fut + Sync,
    Fut: Future<Output = T>,
{
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let body = &body;
                let setup = setup(world, store, rank);
                s.spawn(move || {
                    runtime().block_on(async {
                        tokio::time::timeout(LIMIT, async {
                            let links = connect_mesh(&setup, options).await.expect("mesh set-up");
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

const SIZES: [usize; 6] = [
    0,
    1,
    4096,
    1024 * 1024,
    1024 * 1024 + 13,
    5 * 1024 * 1024 + 3,
];

/// Every rank sends every size to every peer in order; every receive gets
/// the next message from that peer, intact.
async fn exchange(rank: usize, links: &Links) {
    for (p, link) in links.iter().enumerate() {
        let Some(link) = link else { continue };
        let sends = async {
            for (k, &len) in SIZES.iter().enumerate() {
                let data = pattern(rank, p, k, len);
                link.send(header(k as u64, len), BufRef::from_host(&data[..]))
                    .await
                    .unwrap();
            }
        };
        let recvs = async {
            for (k, &len) in SIZES.iter().enumerate() {
                let mut got = vec![0u8; len];
                link.recv(header(k as u64, len), BufMut::from_host(&mut got[..]))
                    .await
                    .unwrap();
                assert!(
                    got == pattern(p, rank, k, len),
                    "message {k} from {p} to {rank}"
                );
            }
        };
        tokio::join!(sends, recvs);
    }
}

/// A receive window far smaller than a message, and than the pieces a
/// sender writes at once: both ranks send and receive at once, plainly and
/// reduced, and every byte arrives. (A receiver that stopped reading the
/// streams it had while it waited for the next one deadlocked here.)
#[test]
fn a_small_receive_window_carries_large_messages_both_ways() {
    const LEN: usize = 8 * 1024 * 1024 + 8;
    let options = QuicOptions {
        receive_window: Some(MIN_WINDOW),
        ..QuicOptions::default()
    };
    let store = Arc::new(HashStore::new());
    run_ranks_with(2, &store, &options, |rank, links| async move {
        let peer = 1 - rank;
        let link = links[peer].as_ref().unwrap();
        let data = pattern(rank, peer, 0, LEN);
        let mut got = vec![0u8; LEN];
        let (sent, received) = tokio::join!(
            link.send(header(0, LEN), BufRef::from_host(&data[..])),
            link.recv(header(0, LEN), BufMut::from_host(&mut got[..]))
        );
        sent.unwrap();
        received.unwrap();
        assert!(got == pattern(peer, rank, 0, LEN), "message to {rank}");

        let n = LEN / 4;
        let value = |r: usize, i: usize| (i % 1000 + 3 * r) as f32;
        let h = FrameHeader::data(
            COMM,
            1,
            0,
            LEN,
            Fingerprint::new(CollectiveKind::AllReduce, DataType::F32, n).with_op(ReduceOp::Sum),
        );
        let mine: Vec<f32> = (0..n).map(|i| value(rank, i)).collect();
        let mut into = mine.clone();
        let reduction = Reduction {
            op: ReduceOp::Sum,
            dtype: DataType::F32,
            local: None,
            kernels: &HOST_KERNELS,
        };
        let (sent, reduced) = tokio::join!(
            link.send(h, BufRef::from_host(bytemuck::cast_slice(&mine[..]))),
            link.recv_reduce(
                h,
                BufMut::from_host(bytemuck::cast_slice_mut(&mut into[..])),
                reduction
            )
        );
        sent.unwrap();
        reduced.unwrap();
        for (i, v) in into.iter().enumerate() {
            assert_eq!(*v, value(0, i) + value(1, i), "element {i} on rank {rank}");
        }
    });
}

#[test]
fn messages_arrive_in_order_and_intact() {
    let store = Arc::new(HashStore::new());
    run_ranks(3, &store, |rank, links| async move {
        exchange(rank, &links).await
    });
}

#[test]
fn a_stranger_is_refused_and_the_job_goes_on() {
    let store = Arc::new(HashStore::new());
    run_ranks(2, &store, |rank, links| {
        let store = store.clone();
        async move {
            if rank == 1 {
                let value = store.get("quic/0", Duration::from_secs(5)).unwrap();
                let (addr, fp) = decode_published(&value, None, COMM, 0).unwrap();
                // Garbage datagrams at the rank's port.
                let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
                for i in 0..50u8 {
                    udp.send_to(&[i; 1200], addr).unwrap();
                }
                // A QUIC client that knows rank 0's fingerprint, with a
                // certificate of its own: refused by rank 0's verifier.
                let me = Identity::generate().unwrap();
                let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
                let mut tls = rustls::ClientConfig::builder_with_provider(provider.clone())
                    .with_protocol_versions(&[&rustls::version::TLS13])
                    .unwrap()
                    .dangerous()
                    .with_custom_certificate_verifier(Arc::new(PinnedServer {
                        expected: fp,
                        provider,
                    }))
                    .with_client_auth_cert(vec![me.cert.clone()], me.key())
                    .unwrap();
                tls.alpn_protocols = vec![b"ccl/1".to_vec()];
                let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(tls).unwrap();
                let mut ep = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
                ep.set_default_client_config(quinn::ClientConfig::new(Arc::new(crypto)));
                let r: Result<(), String> = tokio::time::timeout(Duration::from_secs(10), async {
                    let conn = ep
                        .connect(addr, "ccl")
                        .map_err(|e| e.to_string())?
                        .await
                        .map_err(|e| e.to_string())?;
                    // TLS 1.3: the client may finish before the server refuses.
                    let (mut tx, mut rx) = conn.open_bi().await.map_err(|e| e.to_string())?;
                    let _ = tx.write_all(&[0u8; 24]).await;
                    let mut b = [0u8; 1];
                    rx.read_exact(&mut b).await.map_err(|e| e.to_string())?;
                    Ok(())
                })
                .await
                .expect("the stranger got an answer in time");
                let e = r.expect_err("a stranger's certificate must be refused");
                eprintln!("the stranger got: {e}");
            }
            exchange(rank, &links).await
        }
    });
}

#[test]
fn an_abort_names_the_rank_that_failed_first() {
    let store = Arc::new(HashStore::new());
    let out = run_ranks(2, &store, |rank, links| async move {
        let link = links[1 - rank].clone().unwrap();
        if rank == 0 {
            let notice = AbortNotice {
                failed_rank: 0,
                reason: "out of memory".into(),
            };
            link.abort(&notice).await.unwrap();
            None
        } else {
            let mut got = [0u8; 8];
            Some(
                link.recv(header(0, 8), BufMut::from_host(&mut got[..]))
                    .await
                    .unwrap_err(),
            )
        }
    });
    match &out[1] {
        Some(Error::PeerLost { peer: 0, cause, .. }) => {
            assert!(cause.contains("out of memory"), "{cause}")
        }
        other => panic!("expected PeerLost naming rank 0, got {other:?}"),
    }
}
