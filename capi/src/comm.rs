//! Communicators from C: made from the environment, from a store address or
//! from a unique id; split, aborted, destroyed; what they tell; their
//! pre-multiplied-sum ops.

use std::{
    ffi::{c_char, c_double, c_int, c_void, CStr},
    sync::{
        atomic::{AtomicBool, Ordering},
        Mutex,
    },
    time::Duration,
};

use ccl::{Communicator, Config, Error, JobSecret, ReduceOp, Result, TcpStoreServer};
use ccl_rendezvous::net::advertised_ip;

use crate::{
    errors::entry,
    handles::Table,
    types::{
        cclComm_t, cclDataType_t, cclRedOp_t, cclResult_t, cclScalarHostImmediate,
        cclScalarResidence_t, cclUniqueId, dtype, fixed_op, CCL_FIRST_CREATED_OP,
        CCL_SPLIT_NOCOLOR, CCL_UNIQUE_ID_BYTES,
    },
};

/// A communicator as C holds it.
pub(crate) struct CommState {
    /// Its device calls that returned before they completed: declared
    /// first, so that they are waited for before the communicator goes.
    pub device: Mutex<crate::device::DeviceCalls>,
    pub comm: Communicator,
    /// A thread is in a call on it (calls from two threads at once are an error).
    busy: AtomicBool,
    /// The message of the last failure on it, for `cclGetLastError`.
    pub last_error: Mutex<std::ffi::CString>,
    /// The scalars of its pre-multiplied-sum ops (`None`: destroyed).
    premul: Mutex<Vec<Option<f64>>>,
}

static COMMS: Table<CommState> = Table::new();

/// Every live communicator of C's.
pub(crate) fn comms() -> &'static Table<CommState> {
    &COMMS
}

/// Marks a communicator in use by this thread for as long as it lives.
pub(crate) struct InUse<'a>(&'a CommState);

impl Drop for InUse<'_> {
    fn drop(&mut self) {
        self.0.busy.store(false, Ordering::Release);
    }
}

impl CommState {
    fn new(comm: Communicator) -> CommState {
        CommState {
            device: Mutex::default(),
            comm,
            busy: AtomicBool::new(false),
            last_error: Mutex::new(Default::default()),
            premul: Mutex::new(Vec::new()),
        }
    }

    /// Claims the communicator for one call of this thread; an error if
    /// another thread is in a call on it.
    pub(crate) fn claim(&self) -> Result<InUse<'_>> {
        if self.busy.swap(true, Ordering::Acquire) {
            return Err(Error::InvalidArgument(format!(
                "{:?} is in a call of another thread: one thread at a time may call on a \
                 communicator (use one communicator per thread, or cclCommSplit)",
                self.comm
            )));
        }
        Ok(InUse(self))
    }

    /// The reduction op a C value names on this communicator.
    pub(crate) fn op(&self, v: cclRedOp_t) -> Result<ReduceOp> {
        if let Some(op) = fixed_op(v) {
            return Ok(op);
        }
        let scalars = self.premul.lock().unwrap_or_else(|p| p.into_inner());
        usize::try_from(v - CCL_FIRST_CREATED_OP)
            .ok()
            .and_then(|i| scalars.get(i).copied().flatten())
            .map(ReduceOp::PreMulSum)
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "{v} is no cclRedOp_t (nor an op created on this communicator)"
                ))
            })
    }
}

/// The live communicator behind `comm`.
pub(crate) fn lookup(comm: cclComm_t) -> Result<std::sync::Arc<CommState>> {
    COMMS.get(comm as usize).ok_or_else(|| {
        Error::InvalidArgument(format!(
            "{comm:p} is no live communicator (destroyed, or never made by cclCommInit*)"
        ))
    })
}

/// `*out`, checked for null.
pub(crate) fn out<'a, T>(ptr: *mut T, what: &str) -> Result<&'a mut T> {
    // SAFETY: a non-null pointer the caller passed for us to write a `T` to.
    unsafe { ptr.as_mut() }.ok_or_else(|| Error::InvalidArgument(format!("{what} is NULL")))
}

/// A count or rank from C: not negative.
fn non_negative(v: c_int, what: &str) -> Result<usize> {
    usize::try_from(v).map_err(|_| Error::InvalidArgument(format!("{what} {v} is negative")))
}

