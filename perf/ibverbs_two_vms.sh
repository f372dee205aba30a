#!/usr/bin/env bash
# loom over ibverbs against loom over tcp across a wire: two qemu TCG VMs
# (tests/vm/run-in-vm.sh --rxe --net-socket, as tests/vm/ibverbs_two_vms.sh)
# joined by a qemu socket network, one Soft-RoCE device each on the VM's
# virtio NIC; rank 0 in VM A (10.0.9.1), rank 1 in VM B (10.0.9.2).  Both
# transports use the same link, so unlike perf/ibverbs_compare.sh (one VM,
# where loom's tcp is loopback in the guest kernel) this compares them on
# the same wire.  Each VM is booted once and runs the same list of cells in
# the same order; loom's bootstrap (a new LOOM_ROOT_ADDR port per cell)
# puts the two ranks of a cell together.  Per round, per link MTU, per
# library (with --before), alternating:
#   all_reduce  loom-perf all_reduce SIZES (out-of-place time) over ibverbs,
#               then over tcp: busbw ratio ibverbs / tcp per size
#   one way     loom-perf sendrecv -p oneway 1 MiB (rank 0 sends, rank 1
#               receives) over ibverbs, then tcp: ratio ibverbs / tcp
#   latency     loom-perf sendrecv -p pingpong 8 B (half the round trip),
#               over ibverbs, then tcp: ratio of the times tcp / ibverbs
#   baselines   (once per round and MTU) ib_write_bw -s 1 MiB from A to B,
#               ib_send_lat -s 8, and a plain TCP stream of 64 MiB from A
#               to B (python3 sockets, timed by the sender up to the
#               receiver's close)
# then the median of every ratio over the rounds.  Under TCG absolute
# numbers measure the emulator; the ratios are what count.
#
# usage: perf/ibverbs_two_vms.sh [-r ROUNDS] [--before LIBDIR] [--mtus "9000 1500"]
#          [--sizes "B..."] [--smp N] [--wire unix|stream|udp] [--append ARGS]
#          [--variants "ENV|..."] [--env ENV] [--calibrate] [--no-baselines]
#          [--perf "ibverbs tcp"] [BINDIR]
#   --before LIBDIR: every loom cell also runs with LD_LIBRARY_PATH=LIBDIR (an
#     older build's lib/), alternating with BINDIR's own, in the same VMs.
#   --mtus: the link MTUs (both VMs' eth0 set to each in turn, in the running
#     VMs; rxe's active MTU follows: 9000 -> 4096, 1500 -> 1024).  Default 9000.
#   --sizes: all-reduce sizes in bytes, a geometric list run by one loom-perf
#     per transport (-b first -e last -f ratio); default 256 KiB 1 4 16 MiB.
#   --smp: vCPUs per VM (1: the two VMs' vCPUs fill this machine's 2 cores).
#   --wire: how qemu joins the two virtio NICs (run-in-vm.sh --net-socket):
#     unix (default): a unix stream socket, lossless and without Nagle's
#       algorithm, as a lossless (PFC) Ethernet fabric that RoCE expects;
#     stream: -netdev socket over host TCP (tests/vm/ibverbs_two_vms.sh's):
#       lossless, but apparently Nagle's algorithm on the host socket holds
#       back a small frame while the one before it is unacknowledged: a RoCE
#       round trip (data, ACK, reply) costs about 20 ms (ib_send_lat 22 ms)
#       where guest tcp's costs 0.5 ms;
#     udp: one datagram per frame; frames are lost when a qemu falls behind,
#       each loss a transport timeout for rxe (LOOM_IB_TIMEOUT).
#   --append: guest kernel arguments; default init_on_alloc=0 (see
#     perf/ibverbs_compare.sh: Debian's kernel zeroes every allocation).
#   --variants "ENV|ENV...": the loom cells (both transports) run once per ENV
#     (assignments such as "LOOM_ALGO=ring LOOM_SLOTS=16"; empty: as
#     configured), so that settings are compared in one run.
#   --env "ENV": settings for every loom cell, both transports (LOOM_ALGO=ring:
#     the tuner picks ring for ibverbs and rhd above 512 KiB for tcp).
#   --calibrate: in the first round, at each MTU, `loom-topo --calibrate` over
#     ibverbs and over tcp (the verbs.* and tcp.* lines of one tuning file);
#     a variant "LOOM_TUNING_FILE=/tmp/tuning.conf" then runs with the file
#     of the current MTU, so that the tuner chooses from measured links.
#   --perf "ibverbs tcp": after the rounds, one more all_reduce 1 MiB over
#     each of these under `perf record -a -g` in both VMs; the top of each
#     VM's `perf report` (samples per symbol) is printed.
# ITERS: timed loom-perf iterations per size (10); VM_TIMEOUT: seconds per VM
# (default: scaled with the number of cells).
set -euo pipefail
ROUNDS=${ROUNDS:-3} BEFORE=${BEFORE:-} MTUS=${MTUS:-9000} SIZES=${SIZES:-"262144 1048576 4194304 16777216"}
WIRE=${WIRE:-unix} SMP=${SMP:-1} APPEND=${APPEND-init_on_alloc=0} BASELINES=${BASELINES:-1} PERFCELL=${PERFCELL:-}
while (($#)); do
  case "$1" in
    -r) ROUNDS=$2; shift 2 ;;
    --before) BEFORE=$(cd "$2" && pwd); shift 2 ;;
    --mtus) MTUS=$2; shift 2 ;;
    --sizes) SIZES=$2; shift 2 ;;
    --smp) SMP=$2; shift 2 ;;
    --append) APPEND=$2; shift 2 ;;
    --no-baselines) BASELINES=0; shift ;;
    --perf) PERFCELL=$2; shift 2 ;;
    --variants) VARIANTS=$2; shift 2 ;;
    --env) COMMONENV=$2; shift 2 ;;
    --calibrate) CALIBRATE=1; shift ;;
    --wire) WIRE=$2; shift 2 ;;
    --inside) ROLE=$2; shift 2 ;;
    -*) echo "ibverbs_two_vms: unknown option $1 (usage: see the top of $0)" >&2; exit 2 ;;
    *) break ;;
  esac
