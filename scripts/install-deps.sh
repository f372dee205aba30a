#!/usr/bin/env bash
# Installs the Debian packages loom needs to build and test, if missing.
# Safe to run again: it only calls apt-get when something is absent.
#
# What it costs on a fresh Debian 12 (bookworm, amd64): 489 packages, 0.46 GiB
# to download, 1.92 GiB installed.  The largest: libtorch1.13 (128 MiB),
# libllvm15 and libllvm14 (about 110 MiB each), gcc-12 and its aarch64 twin
# (about 65 MiB each); the aarch64 cross compiler with what it alone pulls
# in is 0.2 GiB.  Measured by resolving PACKAGES against an empty dpkg
# status (apt-get -s -o Dir::State::status=EMPTY_FILE install
# --no-install-recommends ...), dropping what Debian's "required" packages
# pull in anyway, and summing apt-cache show's Installed-Size and Size.
set -euo pipefail

# clang's runtime (libFuzzer, the sanitizers) is versioned: Debian 12's
# clang is 14, Debian 13's 19.
CLANG_MAJOR=14
if [ -r /etc/os-release ] && grep -q '^VERSION_CODENAME=trixie' /etc/os-release; then CLANG_MAJOR=19; fi

PACKAGES=(
  cmake g++ ninja-build pkg-config   # build
  libhwloc-dev hwloc                 # topology detection
  catch2                             # tests
  libucx-dev ucx-utils               # UCX transport (optional at build time)
  libibverbs-dev                     # ibverbs transport (optional at build time)
  qemu-system-x86 linux-image-amd64 busybox-static  # tests/vm/: Soft-RoCE (rdma_rxe) in a VM
  rdma-core ibverbs-utils perftest   # rxe's provider, ibv_devices / ibv_rc_pingpong, ib_write_bw
  libopenmpi-dev openmpi-bin         # the MPI comparison in perf/
  iproute2 procps python3            # multi-host rig, perf scripts
  python3-matplotlib                 # perf/plot_busbw.py
  zlib1g-dev dataset-fashion-mnist   # the reference trainer (gzip'd IDX files, its dataset)
  python3-torch libtorch-dev pybind11-dev  # loom_torch (python/): the torch.distributed backend
  clang "libclang-rt-$CLANG_MAJOR-dev"  # libFuzzer targets (scripts/fuzz.sh)
  g++-aarch64-linux-gnu              # the aarch64 cross build (scripts/cross-aarch64.sh)
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
