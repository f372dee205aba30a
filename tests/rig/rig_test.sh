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
echo "== large all-reduce: the tuner picks hierarchical, and each host sends what its formula says"
# Rank 0 of each host reads its namespace's eth0 tx bytes (/proc/net/dev is
# per network namespace) around 12 all-reduces of S = 16 MiB (loom-perf runs
# out of place and in place, each 1 warm-up + 5).
# Hierarchical: each host sends 2(H-1)/H x S = S per all-reduce across hosts;
# the flat ring over ranks 0,1 | 2,3 crosses hosts twice per loop, so each
# host sends 2(N-1)/N x S = 1.5 S.  Frames add about 4-5% (TCP/IP headers,
# ACKs): accept 1.00-1.10 x the payload.
traffic() {  # $1: LOOM_ALGO or "" (tuner); prints "host <k> <tx bytes> <choice>" lines
  bash "$RIG" --timeout 300 -- env ${1:+LOOM_ALGO=$1} LOOM_DEBUG=INFO LOOM_DEBUG_SUBSYS=TUNE sh -c '
    tx() { awk -F"[: ]+" "/eth0:/ {print \$11}" /proc/net/dev; }
    a=$(tx); "$0" all_reduce -b 16M -e 16M -n 5 -w 1 -c 0 >/dev/null 2>/tmp/rig-tune-$LOOM_RANK.log || exit 1; b=$(tx)
    if [ "$LOOM_LOCAL_RANK" = 0 ]; then
      choice=$(grep -o "AllReduce: .*(cost" /tmp/rig-tune-$LOOM_RANK.log | head -1)
      echo "host $LOOM_HOST_ID $((b - a)) $choice"
    fi
    rm -f /tmp/rig-tune-$LOOM_RANK.log' "$BIN/loom-perf"
}
hier="$(traffic "")" || { echo "$hier"; echo "all-reduce on the rig failed"; exit 1; }
ring="$(traffic "allreduce:ring")" || { echo "$ring"; echo "ring all-reduce on the rig failed"; exit 1; }
printf '%s\n' "tuner:" "$hier" "LOOM_ALGO=allreduce:ring:" "$ring"
python3 - "$hier" "$ring" <<'PY' || exit 1
import re, sys
S, ops = 16 << 20, 12
def sent(text):
    return [int(m.group(1)) for m in re.finditer(r"host \S+ (\d+)", text)]
hier, ring = sent(sys.argv[1]), sent(sys.argv[2])
assert len(hier) == 2 and len(ring) == 2, (hier, ring)
assert "hier" in sys.argv[1], "the tuner did not choose hierarchical for 16 MiB: " + sys.argv[1]
for name, got, want in (("hierarchical", hier, 1.0), ("ring", ring, 1.5)):
    for g in got:
        ratio = g / (want * S * ops)
        print(f"{name}: {g} bytes sent by a host = {ratio:.3f} x the formula's {want} S per all-reduce")
        assert 1.0 <= ratio <= 1.10, f"{name}: {ratio:.3f} x the formula"
PY

echo "== the ucx transport between the rig's hosts (UCX_TLS=tcp: UCX would otherwise use shared memory across namespaces)"
if "$BIN/loom-topo" --env 2>/dev/null | grep -q '^LOOM_UCX_TLS'; then
  bash "$RIG" --timeout 300 -- env LOOM_TRANSPORTS=shm,ucx LOOM_UCX_TLS=tcp UCX_WARN_UNUSED_ENV_VARS=n \
    "$BIN/mp-worker" matrix 0,7,1027,262149 7,2 0,4 || exit 1
else
  echo "(this build has no UCX: skipped)"
fi

echo "== a failing rank fails the run, and the rig is removed all the same"
prefix="rigtest$$"
bash "$RIG" --prefix "$prefix" --timeout 60 -- sh -c 'test "$LOOM_RANK" != 2 || exit 3; sleep 30'
rc=$?
[ "$rc" = 3 ] || { echo "expected exit 3 from the failing rank, got $rc"; exit 1; }
if ip netns list | grep -q "^$prefix-"; then echo "namespaces left behind:"; ip netns list; exit 1; fi
echo "rig test passed"
