//! Loopback throughput and latency of TCP links between two ranks (threads).
//!
//! `cargo run --release -p ccl-transport-tcp --example throughput [MiB] [nsocks...]`
//!
//! For each socket count: a 64 MiB (default) send from rank 0 to rank 1,
//! acknowledged by an empty message (best and median of several), the same
//! with receive-and-reduce (f32 sum) at rank 1, and the round trip of an
//! 8-byte message.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use ccl_core::{
    AlignedBuf, BufMut, BufRef, CollectiveKind, DataType, Fingerprint, FrameHeader, Link, ReduceOp,
    Reduction, Setup, HOST_KERNELS,
};
use ccl_rendezvous::HashStore;
use ccl_transport_tcp::{connect_mesh, TcpOptions};

const ROUNDS: usize = 7;
const PINGS: usize = 20_000;

fn header(seq: u64, len: usize) -> FrameHeader {
    FrameHeader::data(
        1,
        seq,
        0,
        len,
        Fingerprint::new(CollectiveKind::AllReduce, DataType::F32, len / 4).with_op(ReduceOp::Sum),
    )
}

async fn rank_main(
    rank: usize,
    link: Arc<dyn Link>,
    bytes: usize,
) -> Option<(Vec<Duration>, Vec<Duration>, Duration)> {
    let mut buf = AlignedBuf::zeroed(bytes);
    let mut seq = 0u64;
    let mut next = || {
        seq += 1;
        seq
    };
    let mut plain = Vec::new();
    let mut reduced = Vec::new();
    for reduce in [false, true] {
        for _ in 0..ROUNDS {
            let (s_data, s_ack) = (next(), next());
            if rank == 0 {
                let t = Instant::now();
                link.send(header(s_data, bytes), BufRef::from_host(buf.as_slice()))
                    .await
                    .unwrap();
                link.recv(header(s_ack, 0), BufMut::from_host(&mut []))
                    .await
                    .unwrap();
                if reduce { &mut reduced } else { &mut plain }.push(t.elapsed());
            } else {
                if reduce {
                    let red = Reduction {
                        op: ReduceOp::Sum,
                        dtype: DataType::F32,
                        local: None,
                        kernels: &HOST_KERNELS,
                    };
                    link.recv_reduce(
                        header(s_data, bytes),
                        BufMut::from_host(buf.as_mut_slice()),
                        red,
                    )
                    .await
                    .unwrap();
                } else {
                    link.recv(header(s_data, bytes), BufMut::from_host(buf.as_mut_slice()))
                        .await
                        .unwrap();
                }
                link.send(header(s_ack, 0), BufRef::from_host(&[]))
                    .await
                    .unwrap();
            }
        }
    }
    let mut small = [0u8; 8];
    let t = Instant::now();
    for _ in 0..PINGS {
        let (a, b) = (next(), next());
        if rank == 0 {
            link.send(header(a, 8), BufRef::from_host(&small))
                .await
                .unwrap();
            link.recv(header(b, 8), BufMut::from_host(&mut small))
                .await
                .unwrap();
        } else {
            link.recv(header(a, 8), BufMut::from_host(&mut small))
                .await
                .unwrap();
            link.send(header(b, 8), BufRef::from_host(&small))
                .await
                .unwrap();
        }
    }
    let rtt = t.elapsed() / PINGS as u32;
    (rank == 0).then_some((plain, reduced, rtt))
}

fn rate(bytes: usize, mut times: Vec<Duration>) -> String {
    times.sort();
    let mbs = |d: Duration| bytes as f64 / d.as_secs_f64() / 1e6;
    format!(
        "best {:7.0} MB/s, median {:7.0} MB/s",
        mbs(times[0]),
        mbs(times[times.len() / 2])
    )
}

fn main() {
    let mut args = std::env::args().skip(1);
    let mib: usize = args.next().map(|a| a.parse().expect("MiB")).unwrap_or(64);
    let mut socks: Vec<usize> = args.map(|a| a.parse().expect("nsocks")).collect();
    if socks.is_empty() {
        socks = vec![1, 2, 4];
    }
    let bytes = mib << 20;
    for nsocks in socks {
        let store = Arc::new(HashStore::new());
        let opts = TcpOptions {
            nsocks,
            ..TcpOptions::default()
        };
        let results: Vec<_> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..2)
                .map(|rank| {
                    let setup = Setup {
                        rank,
                        world_size: 2,
                        comm: 1,
                        store: store.clone(),
                        timeout: Duration::from_secs(10),
                        secret: None,
                    };
                    let opts = &opts;
                    s.spawn(move || {
                        let rt = tokio::runtime::Builder::new_current_thread()
                            .enable_all()
                            .build()
                            .unwrap();
                        rt.block_on(async {
                            let links = connect_mesh(&setup, opts).await.unwrap();
                            let link = links.into_iter().flatten().next().unwrap();
                            rank_main(rank, link, bytes).await
                        })
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let (plain, reduced, rtt) = results.into_iter().flatten().next().unwrap();
        println!(
            "nsocks {nsocks}: {mib} MiB send:          {}",
            rate(bytes, plain)
        );
        println!(
            "nsocks {nsocks}: {mib} MiB recv_reduce:   {}",
            rate(bytes, reduced)
        );
        println!(
            "nsocks {nsocks}: 8-byte round trip:   {:.1} us",
            rtt.as_secs_f64() * 1e6
        );
    }
}
