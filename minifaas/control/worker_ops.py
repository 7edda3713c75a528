"""The gateway <-> worker control protocol: one frozen dataclass per message each way, over an authenticated session.

Each field declares its bounds (a ``Kind``) in its type; ``to_wire`` and ``from_wire`` convert a message to and
from the JSON a session carries, refusing with ``BadMessage`` a field its class does not allow. Every field is
required unless ``Optional``, an unknown field is refused, and values are bounded and finite, so no value in a
validated message can make a handler raise. ``OPS`` is what a worker accepts, ``REPLIES`` what it answers.

    attach -> attached (what the worker is), then its pool's inventory as ``cache`` messages; refused if taken
    ping -> pong (TCP_INFO of its KV connections)    load -> load (its queue)    start, abort: no reply
    prefill -> first (the first token, once the forwards are done), prefilled (once the state has gone)
    export -> exported    decode -> pinned, received, token... (a step's, of every request, as one ``tokens``), done
    any request -> failed (it could not be done); a message its class refuses -> error
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Annotated, Any, ClassVar, NamedTuple, TypeVar, get_type_hints

from minifaas.cache.prefix_index import CacheEvent
from minifaas.codec.codec import Codec
from minifaas.control.session import MAX_BYTES
from minifaas.model.sampling import SamplingParams
from minifaas.net.connections import TcpInfo


class BadMessage(ValueError):
    """A control message that its op's schema does not allow."""


class Kind:
    def check(self, value: object) -> str | None:
        """Why ``value`` is not of this kind, or None."""
        raise NotImplementedError


@dataclass(frozen=True)
class Int(Kind):
    lo: int = 0
    hi: int = 2**63 - 1

    def check(self, value: object) -> str | None:
        if not isinstance(value, int) or isinstance(value, bool):
            return f"an integer, not {type(value).__name__}"
        return None if self.lo <= value <= self.hi else f"{value} is outside [{self.lo}, {self.hi}]"


@dataclass(frozen=True)
class Number(Kind):
    lo: float = 0.0
    hi: float = math.inf

    def check(self, value: object) -> str | None:
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            return f"a finite number, not {value!r}"[:80]
        return None if self.lo <= value <= self.hi else f"{value} is outside [{self.lo}, {self.hi}]"


@dataclass(frozen=True)
class Bool(Kind):
    def check(self, value: object) -> str | None:
        return None if isinstance(value, bool) else f"true or false, not {type(value).__name__}"


@dataclass(frozen=True)
class Text(Kind):
    max_len: int = 256

    def check(self, value: object) -> str | None:
        if not isinstance(value, str):
            return f"a string, not {type(value).__name__}"
        return None if len(value) <= self.max_len else f"a string of {len(value)} characters (at most {self.max_len})"


@dataclass(frozen=True)
class OneOf(Kind):
    """One of a few names (a codec, a mode): a name the table lacks is refused here, not deep in a handler."""

    names: tuple[str, ...]

    def check(self, value: object) -> str | None:
        return None if value in self.names else f"one of {', '.join(self.names)}, not {value!r}"[:120]


@dataclass(frozen=True)
class IntList(Kind):
    lo: int = 0
    hi: int = 2**31 - 1
    max_len: int = 1 << 24

    def check(self, value: object) -> str | None:
        if not isinstance(value, list) or len(value) > self.max_len:
            return f"a list of at most {self.max_len} integers"
        item = Int(self.lo, self.hi)
        return next((f"item {i}: {why}" for i, v in enumerate(value) if (why := item.check(v))), None)


@dataclass(frozen=True)
class ListOf(Kind):
    """A list of values of one kind."""

    item: Kind
    max_len: int = 1 << 24

    def check(self, value: object) -> str | None:
        if not isinstance(value, list) or len(value) > self.max_len:
            return f"a list of at most {self.max_len} items"
        check = self.item.check  # a plain loop: a decode step's tokens pass here, one item per request
        for i, v in enumerate(value):
            if why := check(v):
                return f"item {i}: {why}"[:200]
        return None


