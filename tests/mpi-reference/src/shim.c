/*
 * The few MPI calls the reference harness makes, behind a C ABI that Rust
 * can declare without bindings: communicators are small integer handles
 * (0 is MPI_COMM_WORLD), data types and ops are ccl's own tags.
 *
 * Data type codes (ccl's DataType tags): 1 i8, 2 u8, 3 i32, 4 u32, 5 i64,
 * 6 u64, 7 f16 and 8 bf16 (moved as 16-bit unsigned integers: MPI has no
 * 16-bit floats, so they are never reduced here), 9 f32, 10 f64.
 * Op codes (ccl's ReduceOp tags): 1 sum, 2 prod, 3 min, 4 max, 6 band,
 * 7 bor, 8 bxor. Avg and premulsum are built from sum by the caller.
 *
 * Every function returns an MPI error code (MPI_SUCCESS is 0), or
 * SHIM_BAD_ARGUMENT for a code or handle it does not know. `in_place` asks
 * for MPI_IN_PLACE where the MPI call allows it (at the root only for the
 * rooted calls).
 */
#include <mpi.h>
#include <stddef.h>

#define SHIM_BAD_ARGUMENT (-1000)
#define MAX_COMMS 256

static MPI_Comm comms[MAX_COMMS];

static MPI_Datatype dtype_of(int code) {
    switch (code) {
    case 1: return MPI_INT8_T;
    case 2: return MPI_UINT8_T;
    case 3: return MPI_INT32_T;
    case 4: return MPI_UINT32_T;
    case 5: return MPI_INT64_T;
    case 6: return MPI_UINT64_T;
    case 7:
    case 8: return MPI_UINT16_T;
    case 9: return MPI_FLOAT;
    case 10: return MPI_DOUBLE;
    default: return MPI_DATATYPE_NULL;
    }
}

static MPI_Op op_of(int code) {
    switch (code) {
    case 1: return MPI_SUM;
    case 2: return MPI_PROD;
    case 3: return MPI_MIN;
    case 4: return MPI_MAX;
    case 6: return MPI_BAND;
    case 7: return MPI_BOR;
    case 8: return MPI_BXOR;
    default: return MPI_OP_NULL;
    }
}

static int comm_of(int h, MPI_Comm *c) {
    if (h < 0 || h >= MAX_COMMS || comms[h] == MPI_COMM_NULL) return SHIM_BAD_ARGUMENT;
    *c = comms[h];
    return MPI_SUCCESS;
}

#define COMM(h)                                 \
    MPI_Comm comm;                              \
    if (comm_of((h), &comm) != MPI_SUCCESS)     \
        return SHIM_BAD_ARGUMENT;
#define DTYPE(code)                             \
    MPI_Datatype dt = dtype_of(code);           \
    if (dt == MPI_DATATYPE_NULL)                \
        return SHIM_BAD_ARGUMENT;
/* 16-bit floats travel as integers: reducing them here would be wrong. */
#define OP(code, dcode)                                         \
    MPI_Op mop = op_of(code);                                   \
    if (mop == MPI_OP_NULL || (dcode) == 7 || (dcode) == 8)     \
        return SHIM_BAD_ARGUMENT;

static int rank_in(MPI_Comm comm) {
    int r = -1;
    MPI_Comm_rank(comm, &r);
    return r;
}

int shim_init(void) {
    int rc = MPI_Init(NULL, NULL);
    if (rc != MPI_SUCCESS) return rc;
    for (int i = 0; i < MAX_COMMS; i++) comms[i] = MPI_COMM_NULL;
    comms[0] = MPI_COMM_WORLD;
    return MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
}

int shim_finalize(void) { return MPI_Finalize(); }

void shim_abort(int code) { MPI_Abort(MPI_COMM_WORLD, code); }

/* Writes the message of `rc` (NUL-terminated) into buf. */
void shim_error_string(int rc, char *buf, int len) {
    char msg[MPI_MAX_ERROR_STRING];
    int n = 0;
    if (rc == SHIM_BAD_ARGUMENT || MPI_Error_string(rc, msg, &n) != MPI_SUCCESS) {
        n = 0;
        const char *s = rc == SHIM_BAD_ARGUMENT ? "bad handle, data type or op code" : "unknown MPI error";
        while (s[n] && n < MPI_MAX_ERROR_STRING - 1) { msg[n] = s[n]; n++; }
    }
    int i = 0;
    for (; i < n && i < len - 1; i++) buf[i] = msg[i];
    if (len > 0) buf[i] = 0;
}

