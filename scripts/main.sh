#!/usr/bin/env bash
# The main job: install what is missing, build, and run a 4-rank all-reduce
# perf test on this machine (8 B .. 64 MiB, float32 sum).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/build.sh
exec build/bin/loom-run -n 4 build/bin/loom-perf all_reduce -b 8 -e 64M -f 2 -d float32 -o sum
