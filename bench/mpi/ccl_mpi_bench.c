/*
 * ccl_mpi_bench: the OpenMPI side of `ccl-bench compare-mpi`.
 *
 * Times the same collectives on the same sizes as ccl-bench and prints the
 * same nccl-tests-style table, so that the two can be read side by side:
 *
 *   mpirun -np 2 ccl_mpi_bench allreduce -b 8 -e 268435456 -f 2 -n 20 -w 5 -d f32 -o sum
 *
 * Sizes are bytes (ccl-bench passes them already parsed). Conventions match
 * ccl-bench: size is the whole buffer (n x per-rank part for allgather,
 * reduce-scatter, alltoall, gather, scatter), rounded down to whole elements
 * per rank (at least one); time is the slowest rank's time for the whole
 * loop of iterations (from a barrier to its last call's return, as
 * nccl-tests times it) over the iterations; GB/s are 1e9 bytes per second;
 * busbw uses nccl-tests' factors. Data are not verified (#wrong is N/A).
 * -i: in-place forms; -v: after each row, a comment line with the median,
 * fastest and slowest iteration (each iteration the slowest rank's time from
 * the end of its previous one).
 *
 * Build: mpicc -O2 -o ccl_mpi_bench ccl_mpi_bench.c  (or bench/mpi/build.sh)
 */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum coll {
    ALLREDUCE, BROADCAST, REDUCE, ALLGATHER, REDUCE_SCATTER,
    ALLTOALL, GATHER, SCATTER, SENDRECV, BARRIER
};
static const char *coll_names[] = {
    "allreduce", "broadcast", "reduce", "allgather", "reduce-scatter",
    "alltoall", "gather", "scatter", "sendrecv", "barrier"
};

struct dtype { const char *name; MPI_Datatype type; int size; };
static const struct dtype dtypes[] = {
    {"i8", MPI_INT8_T, 1},   {"u8", MPI_UINT8_T, 1},   {"i32", MPI_INT32_T, 4},
    {"u32", MPI_UINT32_T, 4}, {"i64", MPI_INT64_T, 8}, {"u64", MPI_UINT64_T, 8},
    {"f32", MPI_FLOAT, 4},   {"f64", MPI_DOUBLE, 8},
};

struct op { const char *name; MPI_Op op; };

static int rank, nranks;

static void die(const char *msg, const char *arg) {
    if (rank == 0) fprintf(stderr, "ccl_mpi_bench: %s%s\n", msg, arg ? arg : "");
    MPI_Finalize();
    exit(2);
}

/* Elements per rank for a size in bytes (see the header comment). */
static size_t per_rank_count(enum coll c, size_t bytes, int esize) {
    size_t n = (size_t)nranks, count = bytes / (size_t)esize;
    switch (c) {
    case ALLGATHER: case REDUCE_SCATTER: case ALLTOALL: case GATHER: case SCATTER:
        count /= n;
        break;
    default:
        break;
    }
    return count ? count : 1;
}

/* Bytes the table reports for a per-rank count: the whole buffer. */
static size_t total_bytes(enum coll c, size_t count, int esize) {
    switch (c) {
    case ALLGATHER: case REDUCE_SCATTER: case ALLTOALL: case GATHER: case SCATTER:
        return count * (size_t)nranks * (size_t)esize;
    case BARRIER:
        return 0;
    default:
        return count * (size_t)esize;
    }
}

static double bus_factor(enum coll c) {
    double n = nranks;
    switch (c) {
    case ALLREDUCE: return 2.0 * (n - 1) / n;
    case ALLGATHER: case REDUCE_SCATTER: case ALLTOALL: case GATHER: case SCATTER:
        return (n - 1) / n;
    default: return 1.0;
    }
}

static int has_root(enum coll c) {
    return c == BROADCAST || c == REDUCE || c == GATHER || c == SCATTER;
}

static int has_op(enum coll c) {
    return c == ALLREDUCE || c == REDUCE || c == REDUCE_SCATTER;
}

