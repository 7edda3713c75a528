"""The dual-timescale scheduler: sans-IO policies over sampled signals, driven by the gateway and the simulator."""

from minifaas.scheduler.long_term import LongTermConfig, LongTermPolicy, RebalanceDecision
from minifaas.scheduler.short_term import ShortTermConfig, ShortTermPolicy, ThresholdDecision
from minifaas.scheduler.signals import Signals, StageLoad

__all__ = [
    "LongTermConfig",
    "LongTermPolicy",
    "RebalanceDecision",
    "ShortTermConfig",
    "ShortTermPolicy",
    "Signals",
    "StageLoad",
    "ThresholdDecision",
]
