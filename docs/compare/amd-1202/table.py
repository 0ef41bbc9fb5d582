#!/usr/bin/env python3
"""Prints the README's table from this folder's compare JSONs: ccl/best per size,
bold with the best peer's name where a peer was faster."""
import json, os, sys

here = os.path.dirname(os.path.abspath(__file__))
names = {"openmpi": "OpenMPI", "mpich": "MPICH", "oneccl": "oneCCL", "gloo": "Gloo"}
print("| collective | ranks | links | 8 B | 128 B | 2 KiB | 32 KiB | 512 KiB | 8 MiB | 128 MiB |")
print("|---|---|---|---|---|---|---|---|---|---|")
wins = total = 0
for coll in ["allreduce", "allgather", "reduce-scatter", "broadcast", "alltoall"]:
    for n in [2, 4]:
        for link in ["shm", "tcp"]:
            path = os.path.join(here, f"{coll}-{n}-{link}.json")
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
