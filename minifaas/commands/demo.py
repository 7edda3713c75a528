"""``minifaas demo``: the default clusters, a concurrent mix of short and long prompts, live.

Starts the gateway on a free port, streams the mix through the OpenAI-compatible HTTP API while showing each
request's progress and the link's use, prints a summary of what each route moved, and shuts everything down.
With ``--dashboard``, clients send a steady mix instead while the link's rate dips every ``--dip-every`` seconds,
so the short-term scheduler can be watched moving t, until Ctrl-C or ``--duration``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import itertools
import json
import os
import random
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

import aiohttp
from rich.console import Console
from rich.live import Live
from rich.table import Table

from minifaas.commands import arguments
from minifaas.commands.arguments import add_model_arguments
from minifaas.commands.main import exit_at_once, stdout_console, user_input
from minifaas.commands.serve import add_arguments as add_serve_arguments
from minifaas.commands.serve import checked_config, kernels_line, log_to, running_server, start_forks
from minifaas.config import LOG_LEVELS, InterClusterLinkConfig, ServeConfig
from minifaas.emulator.pacer import parse_rate
from minifaas.gateway.gateway import Gateway
from minifaas.gateway.inter_cluster_link import NAME, InterClusterLink
from minifaas.launch.startup import StartupView
from minifaas.model.loader import ModelSpec, load_config_dict, load_tokenizer
from minifaas.process_cpu import tree_cpu_s
from minifaas.proctitle import set_title

VERSE = "Shall I compare thee to a summer's day? Thou art more lovely and more temperate. "
TEMPERATURE = 0.8
SNIPPET_CHARS = 40
CLIENTS = 4  # of the steady mix
DIP_FACTOR = 20  # the link's rate during a dip: a twentieth


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--short", type=int, default=8, help="short prompts (stay local)")
    parser.add_argument("--long", type=int, default=4, help="long prompts (go to PrfaaS)")
    parser.add_argument("--long-tokens", type=int, default=2000, help="length of the first long prompt in tokens")
    parser.add_argument("--max-tokens", type=int, default=24, help="tokens generated per prompt")
    parser.add_argument("--threshold", type=int, default=512, help="prompts longer than this go to PrfaaS")
    parser.add_argument("--link-rate", type=arguments.rate, default="50mbit", help="the inter-cluster link's rate")
    parser.add_argument(
        "--dashboard",
        action="store_true",
        help="instead of one mix, send a steady one and dip the link now and then until Ctrl-C, "
        "to watch on the dashboard",
    )
    parser.add_argument(
        "--duration",
        type=arguments.positive,
        help="with --dashboard: stop after this many seconds (default: at Ctrl-C)",
    )
    parser.add_argument(
        "--dip-every", type=arguments.positive, default=30.0, help="with --dashboard: seconds between the link's dips"
    )
    parser.add_argument(
        "--dip-seconds",
        type=arguments.positive,
        default=10.0,
        help="with --dashboard: how long each dip lasts, in seconds",
    )
    parser.add_argument(
        "--log-level",
        type=str.upper,
        default="WARNING",
        choices=LOG_LEVELS,
        help="the least severe log lines shown, the gateway's and its workers'",
    )
    arguments.add_device_arguments(parser)


@dataclass(slots=True)
class DemoRequest:
    name: str
    prompt_chars: int
    status: str = "queued"
    route: str = "-"
    ttft: float | None = None
    tokens: int = 0
    started: float = 0.0
    ended: float | None = None
    kv_bytes: int = 0  # the state's size
    kv_wire_bytes: int = 0  # what it put on the wire, after its codec
    kv_codec: str = "-"
    fallback: str | None = None
    text: str = ""


Send = Callable[[DemoRequest, int], Awaitable[None]]  # one request's row sent, with its sampling seed


def run(args: argparse.Namespace) -> int:
    config = _config(args)
    forked_here = start_forks(config)
    log_to(stdout_console(), args.log_level)
    code = asyncio.run(_demo(args, config))
    if forked_here:  # this process holds the workers' modules too
        exit_at_once(code)
    return code


def _config(args: argparse.Namespace) -> ServeConfig:
    """``serve``'s configuration for the demo, checked as ``serve`` checks it (model, devices), with the demo's
    link and log level."""
    with user_input():
        if min(args.short, args.long) < 0 or not args.short + args.long or min(args.long_tokens, args.max_tokens) < 1:
            raise ValueError("need --short, --long >= 0 (not both 0) and --long-tokens, --max-tokens >= 1")
        if not 0 < args.dip_seconds < args.dip_every or (args.duration is not None and args.duration <= 0):
            raise ValueError("need 0 < --dip-seconds < --dip-every, and --duration > 0")
        if args.duration is not None and not args.dashboard:  # one mix ends when its prompts are done
            raise ValueError("--duration goes with --dashboard: a single mix runs until its prompts are answered")
    config = checked_config(served_args(args))
    with user_input():
        _fits_the_context(args, config)
    return replace(
        config, worker_log_level=args.log_level, link=InterClusterLinkConfig(rate=args.link_rate, delay_ms=5.0)
    )


def _fits_the_context(args: argparse.Namespace, config: ServeConfig) -> None:
    """The longest prompt the demo sends, and --max-tokens after it, within the model's context: past it every
    such request would be refused once all had started."""
    spec = ModelSpec.resolve(config.model, config.seed)
    context = int(load_config_dict(spec).get("max_position_embeddings", 32768))
    longest = 3 * args.long_tokens if args.dashboard else max(r.prompt_chars for r in _mix(args))
    tokens = len(load_tokenizer(spec, config.trust_remote_code).encode(_prompt(longest)))
    if tokens + args.max_tokens > context:
        raise ValueError(f"the longest prompt ({tokens} tokens) and --max-tokens {args.max_tokens}: more than "
                         f"{spec.name}'s context of {context} tokens")  # fmt: skip


def served_args(args: argparse.Namespace) -> argparse.Namespace:
    """``serve``'s flags for the demo's: its model, threshold and devices, any free port, every other flag unset
    (``ServeConfig``'s defaults), so the clusters are placed on the devices as ``serve`` places them."""
    flags = argparse.ArgumentParser()
    add_serve_arguments(flags)
    served = flags.parse_args(["--port", "0"])
    for name in ("model", "dtype", "trust_remote_code", "threshold", *arguments.DEVICE_FLAGS):
        setattr(served, name, getattr(args, name))
    return served


async def _demo(args: argparse.Namespace, config: ServeConfig) -> int:
    console = stdout_console()
    console.print(f"[bold]starting[/] PrfaaS prefill + PD-P + PD-D workers and a {args.link_rate} link emulator ...")
    t0 = time.perf_counter()
    async with contextlib.AsyncExitStack() as stack:
        with StartupView(console, console.print) as view:
            gateway, port = await stack.enter_async_context(running_server(config, view))
        set_title("demo", f":{port}")
        address = f"http://127.0.0.1:{port}"
        ready = f"ready in {time.perf_counter() - t0:.1f} s on port {port}, {kernels_line(gateway)}"
        http = await stack.enter_async_context(aiohttp.ClientSession())
        send = functools.partial(_one, http, f"{address}/v1/completions", gateway.model_name, args.max_tokens)
        cpu, wall = tree_cpu_s(os.getpid()), time.perf_counter()
        if args.dashboard:
            console.print(f"{ready}; the dashboard: {address}/dashboard")
            console.print(
                f"sending a steady mix of short and long prompts (threshold {args.threshold} tokens); the link dips "
                f"to a {DIP_FACTOR}th of {args.link_rate} for {args.dip_seconds:g} s every {args.dip_every:g} s; "
                + ("Ctrl-C stops" if args.duration is None else f"stopping after {args.duration:g} s or at Ctrl-C")
            )
            rows = await _steady_mix(gateway, args, send)
        else:
            console.print(
                f"{ready}; sending {args.short} short and {args.long} long prompts at once (threshold "
                f"{args.threshold} tokens); the dashboard: {address}/dashboard"
            )
            rows = await _one_mix(args, gateway, send, console)
        cpu, wall = tree_cpu_s(os.getpid()) - cpu, time.perf_counter() - wall
        console.print()  # the summary's title apart from the table above
        console.print(_summary(rows))
        tokens = sum(r.tokens for r in rows)
        console.print(
            f"throughput: {tokens} tokens in {wall:.2f} s, {tokens / wall:.1f} tokens/s; "
            f"{tokens / max(cpu, 1e-9):.1f} per CPU-second ({cpu:.2f} CPU-s: the gateway, every worker and emulator)"
        )
    console.print(f"[bold]stopped[/]: all processes shut down; total {time.perf_counter() - t0:.1f} s")
    if args.dashboard:  # requests still running at the end were cut short by it
        return 1 if any(r.status.startswith("HTTP") for r in rows) else 0
    return 0 if all(r.status == "done" for r in rows) else 1


async def _one_mix(args: argparse.Namespace, gateway: Gateway, send: Send, console: Console) -> list[DemoRequest]:
    """The short and long prompts at once, with a live table of their progress."""
    rows = _mix(args)
    # into a file or a pipe a live table shows nothing until it ends, and ends without its last newline
    live = Live(_table(rows, gateway.link), console=console) if console.is_terminal else None
    with live or contextlib.nullcontext():
        jobs = [asyncio.create_task(send(row, seed)) for seed, row in enumerate(rows)]
        while not all(j.done() for j in jobs):
            if live is not None:
                live.update(_table(rows, gateway.link))
            await asyncio.sleep(0.25)
        if live is not None:
            live.update(_table(rows, gateway.link))
        for j in jobs:
            j.result()
    if live is None:
        console.print(_table(rows, gateway.link))
    return rows


async def _steady_mix(gateway: Gateway, args: argparse.Namespace, send: Send) -> list[DemoRequest]:
    """Send prompts and dip the link until SIGINT or ``args.duration``; returns every request's row."""
    rows: list[DemoRequest] = []
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, stop.set)
    try:
        async with asyncio.TaskGroup() as tasks:
            clients = [tasks.create_task(_client(i, args, send, rows)) for i in range(CLIENTS)]
            dips = tasks.create_task(_dips(gateway, args))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(args.duration):
                    await stop.wait()
            for task in [*clients, dips]:
                task.cancel()
    finally:
        loop.remove_signal_handler(signal.SIGINT)
    return rows


