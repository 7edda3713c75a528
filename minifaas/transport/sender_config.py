"""How a KV sender sends: connections, chunk size, pipelining, checksums, deadlines.

Its own module because both the sender and each outgoing transfer read it.
"""

from __future__ import annotations

from dataclasses import dataclass

from minifaas.net.auth import check_secret
from minifaas.net.connections import DEFAULT_CONNECTIONS, MAX_CONNECTIONS, Endpoint

MIN_UNSENT_BYTES = 16 << 10  # a dozen segments: a connection's kernel always has something to send


@dataclass(frozen=True, slots=True)
class SenderConfig:
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

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint(self.host, self.port, self.secret, self.connect_timeout, self.unsent_limit_bytes)
