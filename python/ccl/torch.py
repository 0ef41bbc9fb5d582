"""The torch.distributed backend "cclrs".

    import ccl.torch                                   # registers it
    torch.distributed.init_process_group("cclrs")      # env://, tcp://, file://

It is a `c10d.Backend` written in Python (torch dispatches its collectives
to a Python subclass), registered per device by `init_process_group`, so
that DDP (through the C++ reducer) and FSDP2 (which asks the group for its
backend with `_get_backend(device)`) both find it. Each torch group gets its
own ccl communicator, which meets its peers through the store torch hands
over. CPU and CUDA tensors: a call on CUDA tensors is queued on torch's
current stream (sends and receives on a stream of their own per peer and
direction, which waits for the current one), and its work completes when
the GPU has done it.
"""

import atexit
import queue
import threading
import weakref
from datetime import timedelta
from typing import Callable, List, Optional

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as _C10dBackend

from . import Communicator, ReduceOp

#: The name to pass to `init_process_group` (and `new_group`): it clashes
#: with none in use (Intel's oneCCL bindings register "ccl").
BACKEND_NAME = "cclrs"

_R = dist.ReduceOp.RedOpType
_OPS = [
    (_R.SUM, ReduceOp.SUM),
    (_R.PRODUCT, ReduceOp.PROD),
    (_R.MIN, ReduceOp.MIN),
    (_R.MAX, ReduceOp.MAX),
    (_R.AVG, ReduceOp.AVG),
    (_R.BAND, ReduceOp.BAND),
    (_R.BOR, ReduceOp.BOR),
    (_R.BXOR, ReduceOp.BXOR),
]


def _op(reduce_op) -> ReduceOp:
    """ccl's op for a torch `ReduceOp` (or its `RedOpType`)."""
    kind = getattr(reduce_op, "op", reduce_op)
    if kind == _R.PREMUL_SUM:
        factor = getattr(reduce_op, "factor", None)
        if not isinstance(factor, (int, float)):
            raise NotImplementedError(
                f"cclrs: PREMUL_SUM needs a float factor that Python can read (torch "
                f"{torch.__version__} gives {type(factor).__name__}; a tensor factor, "
                "or a torch without ReduceOp.factor, is not supported)"
            )
        return ReduceOp.premul_sum(float(factor))
    for torch_op, ccl_op in _OPS:
        if kind == torch_op:
            return ccl_op
    raise NotImplementedError(f"cclrs: reduction op {kind} is not supported")


def _tensor(t: torch.Tensor, what: str) -> torch.Tensor:
    """`t` as ccl takes it: a CPU or CUDA tensor (detached: ccl only moves
    its data)."""
    if t.device.type not in ("cpu", "cuda"):
        raise NotImplementedError(f"cclrs: {what} is on {t.device}; ccl moves CPU and CUDA tensors")
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.detach()


def _on(t: torch.Tensor) -> dict:
    """The stream keyword of a call on `t`: for a CUDA tensor, torch's
    current stream of its GPU, on which the call is queued (as NCCL's are
    ordered with it)."""
    if t.device.type == "cuda":
        return {"stream": torch.cuda.current_stream(t.device).cuda_stream}
    return {}


def _settled(t: torch.Tensor) -> None:
    """After copies out of a staging tensor like `t` (on whichever thread
    completes the work): on a GPU, waits for them, so that the work's
    future and `wait` mean the outputs are written."""
    if t.device.type == "cuda":
        torch.cuda.current_stream(t.device).synchronize()


def _one(tensors: List[torch.Tensor], what: str) -> torch.Tensor:
    if len(tensors) != 1:
        raise NotImplementedError(
            f"cclrs: {what} takes one tensor per rank, got {len(tensors)}"
        )
    return tensors[0]


