"""Training helpers in the shape of Lux.jl's DistributedUtils.

    comm = ccl.Communicator()
    synchronize(model, comm)                     # parameters from rank 0 to all
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm)
    data = DistributedDataContainer(dataset, comm, shuffle=True, seed=0)
    for epoch in range(epochs):
        data.set_epoch(epoch)
        for i in range(len(data)): ...          # this rank's share
        opt.step()                               # averages gradients, then steps

Arrays are numpy arrays or torch CPU tensors (anything ccl takes). Many
small arrays are fused into buffers of `bucket_bytes` per call, as DDP's
buckets are, so that a model of a thousand tensors costs a few calls.
"""

import random
from typing import Any, Iterable, List, Optional, Sequence

from . import Communicator, ReduceOp

#: Bytes fused into one call by `synchronize` and `average_gradients`.
DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024


def local_rank(comm: Communicator) -> int:
    """This worker's index in `range(total_workers(comm))`: Lux's
    `local_rank`, the rank in the communicator (not the index among the
    ranks of one host, torch's LOCAL_RANK: that is `comm.host_rank`)."""
    return comm.rank


def total_workers(comm: Communicator) -> int:
    """The number of ranks of `comm`."""
    return comm.world_size


def _arrays(obj: Any) -> List[Any]:
    """The arrays in `obj`: an array, a (nested) list, tuple or dict of
    arrays, a torch module (parameters and buffers) or a torch optimizer
    (its state's tensors), in a fixed order."""
    if hasattr(obj, "named_parameters") and hasattr(obj, "named_buffers"):
        return [p.data for _, p in obj.named_parameters()] + [b.data for _, b in obj.named_buffers()]
    if hasattr(obj, "state_dict") and hasattr(obj, "param_groups"):
        state = obj.state_dict()["state"]
        return [t for k in sorted(state) for _, t in sorted(state[k].items()) if _is_array(t)]
    if isinstance(obj, dict):
        return [a for k in sorted(obj) for a in _arrays(obj[k])]
    if isinstance(obj, (list, tuple)):
        return [a for item in obj for a in _arrays(item)]
    if _is_array(obj):
        return [obj]
    raise TypeError(f"{type(obj).__name__} holds no arrays ccl can synchronize")


def _is_array(obj: Any) -> bool:
    return hasattr(obj, "__dlpack__") and getattr(obj, "ndim", None) is not None and obj.ndim > 0


def _numel(a: Any) -> int:
    return int(a.numel()) if hasattr(a, "numel") and callable(a.numel) else int(a.size)