/// Registers `comm` for C and writes its handle to `out`.
fn hand_out(comm: Communicator, out: &mut cclComm_t) {
    *out = COMMS.insert(CommState::new(comm)) as cclComm_t;
}

/// Servers of the unique ids this process made: they live as long as it.
static SERVERS: Mutex<Vec<TcpStoreServer>> = Mutex::new(Vec::new());

/// Writes ccl's version to `version`: major × 10000 + minor × 100 + patch.
#[no_mangle]
pub extern "C" fn cclGetVersion(version: *mut c_int) -> cclResult_t {
    entry(std::ptr::null_mut(), || {
        let v = |k: &str| k.parse::<c_int>().unwrap_or(0);
        *out(version, "version")? = v(env!("CARGO_PKG_VERSION_MAJOR")) * 10000
            + v(env!("CARGO_PKG_VERSION_MINOR")) * 100
            + v(env!("CARGO_PKG_VERSION_PATCH"));
        Ok(())
    })
}

/// Makes a unique id: this process starts serving a rendezvous (on every
/// interface, advertising the address of `CCL_SOCKET_IFNAME`, else of the
/// first interface that is up and not loopback) for as long as it runs, and
/// draws a fresh job secret. Call it on one rank and hand the id to every
/// rank (`MPI_Bcast`); each then calls `cclCommInitRank`. Thread-safe.
#[no_mangle]
pub extern "C" fn cclGetUniqueId(id: *mut cclUniqueId) -> cclResult_t {
    entry(std::ptr::null_mut(), || {
        let id = out(id, "id")?;
        let mut secret = [0u8; 32];
        getrandom::getrandom(&mut secret)
            .map_err(|e| Error::io("drawing a job secret", std::io::Error::other(e.to_string())))?;
        let secret: String = secret.iter().map(|b| format!("{b:02x}")).collect();
        let ifname = std::env::var("CCL_SOCKET_IFNAME")
            .ok()
            .filter(|s| !s.is_empty());
        let host = advertised_ip(ifname.as_deref())?;
        let any = if host.is_ipv6() {
            "[::]:0"
        } else {
            "0.0.0.0:0"
        };
        let bind = any
            .parse()
            .map_err(|e| Error::Internal(format!("{any}: {e}")))?;
        let server = TcpStoreServer::bind_with_secret(bind, Some(&JobSecret::new(&secret)?))?;
        let text = format!("ccl-id1 {host} {} {secret}", server.local_addr().port());
        SERVERS
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(server);
        id.internal = [0; CCL_UNIQUE_ID_BYTES];
        for (to, from) in id.internal.iter_mut().zip(text.bytes()) {
            *to = from as c_char;
        }
        Ok(())
    })
}

/// The rendezvous address and secret in a unique id.
fn parse_id(id: &cclUniqueId) -> Result<(String, String, String)> {
    let bytes: Vec<u8> = id.internal.iter().map(|&c| c as u8).collect();
    let text = CStr::from_bytes_until_nul(&bytes)
        .ok()
        .and_then(|c| c.to_str().ok())
        .unwrap_or("");
    let f: Vec<&str> = text.split(' ').collect();
    match f[..] {
        ["ccl-id1", host, port, secret] => Ok((host.into(), port.into(), secret.into())),
        _ => Err(Error::InvalidArgument(
            "the cclUniqueId was not made by cclGetUniqueId".into(),
        )),
    }
}

/// Makes rank `rank` of a communicator of `nranks` ranks that meet at the
/// rendezvous of `id` (every rank passes the same id). `CCL_*` variables
/// set the knobs as for `cclCommInitEnv`. Returns once this rank is
/// connected to all others.
#[no_mangle]
pub extern "C" fn cclCommInitRank(
    comm: *mut cclComm_t,
    nranks: c_int,
    id: cclUniqueId,
    rank: c_int,
) -> cclResult_t {
    entry(std::ptr::null_mut(), || {
        let comm = out(comm, "comm")?;
        let (host, port, secret) = parse_id(&id)?;
        let (n, r) = (non_negative(nranks, "nranks")?, non_negative(rank, "rank")?);
        let config = Config::from_env_with(&[
            ("RANK", r.to_string()),
            ("WORLD_SIZE", n.to_string()),
            ("MASTER_ADDR", host),
            ("MASTER_PORT", port),
            ("CCL_STORE_EXTERNAL", "1".into()),
            ("CCL_JOB_SECRET", secret),
        ])?;
        hand_out(Communicator::from_config(&config)?, comm);
        Ok(())
    })
}

