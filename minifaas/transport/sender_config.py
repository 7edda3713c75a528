"""How a KV sender sends: connections, chunk size, pipelining, checksums, deadlines.

Its own module because both the sender and each outgoing transfer read it.
"""

from __future__ import annotations

from dataclasses import dataclass

from minifaas.transport.auth import check_secret
from minifaas.transport.pool import Endpoint


@dataclass(frozen=True, slots=True)
class SenderConfig:
    host: str
    port: int
    secret: bytes
    connections: int = 4
    chunk_bytes: int = 1 << 20
    pipelined: bool = True
    checksums: bool = True  # xxh3 checksum of every payload; off only towards a receiver with accept_unchecked (TLS)
    unsent_limit_bytes: int | None = 1 << 20  # kernel-queued unsent bytes per connection (None: kernel default)
    connect_timeout: float = 5.0
    stall_timeout: float = 10.0
    done_timeout: float = 30.0

    def __post_init__(self) -> None:
        check_secret(self.secret)
        if not 1 <= self.connections <= 64:
            raise ValueError(f"connections must be 1..64, got {self.connections}")
        if not 1 <= self.chunk_bytes <= 64 << 20:
            raise ValueError(f"chunk_bytes must be 1 B..64 MiB, got {self.chunk_bytes}")
        if self.unsent_limit_bytes is not None and self.unsent_limit_bytes <= 0:
            raise ValueError("unsent_limit_bytes must be positive (None: the kernel's default)")
        if min(self.connect_timeout, self.stall_timeout, self.done_timeout) <= 0:
            raise ValueError("timeouts must be positive")

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint(self.host, self.port, self.secret, self.connect_timeout, self.unsent_limit_bytes)