@dataclass(frozen=True)
class MapOf(Kind):
    """An object whose keys are any short strings, each value of one kind."""

    value: Kind
    max_len: int = 1 << 16
    key: Kind = Text(1024)

    def check(self, value: object) -> str | None:
        if not isinstance(value, dict) or len(value) > self.max_len:
            return f"an object of at most {self.max_len} entries"
        bad = ((k, why) for k, v in value.items() if (why := self.key.check(k) or self.value.check(v)))
        return next((f"{k!r}: {why}"[:200] for k, why in bad), None)


@dataclass(frozen=True)
class Address(Kind):
    """[host, port]: where to send something."""

    def check(self, value: object) -> str | None:
        if not isinstance(value, list) or len(value) != 2:
            return "[host, port]"
        return Text(253).check(value[0]) or Int(1, 65535).check(value[1])


@dataclass(frozen=True)
class Optional(Kind):
    kind: Kind

    def check(self, value: object) -> str | None:
        return self.kind.check(value)


@dataclass(frozen=True)
class Nullable(Kind):
    """null, or a value of ``kind`` (the field itself is required unless also Optional)."""

    kind: Kind

    def check(self, value: object) -> str | None:
        return None if value is None else self.kind.check(value)


@dataclass(frozen=True)
class Fields(Kind):
    """A nested object with a schema of its own."""

    schema: Mapping[str, Kind]

    def check(self, value: object) -> str | None:
        if not isinstance(value, dict):
            return f"an object, not {type(value).__name__}"
        try:
            check_fields(value, self.schema)
        except BadMessage as e:
            return str(e)
        return None


@dataclass(frozen=True)
class Converted(Kind):
    """A value of ``kind`` on the wire that is another type in Python: ``load`` makes it, ``dump`` undoes it."""

    kind: Kind
    load: Callable[[object], object]
    dump: Callable[[object], object]

    def check(self, value: object) -> str | None:
        return self.kind.check(value)


def check_fields(message: dict, schema: Mapping[str, Kind]) -> None:
    if not message.keys() <= schema.keys():
        raise BadMessage(f"unknown fields {sorted(message.keys() - schema.keys())}"[:200])
    for name, kind in schema.items():
        if name not in message:
            if isinstance(kind, Optional):
                continue
            raise BadMessage(f"{name!r} is missing")
        why = kind.check(message[name])
        if why is not None:
            raise BadMessage(f"{name!r} must be {why}")


CACHE_EVENTS = "@cache"  # the id cache events go under: they belong to no request, and no request id starts with "@"
message = dataclass(frozen=True, slots=True, kw_only=True)

Req = Annotated[str, Text(256)]  # a request id
TransferId = Annotated[int, Int(0, 2**63 - 1)]
Count = Annotated[int, Int(0, 2**31 - 1)]  # of tokens
TokenIds = Annotated[list[int], IntList(0, 2**31 - 1)]
Bytes = Annotated[int, Int(0, 2**63 - 1)]
Seconds = Annotated[float, Number(0.0)]
Name = Annotated[str, Text(4096)]
Why = Annotated[str, Text(MAX_BYTES)]  # an exception's text: as long as a frame allows
CODEC = OneOf(tuple(c.label for c in Codec))
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
    dump=lambda p: (
        {name: getattr(p, name) for name in _SAMPLING.schema}
        | {"seed": p.resolved_seed, "stop_token_ids": list(p.stop_token_ids)}
    ),
)
_CACHE_EVENT = Fields(  # CacheEvent.to_json
    {
        **dict.fromkeys(("kind", "entry", "cluster", "node", "key", "parent"), Text(4096)),
        "length": Int(0, 2**31 - 1),
        "nbytes": Int(0, 2**63 - 1),
        "at": Number(-float("inf")),
    }
)
EVENT_LIST = Converted(
    ListOf(_CACHE_EVENT),
    load=lambda events: [CacheEvent.from_json(e) for e in events],
    dump=lambda events: [e.to_json() for e in events],
)
TCP_INFO = Fields({f.name: Int(0, 2**64 - 1) for f in fields(TcpInfo)})


