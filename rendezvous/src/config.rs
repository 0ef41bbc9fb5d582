//! Configuration from the environment conventions people already use.
//!
//! Rank and world size come from the first launcher convention found:
//! torchrun (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`), OpenMPI
//! (`OMPI_COMM_WORLD_RANK`, `..._SIZE`, `..._LOCAL_RANK`, `..._LOCAL_SIZE`),
//! PMI (`PMI_RANK`, `PMI_SIZE`), Slurm (`SLURM_PROCID`, `SLURM_NTASKS`,
//! `SLURM_LOCALID`). The rendezvous is `CCL_STORE_PATH` (file store
//! directory), or `MASTER_ADDR`/`MASTER_PORT` (TCP store served by rank 0,
//! or torch's store that torchrun's agent serves when it sets
//! `TORCHELASTIC_USE_AGENT_STORE=True`), or else what the launcher implies:
//! under `mpirun` and `srun` with every rank on one host, a file store in a
//! directory of the job's own under the temp dir; under `srun` on several
//! hosts, a TCP store served by rank 0 on the first host of the node list.
//! `CCL_*` variables set ccl's own knobs.

use std::{
    collections::{BTreeMap, HashMap},
    path::PathBuf,
    time::Duration,
};

use ccl_core::{Error, Result};

pub use ccl_core::DEFAULT_TIMEOUT;

/// Which launcher convention the rank and world size were read from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Launcher {
    Torchrun,
    OpenMpi,
    Pmi,
    Slurm,
    /// No launcher variables: a single rank.
    None,
}

/// Where ranks meet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Rendezvous {
    /// TCP store at this address, served by rank 0, or by someone else
    /// (`external`, `CCL_STORE_EXTERNAL=1`) that every rank connects to.
    Tcp {
        host: String,
        port: u16,
        external: bool,
    },
    /// torch's `TCPStore` at this address, served by torchrun's elastic
    /// agent (`TORCHELASTIC_USE_AGENT_STORE=True`): every rank connects, and
    /// ccl's keys lie under `prefix`, which names the run and its restart.
    TorchAgent {
        host: String,
        port: u16,
        prefix: String,
    },
    /// File store in this directory.
    File(PathBuf),
    /// File store in a directory of this job's own under the temp dir,
    /// named by the launcher's job id (every rank on one host under `mpirun`
    /// or `srun`); the last rank to leave removes it.
    JobDir(PathBuf),
    /// World size 1 with nothing configured: no store needed.
    Local,
}

/// Everything ccl reads from the environment.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    pub rank: usize,
    pub world_size: usize,
    pub local_rank: usize,
    pub local_world_size: usize,
    pub launcher: Launcher,
    pub rendezvous: Rendezvous,
    /// `CCL_TIMEOUT`: deadline of every wait (`600`, `30s`, `500ms`, `10m`).
    pub timeout: Duration,
    /// `CCL_DEBUG`: tracing filter (`warn`, `info`, `debug`, `trace`, or a full filter).
    pub debug: Option<String>,
    /// `CCL_ALGO`: algorithm override, `ring` or per collective `allreduce=rd,broadcast=tree`
    /// (parsed by the facade, which knows the algorithms).
    pub algo: Option<String>,
    /// `CCL_SPIN_US`: microseconds a waiting thread polls before it sleeps
    /// (`None`: the facade decides from the ranks per host and the cores).
    pub spin: Option<Duration>,
    /// `CCL_TRANSPORT`: the one transport every pair must use, by name
    /// (`tcp`, `shm`, `quic`), or a list of candidates in order (`shm,quic`);
    /// `None` (unset or `auto`): each pair takes the first transport that can
    /// connect it.
    pub transport: Option<String>,
    /// `CCL_HOST_ID`: ranks with equal values count as one host (default: the
    /// hostname, boot id and namespaces of the process).
    pub host_id: Option<String>,
    /// `CCL_JOB_SECRET`: the job's shared secret; every store and link
    /// connection proves it (HMAC challenge-response). `None`: unauthenticated.
    pub job_secret: Option<ccl_core::JobSecret>,
    /// `CCL_DEBUG_CHECKS=1`: before every collective, ranks exchange their
    /// calls' arguments and fail with a mismatch if they differ.
    pub debug_checks: bool,
    /// Every `CCL_*` variable but the secret, for the knobs each transport
    /// reads itself ([`Config::knob`]).
    pub knobs: BTreeMap<String, String>,
}

