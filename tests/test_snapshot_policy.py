"""Where snapshots go: the reuse policy splits a prompt only at a prefix seen before; interval as it was."""

from __future__ import annotations

import pytest

from minifaas.cache.pool import HybridPrefixPool
from minifaas.cache.pool_config import PoolConfig
from minifaas.cache.prefix_index import PromptKeys
from minifaas.policy.interfaces import SnapshotPlacement
from minifaas.policy.snapshot_policy import IntervalSnapshots, ReuseSnapshots, SnapshotInput

REUSE = ReuseSnapshots()


def interval(blocks: int) -> IntervalSnapshots:
    return IntervalSnapshots(interval_blocks=blocks)


def points(policy: SnapshotPlacement, start: int, n: int, block: int, hybrid: bool = True, seen: int = 0) -> list[int]:
    return policy.points(SnapshotInput(start, n, block, hybrid, seen))


def test_reuse_without_reuse_keeps_only_the_end() -> None:
    assert points(REUSE, 0, 100, 8) == [100]
    assert points(REUSE, 0, 100, 8, seen=0) == [100]


def test_reuse_adds_the_branch_point_block_aligned_and_inside_the_rest() -> None:
    assert points(REUSE, 0, 100, 8, seen=45) == [40, 100]
    assert points(REUSE, 40, 100, 8, seen=40) == [100]  # already the hit: no split
    assert points(REUSE, 0, 40, 8, seen=40) == [40]  # the end itself
    assert points(REUSE, 0, 100, 8, seen=7) == [100]  # less than a block


def test_interval_is_the_earlier_rule() -> None:
    assert points(interval(2), 0, 37, 8) == [16, 32, 37]
    assert points(interval(2), 16, 37, 8) == [32, 37]
    assert points(interval(0), 0, 37, 8) == [37]
    assert points(interval(2), 0, 37, 8, seen=24) == [16, 32, 37]
    for wrong in (-1, 2.5, True, "4"):  # a policy argument is any JSON value the user wrote
        with pytest.raises(ValueError, match="interval_blocks must be an integer >= 0"):
            IntervalSnapshots(wrong)  # type: ignore[arg-type]


@pytest.mark.parametrize("policy", [REUSE, interval(2)], ids=["reuse", "interval"])
def test_dense_models_need_only_unaligned_ends(policy: SnapshotPlacement) -> None:
    assert points(policy, 0, 37, 8, hybrid=False, seen=24) == [37]
    assert points(policy, 0, 32, 8, hybrid=False) == []
    assert points(policy, 5, 5, 8) == []


def test_a_third_prompt_hits_where_the_first_two_branched() -> None:
    """SGLang-style branch points through the pool: A is stored; B shares its first 3 blocks, so B's
    prefill snapshots there; C, sharing the same 3 blocks, then loads them."""
    block = 4
    pool: HybridPrefixPool[None] = HybridPrefixPool(PoolConfig("pd", 10**9, block, snapshot_policy="reuse"))
    shared = list(range(12))
    a, b, c = shared + [50] * 9, shared + [60] * 9, shared + [70] * 9

    def prefill(tokens: list[int]) -> int:
        keys = PromptKeys.from_tokens(tokens, block, "m")
        lease = pool.acquire(keys, limit=len(tokens) - 1)
        seen = pool.match(keys, limit=len(tokens) - 1).kv_blocks * block
        for j in range(lease.hit_tokens // block, keys.num_full_blocks):
            pool.put_block(keys, j, 0.0, 1)
        for n in pool.snapshot_points(lease.hit_tokens, len(tokens), seen):
            pool.put_snapshot(keys, n, 0.0, 1)
        pool.release(lease)
        return lease.hit_tokens

    assert prefill(a) == 0
    assert prefill(b) == 0  # B found A's blocks but no state to start from: it snapshots at 12
    assert prefill(c) == 12
    assert prefill([*a, 1, 2, 3]) == len(a)  # the next turn of A continues from A's end


def test_pool_config_takes_a_policy_by_name_or_module_and_refuses_others() -> None:
    assert isinstance(HybridPrefixPool(PoolConfig("pd", 1, snapshot_policy="reuse")).snapshots, ReuseSnapshots)
    spec = "minifaas.policy.snapshot_policy:IntervalSnapshots"  # a built-in by its module:Class, with an argument
    pool: HybridPrefixPool[None] = HybridPrefixPool(PoolConfig("pd", 1, 4, 1, snapshot_policy=spec,
                                                               snapshot_args={"interval_blocks": 2}))  # fmt: skip
    assert pool.snapshot_points(0, 20) == [8, 16, 20]  # every 2 blocks, not the pool's own 1
    assert HybridPrefixPool(PoolConfig("pd", 1, 4, 1)).snapshot_points(0, 9) == [4, 8, 9]  # interval: its spacing
    with pytest.raises(ValueError, match="neither a built-in"):
        PoolConfig("pd", 1, snapshot_policy="sometimes")
