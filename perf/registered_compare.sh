#!/usr/bin/env bash
# registered_compare.sh: the zero-copy path (issue 18) against its physical
# limit, N = 2 float32 sum all-reduce, following ../shared/BENCHMARKING.md:
# per repeat and size, in turn: loom on ordinary buffers, loom on
# loomMemAlloc'd registered buffers (loom-perf -R), shm-limit (two processes
# reducing straight out of one shared pre-faulted mapping), loom on ordinary
# buffers with LOOM_ALGO=ring (the tuner's choice at N = 2 without the
# zero-copy vote: what the vote costs ordinary buffers) and, given a second
# build, that build's loom on ordinary buffers (today's numbers).
# Every cell is the median over the repeats of loom-perf's figure (max over
# ranks, median over iterations); busbw in GB/s, in place and out of place.
# With -C, a second table does the same for the zero-copy all-gather,
# reduce-scatter, broadcast or all-to-all (registered against ordinary
# buffers, N = 2; no limit program for those).
#
# usage: perf/registered_compare.sh [options] BUILD [BASE_BUILD]
#   -r R        repeats (default 3)
#   -s "SIZES"  sizes (default "16M 64M")
#   -i N        timed iterations (default 20);  -w N warm-up (default 5)
#   -C "COLLS"  more collectives, loom-perf names (e.g. "all_gather reduce_scatter")
# BUILD, BASE_BUILD: build directories holding bin/loom-run, bin/loom-perf
# (and, in BUILD, bin/shm-limit).
set -euo pipefail
unset LOOM_ALGO
REPEATS=3; SIZES="16M 64M"; ITERS=20; WARMUP=5; COLLS=""
while getopts "r:s:i:w:C:h" opt; do
  case "$opt" in
    r) REPEATS="$OPTARG" ;; s) SIZES="$OPTARG" ;; i) ITERS="$OPTARG" ;; w) WARMUP="$OPTARG" ;;
    C) COLLS="$OPTARG" ;;
    h) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) exit 2 ;;
  esac
done
shift $((OPTIND - 1))
[[ $# -ge 1 && $# -le 2 ]] || { echo "registered_compare.sh: need BUILD [BASE_BUILD] (-h for help)" >&2; exit 2; }
B="$1"; BASE="${2:-}"
for f in loom-run loom-perf shm-limit; do
  [[ -x "$B/bin/$f" ]] || { echo "registered_compare.sh: $B/bin/$f missing" >&2; exit 1; }
done
OUT="$(mktemp -d /tmp/loom-registered.XXXXXX)"
echo "# registered_compare.sh: $B${BASE:+ (base $BASE)}; N=2; sizes $SIZES; $REPEATS repeats;" \
     "iters $ITERS, warmup $WARMUP"
echo "# date $(date -Is); loadavg at start: $(cat /proc/loadavg); results in $OUT"
perf() {  # build, tag, size, extra flags (LOOM_ALGO from the caller's environment; COLL: the collective)
  "$1/bin/loom-run" -n 2 -- "$1/bin/loom-perf" "${COLL:-all_reduce}" -b "$3" -e "$3" -n "$ITERS" -w "$WARMUP" -c 1 \
    --json "$OUT/$2.json" ${4:-} > "$OUT/$2.log" 2>&1 || { echo "loom-perf failed: $OUT/$2.log" >&2; exit 1; }
}
for rep in $(seq 1 "$REPEATS"); do
  for s in $SIZES; do
    perf "$B" "plain-$s-$rep" "$s"
    perf "$B" "reg-$s-$rep" "$s" -R
    LOOM_ALGO=ring perf "$B" "ring-$s-$rep" "$s"
    "$B/bin/shm-limit" -s "$s" -n "$ITERS" > "$OUT/limit-$s-$rep.txt"
    [[ -n "$BASE" ]] && perf "$BASE" "base-$s-$rep" "$s"
    for c in $COLLS; do
      COLL=$c perf "$B" "$c-plain-$s-$rep" "$s"
      COLL=$c perf "$B" "$c-reg-$s-$rep" "$s" -R
      [[ -n "$BASE" ]] && COLL=$c perf "$BASE" "$c-base-$s-$rep" "$s"
    done
  done
done
echo "# loadavg at end: $(cat /proc/loadavg)"
python3 - "$OUT" "$SIZES" "$REPEATS" "${BASE:+1}" "$COLLS" <<'PY'
import json, statistics, sys
out, sizes, reps, base = sys.argv[1], sys.argv[2].split(), int(sys.argv[3]), sys.argv[4] == "1"
colls = sys.argv[5].split()
def loom(tag, place):
    return statistics.median(json.load(open(f"{out}/{tag}-{r}.json"))["rows"][0][place]["busbw_GBps"]
                             for r in range(1, reps + 1))
def limit(s):
    vals = []
    for r in range(1, reps + 1):
        kv = dict(l.split() for l in open(f"{out}/limit-{s}-{r}.txt"))
        vals.append(float(kv["busbw_GBps"]))
    return statistics.median(vals)
cols = ["size", "limit", "reg in", "reg out", "plain in", "plain out", "ring in", "ring out"] + (["base in", "base out"] if base else []) + ["reg in/limit"]
print("| " + " | ".join(cols) + " |")
print("|" + "---|" * len(cols))
for s in sizes:
    lim = limit(s)
    row = [s, f"{lim:.2f}", f"{loom('reg-' + s, 'in_place'):.2f}", f"{loom('reg-' + s, 'out_of_place'):.2f}",
           f"{loom('plain-' + s, 'in_place'):.2f}", f"{loom('plain-' + s, 'out_of_place'):.2f}",
           f"{loom('ring-' + s, 'in_place'):.2f}", f"{loom('ring-' + s, 'out_of_place'):.2f}"]
    if base:
        row += [f"{loom('base-' + s, 'in_place'):.2f}", f"{loom('base-' + s, 'out_of_place'):.2f}"]
    row.append(f"{loom('reg-' + s, 'in_place') / lim:.2f}")
    print("| " + " | ".join(row) + " |")
if colls:
    cols = ["collective", "size", "reg in", "reg out", "plain in", "plain out"] + (["base in", "base out"] if base else []) + ["reg/plain in"]
    print()
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for c in colls:
        for s in sizes:
            reg, plain = loom(f"{c}-reg-{s}", "in_place"), loom(f"{c}-plain-{s}", "in_place")
            row = [c, s, f"{reg:.2f}", f"{loom(c + '-reg-' + s, 'out_of_place'):.2f}", f"{plain:.2f}",
                   f"{loom(c + '-plain-' + s, 'out_of_place'):.2f}"]
            if base:
                row += [f"{loom(c + '-base-' + s, 'in_place'):.2f}", f"{loom(c + '-base-' + s, 'out_of_place'):.2f}"]
            row.append(f"{reg / plain:.2f}")
            print("| " + " | ".join(row) + " |")
PY
