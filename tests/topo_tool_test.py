#!/usr/bin/env python3
"""ctest: loom-topo as users run it.

  topo_tool_test.py BIN_DIR SOURCE_DIR CASE

CASE is one of: local, comm, calibrate, xnuma, env, algorithms, usage (one ctest entry each).
"""
import json
import os
import re
import subprocess
import sys
import tempfile

BIN, SRC, CASE = sys.argv[1], sys.argv[2], sys.argv[3]
TOPO = os.path.join(BIN, "loom-topo")
RUN = os.path.join(BIN, "loom-run")


def run(args, env=None, expect=0):
    e = dict(os.environ)
    e.update(env or {})
    p = subprocess.run(args, env=e, capture_output=True, text=True, timeout=300)
    if p.returncode != expect:
        sys.exit(f"{args}: exit {p.returncode}, expected {expect}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}")
    return p


def rank0_json(stdout):
    return json.loads("\n".join(l[4:] for l in stdout.splitlines() if l.startswith("[0] ")))


def case_local():
    doc = json.loads(run([TOPO, "--json"]).stdout)["machine"]
    nodes = [d for d in os.listdir("/sys/devices/system/node") if re.fullmatch(r"node\d+", d)] \
        if os.path.isdir("/sys/devices/system/node") else ["node0"]
    assert len(doc["numaNodes"]) == len(nodes), (doc["numaNodes"], nodes)
    # hwloc counts the PUs of this process's cgroup: between its affinity mask and all online.
    assert len(os.sched_getaffinity(0)) <= doc["pus"] <= os.sysconf("SC_NPROCESSORS_ONLN"), doc["pus"]
    fixture = os.path.join(SRC, "tests/topologies/eight-gpu.xml")
    doc = json.loads(run([TOPO, "--json"], {"LOOM_TOPO_FILE": fixture}).stdout)["machine"]
    assert doc["source"] == fixture
    assert len(doc["gpus"]) == 8 and len(doc["nics"]) == 4
    assert [g["numa"] for g in doc["gpus"]] == [0, 0, 0, 0, 1, 1, 1, 1]
    pix = [d for d in doc["pciDistance"] if d["class"] == "PIX"]
    assert len(pix) == 4 * 3, pix  # per switch: gpu-gpu, gpu-nic, gpu-nic
    text = run([TOPO], {"LOOM_TOPO_FILE": fixture}).stdout
    assert "8 GPUs, 4 NICs" in text, text
    bad = run([TOPO], {"LOOM_TOPO_FILE": "/nonexistent.xml"}, expect=1)
    assert "/nonexistent.xml" in bad.stderr, bad.stderr


def case_comm():
    p = run([RUN, "-n", "4", "--hosts", "2", "--timeout", "120", TOPO, "--json"])
    comm = rank0_json(p.stdout)["communicator"]
    assert [r["host"] for r in comm["ranks"]] == [0, 0, 1, 1], comm
    assert [r["localRank"] for r in comm["ranks"]] == [0, 1, 0, 1], comm
    assert [h["ranks"] for h in comm["hosts"]] == [[0, 1], [2, 3]], comm
    assert [r["transportFromRank0"] for r in comm["ranks"]] == ["self", "shm", "tcp", "tcp"], comm
    assert [r["classFromRank0"] for r in comm["ranks"]] == ["self", "shm", "net", "net"], comm
    # LOOM_TRANSPORTS=tcp: same hosts, but every pair talks tcp.
    p = run([RUN, "-n", "2", "--timeout", "120", TOPO, "--json"], {"LOOM_TRANSPORTS": "tcp"})
    comm = rank0_json(p.stdout)["communicator"]
    assert comm["nhosts"] == 1 and comm["ranks"][1]["transportFromRank0"] == "tcp", comm
    text = run([RUN, "-n", "3", "--hosts", "3", "--timeout", "120", TOPO]).stdout
    assert "3 ranks on 3 hosts" in text, text


def case_calibrate():
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "tuning.conf")
        run([RUN, "-n", "3", "--hosts", "2", "--timeout", "240", TOPO, "--calibrate", "--out", out,
             "--iters", "50", "--bytes", "4M"])
        values = {}
        with open(out) as f:
            for line in f:
                line = line.strip()
                if not line or line.startswith("#"):
                    continue
                m = re.fullmatch(r"([a-z_]+\.[A-Za-z_]+) = ([0-9.]+)", line)
                assert m, f"not a key = value line: {line!r}"
                values[m.group(1)] = float(m.group(2))
        want = {"shm.alpha_us", "shm.beta_GBps", "tcp.alpha_us", "tcp.beta_GBps", "reduce.GBps"}
        assert set(values) == want, values
        assert all(v > 0 for v in values.values()), values
        # No comparison of the measured numbers: which link answers faster
        # is the benchmarks' business (a loaded machine once made shm's
        # latency come out above tcp's here).
    p = run([TOPO, "--calibrate"], expect=2)
    assert "launcher" in p.stderr, p.stderr


