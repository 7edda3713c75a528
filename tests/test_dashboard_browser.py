"""/dashboard in a real browser: headless Chromium opens the page of a `minifaas serve`, requests go through the
API, and the page's own JavaScript, polling /dashboard/state, must show them and move its figures.

Only the live updates can make the test pass: the page is loaded before any request is sent, so each row
and figure read afterwards was drawn by a later poll. The page's screenshot is saved next to the test's
other files (``MINIFAAS_DASHBOARD_PNG`` names another path)."""

from __future__ import annotations

import asyncio
import json
import os
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from headless_chromium import Chromium, chromium_binary
from serve_child import serving

pytestmark = [
    pytest.mark.slow,  # a `minifaas serve` process and a browser
    pytest.mark.skipif(chromium_binary() is None, reason="no chromium (apt-get install -y chromium)"),
]

LONG = "Whether 'tis nobler in the mind to suffer the slings and arrows of outrageous fortune. " * 12
SHORT = "To be, or not to be: that is the question. "
SEEN_WITHIN_S = 15.0

# what the page shows, read from its DOM
READ_PAGE = """({
  updates: document.getElementById("polls").textContent,
  threshold: document.getElementById("threshold").textContent,
  requests: [...document.querySelectorAll("#requests tr")].map(r => r.dataset.requestId),
  routes: [...document.querySelectorAll("#requests tr td:nth-child(3)")].map(td => td.textContent),
  ttfts: [...document.querySelectorAll("#requests tr td:nth-child(8)")].map(td => td.textContent),
  codecs: document.getElementById("codecs").textContent,
  hitRate: document.getElementById("hit-rate").textContent,
  linkChart: document.querySelector("#link-chart path:nth-of-type(2)")?.getAttribute("d") ?? "",
  workers: document.getElementById("pd-workers").textContent + document.getElementById("prfaas-workers").textContent,
  split: document.getElementById("split").textContent,
})"""


def complete(base: str, prompt: str) -> str:
    body = json.dumps({"model": "kimi-linear-tiny", "prompt": prompt, "max_tokens": 4}).encode()
    req = urllib.request.Request(f"{base}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())["id"]


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with serving("--model", "kimi-linear-tiny", "--threshold", "300", "--link-rate", "50mbit") as (base, _):
        yield base


async def shown(page: Chromium, ids: list[str]) -> dict:
    """The page once its table holds every request in ``ids``."""
    deadline = time.monotonic() + SEEN_WITHIN_S
    while True:
        now = await page.evaluate(READ_PAGE)
        if set(ids) <= set(now["requests"]):
            return now
        assert time.monotonic() < deadline, f"the page never showed {ids}: {now}"
        await asyncio.sleep(0.25)


def test_the_page_shows_requests_as_they_end_and_its_figures_move(server: str, tmp_path: Path) -> None:
    async def run() -> None:
        async with Chromium.open(f"{server}/dashboard") as page:
            while await page.evaluate('document.getElementById("polls")?.textContent ?? "0 updates"') == "0 updates":
                await asyncio.sleep(0.1)  # loading, then its first poll
            before = await page.evaluate(READ_PAGE)
            assert before["requests"] == [] and before["threshold"] == "300" and before["split"] == "1P:1D"
            assert "prfaas-p0" in before["workers"] and "pd-d0" in before["workers"] and "up" in before["workers"]

            first = [await asyncio.to_thread(complete, server, LONG), await asyncio.to_thread(complete, server, SHORT)]
            middle = await shown(page, first)
            assert middle["routes"][middle["requests"].index(first[0])] == "prfaas"
            assert middle["routes"][middle["requests"].index(first[1])] == "local"
            assert all(float(t) > 0 for t in middle["ttfts"])
            assert "MB" in middle["codecs"]  # the long prompt's state crossed the link

            second = await asyncio.to_thread(complete, server, LONG)  # the same prompt: a prefix cache hit
            after = await shown(page, [second])
            assert after["requests"][0] == second  # newest first
            assert int(after["updates"].split()[0]) > int(middle["updates"].split()[0]) > 0
            assert after["hitRate"] != before["hitRate"] and after["hitRate"] != "0%"
            assert after["linkChart"] != before["linkChart"]  # new samples drawn
            await page.screenshot(Path(os.environ.get("MINIFAAS_DASHBOARD_PNG", tmp_path / "dashboard.png")))

    started = time.monotonic()
    asyncio.run(run())
    print(f"browser test: {time.monotonic() - started:.1f} s")
