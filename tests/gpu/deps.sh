# shellcheck shell=bash disable=SC2034  # loom_mps_why: read by the scripts that source this one
# Sourced by the GPU scripts (run.sh, nccl_tests.sh, torch.sh).
# loom_gpu_deps makes
# loom's build dependencies findable on the lent GPU machine, whose image
# has nvcc, CMake and ninja but not pkg-config, hwloc or Catch2, and cannot
# install anything.  Where they are missing, the Debian packages
# scripts/gpu-deps.sh fetched into .gpudeps (carried with the call) are
# unpacked into a private prefix ($LOOM_GPU_DEPS_ROOT, default
# /tmp/loom-gpu-deps), never into /, and PATH, PKG_CONFIG_PATH,
# CMAKE_PREFIX_PATH and LD_LIBRARY_PATH point at it.
# LOOM_GPU_DEPS=force unpacks them even where the machine has its own
# (how the dev machine checks this file); LOOM_GPU_DEPS_AR=1 unpacks with
# ar and tar instead of dpkg-deb.
# Also: CUDA_DEVICE_MAX_CONNECTIONS=32 unless set.  CUDA maps a process's
# streams onto 8 hardware queues by default, and a stream blocked in a wait
# on a flag holds back every stream behind it in its queue; with several
# ranks in one process (loom-gpu-tests, nccl-tests' threads) one rank's
# wait could hold back the stream of the rank it waits for.
loom_gpu_deps() {
  local here=$1 need=0
  export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-32}
  if [ "${LOOM_GPU_DEPS:-}" = force ]; then
    need=1
  else
    { command -v pkg-config >/dev/null && pkg-config --exists hwloc; } || need=1
    # Catch2 2 (catch.hpp) or 3 (catch_all.hpp): the tests take either.
    local h found=0
    for h in /usr/include/catch2/catch{,_all}.hpp /usr/local/include/catch2/catch{,_all}.hpp; do
      [ -f "$h" ] && found=1
    done
    [ "$found" = 1 ] || need=1
  fi
  [ "$need" = 0 ] && return 0
  local debs=$here/.gpudeps root=${LOOM_GPU_DEPS_ROOT:-/tmp/loom-gpu-deps}
  if ! ls "$debs"/*.deb >/dev/null 2>&1; then
    echo "deps.sh: this machine lacks pkg-config, hwloc or Catch2, and there is no $debs:" \
      "run bash scripts/gpu-deps.sh on the dev machine and carry .gpudeps" >&2
    return 1
  fi
  rm -rf "$root" && mkdir -p "$root"
  local d
  for d in "$debs"/*.deb; do
    # libudev1 only where the machine has none (its own matches its kernel).
    case $(basename "$d") in libudev1_*) ldconfig -p 2>/dev/null | grep -q 'libudev.so.1 ' && continue ;; esac
    if command -v dpkg-deb >/dev/null && [ "${LOOM_GPU_DEPS_AR:-}" != 1 ]; then
      dpkg-deb -x "$d" "$root" || return 1
    else  # a .deb is an ar archive holding data.tar.*
      local tmp
      tmp=$(mktemp -d) && (cd "$tmp" && ar x "$d" && tar -xf data.tar.* -C "$root") || return 1
      rm -rf "$tmp"
    fi
  done
  local lib=$root/usr/lib/x86_64-linux-gnu
  sed -i "s|^prefix=/usr\$|prefix=$root/usr|" "$lib"/pkgconfig/*.pc
  export PATH=$root/usr/bin${PATH:+:$PATH}
  export PKG_CONFIG_PATH=$lib/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}
  export CMAKE_PREFIX_PATH=$root/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}
  export LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  echo "deps.sh: pkg-config, hwloc and Catch2 from .gpudeps in $root ($(pkg-config --modversion hwloc 2>&1))"
}

# loom_nccl_include: prints the folder of the nccl.h to build the NCCL shim
# against: NCCL_INCLUDE, else the CUDA toolkit's, else the one in the NCCL
# wheel that PyTorch brings (nvidia-nccl-cu13 on the GPU machine's image,
# where the toolkit has none).  Fails, saying so, when there is none.
loom_nccl_include() {
  local cuda=${CUDA_HOME:-/usr/local/cuda} inc wheel
  inc=${NCCL_INCLUDE:-$cuda/include}
  if [ ! -f "$inc/nccl.h" ] && [ -z "${NCCL_INCLUDE:-}" ]; then
    wheel=$(${PYTHON:-python3} -c 'import nvidia.nccl as m, os; print(os.path.join(list(m.__path__)[0], "include"))' \
      2>/dev/null || true)
    [ -n "$wheel" ] && [ -f "$wheel/nccl.h" ] && inc=$wheel
  fi
  [ -f "$inc/nccl.h" ] || { echo "no nccl.h in $inc (set NCCL_INCLUDE)" >&2; return 1; }
  echo "$inc"
}

# loom_step_limit: prints the seconds the next step may run:
# LOOM_GPU_STEP_TIMEOUT (240), or what is left of LOOM_GPU_BUDGET (seconds
# for the whole script from its start, its build included; 0 or unset:
# none) when that is less; 0 once the budget is spent (the caller then runs
# nothing more and says so).  Meant for the device tool's 10-minute calls: a
# script that would be cut off part-way still ends its own way, with its
# table and its exit status.
loom_step_limit() {
  local step=${LOOM_GPU_STEP_TIMEOUT:-240} budget=${LOOM_GPU_BUDGET:-0} left
  if [ "$budget" -gt 0 ]; then
    left=$((budget - SECONDS))
    [ "$left" -lt "$step" ] && step=$left
    [ "$step" -lt 0 ] && step=0
  fi
  echo "$step"
}

# A private MPS daemon (its own pipe folder) for processes that share the one
# GPU: without it they are time-sliced, and their times are the slicer's
# (on the H200, 582 us for an 8 B all-reduce of 2 processes against 35-49
# us under MPS).  loom_mps_start returns 1 where it cannot start one, with
# the reason in loom_mps_why (LOOM_GPU_MPS=0: never); it sets the daemon's
# variables in the calling shell, so call it directly, not in $(...).
# loom_mps_stop stops what it started.
loom_mps_on=0
loom_mps_why=
loom_mps_start() {
  loom_mps_why=
  [ "${LOOM_GPU_MPS:-1}" = 0 ] && { loom_mps_why="LOOM_GPU_MPS=0"; return 1; }
  command -v nvidia-cuda-mps-control >/dev/null ||
    { loom_mps_why="not installed: processes are time-sliced"; return 1; }
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/loom-mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/loom-mps/log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  # A daemon an earlier call left (killed at its limit: no trap ran) would
  # make -d fail and the phase run time-sliced: stop it first.
  echo quit | timeout 10 nvidia-cuda-mps-control >/dev/null 2>&1 && sleep 1
  if nvidia-cuda-mps-control -d; then
    loom_mps_on=1
    sleep 1
    return 0
  fi
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  loom_mps_why="did not start: processes are time-sliced"
  return 1
}
loom_mps_stop() {
  [ "$loom_mps_on" = 1 ] || return 0
  echo quit | nvidia-cuda-mps-control
  loom_mps_on=0
  sleep 1
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}
