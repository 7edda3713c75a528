"""Every model family in models/README.md's coverage table, through prefill, the wire, the prefix caches and decode.

One child process (tests/family_child.py) prefills for every family with the
prefill worker's own PrefillService; this process receives each state with
the real KVReceiver, joined onto the prefix its decode-side cache holds, and
decodes it. Per family: four prompts (a short one, a 40-token one, that one
continued, and a partial branch of it), each decoded greedily here equal to
transformers' ``generate``; the cache hits the pools must give; only the
increment on the wire when the decode side holds a prefix; the four received
states decoded together as rows of one batch equal to one at a time; and
``kv-size`` arithmetic equal to the bytes held.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from family_child import BLOCK, FAMILIES, family_runtime
from weights import weights_digest

from minifaas.cache.pool_config import PoolConfig
from minifaas.commands.main import main
from minifaas.control.worker_ops import Prefill, Sampling
from minifaas.model.batch_decoder import BatchDecoder
from minifaas.model.decoder import DecoderConfig
from minifaas.model.interleaved_decoder import DecodeStream, InterleavedDecoder
from minifaas.model.kv_size import kv_profile
from minifaas.model.layer_state import ModelState, StateKind
from minifaas.model.loader import MODELS_DIR, ModelSpec, load_config_dict
from minifaas.model.reference import reference_tokens
from minifaas.model.runtime import ModelRuntime
from minifaas.model.sampling import SamplingParams
from minifaas.transport.receiver import KVReceiver, ReceiverConfig
from minifaas.worker.prefix_store import DecodePrefixCache

SECRET = b"family-secret-0123456789abcdef01"
CHILD = Path(__file__).with_name("family_child.py")
GREEDY = SamplingParams(max_tokens=8)  # stops at EOS, as generate() does
LETTERS = {StateKind.FULL_ATTENTION: "F", StateKind.SLIDING_WINDOW: "S", StateKind.LINEAR_ATTENTION: "L"}
pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.slow,
]  # every hybrid family through prefill, the wire and decode


def coverage_table() -> dict[str, dict[str, str]]:
    """models/README.md's coverage table: model_type -> its row, by column."""
    lines = (MODELS_DIR / "README.md").read_text().split("## Model coverage", 1)[1].splitlines()
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines if line.startswith("| `")]
    header = ["model_type", "class", "layers", "parts", "real", "coverage"]
    assert [c.strip("`") for c in rows[0]][:1] == header[:1], "the coverage table's header changed"
    return {row[0].strip("`"): dict(zip(header, row, strict=True)) for row in rows[1:]}


TABLE = coverage_table()
FAMILIES_HERE = sorted(p.stem for p in FAMILIES.glob("*.json"))


