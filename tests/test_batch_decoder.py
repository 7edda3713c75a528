"""Continuous batching decodes every row as if it were alone: tokens, logits, sampling, aborts, bounds."""

from __future__ import annotations

import asyncio
import gc
import math
import threading
import weakref

import pytest
import torch

from minifaas.control.worker_ops import Decode, Sampling, Token
from minifaas.model.batch_cache import BatchCache, PaddedKVLayer
from minifaas.model.batch_decoder import BatchDecoder
from minifaas.model.decoder import DecoderConfig, QueueFull, StepToken
from minifaas.model.family_rows import row_layer
from minifaas.model.host_copy import build_cache
from minifaas.model.interleaved_decoder import DecodeStream, InterleavedDecoder, forward_one
from minifaas.model.layer_state import LayerState, ModelState, StateKind
from minifaas.model.loader import ModelSpec, load_config, preset_names
from minifaas.model.runtime import ModelRuntime
from minifaas.model.sampling import SamplingParams
from minifaas.worker.decode_service import DecodeService

# Lengths straddle mimo-v2-tiny's 65-token window: below it, crossing it while decoding, and past it.
LENGTHS = (3, 70, 20, 60)
MAX_TOKENS = (9, 3, 6, 7)
JOIN_AT = (0, 0, 1, 2)  # step at which each request's state arrives; the last waits for a free row
RUNTIMES: dict[str, ModelRuntime] = {}


def runtime_for(name: str) -> ModelRuntime:
    if name not in RUNTIMES:
        RUNTIMES[name] = ModelRuntime.load(name)
    return RUNTIMES[name]


def prompt(length: int, salt: int = 0) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(length + salt)).tolist()


def drive(decoder: BatchDecoder | InterleavedDecoder, arrivals: dict[int, list[tuple]]) -> dict[str, list[StepToken]]:
    """Submit arrivals[step] before each step until every request is done; the tokens by request."""
    out: dict[str, list[StepToken]] = {}
    step = 0
    while decoder.load or any(s >= step for s in arrivals):
        for args in arrivals.get(step, []):
            decoder.submit(*args)
        for t in decoder.step():
            out.setdefault(t.request, []).append(t)
        step += 1
    return out


@pytest.mark.parametrize("preset", preset_names())
def test_rows_joining_and_leaving_decode_exactly_as_alone(preset: str) -> None:
    runtime = runtime_for(preset)
    decoder = BatchDecoder(runtime, DecoderConfig(max_batch=3))  # one request has to wait for a row
    refs: dict[str, tuple[object, list[int]]] = {}  # request -> (its own DynamicCache, tokens so far)
    arrivals: dict[int, list[tuple]] = {}
    for i, (length, max_tokens, step) in enumerate(zip(LENGTHS, MAX_TOKENS, JOIN_AT)):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        result = runtime.prefill(prompt(length), sampling=params)
        refs[f"r{i}"] = (build_cache(runtime.config, result.state.layers, runtime.device), [result.next_token])
        arrivals.setdefault(step, []).append((f"r{i}", result.state, result.next_token, params))

    step, ties, seen_together = 0, 0, 0
    forwards: list[torch.Tensor] = []  # each forward's last-position logits [rows, vocab], as the decoder drew from
    hook = runtime.model.register_forward_hook(lambda _m, _a, out: forwards.append(out.logits[:, -1].float()))
    while decoder.load or step <= max(JOIN_AT):
        for args in arrivals.get(step, []):
            decoder.submit(*args)
        forwards.clear()
        tokens = decoder.step()
        seen_together = max(seen_together, len(tokens))
        step_logits = torch.cat(forwards)  # rows in the step's output order: lane by lane, as the tokens
        assert len(step_logits) == len(tokens)
        for t, logits in zip(tokens, step_logits):
            cache, so_far = refs[t.request]
            alone = forward_one(runtime, cache, so_far[-1])  # the same input token, decoded alone
            assert torch.allclose(logits, alone, rtol=1e-4, atol=1e-4 * float(alone.abs().max()))
            if t.token != int(alone.argmax()):  # only a near tie may flip a greedy token
                ties += 1
                assert alone.max() - alone[t.token] <= 1e-4 * float(alone.abs().max())
            so_far.append(t.token)
        step += 1
    hook.remove()
    assert seen_together == 3
    assert [len(refs[f"r{i}"][1]) for i in range(len(LENGTHS))] == list(MAX_TOKENS)
    assert ties == 0, f"{ties} greedy tokens flipped on near ties (logits agreed within 1e-4)"


