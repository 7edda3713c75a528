"""The KV sender: layer states to one receiver over a pool of N TCP connections, as the prefill makes them.

One ``OutgoingTransfer`` per state: each layer put is cut into chunks and queued, and N pumps, one per connection,
take the next chunk as soon as their connection has room, so layer i's chunks all leave before layer i+1's; then
END goes out and the sender waits for DONE or ABORT. ``pipelined=False`` holds every layer until the producer is
done (the naive reference). While the producer has no new layer, ALIVE frames show the sender lives.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl as ssl_module
import time
from dataclasses import dataclass

from minifaas.codec.codec import OFF_LOOP_BYTES, Codec, Coded, FrameEncoder, frame_codec, offered, usable
from minifaas.model.host_copy import CopyDone, HostCopier
from minifaas.model.layer_state import LayerState, ModelState
from minifaas.net.channel import Channel
from minifaas.net.connections import (
    DEFAULT_CONNECTIONS,
    MAX_CONNECTIONS,
    Connections,
    TcpInfo,
    check_secret,
    read_tcp_info,
)
from minifaas.net.errors import ProtocolError, RejectedError, StallError, TransferError, first_transfer_error
from minifaas.transport.wire import (
    HEADER_SIZE,
    Chunk,
    FrameType,
    Limits,
    Payload,
    Receipt,
    control,
    cut_tail,
    pack_counts,
    split_chunks,
    split_token_range,
    unpack_header,
)

MIN_UNSENT_BYTES = 16 << 10  # a dozen segments: a connection's kernel always has something to send
IDLE_TRANSFERS = 8  # transfers' worth of connections kept open for the next ones: a prefill batch sends that many


@dataclass(frozen=True, slots=True)
class SenderConfig:
    """How a KV sender sends: connections, chunk size, pipelining, checksums, deadlines."""

    host: str
    port: int
    secret: bytes
    connections: int = DEFAULT_CONNECTIONS
    chunk_bytes: int = 1 << 20
    pipelined: bool = True
    checksums: bool = True  # xxh3 checksum of every payload; off only towards a receiver with accept_unchecked (TLS)
    unsent_bytes: int | None = 4 << 20  # kernel-queued unsent bytes, all connections together (None: kernel default)
    connect_timeout: float = 5.0
    stall_timeout: float = 10.0
    done_timeout: float = 30.0

    def __post_init__(self) -> None:
        check_secret(self.secret)
        if not 1 <= self.connections <= MAX_CONNECTIONS:
            raise ValueError(f"connections must be 1..{MAX_CONNECTIONS}, got {self.connections}")
        if not 1 <= self.chunk_bytes <= 64 << 20:
            raise ValueError(f"chunk_bytes must be 1 B..64 MiB, got {self.chunk_bytes}")
        if self.unsent_bytes is not None and self.unsent_bytes < MIN_UNSENT_BYTES:
            raise ValueError(f"unsent_bytes must be >= {MIN_UNSENT_BYTES} (None: the kernel's default)")
        if min(self.connect_timeout, self.stall_timeout, self.done_timeout) <= 0:
            raise ValueError("timeouts must be positive")

    @property
    def unsent_limit_bytes(self) -> int | None:
        """Unsent bytes one connection's kernel may queue. What a connection has queued stays on it, and
        at a transfer's end the fullest finishes last, so the budget is shared out: the tail it can
        leave is about ``unsent_bytes`` over the link's rate, however many connections there are."""
        if self.unsent_bytes is None:
            return None
        return max(MIN_UNSENT_BYTES, self.unsent_bytes // self.connections)


@dataclass(frozen=True, slots=True)
class TransferReport:
    transfer: int
    layers: int
    nbytes: int  # of state, as the receiver holds it
    connections: int
    seconds: float  # from entering the transfer to the receiver's DONE
    codec: str = "none"  # what the transfer used (the one asked for, or the best the receiver offered)
    wire_bytes: int = 0  # payload bytes that crossed the network
    encode_s: float = 0.0  # coding time at the sender, summed over its pumps
    decode_s: float = 0.0  # decoding time at the receiver, as its DONE says


class OutgoingTransfer:
    def __init__(
        self,
        transfer: int,
        layers: int,
        total_bytes: int,
        pool: Connections,
        settings: SenderConfig,
        codec: Codec = Codec.NONE,
        connections: int = 0,  # at most this many of the pool's (0: the settings'), for a state of a few chunks
    ) -> None:
        self.id, self.connections = transfer, connections or settings.connections
        self.layers = layers
        self.total_bytes = total_bytes
        self.codec = codec  # asked for; once connected, what the receiver can decode
        self.queued_bytes = 0  # put but not yet handed to a socket
        self.sent_bytes = 0
        self.wire_bytes = 0
        self.encode_s = 0.0
        self.report: TransferReport | None = None
        self.finished = False
        self._pool = pool
        self._settings = settings
        self._queue: asyncio.Queue[Chunk | None] = asyncio.Queue()
        self._held: list[Chunk] = []
        self._tokens: dict[int, int] = {}  # layer -> tokens of it put so far (whole layers: all of them)
        self._whole: set[int] = set()  # layers put whole or completed by token ranges
        self._producer_error: Exception | None = None
        self._runner: asyncio.Task[TransferReport] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._copier: HostCopier | None = None  # made by the first state that comes from a GPU
        self.copy_wait_s = 0.0  # pumps waiting for device-to-host copies (in threads, not on the loop)

    async def __aenter__(self) -> OutgoingTransfer:
        self._loop = asyncio.get_running_loop()
        self._started = self._loop.time()
        self._runner = asyncio.create_task(self._run())  # owned: awaited or cancelled in __aexit__
        return self

    async def __aexit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        try:
            await self._finish(exc)
        finally:
            self.finished = True

    async def _finish(self, exc: BaseException | None) -> None:
        """The producer is done: send what waits, its last chunks cut finer, then wait for DONE (or give up)."""
        assert self._runner is not None
        if exc is None and self._producer_error is None and len(self._whole) != self.layers:
            missing = sorted(set(range(self.layers)) - self._whole)
            self._producer_error = ValueError(f"layers {missing} of {self.layers} were not (completely) put")
        if exc is not None or self._producer_error is not None:
            self._runner.cancel()
            with contextlib.suppress(asyncio.CancelledError, TransferError):
                await self._runner
            if self._producer_error is not None and exc is None:
                raise self._producer_error
            return
        waiting = [*(self._queue.get_nowait() for _ in range(self._queue.qsize())), *self._held]
        for chunk in cut_tail(waiting, self.connections, self._settings.unsent_limit_bytes):
            self._queue.put_nowait(chunk)
        for _ in range(self.connections):
            self._queue.put_nowait(None)
        self.report = await self._runner

    def put(self, state: LayerState, start: int = 0, total: int | None = None, ready: CopyDone | None = None) -> None:
        """Queue a finished layer in host memory or, given ``total``, tokens [start, start + state.seq_len) of a
        full-attention layer that will hold ``total`` (pieces of one layer in token order; the receiver sees one
        whole layer). ``ready``: the copy to host memory, if still under way. Call on the event loop's thread."""
        end = start + state.seq_len
        if not self._accept(state.layer, start, end, end if total is None else total):
            return
        if total is None:
            self._enqueue(split_chunks(state, self._settings.chunk_bytes, ready))
        else:
            self._enqueue(split_token_range(state, start, total, self._settings.chunk_bytes, ready))

    def put_threadsafe(self, state: LayerState, start: int = 0, total: int | None = None) -> None:
        """``put`` from another thread, e.g. a model runtime's per-layer callback. A state on a GPU is
        staged to pinned host memory here, in the caller's thread, without waiting for the copy."""
        assert self._loop is not None, "enter the transfer first"
        host, ready = self._stage(state)
        self._loop.call_soon_threadsafe(self.put, host, start, total, ready)

    def _stage(self, state: LayerState) -> tuple[LayerState, CopyDone | None]:
        """``state`` in host memory, and the copy there if one is under way."""
        device = state.slots[0][1].device
        if device.type == "cpu":
            return state, None
        if self._copier is None:
            self._copier = HostCopier(device)
        return self._copier.stage(state)

    def _accept(self, layer: int, start: int, end: int, total: int) -> bool:
        if self._producer_error is not None:
            return False  # the transfer is failing; __aexit__ raises the first error
        if not 0 <= layer < self.layers or layer in self._whole or self._tokens.get(layer, 0) != start:
            self._producer_error = ValueError(f"layer {layer}, tokens [{start}, {end}): not the next part to put")
            return False
        self._tokens[layer] = end
        if end == total:
            self._whole.add(layer)
        return True

    def _enqueue(self, chunks: list[Chunk]) -> None:
        self.queued_bytes += sum(c.length for c in chunks)
        if not self._settings.pipelined:
            self._held.extend(chunks)
            return
        for chunk in chunks:
            self._queue.put_nowait(chunk)

    async def _run(self) -> TransferReport:
        s = self._settings
        channels = await self._pool.acquire(self.connections)
        self.codec = usable(self.codec, offered(self._pool.offer(channels)))
        clean = False
        try:
            start = control(FrameType.START, self.id, pack_counts(self.layers, self.total_bytes))
            channels[0] = await self._pool.send(channels[0], [start], s.stall_timeout)
            try:
                async with asyncio.TaskGroup() as tg:
                    for i in range(len(channels)):
                        tg.create_task(self._pump(channels, i))
            except BaseExceptionGroup as eg:
                raise first_transfer_error(eg) from None
            end = control(FrameType.END, self.id, pack_counts(self.layers, self.sent_bytes))
            await channels[0].send([end], s.stall_timeout)
            receipt = await self._await_done(channels)
            clean = True
        finally:
            for channel in channels:
                if clean:
                    self._pool.release(channel)
                else:
                    self._pool.discard(channel, reset=True)
        assert self._loop is not None
        elapsed = self._loop.time() - self._started
        return TransferReport(
            self.id, self.layers, self.sent_bytes, len(channels), elapsed, self.codec.label, self.wire_bytes,
            self.encode_s, receipt.decode_s,
        )  # fmt: skip

    async def _pump(self, channels: list[Channel], i: int) -> None:
        """Send chunks on ``channels[i]``; its first send may replace it (``Connections.send``)."""
        encoder = FrameEncoder()
        alive_on = channels[0] if i == 0 else None
        while (upcoming := await self._next_frame(encoder, alive_on)) is not None:
            chunk, header, payload = upcoming
            channels[i] = await self._pool.send(channels[i], [header, *payload], self._settings.stall_timeout)
            self.queued_bytes -= chunk.length
            self.sent_bytes += chunk.length
            self.wire_bytes += sum(memoryview(p).nbytes for p in payload)

    async def _next_frame(
        self, encoder: FrameEncoder, alive_on: Channel | None
    ) -> tuple[Chunk, bytes, list[Payload]] | None:
        chunk = await self._take(alive_on)
        if chunk is None:
            return None
        if chunk.ready is not None and not chunk.ready.query():  # its layer is still being copied off the GPU
            started = time.perf_counter()
            await asyncio.to_thread(chunk.ready.synchronize)
            self.copy_wait_s += time.perf_counter() - started
        codec = frame_codec(self.codec, chunk.state.kind, chunk.dtype, chunk.length)
        if codec is Codec.NONE:
            # checksummed here, on this thread, just before the send: the kernel then copies bytes still in cache
            header, payload = chunk.frame(self.id, self._settings.checksums)
            await asyncio.sleep(0)  # framing did not yield: let the other pumps take a turn
            return chunk, header, [payload]
        if chunk.length >= OFF_LOOP_BYTES:
            coded, seconds = await asyncio.to_thread(_timed_encode, encoder, codec, chunk)
        else:
            coded, seconds = _timed_encode(encoder, codec, chunk)
            await asyncio.sleep(0)
        self.encode_s += seconds
        header, parts = chunk.coded_frame(self.id, coded)
        return chunk, header, parts

    async def _take(self, alive_on: Channel | None) -> Chunk | None:
        """The next chunk. While the producer has none, ``alive_on`` carries an ALIVE frame every third of
        the stall timeout: the receiver's stall deadline is for a dead sender or link, not a slow prefill."""
        if alive_on is None:
            return await self._queue.get()
        while True:
            try:
                async with asyncio.timeout(self._settings.stall_timeout / 3):
                    return await self._queue.get()
            except TimeoutError:
                await alive_on.send([control(FrameType.ALIVE, self.id)], self._settings.stall_timeout)

    async def _await_done(self, channels: list[Channel]) -> Receipt:
        """The receiver's reply, due within ``done_timeout`` of this transfer's bytes last moving: on a slow link that
        other transfers share, the link may take the last of them long after END left."""
        s, channel = self._settings, channels[0]
        reply = asyncio.ensure_future(channel.recv_exactly(HEADER_SIZE, None))
        try:
            queued = [c.queued(write=True) for c in channels]
            while not (await asyncio.wait([reply], timeout=s.done_timeout))[0]:
                if queued == (queued := [c.queued(write=True) for c in channels]):
                    raise StallError(f"transfer {self.id}: no reply from the receiver within {s.done_timeout} s")
            raw = reply.result()
        finally:
            reply.cancel()
        h = unpack_header(raw, Limits())
        payload = await channel.recv_exactly(h.length, s.stall_timeout)
        if h.transfer != self.id:
            raise ProtocolError(f"reply for transfer {h.transfer} while waiting for {self.id}")
        if h.type is FrameType.ABORT:
            raise RejectedError(f"transfer {self.id}: receiver says {payload.decode(errors='replace')}")
        if h.type is not FrameType.DONE:
            raise ProtocolError(f"expected DONE, got {h.type.name}")
        receipt = Receipt.unpack(payload)
        if (receipt.layers, receipt.nbytes, receipt.wire_bytes) != (self.layers, self.sent_bytes, self.wire_bytes):
            raise ProtocolError(f"transfer {self.id}: receiver counted {receipt}")
        return receipt


class KVSender:
    def __init__(self, config: SenderConfig, ssl: ssl_module.SSLContext | None = None):
        self.config = config
        self.pool = Connections(
            config.host, config.port, config.secret, config.connections * IDLE_TRANSFERS,
            config.connect_timeout, config.unsent_limit_bytes, ssl,
        )  # fmt: skip
        self._active: set[OutgoingTransfer] = set()

    async def __aenter__(self) -> KVSender:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.pool.close()

    def stream(
        self, transfer_id: int, layers: int, total_bytes: int = 0, codec: Codec = Codec.NONE, connections: int = 0
    ) -> OutgoingTransfer:
        """A transfer to fill with ``put``; entering it starts sending, leaving it waits for DONE. ``connections``:
        at most that many (0: the config's), for a state of a few chunks."""
        tx = OutgoingTransfer(transfer_id, layers, total_bytes, self.pool, self.config, codec, connections)
        self._active = {t for t in self._active if not t.finished}
        self._active.add(tx)
        return tx

    async def send(self, transfer_id: int, state: ModelState, codec: Codec = Codec.NONE) -> TransferReport:
        async with self.stream(transfer_id, len(state.layers), state.nbytes, codec) as tx:
            for layer in state.layers:
                tx.put(layer)
        assert tx.report is not None
        return tx.report

    @property
    def queued_bytes(self) -> int:
        """Bytes put into transfers but not yet handed to a socket."""
        return sum(tx.queued_bytes for tx in self._active if not tx.finished)

    def tcp_infos(self) -> dict[int, TcpInfo]:
        """Kernel TCP_INFO of every live connection, by connection id."""
        return {key: read_tcp_info(ch.sock) for key, ch in self.pool.live.items() if not ch.closed}


def _timed_encode(encoder: FrameEncoder, codec: Codec, chunk: Chunk) -> tuple[Coded, float]:
    start = time.perf_counter()
    coded = encoder.encode(codec, chunk.dtype, chunk.payload)
    return coded, time.perf_counter() - start
