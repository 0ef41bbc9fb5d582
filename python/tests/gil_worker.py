"""A blocking collective releases the GIL: another Python thread of the
rank keeps running while rank 0 waits for a late rank 1."""

import threading
import time

import numpy as np

import ccl

comm = ccl.Communicator()
comm.barrier()
if comm.rank == 1:
    time.sleep(1.0)
ticks = 0
stop = threading.Event()


def count():
    global ticks
    while not stop.is_set():
        ticks += 1
        time.sleep(0.001)


t = threading.Thread(target=count)
t.start()
comm.allreduce(np.ones(16, np.float32))
stop.set()
t.join()
print(f"rank {comm.rank} ticks {ticks}", flush=True)
