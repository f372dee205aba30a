#!/usr/bin/env bash
# Runs a command inside a throw-away qemu VM that has an RDMA stack: the
# host's kernel package (linux-image-amd64, built with CONFIG_RDMA_RXE=m)
# booted under TCG emulation, the host's / read-only over 9p with a tmpfs
# overlay on top, so every installed program and the build tree are there.
#
#   tests/vm/run-in-vm.sh [--rxe] [--timeout S] [--smp N] [--mem MiB]
#                         [--net-socket listen:PORT|connect:PORT|udp:LPORT:RPORT|
#                                       unix-listen:PATH|unix-connect:PATH --ip A.B.C.D]
#                         [--mtu N] [--append KERNEL-ARGS] -- COMMAND...
#
# --rxe: before the command, load rdma_rxe and put a Soft-RoCE device rxe0
#   on a netdev (a veth pair inside the VM; with --net-socket, the VM's
#   virtio NIC, so that two VMs joined by that socket reach each other).
# --mtu N: that netdev's MTU, 9000 by default: jumbo frames, as RoCE
#   deployments run them, give rxe an active MTU of 4096 (1500 gives 1024:
#   four times the packets, and under emulation every packet's kernel path
#   is expensive).  --append: more guest kernel arguments.
# The command runs as root in the VM, in the caller's working directory;
# its output is this script's output and its exit status is this script's.
# Exit 77 (ctest's skip code here) when the VM cannot be built or booted on
# this machine (no qemu, no kernel package, no busybox); 124 on timeout.
#
# Why TCG and not KVM: /dev/kvm exists on the dev machines, but nested KVM
# stalled at boot there (issue 14); TCG boots in about 8 s.
# The guest clock is the TSC (clocksource=tsc tsc=reliable): left to itself
# the kernel marks TCG's TSC unstable and reads the emulated HPET, so every
# clock_gettime becomes a system call and an emulated device read -- a cost
# no real machine has, which a spinning rank pays on every round.
set -euo pipefail

RXE=0 TIMEOUT=300 SMP=2 MEM=1024 NETSOCK="" IP="" MTU=9000 APPEND=""
while (($#)); do
  case "$1" in
    --rxe) RXE=1; shift ;;
    --timeout) TIMEOUT="$2"; shift 2 ;;
    --smp) SMP="$2"; shift 2 ;;
    --mem) MEM="$2"; shift 2 ;;
    --net-socket) NETSOCK="$2"; shift 2 ;;
    --ip) IP="$2"; shift 2 ;;
    --mtu) MTU="$2"; shift 2 ;;
    --append) APPEND="$2"; shift 2 ;;
    --) shift; break ;;
    *) echo "run-in-vm: unknown option $1 (usage: see the top of $0)" >&2; exit 2 ;;
  esac
done
(($#)) || { echo "run-in-vm: no command given (usage: see the top of $0)" >&2; exit 2; }

skip() { echo "run-in-vm: SKIP: $*" >&2; exit 77; }
QEMU=$(command -v qemu-system-x86_64 || true)
[[ -n "$QEMU" ]] || skip "no qemu-system-x86_64 (apt-get install qemu-system-x86; scripts/install-deps.sh)"
BUSYBOX=$(command -v busybox || true)
[[ -n "$BUSYBOX" ]] && file -L "$BUSYBOX" 2>/dev/null | grep -q 'statically linked' ||
  skip "no static busybox (apt-get install busybox-static)"
KERNEL=$(ls -1 /boot/vmlinuz-* 2>/dev/null | sort -V | tail -1 || true)
[[ -n "$KERNEL" ]] || skip "no kernel in /boot (apt-get install linux-image-amd64)"
KVER=${KERNEL#/boot/vmlinuz-}
MODDIR=/lib/modules/$KVER
[[ -d "$MODDIR" ]] || skip "no $MODDIR for kernel $KVER"
[[ -r "$KERNEL" ]] || skip "$KERNEL is not readable"

WORK=$(mktemp -d /tmp/loom-vm.XXXXXX)
QPID=""
cleanup() {
  [[ -n "$QPID" ]] && kill "$QPID" 2>/dev/null && wait "$QPID" 2>/dev/null
  [[ -n "${LOOM_VM_KEEP:-}" ]] && cp "$WORK/console" /tmp/loom-vm-console.log
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# ---- the initramfs: busybox, the modules that mount the host's / ----
mkdir -p "$WORK/initrd"/{bin,mods,proc,sys,dev,lower,rw,root}
cp "$BUSYBOX" "$WORK/initrd/bin/busybox"
# modprobe -D order (dependencies first); missing ones are built in.
MODS="virtio_ring virtio virtio_pci_legacy_dev virtio_pci_modern_dev virtio_pci 9pnet 9pnet_virtio netfs fscache 9p overlay"
n=0
for m in $MODS; do
  f=$(modinfo -k "$KVER" -n "$m" 2>/dev/null || true)
  [[ -n "$f" && -f "$f" ]] || continue
  n=$((n + 1))
  out="$WORK/initrd/mods/$(printf %02d $n)-$m.ko"
  case "$f" in
    *.xz) xz -dc "$f" >"$out" ;;
    *.zst) zstd -qdc "$f" >"$out" ;;
    *.gz) gzip -dc "$f" >"$out" ;;
    *) cp "$f" "$out" ;;
  esac
