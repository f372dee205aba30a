#!/usr/bin/env bash
# small_latency.sh: the 8-byte all-reduce of N ranks on one host against its
# floor, for hosts with fewer cores than ranks (issue 18: 8 ranks on 2 cores).
#
# Per rank count, alternating in one run (A B C D [E] A B ...), each cell the
# median over -r repeats of loom-perf's / the limit's median iteration:
#   loom        loom-perf all_reduce 8 B float32 sum, in place, LOOM_CPU_BIND=auto
#               (the default: oversubscribed ranks bound to CPUs in blocks)
#   loom-free   the same with LOOM_CPU_BIND=off (placement left to the scheduler)
#   limit       oversub-limit -B 1: N processes bound as loom binds them, one
#               shared-memory round per iteration and nothing else (the floor)
#   limit-free  oversub-limit -B 0
#   openmpi     mpi-allreduce-perf under mpirun.openmpi --oversubscribe, when both
#               exist (OpenMPI binds nothing when oversubscribed)
# Every program times each iteration on its own, takes the slowest rank and
# reports the median (loom-perf's method).  The load is printed at the start
# and at the end (shared/BENCHMARKING.md).
#
# usage: perf/small_latency.sh [-n "2 4 8"] [-r 3] [-i 2000] [-B build]
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT_DIR="$(cd "$SCRIPT_DIR/.." && pwd)"
NRANKS="2 4 8"
REPEATS=3
ITERS=2000
BUILD_DIR="$ROOT_DIR/build"
while getopts "n:r:i:B:h" opt; do
  case "$opt" in
    n) NRANKS="$OPTARG" ;;
    r) REPEATS="$OPTARG" ;;
    i) ITERS="$OPTARG" ;;
    B) BUILD_DIR="$OPTARG" ;;
    h) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) exit 2 ;;
  esac
done
BIN="$BUILD_DIR/bin"
for p in loom-run loom-perf oversub-limit; do
  [[ -x "$BIN/$p" ]] || { echo "small_latency.sh: $BIN/$p not found (cmake --build $BUILD_DIR)" >&2; exit 2; }
done
MPIRUN="${MPIRUN:-mpirun.openmpi}"
HAVE_MPI=0
[[ -x "$BIN/mpi-allreduce-perf" ]] && command -v "$MPIRUN" >/dev/null && HAVE_MPI=1
WARM=$(( ITERS / 10 ))

echo "# small_latency.sh: 8 B float32 sum all-reduce, in place; $REPEATS repeat(s) of $ITERS iterations"
echo "# host $(hostname), $(getconf _NPROCESSORS_ONLN) cpus, load at start: $(cut -d' ' -f1-3 /proc/loadavg)"

loom_us() {  # bind-mode n -> in-place median us
  LOOM_CPU_BIND=$1 timeout 300 "$BIN/loom-run" -n "$2" "$BIN/loom-perf" all_reduce -b 8 -e 8 -n "$ITERS" \
    -w "$WARM" -c 0 2>&1 | awk '$1 == "[0]" && $2 == 8 { v = $11 } END { if (v == "") exit 1; print v }'
}
limit_us() {  # bind n
  timeout 300 "$BIN/oversub-limit" -n "$2" -i "$ITERS" -w "$WARM" -B "$1" | awk '$1 == "time_us" { print $2 }'
}
mpi_us() {  # n
  timeout 300 "$MPIRUN" --allow-run-as-root --oversubscribe -np "$1" "$BIN/mpi-allreduce-perf" -b 8 -e 8 \
    -n "$ITERS" -w "$WARM" -c 0 2>&1 | awk '$1 == 8 { v = $10 } END { if (v == "") exit 1; print v }'
}
median() { sort -g | awk '{ a[NR] = $1 } END { if (NR == 0) print "-"; else print (NR % 2 ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2) }'; }

OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
for n in $NRANKS; do
  for rep in $(seq 1 "$REPEATS"); do
    loom_us auto "$n" >>"$OUT/loom.$n" || echo "# n=$n: loom-perf failed" >&2
    loom_us off "$n" >>"$OUT/loomfree.$n" || echo "# n=$n: loom-perf (off) failed" >&2
    limit_us 1 "$n" >>"$OUT/limit.$n" || echo "# n=$n: oversub-limit failed" >&2
    limit_us 0 "$n" >>"$OUT/limitfree.$n" || echo "# n=$n: oversub-limit -B 0 failed" >&2
    if [[ $HAVE_MPI == 1 ]]; then mpi_us "$n" >>"$OUT/mpi.$n" || echo "# n=$n: mpi-allreduce-perf failed" >&2; fi
  done
done

printf "%6s %10s %10s %10s %11s %10s %11s\n" ranks loom_us loom-free limit_us limit-free openmpi loom/limit
for n in $NRANKS; do
  l=$(median <"$OUT/loom.$n" 2>/dev/null || echo -); lf=$(median <"$OUT/loomfree.$n" 2>/dev/null || echo -)
  m=$(median <"$OUT/limit.$n" 2>/dev/null || echo -); mf=$(median <"$OUT/limitfree.$n" 2>/dev/null || echo -)
  o=-; [[ -s "$OUT/mpi.$n" ]] && o=$(median <"$OUT/mpi.$n")
  ratio=$(awk -v a="$l" -v b="$m" 'BEGIN { if (a + 0 > 0 && b + 0 > 0) printf "%.2f", a / b; else print "-" }')
  printf "%6s %10s %10s %10s %11s %10s %11s\n" "$n" "$l" "$lf" "$m" "$mf" "$o" "$ratio"
done
echo "# load at end: $(cut -d' ' -f1-3 /proc/loadavg)"
