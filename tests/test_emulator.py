"""The link emulator: its pacing policy with time passed in, and the relay process with its control port."""

from __future__ import annotations

import asyncio
import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Coroutine
from typing import Any

import pytest

from minifaas.emulator.emulator_process import EmulatorError, EmulatorProcess
from minifaas.emulator.pacer import DelayLine, FlowWindow, Pacer, RateSchedule, parse_bytes, parse_rate
from minifaas.emulator.relay_blocks import CopiedBlock, SplicedBlock, splice_available

pytestmark = pytest.mark.timeout(60)


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 45))


# --- policy, no I/O ---


def test_parse_rate() -> None:
    assert parse_rate("100mbit") == 100e6
    assert parse_rate("5Gbit") == 5e9
    assert parse_rate("2.5e8") == 2.5e8
    assert parse_rate("none") is None
    with pytest.raises(ValueError):
        parse_rate("fast")
    with pytest.raises(ValueError, match="must be positive"):  # not unlimited: a schedule's "5:0" is no outage
        parse_rate("0")


def drain(pacer: Pacer, sizes: list[int], now: float = 0.0) -> float:
    """Send back-to-back, each reservation at the time the previous one finished; returns the end time."""
    for n in sizes:
        now += pacer.reserve(n, now)
    return now


def test_pacer_holds_its_rate_exactly() -> None:
    pacer = Pacer(80e6)  # 10 MB/s
    assert drain(pacer, [100_000] * 100, now=50.0) == pytest.approx(50.0 + 1.0 - pacer.burst_bytes / 10e6)


def test_pacer_forgives_late_wakeups_only_up_to_the_burst() -> None:
    pacer = Pacer(80e6, burst_seconds=0.01)
    assert pacer.reserve(100_000, 0.0) == 0  # an idle link may send a burst at once
    assert pacer.reserve(100_000, 0.0) > 0
    # asleep for a whole second: only one burst's worth (0.01 s, 100 KB) of credit comes back
    assert pacer.reserve(100_000, 1.0) == 0
    assert pacer.reserve(100_000, 1.0) == pytest.approx(0.01)


def test_one_pacer_shared_by_flows_is_an_aggregate_link() -> None:
    link, flows = Pacer(80e6), [Pacer(20e6), Pacer(20e6), Pacer(20e6), Pacer(20e6), Pacer(20e6), Pacer(20e6)]
    clocks = [0.0] * len(flows)
    for _ in range(200):  # each flow sends its next 50 KB when its previous one has left both pacers
        for i, flow in enumerate(flows):
            clocks[i] += flow.reserve(50_000, clocks[i])
            clocks[i] += link.reserve(50_000, clocks[i])
    total_bytes = 200 * 50_000 * len(flows)
    assert total_bytes / max(clocks) == pytest.approx(10e6, rel=0.02)  # six 2.5 MB/s flows share 10 MB/s


def test_unlimited_pacer_never_waits() -> None:
    assert drain(Pacer(None), [1 << 30] * 10) == 0


def test_rate_schedule() -> None:
    schedule = RateSchedule.parse("0:1gbit, 5:100mbit, 8:none")
    assert schedule.steps == ((0.0, 1e9), (5.0, 100e6), (8.0, None))
    with pytest.raises(ValueError):
        RateSchedule(((5, 1.0), (1, 2.0)))


def test_delay_line_never_reorders() -> None:
    line = DelayLine(random.Random(1))
    times = [line.release_time(i * 1e-4, 0.01, 0.008) for i in range(1000)]
    assert times == sorted(times) and min(t - i * 1e-4 for i, t in enumerate(times)) >= 0.002 - 1e-12


def test_parse_bytes() -> None:
    assert parse_bytes("262144") == 262144 and parse_bytes("256KiB") == 262144 and parse_bytes("4mib") == 4 << 20
    assert parse_bytes("64KB") == 64_000 and parse_bytes("none") is None
    for bad in ("fast", "4XB", "-5"):
        with pytest.raises(ValueError):
            parse_bytes(bad)


def test_a_flow_window_lets_window_bytes_per_round_trip_through() -> None:
    window, rtt = FlowWindow(64_000), 0.02
    now, sent = 0.0, 0
    while now < 1.0:  # a sender that sends whatever the window allows, as soon as it allows it
        room = window.room(now)
        assert room is not None
        if room:
            window.sent(room, acked_at=now + rtt)
            sent += room
        else:
            now = window.next_ack()  # type: ignore[assignment]
    assert sent == pytest.approx(64_000 / rtt, rel=0.03)  # window / RTT, whatever the link's rate
    assert window.in_flight <= 64_000


