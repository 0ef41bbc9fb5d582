/*
 * ccl_oneccl_bench: the oneCCL side of `ccl-bench compare`.
 *
 * Times oneCCL's collectives on the same sizes as ccl-bench and prints the
 * same nccl-tests-style table as bench/mpi/ccl_mpi_bench.c (same flags, same
 * conventions: size = whole buffer, n x per-rank part for allgather,
 * reduce-scatter and alltoall, rounded down to whole elements per rank, at
 * least one; time = the slowest rank's time for the whole loop of iterations,
 * over the iterations; GB/s = 1e9 B/s; nccl-tests' busbw factors; -v adds the
 * median, fastest and slowest iteration):
 *
 *   ccl_oneccl_bench allreduce -b 8 -e 268435456 -f 2 -n 20 -w 5 -d f32 -o sum [-r ROOT] [-i] [-v]
 *
 * Each process is one rank: RANK and WORLD_SIZE say which (as torchrun's), and
 * CCL_BENCH_KVS_FILE names a file through which rank 0 hands its main KVS
 * address to the others (oneCCL's own bootstrap: rank 0 creates the main KVS,
 * the others attach to its address). ccl-bench sets these, with oneCCL's
 * CCL_PROCESS_LAUNCHER=none, CCL_LOCAL_RANK and CCL_LOCAL_SIZE.
 *
 * Build: c++ -O2 -std=c++17 -I$VENV/include ccl_oneccl_bench.cpp -L$VENV/lib -lccl -o ...
 */
#include <oneapi/ccl.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

enum coll { ALLREDUCE, BROADCAST, REDUCE, ALLGATHER, REDUCE_SCATTER, ALLTOALL, BARRIER };
static const char *coll_names[] = {"allreduce", "broadcast",      "reduce", "allgather",
                                   "reduce-scatter", "alltoall", "barrier"};

struct dtype {
    const char *name;
    ccl::datatype type;
    int size;
};
static const dtype dtypes[] = {
    {"i8", ccl::datatype::int8, 1},     {"u8", ccl::datatype::uint8, 1},
    {"i32", ccl::datatype::int32, 4},   {"u32", ccl::datatype::uint32, 4},
    {"i64", ccl::datatype::int64, 8},   {"u64", ccl::datatype::uint64, 8},
    {"f32", ccl::datatype::float32, 4}, {"f64", ccl::datatype::float64, 8},
};
struct op {
    const char *name;
    ccl::reduction red;
};
static const op ops[] = {{"sum", ccl::reduction::sum},
                         {"prod", ccl::reduction::prod},
                         {"min", ccl::reduction::min},
                         {"max", ccl::reduction::max}};

static int rank_, nranks;

[[noreturn]] static void die(const char *msg, const char *arg) {
    if (rank_ == 0) std::fprintf(stderr, "ccl_oneccl_bench: %s%s\n", msg, arg ? arg : "");
    std::exit(2);
}

static bool split(coll c) { return c == ALLGATHER || c == REDUCE_SCATTER || c == ALLTOALL; }
static bool has_root(coll c) { return c == BROADCAST || c == REDUCE; }
static bool has_op(coll c) { return c == ALLREDUCE || c == REDUCE || c == REDUCE_SCATTER; }

static double bus_factor(coll c) {
    double n = nranks;
    if (c == ALLREDUCE) return 2.0 * (n - 1) / n;
    if (split(c)) return (n - 1) / n;
    return 1.0;
}

static size_t parse_size(const char *s) {
    char *end;
    unsigned long long v = std::strtoull(s, &end, 10);
    if (*s == '-' || *end != '\0' || v == 0) die("bad size (expected a positive number of bytes): ", s);
    return (size_t)v;
}

static int env_int(const char *name) {
    const char *v = std::getenv(name);
    if (!v || !*v) die("missing environment variable ", name);
    return std::atoi(v);
}

/* oneCCL's bootstrap: rank 0 creates the main KVS and publishes its address
 * in a file (written then renamed, so readers never see half of it); the
 * others wait for the file and attach. */
