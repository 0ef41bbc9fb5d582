//! Safe wrappers over the C shim (`src/shim.c`).
//!
//! Every wrapper checks that its buffers are as long as the MPI call will
//! read or write, so a mistake in the harness panics instead of corrupting
//! memory. Data type and op codes are ccl's tags (see the shim).

use std::os::raw::{c_char, c_int, c_void};

extern "C" {
    fn shim_init() -> c_int;
    fn shim_finalize() -> c_int;
    fn shim_abort(code: c_int);
    fn shim_error_string(rc: c_int, buf: *mut c_char, len: c_int);
    fn shim_rank(h: c_int, rank: *mut c_int) -> c_int;
    fn shim_size(h: c_int, size: *mut c_int) -> c_int;
    fn shim_split(h: c_int, color: c_int, key: c_int, out: *mut c_int) -> c_int;
    fn shim_free(h: c_int) -> c_int;
    fn shim_allreduce(
        h: c_int,
        send: *const c_void,
        recv: *mut c_void,
        count: c_int,
        dtype: c_int,
        op: c_int,
        in_place: c_int,
    ) -> c_int;
    fn shim_bcast(h: c_int, buf: *mut c_void, count: c_int, dtype: c_int, root: c_int) -> c_int;
    fn shim_reduce(
        h: c_int,
        send: *const c_void,
        recv: *mut c_void,
        count: c_int,
        dtype: c_int,
        op: c_int,
        root: c_int,
        in_place: c_int,
    ) -> c_int;
    fn shim_allgather(
        h: c_int,
        send: *const c_void,
        recv: *mut c_void,
        count: c_int,
        dtype: c_int,
        in_place: c_int,
    ) -> c_int;
    fn shim_reduce_scatter_block(
        h: c_int,
        send: *const c_void,
        recv: *mut c_void,
        count: c_int,
        dtype: c_int,
        op: c_int,
        in_place: c_int,
    ) -> c_int;
    fn shim_alltoall(
        h: c_int,
        send: *const c_void,
        recv: *mut c_void,
        count: c_int,
        dtype: c_int,
        in_place: c_int,
    ) -> c_int;
    fn shim_gather(
        h: c_int,
        send: *const c_void,
        recv: *mut c_void,
        count: c_int,
        dtype: c_int,
        root: c_int,
        in_place: c_int,
    ) -> c_int;
    fn shim_scatter(
        h: c_int,
        send: *const c_void,
        recv: *mut c_void,
        count: c_int,
        dtype: c_int,
        root: c_int,
        in_place: c_int,
    ) -> c_int;
    fn shim_barrier(h: c_int) -> c_int;
    fn shim_sendrecv(
        h: c_int,
        send: *const c_void,
        dst: c_int,
        recv: *mut c_void,
        src: c_int,
        count: c_int,
        dtype: c_int,
    ) -> c_int;
}

/// Data type codes (ccl's `DataType` tags; 16-bit floats move as `MPI_UINT16_T`).
pub mod dt {
    pub const I32: i32 = 3;
    pub const U64: i32 = 6;
    pub const F32: i32 = 9;
    pub const F64: i32 = 10;
}

/// Op codes (ccl's `ReduceOp` tags).
pub mod op {
    pub const SUM: i32 = 1;
    pub const MIN: i32 = 3;
    pub const MAX: i32 = 4;
}

pub type Result<T> = std::result::Result<T, String>;

