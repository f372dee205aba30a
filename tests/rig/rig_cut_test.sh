#!/usr/bin/env bash
# ctest: a network cut instead of a death (issue 19).  On the rig (network
# namespaces joined by veth links to one bridge), ranks run 64 MiB
# all-reduces; once every rank has finished one, one host's link goes down
# from outside (`ip link set ... down`) in the middle of the next.  Nothing is
# refused across a cut (no RST, no ICMP): every rank must fail within
# LOOM_TIMEOUT_MS (plus a margin for the failure notices), name the ranks
# across the cut "unreachable" (not dead), and shrink without them; the
# connected side gets a communicator whose all-reduce is exact, the cut side
# (the smaller one) an error rather than a communicator of its own.
#   case 1: 4 hosts x 1 rank over tcp; the bridge's port of the last host
#           goes down (a switch port or cable: the host sees its carrier go)
#   case 2: 4 hosts x 2 ranks, shm within a host, tcp between; the last
#           host takes its own eth0 down (its connects fail at once with
#           "network unreachable", which is no refusal either)
#   case 3: as case 1 with the host's eth0 down, and loomCommShrink(NULL, 0):
#           the connected side's coordinator leaves the silent rank out after
#           the timeout, the cut rank finds every other rank silent
# Exits 77 (ctest: skipped) with the reason when this machine cannot create
# network namespaces.
set -uo pipefail
BIN="${1:?usage: rig_cut_test.sh BIN_DIR}"
RIG="$(dirname "$0")/loom-rig.sh"
TIMEOUT_MS=3000
MARGIN_MS=1500  # the failure notices' settling (500 ms) and scheduling on a loaded machine

bash "$RIG" --check
rc=$?
[ "$rc" = 0 ] || exit "$rc"

cut_case() {  # hosts ranks-per-host transports how(bridge|host) [implicit]
  local hosts=$1 ranks=$2 transports=$3 how=$4 implicit=${5:-}
  local prefix="rigcut$$" dir cutlist="" last=$(($1 - 1)) n=$(($1 * $2))
  dir="$(mktemp -d /tmp/loom-rigcut-XXXXXX)"
  for ((l = 0; l < ranks; l++)); do cutlist+="${cutlist:+,}$((last * ranks + l))"; done
  echo "== $hosts hosts x $ranks ranks ($transports): host $last (ranks $cutlist) cut off by its $how link going down${implicit:+; shrink(NULL, 0)}"
  bash "$RIG" --hosts "$hosts" --ranks "$ranks" --prefix "$prefix" --timeout 120 -- \
    env LOOM_TIMEOUT_MS=$TIMEOUT_MS LOOM_TRANSPORTS="$transports" \
    "$BIN/mp-worker" cut "$cutlist" $((64 << 20)) "$dir" $implicit &
  local rig=$!
  # Every rank has finished one all-reduce: the next is under way.
  for _ in $(seq 600); do
    [ "$(find "$dir" -name 'running*' | wc -l)" -ge "$n" ] && break
    kill -0 "$rig" 2>/dev/null || break
    sleep 0.1
  done
  if [ "$(find "$dir" -name 'running*' | wc -l)" -lt "$n" ]; then
    echo "the ranks did not all start their all-reduces"
    kill "$rig" 2>/dev/null; wait "$rig"; rm -rf "$dir"; return 1
  fi
  sleep 0.2
  if [ "$how" = bridge ]; then
    ip -n "$prefix-br" link set "v$last" down || { kill "$rig"; wait "$rig"; rm -rf "$dir"; return 1; }
  else
    ip -n "$prefix-h$last" link set eth0 down || { kill "$rig"; wait "$rig"; rm -rf "$dir"; return 1; }
  fi
  date +%s%3N >"$dir/cut"
  wait "$rig"
  rc=$?
  python3 - "$dir" "$n" "$cutlist" "$TIMEOUT_MS" "$MARGIN_MS" "$transports" <<'PY'
import os, sys
d, n, cut, timeout, margin, transports = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
cut = [int(x) for x in cut.split(",")]
cut_at = float(open(os.path.join(d, "cut")).read())
connected = [r for r in range(n) if r not in cut]
ok, errors, shrinks, members = True, [], [], set()
for r in range(n):
    path = os.path.join(d, f"rank{r}")
    if not os.path.exists(path):
        print(f"rank {r} wrote no result"); ok = False; continue
    err_at, code, shrink_ms, mem, msg, shrink_msg = open(path).read().rstrip("\n").split("|", 5)
    after = float(err_at) - cut_at
    errors.append(int(after)); shrinks.append(int(float(shrink_ms)))
    print(f"rank {r}: error {after:.0f} ms after the cut: {msg}")
    if after > timeout + margin:
        print(f"  rank {r} took {after:.0f} ms > {timeout} + {margin} ms"); ok = False
    if r in cut:
        print(f"  shrink refused after {float(shrink_ms):.0f} ms: {shrink_msg}")
        if mem != "refused": print(f"  the cut rank {r} got members {mem!r}"); ok = False
    else:
        members.add(mem)
want = ",".join(str(r) for r in connected)
if members != {want}:
    print(f"connected ranks' memberships {members}, want {{{want!r}}}"); ok = False
print(f"cut table | {n} ranks, {transports} | ms from cut to error {errors} | ms in loomCommShrink {shrinks} | members {want}")
sys.exit(0 if ok else 1)
PY
  local check=$?
  rm -rf "$dir"
  if ip netns list | grep -q "^$prefix-"; then echo "namespaces left behind:"; ip netns list; return 1; fi
  [ "$rc" = 0 ] || { echo "a rank failed (exit $rc)"; return 1; }
  return "$check"
}

if [ $# -gt 1 ]; then  # one case by hand: rig_cut_test.sh BIN HOSTS RANKS TRANSPORTS bridge|host
  cut_case "$2" "$3" "$4" "$5" "${6:-}" || exit 1
  exit 0
fi
cut_case 4 1 tcp bridge || exit 1
cut_case 4 2 shm,tcp host || exit 1
cut_case 4 1 tcp host implicit || exit 1
echo "rig cut test passed"
