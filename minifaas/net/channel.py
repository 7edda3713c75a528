"""One TCP connection of the KV transport, with exact sends and receives and stall deadlines.

Plain connections send and receive tensor memory without copies; TLS ones go through asyncio streams. A
deadline bounds progress, not size: ``StallError`` only when no byte moves for ``timeout`` seconds.
"""

from __future__ import annotations

import asyncio
import fcntl
import socket
import ssl as ssl_module
import struct
import termios
from collections.abc import Callable, Sequence

from minifaas.net.errors import ConnectionLostError, StallError, TruncatedError

Buffer = bytes | bytearray | memoryview
Digest = Callable[[memoryview], None]
WAKE_BYTES = 256 << 10  # a receive waits for up to this much before it wakes (SO_RCVLOWAT)


class Channel:
    """A connected socket, plain or TLS. Use ``open_channel`` / ``accept_channel`` to make one."""

    def __init__(self, sock: socket.socket, streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None):
        self.sock = sock
        self._streams = streams
        self._write_lock = asyncio.Lock()
        self._wake_bytes = 1  # SO_RCVLOWAT
        self.closed = False

    async def send(self, parts: Sequence[Buffer], timeout: float | None) -> None:
        async with self._write_lock:
            try:
                if self._streams is None:
                    await self._sendmsg_all([memoryview(p).cast("B") for p in parts], timeout)
                else:
                    writer = self._streams[1]
                    writer.writelines(parts)
                    async with asyncio.timeout(timeout):
                        await writer.drain()
            except TimeoutError:
                raise StallError(f"send made no progress for {timeout} s") from None
            except OSError as e:
                raise ConnectionLostError(f"send failed: {e}") from None

    async def _sendmsg_all(self, views: list[memoryview], timeout: float | None) -> None:
        views = [v for v in views if v.nbytes]
        while views:
            try:
                sent = self.sock.sendmsg(views)
            except (BlockingIOError, InterruptedError):
                sent = 0
            while sent and views:
                if sent >= views[0].nbytes:
                    sent -= views.pop(0).nbytes
                else:
                    views[0] = views[0][sent:]
                    sent = 0
            if views:
                await self._wait(timeout, write=True)

    async def _wait(self, timeout: float | None, write: bool) -> None:
        """Until the socket can be written (or read); TimeoutError only if its kernel queue did not change for
        ``timeout`` seconds (bytes leaving the send queue, or coming into the receive queue below SO_RCVLOWAT)."""
        loop = asyncio.get_running_loop()
        fd = self.sock.fileno()
        if fd < 0:
            raise ConnectionLostError("socket closed")
        add, remove = (loop.add_writer, loop.remove_writer) if write else (loop.add_reader, loop.remove_reader)
        ready = loop.create_future()
        add(fd, lambda: ready.done() or ready.set_result(None))
        try:
            queued = self.queued(write)
            while not (await asyncio.wait([ready], timeout=timeout))[0]:
                if (now := self.queued(write)) == queued:
                    raise TimeoutError
                queued = now
        finally:
            remove(fd)

    def queued(self, write: bool) -> int:
        """Bytes in the kernel's send queue (not yet acknowledged) or receive queue (not yet read)."""
        request = termios.TIOCOUTQ if write else termios.FIONREAD
        try:
            return struct.unpack("i", fcntl.ioctl(self.sock.fileno(), request, b"\0\0\0\0"))[0]
        except OSError:
            return -1  # closed meanwhile: no progress; the next read or write reports why

    async def recv_into(self, view: memoryview, timeout: float | None, digest: Digest | None = None) -> bool:
        """Fill ``view`` exactly, handing each block read to ``digest`` while it is in cache.
        False if the peer closed cleanly before the first byte."""
        got = 0
        try:
            while got < view.nbytes:
                n = await self._recv_some(view[got:], timeout)
                if n == 0:
                    if got == 0:
                        return False
                    raise TruncatedError(f"stream ended after {got} of {view.nbytes} bytes")
                if digest is not None:
                    digest(view[got : got + n])
                got += n
        except TimeoutError:
            raise StallError(f"receive made no progress for {timeout} s") from None
        except (ConnectionError, ssl_module.SSLError) as e:
            raise ConnectionLostError(f"receive failed: {e}") from None
        return True

    async def recv_exactly(self, n: int, timeout: float | None) -> bytearray:
        buf = bytearray(n)
        if n and not await self.recv_into(memoryview(buf), timeout):
            raise TruncatedError(f"stream ended before {n} expected bytes")
        return buf

    async def _recv_some(self, view: memoryview, timeout: float | None) -> int:
        if self._streams is not None:
            async with asyncio.timeout(timeout):
                data = await self._streams[0].read(view.nbytes)
            view[: len(data)] = data
            return len(data)
        while True:  # read what the kernel has without a trip through the event loop; wait only when it is empty
            try:
                return self.sock.recv_into(view)
            except (BlockingIOError, InterruptedError):
                self._wake_at(min(view.nbytes, WAKE_BYTES))
                await self._wait(timeout, write=False)

    def _wake_at(self, nbytes: int) -> None:
        """Be woken only when ``nbytes`` have arrived (or the stream ended): one big read instead of many small."""
        if nbytes != self._wake_bytes:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, max(nbytes, 1))
            self._wake_bytes = nbytes

    def usable(self) -> bool:
        """For an idle connection: the peer has sent no EOF, reset or stray bytes since its last use.
        A receiver that restarted closed every connection it had."""
        if self.closed:
            return False
        if self._streams is not None:  # asyncio owns a TLS socket and reads it: its stream knows
            reader, writer = self._streams
            return not (reader.at_eof() or writer.is_closing())
        try:
            if self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                return False
            self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return True  # nothing to read: quiet, as an idle connection should be
        except OSError:
            return False
        return False  # EOF, or bytes no idle connection should carry

    def close(self, reset: bool = False) -> None:
        """Close; ``reset`` sends an RST so the peer learns at once that the stream is broken."""
        if self.closed:
            return
        self.closed = True
        if reset:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")
        if self._streams is None:
            self.sock.close()
        else:
            self._streams[1].close()


