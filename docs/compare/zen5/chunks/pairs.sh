#!/bin/bash
# usage: pairs.sh N cmd1 cmd2 ... ; each cmd is "label:env:coll"
cd "${BIN_DIR:-target/release}"
N=$1; shift
for i in $(seq 1 $N); do
  for spec in "$@"; do
    label=${spec%%:*}; rest=${spec#*:}; envs=${rest%%:*}; coll=${rest#*:}
    echo -n "$label "
    env $envs ./ccl-bench $coll --size ${SIZE:-128MB} -t shm -n ${ITERS:-10} -w 2 2>&1 | awk '/core-to-core/{printf "%s ",$(NF-1)} /^ +[0-9]/{print $(NF-3)}'
  done
done
