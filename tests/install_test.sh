#!/usr/bin/env bash
# Installs the build into a temporary prefix and checks what a user gets:
# header, versioned libloom.so + libloom.a, tools, the CMake package and
# loom.pc. Builds tests/install_project out of tree with find_package (shared
# and static) and with pkg-config, and runs each with 2 ranks under the
# installed loom-run. Usage: install_test.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$1 src=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
prefix=$tmp/prefix
step() { echo "== $*"; }

step "cmake --install into $prefix"
cmake --install "$build" --prefix "$prefix" >/dev/null
for f in include/loom.h lib/libloom.a lib/cmake/loom/loomConfig.cmake lib/cmake/loom/loomConfigVersion.cmake \
         lib/pkgconfig/loom.pc bin/loom-run bin/loom-perf; do
  [[ -e $prefix/$f ]] || { echo "missing in the prefix: $f"; exit 1; }
done
soname=$(readelf -d "$prefix/lib/libloom.so" | sed -n 's/.*Library soname: \[\(.*\)\]/\1/p')
[[ $soname == libloom.so.0 ]] || { echo "soname is '$soname', expected libloom.so.0"; exit 1; }
[[ -L $prefix/lib/libloom.so && -L $prefix/lib/libloom.so.0 && -f $(readlink -f "$prefix/lib/libloom.so") ]] ||
  { echo "libloom.so -> libloom.so.0 -> libloom.so.X.Y.Z links are missing"; exit 1; }
echo "soname $soname, $(basename "$(readlink -f "$prefix/lib/libloom.so")")"

step "find_package(loom) out of tree"
cmake -S "$src/tests/install_project" -B "$tmp/b" -G Ninja -DCMAKE_PREFIX_PATH="$prefix" \
  -DCMAKE_BUILD_RPATH="$prefix/lib" >/dev/null
cmake --build "$tmp/b" >"$tmp/build.log" || { cat "$tmp/build.log"; exit 1; }
# grep reads all of ldd's output (not -q: with pipefail, ldd killed by
# SIGPIPE after an early match failed the check now and then).
ldd "$tmp/b/example_shared" | grep "$prefix/lib/libloom.so.0" >/dev/null ||
  { echo "example_shared does not load the installed libloom.so.0"; ldd "$tmp/b/example_shared"; exit 1; }
"$prefix/bin/loom-run" -n 2 --timeout 60 "$tmp/b/example_shared"
"$prefix/bin/loom-run" -n 2 --timeout 60 "$tmp/b/example_static"

step "pkg-config loom"
export PKG_CONFIG_PATH=$prefix/lib/pkgconfig
[[ $(pkg-config --modversion loom) == "$(sed -n 's/^project(loom VERSION \([0-9.]*\).*/\1/p' "$src/CMakeLists.txt")" ]]
cc "$src/tests/install_project/example.c" -o "$tmp/example_pc" $(pkg-config --cflags --libs loom) \
  -Wl,-rpath,"$prefix/lib"
"$prefix/bin/loom-run" -n 2 --timeout 60 "$tmp/example_pc"

step "installed loom-perf runs (RPATH finds the installed library)"
"$prefix/bin/loom-run" -n 2 --timeout 60 "$prefix/bin/loom-perf" all_reduce -b 8 -e 1K -f 4 -n 3 -w 1 >/dev/null
echo "install test passed"
