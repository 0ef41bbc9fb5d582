#!/bin/sh
# The issue-25 table: every collective, 2 and 4 ranks, shm and forced TCP, 8 B to
# 128 MiB by x16, 2 rounds of 20 iterations, all four peers (over TCP at 4 ranks
# without MPICH). Run from the repository root after `scripts/test` (which installs
# the peers) and `cargo build --release -p ccl-bench`.
set -u
D=docs/compare/amd-1202
for coll in allreduce allgather reduce-scatter broadcast alltoall; do
  for n in 2 4; do
    for link in shm tcp; do
      peers=openmpi,mpich,oneccl,gloo
      if [ $link = tcp ] && [ $n = 4 ]; then peers=openmpi,oneccl,gloo; fi
      target/release/ccl-bench compare $coll -b 8B -e 128MB -f 16 --ranks $n --transport $link \
          --peers $peers --rounds 2 -n 20 -w 3 --json $D/$coll-$n-$link.json \
          --plot $D/$coll-$n-$link.png > $D/$coll-$n-$link.txt 2>&1
      echo "$coll $n $link rc $? $(date +%T)"
    done
  done
done
