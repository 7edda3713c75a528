"""The first token shown to the client as soon as the prefill worker has it, before the state's tail has crossed.

``EarlyFirst`` is where the prefill (which offers the token) and the gateway (which shows it) meet: a token is
either shown, and a failed prefill is then redone after it, or withdrawn and never shown.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class EarlyFirst:
    def __init__(self) -> None:
        self.token: int | None = None
        self.shown = False
        self.arrived = asyncio.Event()

    def offer(self, token: int) -> None:
        if not self.shown:
            self.token = token
            self.arrived.set()

    def show(self) -> int:
        """The gateway sends the token to the client: from now on the prefill must continue after it."""
        assert self.token is not None
        self.shown = True
        return self.token

    def withdraw(self) -> bool:
        """The attempt that offered the token failed: drop it unless it was shown. Returns ``shown``."""
        if not self.shown:
            self.token = None
            self.arrived.clear()
        return self.shown

    async def shown_before(self, prefill: asyncio.Future, ends_output: Callable[[int], bool]) -> int | None:
        """The first token to send before ``prefill`` ends, or None when the prefill ended first or the token
        ends the output (it then waits for the prefill's end, which may redo it)."""
        while not prefill.done():
            arrived = asyncio.ensure_future(self.arrived.wait())
            try:
                await asyncio.wait({prefill, arrived}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                arrived.cancel()
            if self.token is not None and not prefill.done():  # not withdrawn meanwhile
                if not ends_output(self.token):
                    return self.show()
                break
        await asyncio.wait({prefill})
        return None
