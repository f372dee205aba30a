#!/usr/bin/env bash
# ctest cases for the ibverbs transport, run for real over Soft-RoCE (one
# rxe device) inside a qemu VM (tests/vm/run-in-vm.sh; exit 77 = skipped
# when the VM cannot boot here).
#
#   ibverbs_vm_test.sh BINDIR matrix   every collective x dtypes x ops, exact,
#                                      N = 2, 3, 4 over LOOM_TRANSPORTS=ibverbs
#   ibverbs_vm_test.sh BINDIR fault    rank 1 of 3 is killed (SIGKILL) during
#                                      a 16 MiB all-reduce: ranks 0 and 2 get
#                                      loomRemoteError naming rank 1
#   ibverbs_vm_test.sh BINDIR pingpong ibv_rc_pingpong on the rig (the rig works)
set -euo pipefail
BIN=$(cd "$1" && pwd)
CASE=$2
HERE=$(cd "$(dirname "$0")" && pwd)

if [[ "${3:-}" != --inside ]]; then
  exec "$HERE/run-in-vm.sh" --rxe --timeout 220 -- bash "$HERE/ibverbs_vm_test.sh" "$BIN" "$CASE" --inside
fi

# ---- inside the VM ----
export LOOM_TRANSPORTS=ibverbs LOOM_DEBUG=WARN
case "$CASE" in
  pingpong)
    ibv_devices
    ibv_rc_pingpong -d rxe0 -g 1 -n 20 >/tmp/server.log 2>&1 &
    sleep 1
    ibv_rc_pingpong -d rxe0 -g 1 -n 20 127.0.0.1
    wait
    ;;
  matrix)
    for n in 2 3 4; do
      start=$(date +%s)
      "$BIN/loom-run" -n "$n" --timeout 150 -- "$BIN/mp-worker" matrix 0,1,7,70001 0,2,7,9 0,2 ||
        { echo "FAIL: matrix over ibverbs at N=$n"; exit 1; }
      echo "matrix over ibverbs at N=$n: ok in $(( $(date +%s) - start )) s"
    done
    ;;
  fault)
    dir=$(mktemp -d)
    pids=()
    for r in 0 1 2; do
      LOOM_RANK=$r LOOM_WORLD_SIZE=3 LOOM_ROOT_ADDR=127.0.0.1:29411 LOOM_SECRET=0123456789abcdef0123456789abcdef \
        LOOM_TIMEOUT_MS=60000 "$BIN/mp-worker" fault allreduce 1 $((16 << 20)) "$dir" &
      pids+=($!)
    done
    st=()
    for p in "${pids[@]}"; do
      s=0; wait "$p" || s=$?; st+=("$s")
    done
    echo "exit statuses: ${st[*]} (137 = SIGKILL)"
    [[ "${st[1]}" == 137 ]] || { echo "FAIL: rank 1 was not killed"; exit 1; }
    named=0
    for r in 0 2; do
      line=$(cat "$dir/rank$r" 2>/dev/null || true)
      echo "rank $r: $line"
      [[ "${st[$r]}" == 0 ]] || { echo "FAIL: rank $r exited ${st[$r]}"; exit 1; }
      IFS='|' read -r call code ms abortms msg <<<"$line"
      # loomRemoteError is 6 in include/loom.h.
      [[ "$code" == 6 ]] ||
        { echo "FAIL: rank $r got code $code, not loomRemoteError"; exit 1; }
      [[ "$msg" == *"rank 1 "* ]] && named=$((named + 1))
    done
    # The survivor that sees the death first names rank 1; the other may see
    # that survivor's abort first and name it instead (a race: an abort does
    # not carry its cause to the peers yet, on any transport).
    ((named >= 1)) || { echo "FAIL: no survivor's error names rank 1"; exit 1; }
    echo "fault over ibverbs: survivors got loomRemoteError, $named of 2 naming rank 1"
    ;;
  *) echo "unknown case $CASE"; exit 2 ;;
esac
