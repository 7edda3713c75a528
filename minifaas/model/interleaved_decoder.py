"""The unbatched reference decoder: one DecodeStream and one forward per request per step.

A ``DecodeStream`` is one request's decode in its own transformers cache, rebuilt from the state; ``generate``
prefills then decodes so in this process, through the same state export and cache rebuild as the disaggregated
paths. ``--max-batch 1`` selects ``InterleavedDecoder``, and tests hold ``BatchDecoder`` to its outputs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from minifaas.model.decoder import StepToken
from minifaas.model.host_copy import build_cache
from minifaas.model.layer_state import ModelState
from minifaas.model.runtime import ModelRuntime, decode_finish
from minifaas.model.sampling import GREEDY, History, SamplingParams, sample


class InterleavedDecoder:
    def __init__(self, runtime: ModelRuntime) -> None:
        self.runtime = runtime
        self.arrived: dict[str, tuple[ModelState, int, SamplingParams]] = {}  # turned into streams by step()
        self.streams: dict[str, DecodeStream] = {}

    @property
    def load(self) -> int:
        return len(self.arrived) + len(self.streams)

    def submit(self, request: str, state: ModelState, next_token: int, sampling: SamplingParams) -> None:
        if request in self.arrived or request in self.streams:
            raise ValueError(f"request {request!r} is already decoding")
        self.arrived[request] = (state, next_token, sampling)

    def abort(self, request: str) -> bool:
        return self.arrived.pop(request, None) is not None or self.streams.pop(request, None) is not None

    def step(self) -> list[StepToken]:
        for request, (state, next_token, sampling) in self.arrived.items():
            self.streams[request] = DecodeStream(self.runtime, state, next_token, sampling)
        self.arrived.clear()
        out = []
        for request, stream in list(self.streams.items()):
            if not stream.finished:
                token = stream.step()
                out.append(StepToken(request, token, stream.finish_reason))
            if stream.finished:
                del self.streams[request]
        return out


class DecodeStream:
    """One request's decode: owns its cache, yields tokens until a stop condition."""

    def __init__(self, runtime: ModelRuntime, state: ModelState, next_token: int, sampling: SamplingParams) -> None:
        self.runtime, self.sampling = runtime, sampling
        self.cache = build_cache(runtime.config, state.layers, runtime.device)
        self.position = state.seq_len  # absolute position of the newest token
        self.tokens = [next_token]
        self.history = History(sampling, (next_token,))
        self.finish_reason: str | None = None
        self._check_stop(next_token)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def step(self) -> int:
        """Decode one more token (the stream must not be finished)."""
        if self.finished:
            raise RuntimeError(f"stream already finished ({self.finish_reason})")
        logits = forward_one(self.runtime, self.cache, self.tokens[-1])
        self.position += 1
        token = sample(logits, self.sampling, self.position, self.history, self.runtime.eos_token_id)
        self.tokens.append(token)
        self.history.add(token)
        self._check_stop(token)
        return token

    def run(self) -> list[int]:
        while not self.finished:
            self.step()
        return self.tokens

    def _check_stop(self, token: int) -> None:
        self.finish_reason = decode_finish(self.runtime, self.sampling, token, len(self.tokens), self.position)


def generate(runtime: ModelRuntime, token_ids: Sequence[int], sampling: SamplingParams = GREEDY) -> list[int]:
    """Prefill then decode in this process: the in-process path, not a reference for the disaggregated ones
    (``model.reference`` is)."""
    result = runtime.prefill(token_ids, sampling=sampling)
    return DecodeStream(runtime, result.state, result.next_token, sampling).run()


@torch.no_grad()
def forward_one(runtime: ModelRuntime, cache: object, token: int) -> torch.Tensor:
    """Feed one token to one request's own cache; the logits [vocab] of the one after it."""
    ids = torch.tensor([[token]], dtype=torch.long, device=runtime.device)
    return runtime.model(input_ids=ids, cache=cache, use_cache=True).logits[0, -1].float().cpu()
