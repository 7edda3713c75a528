"""Headless Chromium driven over the DevTools protocol (a websocket, through aiohttp): open a page, run
JavaScript in it, take a screenshot.

    async with Chromium.open("http://127.0.0.1:8000/dashboard") as page:
        rows = await page.evaluate("document.querySelectorAll('tr').length")
        await page.screenshot(path)

Debian's ``chromium`` package; root runs it without its sandbox. The browser gets a profile of its own in
a temporary folder and is killed, with its process group, on exit.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import os
import re
import shutil
import signal
import subprocess
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp

START_TIMEOUT_S = 60.0


def chromium_binary() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Chromium:
    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self._ids = itertools.count(1)

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, url: str, width: int = 1400, height: int = 1100) -> AsyncIterator[Chromium]:
        binary = chromium_binary()
        assert binary is not None, "no chromium: apt-get install -y chromium"
        with tempfile.TemporaryDirectory() as profile:
            argv = [
                binary, "--headless=new", "--disable-gpu", "--no-first-run", "--no-default-browser-check",
                "--remote-debugging-port=0", "--remote-debugging-address=127.0.0.1", f"--user-data-dir={profile}",
                f"--window-size={width},{height}", "--hide-scrollbars",
                *(["--no-sandbox"] if os.geteuid() == 0 else []), url,
            ]  # fmt: skip
            log = Path(profile) / "stderr.log"  # a file, not a pipe: nothing blocks Chromium once it is read
            with log.open("w") as err:
                proc = subprocess.Popen(argv, stderr=err, stdout=subprocess.DEVNULL, start_new_session=True)
            try:
                port = await _devtools_port(proc, log)
                async with aiohttp.ClientSession() as http:
                    ws_url = await _page_socket(http, port, url)
                    async with http.ws_connect(ws_url, max_msg_size=64 << 20) as ws:
                        page = cls(ws)
                        await page.call("Runtime.enable")
                        yield page
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    async def call(self, method: str, **params: Any) -> dict:
        """One DevTools command and its result (the events in between are dropped)."""
        call_id = next(self._ids)
        await self.ws.send_json({"id": call_id, "method": method, "params": params})
        while True:
            msg = await self.ws.receive_json(timeout=30)
            if msg.get("id") == call_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    async def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (JSON-able)."""
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def screenshot(self, path: Path) -> None:
        shot = await self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.write_bytes(base64.b64decode(shot["data"]))


async def _devtools_port(proc: subprocess.Popen, log: Path) -> int:
    """The port Chromium says, on stderr, its DevTools listen on."""
    async with asyncio.timeout(START_TIMEOUT_S):
        while True:
            match = re.search(r"DevTools listening on ws://[\d.]+:(\d+)/", log.read_text())
            if match:
                return int(match.group(1))
            if proc.poll() is not None:
                raise RuntimeError(f"chromium exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
            await asyncio.sleep(0.1)


async def _page_socket(http: aiohttp.ClientSession, port: int, url: str) -> str:
    """The websocket of the tab showing ``url``, once Chromium lists it."""
    for _ in range(100):
        async with http.get(f"http://127.0.0.1:{port}/json/list") as resp:
            targets = await resp.json()
        pages = [t for t in targets if t.get("type") == "page" and t.get("url", "").startswith(url)]
        if pages:
            return pages[0]["webSocketDebuggerUrl"]
        await asyncio.sleep(0.1)
    raise RuntimeError(f"chromium shows no tab at {url}: {targets}")
