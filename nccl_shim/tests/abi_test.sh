#!/usr/bin/env bash
# ctest: libloom_nccl.so exports every nccl*/pnccl* name that NCCL's own
# libnccl.so.2 exports (so a program linked against NCCL loads the shim
# instead), and nothing but nccl*/pnccl* names.  Prototypes are checked at
# build time: the shim compiles against the real nccl.h.
set -euo pipefail
SHIM="${1:?usage: abi_test.sh libloom_nccl.so libnccl.so.2}"
REAL="${2:?usage: abi_test.sh libloom_nccl.so libnccl.so.2}"
names() { nm -D --defined-only "$1" | awk '{print $NF}' | sed 's/@.*//' | sort -u; }
real="$(names "$REAL" | grep -E '^p?nccl')"
shim="$(names "$SHIM")"
echo "$(wc -l <<<"$real") nccl*/pnccl* names in $REAL; $(wc -l <<<"$shim") names in $SHIM"
missing="$(comm -23 <(echo "$real") <(echo "$shim"))"
if [ -n "$missing" ]; then
  echo "FAILED: NCCL exports these and the shim does not:"
  echo "$missing"
  exit 1
fi
extra="$(grep -vE '^p?nccl' <<<"$shim" || true)"
if [ -n "$extra" ]; then
  echo "FAILED: the shim exports names outside NCCL's API:"
  echo "$extra"
  exit 1
fi
# The functions NCCL declares in nccl.h must all be among them, with the
# weak nccl* / strong pnccl* pairing NCCL uses for profilers.
for f in $(grep -oE '^p?nccl[A-Za-z]*\b' <<<"$real" | grep '^nccl'); do
  kind="$(nm -D --defined-only "$SHIM" | awk -v f="$f" '$3 == f {print $2}')"
  if grep -qx "p$f" <<<"$real" && [ "$kind" != W ]; then
    echo "FAILED: $f should be a weak alias of p$f (nm type $kind)"
    exit 1
  fi
done
echo "the shim exports all $(wc -l <<<"$real") of NCCL's names"
