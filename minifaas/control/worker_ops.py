"""The gateway <-> worker control protocol: one frozen dataclass per message each way, over an authenticated session.

Each message class holds its ``op``; each field declares its bounds (a ``schema`` kind) in its type. ``to_wire``
gives the JSON object ``control.session`` signs and frames (an ``Optional`` field that is None is left out; a
trailing ``_`` is not part of a wire name); ``from_wire`` checks one that came in against its class, as
``schema.check_fields`` does, and builds it. ``OPS`` is what a worker accepts, ``REPLIES`` what it answers.

    attach -> attached (what the worker is), then its pool's inventory as ``cache`` messages
    ping -> pong (TCP_INFO of its KV connections)    load -> load (its queue)    start, abort: no reply
    prefill -> first (the first token, once the forwards are done), prefilled (once the state has gone)
    export -> exported    decode -> pinned, received, token... (a step's, of every request, as one ``tokens``), done
    any request -> failed (it could not be done); a message its class refuses -> error

Cache events (``cache``) belong to no request: they go under the ``req`` CACHE_EVENTS, which the gateway
listens on for as long as the worker runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Annotated, Any, ClassVar, NamedTuple, TypeVar, get_type_hints

from minifaas.codec.codec import Codec
from minifaas.control.schema import (
    Address,
    BadMessage,
    Bool,
    Converted,
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
    check_fields,
)  # fmt: skip
from minifaas.control.session import MAX_BYTES
from minifaas.model.sampling import SamplingParams
from minifaas.net.connections import TcpInfo

CACHE_EVENTS = "@cache"  # no request id starts with "@"
message = dataclass(frozen=True, slots=True, kw_only=True)

REQ, TRANSFER, COUNT = Text(256), Int(0, 2**63 - 1), Int(0, 2**31 - 1)
TOKENS = IntList(0, 2**31 - 1)
CODEC = OneOf(tuple(c.label for c in Codec))
BYTES, SECONDS, NAME = Int(0, 2**63 - 1), Number(0.0), Text(4096)
ERROR = Text(MAX_BYTES)  # an exception's text: as long as a frame allows
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
SAMPLING = Converted(  # the seed on the wire is the one the gateway resolved: both ends sample alike
    _SAMPLING,
    load=lambda d: SamplingParams(**d | {"stop_token_ids": tuple(d["stop_token_ids"])}),
    dump=lambda p: {name: getattr(p, name) for name in _SAMPLING.schema}
    | {"seed": p.resolved_seed, "stop_token_ids": list(p.stop_token_ids)},
)
CACHE_EVENT = Fields(  # CacheEvent.to_json
    {
        **dict.fromkeys(("kind", "entry", "cluster", "node", "key", "parent"), NAME),
        "length": COUNT,
        "nbytes": BYTES,
        "at": Number(-float("inf")),
    }
)
TCP_INFO = Fields({f.name: Int(0, 2**64 - 1) for f in fields(TcpInfo)})


def kinds(cls: type) -> dict[str, Kind]:
    """A message class's fields, by wire name, and the kind each must be."""
    hints = get_type_hints(cls, include_extras=True)
    return {name.rstrip("_"): hint.__metadata__[0] for name, hint in hints.items() if hasattr(hint, "__metadata__")}


# What the gateway asks of a worker.


@message
class Attach:
    op: ClassVar[str] = "attach"
    gateway: Annotated[str, Text()]


@message
class Ping:
    op: ClassVar[str] = "ping"


@message
class Prefill:
    op: ClassVar[str] = "prefill"
    req: Annotated[str, REQ]
    transfer: Annotated[int, TRANSFER]
    tokens: Annotated[list[int], TOKENS]
    sampling: Annotated[SamplingParams, SAMPLING]
    kv: Annotated[list, Address()]  # [host, port] to stream the state to
    link_start: Annotated[int, COUNT]  # the decode node holds the KV of tokens before it
    codec: Annotated[str | None, Optional(CODEC)] = None
    seen_tokens: Annotated[int | None, Optional(COUNT)] = None  # the prompt's longest prefix some node stored
    import_: Annotated[int | None, Optional(TRANSFER)] = None  # the transfer a cache move brings its prefix in


