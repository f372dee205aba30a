#!/usr/bin/env bash
# ctest: perf/plot_busbw.py draws loom-perf's JSON (two repeats and a second
# rank count) into a PNG with one curve per label, and refuses input that is
# not perf JSON.  usage: plot_test.sh BIN_DIR SOURCE_DIR
set -euo pipefail
BIN=$1 SRC=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for run in 1 2; do
  "$BIN/loom-run" -n 2 "$BIN/loom-perf" all_reduce -b 8 -e 64K -f 16 -n 3 -w 1 --json "$tmp/n2_$run.json" >/dev/null
done
"$BIN/loom-run" -n 3 "$BIN/loom-perf" all_reduce -b 8 -e 64K -f 16 -n 3 -w 1 --json "$tmp/n3.json" >/dev/null
out=$(/usr/bin/python3 "$SRC/perf/plot_busbw.py" -o "$tmp/plot.png" "$tmp")
echo "$out"
[[ "$out" == *"(2 curves)"* ]] || { echo "FAILED: expected 2 curves (N=2 with 2 repeats, N=3)"; exit 1; }
[[ "$(head -c 8 "$tmp/plot.png" | od -An -tx1 | tr -d ' \n')" == "89504e470d0a1a0a" ]] ||
  { echo "FAILED: $tmp/plot.png is not a PNG"; exit 1; }
[[ $(stat -c %s "$tmp/plot.png") -gt 10000 ]] || { echo "FAILED: the PNG is suspiciously small"; exit 1; }
# A label names a curve; in-place rows plot too.
/usr/bin/python3 "$SRC/perf/plot_busbw.py" --place in_place -o "$tmp/named.png" "loom two ranks=$tmp/n2_1.json" |
  grep -q "(1 curves)" || { echo "FAILED: LABEL=FILE"; exit 1; }
echo '{"not": "perf"}' >"$tmp/bad.json"
if /usr/bin/python3 "$SRC/perf/plot_busbw.py" -o "$tmp/bad.png" "$tmp/bad.json" 2>"$tmp/err"; then
  echo "FAILED: non-perf JSON accepted"; exit 1
fi
grep -q "not perf JSON" "$tmp/err" || { echo "FAILED: unclear error: $(cat "$tmp/err")"; exit 1; }
echo "plot test: ok"
