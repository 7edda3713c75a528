from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minifaas.cache.pool import HybridPrefixPool, Lease
from minifaas.cache.pool_config import PoolConfig
from minifaas.cache.prefix_index import BlockKey, EntryKind, EventKind, PromptKeys, chain, root_key, token_bytes
from minifaas.sim.prefix import SizedPool
from minifaas.traces import trace_path

B = 8  # tokens per block in these tests
TRACE = trace_path("mooncake-synthetic")


def keys(tokens: list[int]) -> PromptKeys:
    return PromptKeys.from_tokens(tokens, B, "test-model")


def keys_from_ids(block_ids: list[int], num_tokens: int, block_size: int) -> PromptKeys:
    """Keys from a trace's one id per block, without tokens; equal ids mean equal block content."""
    if len(block_ids) != -(-num_tokens // block_size):
        raise ValueError(f"{num_tokens} tokens need {-(-num_tokens // block_size)} block ids, got {len(block_ids)}")
    root = root_key("trace-ids")
    full = num_tokens // block_size
    keys: list[BlockKey] = []
    parent = root
    for block_id in block_ids[:full]:
        parent = chain(parent, token_bytes([block_id]))
        keys.append(parent)
    tail = num_tokens - full * block_size
    end = chain(parent, token_bytes([block_ids[full], -tail])) if tail else parent
    return PromptKeys(root, block_size, num_tokens, tuple(keys), end)


class ReservingPool(HybridPrefixPool[str]):
    """A pool that also holds transfers' tail states beside its prefix entries: each reservation makes room by
    evicting, as a store does, and is never evicted itself."""

    def __init__(self, config: PoolConfig, node: str = "") -> None:
        super().__init__(config, node)
        self.transfer_bytes = 0
        self._transfers: dict[str, tuple[int, str | None]] = {}

    @property
    def used_bytes(self) -> int:
        return self.prefix_bytes + self.transfer_bytes

    def reserve_transfer(self, transfer_id: str, nbytes: int, now: float, payload: str | None = None) -> bool:
        if transfer_id in self._transfers:
            raise ValueError(f"transfer {transfer_id} already reserved")
        if not self._make_room(nbytes, now):
            self.counts["transfers_rejected_no_room"] += 1
            return False
        self._transfers[transfer_id] = (nbytes, payload)
        self.transfer_bytes += nbytes
        self.counts["transfers_reserved"] += 1
        return True

    def transfer_payload(self, transfer_id: str) -> str | None:
        return self._transfers[transfer_id][1]

    def finish_transfer(self, transfer_id: str) -> None:
        nbytes, _ = self._transfers.pop(transfer_id)
        self.transfer_bytes -= nbytes
        self.counts["transfers_finished"] += 1


def pool(capacity: int = 10**9, **kw: object) -> ReservingPool:
    return ReservingPool(PoolConfig("pd", capacity, B, **kw), node="p0")  # type: ignore[arg-type]


def store(p: HybridPrefixPool[str], tokens: list[int], now: float = 0.0, start: int = 0) -> PromptKeys:
    """What a prefill worker does after computing tokens[start:]: payload names say what they hold."""
    k = keys(tokens)
    for j in range(start // B, k.num_full_blocks):
        p.put_block(k, j, now, 10, payload=f"kv[{j * B}:{(j + 1) * B}]")
    for n in p.snapshot_points(start, len(tokens)):
        p.put_snapshot(k, n, now, 100, payload=f"state@{n}")
    p.touch(k, len(tokens))
    return k


def naive_hit(p: HybridPrefixPool[str], k: PromptKeys, limit: int) -> int:
    """Reference: the longest n <= limit whose blocks are all stored and that has a snapshot at exactly n."""
    for n in range(limit, 0, -1):
        blocks = all(p.entry(EntryKind.BLOCK, key) for key in k.block_keys[: n // B])
        snapshot = p.entry(EntryKind.SNAPSHOT, k.key_at(n))  # type: ignore[arg-type]
        if blocks and (snapshot or (not p.config.needs_snapshot and n % B == 0)):
            return n
    return 0


def test_keys_are_chained_and_key_at_names_every_prefix() -> None:
    a = list(range(100, 130))
    b = [*a[:17], 7, *a[18:]]
    ka, kb = keys(a), keys(b)
    assert ka.block_keys[:2] == kb.block_keys[:2]
    # a change poisons its block and every later one
    assert all(x != y for x, y in zip(ka.block_keys[2:], kb.block_keys[2:], strict=True))
    for n in range(len(a) + 1):
        assert ka.key_at(n) == keys(a[:n]).end_key
    assert PromptKeys.from_tokens(a, B, "other-model").block_keys[0] != ka.block_keys[0]
    ids = keys_from_ids([4, 5, 6], 20, B)
    assert ids.num_full_blocks == 2 and ids.key_at(16) == ids.block_keys[1] and ids.key_at(12) is None
    with pytest.raises(ValueError):
        keys_from_ids([4, 5], 20, B)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2**31), max_size=40), min_size=2, max_size=12, unique_by=tuple))
