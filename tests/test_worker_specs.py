"""Which workers a configuration asks for, where they come from, the settings of remote ones, their protocol."""

from __future__ import annotations

import argparse
from pathlib import Path

import msgspec
import pytest

from minifaas.commands.serve import add_arguments, config_from_args
from minifaas.commands.worker import parse_args
from minifaas.config import ClusterConfig, InterClusterLinkConfig, SchedulerConfig, ServeConfig
from minifaas.control.worker_ops import OPS, Decode, Sampling, from_wire
from minifaas.launch.worker_specs import planned_specs
from minifaas.model.sampling import SamplingParams
from minifaas.net.address import parse_address
from minifaas.worker.worker_process import _advertised


def test_local_workers_by_default_and_hand_started_ones_by_address() -> None:
    default = ServeConfig()
    assert [(s.name, s.role, s.cluster, s.address) for s in planned_specs(default)] == [
        ("prfaas-p0", "prefill", "prfaas", None),
        ("pd-p0", "prefill", "pd", None),
        ("pd-d0", "decode", "pd", None),
    ]
    assert default.all_local and default.link_emulated
    mixed = ServeConfig(prfaas=ClusterConfig(workers=("10.0.0.7:7000", "[fd00::7]:7001")))
    specs = planned_specs(mixed)
    assert [(s.name, s.cluster, s.address) for s in specs[:2]] == [
        ("", "prfaas", ("10.0.0.7", 7000)),
        ("", "prfaas", ("fd00::7", 7001)),
    ]
    assert [s.name for s in specs[2:]] == ["pd-p0", "pd-d0"]  # the PD cluster still starts its own
    assert not mixed.all_local and not mixed.link_emulated  # a remote worker: the link is the network
    assert not ServeConfig(launcher="ray").link_emulated
    assert ServeConfig(link=InterClusterLinkConfig(emulated=False)).link_emulated is False


def test_settings_that_cannot_hold_are_refused() -> None:
    remote = ClusterConfig(workers=("10.0.0.7:7000",))
    with pytest.raises(ValueError, match="the link is the network"):
        ServeConfig(prfaas=remote, link=InterClusterLinkConfig(emulated=True))
    with pytest.raises(ValueError, match="hand-started ones keep their role"):
        ServeConfig(pd=ClusterConfig(workers=("h:1", "h:2")), scheduler=SchedulerConfig(profile="p.json"))
    with pytest.raises(ValueError, match="not HOST:PORT"):
        ClusterConfig(workers=("no-port",))
    with pytest.raises(ValueError, match="launcher"):
        ServeConfig(launcher="k8s")
    with pytest.raises(ValueError, match="heartbeat"):
        ServeConfig(heartbeat_s=5.0, heartbeat_deadline_s=5.0)
    assert ServeConfig(prfaas=ClusterConfig(prefill_workers=0), pd=ClusterConfig(workers=("h:1", "h:2")))


def test_workers_from_toml(tmp_path: Path) -> None:
    path = tmp_path / "serve.toml"
    path.write_text(
        '[serve]\nsecret_file = "cluster.key"\nlauncher = "ray"\n'
        '[prfaas]\nworkers = ["203.0.113.7:7000"]\n'
        '[ray]\naddress = "10.0.0.1:6379"\ncpus_per_worker = 2\n'
    )
    config = ServeConfig.from_toml(path)
    assert config.prfaas.workers == ("203.0.113.7:7000",) and config.secret_file == "cluster.key"
    assert config.ray.address == "10.0.0.1:6379" and config.ray.cpus_per_worker == 2


def test_the_kv_address_a_worker_advertises() -> None:
    def args(*extra: str) -> object:
        return parse_args(["--role", "decode", "--cluster", "pd", "--model", "kimi-linear-tiny", *extra])

    assert _advertised(args(), "10.0.0.5", 7102) == ["10.0.0.5", 7102]
    assert _advertised(args(), "0.0.0.0", 7102) == ["", 7102]  # the gateway fills in where it reached us
    assert _advertised(args("--advertise", "203.0.113.9"), "0.0.0.0", 7102) == ["203.0.113.9", 7102]
    assert _advertised(args("--advertise", "203.0.113.9:31000"), "0.0.0.0", 7102) == ["203.0.113.9", 31000]
    assert _advertised(args("--advertise", "2001:db8::5"), "::", 7102) == ["2001:db8::5", 7102]  # not port 5
    assert _advertised(args("--advertise", "[2001:db8::5]:31000"), "::", 7102) == ["2001:db8::5", 31000]
    assert _advertised(args("--advertise", "[2001:db8::5]"), "::", 7102) == ["2001:db8::5", 7102]
    for bad in ("host:99999", "host:abc", ":31000"):
        with pytest.raises(SystemExit):
            args("--advertise", bad)
    assert parse_address("[::1]:80") == ("::1", 80)
    with pytest.raises(SystemExit):
        parse_args(["--role", "decode", "--cluster", "pd", "--model", "kimi-linear-tiny", "--listen", "nowhere"])


