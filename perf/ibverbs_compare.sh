#!/usr/bin/env bash
# loom over ibverbs against perftest on the same Soft-RoCE device, in one
# VM and one run (tests/vm/run-in-vm.sh --rxe), alternating, -r rounds, then
# the median of each ratio over the rounds.  Each ratio compares like with like:
#   bandwidth, one way  loom-perf sendrecv -p oneway 1 MiB (rank 0 only sends,
#                       rank 1 only receives)     vs  ib_write_bw -s 1 MiB
#   bandwidth, both     loom-perf sendrecv 1 MiB (both ranks send and receive
#                       at once; per rank, per direction)  vs  ib_write_bw -b / 2
#   latency             loom-perf sendrecv -p pingpong 8 B (half the round trip)
#                       vs  ib_send_lat -s 8 (t_typical, half the round trip);
#                       loom as configured (LOOM_SPIN_US, default 20 us, then it
#                       sleeps in poll()) and spinning (LOOM_SPIN_US=1000:
#                       perftest busy-polls)
#   all-reduce          loom-perf all_reduce 1 MiB busbw over ibverbs vs over tcp
# Under TCG emulation absolute numbers measure the emulator; the ratios are
# what the issue asks for.
#
# usage: perf/ibverbs_compare.sh [-r ROUNDS] [--before LIBDIR] [--mtus "M..."]
#                                [--append ARGS] [--allreduce] [--rendezvous] [BINDIR]
#   --before LIBDIR: every loom cell also runs with LD_LIBRARY_PATH=LIBDIR (the
#     lib/ of an older build: libloom.so.0 before a change), alternating with
#     BINDIR's own library, so that before and after come from one VM run.
#   --mtus "1500 9000": each round runs every cell (perftest's too) at each of
#     these link MTUs in turn, set on the veth pair under rxe0 in the running
#     VM (rxe's active MTU follows: 1500 -> 1024, 9000 -> 4096), so that MTUs
#     are compared in one VM run.  Default: the rig's (run-in-vm.sh --mtu, 9000).
#   --append ARGS: guest kernel arguments (run-in-vm.sh --append); default
#     init_on_alloc=0: Debian's kernel zeroes every allocation, so rxe pays a
#     memset of each packet's kmalloc'd buffer (7% of the guest's CPU in an
#     ibverbs all-reduce at 1 KiB MTU, perf record in the guest), a cost no
#     NIC has; tcp's page fragments are zeroed too (clear_page, 6%).  Both
#     transports and perftest run without it; --append "" keeps it.
#   --allreduce: only the all-reduce cells (ibverbs and tcp).
#   --rendezvous: instead, one-way point-to-point bandwidth at 1..16 MiB with
#     and without the rendezvous (LOOM_IB_RENDEZVOUS_BYTES=0: every byte
#     through the slots; default: RDMA writes into the receiver's buffer, plain
#     malloc'd buffers, registered per transfer; -R: loomMemAlloc buffers
#     registered with loomCommRegister, found in the registration cache)
#     against ib_write_bw -x 1 at each size (one direction).
# Rates in MiB/s (perftest's MB/sec is 2^20 bytes).  ITERS: loom-perf
# iterations of the rendezvous sweep (5); PT_MIB: MiB per ib_write_bw run
# there (64); VM_TIMEOUT: seconds (580).
set -euo pipefail
ROUNDS=${ROUNDS:-3}
MODE=${MODE:-basic}
BEFORE=${BEFORE:-}
MTUS=${MTUS:-} APPEND=${APPEND-init_on_alloc=0} ONLY_AR=${ONLY_AR:-0}
while (($#)); do
  case "$1" in
    -r) ROUNDS=$2; shift 2 ;;
    --before) BEFORE=$(cd "$2" && pwd); shift 2 ;;
    --rendezvous) MODE=rendezvous; shift ;;
    --mtus) MTUS=$2; shift 2 ;;
    --append) APPEND=$2; shift 2 ;;
    --allreduce) ONLY_AR=1; shift ;;
    *) break ;;
  esac
done
HERE=$(cd "$(dirname "$0")" && pwd)
BIN=$(cd "${1:-$HERE/../build/bin}" && pwd)

