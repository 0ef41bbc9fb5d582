"""ccl: collective communication in pure Rust.

>>> import ccl, numpy as np
>>> comm = ccl.Communicator()          # the job torchrun, mpirun, srun or ccl-run started
>>> x = np.full(4, comm.rank, dtype=np.float32)
>>> comm.allreduce(x)                  # in place: every rank now holds the sum
>>> work = comm.allreduce(x, op=ccl.ReduceOp.AVG, async_op=True)
>>> work.wait()

Arrays are anything that exports DLPack (numpy arrays, torch tensors) or
the buffer protocol; ccl reads and writes their memory directly, so they
must be contiguous, and outputs writable. `import ccl.torch` registers the
torch.distributed backend "cclrs"; `ccl.train` has training helpers.
"""

from ._ccl import (
    BrokenError,
    Communicator,
    Error,
    MismatchError,
    PeerLostError,
    ReduceOp,
    StoreError,
    TimeoutError,
    UnsupportedError,
    Work,
    __version__,
)

__all__ = [
    "BrokenError",
    "Communicator",
    "Error",
    "MismatchError",
    "PeerLostError",
    "ReduceOp",
    "StoreError",
    "TimeoutError",
    "UnsupportedError",
    "Work",
    "__version__",
]
