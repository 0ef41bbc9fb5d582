#!/bin/bash
# abs.sh ROUNDS "colls" "sizes" ranks : old/new ccl-bench alternated; prints "coll size build c2c us"
cd "${BIN_DIR:-.}"
R=$1; C=$2; S=$3; N=${4:-2}
for i in $(seq 1 $R); do for s in $S; do
  case $s in 2MB) it=100;; 8MB) it=40;; 32MB) it=20;; *) it=8;; esac
  for c in $C; do for v in old new; do
    ./ccl-bench-$v $c --size $s --ranks $N -t shm -n $it -w 3 2>&1 | awk -v c=$c -v s=$s -v d=$v '/core-to-core/{x=$(NF-1)} /^ +[0-9]/{print c, s, d, x, $(NF-3)}'
  done; done
done; done
