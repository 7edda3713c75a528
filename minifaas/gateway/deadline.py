"""A request's deadlines: the first token within one limit, each next one within another, all in an optional total.

They bound the server's silence, not the length of what it says: a long answer that keeps
streaming is never cut, a request whose worker has gone quiet is. Each limit covers one
wait for the gateway's next token (the prefill, then each decode step), never the time the
client takes to read what it was sent. The total, when set, is wall-clock time from
arrival.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from minifaas.gateway.requests import DeadlineExceeded


class RequestDeadline:
    def __init__(self, first_token: float, between_tokens: float, total: float | None, now: float) -> None:
        self.first_token_s, self.between_tokens_s, self.total_s = first_token, between_tokens, total
        self._end = None if total is None else now + total

    def first_token(self) -> contextlib.AbstractAsyncContextManager[None]:
        return self._within(self.first_token_s, f"no first token within {self.first_token_s:g} s")

    def next_token(self) -> contextlib.AbstractAsyncContextManager[None]:
        return self._within(self.between_tokens_s, f"no token for {self.between_tokens_s:g} s")

    @contextlib.asynccontextmanager
    async def _within(self, seconds: float, silence: str) -> AsyncIterator[None]:
        until = asyncio.get_running_loop().time() + seconds
        why = silence
        if self._end is not None and self._end < until:
            until, why = self._end, f"the request took longer than its limit of {self.total_s:g} s"
        try:
            async with asyncio.timeout_at(until) as timeout:
                yield
        except TimeoutError:
            if not timeout.expired():
                raise  # a TimeoutError of something inside, not this deadline
            raise DeadlineExceeded(why) from None
