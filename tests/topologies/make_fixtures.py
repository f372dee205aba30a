#!/usr/bin/env python3
"""Writes the hwloc XML fixtures of this folder (run from anywhere; needs
lstopo-no-graphics).  The CPU side comes from an hwloc synthetic description,
the PCI tree is added here, so the files stay readable and reproducible:

  two-socket.xml   2 packages x 4 cores x 2 PUs, one NUMA node each (32 GiB);
                   an Ethernet NIC on package 0, an InfiniBand NIC on package 1.
  eight-gpu.xml    2 packages x 8 cores, one NUMA node each; per package one
                   host bridge with two root ports, each leading to a PCIe
                   switch with 2 GPUs and 1 NIC: 8 GPUs + 4 NICs in all.
"""
import os
import re
import subprocess

HERE = os.path.dirname(os.path.abspath(__file__))


class Gp:
    def __init__(self, start):
        self.n = start

    def __call__(self):
        self.n += 1
        return self.n


def synthetic(desc):
    xml = subprocess.run(["lstopo-no-graphics", "--input", desc, "--of", "xml", "-"],
                         check=True, capture_output=True, text=True).stdout
    xml = re.sub(r'\s*<info name="(ProcessName|hwlocVersion)"[^>]*/>', "", xml)
    return xml


def osdev(gp, ind, name, kind, subtype=None):
    st = f' subtype="{subtype}"' if subtype else ""
    return f'{ind}<object type="OSDev" gp_index="{gp()}" name="{name}"{st} osdev_type="{kind}"/>\n'


def pcidev(gp, ind, bus, cls, ids, osdevs):
    s = f'{ind}<object type="PCIDev" gp_index="{gp()}" pci_busid="0000:{bus:02x}:00.0" pci_type="{cls} [{ids}] [0000:0000] 01" pci_link_speed="15.753846">\n'
    for o in osdevs:
        s += osdev(gp, ind + "  ", *o)
    return s + f"{ind}</object>\n"


def bridge(gp, ind, depth, busid, sec, sub, children):
    s = (f'{ind}<object type="Bridge" gp_index="{gp()}" bridge_type="1-1" depth="{depth}" '
         f'bridge_pci="0000:[{sec:02x}-{sub:02x}]" pci_busid="{busid}" '
         f'pci_type="0604 [10b5:8747] [0000:0000] ca" pci_link_speed="15.753846">\n')
    return s + "".join(children) + f"{ind}</object>\n"


def host_bridge(gp, ind, lo, hi, children):
    s = f'{ind}<object type="Bridge" gp_index="{gp()}" bridge_type="0-1" depth="0" bridge_pci="0000:[{lo:02x}-{hi:02x}]">\n'
    return s + "".join(children) + f"{ind}</object>\n"


def insert_io(xml, per_package):
    """Appends per_package[i] (I/O XML) as the last children of package i."""
    out, pkg, depth_stack = [], -1, []
    for line in xml.splitlines(keepends=True):
        stripped = line.strip()
        if stripped.startswith('<object type="Package"'):
            pkg += 1
            depth_stack.append("pkg")
        elif stripped.startswith("<object") and not stripped.endswith("/>"):
            depth_stack.append("obj")
        elif stripped == "</object>":
            kind = depth_stack.pop()
            if kind == "pkg":
                out.append(per_package[pkg])
        out.append(line)
    return out


def two_socket():
    xml = synthetic("pack:2 [numa(memory=34359738368)] core:4 pu:2")
    gp = Gp(1000)
    ind = "      "
    p0 = host_bridge(gp, ind, 0x00, 0x7f, [bridge(gp, ind + "  ", 1, "0000:00:01.0", 0x04, 0x04, [
        pcidev(gp, ind + "    ", 0x04, "0200", "8086:1572", [("eth0", 2)])])])
    p1 = host_bridge(gp, ind, 0x80, 0xff, [bridge(gp, ind + "  ", 1, "0000:80:01.0", 0x81, 0x81, [
        pcidev(gp, ind + "    ", 0x81, "0207", "15b3:1017", [("ib0", 2), ("mlx5_0", 3)])])])
    return insert_io(xml, [p0, p1])


def eight_gpu():
    xml = synthetic("pack:2 [numa(memory=274877906944)] core:8 pu:1")
    gp = Gp(1000)
    ind = "      "
    per_pkg = []
    gpu, nic = 0, 0
    for p in range(2):
        base = 0x80 * p
        ports = []
        for s in range(2):
            up = base + 0x10 + 0x20 * s          # switch upstream bus
            devs = []
            for d in range(3):
                bus = up + 1 + d
                if d < 2:
                    dev = pcidev(gp, ind + "      ", bus, "0302", "10de:20b0",
                                 [(f"cuda{gpu}", 5, "CUDA"), (f"nvml{gpu}", 1, "NVML")])
                    gpu += 1
                else:
                    dev = pcidev(gp, ind + "      ", bus, "0207", "15b3:101b",
                                 [(f"ib{nic}", 2), (f"mlx5_{nic}", 3, "OpenFabrics")])
                    nic += 1
                devs.append(bridge(gp, ind + "    ", 3, f"0000:{up:02x}:{d:02x}.0", bus, bus, [dev]))
            switch = bridge(gp, ind + "  ", 2, f"0000:{up - 1:02x}:00.0", up, up + 3, devs)
            ports.append(bridge(gp, ind + "  ", 1, f"0000:{base:02x}:{s + 1:02x}.0", up - 1, up + 3, [
                switch.replace(ind + "  <", ind + "    <", 1)]))
        per_pkg.append(host_bridge(gp, ind, base, base + 0x7f, ports))
    return insert_io(xml, per_pkg)


for name, lines in (("two-socket.xml", two_socket()), ("eight-gpu.xml", eight_gpu())):
    with open(os.path.join(HERE, name), "w") as f:
        f.writelines(lines)
    print("wrote", name)
