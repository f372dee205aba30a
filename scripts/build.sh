#!/usr/bin/env bash
# Configures and builds loom into build/ (Release with debug info, -Werror).
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DLOOM_WERROR=ON "$@" >/dev/null
cmake --build build -j"$(getconf _NPROCESSORS_ONLN)"
