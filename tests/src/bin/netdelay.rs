//! `ccl-netdelay`: a delay line for kernels without `tc netem`. It holds
//! every packet that an NFQUEUE rule hands it for a fixed time, then lets it
//! through, in arrival order. Run it inside a network namespace (it serves
//! that namespace's queue), then point a rule at the queue, e.g. to delay
//! what a host receives on eth0:
//!
//! ```text
//! ccl-netdelay --queue 0 --delay-ms 20 &
//! iptables -A INPUT -i eth0 -j NFQUEUE --queue-num 0
//! ```
//!
//! It prints `ready` once the queue is bound, and on SIGTERM or SIGINT the
//! number of packets it held, their mean hold time, and how often its socket
//! overran (the kernel then drops packets, which a wire would lose too). Packets are handed
//! over as the kernel has them (GSO packets stay whole) and without their
//! payload, so the cost is one netlink message per packet and a batched
//! verdict. Needs root (CAP_NET_ADMIN).

use std::{
    collections::VecDeque,
    io,
    os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd},
    process::ExitCode,
    sync::atomic::{AtomicBool, Ordering},
    time::{Duration, Instant},
};

use nix::{
    poll::{ppoll, PollFd, PollFlags},
    sys::time::TimeSpec,
};

/// Netlink message header length.
const NLMSG_HDR: usize = 16;
/// `struct nfgenmsg` length.
const NFGEN_HDR: usize = 4;
/// nfnetlink subsystem of NFQUEUE.
const NFNL_SUBSYS_QUEUE: u16 = 3;
const NFQNL_MSG_PACKET: u16 = 0;
const NFQNL_MSG_CONFIG: u16 = 2;
const NFQNL_MSG_VERDICT_BATCH: u16 = 3;
const NFQA_PACKET_HDR: u16 = 1;
const NFQA_VERDICT_HDR: u16 = 2;
const NFQA_CFG_CMD: u16 = 1;
const NFQA_CFG_PARAMS: u16 = 2;
const NFQA_CFG_QUEUE_MAXLEN: u16 = 3;
const NFQA_CFG_MASK: u16 = 4;
const NFQA_CFG_FLAGS: u16 = 5;
const NFQNL_CFG_CMD_BIND: u8 = 1;
const NFQNL_COPY_META: u8 = 1;
/// Hand GSO packets over whole instead of segmenting them first.
const NFQA_CFG_F_GSO: u32 = 1 << 2;
const NF_ACCEPT: u32 = 1;
/// Packets the kernel may hold for this queue: 1 Gbit/s for 100 ms of
/// 1 500-byte packets is about 8 300.
const QUEUE_MAXLEN: u32 = 100_000;

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::Relaxed);
}

struct Args {
    queue: u16,
    delay: Duration,
}

fn parse_args() -> Result<Args, String> {
    let mut queue = None;
    let mut delay = None;
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().ok_or(format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--queue" => queue = Some(value.parse().map_err(|e| format!("--queue {value}: {e}"))?),
            "--delay-ms" => {
                let ms: f64 = value
                    .parse()
                    .map_err(|e| format!("--delay-ms {value}: {e}"))?;
                if !(0.0..=10_000.0).contains(&ms) {
                    return Err(format!("--delay-ms {value}: expected 0 to 10000"));
                }
                delay = Some(Duration::from_secs_f64(ms / 1000.0));
            }
            other => return Err(format!("unknown option {other}")),
        }
    }
    Ok(Args {
        queue: queue.ok_or("--queue N is required")?,
        delay: delay.ok_or("--delay-ms MS is required")?,
    })
}

/// A netlink socket bound to one NFQUEUE queue of this namespace.
struct Queue {
    fd: OwnedFd,
    number: u16,
    seq: u32,
}

