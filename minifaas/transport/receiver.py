"""The KV receiver: an asyncio server that turns frames from many connections back into layers.

A frame goes to its transfer by id (``TransferTable``: frames may open one before its consumer asks); a chunk's
payload is read straight into the slot's tensor memory (``wire.Reassembly``) and checksummed as it lands (a coded
one is decoded into it); each layer is handed to the consumer iterating the ``IncomingTransfer`` once it is whole,
and DONE goes back when the last is. A consumer may ``release`` a state's memory for reuse. What goes wrong (a
bad frame, a broken connection, a stall, a transfer nobody claims) is handled by the methods at its end.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import socket
import ssl as ssl_module
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field

import torch

from minifaas.codec.codec import ALL_CODECS, OFF_LOOP_BYTES, Codec, FrameDecoder, offer_mask
from minifaas.model.layer_state import Checksum, LayerState, ModelState, checksum
from minifaas.net.channel import Channel, Digest, accept_channel
from minifaas.net.connections import check_secret, verify_sender
from minifaas.net.errors import (
    AuthError,
    ConnectionLostError,
    CorruptFrameError,
    DroppedError,
    ProtocolError,
    StallError,
    TransferAbortedError,
    TransferError,
    TruncatedError,
)
from minifaas.transport.wire import (
    HEADER_SIZE,
    UNCHECKED,
    FrameHeader,
    FrameType,
    Limits,
    Reassembly,
    Receipt,
    control,
    unpack_counts,
    unpack_header,
)

log = logging.getLogger(__name__)
MAX_OPEN_TRANSFERS = 256  # the default; a decode worker holds one per request it may take (max_batch + max_waiting)


@dataclass(frozen=True, slots=True)
class ReceiverConfig:
    secret: bytes
    host: str = "127.0.0.1"
    port: int = 0
    handshake_timeout: float = 5.0
    stall_timeout: float = 10.0
    max_transfer_bytes: int = 64 << 30
    max_open_transfers: int = MAX_OPEN_TRANSFERS
    unclaimed_grace: float = 10.0  # an ended transfer no consumer claimed is dropped after this long
    recycle_bytes: int = 4 << 30  # received memory kept for reuse once released (0: none)
    accept_unchecked: bool = False  # take chunks whose sender skipped the payload checksum (TLS, trusted links)
    limits: Limits = field(default_factory=Limits)
    codecs: frozenset[Codec] = ALL_CODECS  # offered in the handshake: senders code frames with these only
    pinned: bool = False  # receive into page-locked memory (a decode node on a GPU: async copies to it)

    def __post_init__(self) -> None:
        check_secret(self.secret)
        if min(self.handshake_timeout, self.stall_timeout, self.unclaimed_grace) <= 0:
            raise ValueError("timeouts must be positive")
        if self.max_transfer_bytes <= 0 or self.max_open_transfers <= 0 or self.recycle_bytes < 0:
            raise ValueError("transfer limits must be positive")


@dataclass(slots=True)
class ReceiverStats:
    auth_failures: int = 0
    completed: int = 0
    failed: int = 0
    dropped: int = 0  # unclaimed transfers dropped (after the grace, or to make room)
    bytes_received: int = 0  # payload bytes off the network


class ReceiveBuffers:
    """Receive memory used again instead of freshly mapped (and page-faulted) for every transfer. A consumer done
    with a received state gives it back (``KVReceiver.release``); releasing a state still in use is a bug, its bytes
    will be overwritten. ``pinned``: page-locked memory, for a decode node's asynchronous copies to a GPU; such a
    state goes back only once they are done."""

    def __init__(self, max_bytes: int, pinned: bool = False):
        self.max_bytes, self.pinned = max_bytes, pinned
        self.held_bytes = 0
        self._sizes: list[int] = []  # sorted, parallel to _buffers
        self._buffers: list[torch.Tensor] = []
        self._held: set[int] = set()  # data pointers, so a double release cannot hand one buffer out twice
        self.reused = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of exactly ``nbytes``: a view of a pooled buffer at most twice as large, or new memory."""
        i = bisect.bisect_left(self._sizes, nbytes)
        if nbytes and i < len(self._sizes) and self._sizes[i] <= 2 * nbytes:
            size, buf = self._sizes.pop(i), self._buffers.pop(i)
            self.held_bytes -= size
            self._held.discard(buf.data_ptr())
            self.reused += 1
            return buf[:nbytes]
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)

    def give(self, tensor: torch.Tensor) -> None:
        """Return the memory behind ``tensor`` (a slot of a received state) to the pool."""
        storage = tensor.untyped_storage()
        whole = torch.empty(0, dtype=torch.uint8).set_(storage)
        size, ptr = whole.numel(), whole.data_ptr()
        if size == 0 or ptr in self._held or self.held_bytes + size > self.max_bytes:
            return
        i = bisect.bisect_left(self._sizes, size)
        self._sizes.insert(i, size)
        self._buffers.insert(i, whole)
        self._held.add(ptr)
        self.held_bytes += size


