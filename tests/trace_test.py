#!/usr/bin/env python3
"""ctest: LOOM_TRACE writes a timeline per rank that tools/loom_trace_merge.py merges.

  trace_test.py BIN_DIR SOURCE_DIR

Runs loom-perf under loom-run with LOOM_TRACE set, on the ring (executor
steps) and on the default shared-memory path, and checks what the files
say against what ran: every rank traced the same operations in the same
order, the ring's steps name real peers and carry bytes, each step lies
inside an operation of its rank, its waiting + moving + reducing add up to
its duration, "%r" names the files, and the merge tool combines the ranks.
"""
import json
import os
import subprocess
import sys
import tempfile

BIN, SRC = sys.argv[1], sys.argv[2]
RUN, PERF = os.path.join(BIN, "loom-run"), os.path.join(BIN, "loom-perf")
MERGE = os.path.join(SRC, "tools", "loom_trace_merge.py")


def run(args, env=None):
    e = dict(os.environ)
    e.update(env or {})
    p = subprocess.run(args, env=e, capture_output=True, text=True, timeout=240)
    if p.returncode != 0:
        sys.exit(f"{args}: exit {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}")
    return p


def check(cond, what):
    if not cond:
        sys.exit("FAILED: " + what)


def load(path):
    with open(path) as f:
        return json.load(f)


def complete(d, tid0):
    return [e for e in d["traceEvents"] if e.get("ph") == "X" and (e["tid"] == 0) == tid0]


with tempfile.TemporaryDirectory() as tmp:
    # The ring at 1 MiB: 2 ranks, 3 timed + 1 warm-up iterations.
    base = os.path.join(tmp, "ring.json")
    run([RUN, "-n", "2", PERF, "all_reduce", "-b", "1M", "-e", "1M", "-n", "3", "-w", "1"],
        {"LOOM_TRACE": base, "LOOM_ALGO": "ring", "LOOM_TRANSPORTS": "shm,tcp"})
    ranks = [load(f"{base}.{r}") for r in range(2)]
    names = []
    for r, d in enumerate(ranks):
        check(d["otherData"]["loom_rank"] == r and d["otherData"]["loom_nranks"] == 2, f"rank {r}: header")
        check(d["otherData"]["dropped"] == 0, f"rank {r}: no events dropped")
        ops, steps = complete(d, True), complete(d, False)
        # (loom-perf's own small all-reduces of timings are traced too)
        ars = [e for e in ops if e["name"] == "AllReduce" and e["args"]["bytes"] == 1 << 20]
        check(len(ars) >= 4, f"rank {r}: at least the 4 all-reduces of 1 MiB traced ({len(ars)})")
        for e in ops:
            check(e["args"].get("algorithm") == "ring", f"rank {r}: LOOM_ALGO=ring shows in every event: {e}")
        names.append([(e["name"], e["args"].get("seq")) for e in ops])
        check(steps, f"rank {r}: ring steps traced")
        for s in steps:
            a = s["args"]
            check(a["bytes"] > 0, f"rank {r}: step with bytes: {s}")
            check(a["from"] in (-1, 1 - r) and a["to"] in (-1, 1 - r) and (a["from"], a["to"]) != (-1, -1),
                  f"rank {r}: step peers are the other rank: {s}")
            parts = a["wait_us"] + a["move_us"] + a["reduce_us"]
            check(abs(parts - s["dur"]) <= 0.01 + 1e-6 * s["dur"] or (a["wait_us"] == 0 and parts >= s["dur"]),
                  f"rank {r}: waiting + moving + reducing = duration: {s}")
            check(any(o["ts"] - 0.5 <= s["ts"] and s["ts"] + s["dur"] <= o["ts"] + o["dur"] + 0.5 for o in ops),
                  f"rank {r}: step inside one of its operations: {s}")
        check(any(s["name"] == "recvReduceSend" and s["args"]["reduce_us"] > 0 for s in steps),
              f"rank {r}: the ring's reducing steps record reduction time")
    check(names[0] == names[1], "both ranks traced the same operations in the same order")

    # Merged: one process per rank, every event of both files.
    merged = os.path.join(tmp, "merged.json")
    p = run([sys.executable, MERGE, base, "-o", merged])
    m = load(merged)
    procs = {e["pid"] for e in m["traceEvents"] if e.get("name") == "process_name"}
    check(procs == {0, 1}, f"merged trace has ranks 0 and 1 ({procs})")
    check(len(m["traceEvents"]) == sum(len(d["traceEvents"]) for d in ranks), "merge keeps every event")
    check("waiting" in p.stderr and p.stderr.count("\n") >= 3, "merge prints its per-rank summary:\n" + p.stderr)

    # The default path at 8 B (one-shot over shared memory), files named by %r.
    pattern = os.path.join(tmp, "small-%r.json")
    run([RUN, "-n", "3", PERF, "all_reduce", "-b", "8", "-e", "8", "-n", "5", "-w", "1"], {"LOOM_TRACE": pattern})
    for r in range(3):
        d = load(os.path.join(tmp, f"small-{r}.json"))
        algos = {e["args"].get("algorithm") for e in complete(d, True)
                 if e["name"] == "AllReduce" and e["args"]["bytes"] == 8}
        check(algos == {"oneshot"}, f"rank {r}: 8 B all-reduces traced as one-shot ({algos})")
    p = run([sys.executable, MERGE, "--summary"] + [os.path.join(tmp, f"small-{r}.json") for r in range(3)])
    check(len(p.stdout.strip().splitlines()) == 4, "summary: a header and a line per rank:\n" + p.stdout)

print("trace test: ok")
