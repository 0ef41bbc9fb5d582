//! The loopback TCP bound of a comparison over TCP, measured in the same run:
//! plain TCP streams between threads pinned where the ranks are, unpaced
//! (the congestion control ccl's links within a host get) and moving nothing
//! but bytes, in two patterns: a ring (rank i sends to rank i+1 and receives
//! from rank i-1, all at once) and one stream alone (rank 0 to rank 1). The
//! faster pattern's aggregate rate is what the kernel's two copies per byte
//! (into a socket, out of another) allow on this machine. [`bound_busbw`]
//! turns it into the bus bandwidth a collective would reach if it only moved
//! the bytes it must between ranks at that rate.

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
const REPS: usize = 5;
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

/// One measurement of both patterns.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct TcpRate {
    /// The ring: bytes received per second by all ranks together (1e9).
    pub ring_gbps: f64,
    /// One stream alone, rank 0 to rank 1 (1e9 bytes per second).
    pub one_gbps: f64,
    /// The congestion control the streams ran with.
    pub congestion: String,
}

impl TcpRate {
    /// The faster pattern's rate.
    pub fn best_gbps(&self) -> f64 {
        self.ring_gbps.max(self.one_gbps)
    }
}

/// Connects a stream from rank `from` to rank `to` for each pair of `pairs`
/// over loopback; returns (sending end, receiving end) per pair.
fn connect(pairs: &[(usize, usize)], congestion: &str) -> io::Result<Vec<(TcpStream, TcpStream)>> {
    let mut streams = Vec::with_capacity(pairs.len());
    for _ in pairs {
        let l = socket(congestion)?;
        l.bind(&SocketAddr::from((Ipv4Addr::LOCALHOST, 0)).into())?;
        l.listen(1)?;
        l.set_nonblocking(true)?;
        let l = TcpListener::from(l);
        let tx = socket(congestion)?;
        tx.connect_timeout(&l.local_addr()?.into(), DEADLINE)?;
        let start = Instant::now();
        let rx = loop {
            match l.accept() {
                Ok((s, _)) => break s,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock && start.elapsed() < DEADLINE => {
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(e) => return Err(e),
            }
        };
        rx.set_nonblocking(false)?;
        let tx = TcpStream::from(tx);
        for s in [&tx, &rx] {
            s.set_read_timeout(Some(DEADLINE))?;
            s.set_write_timeout(Some(DEADLINE))?;
        }
        streams.push((tx, rx));
    }
    Ok(streams)
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

/// The aggregate rate (GB/s, 1e9 bytes received per second by all streams
/// together) of a stream per pair `(from, to)` of `pairs`, each end on a
/// thread pinned where its rank is (`cpus[rank % len]`, when not empty),
/// each stream moving [`PASSES`] buffers of `bytes` per repetition; the
/// best of [`REPS`] repetitions.
fn measure_streams(
    pairs: &[(usize, usize)],
    cpus: &[usize],
    bytes: usize,
    congestion: &str,
) -> Result<f64, String> {
    let streams = connect(pairs, congestion).map_err(|e| {
        format!(
            "TCP bound: connecting {} streams over loopback: {e}",
            pairs.len()
        )
    })?;
    let barrier = Arc::new(Barrier::new(2 * pairs.len()));
    let errors = Arc::new(Mutex::new(Vec::new()));
    let mut handles = Vec::with_capacity(2 * pairs.len());
    for (&(from, to), (tx, rx)) in pairs.iter().zip(streams) {
        for (stream, send, rank) in [(tx, true, from), (rx, false, to)] {
            let cpu = (!cpus.is_empty()).then(|| cpus[rank % cpus.len()]);
            let (barrier, errors) = (barrier.clone(), errors.clone());
            handles.push(std::thread::spawn(move || {
                if let Some(c) = cpu {
                    pin_current_thread(c);
                }
                let (mut times, failed) = run_end(Some(stream), send, bytes, &barrier);
                if let Some(e) = failed {
                    let what = if send { "sending to" } else { "receiving from" };
                    let other = if send { to } else { from };
                    if let Ok(mut v) = errors.lock() {
                        v.push(format!("rank {rank} {what} rank {other}: {e}"));
                    }
                }
                times.remove(0); // the first repetition warms up
                (send, times)
            }));
        }
    }
    let mut receiver_times = Vec::with_capacity(pairs.len());
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
    Ok((0..REPS)
        .filter_map(|r| {
            let t = receiver_times
                .iter()
                .filter_map(|v| v.get(r))
                .fold(0f64, |a, &b| a.max(b));
            (t > 0.0).then(|| (pairs.len() * PASSES * bytes) as f64 / t / 1e9)
        })
        .fold(0f64, f64::max))
}

/// Measures both patterns for `n` ranks placed on `cpus` (see the module
/// docs), with buffers of `bytes`.
pub fn measure(n: usize, cpus: &[usize], bytes: usize) -> Result<TcpRate, String> {
    if n < 2 {
        return Err("TCP bound: streams need at least 2 ranks".into());
    }
    let congestion = Congestion::Auto.within_host();
    let ring: Vec<(usize, usize)> = (0..n).map(|i| (i, (i + 1) % n)).collect();
    let ring_gbps = measure_streams(&ring, cpus, bytes, &congestion)?;
    let one_gbps = measure_streams(&[(0, 1)], cpus, bytes, &congestion)?;
    // What the kernel gave a socket opened as the streams' were.
    let congestion = socket(&congestion)
        .and_then(|s| SockRef::from(&s).tcp_congestion())
        .map(|c| {
            String::from_utf8_lossy(&c)
                .trim_end_matches('\0')
                .to_string()
        })
        .unwrap_or_else(|e| format!("unknown ({e})"));
    Ok(TcpRate {
        ring_gbps,
        one_gbps,
        congestion,
    })
}

/// Whether `coll` on `n` ranks moves its bytes one way over one stream (a
/// broadcast or reduce of 2 ranks), which only the one-stream pattern
/// bounds: the ring's rate counts a second stream that would carry nothing.
fn one_way(coll: Coll, n: usize) -> bool {
    n == 2 && matches!(coll, Coll::Broadcast | Coll::Reduce)
}

/// The aggregate rate (1e9 bytes per second) that bounds `coll` on `n`
/// ranks: one stream's for a call that moves its bytes one way between 2
/// ranks, else the faster pattern's.
pub fn rate_for(coll: Coll, n: usize, rate: &TcpRate) -> f64 {
    match one_way(coll, n) {
        true => rate.one_gbps,
        false => rate.best_gbps(),
    }
}

/// The busbw (GB/s, nccl-tests' factors) that `coll` on `n` ranks would
/// reach moving only the bytes it must between ranks at the aggregate TCP
/// rate `rate` ([`rate_for`]): for a buffer of S bytes, allreduce sends
/// 2(n-1)S in all, reduce-scatter, allgather, alltoall and broadcast
/// (n-1)S, reduce (n-1)S, sendrecv nS. `None` for gather and scatter (all
/// bytes go through one root, which an aggregate rate does not bound),
/// barrier and a single rank.
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

/// The formula [`bound_busbw`] uses with [`rate_for`]'s rate, in words, for
/// the table's header.
pub fn bound_formula(coll: Coll, n: usize) -> &'static str {
    match coll {
        _ if one_way(coll, n) => "one stream's tcp / (n-1)",
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
    fn a_one_way_call_of_two_ranks_is_bound_by_one_stream() {
        let rate = TcpRate {
            ring_gbps: 9.0,
            one_gbps: 7.0,
            congestion: "cubic".into(),
        };
        assert_eq!(rate_for(Coll::Broadcast, 2, &rate), 7.0);
        assert_eq!(rate_for(Coll::Reduce, 2, &rate), 7.0);
        assert_eq!(rate_for(Coll::Broadcast, 3, &rate), 9.0);
        assert_eq!(rate_for(Coll::Allgather, 2, &rate), 9.0);
        assert_eq!(
            bound_formula(Coll::Broadcast, 2),
            "one stream's tcp / (n-1)"
        );
        assert_eq!(bound_formula(Coll::Broadcast, 4), "tcp / (n-1)");
    }

    #[test]
    fn streams_move_bytes() {
        for n in [2, 3] {
            let rate = measure(n, &[], 256 * 1024).unwrap();
            assert!(
                rate.ring_gbps > 0.0 && rate.one_gbps > 0.0,
                "{n} ranks: {rate:?}"
            );
            assert!(!rate.congestion.is_empty(), "{rate:?}");
        }
        assert!(measure(1, &[], 1024).is_err());
    }
}
