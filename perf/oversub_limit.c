/*
 * oversub-limit: the floor of a small all-reduce between N processes of
 * one host, for perf/small_latency.sh (issue: 8 ranks on 2 cores).
 *
 *   oversub-limit [-n NRANKS] [-i ITERS] [-w WARMUP] [-B 0|1]
 *
 * N processes share one mapping.  Per iteration every process writes its
 * 8-byte value (two float32) into its own cache line and publishes the
 * iteration number there, waits until every process published it (yielding
 * the CPU between looks, as a waiting loom rank does when the host runs more
 * ranks than cores), then sums the N values: one shared-memory round, no
 * acknowledgements, no checks, no library.  That is the least an all-reduce
 * between processes can do; when the processes outnumber the cores it costs
 * about one context switch per process per iteration on each core.
 *
 * -B 1 (the default) binds the processes to the CPUs as loom's
 * LOOM_CPU_BIND=auto does (contiguous blocks, only when they outnumber the
 * CPUs); -B 0 leaves placement to the scheduler.
 *
 * Timing as loom-perf: each iteration timed on its own in every process,
 * the slowest process's time per iteration, the median over ITERS (default
 * 2000, after 200 warm-up iterations).  Output, "key value" per line:
 *   ranks 8
 *   cpus 2
 *   bound 1
 *   time_us 9.8
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

struct Line {
  _Atomic uint64_t seq;
  float value[2][2]; /* by iteration parity: a reader of k and a writer of k+2 never meet */
  char pad[64 - 8 - 16];
};

static int cmp(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return x < y ? -1 : x > y;
}

static void usage(void) {
  fprintf(stderr, "usage: oversub-limit [-n NRANKS (2..256)] [-i ITERS] [-w WARMUP] [-B 0|1]\n");
  exit(2);
}

int main(int argc, char** argv) {
  int n = 8, bind = 1;
  long iters = 2000, warm = 200;
  for (int c; (c = getopt(argc, argv, "n:i:w:B:h")) != -1;) {
    switch (c) {
      case 'n': n = atoi(optarg); break;
      case 'i': iters = atol(optarg); break;
      case 'w': warm = atol(optarg); break;
      case 'B': bind = atoi(optarg); break;
      default: usage();
    }
  }
  if (n < 2 || n > 256 || iters < 1 || iters > 1000000 || warm < 0 || (bind != 0 && bind != 1)) usage();
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (sched_getaffinity(0, sizeof allowed, &allowed) != 0) {
    perror("sched_getaffinity");
    return 1;
  }
  int cpus[CPU_SETSIZE], ncpu = 0;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &allowed)) cpus[ncpu++] = c;
  const int bound = bind && n > ncpu;

  size_t bytes = sizeof(struct Line) * (size_t)n + sizeof(double) * (size_t)n * (size_t)iters;
  void* mem = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
  if (mem == MAP_FAILED) {
    perror("mmap");
    return 1;
  }
  struct Line* lines = mem;
  double* took = (double*)(lines + n); /* [rank][iteration] */

  for (int r = 0; r < n; ++r) {
    pid_t pid = fork();
    if (pid < 0) {
      perror("fork");
      return 1;
    }
    if (pid) continue;
    if (bound) {
      cpu_set_t one;
      CPU_ZERO(&one);
      CPU_SET(cpus[(long)r * ncpu / n], &one);
      if (sched_setaffinity(0, sizeof one, &one) != 0) _exit(1);
    }
    float sum = 0;
    for (long k = 1; k <= warm + iters; ++k) {
      double t0 = now_us();
      struct Line* me = &lines[r];
      me->value[k & 1][0] = (float)r;
      me->value[k & 1][1] = (float)k;
      atomic_store_explicit(&me->seq, (uint64_t)k, memory_order_release);
      float s0 = 0, s1 = 0;
      for (int q = 0; q < n; ++q) {
        while (atomic_load_explicit(&lines[q].seq, memory_order_acquire) < (uint64_t)k) sched_yield();
        s0 += lines[q].value[k & 1][0];
        s1 += lines[q].value[k & 1][1];
      }
      sum += s0 + s1;
      if (k > warm) took[(long)r * iters + (k - warm - 1)] = now_us() - t0;
    }
    _exit(sum == 0 ? 3 : 0); /* keep the sums alive */
  }
  int bad = 0;
  for (int r = 0; r < n; ++r) {
    int st = 0;
    if (wait(&st) < 0 || !WIFEXITED(st) || WEXITSTATUS(st) != 0) bad = 1;
  }
  if (bad) {
    fprintf(stderr, "oversub-limit: a process failed\n");
    return 1;
  }
  double* worst = calloc((size_t)iters, sizeof(double));
  for (long k = 0; k < iters; ++k)
    for (int r = 0; r < n; ++r)
      if (took[(long)r * iters + k] > worst[k]) worst[k] = took[(long)r * iters + k];
  qsort(worst, (size_t)iters, sizeof(double), cmp);
  printf("ranks %d\ncpus %d\nbound %d\ntime_us %.2f\n", n, ncpu, bound, worst[iters / 2]);
  return 0;
}
