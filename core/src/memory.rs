//! Memory that knows where it lives.
//!
//! A call's buffers are [`BufRef`]s (read) and [`BufMut`]s (written): an
//! address, a length and a [`MemoryKind`]. Code that moves or combines
//! bytes asks the memory how: [`Kernels`] are what one kind of memory
//! brings (reduction kernels, copies, scratch allocation), chosen by the
//! kind of a call's buffers. Host memory has [`HostKernels`], the CPU
//! kernels of [`crate::kernels`]. A link or kernel that only handles host
//! memory takes the bytes with [`BufRef::host`] / [`BufMut::host`], which
//! fail clearly for any other kind instead of dereferencing it.

use std::{any::Any, fmt, marker::PhantomData};

use crate::{kernels, AlignedBuf, DataType, Error, ReduceOp, Result};

/// Where memory lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MemoryKind {
    /// Memory this process reads and writes with the CPU.
    Host,
    /// Memory of the GPU with this ordinal (CUDA device memory).
    Device { ordinal: u32 },
}

impl fmt::Display for MemoryKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MemoryKind::Host => f.write_str("host memory"),
            MemoryKind::Device { ordinal } => write!(f, "memory of GPU {ordinal}"),
        }
    }
}

/// The error of host-only code handed memory of another kind.
fn not_host(kind: MemoryKind, what: &str) -> Error {
    Error::Unsupported(format!(
        "{what} lies in {kind}, and this path handles host memory only"
    ))
}

/// Memory a call reads: where it lives, its address and its length in bytes.
#[derive(Clone, Copy)]
pub struct BufRef<'a> {
    kind: MemoryKind,
    ptr: *const u8,
    len: usize,
    _borrow: PhantomData<&'a [u8]>,
}

// SAFETY: a shared view of memory, like `&[u8]`; device memory is only ever
// handed to code for its kind.
unsafe impl Send for BufRef<'_> {}
unsafe impl Sync for BufRef<'_> {}

impl<'a> BufRef<'a> {
    /// Host memory.
    pub fn from_host(bytes: &'a [u8]) -> BufRef<'a> {
        BufRef {
            kind: MemoryKind::Host,
            ptr: bytes.as_ptr(),
            len: bytes.len(),
            _borrow: PhantomData,
        }
    }

    /// Memory of `kind` at `ptr`.
    ///
    /// # Safety
    /// `len` bytes at `ptr` must be memory of `kind`, readable and not
    /// written by anyone else for `'a`.
    pub unsafe fn from_raw(kind: MemoryKind, ptr: *const u8, len: usize) -> BufRef<'a> {
        BufRef {
            kind,
            ptr,
            len,
            _borrow: PhantomData,
        }
    }

    /// Where the memory lives.
    pub fn kind(&self) -> MemoryKind {
        self.kind
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The address (of memory of [`BufRef::kind`]).
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr
    }

    /// The bytes, if this is host memory.
    pub fn host(self) -> Result<&'a [u8]> {
        match self.kind {
            MemoryKind::Host if self.len == 0 => Ok(&[]),
            // SAFETY: host memory readable for 'a (the constructors' contract).
            MemoryKind::Host => Ok(unsafe { std::slice::from_raw_parts(self.ptr, self.len) }),
            kind => Err(not_host(kind, "a buffer read")),
        }
    }

    /// Bytes `at..at + len`; `None` if they do not lie within.
    pub fn slice(self, at: usize, len: usize) -> Option<BufRef<'a>> {
        (at.checked_add(len)? <= self.len).then(|| BufRef {
            ptr: self.ptr.wrapping_add(at),
            len,
            ..self
        })
    }
}

impl fmt::Debug for BufRef<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "BufRef({} bytes of {} at {:p})",
            self.len, self.kind, self.ptr
        )
    }
}

/// Memory a call writes: where it lives, its address and its length in bytes.
pub struct BufMut<'a> {
    kind: MemoryKind,
    ptr: *mut u8,
    len: usize,
    _borrow: PhantomData<&'a mut [u8]>,
}

// SAFETY: an exclusive view of memory, like `&mut [u8]`.
unsafe impl Send for BufMut<'_> {}
unsafe impl Sync for BufMut<'_> {}

