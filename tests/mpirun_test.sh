#!/usr/bin/env bash
# The README's launch command, `mpirun -np 4 loom-perf all_reduce ...`, with no
# loom flags: the 4 ranks must form one communicator of 4 (rank 0 prints
# "nranks 4") and check every value. Only OpenMPI's own permissions go through
# its environment: running as root, and more ranks than cores.
# Usage: mpirun_test.sh BIN_DIR
set -euo pipefail
if ! command -v mpirun >/dev/null || ! mpirun --version 2>/dev/null | grep "Open MPI" >/dev/null; then
  echo "SKIPPED: mpirun is not OpenMPI's (openmpi-bin not installed or another MPI is the default)"
  exit 77
fi
# More ranks than cores: OpenMPI 4's variable, and OpenMPI 5's (its launcher,
# PRRTE, ignores the first).
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe
out=$(timeout 120 mpirun -np 4 "$1/loom-perf" all_reduce -b 8 -e 1M -f 8 -n 5 -w 1)
echo "$out"
grep -q "nranks 4," <<<"$out" || { echo "the ranks did not form one communicator of 4"; exit 1; }
