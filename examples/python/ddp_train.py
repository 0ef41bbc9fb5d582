"""Data-parallel training with torch DDP on a synthetic regression task.

    torchrun --nproc-per-node 2 examples/python/ddp_train.py --backend cclrs
    torchrun --nproc-per-node 2 examples/python/ddp_train.py --backend gloo

Every rank builds the same data set from a seed (no downloads) and trains on
its share (DistributedSampler); DDP averages the gradients through the
backend. Rank 0 prints the loss of each step (averaged over the ranks);
every rank prints a digest of its final parameters, which must agree.
`--json FILE` writes the losses and timings (rank 0).
"""

import argparse
import hashlib
import json
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def mlp(width: int, hidden: int, layers: int) -> nn.Module:
    dims = [width] + [hidden] * layers
    blocks = []
    for a, b in zip(dims, dims[1:]):
        blocks += [nn.Linear(a, b), nn.GELU()]
    return nn.Sequential(*blocks, nn.Linear(dims[-1], 1))


def synthetic(samples: int, width: int, seed: int) -> TensorDataset:
    """Inputs and the outputs of a fixed random teacher, plus noise."""
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(samples, width, generator=g)
    teacher = torch.randn(width, 1, generator=g) / width**0.5
    y = torch.tanh(x @ teacher) + 0.01 * torch.randn(samples, 1, generator=g)
    return TensorDataset(x, y)


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="cclrs", help="cclrs, gloo, ...")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=32, help="samples per rank and step")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write losses and timings here (rank 0)")
    args = p.parse_args()

    if args.backend == "cclrs":
        import ccl.torch  # noqa: F401  (registers the backend)
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(args.seed)
    model = DDP(mlp(args.width, args.hidden, args.layers))
    params = sum(p.numel() for p in model.parameters())
    data = synthetic(args.batch * world * args.steps, args.width, args.seed)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.MSELoss()

    losses, step_times, backward_times = [], [], []
    sampler.set_epoch(0)
    for step, (x, y) in enumerate(loader):
        start = time.perf_counter()
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        t_backward = time.perf_counter()
        loss.backward()  # DDP's allreduce of gradient buckets overlaps this
        backward_times.append(time.perf_counter() - t_backward)
        opt.step()
        step_times.append(time.perf_counter() - start)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        mean /= world
        losses.append(mean.item())
        if rank == 0:
            print(f"step {step:3d} loss {losses[-1]:.8f}", flush=True)

    # The backward pass alone, without communication (DDP's no_sync), to
    # tell how much of the synchronised backward was spent waiting on it.
    compute_only = []
    x, y = data[: args.batch]
    for _ in range(max(3, len(backward_times) // 2)):
        with model.no_sync():
            loss = loss_fn(model(x), y)
            t = time.perf_counter()
            loss.backward()
            compute_only.append(time.perf_counter() - t)
    opt.zero_grad()

    print(f"rank {rank} params {digest(model.module)}", flush=True)
    if rank == 0:
        warm = step_times[2:] or step_times
        bwd = sorted(backward_times[2:] or backward_times)
        summary = {
            "backend": args.backend,
            "world_size": world,
            "parameters": params,
            "losses": losses,
            "step_ms_median": 1e3 * sorted(warm)[len(warm) // 2],
            "backward_ms_median": 1e3 * bwd[len(bwd) // 2],
            "backward_no_comm_ms_median": 1e3 * sorted(compute_only)[len(compute_only) // 2],
        }
        summary["comm_wait_ms"] = summary["backward_ms_median"] - summary["backward_no_comm_ms_median"]
        print(
            f"# {args.backend}: {world} ranks, {params} parameters, step {summary['step_ms_median']:.1f} ms, "
            f"backward {summary['backward_ms_median']:.1f} ms of which waiting on communication "
            f"{summary['comm_wait_ms']:.1f} ms",
            flush=True,
        )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
