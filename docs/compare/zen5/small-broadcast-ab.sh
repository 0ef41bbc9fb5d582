#!/bin/bash
# The 2-rank shm broadcast of 8 B-2 KiB, two builds alternated (ccl-bench-old,
# ccl-bench-new: `cargo build --release -p ccl-bench` of each commit, copied),
# 8 runs each of 50,000 calls; prints "build c2c-ns size us" lines, then the
# medians. And the instructions of one rank's calls under callgrind:
# `small-broadcast-ab.sh callgrind RANK` (the other rank runs natively).
set -e
if [ "$1" = callgrind ]; then
  port=$((20000 + RANDOM % 10000)); vr=$2
  for r in 0 1; do
    env MASTER_ADDR=127.0.0.1 MASTER_PORT=$port WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 RANK=$r LOCAL_RANK=$r \
      taskset -c $r $([ $r = "$vr" ] && echo valgrind --tool=callgrind --callgrind-out-file=cg.$r.out \
        --collect-atstart=no --toggle-collect=ccl_bench::worker::call) \
      ./ccl-bench broadcast -b 8B -e 8B -t shm -n 20000 -w 100 > cg.$r.log 2>&1 &
  done
  wait; grep Collected cg.$vr.log   # instructions / 20,100 calls
  exit
fi
for i in $(seq 1 8); do for v in old new; do
  ./ccl-bench-$v broadcast -b 8B -e 2KB -f 16 -t shm -n 50000 -w 5000 2>&1 |
    awk -v v=$v '/core-to-core round trip/{c=$(NF-1)} /^ +[0-9]/{print v, c, $1, $7}'
done; done | tee ab.txt
python3 - <<'P'
import collections, statistics
d = collections.defaultdict(list)
for l in open('ab.txt'):
    v, c, s, t = l.split(); d[(int(s), v)].append(float(t))
for s in sorted({k[0] for k in d}):
    print(s, 'B: old %.3f us, new %.3f us (medians)' % (statistics.median(d[(s, 'old')]), statistics.median(d[(s, 'new')])))
P
