"""Where snapshots go: the reuse policy splits a prompt only at a prefix seen before; interval as it was."""

from __future__ import annotations

import pytest

from minifaas.cache.block_hash import PromptKeys
from minifaas.cache.pool import HybridPrefixPool, PoolConfig
from minifaas.policy.snapshot_policy import SnapshotPolicy, snapshot_points

REUSE, INTERVAL = SnapshotPolicy.REUSE, SnapshotPolicy.INTERVAL


def test_reuse_without_reuse_keeps_only_the_end() -> None:
    assert snapshot_points(REUSE, 0, 100, 8, 2, True) == [100]
    assert snapshot_points(REUSE, 0, 100, 8, 2, True, seen_tokens=0) == [100]


def test_reuse_adds_the_branch_point_block_aligned_and_inside_the_rest() -> None:
    assert snapshot_points(REUSE, 0, 100, 8, 2, True, seen_tokens=45) == [40, 100]
    assert snapshot_points(REUSE, 40, 100, 8, 2, True, seen_tokens=40) == [100]  # already the hit: no split
    assert snapshot_points(REUSE, 0, 40, 8, 2, True, seen_tokens=40) == [40]  # the end itself
    assert snapshot_points(REUSE, 0, 100, 8, 2, True, seen_tokens=7) == [100]  # less than a block


def test_interval_is_the_earlier_rule() -> None:
    assert snapshot_points(INTERVAL, 0, 37, 8, 2, True) == [16, 32, 37]
    assert snapshot_points(INTERVAL, 16, 37, 8, 2, True) == [32, 37]
    assert snapshot_points(INTERVAL, 0, 37, 8, 0, True) == [37]
    assert snapshot_points(INTERVAL, 0, 37, 8, 2, True, seen_tokens=24) == [16, 32, 37]


@pytest.mark.parametrize("policy", list(SnapshotPolicy))
def test_dense_models_need_only_unaligned_ends(policy: SnapshotPolicy) -> None:
    assert snapshot_points(policy, 0, 37, 8, 2, False, seen_tokens=24) == [37]
    assert snapshot_points(policy, 0, 32, 8, 2, False) == []
    assert snapshot_points(policy, 5, 5, 8, 2, True) == []


def test_a_third_prompt_hits_where_the_first_two_branched() -> None:
    """SGLang-style branch points through the pool: A is stored; B shares its first 3 blocks, so B's
    prefill snapshots there; C, sharing the same 3 blocks, then loads them."""
    block = 4
    pool: HybridPrefixPool[None] = HybridPrefixPool(PoolConfig("pd", 10**9, block, snapshot_policy="reuse"))
    shared = list(range(12))
    a, b, c = shared + [50] * 9, shared + [60] * 9, shared + [70] * 9

    def prefill(tokens: list[int]) -> int:
        keys = PromptKeys.from_tokens(tokens, block, "m")
        lease = pool.acquire(keys, 0.0, limit=len(tokens) - 1)
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


def test_pool_config_takes_a_policy_by_name_and_refuses_others() -> None:
    assert PoolConfig("pd", 1, snapshot_policy="reuse").snapshot_policy is REUSE
    with pytest.raises(ValueError):
        PoolConfig("pd", 1, snapshot_policy="sometimes")
