"""A digest of a model's weights, to check that two processes built the same ones."""

from __future__ import annotations

import hashlib

import torch


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 over every parameter and buffer, in name order: equal digests mean equal weights."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
