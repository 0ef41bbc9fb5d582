/* Every misuse of the C interface gives its result code and a message,
 * never undefined behaviour. Run under valgrind (or AddressSanitizer) so
 * that a silent memory error fails too. One process; the communicators of
 * more than one rank have their ranks as threads. Exits 0 only if every
 * case gave what it should. */
#include <ccl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int cases, failed;

static void sleep_ms(long ms) {
  struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
  nanosleep(&t, NULL);
}

static void expect(cclResult_t got, cclResult_t want, cclComm_t comm, const char *what) {
  cases++;
  const char *msg = cclGetLastError(comm);
  if (got != want || (want != cclSuccess && (msg == NULL || msg[0] == '\0'))) {
    fprintf(stderr, "FAIL %s: got %d (%s), want %d; message: %s\n", what, got,
            cclGetErrorString(got), want, msg ? msg : "(null)");
    failed++;
  } else if (want != cclSuccess) {
    printf("ok   %-44s %-18s %s\n", what, cclGetErrorString(got), msg);
  }
}

static cclUniqueId id2;
static cclComm_t pair[2];
/* Set by the main thread just before rank 0's allreduce, and by the
 * intruder once it has made its call: rank 1 joins only then, so rank 0's
 * call cannot be over before the intruder tried (valgrind starves threads). */
static int entered, intruded;

static void await_flag(int *flag) {
  while (!__atomic_load_n(flag, __ATOMIC_ACQUIRE)) sleep_ms(1);
}

static void *rank_thread(void *arg) {
  int r = (int)(intptr_t)arg;
  expect(cclCommInitRank(&pair[r], 2, id2, r), cclSuccess, NULL, "init rank of a pair");
  return NULL;
}

static void *late_rank_one(void *arg) {
  (void)arg;
  await_flag(&intruded);
  float x = 1;
  expect(cclAllReduce(&x, &x, 1, cclFloat32, cclSum, pair[1], NULL), cclSuccess, pair[1],
         "rank 1's allreduce, late");
  return NULL;
}

static void *intruder(void *arg) {
  (void)arg;
  await_flag(&entered);
  /* Time for the main thread to get from the flag into the call. */
  sleep_ms(500);
  expect(cclBarrier(pair[0], NULL), cclInvalidArgument, pair[0],
         "a call while another thread is in one");
  __atomic_store_n(&intruded, 1, __ATOMIC_RELEASE);
  return NULL;
}