async def _client(i: int, args: argparse.Namespace, send: Send, rows: list[DemoRequest]) -> None:
    draw = random.Random(i)
    for n in itertools.count():
        long = (n + i) % 2 == 1
        if long:  # past the threshold, up to three times --long-tokens
            chars = draw.randint(args.threshold, max(args.threshold, 3 * args.long_tokens))
        else:  # up to half the threshold, and at least a character
            top = max(1, args.threshold // 2)
            chars = draw.randint(min(40, top), top)
        row = DemoRequest(f"{'long' if long else 'short'}-{i}.{n}", chars)
        rows.append(row)
        await send(row, CLIENTS * n + i)


async def _dips(gateway: Gateway, args: argparse.Namespace) -> None:
    """The link at a ``DIP_FACTOR``th of its rate for ``dip_seconds`` in every ``dip_every``; back at the end."""
    rate = parse_rate(args.link_rate)
    low = (rate or 1e9) / DIP_FACTOR
    while True:
        await asyncio.sleep(args.dip_every - args.dip_seconds)
        await gateway.link.control.set_rate(low)
        await asyncio.sleep(args.dip_seconds)
        await gateway.link.control.set_rate(rate)


def _mix(args: argparse.Namespace) -> list[DemoRequest]:
    """The one mix: short prompts of 60, 80, ... characters, long ones of --long-tokens, then 100 more each."""
    short = [DemoRequest(f"short-{i}", 60 + 20 * i) for i in range(args.short)]
    return short + [DemoRequest(f"long-{i}", args.long_tokens + 100 * i) for i in range(args.long)]


def _prompt(chars: int) -> str:
    """Verse of about ``chars`` characters, cut after a whole word, so the answer starts with one."""
    return (VERSE * (chars // len(VERSE) + 1))[:chars].rsplit(" ", 1)[0] + " "


async def _one(http: aiohttp.ClientSession, url: str, model: str, max_tokens: int, row: DemoRequest, seed: int) -> None:
    prompt = _prompt(row.prompt_chars)
    row.prompt_chars = len(prompt)
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "temperature": TEMPERATURE,
        "seed": seed,
        "stream_options": {"include_usage": True},
    }
    row.started = time.perf_counter()
    row.status = "prefill"
    async with http.post(url, json=body) as resp:
        if resp.status != 200:
            row.status = f"HTTP {resp.status}"
            return
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                row.text += chunk["choices"][0].get("text") or ""
                row.tokens += 1
                row.ttft = row.ttft or time.perf_counter() - row.started
                row.status = "decoding"
            if chunk.get("usage"):
                row.tokens = chunk["usage"]["completion_tokens"]
            info = chunk.get("minifaas")
            if info:
                row.route, row.fallback, row.kv_codec = info["route"], info["fallback"], info["kv_codec"] or "-"
                row.kv_bytes, row.kv_wire_bytes = info["kv_bytes"], info["kv_wire_bytes"]
    row.ended = time.perf_counter()
    row.status = "done"


def _table(rows: list[DemoRequest], link: InterClusterLink) -> Table:
    util = f"{NAME}: {100 * (link.stats.get('utilisation') or 0):.0f}%" if link.stats else "-"
    table = Table(title=f"requests (link utilisation {util})")
    for col in ("request", "prompt chars", "status", "route", "TTFT s", "tokens", "tokens/s"):
        table.add_column(col, justify="left" if col in ("request", "status", "route") else "right")
    table.add_column("text", no_wrap=True, max_width=SNIPPET_CHARS, overflow="ellipsis")
    for r in rows:
        rate = r.tokens / ((r.ended or time.perf_counter()) - r.started) if r.tokens else 0.0
        ttft = f"{r.ttft:.2f}" if r.ttft else "-"
        snippet = r.text.replace("\n", " / ")[:SNIPPET_CHARS]
        table.add_row(r.name, str(r.prompt_chars), r.status, r.route, ttft, str(r.tokens), f"{rate:.1f}", snippet)
    return table


def _summary(rows: list[DemoRequest]) -> Table:
    table = Table(title="summary by route")  # KV state: its size; on the wire: what it took after its codec
    columns = ("route", "requests", "mean TTFT s", "mean e2e s", "KV state", "on the wire", "codec", "fallbacks")
    for col in columns:
        table.add_column(col, justify="left" if col in ("route", "codec") else "right")
    for route in sorted({r.route for r in rows}):
        group = [r for r in rows if r.route == route and r.ended]
        if not group:
            continue
        ttft = sum(r.ttft or 0 for r in group) / len(group)
        e2e = sum((r.ended or 0) - r.started for r in group) / len(group)
        state, wire = sum(r.kv_bytes for r in group), sum(r.kv_wire_bytes for r in group)
        sizes = (f"{state / 1e6:.2f} MB", f"{wire / 1e6:.2f} MB")
        codecs = ", ".join(sorted({r.kv_codec for r in group}))
        fallbacks = str(sum(1 for r in group if r.fallback))
        table.add_row(route, str(len(group)), f"{ttft:.2f}", f"{e2e:.2f}", *sizes, codecs, fallbacks)
    return table
