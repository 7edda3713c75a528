"""docs/DEPLOY.md's two-host example runs as written: namespaces as hosts, hand-started workers, a gateway.

Root only (it builds network namespaces). The block cleans up after itself;
this test checks that it did: no namespace, no veth and no process is left.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from netns import unavailable
from test_docs_commands import ROOT, marked_blocks

_NO_NETNS = unavailable()
pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.skipif(_NO_NETNS is not None, reason=_NO_NETNS or "")]


def test_the_two_hosts_example_runs_as_written(tmp_path: Path) -> None:
    (block,) = marked_blocks((ROOT / "docs" / "DEPLOY.md").read_text(), "two-hosts-example")
    script = tmp_path / "two_hosts.sh"
    script.write_text(block)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}  # this venv's minifaas
    # The block's results go to stdout and the processes' logs to stderr, read apart: a log line
    # written between two writes of a result line (unbuffered Python writes print's parts apart)
    # would break it.
    proc = subprocess.Popen(["bash", str(script)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        out, log = proc.communicate(timeout=540)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    report = f"stdout:\n{out[-3000:]}\nstderr:\n{log[-3000:]}"
    assert proc.returncode == 0, report
    routes = re.findall(r"^(local|prfaas) (\d+) KV bytes, (\d+) on the wire, TTFT ([\d.]+) s$", out, re.M)
    assert [r[0] for r in routes] == ["local", "prfaas"], report
    assert int(routes[1][1]) > 0 and 0 < int(routes[1][2]) <= int(routes[1][1])  # coded, perhaps, never larger
    rtt = re.search(r'^minifaas:link_rtt_seconds\{link="prfaas->pd"\} ([\d.e+-]+)$', out, re.M)
    assert rtt is not None and float(rtt.group(1)) > 0, report
    sent = re.search(r"Sent (\d+) bytes", out)
    # the KV crossed the bottleneck, as coded
    assert sent is not None and int(sent.group(1)) >= int(routes[1][2]), report
    print("the two-hosts example:", routes, "rtt", rtt.group(1), "s")
    with pytest.raises(ProcessLookupError):  # the block's workers and gateway are all gone
        os.killpg(proc.pid, 0)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
    assert "mf-prfaas" not in listed and "mf-pd" not in listed and "mf-gw" not in links
