#!/usr/bin/env bash
# Builds the libFuzzer targets of tests/fuzz with clang (ASan+UBSan) into
# build-fuzz/ and runs each for a bounded time (LOOM_FUZZ_SECONDS, default 25)
# from a corpus kept in build-fuzz/corpus/<target>.  Prints executions and
# fails on any finding (the crashing input is left in build-fuzz/).
# Skips, saying so, when clang or its libFuzzer runtime is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${LOOM_FUZZ_SECONDS:-25}"
cc=$(command -v clang || command -v clang-14 || true)
cxx=$(command -v clang++ || command -v clang++-14 || true)
if [ -z "$cc" ] || [ -z "$cxx" ]; then
  echo "fuzz.sh: SKIPPED: clang is not installed (apt-get install clang libclang-rt-N-dev, N its version; scripts/install-deps.sh does)"
  exit 0
fi
if ! echo 'extern "C" int LLVMFuzzerTestOneInput(const char*, unsigned long) { return 0; }' |
    "$cxx" -x c++ -fsanitize=fuzzer - -o /tmp/loom-fuzz-probe.$$ 2>/dev/null; then
  echo "fuzz.sh: SKIPPED: $cxx cannot link -fsanitize=fuzzer (install libclang-rt-N-dev for its version N)"
  exit 0
fi
rm -f /tmp/loom-fuzz-probe.$$
targets=(fuzz_bootstrap fuzz_tcp_hello fuzz_tcp_frames fuzz_env)
# The ibverbs records' target exists when CMake finds libibverbs (as the transport).
[[ -f /usr/include/infiniband/verbs.h ]] && targets+=(fuzz_ib_records)
# -Werror stays off: the project's warnings are policed by the GCC build.
cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_COMPILER="$cc" \
  -DCMAKE_CXX_COMPILER="$cxx" -DLOOM_FUZZ=ON -DLOOM_BUILD_TESTS=OFF \
  -DLOOM_SANITIZE=address,undefined >/dev/null
cmake --build build-fuzz -j"$(getconf _NPROCESSORS_ONLN)" --target "${targets[@]}"
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
export ASAN_OPTIONS=detect_leaks=1
# One fuzzer per CPU at a time (each is single-threaded): the same seconds
# per target, in about half the wall time on CI's two cores.
fuzz_one() {
  local t=$1 log="build-fuzz/$1.log" res execs
  mkdir -p "build-fuzz/corpus/$t"
  rm -f "build-fuzz/$t.result"
  if (cd build-fuzz && "./bin/$t" -max_total_time="$secs" -max_len=4096 -timeout=10 \
      -print_final_stats=1 "corpus/$t" >"$t.log" 2>&1); then
    res=ok
  else
    res=FAILED
  fi
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo '?')
  echo "fuzz: $t: $res, $execs executions in ${secs} s, corpus $(ls "build-fuzz/corpus/$t" | wc -l) inputs" \
    >"build-fuzz/$t.result"
}
par="$(getconf _NPROCESSORS_ONLN)"
for t in "${targets[@]}"; do
  while [ "$(jobs -rp | wc -l)" -ge "$par" ]; do wait -n || true; done
  fuzz_one "$t" &
done
wait
# Each target's result file says how it went (none: it died).
status=0
for t in "${targets[@]}"; do
  if [ -f "build-fuzz/$t.result" ]; then cat "build-fuzz/$t.result"; else echo "fuzz: $t: FAILED (no result)"; fi
  if ! grep -qs ': ok,' "build-fuzz/$t.result"; then
    status=1
    tail -40 "build-fuzz/$t.log"
  fi
done
exit $status