def test_a_window_set_mid_flow_counts_what_is_already_in_flight() -> None:
    window = FlowWindow(None)
    assert window.room(0.0) is None
    window.sent(50_000, acked_at=1.0)
    window.set_window(20_000)
    assert window.room(0.5) == 0 and window.next_ack() == 1.0
    assert window.room(1.0) == 20_000 and window.next_ack() is None
    for bad in (0, 100, 2.5e6, True, "4MiB"):
        with pytest.raises(ValueError, match="whole number of bytes"):
            FlowWindow(bad)  # type: ignore[arg-type]


# --- the relay process ---


async def echo_server() -> asyncio.Server:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
        writer.close()

    return await asyncio.start_server(echo, "127.0.0.1", 0)


async def echo_through(port: int, payload: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(payload)
    writer.write_eof()
    data = await reader.read()
    writer.close()
    return data


@pytest.mark.parametrize("splice", ["on", "off"])
def test_relay_carries_bytes_exactly_both_ways_and_counts_them(splice: str) -> None:
    payload = os.urandom(3 << 20)

    async def main() -> None:
        server = await echo_server()
        target = server.sockets[0].getsockname()
        options = {"rate": "400mbit", "delay_ms": 3, "jitter_ms": 2, "read_bytes": 4096, "splice": splice}
        async with server, EmulatorProcess(target, **options) as link:
            results = await asyncio.gather(*(echo_through(link.port, payload) for _ in range(3)))
            assert all(r == payload for r in results)
            stats = await link.control.stats()
            assert stats["up_bytes"] == stats["down_bytes"] == 3 * len(payload)
            assert stats["flows_total"] == 3 and stats["rate_bps"] == 400e6 and stats["delay_ms"] == 3

    run(main())


def test_control_commands_change_the_link() -> None:
    async def main() -> None:
        server = await echo_server()
        async with server, EmulatorProcess(server.sockets[0].getsockname(), rate="1gbit") as link:
            await link.control.set_rate(50e6)
            await link.control.set_flow_rate(10e6)
            await link.control.set_delay(7, 1)
            stats = await link.control.stats()
            assert (stats["rate_bps"], stats["flow_rate_bps"], stats["delay_ms"]) == (50e6, 10e6, 7)
            await link.control.schedule([(0, 2e9)])
            async with asyncio.timeout(10):
                while (await link.control.stats())["rate_bps"] != 2e9:
                    await asyncio.sleep(0.01)
            await link.control.stall(0.2)
            assert (await link.control.stats())["stalled"] is True
            with pytest.raises(EmulatorError):
                await link.control.command("explode")

    run(main())


async def counting_server(received: list[int]) -> asyncio.Server:
    """Reads every connection to its end, adding up the bytes."""

    async def read_all(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(1 << 16):
            received[0] += len(data)
        writer.close()

    return await asyncio.start_server(read_all, "127.0.0.1", 0)


def test_a_window_caps_each_flow_at_window_per_round_trip_and_changes_over_the_control_port() -> None:
    window, rtt = 48_000, 0.02  # 10 ms each way, and no rate limit: only the window holds the flow back

    async def main() -> None:
        received = [0]
        server = await counting_server(received)
        options = {"window": "48000", "delay_ms": rtt / 2 * 1000}
        async with server, EmulatorProcess(server.sockets[0].getsockname(), **options) as link:
            assert (await link.control.stats())["window_bytes"] == window
            nbytes = 1_200_000
            loop = asyncio.get_running_loop()
            _, writer = await asyncio.open_connection("127.0.0.1", link.port)
            start = loop.time()
            writer.write(bytes(nbytes))
            async with asyncio.timeout(20):
                while received[0] < nbytes:
                    await asyncio.sleep(0.005)
            seconds = loop.time() - start
            writer.close()
            # every byte passed the window, and a window's worth is acknowledged one round trip after it left
            assert seconds >= 0.95 * rtt * (nbytes / window - 1)
            await link.control.set_window(None)
            assert (await link.control.stats())["window_bytes"] is None
            for bad in (100, 3.5, "big"):
                with pytest.raises(EmulatorError, match="whole number of bytes"):
                    await link.control.set_window(bad)  # type: ignore[arg-type]

    run(main())


async def only_flow(link: Any) -> Any:
    """The one flow through an in-process relay, once its target end is connected."""
    async with asyncio.timeout(10):
        while not link.flows or next(iter(link.flows.values()))[0].upstream is None:
            await asyncio.sleep(0.005)
    return next(iter(link.flows.values()))[0]


def test_the_relay_buffers_two_reads_per_flow_so_backpressure_reaches_the_sender() -> None:
    """Left to the kernel, a loopback receive buffer grows to megabytes, and a window-bound flow's backlog
    sits in the relay, out of the sender's sight: the end of a 16-connection transfer at 30 ms waited on it."""
    from minifaas.emulator.relay import LinkEmulator, RelayConfig

    async def main() -> None:
        server = await counting_server([0])
        target = server.sockets[0].getsockname()
        async with server, LinkEmulator(RelayConfig(*target, rate_bps=1e9, window_bytes=285_000)) as link:
            _, writer = await asyncio.open_connection("127.0.0.1", link.port)
            flow = await only_flow(link)

            def buffers() -> tuple[int, int]:  # Linux reports twice what it was given
                ends = (flow.client, flow.upstream)
                client, upstream = (end.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) // 2 for end in ends)
                return client, upstream

            assert buffers() == (2 * (285_000 // 8), 2 * (285_000 // 8))  # reads of an eighth of the window
            link.set_rate(100e6)  # reads of 2 ms at 100 Mbit/s: 25 KB
            assert buffers() == (50_000, 50_000)
            link.set_rate(20e6)  # 5 KB: the floor, one of each socket's segments (the flow began on a faster link)
            ends = (flow.client, flow.upstream)
            segments = tuple(end.getsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG) for end in ends)
            assert buffers() == segments and min(segments) > 10_000
            link.set_window(None)
            link.set_rate(400e6)  # 2 ms: 100 KB
            assert buffers() == (200_000, 200_000)
            writer.close()
        async with LinkEmulator(RelayConfig(*target)) as bare:  # no rate and no window: the kernel's sizing
            _, writer = await asyncio.open_connection("127.0.0.1", bare.port)
            assert not getattr(await only_flow(bare), "bounded", None)
            writer.close()

    run(main())


@pytest.mark.slow
def test_a_slow_link_acknowledges_each_flows_bytes_as_it_carries_them() -> None:
    """Forty flows of 150 KB through 5 Mbit/s: each sender sees its bytes leave a little at a time, never held
    for seconds (its stall deadline would fire), and none sees them all leave before the link could carry them."""
    from bench_transport import acknowledged_send

    from minifaas.emulator.relay import LinkEmulator, RelayConfig

    flows, each, rate = 40, 150_000, 5e6
    link_s = flows * each * 8 / rate

    async def main() -> None:
        received = [0]
        server = await counting_server(received)
        async with server, LinkEmulator(RelayConfig(*server.sockets[0].getsockname(), rate_bps=rate)) as link:
            started = time.perf_counter()  # the clock acknowledged_send reports on
            results = await asyncio.gather(*(acknowledged_send(link.port, each) for _ in range(flows)))
        stood = max(longest for longest, _ in results)
        emptied = min(at for _, at in results) - started
        assert stood < 3.0, f"a sender's bytes stood still for {stood:.1f} s"
        assert emptied > 0.5 * link_s, f"a sender saw all its bytes acknowledged after {emptied:.1f} s of {link_s} s"

    asyncio.run(asyncio.wait_for(main(), 50))


def test_routes_carry_flows_to_several_targets_over_one_link() -> None:
    async def tagged_server(tag: bytes) -> asyncio.Server:
        async def reply(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(tag + await reader.read())
            await writer.drain()
            writer.close()

        return await asyncio.start_server(reply, "127.0.0.1", 0)

    async def main() -> None:
        first, second = await tagged_server(b"1:"), await tagged_server(b"2:")
        async with first, second, EmulatorProcess(first.sockets[0].getsockname(), rate="1gbit") as link:
            port = await link.control.add_route(second.sockets[0].getsockname()[:2])
            assert port != link.port
            assert await echo_through(link.port, b"a") == b"1:a"
            assert await echo_through(port, b"bb") == b"2:bb"
            stats = await link.control.stats()
            assert stats["up_bytes"] == 3 and stats["flows_total"] == 2  # one link counts both routes
            assert set(stats["routes"]) == {str(link.port), str(port)}
            await link.control.remove_route(link.port)  # the first route can go too
            with pytest.raises(OSError):
                await echo_through(link.port, b"c")
            assert await echo_through(port, b"d") == b"2:d"
            with pytest.raises(EmulatorError, match="no route"):
                await link.control.remove_route(link.port)

    run(main())


def test_a_removed_route_lets_the_next_socket_open_in_the_same_turn_work() -> None:
    """A route goes while another's flows start (a decode worker retired as PrfaaS KV flows to the next one):
    the removed route's listening socket must outlive the loop's watch on it, or the next socket opened in
    the same turn takes its number and the loop's stale entry for it refuses the new socket (a flow reset)."""
    from minifaas.emulator.relay import LinkEmulator, RelayConfig

    async def main() -> None:
        server = await echo_server()
        target = server.sockets[0].getsockname()[:2]
        async with server, LinkEmulator(RelayConfig(*target)) as link:
            other = link.add_route(*target)
            await asyncio.sleep(0.05)  # both routes' accept loops are waiting on their listening sockets
            link.remove_route(link.port)
            loop = asyncio.get_running_loop()
            with socket.socket() as sock:  # opened at once, as a flow's upstream socket is
                sock.setblocking(False)
                await loop.sock_connect(sock, ("127.0.0.1", other))
                await loop.sock_sendall(sock, b"whole")
                assert await loop.sock_recv(sock, 16) == b"whole"
            await asyncio.sleep(0.1)  # the removed route's accept loop has ended, and its socket closed
            with pytest.raises(OSError):
                await echo_through(link.port, b"gone")
            assert link.routes == {other: target}

    run(main())


def test_cut_resets_every_connection() -> None:
    async def main() -> None:
        server = await echo_server()
        async with server, EmulatorProcess(server.sockets[0].getsockname()) as link:
            reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
            writer.write(b"ping")
            assert await reader.readexactly(4) == b"ping"
            await link.control.cut()
            with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
                async with asyncio.timeout(10):
                    await reader.readexactly(1)
            writer.close()
            assert (await link.control.stats())["cuts"] == 1

    run(main())


def test_command_line_help() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "minifaas.commands.link_emulator", "--help"], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0 and "--flow-rate" in done.stdout


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as server:
        near = socket.create_connection(server.getsockname())
        far, _ = server.accept()
    for sock in (near, far):
        sock.setblocking(False)
    return near, far


@pytest.mark.parametrize("kind", [SplicedBlock, CopiedBlock])
def test_a_block_moves_a_stream_between_sockets_and_can_flip_one_byte(kind: type) -> None:
    if kind is SplicedBlock and not splice_available():
        pytest.skip("no splice(2) on this platform")
    payload = os.urandom(3 << 20)

    async def main() -> tuple[bytes, int]:
        loop = asyncio.get_running_loop()
        (src_in, src), (dst, dst_out) = tcp_pair(), tcp_pair()
        block = kind(1 << 16)

        async def feed() -> None:
            await loop.sock_sendall(src_in, payload)
            src_in.shutdown(socket.SHUT_WR)

        async def collect() -> bytes:
            out = bytearray()
            while data := await loop.sock_recv(dst_out, 1 << 20):
                out += data
            return bytes(out)

        flipped_at = -1
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(feed())
                received = tg.create_task(collect())
                moved = 0
                while n := await block.fill(src, 1 << 16):
                    if flipped_at < 0:
                        block.flip_byte(n // 2)
                        flipped_at = moved + n // 2
                    await block.drain(dst)
                    moved += n
                dst.shutdown(socket.SHUT_WR)
        finally:
            block.close()
            for sock in (src_in, src, dst, dst_out):
                sock.close()
        return received.result(), flipped_at

    received, flipped_at = run(main())
    expected = bytearray(payload)
    expected[flipped_at] ^= 0xFF
    assert flipped_at >= 0 and received == bytes(expected)


def test_the_link_emulator_does_not_import_torch() -> None:
    """A relay moves bytes: each emulator process starts in a fraction of a second and holds no model library."""
    code = "import sys, minifaas.commands.link_emulator; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_an_emulator_that_refuses_its_options_is_one_line_from_it_and_one_error_from_its_starter(
    capfd: pytest.CaptureFixture[str],
) -> None:
    async def main() -> None:
        with pytest.raises(EmulatorError, match=r"exited before it was ready \(exit code 2\)"):
            async with EmulatorProcess(("127.0.0.1", 9), delay_ms=1, jitter_ms=5):
                pass

    run(main())
    err = capfd.readouterr().err  # the child's stderr, shared with this process
    assert "minifaas link-emulator: error: need delay_ms >= 0 and 0 <= jitter_ms <= delay_ms" in err
    assert "Traceback" not in err, err
