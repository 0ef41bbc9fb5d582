#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <immintrin.h>

#define TOTAL (128u<<20)
#define PART (TOTAL/2)
static size_t CH = 512*1024;
static int MODE = 0;   /* 0 current, 1 interleave own+fetch, 2 single-copy direct, 3 own only, 4 own copy plain memcpy */
static int ITERS = 10;
static size_t SUB = 16384;
static uint8_t *in[2], *out[2], *slot[2][2];
static _Atomic uint64_t pub[2], done_[2];
static pthread_barrier_t bar;

static void nt(uint8_t *d, const uint8_t *s, size_t n) {
  for (size_t i = 0; i < n; i += 64) {
    __m256i a = _mm256_loadu_si256((const __m256i*)(s+i)), b = _mm256_loadu_si256((const __m256i*)(s+i+32));
    _mm256_stream_si256((__m256i*)(d+i), a); _mm256_stream_si256((__m256i*)(d+i+32), b);
  }
  _mm_sfence();
}
static void nt2(uint8_t *d1, const uint8_t *s1, uint8_t *d2, const uint8_t *s2, size_t n) {
  for (size_t o = 0; o < n; o += SUB) { size_t l = n-o < SUB ? n-o : SUB; nt(d1+o, s1+o, l); nt(d2+o, s2+o, l); }
}
static double now() { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec*1e-9; }
static void *run(void *arg) {
  int me = (int)(intptr_t)arg, peer = 1-me;
  cpu_set_t c; CPU_ZERO(&c); CPU_SET(me, &c); sched_setaffinity(0, sizeof c, &c);
  memset(in[me], me+1, TOTAL); memset(out[me], 0, TOTAL);
  uint64_t round = 0;
  double best = 1e9, sum = 0;
  for (int it = 0; it < ITERS + 2; it++) {
    pthread_barrier_wait(&bar);
    double t0 = now();
    if (MODE == 2) { nt(out[me] + me*PART, in[me] + me*PART, PART); nt(out[me] + peer*PART, in[peer] + me*PART, PART); }
    else if (MODE == 3) { nt(out[me], in[me], TOTAL); }
    else if (MODE == 4) { memcpy(out[me], in[me], TOTAL); }
    else for (size_t off = 0; off < PART; off += CH) {
      round++;
      uint8_t *s = slot[me][round&1];
      while (atomic_load_explicit(&done_[peer], memory_order_acquire) + 1 < round) _mm_pause();
      memcpy(s, in[me] + peer*PART + off, CH);
      atomic_store_explicit(&pub[me], round, memory_order_release);
      uint8_t *own_d = out[me] + me*PART + off, *own_s = in[me] + me*PART + off;
      uint8_t *f_d = out[me] + peer*PART + off, *f_s = slot[peer][round&1];
      if (MODE == 1) {
        while (atomic_load_explicit(&pub[peer], memory_order_acquire) < round) _mm_pause();
        nt2(own_d, own_s, f_d, f_s, CH);
      } else if (me == 0) {
        nt(own_d, own_s, CH);
        while (atomic_load_explicit(&pub[peer], memory_order_acquire) < round) _mm_pause();
        nt(f_d, f_s, CH);
      } else {
        while (atomic_load_explicit(&pub[peer], memory_order_acquire) < round) _mm_pause();
        nt(f_d, f_s, CH);
        nt(own_d, own_s, CH);
      }
      atomic_store_explicit(&done_[me], round, memory_order_release);
    }
    pthread_barrier_wait(&bar);
    double t = now() - t0;
    if (it >= 2) { sum += t; if (t < best) best = t; }
  }
  if (me == 0) printf("mode %d ch %zu sub %zu: best %.2f mean %.2f ms\n", MODE, CH, SUB, best*1e3, sum/ITERS*1e3);
  return 0;
}
int main(int argc, char **argv) {
  if (argc > 1) MODE = atoi(argv[1]);
  if (argc > 2) CH = strtoul(argv[2], 0, 0);
  if (argc > 3) SUB = strtoul(argv[3], 0, 0);
  for (int r = 0; r < 2; r++) { in[r] = aligned_alloc(4096, TOTAL); out[r] = aligned_alloc(4096, TOTAL);
    for (int k = 0; k < 2; k++) slot[r][k] = aligned_alloc(4096, 1<<20); }
  pthread_barrier_init(&bar, 0, 2);
  pthread_t t[2];
  for (int r = 0; r < 2; r++) pthread_create(&t[r], 0, run, (void*)(intptr_t)r);
  for (int r = 0; r < 2; r++) pthread_join(t[r], 0);
}
