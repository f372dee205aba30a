#!/usr/bin/env bash
# nccl-tests on loom's NCCL drop-in (libloom_nccl.so), 2 ranks on one GPU,
# on the GPU machine (issue 16):
#   tests/gpu/nccl_tests.sh NCCL_TESTS_SRC [build-dir]      (default: build-gpu)
# NCCL_TESTS_SRC is a checkout of github.com/NVIDIA/nccl-tests; it is not
# part of loom (fetch it beside the project, never commit it).
#
# Builds the shim in build-dir (and loom with it), then nccl-tests against
# NCCL 2.28's nccl.h (NCCL_INCLUDE, default /usr/local/cuda/include) and the
# shim as libnccl.so, for the GPU's compute capability, and runs
#   all_reduce_perf -b 8 -e 256M -f 2 -g 1
# with 2 ranks on GPU 0 (NCCL itself refuses two ranks on one GPU):
#   - mpirun found: nccl-tests built with MPI=1, 2 processes, and
#     NCCL_TESTS_DEVICE=0 so that both take GPU 0 (nccl-tests otherwise
#     gives local rank r GPU r);
#   - no mpirun: one process with 2 threads (-t 2).  nccl-tests gives thread
#     t GPU t, so a copy of its source is built with every thread on GPU
#     NCCL_TESTS_DEVICE (one line of src/common.cu; the original is untouched),
#     and -p 1 so that each thread initialises its own communicator.
# Then every reduction op (-o all, PreMulSum included; NCCL_TESTS_ONLY name
# all_reduce_ops) to 4 MiB, and the other collectives briefly (8 B .. 64 MiB).  With mpirun, under a
# private MPS daemon where the machine has one (deps.sh).  LD_LIBRARY_PATH puts
# the shim's libnccl.so.2 first, so nothing is rebuilt against loom.
# NCCL_TESTS_ONLY (a list of test names) runs only those; LOOM_GPU_BUDGET
# (seconds, deps.sh's loom_step_limit) bounds the whole script.
# Exits non-zero if a run fails or reports a wrong value.
set -uo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
src=${1:?usage: tests/gpu/nccl_tests.sh NCCL_TESTS_SRC [build-dir]}
src=$(cd "$src" && pwd)
build=${2:-$here/build-gpu}
cuda=${CUDA_HOME:-/usr/local/cuda}
export PATH=$cuda/bin:$PATH
source "$here/tests/gpu/deps.sh"
loom_gpu_deps "$here" || exit 2
nccl_include=$(loom_nccl_include) || exit 2
echo "nccl.h: $nccl_include/nccl.h ($(grep -m1 -E '^#define NCCL_VERSION_CODE' "$nccl_include/nccl.h"))"
command -v nvidia-smi >/dev/null && nvidia-smi -L
cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d '.')
cc=${cc:-90}

cmake -S "$here" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DLOOM_CUDA_ARCHS="$cc" \
  -DLOOM_NCCL_INCLUDE_DIR="$nccl_include" -DLOOM_BUILD_TORCH=OFF >"$build.cmake.log" 2>&1 ||
  { tail -20 "$build.cmake.log"; exit 2; }
cmake --build "$build" -j"$(nproc)" --target loom loom_cuda loom_nccl || exit 2
shimdir=$build/lib/loom_nccl
[ -e "$shimdir/libnccl.so.2" ] || { echo "no $shimdir/libnccl.so.2"; exit 2; }

# NCCL_HOME for nccl-tests' Makefile: NVIDIA's header, the shim as the library.
home=$build/nccl-tests-home
mkdir -p "$home/include" "$home/lib"
ln -sf "$nccl_include/nccl.h" "$home/include/nccl.h"
[ -f "$nccl_include/nccl_device.h" ] && ln -sf "$nccl_include/nccl_device.h" "$home/include/nccl_device.h"
# nccl_device.h includes its own folder (nccl_device/impl/...), and nccl.h
# cuda_runtime.h, which PyTorch's NCCL wheel does not hold beside it.
[ -d "$nccl_include/nccl_device" ] && ln -sfn "$nccl_include/nccl_device" "$home/include/nccl_device"
ln -sf "$shimdir/libnccl.so.2" "$home/lib/libnccl.so"
ln -sf "$shimdir/libnccl.so.2" "$home/lib/libnccl.so.2"

work=$build/nccl-tests
rm -rf "$work" && cp -r "$src" "$work"
# NCCL_TESTS_MODE=mpi|threads chooses; by default MPI when mpirun is there.
mode=${NCCL_TESTS_MODE:-$(command -v mpirun >/dev/null && echo mpi || echo threads)}
if [ "$mode" = mpi ]; then
  # MPI_HOME holds include/mpi.h and lib/: Open MPI's mpicc says where
  # (Debian: /usr/lib/x86_64-linux-gnu/openmpi), else beside mpirun.
  mpi_inc=$(mpicc --showme:incdirs 2>/dev/null | awk '{print $1}')
  if [ -n "$mpi_inc" ] && [ -f "$mpi_inc/mpi.h" ]; then mpi_default=$(dirname "$mpi_inc"); else
    mpi_default=$(dirname "$(dirname "$(command -v mpirun)")"); fi
  mpi_home=${MPI_HOME:-$mpi_default}
  make -C "$work/src" -j"$(nproc)" MPI=1 MPI_HOME="$mpi_home" CUDA_HOME="$cuda" NCCL_HOME="$home" \
    NVCC_GENCODE="-gencode=arch=compute_$cc,code=sm_$cc" BUILDDIR="$work/build" >/dev/null || exit 2
  launch=(mpirun --allow-run-as-root --oversubscribe -np 2 -x NCCL_TESTS_DEVICE=0 -x LD_LIBRARY_PATH -x LOOM_DEVICE)
  shape=(-g 1)