def field_kinds(cls: type) -> dict[str, Kind]:
    """A message class's fields by wire name (a trailing ``_`` dropped), each with the kind it must be."""
    hints = get_type_hints(cls, include_extras=True)
    return {name.rstrip("_"): hint.__metadata__[0] for name, hint in hints.items() if hasattr(hint, "__metadata__")}


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
    req: Req
    transfer: TransferId
    tokens: TokenIds
    sampling: Annotated[SamplingParams, SAMPLING]
    kv: Annotated[list, Address()]  # [host, port] to stream the state to
    link_start: Count  # the decode node holds the KV of the tokens before it
    codec: Annotated[str | None, Optional(CODEC)] = None
    seen_tokens: Annotated[int | None, Optional(Int(0, 2**31 - 1))] = None  # the longest prefix some node stored
    import_: Annotated[int | None, Optional(Int(0, 2**63 - 1))] = None  # the transfer a cache move brings in


@message
class Export:
    op: ClassVar[str] = "export"
    req: Req
    transfer: TransferId
    tokens: TokenIds
    length: Count
    kv: Annotated[list, Address()]
    codec: Annotated[str | None, Optional(CODEC)] = None


@message
class Decode:
    op: ClassVar[str] = "decode"
    req: Req
    transfer: TransferId
    sampling: Annotated[SamplingParams, SAMPLING]
    tokens: TokenIds
    link_start: Count


@message
class Start:
    op: ClassVar[str] = "start"
    req: Req
    next_token: Count


@message
class Abort:
    op: ClassVar[str] = "abort"
    req: Req


@message
class Load:
    op: ClassVar[str] = "load"
    req: Req


@message
class Attached:
    op: ClassVar[str] = "attached"
    name: Name
    role: Name
    cluster: Name
    model: Name
    max_batch: Annotated[int | None, Optional(Int(0, 2**31 - 1))] = None  # a decode worker's rows per forward
    kv: Annotated[list | None, Nullable(Address())]  # where KV for it goes ("" host: the address the gateway dialled)
    pid: Annotated[int, Int(1, 2**31 - 1)]
    codecs: Annotated[dict, MapOf(ListOf(Number(), max_len=4))]  # codec -> [bytes, wire bytes, encode s, decode s]
    kernels: Name
    deadline_s: Annotated[float, Number()]


@message
class CacheEvents:
    op: ClassVar[str] = "cache"
    req: Req
    events: Annotated[list[CacheEvent], EVENT_LIST]


@message
class Pong:
    op: ClassVar[str] = "pong"
    tcp: Annotated[dict | None, Optional(MapOf(TCP_INFO))] = None  # a prefill worker's
    queued_bytes: Annotated[int | None, Optional(Int(0, 2**63 - 1))] = None


@message
class First:
    op: ClassVar[str] = "first"
    req: Req
    transfer: TransferId
    next_token: Count


@message
class Prefilled:
    op: ClassVar[str] = "prefilled"
    req: Req
    transfer: TransferId
    next_token: Count
    kv_bytes: Bytes
    cached_tokens: Count
    computed_tokens: Count
    queue_s: Seconds
    prefill_s: Seconds
    transfer_tail_s: Seconds
    worker_s: Seconds
    codec: Annotated[str, CODEC]
    kv_wire_bytes: Bytes
    kv_encode_s: Seconds
    kv_decode_s: Seconds


