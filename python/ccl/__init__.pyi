from typing import Optional

from ._ccl import (
    BrokenError as BrokenError,
    Communicator as Communicator,
    DeviceBuffer as DeviceBuffer,
    Error as Error,
    MismatchError as MismatchError,
    PeerLostError as PeerLostError,
    SharedBuffer as SharedBuffer,
    StoreError as StoreError,
    TimeoutError as TimeoutError,
    UnsupportedError as UnsupportedError,
    Work as Work,
    __version__ as __version__,
)

class ReduceOp:
    SUM: "ReduceOp"
    PROD: "ReduceOp"
    MIN: "ReduceOp"
    MAX: "ReduceOp"
    AVG: "ReduceOp"
    BAND: "ReduceOp"
    BOR: "ReduceOp"
    BXOR: "ReduceOp"
    name: str
    scalar: Optional[float]
    def __init__(self, name: str, scalar: Optional[float] = None) -> None: ...
    @staticmethod
    def premul_sum(scalar: float) -> "ReduceOp": ...