else
  grep -q 'gpus\[i\] = (gpu0 != -1 ? gpu0 : localRank\*nThreads\*nGpus) + i;' "$work/src/common.cu" ||
    { echo "nccl-tests' device assignment changed: adapt the patch"; exit 2; }
  sed -i 's/gpus\[i\] = (gpu0 != -1 ? gpu0 : localRank\*nThreads\*nGpus) + i;/gpus[i] = gpu0 != -1 ? gpu0 : localRank*nThreads*nGpus + i;/' \
    "$work/src/common.cu"
  # Newer nccl-tests (2.19 on) also check the devices in src/util.cu, the
  # same way: thread i on GPU NCCL_TESTS_DEVICE + i, refused past the last.
  if [ -f "$work/src/util.cu" ] && grep -q 'cudaDev = (gpu0 != -1 ? gpu0 : localRank\*nThreads\*nGpus) + i;' "$work/src/util.cu"; then
    sed -i 's/cudaDev = (gpu0 != -1 ? gpu0 : localRank\*nThreads\*nGpus) + i;/cudaDev = gpu0 != -1 ? gpu0 : localRank*nThreads*nGpus + i;/' \
      "$work/src/util.cu"
    sed -i 's/(gpu0 != -1 ? gpu0 : localRank\*nThreads\*nGpus) + nThreads\*nGpus, available_devices/gpu0 != -1 ? gpu0 + 1 : localRank*nThreads*nGpus + nThreads*nGpus, available_devices/' \
      "$work/src/util.cu"
  fi
  make -C "$work/src" -j"$(nproc)" MPI=0 CUDA_HOME="$cuda" NCCL_HOME="$home" \
    NVCC_GENCODE="-gencode=arch=compute_$cc,code=sm_$cc" BUILDDIR="$work/build" >/dev/null || exit 2
  export NCCL_TESTS_DEVICE=0
  launch=()
  shape=(-t 2 -g 1 -p 1)  # parallel init: each thread makes its own communicator
fi
# The two processes share the one GPU: under a private MPS daemon where there
# is one, so that the times are loom's and not the time slicer's (the
# issue's 8 B target is in nccl-tests' convention: iterations back to back,
# one synchronisation); LOOM_GPU_MPS=0: not.
if [ "$mode" = mpi ]; then
  trap loom_mps_stop EXIT
  if loom_mps_start; then
    echo "under MPS ($CUDA_MPS_PIPE_DIRECTORY)"
    launch+=(-x CUDA_MPS_PIPE_DIRECTORY -x CUDA_MPS_LOG_DIRECTORY)
  else
    echo "no MPS: $loom_mps_why"
  fi
fi
echo "nccl-tests ($mode) on $(readlink -f "$shimdir/libnccl.so.2")"
export LD_LIBRARY_PATH=$shimdir:$build/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export LOOM_DEVICE=cuda NCCL_DEBUG=VERSION
unset NCCL_INCLUDE  # the build's, not a setting of NCCL's (the shim would warn about it)

status=0
run() {  # name, args...: fails on a non-zero exit or a wrong value
  local name=$1 out lim
  shift
  lim=$(loom_step_limit)
  if [ "$lim" -le 0 ]; then
    echo "!! $name not run: LOOM_GPU_BUDGET=${LOOM_GPU_BUDGET} s spent"
    status=1
    return
  fi
  echo "== $name"
  out=$(timeout -k 15 "$lim" "${launch[@]}" "$work/build/$name" "${shape[@]}" "$@" 2>&1)
  local rc=$?
  echo "$out"
  if [ $rc -ne 0 ] || ! grep -q 'Out of bounds values : 0 OK' <<<"$out"; then
    echo "!! $name failed (exit $rc)"
    status=1
  fi
}
# NCCL_TESTS_ONLY="alltoall_perf ...": only those (a quick recheck).
only=" ${NCCL_TESTS_ONLY:-} "
wanted() { [ "$only" = "  " ] || [[ "$only" == *" $1 "* ]]; }
wanted all_reduce_perf && run all_reduce_perf -b 8 -e 256M -f 2
# Every op nccl-tests knows (sum, prod, max, min, avg, PreMulSum), briefly:
# the shim's PreMulSum on CUDA communicators (loomScale, then loomSum).
wanted all_reduce_ops && run all_reduce_perf -b 8 -e 4M -f 8 -o all
for t in all_gather_perf reduce_scatter_perf broadcast_perf reduce_perf alltoall_perf sendrecv_perf gather_perf \
  scatter_perf; do
  wanted "$t" && run "$t" -b 8 -e 64M -f 8
done
exit $status
