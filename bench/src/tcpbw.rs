//! The loopback TCP bound of a comparison over TCP, measured in the same run:
//! n plain TCP streams in a ring (rank i's process sends to rank i+1's and
//! receives from rank i-1's), each end on a thread pinned where its rank is,
//! unpaced (the congestion control ccl's links within a host get) and moving
//! nothing but bytes. Their aggregate rate is what the kernel's two copies
//! per byte (into the socket, out of it) allow on this machine with every
//! rank sending and receiving at once. [`bound_busbw`] turns it into the bus
//! bandwidth a collective would reach if it only moved the bytes it must
//! between ranks at that rate.

use std::{
    io::{self, Read, Write},
    net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream},
    sync::{Arc, Barrier, Mutex},
    time::{Duration, Instant},
};

use ccl_transport_tcp::Congestion;
use serde::{Deserialize, Serialize};
use socket2::{Domain, Protocol, SockRef, Socket, Type};

use crate::{coll::Coll, membw::pin_current_thread};

/// Passes over the buffer per timed repetition, and repetitions (the best counts).
const PASSES: usize = 4;
const REPS: usize = 3;
/// Bound on every read, write and the set-up of the streams.
const DEADLINE: Duration = Duration::from_secs(30);

/// A socket for one end of a stream, with the congestion control of ccl's
/// links within a host (`name`) where the kernel allows it (else its
/// default: [`TcpRate::congestion`] says which ran).
fn socket(name: &str) -> io::Result<Socket> {
    let s = Socket::new(Domain::IPV4, Type::STREAM, Some(Protocol::TCP))?;
    let _ = s.set_tcp_congestion(name.as_bytes());
    Ok(s)
}

/// One measurement of the ring.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct TcpRate {
    /// Bytes received per second by all ranks together (1e9).
    pub gbps: f64,
    /// The congestion control the streams ran with.
    pub congestion: String,
}

