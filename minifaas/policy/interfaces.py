"""The policy interfaces: one small Protocol per decision, which the gateway and the simulator alike call.

Each method takes frozen values (what the policy may see) and returns a frozen decision; a policy does no
I/O, keeps no clock (time comes in the signals) and reaches into nothing of the caller's. The shipped
policies implement these, and callers use nothing else of them. A policy is named by a built-in name, whose
class its driver builds, or by ``module:Class``, built by ``policy.plugin.load_policy``; docs/POLICIES.md lists
the keywords each is offered.

    RoutingPolicy      per request: which cluster prefills it, which node, which decode node   (router.py)
    ShortTermControl   per tick (seconds): the threshold t and the routing rule               (short_term.py)
    LongTermControl    per tick, acting once a period: the P:D split and role changes         (long_term.py)
    SnapshotPlacement  per prefill, in the workers: where the linear state is kept            (snapshot_policy.py)
    CodecPolicy        per transfer across the link: which codec                              (codec_policy.py)
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
    def route(self, request: RouteInput) -> RouteDecision:
        """Where ``request`` is prefilled and decoded (nodes named in its views), or Path.REJECT."""
        ...


class ShortTermControl(Protocol):
    def step(self, signals: Signals) -> ThresholdDecision:
        """One tick: the threshold and the routing rule the router gets from now on."""
        ...

    def set_base(self, base: int) -> int:
        """The long-term policy's new t (a floor to return to); returns the threshold from now on."""
        ...


class LongTermControl(Protocol):
    def step(self, signals: Signals) -> RebalanceDecision | None:
        """One tick: None between plans; a plan (its t, its split, workers to move) when one is made."""
        ...

    def converted(self, decision: RebalanceDecision, ok: bool) -> None:
        """One worker that ``decision`` moved has changed role (``ok``), or could not."""
        ...


class SnapshotPlacement(Protocol):
    def points(self, prompt: SnapshotInput) -> list[int]:
        """Lengths in (start, num_tokens], ascending, at which the prefill keeps its state."""
        ...


class CodecPolicy(Protocol):
    def choose(self, link: LinkShare, transfer: TransferShape) -> CodecChoice:
        """The codec of a transfer about to cross ``link`` (none, lossless, fp8 or int8)."""
        ...

    def observe(self, sample: CodecSample) -> None:
        """What a coded transfer (or a worker's start-up calibration) measured."""
        ...