done
# The command, its directory and environment travel as a script on the
# host's / (read by the VM over 9p); the status comes back on the console.
cmdfile="$WORK/cmd.sh"
{
  echo "cd $(printf %q "$PWD") 2>/dev/null || cd /"
  echo "export PATH=$(printf %q "$PATH") HOME=/root"
  for v in $(compgen -e); do
    case "$v" in LOOM_*|UCX_*) echo "export $v=$(printf %q "${!v}")" ;; esac
  done
  if ((RXE)); then
    echo "modprobe -a crc32_generic rdma_rxe ib_uverbs veth || exit 90"
    if [[ -n "$NETSOCK" ]]; then
      echo "modprobe virtio_net; i=0; until [ -e /sys/class/net/eth0 ]; do i=\$((i+1)); [ \$i -gt 50 ] && exit 91; sleep 0.1; done"
      echo "ip link set lo up; ip link set eth0 mtu $MTU up || exit 91; ip addr add ${IP:-10.0.9.1}/24 dev eth0 || exit 91"
      echo "rdma link add rxe0 type rxe netdev eth0 || exit 92"
    else
      echo "ip link set lo up; ip link add veth0 type veth peer name veth1 || exit 91"
      echo "ip link set veth0 mtu $MTU && ip link set veth1 mtu $MTU || exit 91"
      echo "ip addr add ${IP:-10.0.9.1}/24 dev veth0; ip link set veth0 up; ip link set veth1 up"
      echo "rdma link add rxe0 type rxe netdev veth0 || exit 92"
    fi
    echo "i=0; until grep -qs ACTIVE /sys/class/infiniband/rxe0/ports/1/state; do i=\$((i+1)); [ \$i -gt 50 ] && exit 93; sleep 0.1; done"
  fi
  printf '%q ' "$@"; echo
} >"$cmdfile"

cat >"$WORK/initrd/init" <<EOF
#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
for m in /mods/*.ko; do insmod \$m 2>/dev/null; done
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=262144,cache=loose hostroot /lower || { echo "run-in-vm: cannot mount the host's /"; poweroff -f; }
# The kernel loads modules on demand (rxe's crc32) through /sbin/modprobe of
# this initramfs, not of the chroot: give it the host's modules.
mkdir -p /sbin /lib; ln -s /bin/busybox /sbin/modprobe; ln -s /lower/lib/modules /lib/modules
mount -t tmpfs -o size=512m tmpfs /rw; mkdir -p /rw/up /rw/work
mount -t overlay overlay -o lowerdir=/lower,upperdir=/rw/up,workdir=/rw/work /root
for d in proc sys dev; do mount --move /\$d /root/\$d; done
mount -t tmpfs tmpfs /root/tmp; mkdir -p /root/dev/shm /root/dev/pts; mount -t tmpfs tmpfs /root/dev/shm
mount -t devpts devpts /root/dev/pts
ln -sf /proc/self/fd /root/dev/fd; ln -sf /proc/self/fd/0 /root/dev/stdin; ln -sf /proc/self/fd/1 /root/dev/stdout; ln -sf /proc/self/fd/2 /root/dev/stderr
cp /lower$cmdfile /root/tmp/loom-vm-cmd.sh
hostname loom-vm
echo LOOM_VM_START
chroot /root /bin/sh /tmp/loom-vm-cmd.sh </root/dev/null
echo "LOOM_VM_STATUS=\$?"
poweroff -f
EOF
chmod +x "$WORK/initrd/init"
(cd "$WORK/initrd" && find . | cpio -o -H newc --quiet | gzip -1 >"$WORK/initrd.gz")

NET=(-nic none)
if [[ -n "$NETSOCK" ]]; then
  mode=${NETSOCK%%:*} port=${NETSOCK#*:}
  mac=52:54:00:12:34:$(printf %02x "$(( ${IP##*.} % 256 ))")
  if [[ $mode == udp ]]; then  # udp:LOCALPORT:REMOTEPORT, one datagram per frame
    NET=(-netdev "socket,id=n0,udp=127.0.0.1:${port#*:},localaddr=127.0.0.1:${port%%:*}")
  elif [[ $mode == unix-listen || $mode == unix-connect ]]; then  # a unix stream socket at PATH
    NET=(-netdev "stream,id=n0,server=$([[ $mode == unix-listen ]] && echo on || echo off),addr.type=unix,addr.path=$port")
  else
    NET=(-netdev "socket,id=n0,$mode=127.0.0.1:$port")
  fi
  NET+=(-device "virtio-net-pci,netdev=n0,mac=$mac")
fi

timeout --foreground -k 5 "$TIMEOUT" "$QEMU" -accel tcg,thread=multi -cpu max -smp "$SMP" -m "$MEM" \
  -nographic -no-reboot -kernel "$KERNEL" -initrd "$WORK/initrd.gz" \
  -append "console=ttyS0 quiet loglevel=1 panic=-1 rdinit=/init clocksource=tsc tsc=reliable${APPEND:+ $APPEND}" \
  -virtfs local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap \
  "${NET[@]}" </dev/null >"$WORK/console" 2>&1 &
QPID=$!
rc=0
wait "$QPID" || rc=$?
QPID=""
# Print what the command printed (between the markers), without the CRs of the serial console.
tr -d '\r' <"$WORK/console" | sed -n '/LOOM_VM_START$/,/^LOOM_VM_STATUS=/p' | sed '1d;/^LOOM_VM_STATUS=/d'
status=$(tr -d '\r' <"$WORK/console" | sed -n 's/^LOOM_VM_STATUS=\([0-9]*\)$/\1/p' | tail -1)
if [[ -z "$status" ]]; then
  echo "run-in-vm: the VM did not report a status (qemu exit $rc); its console:" >&2
  tr -d '\r' <"$WORK/console" | tail -30 >&2
  ((rc == 124)) && exit 124
  grep -q LOOM_VM_START "$WORK/console" || exit 77
  exit 125
fi
exit "$status"
