"""Layer states between host memory and the device: out of the GPU without stalling anyone, and back into a cache.

``HostCopier.stage`` runs in the compute thread: it queues each tensor's copy on a side CUDA stream and returns at
once, so the copy of layer i overlaps the compute of layer i+1. Whoever reads the host bytes first waits for the
copy's event in a thread, never on the event loop. On the CPU ``stage`` hands the state back as it is. The other
way, for a decode node or a prompt continuing a cached prefix, ``build_cache`` puts states into a fresh Cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from minifaas.model.layer_state import LayerState, StateKind, new_cache
from minifaas.model.state_layout import layout_of_cache

if TYPE_CHECKING:
    from transformers import PreTrainedConfig
    from transformers.cache_utils import Cache


class CopyDone(Protocol):
    """What a reader of staged bytes waits on: a ``torch.cuda.Event`` has exactly these two methods."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class HostCopier:
    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def stage(self, state: LayerState) -> tuple[LayerState, CopyDone | None]:
        """The state in host memory, and the event its bytes are ready at (None: ready now)."""
        if self.stream is None or all(t.device.type == "cpu" for _, t in state.slots):
            return state, None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # after the kernels that wrote it
        slots = []
        with torch.cuda.stream(self.stream):
            for name, tensor in state.slots:
                host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                host.copy_(tensor, non_blocking=True)
                tensor.record_stream(self.stream)  # its memory is not reused before the copy has read it
                slots.append((name, host))
            done = torch.cuda.Event()
            done.record(self.stream)
        return LayerState(state.layer, state.kind, state.seq_len, tuple(slots)), done

    def to_host(self, state: LayerState) -> LayerState:
        """The state copied to host memory, waited for (blocking: call it off the event loop)."""
        host, done = self.stage(state)
        if done is not None:
            done.synchronize()
        return host


def build_cache(config: PreTrainedConfig, states: Sequence[LayerState], device: torch.device | str) -> Cache:
    """A fresh cache holding ``states`` (every part, in order), ready to continue. Tensors are copied onto
    ``device`` even when already there, so the cache never mutates a state someone else holds (a pooled prefix)."""
    cache = new_cache(config)
    layout = layout_of_cache(cache)
    if len(states) != len(layout.parts):
        raise ValueError(f"the model's layers hold {len(layout.parts)} states, got {len(states)}")
    for i, (part, state) in enumerate(zip(layout.parts, states)):
        if state.layer != i:
            raise ValueError(f"state for part {state.layer} given at position {i}")
        if state.kind is not part.kind:
            raise ValueError(f"part {i} (layer {part.layer}): model expects {part.kind.name}, got {state.kind.name}")
        _write(cache.layers[part.layer], state, device)
    return cache


def _write(cache_layer: Any, state: LayerState, device: torch.device | str) -> None:
    tensors = dict(to_device(state, device).slots)  # asynchronous from pinned memory
    if state.kind is StateKind.LINEAR_ATTENTION:
        for name, t in tensors.items():
            which, idx = name.split(".")
            i = int(idx)
            if which == "conv":
                cache_layer.conv_states[i] = t
                cache_layer.conv_kernel_size[i] = t.shape[-1]
                cache_layer.is_conv_states_initialized[i] = True
            else:
                cache_layer.recurrent_states[i] = t
                cache_layer.is_recurrent_states_initialized[i] = True
            cache_layer.has_previous_state[i] = True
            cache_layer.device, cache_layer.dtype = t.device, t.dtype
        # the token count kept beside it is its get_seq_length: a model whose first layer is linear takes positions
        if hasattr(cache_layer, "cumulative_length_linear"):
            cache_layer.cumulative_length_linear = torch.tensor(state.seq_len, device=cache_layer.device)
        return
    keys, values = tensors["keys"], tensors["values"]
    cache_layer.lazy_initialization(keys, values)  # a hybrid layer dispatches two tensors to its attention half
    cache_layer.keys, cache_layer.values = keys, values
    if state.kind is StateKind.SLIDING_WINDOW:
        cache_layer.cumulative_length = state.seq_len


def to_device(state: LayerState, device: torch.device | str) -> LayerState:
    """``state`` on ``device``; from pinned host memory the copies are asynchronous on the current stream,
    so the forward that reads them is queued behind them and the host never waits."""
    target = torch.device(device)
    slots = tuple(
        (n, t.to(target, non_blocking=t.device.type == "cpu" and t.is_pinned(), copy=True)) for n, t in state.slots
    )
    return LayerState(state.layer, state.kind, state.seq_len, slots)
