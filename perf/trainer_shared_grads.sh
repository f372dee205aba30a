#!/usr/bin/env bash
# trainer_shared_grads.sh: the reference trainer's gradients in loomMemAlloc
# memory (the default: shared memory all-reduces the buckets straight out of
# the peers' buffers) against ordinary memory (--plain-grads), issue 18.
# Following ../shared/BENCHMARKING.md the two run in turn, R times, and the
# table shows medians of the trainer's own summary (samples/s, and the mean
# time per step spent waiting for gradient all-reduces).
#
# usage: perf/trainer_shared_grads.sh [-r R] [-n N] [-s STEPS] BUILD [-- TRAINER FLAGS]
#   -r R      repeats (default 5)
#   -n N      ranks (default 2)
#   -s STEPS  steps per run (default 60; the first two are not timed)
# Default model: the trainer's (784-1024-1024-1024-10, 2.9M parameters, an
# 11.7 MB gradient in a 1 MB and a 10.7 MB bucket), global batch 256, stage 0.
set -euo pipefail
REPEATS=5; N=2; STEPS=60
while getopts "r:n:s:h" opt; do
  case "$opt" in
    r) REPEATS="$OPTARG" ;; n) N="$OPTARG" ;; s) STEPS="$OPTARG" ;;
    h) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) exit 2 ;;
  esac
done
shift $((OPTIND - 1))
[[ $# -ge 1 ]] || { echo "trainer_shared_grads.sh: need BUILD (-h for help)" >&2; exit 2; }
BUILD="$1"; shift
[[ "${1:-}" == "--" ]] && shift
for b in loom-run loom-trainer; do
  [[ -x "$BUILD/bin/$b" ]] || { echo "trainer_shared_grads.sh: $BUILD/bin/$b is missing" >&2; exit 2; }
done
declare -A SPS WAIT
for ((r = 0; r < REPEATS; ++r)); do
  for mode in shared plain; do
    flag=""; [[ $mode == plain ]] && flag="--plain-grads"
    line=$("$BUILD/bin/loom-run" -n "$N" -- "$BUILD/bin/loom-trainer" --steps "$STEPS" --log-every 100000 --no-eval \
           $flag "$@" 2>&1 | grep -o 'summary:.*') || { echo "trainer_shared_grads.sh: the $mode run failed" >&2; exit 1; }
    SPS[$mode]+="$(sed 's/.*samples_per_s=\([0-9.]*\).*/\1/' <<<"$line") "
    WAIT[$mode]+="$(sed 's/.*comm_wait_ms=\([0-9.]*\).*/\1/' <<<"$line") "
  done
done
median() { tr ' ' '\n' <<<"$1" | sed '/^$/d' | sort -g | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2}'; }
printf "%d ranks, %d steps, %d repeats (medians)\n" "$N" "$STEPS" "$REPEATS"
printf "%-28s %12s %16s\n" gradients samples/s comm_wait_ms
printf "%-28s %12s %16s\n" "loomMemAlloc (default)" "$(median "${SPS[shared]}")" "$(median "${WAIT[shared]}")"
printf "%-28s %12s %16s\n" "ordinary (--plain-grads)" "$(median "${SPS[plain]}")" "$(median "${WAIT[plain]}")"
