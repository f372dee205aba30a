#!/usr/bin/env bash
# trainer_scaling.sh: what data parallelism through loom costs and gains in a
# training step, measured with the reference trainer (build/bin/loom-trainer).
#
# Weak scaling as frameworks report it: a fixed batch per rank (global batch =
# per-rank batch x N), the default 2.9M-parameter MLP on Fashion-MNIST.  For
# each N it measures
#   samples/s and scaling efficiency = samples/s(N) / (N x samples/s(1));
#   the share of step time a rank waits on communication, with buckets
#   issued during backward (overlap) and after it (no overlap), at the default
#   25 MB bucket cap (2 buckets for this model) and at 2 MB (4: one per layer);
#   model-state memory per rank (parameters, gradients, Adam state, buffers)
#   and peak RSS, with the replicated and the sharded (--zero) optimizer.
# Runs alternate between configurations, each repeated R times; cells are
# medians over the repeats (../shared/BENCHMARKING.md).  Times are the
# trainer's own: per step after 2 warm-up steps, slowest rank's step time,
# comm wait averaged over ranks.
#
# usage: perf/trainer_scaling.sh [-n "1 2 4"] [-r 3] [-s 30] [-b 64] [-B build]
set -euo pipefail
ROOT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
NRANKS="1 2 4"; REPEATS=3; STEPS=30; BATCH=64; BUILD_DIR="$ROOT_DIR/build"
while getopts "n:r:s:b:B:h" opt; do
  case $opt in
    n) NRANKS="$OPTARG" ;; r) REPEATS="$OPTARG" ;; s) STEPS="$OPTARG" ;;
    b) BATCH="$OPTARG" ;; B) BUILD_DIR="$OPTARG" ;;
    *) sed -n '2,20p' "$0"; exit 2 ;;
  esac
done
RUN="$BUILD_DIR/bin/loom-run"; TRAINER="$BUILD_DIR/bin/loom-trainer"
[[ -x "$RUN" && -x "$TRAINER" ]] || { echo "build first: bash scripts/build.sh" >&2; exit 2; }
OUT="$(mktemp -d)"; trap 'rm -rf "$OUT"' EXIT

echo "machine: $(getconf _NPROCESSORS_ONLN) cores, load at start: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "per-rank batch $BATCH, $STEPS steps per run, $REPEATS repeats, median reported"

CONFIGS=("overlap25:--bucket-mb 25" "nooverlap25:--bucket-mb 25 --no-overlap"
         "overlap2:--bucket-mb 2" "nooverlap2:--bucket-mb 2 --no-overlap")
for rep in $(seq "$REPEATS"); do
  for n in $NRANKS; do
    for c in "${CONFIGS[@]}"; do
      name="${c%%:*}"; flags="${c#*:}"
      "$RUN" -n "$n" --timeout 600 "$TRAINER" --steps "$STEPS" --global-batch $((BATCH * n)) \
        --no-eval --log-every 100000 $flags 2>&1 | grep 'summary:' > "$OUT/$n.$name.$rep" || true
    done
  done
done
for n in $NRANKS; do
  for z in "adam:" "adamzero:--zero"; do
    "$RUN" -n "$n" --timeout 600 "$TRAINER" --steps 5 --global-batch $((BATCH * n)) --optimizer adam \
      --no-eval --log-every 100000 ${z#*:} 2>&1 | grep 'summary:' > "$OUT/$n.${z%%:*}.1" || true
  done
done
echo "load at end: $(cut -d' ' -f1-3 /proc/loadavg)"

python3 - "$OUT" "$NRANKS" "$REPEATS" <<'PY'
import os, re, statistics, sys
out, nranks, reps = sys.argv[1], [int(x) for x in sys.argv[2].split()], int(sys.argv[3])
def get(n, name, rep):
    p = os.path.join(out, f"{n}.{name}.{rep}")
    s = open(p).read() if os.path.exists(p) else ""
    return dict(re.findall(r"(\w+)=([\w.\-]+)%?", s))
def med(n, name, key):
    v = [float(get(n, name, r)[key]) for r in range(1, reps + 1) if key in get(n, name, r)]
    return statistics.median(v) if v else float("nan")
base = med(nranks[0], "overlap25", "samples_per_s") / nranks[0]
print("\n| ranks | buckets | overlap | samples/s | scaling eff. | step ms | comm wait ms | comm share |")
print("|---|---|---|---|---|---|---|---|")
for n in nranks:
    for name, cap, ov in [("overlap25", "25 MB", "yes"), ("nooverlap25", "25 MB", "no"),
                          ("overlap2", "2 MB", "yes"), ("nooverlap2", "2 MB", "no")]:
        sps = med(n, name, "samples_per_s")
        print(f"| {n} | {cap} | {ov} | {sps:.0f} | {sps / (n * base) * 100:.0f}% | "
              f"{med(n, name, 'step_ms'):.1f} | {med(n, name, 'comm_wait_ms'):.1f} | "
              f"{med(n, name, 'comm_share'):.1f}% |")
print("\n| ranks | optimizer | model state MB per rank | peak RSS MB per rank |")
print("|---|---|---|---|")
for n in nranks:
    for name, label in [("adam", "Adam, replicated"), ("adamzero", "Adam, sharded (--zero)")]:
        d = get(n, name, 1)
        print(f"| {n} | {label} | {d.get('model_state_mb', '?')} | {d.get('peak_rss_mb', '?')} |")
PY
