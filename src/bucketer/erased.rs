//! The bucketer's type erasure: a bucket holds `Vec<T>`s of one element
//! type behind `Box<dyn Any>`, and [`Ops`] does for each `T` what a bucket
//! needs (allocate, pack, unpack, launch the allreduce).

use std::any::Any;

use ccl_core::{Element, Error, ReduceOp, Result, Work};

use crate::Communicator;

/// A `Vec<T>` of some element type, its type erased.
pub(super) type Boxed = Box<dyn Any + Send>;
/// A launched allreduce, or why it could not start.
type Launched = Result<Box<dyn Pending>>;

/// The operations on type-erased `Vec<T>`s a bucket needs, for one `T`.
pub(super) struct Ops {
    /// A zeroed `Vec<T>` of `len` elements.
    pub(super) alloc: fn(usize) -> Boxed,
    /// `bucket[offset..offset + len] = tensor` (or `+=` when `add`).
    pub(super) pack: fn(&mut Boxed, &Boxed, usize, bool) -> Result<()>,
    /// `tensor = bucket[offset..offset + len]`.
    pub(super) unpack: fn(&Boxed, &mut Boxed, usize) -> Result<()>,
    /// Launches the allreduce of a `Vec<T>`.
    pub(super) launch: fn(&Communicator, Boxed, ReduceOp) -> Launched,
    /// Launches the allreduce of several `Vec<T>`s where they lie
    /// ([`Communicator::launch_allreduce_on`]); the result is a `Vec<Vec<T>>`.
    pub(super) launch_on: fn(&Communicator, Vec<Boxed>, ReduceOp) -> Launched,
    /// A `Vec<Vec<T>>` as its `Vec<T>`s.
    pub(super) split: fn(Boxed) -> Result<Vec<Boxed>>,
}

/// A launched allreduce whose result is a type-erased `Vec<T>`.
pub(super) trait Pending: Send {
    fn wait(self: Box<Self>) -> Result<Boxed>;
}

impl<T: Element> Pending for Work<Vec<T>> {
    fn wait(self: Box<Self>) -> Result<Boxed> {
        (*self).wait().map(|v| Box::new(v) as Boxed)
    }
}

/// An allreduce of several `Vec<T>`s, whose result is a `Vec<Vec<T>>`.
struct InPlace<T>(Work<Vec<Vec<T>>>);

impl<T: Element> Pending for InPlace<T> {
    fn wait(self: Box<Self>) -> Result<Boxed> {
        self.0.wait().map(|v| Box::new(v) as Boxed)
    }
}

pub(super) fn typed<T: Element>(b: &Boxed) -> Result<&Vec<T>> {
    b.downcast_ref::<Vec<T>>()
        .ok_or_else(|| Error::Internal(format!("bucketer: a buffer is not a Vec<{}>", T::DTYPE)))
}

pub(super) fn typed_mut<T: Element>(b: &mut Boxed) -> Result<&mut Vec<T>> {
    b.downcast_mut::<Vec<T>>()
        .ok_or_else(|| Error::Internal(format!("bucketer: a buffer is not a Vec<{}>", T::DTYPE)))
}

pub(super) fn range_err(what: &str) -> Error {
    Error::Internal(format!("bucketer: {what} out of the bucket's range"))
}

impl Ops {
    pub(super) fn of<T: Element>() -> &'static Ops {
        fn alloc<T: Element>(len: usize) -> Boxed {
            Box::new(vec![T::zeroed(); len])
        }
        fn pack<T: Element>(
            bucket: &mut Boxed,
            tensor: &Boxed,
            off: usize,
            add: bool,
        ) -> Result<()> {
            let t = typed::<T>(tensor)?;
            let b = typed_mut::<T>(bucket)?;
            let dst = b
                .get_mut(off..off + t.len())
                .ok_or_else(|| range_err("pack"))?;
            if add {
                ccl_core::kernels::reduce(
                    ReduceOp::Sum,
                    T::DTYPE,
                    bytemuck::cast_slice_mut(dst),
                    None,
                    bytemuck::cast_slice(t),
                )
            } else {
                dst.copy_from_slice(t);
                Ok(())
            }
        }
        fn unpack<T: Element>(bucket: &Boxed, tensor: &mut Boxed, off: usize) -> Result<()> {
            let b = typed::<T>(bucket)?;
            let t = typed_mut::<T>(tensor)?;
            let src = b
                .get(off..off + t.len())
                .ok_or_else(|| range_err("unpack"))?;
            t.copy_from_slice(src);
            Ok(())
        }
        fn launch<T: Element>(
            comm: &Communicator,
            buf: Boxed,
            op: ReduceOp,
        ) -> Result<Box<dyn Pending>> {
            let v = buf.downcast::<Vec<T>>().map_err(|_| {
                Error::Internal(format!("bucketer: a buffer is not a Vec<{}>", T::DTYPE))
            })?;
            Ok(Box::new(comm.iallreduce(*v, op)))
        }
        fn launch_on<T: Element>(
            comm: &Communicator,
            bufs: Vec<Boxed>,
            op: ReduceOp,
        ) -> Result<Box<dyn Pending>> {
            let vecs = bufs
                .into_iter()
                .map(|b| b.downcast::<Vec<T>>().map(|v| *v))
                .collect::<std::result::Result<Vec<Vec<T>>, _>>()
                .map_err(|_| {
                    Error::Internal(format!("bucketer: a tensor is not a Vec<{}>", T::DTYPE))
                })?;
            let mut vecs = vecs;
            let pieces = vecs
                .iter_mut()
                .map(|v| {
                    let bytes: &mut [u8] = bytemuck::cast_slice_mut(v);
                    (bytes.as_mut_ptr(), bytes.len())
                })
                .collect();
            // SAFETY: the vectors' heap memory does not move when they move
            // into the completion, which keeps them alive and untouched
            // until the engine is done with them.
            let work = unsafe { comm.launch_allreduce_on(T::DTYPE, op, pieces, move || vecs) };
            Ok(Box::new(InPlace(work)))
        }
        fn split<T: Element>(all: Boxed) -> Result<Vec<Boxed>> {
            let vecs = all.downcast::<Vec<Vec<T>>>().map_err(|_| {
                Error::Internal(format!(
                    "bucketer: a result is not a Vec<Vec<{}>>",
                    T::DTYPE
                ))
            })?;
            Ok(vecs.into_iter().map(|v| Box::new(v) as Boxed).collect())
        }
        macro_rules! table {
            ($($t:ty),*) => {{
                $(if T::DTYPE == <$t as Element>::DTYPE {
                    static OPS: Ops = Ops {
                        alloc: alloc::<$t>,
                        pack: pack::<$t>,
                        unpack: unpack::<$t>,
                        launch: launch::<$t>,
                        launch_on: launch_on::<$t>,
                        split: split::<$t>,
                    };
                    return &OPS;
                })*
                unreachable!("every Element type is listed")
            }};
        }
        table!(
            i8,
            u8,
            i32,
            u32,
            i64,
            u64,
            crate::f16,
            crate::bf16,
            f32,
            f64
        )
    }
}
