"""How the link emulator's relay holds a block of a flow's bytes between reading and sending it.

``CopiedBlock`` is the reference: a buffer every byte is copied into and out of. ``SplicedBlock`` is a pipe that
splice(2) moves the socket's pages through, sparing the relay those two copies, most of its work.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import socket
from typing import Protocol

_SPLICE_FLAGS = getattr(os, "SPLICE_F_MOVE", 0) | getattr(os, "SPLICE_F_NONBLOCK", 0)


class Block(Protocol):
    filled: int

    async def fill(self, src: socket.socket, size: int) -> int:
        """Read up to ``size`` bytes (at least one, unless the stream ended: 0)."""
        ...

    async def drain(self, dst: socket.socket) -> None:
        """Send every byte filled."""
        ...

    def flip_byte(self, at: int) -> None: ...

    def close(self) -> None: ...


def splice_available() -> bool:
    return hasattr(os, "splice") and hasattr(fcntl, "F_SETPIPE_SZ")


class CopiedBlock:
    def __init__(self, size: int) -> None:
        self._buf = bytearray(size)
        self.filled = 0

    async def fill(self, src: socket.socket, size: int) -> int:
        loop = asyncio.get_running_loop()
        self.filled = await loop.sock_recv_into(src, memoryview(self._buf)[: min(size, len(self._buf))])
        return self.filled

    async def drain(self, dst: socket.socket) -> None:
        await asyncio.get_running_loop().sock_sendall(dst, memoryview(self._buf)[: self.filled])

    def flip_byte(self, at: int) -> None:
        self._buf[at] ^= 0xFF

    def close(self) -> None:
        pass


class SplicedBlock:
    def __init__(self, size: int) -> None:
        self._r, self._w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        with contextlib.suppress(OSError):  # beyond /proc/sys/fs/pipe-max-size without privilege: keep the default
            fcntl.fcntl(self._w, fcntl.F_SETPIPE_SZ, size)
        self.capacity = fcntl.fcntl(self._w, fcntl.F_GETPIPE_SZ)
        self.filled = 0

    async def fill(self, src: socket.socket, size: int) -> int:
        while True:
            try:
                self.filled = os.splice(src.fileno(), self._w, min(size, self.capacity), flags=_SPLICE_FLAGS)
                return self.filled
            except (BlockingIOError, InterruptedError):
                await _ready(src, write=False)

    async def drain(self, dst: socket.socket) -> None:
        left = self.filled
        while left:
            try:
                left -= os.splice(self._r, dst.fileno(), left, flags=_SPLICE_FLAGS)
            except (BlockingIOError, InterruptedError):
                await _ready(dst, write=True)

    def flip_byte(self, at: int) -> None:
        data = bytearray(os.read(self._r, self.filled))  # the pipe holds exactly the block: it comes back whole
        data[at] ^= 0xFF
        os.write(self._w, data)

    def close(self) -> None:
        for fd in (self._r, self._w):
            with contextlib.suppress(OSError):
                os.close(fd)


async def _ready(sock: socket.socket, write: bool) -> None:
    loop = asyncio.get_running_loop()
    fd = sock.fileno()
    if fd < 0:
        raise ConnectionResetError("socket closed")
    ready = loop.create_future()
    add, remove = (loop.add_writer, loop.remove_writer) if write else (loop.add_reader, loop.remove_reader)
    add(fd, lambda: ready.done() or ready.set_result(None))
    try:
        await ready
    finally:
        remove(fd)
