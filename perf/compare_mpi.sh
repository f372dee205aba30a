#!/usr/bin/env bash
# compare_mpi.sh: loom's all-reduce against OpenMPI's MPI_Allreduce, side by
# side, following ../shared/BENCHMARKING.md:
#   - both programs measure the same way (persistent pre-faulted buffers; each
#     iteration timed on its own; max over ranks; median over iterations);
#   - runs alternate A B A B ... (loom, MPI, loom, MPI, ...) with R repeats per
#     rank count, and every cell is the median over the repeats;
#   - the machine's load is printed at the start and at the end;
#   - a one-process memcpy at 64 MiB gives the physical reference, from which
#     the memory-bandwidth limit of a 2-rank all-reduce is derived (below).
#
# usage: perf/compare_mpi.sh [options]
#   -n "2 4 8"   rank counts (default "2 4 8"; env NRANKS)
#   -r R         repeats of each A/B pair (default 3; env REPEATS)
#   -b SIZE      smallest size (default 8; env MINBYTES)
#   -e SIZE      largest size (default 64M; env MAXBYTES)
#   -f F         size step factor (default 2)
#   -i N         timed iterations per size (default 20; env ITERS)
#   -w N         warm-up iterations per size (default 5; env WARMUP)
#   -c 0|1       let both programs verify their results (default 1; env CHECK)
#   -p PLACE     out_of_place (default) or in_place
#   -B DIR       build directory (default build; env BUILD_DIR)
#   -o DIR       where the JSON of every run is kept (default: a temp dir)
#   -t SECONDS   time limit of one run (default 900; env RUN_TIMEOUT)
# Needs build/bin/{loom-run,loom-perf,mpi-allreduce-perf,memcpy-bw}
# (cmake --build build) and mpirun.openmpi.
#
# Output: per rank count, one row per size:
#   size, loom time, mpi time, loom/mpi time ratio (< 1: loom is faster),
#   loom busbw, mpi busbw, loom/mpi busbw ratio (> 1: loom is faster),
#   followed by the range (min..max over repeats) of the ratio so that noise
#   can be judged; BENCHMARKING.md: differences under ~30% are noise unless
#   repeated sweeps agree.
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT_DIR="$(cd "$SCRIPT_DIR/.." && pwd)"

NRANKS="${NRANKS:-2 4 8}"
REPEATS="${REPEATS:-3}"
MINBYTES="${MINBYTES:-8}"
MAXBYTES="${MAXBYTES:-64M}"
STEP="${STEP:-2}"
ITERS="${ITERS:-20}"
WARMUP="${WARMUP:-5}"
CHECK="${CHECK:-1}"
PLACE="${PLACE:-out_of_place}"
BUILD_DIR="${BUILD_DIR:-$ROOT_DIR/build}"
OUT_DIR="${OUT_DIR:-}"
RUN_TIMEOUT="${RUN_TIMEOUT:-900}"

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }

while getopts "n:r:b:e:f:i:w:c:p:B:o:t:h" opt; do
  case "$opt" in
    n) NRANKS="$OPTARG" ;;
    r) REPEATS="$OPTARG" ;;
    b) MINBYTES="$OPTARG" ;;
    e) MAXBYTES="$OPTARG" ;;
    f) STEP="$OPTARG" ;;
    i) ITERS="$OPTARG" ;;
    w) WARMUP="$OPTARG" ;;
    c) CHECK="$OPTARG" ;;
    p) PLACE="$OPTARG" ;;
    B) BUILD_DIR="$OPTARG" ;;
    o) OUT_DIR="$OPTARG" ;;
    t) RUN_TIMEOUT="$OPTARG" ;;
    h) usage; exit 0 ;;
    *) usage >&2; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
if [[ $# -gt 0 ]]; then echo "compare_mpi.sh: unexpected argument '$1'" >&2; exit 2; fi
case "$PLACE" in out_of_place|in_place) ;; *) echo "compare_mpi.sh: -p out_of_place|in_place" >&2; exit 2 ;; esac
[[ "$REPEATS" =~ ^[1-9][0-9]*$ ]] || { echo "compare_mpi.sh: -r: a positive integer" >&2; exit 2; }
for n in $NRANKS; do
  [[ "$n" =~ ^[1-9][0-9]*$ ]] || { echo "compare_mpi.sh: -n: bad rank count '$n'" >&2; exit 2; }
done

