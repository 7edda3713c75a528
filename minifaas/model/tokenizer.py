"""Tokenizers: a byte-level one for the presets (nothing to download), or a checkpoint's own.

``IncrementalDecoder`` turns a stream of token ids into text pieces, never a split character, at a cost per token
that does not grow with the output: it decodes only the tokens not shown yet, with the last piece's tokens before
them as context (a tokenizer may render a token differently at a text's start). A piece ending in U+FFFD waits
for the rest of its character, for up to ``MAX_PENDING`` tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

MAX_PENDING = 16  # tokens a window may wait for a whole character (UTF-8 needs at most 4 bytes)


class ByteTokenizer:
    """Token i < 256 is byte i; a few special tokens follow. Vocab 264 (padded to a multiple of 8)."""

    SPECIALS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>")
    bos_token_id, eos_token_id, pad_token_id, im_start_id, im_end_id = range(256, 261)
    vocab_size = 264

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

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
        return list(out["input_ids"])  # a BatchEncoding


Tokenizer = ByteTokenizer | HFTokenizer


class IncrementalDecoder:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._window: list[int] = []  # context tokens, then the ones not shown yet
        self._context = 0  # how many of the window's tokens are context

    def push(self, token_id: int) -> str:
        """The text that ``token_id`` completes ("" while a character or a token's text is unfinished)."""
        self._window.append(token_id)
        shown = self._tok.decode(self._window[: self._context])
        text = self._tok.decode(self._window)
        pending = len(self._window) - self._context
        if (len(text) <= len(shown) or text.endswith("\ufffd")) and pending < MAX_PENDING:
            return ""
        del self._window[: self._context]  # the new piece's tokens are the next one's context
        self._context = len(self._window)
        return text[len(shown) :]

    def flush(self) -> str:
        """What is still held back (an unfinished character, shown as U+FFFD); the decoder starts over."""
        shown = self._tok.decode(self._window[: self._context])
        text = self._tok.decode(self._window)
        self._window, self._context = [], 0
        return text[len(shown) :]