impl<'a> BufMut<'a> {
    /// Host memory.
    pub fn from_host(bytes: &'a mut [u8]) -> BufMut<'a> {
        BufMut {
            kind: MemoryKind::Host,
            ptr: bytes.as_mut_ptr(),
            len: bytes.len(),
            _borrow: PhantomData,
        }
    }

    /// Memory of `kind` at `ptr`.
    ///
    /// # Safety
    /// `len` bytes at `ptr` must be memory of `kind`, writable and not
    /// accessed by anyone else for `'a`.
    pub unsafe fn from_raw(kind: MemoryKind, ptr: *mut u8, len: usize) -> BufMut<'a> {
        BufMut {
            kind,
            ptr,
            len,
            _borrow: PhantomData,
        }
    }

    /// Where the memory lives.
    pub fn kind(&self) -> MemoryKind {
        self.kind
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The address (of memory of [`BufMut::kind`]).
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr
    }

    /// The same memory, read-only, for as long as this borrow.
    pub fn readonly(&self) -> BufRef<'_> {
        BufRef {
            kind: self.kind,
            ptr: self.ptr,
            len: self.len,
            _borrow: PhantomData,
        }
    }

    /// The same memory, for a shorter borrow.
    pub fn reborrow(&mut self) -> BufMut<'_> {
        BufMut {
            kind: self.kind,
            ptr: self.ptr,
            len: self.len,
            _borrow: PhantomData,
        }
    }

    /// The bytes, if this is host memory.
    pub fn host(self) -> Result<&'a mut [u8]> {
        match self.kind {
            MemoryKind::Host if self.len == 0 => Ok(&mut []),
            // SAFETY: host memory writable and exclusive for 'a (the constructors' contract).
            MemoryKind::Host => Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }),
            kind => Err(not_host(kind, "a buffer written")),
        }
    }
}

impl fmt::Debug for BufMut<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "BufMut({} bytes of {} at {:p})",
            self.len, self.kind, self.ptr
        )
    }
}

/// Memory a call owns for a while: scratch space, a pre-multiplied copy of
/// an input. It lives in one kind of memory and is freed when dropped.
pub struct Scratch {
    kind: MemoryKind,
    ptr: *mut u8,
    len: usize,
    /// Owns the allocation at `ptr`.
    _owner: Box<dyn Any + Send>,
}

// SAFETY: `Scratch` owns its memory exclusively, like a `Vec<u8>`.
unsafe impl Send for Scratch {}
unsafe impl Sync for Scratch {}

impl Scratch {
    /// Host scratch of `len` zero bytes, aligned for every element type.
    pub fn host(len: usize) -> Scratch {
        let mut buf = AlignedBuf::zeroed(len);
        let ptr = buf.as_mut_slice().as_mut_ptr();
        Scratch {
            kind: MemoryKind::Host,
            ptr,
            len,
            _owner: Box::new(buf),
        }
    }

    /// Memory of `kind` at `ptr` that `owner` frees when dropped.
    ///
    /// # Safety
    /// `len` bytes at `ptr` must be memory of `kind` that only this value
    /// accesses, valid until `owner` is dropped, and `owner` must not move it.
    pub unsafe fn from_raw(
        kind: MemoryKind,
        ptr: *mut u8,
        len: usize,
        owner: Box<dyn Any + Send>,
    ) -> Scratch {
        Scratch {
            kind,
            ptr,
            len,
            _owner: owner,
        }
    }

    /// Where the memory lives.
    pub fn kind(&self) -> MemoryKind {
        self.kind
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The memory, read-only.
    pub fn buf(&self) -> BufRef<'_> {
        // SAFETY: owned by self, borrowed shared.
        unsafe { BufRef::from_raw(self.kind, self.ptr, self.len) }
    }

    /// The memory, writable.
    pub fn buf_mut(&mut self) -> BufMut<'_> {
        // SAFETY: owned by self, borrowed exclusively.
        unsafe { BufMut::from_raw(self.kind, self.ptr, self.len) }
    }
}

impl fmt::Debug for Scratch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Scratch({} bytes of {})", self.len, self.kind)
    }
}

/// What one kind of memory brings: the reduction kernels, copies and
/// scratch allocation that work on it. The executor, the links and the
/// facade use them for a call's buffers instead of touching the bytes.
pub trait Kernels: Send + Sync {
    /// The kind of memory these kernels work on.
    fn kind(&self) -> MemoryKind;

    /// `into = local ⊕ received` elementwise (`local` defaults to `into`).
    /// Lengths must match; `Avg` and `PreMulSum` combine by summing.
    fn reduce(
        &self,
        op: ReduceOp,
        dtype: DataType,
        into: BufMut<'_>,
        local: Option<BufRef<'_>>,
        received: BufRef<'_>,
    ) -> Result<()>;

