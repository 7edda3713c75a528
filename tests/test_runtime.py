"""The runtime: disaggregated generation equals transformers' own generate() (``model.reference``), for every preset."""

from __future__ import annotations

import os
import socket
import struct
import time
from pathlib import Path

import pytest
import torch
from preloaded import Preloaded
from test_state_codec import encode_bytes
from weights import weights_digest

from minifaas.model import state_codec
from minifaas.model.interleaved_decoder import DecodeStream, generate
from minifaas.model.layer_state import LayerState, ModelState
from minifaas.model.loader import preset_names
from minifaas.model.reference import reference_tokens
from minifaas.model.runtime import ModelRuntime
from minifaas.model.sampling import SamplingParams

PRESETS = preset_names()
LENGTHS = (1, 7, 64, 1030)
CHILD = Path(__file__).with_name("prefill_child.py")
OtherProcess = tuple[dict[str, list[tuple[ModelState, int]]], dict[str, str]]  # states by preset, digests by preset


def prompt(length: int) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(length)).tolist()


@pytest.fixture(scope="module", params=PRESETS)
def runtime(request: pytest.FixtureRequest) -> ModelRuntime:
    return ModelRuntime.load(request.param)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed early")
        buf += chunk
    return bytes(buf)


def _receive_states(server: socket.socket, count: int) -> list[tuple[ModelState, int]]:
    out = []
    for _ in range(count):
        conn, _ = server.accept()
        with conn:
            layers = []
            while (size := struct.unpack("<Q", _recv_exact(conn, 8))[0]) != 0:
                layers.append(state_codec.decode(_recv_exact(conn, size)))
            seq_len, next_token = struct.unpack("<QQ", _recv_exact(conn, 16))
            out.append((ModelState(layers, seq_len), next_token))
    return out


