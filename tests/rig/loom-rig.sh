#!/usr/bin/env bash
# loom-rig: K "hosts" on one machine.  Each host is a network namespace with
# one veth link to a bridge (in a namespace of its own), shaped with tc tbf
# in both directions; R ranks run in each host with their own host identity
# (LOOM_HOST_ID), so ranks on different hosts talk tcp over the shaped links
# and ranks on one host use shared memory.  Everything the rig creates is
# removed on exit, also when a rank fails or the script is interrupted.
#
#   loom-rig.sh [options] -- program [args...]     run R ranks per host
#   loom-rig.sh [options] --perf [loom-perf args]  run loom-perf (default:
#                                                   all_reduce -b 1M -e 64M -f 4)
# Options:
#   --hosts K      hosts (namespaces), default 2
#   --ranks R      ranks per host, default 2
#   --rate RATE    tc rate of every link, default 1gbit ("none": unshaped)
#   --timeout SEC  stop the ranks after SEC seconds (exit 124), default 300
#   --bin DIR      where loom-perf is (for --perf; give it before --perf)
#   --prefix NAME  namespaces are NAME-br, NAME-h0, ...; default loomrig<pid>
#   --check        only check that namespaces can be created and entered
#                  (exit 0, or 77 with the reason on stderr)
# Exit status: the first failing rank's, 77 when namespaces cannot be made
# or entered (not root, no CAP_NET_ADMIN, no ip/tc, / not a mount point as
# in a plain chroot), 2 on bad usage.
#
# Addresses: 10.77.0.(k+1)/24 inside the rig's own namespaces only; rank 0
# listens on 10.77.0.1.  Namespaces share /dev/shm and the file system, but
# not loopback, and their ranks carry different LOOM_HOST_IDs, so loom never
# uses shared memory between them (with equal ids it would: the default
# identity, hostname + boot id, is the same in every namespace).  The kernel here has no netem: links get
# bandwidth (tbf) but no added delay.
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
BIN="$HERE/../../build/bin"
HOSTS=2 RANKS=2 RATE=1gbit TIMEOUT=300 PERF=0 CHECK=0
PREFIX="loomrig$$"
PORT=29517

usage() { sed -n '2,29p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
skip() { echo "loom-rig: cannot build the rig: $*" >&2; exit 77; }

while [ $# -gt 0 ]; do
  case "$1" in
    --hosts) HOSTS="${2:?}"; shift 2 ;;
    --ranks) RANKS="${2:?}"; shift 2 ;;
    --rate) RATE="${2:?}"; shift 2 ;;
    --timeout) TIMEOUT="${2:?}"; shift 2 ;;
    --bin) BIN="${2:?}"; shift 2 ;;
    --prefix) PREFIX="${2:?}"; shift 2 ;;
    --check) CHECK=1; shift ;;
    --perf) PERF=1; shift; break ;;
    --) shift; break ;;
    -h|--help) usage ;;
    *) echo "loom-rig: unknown option '$1'" >&2; usage ;;
  esac
