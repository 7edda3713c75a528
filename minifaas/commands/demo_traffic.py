"""``minifaas demo --dashboard``: a steady mix of prompts and a link that dips now and then, until stopped.

Clients send short and long prompts in turn while the link emulator's rate drops every ``--dip-every`` seconds,
so the short-term scheduler can be watched raising and lowering t. Ctrl-C or ``--duration`` ends the run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import signal
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from minifaas.emulator.pacer import parse_rate

if TYPE_CHECKING:
    from minifaas.gateway.gateway import Gateway

Row = TypeVar("Row")  # the demo's row of one request: this module makes and sends them, the demo draws them

CLIENTS = 4
DIP_FACTOR = 20  # the link's rate during a dip: a twentieth


async def steady_mix(
    gateway: Gateway,
    args: argparse.Namespace,
    new_row: Callable[[str, int], Row],
    send: Callable[[Row, int], Awaitable[None]],
) -> list[Row]:
    """Send prompts and dip the link until SIGINT or ``args.duration``; returns every request's row."""
    rows: list[Row] = []
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, stop.set)
    try:
        async with asyncio.TaskGroup() as tasks:
            clients = [tasks.create_task(_client(i, args, new_row, send, rows)) for i in range(CLIENTS)]
            dips = tasks.create_task(_dips(gateway, args))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(args.duration):
                    await stop.wait()
            for task in [*clients, dips]:
                task.cancel()
    finally:
        loop.remove_signal_handler(signal.SIGINT)
    return rows


async def _client(
    i: int,
    args: argparse.Namespace,
    new_row: Callable[[str, int], Row],
    send: Callable[[Row, int], Awaitable[None]],
    rows: list[Row],
) -> None:
    draw = random.Random(i)
    for n in range(1 << 62):
        long = (n + i) % 2 == 1
        if long:  # past the threshold, up to three times --long-tokens
            chars = draw.randint(args.threshold, max(args.threshold, 3 * args.long_tokens))
        else:  # up to half the threshold, and at least a character
            top = max(1, args.threshold // 2)
            chars = draw.randint(min(40, top), top)
        row = new_row(f"{'long' if long else 'short'}-{i}.{n}", chars)
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
