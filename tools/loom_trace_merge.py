#!/usr/bin/env python3
"""Merge the per-rank LOOM_TRACE files of one job into one timeline.

usage: loom_trace_merge.py [-o OUT.json] [--summary] PATH_OR_FILE...

Each argument is a trace file (PATH.<rank>, as LOOM_TRACE=PATH writes them)
or the PATH given to LOOM_TRACE, which stands for all of PATH.<rank>.  The
output (default: stdout) is one Chrome-trace JSON with a process per rank;
open it in ui.perfetto.dev or chrome://tracing.  --summary prints, per
rank, the operations traced and where the executor's step time went
(waiting on peers and slots, moving bytes, reducing) instead of the JSON.
"""
import argparse
import glob
import json
import os
import re
import sys


def files_for(arg):
    if os.path.isfile(arg):
        return [arg]
    found = [f for f in glob.glob(glob.escape(arg) + ".*") if re.search(r"\.\d+(\.c\d+)?$", f)]
    if not found:
        sys.exit(f"loom_trace_merge: no trace files {arg} or {arg}.<rank>")
    return sorted(found, key=lambda f: [int(x) for x in re.findall(r"\d+", f[len(arg):])])


def load(path):
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, ValueError) as e:
        sys.exit(f"loom_trace_merge: {path}: {e}")
    other = d.get("otherData", {})
    if "loom_rank" not in other or not isinstance(d.get("traceEvents"), list):
        sys.exit(f"loom_trace_merge: {path} is not a LOOM_TRACE file")
    return d


def summary(traces):
    lines = ["rank  host        ops  op time (ms)  step time (ms)  waiting  moving  reducing  dropped"]
    for d in traces:
        o = d["otherData"]
        ops = [e for e in d["traceEvents"] if e.get("ph") == "X" and e.get("tid") == 0]
        steps = [e for e in d["traceEvents"] if e.get("ph") == "X" and e.get("tid", 0) > 0]
        total = sum(e["dur"] for e in steps)
        share = lambda key: (sum(e["args"].get(key, 0) for e in steps) / total * 100) if total else 0
        lines.append(f"{o['loom_rank']:4d}  {o.get('host', '?'):10.10s} {len(ops):4d}  "
                     f"{sum(e['dur'] for e in ops) / 1e3:12.3f}  {total / 1e3:14.3f}  {share('wait_us'):6.1f}%  "
                     f"{share('move_us'):5.1f}%  {share('reduce_us'):7.1f}%  {o.get('dropped', 0):7d}")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("inputs", nargs="+")
    p.add_argument("-o", "--output", help="merged JSON file (default: stdout)")
    p.add_argument("--summary", action="store_true", help="print a per-rank summary instead of the JSON")
    a = p.parse_args()
    paths = []
    for arg in a.inputs:
        paths += files_for(arg)
    traces = sorted((load(f) for f in paths), key=lambda d: d["otherData"]["loom_rank"])
    if a.summary:
        print(summary(traces))
        return
    events = []
    for d in traces:
        events += d["traceEvents"]
    merged = {"displayTimeUnit": "ns", "traceEvents": events,
              "otherData": {"loom_ranks": [d["otherData"] for d in traces]}}
    out = open(a.output, "w") if a.output else sys.stdout
    json.dump(merged, out)
    if a.output:
        out.close()
        print(summary(traces), file=sys.stderr)


if __name__ == "__main__":
    main()