done
HERE=$(cd "$(dirname "$0")" && pwd)
BIN=$(cd "${1:-$HERE/../build/bin}" && pwd)
sizes=($SIZES)
mtus=($MTUS)
libs=(new)
[[ -n "$BEFORE" ]] && libs=(before new)

if [[ -z "${ROLE:-}" ]]; then
  # ---- the host: boot both VMs, each runs this script with --inside ----
  for tr in $PERFCELL; do [[ $tr == ibverbs || $tr == tcp ]] || { echo "--perf: ibverbs and/or tcp" >&2; exit 2; }; done
  echo "host: $(uptime)  ($(getconf _NPROCESSORS_ONLN) cores)"
  echo "command: $0 -r $ROUNDS${BEFORE:+ --before $BEFORE} --mtus \"$MTUS\" --sizes \"$SIZES\" --smp $SMP --wire $WIRE" \
    "--append \"$APPEND\"$( ((BASELINES)) || echo ' --no-baselines')${VARIANTS:+ --variants \"$VARIANTS\"}${COMMONENV:+ --env \"$COMMONENV\"}$( ((${CALIBRATE:-0})) && echo ' --calibrate')${PERFCELL:+ --perf \"$PERFCELL\"} $BIN"
  IFS='|' read -r -a variantenvs <<<"${VARIANTS:-}"
  cells=$((ROUNDS * ${#mtus[@]} * (${#libs[@]} * 6 * (${#variantenvs[@]} > 1 ? ${#variantenvs[@]} : 1) + 3 * BASELINES) +
          ${#mtus[@]} * 2 * ${CALIBRATE:-0}))
  timeout_s=${VM_TIMEOUT:-$((120 + cells * 60 + (${#PERFCELL} ? 300 : 0)))}
  port=$((20000 + $$ % 20000))
  out=$(mktemp -d /tmp/loom-2vm.XXXXXX)
  a=""
  trap '[[ -n "$a" ]] && kill "$a" 2>/dev/null; rm -rf "$out"' EXIT
  inside=(env ROUNDS="$ROUNDS" BEFORE="$BEFORE" MTUS="$MTUS" SIZES="$SIZES" BASELINES="$BASELINES"
          PERFCELL="$PERFCELL" VARIANTS="${VARIANTS:-}" COMMONENV="${COMMONENV:-}" CALIBRATE="${CALIBRATE:-0}" ITERS="${ITERS:-10}" bash "$HERE/ibverbs_two_vms.sh")
  vm=("$HERE/../tests/vm/run-in-vm.sh" --rxe --smp "$SMP" --timeout "$timeout_s" ${APPEND:+--append "$APPEND"})
  neta=(--net-socket "listen:$port") netb=(--net-socket "connect:$port")
  [[ $WIRE == udp ]] && neta=(--net-socket "udp:$port:$((port + 1))") netb=(--net-socket "udp:$((port + 1)):$port")
  [[ $WIRE == unix ]] && neta=(--net-socket "unix-listen:$out/wire") netb=(--net-socket "unix-connect:$out/wire")
  [[ $WIRE == udp || $WIRE == stream || $WIRE == unix ]] || { echo "--wire: unix, udp or stream" >&2; exit 2; }
  "${vm[@]}" "${neta[@]}" --ip 10.0.9.1 --mtu "${mtus[0]}" -- "${inside[@]}" --inside a "$BIN" \
    >"$out/a" 2>&1 &
  a=$!
  # (the second VM's qemu connects to the first's socket: wait for it)
  for w in $(seq 150); do
    [[ $WIRE != unix || -S $out/wire ]] && ((w > 10)) && break
    sleep 0.2
  done
  rb=0 ra=0
  "${vm[@]}" "${netb[@]}" --ip 10.0.9.2 --mtu "${mtus[0]}" -- "${inside[@]}" --inside b "$BIN" \
    >"$out/b" 2>&1 || rb=$?
  wait "$a" || ra=$?
  a=""
  cat "$out/a"
  # VM B only serves; show what it printed when something went wrong there.
  if ((rb != 0)) || grep -q 'FAILED' "$out/b"; then
    sed 's/^/[vm-b] /' "$out/b"
  else
    sed -n '/^VM b, /,$p' "$out/b" | sed 's/^/[vm-b] /'
  fi
  echo "host: $(uptime)"
  echo "vm-a exit $ra, vm-b exit $rb"
  ((ra == 0 && rb == 0))
  exit
fi

# ---- inside a VM: ROLE a (rank 0, 10.0.9.1) or b (rank 1, 10.0.9.2) ----
export LOOM_WORLD_SIZE=2 LOOM_SECRET=0123456789abcdef0123456789abcdef LOOM_SOCKET_IFNAME=eth0 LOOM_TIMEOUT_MS=90000
if [[ $ROLE == a ]]; then rank=0 LOOM_HOST_ID=vm-a; else rank=1 LOOM_HOST_ID=vm-b; fi
export LOOM_RANK=$rank LOOM_HOST_ID
cell=0 cellenv=""
IFS='|' read -r -a variantenvs <<<"${VARIANTS:-}"
((${#variantenvs[@]})) || variantenvs=("")
next() { cell=$((cell + 1)); }
say() { [[ $ROLE == a ]] && echo "$@"; return 0; }
withlib() {  # before|new command...
  if [[ $1 == before ]]; then LD_LIBRARY_PATH=$BEFORE "${@:2}"; else "${@:2}"; fi
}
# One loom-perf run as this VM's rank; a new root port per cell keeps the
# cells apart (a cell that failed on one side times out on the other).
# Cells run in subshells ($(...), <(...)): the caller counts them (next).
# Prints "size out-of-place-time-us" rows (rank 0 prints them).
loomcell() {  # lib transport loom-perf-args...
  local lib=$1 tr=$2 st=0
  shift 2
  counters >/tmp/c0
  withlib "$lib" env LOOM_DEBUG=INFO LOOM_DEBUG_SUBSYS=TUNE,INIT ${COMMONENV:-} $cellenv LOOM_TRANSPORTS="$tr" LOOM_ROOT_ADDR=10.0.9.1:$((29500 + cell)) \
    timeout 150 "$BIN/loom-perf" "$@" >/tmp/cell.log 2>&1 || st=$?
  if ((st)); then
    echo "FAILED (exit $st): LOOM_TRANSPORTS=$tr loom-perf $*" >&2
    tail -5 /tmp/cell.log >&2
  fi
  counters >/tmp/c1
  delta /tmp/c0 /tmp/c1 >/tmp/delta.$cell
  # The algorithm the tuner chose, once per transport and setting.
  local key="/tmp/tuned.$tr.$(tr -c 'A-Za-z0-9=_.-' _ <<<"$cellenv")"
  if [[ $ROLE == a && ! -e $key ]]; then
    touch "$key"
    echo "LOOM_TRANSPORTS=$tr${cellenv:+ $cellenv}: $(grep -o 'TUNE AllReduce.*' /tmp/cell.log | head -1)" \
      "$([[ "${COMMONENV:-} $cellenv" == *LOOM_ALGO=* ]] && echo '(LOOM_ALGO overrides it)');" \
      "$(grep -o 'slots [0-9]* x [0-9]* B' /tmp/cell.log | head -1)" >&2
  fi
  # (rows as loom-perf prints them without loom-run: size count type op root time ...)
  awk '$1 ~ /^[0-9]+$/ && $2 ~ /^[0-9]+$/ {print $1, $6}' /tmp/cell.log
}
first=${sizes[0]} last=${sizes[-1]} factor=2
((${#sizes[@]} > 1)) && factor=$((sizes[1] / sizes[0]))
arcell() { loomcell "$1" "$2" all_reduce -b "$first" -e "$last" -f "$factor" -n "${ITERS:-10}" -w 3; }
ppcell() { loomcell "$1" "$2" sendrecv -p pingpong -b 8 -e 8 -n 30 -w 5; }
calcell() {  # transport MTU: loom-topo --calibrate, the file on rank 0 (VM A)
  withlib new env ${COMMONENV:-} LOOM_TRANSPORTS="$1" LOOM_ROOT_ADDR=10.0.9.1:$((29500 + cell)) \
    timeout 150 "$BIN/loom-topo" --calibrate --out "/tmp/tuning.$1.$2.conf" --iters 50 --bytes 4M >/tmp/cal.log 2>&1 ||
    { echo "FAILED: loom-topo --calibrate over $1" >&2; tail -5 /tmp/cal.log >&2; }
}
owcell() { loomcell "$1" "$2" sendrecv -p oneway -b 1048576 -e 1048576 -n "$((2 * ${ITERS:-10}))" -w 5; }
# perftest from A (client) to B (server): prints column COL of the row for
# SIZE on A (a client that found no server listening yet retries).
ptcell() {  # col size program args...
  local col=$1 size=$2 p=$((18500 + cell)) v="" try
  shift 2
  if [[ $ROLE == b ]]; then
    timeout 90 "$@" -d rxe0 -x 1 -p "$p" >/tmp/pt.log 2>&1 || echo "FAILED: $1 server" >&2
  else
    for try in $(seq 30); do
      sleep 1
      v=$(timeout 90 "$@" -d rxe0 -x 1 -p "$p" 10.0.9.2 2>&1 | awk -v n="$size" -v c="$col" '$1 == n {print $c}')
      [[ -n "$v" ]] && break
    done
    echo "${v:-nan}"
  fi
}
# A plain TCP stream, 64 MiB from A to B, timed by A from connect to B's
# close (B closes after reading everything); prints MiB/s on A.
tcpcell() {
  python3 - "$ROLE" $((5000 + cell)) <<'EOF'
import socket, sys, time
role, port, total = sys.argv[1], int(sys.argv[2]), 64 << 20
if role == "b":
    ls = socket.socket(); ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("10.0.9.2", port)); ls.listen(1); ls.settimeout(90)
    c, _ = ls.accept(); buf = bytearray(1 << 20); n = 0
    while True:
        k = c.recv_into(buf)
        if not k: break
        n += k
    c.close()
    if n != total: print("FAILED: raw tcp received %d of %d bytes" % (n, total), file=sys.stderr)
else:
    deadline = time.time() + 60
    while True:
        try:
            s = socket.create_connection(("10.0.9.2", port), timeout=90); break
        except OSError:
            if time.time() > deadline: print("nan"); sys.exit(0)
            time.sleep(0.2)
    buf = bytes(1 << 20); t = time.monotonic()
    for _ in range(total >> 20): s.sendall(buf)
    s.shutdown(socket.SHUT_WR); s.recv(1)
    print("%.1f" % (total / (time.monotonic() - t) / 1048576))
EOF
}
# Losses and retransmissions, summed over both directions of this VM: rxe's
# hw_counters and the kernel's TCP counters (a cell's cost can hide a
# transport timeout: rxe retransmits after the QP's timeout, 67 ms at 14).
counters() {
  local d=/sys/class/infiniband/rxe0/ports/1/hw_counters c
  for c in sent_pkts rcvd_pkts rcvd_seq_err duplicate_request out_of_seq_request completer_retry_err \
    retry_exceeded_err rcvd_rnr_err send_rnr_err; do
    echo "rxe.$c $(cat $d/$c 2>/dev/null || echo 0)"
  done
  awk '$1 == "Tcp:" {if (!h) {for (i = 2; i <= NF; i++) n[i] = $i; h = 1} else for (i = 2; i <= NF; i++)
    if (n[i] == "OutSegs" || n[i] == "RetransSegs" || n[i] == "InSegs") print "tcp." n[i], $i}' /proc/net/snmp
  awk '$1 == "TcpExt:" {if (!h) {for (i = 2; i <= NF; i++) n[i] = $i; h = 1} else for (i = 2; i <= NF; i++)
    if (n[i] == "TCPLostRetransmit" || n[i] == "TCPTimeouts") print "tcp." n[i], $i}' /proc/net/netstat
}
delta() {  # before-file after-file: the counters that moved
  awk 'NR == FNR {b[$1] = $2; next} $2 != b[$1] {printf " %s %d", $1, $2 - b[$1]}' "$1" "$2"
}
mib() { awk -v n="$1" -v t="$2" 'BEGIN {if (t > 0) printf "%.1f", n / t * 1e6 / 1048576; else printf "nan"}'; }
median() { tr ' ' '\n' | awk '$1 != "" && $1 != "nan"' | sort -g | awk '{v[NR] = $1} END {print NR ? (NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2) : "nan"}'; }
ratio() { awk -v x="$1" -v y="$2" 'BEGIN {if (x > 0 && y > 0) printf "%.3f", y / x; else printf "nan"}'; }  # time_ib time_tcp -> busbw ibverbs/tcp

declare -A R T C
variants=()
for ((i = 1; i <= ROUNDS; i++)); do
  for m in "${mtus[@]}"; do
    ip link set eth0 mtu "$m" || { echo "cannot set MTU $m on eth0" >&2; exit 1; }
    sleep 1
    rxemtu=$(ibv_devinfo -d rxe0 | awk '/active_mtu/ {print $2}')
    say "round $i, link MTU $m (rxe $rxemtu): load in VM A $(cut -d' ' -f1-3 /proc/loadavg)"
    if ((${CALIBRATE:-0} && i == 1)); then
      next; calcell ibverbs "$m"
      next; calcell tcp "$m"
      cat /tmp/tuning.ibverbs.$m.conf /tmp/tuning.tcp.$m.conf >/tmp/tuning.$m.conf 2>/dev/null || :
      say "round $i MTU $m: loom-topo --calibrate: $(grep -h '^[a-z]' /tmp/tuning.$m.conf | tr '\n' ' ')"
    fi
    cat /tmp/tuning.$m.conf >/tmp/tuning.conf 2>/dev/null || :
    if ((BASELINES)); then
      next; wb=$(ptcell 4 1048576 ib_write_bw -s 1048576 -n 100)   # MiB/s average
      next; lat=$(ptcell 6 8 ib_send_lat -s 8 -n 200)               # t_typical, us (half the round trip)
      next; raw=$(tcpcell)
      say "round $i MTU $m: ib_write_bw -s 1 MiB A -> B ${wb} MiB/s; plain TCP stream A -> B ${raw} MiB/s;" \
        "ib_send_lat -s 8 ${lat} us"
    fi
    for l in "${libs[@]}"; do
      # Per setting (--variants) ibverbs then tcp: the all-reduces first, then one way.
      for k in "${!variantenvs[@]}"; do
        cellenv=${variantenvs[$k]}
        next; while read -r n t; do T[ib$k,$n]=$t; done < <(arcell "$l" ibverbs)
        C[ib$k]=$cell
        next; while read -r n t; do T[tcp$k,$n]=$t; done < <(arcell "$l" tcp)
        C[tcp$k]=$cell
      done
      for k in "${!variantenvs[@]}"; do
        cellenv=${variantenvs[$k]}
        next; read -r n t < <(owcell "$l" ibverbs) || t=nan
        T[ib$k,ow]=$t C[ib$k,ow]=$cell
        next; read -r n t < <(owcell "$l" tcp) || t=nan
        T[tcp$k,ow]=$t C[tcp$k,ow]=$cell
        next; read -r n t < <(ppcell "$l" ibverbs) || t=nan
        T[ib$k,pp]=$t
        next; read -r n t < <(ppcell "$l" tcp) || t=nan
        T[tcp$k,pp]=$t
      done
      cellenv=""
      [[ $ROLE == a ]] || { T=(); continue; }
      for k in "${!variantenvs[@]}"; do
        e=${variantenvs[$k]}
        v="$l, MTU $m${e:+, $e}"
        ((i == 1)) && variants+=("$v")
        line="round $i $v: all_reduce busbw ibverbs/tcp"
        for n in "${sizes[@]}"; do
          r=$(ratio "${T[ib$k,$n]:-nan}" "${T[tcp$k,$n]:-nan}")
          R[$v,$n]+=" $r"
          line+=" | $((n / 1024)) KiB: ${T[ib$k,$n]:-nan} vs ${T[tcp$k,$n]:-nan} us, $r"
        done
        r=$(ratio "${T[ib$k,ow]}" "${T[tcp$k,ow]}")
        R[$v,ow]+=" $r"
        echo "$line"
        r2=$(ratio "${T[ib$k,pp]}" "${T[tcp$k,pp]}")
        R[$v,pp]+=" $r2"
        echo "round $i $v: one way 1 MiB ibverbs $(mib 1048576 "${T[ib$k,ow]}") MiB/s, tcp $(mib 1048576 "${T[tcp$k,ow]}") MiB/s, ratio $r;" \
          "8 B pingpong (half the round trip) ibverbs ${T[ib$k,pp]} us, tcp ${T[tcp$k,pp]} us, ratio $r2"
        echo "  VM A's counters, all_reduce: ibverbs$(cat /tmp/delta.${C[ib$k]}); tcp$(cat /tmp/delta.${C[tcp$k]})"
        echo "  one way: ibverbs$(cat /tmp/delta.${C[ib$k,ow]}); tcp$(cat /tmp/delta.${C[tcp$k,ow]})"
      done
      T=()
    done
  done
done
if [[ $ROLE == a ]]; then
  echo "medians over $ROUNDS rounds, busbw ibverbs / tcp (above 1: ibverbs faster):"
  for v in "${variants[@]}"; do
    line="  $v: all_reduce"
    for n in "${sizes[@]}"; do line+=" $((n / 1024)) KiB $(median <<<"${R[$v,$n]}"),"; done
    echo "$line one way 1 MiB $(median <<<"${R[$v,ow]}"), 8 B latency $(median <<<"${R[$v,pp]}")"
  done
fi
for tr in $PERFCELL; do
  # The profile of one more all-reduce (the last MTU, BINDIR's library) in
  # each VM: perf record over the whole VM while the cell runs.
  # (perf is slow to start under TCG: wait for its first write before the cell)
  perf record -a -g -e cpu-clock -F 499 -o /tmp/perf.$tr.data >/dev/null 2>/tmp/perf.err &
  p=$!
  for w in $(seq 100); do [[ -s /tmp/perf.$tr.data ]] && break; sleep 0.2; done
  sleep 1
  next; loomcell new "$tr" all_reduce -b 1048576 -e 1048576 -n 40 -w 3 >/tmp/perf.$tr.rows
  kill -INT "$p"; wait "$p" || true
  say "perf record -a -g over $tr all_reduce 1 MiB x 86 (40 timed, out of place and in place):" \
    "$(awk '{print $2}' /tmp/perf.$tr.rows) us per all-reduce (median)"
  echo "VM $ROLE, $tr, samples per symbol (perf report -n --no-children --sort sym):"
  perf report -i /tmp/perf.$tr.data -n --no-children --sort sym --stdio -g none 2>/tmp/perf.err |
    awk '/^# Samples/ || (!/^#/ && !/^$/ && n++ < 22)'
  if [[ -s /tmp/perf.err ]]; then tail -3 /tmp/perf.err; fi
done
