#!/usr/bin/env bash
# Two VMs joined by a qemu socket network, one Soft-RoCE device each (rxe0
# on the VM's virtio NIC): rank 0 in the first, rank 1 in the second, the
# collective matrix over LOOM_TRANSPORTS=ibverbs, exact.  Exit 77 when a VM
# cannot boot here.   Usage: ibverbs_two_vms.sh BINDIR
set -euo pipefail
BIN=$(cd "$1" && pwd)
HERE=$(cd "$(dirname "$0")" && pwd)
PORT=$((20000 + $$ % 20000))
common=(LOOM_WORLD_SIZE=2 LOOM_ROOT_ADDR=10.0.9.1:29500 LOOM_SECRET=0123456789abcdef0123456789abcdef
        LOOM_SOCKET_IFNAME=eth0 LOOM_TRANSPORTS=ibverbs LOOM_TIMEOUT_MS=120000)
cmd="$BIN/mp-worker matrix 0,7,70001 0,7 0,2"
out=$(mktemp -d)
trap 'kill $a 2>/dev/null || true; rm -rf "$out"' EXIT
env "${common[@]}" LOOM_RANK=0 LOOM_HOST_ID=vm-a "$HERE/run-in-vm.sh" --rxe --smp 1 --timeout 200 \
  --net-socket "listen:$PORT" --ip 10.0.9.1 -- $cmd >"$out/a" 2>&1 &
a=$!
sleep 2
rb=0
env "${common[@]}" LOOM_RANK=1 LOOM_HOST_ID=vm-b "$HERE/run-in-vm.sh" --rxe --smp 1 --timeout 200 \
  --net-socket "connect:$PORT" --ip 10.0.9.2 -- $cmd >"$out/b" 2>&1 || rb=$?
ra=0
wait "$a" || ra=$?
sed 's/^/[vm-a] /' "$out/a"
sed 's/^/[vm-b] /' "$out/b"
echo "vm-a exit $ra, vm-b exit $rb"
((ra == 77 || rb == 77)) && exit 77
((ra == 0 && rb == 0))
