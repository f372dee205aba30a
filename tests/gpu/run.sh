#!/usr/bin/env bash
# The GPU suite, one command on a machine with an NVIDIA GPU:
#   tests/gpu/run.sh [PHASE...]         (default: every phase, in order)
# PHASE: probe, check, perf, hier, sanitize, sweep (each builds first if it
# must; sweep, not in the default list, measures the IPC all-reduce at
# every LOOM_DEVICE_SLOT_BYTES from 4 to 128 MiB under MPS).  The
# lent GPU machine takes at most 10 minutes a call, so there run one or two
# phases a call (docs/testing.md, "On the GPU machine"); every step has a
# timeout of LOOM_GPU_STEP_TIMEOUT seconds (default 240).  LOOM_GPU_BUILD
# names the build folder (default build-gpu); LOOM_GPU_RESULTS a file that
# gets each step's result as it ends.  Where the machine lacks
# pkg-config, hwloc or Catch2, tests/gpu/deps.sh takes them from .gpudeps
# (bash scripts/gpu-deps.sh on the dev machine, carried with the call).
# Builds loom with the CUDA plug-in for the GPU found (its compute
# capability), runs the host-side CUDA unit tests, the GPU checks
# (loom-gpu-tests: kernels bit for bit against the host, every collective x
# program variant with 1, 2 and 4 ranks on the one GPU, stream order), CUDA
# communicators through the C API (loom-gpu-comm-tests: LOOM_DEVICE=cuda,
# 1, 2 and 4 processes sharing the one GPU, every collective on device
# buffers, send/recv staging made on first use, a group over two
# communicators, loomMemAlloc's device memory, the call returning before
# the stream's work is done, errors), the same with LOOM_DEVICE_PATH=staged
# (device buffers through pinned host memory, the path between hosts),
# their all-reduce speed (loom-gpu-comm-perf, printed, not judged), loom-perf
# on device buffers (-G: all-reduce up to 256 MiB, all-to-all, gather,
# scatter and sendrecv, 2 ranks, checked; all-reduce, reduce-scatter and
# all-gather on the hierarchical and the staged path with 4 ranks posing as
# 2 hosts), a short
# run of each under compute-sanitizer when it is installed, and prints a
# table.
# Exits non-zero on any wrong value, error or hang.
set -uo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
build=${LOOM_GPU_BUILD:-$here/build-gpu}
phases=("$@")
[ ${#phases[@]} -eq 0 ] && phases=(probe check perf hier sanitize)
for p in "${phases[@]}"; do
  case $p in
  probe | check | perf | hier | sanitize | sweep) ;;
  *) echo "run.sh: unknown phase $p (probe, check, perf, hier, sanitize, sweep)" >&2; exit 2 ;;
  esac
done
run=("$build/bin/loom-run")
lp=("$build/bin/loom-perf")
nvsmi=$(command -v nvidia-smi || true)
if [[ -z "$nvsmi" ]] || ! "$nvsmi" -L >/dev/null 2>&1; then
  echo "run.sh: no GPU (nvidia-smi -L fails): nothing to run" >&2
  exit 77
fi
"$nvsmi" -L
cap=$("$nvsmi" --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d ' .')
export PATH=/usr/local/cuda/bin:$PATH
source "$here/tests/gpu/deps.sh"
loom_gpu_deps "$here" || exit 2
echo "== build for sm_$cap in $build"
t0=$SECONDS
cmake -S "$here" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DLOOM_BUILD_TORCH=OFF \
  -DLOOM_CUDA_ARCHS="$cap" >"$build.cmake.log" 2>&1 || { tail -20 "$build.cmake.log"; exit 1; }
# Only what the phases asked for run (the unit tests are most of the build).
targets=(loom loom_cuda)
for phase in "${phases[@]}"; do
  case $phase in
  probe) targets+=(loom-gpu-probe) ;;
  check) targets+=(loom-unit-tests loom-gpu-tests loom-gpu-comm-tests) ;;
  perf | hier | sweep) targets+=(loom-gpu-comm-perf loom-perf loom-run) ;;
  sanitize) targets+=(loom-gpu-tests loom-gpu-comm-tests) ;;
  esac
done
cmake --build "$build" -j"$(nproc)" --target "${targets[@]}" >"$build.build.log" 2>&1 ||
  { tail -40 "$build.build.log"; exit 1; }
echo "   built in $((SECONDS - t0)) s"
# LOOM_GPU_RESULTS: a file that gets each step's row as it finishes, so a
# call cut off at its limit still says what ran (the device tool's $OUT).
results_file=${LOOM_GPU_RESULTS:-}
[ -n "$results_file" ] && echo "build: $((SECONDS - t0)) s" >>"$results_file"

