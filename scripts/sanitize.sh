#!/usr/bin/env bash
# Builds loom with ASan+UBSan (build-asan/) and with TSan (build-tsan/) and
# runs a chosen subset of the tests in each; scripts/test.sh runs it in CI.
#
# The subsets, and why (the whole CI must stay under 25 minutes; a sanitized
# rank is 2-15x slower, so the full matrices would take most of it):
#  ASan+UBSan:
#  - every unit test (one process; bootstrap with hostile clients, the
#    network-byte checks, reduction kernels, the schedule simulator,
#    tree/rhd): covers the parsers and the executor's buffer arithmetic;
#  - loom.h as C;
#  - the multi-process tests that exercise distinct code rather than more
#    sizes: small-size matrices over shm and tcp (one-shot, ring and the tcp
#    frame reader), the staged all-reduce across chunks, mixed collectives
#    on two communicators from two threads, groups, streams, bad arguments,
#    mismatched calls, split, the fault tests (a rank killed during init,
#    during an all-reduce and between operations: the error and abort paths),
#    loomCommDump / the dump signal, and the shrink tests but the 64 MiB
#    one (revoke, shrink after kills: the control thread and the agreement);
#  - left out: the 1 MiB/64 MiB matrices, forced algorithms at every N, the
#    soak and the multi-host mixes: the same code paths at larger sizes, run
#    unsanitized by the main suite.
#  TSan sees races between threads of one process only, so:
#  - the unit tests, where ranks are threads (bootstrap, hostile clients, the
#    simulator running the real executor), except the sweeps to N = 64 and
#    the large-count and large-size ones (the same code as N <= 8 and small
#    sizes, 5-20x slower under TSan: the stream programs' large sizes alone
#    took 40 s of TSan's 341), and the device zero-copy exactness sweep
#    over publishers (53 s of TSan's 313 in session 40: one program's
#    arithmetic, whose threads the mixed back-to-back zero-copy test and
#    the other zero-copy tests run under TSan);
#  - the multi-process tests whose ranks run several threads: two
#    communicators from two threads, streams (a worker thread per stream),
#    groups, mismatched calls, the fault tests (the killer thread, abort),
#    loomCommDump from a second thread plus the dump-signal thread, and the
#    shrink tests (the control thread's notices against running operations).
# Usage: scripts/sanitize.sh [asan|tsan]...  (default: both)
set -euo pipefail
cd "$(dirname "$0")/.."
jobs="$(getconf _NPROCESSORS_ONLN)"
asan_subset='^unit:|^mp: ?(every collective type and op is exact at small sizes|the staged all-reduce|mixed collectives|group calls|many operations on a stream|wrong arguments|loomCommSplit|ranks that call different|a rank killed|loomCommDump|revoke stops|survivors of a rank killed between|two ranks killed)'
tsan_subset='^unit:|^mp: ?(mixed collectives|group calls|many operations on a stream|ranks that call different|a rank killed|loomCommDump|revoke stops|survivors of a rank killed between|two ranks killed)'
tsan_exclude='N = 1\.\.64|N up to 64|every N to 64|large counts|large sizes are exact|whoever publishes'


run_variant() {
  local name=$1 flags=$2 subset=$3 exclude=${4:-'^$'}
  local dir=build-$name
  cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DLOOM_WERROR=ON \
    -DLOOM_SANITIZE="$flags" >/dev/null
  cmake --build "$dir" -j"$jobs" --target loom-unit-tests loom-mp-tests mp-worker loom-run c-api-check
  (cd "$dir" && ctest --output-on-failure --timeout 900 -R "$subset" -E "$exclude")
}

# halt_on_error: a finding fails the test instead of scrolling past.
export ASAN_OPTIONS=detect_leaks=1:halt_on_error=1:abort_on_error=0
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
export TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1
export UCX_MEM_EVENTS=no  # UCX's malloc hooks and TSan do not mix

variants=("$@")
[ ${#variants[@]} -eq 0 ] && variants=(asan tsan)
for v in "${variants[@]}"; do
  case "$v" in
    asan) run_variant asan address,undefined "$asan_subset" ;;
    tsan) run_variant tsan thread "$tsan_subset" "$tsan_exclude" ;;
    *) echo "sanitize.sh: unknown variant $v (asan, tsan)" >&2; exit 2 ;;
  esac
done
