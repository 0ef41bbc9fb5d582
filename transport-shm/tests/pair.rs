//! Two ranks as threads of one process, each with its own runtime, joined by
//! a shared-memory link (cross-memory attach works on one's own process too).

use std::{
    sync::{Arc, Mutex},
    thread,
    time::Duration,
};

use tokio::runtime::Runtime;

use ccl_core::{
    AbortNotice, BufMut, BufRef, CollectiveKind, DataType, Error, Fingerprint, FrameHeader, Link,
    ReduceOp, Reduction, Setup, Spin, Store, Transport, HOST_KERNELS,
};
use ccl_rendezvous::HashStore;
use ccl_transport_shm::{SharedBuffer, ShmOptions, ShmTransport, REF_MIN};

fn header(step: u32, len: usize) -> FrameHeader {
    let fp = Fingerprint::new(CollectiveKind::AllReduce, DataType::U8, len);
    FrameHeader::data(9, 1, step, len, fp)
}

/// Options with `bytes` per pair, and how long waiters spin.
fn opts(bytes: usize, spin_us: u64) -> (ShmOptions, Spin) {
    let spin = Spin {
        window: Duration::from_micros(spin_us),
        yield_between: false,
        repoll: false,
    };
    (
        ShmOptions {
            bytes,
            ..ShmOptions::default()
        },
        spin,
    )
}

/// Runs `f(rank, link)` on two threads joined by one link.
fn pair<T: Send + 'static>(
    (o, spin): (ShmOptions, Spin),
    f: impl Fn(usize, Arc<dyn Link>, &Runtime) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let store: Arc<dyn Store> = Arc::new(HashStore::new());
    let f = Arc::new(f);
    let threads: Vec<_> = (0..2)
        .map(|rank| {
            let (store, f, o) = (store.clone(), f.clone(), o.clone());
            thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                let _guard = rt.enter();
                let setup = Setup {
                    rank,
                    world_size: 2,
                    comm: 9,
                    store,
                    timeout: Duration::from_secs(20),
                    secret: None,
                };
                let connector = ShmTransport::new(o).prepare(&setup).unwrap();
                let mut links = rt
                    .block_on(connector.connect(&[1 - rank], &[], spin))
                    .unwrap();
                let link = links.pop().unwrap().expect("shared memory works here");
                f(rank, link, &rt)
            })
        })
        .collect();
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}