if [[ "${2:-}" != --inside ]]; then
  echo "host load before the VM: $(cut -d' ' -f1-3 /proc/loadavg) on $(getconf _NPROCESSORS_ONLN) cores"
  st=0
  "$HERE/../tests/vm/run-in-vm.sh" --rxe --timeout "${VM_TIMEOUT:-580}" ${APPEND:+--append "$APPEND"} -- \
    env ROUNDS="$ROUNDS" MODE="$MODE" BEFORE="$BEFORE" ITERS="${ITERS:-5}" PT_MIB="${PT_MIB:-64}" \
    MTUS="$MTUS" ONLY_AR="$ONLY_AR" \
    bash "$HERE/ibverbs_compare.sh" "$BIN" --inside || st=$?
  echo "host load after the VM: $(cut -d' ' -f1-3 /proc/loadavg)"
  exit "$st"
fi

perftest() {  # server in the background, client in front; prints the client's output
  # (a client that found no server listening leaves the server waiting: timeouts end both)
  timeout 120 "$@" -d rxe0 -x 1 >/tmp/pt-server.log 2>&1 &
  local s=$!
  sleep 1
  timeout 120 "$@" -d rxe0 -x 1 127.0.0.1 2>&1 || true
  sleep 1
  kill "$s" 2>/dev/null || true
  wait "$s" || true
}
ptcell() {  # column size perftest-args...: the row for that size (a client that found no server yet prints none: retry)
  local col=$1 n=$2 v="" try
  shift 2
  for try in 1 2 3; do
    v=$(perftest "$@" | awk -v n="$n" -v c="$col" '$1 == n {print $c}')
    [[ -n "$v" ]] && break
  done
  echo "${v:-nan}"
}
loomperf() {  # transports coll size iters [loom-perf args] -> the out-of-place time (us)
  local tr=$1 coll=$2 n=$3 it=$4
  shift 4
  LOOM_TRANSPORTS=$tr "$BIN/loom-run" -n 2 --timeout 200 -- "$BIN/loom-perf" "$coll" -b "$n" -e "$n" -n "$it" -w 5 "$@" 2>&1 |
    awk '$2 ~ /^[0-9]+$/ && $3 ~ /^[0-9]+$/ {t = $7} END {print t == "" ? "nan" : t}'
}
median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{v[NR] = $1} END {print NR ? (NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2) : "nan"}'; }
if [[ "$MODE" == rendezvous ]]; then
  sizes=(1048576 2097152 4194304 8388608 16777216)
  sweep() {  # loom-perf sendrecv -p oneway 1..16 MiB -> "size time_us" rows; extra arguments go to loom-perf
    LOOM_TRANSPORTS=ibverbs "$BIN/loom-run" -n 2 --timeout 280 -- "$BIN/loom-perf" sendrecv -p oneway -b 1048576 \
      -e 16777216 -f 2 -n "${ITERS:-5}" -w 2 "$@" 2>&1 | awk '$2 ~ /^[0-9]+$/ && $3 ~ /^[0-9]+$/ {print $2, $7}'
  }
  declare -A R
  for ((i = 1; i <= ROUNDS; i++)); do
    for n in "${sizes[@]}"; do
      iters=$((${PT_MIB:-64} * 1048576 / n)); ((iters >= 8)) || iters=8
      R[$i,wb,$n]=$(ptcell 4 "$n" ib_write_bw -s "$n" -n "$iters")
    done
    while read -r n t; do R[$i,slots,$n]=$t; done < <(LOOM_IB_RENDEZVOUS_BYTES=0 sweep)
    while read -r n t; do R[$i,rndv,$n]=$t; done < <(sweep)
    while read -r n t; do R[$i,reg,$n]=$t; done < <(sweep -R)
    for n in "${sizes[@]}"; do
      awk -v i="$i" -v n="$n" -v wb="${R[$i,wb,$n]}" -v s="${R[$i,slots,$n]}" -v r="${R[$i,rndv,$n]}" \
        -v g="${R[$i,reg,$n]}" 'BEGIN {
        m = 1048576; ls = n / s * 1e6 / m; lr = n / r * 1e6 / m; lg = n / g * 1e6 / m
        printf "round %d %5.0f KiB one way: ib_write_bw %6.1f | loom slots %6.1f, rendezvous %6.1f, registered %6.1f MiB/s | vs ib_write_bw: slots %.2f rendezvous %.2f registered %.2f\n",
          i, n / 1024, wb, ls, lr, lg, ls / wb, lr / wb, lg / wb }'
    done
  done
  exit 0
