#!/usr/bin/env bash
# ctest cases for the ibverbs transport, run for real over Soft-RoCE (one
# rxe device) inside a qemu VM (tests/vm/run-in-vm.sh; exit 77 = skipped
# when the VM cannot boot here).
#
#   ibverbs_vm_test.sh BINDIR matrix   every collective x dtypes x ops, exact,
#                                      N = 2, 3, 4 over LOOM_TRANSPORTS=ibverbs;
#                                      then ring chunks of LOOM_SLOTS-1 slots at
#                                      N = 3 (lazy credits keep the capacity)
#   ibverbs_vm_test.sh BINDIR fault    rank 1 of 3 is killed (SIGKILL) during
#                                      a 16 MiB all-reduce: ranks 0 and 2 get
#                                      loomRemoteError naming rank 1
#   ibverbs_vm_test.sh BINDIR shrink   kill -9 between operations (N = 4) and
#                                      during a 4 MiB all-reduce (N = 3): every
#                                      survivor shrinks to the same members and
#                                      the new communicator's collectives are exact
#   ibverbs_vm_test.sh BINDIR rendezvous  loomSend/loomRecv around and far above
#                                      LOOM_IB_RENDEZVOUS_BYTES (64 KiB here), exact:
#                                      plain and loomCommRegister'd buffers, grouped;
#                                      the transport's trace shows each transfer of
#                                      the threshold or more went direct, from/into
#                                      which memory; a larger receive than send fails
#   ibverbs_vm_test.sh BINDIR rendezvouskill  the sender, then the receiver, of a
#                                      32 MiB rendezvous is killed mid-transfer: the
#                                      other gets loomRemoteError naming it
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
    # The server listens once it has set up its device, which under TCG
    # can take more than a second: the client retries a refused connect
    # (it fails with "Couldn't connect" and leaves the server waiting).
    ok=0
    for _ in $(seq 1 40); do
      if ibv_rc_pingpong -d rxe0 -g 1 -n 20 127.0.0.1; then ok=1; break; fi
      sleep 0.5
    done
    wait
    [[ $ok == 1 ]] || { echo "FAIL: ibv_rc_pingpong never connected"; cat /tmp/server.log; exit 1; }
    ;;
  matrix)
    for n in 2 3 4; do
      start=$(date +%s)
      "$BIN/loom-run" -n "$n" --timeout 150 -- "$BIN/mp-worker" matrix 0,1,7,70001 0,2,7,9 0,2 ||
        { echo "FAIL: matrix over ibverbs at N=$n"; exit 1; }
      echo "matrix over ibverbs at N=$n: ok in $(( $(date +%s) - start )) s"
    done
    # Credits come back with the next slot written the other way, or alone
    # once half the ring is free: the ring's spare slots must keep a whole
    # chunk (LOOM_SLOTS-1 slots, every rank sending first in a ring loop)
    # sendable after small operations left credit unreturned.
    start=$(date +%s)
    LOOM_ALGO=ring LOOM_SLOTS=8 LOOM_SLOT_BYTES=4096 LOOM_CHUNK_SIZE=1M LOOM_TIMEOUT_MS=30000 \
      "$BIN/loom-run" -n 3 --timeout 90 -- "$BIN/mp-worker" matrix 0,1,7,70001 7 0 ||
      { echo "FAIL: full-chunk ring over ibverbs after small operations"; exit 1; }
    echo "ring with chunks of LOOM_SLOTS-1 slots over ibverbs at N=3: ok in $(( $(date +%s) - start )) s"
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
    # A survivor that sees the other's abort first asks it why (the control
    # socket's Why): both name rank 1.
    ((named == 2)) || { echo "FAIL: only $named of 2 survivors' errors name rank 1"; exit 1; }
    echo "fault over ibverbs: survivors got loomRemoteError, both naming rank 1"
    ;;
  shrink)
    # mp-worker's shrink scenario checks exactness on each rank and writes
    # "members|ms to error|ms in shrink|...|message" to DIR/rankR.
    run_shrink() {  # MODE N VICTIM BYTES
      local mode=$1 n=$2 victim=$3 bytes=$4 dir pids=() st=() want="" r
      dir=$(mktemp -d)
      for ((r = 0; r < n; ++r)); do
        LOOM_RANK=$r LOOM_WORLD_SIZE=$n LOOM_ROOT_ADDR=127.0.0.1:29412 LOOM_SECRET=0123456789abcdef0123456789abcdef \
          LOOM_TIMEOUT_MS=20000 "$BIN/mp-worker" shrink "$mode" "$victim" "$bytes" "$dir" &
        pids+=($!)
        ((r == victim)) || want+="${want:+,}$r"
      done
      for ((r = 0; r < n; ++r)); do
        local s=0; wait "${pids[$r]}" || s=$?; st+=("$s")
      done
      echo "$mode N=$n victim $victim: exit statuses ${st[*]} (137 = SIGKILL)"
      [[ "${st[$victim]}" == 137 ]] || { echo "FAIL: rank $victim was not killed"; exit 1; }
      for ((r = 0; r < n; ++r)); do
        ((r == victim)) && continue
        local line; line=$(cat "$dir/rank$r" 2>/dev/null || true)
        echo "  rank $r: $line"
        [[ "${st[$r]}" == 0 ]] || { echo "FAIL: rank $r exited ${st[$r]}"; exit 1; }
        [[ "${line%%|*}" == "$want" ]] || { echo "FAIL: rank $r ended with members '${line%%|*}', not $want"; exit 1; }
      done
    }
    run_shrink between 4 1 $((1 << 20))
    run_shrink allreduce 3 2 $((4 << 20))
    echo "shrink over ibverbs: every survivor agreed and the new communicators are exact"
    ;;
  rendezvous)
    sizes=(65535 65536 200003 1048583 4194304)
    log=/tmp/rendezvous.log
    LOOM_IB_RENDEZVOUS_BYTES=65536 LOOM_DEBUG=TRACE LOOM_DEBUG_SUBSYS=NET \
      "$BIN/loom-run" -n 2 --timeout 150 -- "$BIN/mp-worker" rendezvous "$(IFS=,; echo "${sizes[*]}")" >"$log" 2>&1 ||
      { cat "$log"; echo "FAIL: rendezvous scenario"; exit 1; }
    grep -E "exact|mismatched" "$log"
    ! grep -q "through the slots" "$log" || { grep "through the slots" "$log"; echo "FAIL: a transfer fell back to slots"; exit 1; }
    for n in "${sizes[@]}"; do
      all=$(grep -c "direct transfer of $n bytes" "$log" || true)
      pinned=$(grep "direct transfer of $n bytes" "$log" | grep -c "loomCommRegister'd" || true)
      fresh=$(grep "direct transfer of $n bytes" "$log" | grep -c "registered for this transfer" || true)
      echo "$n bytes: $all direct transfers logged ($pinned from/into loomCommRegister'd memory, $fresh registered for the transfer)"
      # Per size and rank: 6 sends and 6 receives (3 plain, 2 registered, 1 grouped, each way).
      if ((n < 65536)); then
        ((all == 0)) || { echo "FAIL: $n bytes (below the threshold) went direct"; exit 1; }
      else
        ((all == 24 && pinned == 12 && fresh == 12)) || { echo "FAIL: $n bytes: expected 24 direct transfers, 12 of them registered"; exit 1; }
      fi
    done
    echo "rendezvous over ibverbs: exact around and above the threshold, registered buffers found in the cache"
    ;;
  rendezvouskill)
    for victim in 0 1; do
      dir=$(mktemp -d)
      pids=()
      for r in 0 1; do
        LOOM_RANK=$r LOOM_WORLD_SIZE=2 LOOM_ROOT_ADDR=127.0.0.1:29413 LOOM_SECRET=0123456789abcdef0123456789abcdef \
          LOOM_TIMEOUT_MS=60000 LOOM_IB_RENDEZVOUS_BYTES=65536 \
          "$BIN/mp-worker" rendezvouskill "$victim" $((32 << 20)) "$dir" &
        pids+=($!)
      done
      st=()
      for p in "${pids[@]}"; do
        s=0; wait "$p" || s=$?; st+=("$s")
      done
      other=$((1 - victim))
      line=$(cat "$dir/rank$other" 2>/dev/null || true)
      echo "victim $victim: exit statuses ${st[*]}; rank $other: $line"
      [[ "${st[$victim]}" == 137 ]] || { echo "FAIL: rank $victim was not killed"; exit 1; }
      [[ "${st[$other]}" == 0 ]] || { echo "FAIL: rank $other exited ${st[$other]}"; exit 1; }
      IFS='|' read -r code ms msg <<<"$line"
      [[ "$code" == 6 ]] || { echo "FAIL: rank $other got code $code, not loomRemoteError"; exit 1; }
      [[ "$msg" == *"rank $victim "* ]] || { echo "FAIL: rank $other's error does not name rank $victim"; exit 1; }
    done
    echo "rendezvouskill over ibverbs: the survivor got loomRemoteError naming the dead sender / receiver"
    ;;
  *) echo "unknown case $CASE"; exit 2 ;;
esac
