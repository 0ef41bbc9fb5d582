#define _GNU_SOURCE
#include <sched.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdatomic.h>
#include <time.h>
#include <sys/mman.h>
static size_t LEN=2<<20, CH;
static int NS=2;
static char *slots, *src, *dst;
static _Alignas(64) atomic_long posted; static _Alignas(64) atomic_long freed;
static double ns(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec*1e9+t.tv_nsec;}
static void pin(int c){cpu_set_t s;CPU_ZERO(&s);CPU_SET(c,&s);pthread_setaffinity_np(pthread_self(),sizeof s,&s);}
static int ITERS=200;
static void *writer(void*a){pin(0); long k=0; for(int it=0;it<ITERS;it++) for(size_t off=0;off<LEN;off+=CH,k++){ while(k-atomic_load_explicit(&freed,memory_order_acquire)>=NS); memcpy(slots+(k%NS)*CH,src+off,CH); atomic_store_explicit(&posted,k+1,memory_order_release);} return 0;}
static void *reader(void*a){pin(1); long k=0; for(int it=0;it<ITERS;it++) for(size_t off=0;off<LEN;off+=CH,k++){ while(atomic_load_explicit(&posted,memory_order_acquire)<=k); memcpy(dst+off,slots+(k%NS)*CH,CH); atomic_store_explicit(&freed,k+1,memory_order_release);} return 0;}
int main(int c,char**v){CH=(c>1?atol(v[1]):256)<<10; NS=c>2?atoi(v[2]):2; int shm=c>3;
  slots = shm ? mmap(0,NS*CH,PROT_READ|PROT_WRITE,MAP_SHARED|MAP_ANONYMOUS,-1,0) : aligned_alloc(4096,NS*CH);
  src=aligned_alloc(4096,LEN); dst=aligned_alloc(4096,LEN); memset(src,1,LEN); memset(dst,0,LEN); memset(slots,0,NS*CH);
  pthread_t w,r; double t=ns(); pthread_create(&w,0,writer,0); pthread_create(&r,0,reader,0); pthread_join(w,0); pthread_join(r,0); t=ns()-t;
  printf("chunk %zu KiB, %d slots: %.1f us per 2 MiB (%.1f GB/s)\n", CH>>10, NS, t/1e3/ITERS, LEN*ITERS/t);}
