"""The package's behaviour beyond results: errors, a dead peer, the GIL,
async and await, split, the torch init methods."""

import asyncio
import os
import tempfile

import numpy as np
import pytest

import ccl
from conftest import assert_ok, free_port


def test_bad_inputs_raise_clear_errors(ranks):
    for n in (1, 2):
        result = ranks("errors_worker.py", n, timeout=120)
        assert_ok(result)
        for r in result:
            lines = r.out.splitlines()
            assert len(lines) == 23, r.out + r.err
            assert all(line.startswith("ok") for line in lines), r.out


def test_a_peer_dying_mid_collective_fails_the_others_within_the_timeout(ranks):
    result = ranks("peer_loss_worker.py", 3, timeout=60)
    assert result[1].returncode == 3
    for r in (result[0], result[2]):
        assert r.returncode == 0, r.out + r.err
        assert "raised" in r.out and "rank 1" in r.out, r.out
        seconds = float(r.out.split(" after ")[1].split("s:")[0])
        assert seconds < 15, r.out


def test_a_blocking_call_releases_the_gil(ranks):
    result = ranks("gil_worker.py", 2, timeout=60)
    assert_ok(result)
    ticks = int(result[0].out.split("ticks ")[1])
    assert ticks > 100, result[0].out  # about 1 s of 1 ms ticks while waiting


def test_single_rank_async_await_and_split():
    os.environ.pop("RANK", None)
    comm = ccl.Communicator(rank=0, world_size=1)
    assert (comm.rank, comm.world_size) == (0, 1)
    x = np.arange(6, dtype=np.float64)
    work = comm.allreduce(x, op=ccl.ReduceOp.premul_sum(2.0), async_op=True)
    work.wait()
    assert work.is_completed()
    assert x.tolist() == [0, 2, 4, 6, 8, 10]

    async def twice():
        await comm.allreduce(x, op="prod", async_op=True)
        return x

    assert asyncio.run(twice()).tolist() == [0, 2, 4, 6, 8, 10]
    # Buffer-protocol objects lend their own memory too.
    import array

    doubles = array.array("d", [1.5, 2.5])
    comm.allreduce(doubles, op=ccl.ReduceOp.premul_sum(2.0))
    assert doubles.tolist() == [3.0, 5.0]
    sub = comm.split(0)
    assert sub is not None and sub.world_size == 1
    assert comm.split(None) is None
    with sub:
        sub.barrier()
    comm.close()


@pytest.mark.parametrize("method", ["env://", "tcp", "file"])
def test_torch_init_methods(ranks, method):
    if method == "tcp":
        method = f"tcp://127.0.0.1:{free_port()}"
    elif method == "file":
        method = "file://" + os.path.join(tempfile.mkdtemp(), "store")
    result = ranks("torch_init_worker.py", 3, [method], timeout=120)
    assert_ok(result)
