#!/usr/bin/python3
"""Draw bus bandwidth (and time) against size from the perf scripts' JSON.

usage: perf/plot_busbw.py [-o OUT.png] [--place out_of_place|in_place] [--title T] INPUT...

Each INPUT is a JSON file written by `loom-perf --json` or
`mpi-allreduce-perf --json` (compare_mpi.sh keeps one per run in its output
directory), a directory of them, or LABEL=PATH to name the curve.  Files
with the same label (by default the tool and rank count, e.g.
"loom-perf N=4") are repeats: each point is their median.  The figure has
busbw (GB/s) on the left and time per operation (us, log scale) on the
right, size on a log2 axis; it is written with Debian's matplotlib
(python3-matplotlib, installed by scripts/install-deps.sh).

  perf/compare_mpi.sh -n "2 4" -r 3      # prints where its JSON went
  perf/plot_busbw.py -o allreduce.png /tmp/compare_mpi.XXXX
"""
import argparse
import json
import os
import statistics
import sys

import matplotlib

matplotlib.use("Agg")  # files only: no display needed
import matplotlib.pyplot as plt  # noqa: E402


def inputs(args):
    for a in args:
        label, path = (a.split("=", 1) if "=" in a and not os.path.exists(a) else (None, a))
        if os.path.isdir(path):
            for f in sorted(os.listdir(path)):
                if f.endswith(".json"):
                    yield label, os.path.join(path, f)
        elif os.path.isfile(path):
            yield label, path
        else:
            sys.exit(f"plot_busbw: {path}: no such file or directory")


def load(path):
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, ValueError) as e:
        sys.exit(f"plot_busbw: {path}: {e}")
    if not isinstance(d.get("rows"), list):
        sys.exit(f"plot_busbw: {path}: not perf JSON (no rows)")
    return d


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("inputs", nargs="+")
    p.add_argument("-o", "--output", default="busbw.png")
    p.add_argument("--place", default="out_of_place", choices=["out_of_place", "in_place"])
    p.add_argument("--title", default=None)
    a = p.parse_args()

    curves = {}  # label -> size -> ([busbw], [time])
    collectives = set()
    for label, path in inputs(a.inputs):
        d = load(path)
        collectives.add(d.get("collective", "?"))
        name = label or f"{d.get('tool', os.path.basename(path))} N={d.get('nranks', '?')}"
        for row in d["rows"]:
            cell = row.get(a.place)
            if not cell or cell.get("busbw_GBps") is None:
                continue
            bw, t = curves.setdefault(name, {}).setdefault(int(row["size"]), ([], []))
            bw.append(float(cell["busbw_GBps"]))
            t.append(float(cell["time_us"]))
    if not curves:
        sys.exit(f"plot_busbw: no {a.place} rows in the inputs")

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in sorted(curves):
        sizes = sorted(curves[name])
        left.plot(sizes, [statistics.median(curves[name][s][0]) for s in sizes], marker="o", ms=3, label=name)
        right.plot(sizes, [statistics.median(curves[name][s][1]) for s in sizes], marker="o", ms=3, label=name)
    for ax, ylabel in ((left, "bus bandwidth (GB/s)"), (right, "time per operation (us)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("size (bytes)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    right.set_yscale("log")
    left.legend(fontsize=8)
    fig.suptitle(a.title or f"{', '.join(sorted(collectives))} ({a.place.replace('_', ' ')}; median of repeats)")
    fig.tight_layout()
    fig.savefig(a.output, dpi=110)
    print(f"plot_busbw: wrote {a.output} ({len(curves)} curves)")


if __name__ == "__main__":
    main()
