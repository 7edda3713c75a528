"""The cluster secret: one per deployment, for the KV link and every control channel alike.

It comes from a file (``--secret-file``) or the MINIFAAS_SECRET environment variable, never from the command
line. A file that other users may read is refused.
"""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path

from minifaas.net.connections import MIN_SECRET_BYTES

SECRET_ENV = "MINIFAAS_SECRET"


def load_secret(path: str | None = None, environ: Mapping[bytes, bytes] | None = None) -> bytes:
    """The secret from ``path`` if given, else from $MINIFAAS_SECRET; ValueError says what is wrong."""
    if path is not None:
        file = Path(path)
        try:
            mode = file.stat().st_mode
            secret = file.read_bytes().strip()
        except OSError as e:
            raise ValueError(f"cannot read the secret file {path}: {e.strerror}") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ValueError(f"{path} is readable by other users: chmod 600 {path}")
        where = path
    else:
        secret = (os.environb if environ is None else environ).get(SECRET_ENV.encode(), b"").strip()
        if not secret:
            raise ValueError(f"no cluster secret: give --secret-file PATH or set {SECRET_ENV}")
        where = f"${SECRET_ENV}"
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"the secret in {where} is {len(secret)} bytes; it needs at least {MIN_SECRET_BYTES}")
    return secret


def new_secret() -> bytes:
    """A fresh secret, for a deployment whose workers are all the gateway's own children."""
    return secrets.token_hex(32).encode()