def test_distinct_token_sequences_get_distinct_keys(seqs: list[list[int]]) -> None:
    ends = {keys(s).end_key for s in seqs}
    assert len(ends) == len(seqs)
    blocks: dict[bytes, tuple[int, ...]] = {}
    for s in seqs:
        for j, key in enumerate(keys(s).block_keys):
            assert blocks.setdefault(key, tuple(s[: (j + 1) * B])) == tuple(s[: (j + 1) * B])


def test_a_hit_needs_an_exact_snapshot() -> None:
    p = pool(snapshot_interval_blocks=2)  # snapshots every 16 tokens and at prompt ends
    prompt = list(range(1, 38))
    store(p, prompt)
    assert p.snapshot_points(0, 37) == [16, 32, 37]
    longer = keys([*prompt[:35], 900, 901, 902])  # diverges inside the 5th block
    assert p.match(longer).kv_blocks == 4 and p.match(longer).hit_tokens == 32
    lease = p.acquire(keys(prompt), limit=36)  # the last token is always computed
    assert (lease.hit_tokens, lease.snapshot_payload) == (32, "state@32")
    assert lease.block_payloads == [f"kv[{i}:{i + 8}]" for i in range(0, 32, 8)]
    p.release(lease)
    assert p.acquire(keys(prompt)).hit_tokens == 37  # the prompt-end snapshot
    dense = pool(needs_snapshot=False)
    store(dense, prompt)
    assert dense.match(longer).hit_tokens == 32 and dense.snapshot_points(0, 37) == [37]


def test_a_decode_node_can_pin_the_kv_blocks_without_a_snapshot() -> None:
    p = pool(snapshot_interval_blocks=0)
    prompt = list(range(1, 38))
    store(p, prompt)
    other = keys([*prompt[:35], 900, 901])
    assert p.acquire(other).hit_tokens == 0  # no snapshot on its path
    kv = p.acquire(other, kv_only=True)
    assert (kv.hit_tokens, kv.snapshot, len(kv.block_payloads)) == (32, None, 4)
    assert all(e.refs == 1 for e in kv.blocks) and p.counts["kv_hit_tokens"] == 32
    p.release(kv)
    assert all(e.refs == 0 for e in kv.blocks)


def test_next_turn_reuses_the_previous_prompt_end_mid_block() -> None:
    p = pool(snapshot_interval_blocks=0)  # the off switch: snapshots only at prompt ends
    turn1 = list(range(50, 71))  # 21 tokens: ends inside block 2
    store(p, turn1)
    turn2 = [*turn1, 5, 6, 7, 8, 9, 10, 11]
    lease = p.acquire(keys(turn2), limit=len(turn2) - 1)
    assert (lease.hit_tokens, lease.snapshot_payload) == (21, "state@21")
    assert lease.block_payloads == ["kv[0:8]", "kv[8:16]"]  # the snapshot carries the KV of 16..21
    p.release(lease)
    store(p, turn2, now=1.0, start=21)
    assert p.entry(EntryKind.BLOCK, keys(turn2).block_keys[2]) is not None
    with pytest.raises(ValueError):
        p.release(lease)


