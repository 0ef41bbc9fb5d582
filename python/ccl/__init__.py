"""ccl: collective communication in pure Rust.

>>> import ccl, numpy as np
>>> comm = ccl.Communicator()          # the job torchrun, mpirun, srun or ccl-run started
>>> x = np.full(4, comm.rank, dtype=np.float32)
>>> comm.allreduce(x)                  # in place: every rank now holds the sum
>>> work = comm.allreduce(x, op=ccl.ReduceOp.AVG, async_op=True)
>>> work.wait()

Arrays are anything that exports DLPack (numpy arrays, torch tensors) or
the buffer protocol; ccl reads and writes their memory directly, so they
must be contiguous, and outputs writable. Arrays in GPU memory (CUDA
tensors, `ccl.DeviceBuffer`) make the call run on the GPU, ordered on
`stream=` (a CUDA stream handle; the GPU's default stream if omitted).
Arrays made of a `ccl.SharedBuffer` (`numpy.from_dlpack(ccl.SharedBuffer(n))`)
are host memory that the other ranks of the host copy directly, about twice
as fast for large blocks. `import ccl.torch` registers the
torch.distributed backend "cclrs"; `ccl.train` has training helpers.
"""

import atexit
from typing import Optional

from ._ccl import (
    BrokenError,
    Communicator,
    DeviceBuffer,
    Error,
    MismatchError,
    PeerLostError,
    SharedBuffer,
    StoreError,
    TimeoutError,
    UnsupportedError,
    Work,
    __version__,
    _at_exit,
)

# Before the interpreter exits, ccl's threads stop calling into it.
atexit.register(_at_exit)



class ReduceOp:
    """A reduction op: `ReduceOp.SUM`, `PROD`, `MIN`, `MAX`, `AVG` (integer
    division for integers), `BAND`, `BOR`, `BXOR` (integers only), or
    `ReduceOp.premul_sum(scalar)`: each rank multiplies its input by its own
    scalar, then the inputs are summed. Calls also take the names as strings
    ("sum", "avg", ...)."""

    __slots__ = ("name", "scalar")

    def __init__(self, name: str, scalar: Optional[float] = None):
        self.name = name
        self.scalar = scalar

    @staticmethod
    def premul_sum(scalar: float) -> "ReduceOp":
        return ReduceOp("premulsum", float(scalar))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ReduceOp) and (self.name, self.scalar) == (other.name, other.scalar)

    def __hash__(self) -> int:
        return hash((self.name, self.scalar))

    def __repr__(self) -> str:
        return f"ReduceOp.premul_sum({self.scalar})" if self.scalar is not None else f"ReduceOp.{self.name.upper()}"


for _name in ("sum", "prod", "min", "max", "avg", "band", "bor", "bxor"):
    setattr(ReduceOp, _name.upper(), ReduceOp(_name))
del _name

__all__ = [
    "BrokenError",
    "Communicator",
    "DeviceBuffer",
    "Error",
    "MismatchError",
    "PeerLostError",
    "ReduceOp",
    "SharedBuffer",
    "StoreError",
    "TimeoutError",
    "UnsupportedError",
    "Work",
    "__version__",
]