/// Parses `600`, `2.5`, `30s`, `500ms`, `10m`, `1h` (a bare number is seconds).
pub fn parse_duration(s: &str) -> Option<Duration> {
    let s = s.trim();
    let (num, unit) = match s.find(|c: char| c.is_ascii_alphabetic()) {
        Some(i) => (&s[..i], &s[i..]),
        None => (s, "s"),
    };
    let v: f64 = num.trim().parse().ok()?;
    let secs = match unit {
        "ms" => v / 1000.0,
        "s" => v,
        "m" | "min" => v * 60.0,
        "h" => v * 3600.0,
        _ => return None,
    };
    (secs.is_finite() && secs >= 0.0).then(|| Duration::from_secs_f64(secs))
}

impl Config {
    /// Reads the process environment (variables that are not UTF-8 count as unset).
    pub fn from_env() -> Result<Config> {
        Config::from_env_with(&[])
    }

    /// Reads the process environment with the variables of `extra` set over
    /// it (the C and Python bindings pass rank, size and store this way).
    pub fn from_env_with(extra: &[(&str, String)]) -> Result<Config> {
        Config::from_vars(
            std::env::vars_os()
                .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
                .chain(extra.iter().map(|(k, v)| (k.to_string(), v.clone()))),
        )
    }

    /// Reads these variables (for tests and embedders); of a name given
    /// twice, the last value counts.
    pub fn from_vars<K: Into<String>, V: Into<String>>(
        vars: impl IntoIterator<Item = (K, V)>,
    ) -> Result<Config> {
        let vars: HashMap<String, String> = vars
            .into_iter()
            .map(|(k, v)| (k.into(), v.into()))
            .collect();
        let var = |k: &str| vars.get(k).cloned();
        let num =
            |k: &str| -> Result<Option<usize>> {
                match var(k) {
                    None => Ok(None),
                    Some(v) => v.trim().parse::<usize>().map(Some).map_err(|_| {
                        Error::Config(format!("{k}={v:?} is not a non-negative integer"))
                    }),
                }
            };
        let conventions: [(Launcher, &str, &str, &str, &str); 4] = [
            (
                Launcher::Torchrun,
                "RANK",
                "WORLD_SIZE",
                "LOCAL_RANK",
                "LOCAL_WORLD_SIZE",
            ),
            (
                Launcher::OpenMpi,
                "OMPI_COMM_WORLD_RANK",
                "OMPI_COMM_WORLD_SIZE",
                "OMPI_COMM_WORLD_LOCAL_RANK",
                "OMPI_COMM_WORLD_LOCAL_SIZE",
            ),
            (
                Launcher::Pmi,
                "PMI_RANK",
                "PMI_SIZE",
                "MPI_LOCALRANKID",
                "MPI_LOCALNRANKS",
            ),
            (
                Launcher::Slurm,
                "SLURM_PROCID",
                "SLURM_NTASKS",
                "SLURM_LOCALID",
                "SLURM_NTASKS_PER_NODE",
            ),
        ];
        let mut found = None;
        for (launcher, r, w, lr, lw) in conventions {
            if let (Some(rank), Some(world)) = (num(r)?, num(w)?) {
                let local_rank = num(lr)?.unwrap_or(rank);
                let local_world = num(lw)?.unwrap_or(world);
                found = Some((launcher, rank, world, local_rank, local_world));
                break;
            }
        }
        let (launcher, rank, world_size, local_rank, local_world_size) =
            found.unwrap_or((Launcher::None, 0, 1, 0, 1));
        if world_size == 0 {
            return Err(Error::Config("world size is 0".into()));
        }
        if rank >= world_size {
            return Err(Error::Config(format!(
                "rank {rank} is not below world size {world_size}"
            )));
        }
        let rendezvous = if let Some(path) = var("CCL_STORE_PATH") {
            Rendezvous::File(PathBuf::from(path))
        } else {
            match (var("MASTER_ADDR"), var("MASTER_PORT")) {
                (Some(host), Some(port)) => {
                    let port = port.trim().parse().map_err(|_| {
                        Error::Config(format!("MASTER_PORT={port:?} is not a port number"))
                    })?;
                    let external = flag(var("CCL_STORE_EXTERNAL"), "CCL_STORE_EXTERNAL", false)?;
                    if torch_agent_store(var("TORCHELASTIC_USE_AGENT_STORE"))? {
                        let run = var("TORCHELASTIC_RUN_ID").unwrap_or_else(|| "none".into());
                        let restart =
                            var("TORCHELASTIC_RESTART_COUNT").unwrap_or_else(|| "0".into());
                        Rendezvous::TorchAgent {
                            host,
                            port,
                            prefix: format!("ccl/{run}/restart-{restart}"),
                        }
                    } else {
                        Rendezvous::Tcp {
                            host,
                            port,
                            external,
                        }
                    }
                }
                _ if world_size == 1 => Rendezvous::Local,
                (Some(_), None) => {
                    return Err(Error::Config(format!(
                        "rank {rank} of {world_size}: MASTER_ADDR is set but MASTER_PORT is not"
                    )))
                }
                (None, _) => launcher_rendezvous(launcher, &var, world_size)
                    .map_err(|e| Error::Config(format!("rank {rank} of {world_size}: {e}")))?,
            }
        };
        let timeout = match var("CCL_TIMEOUT") {
            None => DEFAULT_TIMEOUT,
            Some(v) => parse_duration(&v).filter(|d| !d.is_zero()).ok_or_else(|| {
                Error::Config(format!(
                    "CCL_TIMEOUT={v:?} is not a duration like 600, 30s or 10m"
                ))
            })?,
        };
        Ok(Config {
            rank,
            world_size,
            local_rank,
            local_world_size,
            launcher,
            rendezvous,
            timeout,
            debug: var("CCL_DEBUG").filter(|s| !s.is_empty()),
            algo: var("CCL_ALGO").filter(|s| !s.is_empty()),
            spin: num("CCL_SPIN_US")?.map(|us| Duration::from_micros(us as u64)),
            transport: var("CCL_TRANSPORT")
                .map(|t| t.trim().to_ascii_lowercase())
                .filter(|t| !t.is_empty() && t != "auto"),
            host_id: var("CCL_HOST_ID").filter(|s| !s.is_empty()),
            job_secret: var("CCL_JOB_SECRET")
                .filter(|s| !s.is_empty())
                .map(ccl_core::JobSecret::new)
                .transpose()?,
            debug_checks: flag(var("CCL_DEBUG_CHECKS"), "CCL_DEBUG_CHECKS", false)?,
            knobs: vars
                .iter()
                // The secret is read above, and never printed.
                .filter(|(k, _)| k.starts_with("CCL_") && k.as_str() != "CCL_JOB_SECRET")
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
        })
    }

