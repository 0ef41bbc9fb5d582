#!/bin/bash
# sweep.sh ROUNDS "colls" "sizes" "divs" [ranks]
cd "${BIN_DIR:-target/release}"
R=$1; C=$2; S=$3; D=$4; N=${5:-2}
for i in $(seq 1 $R); do for s in $S; do
  case $s in 2MB) it=100;; 8MB) it=40;; 32MB) it=20;; *) it=8;; esac
  for c in $C; do for d in $D; do
    CCL_X_DIV=$d ./ccl-bench $c --size $s --ranks $N -t shm -n $it -w 3 2>&1 | awk -v c=$c -v s=$s -v d=$d '/core-to-core/{x=$(NF-1)} /^ +[0-9]/{print c, s, d, x, $(NF-3)}'
  done; done
done; done
