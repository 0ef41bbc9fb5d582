//! One rank of ccl's multi-process tests. Joins from torchrun-style variables,
//! runs the scenario named by its first argument, checks every result against
//! values computed here independently of ccl, and exits 0 only if all match.
//!
//! Scenarios: `collectives` (every collective × dtype × op, in-place,
//! out-of-place and async), `split`, `p2p`, `mismatch`, `die VICTIM`,
//! `store-gone DIR`, and more (see `main`). `serve-store` is no rank: it
//! serves a TCP store at `MASTER_ADDR:MASTER_PORT` until it is killed.

use std::{process::exit, time::Instant};

mod calls;
mod checks;
mod shared;

use calls::{Calls, OnDevice};
use ccl::{bf16, f16, Communicator, ReduceOp};
use checks::{check_calls, check_type, Checker};

fn collectives(comm: &Communicator, ck: &mut Checker) {
    let counts = [0, 1, 7, 1031];
    check_type::<i8>(comm, ck, &counts);
    check_type::<u8>(comm, ck, &counts);
    check_type::<i32>(comm, ck, &counts);
    check_type::<u32>(comm, ck, &counts);
    check_type::<i64>(comm, ck, &counts);
    check_type::<u64>(comm, ck, &counts);
    check_type::<f16>(comm, ck, &counts);
    check_type::<bf16>(comm, ck, &counts);
    check_type::<f32>(comm, ck, &counts);
    check_type::<f64>(comm, ck, &counts);
    // Large enough to be cut into many pipelined pieces.
    check_type::<f32>(comm, ck, &[300_007]);
}

/// Every blocking collective on device memory (the GPU of `CCL_TEST_GPU`,
/// 0 by default; the stand-in with `CCL_CUDA_STAND_IN=1`), staged through
/// host memory, checked as on the host; then memory of the wrong kind.
fn device(comm: &Communicator, ck: &mut Checker) {
    let ordinal = std::env::var("CCL_TEST_GPU").map_or(0, |v| v.parse().unwrap_or(0));
    let Some(gpu) = ck.ok("opening the GPU", ccl::cuda::open(ordinal)) else {
        return;
    };
    let Some(stream) = ck.ok("a stream", ccl::cuda::Stream::new(gpu.clone())) else {
        return;
    };
    let dev = OnDevice { comm, stream };
    let counts = [0, 1, 7, 1031];
    check_calls::<i8>(&dev, ck, &counts);
    check_calls::<u8>(&dev, ck, &counts);
    check_calls::<i32>(&dev, ck, &counts);
    check_calls::<u32>(&dev, ck, &counts);
    check_calls::<i64>(&dev, ck, &counts);
    check_calls::<u64>(&dev, ck, &counts);
    check_calls::<f16>(&dev, ck, &counts);
    check_calls::<bf16>(&dev, ck, &counts);
    check_calls::<f32>(&dev, ck, &counts);
    check_calls::<f64>(&dev, ck, &counts);
    // Many chunks in flight (with a small CCL_CUDA_CHUNK).
    check_calls::<f32>(&dev, ck, &[300_007]);
    device_transfers::<u32>(&dev, ck);
    device_transfers::<i8>(&dev, ck);
    device_transfers::<f64>(&dev, ck);
    // What a receive through GPUDirect RDMA calls before the caller's
    // stream may read what the NIC wrote: on a GPU, the driver's flush.
    ck.ok(
        "flushing a NIC's writes to the GPU",
        gpu.flush_remote_writes(),
    );
    // Host memory passed as device memory: refused, naming the call.
    let sum = ccl::Collective::new(ccl::CollectiveKind::AllReduce, ccl::DataType::F32, 4);
    let mut host = [0f32; 4];
    let kind = ccl::MemoryKind::Device { ordinal };
    let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut host);
    // SAFETY: refused before it is touched.
    let e = unsafe {
        comm.launch_on_stream(
            &sum,
            ccl::BufRef::from_raw(kind, bytes.as_ptr(), 16),
            ccl::BufMut::from_raw(kind, bytes.as_mut_ptr(), 16),
            &dev.stream,
        )
    }
    .wait();
    match e {
        Err(ccl::Error::InvalidArgument(m)) if m.contains("driver says it is host memory") => {
            ck.checks += 1
        }
        other => ck.fail(format!("host memory passed as device memory: {other:?}")),
    }
    println!("device: {}", gpu.name());
}

