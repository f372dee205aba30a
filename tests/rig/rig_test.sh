#!/usr/bin/env bash
# ctest: 2 hosts x 2 ranks on the rig (network namespaces, 1 Gbit/s links).
# Checks that ranks on different hosts reach each other over tcp and ranks on
# one host over shared memory, and that collectives (all-reduce among them)
# are exact across the shaped links.  Exits 77 (ctest: skipped) with the
# reason when this machine cannot create network namespaces.
set -uo pipefail
BIN="${1:?usage: rig_test.sh BIN_DIR}"
RIG="$(dirname "$0")/loom-rig.sh"

bash "$RIG" --check
rc=$?
[ "$rc" = 0 ] || exit "$rc"

echo "== topology as loom sees it on the rig"
out="$(bash "$RIG" --timeout 120 -- "$BIN/loom-topo" --json)" || { echo "$out"; echo "loom-topo failed on the rig"; exit 1; }
echo "$out" | sed -n 's/^\[0\] //p' | python3 -c '
import json, sys
doc = json.load(sys.stdin)
comm = doc["communicator"]
hosts = [r["host"] for r in comm["ranks"]]
transports = [r["transportFromRank0"] for r in comm["ranks"]]
print("hosts", hosts, "transports from rank 0", transports)
assert comm["nranks"] == 4 and comm["nhosts"] == 2, comm
assert hosts == [0, 0, 1, 1], hosts
assert [h["ranks"] for h in comm["hosts"]] == [[0, 1], [2, 3]], comm["hosts"]
assert transports == ["self", "shm", "tcp", "tcp"], transports
assert all(r["nicName"] == "eth0" for r in comm["ranks"]), "ranks should use the rig link eth0"
' || exit 1

echo "== collectives exact across the shaped links (float32 and int32, every op)"
bash "$RIG" --timeout 300 -- "$BIN/mp-worker" matrix 0,1,7,1027,262149 7,2 all || exit 1
echo "== 16 MiB all-reduce checked by loom-perf"
bash "$RIG" --timeout 300 --bin "$BIN" --perf all_reduce -b 16M -e 16M -n 3 -w 1 -c 1 || exit 1
echo "== a failing rank fails the run, and the rig is removed all the same"
prefix="rigtest$$"
bash "$RIG" --prefix "$prefix" --timeout 60 -- sh -c 'test "$LOOM_RANK" != 2 || exit 3; sleep 30'
rc=$?
[ "$rc" = 3 ] || { echo "expected exit 3 from the failing rank, got $rc"; exit 1; }
if ip netns list | grep -q "^$prefix-"; then echo "namespaces left behind:"; ip netns list; exit 1; fi
echo "rig test passed"
