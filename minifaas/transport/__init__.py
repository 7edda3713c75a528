"""Cross-datacenter KV transport: wire format, sender, receiver, link emulator, link health."""

from minifaas.transport.errors import (
    AuthError,
    ConnectionLostError,
    CorruptFrameError,
    ProtocolError,
    RejectedError,
    StallError,
    TransferAbortedError,
    TransferError,
    TruncatedError,
)
from minifaas.transport.incoming import IncomingTransfer
from minifaas.transport.link_health import LinkHealth, LinkMonitor, TcpInfo
from minifaas.transport.outgoing import OutgoingTransfer, TransferReport
from minifaas.transport.receiver import KVReceiver, ReceiverConfig
from minifaas.transport.sender import KVSender, SenderConfig

__all__ = [
    "AuthError",
    "ConnectionLostError",
    "CorruptFrameError",
    "IncomingTransfer",
    "KVReceiver",
    "KVSender",
    "LinkHealth",
    "LinkMonitor",
    "OutgoingTransfer",
    "ProtocolError",
    "ReceiverConfig",
    "RejectedError",
    "SenderConfig",
    "StallError",
    "TcpInfo",
    "TransferAbortedError",
    "TransferError",
    "TransferReport",
    "TruncatedError",
]
