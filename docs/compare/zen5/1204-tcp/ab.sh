#!/bin/bash
# ab3.sh ROUNDS "label=bin env..." ... ; env SIZES KINDS T N RANKS X
cd "$(dirname "$0")"
R=$1; shift
for i in $(seq 1 $R); do for v in "$@"; do l=${v%%=*}; rest=${v#*=}; b=${rest%% *}; e=${rest#$b}
  for s in ${SIZES:-128MB}; do for k in ${KINDS:-allgather alltoall}; do
    t=$(env $e ./ccl-bench-$b $k -N ${RANKS:-2} -t ${T:-tcp} -s $s -n ${N:-5} -w 2 $X 2>&1 | grep -E '^ +[0-9]' | awk '{print $7}')
    echo "$l $k@$s $t"
  done; done; done; done > /tmp/a2a/ab3.out
python3 - "$@" <<'P'
import collections, statistics, sys
labels = [a.split('=')[0] for a in sys.argv[1:]]
d = collections.defaultdict(list)
for l in open('/tmp/a2a/ab3.out'):
    a, k, t = l.split(); d[(k, a)].append(float(t))
for k in sorted({k for k, _ in d}):
    base = statistics.median(d[(k, labels[0])])
    print(f"{k:22s} " + "  ".join(f"{a} {statistics.median(d[(k, a)]):8.1f} ({statistics.median(d[(k, a)])/base:.3f})" for a in labels) + f"  n={len(d[(k, labels[0])])}")
P
