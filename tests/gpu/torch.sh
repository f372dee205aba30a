#!/usr/bin/env bash
# PyTorch on the GPU machine (its torch, 2.11 there), one command:
#   tests/gpu/torch.sh [build-dir]      (default: build-gpu-torch)
# 1. loom_torch (issue 17) built against this machine's torch (c10d of
#    torch 2.x, where the dev VM has Debian's 1.13) and its tests run
#    (ctest -R "torch:": every collective against gloo, DDP, tags, timeouts,
#    monitored_barrier, shrink, zero-copy, the crash loop), CPU tensors.
# 2. torch's own "nccl" backend on loom's NCCL drop-in (issue 16):
#    tests/gpu/nccl_shim_torch.py with LD_PRELOAD=libloom_nccl.so, 2 ranks on
#    one GPU (torchrun), every collective and a short DDP run against gloo;
#    then again with TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1, so
#    that torch registers its allocator's segments (device zero-copy).
# Step 2 runs first: it needs the GPU, step 1 only this machine's torch.
# PYTHON picks the interpreter (default: python3).  Exits non-zero if a step
# fails; prints a table.  Steps time out after LOOM_GPU_STEP_TIMEOUT seconds
# (default 240); LOOM_GPU_RESULTS names a file that gets each step's row as
# it finishes (a call cut off at the device tool's limit still says what
# ran); tests/gpu/deps.sh brings what the machine lacks (.gpudeps).
set -uo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$here/build-gpu-torch}
py=${PYTHON:-python3}
"$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())' ||
  { echo "no torch for $py"; exit 2; }
prefix=$("$py" -c 'import torch; print(torch.utils.cmake_prefix_path)')
export PATH=/usr/local/cuda/bin:$PATH
source "$here/tests/gpu/deps.sh"
loom_gpu_deps "$here" || exit 2
limit=${LOOM_GPU_STEP_TIMEOUT:-240}
cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d '.')
cc=${cc:-90}
# The shim (step 2) needs nccl.h: the toolkit's or PyTorch's NCCL wheel's.
# Without one, step 1 still runs and step 2 fails saying why.
shim=()
if nccl_include=$(loom_nccl_include); then
  echo "nccl.h: $nccl_include/nccl.h"
  shim=(-DLOOM_NCCL_INCLUDE_DIR="$nccl_include")
fi

status=0
names=() results=()
results_file=${LOOM_GPU_RESULTS:-}
step() {
  local name=$1 r t=$SECONDS rc left=0
  shift
  # LOOM_GPU_BUDGET (deps.sh) bounds the whole script; each step keeps its
  # own timeout as well.
  if [ "${LOOM_GPU_BUDGET:-0}" -gt 0 ]; then
    left=$((LOOM_GPU_BUDGET - SECONDS))
    [ "$left" -le 0 ] && left=-1
  fi
  if [ "$left" -lt 0 ]; then
    r="NOT RUN (LOOM_GPU_BUDGET=${LOOM_GPU_BUDGET} s spent)"
    status=1
  else
    echo "== $name: $*"
    if [ "$left" -gt 0 ]; then timeout -k 15 "$left" "$@"; else "$@"; fi
    rc=$?
    if [ $rc -eq 0 ]; then r="ok ($((SECONDS - t)) s)"; else r="FAIL ($rc)"; status=1; fi
  fi
  names+=("$name") results+=("$r")
  [ -n "$results_file" ] && printf '%-60s %s\n' "$name" "$r" >>"$results_file"
  return 0
}
# The extension must share the libstdc++ that python and torch load.  The
# GPU machine's default g++ (/opt/gcc, 13.3) linked a private copy into it,
# and the first number a message formatted died with SIGSEGV there.  The
# system compiler, where there is one, links the shared library; else the
# process's own libstdc++.so.6 is named on the module's link line, so that
# the static copy is never pulled in.
cxx=()
if [ -z "${CXX:-}" ] && [ -x /usr/bin/g++ ]; then
  # nvcc's host compiler too, so no object needs a newer libstdc++.
  cxx=(-DCMAKE_CXX_COMPILER=/usr/bin/g++ -DCMAKE_C_COMPILER=/usr/bin/gcc -DCMAKE_CUDA_HOST_COMPILER=/usr/bin/g++)
else
  stdcxx=$("$py" -c 'import torch; print(next(l.split()[-1] for l in open("/proc/self/maps") if "libstdc++" in l))' \
    2>/dev/null || true)
  [ -n "$stdcxx" ] && cxx=(-DCMAKE_MODULE_LINKER_FLAGS="$stdcxx")
fi
echo "extension's C++: ${cxx[*]:-the default compiler}"
step "configure (torch from $prefix)" cmake -S "$here" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$prefix" -DPython3_EXECUTABLE="$(command -v "$py")" -DLOOM_BUILD_TORCH=ON \
  -DLOOM_CUDA_ARCHS="$cc" "${shim[@]}" "${cxx[@]}"
# Only what the steps use (the unit tests are most of a whole build; the
# torch tests launch their ranks with loom-run); -k 0: one target that fails
# to build does not keep the others from it.
targets=(loom loom_cuda loom_torch_ext loom-run)
[ ${#shim[@]} -gt 0 ] && targets+=(loom_nccl)  # no nccl.h: no such target (naming it would build nothing)
step "build loom, loom_torch, the shim" timeout -k 15 "$((3 * limit))" cmake --build "$build" -j"$(nproc)" \
  --target "${targets[@]}" -- -k 0
step "the NCCL shim built" ls "$build/lib/libloom_nccl.so"
step "torch nccl backend on libloom_nccl.so, 2 ranks on one GPU" env LD_PRELOAD="$build/lib/libloom_nccl.so" \
  NCCL_DEBUG=VERSION timeout -k 15 "$limit" "$py" -m torch.distributed.run --standalone --nproc-per-node 2 \
  "$here/tests/gpu/nccl_shim_torch.py"
# The same with torch registering its allocator's segments with every
# communicator (ncclCommRegister -> loomCommRegister): large all-reduces,
# reduce-scatters and all-gathers on them are then read in place (device
# zero-copy), and each segment's free deregisters it first.
step "the same, torch registering its segments (zero-copy)" env LD_PRELOAD="$build/lib/libloom_nccl.so" \
  TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1 NCCL_DEBUG=VERSION timeout -k 15 "$limit" "$py" \
  -m torch.distributed.run --standalone --nproc-per-node 2 "$here/tests/gpu/nccl_shim_torch.py"
step "loom_torch built for this torch" bash -c "ls '$build'/python/loom_torch/*.so"
# Fails where nm is missing or nothing was built, not only on a private copy.
step "loom_torch shares the process's libstdc++" bash -c "set -o pipefail; command -v nm >/dev/null &&
  syms=\$(nm -D --defined-only '$build'/python/loom_torch/*.so) && ! grep -q _ZNSo9_M_insert <<<\"\$syms\""
step "loom_torch tests on this torch (ctest -R torch:)" ctest --test-dir "$build" -R "^torch:" --output-on-failure \
  --timeout "$limit"
echo
printf '%-60s %s\n' "step" "result"
for i in "${!names[@]}"; do printf '%-60s %s\n' "${names[$i]}" "${results[$i]}"; done
exit $status