@message
class Exported:
    op: ClassVar[str] = "exported"
    req: Req
    tokens: Count
    bytes: Bytes
    codec: Annotated[str | None, Optional(CODEC)] = None  # these four: none when nothing was sent
    kv_wire_bytes: Annotated[int | None, Optional(Int(0, 2**63 - 1))] = None
    kv_encode_s: Annotated[float | None, Optional(Number(0.0))] = None
    kv_decode_s: Annotated[float | None, Optional(Number(0.0))] = None


@message
class Aborted:
    op: ClassVar[str] = "aborted"
    req: Req
    tokens: Count
    done_tokens: Count


@message
class Pinned:
    op: ClassVar[str] = "pinned"
    req: Req
    transfer: TransferId
    tokens: Count


@message
class Received:
    op: ClassVar[str] = "received"
    req: Req
    transfer: TransferId
    bytes: Bytes


class Token(NamedTuple):
    """A request's token of one decode step: an entry of ``Tokens``, a tuple since one goes per row per step."""

    req: Req
    transfer: TransferId
    token: Count
    finish: Annotated[str | None, Nullable(Text(4096))]
    op = "token"


TOKEN_ENTRIES = Converted(
    ListOf(Fields(field_kinds(Token))),
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
    req: Req
    transfer: TransferId
    finish: Name


@message
class LoadReply:
    op: ClassVar[str] = "load"
    req: Req
    load: Annotated[int, Int(0, 2**63 - 1)]


@message
class Failed:
    op: ClassVar[str] = "failed"
    req: Req
    transfer: TransferId
    error: Why


@message
class Error:
    op: ClassVar[str] = "error"
    req: Req
    error: Why


@message
class Taken:
    """A worker's answer to a gateway that would attach while another is attached (from ``control.server``)."""

    op: ClassVar[str] = "refused"
    error: Why


OpMessage = Attach | Ping | Prefill | Export | Decode | Start | Abort | Load
ReplyMessage = (
    Attached | CacheEvents | Pong | First | Prefilled | Exported | Aborted | Pinned | Received | Token | Tokens | Done
    | LoadReply | Failed | Error | Taken
)  # fmt: skip
OPS: dict[str, type[OpMessage]] = {cls.op: cls for cls in OpMessage.__args__}
REPLIES: dict[str, type[ReplyMessage]] = {cls.op: cls for cls in ReplyMessage.__args__ if cls is not Token}
_SCHEMAS = {cls: {"op": Text(), **field_kinds(cls)} for cls in (*OPS.values(), *REPLIES.values())}  # by wire name
_FIELDS = {  # (attribute, wire name, kind), in the order they go on the wire
    cls: [(f.name, f.name.rstrip("_"), schema[f.name.rstrip("_")]) for f in fields(cls)]
    for cls, schema in _SCHEMAS.items()
}
M = TypeVar("M")


def to_wire(msg: Any) -> dict:
    """The JSON object ``msg`` is on the wire."""
    wire = {"op": msg.op}
    for name, key, kind in _FIELDS[type(msg)]:
        value = getattr(msg, name)
        if value is not None or not isinstance(kind, Optional):
            wire[key] = kind.dump(value) if isinstance(kind, Converted) else value
    return wire


def from_wire(raw: dict, messages: Mapping[str, type[M]]) -> M:
    """The message ``raw`` is, if its op is one of ``messages`` and its class allows every field; else BadMessage."""
    op = raw.get("op")
    if not isinstance(op, str) or op not in messages:
        raise BadMessage(f"unknown op {op!r}"[:100])
    cls = messages[op]
    check_fields(raw, _SCHEMAS[cls])
    values = {}
    try:
        for name, key, kind in _FIELDS[cls]:
            if key in raw:  # else an Optional field left out: None
                values[name] = kind.load(raw[key]) if isinstance(kind, Converted) else raw[key]
    except ValueError as e:  # each field in bounds, not all together (min_tokens over max_tokens, say)
        raise BadMessage(str(e)[:200]) from None
    return cls(**values)
