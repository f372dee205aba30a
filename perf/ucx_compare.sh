#!/usr/bin/env bash
# ucx_compare.sh: how close each loom transport gets to the raw link.
#
# For 2 ranks on this machine, one table with, per size:
#   - loom-perf all_reduce (float32 sum, out of place) bus bandwidth over
#       ucx/tcp  LOOM_TRANSPORTS=ucx UCX_TLS=tcp
#       tcp      LOOM_TRANSPORTS=tcp   (loom's own sockets)
#       ucx/sm   LOOM_TRANSPORTS=ucx UCX_TLS=sm
#       shm      LOOM_TRANSPORTS=shm   (loom's own shared memory)
#   - ucx_perftest tag_bw (UCP tagged point-to-point, one direction)
#     bandwidth for UCX_TLS=tcp and UCX_TLS=sm: the raw link under UCX.
# For 2 ranks an all-reduce's bus bandwidth is bytes/time, and each rank
# sends and receives `bytes` in that time (both directions at once), so
# busbw = 1.0 x link means loom keeps the link as busy as a one-way stream.
# Runs alternate between the configurations size by size (A B C D A B ...),
# each cell the median over -r repeats; the machine's load is printed at the
# start and at the end (shared/BENCHMARKING.md).
#
# usage: perf/ucx_compare.sh [options]
#   -b SIZE   smallest size (default 8; env MINBYTES)
#   -e SIZE   largest size (default 64M; env MAXBYTES; always included)
#   -f F      size step factor (default 8; env STEP)
#   -r R      repeats per cell (default 1; env REPEATS)
#   -B DIR    build directory (default build; env BUILD_DIR)
#   -t SEC    time limit of one run (default 300)
# Needs build/bin/{loom-run,loom-perf} built with UCX, and ucx_perftest
# (Debian: ucx-utils).  Bandwidths in GB/s (1e9 bytes/s); ucx_perftest's
# MB/s are MiB/s and are converted.
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT_DIR="$(cd "$SCRIPT_DIR/.." && pwd)"
MINBYTES="${MINBYTES:-8}"
MAXBYTES="${MAXBYTES:-64M}"
STEP="${STEP:-8}"
REPEATS="${REPEATS:-1}"
BUILD_DIR="${BUILD_DIR:-$ROOT_DIR/build}"
RUN_TIMEOUT=300

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
while getopts "b:e:f:r:B:t:h" opt; do
  case "$opt" in
    b) MINBYTES="$OPTARG" ;;
    e) MAXBYTES="$OPTARG" ;;
    f) STEP="$OPTARG" ;;
    r) REPEATS="$OPTARG" ;;
    B) BUILD_DIR="$OPTARG" ;;
    t) RUN_TIMEOUT="$OPTARG" ;;
    h) usage; exit 0 ;;
    *) usage >&2; exit 2 ;;
  esac
done

bytes() {  # 8, 4K, 64M -> bytes
  local v="$1"
  case "$v" in
    *[kK]) echo $(( ${v%?} * 1024 )) ;;
    *[mM]) echo $(( ${v%?} * 1024 * 1024 )) ;;
    *[gG]) echo $(( ${v%?} * 1024 * 1024 * 1024 )) ;;
    *) echo $(( v )) ;;
  esac
}
MIN=$(bytes "$MINBYTES"); MAX=$(bytes "$MAXBYTES")
[[ "$STEP" -ge 2 && "$MIN" -ge 4 && "$MAX" -ge "$MIN" ]] || { echo "ucx_compare.sh: bad sizes/step" >&2; exit 2; }

BIN="$BUILD_DIR/bin"
for p in "$BIN/loom-run" "$BIN/loom-perf"; do
  [[ -x "$p" ]] || { echo "ucx_compare.sh: $p not found (bash scripts/build.sh)" >&2; exit 2; }
done
command -v ucx_perftest >/dev/null || { echo "ucx_compare.sh: ucx_perftest not found (apt-get install ucx-utils)" >&2; exit 2; }
if ! LOOM_TRANSPORTS=ucx "$BIN/loom-run" -n 1 -- "$BIN/loom-perf" all_reduce -b 8 -e 8 -n 1 -w 0 >/dev/null 2>&1; then
  echo "ucx_compare.sh: this loom has no ucx transport (built without UCX?)" >&2; exit 2
fi
PYTHON="$(command -v python3)"
export UCX_WARN_UNUSED_ENV_VARS=n

SIZES=()
s=$MIN
while [[ $s -lt $MAX ]]; do SIZES+=("$s"); s=$(( s * STEP )); done
SIZES+=("$MAX")

OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT

echo "# ucx_compare.sh: 2 ranks on $(hostname), all_reduce float32 sum out of place, $REPEATS repeat(s)"
echo "# load at start: $(cut -d' ' -f1-3 /proc/loadavg) on $(getconf _NPROCESSORS_ONLN) cpus"
echo "# $(ucx_info -v 2>/dev/null | sed -n "s/^# Version /ucx /p")"

