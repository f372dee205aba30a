/*
 * mpi-allreduce-perf: MPI_Allreduce (float32, sum) measured exactly as
 * loom-perf measures loom's all_reduce, so that the two can be compared
 * side by side (perf/compare_mpi.sh).
 *
 *   mpirun.openmpi --allow-run-as-root --oversubscribe -np 4 \
 *       build/bin/mpi-allreduce-perf -b 8 -e 64M -f 2 -n 20 -w 5
 *
 * Same method as loom-perf: persistent buffers allocated and pre-faulted once
 * at the largest size; per size one checked run (-c 1), -w warm-up
 * iterations, then -n iterations each timed on its own; the per-iteration
 * times are reduced with MPI_MAX across ranks after the timed loop and the
 * median is reported.  algbw = size/time, busbw = algbw * 2(n-1)/n
 * (nccl-tests).  In-place uses MPI_IN_PLACE.
 *
 * Exit status: 0 ok, 2 bad arguments, 3 wrong results.
 */
#define _GNU_SOURCE
#include <mpi.h>

#include <errno.h>
#include <getopt.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
  int valid;
  double time_us, time_min_us, time_max_us, algbw, busbw;
  long long wrong; /* -1: not checked */
} cell_t;

typedef struct {
  size_t size, count;
  cell_t oop, ip;
} row_t;

static int g_rank = 0, g_nranks = 1;

static void bad_args(const char* msg, const char* arg) {
  if (g_rank == 0) {
    fprintf(stderr, "mpi-allreduce-perf: %s%s%s%s\n(mpi-allreduce-perf -h for help)\n", msg,
            arg ? " '" : "", arg ? arg : "", arg ? "'" : "");
  }
  MPI_Finalize();
  exit(2);
}

static void usage(void) {
  if (g_rank != 0) return;
  printf(
      "usage: mpi-allreduce-perf [options]   (MPI_Allreduce, float32, sum)\n"
      "  -b N  smallest size in bytes (default 8; suffixes K, M, G)\n"
      "  -e N  largest size (default 64M)\n"
      "  -f N  step factor (default 2)\n"
      "  -n N  timed iterations per size (default 20)\n"
      "  -w N  warm-up iterations per size (default 5)\n"
      "  -c 0|1  verify results (default 1)\n"
      "  --json FILE  rank 0 also writes the rows as JSON\n");
}

static int parse_size(const char* s, size_t* out) {
  char* end = NULL;
  unsigned long long v, mul = 1;
  if (!s || !*s || *s == '-' || *s == '+') return 0;
  errno = 0;
  v = strtoull(s, &end, 10);
  if (errno || end == s) return 0;
  if (*end) {
    switch (*end) {
      case 'k': case 'K': mul = 1ull << 10; break;
      case 'm': case 'M': mul = 1ull << 20; break;
      case 'g': case 'G': mul = 1ull << 30; break;
      default: return 0;
    }
    ++end;
    if (*end == 'B' || *end == 'b') ++end;
    if (*end) return 0;
  }
  if (v > UINT64_MAX / mul) return 0;
  *out = (size_t)(v * mul);
  return 1;
}

static int parse_int(const char* s, long lo, long hi, long* out) {
  char* end = NULL;
  long v;
  if (!s || !*s) return 0;
  errno = 0;
  v = strtol(s, &end, 10);
  if (errno || *end || end == s || v < lo || v > hi) return 0;
  *out = v;
  return 1;
}

