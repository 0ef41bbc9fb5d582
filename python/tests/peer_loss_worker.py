"""Rank 1 dies in the middle of a large allreduce; the others must raise
within the communicator's timeout, naming the lost rank."""

import os
import sys
import time

import numpy as np

import ccl

comm = ccl.Communicator(timeout=10)
comm.barrier()
big = np.ones(16 << 20, np.float32)  # 64 MiB: the call is still running when rank 1 exits
if comm.rank == 1:
    comm.allreduce(big, async_op=True)
    time.sleep(0.005)
    os._exit(3)
start = time.monotonic()
try:
    for _ in range(20):  # should rank 1's part have finished, the next call fails
        comm.allreduce(big)
    print("no error")
    sys.exit(1)
except (ccl.PeerLostError, ccl.TimeoutError, ccl.BrokenError) as e:
    print(f"raised {type(e).__name__} after {time.monotonic() - start:.1f}s: {e}", flush=True)
