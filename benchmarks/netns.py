"""A real kernel bottleneck for the transport (Linux, root): two network namespaces, one veth, tbf.

The userspace emulator paces bytes but never drops a packet. Here both ends of
a veth pair live in their own namespace and each egress goes through a token
bucket filter with a short queue, so a sender that outruns the rate overflows
a real queue, loses packets and retransmits, and TCP_INFO shows it.

    reason = unavailable()              # None, or why this host cannot do it
    with NetnsLink(rate="50mbit", rtt_ms=30, window_bytes=64_000) as link:
        subprocess.run(link.exec("a", [sys.executable, "-m", ...]))   # a process inside namespace a

``rtt_ms``: a round trip, made by ``netns_delay`` in user space on the return
path (b to a), since netem is not on every kernel. ``window_bytes``: b
advertises about that window to a (its route's ``window`` metric; the kernel
keeps it a little above the clamp, and not below about 60 KB), so one
connection from a keeps about that much in flight, like a long fat pipe's
window-limited TCP. The namespaces (and the veth, tun and delay process in
them) are gone on exit, also after an error half-way through setting up.
``python benchmarks/netns.py`` runs the two ends of a measurement
inside them: ``sink`` (a KV receiver) and ``probe`` (a KV sender that prints
link-health readings as JSON lines); ``run_pair`` runs a sink and a sender.

With ``from_root=True`` each namespace also gets an unshaped veth to the root
namespace (``root_addresses``), so a process in the root namespace (a gateway)
reaches both "hosts" while traffic between them crosses the shaped link:
the two-host deployment of docs/DEPLOY.md on one machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import select
import shutil
import subprocess
import sys
from itertools import count
from pathlib import Path
from typing import Any

from minifaas.commands import arguments
from minifaas.emulator.pacer import check_window, parse_rate
from minifaas.net.connections import DEFAULT_CONNECTIONS
from minifaas.net.errors import TransferError
from minifaas.net.link_health import LinkMonitor

_serial = count()
HERE = Path(__file__).resolve().parent
NETNS = str(HERE / "netns.py")  # this program: ``python NETNS sink|probe ...``
NETNS_DELAY = str(HERE / "netns_delay.py")
_TUN = "mfrtt"  # the delay process's tun, inside namespace b


def unavailable() -> str | None:
    """Why namespaces cannot be built here, or None if they can."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs the ip and tc commands (iproute2)"
    probe = f"mfprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=10)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=10)
    return None


