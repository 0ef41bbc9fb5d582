#!/usr/bin/env bash
# Builds the OpenMPI benchmark by hand (ccl-bench compare-mpi builds it by
# itself, into the target directory, on first use).
#   bench/mpi/build.sh [OUT]      default OUT: target/ccl_mpi_bench
# Then, e.g.:
#   mpirun -np 2 target/ccl_mpi_bench allreduce -b 8 -e 268435456 -f 2 -n 20 -w 5 -d f32 -o sum
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:-$here/../../target/ccl_mpi_bench}"
command -v mpicc >/dev/null || {
  echo "build.sh: mpicc not found: apt-get install openmpi-bin libopenmpi-dev" >&2
  exit 1
}
mkdir -p "$(dirname "$out")"
mpicc -O2 -Wall -Wextra -o "$out" "$here/ccl_mpi_bench.c"
echo "$out"
