"""The worker protocol's messages: each is, byte for byte, the JSON object written out by hand below (same keys,
same order, same types), reads back as itself, and a message that breaks a bound is refused, naming the field.

``control.session`` signs ``msgspec.json.encode(message)``, so equal bodies are equal frames.
"""

from __future__ import annotations

from dataclasses import fields

import msgspec
import pytest

from minifaas.control.worker_ops import (
    OPS,
    REPLIES,
    Abort,
    Aborted,
    Attach,
    Attached,
    BadMessage,
    CacheEvents,
    Decode,
    Done,
    Error,
    Export,
    Exported,
    Failed,
    First,
    Load,
    LoadReply,
    Ping,
    Pinned,
    Pong,
    Prefill,
    Prefilled,
    Received,
    Sampling,
    Start,
    Taken,
    Token,
    Tokens,
    WireEvent,
    from_wire,
)  # fmt: skip
from minifaas.model.sampling import SamplingParams
from minifaas.net.connections import TcpInfo

P = SamplingParams(max_tokens=9, temperature=0.7, top_p=0.9, top_k=5, min_tokens=2, seed=3, stop_token_ids=(1, 2))
S = {"max_tokens": 9, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_tokens": 2, "presence_penalty": 0.0,
     "frequency_penalty": 0.0, "seed": 3, "stop_token_ids": [1, 2], "ignore_eos": False}  # fmt: skip
EVENT = {"kind": "store", "entry": "block", "cluster": "pd", "node": "n", "key": "ab12", "parent": "", "length": 16,
         "nbytes": 4096, "at": 1.5}  # fmt: skip
CODING = {"codec": "fp8", "kv_wire_bytes": 50, "kv_encode_s": 0.01, "kv_decode_s": 0.02}
TCP = {f.name: 1 for f in fields(TcpInfo)}
PS = Sampling.of(P)

