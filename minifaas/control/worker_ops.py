"""The gateway <-> worker control protocol: one frozen msgspec Struct per message each way, over a session.

A message's class is its ``op`` on the wire, and each field's type carries its bounds. A session sends a
message as its JSON object; ``from_wire`` reads one back as the class its op names, refusing with ``BadMessage``
an unknown op or field, a missing one, or a value out of bounds, so no value in a message that was read can make
a handler raise. ``OPS`` is what a worker accepts, ``REPLIES`` what it answers.

    attach -> attached (what the worker is), then its pool's inventory as ``cache`` messages; refused if taken
    ping -> pong (TCP_INFO of its KV connections)    load -> load (its queue)    start, abort: no reply
    prefill -> first (the first token, once the forwards are done), prefilled (once the state has gone)
    export -> exported    decode -> pinned, received, token... (a step's, of every request, as one ``tokens``), done
    any request -> failed (it could not be done); a message its class refuses -> error
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, ClassVar, Literal, TypeVar, get_args

import msgspec
from msgspec import Meta, Struct, field

from minifaas.cache.prefix_index import CacheEvent, EntryKind, EventKind
from minifaas.codec.codec import Codec
from minifaas.control.server import Taken
from minifaas.control.session import Message, Why
from minifaas.model.sampling import MAX_PENALTY, SamplingParams
from minifaas.net.address import Address
from minifaas.net.connections import TcpInfo


class BadMessage(ValueError):
    """A control message that its op's class does not allow."""


CACHE_EVENTS = "@cache"  # the id cache events go under: they belong to no request, and no request id starts with "@"

Req = Annotated[str, Meta(max_length=256)]  # a request id
TransferId = Annotated[int, Meta(ge=0, le=2**63 - 1)]
Count = Annotated[int, Meta(ge=0, le=2**31 - 1)]  # of tokens
TokenIds = Annotated[list[Count], Meta(max_length=1 << 24)]
Bytes = Annotated[int, Meta(ge=0, le=2**63 - 1)]
Seconds = Annotated[float, Meta(ge=0.0)]
Name = Annotated[str, Meta(max_length=4096)]
CodecName = Literal[tuple(c.label for c in Codec)]  # type: ignore[valid-type]
Penalty = Annotated[float, Meta(ge=-MAX_PENALTY, le=MAX_PENALTY)]
Hex = Annotated[str, Meta(pattern="^([0-9a-f]{2})*$", max_length=4096)]


class Sampling(Struct, frozen=True, forbid_unknown_fields=True):
    """A request's SamplingParams as they cross, with the seed the gateway resolved: both ends sample alike."""

    max_tokens: Annotated[int, Meta(ge=1, le=2**31 - 1)]
    temperature: Annotated[float, Meta(ge=0.0, le=100.0)]
    top_p: Annotated[float, Meta(ge=0.0, le=1.0)]
    top_k: Count
    min_tokens: Count
    presence_penalty: Penalty
    frequency_penalty: Penalty
    seed: Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
    stop_token_ids: Annotated[list[Count], Meta(max_length=4096)]
    ignore_eos: bool

    def __post_init__(self) -> None:
        self.params()  # what the bounds allow but SamplingParams refuses (min_tokens over max_tokens, say)

    @classmethod
    def of(cls, p: SamplingParams) -> Sampling:
        return cls(p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_tokens, p.presence_penalty,
                   p.frequency_penalty, p.resolved_seed, list(p.stop_token_ids), p.ignore_eos)  # fmt: skip

    def params(self) -> SamplingParams:
        return SamplingParams(**msgspec.structs.asdict(self) | {"stop_token_ids": tuple(self.stop_token_ids)})


class WireEvent(Struct, frozen=True, forbid_unknown_fields=True):
    """A CacheEvent as it crosses, its keys in hex."""

    kind: EventKind
    entry: EntryKind
    cluster: Name
    node: Name
    key: Hex
    parent: Hex
    length: Count
    nbytes: Bytes
    at: float

    @classmethod
    def of(cls, e: CacheEvent) -> WireEvent:
        return cls(e.kind, e.entry, e.pool, e.node, e.key.hex(), e.parent.hex(), e.length, e.nbytes, e.at)

    def event(self) -> CacheEvent:
        key, parent = bytes.fromhex(self.key), bytes.fromhex(self.parent)
        return CacheEvent(self.kind, self.entry, self.cluster, self.node, key, parent, self.length, self.nbytes,
                          self.at)  # fmt: skip


class Attach(Message, tag="attach"):
    gateway: Annotated[str, Meta(max_length=256)]


class Ping(Message, tag="ping"):
    pass


