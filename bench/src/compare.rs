//! `compare`: ccl and its peers (OpenMPI, MPICH, oneCCL, Gloo) on the same
//! collective, type, sizes, rank count, placement and links, in one run.
//!
//! For every size, each of `--rounds` rounds starts a fresh job of ccl and of
//! every peer, one after the other, in an order rotated from round to round,
//! so that a slow drift of a noisy machine hits all alike; the round with the
//! median time counts for each. The memory bound (a copy, plain or with
//! streaming stores, and a plain `a += b`, on as many threads as ranks,
//! placed as the ranks) is measured
//! before and after the sweep, and the better of the two counts. One
//! nccl-tests-style table gives every library's time and busbw per size, the
//! best peer, ccl's busbw over the best peer's, and ccl's busbw over the
//! bound. Over TCP a second bound, plain loopback TCP streams placed as the
//! ranks ([`tcpbw`]), is measured before and after the sweep as well.

use std::fmt::Write as _;

use ccl_transport_tcp::Congestion;
use serde::{Deserialize, Serialize};

use crate::{
    args::{CompareTarget, PeersArgs, Plan},
    c2c,
    coll::Coll,
    membw::{self, MemBw},
    peers::{self, JobError, Link, Peer, PeerKind, PeerRow, PeerTools},
    plot::{self, Series},
    report::{self, Row, Versions},
    size::format_size,
    tcpbw::{self, TcpRate},
};

/// One peer's figures for one size.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PeerResult {
    pub peer: String,
    #[serde(flatten)]
    pub row: PeerRow,
    /// Every round's time ([`report::TIME_DEFINITION`]), in run order.
    pub round_times_us: Vec<f64>,
    /// The core-to-core round trip (ns) measured just before each round's
    /// job, in run order ([`crate::c2c`]); `None` where it could not be.
    #[serde(default)]
    pub round_core_to_core_ns: Vec<Option<f64>>,
    /// Jobs of this peer at this size that hung, were killed at the limit and
    /// started again ([`PEER_HANG_RETRIES`]); their rounds are the reruns'.
    #[serde(default)]
    pub hung_jobs: usize,
}

/// How often one round's job of a peer that hung (killed at its limit) is
/// started again before the comparison fails: MPICH's 2-rank jobs over TCP
/// hang now and then. ccl's own jobs are never retried: a hang of ccl fails
/// the run.
pub const PEER_HANG_RETRIES: usize = 2;

