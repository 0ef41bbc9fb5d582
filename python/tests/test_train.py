"""ccl.train: the data container's dealing, and synchronize with
DistributedOptimizer across real processes against one process."""

import pytest

from ccl.train import DistributedDataContainer
from conftest import assert_ok


@pytest.mark.parametrize("total", [0, 1, 10, 12, 13])
@pytest.mark.parametrize("n", [1, 3, 4])
def test_container_deals_equal_shares_like_distributed_sampler(total, n):
    data = list(range(100, 100 + total))
    for shuffle in (False, True):
        shares = [DistributedDataContainer(data, rank=r, world_size=n, shuffle=shuffle, seed=3) for r in range(n)]
        lengths = {len(s) for s in shares}
        assert lengths == {-(-total // n)}
        dealt = [item for s in shares for item in s]
        assert sorted(set(dealt)) == data  # every item, padding repeats only
        if shuffle and total > 3:
            before = [list(s) for s in shares]
            for s in shares:
                s.set_epoch(1)
            assert [list(s) for s in shares] != before
            # The same order on every rank: the shares still cover the data.
            assert sorted(set(i for s in shares for i in s)) == data
        cut = [DistributedDataContainer(data, rank=r, world_size=n, drop_last=True) for r in range(n)]
        assert all(len(s) == total // n for s in cut)
        assert len({i for s in cut for i in s}) == total - total % n


def test_bad_container_arguments():
    with pytest.raises(ValueError):
        DistributedDataContainer([1], rank=2, world_size=2)
    with pytest.raises(ValueError):
        DistributedDataContainer([1])


@pytest.mark.parametrize("n", [1, 2, 4])
def test_synchronize_and_distributed_optimizer_match_one_process(ranks, n):
    result = ranks("train_worker.py", n, timeout=120)
    assert_ok(result)
    digests = {r.out.split("digest ")[1].split()[0] for r in result}
    assert len(digests) == 1, [r.out for r in result]
    for r in result:
        assert float(r.out.split("gap ")[1]) < 1e-5, r.out
