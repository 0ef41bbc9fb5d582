//! Collectives and transfers from C, in NCCL's shape: a blocking call
//! returns when its result is in the receive buffer; between `cclGroupStart`
//! and `cclGroupEnd` calls are only started, and `cclGroupEnd` waits for all
//! of them (or `cclGroupEndAsync` hands back a `cclWork_t` for them).
//!
//! Every call is checked here only for what C can get wrong and Rust
//! cannot (null pointers, counts whose bytes overflow, misaligned buffers
//! of reductions, a stream); the arguments themselves are checked by the
//! one untyped call path of the library, as for every other caller.

use std::{
    cell::RefCell,
    ffi::{c_int, c_void},
    sync::Arc,
};

use ccl::{BufMut, BufRef, Collective, CollectiveKind as K, Error, MemoryKind, Result};

use crate::{
    comm::{lookup, CommState},
    device::{launch_transfers, place, GroupedTransfer, Place},
    errors::entry,
    types::{cclComm_t, cclDataType_t, cclRedOp_t, cclResult_t, cclUint8, cclWork_t, dtype},
    work::{pending, Pending},
};

thread_local! {
    /// How deep this thread's groups nest, and the calls it made since its
    /// outermost `cclGroupStart`.
    static GROUP: RefCell<(usize, Vec<Grouped>)> = const { RefCell::new((0, Vec::new())) };
}

/// A call made in a group.
enum Grouped {
    /// Started: on the host (waited for at the group's end), or on a
    /// device (queued; its communicator keeps it once the group ends).
    Started(Pending, Option<Arc<CommState>>),
    /// A device transfer, queued at the group's end together with its
    /// communicator's others on its stream.
    Transfer(GroupedTransfer),
}

/// One call's C arguments.
struct Args {
    kind: K,
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    datatype: cclDataType_t,
    op: Option<cclRedOp_t>,
    root: Option<c_int>,
}

impl Args {
    fn new(
        kind: K,
        send: *const c_void,
        recv: *mut c_void,
        count: usize,
        datatype: cclDataType_t,
    ) -> Args {
        let (op, root) = (None, None);
        Args {
            kind,
            send,
            recv,
            count,
            datatype,
            op,
            root,
        }
    }

    fn op(self, op: cclRedOp_t) -> Args {
        Args {
            op: Some(op),
            ..self
        }
    }

    fn root(self, root: c_int) -> Args {
        Args {
            root: Some(root),
            ..self
        }
    }
}

/// The memory of `len` bytes at `ptr` (host or device memory from C),
/// checked for null and, for reductions, for the alignment of `size`-byte
/// elements.
fn memory(
    ptr: *const c_void,
    len: usize,
    size: usize,
    reduces: bool,
    what: &str,
) -> Result<*mut u8> {
    if len > 0 && ptr.is_null() {
        return Err(Error::InvalidArgument(format!("{what} is NULL")));
    }
    if len > 0 && reduces && ptr as usize % size != 0 {
        return Err(Error::InvalidArgument(format!(
            "{what} {ptr:p} is not aligned for {size}-byte elements, which a reduction needs"
        )));
    }
    Ok(ptr.cast_mut().cast())
}

