#!/bin/bash
# Alternates the old and new ccl-bench on small 2-rank TCP calls; prints µs per call.
# usage: ab.sh ROUNDS OUT
R=${1:-4}; OUT=${2:-ab-tcp.txt}
: > $OUT
for r in $(seq 1 $R); do
  for v in old new; do
    for c in "broadcast -b 8B -e 2KB -f 16" "allreduce -b 8B -e 128B -f 16" "allgather -b 128B -e 2KB -f 16" "alltoall -b 2KB -e 2KB"; do
      ${BIN_DIR:-/tmp/bins}/ccl-bench.$v $c -N 2 -t tcp -n 20000 -w 2000 2>&1 | awk -v v=$v -v c="${c%% *}" -v r=$r '$1 ~ /^[0-9]+$/ {print r, v, c, $1, $7}' >> $OUT
    done
  done
done
