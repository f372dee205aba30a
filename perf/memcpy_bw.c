/*
 * memcpy-bw: memory bandwidth of memcpy on this machine, the physical
 * reference for the host-memory collectives (perf/compare_mpi.sh).
 *
 *   memcpy-bw [-s BYTES] [-n ITERS] [-p PROCS]
 *
 * Each of PROCS processes (default 1) copies BYTES (default 64 MiB) between
 * two private, pre-faulted buffers ITERS times (default 20, after 3 warm-up
 * copies), all processes starting together.  Reported per process: the
 * median time of one copy, the copy rate (BYTES / time) and the memory
 * traffic rate (2 * BYTES / time: every byte is read once and written once),
 * plus the sum of the traffic rates over the processes.  Output is one
 * "key value" line per figure, e.g.
 *   procs 1
 *   bytes 67108864
 *   time_us 4100.2
 *   copy_GBps 16.37
 *   rw_GBps 32.73            (per process, median over processes)
 *   rw_GBps_total 32.73      (sum over processes)
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e6 + ts.tv_nsec * 1e-3;
}

static int cmp_double(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

static size_t parse_size(const char* s) {
  char* end = NULL;
  unsigned long long v = strtoull(s, &end, 10);
  if (end == s) return 0;
  switch (*end) {
    case 'k': case 'K': v <<= 10; ++end; break;
    case 'm': case 'M': v <<= 20; ++end; break;
    case 'g': case 'G': v <<= 30; ++end; break;
    default: break;
  }
  if (*end) return 0;
  return (size_t)v;
}

/* One process: returns the median copy time in us. */
static double run_one(size_t bytes, int iters, int start_fd) {
  char *a, *b;
  double* t = calloc((size_t)iters, sizeof(double));
  double med;
  char go;
  int i;
  if (!t || posix_memalign((void**)&a, 4096, bytes) || posix_memalign((void**)&b, 4096, bytes)) {
    fprintf(stderr, "memcpy-bw: out of memory\n");
    exit(1);
  }
  memset(a, 1, bytes); /* pre-fault both buffers */
  memset(b, 2, bytes);
  if (start_fd >= 0 && read(start_fd, &go, 1) != 1) exit(1);
  for (i = 0; i < 3; ++i) memcpy(i & 1 ? a : b, i & 1 ? b : a, bytes);
  for (i = 0; i < iters; ++i) {
    double t0 = now_us();
    memcpy(i & 1 ? a : b, i & 1 ? b : a, bytes);
    t[i] = now_us() - t0;
  }
  /* keep the copies alive */
  if (a[bytes / 2] == 42 && b[bytes / 3] == 42) fprintf(stderr, " ");
  qsort(t, (size_t)iters, sizeof(double), cmp_double);
  med = (iters % 2) ? t[iters / 2] : 0.5 * (t[iters / 2 - 1] + t[iters / 2]);
  free(a);
  free(b);
  free(t);
  return med;
}

int main(int argc, char** argv) {
  size_t bytes = 64u << 20;
  int iters = 20, procs = 1, c, p;
  int start[2], results[2];
  double* med;
  double total = 0;
  while ((c = getopt(argc, argv, "s:n:p:h")) != -1) {
    switch (c) {
      case 's': bytes = parse_size(optarg); break;
      case 'n': iters = atoi(optarg); break;
      case 'p': procs = atoi(optarg); break;
      case 'h':
        printf("usage: memcpy-bw [-s BYTES] [-n ITERS] [-p PROCS]\n");
        return 0;
      default:
        fprintf(stderr, "usage: memcpy-bw [-s BYTES] [-n ITERS] [-p PROCS]\n");
        return 2;
    }
  }
  if (bytes == 0 || iters < 1 || procs < 1 || procs > 256) {
    fprintf(stderr, "memcpy-bw: bad arguments\n");
    return 2;
  }
  med = calloc((size_t)procs, sizeof(double));
  if (pipe(start) || pipe(results)) return 1;
  for (p = 0; p < procs; ++p) {
    pid_t pid = fork();
    if (pid < 0) return 1;
    if (pid == 0) {
      double m;
      close(start[1]);
      close(results[0]);
      m = run_one(bytes, iters, start[0]);
      if (write(results[1], &m, sizeof m) != (ssize_t)sizeof m) _exit(1);
      _exit(0);
    }
  }
  close(start[0]);
  close(results[1]);
  usleep(200000); /* let every child allocate and fault its buffers */
  for (p = 0; p < procs; ++p)
    if (write(start[1], "g", 1) != 1) return 1;
  for (p = 0; p < procs; ++p)
    if (read(results[0], &med[p], sizeof(double)) != (ssize_t)sizeof(double)) return 1;
  for (p = 0; p < procs; ++p) wait(NULL);
  for (p = 0; p < procs; ++p) total += 2.0 * (double)bytes / 1e3 / med[p];
  qsort(med, (size_t)procs, sizeof(double), cmp_double);
  printf("procs %d\nbytes %zu\niters %d\n", procs, bytes, iters);
  printf("time_us %.1f\n", med[procs / 2]);
  printf("copy_GBps %.2f\n", (double)bytes / 1e3 / med[procs / 2]);
  printf("rw_GBps %.2f\n", 2.0 * (double)bytes / 1e3 / med[procs / 2]);
  printf("rw_GBps_total %.2f\n", total);
  free(med);
  return 0;
}