/// Runs or starts a collective.
fn collective(comm: cclComm_t, a: Args, stream: *mut c_void) -> cclResult_t {
    entry(comm, || {
        let state = lookup(comm)?;
        let _claim = state.claim()?;
        state.async_error();
        let (rank, n) = (state.comm.rank(), state.comm.world_size());
        let dtype = dtype(a.datatype)?;
        let mut coll = Collective::new(a.kind, dtype, a.count);
        if let Some(op) = a.op {
            coll = coll.with_op(state.op(op)?);
        }
        if let Some(root) = a.root {
            let root = usize::try_from(root)
                .map_err(|_| Error::InvalidArgument(format!("root {root} is negative")))?;
            coll = coll.with_root(root);
        }
        let size = dtype.size();
        let whole = a
            .count
            .checked_mul(n)
            .and_then(|e| e.checked_mul(size))
            .filter(|&b| b <= isize::MAX as usize);
        if whole.is_none() {
            return Err(Error::InvalidArgument(format!(
                "a count of {} {dtype} elements on {n} ranks overflows",
                a.count
            )));
        }
        let (ni, no) = coll.buffer_elems(rank, n);
        let (ni, no) = (ni * size, no * size);
        let reduces = coll.reduces();
        let send = memory(a.send, ni, size, reduces, "sendbuff")?;
        let recv = memory(a.recv, no, size, reduces, "recvbuff")?;
        let place = place(&state, stream, &[(a.send, ni), (a.recv.cast_const(), no)])?;
        let kind = place.kind();
        // SAFETY: memory of the caller's, valid for these lengths until the
        // call completes (its contract, as NCCL's).
        let (input, output) = unsafe {
            (
                BufRef::from_raw(kind, send, ni),
                BufMut::from_raw(kind, recv, no),
            )
        };
        if let Some(stream) = place.stream() {
            // SAFETY: as above; ordered on the caller's stream.
            let work = unsafe { state.comm.launch_on_stream(&coll, input, output, &stream) };
            if in_group() {
                return join_group(Grouped::Started(pending(work, comm), Some(state.clone())));
            }
            return state.queued(work);
        }
        if in_group() {
            // SAFETY: as above, until the group's end waits for it.
            let work = unsafe { state.comm.launch(&coll, input, output) };
            return join_group(Grouped::Started(pending(work, comm), None));
        }
        state.comm.run(&coll, input, output)
    })
}

/// Runs or starts one side of a transfer of `count` elements.
fn transfer(
    comm: cclComm_t,
    buf: *const c_void,
    count: usize,
    datatype: cclDataType_t,
    peer: c_int,
    send: bool,
    stream: *mut c_void,
) -> cclResult_t {
    entry(comm, || {
        let state = lookup(comm)?;
        let _claim = state.claim()?;
        state.async_error();
        let dtype = dtype(datatype)?;
        let peer = usize::try_from(peer)
            .map_err(|_| Error::InvalidArgument(format!("peer {peer} is negative")))?;
        let bytes = count
            .checked_mul(dtype.size())
            .filter(|&b| b <= isize::MAX as usize)
            .ok_or_else(|| {
                Error::InvalidArgument(format!("a count of {count} {dtype} elements overflows"))
            })?;
        let what = if send { "sendbuff" } else { "recvbuff" };
        let ptr = memory(buf, bytes, dtype.size(), false, what)?;
        let place = place(&state, stream, &[(buf, bytes)])?;
        if let Place::Device(..) = place {
            let t = GroupedTransfer {
                comm,
                state: state.clone(),
                place,
                dtype,
                peer,
                send,
                ptr,
                len: bytes,
            };
            if in_group() {
                return join_group(Grouped::Transfer(t));
            }
            let (_, state, work) = launch_transfers(vec![t])
                .pop()
                .ok_or_else(|| Error::Internal("a device transfer was not queued".into()))?;
            return state.queued(work);
        }
        // SAFETY: host memory of the caller's, valid until the call completes.
        let mem = unsafe { BufMut::from_raw(MemoryKind::Host, ptr, bytes) };
        let work = match send {
            // SAFETY: as above.
            true => unsafe { state.comm.launch_send(dtype, peer, mem.readonly()) },
            false => unsafe { state.comm.launch_recv(dtype, peer, mem) },
        };
        if in_group() {
            return join_group(Grouped::Started(pending(work, comm), None));
        }
        drop(_claim);
        work.wait()
    })
}

fn in_group() -> bool {
    GROUP.with(|g| g.borrow().0 > 0)
}

/// Adds a call to this thread's group.
fn join_group(call: Grouped) -> Result<()> {
    GROUP.with(|g| g.borrow_mut().1.push(call));
    Ok(())
}