async def open_channel(
    host: str, port: int, timeout: float, ssl: ssl_module.SSLContext | None = None, unsent_limit: int | None = None
) -> Channel:
    """Connect. ``unsent_limit`` (TCP_NOTSENT_LOWAT) keeps the kernel from queueing more than that many
    unsent bytes, so a slow connection stops taking chunks that a faster one could carry."""
    try:
        async with asyncio.timeout(timeout):
            if ssl is not None:
                reader, writer = await asyncio.open_connection(host, port, ssl=ssl)
                channel = Channel(writer.get_extra_info("socket"), (reader, writer))  # asyncio's TransportSocket
            else:
                infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
                family, _, _, _, address = infos[0]
                sock = socket.socket(family, socket.SOCK_STREAM)
                sock.setblocking(False)
                try:
                    await asyncio.get_running_loop().sock_connect(sock, address)
                except BaseException:
                    sock.close()
                    raise
                channel = Channel(sock)
            channel.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if unsent_limit is not None:
                channel.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, unsent_limit)
            return channel
    except TimeoutError:
        raise StallError(f"connecting to {host}:{port} took over {timeout} s") from None
    except OSError as e:
        raise ConnectionLostError(f"cannot connect to {host}:{port}: {e}") from None


async def accept_channel(sock: socket.socket, ssl: ssl_module.SSLContext | None = None) -> Channel:
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if ssl is None:
        return Channel(sock)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 20)
    transport, _ = await loop.connect_accepted_socket(lambda: asyncio.StreamReaderProtocol(reader), sock, ssl=ssl)
    writer = asyncio.StreamWriter(transport, transport.get_protocol(), reader, loop)  # type: ignore[arg-type]
    return Channel(sock, (reader, writer))