BIN="$BUILD_DIR/bin"
LOOM_RUN="$BIN/loom-run"
LOOM_PERF="$BIN/loom-perf"
MPI_PERF="$BIN/mpi-allreduce-perf"
MEMCPY_BW="$BIN/memcpy-bw"
MPIRUN="${MPIRUN:-mpirun.openmpi}"
for f in "$LOOM_RUN" "$LOOM_PERF" "$MPI_PERF" "$MEMCPY_BW"; do
  [[ -x "$f" ]] || { echo "compare_mpi.sh: $f missing: build first (cmake --build $BUILD_DIR)" >&2; exit 1; }
done
command -v "$MPIRUN" >/dev/null || { echo "compare_mpi.sh: $MPIRUN not found" >&2; exit 1; }
PYTHON="${PYTHON:-/usr/bin/python3}"
[[ -x "$PYTHON" ]] || PYTHON="$(command -v python3)"

if [[ -z "$OUT_DIR" ]]; then
  OUT_DIR="$(mktemp -d /tmp/loom-compare.XXXXXX)"
fi
mkdir -p "$OUT_DIR"

echo "# compare_mpi.sh: loom all_reduce vs MPI_Allreduce, float32 sum"
echo "# date $(date -Is), host $(hostname), cores $(getconf _NPROCESSORS_ONLN)"
echo "# ranks: $NRANKS; repeats $REPEATS (alternating loom, MPI); sizes $MINBYTES..$MAXBYTES x$STEP;" \
     "iters $ITERS, warmup $WARMUP, check $CHECK; showing $PLACE"
LOAD_START="$(cat /proc/loadavg)"
echo "# loadavg at start: $LOAD_START"
CORES="$(getconf _NPROCESSORS_ONLN)"
if awk -v l="${LOAD_START%% *}" -v c="$CORES" 'BEGIN { exit !(l > 0.25 * c) }'; then
  echo "# WARNING: the machine is not quiet (1-min load ${LOAD_START%% *} on $CORES cores): expect noise"
fi
# Busy CPU time of the whole machine (jiffies), to tell at the end how much
# of it other processes used while we ran.
busy_jiffies() { awk '/^cpu / { print $2 + $3 + $4 + $7 + $8 + $9 }' /proc/stat; }
BUSY_START="$(busy_jiffies)"
WALL_START="$(date +%s.%N)"
echo "# per-run JSON in $OUT_DIR"

# ---------------------------------------------------------------------------
# Memory bandwidth reference.
# memcpy-bw reports rw_GBps = 2 * bytes / time: a copy of S bytes reads S and
# writes S, so this is the memory traffic one core can sustain.  -p 2 runs two
# copies at once (one per rank of a 2-rank job) and reports their sum.
# ---------------------------------------------------------------------------
"$MEMCPY_BW" -s 64M -n 20 -p 1 > "$OUT_DIR/memcpy_p1_start.txt"
"$MEMCPY_BW" -s 64M -n 20 -p 2 > "$OUT_DIR/memcpy_p2_start.txt"

# ---------------------------------------------------------------------------
# The sweeps: A B A B ...
# ---------------------------------------------------------------------------
FAILED=0
for n in $NRANKS; do
  for rep in $(seq 1 "$REPEATS"); do
    lj="$OUT_DIR/loom_n${n}_r${rep}.json"
    mj="$OUT_DIR/mpi_n${n}_r${rep}.json"
    rm -f "$lj" "$mj"
    echo "# n=$n repeat $rep/$REPEATS: loom ..." >&2
    rc=0
    timeout "$RUN_TIMEOUT" "$LOOM_RUN" -n "$n" "$LOOM_PERF" all_reduce -b "$MINBYTES" -e "$MAXBYTES" \
      -f "$STEP" -n "$ITERS" -w "$WARMUP" -c "$CHECK" -d float32 -o sum --json "$lj" \
      > "$OUT_DIR/loom_n${n}_r${rep}.txt" 2>&1 || rc=$?
    if [[ $rc -ne 0 ]]; then
      echo "# n=$n repeat $rep: loom-perf FAILED (exit $rc), see $OUT_DIR/loom_n${n}_r${rep}.txt" >&2
      FAILED=1
    fi
    echo "# n=$n repeat $rep/$REPEATS: mpi ..." >&2
    rc=0
    timeout "$RUN_TIMEOUT" "$MPIRUN" --allow-run-as-root --oversubscribe -np "$n" "$MPI_PERF" \
      -b "$MINBYTES" -e "$MAXBYTES" -f "$STEP" -n "$ITERS" -w "$WARMUP" -c "$CHECK" --json "$mj" \
      > "$OUT_DIR/mpi_n${n}_r${rep}.txt" 2>&1 || rc=$?
    if [[ $rc -ne 0 ]]; then
      echo "# n=$n repeat $rep: mpi-allreduce-perf FAILED (exit $rc), see $OUT_DIR/mpi_n${n}_r${rep}.txt" >&2
      FAILED=1
    fi
  done
