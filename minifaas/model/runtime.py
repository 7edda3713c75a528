"""The model runtime: prefill with a per-layer callback, and when a decode ends.

``prefill`` hooks every decoder layer, so layer i's final state goes to ``on_layer`` while layer i+1 computes,
and a sender can put it on the wire during the rest of the forward. Everything here blocks on the model; async
callers run it on the runtime's own thread (``on_forward_thread``).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from minifaas.model.host_copy import build_cache
from minifaas.model.host_memory import keep_freed_memory
from minifaas.model.kernels import KernelReport, kernels_in_use
from minifaas.model.layer_state import LayerState, ModelState, StateLayout, new_cache
from minifaas.model.loader import DEFAULT_MODEL, ModelSpec, load_config, load_model, load_tokenizer, resolve_dtype
from minifaas.model.sampling import GREEDY, SamplingParams, sample
from minifaas.model.state_layout import layout_of
from minifaas.model.tokenizer import Tokenizer

OnLayer = Callable[[LayerState], None]
OnTokens = Callable[[LayerState, int, int], None]  # (piece, start, total): see ModelRuntime.prefill
T = TypeVar("T")


@dataclass(slots=True)
class PrefillResult:
    state: ModelState
    next_token: int
    logits: torch.Tensor  # [vocab] float32 on the CPU: the distribution of the token after the prompt
    computed_tokens: int
    seconds: float


class ModelRuntime:
    def __init__(self, model: torch.nn.Module, tokenizer: Tokenizer, spec: ModelSpec, device: str) -> None:
        self.model, self.tokenizer, self.spec, self.device = model, tokenizer, spec, device
        self.config = model.config
        self.decoder_layers = model.model.layers
        self.num_layers = len(self.decoder_layers)
        self.layout = layout_of(self.config)
        self.num_states = len(self.layout.parts)  # what a transfer counts as layers (see layer_state)
        if self.layout.num_layers != self.num_layers:
            raise ValueError(f"{spec.name}: {self.num_layers} decoder layers but {self.layout.num_layers} cache layers")
        self.max_context = int(getattr(self.config, "max_position_embeddings", 0) or 1 << 20)
        self.kernels: KernelReport = kernels_in_use(model)  # what they are bound to; what ran, once recorded
        self._forward_thread: ThreadPoolExecutor | None = None

    async def on_forward_thread(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` on this runtime's own thread, where a server runs all of its forwards: one
        thread's allocator arena hands the same blocks back to every forward, still in the caches."""
        if self._forward_thread is None:
            self._forward_thread = ThreadPoolExecutor(1, thread_name_prefix=f"forward-{self.spec.name}")
        return await asyncio.get_running_loop().run_in_executor(self._forward_thread, functools.partial(fn, *args))

    @classmethod
    def load(
        cls, name_or_path: str = DEFAULT_MODEL, device: str = "cpu", seed: int = 0, dtype: torch.dtype | None = None,
        trust_remote_code: bool = False,
    ) -> ModelRuntime:  # fmt: skip
        """``dtype`` None: ``--dtype auto`` (bfloat16 on CUDA, float32 on the CPU). Sets the process's
        C allocator to keep freed memory for the next forward (``host_memory.keep_freed_memory``)."""
        keep_freed_memory()
        spec = ModelSpec.resolve(name_or_path, seed)
        tokenizer = load_tokenizer(spec, trust_remote_code)
        if spec.kind == "preset" and load_config(spec).vocab_size < tokenizer.vocab_size:
            raise ValueError(f"{spec.name}: vocab smaller than the byte tokenizer's")
        model = load_model(spec, device, dtype or resolve_dtype("auto", device), trust_remote_code)
        return cls(model, tokenizer, spec, device)

    @property
    def eos_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @torch.no_grad()
    def prefill(
        self, token_ids: Sequence[int], prefix_state: ModelState | None = None, on_layer: OnLayer | None = None,
        sampling: SamplingParams = GREEDY, chunk_tokens: int = 0, on_tokens: OnTokens | None = None,
    ) -> PrefillResult:  # fmt: skip
        """Run the prompt's tokens after ``prefix_state`` (if any), in forwards of at most ``chunk_tokens`` (0: one);
        the state returned covers both. ``on_layer`` gets each layer's final state once. With ``on_tokens``,
        full-attention layers go there instead, one piece per forward: ``on_tokens(piece, start, total)``, the
        pieces of a layer that will hold ``total`` tokens in order, tiling [0, total) (the first has the prefix).
        """
        if not token_ids:
            raise ValueError("prefill needs at least one new token")
        if chunk_tokens < 0:
            raise ValueError(f"chunk_tokens must be >= 0 (0: one forward), got {chunk_tokens}")
        start = time.perf_counter()
        prefix_len = prefix_state.seq_len if prefix_state else 0
        total = prefix_len + len(token_ids)
        if total > self.max_context:
            raise ValueError(f"{total} tokens exceed the model's context of {self.max_context}")
        cache = build_cache(self.config, prefix_state.layers, self.device) if prefix_state else new_cache(self.config)
        hook = _LayerHook(self.layout, cache, prefix_len, total, on_layer, on_tokens)
        logits = self._forwards(token_ids, cache, hook, chunk_tokens or len(token_ids))
        got = [state.layer for state in hook.layers]
        if got != list(range(self.num_states)):
            raise RuntimeError(f"layer hooks gave states {got}, expected each part once in order")
        token = sample(logits, sampling, total, eos_token_id=self.eos_token_id)  # the first token: no history
        return PrefillResult(ModelState(hook.layers, total), token, logits, len(token_ids), time.perf_counter() - start)

    def _forwards(self, token_ids: Sequence[int], cache: object, hook: _LayerHook, step: int) -> torch.Tensor:
        """The prompt's forwards of at most ``step`` tokens, ``hook`` on every decoder layer; the last logits."""
        handles = [
            layer.register_forward_hook(lambda m, a, o, i=i: hook(i)) for i, layer in enumerate(self.decoder_layers)
        ]
        try:
            for begin, end in itertools.pairwise([*range(hook.prefix_len, hook.total, step), hook.total]):
                hook.begin, hook.end = begin, end
                piece = token_ids[begin - hook.prefix_len : end - hook.prefix_len]
                ids = torch.tensor([list(piece)], dtype=torch.long, device=self.device)
                out = self.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        finally:
            for h in handles:
                h.remove()
        return out.logits[0, -1].float().cpu()