static void run_once(enum coll c, void *in, void *out, size_t count, MPI_Datatype t,
                     MPI_Op op, int root, int inplace) {
    int ic = (int)count;
    int next = (rank + 1) % nranks, prev = (rank + nranks - 1) % nranks;
    size_t esize;
    MPI_Aint lb, extent;
    MPI_Type_get_extent(t, &lb, &extent);
    esize = (size_t)extent;
    switch (c) {
    case ALLREDUCE:
        MPI_Allreduce(inplace ? MPI_IN_PLACE : in, out, ic, t, op, MPI_COMM_WORLD);
        break;
    case BROADCAST:
        MPI_Bcast(out, ic, t, root, MPI_COMM_WORLD);
        break;
    case REDUCE:
        MPI_Reduce(inplace && rank == root ? MPI_IN_PLACE : in, out, ic, t, op, root,
                   MPI_COMM_WORLD);
        break;
    case ALLGATHER:
        if (inplace)
            MPI_Allgather(MPI_IN_PLACE, 0, t, out, ic, t, MPI_COMM_WORLD);
        else
            MPI_Allgather(in, ic, t, out, ic, t, MPI_COMM_WORLD);
        break;
    case REDUCE_SCATTER:
        MPI_Reduce_scatter_block(inplace ? MPI_IN_PLACE : in, inplace ? in : out, ic, t, op,
                                 MPI_COMM_WORLD);
        break;
    case ALLTOALL:
        if (inplace)
            MPI_Alltoall(MPI_IN_PLACE, 0, t, out, ic, t, MPI_COMM_WORLD);
        else
            MPI_Alltoall(in, ic, t, out, ic, t, MPI_COMM_WORLD);
        break;
    case GATHER:
        if (inplace && rank == root)
            MPI_Gather(MPI_IN_PLACE, 0, t, out, ic, t, root, MPI_COMM_WORLD);
        else
            MPI_Gather(in, ic, t, out, ic, t, root, MPI_COMM_WORLD);
        break;
    case SCATTER:
        if (inplace && rank == root)
            MPI_Scatter(in, ic, t, MPI_IN_PLACE, 0, t, root, MPI_COMM_WORLD);
        else
            MPI_Scatter(in, ic, t, out, ic, t, root, MPI_COMM_WORLD);
        break;
    case SENDRECV:
        if (nranks == 1)
            memcpy(out, in, count * esize);
        else
            MPI_Sendrecv(in, ic, t, next, 0, out, ic, t, prev, 0, MPI_COMM_WORLD,
                         MPI_STATUS_IGNORE);
        break;
    case BARRIER:
        MPI_Barrier(MPI_COMM_WORLD);
        break;
    }
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static size_t parse_size(const char *s) {
    char *end;
    unsigned long long v = strtoull(s, &end, 10);
    if (*s == '-' || *end != '\0' || v == 0) die("bad size (expected a positive number of bytes): ", s);
    return (size_t)v;
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &nranks);

    static const struct op ops[] = {
        {"sum", MPI_SUM}, {"prod", MPI_PROD}, {"min", MPI_MIN}, {"max", MPI_MAX},
        {"band", MPI_BAND}, {"bor", MPI_BOR}, {"bxor", MPI_BXOR},
    };
    if (argc < 2) die("usage: ccl_mpi_bench COLLECTIVE [-b MIN] [-e MAX] [-f FACTOR] [-n ITERS] [-w WARMUP] [-d DTYPE] [-o OP] [-r ROOT] [-i] [-v]", NULL);
    int ci = -1;
    for (int i = 0; i < (int)(sizeof coll_names / sizeof *coll_names); i++)
        if (strcmp(argv[1], coll_names[i]) == 0) ci = i;
    if (ci < 0) die("unknown collective: ", argv[1]);
    enum coll c = (enum coll)ci;

    size_t minb = 8, maxb = 8;
    double factor = 2;
    int iters = 20, warmup = 5, root = 0, inplace = 0, verbose = 0;
    const struct dtype *dt = &dtypes[6];
    const struct op *op = &ops[0];
    for (int i = 2; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "-i") == 0) { inplace = 1; continue; }
        if (strcmp(a, "-v") == 0) { verbose = 1; continue; }
        if (!v) die("missing value after ", a);
        i++;
        if (strcmp(a, "-b") == 0) minb = parse_size(v);
        else if (strcmp(a, "-e") == 0) maxb = parse_size(v);
        else if (strcmp(a, "-f") == 0) factor = atof(v);
        else if (strcmp(a, "-n") == 0) iters = atoi(v);
        else if (strcmp(a, "-w") == 0) warmup = atoi(v);
        else if (strcmp(a, "-r") == 0) root = atoi(v);
        else if (strcmp(a, "-d") == 0) {
            dt = NULL;
            for (size_t k = 0; k < sizeof dtypes / sizeof *dtypes; k++)
                if (strcmp(v, dtypes[k].name) == 0) dt = &dtypes[k];
            if (!dt) die("unsupported dtype for MPI: ", v);
        } else if (strcmp(a, "-o") == 0) {
            op = NULL;
            for (size_t k = 0; k < sizeof ops / sizeof *ops; k++)
                if (strcmp(v, ops[k].name) == 0) op = &ops[k];
            if (!op) die("unsupported op for MPI: ", v);
        } else die("unknown option: ", a);
    }
    if (maxb < minb) die("max size is below min size", NULL);
    if (factor <= 1.0) die("factor must be above 1", NULL);
    if (iters < 1) die("iterations must be at least 1", NULL);
    if (root < 0 || root >= nranks) die("root is not below the number of ranks", NULL);
    if (c == BARRIER) minb = maxb = 1;

    char version[MPI_MAX_LIBRARY_VERSION_STRING];
    int vlen;
    MPI_Get_library_version(version, &vlen);
    /* the first line, up to its first comma (MPICH's string has many lines) */
    version[strcspn(version, ",\n")] = '\0';
    if (rank == 0) {
        printf("# ccl_mpi_bench %s: %d ranks, dtype %s, op %s, root %d, %s, iters %d, warmup %d\n",
               coll_names[c], nranks, dt->name, has_op(c) ? op->name : "none", root,
               inplace ? "in-place" : "out-of-place", iters, warmup);
        printf("# library: %s\n", version);
        printf("#\n# %12s %12s %6s %6s %5s %10s %12s %8s %8s %7s\n", "size", "count", "type",
               "redop", "root", "algo", "time", "algbw", "busbw", "#wrong");
        printf("# %12s %12s %6s %6s %5s %10s %12s %8s %8s\n", "(B)", "(elements)", "", "", "",
               "", "(us)", "(GB/s)", "(GB/s)");
        fflush(stdout);
    }

    double *times = malloc(sizeof(double) * (size_t)iters);
    double *maxes = malloc(sizeof(double) * (size_t)iters);
    /* Touched now, so that the timed loops take no page faults on them. */
    memset(times, 0, sizeof(double) * (size_t)iters);
    double bw_sum = 0, bw_peak = 0;
    int rows = 0;
    size_t last = 0;
    for (double s = (double)minb; s <= (double)maxb * 1.0000001; s *= factor) {
        size_t count = c == BARRIER ? 0 : per_rank_count(c, (size_t)s, dt->size);
        size_t bytes = total_bytes(c, count, dt->size);
        if (c != BARRIER && bytes == last) continue;
        last = bytes;
        size_t es = (size_t)dt->size, n = (size_t)nranks;
        size_t in_elems = count, out_elems = count;
        switch (c) {
        case ALLGATHER: out_elems = n * count; if (inplace) in_elems = 0; break;
        case REDUCE_SCATTER: in_elems = n * count; break;
        case ALLTOALL: in_elems = out_elems = n * count; break;
        case GATHER: out_elems = n * count; break;
        case SCATTER: in_elems = n * count; break;
        default: break;
        }
        char *in = calloc(in_elems ? in_elems : 1, es);
        char *out = calloc(out_elems ? out_elems : 1, es);
        for (size_t k = 0; k < in_elems * es; k++) in[k] = (char)((k * 7 + (size_t)rank) % 5 + 1);
        for (size_t k = 0; k < out_elems * es; k++) out[k] = (char)((k * 3 + (size_t)rank) % 5 + 1);
        void *ip = in, *op_ = out;
        for (int w = 0; w < warmup; w++)
            run_once(c, ip, op_, count, dt->type, op->op, root, inplace);
        MPI_Barrier(MPI_COMM_WORLD);
        double start = MPI_Wtime(), last = start;
        for (int it = 0; it < iters; it++) {
            run_once(c, ip, op_, count, dt->type, op->op, root, inplace);
            double now = MPI_Wtime();
            times[it] = now - last;
            last = now;
        }
        double mine = (last - start) / iters, t = 0;
        MPI_Reduce(times, maxes, iters, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
        MPI_Reduce(&mine, &t, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
        if (rank == 0) {
            double algbw = t > 0 ? (double)bytes / 1e9 / t : 0;
            double busbw = algbw * bus_factor(c);
            bw_sum += busbw;
            if (busbw > bw_peak) bw_peak = busbw;
            rows++;
            printf("  %12zu %12zu %6s %6s %5d %10s %12.3f %8.3f %8.3f %7s\n", bytes,
                   c == BARRIER ? (size_t)0 : bytes / es, dt->name, has_op(c) ? op->name : "none",
                   has_root(c) ? root : -1, "mpi", t * 1e6, algbw, busbw, "N/A");
            if (verbose) {
                qsort(maxes, (size_t)iters, sizeof(double), cmp_double);
                double med = iters % 2 ? maxes[iters / 2]
                                       : (maxes[iters / 2 - 1] + maxes[iters / 2]) / 2;
                printf("#  per iteration (slowest rank): median %.2f us, min %.2f us, "
                       "max %.2f us\n", med * 1e6, maxes[0] * 1e6, maxes[iters - 1] * 1e6);
            }
            fflush(stdout);
        }
        free(in);
        free(out);
        if (c == BARRIER) break;
    }
    if (rank == 0) {
        printf("# Avg bus bandwidth    : %.3f GB/s\n", rows ? bw_sum / rows : 0.0);
        printf("# Peak bus bandwidth   : %.3f GB/s\n", bw_peak);
    }
    free(times);
    free(maxes);
    MPI_Finalize();
    return 0;
}
