/* Every collective of ccl from C, checked: several element types and ops,
 * in place and out of place, a ring of grouped sends and receives, calls
 * started in a group and waited for through a cclWork_t, and a split.
 * Run it under a launcher: ccl-run -n 4 ./allreduce
 * Prints "rank R: N checks, F failures" and exits 0 only if F is 0. */
#include <ccl.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int rank, nranks, checks, failures;
static cclComm_t comm;

#define CCL(call)                                                            \
  do {                                                                       \
    cclResult_t r_ = (call);                                                 \
    if (r_ != cclSuccess) {                                                  \
      fprintf(stderr, "rank %d: %s failed: %s: %s\n", rank, #call,           \
              cclGetErrorString(r_), cclGetLastError(comm));                 \
      exit(2);                                                               \
    }                                                                        \
  } while (0)

static void check(int ok, const char *what, long i) {
  checks++;
  if (!ok) {
    if (failures < 20) fprintf(stderr, "rank %d: %s wrong at %ld\n", rank, what, i);
    failures++;
  }
}

/* What rank r contributes at index i: small integers, exact in every type. */
static long value(int r, long i) { return (r + 1) * 3 + (i % 7) - 4; }

static void allreduce_int32(size_t n) {
  int32_t *in = malloc(n * sizeof *in), *out = malloc(n * sizeof *out);
  for (size_t i = 0; i < n; i++) in[i] = (int32_t)value(rank, i);
  CCL(cclAllReduce(in, out, n, cclInt32, cclSum, comm, NULL));
  for (size_t i = 0; i < n; i++) {
    long want = 0;
    for (int r = 0; r < nranks; r++) want += value(r, i);
    check(out[i] == want, "allreduce int32 sum", (long)i);
  }
  CCL(cclAllReduce(in, in, n, cclInt32, cclMax, comm, NULL)); /* in place */
  for (size_t i = 0; i < n; i++) check(in[i] == value(nranks - 1, i), "allreduce int32 max in place", (long)i);
  free(in);
  free(out);
}

static void allreduce_floats(size_t n) {
  double *d = malloc(n * sizeof *d);
  float *f = malloc(n * sizeof *f);
  for (size_t i = 0; i < n; i++) d[i] = f[i] = (float)value(rank, i);
  CCL(cclAllReduce(d, d, n, cclFloat64, cclAvg, comm, NULL));
  CCL(cclAllReduce(f, f, n, cclFloat32, cclMin, comm, NULL));
  for (size_t i = 0; i < n; i++) {
    double want = 0;
    for (int r = 0; r < nranks; r++) want += value(r, i);
    check(fabs(d[i] - want / nranks) < 1e-9, "allreduce f64 avg", (long)i);
    check(f[i] == (float)value(0, i), "allreduce f32 min", (long)i);
  }
  /* A pre-multiplied sum: each rank scales its input by rank + 1. */
  double scalar = rank + 1;
  cclRedOp_t premul;
  CCL(cclRedOpCreatePreMulSum(&premul, &scalar, cclFloat64, cclScalarHostImmediate, comm));
  for (size_t i = 0; i < n; i++) d[i] = 1.0;
  CCL(cclAllReduce(d, d, n, cclFloat64, premul, comm, NULL));
  for (size_t i = 0; i < n; i++) check(d[i] == nranks * (nranks + 1) / 2.0, "allreduce premulsum", (long)i);
  CCL(cclRedOpDestroy(premul, comm));
  free(d);
  free(f);
}

static void bitwise_and_products(void) {
  uint8_t b[4] = {0xff, 0x0f, (uint8_t)(1 << rank), 0xf0};
  CCL(cclAllReduce(b, b, 4, cclUint8, cclBand, comm, NULL));
  check(b[0] == 0xff && b[1] == 0x0f && b[3] == 0xf0, "allreduce u8 band", 0);
  check(b[2] == (nranks == 1 ? 1 : 0), "allreduce u8 band", 2);
  int64_t p = 2;
  CCL(cclAllReduce(&p, &p, 1, cclInt64, cclProd, comm, NULL));
  check(p == (int64_t)1 << nranks, "allreduce i64 prod", 0);
}

static void rooted(size_t n) {
  int root = nranks - 1;
  float *buf = calloc(n, sizeof *buf);
  if (rank == root)
    for (size_t i = 0; i < n; i++) buf[i] = (float)i;
  CCL(cclBroadcast(buf, buf, n, cclFloat32, root, comm, NULL));
  for (size_t i = 0; i < n; i++) check(buf[i] == (float)i, "broadcast", (long)i);
  int32_t *in = malloc(n * sizeof *in), *out = calloc(n, sizeof *out);
  for (size_t i = 0; i < n; i++) in[i] = (int32_t)value(rank, i);
  CCL(cclReduce(in, out, n, cclInt32, cclSum, 0, comm, NULL));
  if (rank == 0)
    for (size_t i = 0; i < n; i++) {
      long want = 0;
      for (int r = 0; r < nranks; r++) want += value(r, i);
      check(out[i] == want, "reduce", (long)i);
    }
  /* Gather n from each rank to the root, then scatter it back. */
  int32_t *all = calloc(n * nranks, sizeof *all), *mine = calloc(n, sizeof *mine);
  CCL(cclGather(in, all, n, cclInt32, root, comm, NULL));
  if (rank == root)
    for (int r = 0; r < nranks; r++)
      for (size_t i = 0; i < n; i++) check(all[r * n + i] == value(r, i), "gather", (long)i);
  CCL(cclScatter(all, mine, n, cclInt32, root, comm, NULL));
  for (size_t i = 0; i < n; i++) check(mine[i] == value(rank, i), "scatter", (long)i);
  free(buf);
  free(in);
  free(out);
  free(all);
  free(mine);
}

