"""/dashboard and /dashboard/state on a real `minifaas serve`: the link, t, the clusters and the last requests."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from serve_child import serving

pytestmark = pytest.mark.slow  # a `minifaas serve` process

SHORT = "To be, or not to be: that is the question. "
LONG = "Whether 'tis nobler in the mind to suffer the slings and arrows of outrageous fortune. " * 12


def get(url: str) -> tuple[int, str, bytes]:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.status, r.headers["Content-Type"], r.read()


def complete(base: str, prompt: str, max_tokens: int = 4) -> dict:
    # ignore_eos: a random-weight model may sample its end-of-sequence token; every request here ends by length
    body = json.dumps(
        {"model": "kimi-linear-tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    ).encode()
    req = urllib.request.Request(f"{base}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def state(base: str) -> dict:
    return json.loads(get(f"{base}/dashboard/state")[2])


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with serving("--model", "kimi-linear-tiny", "--threshold", "300", "--link-rate", "50mbit") as (base, _):
        yield base


def test_state_shows_the_requests_the_link_and_the_clusters(server: str) -> None:
    before = state(server)
    long_answer = complete(server, LONG)
    complete(server, SHORT)
    complete(server, LONG)  # the same prompt again: its prefix is cached
    time.sleep(2.5)  # two samples after the transfers
    after = state(server)

    recent = after["requests"][:3]  # newest first
    assert [r["prompt_tokens"] for r in recent] == [len(LONG), len(SHORT), len(LONG)]
    assert recent[2]["request_id"] == long_answer["id"] and recent[2]["route"] == "prfaas"
    assert recent[1]["route"] == "local" and recent[1]["prefill_worker"].startswith("pd-p")
    for r in recent:
        assert r["outcome"] == "length" and r["decode_worker"].startswith("pd-d")
        assert 0 < r["ttft_s"] <= r["e2e_s"]
        assert r["fallback"] is None and r["migrations"] == 0
    assert recent[0]["cached_tokens"] > 0

    link = after["link"]
    assert link["up"] and link["emulated"] and link["name"] == "prfaas->pd"
    assert len(link["samples"]) > len(before["link"]["samples"])
    assert {s["ceiling_bps"] for s in link["samples"][-2:]} == {50e6}
    assert sum(link["wire_bytes_by_codec"].values()) > 0  # the long prompts' state crossed it
    assert any(s["egress_bps"] > 0 for s in link["samples"])
    assert all(s["threshold"] == 300 and s["rule"] in ("scarce", "abundant") for s in link["samples"])

    pd = after["clusters"]["pd"]
    assert pd["split"] == {"prefill": 1, "decode": 1}
    names = {w["name"]: w for c in after["clusters"].values() for w in c["workers"]}
    assert set(names) == {"prfaas-p0", "pd-p0", "pd-d0"}
    assert all(w["state"] == "up" and w["restarts"] == 0 for w in names.values())

    cache = after["prefix_cache"]
    assert 0 < cache["cached_tokens"] < cache["prompt_tokens"]
    assert cache["hit_rate"] == pytest.approx(cache["cached_tokens"] / cache["prompt_tokens"])
    scheduler = after["scheduler"]
    assert scheduler["threshold"] == 300 and not scheduler["fixed"]
    # the idle link at the start: the scheduler holds t at its base and moves cache for long prompts
    first = scheduler["changes"][0]
    assert (first["rule_from"], first["rule"], first["from"], first["to"]) == ("scarce", "abundant", 300, 300)
    assert (first["action"], first["reason"]) == ("hold", "at_base") and first["at"] <= after["now"]


def test_since_brings_only_the_newer_samples(server: str) -> None:
    whole = state(server)["link"]["samples"]
    time.sleep(2.2)
    newer = json.loads(get(f"{server}/dashboard/state?since={whole[-1]['at']}")[2])["link"]["samples"]
    assert 1 <= len(newer) <= 3 and all(s["at"] > whole[-1]["at"] for s in newer)
    for bad in ("yesterday", "nan"):
        with pytest.raises(urllib.error.HTTPError) as refused:
            get(f"{server}/dashboard/state?since={bad}")
        assert refused.value.code == 400, bad


def test_no_per_request_series_in_metrics(server: str) -> None:
    complete(server, SHORT)
    metrics = get(f"{server}/metrics")[2].decode()
    ids = [r["request_id"] for r in state(server)["requests"]]
    assert ids and not any(i in metrics for i in ids)


def test_the_page_is_served_whole(server: str) -> None:
    status, kind, page = get(f"{server}/dashboard")
    assert status == 200 and kind.startswith("text/html")
    text = page.decode()
    assert "/dashboard/state" in text and "<script" in text
    assert "http://" not in text and "https://" not in text  # nothing fetched from elsewhere


def test_every_metric_the_grafana_dashboard_queries_is_in_metrics(server: str) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    complete(server, LONG)  # every labelled family has a series
    series = set()
    for family in text_string_to_metric_families(get(f"{server}/metrics")[2].decode()):
        series |= {sample.name for sample in family.samples}
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}.get(family.type, ("",))
        series |= {family.name + suffix for suffix in suffixes}  # a family without a labelled series yet
    board = json.loads((Path(__file__).parent.parent / "docs" / "grafana_dashboard.json").read_text())
    graphs = [p for p in board["panels"] if p["type"] != "row"]
    queried = {name for p in graphs for t in p["targets"] for name in re.findall(r"minifaas:\w+", t["expr"])}
    assert len(queried) >= 25 and sorted(queried - series) == []
    titles = [p["title"] for p in board["panels"] if p["type"] == "row"]
    assert [t.split(".")[0] for t in titles] == ["1", "2", "3", "4", "5", "6"]  # in request-flow order
    assert any("link" in t.lower() for t in titles) and all(p["targets"] for p in graphs)
