/* ccl.h: the C interface of ccl (libcclrs), a collective communication library.
 * Generated from capi/src by cbindgen; do not edit. See capi/README.md.
 *
 * Link with -lcclrs. Every call returns a cclResult_t; on failure
 * cclGetLastError(comm) has a message naming the rank and the call.
 * Threads: calls on one communicator come from one thread at a time (a call
 * while another thread is in one returns cclInvalidArgument); calls marked
 * "Thread-safe" below may come from any thread at any time.
 * Memory: buffers are host memory; a blocking call may reuse them once it
 * returns, a call started in a group once the group ended (cclGroupEnd) or
 * its work completed (cclGroupEndAsync). Streams are reserved for device
 * buffers: pass NULL. */

#ifndef CCL_H
#define CCL_H

#include <stddef.h>
#include <stdint.h>

// `cclCommSplit`'s color of a rank that joins no new communicator.
#define CCL_SPLIT_NOCOLOR -1

// Bytes of a `cclUniqueId`.
#define CCL_UNIQUE_ID_BYTES 256

// A communicator (opaque).
typedef struct cclComm cclComm;

// An asynchronous call in progress (opaque).
typedef struct cclWork cclWork;

// What every call returns: `cclSuccess`, or the kind of failure;
// `cclGetLastError` has the message. The numbers never change.
typedef int cclResult_t;

// A handle on a communicator.
typedef cclComm *cclComm_t;

// A handle on an asynchronous call.
typedef cclWork *cclWork_t;

// An element type.
typedef int cclDataType_t;

// A reduction op: one of the constants, or an op made by
// `cclRedOpCreatePreMulSum` on a communicator.
typedef int cclRedOp_t;

// What `cclGetUniqueId` makes on one rank and the program hands to every
// rank by its own means (`MPI_Bcast`, a file): the address of a rendezvous
// and the secret of the job. Treat it as a secret.
typedef struct {
  char internal[CCL_UNIQUE_ID_BYTES];
} cclUniqueId;

// Where the scalar of `cclRedOpCreatePreMulSum` lies.
typedef int cclScalarResidence_t;

// The call succeeded.
#define cclSuccess 0

// Bad arguments (a null pointer, a count out of range, a foreign or
// destroyed handle, a call from a second thread), detected before anything
// was sent.
#define cclInvalidArgument 1

// A deadline passed (`cclCommSetTimeout`, `CCL_TIMEOUT`).
#define cclTimeout 2

// A peer exited, its link dropped, or it reported its own failure.
#define cclPeerLost 3

// Ranks made different calls.
#define cclMismatch 4

// Bytes from a peer broke the protocol.
#define cclProtocolError 5

// The rendezvous store failed.
#define cclStoreError 6

// The configuration (environment variables, addresses) is missing or wrong.
#define cclConfigError 7

// An operating-system call failed.
#define cclSystemError 8

// The communicator failed earlier (or was aborted) and can no longer be used.
#define cclBroken 9

// A bug in ccl.
#define cclInternalError 10

// Something this build cannot do (device memory without GPU support).
#define cclUnsupported 11

#define cclInt8 0

#define cclUint8 1

#define cclInt32 2

#define cclUint32 3

#define cclInt64 4

#define cclUint64 5

#define cclFloat16 6

#define cclFloat32 7

#define cclFloat64 8

#define cclBfloat16 9

#define cclSum 0

#define cclProd 1

#define cclMax 2

#define cclMin 3

// Sum divided by the number of ranks (integer division for integers).
#define cclAvg 4

// Bitwise and, or, xor (integer types only).
#define cclBand 5

#define cclBor 6

#define cclBxor 7

// The first number of the ops `cclRedOpCreatePreMulSum` makes.
#define CCL_FIRST_CREATED_OP 4096

// In host memory, read when the op is created.
#define cclScalarHostImmediate 0

// In device memory (needs GPU support: unsupported in this build).
#define cclScalarDevice 1

