#!/usr/bin/env python3
"""docs/configuration.md's table of LOOM_* variables, generated from config.cc's table.

The table between the two markers in docs/configuration.md is what `loom-topo --env
--json` prints (configTable() in src/core/config.cc), rendered as markdown.

  docs_env_table.py BIN_DIR           check: exit 1 with a diff if the page differs
  docs_env_table.py BIN_DIR --write   rewrite the page's table

ctest runs the check ("docs: ..."), so a variable added, removed or given a
new default in config.cc without the page (or the other way round) fails.
"""
import difflib
import json
import pathlib
import subprocess
import sys

BEGIN = "<!-- LOOM_* table: generated from src/core/config.cc by scripts/docs_env_table.py; edit config.cc -->"
END = "<!-- end of the generated LOOM_* table -->"
README = pathlib.Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


def cell(text):
    return text.replace("|", "\\|")


def render(variables):
    rows = ["| variable | type | default | meaning |", "|---|---|---|---|"]
    for v in variables:
        rows.append(f"| `{v['name']}` | {cell(v['type'])} | {cell(v['default'])} | {cell(v['meaning'])} |")
    return "\n".join(rows)


def main():
    if len(sys.argv) not in (2, 3) or (len(sys.argv) == 3 and sys.argv[2] != "--write"):
        sys.exit(__doc__)
    out = subprocess.run([f"{sys.argv[1]}/loom-topo", "--env", "--json"], check=True,
                         capture_output=True, text=True).stdout
    table = render(json.loads(out)["variables"])
    text = README.read_text()
    if BEGIN not in text or END not in text:
        sys.exit(f"{README}: the markers of the generated table are missing:\n{BEGIN}\n{END}")
    head, rest = text.split(BEGIN, 1)
    old, tail = rest.split(END, 1)
    new = f"\n{table}\n"
    if len(sys.argv) == 3:
        README.write_text(head + BEGIN + new + END + tail)
        print(f"{README}: table rewritten ({table.count(chr(10)) - 1} variables)")
        return
    if old != new:
        sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), new.splitlines(True),
                                                   "docs/configuration.md", "loom-topo --env"))
        sys.exit(f"docs/configuration.md's LOOM_* table differs from config.cc's: run "
                 f"python3 scripts/docs_env_table.py {sys.argv[1]} --write")
    print(f"docs/configuration.md's LOOM_* table is config.cc's ({table.count(chr(10)) - 1} variables)")


if __name__ == "__main__":
    main()
