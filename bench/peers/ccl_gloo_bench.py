"""ccl_gloo_bench: the Gloo side of `ccl-bench compare` (torch.distributed).

Times torch.distributed's collectives on the gloo backend over the same sizes
as ccl-bench and prints the same nccl-tests-style table as
bench/mpi/ccl_mpi_bench.c, with the same flags and conventions (size = whole
buffer, n x per-rank part for allgather, reduce-scatter and alltoall, rounded
down to whole elements per rank, at least one; time = the slowest rank's time
for the whole loop of iterations, over the iterations; GB/s = 1e9 B/s;
nccl-tests' busbw factors; -v adds the median, fastest and slowest iteration):

    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 \
        python ccl_gloo_bench.py allreduce -b 8 -e 268435456 -f 2 -n 20 -w 5 -d f32 -o sum -v

Each process is one rank, joined through torch's env:// rendezvous (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT; torchrun sets them too). Gloo moves
data over TCP only (it has no shared-memory transport on CPU).
"""

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist

DTYPES = {
    "i8": torch.int8,
    "u8": torch.uint8,
    "i32": torch.int32,
    "i64": torch.int64,
    "f32": torch.float32,
    "f64": torch.float64,
}
OPS = {
    "sum": dist.ReduceOp.SUM,
    "prod": dist.ReduceOp.PRODUCT,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
}
SPLIT = ("allgather", "reduce-scatter", "alltoall")
HAS_OP = ("allreduce", "reduce", "reduce-scatter")
HAS_ROOT = ("broadcast", "reduce")
COLLS = ("allreduce", "broadcast", "reduce", "allgather", "reduce-scatter", "alltoall", "barrier")


def bus_factor(coll: str, n: int) -> float:
    if coll == "allreduce":
        return 2 * (n - 1) / n
    if coll in SPLIT:
        return (n - 1) / n
    return 1.0


def run_once(coll, inp, out, op, root):
    # torch's all_reduce and reduce work in place only: they are timed as
    # they are (no copy added), whatever -i says.
    if coll == "allreduce":
        dist.all_reduce(out, op=op)
    elif coll == "broadcast":
        dist.broadcast(out, src=root)
    elif coll == "reduce":
        dist.reduce(out, dst=root, op=op)
    elif coll == "allgather":
        dist.all_gather_into_tensor(out, inp)
    elif coll == "reduce-scatter":
        dist.reduce_scatter_tensor(out, inp, op=op)
    elif coll == "alltoall":
        dist.all_to_all_single(out, inp)
    elif coll == "barrier":
        dist.barrier()


def positive_bytes(text: str) -> int:
    v = int(text)
    if v <= 0:
        raise argparse.ArgumentTypeError("expected a positive number of bytes")
    return v


def main() -> int:
    p = argparse.ArgumentParser(prog="ccl_gloo_bench", description=__doc__.splitlines()[0])
    p.add_argument("coll", choices=COLLS)
    p.add_argument("-b", type=positive_bytes, default=8)
    p.add_argument("-e", type=positive_bytes, default=8)
    p.add_argument("-f", type=float, default=2.0)
    p.add_argument("-n", type=int, default=20)
    p.add_argument("-w", type=int, default=5)
    p.add_argument("-d", choices=sorted(DTYPES), default="f32")
    p.add_argument("-o", choices=sorted(OPS), default="sum")
    p.add_argument("-r", type=int, default=0)
    p.add_argument("-i", action="store_true", help="in-place forms (allreduce, reduce and broadcast always are)")
    p.add_argument("-v", action="store_true", help="median, fastest and slowest iteration")
    a = p.parse_args()
    if a.e < a.b or a.f <= 1 or a.n < 1:
        p.error("need MAX >= MIN, FACTOR > 1 and ITERS >= 1")
    one_buffer = ("allreduce", "reduce", "broadcast")  # torch's forms of these take one tensor
    if a.i and a.coll not in one_buffer:
        p.error("-i: only allreduce, reduce and broadcast have an in-place form here")
    inplace = a.i or a.coll in one_buffer

    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    if not 0 <= a.r < n:
        p.error("root is not below the number of ranks")
    dt = DTYPES[a.d]
    es = torch.tensor([], dtype=dt).element_size()
    op = OPS[a.o]
    coll = a.coll
    if rank == 0:
        print(
            f"# ccl_gloo_bench {coll}: {n} ranks, dtype {a.d}, op {a.o if coll in HAS_OP else 'none'}, "
            f"root {a.r}, {'in-place' if inplace else 'out-of-place'}, iters {a.n}, warmup {a.w}"
        )
        print(f"# library: torch {torch.__version__} gloo")
        print(
            f"#\n# {'size':>12} {'count':>12} {'type':>6} {'redop':>6} {'root':>5} {'algo':>10} "
            f"{'time':>12} {'algbw':>8} {'busbw':>8} {'#wrong':>7}"
        )
        print(f"# {'(B)':>12} {'(elements)':>12} {'':>6} {'':>6} {'':>5} {'':>10} {'(us)':>12} {'(GB/s)':>8} {'(GB/s)':>8}")
        sys.stdout.flush()

    bw_sum, bw_peak, rows, last = 0.0, 0.0, 0, 0
    s = float(a.b)
    if coll == "barrier":
        s = float(a.e)
    while s <= a.e * 1.0000001:
        count = 0
        nbytes = 0
        if coll != "barrier":
            count = int(s) // es
            if coll in SPLIT:
                count //= n
            count = max(count, 1)
            nbytes = count * es * (n if coll in SPLIT else 1)
        s *= a.f
        if coll != "barrier" and nbytes == last:
            continue
        last = nbytes
        in_elems = n * count if coll in ("reduce-scatter", "alltoall") else count
        out_elems = n * count if coll in ("allgather", "alltoall") else count
        g = torch.Generator().manual_seed(rank)
        inp = torch.randint(1, 6, (max(in_elems, 1),), generator=g).to(dt)
        out = torch.randint(1, 6, (max(out_elems, 1),), generator=g).to(dt)
        for _ in range(a.w):
            run_once(coll, inp, out, op, a.r)
        dist.barrier()
        times = [0.0] * a.n
        start = last = time.perf_counter()
        for it in range(a.n):
            run_once(coll, inp, out, op, a.r)
            now = time.perf_counter()
            times[it] = now - last
            last = now
        slowest = torch.tensor(times + [(last - start) / a.n], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        if rank == 0:
            t = slowest[-1].item()
            algbw = nbytes / 1e9 / t if t > 0 else 0.0
            busbw = algbw * bus_factor(coll, n)
            bw_sum += busbw
            bw_peak = max(bw_peak, busbw)
            rows += 1
            print(
                f"  {nbytes:>12} {nbytes // es:>12} {a.d:>6} {a.o if coll in HAS_OP else 'none':>6} "
                f"{a.r if coll in HAS_ROOT else -1:>5} {'gloo':>10} {t * 1e6:>12.3f} {algbw:>8.3f} {busbw:>8.3f} {'N/A':>7}"
            )
            if a.v:
                v = slowest[:-1].tolist()
                print(
                    f"#  per iteration (slowest rank): median {statistics.median(v) * 1e6:.2f} us, "
                    f"min {min(v) * 1e6:.2f} us, max {max(v) * 1e6:.2f} us"
                )
            sys.stdout.flush()
        if coll == "barrier":
            break
    if rank == 0:
        print(f"# Avg bus bandwidth    : {bw_sum / rows if rows else 0.0:.3f} GB/s")
        print(f"# Peak bus bandwidth   : {bw_peak:.3f} GB/s")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