FORGET_AFTER = 4096  # ended transfer ids remembered, so late frames are skipped, not restarted
OnDrop = Callable[["IncomingTransfer", str], None]
_END = None


class IncomingTransfer:
    """One transfer as its consumer sees it: each layer as soon as it is whole, until the last or the
    ``TransferError`` that ended it."""

    def __init__(self, transfer: int, max_bytes: int, now: float, allocate: Callable[[int], torch.Tensor]):
        self.id = transfer
        self.assembly: Reassembly | None = Reassembly(transfer, max_bytes, allocate)
        self.error: TransferError | None = None
        self.started = False  # a frame has arrived
        self.claimed = False  # a consumer holds this object
        self.last_progress = now
        self.receiving = 0  # chunk payloads being read now: each connection's own deadline watches those
        self.reply_to: Channel | None = None  # where END came from; DONE or ABORT goes back there
        self.received_bytes = 0
        self.wire_bytes = 0  # payload bytes as they came off the network (coded ones smaller)
        self.decode_s = 0.0
        self.complete = False
        self.abandoned = False  # its consumer stopped waiting (the request was aborted): a failure now is expected
        self.layers = 0  # delivered so far
        self._queue: asyncio.Queue[LayerState | TransferError | None] = asyncio.Queue()

    @property
    def finished(self) -> bool:
        return self.complete or self.error is not None

    def abandon(self) -> None:
        self.abandoned = True

    def deliver(self, layers: list[LayerState], now: float) -> bool:
        """Hand on layers that are ready; True if this completed the transfer."""
        self.last_progress = now
        for layer in layers:
            self._queue.put_nowait(layer)
        self.layers += len(layers)
        if self.assembly is not None and self.assembly.complete:
            self.received_bytes = self.assembly.received
            self.complete = True
            self.assembly = None  # the layers now belong to the consumer
            self._queue.put_nowait(_END)
            return True
        return False

    def fail(self, error: TransferError) -> bool:
        """End the transfer with ``error``, freeing the partial state. False if it had already ended."""
        if self.finished:
            return False
        self.error = error
        self.assembly = None
        self._queue.put_nowait(error)
        return True

    def discard(self) -> list[LayerState]:
        """Take back the delivered layers no consumer took (the transfer was dropped unclaimed)."""
        items = [self._queue.get_nowait() for _ in range(self._queue.qsize())]
        return [item for item in items if isinstance(item, LayerState)]

    async def __aiter__(self) -> AsyncIterator[LayerState]:
        while True:
            item = await self._queue.get()
            if item is _END:
                self._queue.put_nowait(_END)  # a second iteration ends at once too
                return
            if isinstance(item, TransferError):
                self._queue.put_nowait(item)
                raise item
            yield item

    async def model_state(self) -> ModelState:
        layers = [layer async for layer in self]
        return ModelState(layers, max((layer.seq_len for layer in layers), default=0))


