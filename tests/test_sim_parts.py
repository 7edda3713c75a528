"""The simulator's parts on their own: engine, arrivals, link, pools, trace readers."""

from __future__ import annotations

import numpy as np
import pytest

from minifaas.planner.paper import H20_DECODE, H20_PREFILL
from minifaas.sim.arrivals import ArrivalKind, ArrivalSpec, arrival_times
from minifaas.sim.decode import DecodeInstances
from minifaas.sim.engine import EventLoop
from minifaas.sim.fluid_link import FluidLink, LinkConfig
from minifaas.sim.prefill import PrefillInstances
from minifaas.sim.workload import read_workload
from minifaas.traces import trace_path

GB = 1e9 / 8  # bytes in one gigabit


def test_events_fire_in_time_order_with_feed_merged() -> None:
    loop = EventLoop()
    seen: list[tuple[str, float]] = []
    loop.feed([0.5, 1.5, 3.0], lambda i: seen.append((f"feed{i}", loop.now)))
    loop.at(1.0, lambda _: seen.append(("a", loop.now)))
    loop.at(2.0, lambda _: loop.at(2.5, lambda _: seen.append(("c", loop.now))))
    loop.run(until=2.9)
    assert seen == [("feed0", 0.5), ("a", 1.0), ("feed1", 1.5), ("c", 2.5)]
    loop.run()
    assert seen[-1] == ("feed2", 3.0)
    with pytest.raises(ValueError):
        loop.at(1.0, lambda _: None)


@pytest.mark.parametrize("kind", list(ArrivalKind))
def test_arrival_processes_keep_their_mean_rate(kind: ArrivalKind) -> None:
    spec = ArrivalSpec(kind, rate=20.0, on_s=2.0, off_s=6.0)
    times = arrival_times(spec, 2_000.0, np.random.default_rng(1))
    assert np.all(np.diff(times) >= 0) and times[-1] < 2_000.0
    assert times.size / 2_000.0 == pytest.approx(20.0, rel=0.08)


def test_bursty_arrivals_are_burstier_than_poisson() -> None:
    rng = np.random.default_rng(2)
    counts = {}
    for kind in (ArrivalKind.POISSON, ArrivalKind.BURSTY):
        times = arrival_times(ArrivalSpec(kind, 10.0, on_s=5.0, off_s=15.0), 4_000.0, rng)
        per_second = np.bincount(times.astype(int), minlength=4_000)
        counts[kind] = per_second.var() / per_second.mean()  # index of dispersion: 1 for Poisson
    assert counts[ArrivalKind.POISSON] == pytest.approx(1.0, abs=0.15)
    assert counts[ArrivalKind.BURSTY] > 3.0


def test_link_shares_bandwidth_equally() -> None:
    link = FluidLink(gbps=8.0)  # 1 GB/s
    link.add(0.0, 1, 1e9)
    link.add(0.0, 2, 2e9)
    # both at 0.5 GB/s until flow 1 is done at t=2, then flow 2 alone: 1 GB left at 1 GB/s
    assert link.next_completion() == pytest.approx(2.0)
    assert link.pop_done(2.0) == [1]
    assert link.next_completion() == pytest.approx(3.0)
    assert link.pop_done(3.0) == [2]
    assert link.delivered.sum() == pytest.approx(3e9)
    assert link.next_completion() == float("inf")


def test_link_bandwidth_change_moves_completions() -> None:
    link = FluidLink(gbps=8.0)
    link.add(0.0, 1, 2e9)
    link.set_bandwidth(1.0, 4.0)  # 1 GB sent; 1 GB left at 0.5 GB/s
    assert link.next_completion() == pytest.approx(3.0)
    link.set_bandwidth(2.0, 0.0)  # cut: never finishes
    assert link.next_completion() == float("inf")
    link.set_bandwidth(5.0, 8.0)  # 0.5 GB left at 1 GB/s
    assert link.next_completion() == pytest.approx(5.5)
    egress = link.egress_gbps(5.0)
    assert egress[0] == pytest.approx(8.0) and egress[1] == pytest.approx(4.0) and egress[3] == 0.0


def test_link_finishes_flows_late_in_a_long_run() -> None:
    # past about 10^4 s a float step of the clock carries more bytes than the completion tolerance
    for start in (4e4, 1e5, 1e6):
        link = FluidLink(gbps=100.0)
        now = start
        for flow, size in enumerate((3.3e9, 1.7e9, 0.9e9)):
            link.add(now, flow, size)
        done: list[int] = []
        for _ in range(10):  # one event per flow, a few more for clock steps
            now = max(link.next_completion(), now)
            done += link.pop_done(now)
            if not link.active:
                break
        assert sorted(done) == [0, 1, 2] and now - start == pytest.approx(5.9e9 / (100.0 * GB), rel=1e-6)


def test_link_config_validates() -> None:
    assert LinkConfig(rtt_s=0.02).one_way_s == pytest.approx(0.01)
    with pytest.raises(ValueError):
        LinkConfig(schedule=((10.0, 5.0), (5.0, 1.0)))


def test_prefill_pool_is_fcfs_and_picks_the_first_free_node() -> None:
    pool = PrefillInstances("pd", "pd-p", H20_PREFILL, 2)
    t = H20_PREFILL.latency_s(10_000)
    assert pool.latency_s(10_000) == pytest.approx(float(t))
    first = pool.place(0, 0.0, 10_000, request=0)
    assert (first.start, first.end) == pytest.approx((0.0, float(t)))
    assert pool.first_free() == 1
    assert pool.place(1, 0.0, 10_000, request=1).start == 0.0
    queued = pool.place(0, 1.0, 10_000, request=2)  # queued behind the first
    assert queued.start == pytest.approx(float(t))
    assert list(pool.queue[0]) == [first, queued]
    views = pool.views({})
    assert len(views) == 1 and views[0].node_id == "pd-p-1" and views[0].load == 10_000
    assert {v.node_id for v in pool.views({0: 512})} == {"pd-p-0", "pd-p-1"}


