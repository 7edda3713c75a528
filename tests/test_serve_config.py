"""The serve configuration's link section: the window beside rate and delay, KV compression (TOML, flags, what the
workers are started with), defaults, and bad values refused."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from minifaas.commands.main import main
from minifaas.commands.serve import add_arguments, config_from_args
from minifaas.commands.worker import parse_args
from minifaas.config import InterClusterLinkConfig, ServeConfig
from minifaas.launch.worker_specs import worker_argv
from minifaas.net.connections import DEFAULT_CONNECTIONS
from minifaas.transport.outgoing import SenderConfig


def serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_kv_compression_from_toml_flag_and_default(tmp_path: Path) -> None:
    assert ServeConfig().link.kv_compression == "auto"
    toml = tmp_path / "serve.toml"
    toml.write_text('[link]\nrate = "50mbit"\nkv_compression = "lossless"\n')
    assert ServeConfig.from_toml(toml).link.kv_compression == "lossless"
    assert config_from_args(serve_args("--config", str(toml))).link.kv_compression == "lossless"
    assert config_from_args(serve_args("--config", str(toml), "--kv-compression", "fp8")).link.kv_compression == "fp8"


def test_a_clusters_torch_threads_from_toml_reach_its_workers(tmp_path: Path) -> None:
    toml = tmp_path / "serve.toml"
    toml.write_text("[prfaas]\nthreads = 3\n[pd]\nthreads = 2\ndecode_threads = 4\n")
    config = config_from_args(serve_args("--config", str(toml)))  # as minifaas serve reads it, flags or none
    assert (config.prfaas.threads, config.pd.threads, config.pd.decode_threads) == (3, 2, 4)
    argv = worker_argv(config, "decode", "pd")
    assert argv[argv.index("--threads") + 1] == "4"


def test_a_bad_mode_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"codec 'zip': neither a built-in \(none, lossless, fp8, int8, auto\)"):
        InterClusterLinkConfig(kv_compression="zip")
    with pytest.raises(ValueError, match="codec 'zip'"):
        config_from_args(serve_args("--kv-compression", "zip"))
    with pytest.raises(SystemExit):
        serve_args("--kv-compression", "codecs:not a class")


@pytest.mark.parametrize(("role", "cluster"), [("prefill", "prfaas"), ("prefill", "pd"), ("decode", "pd")])
def test_every_worker_gets_the_mode(role: str, cluster: str) -> None:
    config = ServeConfig(link=InterClusterLinkConfig(kv_compression="int8"))
    argv = worker_argv(config, role, cluster)
    assert parse_args(["--role", role, "--cluster", cluster, "--name", "w", *argv]).kv_compression == "int8"


def test_the_link_takes_a_window_from_toml(tmp_path: Path) -> None:
    path = tmp_path / "serve.toml"
    path.write_text('[link]\nrate = "1gbit"\nwindow = "4MiB"\ndelay_ms = 15.0\n')
    link = ServeConfig.from_toml(path).link
    assert (link.rate, link.window, link.delay_ms) == ("1gbit", "4MiB", 15.0)


def test_one_default_number_of_connections_everywhere() -> None:
    sender = SenderConfig("h", 1, b"s" * 32)
    assert InterClusterLinkConfig().connections == sender.connections == DEFAULT_CONNECTIONS == 16


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"window": "10"}, "whole number of bytes"),
        ({"window": "4XB"}, "not a size"),
        ({"rate": "fast"}, "not a rate"),
        ({"rate": "0mbit"}, "a rate must be positive, got '0mbit'"),
        ({"flow_rate": "0.0"}, "a rate must be positive, got '0.0'"),
        ({"connections": 0}, "connections 1..64"),
    ],
)
def test_bad_link_settings_are_refused_in_one_line(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        InterClusterLinkConfig(**changes)  # type: ignore[arg-type]


@pytest.mark.parametrize("command", ["serve --link-window 100", "link-emulator --target :9000 --window 100"])
def test_a_bad_window_flag_is_one_error_line(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(command.split())
    assert stopped.value.code == 2
    assert "a flow window must be a whole number of bytes >= 1500, got 100" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("toml", "error"),
    [
        ("[link]\nrate = 12\n", "[link] rate must be str, got 12"),
        ("[prfaas]\nprefill_workers = 1.5\n", "[prfaas] prefill_workers must be int, got 1.5"),
        ("[http]\nmax_connections = true\n", "[http] max_connections must be int, got True"),
        ("[serve]\nthreshold = '512'\n", "[serve] threshold must be int, got '512'"),
        ("[link]\nratez = '1mbit'\n", "[link] has no setting 'ratez'"),
        ("[serve]\nthresold = 5\n", "[serve] has no setting 'thresold'"),
        ("[foo]\nx = 1\n", "unknown tables ['foo']"),
        ("[serve]\napi_key = ''\n", "[serve] api_key is empty: give a key, or leave the setting out"),
        ("threshold = 5\n[pd]\nmax_batch = 4\n", "settings ['threshold'] outside any table: the gateway's go under"),
        ("[link]\ndelay_ms = nan\n", "delay_ms must be a finite number, got nan"),
        ("[serve]\nfirst_token_timeout = inf\n", "first_token_timeout must be a finite number, got inf"),
        ("[cache]\ncapacity_mib = nan\n", "capacity_mib must be a finite number, got nan"),
        ("[prfaas]\ndecode_workers = 1\n", "the PrfaaS cluster only prefills: [prfaas] decode_workers must be 0"),
        ("[link]\nrate = '0mbit'\n", "a rate must be positive, got '0mbit'"),
        ("[link]\ndelay_ms = 5.0\njitter_ms = 10.0\n", "0 <= jitter_ms <= delay_ms"),  # as the emulator needs
        ("[serve]\n[serve.prfaas]\nprefill_workers = 3\n", "[serve] has no setting 'prfaas': [prfaas] is a table"),
        ("[serve]\nprfaas = 3\n", "[serve] has no setting 'prfaas': [prfaas] is a table of its own"),
        ("[serve]\nlink = 'x'\n", "[serve] has no setting 'link': [link] is a table of its own"),
        ("[pd]\nworkers = [7000]\n", "[pd] workers must be a list of str, got [7000]"),
        ("[prfaas]\ndevices = ['cuda:0', 1]\n", "[prfaas] devices must be a list of str, got ['cuda:0', 1]"),
        ("[serve]\nrouter_args = 5\n", "[serve] router_args must be a table, got 5"),
        ("[scheduler]\nshort_term_args = [1]\n", "[scheduler] short_term_args must be a table, got [1]"),
    ],
)  # fmt: skip
def test_a_toml_value_of_the_wrong_type_or_name_is_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], toml: str, error: str
) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(toml)
    with pytest.raises(SystemExit) as stopped:
        main(["serve", "--config", str(path)])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert error in err and "Traceback" not in err, err


def test_a_toml_float_setting_takes_an_int(tmp_path: Path) -> None:
    path = tmp_path / "ok.toml"
    path.write_text("[serve]\ndtype = 'float32'\n[link]\ndelay_ms = 20\n[prfaas]\ndevices = ['cuda:0']\n")
    config = ServeConfig.from_toml(path)
    assert config.link.delay_ms == 20 and config.prfaas.devices == ("cuda:0",)