impl Queue {
    fn bind(number: u16) -> io::Result<Queue> {
        // SAFETY: plain system calls on a descriptor this function owns.
        let fd = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                libc::NETLINK_NETFILTER,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is a new descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let queue = Queue { fd, number, seq: 0 };
        // A deep receive buffer: packets the kernel cannot hand over are dropped.
        let size: libc::c_int = 64 << 20;
        // SAFETY: `size` outlives the call and its length is passed.
        unsafe {
            libc::setsockopt(
                queue.fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVBUFFORCE,
                (&size as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        let mut cmd = vec![NFQNL_CFG_CMD_BIND, 0];
        cmd.extend_from_slice(&0u16.to_be_bytes()); // pf: unused by BIND
        queue.request(NFQNL_MSG_CONFIG, &[(NFQA_CFG_CMD, &cmd)])?;
        let mut params = 0u32.to_be_bytes().to_vec(); // copy range: none
        params.push(NFQNL_COPY_META);
        queue.request(
            NFQNL_MSG_CONFIG,
            &[
                (NFQA_CFG_PARAMS, &params),
                (NFQA_CFG_QUEUE_MAXLEN, &QUEUE_MAXLEN.to_be_bytes()),
                (NFQA_CFG_MASK, &NFQA_CFG_F_GSO.to_be_bytes()),
                (NFQA_CFG_FLAGS, &NFQA_CFG_F_GSO.to_be_bytes()),
            ],
        )?;
        Ok(queue)
    }

    /// Builds one nfnetlink message of this queue.
    fn message(&self, kind: u16, flags: u16, attrs: &[(u16, &[u8])]) -> Vec<u8> {
        let mut msg = vec![0u8; NLMSG_HDR];
        msg.extend_from_slice(&[libc::AF_UNSPEC as u8, 0]);
        msg.extend_from_slice(&self.number.to_be_bytes());
        for (kind, payload) in attrs {
            msg.extend_from_slice(&((4 + payload.len()) as u16).to_ne_bytes());
            msg.extend_from_slice(&kind.to_ne_bytes());
            msg.extend_from_slice(payload);
            msg.resize(msg.len().next_multiple_of(4), 0);
        }
        let len = msg.len() as u32;
        msg[0..4].copy_from_slice(&len.to_ne_bytes());
        msg[4..6].copy_from_slice(&((NFNL_SUBSYS_QUEUE << 8) | kind).to_ne_bytes());
        msg[6..8].copy_from_slice(&flags.to_ne_bytes());
        msg[8..12].copy_from_slice(&self.seq.to_ne_bytes());
        msg
    }

    fn send(&self, msg: &[u8]) -> io::Result<()> {
        // SAFETY: `msg` is a valid buffer of the given length.
        let n = unsafe { libc::send(self.fd.as_raw_fd(), msg.as_ptr().cast(), msg.len(), 0) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Sends a configuration message and waits for the kernel's answer.
    fn request(&self, kind: u16, attrs: &[(u16, &[u8])]) -> io::Result<()> {
        let flags = (libc::NLM_F_REQUEST | libc::NLM_F_ACK) as u16;
        self.send(&self.message(kind, flags, attrs))?;
        let mut buf = vec![0u8; 8192];
        let n = self.recv(&mut buf, true)?;
        if n >= NLMSG_HDR + 4 && u16::from_ne_bytes([buf[4], buf[5]]) == libc::NLMSG_ERROR as u16 {
            let errno = i32::from_ne_bytes(buf[16..20].try_into().expect("4 bytes"));
            if errno != 0 {
                return Err(io::Error::from_raw_os_error(-errno));
            }
            return Ok(());
        }
        Err(io::Error::other("no answer from the kernel's NFQUEUE"))
    }

    /// Receives one datagram (several messages); `Ok(0)` when none waits.
    fn recv(&self, buf: &mut [u8], wait: bool) -> io::Result<usize> {
        let flags = if wait { 0 } else { libc::MSG_DONTWAIT };
        // SAFETY: `buf` is a valid, writable buffer of the given length.
        let n = unsafe {
            libc::recv(
                self.fd.as_raw_fd(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                flags,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            return match e.kind() {
                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => Ok(0),
                _ => Err(e),
            };
        }
        Ok(n as usize)
    }

    /// Lets through every held packet up to and including `id`.
    fn accept_through(&self, id: u32) -> io::Result<()> {
        let mut verdict = NF_ACCEPT.to_be_bytes().to_vec();
        verdict.extend_from_slice(&id.to_be_bytes());
        let msg = self.message(
            NFQNL_MSG_VERDICT_BATCH,
            libc::NLM_F_REQUEST as u16,
            &[(NFQA_VERDICT_HDR, &verdict)],
        );
        self.send(&msg)
    }

    /// Waits until a message arrives or `timeout` passes.
    fn wait(&self, timeout: Option<Duration>) {
        let mut fds = [PollFd::new(self.fd.as_fd(), PollFlags::POLLIN)];
        // An interruption (the stop signal) is a wake-up like any other.
        let _ = ppoll(&mut fds, timeout.map(TimeSpec::from), None);
    }
}

/// The packet ids of the NFQUEUE packet messages in one datagram.
fn packet_ids(datagram: &[u8], ids: &mut Vec<u32>) {
    let mut at = 0;
    while at + NLMSG_HDR <= datagram.len() {
        let len = u32::from_ne_bytes(datagram[at..at + 4].try_into().expect("4 bytes")) as usize;
        if len < NLMSG_HDR || at + len > datagram.len() {
            break;
        }
        let kind = u16::from_ne_bytes([datagram[at + 4], datagram[at + 5]]);
        if kind == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET {
            let mut a = at + NLMSG_HDR + NFGEN_HDR;
            while a + 4 <= at + len {
                let alen = u16::from_ne_bytes([datagram[a], datagram[a + 1]]) as usize;
                let akind = u16::from_ne_bytes([datagram[a + 2], datagram[a + 3]]) & 0x3fff;
                if alen < 4 || a + alen > at + len {
                    break;
                }
                if akind == NFQA_PACKET_HDR && alen >= 8 {
                    ids.push(u32::from_be_bytes(
                        datagram[a + 4..a + 8].try_into().expect("4 bytes"),
                    ));
                    break;
                }
                a += alen.next_multiple_of(4);
            }
        }
        at += len.next_multiple_of(4);
    }
}

fn run(args: Args) -> io::Result<()> {
    let queue = Queue::bind(args.queue)?;
    println!("ready");
    let mut held: VecDeque<(Instant, u32)> = VecDeque::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut ids = Vec::new();
    let (mut count, mut total_hold, mut overruns) = (0u64, Duration::ZERO, 0u64);
    while !STOP.load(Ordering::Relaxed) {
        let now = Instant::now();
        // Release what is due, in one verdict for the newest due packet.
        let mut through = None;
        while let Some(&(due, id)) = held.front() {
            if due > now {
                break;
            }
            held.pop_front();
            total_hold += now - (due - args.delay);
            count += 1;
            through = Some(id);
        }
        if let Some(id) = through {
            queue.accept_through(id)?;
        }
        queue.wait(
            held.front()
                .map(|&(due, _)| due.saturating_duration_since(now)),
        );
        loop {
            let n = match queue.recv(&mut buf, false) {
                // The socket overran: the kernel dropped packets (lost, as on a wire).
                Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => {
                    overruns += 1;
                    continue;
                }
                n => n?,
            };
            if n == 0 {
                break;
            }
            ids.clear();
            packet_ids(&buf[..n], &mut ids);
            let arrived = Instant::now();
            held.extend(ids.iter().map(|&id| (arrived + args.delay, id)));
        }
    }
    let mean = total_hold.as_secs_f64() * 1000.0 / count.max(1) as f64;
    println!("held {count} packets, mean {mean:.2} ms, {overruns} overruns");
    Ok(())
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("ccl-netdelay: {e}\nusage: ccl-netdelay --queue N --delay-ms MS");
            return ExitCode::from(2);
        }
    };
    for sig in [libc::SIGTERM, libc::SIGINT] {
        // SAFETY: the handler only stores to an atomic.
        unsafe { libc::signal(sig, on_signal as *const () as libc::sighandler_t) };
    }
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ccl-netdelay: {e} (needs root, and a kernel with NFQUEUE)");
            ExitCode::FAILURE
        }
    }
}
