#!/bin/sh
# The 2-rank rows of docs/compare/zen5/scan.sh on the Zen 2 VM of 2026-12-03 (AMD EPYC, CPU
# family 23 model 49, 2 vCPUs, 512 KiB of L2 each, 16 MiB of L3): every collective, 8 B to
# 128 MiB by x16, 3 rounds of 20 calls, against OpenMPI and MPICH, over shm (and TCP with
# `scan.sh tcp`). Run from the repository root after `scripts/test` (which installs the
# peers) and `cargo build --release -p ccl-bench`.
set -u
D=docs/compare/zen2
link=${1:-shm}
for coll in allreduce allgather reduce-scatter broadcast alltoall; do
  timeout 1200 target/release/ccl-bench compare $coll -b 8B -e 128MB -f 16 --ranks 2 --transport $link \
      --peers openmpi,mpich --rounds 3 -n 20 -w 3 --json $D/scan-$coll-2-$link.json > $D/scan-$coll-2-$link.txt 2>&1
  echo "$coll 2 $link rc $? $(date +%T)"
done