class Prefill(Message, tag="prefill"):
    req: Req
    transfer: TransferId
    tokens: TokenIds
    sampling: Sampling
    kv: Address  # to stream the state to
    link_start: Count  # the decode node holds the KV of the tokens before it
    codec: CodecName | None = None
    seen_tokens: Count | None = None  # the longest prefix some node stored
    import_: TransferId | None = field(default=None, name="import")  # the transfer a cache move brings in


class Export(Message, tag="export"):
    req: Req
    transfer: TransferId
    tokens: TokenIds
    length: Count
    kv: Address
    codec: CodecName | None = None


class Decode(Message, tag="decode"):
    req: Req
    transfer: TransferId
    sampling: Sampling
    tokens: TokenIds
    link_start: Count


class Start(Message, tag="start"):
    req: Req
    next_token: Count


class Abort(Message, tag="abort"):
    req: Req


class Load(Message, tag="load"):
    req: Req


class Attached(Message, tag="attached", kw_only=True):
    name: Name
    role: Name
    cluster: Name
    model: Name
    max_batch: Count | None = None  # a decode worker's rows per forward
    kv: Address | None  # where KV for it goes ("" host: the address the gateway dialled)
    pid: Annotated[int, Meta(ge=1, le=2**31 - 1)]
    # codec -> [bytes, wire bytes, encode s, decode s], each >= 0
    codecs: Annotated[dict[Name, Annotated[list[Seconds], Meta(max_length=4)]], Meta(max_length=1 << 16)]
    kernels: Name
    deadline_s: Seconds


class CacheEvents(Message, tag="cache"):
    req: Req
    events: list[WireEvent]


class Pong(Message, tag="pong"):
    tcp: Annotated[dict[Name, TcpInfo], Meta(max_length=1 << 16)] | None = None  # a prefill worker's
    queued_bytes: Bytes | None = None


class First(Message, tag="first"):
    req: Req
    transfer: TransferId
    next_token: Count


class Prefilled(Message, tag="prefilled"):
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
    codec: CodecName
    kv_wire_bytes: Bytes
    kv_encode_s: Seconds
    kv_decode_s: Seconds


class Exported(Message, tag="exported"):
    req: Req
    tokens: Count
    bytes: Bytes
    codec: CodecName | None = None  # these four: none when nothing was sent
    kv_wire_bytes: Bytes | None = None
    kv_encode_s: Seconds | None = None
    kv_decode_s: Seconds | None = None


class Aborted(Message, tag="aborted"):
    req: Req
    tokens: Count
    done_tokens: Count


class Pinned(Message, tag="pinned"):
    req: Req
    transfer: TransferId
    tokens: Count


class Received(Message, tag="received"):
    req: Req
    transfer: TransferId
    bytes: Bytes


class Token(Struct, frozen=True, forbid_unknown_fields=True):
    """A request's token of one decode step: an entry of ``Tokens``, which carries a step's, one per row."""

    op: ClassVar[str] = "token"  # what a request's inbox sees it as, beside the messages that have a tag
    req: Req
    transfer: TransferId
    token: Count
    finish: Name | None


class Tokens(Message, tag="tokens"):
    tokens: list[Token]


class Done(Message, tag="done"):
    req: Req
    transfer: TransferId
    finish: Name


class LoadReply(Message, tag="load"):
    req: Req
    load: Annotated[int, Meta(ge=0, le=2**63 - 1)]


class Failed(Message, tag="failed"):
    req: Req
    transfer: TransferId
    error: Why


class Error(Message, tag="error"):
    req: Req
    error: Why


OpMessage = Attach | Ping | Prefill | Export | Decode | Start | Abort | Load
ReplyMessage = (
    Attached | CacheEvents | Pong | First | Prefilled | Exported | Aborted | Pinned | Received | Tokens | Done
    | LoadReply | Failed | Error | Taken
)  # fmt: skip
OPS: dict[str, type[OpMessage]] = {cls.__struct_config__.tag: cls for cls in get_args(OpMessage)}
REPLIES: dict[str, type[ReplyMessage]] = {cls.__struct_config__.tag: cls for cls in get_args(ReplyMessage)}
M = TypeVar("M")


def from_wire(raw: dict, messages: Mapping[str, type[M]]) -> M:
    """The message ``raw`` is, if its op is one of ``messages`` and its class allows every field; else BadMessage."""
    op = raw.get("op")
    if not isinstance(op, str) or op not in messages:
        raise BadMessage(f"unknown op {op!r}"[:100])
    try:
        return msgspec.convert(raw, messages[op])
    except msgspec.ValidationError as e:
        raise BadMessage(str(e)[:200]) from None
