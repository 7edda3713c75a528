"""CPU time of a process tree, from /proc: what a deployment of several processes spends, all told."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def tree_cpu_s(root: int) -> float:
    """CPU seconds spent so far by ``root`` and every process below it, reaped children included, so a process
    that ended between two readings still counts. 0.0 where /proc is not there."""
    stats: dict[int, list[str]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError):
                stat = (entry / "stat").read_text()
                stats[int(entry.name)] = stat[stat.rindex(")") + 2 :].split()  # state, ppid, ...
    below: dict[int, list[int]] = {}
    for pid, fields in stats.items():
        below.setdefault(int(fields[1]), []).append(pid)
    tree, ticks = [root], 0
    while tree:
        pid = tree.pop()
        if pid in stats:
            ticks += sum(map(int, stats[pid][11:15]))
            tree += below.get(pid, [])
    return ticks / os.sysconf("SC_CLK_TCK")