static ccl::shared_ptr_class<ccl::kvs> make_kvs() {
    const char *path = std::getenv("CCL_BENCH_KVS_FILE");
    if (!path || !*path) die("missing environment variable ", "CCL_BENCH_KVS_FILE");
    ccl::kvs::address_type addr;
    if (rank_ == 0) {
        auto kvs = ccl::create_main_kvs();
        addr = kvs->get_address();
        std::string tmp = std::string(path) + ".tmp";
        {
            std::ofstream f(tmp, std::ios::binary);
            f.write(addr.data(), (std::streamsize)addr.size());
            if (!f) die("cannot write ", tmp.c_str());
        }
        if (std::rename(tmp.c_str(), path) != 0) die("cannot rename to ", path);
        return kvs;
    }
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    for (;;) {
        std::ifstream f(path, std::ios::binary);
        if (f && f.read(addr.data(), (std::streamsize)addr.size())) break;
        if (std::chrono::steady_clock::now() > deadline) die("rank 0's KVS address never came: ", path);
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    return ccl::create_kvs(addr);
}

/* In-place forms: allreduce and reduce only (ccl-bench compare runs out-of-place). */
static void run_once(coll c, void *in, void *out, size_t count, ccl::datatype t, ccl::reduction red,
                     int root, bool inplace, const ccl::communicator &comm) {
    void *src = inplace ? out : in;
    switch (c) {
    case ALLREDUCE: ccl::allreduce(src, out, count, t, red, comm).wait(); break;
    case BROADCAST: ccl::broadcast(out, count, t, root, comm).wait(); break;
    case REDUCE: ccl::reduce(src, out, count, t, red, root, comm).wait(); break;
    case ALLGATHER: ccl::allgather(in, out, count, t, comm).wait(); break;
    case REDUCE_SCATTER: ccl::reduce_scatter(in, out, count, t, red, comm).wait(); break;
    case ALLTOALL: ccl::alltoall(in, out, count, t, comm).wait(); break;
    case BARRIER: ccl::barrier(comm).wait(); break;
    }
}

int main(int argc, char **argv) {
    rank_ = env_int("RANK");
    nranks = env_int("WORLD_SIZE");
    if (argc < 2) die("usage: ccl_oneccl_bench COLLECTIVE [-b MIN] [-e MAX] [-f FACTOR] [-n ITERS] [-w WARMUP] [-d DTYPE] [-o OP] [-r ROOT] [-i] [-v]", nullptr);
    int ci = -1;
    for (int i = 0; i < (int)(sizeof coll_names / sizeof *coll_names); i++)
        if (std::strcmp(argv[1], coll_names[i]) == 0) ci = i;
    if (ci < 0) die("unknown collective: ", argv[1]);
    coll c = (coll)ci;

    size_t minb = 8, maxb = 8;
    double factor = 2;
    int iters = 20, warmup = 5, root = 0;
    bool inplace = false, verbose = false;
    const dtype *dt = &dtypes[6];
    const op *o = &ops[0];
    for (int i = 2; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : nullptr;
        if (!std::strcmp(a, "-i")) { inplace = true; continue; }
        if (!std::strcmp(a, "-v")) { verbose = true; continue; }
        if (!v) die("missing value after ", a);
        i++;
        if (!std::strcmp(a, "-b")) minb = parse_size(v);
        else if (!std::strcmp(a, "-e")) maxb = parse_size(v);
        else if (!std::strcmp(a, "-f")) factor = std::atof(v);
        else if (!std::strcmp(a, "-n")) iters = std::atoi(v);
        else if (!std::strcmp(a, "-w")) warmup = std::atoi(v);
        else if (!std::strcmp(a, "-r")) root = std::atoi(v);
        else if (!std::strcmp(a, "-d")) {
            dt = nullptr;
            for (const auto &d : dtypes)
                if (!std::strcmp(v, d.name)) dt = &d;
            if (!dt) die("unsupported dtype for oneCCL: ", v);
        } else if (!std::strcmp(a, "-o")) {
            o = nullptr;
            for (const auto &p : ops)
                if (!std::strcmp(v, p.name)) o = &p;
            if (!o) die("unsupported op for oneCCL: ", v);
        } else die("unknown option: ", a);
    }
    if (maxb < minb) die("max size is below min size", nullptr);
    if (factor <= 1.0) die("factor must be above 1", nullptr);
    if (iters < 1) die("iterations must be at least 1", nullptr);
    if (root < 0 || root >= nranks) die("root is not below the number of ranks", nullptr);
    if (c == BARRIER) minb = maxb = 1;
    // oneCCL's broadcast has one buffer: it is in place whatever -i says.
    if (c == BROADCAST) inplace = true;
    if (inplace && c != ALLREDUCE && c != REDUCE && c != BROADCAST)
        die("-i: only allreduce, reduce and broadcast have an in-place form here", nullptr);

    ccl::init();
    auto kvs = make_kvs();
    auto comm = ccl::create_communicator(nranks, rank_, kvs);

    if (rank_ == 0) {
        std::printf("# ccl_oneccl_bench %s: %d ranks, dtype %s, op %s, root %d, %s, iters %d, warmup %d\n",
                    coll_names[c], nranks, dt->name, has_op(c) ? o->name : "none", root,
                    inplace ? "in-place" : "out-of-place", iters, warmup);
        auto v = ccl::get_library_version();
        std::printf("# library: oneCCL %s\n", v.full ? v.full : "(unknown)");
        std::printf("#\n# %12s %12s %6s %6s %5s %10s %12s %8s %8s %7s\n", "size", "count", "type", "redop",
                    "root", "algo", "time", "algbw", "busbw", "#wrong");
        std::printf("# %12s %12s %6s %6s %5s %10s %12s %8s %8s\n", "(B)", "(elements)", "", "", "", "",
                    "(us)", "(GB/s)", "(GB/s)");
        std::fflush(stdout);
    }

    std::vector<double> times((size_t)iters), maxes((size_t)iters);
    double bw_sum = 0, bw_peak = 0;
    int rows = 0;
    size_t last = 0;
    size_t es = (size_t)dt->size, n = (size_t)nranks;
    for (double s = (double)minb; s <= (double)maxb * 1.0000001; s *= factor) {
        size_t count = 0, bytes = 0;
        if (c != BARRIER) {
            count = (size_t)s / es;
            if (split(c)) count /= n;
            if (!count) count = 1;
            bytes = count * es * (split(c) ? n : 1);
            if (bytes == last) continue;
        }
        last = bytes;
        size_t in_elems = count, out_elems = count;
        if (c == ALLGATHER) out_elems = n * count;
        if (c == REDUCE_SCATTER) in_elems = n * count;
        if (c == ALLTOALL) in_elems = out_elems = n * count;
        std::vector<char> in(std::max<size_t>(in_elems, 1) * es), out(std::max<size_t>(out_elems, 1) * es);
        for (size_t k = 0; k < in.size(); k++) in[k] = (char)((k * 7 + (size_t)rank_) % 5 + 1);
        for (size_t k = 0; k < out.size(); k++) out[k] = (char)((k * 3 + (size_t)rank_) % 5 + 1);
        for (int w = 0; w < warmup; w++)
            run_once(c, in.data(), out.data(), count, dt->type, o->red, root, inplace, comm);
        ccl::barrier(comm).wait();
        auto start = std::chrono::steady_clock::now(), last = start;
        for (int it = 0; it < iters; it++) {
            run_once(c, in.data(), out.data(), count, dt->type, o->red, root, inplace, comm);
            auto now = std::chrono::steady_clock::now();
            times[(size_t)it] = std::chrono::duration<double>(now - last).count();
            last = now;
        }
        double mine = std::chrono::duration<double>(last - start).count() / iters, t = 0;
        ccl::allreduce(times.data(), maxes.data(), (size_t)iters, ccl::datatype::float64, ccl::reduction::max, comm)
            .wait();
        ccl::allreduce(&mine, &t, 1, ccl::datatype::float64, ccl::reduction::max, comm).wait();
        if (rank_ == 0) {
            double algbw = t > 0 ? (double)bytes / 1e9 / t : 0;
            double busbw = algbw * bus_factor(c);
            bw_sum += busbw;
            bw_peak = std::max(bw_peak, busbw);
            rows++;
            std::printf("  %12zu %12zu %6s %6s %5d %10s %12.3f %8.3f %8.3f %7s\n", bytes,
                        c == BARRIER ? (size_t)0 : bytes / es, dt->name, has_op(c) ? o->name : "none",
                        has_root(c) ? root : -1, "oneccl", t * 1e6, algbw, busbw, "N/A");
            if (verbose) {
                std::sort(maxes.begin(), maxes.end());
                double med = iters % 2 ? maxes[(size_t)iters / 2]
                                       : (maxes[(size_t)iters / 2 - 1] + maxes[(size_t)iters / 2]) / 2;
                std::printf("#  per iteration (slowest rank): median %.2f us, min %.2f us, max %.2f us\n",
                            med * 1e6, maxes[0] * 1e6, maxes[(size_t)iters - 1] * 1e6);
            }
            std::fflush(stdout);
        }
        if (c == BARRIER) break;
    }
    if (rank_ == 0) {
        std::printf("# Avg bus bandwidth    : %.3f GB/s\n", rows ? bw_sum / rows : 0.0);
        std::printf("# Peak bus bandwidth   : %.3f GB/s\n", bw_peak);
    }
    return 0;
}
