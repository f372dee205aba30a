#!/usr/bin/env bash
# Runs a test script under python3 -m loom_torch.run (torchrun) with N ranks on
# a free port, so that tests running at the same time (or other jobs on the
# machine) do not fight over torchrun's default port 29500.
# Usage: launch.sh PYTHON N script.py [args]
set -euo pipefail
py=$1 n=$2
shift 2
port=$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
# A rank that dies of a signal prints every thread's Python stack first.
export PYTHONFAULTHANDLER=1
exec "$py" -m loom_torch.run --nproc_per_node "$n" --master_addr 127.0.0.1 --master_port "$port" "$@"
