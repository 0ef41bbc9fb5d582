//! The blocking collectives the checks make, through one trait: on the host
//! they are the communicator's typed methods; on a GPU ([`OnDevice`]) each
//! copies its buffers into device memory, runs the call ordered on a stream
//! with `launch_on_stream`, and copies the result back.

use ccl::{
    cuda::{Gpu, Stream, Transfer},
    BufMut, BufRef, Collective, CollectiveKind, Communicator, Element, MemoryKind, ReduceOp,
    Result,
};

/// Declares [`Calls`] and its two implementations from one list of
/// `name: form Kind(argument: type => Collective method)`.
macro_rules! calls {
    ($($name:ident: $form:ident $kind:ident($($arg:ident: $ty:ty => $with:ident),*);)*) => {
        /// The blocking collectives of the checks.
        pub(crate) trait Calls {
            fn rank(&self) -> usize;
            fn world_size(&self) -> usize;
            $(calls!(@sig $form $name($($arg: $ty),*););)*
        }

        impl Calls for Communicator {
            fn rank(&self) -> usize {
                Communicator::rank(self)
            }
            fn world_size(&self) -> usize {
                Communicator::world_size(self)
            }
            $(calls!(@host $form $name($($arg: $ty),*));)*
        }

        impl Calls for OnDevice<'_> {
            fn rank(&self) -> usize {
                self.comm.rank()
            }
            fn world_size(&self) -> usize {
                self.comm.world_size()
            }
            $(calls!(@device $form $name $kind($($arg: $ty => $with),*));)*
        }
    };
    (@sig in_place $name:ident($($arg:ident: $ty:ty),*);) => {
        fn $name<T: Element>(&self, buf: &mut [T] $(, $arg: $ty)*) -> Result<()>;
    };
    (@sig out_of_place $name:ident($($arg:ident: $ty:ty),*);) => {
        fn $name<T: Element>(&self, input: &[T], output: &mut [T] $(, $arg: $ty)*) -> Result<()>;
    };
    (@host in_place $name:ident($($arg:ident: $ty:ty),*)) => {
        fn $name<T: Element>(&self, buf: &mut [T] $(, $arg: $ty)*) -> Result<()> {
            Communicator::$name(self, buf $(, $arg)*)
        }
    };
    (@host out_of_place $name:ident($($arg:ident: $ty:ty),*)) => {
        fn $name<T: Element>(&self, input: &[T], output: &mut [T] $(, $arg: $ty)*) -> Result<()> {
            Communicator::$name(self, input, output $(, $arg)*)
        }
    };
    (@device in_place $name:ident $kind:ident($($arg:ident: $ty:ty => $with:ident),*)) => {
        fn $name<T: Element>(&self, buf: &mut [T] $(, $arg: $ty)*) -> Result<()> {
            self.in_place(of::<T>(CollectiveKind::$kind)$(.$with($arg))*, buf)
        }
    };
    (@device out_of_place $name:ident $kind:ident($($arg:ident: $ty:ty => $with:ident),*)) => {
        fn $name<T: Element>(&self, input: &[T], output: &mut [T] $(, $arg: $ty)*) -> Result<()> {
            self.out_of_place(of::<T>(CollectiveKind::$kind)$(.$with($arg))*, input, output)
        }
    };
}

calls! {
    allreduce: in_place AllReduce(op: ReduceOp => with_op);
    allreduce_into: out_of_place AllReduce(op: ReduceOp => with_op);
    reduce: in_place Reduce(op: ReduceOp => with_op, root: usize => with_root);
    reduce_into: out_of_place Reduce(op: ReduceOp => with_op, root: usize => with_root);
    reduce_scatter: in_place ReduceScatter(op: ReduceOp => with_op);
    reduce_scatter_into: out_of_place ReduceScatter(op: ReduceOp => with_op);
    broadcast: in_place Broadcast(root: usize => with_root);
    broadcast_into: out_of_place Broadcast(root: usize => with_root);
    gather: in_place Gather(root: usize => with_root);
    gather_into: out_of_place Gather(root: usize => with_root);
    scatter: in_place Scatter(root: usize => with_root);
    scatter_into: out_of_place Scatter(root: usize => with_root);
    allgather: in_place AllGather();
    allgather_into: out_of_place AllGather();
    alltoall: in_place AllToAll();
    alltoall_into: out_of_place AllToAll();
}

fn of<T: Element>(kind: CollectiveKind) -> Collective {
    Collective::new(kind, T::DTYPE, 0)
}

/// A communicator's calls on the memory of one GPU, ordered on one stream.
pub(crate) struct OnDevice<'a> {
    pub comm: &'a Communicator,
    pub stream: Stream,
}