fn error_string(rc: c_int) -> String {
    let mut buf = [0 as c_char; 512];
    // SAFETY: the shim writes at most `len` bytes, NUL-terminated.
    unsafe { shim_error_string(rc, buf.as_mut_ptr(), buf.len() as c_int) };
    let bytes: Vec<u8> = buf
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

fn check(rc: c_int, what: &str) -> Result<()> {
    if rc == 0 {
        Ok(())
    } else {
        Err(format!("MPI {what} failed ({rc}): {}", error_string(rc)))
    }
}

fn int(v: usize, what: &str) -> Result<c_int> {
    c_int::try_from(v).map_err(|_| format!("{what} {v} does not fit MPI's int"))
}

/// Stand-ins for empty buffers, which MPI never touches. Empty Rust slices
/// point at a dangling address equal to their alignment, and for 1-byte
/// types that is 0x1: OpenMPI's `MPI_IN_PLACE`. Distinct send and receive
/// stand-ins also keep OpenMPI from rejecting `sendbuf == recvbuf`.
static EMPTY_SEND: [u64; 4] = [0; 4];
static EMPTY_RECV: [u64; 4] = [0; 4];

fn ptr<T>(s: &[T]) -> *const c_void {
    if s.is_empty() {
        EMPTY_SEND.as_ptr() as *const c_void
    } else {
        s.as_ptr() as *const c_void
    }
}

fn mptr<T>(s: &mut [T]) -> *mut c_void {
    if s.is_empty() {
        // Never written: MPI moves no element of an empty buffer.
        EMPTY_RECV.as_ptr() as *mut c_void
    } else {
        s.as_mut_ptr() as *mut c_void
    }
}

fn need(len: usize, want: usize, what: &str) {
    assert!(
        len >= want,
        "harness bug: {what} has {len} elements, MPI uses {want}"
    );
}

pub fn init() -> Result<()> {
    // SAFETY: called once, first.
    check(unsafe { shim_init() }, "init")
}

pub fn finalize() -> Result<()> {
    // SAFETY: called once, last.
    check(unsafe { shim_finalize() }, "finalize")
}

/// Ends the whole job (every rank) with `code`.
pub fn abort(code: i32) -> ! {
    // SAFETY: MPI_Abort does not return.
    unsafe { shim_abort(code) };
    std::process::exit(code)
}

/// A communicator handle (0 is `MPI_COMM_WORLD`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Comm(c_int);

pub const WORLD: Comm = Comm(0);

impl Comm {
    pub fn rank(self) -> Result<usize> {
        let mut r = -1;
        // SAFETY: writes one int.
        check(unsafe { shim_rank(self.0, &mut r) }, "Comm_rank")?;
        Ok(r as usize)
    }

    pub fn size(self) -> Result<usize> {
        let mut r = -1;
        // SAFETY: writes one int.
        check(unsafe { shim_size(self.0, &mut r) }, "Comm_size")?;
        Ok(r as usize)
    }

    /// `MPI_Comm_split`, `None` being `MPI_UNDEFINED` (and `MPI_COMM_NULL` back).
    pub fn split(self, color: Option<u32>, key: i32) -> Result<Option<Comm>> {
        let color = match color {
            Some(c) => int(c as usize, "color")?,
            None => -1,
        };
        let mut out = -1;
        // SAFETY: writes one int.
        check(
            unsafe { shim_split(self.0, color, key, &mut out) },
            "Comm_split",
        )?;
        Ok((out >= 0).then_some(Comm(out)))
    }

    pub fn free(self) -> Result<()> {
        // SAFETY: handle from `split`, freed once.
        check(unsafe { shim_free(self.0) }, "Comm_free")
    }

    /// `MPI_Allreduce` of `recv.len()` elements; `send` `None` is `MPI_IN_PLACE`.
    pub fn allreduce<T>(
        self,
        send: Option<&[T]>,
        recv: &mut [T],
        dtype: i32,
        op: i32,
    ) -> Result<()> {
        let n = recv.len();
        if let Some(s) = send {
            need(s.len(), n, "allreduce send");
        }
        // SAFETY: both buffers hold `n` elements.
        check(
            unsafe {
                shim_allreduce(
                    self.0,
                    send.map_or(std::ptr::null(), ptr),
                    mptr(recv),
                    int(n, "count")?,
                    dtype,
                    op,
                    send.is_none() as c_int,
                )
            },
            "Allreduce",
        )
    }

    pub fn bcast<T>(self, buf: &mut [T], dtype: i32, root: usize) -> Result<()> {
        // SAFETY: `buf` holds the count.
        check(
            unsafe {
                shim_bcast(
                    self.0,
                    mptr(buf),
                    int(buf.len(), "count")?,
                    dtype,
                    int(root, "root")?,
                )
            },
            "Bcast",
        )
    }

    /// `MPI_Reduce` of `count` elements; `send` `None` (root only) is `MPI_IN_PLACE`
    /// with the input in `recv`. `recv` is ignored off the root.
    #[allow(clippy::too_many_arguments)]
    pub fn reduce<T>(
        self,
        send: Option<&[T]>,
        recv: &mut [T],
        count: usize,
        dtype: i32,
        op: i32,
        root: usize,
    ) -> Result<()> {
        let here = self.rank()? == root;
        match send {
            Some(s) => need(s.len(), count, "reduce send"),
            None => assert!(here, "harness bug: in-place reduce off the root"),
        }
        if here {
            need(recv.len(), count, "reduce recv");
        }
        // SAFETY: lengths checked above.
        check(
            unsafe {
                shim_reduce(
                    self.0,
                    send.map_or(std::ptr::null(), ptr),
                    mptr(recv),
                    int(count, "count")?,
                    dtype,
                    op,
                    int(root, "root")?,
                    send.is_none() as c_int,
                )
            },
            "Reduce",
        )
    }

    /// `MPI_Allgather` of `count` per rank; `send` `None` is `MPI_IN_PLACE`.
    pub fn allgather<T>(
        self,
        send: Option<&[T]>,
        recv: &mut [T],
        count: usize,
        dtype: i32,
    ) -> Result<()> {
        let n = self.size()?;
        need(recv.len(), n * count, "allgather recv");
        if let Some(s) = send {
            need(s.len(), count, "allgather send");
        }
        // SAFETY: lengths checked above.
        check(
            unsafe {
                shim_allgather(
                    self.0,
                    send.map_or(std::ptr::null(), ptr),
                    mptr(recv),
                    int(count, "count")?,
                    dtype,
                    send.is_none() as c_int,
                )
            },
            "Allgather",
        )
    }

    /// `MPI_Reduce_scatter_block` of `count` per rank; `send` `None` is
    /// `MPI_IN_PLACE` (input: all of `recv`; result: its first `count`).
    pub fn reduce_scatter_block<T>(
        self,
        send: Option<&[T]>,
        recv: &mut [T],
        count: usize,
        dtype: i32,
        op: i32,
    ) -> Result<()> {
        let n = self.size()?;
        match send {
            Some(s) => {
                need(s.len(), n * count, "reduce_scatter send");
                need(recv.len(), count, "reduce_scatter recv");
            }
            None => need(recv.len(), n * count, "reduce_scatter in-place buffer"),
        }
        // SAFETY: lengths checked above.
        check(
            unsafe {
                shim_reduce_scatter_block(
                    self.0,
                    send.map_or(std::ptr::null(), ptr),
                    mptr(recv),
                    int(count, "count")?,
                    dtype,
                    op,
                    send.is_none() as c_int,
                )
            },
            "Reduce_scatter_block",
        )
    }

    /// `MPI_Alltoall` of `count` per pair; `send` `None` is `MPI_IN_PLACE`.
    pub fn alltoall<T>(
        self,
        send: Option<&[T]>,
        recv: &mut [T],
        count: usize,
        dtype: i32,
    ) -> Result<()> {
        let n = self.size()?;
        need(recv.len(), n * count, "alltoall recv");
        if let Some(s) = send {
            need(s.len(), n * count, "alltoall send");
        }
        // SAFETY: lengths checked above.
        check(
            unsafe {
                shim_alltoall(
                    self.0,
                    send.map_or(std::ptr::null(), ptr),
                    mptr(recv),
                    int(count, "count")?,
                    dtype,
                    send.is_none() as c_int,
                )
            },
            "Alltoall",
        )
    }

    /// `MPI_Gather` of `count` per rank; `send` `None` (root only) is
    /// `MPI_IN_PLACE` with the root's block already in `recv`.
    pub fn gather<T>(
        self,
        send: Option<&[T]>,
        recv: &mut [T],
        count: usize,
        dtype: i32,
        root: usize,
    ) -> Result<()> {
        let here = self.rank()? == root;
        match send {
            Some(s) => need(s.len(), count, "gather send"),
            None => assert!(here, "harness bug: in-place gather off the root"),
        }
        if here {
            need(recv.len(), self.size()? * count, "gather recv");
        }
        // SAFETY: lengths checked above.
        check(
            unsafe {
                shim_gather(
                    self.0,
                    send.map_or(std::ptr::null(), ptr),
                    mptr(recv),
                    int(count, "count")?,
                    dtype,
                    int(root, "root")?,
                    send.is_none() as c_int,
                )
            },
            "Gather",
        )
    }

    /// `MPI_Scatter` of `count` per rank; `recv` `None` (root only) is
    /// `MPI_IN_PLACE`: the root keeps its block in `send`.
    pub fn scatter<T>(
        self,
        send: &[T],
        recv: Option<&mut [T]>,
        count: usize,
        dtype: i32,
        root: usize,
    ) -> Result<()> {
        let here = self.rank()? == root;
        if here {
            need(send.len(), self.size()? * count, "scatter send");
        }
        let in_place = recv.is_none();
        let recv_ptr = match recv {
            Some(r) => {
                need(r.len(), count, "scatter recv");
                mptr(r)
            }
            None => {
                assert!(here, "harness bug: in-place scatter off the root");
                std::ptr::null_mut()
            }
        };
        // SAFETY: lengths checked above.
        check(
            unsafe {
                shim_scatter(
                    self.0,
                    ptr(send),
                    recv_ptr,
                    int(count, "count")?,
                    dtype,
                    int(root, "root")?,
                    in_place as c_int,
                )
            },
            "Scatter",
        )
    }

    pub fn barrier(self) -> Result<()> {
        // SAFETY: no buffers.
        check(unsafe { shim_barrier(self.0) }, "Barrier")
    }

    /// `MPI_Sendrecv`: `send` to `dst`, `recv` (same length) from `src`.
    pub fn sendrecv<T>(
        self,
        send: &[T],
        dst: usize,
        recv: &mut [T],
        src: usize,
        dtype: i32,
    ) -> Result<()> {
        need(recv.len(), send.len(), "sendrecv recv");
        // SAFETY: both hold `send.len()` elements.
        check(
            unsafe {
                shim_sendrecv(
                    self.0,
                    ptr(send),
                    int(dst, "dst")?,
                    mptr(recv),
                    int(src, "src")?,
                    int(send.len(), "count")?,
                    dtype,
                )
            },
            "Sendrecv",
        )
    }
}
