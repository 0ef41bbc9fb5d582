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
