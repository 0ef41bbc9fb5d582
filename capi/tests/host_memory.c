/* Host memory of cclHostAlloc, which the other ranks of the host map and
 * copy (or reduce) directly: allgather, all-to-all, broadcast and allreduce
 * on it, blocks of 4 MiB
 * (far above the smallest direct copy), checked element by element; the
 * buffers freed and allocated again, and the calls made once more with
 * other values; then misuse: a size of 0, a NULL ptr, freeing memory that
 * is not cclHostAlloc's. Run under ccl-run over shared memory; with
 * CCL_DEBUG=info,ccl_transport_shm::region=debug,ccl_algorithms::group::board=debug
 * each rank logs the peers' buffers it mapped and its reductions out of them. Exits 0 only if every check passed. */
#include <ccl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

static int failures;

static void check(int ok, int rank, const char *what) {
  if (!ok) {
    fprintf(stderr, "rank %d: FAIL %s\n", rank, what);
    failures++;
  }
}

static void must(cclResult_t r, cclComm_t comm, const char *what) {
  if (r != cclSuccess) {
    fprintf(stderr, "%s: %s: %s\n", what, cclGetErrorString(r), cclGetLastError(comm));
    exit(2);
  }
}

/* Element i of rank r's data in pass `salt`. */
static uint32_t value(uint32_t salt, int r, size_t i) {
  return salt << 28 | (uint32_t)r << 24 | (uint32_t)(i & 0xffffff);
}

static void pass(cclComm_t comm, int rank, int n, uint32_t salt) {
  const size_t block = 1u << 20; /* u32: 4 MiB */
  uint32_t *in, *out;
  must(cclHostAlloc((void **)&in, n * block * sizeof(uint32_t)), comm, "cclHostAlloc");
  must(cclHostAlloc((void **)&out, n * block * sizeof(uint32_t)), comm, "cclHostAlloc");

  for (size_t i = 0; i < block; i++) in[i] = value(salt, rank, i);
  must(cclAllGather(in, out, block, cclUint32, comm, NULL), comm, "allgather");
  int ok = 1;
  for (size_t i = 0; i < n * block && ok; i++) ok = out[i] == value(salt, (int)(i / block), i % block);
  check(ok, rank, "allgather");

  for (size_t i = 0; i < n * block; i++) in[i] = value(salt, rank, i);
  must(cclAllToAll(in, out, block, cclUint32, comm, NULL), comm, "alltoall");
  ok = 1;
  for (size_t i = 0; i < n * block && ok; i++)
    ok = out[i] == value(salt, (int)(i / block), (size_t)rank * block + i % block);
  check(ok, rank, "alltoall");

  int root = (int)(salt % (uint32_t)n);
  for (size_t i = 0; i < block; i++) in[i] = rank == root ? value(salt, root, i) : 0;
  must(cclBroadcast(in, in, block, cclUint32, root, comm, NULL), comm, "broadcast");
  ok = 1;
  for (size_t i = 0; i < block && ok; i++) ok = in[i] == value(salt, root, i);
  check(ok, rank, "broadcast in place");

  for (size_t i = 0; i < block; i++) in[i] = value(salt, rank, i);
  must(cclAllReduce(in, out, block, cclUint32, cclSum, comm, NULL), comm, "allreduce");
  ok = 1;
  for (size_t i = 0; i < block && ok; i++) {
    uint32_t sum = 0;
    for (int r = 0; r < n; r++) sum += value(salt, r, i);
    ok = out[i] == sum;
  }
  check(ok, rank, "allreduce");

  must(cclHostFree(in), comm, "cclHostFree");
  must(cclHostFree(out), comm, "cclHostFree");
}

int main(void) {
  cclComm_t comm;
  must(cclCommInitEnv(&comm), NULL, "init");
  int rank, n;
  must(cclCommUserRank(comm, &rank), comm, "rank");
  must(cclCommCount(comm, &n), comm, "count");
  for (uint32_t salt = 1; salt <= 3; salt++) pass(comm, rank, n, salt);

  void *p = &failures;
  check(cclHostAlloc(&p, 0) == cclInvalidArgument && p == NULL, rank, "a size of 0");
  check(cclHostAlloc(NULL, 64) == cclInvalidArgument, rank, "a NULL ptr");
  check(cclHostFree(&failures) == cclInvalidArgument, rank, "freeing other memory");
  check(cclHostFree(NULL) == cclSuccess, rank, "freeing NULL");

  must(cclCommDestroy(comm), NULL, "destroy");
  printf("rank %d of %d: host memory %s\n", rank, n, failures ? "FAILED" : "ok");
  return failures ? 1 : 0;
}