def test_pinned_entries_survive_and_stores_are_refused_when_nothing_can_go() -> None:
    p = pool(capacity=2 * 10 + 100, snapshot_interval_blocks=0)
    a = store(p, list(range(16)))  # two blocks and a snapshot fill the pool
    lease = p.acquire(a)
    assert lease.hit_tokens == 16
    assert not p.put_block(keys(list(range(900, 908))), 0, 2.0, 10)
    assert p.counts["block_store_rejected_no_room"] == 1 and p.used_bytes == p.config.capacity_bytes
    assert not p.reserve_transfer("r1", 5, 2.0)
    p.release(lease)
    assert p.reserve_transfer("r1", 5, 3.0, payload="tail")
    assert p.entry(EntryKind.SNAPSHOT, a.end_key) is None  # the leaf went first
    assert p.entry(EntryKind.BLOCK, a.block_keys[0]) is not None
    assert p.transfer_payload("r1") == "tail" and p.transfer_bytes == 5
    p.finish_transfer("r1")
    assert p.transfer_bytes == 0 and p.counts["transfers_finished"] == 1


def test_lru_evicts_the_least_recently_used_leaf_first() -> None:
    p = pool(capacity=3 * 110, snapshot_interval_blocks=0)
    a, b = store(p, list(range(8)), now=0.0), store(p, list(range(100, 108)), now=1.0)
    p.release(p.acquire(a))  # a is now more recent than b
    store(p, list(range(200, 208)), now=3.0)
    store(p, list(range(300, 308)), now=4.0)
    assert p.match(a).hit_tokens == 8 and p.match(b).hit_tokens == 0
    assert p.counts["blocks_evicted"] == 1 and p.counts["snapshots_evicted"] == 1


def test_events_report_new_entries_new_holders_and_evictions() -> None:
    p = pool(capacity=2 * 110, snapshot_interval_blocks=0)
    k = store(p, list(range(8)))
    assert [(e.kind, e.entry, e.node) for e in p.drain_events()] == [
        (EventKind.STORE, EntryKind.BLOCK, "p0"),
        (EventKind.STORE, EntryKind.SNAPSHOT, "p0"),
    ]
    p.put_block(k, 0, 1.0, 10, node="p0")
    p.put_block(k, 0, 1.0, 10, node="p1")
    assert [(e.kind, e.node) for e in p.drain_events()] == [(EventKind.STORE, "p1")]
    store(p, list(range(50, 58)), now=2.0)
    store(p, list(range(60, 68)), now=3.0)
    evicted = [e for e in p.drain_events() if e.kind is EventKind.EVICT]
    assert {e.key for e in evicted} >= {k.block_keys[0], k.end_key}
    assert len(p.inventory(now=4.0)) == 4  # two prompts still held, block + snapshot each


def test_prefix_cache_off_switch() -> None:
    p = pool(enabled=False)
    k = store(p, list(range(40)))
    assert p.acquire(k).hit_tokens == 0 and p.prefix_bytes == 0
    assert p.counts["store_skipped_disabled"] > 0 and not p.drain_events()


ops = st.lists(
    st.tuples(st.sampled_from(["store", "acquire", "release", "transfer", "finish"]), st.integers(0, 10**6)),
    max_size=60,
)


@settings(max_examples=120, deadline=None)
@given(ops=ops, capacity=st.integers(0, 600), interval=st.integers(0, 2), needs_snapshot=st.booleans())
def test_pool_invariants_under_random_traffic(
    ops: list[tuple[str, int]], capacity: int, interval: int, needs_snapshot: bool
) -> None:
    p = pool(capacity, snapshot_interval_blocks=interval, needs_snapshot=needs_snapshot)
    rng = random.Random(0)
    leases: list[Lease[str]] = []
    transfers: list[str] = []
    for i, (op, seed) in enumerate(ops):
        rng.seed(seed)  # prompts share prefixes: few distinct tokens, varied lengths
        tokens = [rng.randrange(2) for _ in range(rng.randrange(1, 40))]
        k = keys(tokens)
        if op == "store":
            store(p, tokens, now=i)
        elif op == "acquire":
            limit = rng.randrange(len(tokens) + 1)
            expected = naive_hit(p, k, limit)
            lease = p.acquire(k, limit=limit)
            assert lease.hit_tokens == expected
            if needs_snapshot and lease.hit_tokens:
                assert lease.snapshot is not None and lease.snapshot.length == lease.hit_tokens
                assert lease.snapshot.key == k.key_at(lease.hit_tokens)
            leases.append(lease)
        elif op == "release" and leases:
            p.release(leases.pop(seed % len(leases)))
        elif op == "transfer" and p.reserve_transfer(f"t{i}", seed % 50, now=i):
            transfers.append(f"t{i}")
        elif op == "finish" and transfers:
            p.finish_transfer(transfers.pop(0))
        assert 0 <= p.used_bytes <= capacity
        for lease in leases:  # referenced entries are never evicted
            for e in (*lease.blocks, *([lease.snapshot] if lease.snapshot else [])):
                assert p.entry(e.kind, e.key) is e
        for e in p.entries():  # prefix-closed: every stored entry's parent block is stored
            needs_parent = e.length > B if e.kind is EntryKind.BLOCK else e.length >= B
            assert not needs_parent or p.entry(EntryKind.BLOCK, e.parent) is not None