class TransferTable:
    """A receiver's transfers by id (frames may open one before its consumer asks), and why recently ended ones
    ended, so late frames are skipped, not restarted. Full, it drops the oldest unclaimed transfer."""

    def __init__(
        self, max_open: int, max_transfer_bytes: int, allocate: Callable[[int], torch.Tensor], grace: float = 10.0,
        on_drop: OnDrop | None = None,
    ) -> None:  # fmt: skip
        self.max_open, self.max_transfer_bytes, self._allocate = max_open, max_transfer_bytes, allocate
        self.grace, self._on_drop = grace, on_drop
        self.open: dict[int, IncomingTransfer] = {}  # in the order they opened
        self._unclaimed: OrderedDict[int, float] = OrderedDict()  # ended, unclaimed id -> when it ended
        self._ended: OrderedDict[int, str] = OrderedDict()  # ended id -> why it failed ("" if it did not)

    def claim(self, transfer_id: int, now: float) -> IncomingTransfer:
        """The transfer for its consumer: the one frames opened, or a new one waiting for them."""
        t = self.open.get(transfer_id)
        if t is None and transfer_id in self._ended:  # dropped, or claimed once already
            why = self._ended[transfer_id].removeprefix("DroppedError: ")
            t = IncomingTransfer(transfer_id, self.max_transfer_bytes, now, self._allocate)
            t.fail(DroppedError(why or f"transfer {transfer_id} has already ended"))
        elif t is None:
            t = self._open(transfer_id, now)
        t.claimed = True
        if t.finished:
            self.open.pop(transfer_id, None)
            self._unclaimed.pop(transfer_id, None)
        return t

    def for_frame(self, transfer_id: int, now: float) -> IncomingTransfer | None:
        """Where a frame goes; None if its transfer has ended (skip the frame)."""
        t = self.open.get(transfer_id)
        if t is None and transfer_id not in self._ended:
            t = self._open(transfer_id, now)
        return None if t is None or t.finished else t

    def failure(self, transfer_id: int) -> str:
        """Why an ended transfer failed ("" if it did not, or is not remembered)."""
        return self._ended.get(transfer_id, "")

    def ended(self, t: IncomingTransfer, now: float) -> None:
        """Record that ``t`` completed or failed."""
        self._remember(t.id, "" if t.error is None else reason(t.error))
        if t.claimed:
            self.open.pop(t.id, None)
        elif t.id in self.open:
            self._unclaimed[t.id] = now

    def sweep(self, now: float) -> None:
        """Drop the transfers that ended unclaimed more than ``grace`` seconds ago."""
        while self._unclaimed:
            transfer_id, ended_at = next(iter(self._unclaimed.items()))
            if now - ended_at < self.grace:
                return
            self._drop(transfer_id, f"ended {now - ended_at:.1f} s ago and no consumer claimed it")

    def stalled(self, now: float, limit: float) -> list[IncomingTransfer]:
        """Started, unfinished transfers without progress for more than ``limit`` seconds and no payload
        being read (a payload still arriving, however slowly, is its connection's deadline to judge)."""
        quiet = (t for t in self.open.values() if t.started and not t.finished and not t.receiving)
        return [t for t in quiet if now - t.last_progress > limit]

    def _drop(self, transfer_id: int, why: str) -> None:
        t = self.open.pop(transfer_id)
        self._unclaimed.pop(transfer_id, None)
        cause = f"transfer {transfer_id} was dropped: {why}"
        t.fail(DroppedError(cause))  # if unfinished: later frames are skipped, its END is answered with the cause
        self._remember(transfer_id, f"DroppedError: {cause}")
        if self._on_drop is not None:
            self._on_drop(t, cause)

    def _open(self, transfer_id: int, now: float) -> IncomingTransfer:
        if len(self.open) >= self.max_open:
            self._make_room()
        t = self.open[transfer_id] = IncomingTransfer(transfer_id, self.max_transfer_bytes, now, self._allocate)
        return t

    def _make_room(self) -> None:
        full = f"the table of {self.max_open} transfers was full"
        if self._unclaimed:
            self._drop(next(iter(self._unclaimed)), f"ended and unclaimed when {full}")
            return
        oldest = next((t for t in self.open.values() if not t.claimed), None)
        if oldest is None:
            raise ProtocolError(f"more than {self.max_open} open transfers, all of them claimed")
        self._drop(oldest.id, f"unclaimed and unfinished when {full}")

    def _remember(self, transfer_id: int, why: str) -> None:
        self._ended[transfer_id] = why
        self._ended.move_to_end(transfer_id)
        while len(self._ended) > FORGET_AFTER:
            self._ended.popitem(last=False)


