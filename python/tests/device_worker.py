"""One rank of the device checks: calls on ccl.DeviceBuffer memory (the
stand-in GPU, CCL_CUDA_STAND_IN=1), blocking and async, checked against
numpy on the host, then the misuse that must fail clearly."""

import numpy as np

import ccl


def dev(host: np.ndarray) -> ccl.DeviceBuffer:
    buf = ccl.DeviceBuffer(host.size, str(host.dtype))
    buf.copy_from(host)
    return buf


def back(buf: ccl.DeviceBuffer) -> np.ndarray:
    host = np.empty(len(buf), dtype=buf.dtype)
    buf.copy_to(host)
    return host


def main() -> None:
    comm = ccl.Communicator()
    r, n = comm.rank, comm.world_size
    checked = 0

    def check(what: str, got: np.ndarray, want: np.ndarray) -> None:
        nonlocal checked
        checked += 1
        assert np.array_equal(got, want), f"rank {r}: {what}: got {got[:8]}, want {want[:8]}"

    count = 100_003  # many chunks with a small CCL_CUDA_CHUNK
    base = np.arange(count) % 7
    for dtype in ("float32", "int64", "float64"):
        x = dev((base + r).astype(dtype))
        comm.allreduce(x)
        check(f"allreduce {dtype} in place", back(x), (n * base + n * (n - 1) // 2).astype(dtype))
        y = dev(np.zeros(count, dtype=dtype))
        work = comm.allreduce(dev((base + r).astype(dtype)), y, op="max", async_op=True)
        work.wait()
        check(f"allreduce {dtype} max, async, out of place", back(y), (base + n - 1).astype(dtype))

    mine = dev(np.full(1000, r, dtype=np.int32))
    every = dev(np.zeros(1000 * n, dtype=np.int32))
    comm.allgather(mine, every)
    check("allgather", back(every), np.repeat(np.arange(n, dtype=np.int32), 1000))

    parts = dev(np.arange(n * 64, dtype=np.float32))
    part = dev(np.zeros(64, dtype=np.float32))
    comm.reduce_scatter(parts, part, op=ccl.ReduceOp.SUM)
    check("reduce_scatter", back(part), n * np.arange(r * 64, (r + 1) * 64, dtype=np.float32))

    b = dev(np.arange(count, dtype=np.float32) if r == n - 1 else np.zeros(count, dtype=np.float32))
    comm.broadcast(b, root=n - 1)
    check("broadcast", back(b), np.arange(count, dtype=np.float32))

    if n > 1:
        # One way, rank 0 to the last: each rank only sends or only receives.
        if r == 0:
            comm.send(dev(np.arange(count, dtype=np.float64)), n - 1)
        elif r == n - 1:
            got = dev(np.zeros(count, dtype=np.float64))
            comm.recv(got, 0)
            check("send and recv", back(got), np.arange(count, dtype=np.float64))

    # Misuse: clear errors, nothing sent.
    try:
        comm.allreduce(np.zeros(4, dtype=np.float32), dev(np.zeros(4, dtype=np.float32)))
        raise AssertionError("host input with a device output was taken")
    except ValueError as e:
        assert "lies in host memory" in str(e), e
    try:
        comm.allreduce(np.zeros(4, dtype=np.float32), stream=12345)
        raise AssertionError("a stream with host arrays was taken")
    except ValueError as e:
        assert "host memory" in str(e), e
    try:
        ccl.DeviceBuffer(4, "complex64")
        raise AssertionError("an unknown element type was taken")
    except TypeError as e:
        assert "float32" in str(e), e
    buf = ccl.DeviceBuffer(4, "bfloat16")
    assert (len(buf), buf.dtype, buf.device, buf.nbytes) == (4, "bfloat16", 0, 8), repr(buf)
    assert buf.__dlpack_device__() == (2, 0)
    assert type(buf.__dlpack__()).__name__ == "PyCapsule"
    comm.barrier()
    print(f"rank {r}: device: checked {checked}")
    comm.close()


if __name__ == "__main__":
    main()
