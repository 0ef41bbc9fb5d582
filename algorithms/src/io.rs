//! The memory of one call: its input and output, where they live, and the
//! kernels that work on them.

use std::marker::PhantomData;

use ccl_core::{BufMut, BufRef, Error, Kernels, MemoryKind, Result, HOST_KERNELS};

use crate::schedule::Layout;

/// An address and a length in bytes.
type Piece = (*mut u8, usize);

/// One region, or several taken end to end as one (the tensors of a bucket).
#[derive(Clone, Debug)]
enum Parts {
    One([Piece; 1]),
    Many(Vec<Piece>),
}

impl Parts {
    fn pieces(&self) -> &[Piece] {
        match self {
            Parts::One(one) => one,
            Parts::Many(many) => many,
        }
    }

    fn len(&self) -> usize {
        self.pieces().iter().map(|&(_, len)| len).sum()
    }
}

/// The caller's input and output memory for one call.
///
/// Input and output are disjoint, the same memory, or, for in-place calls
/// whose input and output differ in size, one lies inside the other at the
/// block the collective defines (this rank's block of an allgather output, of
/// a reduce-scatter input, of a gather/scatter root buffer). Schedules copy or
/// reduce a region onto itself by skipping the copy or the second operand.
/// Both lie in one kind of memory, which [`IoBuffers::kernels`] work on.
///
/// An in-place call may also hold several buffers taken end to end as one
/// ([`IoBuffers::pieces_in_place`]): group algorithms run on them where they
/// lie; schedules need one contiguous buffer.
pub struct IoBuffers<'a> {
    input: Parts,
    output: Parts,
    kernels: &'static dyn Kernels,
    _borrow: PhantomData<&'a mut [u8]>,
}

// SAFETY: IoBuffers is a pair of byte regions handed to one execution at a
// time; sending it to another thread is as safe as sending the borrows.
unsafe impl Send for IoBuffers<'_> {}
unsafe impl Sync for IoBuffers<'_> {}

impl<'a> IoBuffers<'a> {
    /// One buffer that is both input and output.
    pub fn in_place(mut buf: BufMut<'a>, kernels: &'static dyn Kernels) -> Result<IoBuffers<'a>> {
        let piece = (buf.as_mut_ptr(), buf.len());
        IoBuffers::checked(
            Parts::One([piece]),
            Parts::One([piece]),
            buf.kind(),
            kernels,
        )
    }

    /// Separate input and output.
    pub fn separate(
        input: BufRef<'a>,
        mut output: BufMut<'a>,
        kernels: &'static dyn Kernels,
    ) -> Result<IoBuffers<'a>> {
        if input.kind() != output.kind() {
            return Err(Error::InvalidArgument(format!(
                "the input lies in {} and the output in {}: one call's buffers share one kind of memory",
                input.kind(),
                output.kind()
            )));
        }
        let piece_in = (input.as_ptr().cast_mut(), input.len());
        let piece_out = (output.as_mut_ptr(), output.len());
        IoBuffers::checked(
            Parts::One([piece_in]),
            Parts::One([piece_out]),
            output.kind(),
            kernels,
        )
    }

    /// Host memory: `input` and `output` separate.
    pub fn host(input: &'a [u8], output: &'a mut [u8]) -> IoBuffers<'a> {
        IoBuffers {
            input: Parts::One([(input.as_ptr().cast_mut(), input.len())]),
            output: Parts::One([(output.as_mut_ptr(), output.len())]),
            kernels: &HOST_KERNELS,
            _borrow: PhantomData,
        }
    }

    /// Host memory: one buffer that is both input and output.
    pub fn host_in_place(buf: &'a mut [u8]) -> IoBuffers<'a> {
        let piece = (buf.as_mut_ptr(), buf.len());
        IoBuffers {
            input: Parts::One([piece]),
            output: Parts::One([piece]),
            kernels: &HOST_KERNELS,
            _borrow: PhantomData,
        }
    }

    /// Buffers of `kernels`' kind from raw parts.
    ///
    /// # Safety
    /// Both regions must be memory of that kind, stay valid, and be touched
    /// by nobody else, until the execution that receives them has finished
    /// or been dropped. They must overlap only as described on [`IoBuffers`].
    pub unsafe fn from_raw(
        input: *const u8,
        input_len: usize,
        output: *mut u8,
        output_len: usize,
        kernels: &'static dyn Kernels,
    ) -> IoBuffers<'static> {
        IoBuffers {
            input: Parts::One([(input.cast_mut(), input_len)]),
            output: Parts::One([(output, output_len)]),
            kernels,
            _borrow: PhantomData,
        }
    }

    /// Several buffers taken end to end as one, each both input and output.
    ///
    /// # Safety
    /// As [`IoBuffers::from_raw`], for every `(address, bytes)`; the buffers
    /// must not overlap.
    pub unsafe fn pieces_in_place(
        pieces: Vec<(*mut u8, usize)>,
        kernels: &'static dyn Kernels,
    ) -> IoBuffers<'static> {
        IoBuffers {
            input: Parts::Many(pieces.clone()),
            output: Parts::Many(pieces),
            kernels,
            _borrow: PhantomData,
        }
    }

    fn checked(
        input: Parts,
        output: Parts,
        kind: MemoryKind,
        kernels: &'static dyn Kernels,
    ) -> Result<IoBuffers<'a>> {
        if kernels.kind() != kind {
            return Err(Error::Internal(format!(
                "kernels for {} given buffers in {kind}",
                kernels.kind()
            )));
        }
        Ok(IoBuffers {
            input,
            output,
            kernels,
            _borrow: PhantomData,
        })
    }
}

impl IoBuffers<'_> {
    /// Where the buffers live.
    pub fn kind(&self) -> MemoryKind {
        self.kernels.kind()
    }

    /// The kernels that work on the buffers.
    pub fn kernels(&self) -> &'static dyn Kernels {
        self.kernels
    }

    /// Bytes of input and of output.
    pub fn lens(&self) -> (usize, usize) {
        (self.input.len(), self.output.len())
    }

    /// The input and the output as one region each (address, bytes); an
    /// error for buffers taken end to end.
    pub fn contiguous(&self) -> Result<(Piece, Piece)> {
        match (&self.input, &self.output) {
            (Parts::One([i]), Parts::One([o])) => Ok((*i, *o)),
            _ => Err(Error::Internal(
                "a schedule runs on one buffer, not on several taken end to end".into(),
            )),
        }
    }

    /// Whether input and output share memory.
    pub fn layout(&self) -> Layout {
        let overlap = |&(a, alen): &Piece, &(b, blen): &Piece| {
            let (a, b) = (a as usize, b as usize);
            alen > 0 && blen > 0 && a < b + blen && b < a + alen
        };
        let inputs = self.input.pieces();
        let shared = self
            .output
            .pieces()
            .iter()
            .any(|o| inputs.iter().any(|i| overlap(i, o)));
        if shared {
            Layout::InPlace
        } else {
            Layout::OutOfPlace
        }
    }

    /// The input's pieces, in order.
    pub fn input_pieces(&self) -> &[(*mut u8, usize)] {
        self.input.pieces()
    }

    /// The output's pieces, in order.
    pub fn output_pieces(&self) -> &[(*mut u8, usize)] {
        self.output.pieces()
    }
}
