"""The gateway <-> worker control protocol: what each message holds, over an authenticated session.

Messages are small dicts with an ``op`` and usually a ``req`` (request id),
signed and framed by ``minifaas.control.session``; bulk state never goes here
(it goes over the KV transport). ``WORKER_OPS`` is everything a worker accepts,
field by field; a worker checks each message against it before it acts on it.

    attach   the gateway takes over the session; the worker answers ``attached``
             (name, role, cluster, model, KV address, pid) and its pool's inventory
    ping     -> ``pong`` (the TCP_INFO of the worker's KV connections)
    prefill  compute a prompt and stream its state to ``kv``; -> ``first`` (the first token, as soon as
             the forwards are done), then ``prefilled`` once the state has gone
    export   send a cached prefix to another cluster's node; -> ``exported``
    decode   expect the state of ``transfer`` and decode it; -> ``token``..., ``done``
    start    the first token of a request whose state has arrived
    abort    stop a request, wherever it is
    load     -> ``load``: prompt tokens queued (prefill) or requests decoding

A worker's prefix cache events, ``{"op": "cache", "events": [...]}``, belong to
no request: they go under the ``req`` CACHE_EVENTS, which the gateway listens
on for as long as the worker runs.
"""

from __future__ import annotations

from minifaas.codec.codec import Codec
from minifaas.control.schema import Address, Bool, Fields, Int, IntList, Kind, Number, OneOf, Optional, Text
from minifaas.model.sampling import SamplingParams

CACHE_EVENTS = "@cache"  # no request id starts with "@"

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
    "attach": {"gateway": Text()},
    "ping": {},
    "prefill": {
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
    "export": {
        "req": _REQ,
        "transfer": _TRANSFER,
        "tokens": _TOKENS,
        "length": _COUNT,
        "kv": Address(),
        "codec": Optional(_CODEC),
    },
    "decode": {"req": _REQ, "transfer": _TRANSFER, "sampling": _SAMPLING, "tokens": _TOKENS, "link_start": _COUNT},
    "start": {"req": _REQ, "next_token": _COUNT},
    "abort": {"req": _REQ},
    "load": {"req": _REQ},
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
