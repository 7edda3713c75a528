"""The gateway <-> worker control protocol: the fields of every message each way, over an authenticated session.

Messages are small dicts with an ``op`` and usually a ``req`` (request id), signed and framed by
``control.session``; bulk state goes over the KV transport instead. ``WORKER_OPS`` holds what a worker
accepts (``Op``), ``WORKER_REPLIES`` what it answers (``Reply``); each side checks a message against its
table (``schema.validate``) before it acts on it.

    attach -> attached (what the worker is), then its pool's inventory as ``cache`` messages
    ping -> pong (TCP_INFO of its KV connections)    load -> load (its queue)    start, abort: no reply
    prefill -> first (the first token, once the forwards are done), prefilled (once the state has gone)
    export -> exported    decode -> pinned, received, token... (a step's, of every request, as one ``tokens``), done
    any request -> failed (it could not be done); a message its table refuses -> error

Cache events (``cache``) belong to no request: they go under the ``req`` CACHE_EVENTS, which the gateway
listens on for as long as the worker runs.
"""

from __future__ import annotations

from dataclasses import fields
from enum import StrEnum

from minifaas.codec.codec import Codec
from minifaas.control.schema import (
    Address,
    Bool,
    Fields,
    Int,
    IntList,
    Kind,
    ListOf,
    MapOf,
    Nullable,
    Number,
    OneOf,
    Optional,
    Text,
)  # fmt: skip
from minifaas.control.session import MAX_BYTES
from minifaas.model.sampling import SamplingParams
from minifaas.net.connections import TcpInfo

CACHE_EVENTS = "@cache"  # no request id starts with "@"


class Op(StrEnum):
    """What the gateway asks of a worker."""

    ATTACH = "attach"
    PING = "ping"
    PREFILL = "prefill"
    EXPORT = "export"
    DECODE = "decode"
    START = "start"
    ABORT = "abort"
    LOAD = "load"


class Reply(StrEnum):
    """What a worker answers; the last two never come from a worker's session (no table entry)."""

    ATTACHED = "attached"
    CACHE = "cache"
    PONG = "pong"
    FIRST = "first"
    PREFILLED = "prefilled"
    EXPORTED = "exported"
    ABORTED = "aborted"
    PINNED = "pinned"
    RECEIVED = "received"
    TOKEN = "token"
    TOKENS = "tokens"
    DONE = "done"
    LOAD = "load"
    FAILED = "failed"
    ERROR = "error"
    REFUSED = "refused"  # control.server's answer to a second gateway
    LOST = "lost"  # the gateway's own word, put in every open inbox when the session is lost


_REQ, _TRANSFER, _COUNT = Text(256), Int(0, 2**63 - 1), Int(0, 2**31 - 1)
_TOKENS = IntList(0, 2**31 - 1)
_CODEC = OneOf(tuple(c.label for c in Codec))
_SAMPLING = Fields(
    {
        "max_tokens": Int(1, 2**31 - 1),
        "temperature": Number(0.0, 100.0),
        "top_p": Number(0.0, 1.0),
        "top_k": Int(0, 2**31 - 1),
        "min_tokens": Int(0, 2**31 - 1),
        "presence_penalty": Number(-2.0, 2.0),
        "frequency_penalty": Number(-2.0, 2.0),
        "seed": Int(-(2**63), 2**63 - 1),
        "stop_token_ids": IntList(0, 2**31 - 1, max_len=4096),
        "ignore_eos": Bool(),
    }
)
WORKER_OPS: dict[str, dict[str, Kind]] = {
    Op.ATTACH: {"gateway": Text()},
    Op.PING: {},
    Op.PREFILL: {
        "req": _REQ,
        "transfer": _TRANSFER,
        "tokens": _TOKENS,
        "sampling": _SAMPLING,
        "kv": Address(),
        "link_start": _COUNT,
        "codec": Optional(_CODEC),
        "import": Optional(_TRANSFER),
        "seen_tokens": Optional(_COUNT),  # the prompt's longest prefix some node stored: a snapshot point
    },
    Op.EXPORT: {
        "req": _REQ,
        "transfer": _TRANSFER,
        "tokens": _TOKENS,
        "length": _COUNT,
        "kv": Address(),
        "codec": Optional(_CODEC),
    },
    Op.DECODE: {"req": _REQ, "transfer": _TRANSFER, "sampling": _SAMPLING, "tokens": _TOKENS, "link_start": _COUNT},
    Op.START: {"req": _REQ, "next_token": _COUNT},
    Op.ABORT: {"req": _REQ},
    Op.LOAD: {"req": _REQ},
}

