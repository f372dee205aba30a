#!/usr/bin/env bash
# shrink_bench.sh: time from killing a rank to a working shrunken communicator.
#
# For each transport list and rank count: N ranks of `mp-worker shrink
# allreduce` run 1 MiB all-reduces; rank N/2 is SIGKILLed 2 ms into one.
# Each survivor gets the error, waits until loomCommGetAsyncError names the
# dead rank, dumps, revokes, calls loomCommShrink, and runs an all-gather and
# a checked all-reduce on the new communicator.  One cell = the time from the
# victim's kill (wall clock written just before raise(SIGKILL)) to the LAST
# survivor's checked all-reduce on the shrunken communicator; also the
# slowest survivor's time from its failed call to its error, and its time in
# loomCommShrink.  Cells alternate between configurations; medians over -r
# repeats.  The load average is printed at the start and at the end.
#
# usage: perf/shrink_bench.sh [-r REPEATS] [-n "3 4 5 6 7 8"] [-T "shm,tcp tcp"] [-B BUILD_DIR]
set -euo pipefail
REPEATS=3
NS="3 4 5 6 7 8"
TRANSPORTS="shm,tcp tcp"
BUILD_DIR=build
while getopts "r:n:T:B:" o; do
  case $o in
    r) REPEATS=$OPTARG ;;
    n) NS=$OPTARG ;;
    T) TRANSPORTS=$OPTARG ;;
    B) BUILD_DIR=$OPTARG ;;
    *) sed -n 2,15p "$0"; exit 2 ;;
  esac
done
BIN=$BUILD_DIR/bin
[ -x "$BIN/mp-worker" ] || { echo "no $BIN/mp-worker (build the tests first)" >&2; exit 1; }
echo "load at start: $(cut -d' ' -f1-3 /proc/loadavg), $(getconf _NPROCESSORS_ONLN) cores"
RESULTS=$(mktemp)
run_one() {  # transports n -> appends "transports n killToWorking errorMs shrinkMs" to $RESULTS
  local tr=$1 n=$2 dir port victim pids=() r
  dir=$(mktemp -d /tmp/loom-shrink-bench-XXXXXX)
  port=$((20000 + RANDOM % 20000))
  victim=$((n / 2))
  for ((r = 0; r < n; r++)); do
    LOOM_RANK=$r LOOM_WORLD_SIZE=$n LOOM_ROOT_ADDR=127.0.0.1:$port \
      LOOM_SECRET=0123456789abcdef0123456789abcdef LOOM_TRANSPORTS=$tr LOOM_TIMEOUT_MS=5000 \
      timeout 60 "$BIN/mp-worker" shrink allreduce $victim $((1 << 20)) "$dir" >/dev/null 2>"$dir/err$r" &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || true; done
  python3 - "$dir" "$n" "$victim" "$tr" >>"$RESULTS" <<'PY'
import sys, os
d, n, victim, tr = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
try:
    killed = float(open(f"{d}/killed{victim}").read())
    rows = [open(f"{d}/rank{r}").read().split("|") for r in range(n) if r != victim]
    done = max(float(x[3]) for x in rows)
    err = max(float(x[1]) for x in rows)
    shr = max(float(x[2]) for x in rows)
    print(tr, n, f"{done - killed:.1f}", f"{err:.1f}", f"{shr:.1f}")
except Exception as e:
    print(tr, n, "failed", "-", "-")
    sys.stderr.write(f"{tr} n={n}: run failed ({e}); see {d}\n")
    sys.exit(0)
PY
  if ! grep -q "^$tr $n failed" "$RESULTS"; then rm -rf "$dir"; fi
}
for ((k = 0; k < REPEATS; k++)); do
  for n in $NS; do
    for tr in $TRANSPORTS; do run_one "$tr" "$n"; done
  done
done
echo "load at end: $(cut -d' ' -f1-3 /proc/loadavg)"
python3 - "$RESULTS" "$REPEATS" <<'PY'
import sys, statistics, collections
cells = collections.defaultdict(list)
for line in open(sys.argv[1]):
    tr, n, a, b, c = line.split()
    cells[(tr, int(n))].append((a, b, c))
print(f"| transports | ranks | kill -> working shrunken comm, ms (median of {sys.argv[2]}) | error ms | shrink ms | runs failed |")
print("|---|---|---|---|---|---|")
for (tr, n), v in sorted(cells.items(), key=lambda kv: (kv[0][0], kv[0][1])):
    ok = [x for x in v if x[0] != "failed"]
    med = lambda i: f"{statistics.median(float(x[i]) for x in ok):.0f}" if ok else "-"
    print(f"| {tr} | {n} | {med(0)} | {med(1)} | {med(2)} | {len(v) - len(ok)} |")
PY
rm -f "$RESULTS"