    /// The value of the `CCL_*` variable `name`, unless unset or empty.
    pub fn knob(&self, name: &str) -> Option<&str> {
        self.knobs
            .get(name)
            .map(String::as_str)
            .filter(|v| !v.is_empty())
    }

    /// The knob `name` as a whole number within `range` (`default` when
    /// unset); a `Config` error naming it otherwise.
    pub fn knob_number(
        &self,
        name: &str,
        default: usize,
        range: std::ops::RangeInclusive<usize>,
    ) -> Result<usize> {
        let Some(v) = self.knob(name) else {
            return Ok(default);
        };
        v.trim()
            .parse::<usize>()
            .ok()
            .filter(|n| range.contains(n))
            .ok_or_else(|| {
                Error::Config(format!(
                    "{name}={v:?} is not a whole number within {}..={}",
                    range.start(),
                    range.end()
                ))
            })
    }

    /// The 0/1 switch `name` (`default` when unset).
    pub fn knob_flag(&self, name: &str, default: bool) -> Result<bool> {
        flag(self.knob(name).map(str::to_string), name, default)
    }
}

/// Whether torchrun's agent serves the store (`TORCHELASTIC_USE_AGENT_STORE`,
/// which torch sets to `True` or `False`).
fn torch_agent_store(value: Option<String>) -> Result<bool> {
    match value.as_deref().map(str::trim) {
        None | Some("" | "False" | "false" | "0") => Ok(false),
        Some("True" | "true" | "1") => Ok(true),
        Some(v) => Err(Error::Config(format!(
            "TORCHELASTIC_USE_AGENT_STORE={v:?}: expected True or False"
        ))),
    }
}

/// Lowest port of a Slurm job's TCP store on several hosts
/// ([`slurm_port`]); the ports span 10,000 from here.
const SLURM_PORTS: u16 = 15000;