declare -a names results
status=0
step() {  # step NAME COMMAND...: runs it under the step timeout, records ok/FAIL
  local name=$1; shift
  local lim; lim=$(loom_step_limit)
  if [ "$lim" -le 0 ]; then record "$name" "NOT RUN (LOOM_GPU_BUDGET=${LOOM_GPU_BUDGET} s spent)"; status=1; return; fi
  echo "== $name: $*"
  local t=$SECONDS
  timeout -k 15 "$lim" "$@"  # -k: a process that ignores SIGTERM does not hold the call to its limit
  local rc=$?
  if [ $rc -eq 0 ]; then record "$name" "ok ($((SECONDS - t)) s)"; elif [ $rc -eq 124 ]; then
    record "$name" "TIMEOUT (${lim} s)"; status=1; else record "$name" "FAIL ($rc)"; status=1; fi
}
record() {  # record NAME RESULT: a row of the table (and of LOOM_GPU_RESULTS)
  names+=("$1"); results+=("$2")
  [ -n "$results_file" ] && printf '%-75s %s\n' "$1" "$2" >>"$results_file"
  return 0
}
# perf, hier and sweep run under a private MPS daemon where the machine
# has one (deps.sh's loom_mps_start; LOOM_GPU_MPS=0: never), stopped when
# the phase ends.
mps_start() { loom_mps_start || record "MPS for the speed phases" "$loom_mps_why"; }
mps_stop() { loom_mps_stop; }
trap mps_stop EXIT
for phase in "${phases[@]}"; do
  mps_stop
  case $phase in perf | hier | sweep) mps_start ;; esac
  case $phase in
  probe)
    # What the CUDA code takes for granted, one line each, with timeouts:
    # stream waits and writes on device and pinned host flags, released
    # from the host and through CUDA IPC from another process, the device's
    # attributes, and which of many streams a blocked wait holds back.
    step "GPU: probe (stream memory operations, IPC, queues)" "$build/bin/loom-gpu-probe"
    ;;
  check)
    step "host-side CUDA unit tests" "$build/bin/loom-unit-tests" "[cuda]"
    # Up to 16 MiB of float32 (4 slots' rounds): 64 MiB and three rank
    # counts did not fit the step's 240 s on the H200.
    step "GPU: kernels, programs (1,2,4 ranks), order" "$build/bin/loom-gpu-tests" --ranks 1,2,4 \
      --max-count 4194304
    step "GPU: CUDA communicators (1,2,4 processes, one GPU)" "$build/bin/loom-gpu-comm-tests" --ranks 1,2,4
    # The staged path (pinned host memory and the host transports: what
    # ranks on several hosts use), forced on this one host.
    step "GPU: CUDA communicators, staged path (2,4 processes)" env LOOM_DEVICE_PATH=staged \
      "$build/bin/loom-gpu-comm-tests" --ranks 2,4
    ;;
  perf)
    # A measurement (issue 15's goals: busbw at 256 MiB >= 60% of the copy
    # bandwidth it prints, 8 B <= 30 us); fails only if a rank fails.
    step "GPU: all-reduce speed, 2 processes (loom-gpu-comm-perf)" "$build/bin/loom-gpu-comm-perf" --ranks 2
    # The same replayed from a CUDA graph (the graph lane's programs).
    step "GPU: all-reduce speed from CUDA graph replays, 2 processes" "$build/bin/loom-gpu-comm-perf" --ranks 2 --graph 1
    # loom-perf with device buffers (-G), checked; its busbw is printed next
    # to loom-gpu-comm-perf's copy bandwidth above.
    step "loom-perf -G all_reduce, 2 ranks, 8 B .. 256 MiB" "${run[@]}" -n 2 "${lp[@]}" all_reduce -G -b 8 -e 256M -f 4 -c 1
    # loomMemAlloc buffers (-R): large all-reduces read in place (zero-copy).
    step "loom-perf -G -R all_reduce (zero-copy), 2 ranks, 8 B .. 256 MiB" "${run[@]}" -n 2 "${lp[@]}" all_reduce -G -R -b 8 -e 256M -f 4 -c 1
    # cudaMalloc buffers registered with loomCommRegister (a framework's
    # segments): read in place the same way.
    step "loom-perf -G --cuda-registered all_reduce (zero-copy), 2 ranks, 8 B .. 256 MiB" "${run[@]}" -n 2 "${lp[@]}" \
      all_reduce -G --cuda-registered -b 8 -e 256M -f 4 -c 1
    step "loom-perf -G all_reduce, staged path, 2 ranks, 8 B .. 256 MiB" env LOOM_DEVICE_PATH=staged \
      "${run[@]}" -n 2 "${lp[@]}" all_reduce -G -b 8 -e 256M -f 4 -c 1
    for coll in alltoall gather scatter sendrecv; do
      step "loom-perf -G $coll, 2 ranks, 8 B .. 64 MiB" "${run[@]}" -n 2 "${lp[@]}" "$coll" -G -b 8 -e 64M -f 8 -c 1 -r 1
    done
    # The other collectives on loomMemAlloc buffers (zero-copy above
    # LOOM_DEVICE_ONESHOT_BYTES), next to the rows above.
    for coll in reduce_scatter all_gather alltoall broadcast reduce gather scatter; do
      step "loom-perf -G -R $coll (zero-copy), 2 ranks, 8 B .. 64 MiB" "${run[@]}" -n 2 "${lp[@]}" "$coll" -G -R \
        -b 8 -e 64M -f 8 -c 1 -r 1
    done
    step "loom-perf --device cuda (the ctest script)" bash "$here/tests/perf_device_test.sh" "$build/bin"
    ;;
  sweep)
    # The IPC path's all-reduce against its slot (each round costs tens of
    # microseconds, docs/testing.md): 2 processes, 1 MiB .. 256 MiB, checked.
    for slot in 4 16 32 64 128; do
      step "loom-perf -G all_reduce, 2 ranks, LOOM_DEVICE_SLOT_BYTES=${slot} MiB, 1 MiB .. 256 MiB" \
        env LOOM_DEVICE_SLOT_BYTES=$((slot << 20)) "${run[@]}" -n 2 "${lp[@]}" all_reduce -G -b 1M -e 256M -f 4 -c 1
      step "loom-perf -G -R all_reduce (zero-copy), 2 ranks, LOOM_DEVICE_SLOT_BYTES=${slot} MiB, 1 MiB .. 256 MiB" \
        env LOOM_DEVICE_SLOT_BYTES=$((slot << 20)) "${run[@]}" -n 2 "${lp[@]}" all_reduce -G -R -b 1M -e 256M -f 4 -c 1
    done
    ;;
  hier)
    # The hierarchical path (within a "host" over CUDA IPC, between hosts
    # staged): 4 processes posing as 2 hosts of 2 (loom-run --hosts sets
    # LOOM_HOST_ID and numbers ranks host by host), every size through it,
    # against the staged path; all-reduce, then reduce-scatter and
    # all-gather.
    for coll in all_reduce reduce_scatter all_gather; do
      step "loom-perf -G $coll, hierarchical path, 4 ranks as 2 hosts x 2, 8 B .. 64 MiB" \
        env LOOM_DEVICE_PATH=hier LOOM_DEVICE_HIER_MIN_BYTES=0 \
        "${run[@]}" -n 4 --hosts 2 "${lp[@]}" "$coll" -G -b 8 -e 64M -f 8 -c 1
      step "loom-perf -G $coll, staged path, 4 ranks as 2 hosts x 2 (to compare), 8 B .. 64 MiB" \
        env LOOM_DEVICE_PATH=staged "${run[@]}" -n 4 --hosts 2 "${lp[@]}" "$coll" -G -b 8 -e 64M -f 8 -c 1
    done
    ;;
  sanitize)
    # compute-sanitizer works on the Firecracker machines, not under gVisor
    # ("Device not supported"): a refusal is reported as such, not as a
    # finding.
    # Each run once, its output kept: a refusal shows in it.
    sanitize_step() {  # sanitize_step NAME ARGS...
      local name=$1 log
      shift
      log=$(mktemp)
      step "$name" bash -c 'set -o pipefail; compute-sanitizer --error-exitcode 1 "$@" 2>&1 | tee "$0"' "$log" "$@"
      if grep -q "Device not supported" "$log"; then
        results[${#results[@]} - 1]="refused by this machine (Device not supported)"
        [ -n "$results_file" ] && printf '%-75s %s\n' "$name" "(the FAIL above: refused by this machine)" >>"$results_file"
        # A refusal is not a finding.
        status=$sanitize_status
      fi
      rm -f "$log"
    }
    if ! command -v compute-sanitizer >/dev/null; then
      record "compute-sanitizer" "not installed"
    else
      sanitize_status=$status
      sanitize_step "compute-sanitizer (memcheck, short run)" "$build/bin/loom-gpu-tests" --ranks 2 --max-count 4096
      sanitize_status=$status
      sanitize_step "compute-sanitizer on CUDA communicators (2 processes)" --target-processes all \
        "$build/bin/loom-gpu-comm-tests" --ranks 2 --max-count 4096
    fi
    ;;
  esac
done
echo
printf '%-75s %s\n' "step" "result"
for i in "${!names[@]}"; do printf '%-75s %s\n' "${names[$i]}" "${results[$i]}"; done
exit $status