@pytest.fixture(scope="module")
def other_process(python: Preloaded) -> OtherProcess:
    """One child process for every preset (seed 0): each prompt's streamed state, and each preset's weights' digest."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(300)
        port = server.getsockname()[1]
        cmd = [str(CHILD), str(port), "0", ",".join(PRESETS), *map(str, LENGTHS)]
        child = python.start(cmd, cwd=CHILD.parent, env=dict(os.environ))
        try:
            states = {preset: _receive_states(server, len(LENGTHS)) for preset in PRESETS}
            out, err = child.communicate(timeout=300)
        finally:
            if child.returncode is None:
                child.kill()
                child.communicate()
    assert child.returncode == 0, err[-2000:]
    digests = dict(line.split() for line in out.splitlines())
    return states, digests


@pytest.mark.slow  # a child process, shared by every preset
def test_prefill_in_one_process_decode_in_another_equals_generate(
    runtime: ModelRuntime, other_process: OtherProcess
) -> None:
    received = other_process[0][runtime.spec.name]
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    for n, (state, next_token) in zip(LENGTHS, received):
        assert state.seq_len == n and [s.layer for s in state.layers] == list(range(runtime.num_layers))
        ours = DecodeStream(runtime, state, next_token, params).run()
        assert ours == reference_tokens(runtime, prompt(n), params), f"{runtime.spec.name}, {n} prompt tokens"


@pytest.mark.parametrize("cut", [1, 100, 299])
def test_prefix_continuation_matches_one_prefill(runtime: ModelRuntime, cut: int) -> None:
    ids = prompt(300)
    head = runtime.prefill(ids[:cut])
    rest = runtime.prefill(ids[cut:], prefix_state=head.state)
    whole = runtime.prefill(ids)
    rel = (rest.logits - whole.logits).abs().max() / whole.logits.abs().max()
    assert rel < 1e-4
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    assert DecodeStream(runtime, rest.state, rest.next_token, params).run() == reference_tokens(runtime, ids, params)
    assert rest.computed_tokens == 300 - cut and rest.state.seq_len == 300


def test_on_layer_fires_once_per_layer_in_order_before_the_next_layer_runs(runtime: ModelRuntime) -> None:
    calls: list[tuple[int, float]] = []
    starts: dict[int, float] = {}

    def mark_start(module: torch.nn.Module, args: object, index: int) -> None:
        starts.setdefault(index, time.perf_counter())

    handles = [
        layer.register_forward_pre_hook(lambda m, a, i=i: mark_start(m, a, i))
        for i, layer in enumerate(runtime.decoder_layers)
    ]
    try:
        runtime.prefill(prompt(200), on_layer=lambda s: calls.append((s.layer, time.perf_counter())))
    finally:
        for h in handles:
            h.remove()
    assert [i for i, _ in calls] == list(range(runtime.num_layers))
    for i, t in calls[:-1]:
        assert t < starts[i + 1], f"layer {i} was handed over only after layer {i + 1} started"


def test_on_layer_state_is_the_final_state(runtime: ModelRuntime) -> None:
    seen = []
    result = runtime.prefill(prompt(150), on_layer=seen.append)
    for early, final in zip(seen, runtime.prefill(prompt(150)).state.layers):
        for (name, a), (_, b) in zip(early.slots, final.slots):
            assert torch.equal(a, b), f"layer {early.layer} slot {name} changed after its callback"
    assert result.state.nbytes == sum(s.nbytes for s in seen)


def test_seeded_sampling_is_the_same_across_prefill_and_decode_processes(runtime: ModelRuntime) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=1234, ignore_eos=True)
    whole = generate(runtime, prompt(40), params)
    first = runtime.prefill(prompt(40), sampling=params)
    restored = ModelState([state_codec.decode(encode_bytes(s)) for s in first.state.layers], 40)
    assert DecodeStream(runtime, restored, first.next_token, params).run() == whole
    other = generate(runtime, prompt(40), SamplingParams(max_tokens=12, temperature=0.9, seed=99, ignore_eos=True))
    assert other != whole


@pytest.mark.slow  # the child process above
def test_same_preset_and_seed_give_identical_weights_in_another_process(
    runtime: ModelRuntime, other_process: OtherProcess
) -> None:
    assert other_process[1][runtime.spec.name] == weights_digest(runtime.model)
    other_seed = ModelRuntime.load(runtime.spec.name, seed=1)
    assert weights_digest(other_seed.model) != weights_digest(runtime.model)


def test_prompt_beyond_context_is_refused(runtime: ModelRuntime) -> None:
    with pytest.raises(ValueError, match="exceed"):
        runtime.prefill([1] * (runtime.max_context + 1))
    with pytest.raises(ValueError, match="at least one"):
        runtime.prefill([])


@pytest.mark.parametrize("chunk", [8, 37, 300])
def test_prefill_in_token_chunks_matches_one_prefill(runtime: ModelRuntime, chunk: int) -> None:
    ids = prompt(300)
    whole = runtime.prefill(ids)
    chunked = runtime.prefill(ids, chunk_tokens=chunk)
    rel = (chunked.logits - whole.logits).abs().max() / whole.logits.abs().max()
    assert rel < 1e-4
    for a, b in zip(chunked.state.layers, whole.state.layers, strict=True):
        assert (a.layer, a.kind, a.seq_len) == (b.layer, b.kind, b.seq_len)
        for (name, x), (_, y) in zip(a.slots, b.slots, strict=True):
            assert x.shape == y.shape and torch.allclose(x, y, rtol=1e-4, atol=1e-5), f"layer {a.layer} {name}"
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    decoded = DecodeStream(runtime, chunked.state, chunked.next_token, params).run()
    assert decoded == reference_tokens(runtime, ids, params)


def test_token_chunks_go_out_in_order_and_tile_the_final_state(runtime: ModelRuntime) -> None:
    """After a prefix: the first range includes it; each later forward hands over its own tokens."""
    ids = prompt(260)
    head = runtime.prefill(ids[:50])
    ranges: dict[int, list[tuple[int, int, int]]] = {}
    pieces: dict[int, list[torch.Tensor]] = {}
    whole_layers: list[int] = []

    def on_tokens(piece: LayerState, start: int, total: int) -> None:
        ranges.setdefault(piece.layer, []).append((start, start + piece.seq_len, total))
        pieces.setdefault(piece.layer, []).append(piece.tensor("keys").clone())

    result = runtime.prefill(
        ids[50:], head.state, on_layer=lambda s: whole_layers.append(s.layer), chunk_tokens=100, on_tokens=on_tokens
    )
    grows = [s.layer for s in result.state.layers if s.kind.grows]
    assert sorted(ranges) == grows and whole_layers == [s.layer for s in result.state.layers if not s.kind.grows]
    for layer in grows:
        assert ranges[layer] == [(0, 150, 260), (150, 250, 260), (250, 260, 260)]
        keys = result.state.layers[layer].tensor("keys")
        assert torch.equal(torch.cat(pieces[layer], dim=-2), keys), f"layer {layer}: pieces differ from the state"
    with pytest.raises(ValueError, match="chunk_tokens"):
        runtime.prefill(ids, chunk_tokens=-1)