/// Send and receive between device buffers: each rank sends to its right
/// and receives from its left, both queued before either is waited for.
fn device_transfers<T: checks::TestElem>(dev: &OnDevice, ck: &mut Checker) {
    let (r, n) = (dev.comm.rank(), dev.comm.world_size());
    if n == 1 {
        return;
    }
    let (right, left) = ((r + 1) % n, (r + n - 1) % n);
    let value = |from: usize, i: usize| T::from_i64(((from * 31 + i) % 100) as i64);
    for c in [0usize, 1, 1031, 300_007] {
        let mine: Vec<T> = (0..c).map(|i| value(r, i)).collect();
        let mut got = vec![T::from_i64(0); c];
        ck.ok(
            "device send and recv",
            dev.exchange(&mine, right, &mut got, left),
        );
        let what = format!("device ring exchange of {c} {}", T::DTYPE);
        ck.vec(&what, &got, |i| value(left, i), c);
        // One way, each call alone on its stream: rank 0 to the last.
        let last = n - 1;
        if r == 0 {
            ck.ok("device send", dev.send(&mine, last));
        } else if r == last {
            let mut got = vec![T::from_i64(0); c];
            ck.ok("device recv", dev.recv(&mut got, 0));
            let what = format!("device send of {c} {} from rank 0", T::DTYPE);
            ck.vec(&what, &got, |i| value(0, i), c);
        }
    }
}

/// Collectives and transfers on cudarc's slices and stream, on CUDA device
/// 0: a real GPU only (cudarc cannot drive the stand-in).
fn cudarc_checks(comm: &Communicator, ck: &mut Checker) {
    use ccl::{cuda::cudarc::driver::CudaContext, Collective, CollectiveKind, DataType};
    // ccl::cuda::open checks for the driver first: cudarc would panic without one.
    if ck.ok("opening the GPU", ccl::cuda::open(0)).is_none() {
        return;
    }
    let cuda = |e: ccl::cuda::cudarc::driver::DriverError| ccl::Error::Internal(e.to_string());
    let Some(ctx) = ck.ok("cudarc's context", CudaContext::new(0).map_err(cuda)) else {
        return;
    };
    let Some(stream) = ck.ok("a cudarc stream", ctx.new_stream().map_err(cuda)) else {
        return;
    };
    let (r, n) = (comm.rank(), comm.world_size());
    let count = 1 << 20;
    let host: Vec<f32> = (0..count).map(|i| (r + i % 7) as f32).collect();
    let Some(mut buf) = ck.ok("upload", stream.clone_htod(&host).map_err(cuda)) else {
        return;
    };
    let sum = Collective::new(CollectiveKind::AllReduce, DataType::F32, 0).with_op(ReduceOp::Sum);
    ck.ok(
        "cudarc allreduce",
        comm.launch_in_place_on_cudarc(sum, &mut buf, &stream)
            .wait(),
    );
    if let Some(back) = ck.ok("download", stream.clone_dtoh(&buf).map_err(cuda)) {
        let want = |i: usize| (n * (n - 1) / 2 + n * (i % 7)) as f32;
        ck.vec("cudarc allreduce in place", &back, want, count);
    }
    let mine = stream.clone_htod(&vec![r as i64; 1000]).map_err(cuda);
    let all = stream.alloc_zeros::<i64>(1000 * n).map_err(cuda);
    if let (Some(mine), Some(mut all)) = (ck.ok("upload", mine), ck.ok("alloc", all)) {
        let gather = Collective::new(CollectiveKind::AllGather, DataType::I64, 0);
        ck.ok(
            "cudarc allgather",
            comm.launch_on_cudarc(gather, &mine, &mut all, &stream)
                .wait(),
        );
        if let Some(back) = ck.ok("download", stream.clone_dtoh(&all).map_err(cuda)) {
            ck.vec("cudarc allgather", &back, |i| (i / 1000) as i64, 1000 * n);
        }
    }
    if n > 1 && (r == 0 || r == n - 1) {
        let data: Vec<f64> = (0..count).map(|i| i as f64).collect();
        if r == 0 {
            if let Some(out) = ck.ok("upload", stream.clone_htod(&data).map_err(cuda)) {
                ck.ok(
                    "cudarc send",
                    comm.launch_send_on_cudarc(n - 1, &out, &stream).wait(),
                );
            }
        } else if let Some(mut into) =
            ck.ok("alloc", stream.alloc_zeros::<f64>(count).map_err(cuda))
        {
            ck.ok(
                "cudarc recv",
                comm.launch_recv_on_cudarc(0, &mut into, &stream).wait(),
            );
            if let Some(back) = ck.ok("download", stream.clone_dtoh(&into).map_err(cuda)) {
                ck.vec("cudarc send and recv", &back, |i| i as f64, count);
            }
        }
    }
    println!("cudarc: {}", ctx.name().unwrap_or_default());
}

