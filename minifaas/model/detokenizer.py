"""Token ids in, text pieces out, as a stream: never a split character, and a cost per token that does not grow.

Only a window is decoded, never the whole output: the tokens not shown yet, after the
tokens of the last piece shown, which are there as context (a tokenizer may render a
token differently at the start of a text: SentencePiece drops the leading space of its
first word). A window whose text ends in U+FFFD waits for the rest of its character;
after ``MAX_PENDING`` tokens without a whole one (bytes that never form a character)
it is shown as it decodes, as a decode of the whole output would show it. For the byte
tokenizer the pieces, then ``flush``, join to exactly ``tokenizer.decode(all ids)``.
"""

from __future__ import annotations

from minifaas.model.tokenizer import Tokenizer

MAX_PENDING = 16  # tokens a window may wait for a whole character (UTF-8 needs at most 4 bytes)
REPLACEMENT = "\ufffd"


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
        if (len(text) <= len(shown) or text.endswith(REPLACEMENT)) and pending < MAX_PENDING:
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
