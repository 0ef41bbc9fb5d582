"""init_process_group("cclrs") with the init method in argv[1] (env://,
tcp://host:port, file:///path), then a few collectives, a subgroup and an
async allreduce with a future."""

import os
import sys

import torch
import torch.distributed as dist

import ccl.torch  # noqa: F401

method = sys.argv[1]
rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
if method == "env://":
    dist.init_process_group("cclrs", init_method=method)
else:
    dist.init_process_group("cclrs", init_method=method, rank=rank, world_size=n)
assert dist.get_backend() == "cclrs", dist.get_backend()
t = torch.full((5,), float(rank + 1))
dist.all_reduce(t)
assert t.tolist() == [n * (n + 1) / 2] * 5, t
work = dist.all_reduce(torch.ones(3), op=dist.ReduceOp.AVG, async_op=True)
value = work.get_future().wait()
assert value[0].tolist() == [1.0, 1.0, 1.0], value
evens = dist.new_group([r for r in range(n) if r % 2 == 0])
if rank % 2 == 0:
    s = torch.ones(1)
    dist.all_reduce(s, group=evens)
    assert s.item() == (n + 1) // 2, s
dist.barrier()
dist.destroy_process_group()
print(f"rank {rank} ok", flush=True)
