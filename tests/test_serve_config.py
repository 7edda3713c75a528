"""The serve configuration's KV compression setting: TOML, flags, what the workers are started with."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from minifaas.serve.config import LinkConfig, ServeConfig
from minifaas.serve.serve_cli import add_arguments, config_from_args
from minifaas.serve.worker import parse_args
from minifaas.serve.worker_specs import worker_argv


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


def test_a_bad_mode_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="kv_compression must be one of none, lossless, fp8, int8, auto, got 'zip'"):
        LinkConfig(kv_compression="zip")
    with pytest.raises(SystemExit):
        serve_args("--kv-compression", "zip")


@pytest.mark.parametrize(("role", "cluster"), [("prefill", "prfaas"), ("prefill", "pd"), ("decode", "pd")])
def test_every_worker_gets_the_mode(role: str, cluster: str) -> None:
    config = ServeConfig(link=LinkConfig(kv_compression="int8"))
    argv = worker_argv(config, role, cluster)
    assert parse_args(["--role", role, "--cluster", cluster, "--name", "w", *argv]).kv_compression == "int8"