PAIRS = [  # (the message written out by hand, as a dataclass)
    ({"op": "attach", "gateway": "host:1"}, Attach(gateway="host:1")),
    ({"op": "ping"}, Ping()),
    ({"op": "prefill", "req": "r", "transfer": 5, "tokens": [1, 2], "sampling": S, "kv": ["h", 9], "link_start": 0,
      "codec": "none", "seen_tokens": 16, "import": 4},
     Prefill(req="r", transfer=5, tokens=[1, 2], sampling=PS, kv=("h", 9), link_start=0, codec="none",
             seen_tokens=16, import_=4)),
    ({"op": "prefill", "req": "r", "transfer": 5, "tokens": [1], "sampling": S, "kv": ["h", 9], "link_start": 0,
      "codec": "fp8", "seen_tokens": 0},
     Prefill(req="r", transfer=5, tokens=[1], sampling=PS, kv=("h", 9), link_start=0, codec="fp8", seen_tokens=0)),
    ({"op": "export", "req": "r", "transfer": 6, "tokens": [1, 2, 3], "length": 2, "kv": ["h", 9], "codec": "none"},
     Export(req="r", transfer=6, tokens=[1, 2, 3], length=2, kv=("h", 9), codec="none")),
    ({"op": "decode", "req": "r", "transfer": 5, "sampling": S, "tokens": [1, 2], "link_start": 32},
     Decode(req="r", transfer=5, sampling=PS, tokens=[1, 2], link_start=32)),
    ({"op": "start", "req": "r", "next_token": 7}, Start(req="r", next_token=7)),
    ({"op": "abort", "req": "r"}, Abort(req="r")),
    ({"op": "load", "req": "r"}, Load(req="r")),
    ({"op": "attached", "name": "d0", "role": "decode", "cluster": "pd", "model": "m", "max_batch": 8, "kv": ["", 7],
      "pid": 42, "codecs": {}, "kernels": "torch", "deadline_s": 5.0},
     Attached(name="d0", role="decode", cluster="pd", model="m", max_batch=8, kv=("", 7), pid=42, codecs={},
              kernels="torch", deadline_s=5.0)),
    ({"op": "attached", "name": "p0", "role": "prefill", "cluster": "prfaas", "model": "m", "kv": None, "pid": 43,
      "codecs": {"fp8": [100.0, 50.0, 0.01, 0.02]}, "kernels": "fla", "deadline_s": 5},
     Attached(name="p0", role="prefill", cluster="prfaas", model="m", kv=None, pid=43,
              codecs={"fp8": [100.0, 50.0, 0.01, 0.02]}, kernels="fla", deadline_s=5)),
    ({"op": "cache", "req": "@cache", "events": [EVENT]},
     CacheEvents(req="@cache", events=[msgspec.convert(EVENT, WireEvent)])),
    ({"op": "pong"}, Pong()),
    ({"op": "pong", "tcp": {"h:1/0": TCP}, "queued_bytes": 0}, Pong(tcp={"h:1/0": TcpInfo(**TCP)}, queued_bytes=0)),
    ({"op": "first", "req": "r", "transfer": 5, "next_token": 11}, First(req="r", transfer=5, next_token=11)),
    ({"op": "prefilled", "req": "r", "transfer": 5, "next_token": 11, "kv_bytes": 100, "cached_tokens": 16,
      "computed_tokens": 2, "queue_s": 0.0, "prefill_s": 0.5, "transfer_tail_s": 0.25, "worker_s": 1.0, **CODING},
     Prefilled(req="r", transfer=5, next_token=11, kv_bytes=100, cached_tokens=16, computed_tokens=2, queue_s=0.0,
               prefill_s=0.5, transfer_tail_s=0.25, worker_s=1.0, **CODING)),
    ({"op": "exported", "req": "r", "tokens": 0, "bytes": 0}, Exported(req="r", tokens=0, bytes=0)),
    ({"op": "exported", "req": "r", "tokens": 16, "bytes": 100} | CODING,
     Exported(req="r", tokens=16, bytes=100, **CODING)),
    ({"op": "aborted", "req": "r", "tokens": 90, "done_tokens": 64}, Aborted(req="r", tokens=90, done_tokens=64)),
    ({"op": "pinned", "req": "r", "transfer": 5, "tokens": 32}, Pinned(req="r", transfer=5, tokens=32)),
    ({"op": "received", "req": "r", "transfer": 5, "bytes": 100}, Received(req="r", transfer=5, bytes=100)),
    ({"op": "tokens", "tokens": [{"req": "a", "transfer": 5, "token": 3, "finish": None},
                                 {"req": "b", "transfer": 6, "token": 4, "finish": "length"}]},
     Tokens(tokens=[Token("a", 5, 3, None), Token("b", 6, 4, "length")])),
    ({"op": "done", "req": "r", "transfer": 5, "finish": "stop"}, Done(req="r", transfer=5, finish="stop")),
    ({"op": "load", "req": "r", "load": 3}, LoadReply(req="r", load=3)),
    ({"op": "failed", "req": "r", "transfer": 5, "error": "OSError: gone"},
     Failed(req="r", transfer=5, error="OSError: gone")),
    ({"op": "error", "req": "", "error": "unknown op 'x'"}, Error(req="", error="unknown op 'x'")),
    ({"op": "refused", "error": "another client (a:1) is attached"}, Taken(error="another client (a:1) is attached")),
]  # fmt: skip


def body(message: object) -> bytes:
    return msgspec.json.encode(message)  # what control.session signs


@pytest.mark.parametrize(("written", "message"), PAIRS, ids=[type(m).__name__ for _, m in PAIRS])
def test_a_message_is_the_bytes_of_its_dict_written_out_and_reads_as_itself(written: dict, message: object) -> None:
    assert body(message) == body(written)
    table = OPS if type(message) in OPS.values() else REPLIES
    assert from_wire(written, table) == message
    assert from_wire(msgspec.json.decode(body(message)), table) == message


