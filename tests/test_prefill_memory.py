"""A long prompt is prefilled in chunks with no tensor of L x L: the largest one grows with L, not with its square.

Every tensor an op makes during a chunked prefill is watched (a TorchDispatchMode sees each op's outputs): twice
the prompt makes a largest tensor about twice as large, and none comes near L x L. An attention that built its
scores for the whole prompt at once would fail both. The served figures (peak RSS of the prefill worker at 2K,
8K and 32K tokens) are bench_scale's.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from minifaas.model.runtime import ModelRuntime

CHUNK = 256


class LargestTensor(TorchDispatchMode):
    """The most elements any op's output had while the mode was on."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


@pytest.fixture(scope="module")
def runtime() -> ModelRuntime:
    return ModelRuntime.load("shakespeare-qwen3.5")


def largest_in_prefill(runtime: ModelRuntime, length: int) -> int:
    tokens = [(7 * i + 3) % 256 for i in range(length)]
    with LargestTensor() as watch:
        runtime.prefill(tokens, chunk_tokens=CHUNK)
    return watch.numel


def test_a_chunked_prefill_makes_no_tensor_of_the_prompt_squared(runtime: ModelRuntime) -> None:
    short, long = largest_in_prefill(runtime, 2048), largest_in_prefill(runtime, 4096)
    assert long <= 2.5 * short  # linear in the prompt
    assert long < 4096 * 4096 // 8  # and far from L x L (an attention's whole score matrix is L x L per head)
