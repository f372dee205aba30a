/*
 * shm-limit: the physical limit of a two-rank all-reduce on one host, for
 * the zero-copy path (docs/usage.md, "Registered memory").
 *
 *   shm-limit [-s BYTES (suffixes K, M, G)] [-n ITERS]
 *
 * Two processes share one pre-faulted mapping holding both ranks' float32
 * buffers (BYTES each, default 64 MiB).  Per iteration, after a barrier,
 * process p sums half p of the two buffers and writes the sum into half p
 * of both, so that both buffers end up holding the all-reduce: nothing is
 * copied in, every byte is read once and written once.  This is what an
 * all-reduce straight out of shared buffers can at best do; loom's own
 * protocol (flags, waits, chunking) comes on top.  Time per iteration: the
 * later of the two processes, median over ITERS (default 20, after 3
 * warm-up rounds).  Output, "key value" per line:
 *   bytes 67108864
 *   time_us 3950.1
 *   busbw_GBps 16.99      (BYTES / time: nccl-tests' busbw for N = 2)
 */
#define _GNU_SOURCE
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

struct Ctl {
  _Atomic uint64_t arrived[2];  /* barrier: rounds each process reached */
  double took[2][1024];         /* per process and iteration, us */
};

static void barrier(struct Ctl* c, int me, uint64_t round) {
  atomic_store_explicit(&c->arrived[me], round, memory_order_release);
  while (atomic_load_explicit(&c->arrived[1 - me], memory_order_acquire) < round) sched_yield();
}

static void reduce_half(float* restrict a, float* restrict b, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    float s = a[i] + b[i];
    a[i] = s;
    b[i] = s;
  }
}

static int cmp(const void* x, const void* y) {
  double a = *(const double*)x, b = *(const double*)y;
  return (a > b) - (a < b);
}

int main(int argc, char** argv) {
  size_t bytes = (size_t)64 << 20;
  int iters = 20, opt;
  while ((opt = getopt(argc, argv, "s:n:h")) != -1) {
    if (opt == 's') {
      char* end;
      bytes = strtoull(optarg, &end, 0);
      if (*end == 'K') bytes <<= 10;
      else if (*end == 'M') bytes <<= 20;
      else if (*end == 'G') bytes <<= 30;
    }
    else if (opt == 'n') iters = atoi(optarg);
    else {
      fprintf(stderr, "usage: shm-limit [-s BYTES] [-n ITERS (1..1024)]\n");
      return opt == 'h' ? 0 : 2;
    }
  }
  if (iters < 1 || iters > 1024 || bytes < 64) {
    fprintf(stderr, "shm-limit: -n 1..1024, -s >= 64\n");
    return 2;
  }
  size_t n = bytes / sizeof(float);
  size_t total = sizeof(struct Ctl) + 2 * n * sizeof(float) + 4096;
  uint8_t* m = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
  if (m == MAP_FAILED) {
    perror("mmap");
    return 1;
  }
  struct Ctl* c = (struct Ctl*)m;
  float* buf[2];
  buf[0] = (float*)(m + ((sizeof(struct Ctl) + 4095) & ~(size_t)4095));
  buf[1] = buf[0] + n;
  for (size_t i = 0; i < n; ++i) buf[0][i] = buf[1][i] = 1.0f;
  pid_t child = fork();
  if (child < 0) {
    perror("fork");
    return 1;
  }
  int me = child == 0 ? 1 : 0;
  size_t half = n / 2, lo = me ? half : 0, len = me ? n - half : half;
  const int warm = 3;
  uint64_t round = 0;
  for (int it = -warm; it < iters; ++it) {
    barrier(c, me, ++round);
    double t0 = now_us();
    reduce_half(buf[0] + lo, buf[1] + lo, len);
    barrier(c, me, ++round);
    if (it >= 0) c->took[me][it] = now_us() - t0;
  }
  if (child == 0) _exit(0);
  waitpid(child, NULL, 0);
  double t[1024];
  for (int i = 0; i < iters; ++i) t[i] = c->took[0][i] > c->took[1][i] ? c->took[0][i] : c->took[1][i];
  qsort(t, (size_t)iters, sizeof t[0], cmp);
  double med = iters % 2 ? t[iters / 2] : 0.5 * (t[iters / 2 - 1] + t[iters / 2]);
  printf("bytes %zu\ntime_us %.1f\nbusbw_GBps %.2f\n", bytes, med, (double)bytes / med / 1e3);
  return 0;
}
