"""Stop strings found in streamed text at a cost per character that grows with neither their number nor the text.

An Aho-Corasick automaton over characters. The output ends where the first stop string to complete begins,
wherever the text was cut into tokens; text that may still start a stop string is held back until it cannot.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

MAX_STOPS = 64  # with MAX_STOP_CHARS, at most 16K automaton states per request
MAX_STOP_CHARS = 256


class StopMatcher:
    def __init__(self, stops: Sequence[str]) -> None:
        self._next: list[dict[str, int]] = [{}]  # state -> character -> state
        self._depth = [0]  # characters matched in each state
        self._ends = [0]  # the length of the longest stop string ending in each state (0: none)
        for stop in stops:
            self._add(stop)
        self._fail = [0] * len(self._next)  # state -> the longest proper suffix that is a state too
        self._link()
        self._state = 0
        self._held = ""

    def feed(self, piece: str, stop_allowed: bool = True) -> tuple[str, bool]:
        """The text now safe to show, and whether a stop string ended the output within ``piece``.
        With ``stop_allowed`` False (min_tokens not reached) a completed stop string is passed over."""
        text, state = self._held + piece, self._state
        for i, ch in enumerate(piece, start=len(self._held)):
            state = self._step(state, ch)
            if stop_allowed and self._ends[state]:
                self._held, self._state = "", 0
                return text[: i + 1 - self._ends[state]], True
        keep = self._depth[state]  # the longest tail that may grow into a stop string
        self._held, self._state = text[len(text) - keep :], state
        return text[: len(text) - keep], False

    def flush(self) -> str:
        held, self._held, self._state = self._held, "", 0
        return held

    def _step(self, state: int, ch: str) -> int:
        while state and ch not in self._next[state]:
            state = self._fail[state]
        return self._next[state].get(ch, 0)

    def _add(self, stop: str) -> None:
        state = 0
        for ch in stop:
            if ch not in self._next[state]:
                self._next.append({})
                self._depth.append(self._depth[state] + 1)
                self._ends.append(0)
                self._next[state][ch] = len(self._next) - 1
            state = self._next[state][ch]
        self._ends[state] = len(stop)

    def _link(self) -> None:
        """Failure links, breadth first (a link is shallower, so set before it is followed); a state
        inherits the stop string that ends at its link."""
        queue = deque(self._next[0].values())
        while queue:
            state = queue.popleft()
            for ch, child in self._next[state].items():
                self._fail[child] = 0 if state == 0 else self._step(self._fail[state], ch)
                self._ends[child] = self._ends[child] or self._ends[self._fail[child]]
                queue.append(child)