class KVReceiver:
    def __init__(self, config: ReceiverConfig, ssl: ssl_module.SSLContext | None = None):
        self.config = config
        self.stats = ReceiverStats()
        self.buffers = ReceiveBuffers(config.recycle_bytes, config.pinned)
        self._ssl = ssl
        self._listener: socket.socket | None = None
        self._group = asyncio.TaskGroup()
        self._tasks: set[asyncio.Task[None]] = set()
        self._table = TransferTable(
            config.max_open_transfers,
            config.max_transfer_bytes,
            self.buffers.take,
            config.unclaimed_grace,
            self._dropped,
        )

    @property
    def port(self) -> int:
        assert self._listener is not None, "the receiver is not running"
        return self._listener.getsockname()[1]

    async def __aenter__(self) -> KVReceiver:
        listener = socket.create_server((self.config.host, self.config.port), backlog=128, reuse_port=False)
        listener.setblocking(False)
        self._listener = listener
        await self._group.__aenter__()
        self._spawn(self._accept_loop())
        self._spawn(self._reap_stalled())
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in self._tasks:
            task.cancel()
        try:
            await self._group.__aexit__(None, None, None)
        finally:
            if self._listener is not None:
                self._listener.close()
            for t in self._table.open.values():
                t.fail(ConnectionLostError("the receiver shut down"))

    def transfer(self, transfer_id: int) -> IncomingTransfer:
        """The incoming transfer with this id, claimed by the caller (created if no frame came yet)."""
        return self._table.claim(transfer_id, asyncio.get_running_loop().time())

    def release(self, state: ModelState | LayerState) -> None:
        """The consumer is done with a received state: its memory may receive the next transfer."""
        for layer in state.layers if isinstance(state, ModelState) else [state]:
            for _, tensor in layer.slots:
                self.buffers.give(tensor)

    def _spawn(self, coro: Coroutine[object, object, None]) -> None:
        task = self._group.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _finish(self, t: IncomingTransfer) -> None:
        self.stats.completed += t.complete
        self.stats.failed += t.error is not None
        self._table.ended(t, asyncio.get_running_loop().time())

    async def _accept_loop(self) -> None:
        assert self._listener is not None
        loop = asyncio.get_running_loop()
        while True:
            sock, _ = await loop.sock_accept(self._listener)
            self._spawn(self._serve(sock))

    async def _serve(self, sock: socket.socket) -> None:
        carried: set[int] = set()  # the transfers this connection carried frames of
        channel: Channel | None = None
        clean = False
        try:
            channel = await accept_channel(sock, self._ssl)
            offer = offer_mask(self.config.codecs)
            await verify_sender(channel, self.config.secret, self.config.handshake_timeout, offer)
            decoder = FrameDecoder()
            while await self._read_frame(channel, carried, decoder):
                pass
            clean = True
            await self._lost(carried, TruncatedError("connection closed before the transfer was complete"))
        except (TransferError, OSError) as e:
            await self._broken(carried, e)
        finally:
            if channel is None:
                sock.close()
            else:
                channel.close(reset=not clean)

    async def _read_frame(self, channel: Channel, carried: set[int], decoder: FrameDecoder) -> bool:
        raw = bytearray(HEADER_SIZE)
        if not await channel.recv_into(memoryview(raw), None):
            return False
        h = unpack_header(raw, self.config.limits)
        t = self._table.for_frame(h.transfer, asyncio.get_running_loop().time())
        if t is None:
            await channel.recv_exactly(h.length, self.config.stall_timeout)  # too late: skip it
            if h.type is FrameType.END and (why := self._table.failure(h.transfer)):
                await channel.send([control(FrameType.ABORT, h.transfer, why.encode())], self.config.stall_timeout)
            return True
        carried.add(h.transfer)
        t.started = True
        try:
            await self._apply(t, h, channel, decoder)
        except TransferError as e:
            await self._fail(t, e)
            raise
        return True

    async def _apply(self, t: IncomingTransfer, h: FrameHeader, channel: Channel, decoder: FrameDecoder) -> None:
        if h.type is FrameType.CHUNK:
            await self._chunk(t, h, channel, decoder)
            return
        payload = await channel.recv_exactly(h.length, self.config.stall_timeout)
        if checksum(payload) != h.crc:
            raise CorruptFrameError(f"{h.type.name} payload checksum mismatch")
        if t.assembly is None:
            return  # the transfer failed or was dropped while its payload arrived
        t.last_progress = asyncio.get_running_loop().time()
        if h.type is FrameType.START:
            t.assembly.start(*unpack_counts(payload))
        elif h.type is FrameType.END:
            t.reply_to = channel
            t.assembly.end(*unpack_counts(payload))
            await self._progress(t, [])
        elif h.type is FrameType.ABORT:
            await self._fail(t, TransferAbortedError(f"sender: {payload.decode(errors='replace')}"))
        elif h.type is not FrameType.ALIVE:  # the sender lives: the progress stamped above is all it means
            raise ProtocolError(f"a receiver does not accept {h.type.name} frames")

    async def _chunk(self, t: IncomingTransfer, h: FrameHeader, channel: Channel, decoder: FrameDecoder) -> None:
        """Read a chunk's payload into its place in the slot (decoding a coded one there), check and commit it."""
        codec, unchecked = Codec(h.codec), h.codec == 0 and bool(h.flags & UNCHECKED)
        if codec is not Codec.NONE and codec not in self.config.codecs:
            raise ProtocolError(f"a {codec.label} chunk; this receiver did not offer that codec")
        if unchecked and not self.config.accept_unchecked:
            raise ProtocolError("a chunk without a payload checksum; this receiver requires them")
        assert t.assembly is not None
        view = t.assembly.buffer_for(h)
        if codec is not Codec.NONE:
            payload = decoder.scratch(h.length)
            await self._receive(t, channel, payload)
            if h.length >= OFF_LOOP_BYTES:
                crc, seconds = await asyncio.to_thread(decoder.decode_into, codec, h.dtype, payload, view)
            else:
                crc, seconds = decoder.decode_into(codec, h.dtype, payload, view)
            t.decode_s += seconds
        elif unchecked:
            await self._receive(t, channel, view)
            crc = h.crc
        else:
            digest = Checksum()  # fed each block as it is read, while it is in cache
            await self._receive(t, channel, view, digest.update)
            crc = digest.value
        if t.assembly is not None:  # else the transfer failed meanwhile
            await self._progress(t, t.assembly.commit(h, view, crc))

    async def _receive(
        self, t: IncomingTransfer, channel: Channel, view: memoryview, digest: Digest | None = None
    ) -> None:
        """Read one chunk's payload and count its bytes; meanwhile the transfer is not judged stalled as a whole."""
        t.receiving += 1
        try:
            await channel.recv_into(view, self.config.stall_timeout, digest)
            self.stats.bytes_received += view.nbytes
            t.wire_bytes += view.nbytes
        finally:
            t.receiving -= 1
            t.last_progress = asyncio.get_running_loop().time()

    async def _progress(self, t: IncomingTransfer, layers: list[LayerState]) -> None:
        if not t.deliver(layers, asyncio.get_running_loop().time()):
            return
        self._finish(t)
        if t.reply_to is not None:
            receipt = Receipt(t.layers, t.received_bytes, t.wire_bytes, t.decode_s)
            await t.reply_to.send([control(FrameType.DONE, t.id, receipt.pack())], self.config.stall_timeout)

    # What goes wrong: failed, lost, stalled and dropped transfers.

    async def _fail(self, t: IncomingTransfer, error: TransferError) -> None:
        """End ``t`` with ``error`` (if it has not ended) and tell its sender, if it waits for DONE."""
        if not t.fail(error):
            return
        (log.debug if t.abandoned else log.warning)("transfer %d failed: %s: %s", t.id, type(error).__name__, error)
        self._finish(t)
        await self._abort(t, reason(error))

    async def _lost(self, carried: set[int], error: TransferError) -> None:
        for transfer_id in carried:
            if (t := self._table.open.get(transfer_id)) is not None:
                await self._fail(t, error)

    async def _broken(self, carried: set[int], e: TransferError | OSError) -> None:
        """A connection failed its handshake, or broke off with ``e``: the transfers it carried fail."""
        if isinstance(e, AuthError):
            self.stats.auth_failures += 1
            log.warning("rejected a connection: %s", e)
            return
        if isinstance(e, OSError):
            e = ConnectionLostError(str(e))
        elif isinstance(e, ProtocolError):  # the peer sent what the wire does not allow (another version, say)
            log.warning("dropped a connection: %s: %s", type(e).__name__, e)
        elif not carried:  # a sender that gave up before its first frame, in the handshake even
            log.debug("a connection closed before it carried a frame: %s", e)
        await self._lost(carried, e)

    def _dropped(self, t: IncomingTransfer, cause: str) -> None:
        self.stats.dropped += 1
        log.warning("%s", cause)
        for layer in t.discard():
            self.release(layer)
        if not t.complete:
            self._spawn(self._abort(t, f"DroppedError: {cause}"))

    async def _abort(self, t: IncomingTransfer, why: str) -> None:
        """ABORT to ``t``'s sender if it waits for DONE on END's connection; a failed reply is let go (the sender
        learns from the broken connection or its deadline)."""
        if t.reply_to is not None and not t.reply_to.closed:
            with contextlib.suppress(TransferError):
                await t.reply_to.send([control(FrameType.ABORT, t.id, why.encode())], self.config.stall_timeout)

    async def _reap_stalled(self) -> None:
        loop = asyncio.get_running_loop()
        limit = self.config.stall_timeout
        while True:
            await asyncio.sleep(min(limit / 4, 1.0))
            self._table.sweep(loop.time())
            for t in self._table.stalled(loop.time(), limit):
                await self._fail(t, StallError(f"transfer {t.id}: no progress for {limit} s"))


def reason(error: TransferError) -> str:
    return f"{type(error).__name__}: {error}"[:1024]