/// Makes this process's communicator from the environment a launcher set
/// (torchrun, `ccl-run`, OpenMPI, PMI, Slurm; `MASTER_ADDR`/`MASTER_PORT`
/// or `CCL_STORE_PATH`; `CCL_*` knobs), as `Communicator::from_env`.
#[no_mangle]
pub extern "C" fn cclCommInitEnv(comm: *mut cclComm_t) -> cclResult_t {
    entry(std::ptr::null_mut(), || {
        let comm = out(comm, "comm")?;
        hand_out(Communicator::from_env()?, comm);
        Ok(())
    })
}

/// Makes rank `rank` of `nranks` ranks that meet at a TCP store at
/// `host:port`, which rank 0 serves (torchrun's `MASTER_ADDR` and
/// `MASTER_PORT`); `CCL_JOB_SECRET` and the other `CCL_*` knobs apply.
#[no_mangle]
pub extern "C" fn cclCommInitStore(
    comm: *mut cclComm_t,
    nranks: c_int,
    rank: c_int,
    host: *const c_char,
    port: c_int,
) -> cclResult_t {
    entry(std::ptr::null_mut(), || {
        let comm = out(comm, "comm")?;
        if host.is_null() {
            return Err(Error::InvalidArgument("host is NULL".into()));
        }
        // SAFETY: a non-null, NUL-terminated string of the caller's.
        let host = unsafe { CStr::from_ptr(host) }
            .to_str()
            .map_err(|_| Error::InvalidArgument("host is not UTF-8".into()))?;
        let (n, r) = (non_negative(nranks, "nranks")?, non_negative(rank, "rank")?);
        let config = Config::from_env_with(&[
            ("RANK", r.to_string()),
            ("WORLD_SIZE", n.to_string()),
            ("MASTER_ADDR", host.to_string()),
            ("MASTER_PORT", non_negative(port, "port")?.to_string()),
        ])?;
        hand_out(Communicator::from_config(&config)?, comm);
        Ok(())
    })
}

/// Splits `comm` (`MPI_Comm_split`): ranks passing the same `color` form a
/// new communicator, ordered by `key` then by rank; a rank passing
/// `CCL_SPLIT_NOCOLOR` takes part and gets NULL. Every rank must call it.
#[no_mangle]
pub extern "C" fn cclCommSplit(
    comm: cclComm_t,
    color: c_int,
    key: c_int,
    newcomm: *mut cclComm_t,
) -> cclResult_t {
    entry(comm, || {
        let newcomm = out(newcomm, "newcomm")?;
        let state = lookup(comm)?;
        let _claim = state.claim()?;
        let color = match color {
            CCL_SPLIT_NOCOLOR => None,
            c => Some(u32::try_from(c).map_err(|_| {
                Error::InvalidArgument(format!(
                    "color {c} is neither CCL_SPLIT_NOCOLOR nor at least 0"
                ))
            })?),
        };
        *newcomm = std::ptr::null_mut();
        if let Some(c) = state.comm.split(color, i64::from(key))? {
            hand_out(c, newcomm);
        }
        Ok(())
    })
}

/// Aborts `comm` (as `ncclCommAbort`): calls running or queued on it, from
/// any thread, fail at once, every peer is told, and later calls fail with
/// `cclBroken`. Thread-safe: meant to be called while another thread waits
/// in a call. The handle stays valid until `cclCommDestroy`.
#[no_mangle]
pub extern "C" fn cclCommAbort(comm: cclComm_t) -> cclResult_t {
    entry(comm, || {
        lookup(comm)?.comm.abort();
        Ok(())
    })
}