fn block_on<F: std::future::Future>(rt: &Runtime, f: F) -> F::Output {
    rt.block_on(tokio::time::timeout(Duration::from_secs(20), f))
        .expect("no hang")
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[test]
fn messages_of_every_size_arrive_intact() {
    // Sizes straddle the block, the ring (64 KiB with these options) and the by-reference threshold.
    let sizes = [
        0,
        1,
        63,
        64,
        65,
        4095,
        20_000,
        60_000,
        64 * 1024,
        REF_MIN + 1,
        300_000,
        3 << 20,
    ];
    for spin in [0, 50] {
        pair(opts(2 * 64 * 1024 + 4096, spin), move |rank, link, rt| {
            for (step, &len) in sizes.iter().enumerate() {
                // From a vector (through the ring) and, from REF_MIN, from
                // a shared buffer (by reference).
                for shared in [false, true] {
                    let h = header(2 * step as u32 + u32::from(shared), len);
                    let mut buf = SharedBuffer::new(len.max(1)).unwrap();
                    let out = match shared {
                        true => {
                            buf.as_bytes_mut()[..len].copy_from_slice(&pattern(len, rank as u8));
                            &buf.as_bytes()[..len]
                        }
                        false => &pattern(len, rank as u8)[..],
                    };
                    let mut got = vec![0u8; len];
                    block_on(rt, async {
                        let (s, r) = futures_join(
                            link.send(h, BufRef::from_host(out)),
                            link.recv(h, BufMut::from_host(&mut got)),
                        )
                        .await;
                        s.unwrap();
                        r.unwrap();
                    });
                    assert_eq!(
                        got,
                        pattern(len, 1 - rank as u8),
                        "{len} bytes, shared {shared}"
                    );
                }
            }
        });
    }
}

#[test]
fn recv_reduce_adds_inline_and_by_reference() {
    for (len, shared) in [
        (16usize, false),
        (4096, false),
        (REF_MIN, false),
        (REF_MIN, true),
        (1 << 20, false),
        (1 << 20, true),
    ] {
        pair(opts(1 << 20, 20), move |rank, link, rt| {
            let n = len / 4;
            let values: Vec<u8> = (0..n)
                .flat_map(|i| ((i + rank) as f32).to_le_bytes())
                .collect();
            let mut buf = SharedBuffer::new(len).unwrap();
            buf.as_bytes_mut().copy_from_slice(&values);
            let mine = if shared { buf.as_bytes() } else { &values[..] };
            let h = FrameHeader::data(
                9,
                1,
                0,
                len,
                Fingerprint::new(CollectiveKind::AllReduce, DataType::F32, n),
            );
            let mut acc = vec![0u8; len];
            block_on(rt, async {
                let red = Reduction {
                    op: ReduceOp::Sum,
                    dtype: DataType::F32,
                    local: Some(BufRef::from_host(mine)),
                    kernels: &HOST_KERNELS,
                };
                let (s, r) = futures_join(
                    link.send(h, BufRef::from_host(mine)),
                    link.recv_reduce(h, BufMut::from_host(&mut acc), red),
                )
                .await;
                s.unwrap();
                r.unwrap();
            });
            for (i, c) in acc.chunks(4).enumerate() {
                let v = f32::from_le_bytes(c.try_into().unwrap());
                assert_eq!(v, (2 * i + 1) as f32, "element {i} of {n}");
            }
        });
    }
}

/// A log kept in memory.
#[derive(Clone, Default)]
struct Log(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Log {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A payload in a shared buffer reaches the receiver through its mapping of
/// that buffer (its debug log says it mapped it), copied and reduced alike.
#[test]
fn shared_buffers_go_through_the_receivers_mapping() {
    let log = Log::default();
    let sink = log.clone();
    // The only test here that installs a subscriber (one per process).
    tracing_subscriber::fmt()
        .with_max_level(tracing::Level::DEBUG)
        .with_writer(move || sink.clone())
        .init();
    let len = 1 << 20;
    pair(opts(1 << 20, 20), move |rank, link, rt| {
        let n = len / 4;
        let mut mine = SharedBuffer::new(len).unwrap();
        for (i, x) in mine.as_mut_slice::<f32>().iter_mut().enumerate() {
            *x = (i + rank) as f32;
        }
        let h = |step| {
            let fp = Fingerprint::new(CollectiveKind::AllReduce, DataType::F32, n);
            FrameHeader::data(9, 1, step, len, fp)
        };
        let (mut got, mut acc) = (vec![0u8; len], vec![0u8; len]);
        block_on(rt, async {
            let (s, r) = futures_join(
                link.send(h(0), BufRef::from_host(mine.as_bytes())),
                link.recv(h(0), BufMut::from_host(&mut got)),
            )
            .await;
            s.unwrap();
            r.unwrap();
            let red = Reduction {
                op: ReduceOp::Sum,
                dtype: DataType::F32,
                local: Some(BufRef::from_host(mine.as_bytes())),
                kernels: &HOST_KERNELS,
            };
            let (s, r) = futures_join(
                link.send(h(1), BufRef::from_host(mine.as_bytes())),
                link.recv_reduce(h(1), BufMut::from_host(&mut acc), red),
            )
            .await;
            s.unwrap();
            r.unwrap();
        });
        for i in 0..n {
            let at = |b: &[u8]| f32::from_le_bytes(b[4 * i..4 * i + 4].try_into().unwrap());
            assert_eq!(at(&got), (i + 1 - rank) as f32, "element {i}");
            assert_eq!(at(&acc), (2 * i + 1) as f32, "element {i}");
        }
    });
    let text = String::from_utf8(log.0.lock().unwrap().clone()).unwrap();
    assert_eq!(text.matches("mapped shared buffer").count(), 2, "{text}");
}

#[test]
fn mismatched_header_is_named() {
    let errs = pair(opts(1 << 20, 0), |rank, link, rt| {
        block_on(rt, async {
            if rank == 0 {
                link.send(header(0, 8), BufRef::from_host(&[0; 8]))
                    .await
                    .unwrap();
                None
            } else {
                let other = FrameHeader::data(
                    9,
                    2,
                    0,
                    8,
                    Fingerprint::new(CollectiveKind::AllReduce, DataType::U8, 8),
                );
                Some(
                    link.recv(other, BufMut::from_host(&mut [0; 8]))
                        .await
                        .unwrap_err(),
                )
            }
        })
    });
    assert!(
        matches!(
            errs[1],
            Some(Error::Mismatch {
                rank: 1,
                peer: 0,
                ..
            })
        ),
        "{:?}",
        errs[1]
    );
}

#[test]
fn abort_notice_reaches_a_waiting_receiver() {
    let errs = pair(opts(1 << 20, 0), |rank, link, rt| {
        block_on(rt, async {
            if rank == 0 {
                tokio::time::sleep(Duration::from_millis(50)).await;
                let notice = AbortNotice {
                    failed_rank: 0,
                    reason: "rank 0 gave up".into(),
                };
                link.abort(&notice).await.unwrap();
                None
            } else {
                Some(
                    link.recv(header(0, 8), BufMut::from_host(&mut [0; 8]))
                        .await
                        .unwrap_err(),
                )
            }
        })
    });
    match &errs[1] {
        Some(Error::PeerLost {
            rank: 1,
            peer: 0,
            cause,
            ..
        }) => {
            assert!(cause.contains("gave up"), "{cause}")
        }
        e => panic!("{e:?}"),
    }
}

#[test]
fn a_dropped_peer_fails_a_waiting_sender() {
    // By reference (a shared buffer), and through a ring that fills up.
    for shared in [true, false] {
        let errs = pair(opts(1 << 20, 0), move |rank, link, rt| {
            if rank == 0 {
                // Leave without reading: the send on rank 1 must not wait forever.
                thread::sleep(Duration::from_millis(100));
                drop(link);
                None
            } else {
                let mut buf = SharedBuffer::new(4 << 20).unwrap();
                buf.as_bytes_mut().fill(7);
                let vec = vec![7u8; 4 << 20];
                let data = if shared { buf.as_bytes() } else { &vec[..] };
                Some(
                    block_on(
                        rt,
                        link.send(header(0, data.len()), BufRef::from_host(data)),
                    )
                    .unwrap_err(),
                )
            }
        });
        assert!(
            matches!(
                errs[1],
                Some(Error::PeerLost {
                    rank: 1,
                    peer: 0,
                    ..
                })
            ),
            "shared {shared}: {:?}",
            errs[1]
        );
    }
}

/// Joins two futures (both must make progress: a send may wait for the receive).
async fn futures_join<A: std::future::Future, B: std::future::Future>(
    a: A,
    b: B,
) -> (A::Output, B::Output) {
    tokio::join!(a, b)
}