iters_for() {  # fewer iterations for large sizes
  local sz=$1 n=$(( 268435456 / $1 ))
  (( n > 1000 )) && n=1000
  (( n < 5 )) && n=5
  echo "$n"
}

loom_cell() {  # name env... -> appends "name size rep busbw" to $OUT/cells
  local name=$1 sz=$2 rep=$3; shift 3
  local n; n=$(iters_for "$sz")
  local js="$OUT/$name.$sz.$rep.json"
  if env "$@" timeout "$RUN_TIMEOUT" "$BIN/loom-run" -n 2 -- "$BIN/loom-perf" all_reduce -b "$sz" -e "$sz" \
       -n "$n" -w 3 -c 0 --json "$js" >"$OUT/$name.$sz.$rep.txt" 2>&1; then
    "$PYTHON" -c 'import json,sys; r=json.load(open(sys.argv[1]))["rows"][0]["out_of_place"]; print(sys.argv[2], sys.argv[3], sys.argv[4], r["busbw_GBps"])' \
      "$js" "$name" "$sz" "$rep" >>"$OUT/cells"
  else
    echo "# $name size $sz: loom-perf failed, see below" >&2; tail -5 "$OUT/$name.$sz.$rep.txt" >&2
  fi
}

perftest_cell() {  # name tls size rep
  local name=$1 tls=$2 sz=$3 rep=$4
  local n; n=$(iters_for "$sz")
  local port=$(( 13000 + RANDOM % 20000 ))
  UCX_TLS=$tls timeout "$RUN_TIMEOUT" ucx_perftest -p "$port" >"$OUT/srv.txt" 2>&1 &
  local srv=$!
  sleep 0.5
  local out=""
  for try in 1 2 3 4 5; do
    if out=$(UCX_TLS=$tls timeout "$RUN_TIMEOUT" ucx_perftest -p "$port" -t tag_bw -s "$sz" -n "$n" -w 3 127.0.0.1 2>&1); then
      break
    fi
    sleep 0.5
  done
  wait "$srv" 2>/dev/null || true
  local mbs; mbs=$(echo "$out" | awk '/^Final:/ {print $7}')
  if [[ -n "$mbs" ]]; then
    echo "$name $sz $rep $(awk -v m="$mbs" 'BEGIN {printf "%.6g", m * 1048576 / 1e9}')" >>"$OUT/cells"
  else
    echo "# $name size $sz: ucx_perftest failed:" >&2; echo "$out" | tail -3 >&2
  fi
}

for sz in "${SIZES[@]}"; do
  for rep in $(seq 1 "$REPEATS"); do
    loom_cell ucx_tcp "$sz" "$rep" LOOM_TRANSPORTS=ucx UCX_TLS=tcp
    loom_cell tcp "$sz" "$rep" LOOM_TRANSPORTS=tcp
    perftest_cell perftest_tcp tcp "$sz" "$rep"
    loom_cell ucx_sm "$sz" "$rep" LOOM_TRANSPORTS=ucx UCX_TLS=sm
    loom_cell shm "$sz" "$rep" LOOM_TRANSPORTS=shm
    perftest_cell perftest_sm sm "$sz" "$rep"
  done
done
echo "# load at end:   $(cut -d' ' -f1-3 /proc/loadavg)"

"$PYTHON" - "$OUT/cells" <<'EOF'
import statistics, sys
cells = {}
for line in open(sys.argv[1]):
    name, size, rep, bw = line.split()
    cells.setdefault((name, int(size)), []).append(float(bw))
cols = ["ucx_tcp", "tcp", "perftest_tcp", "ucx_sm", "shm", "perftest_sm"]
def med(name, size):
    v = cells.get((name, size))
    return statistics.median(v) if v else None
def fmt(x):
    return "      -" if x is None else f"{x:7.3f}"
def ratio(a, b):
    return "    -" if a is None or not b else f"{a / b:5.2f}"
sizes = sorted({s for _, s in cells})
print("# busbw GB/s: loom all_reduce (N=2) over ucx/tcp, loom tcp, ucx/sm, loom shm;")
print("# perftest_*: ucx_perftest tag_bw one-way GB/s for the same UCX_TLS; x/pt = loom busbw / perftest")
print(f"{'size':>10} {'ucx/tcp':>7} {'tcp':>7} {'pt_tcp':>7} {'ucx/pt':>6} {'tcp/pt':>6}   "
      f"{'ucx/sm':>7} {'shm':>7} {'pt_sm':>7} {'ucx/pt':>6} {'shm/pt':>6}")
for s in sizes:
    a, b, c = med("ucx_tcp", s), med("tcp", s), med("perftest_tcp", s)
    d, e, f = med("ucx_sm", s), med("shm", s), med("perftest_sm", s)
    print(f"{s:>10} {fmt(a)} {fmt(b)} {fmt(c)} {ratio(a, c):>6} {ratio(b, c):>6}   "
          f"{fmt(d)} {fmt(e)} {fmt(f)} {ratio(d, f):>6} {ratio(e, f):>6}")
EOF
