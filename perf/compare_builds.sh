#!/usr/bin/env bash
# compare_builds.sh: two builds of loom side by side (say, before and after a
# refactor), all-reduce float32 sum, following ../shared/BENCHMARKING.md:
# runs alternate A B A B ... per rank count, every cell is the median over
# the repeats (loom-perf itself takes the max over ranks and the median over
# iterations), and the range of the per-repeat B/A ratios shows the noise.
#
# usage: perf/compare_builds.sh [options] BUILD_A BUILD_B
#   -n "2 4"   rank counts (default "2 4")
#   -r R       repeats of each A/B pair (default 3)
#   -b SIZE    smallest size (default 8);  -e SIZE largest (default 64M);  -f F step (default 4)
#   -i N       timed iterations per size (default 20);  -w N warm-up (default 5)
#   -p PLACE   out_of_place (default) or in_place
# BUILD_A/BUILD_B: build directories holding bin/loom-run and bin/loom-perf.
# Output per rank count: size, A us, B us, B/A time (< 1: B faster), range.
set -euo pipefail
NRANKS="2 4"; REPEATS=3; MINB=8; MAXB=64M; STEP=4; ITERS=20; WARMUP=5; PLACE=out_of_place
while getopts "n:r:b:e:f:i:w:p:h" opt; do
  case "$opt" in
    n) NRANKS="$OPTARG" ;; r) REPEATS="$OPTARG" ;; b) MINB="$OPTARG" ;; e) MAXB="$OPTARG" ;;
    f) STEP="$OPTARG" ;; i) ITERS="$OPTARG" ;; w) WARMUP="$OPTARG" ;; p) PLACE="$OPTARG" ;;
    h) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) exit 2 ;;
  esac
done
shift $((OPTIND - 1))
[[ $# -eq 2 ]] || { echo "compare_builds.sh: need BUILD_A BUILD_B (-h for help)" >&2; exit 2; }
A="$1"; B="$2"
for d in "$A" "$B"; do
  for f in loom-run loom-perf; do
    [[ -x "$d/bin/$f" ]] || { echo "compare_builds.sh: $d/bin/$f missing" >&2; exit 1; }
  done
done
OUT="$(mktemp -d /tmp/loom-builds.XXXXXX)"
echo "# compare_builds.sh: A=$A  B=$B; ranks $NRANKS; $REPEATS repeats (A B alternating);" \
     "sizes $MINB..$MAXB x$STEP; iters $ITERS, warmup $WARMUP; $PLACE"
echo "# date $(date -Is); loadavg at start: $(cat /proc/loadavg); JSON in $OUT"
for n in $NRANKS; do
  for rep in $(seq 1 "$REPEATS"); do
    for side in A B; do
      dir=$A; [[ $side == B ]] && dir=$B
      "$dir/bin/loom-run" -n "$n" "$dir/bin/loom-perf" all_reduce -b "$MINB" -e "$MAXB" -f "$STEP" \
        -n "$ITERS" -w "$WARMUP" -d float32 -o sum --json "$OUT/${side}_n${n}_r${rep}.json" \
        > "$OUT/${side}_n${n}_r${rep}.txt" 2>&1 || { echo "# $side n=$n r$rep FAILED: $OUT/${side}_n${n}_r${rep}.txt"; exit 1; }
    done
  done
done
echo "# loadavg at end: $(cat /proc/loadavg)"
OUT="$OUT" NRANKS="$NRANKS" REPEATS="$REPEATS" PLACE="$PLACE" python3 - <<'PYEOF'
import json, os, statistics
out, place, reps = os.environ["OUT"], os.environ["PLACE"], int(os.environ["REPEATS"])
for n in os.environ["NRANKS"].split():
    cells = {}  # size -> side -> [time_us per repeat]
    for rep in range(1, reps + 1):
        for side in "AB":
            d = json.load(open(os.path.join(out, f"{side}_n{n}_r{rep}.json")))
            if (d.get("wrong_total") or 0) or (d.get("oob_total") or 0):
                raise SystemExit(f"{side} n={n} r{rep}: wrong results")
            for r in d["rows"]:
                c = r.get(place)
                if c: cells.setdefault(r["size"], {"A": [], "B": []})[side].append(c["time_us"])
    print(f"\n## {n} ranks, median of {reps} repeats")
    print(f"# {'size':>9} {'A us':>10} {'B us':>10} {'B/A':>6} {'range':>11}")
    for size in sorted(cells):
        a, b = cells[size]["A"], cells[size]["B"]
        ratios = [y / x for x, y in zip(a, b) if x]
        ma, mb = statistics.median(a), statistics.median(b)
        rng = f"{min(ratios):.2f}..{max(ratios):.2f}" if ratios else "-"
        print(f"  {size:>9} {ma:>10.2f} {mb:>10.2f} {mb / ma:>6.2f} {rng:>11}")
PYEOF
