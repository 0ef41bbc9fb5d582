"""Data-parallel linear regression with numpy and ccl's training helpers
(no torch): runs under any launcher.

    torchrun --nproc-per-node 2 --no-python python3 examples/python/train_numpy.py
    mpirun -n 4 python3 examples/python/train_numpy.py
    ccl-run -n 2 python3 examples/python/train_numpy.py

Rank 0 starts from its own random weights and `synchronize` hands them to
every rank; each rank computes the gradient on its share of the data
(`DistributedDataContainer`) and `average_gradients` averages them, so every
rank takes the same step. Rank 0 prints the loss; every rank prints a digest
of its final weights, which must agree.
"""

import argparse
import hashlib

import numpy as np

import ccl
from ccl.train import (
    DistributedDataContainer,
    average_gradients,
    local_rank,
    synchronize,
    total_workers,
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=4096)
    p.add_argument("--features", type=int, default=16)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.1)
    args = p.parse_args()

    comm = ccl.Communicator()
    rng = np.random.default_rng(1234)  # the same data set on every rank
    x = rng.standard_normal((args.samples, args.features)).astype(np.float32)
    truth = rng.standard_normal(args.features).astype(np.float32)
    y = x @ truth + 0.01 * rng.standard_normal(args.samples).astype(np.float32)

    # Different starting points on every rank, until synchronize.
    w = np.random.default_rng(100 + comm.rank).standard_normal(args.features).astype(np.float32)
    synchronize(w, comm, root=0)

    data = DistributedDataContainer(np.arange(args.samples), comm, shuffle=True, seed=7)
    for epoch in range(args.epochs):
        data.set_epoch(epoch)
        mine = np.fromiter(data, dtype=np.int64)
        for start in range(0, len(mine), args.batch):
            idx = mine[start : start + args.batch]
            err = x[idx] @ w - y[idx]
            grad = (2.0 / len(idx)) * (x[idx].T @ err)
            average_gradients([grad], comm)
            w -= args.lr * grad
        loss = np.array([np.mean((x @ w - y) ** 2)], dtype=np.float64)
        comm.allreduce(loss, op=ccl.ReduceOp.MAX)
        if comm.rank == 0:
            print(f"epoch {epoch} loss {loss[0]:.6f}", flush=True)

    digest = hashlib.sha256(w.tobytes()).hexdigest()[:16]
    print(f"rank {local_rank(comm)} of {total_workers(comm)} (rank {comm.host_rank} on its host) weights {digest}", flush=True)


if __name__ == "__main__":
    main()
