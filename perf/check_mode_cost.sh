#!/usr/bin/env bash
# The cost of the mismatched-call check (LOOM_CHECK_MODE=on vs off), by
# default at 8 B: float32 sum all-reduce with loom-perf, N = 2 and 4, over
# the default path (shared memory: the one-shot mailboxes) and over tcp (the
# executor's per-slot tag check).  COLL and BYTES pick another collective and
# size (rooted ones on the executor path add a tag handshake per operation).  On and off alternate within each repetition (see
# /work/shared/BENCHMARKING.md); the table gives, per configuration, the
# median over repetitions of loom-perf's time (itself the median over
# iterations of the per-iteration max over ranks) and the on/off ratio.
#
#   bash perf/check_mode_cost.sh [REPS] [ITERS] [COLL] [BYTES]
#        (default 5 x 2000 all_reduce 8; e.g. 5 200 broadcast 262144)
set -euo pipefail
cd "$(dirname "$0")/.."
reps=${1:-5}
iters=${2:-2000}
coll=${3:-all_reduce}
bytes=${4:-8}
bin=build/bin
[ -x $bin/loom-perf ] || { echo "build first: bash scripts/build.sh" >&2; exit 2; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "# $coll $bytes B, $(date -u +%FT%TZ), $(getconf _NPROCESSORS_ONLN) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
for rep in $(seq 1 "$reps"); do
  for path in shm tcp; do
    for n in 2 4; do
      for mode in on off; do
        LOOM_TRANSPORTS=$([ $path = shm ] && echo shm,tcp || echo tcp) LOOM_CHECK_MODE=$mode \
          $bin/loom-run -n "$n" --timeout 120 $bin/loom-perf "$coll" -b "$bytes" -e "$bytes" -n "$iters" -w $((iters / 10 + 1)) -c 0 \
          --json "$tmp/$path-$n-$mode-$rep.json" >/dev/null
      done
    done
  done
done
python3 - "$tmp" "$reps" <<'PY'
import json, sys, statistics, glob, os
tmp, reps = sys.argv[1], int(sys.argv[2])
print("| path | N | check on (us) | check off (us) | on/off | per-rep on/off |")
print("|---|---|---|---|---|---|")
for path in ("shm", "tcp"):
    for n in (2, 4):
        t = {}
        for mode in ("on", "off"):
            t[mode] = []
            for rep in range(1, reps + 1):
                with open(os.path.join(tmp, f"{path}-{n}-{mode}-{rep}.json")) as f:
                    row = json.load(f)["rows"][0]
                t[mode].append(row["out_of_place"]["time_us"])
        on, off = statistics.median(t["on"]), statistics.median(t["off"])
        ratios = " ".join(f"{a / b:.2f}" for a, b in zip(t["on"], t["off"]))
        print(f"| {path} | {n} | {on:.2f} | {off:.2f} | {on / off:.3f} | {ratios} |")
PY
echo "# load after: $(cut -d' ' -f1-3 /proc/loadavg)"
