#!/usr/bin/env python3
"""Prints a README table from the compare JSONs in DIR (named PREFIX + COLL-N-LINK.json,
as docs/compare/*/run.sh and scan.sh write them): ccl/best per size, bold with the best
peer's name where a peer was faster.

Usage: table.py DIR [PREFIX]"""
import json, os, sys

if len(sys.argv) not in (2, 3):
    sys.exit(__doc__)
here = sys.argv[1]
prefix = sys.argv[2] if len(sys.argv) == 3 else ""
names = {"openmpi": "OpenMPI", "mpich": "MPICH", "oneccl": "oneCCL", "gloo": "Gloo"}
print("| collective | ranks | links | 8 B | 128 B | 2 KiB | 32 KiB | 512 KiB | 8 MiB | 128 MiB |")
print("|---|---|---|---|---|---|---|---|---|---|")
wins = total = 0
for coll in ["allreduce", "allgather", "reduce-scatter", "broadcast", "alltoall"]:
    for n in [2, 4]:
        for link in ["shm", "tcp"]:
            path = os.path.join(here, f"{prefix}{coll}-{n}-{link}.json")
            if not os.path.exists(path):
                print(f"| {coll} | {n} | {link} | (no run) |")
                continue
            rows = json.load(open(path))["rows"]
            cells = []
            for r in rows:
                q = r["ratio_to_best"]
                total += 1
                if q >= 1.0:
                    wins += 1
                    cells.append(f"{q:.2f}")
                else:
                    cells.append(f"**{q:.2f}** {names.get(r['best_peer'], r['best_peer'])}")
            label = "all-to-all" if coll == "alltoall" else coll
            print(f"| {label} | {n} | {link} | " + " | ".join(cells) + " |")
print(f"\nccl at or above the best peer at {wins} of {total} points", file=sys.stderr)