fn p2p(comm: &Communicator, ck: &mut Checker) {
    let (r, n) = (comm.rank(), comm.world_size());
    if n == 1 {
        return;
    }
    for c in [0usize, 1, 1000, 2_000_003] {
        let right = (r + 1) % n;
        let left = (r + n - 1) % n;
        let mine: Vec<u32> = (0..c).map(|i| (r * 1000 + i) as u32).collect();
        let w = comm.isend(mine.clone(), right);
        let mut got = vec![0u32; c];
        ck.ok("recv", comm.recv(&mut got, left));
        ck.ok("isend", w.wait());
        ck.vec(
            &format!("ring exchange count {c}"),
            &got,
            |i| (left * 1000 + i) as u32,
            c,
        );
        let w = comm.irecv(vec![0u32; c], left);
        ck.ok("send", comm.send(&mine, right));
        if let Some(x) = ck.ok("irecv", w.wait()) {
            ck.vec(
                &format!("irecv count {c}"),
                &x,
                |i| (left * 1000 + i) as u32,
                c,
            );
        }
    }
}

fn split(comm: &Communicator, ck: &mut Checker) {
    let (r, n) = (comm.rank(), comm.world_size());
    // The last rank joins no group; the others split by parity, ordered by descending rank.
    let color = if r == n - 1 && n > 1 {
        None
    } else {
        Some((r % 2) as u32)
    };
    let sub = ck.ok("split", comm.split(color, -(r as i64))).flatten();
    match (color, sub) {
        (None, None) => {}
        (None, Some(_)) => ck.fail("rank with no color got a communicator".into()),
        (Some(_), None) => ck.fail("split returned no communicator".into()),
        (Some(col), Some(sub)) => {
            let mut members: Vec<usize> = (0..n)
                .filter(|&p| (p % 2) as u32 == col && !(p == n - 1 && n > 1))
                .collect();
            members.reverse();
            let want_rank = members.iter().position(|&p| p == r).unwrap();
            ck.checks += 1;
            if sub.rank() != want_rank || sub.world_size() != members.len() {
                ck.fail(format!(
                    "split: rank {} of {}, want {want_rank} of {}",
                    sub.rank(),
                    sub.world_size(),
                    members.len()
                ));
            }
            let mut v = vec![r as u64; 5];
            if ck
                .ok("allreduce on split", sub.allreduce(&mut v, ReduceOp::Sum))
                .is_some()
            {
                let s: u64 = members.iter().map(|&p| p as u64).sum();
                ck.vec("allreduce on split", &v, |_| s, 5);
            }
            let mut b = vec![r as i32; 3];
            if ck
                .ok("broadcast on split", sub.broadcast(&mut b, 0))
                .is_some()
            {
                ck.vec("broadcast on split", &b, |_| members[0] as i32, 3);
            }
        }
    }
    // The parent still works, and a group made with new_group too.
    let mut v = vec![1u8; 3];
    if ck
        .ok(
            "allreduce on parent after split",
            comm.allreduce(&mut v, ReduceOp::Sum),
        )
        .is_some()
    {
        ck.vec("allreduce on parent after split", &v, |_| n as u8, 3);
    }
    let evens: Vec<usize> = (0..n).step_by(2).collect();
    let g = ck.ok("new_group", comm.new_group(&evens)).flatten();
    ck.checks += 1;
    if g.is_some() != (r % 2 == 0) {
        ck.fail("new_group membership".into());
    }
    if let Some(g) = g {
        let mut x = vec![1i64; 2];
        if ck
            .ok("allreduce on new_group", g.allreduce(&mut x, ReduceOp::Sum))
            .is_some()
        {
            ck.vec("allreduce on new_group", &x, |_| evens.len() as i64, 2);
        }
    }
}

