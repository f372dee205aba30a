#!/usr/bin/env bash
# algo_sweep.sh: every algorithm forced in turn (LOOM_ALGO) against the
# tuner's own choice, for one collective, per rank count and size.  Prints a
# table of median times (us) per algorithm, the fastest, what the tuner chose
# and its time relative to the fastest, and exits 1 if any choice is more than
# the tolerance slower than the fastest forced algorithm (issue 5's check).
#
# usage: perf/algo_sweep.sh [options]
#   -c COLL      all_reduce (default), reduce_scatter, all_gather, broadcast, reduce
#   -n "2 3 4 8" rank counts (default "2 3 4 8")
#   -H K         ranks pose as K hosts (loom-run --hosts K; default 1)
#   -T LIST      LOOM_TRANSPORTS (default: loom's default)
#   -b/-e/-f     sizes (default 8 .. 64M, factor 8)
#   -i N         timed iterations per size (default 20), -w warm-up (default 3)
#   -r R         repeats; runs alternate over the algorithms, the cell is the
#                median over repeats of loom-perf's median (default 3)
#   -t TOL       tolerance for the tuner's choice (default 0.10)
#   -o DIR       keep loom-perf's JSON here (default: a temp dir)
# The machine's load is printed before and after (see ../shared/BENCHMARKING.md:
# differences under ~30% are noise on the 2-core VMs unless repeated).
set -euo pipefail

ROOT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN="${BUILD_DIR:-$ROOT_DIR/build}/bin"
COLL=all_reduce NRANKS="2 3 4 8" HOSTS=1 TRANSPORTS="" MINB=8 MAXB=64M STEP=8 ITERS=20 WARM=3 REPEATS=3 TOL=0.10 OUT=""
while getopts "c:n:H:T:b:e:f:i:w:r:t:o:h" opt; do
  case "$opt" in
    c) COLL="$OPTARG" ;; n) NRANKS="$OPTARG" ;; H) HOSTS="$OPTARG" ;; T) TRANSPORTS="$OPTARG" ;;
    b) MINB="$OPTARG" ;; e) MAXB="$OPTARG" ;; f) STEP="$OPTARG" ;; i) ITERS="$OPTARG" ;;
    w) WARM="$OPTARG" ;; r) REPEATS="$OPTARG" ;; t) TOL="$OPTARG" ;; o) OUT="$OPTARG" ;;
    *) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 2 ;;
  esac
done
[[ -x "$BIN/loom-perf" && -x "$BIN/loom-run" ]] || { echo "algo_sweep: build first (bash scripts/build.sh)" >&2; exit 2; }
[[ -n "$OUT" ]] || OUT="$(mktemp -d /tmp/loom-algo-sweep.XXXXXX)"
mkdir -p "$OUT"

key="${COLL//_/}"  # LOOM_ALGO's collective name: allreduce, reducescatter, ...
case "$COLL" in
  all_reduce) ALGOS="oneshot staged ring rhd tree" ;;
  reduce_scatter | all_gather) ALGOS="oneshot ring rhd" ;;
  broadcast) ALGOS="oneshot ring tree" ;;
  reduce) ALGOS="oneshot ring" ;;
  *) echo "algo_sweep: unknown collective $COLL" >&2; exit 2 ;;
esac
if ((HOSTS > 1)); then
  ALGOS="${ALGOS/oneshot /}"; ALGOS="${ALGOS/staged /}"
  case "$COLL" in all_reduce) ALGOS="$ALGOS hier-ring hier-rhd hier-tree" ;; reduce_scatter | all_gather) ALGOS="$ALGOS hier" ;; esac
fi

