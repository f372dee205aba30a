#!/usr/bin/env bash
# Builds loom on Debian 13 (trixie: g++ 14, CMake 3.31, Catch2 3, UCX 1.18,
# hwloc 2.12, PyTorch 2.6 on CPU) in a chroot made with debootstrap from
# Debian's archive, and runs ctest there (as root, on Debian 12 or 13):
#
#   bash scripts/debian13.sh                 # the torch tests (torch 2.x's c10d)
#   bash scripts/debian13.sh -R "^unit:"     # any ctest arguments
#   bash scripts/debian13.sh --run 'LOOM_BUILD_DIR=build-trixie bash perf/torch_compare.sh'
#                                            # a command in the repository instead
#
# The chroot lives in LOOM_TRIXIE_ROOT (default /var/tmp/loom-trixie; made
# once, about 1.3 GiB, a minute to make) and the build in build-trixie/.  The
# repository, /proc, /sys, /dev and /dev/shm are bind-mounted while it runs.
# Not there: qemu (the vm: tests) and CUDA, whose tests skip and say so.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
root=${LOOM_TRIXIE_ROOT:-/var/tmp/loom-trixie}
run=
if [ "${1:-}" = --run ]; then
  run=${2:?--run needs a command}
  shift 2
fi
[ $# -gt 0 ] || set -- -R "^torch:"
packages=(cmake g++ ninja-build pkg-config libhwloc-dev hwloc catch2 libucx-dev libibverbs-dev
  python3 python3-torch libtorch-dev pybind11-dev python3-matplotlib zlib1g-dev dataset-fashion-mnist procps iproute2
  libopenmpi-dev openmpi-bin)

[ "$(id -u)" -eq 0 ] || { echo "debian13: needs root (debootstrap, chroot, mount)"; exit 2; }
[ "$(realpath -m "$root")" != / ] || { echo "debian13: LOOM_TRIXIE_ROOT may not be /"; exit 2; }
# In a mount namespace of its own: the bind mounts reach none of the host's
# mounts (where / is shared, as under systemd) and vanish with the script,
# even when it is killed.
if [ -z "${LOOM_DEBIAN13_NS:-}" ]; then
  exec env LOOM_DEBIAN13_NS=1 unshare --mount --propagation private bash "$0" ${run:+--run "$run"} "$@"
fi
if [ ! -x "$root/usr/bin/apt-get" ]; then
  command -v debootstrap >/dev/null || apt-get install -y -qq --no-install-recommends debootstrap
  echo "debian13: debootstrap trixie into $root"
  debootstrap --variant=minbase trixie "$root" http://deb.debian.org/debian >/dev/null
fi

# The mounts below end with the namespace: nothing to undo.
bind() {  # bind SRC DST: DST inside the chroot
  mkdir -p "$root$2"
  mount --bind "$1" "$root$2"
}
# The root a mount point of its own: ip netns (the rig tests) remounts it.
mount --bind "$root" "$root"
bind /proc /proc
bind /sys /sys
bind /dev /dev
bind /dev/shm /dev/shm
bind "$here" /loom
# The host's name resolution (torchrun --standalone looks up its hostname).
cp /etc/resolv.conf "$root/etc/resolv.conf" 2>/dev/null || true
cp /etc/hosts "$root/etc/hosts" 2>/dev/null || true

missing=()
for p in "${packages[@]}"; do
  status=$(chroot "$root" dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
  [ "$status" = "install ok installed" ] || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "debian13: installing in the chroot: ${missing[*]}"
  chroot "$root" env DEBIAN_FRONTEND=noninteractive sh -c \
    "apt-get update -qq && apt-get install -y -qq --no-install-recommends ${missing[*]}" >/dev/null
fi
chroot "$root" sh -c 'g++ --version | head -1; python3 -c "import torch; print(\"torch\", torch.__version__)"'
chroot "$root" env -C /loom cmake -S . -B build-trixie -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DLOOM_WERROR=ON >/dev/null
chroot "$root" env -C /loom cmake --build build-trixie -j"$(getconf _NPROCESSORS_ONLN)"
if [ -n "$run" ]; then
  chroot "$root" env -C /loom bash -c "$run"
else
  chroot "$root" env -C /loom ctest --test-dir build-trixie --output-on-failure --timeout 900 "$@"
fi