@message
class Export:
    op: ClassVar[str] = "export"
    req: Annotated[str, REQ]
    transfer: Annotated[int, TRANSFER]
    tokens: Annotated[list[int], TOKENS]
    length: Annotated[int, COUNT]
    kv: Annotated[list, Address()]
    codec: Annotated[str | None, Optional(CODEC)] = None


@message
class Decode:
    op: ClassVar[str] = "decode"
    req: Annotated[str, REQ]
    transfer: Annotated[int, TRANSFER]
    sampling: Annotated[SamplingParams, SAMPLING]
    tokens: Annotated[list[int], TOKENS]
    link_start: Annotated[int, COUNT]


@message
class Start:
    op: ClassVar[str] = "start"
    req: Annotated[str, REQ]
    next_token: Annotated[int, COUNT]


@message
class Abort:
    op: ClassVar[str] = "abort"
    req: Annotated[str, REQ]


@message
class Load:
    op: ClassVar[str] = "load"
    req: Annotated[str, REQ]


# What a worker answers.


@message
class Attached:
    op: ClassVar[str] = "attached"
    name: Annotated[str, NAME]
    role: Annotated[str, NAME]
    cluster: Annotated[str, NAME]
    model: Annotated[str, NAME]
    max_batch: Annotated[int | None, Optional(COUNT)] = None  # a decode worker's rows per forward
    kv: Annotated[list | None, Nullable(Address())]  # where KV for it goes ("" host: the address the gateway dialled)
    pid: Annotated[int, Int(1, 2**31 - 1)]
    codecs: Annotated[dict, MapOf(ListOf(Number(), max_len=4))]  # codec -> [bytes, wire bytes, encode s, decode s]
    kernels: Annotated[str, NAME]
    deadline_s: Annotated[float, Number()]


@message
class CacheEvents:
    op: ClassVar[str] = "cache"
    req: Annotated[str, REQ]
    events: Annotated[list[dict], ListOf(CACHE_EVENT)]


@message
class Pong:
    op: ClassVar[str] = "pong"
    tcp: Annotated[dict | None, Optional(MapOf(TCP_INFO))] = None  # a prefill worker's
    queued_bytes: Annotated[int | None, Optional(BYTES)] = None


@message
class First:
    op: ClassVar[str] = "first"
    req: Annotated[str, REQ]
    transfer: Annotated[int, TRANSFER]
    next_token: Annotated[int, COUNT]


@message
class Prefilled:
    op: ClassVar[str] = "prefilled"
    req: Annotated[str, REQ]
    transfer: Annotated[int, TRANSFER]
    next_token: Annotated[int, COUNT]
    kv_bytes: Annotated[int, BYTES]
    cached_tokens: Annotated[int, COUNT]
    computed_tokens: Annotated[int, COUNT]
    queue_s: Annotated[float, SECONDS]
    prefill_s: Annotated[float, SECONDS]
    transfer_tail_s: Annotated[float, SECONDS]
    worker_s: Annotated[float, SECONDS]
    codec: Annotated[str, CODEC]
    kv_wire_bytes: Annotated[int, BYTES]
    kv_encode_s: Annotated[float, SECONDS]
    kv_decode_s: Annotated[float, SECONDS]


@message
class Exported:
    op: ClassVar[str] = "exported"
    req: Annotated[str, REQ]
    tokens: Annotated[int, COUNT]
    bytes: Annotated[int, BYTES]
    codec: Annotated[str | None, Optional(CODEC)] = None  # these four: none when nothing was sent
    kv_wire_bytes: Annotated[int | None, Optional(BYTES)] = None
    kv_encode_s: Annotated[float | None, Optional(SECONDS)] = None
    kv_decode_s: Annotated[float | None, Optional(SECONDS)] = None


@message
class Aborted:
    op: ClassVar[str] = "aborted"
    req: Annotated[str, REQ]
    tokens: Annotated[int, COUNT]
    done_tokens: Annotated[int, COUNT]