echo "# algo_sweep $COLL, ranks {$NRANKS}, hosts $HOSTS, transports ${TRANSPORTS:-default}, $REPEATS repeats, $(date -u +%FT%TZ)"
echo "# load before: $(cut -d' ' -f1-3 /proc/loadavg)"
for n in $NRANKS; do
  for rep in $(seq 1 "$REPEATS"); do
    for algo in auto $ALGOS; do
      env_args=()
      [[ "$algo" != auto ]] && env_args+=("LOOM_ALGO=$key:$algo")
      [[ -n "$TRANSPORTS" ]] && env_args+=("LOOM_TRANSPORTS=$TRANSPORTS")
      hosts_args=()
      ((HOSTS > 1)) && hosts_args=(--hosts "$HOSTS")
      env "${env_args[@]}" LOOM_DEBUG=WARN "$BIN/loom-run" -n "$n" "${hosts_args[@]}" -- "$BIN/loom-perf" "$COLL" \
        -b "$MINB" -e "$MAXB" -f "$STEP" -n "$ITERS" -w "$WARM" --json "$OUT/$n-$algo-$rep.json" >"$OUT/$n-$algo-$rep.log" 2>&1 ||
        { echo "algo_sweep: run n=$n algo=$algo failed (see $OUT/$n-$algo-$rep.log)" >&2; exit 1; }
    done
  done
  if ((HOSTS > 1)); then hosts_flag="--hosts $HOSTS"; else hosts_flag=""; fi
  LOOM_DEBUG=INFO LOOM_DEBUG_SUBSYS=TUNE "$BIN/loom-run" -n "$n" $hosts_flag -- "$BIN/loom-perf" "$COLL" -b 8 -e 8 -n 1 -w 0 \
    2>&1 | grep -o 'TUNE .*' >"$OUT/$n-choice.txt" || true
done
echo "# load after: $(cut -d' ' -f1-3 /proc/loadavg)"

python3 - "$OUT" "$TOL" "$COLL" "$NRANKS" "auto $ALGOS" "$REPEATS" <<'EOF'
import json, statistics, sys
out, tol, coll, nranks, algos, reps = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4].split(), sys.argv[5].split(), int(sys.argv[6])
bad = 0
for n in nranks:
    t = {}
    for a in algos:
        for r in range(1, reps + 1):
            with open(f"{out}/{n}-{a}-{r}.json") as f:
                for row in json.load(f)["rows"]:
                    c = row["out_of_place"]
                    if c and c["wrong"] in (0, None):
                        t.setdefault((row["size"], a), []).append(c["time_us"])
    sizes = sorted({s for s, _ in t})
    try:
        choice = open(f"{out}/{n}-choice.txt").read().strip().splitlines()
    except OSError:
        choice = []
    key = coll.replace("_", "")
    line = next((l.split("TUNE ", 1)[-1] for l in choice if l.split("TUNE ", 1)[-1].replace(" ", "").lower().startswith(key)), "")
    # "AllReduce: oneshot <= 16K, staged <= 512K, rhd (cost model, ...)" -> [(16384, oneshot), ...]
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    ranges = []
    for part in line.split(":", 1)[-1].split("(")[0].split(","):
        part = part.strip()
        if not part:
            continue
        if "<=" in part:
            a, lim = [x.strip() for x in part.split("<=")]
            ranges.append((int(lim.rstrip("KMG")) * units[lim[-1] if lim[-1] in "KMG" else ""], a))
        else:
            ranges.append((float("inf"), part))
    def chosen(size):
        for lim, a in ranges:
            if size <= lim:
                return a if a in algos else ("hier" if a.startswith("hier") and "hier" in algos else a)
        return None
    print(f"\n## {coll}, N={n}  tuner: {line}")
    forced = [a for a in algos if a != "auto"]
    print(f"{'size':>10} " + " ".join(f"{a:>10}" for a in ["auto"] + forced) + f" {'fastest':>10} {'choice':>10} {'choice/best':>11} {'auto/best':>9}")
    for s in sizes:
        med = {a: statistics.median(t[(s, a)]) for a in algos if (s, a) in t}
        # one-shot above its mailbox size falls back to the ring: not its own number
        cand = {a: v for a, v in med.items() if a != "auto" and not (a == "oneshot" and s > 16384 * (1 if coll in ("all_reduce", "broadcast", "reduce") else int(n)))}
        if not cand or "auto" not in med:
            continue
        best = min(cand, key=cand.get)
        c = chosen(s)
        cr = cand[c] / cand[best] if c in cand else float("nan")
        ratio = med["auto"] / cand[best]
        # The check compares the chosen algorithm's own forced time with the
        # fastest: separate runs of one algorithm differ by more than 10% here.
        flag = "" if cr == cr and cr <= 1 + tol else "  <-- choice slower than the fastest by more than %d%%" % round(tol * 100)
        bad += bool(flag)
        cells = " ".join(f"{med.get(a, float('nan')):10.1f}" if a in med and (a == 'auto' or a in cand) else f"{'-':>10}" for a in ["auto"] + forced)
        print(f"{s:>10} {cells} {best:>10} {str(c):>10} {cr:11.2f} {ratio:9.2f}{flag}")
print(f"\n{bad} size(s) where the tuner's choice (its own forced time) was more than {round(tol*100)}% slower than the fastest forced algorithm")
sys.exit(1 if bad else 0)
EOF
