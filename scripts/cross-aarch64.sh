#!/usr/bin/env bash
# Compiles every library source for aarch64 (Grace-Hopper hosts) with
# Debian's cross compiler, to objects only: linking would need arm64 builds
# of hwloc (and UCX) through multiarch.  Fails on any error or warning
# (-Werror), printing one line per file.  scripts/test.sh runs it in CI.
#
# The files are globbed, so new sources are picked up: src/*/*.cc,
# algorithms/*.cc, transports/*.cc and transports/<name>/*.cc, except
# transports/ucx (it needs UCX's headers for aarch64; this machine has the
# x86 ones only) and transports/ibverbs unless libibverbs-dev:arm64 is
# installed (its headers then come from /usr/include/infiniband).  That is
# what CMakeLists.txt compiles into loom_objs, ucx aside.
#
# hwloc: its headers in /usr/include are arch-independent, apart from
# hwloc/autogen/config.h under the multiarch directory, which holds only the
# version and compiler-attribute macros (no type sizes); the x86 copy is used
# unless libhwloc-dev:arm64 is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
CXX=aarch64-linux-gnu-g++
if ! command -v "$CXX" >/dev/null; then
  echo "cross-aarch64: installing g++-aarch64-linux-gnu"
  SUDO=""
  [[ $(id -u) -ne 0 ]] && SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends g++-aarch64-linux-gnu
fi

hwloc_arch=/usr/include/aarch64-linux-gnu
[ -f "$hwloc_arch/hwloc/autogen/config.h" ] || hwloc_arch=/usr/include/x86_64-linux-gnu
[ -f /usr/include/hwloc.h ] && [ -f "$hwloc_arch/hwloc/autogen/config.h" ] ||
  { echo "cross-aarch64: hwloc headers not found (apt-get install libhwloc-dev)" >&2; exit 1; }
# Only hwloc's headers, not all of /usr/include: the rest must come from
# the aarch64 sysroot.
inc=$(mktemp -d)
out=$(mktemp -d)
trap 'rm -rf "$inc" "$out"' EXIT
mkdir -p "$inc/hwloc/autogen"
ln -s /usr/include/hwloc.h "$inc/hwloc.h"
for f in /usr/include/hwloc/*; do [ -e "$inc/hwloc/$(basename "$f")" ] || ln -s "$f" "$inc/hwloc/"; done
ln -s "$hwloc_arch/hwloc/autogen/config.h" "$inc/hwloc/autogen/config.h"

shopt -s nullglob
files=()
verbs_arm64=0
if dpkg-query -W -f='${Status}' libibverbs-dev:arm64 2>/dev/null | grep -q "install ok installed"; then
  verbs_arm64=1
  ln -s /usr/include/infiniband "$inc/infiniband"
fi
for f in src/*/*.cc algorithms/*.cc transports/*.cc transports/*/*.cc; do
  [[ "$f" == transports/ucx/* ]] && continue
  [[ "$f" == transports/ibverbs/* ]] && ((!verbs_arm64)) && continue
  files+=("$f")
done
((verbs_arm64)) || echo "cross-aarch64: skipping transports/ibverbs (no libibverbs-dev:arm64)"
((${#files[@]})) || { echo "cross-aarch64: no sources found" >&2; exit 1; }

start=$(date +%s)
export CXX inc out
# One compiler per core; each prints its own line.
printf '%s\n' "${files[@]}" | xargs -P "$(getconf _NPROCESSORS_ONLN)" -I{} sh -c '
  o="$out/$(echo "{}" | tr / _).o"
  if "$CXX" -std=c++17 -O2 -g0 -fPIC -Wall -Wextra -Werror -I. -Iinclude -isystem "$inc" \
      -c "{}" -o "$o" 2>"$o.log"; then
    echo "cross-aarch64: ok     {}"
  else
    echo "cross-aarch64: FAILED {}"; cat "$o.log"
  fi'
failed=$(find "$out" -name '*.log' -size +0 | wc -l)
ok=$(find "$out" -name '*.o' | wc -l)
echo "cross-aarch64: $ok of ${#files[@]} sources compiled for aarch64 ($($CXX -dumpversion)," \
  "$(($(date +%s) - start)) s), $failed with errors or warnings"
[ "$ok" = "${#files[@]}" ] && [ "$failed" = 0 ]