static void blocks(size_t n) {
  size_t total = n * nranks;
  int64_t *all = malloc(total * sizeof *all), *part = malloc(n * sizeof *part);
  /* Allgather in place: this rank's part sits in its block. */
  for (size_t i = 0; i < n; i++) all[rank * n + i] = value(rank, i);
  CCL(cclAllGather(all + rank * n, all, n, cclInt64, comm, NULL));
  for (int r = 0; r < nranks; r++)
    for (size_t i = 0; i < n; i++) check(all[r * n + i] == value(r, i), "allgather in place", (long)i);
  /* Reduce-scatter: block r of the sum to rank r. */
  for (size_t i = 0; i < total; i++) all[i] = value(rank, i);
  CCL(cclReduceScatter(all, part, n, cclInt64, cclSum, comm, NULL));
  for (size_t i = 0; i < n; i++) {
    long want = 0;
    for (int r = 0; r < nranks; r++) want += value(r, rank * n + i);
    check(part[i] == want, "reduce-scatter", (long)i);
  }
  /* All-to-all in place: block p goes to rank p. */
  for (int p = 0; p < nranks; p++)
    for (size_t i = 0; i < n; i++) all[p * n + i] = rank * 1000 + p;
  CCL(cclAllToAll(all, all, n, cclInt64, comm, NULL));
  for (int r = 0; r < nranks; r++)
    for (size_t i = 0; i < n; i++) check(all[r * n + i] == r * 1000 + rank, "alltoall", (long)i);
  free(all);
  free(part);
}

static void transfers(void) {
  if (nranks < 2) return;
  int next = (rank + 1) % nranks, prev = (rank + nranks - 1) % nranks;
  double out[1000], in[1000];
  for (int i = 0; i < 1000; i++) out[i] = rank + i * 0.5;
  /* Every rank sends first: grouped, as with NCCL. */
  CCL(cclGroupStart());
  CCL(cclSend(out, 1000, cclFloat64, next, comm, NULL));
  CCL(cclRecv(in, 1000, cclFloat64, prev, comm, NULL));
  CCL(cclGroupEnd());
  for (int i = 0; i < 1000; i++) check(in[i] == prev + i * 0.5, "send/recv ring", i);
}

static void asynchronous(size_t n) {
  float *a = malloc(n * sizeof *a), *b = malloc(n * sizeof *b);
  for (size_t i = 0; i < n; i++) a[i] = b[i] = 1.0f;
  cclWork_t work;
  CCL(cclGroupStart());
  CCL(cclAllReduce(a, a, n, cclFloat32, cclSum, comm, NULL));
  CCL(cclAllReduce(b, b, n, cclFloat32, cclMax, comm, NULL));
  CCL(cclGroupEndAsync(&work));
  int done = 0;
  CCL(cclWorkTest(work, &done));
  CCL(cclWorkWait(work));
  CCL(cclWorkTest(work, &done));
  check(done == 1, "work done after wait", 0);
  CCL(cclWorkFree(work));
  for (size_t i = 0; i < n; i++) check(a[i] == nranks && b[i] == 1.0f, "grouped async", (long)i);
  free(a);
  free(b);
}

static void split(void) {
  cclComm_t half;
  CCL(cclCommSplit(comm, rank % 2, rank, &half));
  int hn, hr;
  CCL(cclCommCount(half, &hn));
  CCL(cclCommUserRank(half, &hr));
  check(hn == (nranks + 1 - rank % 2) / 2 && hr == rank / 2, "split sizes", 0);
  int32_t one = 1;
  CCL(cclAllReduce(&one, &one, 1, cclInt32, cclSum, half, NULL));
  check(one == hn, "allreduce on a split", 0);
  CCL(cclBarrier(half, NULL));
  CCL(cclCommDestroy(half));
}

int main(void) {
  int version;
  CCL(cclGetVersion(&version));
  CCL(cclCommInitEnv(&comm));
  CCL(cclCommCount(comm, &nranks));
  CCL(cclCommUserRank(comm, &rank));
  size_t sizes[] = {0, 1, 7, 1031, 300007};
  for (int s = 0; s < 5; s++) {
    allreduce_int32(sizes[s]);
    allreduce_floats(sizes[s]);
    rooted(sizes[s]);
    blocks(sizes[s]);
    asynchronous(sizes[s]);
  }
  bitwise_and_products();
  transfers();
  split();
  CCL(cclBarrier(comm, NULL));
  CCL(cclCommDestroy(comm));
  printf("rank %d: %d checks, %d failures (ccl %d)\n", rank, checks, failures, version);
  return failures ? 1 : 0;
}