/// A group's calls, all started: the device transfers queued now; the
/// calls on the host, and those on devices with their communicators.
fn start_all(calls: Vec<Grouped>) -> (Vec<Pending>, Vec<(Pending, Arc<CommState>)>) {
    let (mut host, mut device, mut transfers) = (Vec::new(), Vec::new(), Vec::new());
    for call in calls {
        match call {
            Grouped::Started(p, None) => host.push(p),
            Grouped::Started(p, Some(state)) => device.push((p, state)),
            Grouped::Transfer(t) => transfers.push(t),
        }
    }
    for (comm, state, work) in launch_transfers(transfers) {
        device.push((pending(work, comm), state));
    }
    (host, device)
}

/// Starts a group: until the matching `cclGroupEnd`, this thread's calls
/// are started and return at once. Groups nest; the outermost end counts.
/// Send and receive between pairs of ranks must be grouped (or asynchronous)
/// when both ranks send first, as with NCCL.
#[no_mangle]
pub extern "C" fn cclGroupStart() -> cclResult_t {
    entry(std::ptr::null_mut(), || {
        GROUP.with(|g| g.borrow_mut().0 += 1);
        Ok(())
    })
}

/// Ends a group: at the outermost end, waits for every call of the group
/// on host memory, queues those on device memory (which then run as their
/// streams reach them: `cclCommGetAsyncError`), and returns the first
/// failure (each failure is also recorded on its communicator).
#[no_mangle]
pub extern "C" fn cclGroupEnd() -> cclResult_t {
    entry(std::ptr::null_mut(), || {
        let Some(calls) = end_group()? else {
            return Ok(());
        };
        let (host, device) = start_all(calls);
        let queued = device
            .into_iter()
            .map(|(p, state)| p.queue_on(&state))
            .fold(Ok(()), Result::and);
        crate::work::wait_all(host).and(queued)
    })
}

/// Ends a group without waiting: at the outermost end, writes to `work` a
/// handle on every call started in the group (`cclWorkTest`, `cclWorkWait`,
/// `cclWorkFree`); at an inner end, writes NULL. The buffers must stay
/// untouched until the work completes. A refused end (`work` NULL) leaves
/// the group open.
#[no_mangle]
pub extern "C" fn cclGroupEndAsync(work: *mut cclWork_t) -> cclResult_t {
    entry(std::ptr::null_mut(), || {
        let out = crate::comm::out(work, "work")?;
        *out = match end_group()? {
            Some(calls) => {
                let (mut all, device) = start_all(calls);
                all.extend(device.into_iter().map(|(p, _)| p));
                crate::work::hand_out(all)
            }
            None => std::ptr::null_mut(),
        };
        Ok(())
    })
}

/// Closes one level of this thread's group; the calls at the outermost.
fn end_group() -> Result<Option<Vec<Grouped>>> {
    GROUP.with(|g| {
        let mut g = g.borrow_mut();
        match g.0 {
            0 => Err(Error::InvalidArgument(
                "cclGroupEnd without cclGroupStart".into(),
            )),
            1 => {
                g.0 = 0;
                Ok(Some(std::mem::take(&mut g.1)))
            }
            _ => {
                g.0 -= 1;
                Ok(None)
            }
        }
    })
}

/// Every rank gets the reduction (`op`) of every rank's `count` elements.
/// In place when `sendbuff == recvbuff`.
#[no_mangle]
pub extern "C" fn cclAllReduce(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: cclDataType_t,
    op: cclRedOp_t,
    comm: cclComm_t,
    stream: *mut c_void,
) -> cclResult_t {
    let args = Args::new(K::AllReduce, sendbuff, recvbuff, count, datatype);
    collective(comm, args.op(op), stream)
}

/// `root`'s `count` elements go to every rank's `recvbuff`; `sendbuff` is
/// read on the root only. In place when `sendbuff == recvbuff`.
#[no_mangle]
pub extern "C" fn cclBroadcast(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: cclDataType_t,
    root: c_int,
    comm: cclComm_t,
    stream: *mut c_void,
) -> cclResult_t {
    let args = Args::new(K::Broadcast, sendbuff, recvbuff, count, datatype);
    collective(comm, args.root(root), stream)
}

