"""The gateway <-> worker control channel: one JSON object per line over a local TCP stream.

Messages are small dicts with an ``op`` and usually a ``req`` (request id);
bulk state never goes here (it goes over the KV transport). A worker's prefix
cache events, ``{"op": "cache", "events": [...]}``, belong to no request: they
go under the ``req`` CACHE_EVENTS, which the gateway listens on for as long as
the worker runs.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from minifaas.model.sampling import SamplingParams

MAX_LINE = 64 << 20  # a prompt of a few million token ids still fits
CACHE_EVENTS = "@cache"  # no request id starts with "@"


async def messages(reader: asyncio.StreamReader) -> AsyncIterator[dict]:
    while line := await reader.readline():
        yield json.loads(line)


def send(writer: asyncio.StreamWriter, message: dict) -> None:
    """Queue one message; writes of whole lines never interleave (the loop runs one task at a time)."""
    writer.write(json.dumps(message, separators=(",", ":")).encode() + b"\n")


def sampling_to_json(p: SamplingParams) -> dict:
    return {
        "max_tokens": p.max_tokens,
        "temperature": p.temperature,
        "top_p": p.top_p,
        "top_k": p.top_k,
        "min_tokens": p.min_tokens,
        "presence_penalty": p.presence_penalty,
        "frequency_penalty": p.frequency_penalty,
        "seed": p.resolved_seed,
        "stop_token_ids": list(p.stop_token_ids),
        "ignore_eos": p.ignore_eos,
    }


def sampling_from_json(d: dict) -> SamplingParams:
    return SamplingParams(
        max_tokens=d["max_tokens"],
        temperature=d["temperature"],
        top_p=d["top_p"],
        top_k=d["top_k"],
        min_tokens=d["min_tokens"],
        presence_penalty=d["presence_penalty"],
        frequency_penalty=d["frequency_penalty"],
        seed=d["seed"],
        stop_token_ids=tuple(d["stop_token_ids"]),
        ignore_eos=d["ignore_eos"],
    )