_BYTES, _SECONDS, _NAME = Int(0, 2**63 - 1), Number(0.0), Text(4096)
_ERROR = Text(MAX_BYTES)  # an exception's text: as long as a frame allows
_CODING = {"codec": _CODEC, "kv_wire_bytes": _BYTES, "kv_encode_s": _SECONDS, "kv_decode_s": _SECONDS}
_CACHE_EVENT = Fields(  # CacheEvent.to_json
    {
        **dict.fromkeys(("kind", "entry", "cluster", "node", "key", "parent"), _NAME),
        "length": _COUNT,
        "nbytes": _BYTES,
        "at": Number(-float("inf")),
    }
)
_TOKEN = {"req": _REQ, "transfer": _TRANSFER, "token": _COUNT, "finish": Nullable(_NAME)}
_TCP_INFO = Fields({f.name: Int(0, 2**64 - 1) for f in fields(TcpInfo)})
WORKER_REPLIES: dict[str, dict[str, Kind]] = {
    Reply.ATTACHED: {
        **dict.fromkeys(("name", "role", "cluster", "model", "kernels"), _NAME),
        "kv": Nullable(Address()),  # where KV for it goes ("" host: the address the gateway dialled)
        "pid": Int(1, 2**31 - 1),
        "codecs": MapOf(ListOf(Number(), max_len=4)),  # codec -> [bytes, wire bytes, encode s, decode s]
        "deadline_s": Number(),
        "max_batch": Optional(_COUNT),  # a decode worker's rows per forward
    },
    Reply.CACHE: {"req": _REQ, "events": ListOf(_CACHE_EVENT)},
    Reply.PONG: {"tcp": Optional(MapOf(_TCP_INFO)), "queued_bytes": Optional(_BYTES)},  # a prefill worker's
    Reply.FIRST: {"req": _REQ, "transfer": _TRANSFER, "next_token": _COUNT},
    Reply.PREFILLED: {
        "req": _REQ,
        "transfer": _TRANSFER,
        "next_token": _COUNT,
        "kv_bytes": _BYTES,
        "cached_tokens": _COUNT,
        "computed_tokens": _COUNT,
        **dict.fromkeys(("queue_s", "prefill_s", "transfer_tail_s", "worker_s"), _SECONDS),
        **_CODING,
    },
    Reply.EXPORTED: {
        "req": _REQ,
        "tokens": _COUNT,
        "bytes": _BYTES,
        **{name: Optional(kind) for name, kind in _CODING.items()},  # none when nothing was sent
    },
    Reply.ABORTED: {"req": _REQ, "tokens": _COUNT, "done_tokens": _COUNT},
    Reply.PINNED: {"req": _REQ, "transfer": _TRANSFER, "tokens": _COUNT},
    Reply.RECEIVED: {"req": _REQ, "transfer": _TRANSFER, "bytes": _BYTES},
    Reply.TOKEN: _TOKEN,
    Reply.TOKENS: {"tokens": ListOf(Fields(_TOKEN))},
    Reply.DONE: {"req": _REQ, "transfer": _TRANSFER, "finish": _NAME},
    Reply.LOAD: {"req": _REQ, "load": Int(0, 2**63 - 1)},
    Reply.FAILED: {"req": _REQ, "transfer": _TRANSFER, "error": _ERROR},
    Reply.ERROR: {"req": _REQ, "error": _ERROR},
}


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
