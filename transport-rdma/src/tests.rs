//! The protocol core over the simulated fabric, two peers in this process,
//! driven by hand: eager and rendezvous messages, flow control, the
//! registration cache, and every fault turning into the right error.

use std::{
    path::PathBuf,
    sync::{
        atomic::{AtomicU32, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

use ccl_core::{AbortNotice, CollectiveKind, DataType, Error, Fingerprint, FrameHeader};

use crate::{
    proto::{Owned, Peer, PeerRing, RecvOp, RingConfig, SendOp},
    regcache::RegCache,
    sim::{Faults, SimNic},
    verbs::{Channel, Completion, QueuePair, Remote, Status, Verbs},
    COUNTERS,
};

/// A fabric directory of its own, removed on drop.
struct Fabric(PathBuf);

impl Fabric {
    fn new() -> Fabric {
        static N: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "ccl-rdma-test-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        Fabric(dir)
    }
}

impl Drop for Fabric {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

type P = Peer<SimNic>;

/// Ranks 0 and 1, connected, each with a NIC of its own.
fn pair(fabric: &Fabric, cfg: RingConfig, faults: [Faults; 2]) -> (P, P) {
    let nics: Vec<Arc<SimNic>> = faults
        .iter()
        .map(|f| Arc::new(SimNic::open(&fabric.0, *f).unwrap()))
        .collect();
    let mut halves: Vec<_> = nics
        .iter()
        .map(|n| {
            let qp = n.queue_pair(&n.channel().unwrap()).unwrap();
            let ring = Owned::new(&**n, cfg.slots * cfg.slot_bytes).unwrap();
            (qp, ring)
        })
        .collect();
    let ends: Vec<_> = halves
        .iter()
        .map(|(qp, ring)| {
            (
                qp.endpoint(),
                Remote {
                    addr: ring.region.addr,
                    rkey: ring.region.rkey,
                },
            )
        })
        .collect();
    let (h1, h0) = (halves.pop().unwrap(), halves.pop().unwrap());
    let make = |me: usize, (mut qp, ring): (crate::sim::SimQp, Owned)| {
        let (endpoint, remote) = ends[1 - me];
        qp.connect(&endpoint).unwrap();
        let cache = Arc::new(Mutex::new(RegCache::new(8)));
        Peer::new(
            (me, 1 - me),
            cfg,
            nics[me].clone(),
            cache,
            qp,
            ring,
            PeerRing { remote },
        )
        .unwrap()
    };
    (make(0, h0), make(1, h1))
}

fn header(step: u32, len: usize) -> FrameHeader {
    FrameHeader::data(
        7,
        1,
        step,
        len,
        Fingerprint::new(CollectiveKind::SendRecv, DataType::U8, len),
    )
}

fn small() -> RingConfig {
    RingConfig {
        slots: 4,
        slot_bytes: 4096,
        keepalive: Duration::from_millis(20),
    }
}

/// Sends `msgs` from `a` to `b`, the receiver polling only every
/// `patience`-th round; returns what arrived.
fn transfer(
    a: &mut P,
    b: &mut P,
    msgs: &[Vec<u8>],
    patience: usize,
) -> crate::Result<Vec<Vec<u8>>> {
    let mut got: Vec<Vec<u8>> = msgs.iter().map(|m| vec![0u8; m.len()]).collect();
    let (mut s, mut r) = (0, 0);
    let mut send: Option<SendOp> = None;
    let mut recv: Option<RecvOp> = None;
    for round in 0..200_000 {
        if r == msgs.len() {
            return Ok(got);
        }
        a.progress()?;
        if s < msgs.len() {
            let op =
                send.get_or_insert_with(|| SendOp::new(header(s as u32, msgs[s].len()), &msgs[s]));
            if a.poll_send(op)? {
                send = None;
                s += 1;
            } else {
                a.idle()?;
            }
        }
        if round % patience == 0 {
            b.progress()?;
            let op = recv
                .get_or_insert_with(|| RecvOp::new(header(r as u32, msgs[r].len()), &mut got[r]));
            if b.poll_recv(op, &mut |_| Ok(()))? {
                recv = None;
                r += 1;
            } else {
                b.idle()?;
            }
        }
    }
    panic!("transfer did not finish: {s} sent, {r} received");
}

fn messages(sizes: &[usize]) -> Vec<Vec<u8>> {
    sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| (0..n).map(|j| (i * 31 + j) as u8).collect())
        .collect()
}

#[test]
fn eager_and_rendezvous_messages_arrive_intact_with_zero_copies_above_the_eager_limit() {
    let fabric = Fabric::new();
    let (mut a, mut b) = pair(&fabric, small(), Default::default());
    let limit = small().eager_limit();
    let sizes = [0, 1, limit, limit + 1, 100_000, 7, 3 << 20];
    let msgs = messages(&sizes);
    let before = COUNTERS.get();
    let got = transfer(&mut a, &mut b, &msgs, 1).unwrap();
    assert_eq!(got, msgs);
    let after = COUNTERS.get();
    let large: u64 = sizes
        .iter()
        .filter(|&&n| n > limit)
        .map(|&n| n as u64)
        .sum();
    // Other tests of this process may add to the counters too.
    assert!(after.zero_copy_sent - before.zero_copy_sent >= large);
    assert!(after.zero_copy_received - before.zero_copy_received >= large);
}

/// Drives one message from `a` to `b` until both ops are done or one fails
/// (a bounded number of rounds).
fn one_message(
    a: &mut P,
    b: &mut P,
    send: &mut SendOp,
    recv: &mut RecvOp,
) -> (crate::Result<bool>, crate::Result<bool>) {
    let (mut sent, mut got) = (Ok(false), Ok(false));
    for _ in 0..100_000 {
        if matches!(sent, Ok(false)) {
            sent = a.progress().and_then(|()| a.poll_send(send));
        }
        if matches!(got, Ok(false)) {
            got = b
                .progress()
                .and_then(|()| b.poll_recv(recv, &mut |_| Ok(())));
        }
        if !matches!((&sent, &got), (Ok(false), _) | (_, Ok(false))) {
            break;
        }
    }
    (sent, got)
}

/// GPU memory (GPUDirect RDMA) is never touched by the CPU: even a message
/// far below the eager limit goes by rendezvous, written by the NIC from
/// and into it. The simulated NIC registers host memory posing as a GPU's,
/// as ccl's CUDA stand-in's is. A transfer whose sides disagree on the kind
/// of memory fails, naming the peer, instead of hanging.
#[test]
fn gpu_memory_always_goes_by_rendezvous_and_a_kind_mismatch_is_an_error() {
    let fabric = Fabric::new();
    let (mut a, mut b) = pair(&fabric, small(), Default::default());
    let msg: Vec<u8> = (0..100u8).collect();
    let mut got = vec![0u8; 100];
    let before = COUNTERS.get();
    let mut s = SendOp::device(header(0, 100), msg.as_ptr() as u64, 100);
    let mut r = RecvOp::device(header(0, 100), got.as_mut_ptr() as u64, 100);
    let (x, y) = one_message(&mut a, &mut b, &mut s, &mut r);
    assert_eq!((x.unwrap(), y.unwrap()), (true, true));
    assert_eq!(got, msg);
    let after = COUNTERS.get();
    assert!(after.device_bytes - before.device_bytes >= 200);
    assert!(after.zero_copy_received - before.zero_copy_received >= 100);

    // From GPU memory into host memory.
    let mut s = SendOp::device(header(1, 100), msg.as_ptr() as u64, 100);
    let mut r = RecvOp::new(header(1, 100), &mut got);
    let (_, y) = one_message(&mut a, &mut b, &mut s, &mut r);
    let e = y.unwrap_err().to_string();
    assert!(
        e.contains("same kind of memory") && e.contains("rank 0"),
        "{e}"
    );

    // From host memory (eagerly) into GPU memory.
    let (mut a, mut b) = pair(&fabric, small(), Default::default());
    let mut s = SendOp::new(header(2, 100), &msg);
    let mut r = RecvOp::device(header(2, 100), got.as_mut_ptr() as u64, 100);
    let (_, y) = one_message(&mut a, &mut b, &mut s, &mut r);
    let e = y.unwrap_err().to_string();
    assert!(
        e.contains("same kind of memory") && e.contains("rank 0"),
        "{e}"
    );
}

#[test]
fn a_slow_receiver_is_never_overrun_and_a_fast_sender_never_deadlocks() {
    let fabric = Fabric::new();
    for faults in [
        Faults::default(),
        Faults {
            reorder: true,
            delay: 3,
            ..Faults::default()
        },
    ] {
        let (mut a, mut b) = pair(&fabric, small(), [faults; 2]);
        // Many more messages than slots, eager and large mixed; the receiver
        // polls once in 7 rounds. A slot overwritten before it was read
        // would be a protocol error (slot numbers are checked) or corrupt data.
        let sizes: Vec<usize> = (0..200)
            .map(|i| if i % 10 == 9 { 9000 } else { i * 13 % 4000 })
            .collect();
        let msgs = messages(&sizes);
        assert_eq!(transfer(&mut a, &mut b, &msgs, 7).unwrap(), msgs);
        // And the other way at once, each side sending before receiving.
        assert_eq!(transfer(&mut b, &mut a, &msgs, 1).unwrap(), msgs);
    }
}

#[test]
fn a_receive_reduces_out_of_the_ring_and_out_of_scratch() {
    let fabric = Fabric::new();
    let (mut a, mut b) = pair(&fabric, small(), Default::default());
    for len in [100, 50_000] {
        let data: Vec<u8> = (0..len).map(|i| i as u8).collect();
        let mut send = SendOp::new(header(0, len), &data);
        let mut recv = RecvOp::sink(header(0, len), len);
        let mut sum = 0u64;
        let mut sink = |got: &[u8]| {
            sum = got.iter().map(|&x| u64::from(x)).sum();
            Ok(())
        };
        let mut done = false;
        for _ in 0..100_000 {
            a.progress().unwrap();
            let sent = a.poll_send(&mut send).unwrap();
            b.progress().unwrap();
            done = b.poll_recv(&mut recv, &mut sink).unwrap();
            b.idle().unwrap();
            if done && sent {
                break;
            }
        }
        assert!(done);
        assert_eq!(sum, data.iter().map(|&x| u64::from(x)).sum::<u64>());
    }
}

/// The first error of `step`, run at most `rounds` times.
fn first_error<T>(rounds: usize, mut step: impl FnMut() -> crate::Result<T>) -> Error {
    (0..rounds).find_map(|_| step().err()).expect("an error")
}

#[test]
fn a_mismatched_message_is_a_mismatch_not_a_hang() {
    let fabric = Fabric::new();
    let (mut a, mut b) = pair(&fabric, small(), Default::default());
    // A large send meets a small receive: the RTS's header is checked.
    let data = vec![1u8; 10_000];
    let mut send = SendOp::new(header(0, data.len()), &data);
    let mut into = vec![0u8; 10];
    let mut recv = RecvOp::new(header(0, 10), &mut into);
    let e = first_error(10_000, || {
        a.progress().unwrap();
        a.poll_send(&mut send).unwrap();
        b.progress()
            .and_then(|()| b.poll_recv(&mut recv, &mut |_| Ok(())))
    });
    assert!(
        matches!(
            e,
            Error::Mismatch {
                rank: 1,
                peer: 0,
                ..
            } | Error::Protocol {
                rank: 1,
                peer: 0,
                ..
            }
        ),
        "{e}"
    );
    // The pair stays failed.
    assert_eq!(b.progress().unwrap_err().to_string(), e.to_string());
}

/// Runs sends of `data` from `a` until one fails.
fn until_error(a: &mut P, b: &mut P, data: &[u8]) -> Error {
    let mut into = vec![0u8; data.len()];
    for step in 0..100u32 {
        let mut send = SendOp::new(header(step, data.len()), data);
        let mut recv = RecvOp::new(header(step, data.len()), &mut into);
        let (mut sent, mut got) = (false, false);
        for _ in 0..10_000 {
            match a.progress().and_then(|()| a.poll_send(&mut send)) {
                Err(e) => return e,
                Ok(done) => sent |= done,
            }
            got |= matches!(
                b.progress()
                    .and_then(|()| b.poll_recv(&mut recv, &mut |_| Ok(()))),
                Ok(true)
            );
            if let Err(e) = a.idle() {
                return e;
            }
            if sent && got {
                break;
            }
        }
    }
    panic!("no error");
}

#[test]
fn a_remote_access_error_is_a_protocol_error_naming_the_peer_and_later_work_is_flushed() {
    let fabric = Fabric::new();
    let faults = Faults {
        access_error_after: Some(5),
        ..Faults::default()
    };
    let (mut a, mut b) = pair(&fabric, small(), [faults, Faults::default()]);
    let e = until_error(&mut a, &mut b, &[3u8; 100]);
    match &e {
        Error::Protocol {
            rank: 0,
            peer: 1,
            msg,
            ..
        } => {
            assert!(msg.contains("remote access error"), "{e}")
        }
        other => panic!("{other}"),
    }
    assert!(a.failed().is_some());
    // A queue pair in the error state drops what arrives, as hardware's
    // does: the peer's keepalive finds it gone.
    let e = first_error(2000, || {
        std::thread::sleep(Duration::from_millis(1));
        b.progress().and_then(|()| b.idle())
    });
    assert!(
        matches!(&e, Error::PeerLost { rank: 1, peer: 0, cause, .. } if cause.contains("no longer answers")),
        "{e}"
    );
}

#[test]
fn the_fabric_refuses_writes_under_a_stale_key_or_past_the_region() {
    let fabric = Fabric::new();
    let nics: Vec<SimNic> = (0..2)
        .map(|_| SimNic::open(&fabric.0, Faults::default()).unwrap())
        .collect();
    let qp = |n: &SimNic| n.queue_pair(&n.channel().unwrap()).unwrap();
    let (mut q0, mut q1) = (qp(&nics[0]), qp(&nics[1]));
    q0.connect(&q1.endpoint()).unwrap();
    q1.connect(&q0.endpoint()).unwrap();
    let src = vec![5u8; 64];
    let dst = vec![0u8; 64];
    let local = nics[0].register(src.as_ptr() as u64, 64).unwrap();
    let far = nics[1].register(dst.as_ptr() as u64, 64).unwrap();
    let write = |id, len, rkey| crate::verbs::Write {
        id,
        addr: local.addr,
        len,
        lkey: local.lkey,
        remote: Remote {
            addr: far.addr,
            rkey,
        },
        imm: None,
    };
    let mut out = Vec::new();
    q0.post_write(&write(1, 64, far.rkey)).unwrap();
    poll_for(&mut q0, &mut out, 1);
    assert_eq!(
        out,
        [Completion::Write {
            id: 1,
            status: Status::Success
        }]
    );
    assert_eq!(dst, src);
    q0.post_write(&write(2, 65, far.rkey)).unwrap();
    nics[1].deregister(&far);
    // The queue pair is in error after the first failure: later work is flushed.
    q0.post_write(&write(3, 64, far.rkey)).unwrap();
    out.clear();
    poll_for(&mut q0, &mut out, 2);
    assert_eq!(
        out,
        [
            Completion::Write {
                id: 2,
                status: Status::RemoteAccess
            },
            Completion::Write {
                id: 3,
                status: Status::Flushed
            }
        ]
    );
    let (mut q2, mut q3) = (qp(&nics[0]), qp(&nics[1]));
    q2.connect(&q3.endpoint()).unwrap();
    q3.connect(&q2.endpoint()).unwrap();
    q2.post_write(&write(4, 64, far.rkey)).unwrap();
    out.clear();
    poll_for(&mut q2, &mut out, 1);
    assert_eq!(
        out,
        [Completion::Write {
            id: 4,
            status: Status::RemoteAccess
        }]
    );
}

/// Polls `q` until `out` holds `n` completions (each is handed out once the
/// modelled clock reaches it, which takes a few empty polls).
/// Whether `fd` is readable now.
fn readable(fd: &impl std::os::fd::AsRawFd) -> bool {
    let mut p = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    let ready = unsafe { libc::poll(&mut p, 1, 0) };
    ready == 1
}

/// The completion channel: an armed queue wakes its owner at the next write
/// with immediate into it, once; a queue with completions on their way
/// refuses to arm (they come only by polling), as does one whose writes
/// have not completed.
#[test]
fn an_armed_queue_wakes_its_channel_at_the_next_arrival() {
    let fabric = Fabric::new();
    let nics: Vec<SimNic> = (0..2)
        .map(|_| SimNic::open(&fabric.0, Faults::default()).unwrap())
        .collect();
    let channels: Vec<_> = nics.iter().map(|n| n.channel().unwrap()).collect();
    let mut q0 = nics[0].queue_pair(&channels[0]).unwrap();
    let mut q1 = nics[1].queue_pair(&channels[1]).unwrap();
    q0.connect(&q1.endpoint()).unwrap();
    q1.connect(&q0.endpoint()).unwrap();
    let dst = [0u8; 8];
    let far = nics[1].register(dst.as_ptr() as u64, 8).unwrap();
    let write = |id| crate::verbs::Write {
        id,
        addr: 0,
        len: 0,
        lkey: 0,
        remote: Remote {
            addr: far.addr,
            rkey: far.rkey,
        },
        imm: Some(7),
    };
    // A queue arms once the process is published as idle, which polls with
    // nothing due bring about (other tests in this process may interleave).
    let arms = |q: &mut crate::sim::SimQp| {
        let mut out = Vec::new();
        (0..100_000).any(|_| {
            q.poll(&mut out);
            q.arm()
        })
    };
    q1.post_recv().unwrap();
    q1.post_recv().unwrap();
    assert!(arms(&mut q1), "an idle queue arms");
    assert!(!readable(&channels[1]));
    q0.post_write(&write(1)).unwrap();
    assert!(
        !q0.arm(),
        "a queue whose write has not completed must not sleep"
    );
    assert!(
        readable(&channels[1]),
        "the arrival woke the armed queue's channel"
    );
    assert!(!readable(&channels[0]), "the writer's channel stays quiet");
    channels[1].drain();
    assert!(!readable(&channels[1]), "drained");
    assert!(
        !q1.arm(),
        "a queue with an arrival not yet polled must not sleep"
    );
    let mut out = Vec::new();
    poll_for(&mut q1, &mut out, 1);
    assert_eq!(out.len(), 1, "{out:?}");
    // Disarmed by the notice: the next arrival gives none until armed again.
    channels[1].drain();
    q0.post_write(&write(2)).unwrap();
    assert!(!readable(&channels[1]), "a notice without arming");
    out.clear();
    poll_for(&mut q1, &mut out, 1);
    assert_eq!(out.len(), 1, "{out:?}");
    assert!(arms(&mut q1));
    assert!(
        arms(&mut q0),
        "the writer's queue arms once its writes completed"
    );
}

fn poll_for<Q: QueuePair>(q: &mut Q, out: &mut Vec<Completion>, n: usize) {
    for _ in 0..1000 {
        if out.len() >= n {
            return;
        }
        q.poll(out);
    }
}

#[test]
fn a_lost_peer_is_peer_lost_naming_it() {
    let fabric = Fabric::new();
    let (mut a, b) = pair(&fabric, small(), Default::default());
    drop(b);
    let data = vec![1u8; 10];
    let mut send = SendOp::new(header(0, 10), &data);
    let mut err = None;
    for _ in 0..1000 {
        if let Err(e) = a
            .progress()
            .and_then(|()| a.poll_send(&mut send))
            .and_then(|_| a.idle())
        {
            err = Some(e);
            break;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    match err.expect("an error") {
        Error::PeerLost {
            rank: 0,
            peer: 1,
            cause,
            ..
        } => assert!(cause.contains("no longer answers"), "{cause}"),
        other => panic!("{other}"),
    }
}

/// Receives message `step` of `len` bytes on `a`, polling a bounded
/// number of times; what arrived.
fn receive(a: &mut P, step: u32, len: usize) -> crate::Result<Vec<u8>> {
    let mut into = vec![0u8; len];
    let mut recv = RecvOp::new(header(step, len), &mut into);
    for _ in 0..100_000 {
        a.progress()?;
        if a.poll_recv(&mut recv, &mut |_| Ok(()))? {
            return Ok(into);
        }
    }
    panic!("message {step} never arrived");
}

/// A side that says bye right after its eager sends, and is then torn
/// down: its messages still arrive; the credit and keepalive the receiver
/// wrote to it before it saw the bye fail without failing the pair; an
/// operation that needs the closed side fails at once, saying so, and one
/// still running on the closing side blames that side, not its peer.
#[test]
fn a_peer_that_said_bye_fails_only_what_needs_it() {
    let fabric = Fabric::new();
    let (mut a, mut b) = pair(&fabric, small(), Default::default());
    let msgs = messages(&[10, 200, 3000]);
    for (i, m) in msgs.iter().enumerate() {
        let mut send = SendOp::new(header(i as u32, m.len()), m);
        b.progress().unwrap();
        assert!(b.poll_send(&mut send).unwrap(), "eager: done once posted");
    }
    assert_eq!(receive(&mut a, 0, 10).unwrap(), msgs[0]);
    b.close(std::time::Instant::now() + Duration::from_secs(2));
    assert_eq!(
        b.writes_in_flight(),
        0,
        "the closing side waits for its writes"
    );
    // A call still running on the closing side (its process exiting) fails
    // blaming that side itself, not the peer it had closed on.
    let e = receive(&mut b, 0, 4).unwrap_err();
    assert_eq!(e.failed_rank(), None, "{e}");
    assert!(
        e.to_string()
            .contains("rank 1: communicator is broken by an earlier error: this rank closed its link to rank 0"),
        "{e}"
    );
    drop(b);
    // Not polled yet, the bye is unseen: the owed credit and a keepalive go
    // to a queue pair that is gone.
    std::thread::sleep(small().keepalive);
    a.idle().unwrap();
    assert_eq!(a.writes_in_flight(), 2);
    assert_eq!(receive(&mut a, 1, 200).unwrap(), msgs[1]);
    assert_eq!(receive(&mut a, 2, 3000).unwrap(), msgs[2]);
    // Their failures come after the NIC's retries, and are forgiven.
    let until = std::time::Instant::now() + Duration::from_secs(10);
    while a.writes_in_flight() > 0 {
        assert!(
            std::time::Instant::now() < until,
            "the failed writes never completed"
        );
        a.progress().unwrap();
        std::thread::sleep(Duration::from_millis(1));
    }
    let closed = |e: Error| match e {
        Error::PeerLost {
            rank: 0,
            peer: 1,
            cause,
            ..
        } if cause.contains("rank 1 closed its communicator") => {}
        other => panic!("{other}"),
    };
    closed(receive(&mut a, 3, 4).unwrap_err());
    let mut send = SendOp::new(header(4, 4), &[1, 2, 3, 4]);
    closed(a.poll_send(&mut send).unwrap_err());
}

#[test]
fn an_abort_notice_reaches_the_peer() {
    let fabric = Fabric::new();
    let (mut a, mut b) = pair(&fabric, small(), Default::default());
    a.abort(&AbortNotice {
        failed_rank: 0,
        reason: "out of patience".into(),
    });
    let mut into = [0u8; 4];
    let mut recv = RecvOp::new(header(0, 4), &mut into);
    let e = first_error(1000, || {
        b.progress()
            .and_then(|()| b.poll_recv(&mut recv, &mut |_| Ok(())))
    });
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
    assert!(e.to_string().contains("out of patience"), "{e}");
}

/// A rank that gives up a receive after offering its buffer (its call
/// failed on another link) still tells the sender why: the notice names the
/// rank that failed first, not the messenger.
#[test]
fn an_abort_notice_follows_a_cancelled_receive() {
    let fabric = Fabric::new();
    let (mut a, mut b) = pair(&fabric, small(), Default::default());
    let data = vec![3u8; 50_000];
    let mut send = SendOp::new(header(0, data.len()), &data);
    let mut into = vec![0u8; data.len()];
    let mut recv = RecvOp::new(header(0, data.len()), &mut into);
    a.progress().unwrap();
    assert!(!a.poll_send(&mut send).unwrap());
    for _ in 0..100 {
        b.progress().unwrap();
        assert!(!b.poll_recv(&mut recv, &mut |_| Ok(())).unwrap());
    }
    b.cancel_recv(&mut recv);
    assert!(
        b.failed().is_some(),
        "the receiver never offered its buffer"
    );
    b.abort(&AbortNotice {
        failed_rank: 5,
        reason: "rank 5 vanished".into(),
    });
    let e = first_error(1000, || a.progress().and_then(|()| a.poll_send(&mut send)));
    assert!(
        matches!(
            e,
            Error::PeerLost {
                rank: 0,
                peer: 5,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("rank 5 vanished"), "{e}");
}

#[test]
fn the_registration_cache_hits_evicts_and_invalidates() {
    let fabric = Fabric::new();
    let nic = SimNic::open(&fabric.0, Faults::default()).unwrap();
    let mut cache = RegCache::new(2);
    let bufs: Vec<Vec<u8>> = (0..4).map(|_| vec![0u8; 8192]).collect();
    let addr = |i: usize| bufs[i].as_ptr() as u64;
    let r0 = cache.acquire(&nic, addr(0), 8192, false).unwrap();
    cache.release(&nic, &r0);
    // The same buffer, or a part of it, hits.
    let again = cache.acquire(&nic, addr(0) + 100, 1000, false).unwrap();
    assert_eq!(again, r0);
    cache.release(&nic, &again);
    assert_eq!((cache.stats().hits, cache.stats().misses), (1, 1));
    // Two more buffers: the least recently used one is evicted, and its key stops working.
    for i in [1, 2] {
        let r = cache.acquire(&nic, addr(i), 8192, false).unwrap();
        cache.release(&nic, &r);
    }
    assert_eq!((cache.len(), cache.stats().evictions), (2, 1));
    let r0b = cache.acquire(&nic, addr(0), 8192, false).unwrap();
    assert_ne!(r0b.rkey, r0.rkey, "an evicted registration is made anew");
    // Invalidating a freed buffer drops its registration, even one in use
    // (once released).
    cache.invalidate(&nic, addr(0), 1);
    assert_eq!(cache.stats().invalidations, 1);
    let r0c = cache.acquire(&nic, addr(0), 8192, false).unwrap();
    assert_ne!(r0c.rkey, r0b.rkey);
    cache.release(&nic, &r0b);
    cache.release(&nic, &r0c);
    cache.clear(&nic);
    assert!(cache.is_empty());
    // GPU memory is never kept unused, even with room: its free is as
    // invisible to ccl as a host buffer's.
    let d = cache.acquire(&nic, addr(3), 8192, true).unwrap();
    assert_eq!(cache.len(), 1);
    cache.release(&nic, &d);
    assert!(cache.is_empty(), "a GPU memory registration was kept");
}

/// Where registrations pin pages, a user buffer's registration lasts only
/// while operations hold it: a buffer freed between calls is never reached
/// through a stale key.
#[test]
fn a_cache_without_room_keeps_registrations_only_while_held() {
    let fabric = Fabric::new();
    let nic = SimNic::open(&fabric.0, Faults::default()).unwrap();
    let mut cache = RegCache::new(0);
    let buf = vec![0u8; 8192];
    let addr = buf.as_ptr() as u64;
    let a = cache.acquire(&nic, addr, 8192, false).unwrap();
    // A second operation on the same buffer while the first holds it shares it.
    let b = cache.acquire(&nic, addr, 4096, false).unwrap();
    assert_eq!(a, b);
    cache.release(&nic, &a);
    assert_eq!(cache.len(), 1);
    cache.release(&nic, &b);
    assert!(cache.is_empty(), "an unused registration was kept");
    let c = cache.acquire(&nic, addr, 8192, false).unwrap();
    assert_ne!(c.rkey, a.rkey, "the next call registers anew");
    assert_eq!((cache.stats().hits, cache.stats().misses), (1, 2));
    cache.release(&nic, &c);
}

/// An eager send is done once posted, so its write can fail while the rank
/// waits on another peer. That wait must end with the failure (the starved
/// peer waits too, for data that will never come), not run into its deadline.
#[test]
fn a_write_that_fails_after_its_send_returned_ends_a_wait_on_another_peer() {
    use ccl_core::{BufMut, BufRef, Link, Spin};

    use crate::link::{RdmaLink, Sleeper};

    let fabric = Fabric::new();
    let failing = Faults {
        access_error_after: Some(1),
        ..Faults::default()
    };
    let (x, _x_peer) = pair(&fabric, small(), [failing, Faults::default()]);
    let (y, _y_peer) = pair(&fabric, small(), [Faults::default(); 2]);
    let (x, y) = (Arc::new(Mutex::new(x)), Arc::new(Mutex::new(y)));
    let pairs: Arc<[_]> = Arc::from([Arc::downgrade(&x), Arc::downgrade(&y)]);
    let spin = Spin {
        window: Duration::ZERO,
        yield_between: false,
        repoll: false,
    };
    // The queues' own channels are gone: a sleep on this one ends only at
    // its limit, so the wait below must end by polling.
    let channel = SimNic::open(&fabric.0, Faults::default())
        .unwrap()
        .channel()
        .unwrap();
    let sleeper = Arc::new(Sleeper::new(channel));
    let to_x = RdmaLink::new((0, 1), x, pairs.clone(), spin, false, sleeper.clone());
    let to_y = RdmaLink::new((0, 2), y, pairs, spin, false, sleeper);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let data = [5u8; 100];
    let mut into = [0u8; 100];
    let waited = runtime.block_on(async {
        to_x.send(header(0, 100), BufRef::from_host(&data))
            .await
            .expect("an eager send returns once posted");
        tokio::time::timeout(
            Duration::from_secs(10),
            to_y.recv(header(0, 100), BufMut::from_host(&mut into)),
        )
        .await
    });
    match waited {
        Ok(Err(Error::Protocol { peer: 1, msg, .. })) => {
            assert!(msg.contains("remote access error"), "{msg}")
        }
        Ok(other) => panic!("the wait ended otherwise: {other:?}"),
        Err(_) => panic!("the wait on rank 2 never saw the failed write to rank 1"),
    }
}
