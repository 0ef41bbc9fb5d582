/* Device memory through the C interface, as NCCL programs pass it: buffers
 * from cclMemAlloc, calls queued on the GPU's default stream (a NULL stream
 * with device buffers), sends and receives grouped, and completion taken
 * from cclGroupEndAsync's work, which completes when the stream reaches the
 * calls. Run under ccl-run with CCL_CUDA_STAND_IN=1: the stand-in's device
 * memory is host memory, which this program fills and checks directly (on a
 * real GPU that would take cudaMemcpy; ccl's Rust tests cover real GPUs).
 * Exits 0 only if every check passed. */
#include <ccl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

/* Waits for everything queued so far on the default stream: a grouped
 * device call's work completes when the stream reaches it. */
static void drain(cclComm_t comm, float *scratch) {
  cclWork_t work;
  must(cclGroupStart(), comm, "group start");
  must(cclAllReduce(scratch, scratch, 1, cclFloat32, cclSum, comm, NULL), comm, "drain");
  must(cclGroupEndAsync(&work), comm, "group end async");
  must(cclWorkWait(work), comm, "work wait");
  must(cclWorkFree(work), comm, "work free");
}

int main(void) {
  const char *stand_in = getenv("CCL_CUDA_STAND_IN");
  if (!stand_in || strcmp(stand_in, "1") != 0) {
    fprintf(stderr, "device: set CCL_CUDA_STAND_IN=1 (this program touches device memory directly)\n");
    return 2;
  }
  cclComm_t comm;
  must(cclCommInitEnv(&comm), NULL, "init");
  int rank, n;
  must(cclCommUserRank(comm, &rank), comm, "rank");
  must(cclCommCount(comm, &n), comm, "count");
  const size_t count = 100003; /* many chunks with a small CCL_CUDA_CHUNK */

  float *x, *scratch;
  must(cclMemAlloc((void **)&x, count * sizeof(float)), comm, "cclMemAlloc");
  must(cclMemAlloc((void **)&scratch, sizeof(float)), comm, "cclMemAlloc");
  for (size_t i = 0; i < count; i++) x[i] = (float)(rank + (int)(i % 7));
  /* Outside a group: queued, and returns. */
  must(cclAllReduce(x, x, count, cclFloat32, cclSum, comm, NULL), comm, "allreduce");
  drain(comm, scratch);
  int ok = 1;
  for (size_t i = 0; i < count; i++)
    ok &= x[i] == (float)(n * (n - 1) / 2 + n * (int)(i % 7));
  check(ok, rank, "allreduce of device memory, in place");

  int32_t *mine, *all;
  must(cclMemAlloc((void **)&mine, 1000 * sizeof(int32_t)), comm, "cclMemAlloc");
  must(cclMemAlloc((void **)&all, 1000 * n * sizeof(int32_t)), comm, "cclMemAlloc");
  for (int i = 0; i < 1000; i++) mine[i] = rank * 1000 + i;
  must(cclAllGather(mine, all, 1000, cclInt32, comm, NULL), comm, "allgather");
  drain(comm, scratch);
  ok = 1;
  for (int i = 0; i < 1000 * n; i++) ok &= all[i] == i;
  check(ok, rank, "allgather of device memory, out of place");

  /* A ring exchange: each rank sends right and receives from the left, in
   * one group so that neither waits for the other. */
  double *out, *in;
  must(cclMemAlloc((void **)&out, count * sizeof(double)), comm, "cclMemAlloc");
  must(cclMemAlloc((void **)&in, count * sizeof(double)), comm, "cclMemAlloc");
  for (size_t i = 0; i < count; i++) out[i] = rank * 1e6 + (double)i, in[i] = -1;
  int right = (rank + 1) % n, left = (rank + n - 1) % n;
  if (n > 1) {
    cclWork_t work;
    must(cclGroupStart(), comm, "group start");
    must(cclSend(out, count, cclFloat64, right, comm, NULL), comm, "send");
    must(cclRecv(in, count, cclFloat64, left, comm, NULL), comm, "recv");
    must(cclGroupEndAsync(&work), comm, "group end async");
    must(cclWorkWait(work), comm, "work wait");
    must(cclWorkFree(work), comm, "work free");
    ok = 1;
    for (size_t i = 0; i < count; i++) ok &= in[i] == left * 1e6 + (double)i;
    check(ok, rank, "ring exchange of device memory");
  }

  /* Broadcast from the last rank, in a group ended by cclGroupEnd (which
   * queues it and returns). */
  for (size_t i = 0; i < count; i++) x[i] = rank == n - 1 ? (float)(i % 1000) : -1.0f;
  must(cclGroupStart(), comm, "group start");
  must(cclBroadcast(x, x, count, cclFloat32, n - 1, comm, NULL), comm, "broadcast");
  must(cclGroupEnd(), comm, "group end");
  drain(comm, scratch);
  ok = 1;
  for (size_t i = 0; i < count; i++) ok &= x[i] == (float)(i % 1000);
  check(ok, rank, "broadcast of device memory");

  /* Host memory passed with a stream: refused before anything is queued. */
  float host[4] = {0};
  cclResult_t r = cclAllReduce(host, host, 4, cclFloat32, cclSum, comm, (void *)x);
  check(r == cclInvalidArgument && strstr(cclGetLastError(comm), "host memory"), rank,
        "host memory with a stream is refused, naming it");
  r = cclMemFree(host);
  check(r == cclInvalidArgument, rank, "cclMemFree of memory it did not allocate");

  cclResult_t async = cclInternalError;
  must(cclCommGetAsyncError(comm, &async), comm, "cclCommGetAsyncError");
  check(async == cclSuccess, rank, "no asynchronous error");
  must(cclMemFree(x), comm, "cclMemFree");
  must(cclMemFree(scratch), comm, "cclMemFree");
  must(cclMemFree(mine), comm, "cclMemFree");
  must(cclMemFree(all), comm, "cclMemFree");
  must(cclMemFree(out), comm, "cclMemFree");
  must(cclMemFree(in), comm, "cclMemFree");
  must(cclCommDestroy(comm), NULL, "destroy");
  if (failures == 0) printf("rank %d of %d: device calls ok\n", rank, n);
  return failures == 0 ? 0 : 1;
}