def test_every_op_and_reply_is_covered_and_the_sampling_crosses_whole() -> None:
    assert {type(m) for _, m in PAIRS} == {*OPS.values(), *REPLIES.values()}
    assert PS.params() == P and msgspec.to_builtins(PS) == S


PRE = {"op": "prefill", "req": "r", "transfer": 5, "tokens": [1, 2], "sampling": S, "kv": ["h", 9], "link_start": 0}


@pytest.mark.parametrize(
    ("raw", "table", "why"),
    [
        ({**PRE, "transfer": -1}, OPS, "Expected `int` >= 0 - at `$.transfer`"),
        ({**PRE, "colour": "red"}, OPS, "Object contains unknown field `colour`"),
        ({k: v for k, v in PRE.items() if k != "kv"}, OPS, "Object missing required field `kv`"),
        ({**PRE, "import": 2**63}, OPS, "Expected `int` <= 9223372036854775807 - at `$.import`"),
        ({**PRE, "import_": 3}, OPS, "Object contains unknown field `import_`"),
        ({**PRE, "codec": "zip"}, OPS, "Invalid enum value 'zip' - at `$.codec`"),
        ({**PRE, "kv": ["h", 0]}, OPS, "Expected `int` >= 1 - at `$.kv[1]`"),
        ({**PRE, "tokens": [1, True]}, OPS, "Expected `int`, got `bool` - at `$.tokens[1]`"),
        ({**PRE, "sampling": {**S, "top_p": 1.5}}, OPS, "Expected `float` <= 1.0 - at `$.sampling.top_p`"),
        ({**PRE, "sampling": {**S, "extra": 1}}, OPS, "Object contains unknown field `extra` - at `$.sampling`"),
        ({"op": "nope"}, OPS, "unknown op 'nope'"),
        ({"op": "attached"}, OPS, "unknown op 'attached'"),
        ({"op": "prefill", "req": "r"}, REPLIES, "unknown op 'prefill'"),
        ({"op": "start", "req": "r", "next_token": 1e308}, OPS, "Expected `int`, got `float` - at `$.next_token`"),
        ({"op": "tokens", "tokens": [{"req": "r", "transfer": 1, "token": -3, "finish": None}]}, REPLIES,
         "Expected `int` >= 0 - at `$.tokens[0].token`"),
        ({"op": "tokens", "tokens": [{"req": "r", "transfer": 1, "token": 3}]}, REPLIES,
         "Object missing required field `finish` - at `$.tokens[0]`"),
        ({"op": "done", "req": "r", "transfer": 1, "finish": None}, REPLIES,
         "Expected `str`, got `null` - at `$.finish`"),
        ({"op": "pong", "queued_bytes": -1}, REPLIES, "Expected `int` >= 0 - at `$.queued_bytes`"),
    ],
)  # fmt: skip
def test_a_message_out_of_bounds_is_refused_naming_the_field(raw: dict, table: dict, why: str) -> None:
    with pytest.raises(BadMessage) as refused:
        from_wire(raw, table)
    assert str(refused.value) == why


def test_sampling_the_bounds_allow_but_sampling_params_refuses_is_a_bad_message() -> None:
    with pytest.raises(BadMessage, match=r"top_p must be in \(0, 1\], got 0.0 - at `\$.sampling`"):
        from_wire({**PRE, "sampling": {**S, "top_p": 0.0}}, OPS)


@pytest.mark.parametrize(("field", "value"), [("kind", "stored"), ("key", "not hex")])
def test_a_cache_event_the_fields_allow_but_cache_event_refuses_is_a_bad_message(field: str, value: str) -> None:
    with pytest.raises(BadMessage):
        from_wire({"op": "cache", "req": "@cache", "events": [{**EVENT, field: value}]}, REPLIES)


def test_an_optional_field_sent_as_null_reads_as_left_out() -> None:
    assert from_wire({"op": "pong", "queued_bytes": None}, REPLIES) == Pong()
