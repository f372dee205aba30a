#!/usr/bin/env bash
# ctest: loom-perf --device cuda (-G).  Without a usable GPU (this machine:
# the CUDA toolkit but no device) -G must fail at once with exit 2 and
# "no CUDA device" and the reason, before any communicator exists, and the
# argument errors of -G are clear.  With a GPU (nvidia-smi -L works) it runs
# the device path for real: 2 ranks on device buffers, every exchange,
# send/recv and all-reduce, checked (-c 1), and all-reduce on loomMemAlloc
# buffers (-R: read in place), exit 0.
# usage: perf_device_test.sh BIN_DIR
set -uo pipefail
BIN=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAILED: $*"; exit 1; }

expect_exit2() {  # expect_exit2 PATTERN ARGS...: exit status 2 and PATTERN on stderr
  local pattern=$1; shift
  timeout 60 "$BIN/loom-perf" "$@" >"$tmp/out" 2>"$tmp/err"
  local rc=$?
  [[ $rc == 2 ]] || fail "loom-perf $*: exit $rc, expected 2 ($(cat "$tmp/err"))"
  grep -q -- "$pattern" "$tmp/err" || fail "loom-perf $*: expected '$pattern' on stderr, got: $(cat "$tmp/err")"
  echo "ok: loom-perf $* -> exit 2: $(head -1 "$tmp/err")"
}

expect_exit2 "expected host or cuda, got 'tpu'" all_reduce --device tpu
expect_exit2 "--cuda-registered needs -G" all_reduce --cuda-registered
expect_exit2 "--cuda-registered and -R: choose one" all_reduce -G -R --cuda-registered

if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  for coll in all_reduce alltoall gather scatter sendrecv; do
    timeout 300 "$BIN/loom-run" -n 2 "$BIN/loom-perf" "$coll" -G -b 8 -e 4M -f 8 -n 3 -w 1 -c 1 -r 1 \
      >"$tmp/out" 2>&1 || { cat "$tmp/out"; fail "loom-perf $coll -G on the GPU"; }
    grep -q "device buffers, issued on a cudaStream_t" "$tmp/out" || fail "loom-perf $coll -G: not on device buffers"
    echo "ok: loom-run -n 2 loom-perf $coll -G (checked)"
  done
  # -R: loomMemAlloc buffers, which large all-reduces read in place.
  timeout 300 "$BIN/loom-run" -n 2 "$BIN/loom-perf" all_reduce -G -R -b 8 -e 16M -f 8 -n 3 -w 1 -c 1 \
    >"$tmp/out" 2>&1 || { cat "$tmp/out"; fail "loom-perf all_reduce -G -R on the GPU"; }
  echo "ok: loom-run -n 2 loom-perf all_reduce -G -R (checked)"
  timeout 300 "$BIN/loom-run" -n 2 "$BIN/loom-perf" all_reduce -G --cuda-registered -b 8 -e 16M -f 8 -n 3 -w 1 -c 1 \
    >"$tmp/out" 2>&1 || { cat "$tmp/out"; fail "loom-perf all_reduce -G --cuda-registered on the GPU"; }
  echo "ok: loom-run -n 2 loom-perf all_reduce -G --cuda-registered (checked)"
else
  expect_exit2 "loom-perf: --device cuda: no CUDA device: " all_reduce -G
  expect_exit2 "no CUDA device" alltoall --device cuda -b 8 -e 1K
  expect_exit2 "no CUDA device" sendrecv --device cuda -b 8 -e 1K
  expect_exit2 "no CUDA device" all_reduce -G -R
  expect_exit2 "no CUDA device" all_reduce -G --cuda-registered
  echo "(no GPU here: the device runs are tests/gpu/run.sh's)"
fi
echo "perf device test: ok"
