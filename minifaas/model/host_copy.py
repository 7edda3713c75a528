"""Layer states out of the GPU without stalling anyone: pinned host buffers, a side stream, an event.

``HostCopier.stage`` runs in the compute thread: it queues each tensor's copy on a side CUDA stream and returns at
once, so the copy of layer i overlaps the compute of layer i+1. Whoever reads the host bytes first waits for the
copy's event in a thread, never on the event loop. On the CPU ``stage`` hands the state back as it is
(``layer_state.to_device`` is the other direction, for a decode node).
"""

from __future__ import annotations

from typing import Protocol

import torch

from minifaas.model.layer_state import LayerState


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