class NetnsLink:
    def __init__(
        self,
        rate: str = "50mbit",
        queue_bytes: int = 32_000,
        burst_bytes: int = 16_000,
        rtt_ms: float = 0.0,
        window_bytes: int | None = None,
        from_root: bool = False,
    ):
        if parse_rate(rate) is None:
            raise ValueError("a namespace link needs a finite rate")
        if not 0 <= rtt_ms <= 10_000:
            raise ValueError(f"rtt_ms must be in [0, 10000], got {rtt_ms}")
        self.rate, self.queue_bytes, self.burst_bytes = rate, queue_bytes, burst_bytes
        self.rtt_ms, self.window_bytes = rtt_ms, check_window(window_bytes)
        self.from_root = from_root
        tag = f"{os.getpid() % 100000}x{next(_serial)}"
        self.namespaces = {"a": f"mfa{tag}", "b": f"mfb{tag}"}
        self.devices = {"a": f"mfva{tag}", "b": f"mfvb{tag}"}
        subnet = 1 + (os.getpid() + next(_serial)) % 250
        self.addresses = {"a": f"10.201.{subnet}.1", "b": f"10.201.{subnet}.2"}  # the two ends of the link
        self._root_devices = {"a": f"mfra{tag}", "b": f"mfrb{tag}"}
        self._root_subnets = {"a": f"10.202.{subnet}", "b": f"10.203.{subnet}"}
        self.root_addresses = {side: f"{net}.2" for side, net in self._root_subnets.items()}  # each seen from root
        self._delay: subprocess.Popen[str] | None = None

    def __enter__(self) -> NetnsLink:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def exec(self, side: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[side], *argv]

    def _build(self) -> None:
        a, b = self.namespaces["a"], self.namespaces["b"]
        _ip("netns", "add", a)
        _ip("netns", "add", b)
        _ip("link", "add", self.devices["a"], "netns", a, "type", "veth", "peer", "name", self.devices["b"], "netns", b)
        for side in ("a", "b"):
            ns, dev = self.namespaces[side], self.devices[side]
            _ip("-n", ns, "addr", "add", f"{self.addresses[side]}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            # sender-side offloads would hand tbf 64 KB super-packets; real links see MTU-sized ones
            subprocess.run(["ip", "netns", "exec", ns, "ethtool", "-K", dev, "tso", "off", "gso", "off"],
                           capture_output=True, timeout=10)  # fmt: skip
            shaper = ["tbf", "rate", self.rate, "burst", str(self.burst_bytes), "limit", str(self.queue_bytes)]
            _tc("-n", ns, "qdisc", "add", "dev", dev, "root", *shaper)
        if self.rtt_ms or self.window_bytes:
            self._route_back()

        if self.from_root:
            for side, ns in self.namespaces.items():
                outside, inside, net = (
                    self._root_devices[side],
                    f"{self._root_devices[side]}i",
                    self._root_subnets[side],
                )
                _ip("link", "add", outside, "type", "veth", "peer", "name", inside, "netns", ns)
                _ip("addr", "add", f"{net}.1/30", "dev", outside)
                _ip("link", "set", outside, "up")
                _ip("-n", ns, "addr", "add", f"{net}.2/30", "dev", inside)
                _ip("-n", ns, "link", "set", inside, "up")

    def _route_back(self) -> None:
        """b's route to a: through the delay process's tun when there is a round trip (everything b
        sends a then comes one RTT late), and with the window b advertises to a."""
        ns, dev = self.namespaces["b"], self.devices["b"]
        if self.rtt_ms:
            self._start_delay()
            _ip("-n", ns, "link", "set", _TUN, "up")
            for conf in ("all", self.devices["b"]):  # a's packets come in on the veth, b's replies leave by the tun
                _sysctl(ns, f"net.ipv4.conf.{conf}.rp_filter=0")
            dev = _TUN
        window = ["window", str(self.window_bytes)] if self.window_bytes else []
        _ip("-n", ns, "route", "add", f"{self.addresses['a']}/32", "dev", dev, *window)

    def _start_delay(self) -> None:
        shown = json.loads(_output(["ip", "-n", self.namespaces["a"], "-j", "link", "show", self.devices["a"]]))
        argv = [sys.executable, NETNS_DELAY, "--tun", _TUN, "--out", self.devices["b"],
                "--to", shown[0]["address"], "--delay-ms", str(self.rtt_ms)]  # fmt: skip
        self._delay = subprocess.Popen(self.exec("b", argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        stdout = self._delay.stdout
        assert stdout is not None
        ready, _, _ = select.select([stdout], [], [], 30)
        if not ready or not stdout.readline():
            self._stop_delay()
            raise RuntimeError(f"the delay process did not start: {self._delay.stderr.read().strip()!r}")  # type: ignore[union-attr]

    def _stop_delay(self) -> None:
        if self._delay is not None and self._delay.poll() is None:
            self._delay.terminate()
            try:
                self._delay.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._delay.kill()
                self._delay.wait()

    def sent_bytes(self, side: str) -> int:
        """Bytes the shaped end of ``side`` has sent across the link (its tbf's counter)."""
        argv = ["tc", "-n", self.namespaces[side], "-j", "-s", "qdisc", "show", "dev", self.devices[side]]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=True)
        return max(q.get("bytes", 0) for q in json.loads(done.stdout))

    def close(self) -> None:
        self._stop_delay()
        if self.from_root:  # the root ends at once (a namespace's own devices go with it, in the background)
            for device in self._root_devices.values():
                subprocess.run(["ip", "link", "del", device], capture_output=True, timeout=10)
        for ns in self.namespaces.values():  # deleting a namespace deletes the veth end and tun inside it
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


def _ip(*args: str) -> None:
    _run(["ip", *args])


def _tc(*args: str) -> None:
    _run(["tc", *args])


def _sysctl(namespace: str, setting: str) -> None:
    _run(["ip", "netns", "exec", namespace, "sysctl", "-qw", setting])


def _run(argv: list[str]) -> None:
    _output(argv)


def _output(argv: list[str]) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=10)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")
    return done.stdout


# --- the two ends of a measurement, run inside the namespaces ---

SECRET_ENV = "MINIFAAS_KV_SECRET"


def run_pair(link: NetnsLink, sender: list[str], env: dict[str, str], timeout: float) -> list[dict[str, Any]]:
    """A sink (a KV receiver taking transfers 0, 1, ...) in namespace b and ``sender`` in a, given the sink's
    address as ``--connect``: the JSON lines the sender printed. Both processes are gone on return."""
    b = link.addresses["b"]
    sink_argv = [sys.executable, NETNS, "sink", "--listen", f"{b}:0", "--transfers", "0",
                 "--accept-unchecked"]  # fmt: skip
    sink = subprocess.Popen(link.exec("b", sink_argv), stdout=subprocess.PIPE, env=env, text=True)
    try:
        port = json.loads(sink.stdout.readline())["port"]  # type: ignore[union-attr]
        done = subprocess.run(link.exec("a", [*sender, "--connect", f"{b}:{port}"]), capture_output=True, env=env,
                              text=True, timeout=timeout)  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(sender[:4])} failed: {done.stderr[-2000:]}")
        return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    finally:
        sink.kill()
        sink.wait()