class _Completer:
    """A thread that completes the futures of a backend's works in call
    order, so that DDP's callbacks run as soon as a bucket is reduced.

    It is joined at shutdown and at interpreter exit: a thread still inside
    a future's C++ callbacks when the interpreter exits is ended by CPython
    in a way that aborts the process."""

    running: "weakref.WeakSet[_Completer]" = weakref.WeakSet()

    def __init__(self):
        self._queue: "queue.SimpleQueue[Optional[Work]]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="cclrs-completer", daemon=True)
        self._thread.start()
        _Completer.running.add(self)

    def add(self, work: "Work") -> None:
        self._queue.put(work)

    def stop(self) -> None:
        """Ends the thread once the works before it are settled."""
        self._queue.put(None)
        self._thread.join(timeout=60)

    def _run(self) -> None:
        while True:
            work = self._queue.get()
            if work is None:
                return
            work._complete()


class Work(dist._Work):
    """A torch Work over one or more ccl works, with a future for DDP's comm
    hooks. `finish` runs once the ccl works are done (copies out of a
    staging buffer); the future's value is `result`."""

    def __init__(
        self,
        works: list,
        result,
        backend: "CclBackend",
        finish: Optional[Callable[[], None]] = None,
    ):
        super().__init__()
        self._works = [w for w in works if w is not None]
        self._result = result
        self._finish = finish
        self._backend = backend
        self._lock = threading.Lock()
        self._done = False
        self._error: Optional[BaseException] = None
        self._future: Optional[torch.futures.Future] = None

    def _complete(self) -> None:
        """Waits for the ccl works (once), runs `finish`, settles the future."""
        with self._lock:
            if not self._done:
                try:
                    for w in self._works:
                        w.wait()
                    if self._finish is not None:
                        self._finish()
                except BaseException as e:  # handed to wait() and the future
                    self._error = e
                self._done = True
                self._works = []
            future, self._future = self._future, None
        if future is not None:
            if self._error is not None:
                future.set_exception(self._error)
            else:
                future.set_result(self._result)

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        self._complete()
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        with self._lock:
            return self._done or all(w.is_completed() for w in self._works)

    def is_success(self) -> bool:
        return self._done and self._error is None

    def exception(self):
        return self._error

    def get_future(self) -> torch.futures.Future:
        future = torch.futures.Future()
        with self._lock:
            done = self._done
            if not done:
                self._future = future
        if done:
            if self._error is not None:
                future.set_exception(self._error)
            else:
                future.set_result(self._result)
        else:
            self._backend._completer().add(self)
        return future


def _backend_base() -> type:
    """`c10d.Backend` where torch lets Python construct one; else (torch
    2.11, for one) `ProcessGroup`, which torch then takes as the whole group
    (its Python subclasses' old path): collectives, DDP and send/recv reach
    it all the same."""
    try:
        _C10dBackend(0, 1)
    except TypeError:
        return dist.ProcessGroup
    return _C10dBackend


_BASE = _backend_base()


