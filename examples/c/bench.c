/* Allreduce timing from C, measured the way ccl-bench measures it: warm-up
 * calls, a barrier, then per iteration the time of one cclAllReduce (f32,
 * sum, out of place) on every rank; the slowest rank's time of each
 * iteration is reduced (max) to rank 0, which prints the mean and median.
 * busbw = algbw * 2(n-1)/n, as nccl-tests reports it.
 * Run: ccl-run -n 2 ./bench SIZE [ITERS [WARMUP]]   (SIZE in bytes, K/M/G
 * suffixes are powers of two). Prints one line:
 *   c-api allreduce bytes=B ranks=N iters=I mean_us=T median_us=M algbw=A busbw=B */
#include <ccl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static cclComm_t comm;

#define CCL(call)                                                                \
  do {                                                                           \
    cclResult_t r_ = (call);                                                     \
    if (r_ != cclSuccess) {                                                      \
      fprintf(stderr, "%s failed: %s: %s\n", #call, cclGetErrorString(r_),       \
              cclGetLastError(comm));                                            \
      exit(2);                                                                   \
    }                                                                            \
  } while (0)

static size_t parse_size(const char *s) {
  char *end;
  double v = strtod(s, &end);
  switch (*end) {
    case 'K': case 'k': v *= 1024.0; break;
    case 'M': case 'm': v *= 1024.0 * 1024.0; break;
    case 'G': case 'g': v *= 1024.0 * 1024.0 * 1024.0; break;
    default: break;
  }
  return (size_t)v;
}

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static int by_value(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s SIZE [ITERS [WARMUP]]\n", argv[0]);
    return 1;
  }
  size_t bytes = parse_size(argv[1]);
  int iters = argc > 2 ? atoi(argv[2]) : 20;
  int warmup = argc > 3 ? atoi(argv[3]) : 5;
  size_t count = bytes / sizeof(float);
  if (count == 0 || iters <= 0 || warmup < 0) {
    fprintf(stderr, "SIZE must hold one f32, ITERS be positive, WARMUP not negative\n");
    return 1;
  }
  CCL(cclCommInitEnv(&comm));
  int rank, nranks;
  CCL(cclCommUserRank(comm, &rank));
  CCL(cclCommCount(comm, &nranks));

  float *in = malloc(count * sizeof(float)), *out = malloc(count * sizeof(float));
  double *times = malloc((size_t)iters * sizeof(double));
  double *slowest = malloc((size_t)iters * sizeof(double));
  if (!in || !out || !times || !slowest) {
    fprintf(stderr, "out of memory\n");
    return 1;
  }
  for (size_t i = 0; i < count; i++) in[i] = (float)(rank + 1);
  memset(out, 0, count * sizeof(float));

  for (int i = 0; i < warmup; i++) CCL(cclAllReduce(in, out, count, cclFloat32, cclSum, comm, NULL));
  CCL(cclBarrier(comm, NULL));
  for (int i = 0; i < iters; i++) {
    double start = now();
    CCL(cclAllReduce(in, out, count, cclFloat32, cclSum, comm, NULL));
    times[i] = now() - start;
  }
  /* Each element is 1 + 2 + ... + n: a wrong result must not pass as fast. */
  float want = (float)nranks * (float)(nranks + 1) / 2.0f;
  if (out[0] != want || out[count - 1] != want) {
    fprintf(stderr, "rank %d: wrong result %g, want %g\n", rank, out[0], want);
    return 3;
  }
  CCL(cclReduce(times, slowest, (size_t)iters, cclFloat64, cclMax, 0, comm, NULL));
  if (rank == 0) {
    double mean = 0;
    for (int i = 0; i < iters; i++) mean += slowest[i];
    mean /= iters;
    qsort(slowest, (size_t)iters, sizeof(double), by_value);
    double median = iters % 2 ? slowest[iters / 2]
                              : (slowest[iters / 2 - 1] + slowest[iters / 2]) / 2;
    double algbw = (double)(count * sizeof(float)) / mean / 1e9;
    double busbw = algbw * 2.0 * (nranks - 1) / nranks;
    printf("c-api allreduce bytes=%zu ranks=%d iters=%d mean_us=%.3f median_us=%.3f "
           "algbw=%.3f busbw=%.3f\n",
           count * sizeof(float), nranks, iters, mean * 1e6, median * 1e6, algbw, busbw);
  }
  CCL(cclCommDestroy(comm));
  free(in);
  free(out);
  free(times);
  free(slowest);
  return 0;
}
