"""torch.distributed.all_reduce of CUDA tensors, every rank on one GPU (the
comparison issue 20 asks for): nccl-tests-style time and busbw per size,
after a check of all_reduce, all_gather, broadcast and a send/recv ring on
CUDA tensors.

    NCCL_MULTI_RANK_GPU_ENABLE=1 torchrun --nproc-per-node 2 torch_cuda_allreduce.py --backend nccl
    torchrun --nproc-per-node 2 torch_cuda_allreduce.py --backend cclrs   # ccl's backend (ccl.torch)

Every rank uses cuda:0 (NCCL before 2.30, or without the variable, refuses
that with "Duplicate GPU detected": the error is printed as the result).
A size's time is the slowest rank's mean over `--iters` calls, after the
stream is synchronized.
"""

import argparse
import time

import torch
import torch.distributed as dist


def size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("B")
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def check(rank: int, n: int, backend: str) -> None:
    """Results of a few calls on CUDA tensors, against what they must be
    (gloo's all_reduce and broadcast only: it sends no CUDA tensors)."""
    dev = torch.device("cuda:0")
    x = torch.full((1000,), float(rank + 1), device=dev)
    dist.all_reduce(x)
    assert torch.all(x == n * (n + 1) / 2), f"all_reduce: {x[:4]}"
    b = torch.arange(1000, device=dev, dtype=torch.float32) if rank == 0 else torch.zeros(1000, device=dev)
    dist.broadcast(b, src=0)
    assert torch.equal(b, torch.arange(1000, device=dev, dtype=torch.float32)), "broadcast"
    if backend == "gloo":
        torch.cuda.synchronize()
        if rank == 0:
            print("# check: all_reduce, broadcast on CUDA tensors: ok", flush=True)
        return
    every = torch.empty(1000 * n, device=dev)
    dist.all_gather_into_tensor(every, torch.full((1000,), float(rank), device=dev))
    assert torch.equal(every, torch.arange(n, device=dev).repeat_interleave(1000).float()), "all_gather"
    if n > 1:
        got = torch.zeros(1000, device=dev)
        ops = [
            dist.P2POp(dist.isend, torch.full((1000,), float(rank), device=dev), (rank + 1) % n),
            dist.P2POp(dist.irecv, got, (rank + n - 1) % n),
        ]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        torch.cuda.synchronize()
        assert torch.all(got == (rank + n - 1) % n), f"send/recv ring: {got[:4]}"
    torch.cuda.synchronize()
    if rank == 0:
        print("# check: all_reduce, all_gather, broadcast, send/recv ring on CUDA tensors: ok", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=["nccl", "gloo", "cclrs"], required=True)
    p.add_argument("--sizes", default="8,1M,256M")
    p.add_argument("--iters", type=int, default=0, help="calls per size (0: by size)")
    args = p.parse_args()
    torch.cuda.set_device(0)
    if args.backend == "cclrs":
        import ccl.torch  # noqa: F401  (registers the backend)
    dist.init_process_group(args.backend, device_id=torch.device("cuda:0") if args.backend == "nccl" else None)
    rank, n = dist.get_rank(), dist.get_world_size()
    check(rank, n, args.backend)
    if rank == 0:
        print(f"# {args.backend}, torch {torch.__version__}, {n} ranks on {torch.cuda.get_device_name(0)}, f32 sum")
        print(f"# {'size (B)':>12} {'time us':>10} {'busbw GB/s':>11}")
    for nbytes in [size(s) for s in args.sizes.split(",")]:
        t = torch.ones(max(nbytes // 4, 1), dtype=torch.float32, device="cuda:0")
        iters = args.iters or max(5, min(1000, (256 << 20) // max(nbytes, 1) * 4))
        for _ in range(max(2, iters // 10)):
            dist.all_reduce(t)
        torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(t)
        torch.cuda.synchronize()
        mean = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64, device="cuda:0")
        dist.all_reduce(mean, op=dist.ReduceOp.MAX)
        if rank == 0:
            secs = mean.item()
            busbw = t.numel() * 4 / secs * 2 * (n - 1) / n / 1e9
            print(f"  {t.numel() * 4:>12} {secs * 1e6:>10.1f} {busbw:>11.2f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except Exception as e:  # the result when the backend refuses (Duplicate GPU detected)
        print(f"torch_cuda_allreduce: {type(e).__name__}: {e}", flush=True)
        raise
