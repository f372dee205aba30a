/* The smallest loom program: every rank contributes rank+1, all-reduce sums,
 * each rank checks the total. Start it with loom-run -n N (or mpirun, torchrun). */
#include <loom.h>
#include <stdio.h>

int main(void) {
  loomComm_t comm;
  loomResult_t r = loomCommInitFromEnv(&comm);
  if (r != loomSuccess) {
    fprintf(stderr, "init: %s: %s\n", loomGetErrorString(r), loomGetLastError(NULL));
    return 1;
  }
  int rank, n;
  loomCommUserRank(comm, &rank);
  loomCommCount(comm, &n);
  int v[4] = {rank + 1, rank + 1, rank + 1, rank + 1};
  r = loomAllReduce(v, v, 4, loomInt32, loomSum, comm, NULL);
  if (r != loomSuccess) {
    fprintf(stderr, "all-reduce: %s: %s\n", loomGetErrorString(r), loomGetLastError(comm));
    return 1;
  }
  int want = n * (n + 1) / 2;
  for (int i = 0; i < 4; ++i) {
    if (v[i] != want) {
      fprintf(stderr, "rank %d: got %d, want %d\n", rank, v[i], want);
      return 1;
    }
  }
  printf("rank %d of %d: sum %d ok (loom %d)\n", rank, n, want, LOOM_VERSION_CODE);
  loomCommDestroy(comm);
  return 0;
}
