"""``minifaas serve``'s flags and TOML file into a ServeConfig: the API key's sources, deadlines, HTTP bounds."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from minifaas.commands.main import main
from minifaas.commands.serve import API_KEY_ENV, add_arguments, config_from_args
from minifaas.config import ServeConfig


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_api_key_comes_from_the_flag_a_file_the_environment_or_the_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    toml = tmp_path / "serve.toml"
    toml.write_text('[serve]\napi_key = "from-toml"\n')
    keyfile = tmp_path / "key"
    keyfile.write_text("from-file\nignored second line\n")
    assert config_from_args(parse("--config", str(toml))).api_key == "from-toml"
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert config_from_args(parse("--config", str(toml))).api_key == "from-env"
    assert config_from_args(parse("--api-key-file", str(keyfile))).api_key == "from-file"
    assert config_from_args(parse("--api-key-file", str(keyfile), "--api-key", "from-flag")).api_key == "from-flag"
    monkeypatch.delenv(API_KEY_ENV)
    assert config_from_args(parse()).api_key is None


@pytest.mark.parametrize("content", [None, "", "\n"])
def test_a_missing_or_empty_key_file_is_a_one_line_error(
    tmp_path: Path, content: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    keyfile = tmp_path / "key"
    if content is not None:
        keyfile.write_text(content)
    with pytest.raises(SystemExit) as done:
        main(["serve", "--api-key-file", str(keyfile)])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("minifaas serve: error: ") and "--api-key-file" in err and err.count("\n") == 1


def test_deadlines_and_http_bounds_from_flags_and_toml(tmp_path: Path) -> None:
    toml = tmp_path / "serve.toml"
    toml.write_text("[serve]\nrequest_timeout = 600.0\ntoken_timeout = 5.0\n[http]\nmax_connections = 64\n")
    config = config_from_args(parse("--config", str(toml), "--first-token-timeout", "30", "--body-timeout", "2"))
    assert (config.first_token_timeout, config.token_timeout, config.request_timeout) == (30.0, 5.0, 600.0)
    assert (config.http.max_connections, config.http.header_timeout, config.http.body_timeout) == (64, 15.0, 2.0)
    defaults = config_from_args(parse())
    assert defaults.request_timeout is None and defaults == ServeConfig()
    for bad in (["--token-timeout", "0"], ["--max-connections", "0"], ["--request-timeout", "-1"]):
        with pytest.raises(ValueError):
            config_from_args(parse(*bad))
