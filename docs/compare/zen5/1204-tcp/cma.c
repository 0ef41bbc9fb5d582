#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>
#include <time.h>
#include <signal.h>
#include <sched.h>
#include <sys/mman.h>
static double now() { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec*1e-9; }
int main(int argc, char **argv) {
  size_t N = 64u<<20;
  size_t chunk = argc > 1 ? strtoul(argv[1],0,0) : N;
  char *src = mmap(0, N, PROT_READ|PROT_WRITE, MAP_PRIVATE|MAP_ANONYMOUS, -1, 0);
  memset(src, 7, N);
  int p[2]; pipe(p);
  pid_t pid = fork();
  if (pid == 0) { cpu_set_t c; CPU_ZERO(&c); CPU_SET(1,&c); sched_setaffinity(0,sizeof c,&c); write(p[1], "x", 1); pause(); return 0; }
  cpu_set_t c; CPU_ZERO(&c); CPU_SET(0,&c); sched_setaffinity(0,sizeof c,&c);
  char x; read(p[0], &x, 1);
  char *dst = malloc(N); memset(dst, 0, N);
  for (int it = 0; it < 5; it++) {
    double t0 = now();
    for (size_t o = 0; o < N; o += chunk) {
      struct iovec l = { dst+o, chunk }, r = { src+o, chunk };
      if (process_vm_readv(pid, &l, 1, &r, 1, 0) != (ssize_t)chunk) { perror("pvr"); return 1; }
    }
    double t1 = now();
    memcpy(dst, src, N);
    double t2 = now();
    printf("chunk %zu: cma %.2f ms (%.1f GB/s) memcpy %.2f ms\n", chunk, (t1-t0)*1e3, N/(t1-t0)/1e9, (t2-t1)*1e3);
  }
  kill(pid, 9);
}
