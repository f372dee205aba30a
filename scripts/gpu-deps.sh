#!/usr/bin/env bash
# Run on the dev machine (Debian 12, its package archive reachable) before a
# session on the lent GPU machine:
#   bash scripts/gpu-deps.sh            -> .gpudeps/*.deb (git-ignored)
# That machine's image has nvcc, CMake, ninja and PyTorch, but not what
# loom's build needs from Debian (pkg-config, hwloc, Catch2), and it cannot
# download anything.  This fetches those packages (Debian's own .debs, no
# install here); name .gpudeps in the device call's carry, and
# tests/gpu/deps.sh (which the GPU scripts source) unpacks them into a
# private prefix there when the machine lacks them.  UCX and verbs are
# optional in the build and stay out.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$here/.gpudeps}
pkgs=(pkgconf pkgconf-bin libpkgconf3 libhwloc15 libhwloc-dev libudev1 catch2)
mkdir -p "$out"
cd "$out"
rm -f ./*.deb
if ! apt-get download "${pkgs[@]}" >/dev/null 2>&1; then
  apt-get update -qq
  apt-get download "${pkgs[@]}"
fi
ls -l ./*.deb
du -sh .