impl OnDevice<'_> {
    fn gpu(&self) -> &dyn Gpu {
        &**self.stream.gpu()
    }

    fn kind(&self) -> MemoryKind {
        MemoryKind::Device {
            ordinal: self.gpu().ordinal(),
        }
    }

    /// Device memory holding `data`.
    fn upload<T: Element>(&self, data: &[T]) -> Result<ccl::Scratch> {
        let bytes: &[u8] = bytemuck::cast_slice(data);
        let mem = self.gpu().alloc_device(bytes.len())?;
        // SAFETY: both live until the stream is synchronized below.
        unsafe {
            self.gpu().copy(
                self.stream.raw(),
                mem.buf().as_ptr().cast_mut(),
                bytes.as_ptr(),
                bytes.len(),
            )?
        };
        self.sync()?;
        Ok(mem)
    }

    /// Copies device memory `mem` back into `data`.
    fn download<T: Element>(&self, mem: &ccl::Scratch, data: &mut [T]) -> Result<()> {
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(data);
        // SAFETY: as in `upload`.
        unsafe {
            self.gpu().copy(
                self.stream.raw(),
                bytes.as_mut_ptr(),
                mem.buf().as_ptr(),
                bytes.len(),
            )?
        };
        self.sync()
    }

    fn sync(&self) -> Result<()> {
        match self
            .stream
            .synchronize(Some(std::time::Duration::from_secs(60)))?
        {
            true => Ok(()),
            false => Err(ccl::Error::Internal(
                "the stream did not drain in 60 s".into(),
            )),
        }
    }

    fn in_place<T: Element>(&self, template: Collective, buf: &mut [T]) -> Result<()> {
        let mem = self.upload(buf)?;
        let at = mem.buf().as_ptr().cast_mut();
        let bytes = std::mem::size_of_val(buf);
        // SAFETY: device memory that outlives the wait.
        unsafe {
            let buf = BufMut::from_raw(self.kind(), at, bytes);
            self.comm
                .launch_in_place_on_stream(template, buf, &self.stream)
        }
        .wait()?;
        self.download(&mem, buf)
    }

    fn out_of_place<T: Element>(
        &self,
        template: Collective,
        input: &[T],
        output: &mut [T],
    ) -> Result<()> {
        let (from, to) = (self.upload(input)?, self.upload(output)?);
        // SAFETY: device memory that outlives the wait.
        unsafe {
            let input = BufRef::from_raw(self.kind(), from.buf().as_ptr(), from.len());
            let output = BufMut::from_raw(self.kind(), to.buf().as_ptr().cast_mut(), to.len());
            self.comm
                .launch_out_of_place_on_stream(template, input, output, &self.stream)
        }
        .wait()?;
        self.download(&to, output)
    }

    /// Sends `mine` to rank `to` and receives `got` from rank `from`, both
    /// between device buffers and queued on the stream before either is
    /// waited for (each would wait for the other's peer otherwise).
    pub(crate) fn exchange<T: Element>(
        &self,
        mine: &[T],
        to: usize,
        got: &mut [T],
        from: usize,
    ) -> Result<()> {
        let (out, back) = (self.upload(mine)?, self.upload(got)?);
        // SAFETY: device memory that outlives both waits.
        let works = unsafe {
            let data = BufRef::from_raw(self.kind(), out.buf().as_ptr(), out.len());
            let into = BufMut::from_raw(self.kind(), back.buf().as_ptr().cast_mut(), back.len());
            let both = vec![
                Transfer::send(T::DTYPE, to, data),
                Transfer::recv(T::DTYPE, from, into),
            ];
            self.comm.launch_transfers_on_stream(both, &self.stream)
        };
        let results: Vec<Result<()>> = works.into_iter().map(|w| w.wait()).collect();
        results.into_iter().collect::<Result<()>>()?;
        self.download(&back, got)
    }

    /// Sends `mine` from device memory to rank `to`, alone on the stream.
    pub(crate) fn send<T: Element>(&self, mine: &[T], to: usize) -> Result<()> {
        let out = self.upload(mine)?;
        // SAFETY: device memory that outlives the wait.
        unsafe {
            let data = BufRef::from_raw(self.kind(), out.buf().as_ptr(), out.len());
            self.comm
                .launch_send_on_stream(T::DTYPE, to, data, &self.stream)
        }
        .wait()
    }

    /// Receives `got` into device memory from rank `from`, alone on the stream.
    pub(crate) fn recv<T: Element>(&self, got: &mut [T], from: usize) -> Result<()> {
        let back = self.upload(got)?;
        // SAFETY: device memory that outlives the wait.
        unsafe {
            let into = BufMut::from_raw(self.kind(), back.buf().as_ptr().cast_mut(), back.len());
            self.comm
                .launch_recv_on_stream(T::DTYPE, from, into, &self.stream)
        }
        .wait()?;
        self.download(&back, got)
    }
}
