#!/usr/bin/env bash
# ctest: NCCL_* variables reach loom as the LOOM_* ones docs/nccl.md lists,
# a LOOM_* variable the user set wins, NCCL_DEBUG=VERSION prints the version
# line, and a variable loom has no equivalent for is warned about once per
# process.  Runs nccl-shim-test --init-only on 2 ranks and reads its stderr.
set -euo pipefail
TEST="${1:?usage: env_test.sh nccl-shim-test loom-run dir}"
RUN="${2:?}"
DIR="${3:?}"
out="$(mktemp)"
trap 'rm -f "$out"' EXIT
fail() { echo "FAILED: $*"; echo "--- output:"; cat "$out"; exit 1; }

# 1. NCCL_DEBUG=INFO: the mapping is logged and loom itself runs over tcp only.
env NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,GRAPH NCCL_SOCKET_IFNAME==lo NCCL_SHM_DISABLE=1 NCCL_ALGO=Tree \
  LOOM_ALGO=ring NCCL_IB_HCA=mlx5_0 NCCL_IB_GID_INDEX=3 NCCL_P2P_DISABLE=1 NCCL_P2P_LEVEL=NVL NCCL_NOT_A_VARIABLE=1 NCCL_TESTS_DEVICE=0 NCCL_VERSION=2.28.9 \
  "$RUN" -n 2 --timeout 60 "$TEST" "$DIR" --init-only >"$out" 2>&1 || fail "the program failed"
grep -q 'NCCL_DEBUG=INFO -> LOOM_DEBUG=INFO' "$out" || fail "NCCL_DEBUG not mapped"
grep -q 'NCCL_SOCKET_IFNAME==lo -> LOOM_SOCKET_IFNAME=lo' "$out" || fail "NCCL_SOCKET_IFNAME not mapped"
grep -q 'NCCL_SHM_DISABLE=1 -> LOOM_TRANSPORTS=tcp' "$out" || fail "NCCL_SHM_DISABLE not mapped"
grep -q 'NCCL_ALGO=Tree not applied: LOOM_ALGO=ring is set and wins' "$out" || fail "the user's LOOM_ALGO did not win"
grep -q 'NCCL_DEBUG_SUBSYS: loom has no subsystem GRAPH' "$out" || fail "unknown subsystem not reported"
grep -q 'NCCL_DEBUG_SUBSYS=INIT,GRAPH -> LOOM_DEBUG_SUBSYS=INIT' "$out" || fail "NCCL_DEBUG_SUBSYS not mapped"
# loom's own INFO line shows the transport it was given.
grep -q 'ready:.*transports tcp' "$out" || fail "loom did not run with LOOM_TRANSPORTS=tcp"
grep -q 'NCCL_IB_HCA=mlx5_0 -> LOOM_IB_HCA=mlx5_0' "$out" || fail "NCCL_IB_HCA not mapped"
grep -q 'NCCL_IB_GID_INDEX=3 -> LOOM_IB_GID_INDEX=3' "$out" || fail "NCCL_IB_GID_INDEX not mapped"
grep -q 'LOOM_DEVICE=auto: CUDA communicators where there is a GPU' "$out" || fail "LOOM_DEVICE not defaulted to auto"
grep -q 'NCCL_P2P_DISABLE=1 -> LOOM_DEVICE_PATH=staged' "$out" || fail "NCCL_P2P_DISABLE not mapped"
for v in NCCL_P2P_LEVEL; do
  n="$(grep -c "$v has no effect" "$out" || true)"
  [ "$n" = 2 ] || fail "$v: warned $n times, expected once per rank (2)"
done
n="$(grep -c 'NCCL_NOT_A_VARIABLE is not known' "$out" || true)"
[ "$n" = 2 ] || fail "unknown variable warned $n times, expected 2"
! grep -q 'NCCL_TESTS_DEVICE' "$out" || fail "nccl-tests' own NCCL_TESTS_DEVICE warned about"
! grep -q 'NCCL_VERSION' "$out" || fail "NCCL_VERSION (a container image's label, not a setting) warned about"
grep -q 'loom-nccl: NCCL 2\.[0-9]*\.[0-9]* API (ncclGetVersion [0-9]*) on loom [0-9.]*' "$out" ||
  fail "no version line at NCCL_DEBUG=INFO"
echo "NCCL_DEBUG=INFO: mappings, LOOM_* precedence, once-per-process warnings: ok"

# 1b. NCCL_NET=IB asks for the ibverbs transport; NCCL_IB_DISABLE=1 wins over it.
env NCCL_DEBUG=INFO NCCL_NET=IB NCCL_IB_DISABLE=1 NCCL_IB_HCA=^mlx5_1 NCCL_IB_GID_INDEX=x \
  "$RUN" -n 2 --timeout 60 "$TEST" "$DIR" --init-only >"$out" 2>&1 || fail "the program failed"
grep -q 'NCCL_NET=IB with NCCL_IB_DISABLE=1: InfiniBand disabled, tcp it is' "$out" || fail "NCCL_IB_DISABLE did not win"
grep -q 'NCCL_IB_HCA=^mlx5_1: loom cannot exclude devices' "$out" || fail "NCCL_IB_HCA=^ not refused"
grep -q 'NCCL_IB_GID_INDEX=x is not a GID index' "$out" || fail "a bad NCCL_IB_GID_INDEX not refused"
! grep -q 'LOOM_TRANSPORTS=.*ibverbs' "$out" || fail "ibverbs chosen although NCCL_IB_DISABLE=1"
echo "NCCL_NET=IB, NCCL_IB_DISABLE, bad NCCL_IB_* values: ok"

# 2. NCCL_DEBUG=VERSION: the version line and nothing at INFO.
env NCCL_DEBUG=VERSION "$RUN" -n 2 --timeout 60 "$TEST" "$DIR" --init-only >"$out" 2>&1 || fail "the program failed"
[ "$(grep -c 'loom-nccl: NCCL .* API .* on loom' "$out")" = 2 ] || fail "NCCL_DEBUG=VERSION: no version line per rank"
! grep -q ' INFO ' "$out" || fail "NCCL_DEBUG=VERSION logged at INFO"
echo "NCCL_DEBUG=VERSION: version line: ok"
grep 'loom-nccl: NCCL' "$out" | head -1
