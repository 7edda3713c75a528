"""The process of test_fla_cpu: one hybrid family's tiny model on fla's Triton kernels (interpreted) and on torch.

Usage: TRITON_INTERPRET=1 python fla_cpu_child.py FAMILY PROMPT_TOKENS; prints one JSON line of figures.

Both paths run in this one process on the same weights (``fla_interpreter.use_fla_on_cpu`` switches them). Each
runs the project's own steps: a prefill with a cache, a prefill continued from that state, and greedy decode
steps on a cache rebuilt from it, with the kernels it calls recorded as a worker's warm-up records them. Their
logits and every layer's state are held against a reference that shares none of the project's state handling:
transformers' own forwards, on its own cache, on the torch path, fed the same tokens. Then one request crosses
the real transport on loopback, prefilled on one path and decoded on the other, both ways, and its tokens are
held against transformers' ``generate``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("run with TRITON_INTERPRET=1")

from fla_interpreter import LAUNCHES, use_fla_on_cpu  # the interpreter's shims, before any kernel runs

from minifaas.model.host_copy import build_cache
from minifaas.model.interleaved_decoder import DecodeStream, forward_one
from minifaas.model.layer_state import LayerState, ModelState
from minifaas.model.loader import MODELS_DIR, ModelSpec, config_from_dict, load_config_dict
from minifaas.model.reference import reference_tokens
from minifaas.model.runtime import ModelRuntime
from minifaas.model.sampling import SamplingParams
from minifaas.model.tokenizer import ByteTokenizer
from minifaas.model.warm_up import recording_kernels
from minifaas.transport.outgoing import KVSender, SenderConfig
from minifaas.transport.receiver import KVReceiver, ReceiverConfig

SECRET = b"fla-cpu-secret-0123456789abcdef0"
DECODE_STEPS = 3
SERVED = SamplingParams(max_tokens=4, ignore_eos=True)

States = dict[str, torch.Tensor]  # "L<decoder layer>.<slot>" -> tensor


def family_runtime(name: str) -> ModelRuntime:
    """The family's tiny model, seeded as the loader seeds a preset, built where fla may load (``load_model``
    would block it: it picks the kernels a CPU runs)."""
    spec = ModelSpec(name, "preset", MODELS_DIR / "families" / f"{name}.json")
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = AutoModelForCausalLM.from_config(config_from_dict(load_config_dict(spec)), dtype=torch.float32)
    return ModelRuntime(model.eval(), ByteTokenizer(), spec, "cpu")


@contextlib.contextmanager
def on_path(runtime: ModelRuntime, path: str) -> Iterator[None]:
    use_fla_on_cpu(runtime.model, path == "fla")
    try:
        yield
    finally:
        use_fla_on_cpu(runtime.model, False)


def cache_states(cache: Any) -> States:
    """Every tensor transformers' cache holds, read straight from its layers (not through ``layer_state``)."""
    out = {}
    for i, layer in enumerate(cache.layers):
        if getattr(layer, "keys", None) is not None and getattr(layer, "is_initialized", True):
            out[f"L{i}.keys"], out[f"L{i}.values"] = layer.keys.clone(), layer.values.clone()
        for j in range(getattr(layer, "number_of_states", 0)):
            if layer.is_conv_states_initialized[j]:
                out[f"L{i}.conv.{j}"] = layer.conv_states[j].clone()
            if layer.is_recurrent_states_initialized[j]:
                out[f"L{i}.recurrent.{j}"] = layer.recurrent_states[j].clone()
    return out


def model_states(runtime: ModelRuntime, state: ModelState) -> States:
    """The project's exported state, named as ``cache_states`` names the cache's tensors."""
    return {f"L{runtime.layout.parts[s.layer].layer}.{name}": t for s in state.layers for name, t in s.slots}


@torch.no_grad()
def reference_steps(runtime: ModelRuntime, prompt: list[int], more: list[int]) -> dict[str, Any]:
    """transformers alone, on the torch path: the prompt, then ``more`` on the same cache, then greedy tokens."""
    model, cache = runtime.model, None
    logits, states, tokens = [], [], []
    for piece in (prompt, more, *([None] * DECODE_STEPS)):
        ids = torch.tensor([piece if piece is not None else tokens[-1:]])
        out = model(input_ids=ids, cache=cache, use_cache=True)
        cache = out.past_key_values
        logits.append(out.logits[0, -1].float())
        states.append(cache_states(cache))
        tokens.append(int(logits[-1].argmax()))
    return {"logits": logits, "states": states, "tokens": tokens}


