"""Chained block keys: the names under which cached state is stored and matched.

A block's key hashes the key before it with the block's tokens, so one key names the whole prefix up to the
block's end, and ``key_at(n)`` names the prefix of any length n. The chain starts at a root made from a namespace
(the model name), so models never share keys. Keys made without the tokens (a trace's) name only block ends and
the prompt's end.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

BlockKey = bytes
KEY_BYTES = 16


def root_key(namespace: str) -> BlockKey:
    return hashlib.blake2b(namespace.encode(), digest_size=KEY_BYTES, person=b"minifaas-root").digest()


def token_bytes(tokens: Sequence[int]) -> bytes:
    """Token ids as little-endian int64, whatever the host's byte order."""
    arr = array("q", tokens)
    if sys.byteorder == "big":
        arr.byteswap()
    return arr.tobytes()


def chain(parent: BlockKey, content: bytes) -> BlockKey:
    # the parent has a fixed length, so parent + content parses one way only
    return hashlib.blake2b(parent + content, digest_size=KEY_BYTES).digest()


@dataclass(frozen=True, slots=True)
class PromptKeys:
    root: BlockKey
    block_size: int
    num_tokens: int
    block_keys: tuple[BlockKey, ...]  # one per FULL block
    end_key: BlockKey  # key_at(num_tokens)
    tokens: Sequence[int] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.num_tokens < 0:
            raise ValueError(f"need block_size >= 1 and num_tokens >= 0, got {self.block_size}, {self.num_tokens}")
        if len(self.block_keys) != self.num_tokens // self.block_size:
            raise ValueError(f"{self.num_tokens} tokens make {self.num_tokens // self.block_size} full blocks")

    @classmethod
    def from_tokens(cls, tokens: Sequence[int], block_size: int, namespace: str = "") -> PromptKeys:
        root = root_key(namespace)
        keys: list[BlockKey] = []
        parent = root
        for start in range(0, len(tokens) - block_size + 1, block_size):
            parent = chain(parent, token_bytes(tokens[start : start + block_size]))
            keys.append(parent)
        tail = tokens[len(keys) * block_size :]
        end = chain(parent, token_bytes(tail)) if tail else parent
        return cls(root, block_size, len(tokens), tuple(keys), end, tuple(tokens))

    @property
    def num_full_blocks(self) -> int:
        return len(self.block_keys)

    def parent_of(self, n: int) -> BlockKey:
        """Key of the last full block inside the prefix of length n (the root if none)."""
        j = n // self.block_size
        return self.block_keys[j - 1] if j else self.root

    def keyed_lengths(self, low: int, high: int) -> tuple[int, ...] | None:
        """The lengths in [low, high] that have a key, longest first; None when every length has one
        (the tokens are known). Without tokens only block boundaries and the prompt's end are keyed."""
        if self.tokens is not None:
            return None
        ends = (self.num_tokens, *range(high - high % self.block_size, low - 1, -self.block_size))
        return tuple(n for n in dict.fromkeys(ends) if low <= n <= high)

    def key_at(self, n: int) -> BlockKey | None:
        if not 0 <= n <= self.num_tokens:
            raise ValueError(f"length {n} outside 0..{self.num_tokens}")
        if n == self.num_tokens:
            return self.end_key
        start = n - n % self.block_size
        if start == n:
            return self.parent_of(n)
        if self.tokens is None:
            return None
        return chain(self.parent_of(n), token_bytes(self.tokens[start:n]))