def test_a_rescaled_node_stretches_what_its_forwards_have_left() -> None:
    pool = PrefillInstances("pd", "pd-p", H20_PREFILL, 1)
    t = float(H20_PREFILL.latency_s(10_000))
    running, queued = pool.place(0, 0.0, 10_000, request=0), pool.place(0, 0.0, 10_000, request=1)
    assert list(pool.rescale(0, t / 2, 2.0)) == [running, queued]  # from halfway on, at half speed
    assert (running.end, queued.start, queued.end) == pytest.approx((1.5 * t, 1.5 * t, 3.5 * t))
    assert running.version == queued.version == 1 and pool.busy_until[0] == pytest.approx(3.5 * t)
    assert not pool.rescale(0, t, 2.0)  # the same speed: nothing moves
    pool.ended(0)
    assert queued.slowdown == 2.0 and list(pool.queue[0]) == [queued]


def test_a_node_takes_its_next_forward_a_turnaround_after_one_ends_at_its_speed() -> None:
    turn = 0.01
    pool = PrefillInstances("pd", "pd-p", H20_PREFILL, 1, turnaround_s=turn)
    t = float(H20_PREFILL.latency_s(10_000))
    running, queued = pool.place(0, 0.0, 10_000, request=0), pool.place(0, 0.0, 10_000, request=1)
    assert (running.end, queued.start, queued.end) == pytest.approx((t, t + turn, 2 * t + turn))
    assert pool.busy() == 1 and pool.busy_until[0] == pytest.approx(2 * t + 2 * turn)
    pool.rescale(0, t / 2, 2.0)  # from halfway on, at half speed: the turnarounds too
    assert (running.end, queued.start, queued.end) == pytest.approx((1.5 * t, 1.5 * t + 2 * turn, 3.5 * t + 2 * turn))
    assert pool.busy_until[0] == pytest.approx(3.5 * t + 4 * turn)
    pool.ended(0)
    pool.ended(0)
    assert pool.busy() == 0  # storing its last prompt, a worker is not counted among those computing
    later = pool.place(0, 3.5 * t + 2 * turn, 10_000, request=2)  # placed as the last forward ended
    assert later.start == pytest.approx(3.5 * t + 4 * turn)
    assert pool.place(0, 10 * t, 10_000, request=3).start == pytest.approx(10 * t)  # long after: at once
    idle = PrefillInstances("pd", "pd-p", H20_PREFILL, 1, turnaround_s=turn)
    assert idle.place(0, 5.0, 10_000, request=0).start == 5.0  # an idle node starts at once
    assert idle.busy_s == pytest.approx(t + turn)


def test_decode_pool_holds_at_most_bs_max_and_hands_slots_over() -> None:
    pool = DecodeInstances(H20_DECODE, 1)
    for request in range(H20_DECODE.bs_max + 2):
        pool.reserve(0)
        joined = pool.arrive(0, request)
        assert joined == (request < H20_DECODE.bs_max)
    assert pool.total_running == H20_DECODE.bs_max and pool.total_waiting == 2
    assert pool.finish(0) == H20_DECODE.bs_max  # the first waiter takes the slot
    assert pool.total_running == H20_DECODE.bs_max and pool.assigned[0] == H20_DECODE.bs_max + 1


def test_a_decode_instance_that_holds_its_steps_computes_only_part_of_each() -> None:
    pool = DecodeInstances(H20_DECODE, 2, by_batch=True, hold=1.0, hold_max_s=10.0)
    assert pool.computing() == 0.0  # no rows: nothing steps
    for _ in range(3):  # three on their way to the first, one of them here
        pool.reserve(0)
    pool.arrive(0, 0)
    pool.join(0, 0, steps=4, now=0.0)
    clock = pool.restep(0)
    assert clock.busy == pytest.approx(0.5) and pool.computing() == pytest.approx(0.5)  # a step, then as long held
    pool.arrive(0, 1)
    pool.arrive(0, 2)
    assert pool.restep(0).busy == 1.0 and pool.computing() == 1.0  # all here: no hold


def test_mooncake_trace_reads_as_documented() -> None:
    trace = read_workload("mooncake-synthetic")
    assert len(trace) == 3_993 and trace.hash_ids is not None
    assert trace.input_tokens.mean() == pytest.approx(15_326, rel=0.01)
    assert trace.rate == pytest.approx(3.9, rel=0.05)
    faster = read_workload("mooncake-synthetic", length_scale=0.25, rate_scale=2.0)
    assert faster.duration_s == pytest.approx(trace.duration_s / 2)
    assert faster.block_tokens == 128
    assert all(-(-p // 128) == len(h) for p, h in zip(faster.input_tokens.tolist(), faster.hash_ids, strict=True))


def test_azure_trace_reads_as_documented() -> None:
    trace = read_workload("azure-conv")
    assert len(trace) == 19_366 and trace.hash_ids is None
    assert trace.input_tokens.mean() == pytest.approx(1_155, rel=0.01)
    assert 3_000 < trace.duration_s < 3_700  # one hour


def test_a_shipped_trace_is_found_by_name_or_path_and_a_wrong_name_lists_the_names() -> None:
    by_path = read_workload(trace_path("azure-code"))
    assert trace_path("azure-code").parent.parent.name == "data"  # in the repository, nothing beside it
    assert len(by_path) == len(read_workload("azure-code")) == 8_819
    with pytest.raises(FileNotFoundError, match="mooncake-synthetic, azure-conv, azure-code"):
        read_workload("mooncake")