@message
class Pinned:
    op: ClassVar[str] = "pinned"
    req: Annotated[str, REQ]
    transfer: Annotated[int, TRANSFER]
    tokens: Annotated[int, COUNT]


@message
class Received:
    op: ClassVar[str] = "received"
    req: Annotated[str, REQ]
    transfer: Annotated[int, TRANSFER]
    bytes: Annotated[int, BYTES]


class Token(NamedTuple):
    """A request's token of one decode step: an entry of ``Tokens``, a tuple since one goes per row per step."""

    req: Annotated[str, REQ]
    transfer: Annotated[int, TRANSFER]
    token: Annotated[int, COUNT]
    finish: Annotated[str | None, Nullable(NAME)]
    op = "token"


TOKEN_ENTRIES = Converted(
    ListOf(Fields(kinds(Token))),
    load=lambda entries: [Token(**entry) for entry in entries],
    dump=lambda tokens: [t._asdict() for t in tokens],
)


@message
class Tokens:
    op: ClassVar[str] = "tokens"
    tokens: Annotated[list[Token], TOKEN_ENTRIES]


@message
class Done:
    op: ClassVar[str] = "done"
    req: Annotated[str, REQ]
    transfer: Annotated[int, TRANSFER]
    finish: Annotated[str, NAME]


@message
class LoadReply:
    op: ClassVar[str] = "load"
    req: Annotated[str, REQ]
    load: Annotated[int, Int(0, 2**63 - 1)]


@message
class Failed:
    op: ClassVar[str] = "failed"
    req: Annotated[str, REQ]
    transfer: Annotated[int, TRANSFER]
    error: Annotated[str, ERROR]


@message
class Error:
    op: ClassVar[str] = "error"
    req: Annotated[str, REQ]
    error: Annotated[str, ERROR]


OpMessage = Attach | Ping | Prefill | Export | Decode | Start | Abort | Load
ReplyMessage = (
    Attached | CacheEvents | Pong | First | Prefilled | Exported | Aborted | Pinned | Received | Token | Tokens | Done
    | LoadReply | Failed | Error
)  # fmt: skip
OPS: dict[str, type[OpMessage]] = {cls.op: cls for cls in OpMessage.__args__}
REPLIES: dict[str, type[ReplyMessage]] = {cls.op: cls for cls in ReplyMessage.__args__ if cls is not Token}


class _Wire(NamedTuple):
    schema: dict[str, Kind]  # by wire name, "op" first
    fields: list[tuple[str, str, Kind]]  # (attribute, wire name, kind)


def _wire(cls: type) -> _Wire:
    by_key = kinds(cls)
    keys = [f.name.rstrip("_") for f in fields(cls)]
    return _Wire({"op": Text(), **by_key}, [(f.name, key, by_key[key]) for f, key in zip(fields(cls), keys)])


_WIRE = {cls: _wire(cls) for cls in (*OPS.values(), *REPLIES.values())}
M = TypeVar("M")


def to_wire(msg: Any) -> dict:
    """The JSON object ``msg`` is on the wire."""
    wire = {"op": msg.op}
    for name, key, kind in _WIRE[type(msg)].fields:
        value = getattr(msg, name)
        if value is None and isinstance(kind, Optional):
            continue
        wire[key] = kind.dump(value) if isinstance(kind, Converted) else value
    return wire


def from_wire(raw: dict, messages: Mapping[str, type[M]]) -> M:
    """The message ``raw`` is, if its op is one of ``messages`` and its class allows every field; else BadMessage."""
    op = raw.get("op")
    if not isinstance(op, str) or op not in messages:
        raise BadMessage(f"unknown op {op!r}"[:100])
    cls = messages[op]
    wire = _WIRE[cls]
    check_fields(raw, wire.schema)
    values = {}
    for name, key, kind in wire.fields:
        if key in raw:
            values[name] = raw[key] if not isinstance(kind, Converted) else _load(kind, key, raw[key])
    return cls(**values)


def _load(kind: Converted, key: str, value: object) -> object:
    try:
        return kind.load(value)
    except ValueError as e:  # in bounds field by field, not together (min_tokens over max_tokens, say)
        raise BadMessage(f"{key!r}: {e}"[:200]) from None
