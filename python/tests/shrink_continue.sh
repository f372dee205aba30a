#!/usr/bin/env bash
# Runs python/tests/shrink_continue.py on N ranks under loom-run --keep-going,
# with the c10d store on a free port.  usage: shrink_continue.sh BIN_DIR PYTHON N
set -euo pipefail
bin=$1 py=$2 n=$3
port=$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
exec "$bin/loom-run" -n "$n" --keep-going --timeout 120 -- env TEST_STORE_PORT="$port" \
  "$py" "$(dirname "$0")/shrink_continue.py"