/// Destroys `comm`: its handle dies at once; the communicator closes once
/// no call is running on it.
#[no_mangle]
pub extern "C" fn cclCommDestroy(comm: cclComm_t) -> cclResult_t {
    entry(std::ptr::null_mut(), || {
        COMMS
            .remove(comm as usize)
            .map(drop)
            .ok_or_else(|| Error::InvalidArgument(format!("{comm:p} is no live communicator")))
    })
}

/// Writes the number of ranks of `comm` to `count`. Thread-safe.
#[no_mangle]
pub extern "C" fn cclCommCount(comm: cclComm_t, count: *mut c_int) -> cclResult_t {
    entry(comm, || {
        *out(count, "count")? = lookup(comm)?.comm.world_size() as c_int;
        Ok(())
    })
}

/// Writes this process's rank in `comm` to `rank`. Thread-safe.
#[no_mangle]
pub extern "C" fn cclCommUserRank(comm: cclComm_t, rank: *mut c_int) -> cclResult_t {
    entry(comm, || {
        *out(rank, "rank")? = lookup(comm)?.comm.rank() as c_int;
        Ok(())
    })
}

/// Sets the deadline of every call on `comm` from now on, in seconds
/// (default: `CCL_TIMEOUT`, else 600). Every rank should set the same value.
#[no_mangle]
pub extern "C" fn cclCommSetTimeout(comm: cclComm_t, seconds: c_double) -> cclResult_t {
    entry(comm, || {
        let state = lookup(comm)?;
        let timeout = Duration::try_from_secs_f64(seconds)
            .ok()
            .filter(|d| !d.is_zero())
            .ok_or_else(|| {
                Error::InvalidArgument(format!("{seconds} seconds is no positive deadline"))
            })?;
        state.comm.set_timeout(timeout);
        Ok(())
    })
}

/// Makes a pre-multiplied-sum op on `comm` (as `ncclRedOpCreatePreMulSum`):
/// each rank multiplies its own input by `*scalar` (an element of
/// `datatype`, in host memory: `cclScalarHostImmediate`), then the inputs
/// are summed. Writes the op to `op`; `cclRedOpDestroy` frees it.
#[no_mangle]
pub extern "C" fn cclRedOpCreatePreMulSum(
    op: *mut cclRedOp_t,
    scalar: *const c_void,
    datatype: cclDataType_t,
    residence: cclScalarResidence_t,
    comm: cclComm_t,
) -> cclResult_t {
    entry(comm, || {
        let op = out(op, "op")?;
        let state = lookup(comm)?;
        let dtype = dtype(datatype)?;
        if residence != cclScalarHostImmediate {
            return Err(Error::Unsupported(format!(
                "scalar residence {residence}: only cclScalarHostImmediate in this build"
            )));
        }
        if scalar.is_null() {
            return Err(Error::InvalidArgument("scalar is NULL".into()));
        }
        let mut bytes = [0u8; 8];
        // SAFETY: the caller's scalar: one element of `dtype` in host memory.
        unsafe {
            std::ptr::copy_nonoverlapping(scalar.cast::<u8>(), bytes.as_mut_ptr(), dtype.size())
        };
        let value = dtype
            .value_to_f64(&bytes[..dtype.size()])
            .ok_or_else(|| Error::Internal(format!("reading one {dtype}")))?;
        ReduceOp::PreMulSum(value).validate(dtype)?;
        let mut scalars = state.premul.lock().unwrap_or_else(|p| p.into_inner());
        scalars.push(Some(value));
        *op = CCL_FIRST_CREATED_OP + (scalars.len() - 1) as cclRedOp_t;
        Ok(())
    })
}

/// Frees an op made by `cclRedOpCreatePreMulSum` on `comm`.
#[no_mangle]
pub extern "C" fn cclRedOpDestroy(op: cclRedOp_t, comm: cclComm_t) -> cclResult_t {
    entry(comm, || {
        let state = lookup(comm)?;
        let mut scalars = state.premul.lock().unwrap_or_else(|p| p.into_inner());
        usize::try_from(op - CCL_FIRST_CREATED_OP)
            .ok()
            .and_then(|i| scalars.get_mut(i))
            .and_then(Option::take)
            .map(drop)
            .ok_or_else(|| {
                Error::InvalidArgument(format!("{op} is no op created on this communicator"))
            })
    })
}