/// The rendezvous that `launcher` implies when neither `CCL_STORE_PATH` nor
/// `MASTER_ADDR`/`MASTER_PORT` is set: for OpenMPI and Slurm with every
/// rank on one host, a file store in the job's own directory under the
/// temp dir (`TMPDIR`, else `/tmp`); for Slurm on several hosts, a TCP store
/// that rank 0 serves on the first host of the node list at [`slurm_port`].
/// Errors say what to set instead.
fn launcher_rendezvous(
    launcher: Launcher,
    var: &impl Fn(&str) -> Option<String>,
    world_size: usize,
) -> std::result::Result<Rendezvous, String> {
    let temp_dir = || {
        PathBuf::from(
            var("TMPDIR")
                .filter(|t| !t.is_empty())
                .unwrap_or_else(|| "/tmp".into()),
        )
    };
    let set_instead = "set MASTER_ADDR (the host of rank 0) and MASTER_PORT, or CCL_STORE_PATH (a directory every host shares)";
    match launcher {
        Launcher::OpenMpi => {
            let local = var("OMPI_COMM_WORLD_LOCAL_SIZE");
            if local.as_deref().map(str::trim) != Some(world_size.to_string().as_str()) {
                return Err(format!(
                    "mpirun started the ranks on several hosts (OMPI_COMM_WORLD_LOCAL_SIZE={}, \
                     OMPI_COMM_WORLD_SIZE={world_size}): {set_instead}",
                    local.as_deref().unwrap_or("unset")
                ));
            }
            let job = var("PMIX_NAMESPACE")
                .or_else(|| var("OMPI_MCA_ess_base_jobid"))
                .filter(|j| !j.trim().is_empty())
                .ok_or_else(|| {
                    format!("mpirun set neither PMIX_NAMESPACE nor OMPI_MCA_ess_base_jobid: {set_instead}")
                })?;
            Ok(Rendezvous::JobDir(
                temp_dir().join(format!("ccl-openmpi-{}", file_safe(&job))),
            ))
        }
        Launcher::Slurm => {
            let number = |name: &str| -> std::result::Result<Option<u64>, String> {
                var(name)
                    .map(|v| {
                        v.trim()
                            .parse()
                            .map_err(|_| format!("{name}={v:?} is not a number"))
                    })
                    .transpose()
            };
            let job = number("SLURM_JOB_ID")?
                .ok_or_else(|| format!("SLURM_JOB_ID is not set: {set_instead}"))?;
            let step = number("SLURM_STEP_ID")?.unwrap_or(0);
            let nodes = match number("SLURM_STEP_NUM_NODES")? {
                Some(n) => Some(n),
                None => match number("SLURM_NNODES")? {
                    Some(n) => Some(n),
                    None => number("SLURM_JOB_NUM_NODES")?,
                },
            };
            if nodes == Some(1) {
                return Ok(Rendezvous::JobDir(
                    temp_dir().join(format!("ccl-slurm-{job}.{step}")),
                ));
            }
            let (name, list) = ["SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"]
                .into_iter()
                .find_map(|name| Some((name, var(name)?)))
                .ok_or_else(|| {
                    format!("Slurm set no SLURM_STEP_NODELIST or SLURM_JOB_NODELIST: {set_instead}")
                })?;
            let host = first_host(&list).ok_or_else(|| {
                format!("{name}={list:?} is not a Slurm host list: {set_instead}")
            })?;
            Ok(Rendezvous::Tcp {
                host,
                port: slurm_port(job, step),
                external: false,
            })
        }
        _ => Err("set MASTER_ADDR and MASTER_PORT (or CCL_STORE_PATH) for the rendezvous".into()),
    }
}

/// The port of a Slurm job's TCP store on several hosts: 15000 + 10 × (job
/// id mod 1000) + (step id mod 10), so that steps of one job, and most jobs
/// sharing a first host, differ.
fn slurm_port(job: u64, step: u64) -> u16 {
    SLURM_PORTS + 10 * (job % 1000) as u16 + (step % 10) as u16
}

/// The first host of a Slurm host list: `gpu[07-09,12],cpu1` starts with
/// `gpu07`; `rack[1-2]-n[3-4]` with `rack1-n3`. `None` if it is not one.
fn first_host(list: &str) -> Option<String> {
    let mut depth = 0i32;
    let end = list
        .char_indices()
        .find(|&(_, c)| {
            match c {
                '[' => depth += 1,
                ']' => depth -= 1,
                _ => {}
            }
            c == ',' && depth == 0
        })
        .map_or(list.len(), |(i, _)| i);
    let mut rest = list[..end].trim();
    let mut host = String::new();
    while let Some(open) = rest.find('[') {
        let close = open + rest[open..].find(']')?;
        let first = rest[open + 1..close].split(',').next()?.split('-').next()?;
        if first.is_empty() || !first.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        host.push_str(&rest[..open]);
        host.push_str(first);
        rest = &rest[close + 1..];
    }
    host.push_str(rest);
    (!host.is_empty() && !host.contains([']', ',', ' '])).then_some(host)
}