done
[[ "$HOSTS" =~ ^[0-9]+$ && "$HOSTS" -ge 1 && "$HOSTS" -le 200 ]] || { echo "loom-rig: --hosts must be 1..200" >&2; exit 2; }
[[ "$RANKS" =~ ^[0-9]+$ && "$RANKS" -ge 1 && "$RANKS" -le 64 ]] || { echo "loom-rig: --ranks must be 1..64" >&2; exit 2; }
[[ "$PREFIX" =~ ^[A-Za-z0-9_.-]{1,40}$ ]] || { echo "loom-rig: --prefix: letters, digits, . _ - only" >&2; exit 2; }
[[ "$TIMEOUT" =~ ^[0-9]+$ ]] || { echo "loom-rig: --timeout must be seconds" >&2; exit 2; }
if [ "$PERF" = 1 ]; then
  [ $# -gt 0 ] || set -- all_reduce -b 1M -e 64M -f 4
  set -- "$BIN/loom-perf" "$@"
fi
[ "$CHECK" = 1 ] || [ $# -gt 0 ] || { echo "loom-rig: no program given" >&2; usage; }

# ---- can we? ----
[ "$(id -u)" = 0 ] || skip "network namespaces need root (running as uid $(id -u))"
command -v ip >/dev/null || skip "ip (iproute2) is not installed"
command -v tc >/dev/null || skip "tc (iproute2) is not installed"

BR="$PREFIX-br"
NAMESPACES=()
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  for ns in "${NAMESPACES[@]}"; do
    # Only processes inside the rig's own namespaces: the ranks we started.
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null || true; done
  done
  for ns in "${NAMESPACES[@]}"; do ip netns del "$ns" 2>/dev/null || true; done
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

addns() {
  ip netns add "$1" 2>/dev/null || skip "'ip netns add' failed (no CAP_SYS_ADMIN / CAP_NET_ADMIN here?)"
  NAMESPACES+=("$1")
  ip -n "$1" link set lo up
}

addns "$BR"
# Entering a namespace remounts / as a slave mount, which fails where / is
# not a mount point (a plain chroot: "mount --make-rslave /" failed: Invalid
# argument).  The ranks must enter theirs, so find out now.
if ! why="$(ip netns exec "$BR" true 2>&1)"; then
  skip "'ip netns exec' cannot enter a network namespace here: ${why:-no message}" \
    "(it needs / to be a mount point; a plain chroot is not)"
fi
ip -n "$BR" link add br0 type bridge || skip "cannot create a bridge"
ip -n "$BR" link set br0 up
shape() {  # namespace device
  [ "$RATE" = none ] && return 0
  # burst: one 1 gbit/s scheduler tick (4 ms at HZ=250) is 500 KB.
  tc -n "$1" qdisc add dev "$2" root tbf rate "$RATE" burst 512kb latency 20ms \
    || skip "tc tbf rate $RATE failed on $2"
}
for ((k = 0; k < HOSTS; k++)); do
  ns="$PREFIX-h$k"
  addns "$ns"
  ip link add eth0 netns "$ns" type veth peer name "v$k" netns "$BR" || skip "cannot create a veth pair"
  ip -n "$BR" link set "v$k" master br0 up
  ip -n "$ns" addr add "10.77.0.$((k + 1))/24" dev eth0
  ip -n "$ns" link set eth0 up
  shape "$ns" eth0     # host -> bridge
  shape "$BR" "v$k"    # bridge -> host
done
if [ "$CHECK" = 1 ]; then
  echo "loom-rig: $HOSTS hosts (network namespaces) with shaped links ($RATE) can be created here"
  exit 0
fi
# The links carry traffic once every bridge port forwards (loom's connects
# retry until LOOM_TIMEOUT_MS anyway).
for _ in $(seq 100); do
  [ "$(bridge -n "$BR" link show | grep -c 'state forwarding')" -ge "$HOSTS" ] && break
  sleep 0.05
done

# ---- run ----
N=$((HOSTS * RANKS))
SECRET="$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')"
echo "loom-rig: $HOSTS hosts x $RANKS ranks, links $RATE, root 10.77.0.1:$PORT: $*" >&2
declare -A RANK_OF
for ((k = 0; k < HOSTS; k++)); do
  for ((l = 0; l < RANKS; l++)); do
    r=$((k * RANKS + l))
    (
      set -o pipefail
      timeout -k 5 "$TIMEOUT" ip netns exec "$PREFIX-h$k" env \
        LOOM_RANK="$r" LOOM_WORLD_SIZE="$N" LOOM_LOCAL_RANK="$l" LOOM_LOCAL_SIZE="$RANKS" \
        LOOM_ROOT_ADDR="10.77.0.1:$PORT" LOOM_SECRET="$SECRET" LOOM_HOST_ID="rig-host$k" \
        "$@" 2>&1 </dev/null | sed -u "s/^/[$r] /"
    ) &
    RANK_OF[$!]=$r
  done
done
status=0
for ((i = 0; i < N; i++)); do
  pid=""
  rc=0
  wait -n -p pid || rc=$?
  if [ "$rc" != 0 ] && [ "$status" = 0 ]; then
    status=$rc
    echo "loom-rig: rank ${RANK_OF[$pid]:-?} failed (exit $rc); stopping the others" >&2
    for ((k = 0; k < HOSTS; k++)); do
      for p in $(ip netns pids "$PREFIX-h$k" 2>/dev/null); do kill -TERM "$p" 2>/dev/null || true; done
    done
  fi
done
exit "$status"
