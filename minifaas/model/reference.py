"""The independent reference for exact output: transformers' own ``generate`` on the same weights.

``reference_run`` shares none of the state export and cache rebuild that the serving paths share, so a bug there
cannot hide on both sides of a comparison. It is greedy only (seeded sampling and penalties are minifaas's own)
and returns every step's logits too; on the CPU in float32 a correct path gives its tokens exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from minifaas.model.runtime import ModelRuntime
from minifaas.model.sampling import GREEDY, SamplingParams


@dataclass(frozen=True, slots=True)
class ReferenceRun:
    tokens: list[int]
    logits: torch.Tensor  # [len(tokens), vocab] float32 on the CPU: what each token was the argmax of


def reference_tokens(runtime: ModelRuntime, prompt_ids: Sequence[int], params: SamplingParams = GREEDY) -> list[int]:
    """The greedy tokens transformers' ``generate`` gives after ``prompt_ids``, stop rules as ``params`` say."""
    return reference_run(runtime, prompt_ids, params).tokens


@torch.no_grad()
def reference_run(runtime: ModelRuntime, prompt_ids: Sequence[int], params: SamplingParams = GREEDY) -> ReferenceRun:
    """``reference_tokens`` with the logits of every step."""
    refuse_unless_greedy(params)
    stops = [*params.stop_token_ids, *(() if params.ignore_eos else (runtime.eos_token_id,))]
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=runtime.device)
    out = runtime.model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=params.max_tokens,
        min_new_tokens=params.min_tokens,
        eos_token_id=stops or None,  # None: no stop token at all, as ignore_eos means
        pad_token_id=runtime.eos_token_id,
        temperature=None,  # a checkpoint's sampling defaults would only warn under greedy search
        top_p=None,
        top_k=None,
        output_logits=True,
        return_dict_in_generate=True,
    )
    logits = torch.stack([step[0].float().cpu() for step in out.logits])
    return ReferenceRun(out.sequences[0, len(prompt_ids) :].tolist(), logits)


def refuse_unless_greedy(params: SamplingParams) -> None:
    if not params.greedy or params.penalised or params.stop:
        raise ValueError(
            "the transformers reference is greedy decoding with stop tokens only: no temperature, "
            f"penalties or stop strings (got {params})"
        )