/// `root` gets the reduction of every rank's `count` elements; `recvbuff`
/// is written on the root only.
#[no_mangle]
pub extern "C" fn cclReduce(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: cclDataType_t,
    op: cclRedOp_t,
    root: c_int,
    comm: cclComm_t,
    stream: *mut c_void,
) -> cclResult_t {
    let args = Args::new(K::Reduce, sendbuff, recvbuff, count, datatype);
    collective(comm, args.op(op).root(root), stream)
}

/// Every rank gets every rank's `sendcount` elements, in rank order
/// (`recvbuff` holds nranks × sendcount). In place when
/// `sendbuff == recvbuff + rank * sendcount` elements.
#[no_mangle]
pub extern "C" fn cclAllGather(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    sendcount: usize,
    datatype: cclDataType_t,
    comm: cclComm_t,
    stream: *mut c_void,
) -> cclResult_t {
    let args = Args::new(K::AllGather, sendbuff, recvbuff, sendcount, datatype);
    collective(comm, args, stream)
}

/// The reduction of every rank's `sendbuff` (nranks × recvcount elements);
/// rank r gets block r of it. In place when
/// `recvbuff == sendbuff + rank * recvcount` elements.
#[no_mangle]
pub extern "C" fn cclReduceScatter(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    recvcount: usize,
    datatype: cclDataType_t,
    op: cclRedOp_t,
    comm: cclComm_t,
    stream: *mut c_void,
) -> cclResult_t {
    let args = Args::new(K::ReduceScatter, sendbuff, recvbuff, recvcount, datatype);
    collective(comm, args.op(op), stream)
}

/// Block p (`count` elements) of every rank's `sendbuff` goes to rank p,
/// into block r of its `recvbuff` for sender r. In place when
/// `sendbuff == recvbuff`.
#[no_mangle]
pub extern "C" fn cclAllToAll(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: cclDataType_t,
    comm: cclComm_t,
    stream: *mut c_void,
) -> cclResult_t {
    let args = Args::new(K::AllToAll, sendbuff, recvbuff, count, datatype);
    collective(comm, args, stream)
}

/// `root` gets every rank's `sendcount` elements, in rank order; `recvbuff`
/// is written on the root only.
#[no_mangle]
pub extern "C" fn cclGather(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    sendcount: usize,
    datatype: cclDataType_t,
    root: c_int,
    comm: cclComm_t,
    stream: *mut c_void,
) -> cclResult_t {
    let args = Args::new(K::Gather, sendbuff, recvbuff, sendcount, datatype);
    collective(comm, args.root(root), stream)
}

/// Block r (`recvcount` elements) of `root`'s `sendbuff` goes to rank r;
/// `sendbuff` is read on the root only.
#[no_mangle]
pub extern "C" fn cclScatter(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    recvcount: usize,
    datatype: cclDataType_t,
    root: c_int,
    comm: cclComm_t,
    stream: *mut c_void,
) -> cclResult_t {
    let args = Args::new(K::Scatter, sendbuff, recvbuff, recvcount, datatype);
    collective(comm, args.root(root), stream)
}

/// Returns once every rank has entered the barrier.
#[no_mangle]
pub extern "C" fn cclBarrier(comm: cclComm_t, stream: *mut c_void) -> cclResult_t {
    let (none, null) = (std::ptr::null(), std::ptr::null_mut());
    collective(comm, Args::new(K::Barrier, none, null, 0, cclUint8), stream)
}

/// Sends `count` elements to rank `peer`, which receives them with `cclRecv`.
#[no_mangle]
pub extern "C" fn cclSend(
    sendbuff: *const c_void,
    count: usize,
    datatype: cclDataType_t,
    peer: c_int,
    comm: cclComm_t,
    stream: *mut c_void,
) -> cclResult_t {
    transfer(comm, sendbuff, count, datatype, peer, true, stream)
}

/// Receives `count` elements from rank `peer`.
#[no_mangle]
pub extern "C" fn cclRecv(
    recvbuff: *mut c_void,
    count: usize,
    datatype: cclDataType_t,
    peer: c_int,
    comm: cclComm_t,
    stream: *mut c_void,
) -> cclResult_t {
    transfer(comm, recvbuff, count, datatype, peer, false, stream)
}