def test_rows_with_their_own_sampling_and_seeds_draw_the_tokens_they_draw_alone() -> None:
    runtime = runtime_for("kimi-linear-tiny")
    params = [
        SamplingParams(max_tokens=7, temperature=0.8, seed=1, ignore_eos=True),
        SamplingParams(max_tokens=5, temperature=1.3, top_p=0.9, seed=2, ignore_eos=True),
        SamplingParams(max_tokens=6, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=1.0, seed=1, ignore_eos=True),  # same seed, other prompt
    ]
    states = [runtime.prefill(prompt(9 + 13 * i, salt=1), sampling=p) for i, p in enumerate(params)]
    # the last row stops at its first token of the other parity than its first one
    parity = 1 - states[3].next_token % 2
    params[3] = SamplingParams(
        max_tokens=8, temperature=1.0, top_p=0.5, seed=3, stop_token_ids=tuple(range(parity, 256, 2))
    )

    arrivals: dict[int, list[tuple]] = {}
    for i, (s, p) in enumerate(zip(states, params)):
        arrivals.setdefault(i // 2, []).append((f"r{i}", s.state, s.next_token, p))
    unbatched = drive(InterleavedDecoder(runtime), arrivals)  # one DecodeStream per request: decoding alone
    batched = drive(BatchDecoder(runtime, DecoderConfig(max_batch=4)), arrivals)
    assert batched == unbatched
    assert [len(batched[f"r{i}"]) + 1 for i in range(3)] == [p.max_tokens for p in params[:3]]
    assert batched["r3"][-1].finish == "stop" and batched["r3"][-1].token % 2 == parity
    assert len({tuple(t.token for t in batched[f"r{i}"]) for i in range(4)}) == 4


def test_an_aborted_row_frees_its_state_at_once_and_the_batch_goes_on() -> None:
    runtime = runtime_for("kimi-linear-tiny")
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    results = [runtime.prefill(prompt(n, salt=2), sampling=params) for n in (5, 40, 17, 26)]
    alone = [DecodeStream(runtime, r.state, r.next_token, params).run() for r in results[:3]]
    decoder = BatchDecoder(runtime, DecoderConfig(max_batch=3))
    for i in range(4):
        decoder.submit(f"r{i}", results[i].state, results[i].next_token, params)
    waiting_state = weakref.ref(results[3].state.layers[-1].tensor("keys"))
    got: dict[str, list[int]] = {f"r{i}": [r.next_token] for i, r in enumerate(results)}
    for _ in range(2):
        for t in decoder.step():
            got[t.request].append(t.token)
    assert len(decoder.running) == 3 and [r.request for r in decoder.waiting] == ["r3"]

    assert decoder.abort("r0")  # running: its row is released now, the last row takes its place
    assert [r.request for r in decoder.running] == ["r2", "r1"]
    assert decoder.cache.rows == 2 and len(decoder.cache.lengths) == 2
    assert decoder.abort("r3")  # waiting: its state is dropped now
    results[3] = None  # type: ignore[call-overload]
    gc.collect()
    assert waiting_state() is None
    assert not decoder.abort("r3") and not decoder.abort("nobody")

    while decoder.load:
        for t in decoder.step():
            got[t.request].append(t.token)
    assert got["r1"] == alone[1] and got["r2"] == alone[2]
    assert len(got["r0"]) == 3 and got["r0"] == alone[0][:3]
    assert decoder.cache.rows == 0


def test_waiting_queue_is_bounded_and_admits_in_arrival_order() -> None:
    runtime = runtime_for("kimi-linear-tiny")
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    results = {n: runtime.prefill(prompt(n, salt=3), sampling=params) for n in (4, 30, 6)}
    # a budget that fits the 30-token row alone, or the two short ones together
    decoder = BatchDecoder(runtime, DecoderConfig(max_batch=4, step_token_budget=40, max_waiting=3))
    decoder.submit("short", results[4].state, results[4].next_token, params)
    decoder.submit("long", results[30].state, results[30].next_token, params)
    decoder.submit("short2", results[6].state, results[6].next_token, params)
    with pytest.raises(QueueFull):
        decoder.submit("one-too-many", results[6].state, results[6].next_token, params)
    with pytest.raises(ValueError, match="already"):
        decoder.submit("long", results[30].state, results[30].next_token, params)
    short, other = results[4].state, BatchDecoder(runtime)
    with pytest.raises(ValueError, match="layers"):  # a malformed state fails alone, at submit
        other.submit("bad", ModelState(short.layers[:-1], short.seq_len), 1, params)
    with pytest.raises(ValueError, match="expected"):
        other.submit("bad", ModelState(short.layers[1:] + short.layers[:1], short.seq_len), 1, params)
    assert other.load == 0
    assert {t.request for t in decoder.step()} == {"short"}  # 2 x 31 > 40: "long" waits, "short2" behind it
    assert [r.request for r in decoder.waiting] == ["long", "short2"]
    while "long" not in {r.request for r in decoder.running}:
        decoder.step()
    assert [r.request for r in decoder.running] == ["long"]
    while decoder.load:
        decoder.step()


def test_full_attention_buffers_grow_geometrically_not_every_step() -> None:
    config = load_config(ModelSpec.resolve("qwen3-tiny"))
    cache = BatchCache(config, row_layer)
    heads, dim = config.num_key_value_heads, config.head_dim
    for length in (3, 9):
        kv = torch.randn(1, heads, length, dim)
        states = [LayerState(i, StateKind.FULL_ATTENTION, length, (("keys", kv), ("values", kv))) for i in range(8)]
        cache.add_row(states, length)
    layer = cache.layers[0]
    assert isinstance(layer, PaddedKVLayer)
    buffers, steps = set(), 200
    for _ in range(steps):
        cache.prepare_step(torch.float32)
        new = torch.randn(2, heads, 1, dim)
        keys, _ = layer.update(new, new)
        assert keys.shape == (2, heads, max(cache.lengths) + 1, dim)
        assert torch.equal(keys[torch.arange(2), :, torch.tensor(cache.lengths)], new[:, :, 0])
        buffers.add(layer.buffers["keys"].data_ptr())
        cache.advance()
    assert len(buffers) <= math.ceil(math.log2((9 + steps) / 9)) + 1
    assert cache.remove_row(0) == 1 and cache.lengths == [9 + steps]  # the longer row moved into row 0
    assert torch.equal(layer.buffers["keys"][0, :, : 9 + steps], keys[1, :, : 9 + steps])


def test_model_state_round_trip_into_rows_matches_dynamic_cache() -> None:
    runtime = runtime_for("mimo-v2-tiny")
    result = runtime.prefill(prompt(90))
    cache = BatchCache(runtime.config, row_layer)
    cache.add_row(result.state.layers, result.state.seq_len)
    ring = cache.layers[1].buffers["keys"][0]  # sliding layer: position p sits in slot p % window
    window = runtime.config.sliding_window
    held = result.state.layers[1].tensor("keys")[0]
    for j, p in enumerate(range(90 - held.shape[-2], 90)):
        assert torch.equal(ring[:, p % window], held[:, j])


class _StatesInMemory:
    """Stands in for the KV receiver: the service's logic is the subject here, the transport has its own tests."""

    def __init__(self, states: dict[int, ModelState]) -> None:
        self.states = states

    def transfer(self, transfer_id: int) -> _StatesInMemory:
        self.current = self.states[transfer_id]
        return self

    async def model_state(self) -> ModelState:
        return self.current


@pytest.mark.parametrize("max_batch", [1, 8])
def test_decode_service_streams_tokens_and_an_abort_mid_step_stops_only_that_request(max_batch: int) -> None:
    runtime = runtime_for("kimi-linear-tiny")
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    results = [runtime.prefill(prompt(n, salt=4), sampling=params) for n in (8, 21, 13)]
    alone = [DecodeStream(runtime, r.state, r.next_token, params).run() for r in results]
    events: dict[str, list] = {f"r{i}": [] for i in range(3)}

    async def scenario() -> int:
        receiver = _StatesInMemory({i: r.state for i, r in enumerate(results)})
        service = DecodeService(runtime, receiver, 30.0, DecoderConfig(max_batch=max_batch))  # type: ignore[arg-type]
        async with asyncio.timeout(120), asyncio.TaskGroup() as tg:
            steps = tg.create_task(service.run())
            for i, r in enumerate(results):
                msg = Decode(req=f"r{i}", transfer=i, sampling=Sampling.of(params), tokens=[], link_start=0)
                tg.create_task(service.decode(msg, lambda m: events[m.req].append(m)))
                service.start(f"r{i}", r.next_token)
            while len(events["r1"]) < 3 or not service.stepping:  # "received" and two tokens, then mid-step
                await asyncio.sleep(0.001)
            service.abort("r1")
            tokens_at_abort, others_at_abort = len(events["r1"]), len(events["r0"])
            while len(events["r0"]) == others_at_abort:  # the step in flight has returned
                await asyncio.sleep(0.001)
            load_after_abort = service.decoder.load
            while any(not e or getattr(e[-1], "finish", None) is None for k, e in events.items() if k != "r1"):
                await asyncio.sleep(0.001)
            steps.cancel()
        assert len(events["r1"]) == tokens_at_abort  # nothing more reached the aborted request
        return load_after_abort

    assert asyncio.run(scenario()) == 2
    for i in (0, 2):
        got = [results[i].next_token] + [e.token for e in events[f"r{i}"] if isinstance(e, Token)]
        assert got == alone[i]
    assert [e.token for e in events["r1"] if isinstance(e, Token)] == alone[1][1:3]


def test_a_request_aborted_and_sent_again_within_one_step_decodes_the_later_state_once() -> None:
    """A retry keeps its request's id: an abort and the retry's arrival inside one step must leave only the retry."""
    runtime = runtime_for("kimi-linear-tiny")
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    busy, old, new = (runtime.prefill(prompt(n, salt=s), sampling=params) for n, s in ((30, 5), (11, 6), (17, 7)))
    want = DecodeStream(runtime, new.state, new.next_token, params).run()
    events: list = []

    async def scenario() -> None:
        receiver = _StatesInMemory({0: busy.state, 1: old.state, 2: new.state})
        service = DecodeService(runtime, receiver, 30.0, DecoderConfig(max_batch=8))  # type: ignore[arg-type]
        gate, step = threading.Event(), service.decoder.step
        service.decoder.step = lambda: (gate.wait(30), step())[1]  # type: ignore[method-assign]  # hold one step
        async with asyncio.timeout(120), asyncio.TaskGroup() as tg:
            steps = tg.create_task(service.run())
            busy_msg = Decode(req="busy", transfer=0, sampling=Sampling.of(params), tokens=[], link_start=0)
            tg.create_task(service.decode(busy_msg, lambda m: None))
            service.start("busy", busy.next_token)
            while not service.stepping:
                await asyncio.sleep(0.001)
            for transfer, first in ((1, old), (2, new)):
                msg = Decode(req="r", transfer=transfer, sampling=Sampling.of(params), tokens=[], link_start=0)
                tg.create_task(service.decode(msg, events.append))
                service.start("r", first.next_token)
                while len(service.arrivals) < transfer:
                    await asyncio.sleep(0.001)
                if transfer == 1:
                    service.abort("r")  # the gateway gave up on the first attempt
            gate.set()
            while not any(getattr(e, "finish", None) for e in events):
                await asyncio.sleep(0.001)
            steps.cancel()

    asyncio.run(scenario())
    tokens = [e for e in events if isinstance(e, Token)]
    assert {e.transfer for e in tokens} == {2} and [e.token for e in tokens] == want[1:]
