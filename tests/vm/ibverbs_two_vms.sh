#!/usr/bin/env bash
# Two VMs joined by a qemu socket network, one Soft-RoCE device each (rxe0
# on the VM's virtio NIC): rank 0 in the first, rank 1 in the second, the
# collective matrix over LOOM_TRANSPORTS=ibverbs, exact.  The links' MTUs
# differ (9000 in the first VM, rxe active MTU 4096; 1500 in the second,
# 1024): both ends must use the smaller path MTU (the transport's INFO line
# says so), or the first VM's 4 KiB packets would not fit the second's link.
# Exit 77 when a VM cannot boot here.   Usage: ibverbs_two_vms.sh BINDIR
set -euo pipefail
BIN=$(cd "$1" && pwd)
HERE=$(cd "$(dirname "$0")" && pwd)
PORT=$((20000 + $$ % 20000))
common=(LOOM_WORLD_SIZE=2 LOOM_ROOT_ADDR=10.0.9.1:29500 LOOM_SECRET=0123456789abcdef0123456789abcdef
        LOOM_SOCKET_IFNAME=eth0 LOOM_TRANSPORTS=ibverbs LOOM_TIMEOUT_MS=120000 LOOM_DEBUG=INFO LOOM_DEBUG_SUBSYS=NET,INIT)
cmd="$BIN/mp-worker matrix 0,7,70001 0,7 0,2"
out=$(mktemp -d)
trap 'kill $a 2>/dev/null || true; rm -rf "$out"' EXIT
env "${common[@]}" LOOM_RANK=0 LOOM_HOST_ID=vm-a "$HERE/run-in-vm.sh" --rxe --smp 1 --timeout 200 \
  --net-socket "listen:$PORT" --ip 10.0.9.1 --mtu 9000 -- $cmd >"$out/a" 2>&1 &
a=$!
sleep 2
rb=0
env "${common[@]}" LOOM_RANK=1 LOOM_HOST_ID=vm-b "$HERE/run-in-vm.sh" --rxe --smp 1 --timeout 200 \
  --net-socket "connect:$PORT" --ip 10.0.9.2 --mtu 1500 -- $cmd >"$out/b" 2>&1 || rb=$?
ra=0
wait "$a" || ra=$?
sed 's/^/[vm-a] /' "$out/a"
sed 's/^/[vm-b] /' "$out/b"
echo "vm-a exit $ra, vm-b exit $rb"
((ra == 77 || rb == 77)) && exit 77
((ra == 0 && rb == 0)) || exit 1
# rxe's active MTU follows each link; every QP takes the smaller one.
grep -q 'ibverbs on rxe0 .* MTU 4096$' "$out/a" || { echo "FAIL: vm-a's rxe0 is not at MTU 4096"; exit 1; }
grep -q 'ibverbs on rxe0 .* MTU 1024$' "$out/b" || { echo "FAIL: vm-b's rxe0 is not at MTU 1024"; exit 1; }
for v in a b; do
  grep -q 'path MTU 1024 ' "$out/$v" || { echo "FAIL: no QP in vm-$v reported its path MTU"; exit 1; }
  if grep 'path MTU' "$out/$v" | grep -vq 'path MTU 1024 '; then
    echo "FAIL: a QP in vm-$v took a path MTU above the smaller end's 1024"; exit 1
  fi
done
echo "path MTU: 1024 on every QP of both VMs (links at 9000 and 1500)"