/// Connects `n` streams in a ring over loopback: element i is rank i's
/// (sending end to rank i+1, receiving end from rank i-1).
fn ring(n: usize, congestion: &str) -> io::Result<Vec<(TcpStream, TcpStream)>> {
    let mut listeners = Vec::with_capacity(n);
    for _ in 0..n {
        let s = socket(congestion)?;
        s.bind(&SocketAddr::from((Ipv4Addr::LOCALHOST, 0)).into())?;
        s.listen(1)?;
        s.set_nonblocking(true)?;
        listeners.push(TcpListener::from(s));
    }
    let mut senders = Vec::with_capacity(n);
    for i in 0..n {
        let s = socket(congestion)?;
        let to = listeners[(i + 1) % n].local_addr()?;
        s.connect_timeout(&to.into(), DEADLINE)?;
        senders.push(TcpStream::from(s));
    }
    let start = Instant::now();
    let mut receivers = Vec::with_capacity(n);
    for l in &listeners {
        let stream = loop {
            match l.accept() {
                Ok((s, _)) => break s,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock && start.elapsed() < DEADLINE => {
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(e) => return Err(e),
            }
        };
        stream.set_nonblocking(false)?;
        receivers.push(stream);
    }
    // Listener i accepted rank i-1's stream: rank i receives on it.
    let mut pairs = Vec::with_capacity(n);
    for (tx, rx) in senders.into_iter().zip(receivers) {
        for s in [&tx, &rx] {
            s.set_read_timeout(Some(DEADLINE))?;
            s.set_write_timeout(Some(DEADLINE))?;
        }
        pairs.push((tx, rx));
    }
    Ok(pairs)
}

/// One end's part: [`REPS`] + 1 repetitions of [`PASSES`] buffers sent (or
/// received), each starting at the barrier; returns each repetition's time.
/// After a failure it keeps meeting the barrier (so no thread waits for it
/// forever) and drops its socket, which ends the stream at the other end.
fn run_end(
    mut stream: Option<TcpStream>,
    send: bool,
    bytes: usize,
    barrier: &Barrier,
) -> (Vec<f64>, Option<io::Error>) {
    let mut buf = vec![if send { 1u8 } else { 0u8 }; bytes.max(1)];
    let mut times = Vec::with_capacity(REPS + 1);
    let mut failed = None;
    for _ in 0..=REPS {
        barrier.wait();
        let t0 = Instant::now();
        if let Some(s) = stream.as_mut() {
            let r = (0..PASSES).try_for_each(|_| {
                if send {
                    s.write_all(&buf)
                } else {
                    s.read_exact(&mut buf)
                }
            });
            if let Err(e) = r {
                failed = Some(e);
                stream = None;
            }
        }
        times.push(t0.elapsed().as_secs_f64());
    }
    (times, failed)
}

/// The aggregate rate (GB/s, 1e9 bytes received per second by all ranks
/// together) of `n` TCP streams in a ring over loopback, rank i's ends
/// pinned to `cpus[i % len]` (when not empty), each moving [`PASSES`]
/// buffers of `bytes` per repetition; the best of [`REPS`] repetitions.
pub fn measure_ring(n: usize, cpus: &[usize], bytes: usize) -> Result<TcpRate, String> {
    if n < 2 {
        return Err("a ring of TCP streams needs at least 2 ranks".into());
    }
    let pairs = ring(n, &Congestion::Auto.within_host())
        .map_err(|e| format!("TCP bound: connecting {n} streams over loopback: {e}"))?;
    let congestion = SockRef::from(&pairs[0].0)
        .tcp_congestion()
        .map(|c| {
            String::from_utf8_lossy(&c)
                .trim_end_matches('\0')
                .to_string()
        })
        .unwrap_or_else(|e| format!("unknown ({e})"));
    let barrier = Arc::new(Barrier::new(2 * n));
    let errors = Arc::new(Mutex::new(Vec::new()));
    let mut handles = Vec::with_capacity(2 * n);
    for (rank, (tx, rx)) in pairs.into_iter().enumerate() {
        let cpu = (!cpus.is_empty()).then(|| cpus[rank % cpus.len()]);
        for (stream, send) in [(tx, true), (rx, false)] {
            let (barrier, errors) = (barrier.clone(), errors.clone());
            handles.push(std::thread::spawn(move || {
                if let Some(c) = cpu {
                    pin_current_thread(c);
                }
                let (mut times, failed) = run_end(Some(stream), send, bytes, &barrier);
                if let Some(e) = failed {
                    let what = if send { "sending" } else { "receiving" };
                    if let Ok(mut v) = errors.lock() {
                        v.push(format!("rank {rank} {what}: {e}"));
                    }
                }
                times.remove(0); // the first repetition warms up
                (send, times)
            }));
        }
    }
    let mut receiver_times = Vec::with_capacity(n);
    for h in handles {
        match h.join() {
            Ok((false, times)) => receiver_times.push(times),
            Ok((true, _)) => {}
            Err(_) => return Err("TCP bound: a stream's thread panicked".into()),
        }
    }
    let errors = errors.lock().map(|v| v.clone()).unwrap_or_default();
    if !errors.is_empty() {
        return Err(format!("TCP bound: {}", errors.join("; ")));
    }
    // A repetition lasts until its last receiver has all its bytes.
    let gbps = (0..REPS)
        .filter_map(|r| {
            let t = receiver_times
                .iter()
                .filter_map(|v| v.get(r))
                .fold(0f64, |a, &b| a.max(b));
            (t > 0.0).then(|| (n * PASSES * bytes) as f64 / t / 1e9)
        })
        .fold(0f64, f64::max);
    Ok(TcpRate { gbps, congestion })
}

/// The busbw (GB/s, nccl-tests' factors) that `coll` on `n` ranks would
/// reach moving only the bytes it must between ranks at the aggregate TCP
/// rate `rate`: for a buffer of S bytes, allreduce sends 2(n-1)S in all,
/// reduce-scatter, allgather, alltoall and broadcast (n-1)S, reduce (n-1)S,
/// sendrecv nS. `None` for gather and scatter (all bytes go through one
/// root, which a ring's aggregate does not bound), barrier and a single rank.
pub fn bound_busbw(coll: Coll, n: usize, rate: f64) -> Option<f64> {
    if n < 2 || rate <= 0.0 {
        return None;
    }
    let nf = n as f64;
    match coll {
        Coll::Allreduce
        | Coll::ReduceScatter
        | Coll::Allgather
        | Coll::Alltoall
        | Coll::Sendrecv => Some(rate / nf),
        Coll::Broadcast | Coll::Reduce => Some(rate / (nf - 1.0)),
        Coll::Gather | Coll::Scatter | Coll::Barrier => None,
    }
}

/// The formula [`bound_busbw`] uses, in words, for the table's header.
pub fn bound_formula(coll: Coll) -> &'static str {
    match coll {
        Coll::Allreduce
        | Coll::ReduceScatter
        | Coll::Allgather
        | Coll::Alltoall
        | Coll::Sendrecv => "tcp / n",
        Coll::Broadcast | Coll::Reduce => "tcp / (n-1)",
        Coll::Gather | Coll::Scatter | Coll::Barrier => "none",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_follow_the_model() {
        // 4 ranks at 8 GB/s: allreduce sends 6S in S/t · 3/2 busbw → 8/4.
        assert!((bound_busbw(Coll::Allreduce, 4, 8.0).unwrap() - 2.0).abs() < 1e-9);
        assert!((bound_busbw(Coll::Allgather, 4, 8.0).unwrap() - 2.0).abs() < 1e-9);
        assert!((bound_busbw(Coll::Broadcast, 3, 8.0).unwrap() - 4.0).abs() < 1e-9);
        assert_eq!(bound_busbw(Coll::Gather, 4, 8.0), None);
        assert_eq!(bound_busbw(Coll::Allreduce, 1, 8.0), None);
    }

    #[test]
    fn a_ring_of_streams_moves_bytes() {
        for n in [2, 3] {
            let rate = measure_ring(n, &[], 256 * 1024).unwrap();
            assert!(rate.gbps > 0.0, "{n} streams: {rate:?}");
            assert!(!rate.congestion.is_empty(), "{rate:?}");
        }
        assert!(measure_ring(1, &[], 1024).is_err());
    }
}