class CclBackend(_BASE):
    """One torch process group's backend: a ccl communicator over the
    group's store."""

    if _BASE is dist.ProcessGroup:
        # A ProcessGroup with no C++ backend keeps no name (torch reads it
        # from its backends): keep the one torch sets, for DeviceMesh.
        def _set_group_name(self, name: str) -> None:
            self._ccl_group_name = name

        @property
        def group_name(self) -> str:
            return self._ccl_group_name

    def __init__(self, store, rank: int, size: int, timeout: timedelta):
        super().__init__(rank, size)
        seconds = timeout.total_seconds() if timeout else None
        self.comm = Communicator(rank, size, store=store, timeout=seconds or None)
        self._completer_thread: Optional[_Completer] = None
        self._streams: dict = {}
        self._completer_lock = threading.Lock()

    def _completer(self) -> _Completer:
        with self._completer_lock:
            if self._completer_thread is None:
                self._completer_thread = _Completer()
            return self._completer_thread

    def getBackendName(self) -> str:
        return BACKEND_NAME

    @staticmethod
    def _async(opts) -> bool:
        """Whether torch asked for an asynchronous call. A blocking one
        (`dist.all_reduce(t)`) runs on the calling thread, which saves the
        hand-over to ccl's engine thread; DDP's calls stay asynchronous."""
        return getattr(opts, "asyncOp", True)

    def _work(self, works, result, finish=None) -> Work:
        return Work(works, result, self, finish)

    # ---- collectives, in the names torch's dispatcher calls -------------

    def allreduce(self, tensors, opts):
        op = _op(opts.reduceOp)
        works = [
            self.comm.allreduce(_tensor(t, "allreduce"), op=op, async_op=self._async(opts), **_on(t))
            for t in tensors
        ]
        return self._work(works, tensors)

    def allreduce_coalesced(self, tensors, opts):
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors, opts):
        t = _one(tensors, "broadcast")
        work = self.comm.broadcast(_tensor(t, "broadcast"), root=opts.rootRank, async_op=self._async(opts), **_on(t))
        return self._work([work], tensors)

    def reduce(self, tensors, opts):
        t = _one(tensors, "reduce")
        work = self.comm.reduce(
            _tensor(t, "reduce"), op=_op(opts.reduceOp), root=opts.rootRank, async_op=self._async(opts), **_on(t)
        )
        return self._work([work], tensors)

    def all_gather_single(self, output, input, opts):
        work = self.comm.allgather(
            _tensor(input, "all_gather input"), _tensor(output, "all_gather output"), async_op=self._async(opts), **_on(input)
        )
        return self._work([work], [output])

    _allgather_base = all_gather_single

    def allgather(self, output_lists, inputs, opts):
        t = _tensor(_one(inputs, "allgather"), "allgather input")
        outputs = output_lists[0]
        staging = torch.empty((len(outputs),) + tuple(t.shape), dtype=t.dtype, device=t.device)
        work = self.comm.allgather(t.contiguous(), staging, async_op=self._async(opts), **_on(t))

        def finish():
            for out, block in zip(outputs, staging):
                out.copy_(block)
            _settled(staging)

        return self._work([work], output_lists, finish)

    def all_gather_single_coalesced(self, outputs, inputs, opts):
        works = [
            self.comm.allgather(_tensor(i, "input"), _tensor(o, "output"), async_op=self._async(opts), **_on(i))
            for o, i in zip(outputs, inputs)
        ]
        return self._work(works, outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def allgather_coalesced(self, output_lists, inputs, opts):
        works = [self.allgather([outs], [i], opts) for outs, i in zip(output_lists, inputs)]
        return self._work([], output_lists, lambda: [w.wait() for w in works])

    def reduce_scatter_single(self, output, input, opts):
        work = self.comm.reduce_scatter(
            _tensor(input, "reduce_scatter input"),
            _tensor(output, "reduce_scatter output"),
            op=_op(opts.reduceOp),
            async_op=self._async(opts),
            **_on(input),
        )
        return self._work([work], [output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter(self, outputs, input_lists, opts):
        out = _tensor(_one(outputs, "reduce_scatter"), "reduce_scatter output")
        staging = torch.cat([_tensor(t, "reduce_scatter input").reshape(-1) for t in input_lists[0]])
        work = self.comm.reduce_scatter(staging, out, op=_op(opts.reduceOp), async_op=self._async(opts), **_on(out))
        return self._work([work], outputs)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts):
        op = _op(opts.reduceOp)
        works = [
            self.comm.reduce_scatter(_tensor(i, "input"), _tensor(o, "output"), op=op, async_op=self._async(opts), **_on(i))
            for o, i in zip(outputs, inputs)
        ]
        return self._work(works, outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def all_to_all_single(self, output, input, output_splits, input_splits, opts):
        n = self.size()
        for splits, what in ((output_splits, "output"), (input_splits, "input")):
            if splits and len(set(splits)) > 1:
                raise NotImplementedError(
                    f"cclrs: all_to_all_single with uneven {what} splits {list(splits)} "
                    "is not supported (ccl's all-to-all moves equal blocks)"
                )
        if input.numel() % n or output.numel() != input.numel():
            raise ValueError(
                f"cclrs: all_to_all_single needs input and output of equal size, divisible "
                f"by the group size {n} (got {input.numel()} and {output.numel()})"
            )
        work = self.comm.alltoall(
            _tensor(input, "all_to_all input"), _tensor(output, "all_to_all output"), async_op=self._async(opts), **_on(input)
        )
        return self._work([work], [output])

    alltoall_base = all_to_all_single

    def alltoall(self, outputs, inputs, opts):
        sizes = {t.numel() for t in list(outputs) + list(inputs)}
        if len(sizes) > 1:
            raise NotImplementedError(
                "cclrs: all_to_all with tensors of different sizes is not supported"
            )
        staging_in = torch.cat([_tensor(t, "all_to_all input").reshape(-1) for t in inputs])
        staging_out = torch.empty_like(staging_in)
        work = self.comm.alltoall(staging_in, staging_out, async_op=self._async(opts), **_on(staging_in))

        def finish():
            for out, block in zip(outputs, staging_out.chunk(len(outputs))):
                out.copy_(block.view_as(out))
            _settled(staging_out)

        return self._work([work], outputs, finish)

    def gather(self, output_lists, inputs, opts):
        t = _tensor(_one(inputs, "gather"), "gather input")
        root = opts.rootRank
        if self.rank() != root:
            work = self.comm.gather(t.contiguous(), None, root=root, async_op=self._async(opts), **_on(t))
            return self._work([work], output_lists)
        outputs = output_lists[0]
        staging = torch.empty((len(outputs),) + tuple(t.shape), dtype=t.dtype, device=t.device)
        work = self.comm.gather(t.contiguous(), staging, root=root, async_op=self._async(opts), **_on(t))

        def finish():
            for out, block in zip(outputs, staging):
                out.copy_(block)
            _settled(staging)

        return self._work([work], output_lists, finish)

    def scatter(self, outputs, input_lists, opts):
        out = _tensor(_one(outputs, "scatter"), "scatter output")
        root = opts.rootRank
        staging = None
        if self.rank() == root:
            staging = torch.cat([_tensor(t, "scatter input").reshape(-1) for t in input_lists[0]])
        work = self.comm.scatter(staging, out, root=root, async_op=self._async(opts), **_on(out))
        return self._work([work], outputs)

    def barrier(self, opts):
        return self._work([self.comm.barrier(async_op=self._async(opts))], [])

    def send(self, tensors, dst: int, tag: int):
        if tag != 0:
            raise NotImplementedError(
                "cclrs: send/recv tags are not supported (messages between two ranks match in "
                "order); use tag 0"
            )
        t = _one(tensors, "send")
        return self._work([self._transfer(_tensor(t, "send"), dst, True)], tensors)

    def recv(self, tensors, src: int, tag: int):
        if tag != 0:
            raise NotImplementedError("cclrs: send/recv tags are not supported; use tag 0")
        t = _one(tensors, "recv")
        return self._work([self._transfer(_tensor(t, "recv"), src, False)], tensors)

    def _transfer(self, t: torch.Tensor, peer: int, send: bool):
        """Starts a send or receive of `t`. On a GPU it runs on a stream of
        its own per peer and direction (which first waits for the current
        stream), so that a rank's sends and receives do not wait for each
        other as they would on one stream."""
        call = self.comm.send if send else self.comm.recv
        if t.device.type != "cuda":
            return call(t, peer, async_op=True)
        key = (t.device.index, peer, send)
        side = self._streams.get(key)
        if side is None:
            side = self._streams[key] = torch.cuda.Stream(t.device)
        side.wait_stream(torch.cuda.current_stream(t.device))
        t.record_stream(side)
        return call(t, peer, async_op=True, stream=side.cuda_stream)

    def recv_anysource(self, tensors, tag: int):
        raise NotImplementedError("cclrs: recv from any source is not supported")

    def abort(self):
        self.comm.abort()

    def shutdown(self):
        if self._completer_thread is not None:
            self._completer_thread.stop()
        self.comm.close()


def _create(store, rank: int, size: int, timeout: timedelta) -> CclBackend:
    return CclBackend(store, rank, size, timeout)


@atexit.register
def _stop_completers() -> None:
    for completer in list(_Completer.running):
        completer.stop()


def _register() -> None:
    if BACKEND_NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND_NAME, _create, devices=["cpu", "cuda"])


_register()
