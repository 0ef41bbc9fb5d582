//! Configuration from the environment conventions people already use.
//!
//! Rank and world size come from the first launcher convention found:
//! torchrun (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`), OpenMPI
//! (`OMPI_COMM_WORLD_RANK`, `..._SIZE`, `..._LOCAL_RANK`, `..._LOCAL_SIZE`),
//! PMI (`PMI_RANK`, `PMI_SIZE`), Slurm (`SLURM_PROCID`, `SLURM_NTASKS`,
//! `SLURM_LOCALID`). The rendezvous is `MASTER_ADDR`/`MASTER_PORT` (TCP store
//! served by rank 0) or `CCL_STORE_PATH` (file store directory). `CCL_*`
//! variables set ccl's own knobs.

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
    /// File store in this directory.
    File(PathBuf),
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
    /// (`tcp`, `shm`, ...); `None` (unset or `auto`): each pair takes the
    /// first transport that can connect it.
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
                (Some(host), Some(port)) => Rendezvous::Tcp {
                    host,
                    port: port
                        .trim()
                        .parse()
                        .map_err(|_| Error::Config(format!("MASTER_PORT={port:?} is not a port number")))?,
                    external: flag(var("CCL_STORE_EXTERNAL"), "CCL_STORE_EXTERNAL", false)?,
                },
                _ if world_size == 1 => Rendezvous::Local,
                (None, _) => {
                    return Err(Error::Config(format!(
                        "rank {rank} of {world_size}: set MASTER_ADDR and MASTER_PORT (or CCL_STORE_PATH) for the rendezvous"
                    )))
                }
                (Some(_), None) => {
                    return Err(Error::Config(format!("rank {rank} of {world_size}: MASTER_ADDR is set but MASTER_PORT is not")))
                }
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
