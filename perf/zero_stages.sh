#!/usr/bin/env bash
# zero_stages.sh: what ZeRO stages 0-3 of the reference trainer cost in
# throughput and save in memory, and how much of ZeRO-3's all-gather time
# the prefetch hides (build/bin/loom-trainer, docs/usage.md).
#
# Model: --hidden 1024x8 by default (784-1024x8-10, 8.4M parameters, 34 MB),
# Adam, a fixed batch per rank (global batch = per-rank batch x N), synthetic
# data (no decompression in the timing).  For each N and stage it reports
# samples/s (slowest rank's step time), the model state a rank holds
# (parameters, gathered layers, gradients, optimizer state) and its resident
# and peak memory.  Stage 2 and 3 use --bucket-mb 4 (stage 2's staging
# buffers are two buckets).
#
# Hidden share of ZeRO-3's all-gathers, at each N > 1: the time a rank waits
# for all-gathers with prefetch (wait_p) against without it (wait_np, where
# every all-gather is waited for whole):  hidden = 1 - wait_p / wait_np;
# with the trainer's default loomMemAlloc buffers (zero-copy all-gathers on
# shared memory) and with --plain-buffers (ordinary memory: the ring).
#
# Runs alternate between configurations, each repeated R times; cells are
# medians over the repeats (../shared/BENCHMARKING.md).  Times are the
# trainer's own: per step after 2 warm-up steps.
#
# usage: perf/zero_stages.sh [-n "1 2 4"] [-r 3] [-s 8] [-b 32] [-m 1024x8] [-B build]
set -euo pipefail
ROOT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
NRANKS="1 2 4"; REPEATS=3; STEPS=8; BATCH=32; MODEL=1024x8; BUILD_DIR="$ROOT_DIR/build"
while getopts "n:r:s:b:m:B:h" opt; do
  case $opt in
    n) NRANKS="$OPTARG" ;; r) REPEATS="$OPTARG" ;; s) STEPS="$OPTARG" ;;
    b) BATCH="$OPTARG" ;; m) MODEL="$OPTARG" ;; B) BUILD_DIR="$OPTARG" ;;
    *) sed -n '2,22p' "$0"; exit 2 ;;
  esac
done
RUN="$BUILD_DIR/bin/loom-run"; TRAINER="$BUILD_DIR/bin/loom-trainer"
[[ -x "$RUN" && -x "$TRAINER" ]] || { echo "build first: bash scripts/build.sh" >&2; exit 2; }
OUT="$(mktemp -d)"; trap 'rm -rf "$OUT"' EXIT

echo "machine: $(getconf _NPROCESSORS_ONLN) cores, load at start: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "model --hidden $MODEL, adam, per-rank batch $BATCH, $STEPS steps per run, $REPEATS repeats, median reported"
CPU0=$(awk '/^cpu /{print $2+$3+$4+$7+$8}' /proc/stat); T0=$(date +%s)

CONFIGS=("z0:--zero 0" "z1:--zero 1" "z2:--zero 2 --bucket-mb 4" "z3:--zero 3" "z3np:--zero 3 --no-prefetch"
         "z3pl:--zero 3 --plain-buffers" "z3plnp:--zero 3 --plain-buffers --no-prefetch")
for rep in $(seq "$REPEATS"); do
  for n in $NRANKS; do
    for c in "${CONFIGS[@]}"; do
      name="${c%%:*}"; flags="${c#*:}"
      [[ $name == z3*np && $n == 1 ]] && continue
      "$RUN" -n "$n" --timeout 600 "$TRAINER" --synthetic --hidden "$MODEL" --optimizer adam \
        --steps "$STEPS" --global-batch $((BATCH * n)) --no-eval --log-every 100000 $flags 2>&1 |
        grep 'summary:' > "$OUT/$n.$name.$rep" || true
    done
  done
done
CPU1=$(awk '/^cpu /{print $2+$3+$4+$7+$8}' /proc/stat); T1=$(date +%s)
DT=$(( T1 > T0 ? T1 - T0 : 1 )); HZ=$(getconf CLK_TCK); NCPU=$(getconf _NPROCESSORS_ONLN)
OURS=$(awk '{print $16 + $17}' /proc/$$/stat)  # CPU time of the runs (reaped children)
echo "load at end: $(cut -d' ' -f1-3 /proc/loadavg); over $DT s the cores were" \
     "$(( (CPU1 - CPU0) * 100 / (HZ * DT * NCPU) ))% busy, $(( OURS * 100 / (HZ * DT * NCPU) ))% with these runs," \
     "$(( (CPU1 - CPU0 - OURS) * 100 / (HZ * DT * NCPU) ))% with other processes"

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
print("\n| ranks | stage | samples/s | step ms | comm wait ms | params MB | gathered MB | grads MB "
      "| optim MB | model state MB | RSS MB | peak RSS MB |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for n in nranks:
    for name, label in [("z0", "0"), ("z1", "1"), ("z2", "2"), ("z3", "3"), ("z3np", "3, no prefetch"),
                        ("z3pl", "3, plain buffers"), ("z3plnp", "3, plain, no prefetch")]:
        if name.endswith("np") and n == 1:
            continue
        cells = [f"{med(n, name, 'samples_per_s'):.0f}", f"{med(n, name, 'step_ms'):.1f}",
                 f"{med(n, name, 'comm_wait_ms'):.1f}"]
        cells += [f"{med(n, name, k):.1f}" for k in
                  ("params_mb", "gathered_mb", "grads_mb", "optim_mb", "model_state_mb", "rss_mb", "peak_rss_mb")]
        print(f"| {n} | {label} | " + " | ".join(cells) + " |")
print("\n| ranks | buffers | all-gather wait ms/step, prefetch | without prefetch | hidden by prefetch |")
print("|---|---|---|---|---|")
for n in nranks:
    if n == 1:
        continue
    for p, label in [("z3", "loomMemAlloc (zero-copy)"), ("z3pl", "plain (ring)")]:
        wp, wnp = med(n, p, "gather_wait_ms"), med(n, p + "np", "gather_wait_ms")
        print(f"| {n} | {label} | {wp:.2f} | {wnp:.2f} | {100 * (1 - wp / wnp):.0f}% |")
PY