fi
libs=(new)
[[ -n "$BEFORE" ]] && libs=(before new)
withlib() {  # before|new command...
  if [[ $1 == before ]]; then LD_LIBRARY_PATH=$BEFORE "${@:2}"; else "${@:2}"; fi
}
mtus=(${MTUS:-rig})
setmtu() {  # the link MTU under rxe0 (both ends of the veth pair); rxe's active MTU follows
  [[ $1 == rig ]] && return 0
  ip link set veth0 mtu "$1" && ip link set veth1 mtu "$1" || { echo "cannot set MTU $1 on veth0/veth1"; exit 1; }
  sleep 0.5
}
declare -A RATIO
variants=()
mib() { awk -v n="$1" -v t="$2" 'BEGIN {printf "%.2f", n / t * 1e6 / 1048576}'; }  # bytes time_us -> MiB/s
for ((i = 1; i <= ROUNDS; i++)); do
  for m in "${mtus[@]}"; do
    setmtu "$m"
    mtu="$(cat /sys/class/net/veth0/mtu) (rxe $(ibv_devinfo -d rxe0 | awk '/active_mtu/ {print $2}'))"
    echo "round $i, link MTU $mtu: load in the VM $(cut -d' ' -f1-3 /proc/loadavg)"
    if ((ONLY_AR)); then
      bw=nan bwb=nan lat=nan
    else
      bw=$(ptcell 4 1048576 ib_write_bw -s 1048576 -n 100)      # MiB/s average, one direction
      bwb=$(ptcell 4 1048576 ib_write_bw -b -s 1048576 -n 50)   # both directions together
      lat=$(ptcell 6 8 ib_send_lat -s 8 -n 1000)                 # t_typical, us (half the round trip)
      echo "round $i: ib_write_bw ${bw} MiB/s one way, -b ${bwb} MiB/s (both ways); ib_send_lat ${lat} us"
    fi
    for l in "${libs[@]}"; do
      v="$l, MTU $m"
      ((i == 1)) && variants+=("$v")
      ow=nan ex=nan pp=nan ps=nan
      if ((!ONLY_AR)); then
        ow=$(withlib "$l" loomperf ibverbs sendrecv 1048576 20 -p oneway)
        ex=$(withlib "$l" loomperf ibverbs sendrecv 1048576 20)
        pp=$(withlib "$l" loomperf ibverbs sendrecv 8 300 -p pingpong)
        # perftest busy-polls; LOOM_SPIN_US=1000 spins through the round trip instead of sleeping.
        ps=$(LOOM_SPIN_US=1000 withlib "$l" loomperf ibverbs sendrecv 8 300 -p pingpong)
      fi
      ai=$(withlib "$l" loomperf ibverbs all_reduce 1048576 10)
      at=$(withlib "$l" loomperf tcp all_reduce 1048576 10)
      # loom-perf prints GB/s with 2 decimals (0.01 under emulation): rates come from the times.
      echo "round $i $v: loom one way $(mib 1048576 "$ow") MiB/s, both ways $(mib 1048576 "$ex") MiB/s per direction;" \
        "8 B pingpong ${pp} us (LOOM_SPIN_US=1000: ${ps} us); all_reduce 1 MiB ${ai} us over ibverbs, ${at} us over tcp"
      read -r r1 r2 r3 r4 r5 < <(awk -v bw="$bw" -v bwb="$bwb" -v lat="$lat" -v ow="$ow" -v ex="$ex" -v pp="$pp" \
        -v ps="$ps" -v ai="$ai" -v at="$at" 'BEGIN {
        m = 1048576 / 1048576 * 1e6
        printf "%.3f %.3f %.3f %.3f %.3f\n", m / ow / bw, m / ex / (bwb / 2), pp / lat, ps / lat, at / ai }')
      echo "round $i $v ratios: one-way bw loom/ib_write_bw $r1; both-ways bw loom per direction/(ib_write_bw -b/2) $r2;" \
        "8 B latency loom pingpong/ib_send_lat $r3 (spinning $r4); all_reduce busbw ibverbs/tcp $r5"
      RATIO[$v,bw]+=" $r1" RATIO[$v,bwb]+=" $r2" RATIO[$v,lat]+=" $r3" RATIO[$v,spin]+=" $r4" RATIO[$v,ar]+=" $r5"
    done
  done
done
echo "medians over $ROUNDS rounds (targets: one-way bw >= 0.9, latency <= 1.5, all_reduce >= 1):"
for v in "${variants[@]}"; do
  echo "  $v: one-way bw $(median <<<"${RATIO[$v,bw]}"), both-ways bw $(median <<<"${RATIO[$v,bwb]}")," \
    "8 B latency $(median <<<"${RATIO[$v,lat]}") (spinning $(median <<<"${RATIO[$v,spin]}")), all_reduce busbw" \
    "ibverbs/tcp $(median <<<"${RATIO[$v,ar]}")"
done