int shim_rank(int h, int *rank) { COMM(h); return MPI_Comm_rank(comm, rank); }

int shim_size(int h, int *size) { COMM(h); return MPI_Comm_size(comm, size); }

/* MPI_Comm_split; color < 0 is MPI_UNDEFINED. *out is the new handle, or -1 for MPI_COMM_NULL. */
int shim_split(int h, int color, int key, int *out) {
    COMM(h);
    MPI_Comm nc = MPI_COMM_NULL;
    int rc = MPI_Comm_split(comm, color < 0 ? MPI_UNDEFINED : color, key, &nc);
    if (rc != MPI_SUCCESS) return rc;
    *out = -1;
    if (nc == MPI_COMM_NULL) return MPI_SUCCESS;
    for (int i = 1; i < MAX_COMMS; i++) {
        if (comms[i] == MPI_COMM_NULL) {
            comms[i] = nc;
            *out = i;
            return MPI_SUCCESS;
        }
    }
    MPI_Comm_free(&nc);
    return SHIM_BAD_ARGUMENT;
}

int shim_free(int h) {
    if (h <= 0) return SHIM_BAD_ARGUMENT;
    COMM(h);
    int rc = MPI_Comm_free(&comm);
    comms[h] = MPI_COMM_NULL;
    return rc;
}

int shim_allreduce(int h, const void *send, void *recv, int count, int code_dtype, int code_op,
                   int in_place) {
    COMM(h);
    DTYPE(code_dtype);
    OP(code_op, code_dtype);
    return MPI_Allreduce(in_place ? MPI_IN_PLACE : send, recv, count, dt, mop, comm);
}

int shim_bcast(int h, void *buf, int count, int code_dtype, int root) {
    COMM(h);
    DTYPE(code_dtype);
    return MPI_Bcast(buf, count, dt, root, comm);
}

int shim_reduce(int h, const void *send, void *recv, int count, int code_dtype, int code_op,
                int root, int in_place) {
    COMM(h);
    DTYPE(code_dtype);
    OP(code_op, code_dtype);
    int here = rank_in(comm) == root;
    return MPI_Reduce(in_place && here ? MPI_IN_PLACE : send, recv, count, dt, mop, root, comm);
}

int shim_allgather(int h, const void *send, void *recv, int count, int code_dtype, int in_place) {
    COMM(h);
    DTYPE(code_dtype);
    return MPI_Allgather(in_place ? MPI_IN_PLACE : send, count, dt, recv, count, dt, comm);
}

int shim_reduce_scatter_block(int h, const void *send, void *recv, int count, int code_dtype,
                              int code_op, int in_place) {
    COMM(h);
    DTYPE(code_dtype);
    OP(code_op, code_dtype);
    return MPI_Reduce_scatter_block(in_place ? MPI_IN_PLACE : send, recv, count, dt, mop, comm);
}

int shim_alltoall(int h, const void *send, void *recv, int count, int code_dtype, int in_place) {
    COMM(h);
    DTYPE(code_dtype);
    return MPI_Alltoall(in_place ? MPI_IN_PLACE : send, count, dt, recv, count, dt, comm);
}

int shim_gather(int h, const void *send, void *recv, int count, int code_dtype, int root,
                int in_place) {
    COMM(h);
    DTYPE(code_dtype);
    int here = rank_in(comm) == root;
    return MPI_Gather(in_place && here ? MPI_IN_PLACE : send, count, dt, recv, count, dt, root,
                      comm);
}

int shim_scatter(int h, const void *send, void *recv, int count, int code_dtype, int root,
                 int in_place) {
    COMM(h);
    DTYPE(code_dtype);
    int here = rank_in(comm) == root;
    return MPI_Scatter(send, count, dt, in_place && here ? MPI_IN_PLACE : recv, count, dt, root,
                       comm);
}

int shim_barrier(int h) {
    COMM(h);
    return MPI_Barrier(comm);
}

int shim_sendrecv(int h, const void *send, int dst, void *recv, int src, int count,
                  int code_dtype) {
    COMM(h);
    DTYPE(code_dtype);
    return MPI_Sendrecv(send, count, dt, dst, 0, recv, count, dt, src, 0, comm, MPI_STATUS_IGNORE);
}
