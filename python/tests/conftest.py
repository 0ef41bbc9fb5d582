"""Launches test workers as real processes, the way torchrun does: one
process per rank with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT set, every run bounded in time."""

import os
import random
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


def free_port() -> int:
    """A TCP port free right now, picked at random below Linux's ephemeral
    range (32768-60999), as ccl's own free_port does: a port from binding
    port 0 lies in that range, where the kernel may hand it to an outgoing
    connection (a rank retrying its connect) before the store binds it."""
    for _ in range(1000):
        port = random.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free TCP port in 20000-32000")


@dataclass
class Rank:
    rank: int
    returncode: Optional[int]
    out: str
    err: str


def run_ranks(script: str, n: int, args: List[str] = (), env: Optional[Dict[str, str]] = None, timeout: float = 120) -> List[Rank]:
    """Runs `script` (a file in python/tests) as `n` ranks; returns each
    rank's exit code and output. A rank still running at `timeout` is
    killed (its returncode is then None)."""
    port = str(free_port())
    procs = []
    for r in range(n):
        e = dict(os.environ)
        e.update(
            RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(n),
            MASTER_ADDR="127.0.0.1", MASTER_PORT=port, PYTHONUNBUFFERED="1",
        )
        e.update(env or {})
        procs.append(
            subprocess.Popen(
                [sys.executable, str(HERE / script), *args],
                env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )
        )
    ranks = []
    for r, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=timeout)
            ranks.append(Rank(r, p.returncode, out, err))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, err = p.communicate()
            ranks.append(Rank(r, None, out, err))
    return ranks


def assert_ok(ranks: List[Rank]) -> None:
    for r in ranks:
        assert r.returncode == 0, f"rank {r.rank} exited with {r.returncode}\n--- stdout\n{r.out}\n--- stderr\n{r.err[-4000:]}"


@pytest.fixture
def ranks():
    return run_ranks
