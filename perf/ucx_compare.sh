#!/usr/bin/env bash
# ucx_compare.sh: how close each loom transport gets to the raw link.
#
# The reference is `ucx_perftest -t tag_bw` (UCP tagged messages of one
# size, one direction, a window of sends in flight), for UCX_TLS=tcp and
# UCX_TLS=sm: the link as UCX itself drives it.  What loom does is measured
# two ways, 2 ranks on this machine, each cell with loom-perf:
#
#   one-way (the like-for-like comparison): `loom-perf sendrecv -p oneway`, rank 0
#     loomSend's SIZE bytes to rank 1, one direction, as tag_bw does, over
#       ucx      LOOM_TRANSPORTS=ucx with the same UCX_TLS (sizes from
#                LOOM_UCX_RENDEZVOUS_BYTES go as one UCX message straight
#                into the receiver's buffer)
#       ucx-old  the same with LOOM_UCX_RENDEZVOUS_BYTES=0
#                UCX_RNDV_THRESH=auto: every byte through 64 KiB slots, each
#                a UCX rendezvous -- the ucx transport before issue 18
#       own      loom's own transport for that link: tcp (sockets) next to
#                UCX_TLS=tcp, shm next to UCX_TLS=sm
#     rate = SIZE / time (GB/s); x pt = rate / perftest's rate.
#   all-reduce (not like for like): `loom-perf all_reduce` (float32 sum, out
#     of place) busbw over the same three.  For N = 2, busbw = SIZE / time and
#     each rank sends and receives SIZE bytes in that time, both directions
#     at once, plus the reduction; a one-way stream's rate is the yardstick,
#     not the limit (on 2 shared cores both directions compete for them).
#
# Runs alternate between the configurations size by size (A B C ... A B C),
# each cell the median over -r repeats; the machine's load is printed at the
# start and at the end (shared/BENCHMARKING.md).  Rates in GB/s (1e9 B/s);
# ucx_perftest's MB/s are MiB/s and are converted.
#
# usage: perf/ucx_compare.sh [options]
#   -b SIZE   smallest size (default 8; env MINBYTES)
#   -e SIZE   largest size (default 64M; env MAXBYTES; always included)
#   -f F      size step factor (default 8; env STEP)
#   -r R      repeats per cell (default 1; env REPEATS)
#   -B DIR    build directory (default build; env BUILD_DIR)
#   -t SEC    time limit of one run (default 300)
#   -A        also the all-reduce table (default: one-way only)
# Needs DIR/bin/{loom-run,loom-perf} built with UCX, and ucx_perftest
# (Debian: ucx-utils).
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT_DIR="$(cd "$SCRIPT_DIR/.." && pwd)"
MINBYTES="${MINBYTES:-8}"
MAXBYTES="${MAXBYTES:-64M}"
STEP="${STEP:-8}"
REPEATS="${REPEATS:-1}"
BUILD_DIR="${BUILD_DIR:-$ROOT_DIR/build}"
RUN_TIMEOUT=300
ALLREDUCE=0

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
while getopts "b:e:f:r:B:t:Ah" opt; do
  case "$opt" in
    b) MINBYTES="$OPTARG" ;;
    e) MAXBYTES="$OPTARG" ;;
    f) STEP="$OPTARG" ;;
    r) REPEATS="$OPTARG" ;;
    B) BUILD_DIR="$OPTARG" ;;
    t) RUN_TIMEOUT="$OPTARG" ;;
    A) ALLREDUCE=1 ;;
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
if ! "$BIN/loom-perf" -h 2>/dev/null | grep -q "oneway"; then
  echo "ucx_compare.sh: $BIN/loom-perf has no one-way mode (sendrecv -p oneway; an older build)" >&2; exit 2
fi
PYTHON="$(command -v python3)"
export UCX_WARN_UNUSED_ENV_VARS=n

SIZES=()
s=$MIN
while [[ $s -lt $MAX ]]; do SIZES+=("$s"); s=$(( s * STEP )); done
SIZES+=("$MAX")

OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT

echo "# ucx_compare.sh: 2 ranks on $(hostname), $REPEATS repeat(s); loom-perf sendrecv -p oneway (one way)$( ((ALLREDUCE)) && echo ' and all_reduce float32 sum out of place')"
echo "# load at start: $(cut -d' ' -f1-3 /proc/loadavg) on $(getconf _NPROCESSORS_ONLN) cpus"
echo "# $(ucx_info -v 2>/dev/null | sed -n "s/^# Version /ucx /p")"

