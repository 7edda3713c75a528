"""Cross-datacenter KV transport: wire format, sender, receiver, link emulator, link health.

Names are imported on first use, so a process that only relays bytes (the link
emulator) never loads torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "errors": (
        "AuthError", "ConnectionLostError", "CorruptFrameError", "DroppedError", "ProtocolError", "RejectedError",
        "StallError", "TransferAbortedError", "TransferError", "TruncatedError",
    ),
    "incoming": ("IncomingTransfer",),
    "link_health": ("LinkHealth", "LinkMonitor", "TcpInfo"),
    "outgoing": ("OutgoingTransfer", "TransferReport"),
    "receiver": ("KVReceiver", "ReceiverConfig"),
    "sender": ("KVSender",),
    "sender_config": ("SenderConfig",),
}  # fmt: skip
_MODULE_OF = {name: module for module, names in _HOMES.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
