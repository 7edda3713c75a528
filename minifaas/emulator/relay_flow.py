"""One connection through the link emulator's relay: both sockets and what the link does to each direction.

Each direction has its own rate cap, window and delay line; the aggregate pacer every flow shares is the relay's.
"""

from __future__ import annotations

import random
import socket

from minifaas.emulator.pacer import DelayLine, FlowWindow, Pacer
from minifaas.emulator.relay_blocks import Block

UP, DOWN = "up", "down"  # up: towards the target (KV direction); down: the replies


class Flow:
    def __init__(
        self, flow_id: int, client: socket.socket, flow_rate: float | None, window: int | None, rng: random.Random
    ):
        self.id = flow_id
        self.client = client
        self.upstream: socket.socket | None = None
        self.pacers = {UP: Pacer(flow_rate), DOWN: Pacer(flow_rate)}
        self.windows = {UP: FlowWindow(window), DOWN: FlowWindow(window)}
        self.delays = {UP: DelayLine(rng), DOWN: DelayLine(rng)}
        self.blocks: list[Block] = []  # every block this flow made, closed with it
        self.bounded: set[str] = set()  # directions whose receive buffer the relay has sized (relay._bound_buffers)

    @property
    def sockets(self) -> tuple[socket.socket, socket.socket | None]:
        """The flow's two ends: the client's (read going up) and the target's (read coming down)."""
        return self.client, self.upstream

    def close(self, reset: bool) -> None:
        """Close both sides; ``reset`` sends RSTs (a cut) instead of an orderly close."""
        for block in self.blocks:
            block.close()
        self.blocks.clear()
        for sock in self.sockets:
            if sock is not None and sock.fileno() >= 0:
                if reset:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")
                sock.close()
