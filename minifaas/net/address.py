"""A TCP address: a (host, port) pair, and HOST:PORT text parsed into one."""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

# the bounds are for a control message that carries one
Address = tuple[Annotated[str, Meta(max_length=253)], Annotated[int, Meta(ge=1, le=65535)]]


def parse_address(text: str) -> Address:
    """HOST:PORT (an IPv6 host in brackets) as a pair; ValueError if it is not one."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"{text!r} is not HOST:PORT")
    return host.strip("[]"), int(port)
