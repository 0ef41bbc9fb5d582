"""Fully sharded data-parallel training (FSDP2, `fully_shard`) on CPU.

    torchrun --nproc-per-node 2 examples/python/fsdp_train.py --backend cclrs

Each rank keeps only its shard of every layer's parameters: FSDP2 gathers a
layer's parameters before it runs (all-gather) and reduce-scatters its
gradients (average) after backward, through the backend's
`all_gather_single` and `reduce_scatter_single`. Rank 0 prints the loss of
each step; every rank prints a digest of the full final parameters.
"""

import argparse
import hashlib

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="cclrs")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    if args.backend == "cclrs":
        import ccl.torch  # noqa: F401  (registers the backend)
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))

    torch.manual_seed(args.seed)
    layers = [nn.Linear(args.width, args.hidden), nn.Linear(args.hidden, args.hidden), nn.Linear(args.hidden, 1)]
    model = nn.Sequential(layers[0], nn.ReLU(), layers[1], nn.ReLU(), layers[2])
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    g = torch.Generator().manual_seed(args.seed + 1 + rank)  # each rank its own data
    for step in range(args.steps):
        x = torch.randn(args.batch, args.width, generator=g)
        y = x.sum(dim=1, keepdim=True).sin()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if rank == 0:
            print(f"step {step:3d} loss {mean.item() / world:.8f}", flush=True)

    h = hashlib.sha256()
    for param in model.parameters():
        h.update(param.full_tensor().detach().contiguous().numpy().tobytes())  # all-gathers the shards
    print(f"rank {rank} params {h.hexdigest()[:16]}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
