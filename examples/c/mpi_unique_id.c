/* ccl beside MPI in one program: rank 0 makes a ccl unique id, MPI_Bcast
 * hands it to every rank, each makes its ccl communicator from it, and then
 * every collective runs through MPI and through ccl on the same data; the
 * results must match. Run: mpirun -n 4 ./mpi_unique_id
 * Prints "rank R: N comparisons, F differences" and exits 0 only if F is 0. */
#include <ccl.h>
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int rank, nranks, compared, differences;
static cclComm_t comm;

#define CCL(call)                                                            \
  do {                                                                       \
    cclResult_t r_ = (call);                                                 \
    if (r_ != cclSuccess) {                                                  \
      fprintf(stderr, "rank %d: %s failed: %s: %s\n", rank, #call,           \
              cclGetErrorString(r_), cclGetLastError(comm));                 \
      MPI_Abort(MPI_COMM_WORLD, 2);                                          \
    }                                                                        \
  } while (0)

static void same(const void *a, const void *b, size_t bytes, const char *what) {
  compared++;
  if (memcmp(a, b, bytes) != 0) {
    fprintf(stderr, "rank %d: %s differs between ccl and MPI\n", rank, what);
    differences++;
  }
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &nranks);
  cclUniqueId id;
  if (rank == 0) CCL(cclGetUniqueId(&id));
  MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD);
  CCL(cclCommInitRank(&comm, nranks, id, rank));
  int crank, cn;
  CCL(cclCommUserRank(comm, &crank));
  CCL(cclCommCount(comm, &cn));
  if (crank != rank || cn != nranks) {
    fprintf(stderr, "rank %d: ccl says rank %d of %d\n", rank, crank, cn);
    MPI_Abort(MPI_COMM_WORLD, 2);
  }

  size_t counts[] = {1, 1000, 262147};
  for (int c = 0; c < 3; c++) {
    size_t n = counts[c];
    int32_t *in = malloc(n * sizeof *in), *a = malloc(n * nranks * sizeof *a),
            *b = malloc(n * nranks * sizeof *b);
    double *din = malloc(n * sizeof *din), *da = malloc(n * sizeof *da), *db = malloc(n * sizeof *db);
    for (size_t i = 0; i < n; i++) {
      in[i] = (int32_t)((rank + 1) * 31 + i % 17) - 40;
      din[i] = 0.5 * rank + (double)(i % 13);
    }
    MPI_Allreduce(in, a, (int)n, MPI_INT32_T, MPI_SUM, MPI_COMM_WORLD);
    CCL(cclAllReduce(in, b, n, cclInt32, cclSum, comm, NULL));
    same(a, b, n * sizeof *a, "allreduce int32 sum");
    MPI_Allreduce(din, da, (int)n, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    CCL(cclAllReduce(din, db, n, cclFloat64, cclMax, comm, NULL));
    same(da, db, n * sizeof *da, "allreduce f64 max");
    MPI_Allgather(in, (int)n, MPI_INT32_T, a, (int)n, MPI_INT32_T, MPI_COMM_WORLD);
    CCL(cclAllGather(in, b, n, cclInt32, comm, NULL));
    same(a, b, n * nranks * sizeof *a, "allgather");
    memcpy(a, in, n * sizeof *a);
    memcpy(b, in, n * sizeof *b);
    MPI_Bcast(a, (int)n, MPI_INT32_T, nranks - 1, MPI_COMM_WORLD);
    CCL(cclBroadcast(b, b, n, cclInt32, nranks - 1, comm, NULL));
    same(a, b, n * sizeof *a, "broadcast");
    int32_t *all = malloc(n * nranks * sizeof *all);
    for (size_t i = 0; i < n * nranks; i++) all[i] = (int32_t)(i % 101) * (rank + 1);
    MPI_Reduce_scatter_block(all, a, (int)n, MPI_INT32_T, MPI_SUM, MPI_COMM_WORLD);
    CCL(cclReduceScatter(all, b, n, cclInt32, cclSum, comm, NULL));
    same(a, b, n * sizeof *a, "reduce-scatter");
    MPI_Alltoall(all, (int)n, MPI_INT32_T, a, (int)n, MPI_INT32_T, MPI_COMM_WORLD);
    CCL(cclAllToAll(all, b, n, cclInt32, comm, NULL));
    same(a, b, n * nranks * sizeof *a, "alltoall");
    MPI_Reduce(in, a, (int)n, MPI_INT32_T, MPI_MIN, 0, MPI_COMM_WORLD);
    CCL(cclReduce(in, b, n, cclInt32, cclMin, 0, comm, NULL));
    if (rank == 0) same(a, b, n * sizeof *a, "reduce min");
    free(in);
    free(a);
    free(b);
    free(din);
    free(da);
    free(db);
    free(all);
  }
  CCL(cclBarrier(comm, NULL));
  CCL(cclCommDestroy(comm));
  printf("rank %d: %d comparisons, %d differences\n", rank, compared, differences);
  MPI_Finalize();
  return differences ? 1 : 0;
}
