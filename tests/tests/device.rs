//! Collectives on GPU memory. Without a GPU (here, CI) they run on the
//! host stand-in (`CCL_CUDA_STAND_IN=1`: device memory that is host memory
//! tagged as a GPU's, streams that are threads), which exercises the whole
//! staging pipeline, the stream ordering and the checks across real
//! processes and links; asking for CUDA must fail with an error that names
//! the driver library. With `CCL_REQUIRE_CUDA=1` (a GPU machine) the same
//! checks run on CUDA device 0 and any failure to open it fails the test.

use std::{
    sync::{
        atomic::{AtomicU32, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use ccl::{
    cuda::{Gpu, StandInGpu, Stream},
    BufMut, BufRef, Collective, CollectiveKind, DataType, Error, MemoryKind, Options, ReduceOp,
    Scratch,
};
use ccl_tests::{assert_all_ok, launch, with_ranks};

const WORKER: &str = env!("CARGO_BIN_EXE_ccl-test-worker");

fn require_cuda() -> bool {
    std::env::var("CCL_REQUIRE_CUDA").is_ok_and(|v| v == "1")
}

/// Runs the worker's device checks on `n` ranks with `env` (plus the
/// stand-in, small chunks, and the logs that tell the path taken); returns
/// whether the ranks used CUDA IPC.
fn device_checks(n: usize, env: &[(&'static str, &str)]) -> bool {
    let mut vars: Vec<(&str, String)> = vec![
        ("CCL_CUDA_STAND_IN", "1".into()),
        ("CCL_CUDA_CHUNK", "4096".into()),
        ("CCL_CUDA_IPC_CHUNK", "4096".into()),
        ("CCL_TIMEOUT", "60s".into()),
        ("CCL_DEBUG", "info".into()),
    ];
    vars.extend(env.iter().map(|&(k, v)| (k, v.to_string())));
    let what = format!("device collectives, {n} ranks, {env:?}");
    let out = launch(WORKER, &["device"], n, &vars, Duration::from_secs(300));
    assert_all_ok(&out, &what);
    for o in &out {
        assert!(o.stdout.contains("stand-in GPU 0"), "{what}: {}", o.stdout);
        assert!(o.stdout.contains(" 0 failures"), "{what}: {}", o.stdout);
    }
    let ipc = out
        .iter()
        .filter(|o| o.stderr.contains("through CUDA IPC"))
        .count();
    assert!(ipc == 0 || ipc == n, "{what}: only {ipc} ranks used IPC");
    if env.contains(&("CCL_CUDA_IPC", "0")) {
        let gpu_reduce = env.contains(&("CCL_CUDA_STAGED_GPU_REDUCE", "1"));
        for o in &out {
            // With CCL_CUDA_STAGED_GPU_REDUCE=1, staged allreduces, reduces
            // and reduce-scatters reduce on the GPU: hundreds of calls (4
            // counts x 10 types x ops x forms); else none does.
            let on_gpu = o.stderr.matches("staged, reduced on the GPU").count();
            match gpu_reduce {
                true => assert!(on_gpu >= 300, "{what}: {on_gpu} reduced on the GPU"),
                false => assert_eq!(on_gpu, 0, "{what}"),
            }
        }
    }
    if env.contains(&("CCL_CUDA_IPC_DIRECT", "0")) {
        for o in &out {
            let direct = o.stderr.matches("between the ranks' own buffers").count();
            // Every allreduce but the pre-multiplied sums': 4 counts x 10
            // types x (2 forms x ops), and the large one.
            assert!(direct >= 100, "{what}: {direct} direct allreduces");
        }
    }
    ipc == n
}

/// Every collective × dtype × op, in place and out of place, on stand-in
/// device memory through CUDA IPC (every rank on one host), many chunks each.
#[test]
fn every_collective_on_device_memory_through_ipc() {
    for n in [1, 2, 3, 4] {
        assert!(
            device_checks(n, &[]),
            "{n} ranks of one host did not use IPC"
        );
    }
}

/// Allreduces through IPC between the ranks' own buffers (every size here),
/// each buffer mapped by the peers, in place and out of place.
#[test]
fn allreduces_through_ipc_between_the_ranks_own_buffers() {
    for n in [2, 3] {
        let env = [
            ("CCL_CUDA_IPC_DIRECT", "0"),
            ("CCL_DEBUG", "info,ccl::device=debug"),
        ];
        assert!(device_checks(n, &env), "{n} ranks did not use IPC");
    }
}

/// The same through pinned host staging: forced (`CCL_CUDA_IPC=0`), over
/// shared memory and TCP, the reductions on the host or on the GPU.
#[test]
fn every_collective_on_device_memory_through_host_staging() {
    let cases = [
        (2, "shm", "0"),
        (3, "shm", "1"),
        (4, "shm", "0"),
        (4, "shm", "1"),
        (2, "tcp", "1"),
        (3, "tcp", "0"),
    ];
    for (n, transport, gpu_reduce) in cases {
        let env = [
            ("CCL_CUDA_IPC", "0"),
            ("CCL_TRANSPORT", transport),
            ("CCL_CUDA_STAGED_GPU_REDUCE", gpu_reduce),
            ("CCL_DEBUG", "info,ccl::device=debug"),
        ];
        assert!(!device_checks(n, &env), "IPC despite CCL_CUDA_IPC=0");
    }
}

/// Ranks on two hosts (`CCL_HOST_ID`) stage through host memory by themselves.
#[test]
fn device_calls_across_hosts_stage_through_host_memory() {
    let out = ccl_tests::launch_each(
        WORKER,
        &["device"],
        3,
        |rank| {
            vec![
                ("CCL_CUDA_STAND_IN", "1".into()),
                ("CCL_CUDA_CHUNK", "4096".into()),
                ("CCL_HOST_ID", format!("host{}", rank % 2)),
                ("CCL_CUDA_STAGED_GPU_REDUCE", "1".into()),
                ("CCL_TIMEOUT", "60s".into()),
                ("CCL_DEBUG", "info".into()),
            ]
        },
        Duration::from_secs(300),
    );
    assert_all_ok(&out, "device collectives on two hosts");
    for o in &out {
        assert!(o.stdout.contains(" 0 failures"), "{}", o.stdout);
        assert!(!o.stderr.contains("through CUDA IPC"), "{}", o.stderr);
    }
}

/// The same checks on CUDA device 0, 1 to 4 ranks sharing it, through IPC
/// and through forced staging. Runs where `CCL_REQUIRE_CUDA=1` says there
/// is a GPU.
#[test]
fn every_collective_on_a_real_gpu() {
    if !require_cuda() {
        eprintln!("skipped: no GPU here (CCL_REQUIRE_CUDA=1 runs this on CUDA device 0)");
        return;
    }
    for ipc in ["1", "0"] {
        for n in [1, 2, 3, 4] {
            let env = [
                ("CCL_TIMEOUT", "120s".to_string()),
                ("CCL_CUDA_IPC", ipc.to_string()),
            ];
            let out = launch(WORKER, &["device"], n, &env, Duration::from_secs(600));
            assert_all_ok(
                &out,
                &format!("device collectives on CUDA, {n} ranks, IPC {ipc}"),
            );
            for o in &out {
                assert!(o.stdout.contains("CUDA device 0"), "{}", o.stdout);
                assert!(o.stdout.contains(" 0 failures"), "{}", o.stdout);
            }
        }
    }
}

/// Collectives and transfers on cudarc's slices and streams, 1 to 4 ranks on
/// CUDA device 0 (cudarc cannot drive the stand-in). Runs where
/// `CCL_REQUIRE_CUDA=1` says there is a GPU.
#[test]
fn cudarc_slices_on_a_real_gpu() {
    if !require_cuda() {
        eprintln!("skipped: no GPU here (CCL_REQUIRE_CUDA=1 runs this on CUDA device 0)");
        return;
    }
    for n in [1, 2, 3, 4] {
        let env = [("CCL_TIMEOUT", "120s".to_string())];
        let out = launch(WORKER, &["cudarc"], n, &env, Duration::from_secs(300));
        assert_all_ok(&out, &format!("cudarc slices, {n} ranks"));
        for o in &out {
            assert!(o.stdout.contains("cudarc: "), "{}", o.stdout);
            assert!(o.stdout.contains(" 0 failures"), "{}", o.stdout);
        }
    }
}

/// Without a driver, asking for CUDA is an error naming the library; never
/// a panic (cudarc panics if called without one).
#[test]
fn cuda_without_a_driver_is_a_clear_error() {
    // The stand-in is chosen only by the variable, which this test lacks.
    assert!(std::env::var_os("CCL_CUDA_STAND_IN").is_none());
    match ccl::cuda::open(0) {
        Ok(gpu) => assert!(require_cuda(), "a GPU without CCL_REQUIRE_CUDA=1: {gpu:?}"),
        Err(e) => {
            eprintln!("{e}");
            assert!(!require_cuda(), "CCL_REQUIRE_CUDA=1 but: {e}");
            assert!(matches!(e, Error::Unsupported(_)), "{e:?}");
            assert!(e.to_string().contains("libcuda.so"), "{e}");
        }
    }
}

fn stand_in() -> Arc<dyn Gpu> {
    Arc::new(StandInGpu::new(0).expect("stand-in GPU"))
}

fn f32s(mem: &Scratch) -> Vec<f32> {
    // The stand-in's device memory is host memory: read it directly.
    let kind = MemoryKind::Host;
    // SAFETY: host memory owned by `mem`, not written while read.
    let bytes = unsafe { BufRef::from_raw(kind, mem.buf().as_ptr(), mem.len()) };
    bytemuck::cast_slice(bytes.host().unwrap()).to_vec()
}

/// NCCL's stream semantics: the call starts after the work queued on the
/// caller's stream before it, and work queued after it sees its result,
/// with the host never blocking in between.
#[test]
fn device_calls_follow_the_callers_stream() {
    for ipc in [true, false] {
        let options = Options {
            cuda_ipc: ipc,
            ..Options::default()
        };
        follows_the_stream(options);
    }
}

fn follows_the_stream(options: Options) {
    let results = with_ranks(2, options, |comm| {
        let r = comm.rank();
        let gpu = stand_in();
        let stream = Stream::new(gpu.clone()).unwrap();
        let count = 100_000;
        let input = gpu.alloc_device(count * 4).unwrap();
        let output = gpu.alloc_device(count * 4).unwrap();
        let source = vec![(r + 1) as f32; count];
        let mut result = vec![0f32; count];
        // The stream first waits for the host, then fills the input.
        let gate = gpu.alloc_words(1).unwrap();
        let word = gpu.device_address(gate.buf().as_ptr()).unwrap();
        gpu.wait_word(stream.raw(), word, 1).unwrap();
        let coll = Collective::new(CollectiveKind::AllReduce, DataType::F32, count);
        let kind = MemoryKind::Device { ordinal: 0 };
        // SAFETY: every buffer outlives the stream's work, synchronized below.
        let work = unsafe {
            gpu.copy(
                stream.raw(),
                input.buf().as_ptr().cast_mut(),
                source.as_ptr().cast(),
                count * 4,
            )
            .unwrap();
            let work = comm.launch_on_stream(
                &coll,
                BufRef::from_raw(kind, input.buf().as_ptr(), count * 4),
                BufMut::from_raw(kind, output.buf().as_ptr().cast_mut(), count * 4),
                &stream,
            );
            gpu.copy(
                stream.raw(),
                result.as_mut_ptr().cast(),
                output.buf().as_ptr(),
                count * 4,
            )
            .unwrap();
            work
        };
        // Nothing ran: the stream still waits for the host.
        std::thread::sleep(Duration::from_millis(200));
        let early = (work.is_completed(), f32s(&output)[0], result[0]);
        // SAFETY: a word of `alloc_words`.
        unsafe { &*(gate.buf().as_ptr() as *const AtomicU32) }.store(1, Ordering::Release);
        work.wait().unwrap();
        assert!(stream.synchronize(Some(Duration::from_secs(30))).unwrap());
        (early, result)
    });
    for (early, result) in results {
        assert_eq!(
            early,
            (false, 0.0, 0.0),
            "ran before the stream's earlier work"
        );
        assert!(result.iter().all(|&x| x == 3.0), "{:?}", &result[..4]);
    }
}

/// A peer that gives up before a device call: the call fails with an error
/// naming the peer, and the caller's stream is released, not left waiting.
#[test]
fn a_lost_peer_fails_the_device_call_and_frees_the_stream() {
    let results = with_ranks(2, Options::default(), |comm| {
        if comm.rank() == 1 {
            comm.abort();
            return Ok(());
        }
        let gpu = stand_in();
        let stream = Stream::new(gpu.clone()).unwrap();
        let count = 1 << 20;
        let buf = gpu.alloc_device(count * 4).unwrap();
        let coll =
            Collective::new(CollectiveKind::AllReduce, DataType::F32, count).with_op(ReduceOp::Sum);
        let kind = MemoryKind::Device { ordinal: 0 };
        // SAFETY: `buf` outlives the call, waited for below.
        let work = unsafe {
            let at = buf.buf().as_ptr().cast_mut();
            comm.launch_on_stream(
                &coll,
                BufRef::from_raw(kind, at, count * 4),
                BufMut::from_raw(kind, at, count * 4),
                &stream,
            )
        };
        let e = work.wait().unwrap_err();
        let released = stream.synchronize(Some(Duration::from_secs(30))).unwrap();
        Err((e, released))
    });
    let (e, released) = results[0].clone().unwrap_err();
    assert!(released, "the stream still waits for a failed call");
    let text = e.to_string();
    assert!(text.contains("rank 0") && text.contains("rank 1"), "{text}");
}

/// On the IPC path no host thread watches a call: a peer that never makes
/// it fails the call at its deadline, naming that peer, and the caller's
/// stream is released rather than left waiting on the GPU.
#[test]
fn a_peer_missing_from_an_ipc_call_is_named_at_the_deadline() {
    let results = with_ranks(2, Options::default(), |comm| {
        let gpu = stand_in();
        let stream = Stream::new(gpu.clone()).unwrap();
        let buf = gpu.alloc_device(1024).unwrap();
        let coll = Collective::new(CollectiveKind::AllReduce, DataType::F32, 256);
        let kind = MemoryKind::Device { ordinal: 0 };
        let run = |comm: &ccl::Communicator| {
            // SAFETY: `buf` outlives the call, waited for at once.
            unsafe {
                let at = buf.buf().as_ptr().cast_mut();
                comm.launch_on_stream(
                    &coll,
                    BufRef::from_raw(kind, at, 1024),
                    BufMut::from_raw(kind, at, 1024),
                    &stream,
                )
            }
            .wait()
        };
        // Both make the first call (which sets up IPC); rank 1 not the second.
        run(&comm).unwrap();
        comm.set_timeout(Duration::from_secs(2));
        if comm.rank() == 1 {
            std::thread::sleep(Duration::from_secs(4));
            return None;
        }
        let e = run(&comm).unwrap_err();
        let released = stream.synchronize(Some(Duration::from_secs(10))).unwrap();
        Some((e.to_string(), released, comm.broken().is_some()))
    });
    let (e, released, broken) = results[0].clone().unwrap();
    assert!(
        e.contains("allreduce") && e.contains("rank 0") && e.contains("[1]"),
        "{e}"
    );
    assert!(released, "the stream still waits for the missing peer");
    assert!(broken, "the communicator is still usable after the timeout");
}

/// A staged call whose stream never reaches it (the caller's earlier work
/// does not end): waiting for it fails at the communicator's deadline,
/// naming the call, instead of waiting forever.
#[test]
fn a_staged_call_behind_a_stuck_stream_times_out() {
    let options = Options {
        cuda_ipc: false,
        ..Options::default()
    };
    let results = with_ranks(2, options, |comm| {
        let gpu = stand_in();
        let stream = Stream::new(gpu.clone()).unwrap();
        let buf = gpu.alloc_device(4096).unwrap();
        let coll = Collective::new(CollectiveKind::AllReduce, DataType::F32, 1024);
        let kind = MemoryKind::Device { ordinal: 0 };
        let gate = gpu.alloc_words(1).unwrap();
        let word = gpu.device_address(gate.buf().as_ptr()).unwrap();
        gpu.wait_word(stream.raw(), word, 1).unwrap();
        comm.set_timeout(Duration::from_secs(2));
        let started = Instant::now();
        // SAFETY: `buf` outlives the call and the stream's work, drained below.
        let work = unsafe {
            let at = buf.buf().as_ptr().cast_mut();
            comm.launch_on_stream(
                &coll,
                BufRef::from_raw(kind, at, 4096),
                BufMut::from_raw(kind, at, 4096),
                &stream,
            )
        };
        let result = work.wait();
        let waited = started.elapsed();
        // SAFETY: a word of `alloc_words`.
        unsafe { &*(gate.buf().as_ptr() as *const AtomicU32) }.store(1, Ordering::Release);
        let drained = stream.synchronize(Some(Duration::from_secs(30))).unwrap();
        (result.map_err(|e| e.to_string()), waited, drained)
    });
    for (result, waited, drained) in results {
        let e = result.expect_err("a call behind a stuck stream succeeded");
        assert!(e.contains("allreduce") && e.contains("timed out"), "{e}");
        assert!(waited < Duration::from_secs(30), "waited {waited:?}");
        assert!(drained, "the stream did not drain once released");
    }
}

/// Memory of the wrong kind is refused before anything is sent.
#[test]
fn device_calls_check_where_their_memory_lives() {
    let results = with_ranks(1, Options::default(), |comm| {
        let gpu = stand_in();
        let stream = Stream::new(gpu.clone()).unwrap();
        let device = gpu.alloc_device(64).unwrap();
        let mut host = [0u8; 64];
        let coll = Collective::new(CollectiveKind::AllReduce, DataType::F32, 16);
        let on = |ordinal| MemoryKind::Device { ordinal };
        let mut errors = Vec::new();
        // SAFETY: each call is refused before it touches memory.
        unsafe {
            // Host memory in an ordinary host ref.
            errors.push(comm.launch_on_stream(
                &coll,
                BufRef::from_host(&host),
                BufMut::from_raw(on(0), device.buf().as_ptr().cast_mut(), 64),
                &stream,
            ));
            // Memory of another GPU than the stream's.
            errors.push(comm.launch_on_stream(
                &coll,
                BufRef::from_raw(on(1), device.buf().as_ptr(), 64),
                BufMut::from_raw(on(1), device.buf().as_ptr().cast_mut(), 64),
                &stream,
            ));
            // Host memory passed as device memory.
            errors.push(comm.launch_on_stream(
                &coll,
                BufRef::from_raw(on(0), host.as_ptr(), 64),
                BufMut::from_raw(on(0), host.as_mut_ptr(), 64),
                &stream,
            ));
            // The wrong length.
            errors.push(comm.launch_on_stream(
                &coll,
                BufRef::from_raw(on(0), device.buf().as_ptr(), 60),
                BufMut::from_raw(on(0), device.buf().as_ptr().cast_mut(), 60),
                &stream,
            ));
        }
        // Device memory without a stream: the host path refuses it.
        // SAFETY: as above.
        let plain = unsafe {
            comm.run(
                &coll,
                BufRef::from_raw(on(0), device.buf().as_ptr(), 64),
                BufMut::from_raw(on(0), device.buf().as_ptr().cast_mut(), 64),
            )
        };
        let mut texts: Vec<String> = errors
            .into_iter()
            .map(|w| w.wait().unwrap_err().to_string())
            .collect();
        texts.push(plain.unwrap_err().to_string());
        texts
    });
    let t = &results[0];
    assert!(t[0].contains("input lies in host memory"), "{}", t[0]);
    assert!(
        t[1].contains("memory of GPU 1") && t[1].contains("stand-in GPU 0"),
        "{}",
        t[1]
    );
    assert!(t[2].contains("driver says it is host memory"), "{}", t[2]);
    assert!(t[3].contains("60 bytes"), "{}", t[3]);
    assert!(t[4].contains("launch_on_stream"), "{}", t[4]);
    for text in t {
        assert!(
            text.contains("allreduce") || text.contains("launch_on_stream"),
            "{text}"
        );
        assert!(
            text.contains("rank 0") || text.contains("launch_on_stream"),
            "{text}"
        );
    }
}

/// Ranks whose device allreduces differ (count, element type, op) all fail
/// naming the mismatch, before any reads another's buffer (the direct IPC
/// path checks the calls when it exchanges the buffers' handles).
#[test]
fn mismatched_device_allreduces_fail_on_every_rank() {
    for what in ["count", "dtype", "op"] {
        let vars = [
            ("CCL_CUDA_STAND_IN", "1".to_string()),
            ("CCL_CUDA_IPC_DIRECT", "0".to_string()),
            ("CCL_TIMEOUT", "30s".to_string()),
        ];
        let out = launch(
            WORKER,
            &["device-mismatch", what],
            2,
            &vars,
            Duration::from_secs(60),
        );
        assert_all_ok(&out, &format!("device mismatch of {what}"));
        for o in &out {
            assert!(
                o.stdout.contains("mismatched calls"),
                "{what}, rank {}: {}\n{}",
                o.rank,
                o.stdout,
                o.stderr
            );
        }
    }
}