async def _sink(host: str, port: int, transfers: int, accept_unchecked: bool) -> None:
    from minifaas.transport.receiver import KVReceiver, ReceiverConfig

    secret = os.environb[SECRET_ENV.encode()]
    async with KVReceiver(ReceiverConfig(secret, host=host, port=port, accept_unchecked=accept_unchecked)) as rx:
        print(json.dumps({"port": rx.port}), flush=True)
        transfer_id = 0
        while transfers == 0 or transfer_id < transfers:  # 0: serve until killed
            try:
                rx.release(await rx.transfer(transfer_id).model_state())
            except TransferError as e:  # the sender sees it too; keep serving the next transfers
                print(json.dumps({"transfer": transfer_id, "error": f"{type(e).__name__}: {e}"}), flush=True)
            transfer_id += 1


async def _probe(host: str, port: int, args: argparse.Namespace) -> None:
    from synthetic import bulk_state

    from minifaas.transport.outgoing import KVSender, SenderConfig

    state = bulk_state(args.bytes)
    monitor = LinkMonitor(parse_rate(args.rate) or 1.0)
    sizes = {name: value for name in ("chunk_bytes", "unsent_bytes") if (value := getattr(args, name)) is not None}
    config = SenderConfig(host, port, os.environb[SECRET_ENV.encode()], connections=args.connections,
                          done_timeout=120, **sizes)  # fmt: skip
    async with KVSender(config) as tx, asyncio.TaskGroup() as tg:
        loop = asyncio.get_running_loop()
        if args.warm_up:  # transfer 0 dials and authenticates every connection; the measured one is transfer 1
            await tx.send(0, bulk_state(64 << 10))
        sending = tg.create_task(tx.send(int(args.warm_up), state))
        while not sending.done():
            await asyncio.wait([sending], timeout=0.2)
            health = monitor.update(loop.time(), tx.tcp_infos(), tx.queued_bytes)
            print(json.dumps({"health": _as_dict(health)}), flush=True)
        report = sending.result()
        print(json.dumps({"done": {"bytes": report.nbytes, "seconds": report.seconds}}), flush=True)


def _as_dict(obj: Any) -> dict[str, Any]:
    return {name: getattr(obj, name) for name in obj.__slots__}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/netns.py", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="role", required=True)
    sink = sub.add_parser("sink", help="a KV receiver that takes transfers 0..N-1, in turn, and drops them")
    sink.add_argument("--listen", required=True, help="HOST:PORT")
    sink.add_argument("--transfers", type=arguments.count, default=1, help="0: until killed")
    sink.add_argument("--accept-unchecked", action="store_true", help="take chunks sent without payload checksums")
    probe = sub.add_parser("probe", help="a KV sender that prints link-health readings")
    probe.add_argument("--connect", required=True, help="HOST:PORT")
    probe.add_argument("--bytes", type=arguments.positive_int, default=8 << 20)
    probe.add_argument("--connections", type=arguments.positive_int, default=DEFAULT_CONNECTIONS)
    probe.add_argument("--rate", default="50mbit", help="the link rate utilisation is measured against")
    probe.add_argument("--warm-up", action="store_true", help="first a small transfer (0) to open the connections")
    probe.add_argument(
        "--chunk-bytes", type=arguments.positive_int, help="the sender's chunk (default: SenderConfig's)"
    )
    probe.add_argument(
        "--unsent-bytes", type=arguments.positive_int, help="the sender's unsent budget (default: SenderConfig's)"
    )
    args = parser.parse_args(argv)
    if args.role == "sink":
        host, _, port = args.listen.rpartition(":")
        asyncio.run(_sink(host, int(port), args.transfers, args.accept_unchecked))
    else:
        host, _, port = args.connect.rpartition(":")
        asyncio.run(_probe(host, int(port), args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