def _buckets(arrays: Sequence[Any], bucket_bytes: int) -> Iterable[List[Any]]:
    """Consecutive arrays of one element type and kind, up to `bucket_bytes`."""
    bucket: List[Any] = []
    size = 0
    for a in arrays:
        nbytes = _numel(a) * a.itemsize if hasattr(a, "itemsize") else a.nbytes
        if bucket and (size + nbytes > bucket_bytes or type(a) is not type(bucket[0]) or a.dtype != bucket[0].dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append(a)
        size += nbytes
    if bucket:
        yield bucket


def _flat(bucket: List[Any]):
    """One contiguous buffer holding the bucket's arrays, and a function
    that copies a buffer's values back into them."""
    first = bucket[0]
    if hasattr(first, "flatten") and hasattr(first, "new_empty"):  # torch
        import torch

        flat = torch.cat([t.reshape(-1) for t in bucket])

        def unflatten(buf):
            offset = 0
            for t in bucket:
                n = t.numel()
                t.copy_(buf[offset : offset + n].view_as(t))
                offset += n

        return flat, unflatten
    import numpy as np

    flat = np.concatenate([np.ascontiguousarray(a).reshape(-1) for a in bucket])

    def unflatten(buf):
        offset = 0
        for a in bucket:
            n = a.size
            a[...] = buf[offset : offset + n].reshape(a.shape)
            offset += n

    return flat, unflatten


def _fused(arrays: Sequence[Any], call, bucket_bytes: int) -> None:
    """Runs `call(buffer)` (started, returns a ccl.Work) on fused buckets of
    `arrays`, then copies the results back."""
    started = []
    for bucket in _buckets(arrays, bucket_bytes):
        if len(bucket) == 1 and _contiguous(bucket[0]):
            started.append((call(bucket[0]), None, None))
        else:
            flat, unflatten = _flat(bucket)
            started.append((call(flat), flat, unflatten))
    for work, flat, unflatten in started:
        work.wait()
        if unflatten is not None:
            unflatten(flat)


def _contiguous(a: Any) -> bool:
    if hasattr(a, "is_contiguous"):
        return a.is_contiguous()
    return bool(a.flags["C_CONTIGUOUS"]) and bool(a.flags["WRITEABLE"])


def synchronize(obj: Any, comm: Communicator, root: int = 0, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Any:
    """Copies the arrays of `obj` (see `_arrays`: a model, an optimizer,
    arrays) from rank `root` to every rank, in place, and returns `obj`.
    Every rank passes arrays of the same shapes and types."""
    arrays = _arrays(obj)
    _fused(arrays, lambda buf: comm.broadcast(buf, root, async_op=True), bucket_bytes)
    return obj


def average_gradients(grads: Sequence[Any], comm: Communicator, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
    """Replaces each array of `grads` by its mean over the ranks."""
    _fused(list(grads), lambda buf: comm.allreduce(buf, op=ReduceOp.AVG, async_op=True), bucket_bytes)


class DistributedOptimizer:
    """Wraps a torch optimizer: `step()` first averages the gradients of its
    parameters across the ranks of `comm` (fused), then steps. Everything
    else (`zero_grad`, `param_groups`, `state_dict`, ...) is the wrapped
    optimizer's."""

    def __init__(self, optimizer: Any, comm: Communicator, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self.optimizer = optimizer
        self.comm = comm
        self.bucket_bytes = bucket_bytes

    def step(self, closure=None):
        grads = [p.grad for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
        average_gradients(grads, self.comm, self.bucket_bytes)
        return self.optimizer.step(closure) if closure is not None else self.optimizer.step()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)


class DistributedDataContainer:
    """This rank's share of `data` (anything with `len` and indexing), as
    torch's DistributedSampler deals it: rank r takes items r, r+n, r+2n, ...
    of the (optionally shuffled) order, padded by repeating the first items
    so that every rank has as many (or, with `drop_last`, cut to that).
    The shuffle depends on `seed` and the epoch (`set_epoch`) only, so that
    every rank computes the same order."""

    def __init__(
        self,
        data: Any,
        comm: Optional[Communicator] = None,
        *,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
    ):
        self.data = data
        self.rank = comm.rank if comm is not None else rank
        self.world_size = comm.world_size if comm is not None else world_size
        if self.rank is None or self.world_size is None:
            raise ValueError("give a communicator, or rank and world_size")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not below world_size {self.world_size}")
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0
        self._dealt: Optional[tuple] = None  # (epoch, indices)

    def set_epoch(self, epoch: int) -> None:
        """Shuffles differently in each epoch (the same on every rank)."""
        self.epoch = epoch

    @property
    def indices(self) -> List[int]:
        """The indices into `data` of this rank's items, in order."""
        if self._dealt is None or self._dealt[0] != self.epoch:
            self._dealt = (self.epoch, self._deal())
        return self._dealt[1]

    def _deal(self) -> List[int]:
        total = len(self.data)
        order = list(range(total))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        n = self.world_size
        if self.drop_last:
            order = order[: total - total % n]
        elif total % n and total:
            pad = n - total % n
            order += (order * (pad // total + 1))[:pad]
        return order[self.rank :: n]

    def __len__(self) -> int:
        total, n = len(self.data), self.world_size
        return total // n if self.drop_last else -(-total // n)

    def __getitem__(self, i: int) -> Any:
        return self.data[self.indices[i]]

    def __iter__(self):
        for i in self.indices:
            yield self.data[i]
