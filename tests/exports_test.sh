#!/usr/bin/env bash
# ctest: libloom.so exports its C API and nothing else (hidden visibility
# and cmake/libloom.map).  Every defined dynamic symbol must be a loom*
# function; the list is printed so a failure shows what leaked.
set -euo pipefail
LIB="${1:?usage: exports_test.sh path/to/libloom.so}"
syms="$(nm -D --defined-only "$LIB" | awk '{print $NF}')"
echo "$(echo "$syms" | wc -l) defined dynamic symbols in $LIB:"
echo "$syms" | tr '\n' ' '
echo
leaked="$(grep -v "^loom[A-Z]" <<<"$syms" || true)"
if [ -n "$leaked" ]; then
  echo "FAILED: exported but not part of the C API:"
  echo "$leaked" | head -50
  exit 1
fi
missing=""
for f in $(sed -n 's/^LOOM_API [^(]* \**\(loom[A-Za-z]*\)(.*/\1/p' "$(dirname "$0")/../include/loom.h"); do
  grep -qx "$f" <<<"$syms" || missing="$missing $f"
done
if [ -n "$missing" ]; then
  echo "FAILED: declared LOOM_API in loom.h but not exported:$missing"
  exit 1
fi
echo "only the C API is exported"