iters_for() {  # fewer iterations for large sizes
  local sz=$1 n=$(( 268435456 / $1 ))
  (( n > 1000 )) && n=1000
  (( n < 5 )) && n=5
  echo "$n"
}

loom_cell() {  # name coll size rep env... -> appends "name size rep GB/s" to $OUT/cells
  local name=$1 coll=$2 sz=$3 rep=$4; shift 4
  local n; n=$(iters_for "$sz")
  local js="$OUT/$name.$sz.$rep.json"
  # $coll unquoted: "sendrecv -p oneway" is a collective and its pattern
  if env "$@" timeout "$RUN_TIMEOUT" "$BIN/loom-run" -n 2 -- "$BIN/loom-perf" $coll -b "$sz" -e "$sz" \
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

OLD=(LOOM_UCX_RENDEZVOUS_BYTES=0 UCX_RNDV_THRESH=auto)
for sz in "${SIZES[@]}"; do
  for rep in $(seq 1 "$REPEATS"); do
    for tls in tcp sm; do
      own=$([[ $tls == tcp ]] && echo tcp || echo shm)
      perftest_cell "pt_$tls" "$tls" "$sz" "$rep"
      loom_cell "send_ucx_$tls" "sendrecv -p oneway" "$sz" "$rep" LOOM_TRANSPORTS=ucx UCX_TLS=$tls
      loom_cell "send_old_$tls" "sendrecv -p oneway" "$sz" "$rep" LOOM_TRANSPORTS=ucx UCX_TLS=$tls "${OLD[@]}"
      loom_cell "send_own_$tls" "sendrecv -p oneway" "$sz" "$rep" LOOM_TRANSPORTS=$own
      if ((ALLREDUCE)); then
        loom_cell "ar_ucx_$tls" all_reduce "$sz" "$rep" LOOM_TRANSPORTS=ucx UCX_TLS=$tls
        loom_cell "ar_old_$tls" all_reduce "$sz" "$rep" LOOM_TRANSPORTS=ucx UCX_TLS=$tls "${OLD[@]}"
        loom_cell "ar_own_$tls" all_reduce "$sz" "$rep" LOOM_TRANSPORTS=$own
      fi
    done
  done
done
echo "# load at end:   $(cut -d' ' -f1-3 /proc/loadavg)"

"$PYTHON" - "$OUT/cells" "$ALLREDUCE" <<'EOF'
import statistics, sys
cells = {}
for line in open(sys.argv[1]):
    name, size, rep, bw = line.split()
    cells.setdefault((name, int(size)), []).append(float(bw))
def med(name, size):
    v = cells.get((name, size))
    return statistics.median(v) if v else None
def fmt(x):
    return "      -" if x is None else f"{x:7.3f}"
def ratio(a, b):
    return "    -" if a is None or not b else f"{a / b:5.2f}"
sizes = sorted({s for _, s in cells})
def table(prefix, title):
    print(title)
    print(f"{'size':>10} | {'pt_tcp':>7} {'ucx':>7} {'x pt':>5} {'ucx-old':>7} {'x pt':>5} {'tcp':>7} {'x pt':>5}"
          f" | {'pt_sm':>7} {'ucx':>7} {'x pt':>5} {'ucx-old':>7} {'x pt':>5} {'shm':>7} {'x pt':>5}")
    for s in sizes:
        row = f"{s:>10}"
        for tls in ("tcp", "sm"):
            pt = med(f"pt_{tls}", s)
            row += f" | {fmt(pt)}"
            for k in ("ucx", "old", "own"):
                v = med(f"{prefix}_{k}_{tls}", s)
                row += f" {fmt(v)} {ratio(v, pt)}"
        print(row)
table("send", "# one way (like for like): GB/s of loom-perf sendrecv -p oneway (rank 0 -> rank 1) and ucx_perftest tag_bw (pt_*);\n"
      "# ucx: LOOM_TRANSPORTS=ucx, same UCX_TLS; ucx-old: + LOOM_UCX_RENDEZVOUS_BYTES=0 UCX_RNDV_THRESH=auto (all slots);\n"
      "# tcp/shm: loom's own transport; x pt = loom / perftest")
if sys.argv[2] == "1":
    print()
    table("ar", "# all-reduce (N = 2, both directions at once plus the reduction; not like for like): loom-perf\n"
          "# all_reduce busbw GB/s; x pt = busbw / perftest's one-way rate")
EOF
