"""Calls on GPU memory through the package: ccl.DeviceBuffer on the
stand-in GPU (host memory posing as a GPU's, CCL_CUDA_STAND_IN=1), 1 to 3
real processes, through CUDA IPC and staged through host memory."""

import pytest

from conftest import assert_ok


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("ipc", ["1", "0"])
def test_device_buffers(ranks, n, ipc):
    env = {"CCL_CUDA_STAND_IN": "1", "CCL_CUDA_CHUNK": "65536", "CCL_CUDA_IPC_CHUNK": "65536", "CCL_CUDA_IPC": ipc}
    result = ranks("device_worker.py", n, [], env=env, timeout=300)
    assert_ok(result)
    for r in result:
        assert f"rank {r.rank}: device: checked" in r.out, r.out


def test_device_buffer_without_a_driver_names_the_library():
    import os

    import ccl

    if os.environ.get("CCL_REQUIRE_CUDA") == "1":
        pytest.skip("a machine with a GPU: the driver is there")

    with pytest.raises(ccl.UnsupportedError, match="libcuda"):
        ccl.DeviceBuffer(4)