int main(void) {
  float f[8] = {0}, g[8] = {0};
  double d = 0.5;
  int n;
  cclComm_t comm;
  cclUniqueId id;

  /* Null pointers, bad ids, bad handles. */
  expect(cclGetVersion(NULL), cclInvalidArgument, NULL, "version into NULL");
  expect(cclGetUniqueId(NULL), cclInvalidArgument, NULL, "unique id into NULL");
  expect(cclCommInitEnv(NULL), cclInvalidArgument, NULL, "communicator into NULL");
  memset(&id, 0, sizeof id);
  expect(cclCommInitRank(&comm, 1, id, 0), cclInvalidArgument, NULL, "an id not made by ccl");
  expect(cclCommInitStore(&comm, 1, 0, NULL, 1), cclInvalidArgument, NULL, "store host NULL");
  cclComm_t foreign = (cclComm_t)(uintptr_t)0x1234567;
  expect(cclCommCount(foreign, &n), cclInvalidArgument, foreign, "a made-up handle");
  expect(cclAllReduce(f, f, 8, cclFloat32, cclSum, NULL, NULL), cclInvalidArgument, NULL,
         "a NULL communicator");

  /* A communicator of one rank, from a unique id. */
  expect(cclGetUniqueId(&id), cclSuccess, NULL, "unique id");
  expect(cclCommInitRank(&comm, 1, id, 0), cclSuccess, NULL, "init rank 0 of 1");
  expect(cclCommInitRank(&comm, 1, id, 5), cclConfigError, NULL, "init rank 5 of 1");
  expect(cclCommInitRank(&comm, -2, id, 0), cclInvalidArgument, NULL, "init with -2 ranks");
  expect(cclCommCount(comm, NULL), cclInvalidArgument, comm, "count into NULL");

  /* Arguments of calls. */
  expect(cclAllReduce(f, g, 8, 42, cclSum, comm, NULL), cclInvalidArgument, comm, "dtype 42");
  expect(cclAllReduce(f, g, 8, cclFloat32, 99, comm, NULL), cclInvalidArgument, comm, "op 99");
  expect(cclAllReduce(f, g, 8, cclFloat32, cclBand, comm, NULL), cclInvalidArgument, comm,
         "bitwise and on floats");
  expect(cclBroadcast(f, f, 8, cclFloat32, -1, comm, NULL), cclInvalidArgument, comm,
         "root -1");
  expect(cclReduce(f, g, 8, cclFloat32, cclSum, 1, comm, NULL), cclInvalidArgument, comm,
         "root 1 of 1");
  expect(cclAllReduce(f, g, SIZE_MAX, cclFloat64, cclSum, comm, NULL), cclInvalidArgument, comm,
         "a count whose bytes overflow");
  expect(cclAllReduce(NULL, g, 8, cclFloat32, cclSum, comm, NULL), cclInvalidArgument, comm,
         "sendbuff NULL");
  expect(cclAllReduce(f, NULL, 8, cclFloat32, cclSum, comm, NULL), cclInvalidArgument, comm,
         "recvbuff NULL");
  expect(cclAllReduce((char *)f + 1, g, 4, cclFloat32, cclSum, comm, NULL), cclInvalidArgument,
         comm, "a misaligned buffer of a reduction");
  expect(cclAllReduce(f, (char *)f + 4, 4, cclFloat32, cclSum, comm, NULL), cclInvalidArgument,
         comm, "buffers overlapping, not in place");
  expect(cclAllReduce(f, g, 8, cclFloat32, cclSum, comm, (void *)f), cclUnsupported, comm,
         "a stream without a CUDA driver");
  expect(cclAllReduce(NULL, NULL, 0, cclFloat32, cclSum, comm, NULL), cclSuccess, comm,
         "count 0 with NULL buffers");
  expect(cclSend(f, 8, cclFloat32, 0, comm, NULL), cclInvalidArgument, comm, "send to itself");
  expect(cclRecv(f, 8, cclFloat32, 3, comm, NULL), cclInvalidArgument, comm, "recv from rank 3 of 1");
  expect(cclCommSplit(comm, -5, 0, &comm), cclInvalidArgument, comm, "split color -5");
  expect(cclCommSetTimeout(comm, -1.0), cclInvalidArgument, comm, "a negative timeout");

  /* Ops made on the communicator. */
  cclRedOp_t op;
  expect(cclRedOpCreatePreMulSum(&op, &d, cclFloat64, cclScalarDevice, comm), cclUnsupported,
         comm, "a scalar in device memory");
  float fhalf = 0.5f;
  int32_t ihalf[2] = {0, 0};
  double dhalf = 0.5;
  expect(cclRedOpCreatePreMulSum(&op, &dhalf, cclFloat64, cclScalarHostImmediate, comm),
         cclSuccess, comm, "premulsum op for f64");
  expect(cclAllReduce(ihalf, ihalf, 2, cclInt32, op, comm, NULL), cclInvalidArgument, comm,
         "a fractional premulsum on int32");
  expect(cclRedOpDestroy(op, comm), cclSuccess, comm, "destroy that op");
  expect(cclRedOpCreatePreMulSum(&op, &fhalf, cclFloat32, cclScalarHostImmediate, comm),
         cclSuccess, comm, "premulsum op");
  expect(cclAllReduce(f, g, 8, cclFloat32, op, comm, NULL), cclSuccess, comm, "allreduce premulsum");
  expect(cclRedOpDestroy(op, comm), cclSuccess, comm, "destroy op");
  expect(cclRedOpDestroy(op, comm), cclInvalidArgument, comm, "destroy op twice");
  expect(cclAllReduce(f, g, 8, cclFloat32, op, comm, NULL), cclInvalidArgument, comm,
         "a destroyed op");

  /* Groups and works. */
  cclWork_t work;
  expect(cclGroupEnd(), cclInvalidArgument, NULL, "group end without start");
  expect(cclWorkWait((cclWork_t)(uintptr_t)0x55), cclInvalidArgument, NULL, "a made-up work");
  expect(cclGroupStart(), cclSuccess, NULL, "group start");
  expect(cclAllReduce(f, f, 8, cclFloat32, cclSum, comm, NULL), cclSuccess, comm, "in a group");
  /* A refused end leaves the group open. */
  expect(cclGroupEndAsync(NULL), cclInvalidArgument, NULL, "group end into NULL");
  expect(cclGroupEndAsync(&work), cclSuccess, NULL, "group end async");
  expect(cclWorkWait(work), cclSuccess, NULL, "work wait");
  expect(cclWorkFree(work), cclSuccess, NULL, "work free");
  expect(cclWorkFree(work), cclInvalidArgument, NULL, "work free twice");

  /* Error strings for every code, and one for no code at all. */
  for (int c = 0; c <= 12; c++) {
    cases++;
    if (cclGetErrorString(c) == NULL || cclGetErrorString(c)[0] == '\0') failed++;
  }

  /* Destroyed handles. */
  expect(cclCommDestroy(comm), cclSuccess, NULL, "destroy");
  expect(cclCommDestroy(comm), cclInvalidArgument, NULL, "destroy twice");
  expect(cclBarrier(comm, NULL), cclInvalidArgument, comm, "a call on a destroyed handle");

  /* Two ranks as threads: a second thread on rank 0's communicator while
   * the first waits in a call for rank 1 is refused. */
  expect(cclGetUniqueId(&id2), cclSuccess, NULL, "unique id for a pair");
  pthread_t t[2];
  for (intptr_t r = 0; r < 2; r++) pthread_create(&t[r], NULL, rank_thread, (void *)r);
  for (int r = 0; r < 2; r++) pthread_join(t[r], NULL);
  pthread_t late, other;
  pthread_create(&late, NULL, late_rank_one, NULL);
  pthread_create(&other, NULL, intruder, NULL);
  float x = 1;
  __atomic_store_n(&entered, 1, __ATOMIC_RELEASE);
  expect(cclAllReduce(&x, &x, 1, cclFloat32, cclSum, pair[0], NULL), cclSuccess, pair[0],
         "rank 0's allreduce");
  pthread_join(late, NULL);
  pthread_join(other, NULL);
  cases++;
  if (x != 2) failed++;
  /* Abort from another thread makes later calls fail as broken. */
  expect(cclCommAbort(pair[0]), cclSuccess, pair[0], "abort");
  expect(cclBarrier(pair[0], NULL), cclBroken, pair[0], "a call after abort");
  expect(cclCommDestroy(pair[0]), cclSuccess, NULL, "destroy rank 0");
  expect(cclCommDestroy(pair[1]), cclSuccess, NULL, "destroy rank 1");

  printf("%d cases, %d failed\n", cases, failed);
  return failed ? 1 : 0;
}