/// A store that outlives jobs: serves `MASTER_ADDR:MASTER_PORT` (with
/// `CCL_JOB_SECRET` if set), prints `serving`, and runs until killed.
fn serve_store() -> ! {
    let var = |k: &str| std::env::var(k).unwrap_or_default();
    let addr = format!("{}:{}", var("MASTER_ADDR"), var("MASTER_PORT"));
    let secret = std::env::var("CCL_JOB_SECRET")
        .ok()
        .map(|s| ccl::JobSecret::new(&s).expect("CCL_JOB_SECRET"));
    let addr = addr.parse().expect("MASTER_ADDR:MASTER_PORT");
    let _server =
        ccl::TcpStoreServer::bind_with_secret(addr, secret.as_ref()).unwrap_or_else(|e| {
            eprintln!("serve-store: {e}");
            exit(3)
        });
    println!("serving");
    loop {
        std::thread::park();
    }
}

/// Ranks 0 and 1 send rank 2 small messages and exit at once, without
/// dropping their communicators; rank 2 takes them only once rank 1's
/// process is gone (returning credits to it then), and a receive that still
/// needs rank 1 fails, saying that it left.
fn leave(comm: &Communicator, ck: &mut Checker) {
    const MESSAGES: u32 = 12;
    let me = std::process::id();
    match comm.rank() {
        0 => {
            ck.ok("send before leaving", comm.send(&[me, 0], 2));
        }
        1 => {
            for i in 0..MESSAGES {
                ck.ok("send before leaving", comm.send(&[me, i], 2));
            }
        }
        _ => {
            let mut got = [0u32; 2];
            if ck
                .ok("receive from rank 1", comm.recv(&mut got, 1))
                .is_none()
            {
                return;
            }
            let gone = |pid: u32| match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
                Ok(stat) => stat
                    .rsplit(')')
                    .next()
                    .is_some_and(|s| s.trim_start().starts_with('Z')),
                Err(_) => true,
            };
            let until = Instant::now() + std::time::Duration::from_secs(20);
            while !gone(got[0]) {
                if Instant::now() > until {
                    return ck.fail(format!("rank 1 (pid {}) did not exit", got[0]));
                }
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            let pid = got[0];
            for i in 1..MESSAGES {
                if ck
                    .ok("receive after rank 1 left", comm.recv(&mut got, 1))
                    .is_some()
                {
                    ck.vec("message from rank 1", &got, |j| [pid, i][j], 2);
                }
            }
            if ck
                .ok("receive after rank 0 left", comm.recv(&mut got, 0))
                .is_some()
            {
                ck.vec("message from rank 0", &got[1..], |_| 0, 1);
            }
            match comm.recv(&mut got, 1) {
                Err(e) if e.to_string().contains("rank 1 closed its communicator") => {
                    ck.checks += 1
                }
                other => ck.fail(format!("a receive from rank 1 after it left: {other:?}")),
            }
        }
    }
}

