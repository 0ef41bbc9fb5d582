#!/bin/sh
# A quick scan of where ccl loses on this host: every collective, 8 B to 128 MiB by x16,
# 3 rounds of 20 calls. 2 ranks against OpenMPI and MPICH over shm and TCP; 4 ranks against
# OpenMPI and MPICH over shm, OpenMPI and Gloo over TCP (MPICH's 4-rank TCP jobs hung in
# earlier sessions). Run from the repository root after `scripts/test` (which installs the
# peers) and `cargo build --release -p ccl-bench`. PLOT=1 also draws each table's busbw against
# size into a PNG beside it.
set -u
D=${D:-docs/compare/zen5}
for n in 2 4; do for link in shm tcp; do for coll in allreduce allgather reduce-scatter broadcast alltoall; do
  peers=openmpi,mpich
  if [ $n = 4 ] && [ $link = tcp ]; then peers=openmpi,gloo; fi
  plot=""
  if [ "${PLOT:-0}" = 1 ]; then plot="--plot $D/scan-$coll-$n-$link.png"; fi
  timeout 1200 target/release/ccl-bench compare $coll -b 8B -e 128MB -f 16 --ranks $n --transport $link \
      --peers $peers --rounds 3 -n 20 -w 3 --json $D/scan-$coll-$n-$link.json $plot > $D/scan-$coll-$n-$link.txt 2>&1
  echo "$coll $n $link rc $? $(date +%T)"
done; done; done
