#!/usr/bin/env bash
# Installs the Debian packages loom needs to build and test, if missing.
# Safe to run again: it only calls apt-get when something is absent.
set -euo pipefail

PACKAGES=(
  cmake g++ ninja-build pkg-config   # build
  libhwloc-dev hwloc                 # topology detection
  catch2                             # tests
  libucx-dev ucx-utils               # UCX transport (optional at build time)
  libibverbs-dev                     # ibverbs transport (optional at build time)
  libopenmpi-dev openmpi-bin         # the MPI comparison in perf/
  iproute2 procps python3            # multi-host rig, perf scripts
  zlib1g-dev dataset-fashion-mnist   # the reference trainer (gzip'd IDX files, its dataset)
  python3-torch libtorch-dev pybind11-dev  # loom_torch (python/): the torch.distributed backend
  clang libclang-rt-14-dev           # libFuzzer targets (scripts/fuzz.sh)
)

missing=()
for p in "${PACKAGES[@]}"; do
  [[ "$p" == \#* ]] && continue
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if ((${#missing[@]})); then
  echo "install-deps: installing ${missing[*]}"
  SUDO=""
  [[ $(id -u) -ne 0 ]] && SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  echo "install-deps: all packages present"
fi

if [[ -x /usr/local/cuda/bin/nvcc ]]; then
  echo "install-deps: CUDA found in /usr/local/cuda"
else
  echo "install-deps: no CUDA in /usr/local/cuda (CUDA parts are skipped)"
fi
