"""Rank 1 dies before a collective; the others must raise within the
communicator's timeout, naming the lost rank."""

import os
import sys
import time

import numpy as np

import ccl

comm = ccl.Communicator(timeout=10)
comm.barrier()
if comm.rank == 1:
    os._exit(3)
start = time.monotonic()
try:
    comm.allreduce(np.ones(1 << 20, np.float32))
    print("no error")
    sys.exit(1)
except (ccl.PeerLostError, ccl.TimeoutError, ccl.BrokenError) as e:
    print(f"raised {type(e).__name__} after {time.monotonic() - start:.1f}s: {e}", flush=True)
