"""Long prompts at once across one slow link: where each went, whether it fell back, and how long it took.

    python benchmarks/bench_long_burst.py [--rate 5mbit] [--prompts 12] [--chars 4000] [--backlog 0 30] [--json]

Starts ``minifaas serve --link-rate RATE --max-link-backlog B`` for each B in turn (0: no bound), posts every
prompt at the same moment (each over the routing threshold, each with its own first line so no prefix is
shared) and waits for each answer: its route and the router's reason, its fallback reason if its PrfaaS prefill
was redone on PD-P, and the seconds from the post to the answer's end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import aiohttp
from bench_scale import serving

LINE = "ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet is the sun. "


async def burst(url: str, prompts: int, chars: int) -> list[dict]:
    async def one(session: aiohttp.ClientSession, model: str, i: int) -> dict:
        body = {"model": model, "prompt": (f"{i} " + LINE * (chars // len(LINE) + 1))[:chars], "max_tokens": 8,
                "temperature": 0}  # fmt: skip
        started = time.perf_counter()
        async with session.post(url + "/v1/completions", json=body) as r:
            answer = await r.json()
        extra = answer.get("minifaas", {})
        return {"status": r.status, "route": extra.get("route"), "reason": extra.get("route_reason"),
                "fallback": extra.get("fallback"), "seconds": round(time.perf_counter() - started, 1)}  # fmt: skip

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        async with session.get(url + "/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
        return await asyncio.gather(*(one(session, model, i) for i in range(prompts)))


def served(rate: str, backlog: float, prompts: int, chars: int) -> list[dict]:
    """One ``minifaas serve --link-rate RATE --max-link-backlog BACKLOG``, one burst through it."""
    with serving(["--link-rate", rate, "--max-link-backlog", str(backlog)]) as server:
        return asyncio.run(burst(server.url, prompts, chars))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", default="5mbit", help="the link's rate (default: 5mbit)")
    p.add_argument("--prompts", type=int, default=12, help="long prompts posted at once (default: 12)")
    p.add_argument("--chars", type=int, default=4000, help="characters per prompt (default: 4000)")
    p.add_argument("--backlog", type=float, nargs="+", default=[0.0, 30.0], metavar="SECONDS",
                   help="serve's --max-link-backlog, a server and a burst each, in turn (default: 0 30)")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="a smoke run: two prompts on a 50 Mbit/s link, the last bound")
    p.add_argument("--json", action="store_true", help="end with one JSON line of every figure")
    a = p.parse_args()
    if a.quick:
        a.rate, a.prompts, a.chars, a.backlog = "50mbit", 2, 2000, a.backlog[-1:]
    runs = []
    for backlog in a.backlog:
        rows = served(a.rate, backlog, a.prompts, a.chars)
        print(f"{a.prompts} prompts of {a.chars} characters at once, link {a.rate}, --max-link-backlog {backlog:g}")
        for i, row in enumerate(rows):
            print(f"  {i:3d}  {row['status']}  {row['route'] or '-':7s} {row['reason'] or '-':20s} "
                  f"{row['fallback'] or '':24s} {row['seconds']:7.1f} s")  # fmt: skip
        fell_back = [r for r in rows if r["fallback"]]
        runs.append({"max_link_backlog_s": backlog, "fell_back": len(fell_back),
                     "max_s": max(r["seconds"] for r in rows), "rows": rows})  # fmt: skip
        print(f"fell back: {len(fell_back)} of {a.prompts}; the last answer after {runs[-1]['max_s']} s")
    if a.json:
        print(json.dumps({"bench": "long_burst", "rate": a.rate, "prompts": a.prompts, "chars": a.chars, "runs": runs}))


if __name__ == "__main__":
    main()