@dataclass(slots=True)
class _LayerHook:
    """One prefill's layer hook: hands each layer's states on as they become final, keeps the final ones."""

    layout: StateLayout
    cache: object
    prefix_len: int
    total: int
    on_layer: OnLayer | None
    on_tokens: OnTokens | None
    begin: int = 0  # tokens [begin, end) of the forward under way
    end: int = 0
    layers: list[LayerState] = field(default_factory=list)  # the last forward's: the final states

    def __call__(self, index: int) -> None:
        last = self.end == self.total
        for state in self.layout.extract(self.cache, index, self.end):
            if last:
                self.layers.append(state)
            if self.on_tokens is not None and state.kind.grows:
                first = 0 if self.begin == self.prefix_len else self.begin
                self.on_tokens(state.slice_tokens(first, self.end), first, self.total)
            elif last and self.on_layer is not None:
                self.on_layer(state)


def decode_finish(runtime: ModelRuntime, p: SamplingParams, token: int, count: int, position: int) -> str | None:
    """Why a stream ends after ``token``, its ``count``-th, at absolute ``position``; None if it goes on."""
    if (token == runtime.eos_token_id and not p.ignore_eos) or token in p.stop_token_ids:
        return "stop"
    if count >= p.max_tokens or position + 1 >= runtime.max_context:
        return "length"
    return None
