#!/usr/bin/env bash
# torch.distributed all_reduce, all_to_all_single, reduce_scatter_tensor and
# all_gather_into_tensor latency/bandwidth and DDP step time, backend
# loom vs gloo in the same job, for 2 and 4 ranks (perf/torch_compare.py has
# the method). Needs a build with loom_torch (python3-torch, libtorch-dev,
# pybind11-dev). Extra arguments go to torch_compare.py (e.g. --max-bytes).
# LOOM_BUILD_DIR: the build whose loom_torch runs (default build; Debian
# 13's chroot: build-trixie, scripts/debian13.sh --run).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD/${LOOM_BUILD_DIR:-build}/python OMP_NUM_THREADS=1
for n in ${RANKS:-2 4}; do
  /usr/bin/python3 -m loom_torch.run --nproc_per_node "$n" perf/torch_compare.py "$@" 2>&1 |
    grep -v -e '^\*\*\*\*' -e 'OMP_NUM_THREADS' -e '^WARNING:torch.distributed.run'
done