def tokens(length: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


A = tokens(40, 1)
PROMPTS = {  # name -> (tokens, the prefix length the decode side asks to keep)
    "short": (tokens(5, 2), 0),
    "first": (A, 0),
    "continued": (A + tokens(14, 3), len(A)),  # the whole first prompt again, then more
    "branch": (A[:20] + tokens(17, 4), 20),  # shares 20 tokens, then leaves it
}


class Child:
    """The prefill process: one JSON line in, one out."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(CHILD), SECRET.hex()], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    async def ask(self, msg: dict) -> dict:
        def exchange() -> dict:
            assert self.process.stdin is not None and self.process.stdout is not None
            self.process.stdin.write(json.dumps(msg) + "\n")
            self.process.stdin.flush()
            line = self.process.stdout.readline()
            if not line:
                raise RuntimeError(f"the prefill process ended (exit {self.process.wait(10)})")
            return json.loads(line)

        return await asyncio.to_thread(exchange)


@pytest.fixture(scope="module")
def child() -> Iterator[Child]:
    c = Child()
    try:
        yield c
    finally:
        assert c.process.stdin is not None
        c.process.stdin.close()
        try:
            assert c.process.wait(60) == 0
        finally:
            if c.process.poll() is None:
                c.process.kill()


async def prefill_remotely(child: Child, rt: ModelRuntime) -> dict[str, tuple[dict, ModelState]]:
    """Every prompt through the child, in order; each state received here, joined onto the kept prefix."""
    loaded = await child.ask({"op": "load", "family": rt.spec.name})
    assert loaded["digest"] == weights_digest(rt.model), "the two processes built different weights"
    kept = DecodePrefixCache(PoolConfig("d", 1 << 30, BLOCK), rt.spec.name, rt.layout.kinds, "d")
    out = {}
    async with KVReceiver(ReceiverConfig(SECRET)) as rx:
        for transfer, (name, (ids, keep)) in enumerate(PROMPTS.items()):
            link_start = kept.pin(transfer, ids, keep)
            msg = msgspec.to_builtins(Prefill(req=name, tokens=ids, sampling=Sampling.of(GREEDY), transfer=transfer,
                                  kv=["127.0.0.1", rx.port], link_start=link_start))  # fmt: skip
            reply, state = await asyncio.gather(child.ask(msg), kept.receive(rx.transfer(transfer)))
            out[name] = ({**reply, "link_start": link_start}, state)
    return out


def batched_equals_alone(rt: ModelRuntime, received: dict[str, tuple[dict, ModelState]]) -> None:
    """The received states as rows of one batch (one waits for a free row) decode as each does alone."""
    params = SamplingParams(max_tokens=7, ignore_eos=True)
    arrivals: dict[int, list[tuple]] = {}
    for i, (name, (reply, state)) in enumerate(received.items()):
        arrivals.setdefault(i // 2, []).append((name, state, reply["next_token"], params))

    def drive(decoder: BatchDecoder | InterleavedDecoder) -> dict[str, list[int]]:
        got: dict[str, list[int]] = {}
        step = 0
        while decoder.load or step in arrivals:
            for args in arrivals.get(step, []):
                decoder.submit(*args)
            for t in decoder.step():
                got.setdefault(t.request, []).append(t.token)
            step += 1
        return got

    batch = BatchDecoder(rt, DecoderConfig(max_batch=3))
    assert drive(batch) == drive(InterleavedDecoder(rt)), f"{rt.spec.name}: a batched row decoded differently"
    assert batch.cache.rows == 0


@pytest.mark.parametrize("family", FAMILIES_HERE)
def test_family_round_trip_prefix_and_batch(family: str, child: Child) -> None:
    rt = family_runtime(family)
    row = TABLE[family]
    assert "".join(LETTERS[k] for k in rt.layout.kinds) == row["parts"], f"{family}: state parts in the table"
    if row["coverage"] != "passes":
        with pytest.raises(NotImplementedError, match="outside its cache"):
            rt.prefill(PROMPTS["short"][0])
        return
    received = asyncio.run(asyncio.wait_for(prefill_remotely(child, rt), 240))
    fixed = any(kind is not StateKind.FULL_ATTENTION for kind in rt.layout.kinds)
    # the first prompt's end is a snapshot; below it a hybrid has one only at 32, a dense model any whole block
    hits = {"short": 0, "first": 0, "continued": 40, "branch": 0 if fixed else 16}
    profile = kv_profile(json.loads((FAMILIES / f"{family}.json").read_text()))
    for name, (reply, state) in received.items():
        ids = PROMPTS[name][0]
        assert reply["cached_tokens"] == hits[name], f"{family} {name}: prefix hit"
        assert state.seq_len == len(ids) and state.nbytes == profile.bytes_at(len(ids)), f"{family} {name}: bytes"
        crossed = sum(
            s.nbytes // s.seq_len * (s.seq_len - reply["link_start"]) if s.kind.grows else s.nbytes
            for s in state.layers
        )
        assert reply["kv_bytes"] == crossed, f"{family} {name}: only tokens from {reply['link_start']} cross"
        decoded = DecodeStream(rt, state, reply["next_token"], GREEDY).run()
        expected = reference_tokens(rt, ids, GREEDY)
        assert decoded == expected, f"{family} {name}: decode after the transfer differs from transformers' generate()"
    assert received["continued"][0]["link_start"] == 32  # the first prompt's whole blocks were kept
    batched_equals_alone(rt, received)


def test_the_coverage_table_matches_the_families_and_the_real_configs() -> None:
    from transformers import CONFIG_MAPPING

    assert set(FAMILIES_HERE) <= set(TABLE), "a tiny family with no row in the coverage table"
    passing = {name for name, row in TABLE.items() if row["coverage"] == "passes"}
    assert passing <= set(FAMILIES_HERE), "a row says passes, but no test runs that family"
    for name, row in TABLE.items():
        assert row["coverage"] == "passes" or row["coverage"].startswith("not covered: "), name
        if name not in FAMILIES_HERE:  # no tiny model: only a family transformers does not have
            assert name not in CONFIG_MAPPING and "not in transformers" in row["coverage"], name
        else:
            assert re.fullmatch(r"[FSL]+", row["parts"]), name
    for path in sorted((MODELS_DIR / "configs").glob("*.json")):
        model_type = load_config_dict(ModelSpec.resolve(str(path)))["model_type"]
        assert model_type in TABLE, f"{path.name}: its family ({model_type}) has no row in the coverage table"


def test_kv_size_reads_every_real_config_and_family(capsys: pytest.CaptureFixture[str]) -> None:
    families = [arg for name in FAMILIES_HERE for arg in ("--model", str(FAMILIES / f"{name}.json"))]
    assert main(["kv-size", "--real-configs", *families, "--json", "--lengths", "1024,131072"]) == 0
    out: dict[str, Any] = json.loads(capsys.readouterr().out)
    assert len(out) == len(list((MODELS_DIR / "configs").glob("*.json"))) + len(FAMILIES_HERE)
    falcon = out["tiiuae__Falcon-H1-0.5B.megatron-bridge-test-dict"]["by_kind"]["attention+mamba"]
    assert falcon["layers"] == 36 and falcon["bytes_per_token"] == 36 * 2 * 2 * 64 * 2  # 2 KV heads of 64, bf16
    assert falcon["fixed_bytes"] == 36 * (24 * 64 * 128 * 4 + (1536 + 2 * 128) * 4 * 2)  # fp32 SSM, bf16 conv
    assert out["nemotron_h"]["by_kind"]["none"]["layers"] == 2