#ifdef __cplusplus
extern "C" {
#endif // __cplusplus

// A short description of a result code, as a string that lives forever.
// Thread-safe.
const char *cclGetErrorString(cclResult_t result);

// The message of the last failure on `comm` (naming ranks and calls), or,
// for NULL or a dead handle, of the calling thread's last failure; an
// empty string if none. It stays valid until the next failure on `comm`
// (or of the thread) and until `comm` is destroyed.
const char *cclGetLastError(cclComm_t comm);

// Starts a group: until the matching `cclGroupEnd`, this thread's calls
// are started and return at once. Groups nest; the outermost end counts.
// Send and receive between pairs of ranks must be grouped (or asynchronous)
// when both ranks send first, as with NCCL.
cclResult_t cclGroupStart(void);

// Ends a group: at the outermost end, waits for every call of the group
// on host memory, queues those on device memory (which then run as their
// streams reach them: `cclCommGetAsyncError`), and returns the first
// failure (each failure is also recorded on its communicator).
cclResult_t cclGroupEnd(void);

// Ends a group without waiting: at the outermost end, writes to `work` a
// handle on every call started in the group (`cclWorkTest`, `cclWorkWait`,
// `cclWorkFree`); at an inner end, writes NULL. The buffers must stay
// untouched until the work completes. A refused end (`work` NULL) leaves
// the group open.
cclResult_t cclGroupEndAsync(cclWork_t *work);

// Every rank gets the reduction (`op`) of every rank's `count` elements.
// In place when `sendbuff == recvbuff`.
cclResult_t cclAllReduce(const void *sendbuff,
                         void *recvbuff,
                         size_t count,
                         cclDataType_t datatype,
                         cclRedOp_t op,
                         cclComm_t comm,
                         void *stream);

// `root`'s `count` elements go to every rank's `recvbuff`; `sendbuff` is
// read on the root only. In place when `sendbuff == recvbuff`.
cclResult_t cclBroadcast(const void *sendbuff,
                         void *recvbuff,
                         size_t count,
                         cclDataType_t datatype,
                         int root,
                         cclComm_t comm,
                         void *stream);

// `root` gets the reduction of every rank's `count` elements; `recvbuff`
// is written on the root only.
cclResult_t cclReduce(const void *sendbuff,
                      void *recvbuff,
                      size_t count,
                      cclDataType_t datatype,
                      cclRedOp_t op,
                      int root,
                      cclComm_t comm,
                      void *stream);

// Every rank gets every rank's `sendcount` elements, in rank order
// (`recvbuff` holds nranks × sendcount). In place when
// `sendbuff == recvbuff + rank * sendcount` elements.
cclResult_t cclAllGather(const void *sendbuff,
                         void *recvbuff,
                         size_t sendcount,
                         cclDataType_t datatype,
                         cclComm_t comm,
                         void *stream);

// The reduction of every rank's `sendbuff` (nranks × recvcount elements);
// rank r gets block r of it. In place when
// `recvbuff == sendbuff + rank * recvcount` elements.
cclResult_t cclReduceScatter(const void *sendbuff,
                             void *recvbuff,
                             size_t recvcount,
                             cclDataType_t datatype,
                             cclRedOp_t op,
                             cclComm_t comm,
                             void *stream);

// Block p (`count` elements) of every rank's `sendbuff` goes to rank p,
// into block r of its `recvbuff` for sender r. In place when
// `sendbuff == recvbuff`.
cclResult_t cclAllToAll(const void *sendbuff,
                        void *recvbuff,
                        size_t count,
                        cclDataType_t datatype,
                        cclComm_t comm,
                        void *stream);

// `root` gets every rank's `sendcount` elements, in rank order; `recvbuff`
// is written on the root only.
cclResult_t cclGather(const void *sendbuff,
                      void *recvbuff,
                      size_t sendcount,
                      cclDataType_t datatype,
                      int root,
                      cclComm_t comm,
                      void *stream);

// Block r (`recvcount` elements) of `root`'s `sendbuff` goes to rank r;
// `sendbuff` is read on the root only.
cclResult_t cclScatter(const void *sendbuff,
                       void *recvbuff,
                       size_t recvcount,
                       cclDataType_t datatype,
                       int root,
                       cclComm_t comm,
                       void *stream);

// Returns once every rank has entered the barrier.
cclResult_t cclBarrier(cclComm_t comm, void *stream);

// Sends `count` elements to rank `peer`, which receives them with `cclRecv`.
cclResult_t cclSend(const void *sendbuff,
                    size_t count,
                    cclDataType_t datatype,
                    int peer,
                    cclComm_t comm,
                    void *stream);

// Receives `count` elements from rank `peer`.
cclResult_t cclRecv(void *recvbuff,
                    size_t count,
                    cclDataType_t datatype,
                    int peer,
                    cclComm_t comm,
                    void *stream);

// Writes ccl's version to `version`: major × 10000 + minor × 100 + patch.
cclResult_t cclGetVersion(int *version);

// Makes a unique id: this process starts serving a rendezvous (on every
// interface, advertising the address of `CCL_SOCKET_IFNAME`, else of the
// first interface that is up and not loopback) for as long as it runs, and
// draws a fresh job secret. Call it on one rank and hand the id to every
// rank (`MPI_Bcast`); each then calls `cclCommInitRank`. Thread-safe.
cclResult_t cclGetUniqueId(cclUniqueId *id);

// Makes rank `rank` of a communicator of `nranks` ranks that meet at the
// rendezvous of `id` (every rank passes the same id). `CCL_*` variables
// set the knobs as for `cclCommInitEnv`. Returns once this rank is
// connected to all others.
cclResult_t cclCommInitRank(cclComm_t *comm, int nranks, cclUniqueId id, int rank);

// Makes this process's communicator from the environment a launcher set
// (torchrun, `ccl-run`, OpenMPI, PMI, Slurm; `MASTER_ADDR`/`MASTER_PORT`
// or `CCL_STORE_PATH`; `CCL_*` knobs), as `Communicator::from_env`.
cclResult_t cclCommInitEnv(cclComm_t *comm);

// Makes rank `rank` of `nranks` ranks that meet at a TCP store at
// `host:port`, which rank 0 serves (torchrun's `MASTER_ADDR` and
// `MASTER_PORT`); `CCL_JOB_SECRET` and the other `CCL_*` knobs apply.
cclResult_t cclCommInitStore(cclComm_t *comm, int nranks, int rank, const char *host, int port);

// Splits `comm` (`MPI_Comm_split`): ranks passing the same `color` form a
// new communicator, ordered by `key` then by rank; a rank passing
// `CCL_SPLIT_NOCOLOR` takes part and gets NULL. Every rank must call it.
cclResult_t cclCommSplit(cclComm_t comm, int color, int key, cclComm_t *newcomm);

// Aborts `comm` (as `ncclCommAbort`): calls running or queued on it, from
// any thread, fail at once, every peer is told, and later calls fail with
// `cclBroken`. Thread-safe: meant to be called while another thread waits
// in a call. The handle stays valid until `cclCommDestroy`.
cclResult_t cclCommAbort(cclComm_t comm);

// Destroys `comm`: its handle dies at once; the communicator closes once
// no call is running on it.
cclResult_t cclCommDestroy(cclComm_t comm);

// Writes the number of ranks of `comm` to `count`. Thread-safe.
cclResult_t cclCommCount(cclComm_t comm, int *count);

// Writes this process's rank in `comm` to `rank`. Thread-safe.
cclResult_t cclCommUserRank(cclComm_t comm, int *rank);

// Sets the deadline of every call on `comm` from now on, in seconds
// (default: `CCL_TIMEOUT`, else 600). Every rank should set the same value.
cclResult_t cclCommSetTimeout(cclComm_t comm, double seconds);

// Makes a pre-multiplied-sum op on `comm` (as `ncclRedOpCreatePreMulSum`):
// each rank multiplies its own input by `*scalar` (an element of
// `datatype`, in host memory: `cclScalarHostImmediate`), then the inputs
// are summed. Writes the op to `op`; `cclRedOpDestroy` frees it.
cclResult_t cclRedOpCreatePreMulSum(cclRedOp_t *op,
                                    const void *scalar,
                                    cclDataType_t datatype,
                                    cclScalarResidence_t residence,
                                    cclComm_t comm);

// Frees an op made by `cclRedOpCreatePreMulSum` on `comm`.
cclResult_t cclRedOpDestroy(cclRedOp_t op, cclComm_t comm);

// Writes to `async_error` the result of `comm`'s device calls that
// returned before they completed: `cclSuccess`, or the code of the first
// that failed (its message in `cclGetLastError(comm)`). As
// `ncclCommGetAsyncError`; thread-safe.
cclResult_t cclCommGetAsyncError(cclComm_t comm, cclResult_t *async_error);

// Allocates `size` bytes of device memory on the calling thread's current
// GPU (`cudaSetDevice`'s; device 0 if none) and writes its address to
// `ptr`: memory that peers on this host can map through CUDA IPC, which
// memory of CUDA's stream-ordered allocator cannot be. As `ncclMemAlloc`;
// free it with `cclMemFree`. `cclUnsupported` without a CUDA driver.
cclResult_t cclMemAlloc(void **ptr, size_t size);

// Frees memory of `cclMemAlloc` (NULL: nothing). The calls that use it
// must have completed.
cclResult_t cclMemFree(void *ptr);

// Allocates `size` bytes (at least 1) of zeroed host memory and writes its
// address to `ptr`. The other ranks of this host map it and copy a
// collective's blocks out of it (and into it) with their own loads and
// stores, where other memory is copied by the kernel: allgather,
// all-to-all, broadcast, gather and scatter over shared memory move large
// blocks about twice as fast. Peers keep their mapping after
// `cclHostFree` until their communicator is destroyed or maps many other
// buffers; the memory returns to the system then. Thread-safe.
cclResult_t cclHostAlloc(void **ptr, size_t size);

// Frees memory of `cclHostAlloc` (NULL: nothing). The calls that use it
// must have completed. Thread-safe.
cclResult_t cclHostFree(void *ptr);

// Writes to `done` whether every call of `work` completed (1) or not (0);
// returns the first failure among those that did. Thread-safe.
cclResult_t cclWorkTest(cclWork_t work, int *done);

// Waits for every call of `work`; returns the first failure. Thread-safe.
cclResult_t cclWorkWait(cclWork_t work);

// Waits at most `seconds` for the calls of `work`; writes to `done` whether
// all completed. Returns the first failure among those that did.
cclResult_t cclWorkWaitTimeout(cclWork_t work, double seconds, int *done);

// Frees `work`, whose calls must have completed (a running call still
// uses its buffers: wait first).
cclResult_t cclWorkFree(cclWork_t work);

#ifdef __cplusplus
}  // extern "C"
#endif  // __cplusplus

#endif  /* CCL_H */