    /// `PreMulSum`'s first step on this rank's own input (others: nothing).
    fn prescale(&self, op: ReduceOp, dtype: DataType, buf: BufMut<'_>) -> Result<()>;

    /// `Avg`'s last step on a fully reduced buffer (others: nothing).
    fn finalize(
        &self,
        op: ReduceOp,
        dtype: DataType,
        buf: BufMut<'_>,
        world_size: usize,
    ) -> Result<()>;

    /// `to = from` (same length; nothing to do when they are the same memory).
    fn copy(&self, to: BufMut<'_>, from: BufRef<'_>) -> Result<()>;

    /// Scratch memory of this kind, `len` bytes, aligned for every element type.
    fn alloc(&self, len: usize) -> Result<Scratch>;
}

/// The CPU kernels, for host memory.
#[derive(Clone, Copy, Debug, Default)]
pub struct HostKernels;

/// The one [`HostKernels`] value, for `&'static dyn Kernels`.
pub static HOST_KERNELS: HostKernels = HostKernels;

impl Kernels for HostKernels {
    fn kind(&self) -> MemoryKind {
        MemoryKind::Host
    }

    fn reduce(
        &self,
        op: ReduceOp,
        dtype: DataType,
        into: BufMut<'_>,
        local: Option<BufRef<'_>>,
        received: BufRef<'_>,
    ) -> Result<()> {
        let local = local.map(BufRef::host).transpose()?;
        kernels::reduce(op, dtype, into.host()?, local, received.host()?)
    }

    fn prescale(&self, op: ReduceOp, dtype: DataType, buf: BufMut<'_>) -> Result<()> {
        kernels::prescale(op, dtype, buf.host()?)
    }

    fn finalize(
        &self,
        op: ReduceOp,
        dtype: DataType,
        buf: BufMut<'_>,
        world_size: usize,
    ) -> Result<()> {
        kernels::finalize(op, dtype, buf.host()?, world_size)
    }

    fn copy(&self, to: BufMut<'_>, from: BufRef<'_>) -> Result<()> {
        let (to, from) = (to.host()?, from.host()?);
        if to.len() != from.len() {
            return Err(Error::Internal(format!(
                "copy of {} bytes into {}",
                from.len(),
                to.len()
            )));
        }
        if to.as_ptr() != from.as_ptr() {
            to.copy_from_slice(from);
        }
        Ok(())
    }

    fn alloc(&self, len: usize) -> Result<Scratch> {
        Ok(Scratch::host(len))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_memory_goes_through_the_host_kernels() {
        let k: &dyn Kernels = &HOST_KERNELS;
        let mut into = [1.0f32, 2.0];
        let received = [10.0f32, 20.0];
        k.reduce(
            ReduceOp::Sum,
            DataType::F32,
            BufMut::from_host(bytemuck::cast_slice_mut(&mut into)),
            None,
            BufRef::from_host(bytemuck::cast_slice(&received)),
        )
        .unwrap();
        assert_eq!(into, [11.0, 22.0]);
        let mut s = k.alloc(8).unwrap();
        assert_eq!((s.kind(), s.len()), (MemoryKind::Host, 8));
        k.copy(s.buf_mut(), BufRef::from_host(bytemuck::cast_slice(&into)))
            .unwrap();
        assert_eq!(
            s.buf().host().unwrap(),
            bytemuck::cast_slice::<f32, u8>(&into)
        );
        assert!(s.buf().slice(4, 4).is_some() && s.buf().slice(5, 4).is_none());
    }

    #[test]
    fn device_memory_is_never_read_as_host_memory() {
        let gpu = MemoryKind::Device { ordinal: 1 };
        // SAFETY: never dereferenced: `host` refuses device memory.
        let r = unsafe { BufRef::from_raw(gpu, 0x1000 as *const u8, 64) };
        let e = r.host().unwrap_err();
        assert!(
            matches!(e, Error::Unsupported(ref m) if m.contains("GPU 1")),
            "{e}"
        );
        // SAFETY: as above.
        let w = unsafe { BufMut::from_raw(gpu, 0x1000 as *mut u8, 64) };
        assert!(HOST_KERNELS.copy(w, BufRef::from_host(&[0u8; 64])).is_err());
    }
}
