"""torch.distributed.all_reduce through cclrs and gloo in one job,
interleaved so that machine noise hits both alike; nccl-tests-style busbw.

    torchrun --nproc-per-node 2 python/bench/torch_allreduce.py --sizes 8,256M

Both backends run in the same processes (gloo as the default group, cclrs
as a second group over the same ranks). For each size, rounds alternate
between them; a round is `--iters` calls after `--warmup`, timed on every
rank, and the slowest rank's mean counts. The median round is reported.
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import ccl.torch  # noqa: F401


def size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("B")
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def round_time(t: torch.Tensor, group, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        dist.all_reduce(t, group=group)
    dist.barrier(group=group)
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(t, group=group)
    mean = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64)
    dist.all_reduce(mean, op=dist.ReduceOp.MAX, group=group)
    return mean.item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="8,1K,64K,1M,16M,256M")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=0, help="calls per round (0: by size)")
    args = p.parse_args()

    dist.init_process_group("gloo")
    n = dist.get_world_size()
    groups = {"gloo": dist.group.WORLD, "cclrs": dist.new_group(backend="cclrs")}
    if dist.get_rank() == 0:
        print(f"# torch {torch.__version__}, {n} ranks, f32 sum; time = median over {args.rounds} rounds "
              f"of the slowest rank's mean; busbw = size/time x 2(n-1)/n")
        print(f"# {'size (B)':>12} {'gloo us':>10} {'gloo busbw':>11} {'cclrs us':>10} {'cclrs busbw':>12} {'speed-up':>9}")
    for nbytes in [size(s) for s in args.sizes.split(",")]:
        t = torch.ones(max(nbytes // 4, 1), dtype=torch.float32)
        iters = args.iters or max(2, min(2000, (64 << 20) // max(nbytes, 1)))
        times = {name: [] for name in groups}
        for _ in range(args.rounds):
            for name, group in groups.items():
                times[name].append(round_time(t, group, iters, max(1, iters // 10)))
        if dist.get_rank() == 0:
            med = {name: statistics.median(v) for name, v in times.items()}
            bus = {name: t.numel() * 4 / med[name] * 2 * (n - 1) / n / 1e9 for name in med}
            print(f"  {t.numel() * 4:>12} {med['gloo'] * 1e6:>10.1f} {bus['gloo']:>10.3f}G "
                  f"{med['cclrs'] * 1e6:>10.1f} {bus['cclrs']:>11.3f}G {med['gloo'] / med['cclrs']:>8.2f}x", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