/// `name` with every byte but ASCII letters, digits, `.`, `_` and `-`
/// replaced by `_`, for a directory name.
fn file_safe(name: &str) -> String {
    name.trim()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// A 0/1 switch read from the environment variable `name` (`value`);
/// unset or empty is `default`.
fn flag(value: Option<String>, name: &str, default: bool) -> Result<bool> {
    match value.as_deref() {
        None | Some("") => Ok(default),
        Some("0") => Ok(false),
        Some("1") => Ok(true),
        Some(v) => Err(Error::Config(format!("{name}={v:?}: expected 0 or 1"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(pairs: &[(&str, &str)]) -> Result<Config> {
        Config::from_vars(pairs.iter().copied())
    }

    #[test]
    fn conventions() {
        let c = cfg(&[
            ("RANK", "2"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "0"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "29500"),
        ])
        .unwrap();
        assert_eq!(
            (c.launcher, c.rank, c.world_size, c.local_rank),
            (Launcher::Torchrun, 2, 4, 0)
        );
        assert_eq!(
            c.rendezvous,
            Rendezvous::Tcp {
                host: "h".into(),
                port: 29500,
                external: false
            }
        );
        let c = cfg(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "29500"),
            ("CCL_STORE_EXTERNAL", "1"),
        ])
        .unwrap();
        assert!(matches!(
            c.rendezvous,
            Rendezvous::Tcp { external: true, .. }
        ));
        let c = cfg(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "3"),
            ("CCL_STORE_PATH", "/tmp/x"),
        ])
        .unwrap();
        assert_eq!(
            (c.launcher, c.rank, c.world_size, c.local_rank),
            (Launcher::OpenMpi, 1, 3, 1)
        );
        assert_eq!(c.rendezvous, Rendezvous::File("/tmp/x".into()));
        let c = cfg(&[
            ("PMI_RANK", "0"),
            ("PMI_SIZE", "2"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "1"),
        ])
        .unwrap();
        assert_eq!(c.launcher, Launcher::Pmi);
        let c = cfg(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "1"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "1"),
        ])
        .unwrap();
        assert_eq!((c.launcher, c.rank, c.local_rank), (Launcher::Slurm, 5, 1));
        let c = cfg(&[]).unwrap();
        assert_eq!(
            (c.launcher, c.world_size, c.rendezvous.clone()),
            (Launcher::None, 1, Rendezvous::Local)
        );
        assert_eq!(c.timeout, DEFAULT_TIMEOUT);
        assert_eq!(c.job_secret, None);
        let c = cfg(&[("CCL_JOB_SECRET", "s3cret")]).unwrap();
        assert_eq!(
            c.job_secret,
            Some(ccl_core::JobSecret::new("s3cret").unwrap())
        );
        assert!(!format!("{c:?}").contains("s3cret"));
        assert_eq!(cfg(&[("CCL_JOB_SECRET", "")]).unwrap().job_secret, None);
        let c = cfg(&[("CCL_DEBUG_CHECKS", "1"), ("CCL_SHM_CMA", "0")]).unwrap();
        assert!(c.debug_checks && !c.knob_flag("CCL_SHM_CMA", true).unwrap());
        let c = cfg(&[("CCL_TRANSPORT", " TCP ")]).unwrap();
        assert_eq!(c.transport.as_deref(), Some("tcp"));
        let c = cfg(&[("CCL_TRANSPORT", "auto")]).unwrap();
        assert!(!c.debug_checks && c.knob_flag("CCL_SHM_CMA", true).unwrap());
        assert_eq!(c.transport, None);
    }

    #[test]
    fn torchruns_agent_store() {
        let torchrun = |extra: &[(&'static str, &'static str)]| {
            let mut vars = vec![
                ("RANK", "1"),
                ("WORLD_SIZE", "2"),
                ("MASTER_ADDR", "h"),
                ("MASTER_PORT", "29500"),
                ("TORCHELASTIC_RUN_ID", "job7"),
                ("TORCHELASTIC_RESTART_COUNT", "2"),
            ];
            vars.extend_from_slice(extra);
            cfg(&vars)
        };
        for on in ["True", "1"] {
            let c = torchrun(&[("TORCHELASTIC_USE_AGENT_STORE", on)]).unwrap();
            assert_eq!(
                c.rendezvous,
                Rendezvous::TorchAgent {
                    host: "h".into(),
                    port: 29500,
                    prefix: "ccl/job7/restart-2".into()
                }
            );
        }
        for off in ["False", "0"] {
            let c = torchrun(&[("TORCHELASTIC_USE_AGENT_STORE", off)]).unwrap();
            assert!(matches!(c.rendezvous, Rendezvous::Tcp { .. }), "{off}");
        }
        assert!(matches!(
            torchrun(&[("TORCHELASTIC_USE_AGENT_STORE", "yes")]),
            Err(Error::Config(_))
        ));
        // A file store, when asked for, wins.
        let c = torchrun(&[
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
            ("CCL_STORE_PATH", "/shared"),
        ])
        .unwrap();
        assert_eq!(c.rendezvous, Rendezvous::File("/shared".into()));
    }

    #[test]
    fn mpirun_on_one_host_meets_in_a_directory_of_the_job() {
        let c = cfg(&[
            ("OMPI_COMM_WORLD_RANK", "2"),
            ("OMPI_COMM_WORLD_SIZE", "3"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "3"),
            ("OMPI_MCA_ess_base_jobid", "1829109761"),
        ])
        .unwrap();
        assert_eq!(
            c.rendezvous,
            Rendezvous::JobDir("/tmp/ccl-openmpi-1829109761".into())
        );
        // OpenMPI 5 (PRRTE) names its job with the host and an `@`.
        let c = cfg(&[
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
            ("PMIX_NAMESPACE", "prterun-vm-4711@1"),
            ("OMPI_MCA_ess_base_jobid", "1"),
            ("TMPDIR", "/scratch"),
        ])
        .unwrap();
        assert_eq!(
            c.rendezvous,
            Rendezvous::JobDir("/scratch/ccl-openmpi-prterun-vm-4711_1".into())
        );
        // Explicit settings win.
        let c = cfg(&[
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
            ("PMIX_NAMESPACE", "1"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "1"),
        ])
        .unwrap();
        assert!(matches!(c.rendezvous, Rendezvous::Tcp { .. }));
    }

    #[test]
    fn mpirun_on_several_hosts_says_what_to_set() {
        for local in [Some("2"), None] {
            let mut vars = vec![
                ("OMPI_COMM_WORLD_RANK", "3"),
                ("OMPI_COMM_WORLD_SIZE", "4"),
                ("PMIX_NAMESPACE", "1"),
            ];
            vars.extend(local.map(|l| ("OMPI_COMM_WORLD_LOCAL_SIZE", l)));
            let e = cfg(&vars).unwrap_err();
            let Error::Config(m) = &e else { panic!("{e}") };
            assert!(
                m.starts_with("rank 3 of 4: mpirun started the ranks on several hosts"),
                "{m}"
            );
            assert!(
                m.contains("set MASTER_ADDR") && m.contains("CCL_STORE_PATH"),
                "{m}"
            );
        }
        let e = cfg(&[
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ])
        .unwrap_err();
        assert!(e.to_string().contains("PMIX_NAMESPACE"), "{e}");
    }

    #[test]
    fn srun_on_one_host_or_several() {
        let srun = |extra: &[(&'static str, &'static str)]| {
            let mut vars = vec![
                ("SLURM_PROCID", "1"),
                ("SLURM_NTASKS", "4"),
                ("SLURM_JOB_ID", "4242"),
                ("SLURM_STEP_ID", "3"),
            ];
            vars.extend_from_slice(extra);
            cfg(&vars)
        };
        for nodes in [
            "SLURM_STEP_NUM_NODES",
            "SLURM_NNODES",
            "SLURM_JOB_NUM_NODES",
        ] {
            let c = srun(&[(nodes, "1")]).unwrap();
            assert_eq!(
                c.rendezvous,
                Rendezvous::JobDir("/tmp/ccl-slurm-4242.3".into())
            );
        }
        let c = srun(&[
            ("SLURM_NNODES", "3"),
            ("SLURM_JOB_NODELIST", "gpu[07-09,12],cpu1"),
        ])
        .unwrap();
        let tcp = |host: &str, port| Rendezvous::Tcp {
            host: host.into(),
            port,
            external: false,
        };
        assert_eq!(c.rendezvous, tcp("gpu07", 15000 + 2420 + 3));
        // The step's nodes before the job's.
        let c = srun(&[
            ("SLURM_JOB_NUM_NODES", "4"),
            ("SLURM_STEP_NUM_NODES", "2"),
            ("SLURM_JOB_NODELIST", "n[1-4]"),
            ("SLURM_STEP_NODELIST", "n[3-4]"),
        ])
        .unwrap();
        assert_eq!(c.rendezvous, tcp("n3", 17423));
        for bad in [
            vec![("SLURM_NNODES", "2")],
            vec![("SLURM_NNODES", "2"), ("SLURM_JOB_NODELIST", "n[1-")],
            vec![("SLURM_NNODES", "two")],
        ] {
            let e = srun(&bad).unwrap_err();
            assert!(
                matches!(e, Error::Config(ref m) if m.starts_with("rank 1 of 4: ")),
                "{e}"
            );
        }
        let e = cfg(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_NNODES", "1"),
        ])
        .unwrap_err();
        assert!(e.to_string().contains("SLURM_JOB_ID is not set"), "{e}");
    }

    #[test]
    fn slurm_host_lists() {
        for (list, first) in [
            ("node1", Some("node1")),
            ("node[1-3,5]", Some("node1")),
            ("a[001-004]", Some("a001")),
            ("x[3,1-2]", Some("x3")),
            ("h1,h[2-3]", Some("h1")),
            ("g[2-3],h[4-5]", Some("g2")),
            ("rack[2-3]-n[05-06]", Some("rack2-n05")),
            ("node-[10-11].cluster", Some("node-10.cluster")),
            ("", None),
            ("h[1-", None),
            ("h[]", None),
            ("h[a-b]", None),
            ("h]", None),
        ] {
            assert_eq!(first_host(list).as_deref(), first, "{list:?}");
        }
    }

    #[test]
    fn bad_values_are_clear_errors() {
        let long = "x".repeat(5000);
        for bad in [
            vec![
                ("RANK", "4"),
                ("WORLD_SIZE", "4"),
                ("MASTER_ADDR", "h"),
                ("MASTER_PORT", "1"),
            ],
            vec![("RANK", "x"), ("WORLD_SIZE", "4")],
            vec![("RANK", "0"), ("WORLD_SIZE", "2")],
            vec![
                ("RANK", "0"),
                ("WORLD_SIZE", "2"),
                ("MASTER_ADDR", "h"),
                ("MASTER_PORT", "99999"),
            ],
            vec![("CCL_TIMEOUT", "soon")],
            vec![("CCL_SPIN_US", "-5")],
            vec![("CCL_JOB_SECRET", long.as_str())],
            vec![("CCL_DEBUG_CHECKS", "yes")],
            vec![
                ("MASTER_ADDR", "h"),
                ("MASTER_PORT", "1"),
                ("CCL_STORE_EXTERNAL", "yes"),
            ],
        ] {
            let e = cfg(&bad).unwrap_err();
            assert!(matches!(e, Error::Config(_)), "{bad:?}: {e}");
        }
    }

    #[test]
    fn knobs_are_checked_where_they_are_read() {
        let c = cfg(&[("CCL_NSOCKS", "0"), ("CCL_SHM_CMA", "off"), ("NSOCKS", "3")]).unwrap();
        let e = c.knob_number("CCL_NSOCKS", 1, 1..=64).unwrap_err();
        assert!(e.to_string().contains("CCL_NSOCKS=\"0\""), "{e}");
        assert_eq!(c.knob_number("CCL_OTHER", 7, 1..=64).unwrap(), 7);
        assert!(c.knob_flag("CCL_SHM_CMA", true).is_err());
        assert_eq!(c.knob("NSOCKS"), None);
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("30"), Some(Duration::from_secs(30)));
        assert_eq!(parse_duration("500ms"), Some(Duration::from_millis(500)));
        assert_eq!(parse_duration("2m"), Some(Duration::from_secs(120)));
        assert_eq!(parse_duration("1.5s"), Some(Duration::from_millis(1500)));
        assert_eq!(parse_duration("-1"), None);
        assert_eq!(parse_duration("5 fortnights"), None);
    }
}