def test_infinite_pool_replay_of_the_mooncake_trace_hits_every_repeated_leading_block() -> None:
    block = 512
    rows = [json.loads(line) for line in TRACE.read_text().splitlines()]
    seen: set[tuple[int, ...]] = set()
    ideal_tokens = ideal_blocks = 0
    for r in rows:  # direct count: leading hash ids whose prefix appeared before
        ids, k = tuple(r["hash_ids"]), 0
        while k < len(ids) and ids[: k + 1] in seen:
            k += 1
        ideal_tokens, ideal_blocks = ideal_tokens + min(k * block, r["input_length"]), ideal_blocks + k
        seen.update(ids[: i + 1] for i in range(len(ids)))

    p = SizedPool(PoolConfig("prfaas", 10**18, block, snapshot_interval_blocks=1))
    hit_tokens = hit_blocks = 0
    for t, r in enumerate(rows):
        k = keys_from_ids(r["hash_ids"], r["input_length"], block)
        lease = p.acquire(k)
        hit_tokens += lease.hit_tokens
        hit_blocks += -(-lease.hit_tokens // block)
        p.release(lease)
        p.store_prompt(k, float(t), block_nbytes=1, snapshot_nbytes=lambda n: 1, start=lease.hit_tokens)
    assert (hit_tokens, hit_blocks) == (ideal_tokens, ideal_blocks)
    assert 0.6 < hit_blocks / sum(len(r["hash_ids"]) for r in rows) < 0.7  # the trace README says 64%
    assert p.counts["blocks_evicted"] == 0 and p.counts["hit_tokens"] == hit_tokens


def test_layer_state_payloads_reassemble_the_prefill_state() -> None:
    """The live system's payloads: full-attention KV sliced per block, the linear state and the
    partial block's KV in the snapshot; joining a hit's pieces gives back the state at that length."""
    torch = pytest.importorskip("torch")
    from test_state_codec import concat_tokens

    from minifaas.model.layer_state import LayerState, StateKind

    gen = torch.Generator().manual_seed(0)
    tokens = list(range(500, 530))
    kv = LayerState(1, StateKind.FULL_ATTENTION, 30, tuple((n, torch.randn(1, 2, 30, 4, generator=gen)) for n in "kv"))
    linear_at = {
        n: LayerState(0, StateKind.LINEAR_ATTENTION, n, (("recurrent.0", torch.randn(1, 2, 4, 4, generator=gen)),))
        for n in range(31)
    }
    p: HybridPrefixPool[list[LayerState]] = HybridPrefixPool(PoolConfig("pd", 10**9, B, snapshot_interval_blocks=1))
    k = keys(tokens)
    for j in range(k.num_full_blocks):
        block = kv.slice_tokens(j * B, (j + 1) * B)
        p.put_block(k, j, 0.0, block.nbytes, [block])
    for n in p.snapshot_points(0, 30):
        tail = kv.slice_tokens(n - n % B, n)
        p.put_snapshot(k, n, 0.0, linear_at[n].nbytes + tail.nbytes, [linear_at[n], tail])

    follow_up = keys([*tokens[:27], 1, 2, 3])
    lease = p.acquire(follow_up)
    assert lease.hit_tokens == 24  # the last block-aligned snapshot before the prompts diverge
    joined = lease.snapshot_payload[1]  # type: ignore[index]
    for payload in reversed(lease.block_payloads):
        joined = concat_tokens(payload[0], joined)  # type: ignore[index]
    assert joined.seq_len == 24
    assert torch.equal(joined.tensor("k"), kv.slice_tokens(0, 24).tensor("k"))
    assert lease.snapshot_payload[0] is linear_at[24]  # type: ignore[index]
    p.release(lease)
    again = p.acquire(k, limit=29)
    assert again.hit_tokens == 24 and p.acquire(k).hit_tokens == 30
