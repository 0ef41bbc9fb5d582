#!/usr/bin/env bash
# The C interface as a C user meets it: installs libcclrs, ccl.h and ccl-run
# under a temporary prefix (scripts/install-capi), builds the C programs
# against the installed header and library only (pkg-config; shared and
# static), and runs them as users launch them: under ccl-run and under
# mpirun, over shared memory and over TCP, and the misuse cases under
# valgrind. Every run has a deadline; all traffic stays on loopback.
set -euo pipefail
cd "$(dirname "$0")/../.."
repo=$PWD
prefix=$(mktemp -d /tmp/ccl-capi-prefix.XXXXXX)
build=$(mktemp -d /tmp/ccl-capi-build.XXXXXX)
trap 'rm -rf "$prefix" "$build"' EXIT
export CCL_SOCKET_IFNAME=lo

step() { printf '\n== %s\n' "$*"; }

step "install under $prefix"
scripts/install-capi "$prefix"
export PKG_CONFIG_PATH="$prefix/lib/pkgconfig"
cflags="-std=c11 -D_POSIX_C_SOURCE=200809L -O2 -Wall -Wextra -Werror $(pkg-config --cflags cclrs)"
libs="$(pkg-config --libs cclrs) -Wl,-rpath,$prefix/lib"

step "compile against the installed header and library"
cd "$build"
# shellcheck disable=SC2086  # flags are word lists
{
  cc $cflags "$repo/examples/c/allreduce.c" -o allreduce $libs -lm
  # The complete program of capi/README.md (its first C block), as printed there.
  awk '/^```c$/ {on = 1; next} on && /^```$/ {exit} on' "$repo/capi/README.md" > readme.c
  cc $cflags readme.c -o readme $libs
  cc $cflags "$repo/examples/c/bench.c" -o bench $libs
  cc $cflags -g "$repo/capi/tests/bad_input.c" -o bad_input $libs -lpthread
  cc $cflags "$repo/examples/c/allreduce.c" -o allreduce-static \
    "$prefix/lib/libcclrs.a" $(pkg-config --static --libs-only-l cclrs | sed 's/-lcclrs//') -lm
  cc $cflags "$repo/capi/tests/device.c" -o device $libs
  cc $cflags "$repo/capi/tests/host_memory.c" -o host_memory $libs
  mpicc $cflags "$repo/examples/c/mpi_unique_id.c" -o mpi_unique_id $libs
  # The header alone compiles as C++ too.
  printf '#include <ccl.h>\nint main() { return cclGetErrorString(cclSuccess) ? 0 : 1; }\n' > cxx.cc
  c++ -Wall -Werror $(pkg-config --cflags cclrs) cxx.cc -o cxx $libs
}
./cxx
# The executables name the installed library, not the build tree. (grep reads
# all of ldd's output: with -q it could stop early, ldd would die of SIGPIPE,
# and pipefail would turn that into a failure, or a false negative.)
ldd ./allreduce | grep "$prefix/lib/libcclrs.so.0" >/dev/null
if ldd ./allreduce-static | grep libcclrs >/dev/null; then
  echo "allreduce-static links libcclrs dynamically" >&2
  exit 1
fi
# The default build runs where libibverbs is not installed.
if ldd "$prefix/lib/libcclrs.so.0" | grep libibverbs >/dev/null; then
  echo "the default libcclrs links libibverbs (the RDMA glue belongs behind its feature)" >&2
  exit 1
fi

run="timeout --kill-after=10 120 $prefix/bin/ccl-run"
step "the README's program, 2 ranks"
$run -n 2 ./readme | tee readme.out
grep -q "rank 1 of 2: mean 0.5" readme.out
for n in 1 3 4; do
  step "every collective, $n rank(s) under ccl-run (shared memory)"
  $run -n "$n" ./allreduce
done
step "every collective, 3 ranks under ccl-run over TCP"
CCL_TRANSPORT=tcp $run -n 3 ./allreduce
step "static library, 2 ranks"
$run -n 2 ./allreduce-static
step "timing program, 2 ranks, 1 MiB (checks its result)"
$run -n 2 ./bench 1M 5 1

step "host memory of cclHostAlloc, which the peers map and copy directly"
for n in 2 3; do
  CCL_DEBUG=info,ccl_transport_shm::region=debug,ccl_algorithms::group::board=debug \
    $run -n "$n" ./host_memory 2>&1 | tee host_memory.out
  [ "$(grep -c "host memory ok" host_memory.out)" = "$n" ]
  # Every rank mapped its peers' buffers (3 passes, each with new ones) and
  # reduced each pass's allreduce straight out of them.
  [ "$(grep -c "mapped shared buffer" host_memory.out)" -ge $((3 * n)) ]
  [ "$(grep -c "straight out of shared buffers" host_memory.out)" = $((3 * n)) ]
done

step "device memory (the stand-in GPU): through CUDA IPC, and staged through host memory"
for n in 2 3; do
  CCL_CUDA_STAND_IN=1 CCL_CUDA_CHUNK=65536 CCL_CUDA_IPC_CHUNK=65536 $run -n "$n" ./device
  CCL_CUDA_STAND_IN=1 CCL_CUDA_CHUNK=65536 CCL_CUDA_IPC=0 $run -n "$n" ./device
done

step "ccl beside MPI: 4 ranks under mpirun, the unique id through MPI_Bcast"
# As tests/mpi-reference runs it: shared memory without single-copy (which
# containers often forbid), unbound, yielding when idle.
mpi_flags=(--oversubscribe --bind-to none -x CCL_SOCKET_IFNAME --mca pml ob1 --mca btl self,vader
  --mca btl_vader_single_copy_mechanism none --mca mpi_yield_when_idle 1 --timeout 120)
[ "$(id -u)" = 0 ] && mpi_flags+=(--allow-run-as-root)
timeout --kill-after=10 120 mpirun "${mpi_flags[@]}" -n 4 ./mpi_unique_id

step "every collective under mpirun and torchrun, no rendezvous variables given"
for n in 2 4; do
  timeout --kill-after=10 120 mpirun "${mpi_flags[@]}" -n "$n" ./allreduce
done
# torchrun's agent serves the store; ccl joins it as a client.
torchrun="${CCL_TEST_VENV:-}/bin/torchrun"
if [ -x "$torchrun" ]; then
  for n in 2 4; do
    timeout --kill-after=10 120 "$torchrun" --nproc-per-node "$n" --no-python ./allreduce
  done
elif [ -n "${CI:-}" ]; then
  echo "torchrun is missing: set CCL_TEST_VENV to a venv with torch (scripts/test does)" >&2
  exit 1
else
  echo "(skipped: no torchrun; set CCL_TEST_VENV to a venv with torch)"
fi

step "misuse of every entry point, under valgrind"
timeout --kill-after=10 300 valgrind -q --error-exitcode=3 --leak-check=no ./bad_input

echo
echo "capi/tests/c-programs.sh: all C programs passed"
