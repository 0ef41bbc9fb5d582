"""Collectives on arrays made of ccl.SharedBuffer, through numpy, torch
(ccl.Communicator) or torch.distributed with the cclrs backend (argv[1]):
allgather, all-to-all, broadcast, allreduce and reduce-scatter on blocks of
1 Mi int64 (8 MiB, copied or reduced directly by the peers), checked
against numpy."""

import sys

import numpy as np

import ccl

api = sys.argv[1]
if api == "torchdist":
    import torch
    import torch.distributed as dist

    import ccl.torch  # noqa: F401

    dist.init_process_group("cclrs")
    n, rank = dist.get_world_size(), dist.get_rank()

    class Calls:
        """The calls below, through torch.distributed."""

        def allgather(self, mine, out):
            dist.all_gather_into_tensor(out, mine)

        def alltoall(self, send, out):
            dist.all_to_all_single(out, send)

        def allreduce(self, send, out):
            # In place, as torch has it.
            dist.all_reduce(send)
            out.copy_(send)

        def reduce_scatter(self, send, out):
            dist.reduce_scatter_tensor(out, send)

        def broadcast(self, buf, root):
            dist.broadcast(buf, root)

    comm = Calls()
else:
    comm = ccl.Communicator()
    n, rank = comm.world_size, comm.rank
block = 1 << 20
wrong = 0


def shared(count):
    """An array of `count` int64 in a new shared buffer."""
    buf = ccl.SharedBuffer(count, "int64")
    if api in ("torch", "torchdist"):
        import torch

        return torch.from_dlpack(buf)
    return np.from_dlpack(buf)


def host(a):
    return a.numpy() if api in ("torch", "torchdist") else a


def check(name, got, want):
    global wrong
    bad = int(np.count_nonzero(host(got) != want))
    if bad:
        print(f"rank {rank}: {name}: {bad} wrong", flush=True)
    wrong += bad


def values(r, count, salt):
    return salt * 10**9 + r * 10**7 + np.arange(count, dtype=np.int64)


for salt in (1, 2):
    mine, out = shared(block), shared(n * block)
    host(mine)[:] = values(rank, block, salt)
    comm.allgather(mine, out)
    check("allgather", out, np.concatenate([values(r, block, salt) for r in range(n)]))

    send, out = shared(n * block), shared(n * block)
    host(send)[:] = values(rank, n * block, salt)
    comm.alltoall(send, out)
    want = np.concatenate([values(r, n * block, salt)[rank * block:(rank + 1) * block] for r in range(n)])
    check("alltoall", out, want)

    send, out = shared(block), shared(block)
    host(send)[:] = values(rank, block, salt)
    comm.allreduce(send, out)
    check("allreduce", out, sum(values(r, block, salt) for r in range(n)))

    send, out = shared(n * block), shared(block)
    host(send)[:] = values(rank, n * block, salt)
    comm.reduce_scatter(send, out)
    want = sum(values(r, n * block, salt) for r in range(n))[rank * block:(rank + 1) * block]
    check("reduce_scatter", out, want)

    root = salt % n
    buf = shared(block)
    if rank == root:
        host(buf)[:] = values(root, block, salt)
    comm.broadcast(buf, root)
    check("broadcast", buf, values(root, block, salt))

assert isinstance(ccl.SharedBuffer(3), ccl.SharedBuffer) and len(ccl.SharedBuffer(3)) == 3
for bad in (0, -1):
    try:
        ccl.SharedBuffer(bad)
    except (ValueError, OverflowError):
        pass
    else:
        raise AssertionError(f"SharedBuffer({bad}) was accepted")
print(f"rank {rank}: {api}: shared buffers checked, {wrong} wrong", flush=True)
