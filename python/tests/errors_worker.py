"""Bad inputs on one rank: each must raise the documented exception with a
message that says what is wrong. Prints one line per case."""

import numpy as np
import torch

import ccl

comm = ccl.Communicator()
n = comm.world_size
f32 = lambda k: np.zeros(k, dtype=np.float32)  # noqa: E731
readonly = f32(4)
readonly.flags.writeable = False

cases = [
    ("non-contiguous", ValueError, "not contiguous", lambda: comm.allreduce(np.zeros((4, 4), np.float32)[:, 1])),
    ("non-contiguous torch", ValueError, "not contiguous", lambda: comm.allreduce(torch.zeros(4, 4).t())),
    ("read-only output", ValueError, "read-only", lambda: comm.allreduce(f32(4), readonly)),
    ("read-only in place", ValueError, "read-only", lambda: comm.allreduce(readonly)),
    ("mismatched types", TypeError, "must match", lambda: comm.allreduce(f32(4), np.zeros(4, np.float64))),
    ("int16", TypeError, "element type", lambda: comm.allreduce(np.zeros(4, np.int16))),
    ("bool", TypeError, "booleans", lambda: comm.allreduce(np.zeros(4, bool))),
    ("no memory", TypeError, "__dlpack__", lambda: comm.allreduce([1.0, 2.0])),
    ("requires grad", ValueError, "cannot lend", lambda: comm.allreduce(torch.zeros(4, requires_grad=True))),
    ("short output", ValueError, "expected", lambda: comm.allgather(f32(4), f32(4 * n - 1))),
    ("short output", ValueError, "expected", lambda: comm.allreduce(f32(4), f32(3))),
    ("bitwise on floats", ValueError, "not defined for floating-point", lambda: comm.allreduce(f32(4), op="band")),
    ("unknown op", ValueError, "no reduction op", lambda: comm.allreduce(f32(4), op="median")),
    ("op of a wrong type", TypeError, "ReduceOp", lambda: comm.allreduce(f32(4), op=3)),
    ("root out of range", ValueError, "root", lambda: comm.broadcast(f32(4), root=n)),
    ("peer out of range", ValueError, "peer", lambda: comm.send(f32(4), n)),
    ("uneven alltoall", ValueError, "elements", lambda: comm.alltoall(f32(4 * n + 1), f32(4 * n))),
    ("negative wait", ValueError, "seconds", lambda: comm.barrier(async_op=True).wait(timeout=-1)),
    ("negative timeout", ValueError, "positive", lambda: setattr(comm, "timeout", -1.0)),
    ("half a job", ValueError, "both rank and world_size", lambda: ccl.Communicator(rank=0)),
    ("store without rank", ValueError, "rank and world_size", lambda: ccl.Communicator(store=object())),
]

for name, exc, text, call in cases:
    try:
        call()
    except exc as e:
        ok = text in str(e)
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {type(e).__name__}: {e}", flush=True)
    except Exception as e:  # the wrong exception
        print(f"FAIL {name}: {type(e).__name__} (expected {exc.__name__}): {e}", flush=True)
    else:
        print(f"FAIL {name}: no exception", flush=True)

# The communicator still works after all that, and fails clearly once closed.
x = np.ones(4, np.float32)
comm.allreduce(x)
print(f"{'ok  ' if x[0] == n else 'FAIL'} still works: {x[0]}", flush=True)
comm.close()
try:
    comm.allreduce(x)
    print("FAIL closed: no exception")
except ccl.BrokenError as e:
    print(f"ok   closed: {e}")
