"""Tokenizers: a byte-level one for the presets (nothing to download), or a checkpoint's own.

Both follow one small protocol so the rest of minifaas never asks which it has.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol


class Tokenizer(Protocol):
    eos_token_id: int
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def chat(self, messages: Sequence[dict[str, str]]) -> list[int]: ...


class ByteTokenizer:
    """Token i < 256 is byte i; a few special tokens follow. Vocab 264 (padded to a multiple of 8)."""

    SPECIALS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>")
    bos_token_id, eos_token_id, pad_token_id, im_start_id, im_end_id = range(256, 261)
    vocab_size = 264

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        return bytes(i for i in ids if i < 256)

    def chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        ids = [self.bos_token_id]
        for m in messages:
            ids += [self.im_start_id, *self.encode(f"{m['role']}\n{m['content']}"), self.im_end_id, *self.encode("\n")]
        return [*ids, self.im_start_id, *self.encode("assistant\n")]


class HFTokenizer:
    """A checkpoint directory's tokenizer, loaded with AutoTokenizer (local files only)."""

    def __init__(self, path: str | Path, trust_remote_code: bool = False) -> None:
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=trust_remote_code)
        self.eos_token_id = int(self._tok.eos_token_id)
        self.vocab_size = len(self._tok)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        out = self._tok.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
        # transformers 5 returns a BatchEncoding (a Mapping) by default; transformers 4 returned the ids
        return list(out["input_ids"] if isinstance(out, Mapping) else out)
