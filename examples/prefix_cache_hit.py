"""A prefix-cache hit on a hybrid model: what the second turn of a conversation no longer computes.

A prefill node's ``PrefixStore`` keeps the full-attention KV in blocks and,
because linear-attention state is valid at one length only, snapshots of every
layer's state at chosen points (here only at each prompt's end, so every
prompt is one forward; ``snapshot_interval_blocks`` adds points inside it).
Turn 1 of a chat runs cold and fills the store; sent again, it loads whole (the
end snapshot kept the logits of the next token, so no forward runs); turn 2
repeats turn 1 and adds a question, so it loads turn 1's end snapshot and
prefills only the new tokens. The outputs must equal cold runs.

    python examples/prefix_cache_hit.py
"""

from __future__ import annotations

from minifaas.cache.pool_config import PoolConfig
from minifaas.model.interleaved_decoder import DecodeStream
from minifaas.model.runtime import ModelRuntime
from minifaas.model.sampling import SamplingParams
from minifaas.model.state_layout import needs_snapshot
from minifaas.worker.prefix_store import PrefixStore

PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)
SYSTEM = "System: you are a concise assistant for engineers who run LLM inference across datacenters.\n" * 2
TURN_1 = SYSTEM + "User: what is prefill/decode disaggregation?\nAssistant: prefill and decode on two clusters.\n"
TURN_2 = TURN_1 + "User: and why hybrid models?\n"
BLOCK = 16


def serve(store: PrefixStore, runtime: ModelRuntime, text: str) -> tuple[list[int], int, int, float]:
    """One prompt through the store: (tokens out, tokens hit, tokens computed, prefill seconds)."""
    plan = store.begin(runtime.tokenizer.encode(text))
    result = store.compute(runtime, plan, sampling=PARAMS)
    store.finish(plan, result, now=0.0)
    out = DecodeStream(runtime, result.state, result.next_token, PARAMS).run()
    return out, plan.hit_tokens, result.computed_tokens, result.seconds


def main() -> None:
    runtime = ModelRuntime.load()
    layout = runtime.layout.kinds
    config = PoolConfig("local", 64 << 20, BLOCK, snapshot_interval_blocks=0, needs_snapshot=needs_snapshot(layout))
    store = PrefixStore(config, "example", layout, node="prefill-0")
    kinds = sorted({kind.name for kind in layout})
    print(f"{runtime.spec.name}: {len(layout)} layers ({', '.join(kinds)}), blocks of {BLOCK} tokens")

    runtime.prefill(runtime.tokenizer.encode("warm up"))  # the first forward pays one-off costs
    first, hit, computed, seconds = serve(store, runtime, TURN_1)
    print(f"turn 1: hit {hit:>3} tokens, computed {computed:>3}, prefill {seconds:.3f}s (fills the store)")
    again, hit, computed, seconds = serve(store, runtime, TURN_1)
    print(f"turn 1 again: hit {hit:>3} tokens, computed {computed:>3}, prefill {seconds:.3f}s (no forward)")
    print(f"turn 1's output again: {again == first}")
    if again != first or computed:
        raise SystemExit(1)
    out, hit, computed, seconds = serve(store, runtime, TURN_2)
    print(f"turn 2: hit {hit:>3} tokens, computed {computed:>3}, prefill {seconds:.3f}s")
    cold_prefill = runtime.prefill(runtime.tokenizer.encode(TURN_2), sampling=PARAMS)
    cold = DecodeStream(runtime, cold_prefill.state, cold_prefill.next_token, PARAMS).run()
    print(f"turn 2 cold:           computed {cold_prefill.computed_tokens:>3}, prefill {cold_prefill.seconds:.3f}s")
    saved = 1 - computed / cold_prefill.computed_tokens
    print(
        f"the hit saved {saved:.0%} of turn 2's prefill tokens; {seconds:.3f}s against {cold_prefill.seconds:.3f}s cold"
    )
    print(f"the store holds {store.pool.used_bytes} bytes of blocks and snapshots")
    print(f"output with the hit equals the cold output: {out == cold}")
    if out != cold or hit == 0:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
