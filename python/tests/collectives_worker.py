"""Every collective, element type and op on one rank of a job, checked
against values computed with numpy. `api`: `numpy` (ccl.Communicator on
numpy arrays), `torch` (ccl.Communicator on torch tensors) or `torchdist`
(torch.distributed with the cclrs backend). Prints each failure and exits 1
if there was one."""

import sys

import numpy as np

import ccl

api = sys.argv[1]
failures = []
checked = 0

NUMPY_TYPES = ["int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "float32", "float64"]
BITWISE = ["band", "bor", "bxor"]
OPS = ["sum", "prod", "min", "max", "avg", "premulsum"] + BITWISE

if api == "numpy":
    comm = ccl.Communicator()
    rank, n = comm.rank, comm.world_size
    types = NUMPY_TYPES

    def arr(values, dtype):
        return np.ascontiguousarray(values, dtype=dtype)

    def host(a):
        return np.asarray(a)
else:
    import torch

    TORCH = {
        "int8": torch.int8, "uint8": torch.uint8, "int32": torch.int32, "int64": torch.int64,
        "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
        "float64": torch.float64,
    }
    types = list(TORCH)
    if api == "torchdist":
        import torch.distributed as dist

        import ccl.torch  # noqa: F401

        dist.init_process_group("cclrs")
        rank, n = dist.get_rank(), dist.get_world_size()
        comm = None
    else:
        comm = ccl.Communicator()
        rank, n = comm.rank, comm.world_size

    def arr(values, dtype):
        return torch.tensor(np.asarray(values, dtype=np.float64), dtype=TORCH[dtype])

    def host(a):
        if isinstance(a, np.ndarray):
            return a
        return a.to(torch.float64).numpy() if a.dtype == torch.bfloat16 else a.numpy()


def is_float(dtype):
    return dtype.startswith("float") or dtype == "bfloat16"


def inputs(op, count, r):
    """Small integers, so that every type holds every result exactly."""
    i = np.arange(count)
    if op == "prod":
        return 1 + (i + r) % 2
    if op in ("min", "max"):
        return (i * 5 + r * 3) % 11
    if op in BITWISE:
        return (i * 7 + r * 13) % 100
    if op == "premulsum":
        return (i + r) % 3
    return (i + 2 * r) % 7


def expected_reduce(op, count, dtype):
    rows = [inputs(op, count, r).astype(np.float64) for r in range(n)]
    if op == "sum":
        return sum(rows)
    if op == "prod":
        return np.prod(rows, axis=0)
    if op == "min":
        return np.min(rows, axis=0)
    if op == "max":
        return np.max(rows, axis=0)
    if op == "avg":
        s = sum(rows)
        return s / n if is_float(dtype) else np.floor(s / n)
    if op == "premulsum":
        return sum((r + 1) * rows[r] for r in range(n))
    ints = [row.astype(np.int64) for row in rows]
    f = {"band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}[op]
    out = ints[0]
    for row in ints[1:]:
        out = f(out, row)
    return out.astype(np.float64)


def tolerance(dtype):
    return {"float16": 2e-3, "bfloat16": 1e-2}.get(dtype, 1e-6)


def check(name, got, want, dtype):
    global checked
    checked += 1
    got = host(got).astype(np.float64).reshape(-1)
    want = np.asarray(want, dtype=np.float64).reshape(-1)
    ok = got.shape == want.shape and (
        np.allclose(got, want, rtol=tolerance(dtype), atol=0) if is_float(dtype) else np.array_equal(got, want)
    )
    if not ok:
        failures.append(f"{name} {dtype}: got {got[:8]} want {want[:8]}")
        print(f"FAIL rank {rank}: {failures[-1]}", flush=True)


def ccl_op(op, r):
    if op == "premulsum":
        return ccl.ReduceOp.premul_sum(float(r + 1))
    return op


def torch_op(op, r):
    R = dist.ReduceOp
    if op == "premulsum":
        return dist._make_nccl_premul_sum(float(r + 1))
    return {"sum": R.SUM, "prod": R.PRODUCT, "min": R.MIN, "max": R.MAX, "avg": R.AVG,
            "band": R.BAND, "bor": R.BOR, "bxor": R.BXOR}[op]


def run_reductions(dtype, count, ops=OPS):
    for op in ops:
        if is_float(dtype) and op in BITWISE:
            continue
        if api == "torchdist" and op == "avg" and not is_float(dtype):
            continue  # torch refuses AVG on integers before reaching the backend
        x = arr(inputs(op, count, rank), dtype)
        want = expected_reduce(op, count, dtype)
        if api == "torchdist" and op == "premulsum" and not hasattr(torch_op(op, rank), "factor"):
            # This torch (2.11, for one) keeps the factor from Python: the
            # backend must refuse the op clearly, on every rank alike.
            try:
                dist.all_reduce(x.clone(), op=torch_op(op, rank))
                failures.append("all_reduce premulsum without a readable factor: no error")
            except NotImplementedError as e:
                if "PREMUL_SUM" not in str(e):
                    failures.append(f"all_reduce premulsum: {e}")
            continue
        if api == "torchdist":
            t = x.clone()
            dist.all_reduce(t, op=torch_op(op, rank))
            check(f"all_reduce {op}", t, want, dtype)
            t = x.clone()
            dist.reduce(t, dst=n - 1, op=torch_op(op, rank))
            if rank == n - 1:
                check(f"reduce {op}", t, want, dtype)
            big = arr(np.tile(inputs(op, count, rank), n), dtype)
            out = arr(np.zeros(count), dtype)
            dist.reduce_scatter_tensor(out, big, op=torch_op(op, rank))
            check(f"reduce_scatter_tensor {op}", out, want, dtype)
            continue
        out = arr(np.zeros(count), dtype)
        comm.allreduce(x, out, op=ccl_op(op, rank))
        check(f"allreduce {op}", out, want, dtype)
        inplace = arr(inputs(op, count, rank), dtype)
        comm.allreduce(inplace, op=ccl_op(op, rank), async_op=True).wait()
        check(f"allreduce in place async {op}", inplace, want, dtype)
        out = arr(np.zeros(count), dtype)
        comm.reduce(x, out, op=ccl_op(op, rank), root=n - 1)
        if rank == n - 1:
            check(f"reduce {op}", out, want, dtype)
        big = arr(np.tile(inputs(op, count, rank), n), dtype)
        out = arr(np.zeros(count), dtype)
        comm.reduce_scatter(big, out, op=ccl_op(op, rank))
        check(f"reduce_scatter {op}", out, want, dtype)


def run_movement(dtype, count):
    mine = np.arange(count) % 50 + rank
    block = lambda r: np.arange(count) % 50 + r  # noqa: E731
    gathered = np.concatenate([block(r) for r in range(n)])
    if api == "torchdist":
        t = arr(mine if rank == 0 else np.zeros(count), dtype)
        dist.broadcast(t, src=0)
        check("broadcast", t, block(0), dtype)
        out = arr(np.zeros(count * n), dtype)
        dist.all_gather_into_tensor(out, arr(mine, dtype))
        check("all_gather_into_tensor", out, gathered, dtype)
        outs = [arr(np.zeros(count), dtype) for _ in range(n)]
        dist.all_gather(outs, arr(mine, dtype))
        check("all_gather", np.concatenate([host(o) for o in outs]), gathered, dtype)
        send = arr(np.concatenate([np.full(count, 10 * rank + j) for j in range(n)]), dtype)
        out = arr(np.zeros(count * n), dtype)
        dist.all_to_all_single(out, send)
        check("all_to_all_single", out, np.concatenate([np.full(count, 10 * j + rank) for j in range(n)]), dtype)
        g = [arr(np.zeros(count), dtype) for _ in range(n)] if rank == n - 1 else None
        dist.gather(arr(mine, dtype), g, dst=n - 1)
        if rank == n - 1:
            check("gather", np.concatenate([host(o) for o in g]), gathered, dtype)
        out = arr(np.zeros(count), dtype)
        dist.scatter(out, [arr(block(r), dtype) for r in range(n)] if rank == 0 else None, src=0)
        check("scatter", out, block(rank), dtype)
        if n > 1:
            got = arr(np.zeros(count), dtype)
            works = [dist.isend(arr(mine, dtype), (rank + 1) % n), dist.irecv(got, (rank - 1) % n)]
            for w in works:
                w.wait()
            check("isend/irecv", got, block((rank - 1) % n), dtype)
        dist.barrier()
        return
    t = arr(mine if rank == 0 else np.zeros(count), dtype)
    comm.broadcast(t, root=0)
    check("broadcast", t, block(0), dtype)
    out = arr(np.zeros(count * n), dtype)
    comm.allgather(arr(mine, dtype), out)
    check("allgather", out, gathered, dtype)
    send = arr(np.concatenate([np.full(count, 10 * rank + j) for j in range(n)]), dtype)
    out = arr(np.zeros(count * n), dtype)
    comm.alltoall(send, out)
    check("alltoall", out, np.concatenate([np.full(count, 10 * j + rank) for j in range(n)]), dtype)
    out = arr(np.zeros(count * n), dtype) if rank == n - 1 else None
    comm.gather(arr(mine, dtype), out, root=n - 1)
    if rank == n - 1:
        check("gather", out, gathered, dtype)
    out = arr(np.zeros(count), dtype)
    comm.scatter(arr(gathered, dtype) if rank == 0 else None, out, root=0)
    check("scatter", out, block(rank), dtype)
    if n > 1:
        got = arr(np.zeros(count), dtype)
        works = [comm.send(arr(mine, dtype), (rank + 1) % n, async_op=True), comm.recv(got, (rank - 1) % n, async_op=True)]
        for w in works:
            w.wait()
        check("send/recv", got, block((rank - 1) % n), dtype)
    comm.barrier()


for dtype in types:
    for count in (1, 5, 1000):
        run_reductions(dtype, count)
        run_movement(dtype, count)
# One large call, pipelined through every transport's chunking.
run_reductions("float32", 3_000_017, ["sum", "premulsum"])
print(f"rank {rank}: {api}: checked {checked} results, {len(failures)} wrong", flush=True)
sys.exit(1 if failures else 0)
