"""A prefix pool's settings, checked when the config is made, and the snapshot policy they name, built once
when the pool starts (a built-in name, or ``module:Class`` through ``policy.plugin``)."""

from __future__ import annotations

from dataclasses import dataclass

from minifaas.policy.interfaces import SnapshotPlacement
from minifaas.policy.plugin import SNAPSHOT, Args, building, check_policy, load_policy, policy_args
from minifaas.policy.snapshot_policy import IntervalSnapshots, ReuseSnapshots


@dataclass(frozen=True, slots=True)
class PoolConfig:
    name: str
    capacity_bytes: int
    block_size: int = 512
    snapshot_interval_blocks: int = 8  # the interval policy's spacing; 0: snapshots only at prompt ends
    needs_snapshot: bool = True  # False for dense models: any block prefix is usable
    enabled: bool = True  # False: --prefix-cache none (no hits, nothing stored)
    events: bool = True  # False: no store/evict events (the simulator's manager reads this pool's index)
    snapshot_policy: str = "interval"  # where snapshots go: a built-in name or module:Class (policy.plugin)
    snapshot_args: Args = ()  # its constructor's keyword arguments

    def __post_init__(self) -> None:
        if self.capacity_bytes < 0 or self.block_size < 1 or self.snapshot_interval_blocks < 0:
            raise ValueError(f"bad pool config {self}")
        object.__setattr__(self, "snapshot_args", policy_args(self.snapshot_args))
        check_policy(self.snapshot_policy, SNAPSHOT, self.snapshot_args)
        snapshot_placement(self)  # built once: a value its constructor refuses is this config's error


def snapshot_placement(config: PoolConfig) -> SnapshotPlacement:
    """The snapshot policy ``config`` names, built with its arguments and the interval it offers."""
    spec, offered = config.snapshot_policy, {"interval_blocks": config.snapshot_interval_blocks}
    with building(SNAPSHOT, spec):
        return (
            ReuseSnapshots() if spec == "reuse"
            else IntervalSnapshots(**(offered | dict(config.snapshot_args))) if spec == "interval"
            else load_policy(spec, SNAPSHOT, config.snapshot_args, **offered)
        )  # fmt: skip
