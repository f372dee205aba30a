#!/usr/bin/env bash
# Installs what is missing, builds, and runs the whole test suite with ctest,
# then the aarch64 cross build (scripts/cross-aarch64.sh), the sanitizer
# builds and the fuzzers (scripts/sanitize.sh, fuzz.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/build.sh
(cd build && ctest --output-on-failure --timeout 900 "$@")
# The whole suite also checks that the library compiles for aarch64 (objects
# only; 12 s on 2 idle cores, 36 s with the machine loaded).
if [ $# -eq 0 ]; then
  bash scripts/cross-aarch64.sh
fi
# The whole suite (no ctest arguments) also runs the sanitizer builds and the
# fuzzers; LOOM_SANITIZERS=0 skips both.
if [ $# -eq 0 ] && [ "${LOOM_SANITIZERS:-1}" != 0 ]; then
  bash scripts/sanitize.sh
  bash scripts/fuzz.sh
fi