done

# ---------------------------------------------------------------------------
# Summary.
#
# Memory-bandwidth limit of a 2-rank all-reduce of S bytes per rank
# (float32 sum; every buffer lives in its process's private memory and, at
# 64 MiB, far outside the caches):
#   Whatever the schedule, each rank must read its S input bytes from DRAM
#   once and write its S output bytes to DRAM once: 2S of DRAM traffic per
#   rank, 4S in all -- a read and a write per byte, the same mix as memcpy.
#   The bytes that cross between the processes (the peer's input half going
#   one way, the reduced half coming back: reduce-scatter + all-gather) can be
#   staged through small shared-memory chunks that are reused while still in
#   cache (pipelined ring slots), so in the best case they add no DRAM traffic.
#   Calibrate against memcpy, whose traffic is also one read + one write per
#   byte:
#     M1 = rw_GBps of `memcpy-bw -p 1` (one core alone),
#     M2 = rw_GBps_total of `memcpy-bw -p 2` (two cores copying at once).
#   Each rank on its own core:   time >= 2S / M1      -> algbw <= M1 / 2
#   Both sharing the memory bus: time >= 4S / M2      -> algbw <= M2 / 4
#   For n = 2, busbw = algbw * 2(n-1)/n = algbw, so
#       busbw_limit = min(M1 / 2, M2 / 4).
#   An implementation whose staging buffers spill to DRAM moves twice as much
#   (copy-in S, reduce 2S, copy-out S = 4S per rank; every crossing byte is
#   written to and read back from shared memory once), which halves the
#   limit: min(M1 / 4, M2 / 8); it is printed too.
#   memcpy-bw runs before and after the sweeps and the larger (less disturbed)
#   figure is used.  The limit is an estimate tied to memcpy's rate, not a
#   hard ceiling: a reduction loop's two read streams and one write stream
#   may move data somewhat faster than memcpy does.
#   At small sizes the buffers sit in cache and these limits do not apply.
# ---------------------------------------------------------------------------
BUSY_END="$(busy_jiffies)"
WALL_END="$(date +%s.%N)"
"$MEMCPY_BW" -s 64M -n 20 -p 1 > "$OUT_DIR/memcpy_p1_end.txt"
"$MEMCPY_BW" -s 64M -n 20 -p 2 > "$OUT_DIR/memcpy_p2_end.txt"
# CPU time (user and system) of everything this script ran: 2nd line of `times`.
# (`times` must run in this shell, not in a $(...) subshell.)
times > "$OUT_DIR/times.txt"
CHILD_TIMES="$(sed -n 2p "$OUT_DIR/times.txt")"
export OUT_DIR NRANKS REPEATS PLACE BUSY_START BUSY_END WALL_START WALL_END CHILD_TIMES CORES
export CLK_TCK="$(getconf CLK_TCK)"
"$PYTHON" - <<'PYEOF'
import json, os, statistics

out = os.environ["OUT_DIR"]
nranks = [int(x) for x in os.environ["NRANKS"].split()]
repeats = int(os.environ["REPEATS"])
place = os.environ["PLACE"]

def kv(path):
    d = {}
    with open(path) as f:
        for line in f:
            parts = line.split()
            if len(parts) == 2:
                d[parts[0]] = float(parts[1])
    return d

def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None

def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None

def fmt(x, spec):
    return format(x, spec) if x is not None else "-"

def human(n):
    for unit, div in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return str(n)

def best(name, key):
    vals = [kv(os.path.join(out, f"{name}_{w}.txt")).get(key) for w in ("start", "end")]
    vals = [v for v in vals if v is not None]
    return (max(vals) if vals else float("nan")), vals

M1, m1s = best("memcpy_p1", "rw_GBps")
M2, m2s = best("memcpy_p2", "rw_GBps_total")
print(f"# memcpy 64 MiB, one process: {M1:.2f} GB/s of memory traffic (read + write; "
      f"start/end {'/'.join(f'{v:.2f}' for v in m1s)})")
print(f"# memcpy 64 MiB, two processes at once: {M2:.2f} GB/s of traffic in all "
      f"(start/end {'/'.join(f'{v:.2f}' for v in m2s)})")
limit = min(M1 / 2, M2 / 4)
spill = min(M1 / 4, M2 / 8)
print(f"# 2-rank all-reduce memory-bandwidth limit at large sizes: busbw <= min(M1/2, M2/4) = "
      f"min({M1 / 2:.2f}, {M2 / 4:.2f}) = {limit:.2f} GB/s (2S of DRAM traffic per rank); "
      f"{spill:.2f} GB/s if the staging goes through DRAM (see compare_mpi.sh)")

