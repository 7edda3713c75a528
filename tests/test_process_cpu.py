"""A process tree's CPU time counts its children's, running and reaped."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from minifaas.process_cpu import tree_cpu_s

BURN = "import time\nend = time.process_time() + 0.6\nwhile time.process_time() < end: pass\n"


def test_a_tree_counts_a_child_while_it_runs_and_after_it_was_reaped() -> None:
    before, own = tree_cpu_s(os.getpid()), time.process_time()
    child = subprocess.Popen([sys.executable, "-c", BURN + "input()"], stdin=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while tree_cpu_s(os.getpid()) - before < 0.5:  # running: its own utime and stime, through the tree
        assert child.poll() is None and time.monotonic() < deadline, "the child's CPU time was not seen"
        time.sleep(0.05)
    child.communicate(b"\n")  # reaped: now in this process's cutime and cstime
    grown = tree_cpu_s(os.getpid()) - before
    assert grown >= 0.5 and time.process_time() - own < 0.5 * grown, grown
    assert tree_cpu_s(10**9) == 0.0  # no such process
