"""``--model`` as users give it: a hub id from the cache (offline, CLI and worker), remote code, wrong names.

The hub cache is built the way huggingface_hub lays it out (models--org--name/
blobs, snapshots/<commit>/ of links into the blobs, refs/main) in a scratch
HF_HOME, from the shipped checkpoint's files; HF_HUB_OFFLINE=1 keeps every
process off the network. The remote-code checkpoint is the same weights under
a model type of its own, whose classes live in the checkpoint's Python files.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from minifaas.control.secret import SECRET_ENV
from minifaas.model.loader import DEFAULT_MODEL, MODELS_DIR

CHECKPOINT = MODELS_DIR / "checkpoints" / DEFAULT_MODEL
REPO_ID = "minifaas-test/shakespeare"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
PROMPT = "KING RICHARD:\n"
REMOTE_CONFIG = """from transformers import Qwen3_5TextConfig


class ByteQwenConfig(Qwen3_5TextConfig):
    model_type = "minifaas_byte_qwen"
"""
REMOTE_MODEL = """from transformers import Qwen3_5ForCausalLM

from .configuration_byte_qwen import ByteQwenConfig


class ByteQwenForCausalLM(Qwen3_5ForCausalLM):
    config_class = ByteQwenConfig
"""


def build_hub_cache(hf_home: Path, repo_id: str, source: Path) -> Path:
    """A hub cache holding ``source``'s files as ``repo_id`` at COMMIT; returns the snapshot directory."""
    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for path in sorted(source.iterdir()):
        if path.is_file() and not path.name.startswith("training_state"):
            data = path.read_bytes()
            blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
            blob.write_bytes(data)
            (snapshot / path.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


@pytest.fixture(scope="module")
def offline_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    hf_home = tmp_path_factory.mktemp("hf_home")
    build_hub_cache(hf_home, REPO_ID, CHECKPOINT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return {**env, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "COLUMNS": "1000"}


@pytest.fixture(scope="module")
def from_directory(offline_env: dict[str, str]) -> str:
    return _text(_generate(str(CHECKPOINT), offline_env))


def _generate(model: str, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "minifaas.commands.main", "generate", "--model", model, "--prompt", PROMPT,
           "--max-tokens", "24", "--temperature", "0.8", "--seed", "3", *extra]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


def _text(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]  # the repr of the generated text


@pytest.mark.slow
def test_a_hub_id_loads_from_the_cache_offline_as_the_directory_does(
    offline_env: dict[str, str], from_directory: str
) -> None:
    from_hub = _generate(REPO_ID, offline_env)
    assert REPO_ID in from_hub.stdout and _text(from_hub) == from_directory


@pytest.mark.slow
def test_remote_code_runs_only_when_trusted(offline_env: dict[str, str], from_directory: str, tmp_path: Path) -> None:
    remote = tmp_path / "byte-qwen-remote"
    shutil.copytree(CHECKPOINT, remote, ignore=shutil.ignore_patterns("training_state*", "*.png", "*.jsonl"))
    config = json.loads((remote / "config.json").read_text())
    config.update(model_type="minifaas_byte_qwen", architectures=["ByteQwenForCausalLM"], auto_map={
        "AutoConfig": "configuration_byte_qwen.ByteQwenConfig",
        "AutoModelForCausalLM": "modeling_byte_qwen.ByteQwenForCausalLM",
    })  # fmt: skip
    (remote / "config.json").write_text(json.dumps(config))
    (remote / "configuration_byte_qwen.py").write_text(REMOTE_CONFIG)
    (remote / "modeling_byte_qwen.py").write_text(REMOTE_MODEL)
    refused = _generate(str(remote), offline_env)
    assert refused.returncode == 2 and "pass --trust-remote-code" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert _text(_generate(str(remote), offline_env, "--trust-remote-code")) == from_directory


def test_a_worker_process_loads_a_hub_id_offline(offline_env: dict[str, str]) -> None:
    env = {**offline_env, SECRET_ENV: "00" * 32}
    cmd = [sys.executable, "-m", "minifaas.commands.worker", "--role", "decode", "--cluster", "pd", "--name", "pd-d0",
           "--model", REPO_ID, "--prefix-cache", "none", "--dtype", "float32", "--exit-with-stdin"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        ready = json.loads(proc.stdout.readline())  # type: ignore[union-attr]  # printed once the model is loaded
        assert ready["kv"][1] > 0 and ready["pid"] == proc.pid
        control = socket.create_connection(tuple(ready["control"]), timeout=30)  # as the gateway does
    finally:
        proc.stdin.close()  # type: ignore[union-attr]  # the gateway's way of saying stop
        proc.wait(timeout=60)
    control.close()
    assert proc.returncode == 0, proc.stderr.read().decode()[-2000:]  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("model", "says"),
    [
        (
            "minifaas-test/not-cached",
            "not a preset, a shipped checkpoint or a local directory; as a hub id: "
            "not in the hub cache .*/hub, and HF_HUB_OFFLINE=1 forbids a download",
        ),
        ("no-such-model", "not a preset \\(kimi-linear-tiny, .*\\), a shipped checkpoint \\(shakespeare-qwen3.5.*hub"),
        ("/no/such/dir", "no model '/no/such/dir'"),
    ],
)
def test_a_wrong_model_is_one_line_saying_what_was_tried(offline_env: dict[str, str], model: str, says: str) -> None:
    done = _generate(model, offline_env)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("minifaas generate: error:"), done.stderr
    assert re.search(says, lines[0]), lines[0]
