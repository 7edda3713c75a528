"""The KV sender: streams layer states to one receiver over a pool of N TCP connections.

    async with KVSender(SenderConfig(host, port, secret, connections=16)) as sender:
        report = await sender.send(transfer_id, model_state)        # a finished state
        async with sender.stream(transfer_id, layers=n) as tx:       # layers as prefill makes them
            await asyncio.to_thread(runtime.prefill, tokens, on_layer=tx.put_threadsafe)
        # prefill in token chunks: tx.put_tokens(layer.slice_tokens(a, b), a, total) for full attention
        await sender.send(transfer_id, model_state, codec=Codec.LOSSLESS)  # coded on the wire (``codec``)

``sender.tcp_infos()`` (kernel TCP_INFO per connection) and ``sender.queued_bytes`` feed
``link_health.LinkMonitor``. ``connections=1`` sends one layer after another on one connection;
``pipelined=False`` holds every layer until the whole state is there. ``stall_timeout`` bounds the time without
progress on any connection, ``done_timeout`` the wait for the receiver's DONE.
"""

from __future__ import annotations

import ssl as ssl_module

from minifaas.codec.codec import Codec
from minifaas.model.layer_state import ModelState
from minifaas.net.connections import Connections
from minifaas.net.link_health import TcpInfo, read_tcp_info
from minifaas.transport.outgoing import OutgoingTransfer, TransferReport
from minifaas.transport.sender_config import SenderConfig

__all__ = ["KVSender", "SenderConfig"]

IDLE_TRANSFERS = 8  # transfers' worth of connections kept open for the next ones: a prefill batch sends that many


class KVSender:
    def __init__(self, config: SenderConfig, ssl: ssl_module.SSLContext | None = None):
        self.config = config
        self.pool = Connections(config.endpoint, max_idle=config.connections * IDLE_TRANSFERS, ssl=ssl)
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