/// Waits up to a minute for `path` to exist.
fn await_file(path: &std::path::Path) -> bool {
    let until = Instant::now() + std::time::Duration::from_secs(60);
    while !path.exists() {
        if Instant::now() > until {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    true
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let scenario = args.get(1).map(String::as_str).unwrap_or("collectives");
    if scenario == "serve-store" {
        serve_store();
    }
    let started = Instant::now();
    let comm = match Communicator::from_env() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("init failed: {e}");
            exit(3);
        }
    };
    let mut ck = Checker {
        rank: comm.rank(),
        failures: 0,
        checks: 0,
    };
    match scenario {
        "collectives" => collectives(&comm, &mut ck),
        "shared" => shared::shared(&comm, &mut ck),
        "p2p" => p2p(&comm, &mut ck),
        "device" => device(&comm, &mut ck),
        "modelled-allreduce" => {
            // One allreduce of COUNT f32 on the simulated RDMA fabric, timed
            // by its modelled clock (no wall clock): prints both ends.
            let count: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(1 << 24);
            let mut buf = vec![1.0f32; count];
            ck.ok("warm-up", comm.barrier());
            let t0 = ccl_transport_rdma::sim::modelled_ns();
            ck.ok("allreduce", comm.allreduce(&mut buf, ReduceOp::Sum));
            let t1 = ccl_transport_rdma::sim::modelled_ns();
            let n = comm.world_size() as f32;
            ck.vec("modelled allreduce", &buf, |_| n, count);
            println!("modelled {t0} {t1}");
        }
        "split" => split(&comm, &mut ck),
        "mismatch" => {
            // Rank 0 makes a call that differs from the others' in `what`.
            let what = args.get(2).map(String::as_str).unwrap_or("count");
            let len = if args.get(3).map(String::as_str) == Some("large") {
                1 << 20
            } else {
                10
            };
            let odd = comm.rank() == 0;
            let floats = |extra: usize| vec![1.0f32; len + extra];
            let r = match what {
                "count" => comm.allreduce(&mut floats(usize::from(odd)), ReduceOp::Sum),
                "dtype" if odd => comm.allreduce(&mut vec![1i32; len], ReduceOp::Sum),
                "dtype" => comm.allreduce(&mut floats(0), ReduceOp::Sum),
                "op" if odd => comm.allreduce(&mut floats(0), ReduceOp::Max),
                "op" => comm.allreduce(&mut floats(0), ReduceOp::Sum),
                "root" => comm.broadcast(&mut floats(0), usize::from(odd)),
                "kind" if odd => comm.broadcast(&mut floats(0), 0),
                "kind" => comm.allreduce(&mut floats(0), ReduceOp::Sum),
                other => {
                    eprintln!("unknown mismatch {other}");
                    exit(2);
                }
            };
            // A broadcast's root that reads nothing of the others may
            // complete, as over links its sends may; it learns at its next
            // call, from the ranks that failed.
            let root_alone = what == "kind" && odd;
            match r {
                Ok(()) if root_alone => match comm.barrier() {
                    Err(e @ ccl::Error::PeerLost { .. }) => {
                        println!("rank {} completed its call, the next failed: {e}", comm.rank())
                    }
                    other => ck.fail(format!(
                        "after the others' mismatch the next call must fail naming one, got {other:?}"
                    )),
                },
                Ok(()) => ck.fail(format!("allreduce with mismatched {what} succeeded")),
                Err(e) => {
                    println!("rank {} error: {e}", comm.rank());
                    match comm.barrier() {
                        Err(ccl::Error::Broken { .. }) => {}
                        other => ck.fail(format!(
                            "after an error the communicator must be broken, got {other:?}"
                        )),
                    }
                }
            }
        }
        "cudarc" => cudarc_checks(&comm, &mut ck),
        "device-mismatch" => {
            // Rank 0's device allreduce differs from the others' in `what`.
            let what = args.get(2).map(String::as_str).unwrap_or("count");
            let Some(gpu) = ck.ok("opening the GPU", ccl::cuda::open(0)) else {
                exit(1);
            };
            let Some(stream) = ck.ok("a stream", ccl::cuda::Stream::new(gpu)) else {
                exit(1);
            };
            let dev = OnDevice {
                comm: &comm,
                stream,
            };
            let odd = comm.rank() == 0;
            let mut floats = vec![1.0f32; 1000 + usize::from(odd && what == "count")];
            let r = match what {
                "dtype" if odd => dev.allreduce(&mut vec![1i32; 1000], ReduceOp::Sum),
                "op" if odd => dev.allreduce(&mut floats, ReduceOp::Max),
                "count" | "dtype" | "op" => dev.allreduce(&mut floats, ReduceOp::Sum),
                other => {
                    eprintln!("unknown mismatch {other}");
                    exit(2);
                }
            };
            match r {
                Ok(()) => ck.fail(format!("device allreduce with mismatched {what} succeeded")),
                Err(e) => println!("rank {} error: {e}", comm.rank()),
            }
        }
        "killed" => {
            // One rank is SIGKILLed at a point the seed picks while every rank
            // repeats a collective; the others must fail naming it.
            let seed: u64 = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(0);
            let pick = |salt: u64, m: u64| {
                (seed.wrapping_add(salt).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 33) % m
            };
            let n = comm.world_size();
            let victim = pick(1, n as u64) as usize;
            let len = [16usize, 64 << 10, 4 << 20][pick(2, 3) as usize];
            let which = pick(3, 3);
            let delay = std::time::Duration::from_millis(5 + pick(4, 150));
            ck.ok("warm-up", comm.barrier());
            if comm.rank() == victim {
                std::thread::spawn(move || {
                    std::thread::sleep(delay);
                    let _ = nix::sys::signal::kill(
                        nix::unistd::Pid::this(),
                        nix::sys::signal::Signal::SIGKILL,
                    );
                });
            }
            println!("victim {victim}, {len} floats, collective {which}, after {delay:?}");
            let mut buf = vec![1.0f32; len];
            let mut out = vec![0.0f32; len * n];
            loop {
                let r = match which {
                    0 => comm.allreduce(&mut buf, ReduceOp::Sum),
                    1 => comm.broadcast(&mut buf, (victim + 1) % n),
                    _ => comm.allgather_into(&buf, &mut out),
                };
                if let Err(e) = r {
                    println!(
                        "rank {} error after {:?}: {e}",
                        comm.rank(),
                        started.elapsed()
                    );
                    break;
                }
                buf.fill(1.0);
                if started.elapsed() > std::time::Duration::from_secs(60) {
                    ck.fail("no error a minute after the kill".into());
                    break;
                }
            }
        }
        "large" => {
            // Messages far above the shared-memory by-reference threshold.
            let (n, r) = (comm.world_size(), comm.rank());
            let len = 1usize << 20;
            let mut v = vec![(r + 1) as f32; len];
            if ck
                .ok("large allreduce", comm.allreduce(&mut v, ReduceOp::Sum))
                .is_some()
            {
                let want = (n * (n + 1) / 2) as f32;
                ck.vec("large allreduce", &v, |_| want, len);
            }
            let mut b: Vec<f32> = (0..len)
                .map(|i| if r == 0 { (i % 1000) as f32 } else { -1.0 })
                .collect();
            if ck
                .ok("large broadcast", comm.broadcast(&mut b, 0))
                .is_some()
            {
                ck.vec("large broadcast", &b, |i| (i % 1000) as f32, len);
            }
            let mine: Vec<f32> = (0..len).map(|i| (r * len + i) as f32).collect();
            let mut all = vec![0.0f32; len * n];
            if ck
                .ok("large allgather", comm.allgather_into(&mine, &mut all))
                .is_some()
            {
                ck.vec("large allgather", &all, |i| i as f32, len * n);
            }
            // Blocks of 256 KiB: over a shared-memory board every rank reads
            // them straight out of the others' buffers (where the kernel
            // allows cross-memory attach).
            let block = 64usize << 10;
            let blocks: Vec<f32> = (0..block * n).map(|i| (r * block * n + i) as f32).collect();
            let from = |src: usize, b: usize, i: usize| (src * block * n + b * block + i) as f32;
            let mut got = vec![0.0f32; block * n];
            if ck
                .ok(
                    "all-to-all of 256 KiB blocks",
                    comm.alltoall_into(&blocks, &mut got),
                )
                .is_some()
            {
                ck.vec(
                    "all-to-all of 256 KiB blocks",
                    &got,
                    |i| from(i / block, r, i % block),
                    block * n,
                );
            }
            let mut got = blocks.clone();
            if ck
                .ok(
                    "all-to-all in place of 256 KiB blocks",
                    comm.alltoall(&mut got),
                )
                .is_some()
            {
                ck.vec(
                    "all-to-all in place of 256 KiB blocks",
                    &got,
                    |i| from(i / block, r, i % block),
                    block * n,
                );
            }
            let mut got = vec![0.0f32; block * n];
            if ck
                .ok(
                    "allgather of 256 KiB blocks",
                    comm.allgather_into(&blocks[..block], &mut got),
                )
                .is_some()
            {
                ck.vec(
                    "allgather of 256 KiB blocks",
                    &got,
                    |i| from(i / block, 0, i % block),
                    block * n,
                );
            }
            let root = n - 1;
            let mut got = vec![0.0f32; if r == root { block * n } else { 0 }];
            if ck
                .ok(
                    "gather of 256 KiB blocks",
                    comm.gather_into(&blocks[..block], &mut got, root),
                )
                .is_some()
            {
                let want = if r == root { block * n } else { 0 };
                ck.vec(
                    "gather of 256 KiB blocks",
                    &got,
                    |i| from(i / block, 0, i % block),
                    want,
                );
            }
            let mut got = vec![0.0f32; block];
            if ck
                .ok(
                    "scatter of 256 KiB blocks",
                    comm.scatter_into(&blocks, &mut got, root),
                )
                .is_some()
            {
                ck.vec(
                    "scatter of 256 KiB blocks",
                    &got,
                    |i| from(root, r, i),
                    block,
                );
            }
        }
        "send-then-exit" => {
            // Rank 0 sends and exits at once, without dropping its
            // communicator; the last rank receives a second later. Over
            // QUIC the data may still be in rank 0's quinn buffers when it
            // calls exit: its exit hook must deliver it.
            let (r, n) = (comm.rank(), comm.world_size());
            let len = 8usize << 20;
            if r == 0 {
                let data: Vec<u32> = (0..len as u32).collect();
                ck.ok("send before exit", comm.send(&data, n - 1));
                println!("rank 0: {} checks, {} failures", ck.checks, ck.failures);
                exit(if ck.failures == 0 { 0 } else { 1 });
            }
            if r == n - 1 {
                std::thread::sleep(std::time::Duration::from_secs(1));
                let mut got = vec![0u32; len];
                if ck
                    .ok("recv from an exited rank", comm.recv(&mut got, 0))
                    .is_some()
                {
                    ck.vec("recv from an exited rank", &got, |i| i as u32, len);
                }
            }
        }
        "repeat" => {
            // Allreduces until one fails (a link is cut from outside), then
            // prints the error. With a DIR, rank 0 writes DIR/ready once the
            // first call succeeded, so that the cut comes after set-up.
            let ready = args.get(2).map(|d| std::path::Path::new(d).join("ready"));
            let mut v = vec![1.0f32; 256 << 10];
            loop {
                if let Err(e) = comm.allreduce(&mut v, ReduceOp::Sum) {
                    println!(
                        "rank {} error after {:?}: {e}",
                        comm.rank(),
                        started.elapsed()
                    );
                    break;
                }
                if let Some(ready) = ready.as_ref().filter(|r| comm.rank() == 0 && !r.exists()) {
                    std::fs::write(ready, b"").expect("DIR/ready");
                }
                v.fill(1.0);
                if started.elapsed() > std::time::Duration::from_secs(120) {
                    ck.fail("no error within two minutes".into());
                    break;
                }
            }
        }
        "leave" => leave(&comm, &mut ck),
        "slow" => {
            // The last rank arrives late (within the deadline) at every call.
            let n = comm.world_size();
            for len in [8usize, 1 << 20] {
                if comm.rank() == n - 1 {
                    std::thread::sleep(std::time::Duration::from_millis(1500));
                }
                let mut v = vec![(comm.rank() + 1) as f32; len];
                if ck
                    .ok("slow allreduce", comm.allreduce(&mut v, ReduceOp::Sum))
                    .is_some()
                {
                    let want = (n * (n + 1) / 2) as f32;
                    ck.vec("slow allreduce", &v, |_| want, len);
                }
            }
        }
        "store-gone" => {
            // The store (served elsewhere) is killed once every rank is set
            // up: rank 0 says so in DIR/ready, the test kills the store and
            // says so in DIR/killed. Collectives must go on; then the last
            // rank dies, and the others must still name it.
            let dir = std::path::PathBuf::from(args.get(2).expect("store-gone DIR"));
            let (r, n) = (comm.rank(), comm.world_size());
            ck.ok("barrier after set-up", comm.barrier());
            if r == 0 {
                std::fs::write(dir.join("ready"), b"").expect("DIR/ready");
            }
            if !await_file(&dir.join("killed")) {
                ck.fail("the store was not killed within a minute".into());
            }
            for len in [4usize, 1 << 20] {
                let mut v = vec![(r + 1) as f32; len];
                if ck
                    .ok(
                        "allreduce without a store",
                        comm.allreduce(&mut v, ReduceOp::Sum),
                    )
                    .is_some()
                {
                    let want = (n * (n + 1) / 2) as f32;
                    ck.vec("allreduce without a store", &v, |_| want, len);
                }
            }
            ck.ok("barrier without a store", comm.barrier());
            if r == n - 1 {
                exit(7);
            }
            let mut v = vec![1.0f32; 1 << 20];
            loop {
                if let Err(e) = comm.allreduce(&mut v, ReduceOp::Sum) {
                    println!("rank {r} error after {:?}: {e}", started.elapsed());
                    break;
                }
                if started.elapsed() > std::time::Duration::from_secs(60) {
                    ck.fail("no error a minute after the last rank died".into());
                    break;
                }
            }
        }
        "die" => {
            let victim: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(0);
            // Warm up so that everything is connected, then the victim dies mid-collective.
            ck.ok("warm-up", comm.barrier());
            // "small": a message the shared-memory board carries, which the
            // victim never joins (its part would be posted at once); else a
            // large one (128 MiB), which the victim leaves 2 ms after it
            // started it, once a call of that size has run. Its progress
            // thread goes on while it sleeps, so the delay must be shorter
            // than any whole call, however fast the machine or however slow
            // the calls before it were: no CPU moves a rank's 128 MiB in and
            // out (a copy of at least 256 MiB) in 2 ms.
            let small = args.get(3).map(String::as_str) == Some("small");
            // "exit": the victim calls `exit`, whose hooks (a transport's
            // teardown) run while its communicator's threads go on, as in a
            // program that exits mid-collective; else it ends as a crash does.
            let by_exit = args.get(4).map(String::as_str) == Some("exit");
            let end = |code| {
                if by_exit {
                    exit(code)
                } else {
                    die(code)
                }
            };
            if small && comm.rank() == victim {
                std::thread::sleep(std::time::Duration::from_millis(20));
                end(7);
            }
            let len = if small { 2 } else { 32 << 20 };
            let buf = vec![1.0f32; len];
            if !small {
                let mut first = buf.clone();
                ck.ok(
                    "allreduce before the death",
                    comm.allreduce(&mut first, ReduceOp::Sum),
                );
            }
            let w = comm.iallreduce(buf, ReduceOp::Sum);
            if comm.rank() == victim {
                std::thread::sleep(std::time::Duration::from_millis(2));
                end(7);
            }
            match w.wait() {
                Ok(_) => ck.fail("allreduce with a dead rank succeeded".into()),
                Err(e) => println!(
                    "rank {} error after {:?}: {e}",
                    comm.rank(),
                    started.elapsed()
                ),
            }
        }
        other => {
            eprintln!("unknown scenario {other}");
            exit(2);
        }
    }
    if std::env::var_os("CCL_RDMA_SIM").is_some() {
        let c = ccl_transport_rdma::COUNTERS.get();
        println!(
            "rdma: eager {} zero-copy sent {} received {} of GPU memory {} \
             waits slept {} woken {} napped {}",
            c.eager_bytes,
            c.zero_copy_sent,
            c.zero_copy_received,
            c.device_bytes,
            c.sleeps,
            c.wakeups,
            c.naps
        );
    }
    println!(
        "rank {}: {} checks, {} failures, {:?}",
        ck.rank,
        ck.checks,
        ck.failures,
        started.elapsed()
    );
    exit(if ck.failures == 0 { 0 } else { 1 });
}

/// Ends the process at once with `code`, as a crash would: no exit
/// handlers run while the communicator's threads go on (`exit` runs them,
/// and a transport's teardown there could reach the peers first).
fn die(code: i32) -> ! {
    // SAFETY: _exit ends the process without touching its state.
    unsafe { libc::_exit(code) }
}