wrong = 0
n2_big = None
for n in nranks:
    rows = {}  # size -> {"loom": [cells], "mpi": [cells]}
    missing = []
    for rep in range(1, repeats + 1):
        for tool in ("loom", "mpi"):
            d = load(os.path.join(out, f"{tool}_n{n}_r{rep}.json"))
            if d is None:
                missing.append(f"{tool} r{rep}")
                continue
            wrong += (d.get("wrong_total") or 0) + (d.get("oob_total") or 0)
            for r in d["rows"]:
                c = r.get(place)
                if c:
                    rows.setdefault(r["size"], {"loom": [], "mpi": []})[tool].append(c)
    print()
    print(f"## {n} ranks, float32 sum, {place}, median of {repeats} repeats"
          + (f"  (missing runs: {', '.join(missing)})" if missing else ""))
    print(f"# {'size':>8}  {'loom us':>9}  {'mpi us':>9}  {'t l/m':>6}  {'range':>13}  "
          f"{'loom busbw':>10}  {'mpi busbw':>9}  {'bw l/m':>6}")
    for size in sorted(rows):
        L, M = rows[size]["loom"], rows[size]["mpi"]
        lt = med([c["time_us"] for c in L]); mt = med([c["time_us"] for c in M])
        lb = med([c["busbw_GBps"] for c in L]); mb = med([c["busbw_GBps"] for c in M])
        tr = lt / mt if lt and mt else None
        br = lb / mb if lb and mb else None
        # Spread of the per-repeat ratios (repeat i of loom against repeat i of MPI).
        pairs = [(a["time_us"], b["time_us"]) for a, b in zip(L, M) if a["time_us"] and b["time_us"]]
        rng = (f"{min(a / b for a, b in pairs):.2f}..{max(a / b for a, b in pairs):.2f}"
               if pairs else "-")
        print(f"  {human(size):>8}  {fmt(lt, '9.2f')}  {fmt(mt, '9.2f')}  {fmt(tr, '6.2f')}  {rng:>13}  "
              f"{fmt(lb, '10.2f')}  {fmt(mb, '9.2f')}  {fmt(br, '6.2f')}")
        if n == 2:
            n2_big = (size, lb, mb)
print()
if n2_big and n2_big[1] is not None and n2_big[0] >= (32 << 20):
    size, lb, mb = n2_big
    print(f"# 2 ranks at {human(size)}: loom busbw {lb:.2f} GB/s = {100 * lb / limit:.0f}% of the "
          f"{limit:.2f} GB/s memory limit; MPI {fmt(mb, '.2f')} GB/s"
          + (f" = {100 * mb / limit:.0f}%" if mb else ""))
    if lb > limit * 1.1 or (mb and mb > limit * 1.1):
        print("#   (above the limit: memcpy was disturbed or under-reports the bus; see the comments)")
elif n2_big:
    print(f"# (largest size {human(n2_big[0])} < 32M: buffers fit in caches, the memory limit does not apply)")

# CPU time other processes used while the sweeps ran (BENCHMARKING.md: say
# when the machine was not quiet).
def secs(t):  # "1m2.5s" -> 62.5
    m, s = t.rstrip("s").split("m")
    return int(m) * 60 + float(s)
try:
    ours = sum(secs(t) for t in os.environ["CHILD_TIMES"].split())
    busy = (int(float(os.environ["BUSY_END"])) - int(float(os.environ["BUSY_START"]))) / int(os.environ["CLK_TCK"])
    wall = float(os.environ["WALL_END"]) - float(os.environ["WALL_START"])
    other = max(0.0, busy - ours)
    cores = int(os.environ["CORES"])
    print(f"# CPU time during the sweeps: {busy:.1f} s busy of {wall * cores:.1f} s available "
          f"({wall:.1f} s x {cores} cores); this script's processes {ours:.1f} s, "
          f"other processes {other:.1f} s ({other / wall:.2f} cores on average)"
          + ("  -> NOT quiet" if other / wall > 0.1 else ""))
except (KeyError, ValueError, ZeroDivisionError):
    pass
if wrong:
    print(f"# WARNING: {wrong} wrong or out-of-bounds values reported by the runs")
PYEOF

echo
echo "# loadavg at end: $(cat /proc/loadavg)"
if [[ "$FAILED" -ne 0 ]]; then
  echo "# some runs failed: see $OUT_DIR" >&2
  exit 1
fi
