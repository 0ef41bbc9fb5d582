"""Every collective x element type x op, through the package and through
the torch backend, on 1 to 4 real processes, against numpy."""

import pytest

from conftest import assert_ok


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("api", ["numpy", "torch", "torchdist"])
def test_every_collective_dtype_and_op(ranks, api, n):
    result = ranks("collectives_worker.py", n, [api], timeout=300)
    assert_ok(result)
    for r in result:
        assert f"rank {r.rank}: {api}: checked" in r.out and ", 0 wrong" in r.out, r.out


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("api", ["numpy", "torch", "torchdist"])
def test_shared_buffers(ranks, api, n):
    """Arrays made of ccl.SharedBuffer: right results, and every rank maps
    its peers' buffers (its debug log says so) rather than copying them
    through the kernel; through torch.distributed's cclrs backend too, whose
    communicator (on torch's store) must honour CCL_DEBUG as well."""
    env = {
        "CCL_TRANSPORT": "shm",
        "CCL_DEBUG": "info,ccl_transport_shm::region=debug,ccl_algorithms::group::board=debug",
    }
    result = ranks("shared_worker.py", n, [api], env=env, timeout=120)
    assert_ok(result)
    for r in result:
        assert f"rank {r.rank}: {api}: shared buffers checked, 0 wrong" in r.out, r.out
        assert "mapped shared buffer" in r.err, r.err[-4000:]
        # Both passes' allreduce and reduce-scatter.
        assert r.err.count("straight out of shared buffers") == 4, r.err[-4000:]