/// Runs `job` until it gives a result, starting it again after a hang at
/// most `retries` times (`note` hears each hang's message and the attempt
/// that follows); returns the result and the number of hangs. Any other
/// failure, or a hang beyond the retries, is the error.
fn retry_hangs<T>(
    retries: usize,
    mut job: impl FnMut() -> Result<T, JobError>,
    mut note: impl FnMut(&str, usize),
) -> Result<(T, usize), String> {
    let mut hangs = 0;
    loop {
        match job() {
            Ok(t) => return Ok((t, hangs)),
            Err(JobError::TimedOut(m)) if hangs < retries => {
                hangs += 1;
                note(&m, hangs);
            }
            Err(JobError::TimedOut(m)) => {
                return Err(format!("{m} ({} times in a row)", hangs + 1))
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// One size of the comparison.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SizeRow {
    pub size_bytes: u64,
    pub count: u64,
    pub ccl: Row,
    pub ccl_round_times_us: Vec<f64>,
    /// As [`PeerResult::round_core_to_core_ns`], before ccl's jobs.
    #[serde(default)]
    pub ccl_round_core_to_core_ns: Vec<Option<f64>>,
    /// The median of every job's core-to-core round trip at this size.
    #[serde(default)]
    pub core_to_core_ns: Option<f64>,
    pub peers: Vec<PeerResult>,
    /// The peer with the highest busbw at this size.
    pub best_peer: String,
    pub best_peer_busbw_gbps: f64,
    /// ccl's busbw / the best peer's = the best peer's time / ccl's (above 1:
    /// ccl is faster than every peer).
    pub ratio_to_best: f64,
    /// ccl's busbw / the memory bound's busbw.
    pub ccl_of_bound: Option<f64>,
    /// The best peer's busbw / the memory bound's busbw.
    pub best_peer_of_bound: Option<f64>,
    /// ccl's busbw / the TCP bound's busbw (runs over TCP).
    #[serde(default)]
    pub ccl_of_tcp_bound: Option<f64>,
    /// The best peer's busbw / the TCP bound's busbw (runs over TCP).
    #[serde(default)]
    pub best_peer_of_tcp_bound: Option<f64>,
}

/// A peer as it ran.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PeerInfo {
    pub name: String,
    /// The library's own words (from its benchmark's `# library:` line).
    pub version: String,
    /// How its ranks were started, with the variables set for them.
    pub launch: String,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PeersConfig {
    pub collective: String,
    pub ranks: usize,
    /// shm or tcp: the links every library was forced onto (Gloo: TCP always).
    pub transport: Link,
    pub placement: String,
    /// The CPUs of ranks 0 and 1, between which the round trip before each
    /// job is measured; `None` with fewer than two CPUs.
    #[serde(default)]
    pub core_to_core_cpus: Option<(usize, usize)>,
    pub dtype: String,
    pub op: String,
    pub root: i64,
    pub inplace: bool,
    pub iters: usize,
    pub warmup: usize,
    pub rounds: usize,
    pub sizes_requested: Vec<u64>,
    pub ccl_launch: String,
    /// The congestion control of ccl's TCP links and of the peers' sockets.
    #[serde(default)]
    pub tcp_congestion: String,
    pub peers: Vec<PeerInfo>,
    pub time_definition: String,
    pub round_definition: String,
}

/// The memory bound of the run.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct MemoryBound {
    pub threads: usize,
    pub buffer_bytes: u64,
    pub before: MemBw,
    pub after: MemBw,
    /// The better of before and after, kernel by kernel.
    pub best: MemBw,
    /// The busbw the collective would reach doing only its memory work at `best`.
    pub bound_busbw_gbps: Option<f64>,
    pub formula: String,
    pub definition: String,
}

/// The loopback TCP bound of a run over TCP ([`tcpbw`]).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TcpBound {
    /// Ranks whose places the streams' ends take.
    pub ranks: usize,
    pub buffer_bytes: u64,
    pub before: TcpRate,
    pub after: TcpRate,
    /// The rate of before and after that bounds the collective (GB/s, all
    /// streams together): the faster pattern's, or one stream's where the
    /// bytes go one way (`tcpbw::rate_for`).
    pub best_gbps: f64,
    /// The busbw the collective would reach moving only its bytes at `best_gbps`.
    pub bound_busbw_gbps: Option<f64>,
    pub formula: String,
    pub definition: String,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PeersReport {
    pub tool: String,
    pub config: PeersConfig,
    pub memory: MemoryBound,
    /// Runs over TCP only.
    #[serde(default)]
    pub tcp: Option<TcpBound>,
    pub rows: Vec<SizeRow>,
    pub versions: Versions,
    pub unix_time: u64,
}

const BOUND_DEFINITION: &str = "copy: the faster of dst.copy_from_slice(src) and a copy with streaming stores, a += b: f32, on one thread per rank placed as the ranks, each on its own buffers; GB/s of destination bytes, all threads together. Bound: the busbw if the collective did only its unavoidable memory work at those rates, every rank reading its peers' buffers directly (for S bytes: allreduce adds (n-1)S and copies (n-1)S; reduce-scatter adds (n-1)S; allgather and alltoall copy (n-1)S; broadcast copies (n-1)S)";

const TCP_BOUND_DEFINITION: &str = "tcp: plain TCP streams over loopback between threads placed as the ranks, unpaced, moving buffers of the memory bound's size, in two patterns: a ring (rank i sends to rank i+1, receives from rank i-1, all at once) and one stream alone (rank 0 to rank 1); GB/s received by all streams together, the faster pattern counts (one stream's for a broadcast or reduce of 2 ranks, whose bytes go one way). Bound: the busbw if the collective only moved the bytes it must between ranks at that rate (for S bytes: allreduce 2(n-1)S; reduce-scatter, allgather, alltoall, broadcast and reduce (n-1)S)";

fn usage(msg: &str) -> i32 {
    eprintln!("ccl-bench: compare: {msg}");
    2
}

fn fail(msg: &str) -> i32 {
    eprintln!("ccl-bench: compare: {msg}");
    1
}

/// The index of the median of `times` (the lower one of an even count).
fn median_index(times: &[f64]) -> usize {
    let mut idx: Vec<usize> = (0..times.len()).collect();
    idx.sort_by(|&a, &b| times[a].total_cmp(&times[b]));
    idx[(idx.len().saturating_sub(1)) / 2]
}

/// The columns of one library: its time and busbw.
const TIME_W: usize = 10;
const BW_W: usize = 12;

fn head_lines(names: &[&str]) -> String {
    let mut a = format!("#  {:>12} {:>12} {:>13}", "size", "count", "ccl algo");
    let mut b = format!("#  {:>12} {:>12} {:>13}", "(B)", "(elements)", "");
    for n in names {
        let _ = write!(
            a,
            " {:>TIME_W$} {:>BW_W$}",
            format!("{n} us"),
            format!("{n} GB/s")
        );
        let _ = write!(b, " {:>TIME_W$} {:>BW_W$}", "(us)", "(busbw)");
    }
    let _ = write!(a, " {:>8} {:>8} {:>8}", "best", "ccl/best", "c2c");
    let _ = write!(b, " {:>8} {:>8} {:>8}", "peer", "(busbw)", "(ns)");
    format!("{}\n{}", a.trim_end(), b.trim_end())
}

fn row_line(r: &SizeRow) -> String {
    let mut s = format!(
        "   {:>12} {:>12} {:>13} {:>TIME_W$.2} {:>BW_W$.3}",
        r.size_bytes, r.count, r.ccl.algo, r.ccl.time_us, r.ccl.busbw_gbps
    );
    for p in &r.peers {
        let _ = write!(
            s,
            " {:>TIME_W$.2} {:>BW_W$.3}",
            p.row.time_us, p.row.busbw_gbps
        );
    }
    let _ = write!(s, " {:>8} {:>8.2}", r.best_peer, r.ratio_to_best);
    match r.core_to_core_ns {
        Some(ns) => write!(s, " {ns:>8.0}"),
        None => write!(s, " {:>8}", "-"),
    }
    .expect("writing to a String");
    s
}

/// The median of the round trips that were measured.
fn median_probe(probes: impl Iterator<Item = Option<f64>>) -> Option<f64> {
    let mut v: Vec<f64> = probes.flatten().collect();
    v.sort_by(f64::total_cmp);
    (!v.is_empty()).then(|| v[v.len() / 2])
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        0.0
    }
}

fn to_csv(rep: &PeersReport) -> String {
    let c = &rep.config;
    let mut s = String::from(
        "collective,ranks,transport,dtype,op,root,inplace,iters,warmup,rounds,size_bytes,count,\
         library,version,time_us,median_time_us,algbw_gbps,busbw_gbps,best_peer,ccl_ratio_to_best,\
         copy_gbps,add_gbps,bound_busbw_gbps,tcp_gbps,tcp_bound_busbw_gbps\n",
    );
    let version = |name: &str| {
        c.peers
            .iter()
            .find(|p| p.name == name)
            .map_or_else(String::new, |p| p.version.clone())
    };
    for r in &rep.rows {
        let ccl = ("ccl", rep.versions.ccl.clone(), &r.ccl);
        let mut lines = vec![(
            ccl.0.to_string(),
            ccl.1,
            ccl.2.time_us,
            ccl.2.median_time_us,
            ccl.2.algbw_gbps,
            ccl.2.busbw_gbps,
        )];
        for p in &r.peers {
            lines.push((
                p.peer.clone(),
                version(&p.peer),
                p.row.time_us,
                p.row.median_time_us,
                p.row.algbw_gbps,
                p.row.busbw_gbps,
            ));
        }
        for (lib, ver, t, med, alg, bus) in lines {
            let fields = [
                c.collective.clone(),
                c.ranks.to_string(),
                c.transport.name().to_string(),
                c.dtype.clone(),
                c.op.clone(),
                c.root.to_string(),
                c.inplace.to_string(),
                c.iters.to_string(),
                c.warmup.to_string(),
                c.rounds.to_string(),
                r.size_bytes.to_string(),
                r.count.to_string(),
                lib,
                ver,
                format!("{t:.3}"),
                format!("{med:.3}"),
                format!("{alg:.6}"),
                format!("{bus:.6}"),
                r.best_peer.clone(),
                format!("{:.4}", r.ratio_to_best),
                format!("{:.3}", rep.memory.best.copy_gbps),
                format!("{:.3}", rep.memory.best.add_gbps),
                rep.memory
                    .bound_busbw_gbps
                    .map_or_else(String::new, |b| format!("{b:.3}")),
                rep.tcp
                    .as_ref()
                    .map_or_else(String::new, |t| format!("{:.3}", t.best_gbps)),
                rep.tcp
                    .as_ref()
                    .and_then(|t| t.bound_busbw_gbps)
                    .map_or_else(String::new, |b| format!("{b:.3}")),
            ];
            let line: Vec<String> = fields.iter().map(|f| report::csv_field(f)).collect();
            s.push_str(&line.join(","));
            s.push('\n');
        }
    }
    s
}

/// The congestion control of ccl's TCP links within this host (as
/// `CCL_TCP_CONGESTION` sets it) and of the peers' sockets (the kernel's
/// default, which none of them changes).
fn tcp_congestion() -> String {
    let knob = std::env::var("CCL_TCP_CONGESTION").ok();
    let ccl = match Congestion::parse(knob.as_deref().filter(|v| !v.is_empty())) {
        Ok(c) => c.within_host(),
        Err(e) => format!("none ({e})"),
    };
    format!(
        "ccl's links {ccl} (CCL_TCP_CONGESTION={}), the peers' sockets the kernel's default {}",
        knob.as_deref().unwrap_or("auto"),
        Congestion::System.within_host()
    )
}

fn write_outputs(plan: &Plan, rep: &PeersReport) -> Result<(), String> {
    if let Some(p) = &plan.json {
        report::write_file(p, &report::to_json(rep))?;
    }
    if let Some(p) = &plan.csv {
        report::write_file(p, &to_csv(rep))?;
    }
    if let Some(p) = &plan.plot {
        let mut series = vec![Series {
            label: format!("ccl ({})", rep.config.transport.name()),
            points: rep
                .rows
                .iter()
                .map(|r| (r.size_bytes, r.ccl.busbw_gbps))
                .collect(),
        }];
        for (i, info) in rep.config.peers.iter().enumerate() {
            let on = match (info.name.as_str(), rep.config.transport) {
                ("gloo", _) | (_, Link::Tcp) => "tcp",
                (_, Link::Shm) => "shm",
            };
            series.push(Series {
                label: format!("{} ({on})", info.name),
                points: rep
                    .rows
                    .iter()
                    .map(|r| (r.size_bytes, r.peers[i].row.busbw_gbps))
                    .collect(),
            });
        }
        if let Some(b) = rep.memory.bound_busbw_gbps {
            series.push(Series {
                label: format!("memory bound ({})", rep.memory.formula),
                points: rep.rows.iter().map(|r| (r.size_bytes, b)).collect(),
            });
        }
        if let Some((b, t)) = rep
            .tcp
            .as_ref()
            .and_then(|t| t.bound_busbw_gbps.map(|b| (b, t)))
        {
            series.push(Series {
                label: format!("TCP bound ({})", t.formula),
                points: rep.rows.iter().map(|r| (r.size_bytes, b)).collect(),
            });
        }
        let c = &rep.config;
        let title = format!(
            "{}: ccl vs peers, {} ranks, {}, {}",
            c.collective,
            c.ranks,
            c.dtype,
            c.transport.name()
        );
        plot::plot_busbw(p, &title, &series)?;
    }
    Ok(())
}

/// The TCP bound from the ring's rates before and after the sweep (the
/// better counts), entered into `rows` and printed.
fn tcp_bound(
    coll: Coll,
    n: usize,
    buffer: usize,
    before: TcpRate,
    after: TcpRate,
    rows: &mut [SizeRow],
) -> TcpBound {
    let best = TcpRate {
        ring_gbps: before.ring_gbps.max(after.ring_gbps),
        one_gbps: before.one_gbps.max(after.one_gbps),
        congestion: after.congestion.clone(),
    };
    let best_gbps = tcpbw::rate_for(coll, n, &best);
    let bound = tcpbw::bound_busbw(coll, n, best_gbps);
    for r in rows.iter_mut() {
        r.ccl_of_tcp_bound = bound.map(|b| ratio(r.ccl.busbw_gbps, b));
        r.best_peer_of_tcp_bound = bound.map(|b| ratio(r.best_peer_busbw_gbps, b));
    }
    println!(
        "# TCP (after): a ring {:.2} GB/s, one stream {:.2} GB/s; the bound's rate {best_gbps:.2}",
        after.ring_gbps, after.one_gbps
    );
    match bound {
        Some(b) => {
            println!(
                "# TCP bound of {} at {n} ranks: busbw {b:.3} GB/s = {} (bench/README.md)",
                coll.name(),
                tcpbw::bound_formula(coll, n),
            );
            println!(
                "# busbw / TCP bound, size by size: ccl {}; best peer {}",
                ratio_list(rows, &|r| r.ccl_of_tcp_bound),
                ratio_list(rows, &|r| r.best_peer_of_tcp_bound)
            );
        }
        None => println!("# TCP bound: none for {} at {n} ranks", coll.name()),
    }
    TcpBound {
        ranks: n,
        buffer_bytes: buffer as u64,
        before,
        after,
        best_gbps,
        bound_busbw_gbps: bound,
        formula: tcpbw::bound_formula(coll, n).into(),
        definition: TCP_BOUND_DEFINITION.into(),
    }
}

/// `f` of every row, two decimals, "-" where it has none.
fn ratio_list(rows: &[SizeRow], f: &dyn Fn(&SizeRow) -> Option<f64>) -> String {
    rows.iter()
        .map(|r| f(r).map_or_else(|| "-".into(), |x| format!("{x:.2}")))
        .collect::<Vec<String>>()
        .join(" ")
}

/// Runs `compare`; returns the exit status.
pub fn main(a: PeersArgs) -> i32 {
    let mut plan = match a.target.plan() {
        Ok(p) => p,
        Err(m) => return usage(&m),
    };
    plan.shared_buffers = a.shared_buffers;
    let n = match CompareTarget::local_ranks(&plan, "compare") {
        Ok(n) => n,
        Err(m) => return usage(&m),
    };
    let mut kinds: Vec<PeerKind> = Vec::new();
    for k in &a.peers {
        if !kinds.contains(k) {
            kinds.push(*k);
        }
    }
    if kinds.is_empty() {
        return usage("--peers: name at least one of openmpi, mpich, oneccl, gloo");
    }
    for k in &kinds {
        if let Err(m) = k.supports(&plan) {
            return usage(&m);
        }
    }
    let target = peers::target_dir().unwrap_or_else(|| "target".into());
    let tools = PeerTools {
        openmpi_mpicc: a.openmpi_mpicc.clone(),
        openmpi_mpirun: a.openmpi_mpirun.clone(),
        mpich_mpicc: a.mpich_mpicc.clone(),
        mpich_mpirun: a.mpich_mpirun.clone(),
        oneccl: a.oneccl.clone().unwrap_or_else(|| target.join("oneccl")),
        python: a
            .python
            .clone()
            .unwrap_or_else(|| target.join("venv").join("bin").join("python")),
    };
    let link = a.transport;
    let mut peers = Vec::with_capacity(kinds.len());
    for k in &kinds {
        match Peer::prepare(*k, &tools, n, plan.bind, link) {
            Ok(p) => peers.push(p),
            Err(m) => return fail(&format!("{}: {m}", k.name())),
        }
    }
    let cpus = match plan.bind.cpus() {
        Ok(c) => c,
        Err(e) => {
            return fail(&format!(
                "--bind core: cannot read the CPUs it may use: {e}"
            ))
        }
    };
    let placement = ccl_run::describe_binding(plan.bind, n, &cpus);
    // One job (start, set-up, warm-up and timed calls of one size) may last
    // three call deadlines: a peer that hangs fails the comparison in minutes.
    let limit = plan.timeout.saturating_mul(3);
    let coll = plan.coll;
    let buffer = a.membw_size as usize;

    println!(
        "# ccl-bench compare {}: {n} ranks on 1 host ({placement}), links {}, dtype {}{}, {}, iters {}, warmup {}, rounds {}",
        coll.name(),
        link.name(),
        plan.dtype,
        plan.op_root_words(),
        plan.form(),
        plan.iters,
        plan.warmup,
        a.rounds
    );
    let ccl_launch = format!(
        "ccl-bench {} --ranks {n} --bind {} --transport {}{} (local processes {placement})",
        coll.name(),
        plan.bind.name(),
        link.name(),
        match plan.shared_buffers {
            true => " --shared-buffers",
            false => "",
        }
    );
    println!("# ccl {}: {ccl_launch}", env!("CARGO_PKG_VERSION"));
    let congestion = tcp_congestion();
    println!("# TCP congestion control: {congestion}");
    for p in &peers {
        println!("# {}: {}", p.kind.name(), p.launch);
    }
    println!(
        "# each size: every library in a fresh job, in an order rotated per round; time = the slowest rank's timed loop / iterations ({} of {} rounds)",
        if a.rounds > 1 { "the median" } else { "one" },
        a.rounds
    );
    println!(
        "# busbw as nccl-tests; ccl/best = ccl busbw / best peer's busbw (above 1, ccl is faster than every peer)"
    );
    let before = membw::measure_both(n, &cpus, buffer);
    println!(
        "# memory (before): copy {:.2} GB/s, a += b {:.2} GB/s ({n} threads placed as the ranks, {} each)",
        before.copy_gbps,
        before.add_gbps,
        format_size(buffer as u64)
    );
    let tcp_before = match link {
        Link::Tcp => match tcpbw::measure(n, &cpus, buffer) {
            Ok(r) => {
                println!(
                    "# TCP (before): a ring of {n} streams {:.2} GB/s, one stream {:.2} GB/s (plain sockets over loopback, {}, ends placed as the ranks, {} buffers)",
                    r.ring_gbps,
                    r.one_gbps,
                    r.congestion,
                    format_size(buffer as u64)
                );
                Some(r)
            }
            Err(m) => return fail(&m),
        },
        Link::Shm => None,
    };
    let probe_cpus =
        c2c::pair(&cpus).or_else(|| ccl_run::allowed_cpus().ok().and_then(|c| c2c::pair(&c)));
    let probe = || probe_cpus.and_then(|(x, y)| c2c::round_trip_ns(x, y));
    match probe_cpus {
        Some((x, y)) => println!(
            "# c2c = core-to-core round trip between CPUs {x} and {y} (those of ranks 0 and 1), measured before every job; the median per size (see README, \"Two speeds of one VM\")"
        ),
        None => println!("# c2c: not measured (fewer than two CPUs)"),
    }
    let mut names = vec!["ccl"];
    names.extend(peers.iter().map(|p| p.kind.name()));
    println!("#\n{}", head_lines(&names));

    let mut rows: Vec<SizeRow> = Vec::new();
    for &bytes in &plan.sizes {
        let entries = peers.len() + 1;
        let mut ccl_rounds: Vec<Row> = Vec::new();
        let mut peer_rounds: Vec<Vec<PeerRow>> = vec![Vec::new(); peers.len()];
        let mut ccl_probes = Vec::with_capacity(a.rounds);
        let mut peer_probes: Vec<Vec<Option<f64>>> = vec![Vec::new(); peers.len()];
        let mut peer_hangs = vec![0usize; peers.len()];
        for round in 0..a.rounds {
            for k in 0..entries {
                let e = (k + round) % entries;
                let ns = probe();
                let r = if e == 0 {
                    ccl_probes.push(ns);
                    peers::run_ccl(&plan, n, link.name(), bytes, limit).map(|r| ccl_rounds.push(r))
                } else {
                    peer_probes[e - 1].push(ns);
                    let peer = &mut peers[e - 1];
                    let name = peer.kind.name();
                    retry_hangs(
                        PEER_HANG_RETRIES,
                        || peer.run(&plan, n, bytes, limit),
                        |m, k| {
                            println!(
                                "# {name}, {}, round {}: {m}; started again ({k} of {PEER_HANG_RETRIES})",
                                format_size(bytes),
                                round + 1
                            )
                        },
                    )
                    .map(|(r, hangs)| {
                        peer_rounds[e - 1].push(r);
                        peer_hangs[e - 1] += hangs;
                    })
                };
                if let Err(m) = r {
                    return fail(&m);
                }
            }
        }
        let ccl_times: Vec<f64> = ccl_rounds.iter().map(|r| r.time_us).collect();
        let ccl = ccl_rounds.swap_remove(median_index(&ccl_times));
        let mut results = Vec::with_capacity(peers.len());
        let core_to_core_ns = median_probe(
            ccl_probes
                .iter()
                .chain(peer_probes.iter().flatten())
                .copied(),
        );
        for (((p, mut rounds), probes), hung_jobs) in peers
            .iter()
            .zip(peer_rounds)
            .zip(peer_probes)
            .zip(peer_hangs)
        {
            let times: Vec<f64> = rounds.iter().map(|r| r.time_us).collect();
            let row = rounds.swap_remove(median_index(&times));
            if row.size_bytes != ccl.size_bytes && coll != Coll::Barrier {
                return fail(&format!(
                    "ccl and {} measured different sizes ({} and {} bytes)",
                    p.kind.name(),
                    ccl.size_bytes,
                    row.size_bytes
                ));
            }
            results.push(PeerResult {
                peer: p.kind.name().into(),
                row,
                round_times_us: times,
                round_core_to_core_ns: probes,
                hung_jobs,
            });
        }
        // The fastest peer (= the highest busbw, every peer moving the same size).
        let best = results
            .iter()
            .min_by(|x, y| x.row.time_us.total_cmp(&y.row.time_us))
            .expect("at least one peer");
        let row = SizeRow {
            size_bytes: ccl.size_bytes,
            count: ccl.count,
            best_peer: best.peer.clone(),
            best_peer_busbw_gbps: best.row.busbw_gbps,
            ratio_to_best: ratio(best.row.time_us, ccl.time_us),
            // Filled in after the sweep, against the run's bound.
            ccl_of_bound: None,
            best_peer_of_bound: None,
            ccl_of_tcp_bound: None,
            best_peer_of_tcp_bound: None,
            ccl,
            ccl_round_times_us: ccl_times,
            ccl_round_core_to_core_ns: ccl_probes,
            core_to_core_ns,
            peers: results,
        };
        println!("{}", row_line(&row));
        rows.push(row);
    }

    let after = membw::measure_both(n, &cpus, buffer);
    let best = before.max(after);
    let bound = membw::bound_busbw(coll, n, plan.inplace, best);
    for r in &mut rows {
        // The bound of the whole run: the better measurement.
        r.ccl_of_bound = bound.map(|b| ratio(r.ccl.busbw_gbps, b));
        r.best_peer_of_bound = bound.map(|b| ratio(r.best_peer_busbw_gbps, b));
    }
    println!(
        "# memory (after): copy {:.2} GB/s, a += b {:.2} GB/s; best: copy {:.2}, a += b {:.2}",
        after.copy_gbps, after.add_gbps, best.copy_gbps, best.add_gbps
    );
    match bound {
        Some(b) => {
            println!(
                "# memory bound of {} at {n} ranks: busbw {b:.3} GB/s = {} with the best copy and a += b (single-copy model, bench/README.md)",
                coll.name(),
                membw::bound_formula(coll, plan.inplace),
            );
            println!(
                "# busbw / bound, size by size: ccl {}; best peer {}",
                ratio_list(&rows, &|r| r.ccl_of_bound),
                ratio_list(&rows, &|r| r.best_peer_of_bound)
            );
        }
        None => println!("# memory bound: none for {} at {n} ranks", coll.name()),
    }
    let tcp = match tcp_before {
        Some(before) => match tcpbw::measure(n, &cpus, buffer) {
            Ok(after) => Some(tcp_bound(coll, n, buffer, before, after, &mut rows)),
            Err(m) => return fail(&m),
        },
        None => None,
    };
    let wins = rows.iter().filter(|r| r.ratio_to_best >= 1.0).count();
    let worst = rows
        .iter()
        .min_by(|x, y| x.ratio_to_best.total_cmp(&y.ratio_to_best));
    if let Some(w) = worst {
        println!(
            "# ccl at or above the best peer at {wins} of {} sizes; lowest ccl/best {:.2} at {} ({})",
            rows.len(),
            w.ratio_to_best,
            format_size(w.size_bytes),
            w.best_peer
        );
    }
    let mut probes: Vec<f64> = rows
        .iter()
        .flat_map(|r| {
            r.ccl_round_core_to_core_ns
                .iter()
                .chain(r.peers.iter().flat_map(|p| &p.round_core_to_core_ns))
        })
        .flatten()
        .copied()
        .collect();
    probes.sort_by(f64::total_cmp);
    if let (Some(lo), Some(hi)) = (probes.first(), probes.last()) {
        println!(
            "# c2c over the run: median {:.0} ns, from {lo:.0} to {hi:.0} ns ({} jobs)",
            probes[probes.len() / 2],
            probes.len()
        );
    }
    let infos: Vec<PeerInfo> = peers
        .iter()
        .map(|p| PeerInfo {
            name: p.kind.name().into(),
            version: p.version.clone().unwrap_or_else(|| p.kind.name().into()),
            launch: p.launch.clone(),
        })
        .collect();
    for i in &infos {
        println!("# {}: {}", i.name, i.version);
    }

    let rep = PeersReport {
        tool: "ccl-bench compare".into(),
        config: PeersConfig {
            collective: coll.name().into(),
            ranks: n,
            transport: link,
            placement,
            core_to_core_cpus: probe_cpus,
            dtype: plan.dtype.name().into(),
            op: plan.op_label(),
            root: plan.root_label(),
            inplace: plan.inplace,
            iters: plan.iters,
            warmup: plan.warmup,
            rounds: a.rounds,
            sizes_requested: plan.sizes.clone(),
            ccl_launch,
            tcp_congestion: congestion,
            peers: infos,
            time_definition: report::TIME_DEFINITION.into(),
            round_definition: "each size: every library once per round in a fresh job, the order rotated by one per round; the round with the median time counts".into(),
        },
        memory: MemoryBound {
            threads: n,
            buffer_bytes: buffer as u64,
            before,
            after,
            best,
            bound_busbw_gbps: bound,
            formula: membw::bound_formula(coll, plan.inplace).into(),
            definition: BOUND_DEFINITION.into(),
        },
        tcp,
        rows,
        versions: Versions::current(),
        unix_time: report::unix_time(),
    };
    if let Err(m) = write_outputs(&plan, &rep) {
        return fail(&m);
    }
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_round() {
        assert_eq!(median_index(&[3.0, 1.0, 2.0]), 2);
        assert_eq!(median_index(&[5.0]), 0);
        assert_eq!(median_index(&[4.0, 1.0, 3.0, 2.0]), 3);
    }

    #[test]
    fn table_has_a_column_pair_per_library() {
        let h = head_lines(&["ccl", "openmpi", "gloo"]);
        for k in ["ccl us", "openmpi GB/s", "gloo us", "ccl/best"] {
            assert!(h.contains(k), "{h}");
        }
    }

    /// A job that hangs `hangs` times, then gives `7`.
    fn hanging(hangs: usize) -> impl FnMut() -> Result<u32, JobError> {
        let mut calls = 0;
        move || {
            calls += 1;
            match calls <= hangs {
                true => Err(JobError::TimedOut(format!("hang {calls}"))),
                false => Ok(7),
            }
        }
    }

    #[test]
    fn a_peer_job_that_hangs_is_started_again_up_to_the_retries() {
        let mut notes = Vec::new();
        let r = retry_hangs(2, hanging(2), |m, k| notes.push(format!("{m}/{k}")));
        assert_eq!(r.unwrap(), (7, 2));
        assert_eq!(notes, ["hang 1/1", "hang 2/2"]);

        let r = retry_hangs(2, hanging(3), |_, _| {});
        assert_eq!(r.unwrap_err(), "hang 3 (3 times in a row)");
        assert_eq!(retry_hangs(0, hanging(0), |_, _| {}).unwrap(), (7, 0));
    }

    #[test]
    fn a_peer_job_that_fails_is_not_started_again() {
        let mut calls = 0;
        let r: Result<(u32, usize), String> = retry_hangs(
            2,
            || {
                calls += 1;
                Err(JobError::Failed("exit 1".into()))
            },
            |_, _| panic!("no hang to note"),
        );
        assert_eq!(r.unwrap_err(), "exit 1");
        assert_eq!(calls, 1);
    }
}