def test_the_worker_protocol_takes_every_sampling_field_the_gateway_sends() -> None:
    params = SamplingParams(
        max_tokens=9, temperature=0.7, top_p=0.9, top_k=5, min_tokens=2, presence_penalty=-1.5,
        frequency_penalty=2.0, seed=3, stop_token_ids=(1, 2), ignore_eos=True,
    )  # fmt: skip
    decode = Decode(req="r", transfer=7, tokens=[1, 2, 3], link_start=0, sampling=Sampling.of(params))
    assert from_wire(msgspec.to_builtins(decode), OPS) == decode and decode.sampling.params() == params


def _threads(c: ServeConfig) -> dict[str, int]:
    return {s.name: int(s.argv[s.argv.index("--threads") + 1]) for s in planned_specs(c)}


def test_local_cpu_workers_share_the_hosts_cores_unless_told_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    assert _threads(ServeConfig()) == {"prfaas-p0": 5, "pd-p0": 5, "pd-d0": 5}  # 16 cores, 3 workers
    wide = ServeConfig(pd=ClusterConfig(prefill_workers=8, decode_workers=12))  # more workers than cores
    assert set(_threads(wide).values()) == {1}
    told = ServeConfig(pd=ClusterConfig(prefill_workers=1, decode_workers=1, threads=3))
    assert _threads(told) == {"prfaas-p0": 10, "pd-p0": 3, "pd-d0": 3}  # what the two PD workers leave of 16
    gpu = ServeConfig(pd=ClusterConfig(prefill_workers=1, decode_workers=1, device="cuda:0"), dtype="float32")
    assert _threads(gpu) == {"prfaas-p0": 16, "pd-p0": 0, "pd-d0": 0}  # a GPU worker keeps torch's default
    assert set(_threads(ServeConfig(launcher="ray")).values()) == {0}  # a Ray node's own cores


def test_a_clusters_decode_workers_may_have_threads_of_their_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    decode = ServeConfig(pd=ClusterConfig(prefill_workers=1, decode_workers=1, decode_threads=2))
    assert _threads(decode) == {"prfaas-p0": 7, "pd-p0": 7, "pd-d0": 2}  # the other two share what it leaves
    both = ServeConfig(pd=ClusterConfig(prefill_workers=1, decode_workers=2, threads=3, decode_threads=4))
    assert _threads(both) == {"prfaas-p0": 5, "pd-p0": 3, "pd-d0": 4, "pd-d1": 4}
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    assert _threads(ServeConfig(pd=ClusterConfig(1, 1, decode_threads=2))) == {"prfaas-p0": 1, "pd-p0": 1, "pd-d0": 2}
    assert _threads(ServeConfig()) == {"prfaas-p0": 1, "pd-p0": 1, "pd-d0": 1}
    with pytest.raises(ValueError, match="decode_threads"):
        ClusterConfig(decode_threads=-1)


def test_a_toml_cluster_table_keeps_the_defaults_it_does_not_name(tmp_path: Path) -> None:
    path = tmp_path / "serve.toml"
    path.write_text("[pd]\nthreads = 1\n")
    c = ServeConfig.from_toml(path)
    assert (c.pd.prefill_workers, c.pd.decode_workers, c.pd.threads) == (1, 1, 1)
    assert c.prfaas == ServeConfig().prfaas


def test_workers_a_gateway_starts_log_at_warning_unless_serve_says_otherwise(tmp_path: Path) -> None:
    def worker_level(config: ServeConfig) -> str:
        spec = planned_specs(config)[0]
        return parse_args(["--role", spec.role, "--cluster", spec.cluster, *spec.argv]).log_level

    def serve(*argv: str) -> ServeConfig:
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        return config_from_args(parser.parse_args(argv))

    assert worker_level(ServeConfig()) == worker_level(serve()) == "WARNING"
    assert worker_level(serve("--log-level", "info")) == "INFO"
    assert parse_args(["--role", "decode", "--cluster", "pd"]).log_level == "INFO"  # started by hand: INFO
    toml = tmp_path / "serve.toml"
    toml.write_text('[serve]\nworker_log_level = "DEBUG"\n')
    assert worker_level(serve("--config", str(toml))) == "DEBUG"
    with pytest.raises(ValueError, match="worker_log_level"):
        ServeConfig(worker_log_level="LOUD")
