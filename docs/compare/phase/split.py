"""Splits the jobs of `ccl-bench compare` JSON files by the core-to-core round
trip measured before each (fast: under 200 ns, slow: 300 ns and more) and
prints each library's median time per size and state.

    python3 docs/compare/phase/split.py docs/compare/phase/*.json

A file whose name starts with "rd-" ran ccl with CCL_ALGO=allreduce=rd and is
reported as ccl-rd; any other as ccl-auto.
"""
import collections
import json
import os
import statistics
import sys


def state(ns):
    return "fast" if ns < 200 else "slow" if ns >= 300 else "between"


times = collections.defaultdict(list)
libs = []
for path in sys.argv[1:]:
    ccl = "ccl-rd" if os.path.basename(path).startswith("rd-") else "ccl-auto"
    for row in json.load(open(path))["rows"]:
        jobs = [(ccl, row["ccl_round_times_us"], row["ccl_round_core_to_core_ns"])]
        jobs += [(p["peer"], p["round_times_us"], p["round_core_to_core_ns"]) for p in row["peers"]]
        for lib, ts, ns in jobs:
            if lib not in libs:
                libs.append(lib)
            for t, n in zip(ts, ns):
                if n is not None:
                    times[(state(n), row["size_bytes"], lib)].append(t)
for s in ("fast", "between", "slow"):
    sizes = sorted({size for st, size, _ in times if st == s})
    if sizes:
        print(f"{s}: median time (us), jobs in brackets")
    for size in sizes:
        cells = []
        for lib in libs:
            t = times.get((s, size, lib))
            cells.append(f"{lib} {statistics.median(t):.1f} ({len(t)})" if t else f"{lib} -")
        print(f"  {size:>10}  " + "  ".join(cells))