def case_xnuma():
    # Pose as a 2-socket server whose even CPUs are on node 0 and odd ones on
    # node 1 (hwloc's 24em64t), bind rank r to CPU r: the two ranks are then
    # on different NUMA nodes of one host, and calibration measures shm_xnuma.
    if not {0, 1} <= os.sched_getaffinity(0):
        print("SKIP: needs CPUs 0 and 1 to bind two ranks to different posed NUMA nodes")
        sys.exit(77)
    xml = os.path.join(SRC, "tests/topologies/hwloc/24em64t-2n6c2t-pci.xml")
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "tuning.conf")
        p = run([RUN, "-n", "2", "--timeout", "240", "sh", "-c",
                 f'exec taskset -c "$LOOM_RANK" "{TOPO}" --json --calibrate --iters 50 --bytes 4M --out "{out}"'],
                {"LOOM_TOPO_FILE": xml})
        doc = rank0_json(p.stdout)
        ranks = doc["communicator"]["ranks"]
        assert [r["numa"] for r in ranks] == [0, 1], ranks
        assert [r["numaCount"] for r in ranks] == [2, 2], ranks
        assert ranks[1]["classFromRank0"] == "shm_xnuma" and ranks[1]["transportFromRank0"] == "shm", ranks
        keys = [l["key"] for l in doc["calibration"]["links"]]
        assert keys == ["shm_xnuma"], keys
        with open(out) as f:
            text = f.read()
        assert re.search(r"^shm_xnuma\.alpha_us = [0-9.]+$", text, re.M), text
        assert not re.search(r"^shm\.alpha_us", text, re.M), text


def case_env():
    listed = {v["name"] for v in json.loads(run([TOPO, "--env", "--json"]).stdout)["variables"]}
    # Every LOOM_* variable named in the sources is in the table...
    used = set()
    for top in ("src", "tools", "include", "perf"):
        for root, _, files in os.walk(os.path.join(SRC, top)):
            for name in files:
                if name.endswith((".cc", ".h", ".c")):
                    with open(os.path.join(root, name)) as f:
                        used |= set(re.findall(r'"(LOOM_[A-Z_]+)', f.read()))
    # (loom.h's macros, such as LOOM_CONFIG_INITIALIZER, are not variables.)
    with open(os.path.join(SRC, "include", "loom.h")) as f:
        used -= set(re.findall(r"#define\s+(LOOM_[A-Z_]+)", f.read()))
    missing = used - listed
    assert not missing, f"LOOM_* variables read but not in the config table: {sorted(missing)}"
    # ...and in docs/configuration.md's table.
    with open(os.path.join(SRC, "docs", "configuration.md")) as f:
        readme = f.read()
    undocumented = [v for v in listed if f"`{v}`" not in readme]
    assert not undocumented, f"not in docs/configuration.md: {undocumented}"
    text = run([TOPO, "--env"], {"LOOM_SPIN_US": "7"}).stdout
    assert re.search(r"LOOM_SPIN_US\s+int\s+20\s+.*\[set: 7\]", text), text


def case_algorithms():
    # docs/algorithms.md's table is the registry's, as loom-topo prints it.
    table = run([TOPO, "--algorithms"]).stdout
    rows = table.splitlines()
    assert len(rows) > 2 and all(r.startswith("|") for r in rows), table
    with open(os.path.join(SRC, "docs", "algorithms.md")) as f:
        readme = f.read()
    start = readme.find(rows[0])
    assert start >= 0, f"docs/algorithms.md has no algorithm table headed {rows[0]!r}; paste `loom-topo --algorithms`"
    lines = readme[start:].splitlines()
    end = next((i for i, l in enumerate(lines) if not l.startswith("|")), len(lines))
    readme_rows = lines[:end]
    assert readme_rows == rows, ("docs/algorithms.md's algorithm table differs from the registry; replace it with "
                                 "`loom-topo --algorithms`:\n" + "\n".join(rows))
    # Every name in the table is one LOOM_ALGO accepts, and the reverse.
    names = set(re.findall(r"`([a-z][a-z-]*)`", "\n".join(r.split(" | ")[0] for r in rows[2:])))
    assert names == {"oneshot", "staged", "ring", "rhd", "tree", "hier", "pairwise", "bruck", "hier-ring", "hier-rhd",
                     "hier-tree"}, names


def case_usage():
    assert "usage" in run([TOPO, "--help"]).stdout
    assert "unknown argument" in run([TOPO, "--bogus"], expect=2).stderr
    assert "--bytes" in run([TOPO, "--bytes", "12x"], expect=2).stderr


{"local": case_local, "comm": case_comm, "calibrate": case_calibrate, "xnuma": case_xnuma, "env": case_env,
 "algorithms": case_algorithms, "usage": case_usage}[CASE]()
print(f"loom-topo {CASE}: passed")
