"""The unbatched reference decoder: one DecodeStream and one forward per request per step.

Each request keeps its own transformers DynamicCache, exactly as ``ModelRuntime.generate`` decodes.
``--max-batch 1`` selects it, and tests hold ``BatchDecoder`` to its outputs.
"""

from __future__ import annotations

from minifaas.model.decoder import StepToken
from minifaas.model.layer_state import ModelState
from minifaas.model.runtime import DecodeStream, ModelRuntime
from minifaas.model.sampling import SamplingParams


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
            self.streams[request] = self.runtime.start_decode(state, next_token, sampling)
        self.arrived.clear()
        out = []
        for request, stream in list(self.streams.items()):
            if not stream.finished:
                token = stream.step()
                out.append(StepToken(request, token, stream.finish_reason))
            if stream.finished:
                del self.streams[request]
        return out
