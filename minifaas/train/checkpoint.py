"""What a training run writes: a standard transformers checkpoint, and the state to resume from.

``from_pretrained`` and ``AutoTokenizer`` load the checkpoint as any model; ``training_state.pt`` keeps the
float32 weights and optimizer moments. Each file is written under a temporary name and renamed, so a run killed
mid-save leaves the previous checkpoint whole.
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
from pathlib import Path

import torch

from minifaas.model.tokenizer import ByteTokenizer
from minifaas.train.tokenizer_files import write_byte_tokenizer

STATE_FILE = "training_state.pt"
SAMPLE_TEMPERATURE = 0.8  # the generation_config default: greedy decoding of a byte model loops


def export_checkpoint(model: torch.nn.Module, out: Path) -> None:
    """Write the bfloat16 checkpoint and tokenizer into ``out``, replacing what was there."""
    from transformers import GenerationConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a bar per save would bury the training progress

    export = copy.deepcopy(model).to(torch.bfloat16)
    export.generation_config = GenerationConfig(
        bos_token_id=ByteTokenizer.bos_token_id,
        eos_token_id=ByteTokenizer.eos_token_id,
        pad_token_id=ByteTokenizer.pad_token_id,
        do_sample=True,
        temperature=SAMPLE_TEMPERATURE,
    )
    with tempfile.TemporaryDirectory(dir=out, prefix=".export-") as tmp:
        export.save_pretrained(tmp)
        write_byte_tokenizer(tmp)
        for name in sorted(os.listdir(tmp)):
            os.chmod(Path(tmp) / name, 0o644)  # readable as any checkpoint is, not private as a temp file
            os.replace(Path(tmp) / name, out / name)


def save_state(out: Path, state: dict) -> None:
    tmp = out / f".{STATE_FILE}.tmp"
    torch.save(state, tmp)
    os.replace(tmp, out / STATE_FILE)


def load_state(out: Path) -> dict:
    path = out / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"--resume: no {STATE_FILE} in {out}; start without --resume")
    return torch.load(path, map_location="cpu", weights_only=True)


def clear_exports(out: Path) -> None:
    """Remove leftovers of an export that was killed half way."""
    for leftover in out.glob(".export-*"):
        shutil.rmtree(leftover, ignore_errors=True)