static int cmp_double(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

/* The same sum pattern as loom-perf: small non-negative integers whose sum
 * over all ranks stays below 2^24, so that the float32 sum is exact in any
 * order. */
static float value(int r, uint64_t i, uint64_t mod) {
  return (float)((i * 7 + (i >> 5) * 3 + 13u * (uint64_t)r) % mod);
}

static void fmt_time(char* b, size_t n, double us) {
  if (us >= 10000.0)
    snprintf(b, n, "%7.0f", us);
  else if (us >= 100.0)
    snprintf(b, n, "%7.1f", us);
  else
    snprintf(b, n, "%7.2f", us);
}

static void print_cell(const cell_t* c) {
  char t[32], w[32];
  fmt_time(t, sizeof t, c->time_us);
  if (c->wrong < 0)
    snprintf(w, sizeof w, "N/A");
  else
    snprintf(w, sizeof w, "%lld", c->wrong);
  printf("  %7s  %6.2f  %6.2f  %6s", t, c->algbw, c->busbw, w);
}

static void json_num(FILE* f, double v) {
  if (v != v || v > 1e300 || v < -1e300)
    fprintf(f, "null");
  else
    fprintf(f, "%.6g", v);
}

static void json_cell(FILE* f, const cell_t* c) {
  fprintf(f, "{\"time_us\": ");
  json_num(f, c->time_us);
  fprintf(f, ", \"time_us_min\": ");
  json_num(f, c->time_min_us);
  fprintf(f, ", \"time_us_max\": ");
  json_num(f, c->time_max_us);
  fprintf(f, ", \"algbw_GBps\": ");
  json_num(f, c->algbw);
  fprintf(f, ", \"busbw_GBps\": ");
  json_num(f, c->busbw);
  if (c->wrong < 0)
    fprintf(f, ", \"wrong\": null, \"oob\": 0}");
  else
    fprintf(f, ", \"wrong\": %lld, \"oob\": 0}", c->wrong);
}

int main(int argc, char** argv) {
  static const struct option long_opts[] = {
      {"minbytes", required_argument, NULL, 'b'},  {"maxbytes", required_argument, NULL, 'e'},
      {"stepfactor", required_argument, NULL, 'f'}, {"iters", required_argument, NULL, 'n'},
      {"warmup_iters", required_argument, NULL, 'w'}, {"check", required_argument, NULL, 'c'},
      {"json", required_argument, NULL, 'J'},      {"help", no_argument, NULL, 'h'},
      {NULL, 0, NULL, 0}};
  size_t minb = 8, maxb = 64ull << 20, factor = 2;
  long iters = 20, warmup = 5, check = 1, v;
  const char* json = NULL;
  int c, i;
  float *sendbuf = NULL, *recvbuf = NULL;
  double* times;
  row_t* rows;
  size_t nrows = 0, bytes, cap, last = (size_t)-1;
  double bw_sum = 0;
  int bw_count = 0;
  long long wrong_total = 0;
  uint64_t mod;

  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &g_nranks);

  opterr = 0;
  while ((c = getopt_long(argc, argv, ":b:e:f:n:w:c:h", long_opts, NULL)) != -1) {
    switch (c) {
      case 'b':
        if (!parse_size(optarg, &minb) || minb == 0) bad_args("-b: bad size", optarg);
        break;
      case 'e':
        if (!parse_size(optarg, &maxb) || maxb == 0) bad_args("-e: bad size", optarg);
        break;
      case 'f':
        if (!parse_int(optarg, 2, 1 << 20, &v)) bad_args("-f: bad step factor (integer >= 2)", optarg);
        factor = (size_t)v;
        break;
      case 'n':
        if (!parse_int(optarg, 1, 1 << 24, &v)) bad_args("-n: bad iteration count", optarg);
        iters = v;
        break;
      case 'w':
        if (!parse_int(optarg, 0, 1 << 24, &v)) bad_args("-w: bad warm-up count", optarg);
        warmup = v;
        break;
      case 'c':
        if (!parse_int(optarg, 0, 1, &v)) bad_args("-c: expected 0 or 1", optarg);
        check = v;
        break;
      case 'J':
        json = optarg;
        break;
      case 'h':
        usage();
        MPI_Finalize();
        return 0;
      case ':':
        bad_args("option needs an argument:", argv[optind - 1]);
        break;
      default:
        bad_args("unknown option", argv[optind - 1]);
    }
  }
  if (optind < argc) bad_args("unexpected argument", argv[optind]);
  if (minb > maxb) bad_args("-b is larger than -e", NULL);
  if (maxb / sizeof(float) > 0x7fffffff) bad_args("-e: MPI counts are int: at most 8G", NULL);

  /* Persistent, pre-faulted buffers (memset touches every page). */
  cap = maxb + 64;
  if (posix_memalign((void**)&sendbuf, 4096, cap) || posix_memalign((void**)&recvbuf, 4096, cap)) {
    fprintf(stderr, "mpi-allreduce-perf: out of memory\n");
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  memset(sendbuf, 0, cap);
  memset(recvbuf, 0, cap);
  times = (double*)calloc((size_t)iters, sizeof(double));
  rows = (row_t*)calloc(64 + 64, sizeof(row_t));
  mod = (uint64_t)((1 << 24) / g_nranks) + 1;

  if (g_rank == 0) {
    printf("# mpi-allreduce-perf: nranks %d, collective all_reduce (MPI_Allreduce)\n", g_nranks);
    {
      char lib[MPI_MAX_LIBRARY_VERSION_STRING];
      int len = 0;
      char* nl;
      MPI_Get_library_version(lib, &len);
      nl = strchr(lib, '\n');
      if (nl) *nl = '\0';
      printf("# %s\n", lib);
    }
    printf("# minBytes %zu maxBytes %zu step: %zu(factor) warmup iters: %ld iters: %ld validation: %ld\n",
           minb, maxb, factor, warmup, iters, check);
    printf("# time: per iteration, max over ranks; median over %ld iterations\n#\n", iters);
    printf("#%51s%s%s\n", "", "          out-of-place           ", "            in-place             ");
    printf("#%11s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s  %7s  %6s  %6s  %6s\n", "size", "count",
           "type", "redop", "root", "time", "algbw", "busbw", "#wrong", "time", "algbw", "busbw",
           "#wrong");
    printf("#%11s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s  %7s  %6s  %6s  %6s\n", "(B)",
           "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", "");
    fflush(stdout);
  }

  for (bytes = minb; bytes <= maxb;) {
    size_t count = bytes / sizeof(float);
    if (count > 0 && count * sizeof(float) != last && nrows < 128) {
      row_t* row = &rows[nrows++];
      int inplace;
      last = count * sizeof(float);
      row->size = count * sizeof(float);
      row->count = count;
      for (inplace = 0; inplace < 2; ++inplace) {
        cell_t* cell = inplace ? &row->ip : &row->oop;
        const void* sb = inplace ? MPI_IN_PLACE : (const void*)sendbuf;
        size_t k;
        double sec;
        cell->valid = 1;
        cell->wrong = -1;
        if (check) {
          long long wrong = 0;
          float* in = inplace ? recvbuf : sendbuf;
          for (k = 0; k < count; ++k) in[k] = value(g_rank, k, mod);
          if (!inplace)
            for (k = 0; k < count; ++k) recvbuf[k] = -7.0f;
          MPI_Allreduce(sb, recvbuf, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
          for (k = 0; k < count; ++k) {
            double expect = 0;
            int r;
            for (r = 0; r < g_nranks; ++r) expect += value(r, k, mod);
            if ((double)recvbuf[k] != expect) ++wrong;
          }
          MPI_Allreduce(MPI_IN_PLACE, &wrong, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
          cell->wrong = wrong;
          wrong_total += wrong;
        }
        for (i = 0; i < warmup; ++i)
          MPI_Allreduce(sb, recvbuf, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        for (i = 0; i < iters; ++i) {
          double t0 = MPI_Wtime();
          MPI_Allreduce(sb, recvbuf, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
          times[i] = (MPI_Wtime() - t0) * 1e6;
        }
        /* Outside the timed loop: an iteration lasts as long as its slowest rank. */
        MPI_Allreduce(MPI_IN_PLACE, times, (int)iters, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        qsort(times, (size_t)iters, sizeof(double), cmp_double);
        cell->time_us = (iters % 2) ? times[iters / 2] : 0.5 * (times[iters / 2 - 1] + times[iters / 2]);
        cell->time_min_us = times[0];
        cell->time_max_us = times[iters - 1];
        sec = cell->time_us * 1e-6;
        cell->algbw = sec > 0 ? (double)row->size / 1e9 / sec : 0.0;
        cell->busbw = cell->algbw * 2.0 * (g_nranks - 1) / g_nranks;
        bw_sum += cell->busbw;
        ++bw_count;
      }
      if (g_rank == 0) {
        printf("%12zu  %12zu  %8s  %6s  %6d", row->size, row->count, "float32", "sum", -1);
        print_cell(&row->oop);
        print_cell(&row->ip);
        printf("\n");
        fflush(stdout);
      }
    }
    if (bytes > maxb / factor) break;
    bytes *= factor;
  }

  if (g_rank == 0) {
    double avg = bw_count ? bw_sum / bw_count : 0.0;
    printf("# Out of bounds values : 0 OK\n");
    printf("# Avg bus bandwidth    : %g \n", avg);
    if (check) printf("# Wrong values         : %lld %s\n", wrong_total, wrong_total ? "FAILED" : "OK");
    printf("#\n");
    fflush(stdout);
    if (json) {
      FILE* f = fopen(json, "w");
      size_t k;
      if (!f) {
        fprintf(stderr, "mpi-allreduce-perf: cannot write %s: %s\n", json, strerror(errno));
      } else {
        fprintf(f, "{\n  \"tool\": \"mpi-allreduce-perf\",\n  \"collective\": \"all_reduce\",\n");
        fprintf(f, "  \"nranks\": %d,\n  \"iters\": %ld,\n  \"warmup_iters\": %ld,\n  \"check\": %ld,\n",
                g_nranks, iters, warmup, check);
        fprintf(f, "  \"rows\": [\n");
        for (k = 0; k < nrows; ++k) {
          fprintf(f,
                  "    {\"size\": %zu, \"count\": %zu, \"type\": \"float32\", \"redop\": \"sum\", "
                  "\"root\": -1, \"out_of_place\": ",
                  rows[k].size, rows[k].count);
          json_cell(f, &rows[k].oop);
          fprintf(f, ", \"in_place\": ");
          json_cell(f, &rows[k].ip);
          fprintf(f, "}%s\n", k + 1 < nrows ? "," : "");
        }
        fprintf(f, "  ],\n  \"wrong_total\": %lld,\n  \"oob_total\": 0,\n  \"avg_busbw_GBps\": ", wrong_total);
        json_num(f, avg);
        fprintf(f, "\n}\n");
        fclose(f);
      }
    }
  }
  free(sendbuf);
  free(recvbuf);
  free(times);
  free(rows);
  MPI_Finalize();
  return wrong_total ? 3 : 0;
}
