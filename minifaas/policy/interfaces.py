"""The policy interfaces: one small Protocol per decision, which the gateway and the simulator alike call.

Each method takes frozen values and returns a frozen decision; a policy does no I/O and keeps no clock (time comes
in its input). Callers use nothing of a policy but these methods; docs/POLICIES.md describes each kind.
"""

from __future__ import annotations

from typing import Protocol

from minifaas.policy.codec_policy import CodecChoice, CodecSample, LinkShare, TransferShape
from minifaas.policy.long_term import RebalanceDecision
from minifaas.policy.router import RouteDecision, RouteInput
from minifaas.policy.short_term import ThresholdDecision
from minifaas.policy.signals import Signals
from minifaas.policy.snapshot_policy import SnapshotInput


class RoutingPolicy(Protocol):
    """Per request: which cluster prefills it, on which node, and which node decodes it."""

    def route(self, request: RouteInput) -> RouteDecision:
        """Where ``request`` is prefilled and decoded (nodes named in its views), or Path.REJECT."""
        ...


class ShortTermControl(Protocol):
    """Per tick (seconds): the threshold t and the routing rule."""

    def step(self, signals: Signals) -> ThresholdDecision:
        """One tick: the threshold and the routing rule the router gets from now on."""
        ...

    def set_base(self, base: int) -> int:
        """The long-term policy's new t (a floor to return to); returns the threshold from now on."""
        ...


class LongTermControl(Protocol):
    """Per tick, acting once a period: the P:D split and which PD workers change role."""

    def step(self, signals: Signals) -> RebalanceDecision | None:
        """One tick: None between plans; a plan (its t, its split, workers to move) when one is made."""
        ...

    def converted(self, decision: RebalanceDecision, ok: bool) -> None:
        """One worker that ``decision`` moved has changed role (``ok``), or could not."""
        ...


class SnapshotPlacement(Protocol):
    """Per prefill, inside each prefill worker: where the linear state is kept."""

    def points(self, prompt: SnapshotInput) -> list[int]:
        """Lengths in (start, num_tokens], ascending, at which the prefill keeps its state."""
        ...


class CodecPolicy(Protocol):
    """Per transfer across the link: which codec it gets."""

    def choose(self, link: LinkShare, transfer: TransferShape) -> CodecChoice:
        """The codec of a transfer about to cross ``link`` (none, lossless, fp8 or int8)."""
        ...

    def observe(self, sample: CodecSample) -> None:
        """What a coded transfer (or a worker's start-up calibration) measured."""
        ...
