"""`minifaas serve` as a child process for a test module: started, its port read, stopped, nothing left."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator


@contextlib.contextmanager
def serving(*flags: str, start_timeout: float = 240.0) -> Iterator[tuple[str, list[str]]]:
    """``minifaas serve --port 0 FLAGS``: its base URL and the lines it logged (until it served, and on as it logs).

    On exit: SIGTERM, exit status 0, and no process of its group left."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "minifaas.commands.main", "serve", "--port", "0", "--log-level", "INFO", *flags],
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    port, lines = None, []
    deadline = time.monotonic() + start_timeout
    while port is None and time.monotonic() < deadline:
        line = proc.stderr.readline()  # type: ignore[union-attr]
        if not line:
            break
        lines.append(line)
        if "serving" in line and "http://" in line:
            port = int(line.split("http://")[1].split("/")[0].rsplit(":", 1)[1])
    if port is None:
        proc.kill()
        raise AssertionError(f"server did not start (exit {proc.wait()}):\n{''.join(lines)[-3000:]}")
    # read on: a server whose log fills the pipe blocks in its next write, and stops serving
    reader = threading.Thread(target=lines.extend, args=(proc.stderr,), daemon=True)
    reader.start()
    try:
        yield f"http://127.0.0.1:{port}", lines
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        reader.join(timeout=5)
        time.sleep(0.5)
        leftovers = subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert leftovers == [], f"processes left after shutdown: {leftovers}"