@torch.no_grad()
def project_steps(runtime: ModelRuntime, prompt: list[int], more: list[int]) -> dict[str, Any]:
    """The same steps through the project: prefill, prefill after that state, decode on a rebuilt cache."""
    first = runtime.prefill(prompt)
    second = runtime.prefill(more, prefix_state=first.state)
    logits, states = [first.logits, second.logits], [model_states(runtime, s.state) for s in (first, second)]
    tokens = [first.next_token, second.next_token]
    cache, seq_len = build_cache(runtime.config, second.state.layers, runtime.device), second.state.seq_len
    for _ in range(DECODE_STEPS):
        logits.append(forward_one(runtime, cache, tokens[-1]))
        seq_len += 1
        states.append(model_states(runtime, ModelState(exported(runtime, cache, seq_len), seq_len)))
        tokens.append(int(logits[-1].argmax()))
    return {"logits": logits, "states": states, "tokens": tokens}


def exported(runtime: ModelRuntime, cache: Any, seq_len: int) -> list:
    """The cache's states, copied: the next forward updates the fixed-size ones in place."""
    states = [s for layer in range(runtime.num_layers) for s in runtime.layout.extract(cache, layer, seq_len)]
    return [LayerState(s.layer, s.kind, s.seq_len, tuple((n, t.clone()) for n, t in s.slots)) for s in states]


def max_errors(got: dict[str, Any], want: dict[str, Any]) -> tuple[float, float]:
    """The largest |difference| of the logits and of the states, step by step; a state missing, extra or
    shaped otherwise raises."""
    logit_err = max(float((g - w).abs().max()) for g, w in zip(got["logits"], want["logits"], strict=True))
    state_err = 0.0
    for step, (g, w) in enumerate(zip(got["states"], want["states"], strict=True)):
        if g.keys() != w.keys():
            raise AssertionError(f"step {step}: states {sorted(g.keys() ^ w.keys())} held by one side only")
        for name in w:
            if g[name].shape != w[name].shape:
                shapes = tuple(g[name].shape), tuple(w[name].shape)
                raise AssertionError(f"step {step} {name}: shape {shapes[0]}, expected {shapes[1]}")
            state_err = max(state_err, float((g[name].float() - w[name].float()).abs().max()))
    return logit_err, state_err


async def serve_across(runtime: ModelRuntime, ids: list[int], prefill_path: str, decode_path: str) -> dict[str, Any]:
    """One request: prefilled on one path, each layer streamed over loopback TCP by the real sender as it
    finishes, received by the real receiver, decoded on the other path."""
    launches = {}
    async with KVReceiver(ReceiverConfig(SECRET)) as rx:
        incoming = rx.transfer(1)
        config = SenderConfig("127.0.0.1", rx.port, SECRET, connections=2, chunk_bytes=4096)
        async with KVSender(config) as tx, asyncio.TaskGroup() as tg:
            receiving = tg.create_task(incoming.model_state())
            LAUNCHES.clear()
            async with tx.stream(1, runtime.num_states) as out:
                with on_path(runtime, prefill_path):
                    result = await asyncio.to_thread(runtime.prefill, ids, on_layer=out.put_threadsafe)
        launches["prefill"] = sum(LAUNCHES.values())
        received = receiving.result()
    LAUNCHES.clear()
    with on_path(runtime, decode_path):
        tokens = DecodeStream(runtime, received, result.next_token, SERVED).run()
    launches["decode"] = sum(LAUNCHES.values())
    return {"tokens": tokens, "launches": launches}


def main(family: str, prompt_tokens: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    runtime = family_runtime(family)
    assert runtime.kernels.label == "fla", runtime.kernels.to_json()  # fla imported and bound
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 256, (prompt_tokens,), generator=gen).tolist()
    more = torch.randint(0, 256, (prompt_tokens // 2,), generator=gen).tolist()
    reference = reference_steps(runtime, prompt, more)
    figures: dict[str, Any] = {"family": family, "tokens": [len(prompt), len(more), DECODE_STEPS]}
    runs = {}
    for path in ("torch", "fla"):
        started = time.perf_counter()
        LAUNCHES.clear()
        with on_path(runtime, path), recording_kernels(runtime):  # as a worker's warm-up records its report
            runs[path] = project_steps(runtime, prompt, more)
        logit_err, state_err = max_errors(runs[path], reference)
        figures[path] = {
            "logit_err": logit_err, "state_err": state_err, "tokens": runs[path]["tokens"],
            "launches": dict(LAUNCHES), "report": runtime.kernels.to_json(),
            "seconds": round(time.perf_counter() - started, 2),
        }  # fmt: skip
    figures["fla_vs_torch"] = dict(zip(("logit_err", "state_err"), max_errors(runs["fla"], runs["torch"])))
    figures["reference_tokens"] = reference["tokens"]
    ids = prompt + more
    figures["generate"] = reference_tokens(runtime, ids, SERVED)
    figures["served"] = {
        f"{a}->{b}": asyncio.run(serve_across(runtime, ids, a, b)) for a, b in (("fla", "torch"), ("torch", "fla"))
    }
    return figures


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]))), flush=True)
