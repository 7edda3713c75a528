"""minifaas train: the byte tokenizer files, seeded and resumable training, the checkpoint it writes."""

from __future__ import annotations

import argparse
import itertools
import os
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from preloaded import Preloaded
from rich.console import Console

from minifaas.commands import train as train_command
from minifaas.model.interleaved_decoder import generate
from minifaas.model.loader import ModelSpec
from minifaas.model.runtime import ModelRuntime
from minifaas.model.sampling import SamplingParams
from minifaas.model.tokenizer import ByteTokenizer, HFTokenizer
from minifaas.train.checkpoint import STATE_FILE
from minifaas.train.tokenizer_files import write_byte_tokenizer
from minifaas.train.train_config import TrainConfig
from minifaas.train.train_log import LOG_FILE, PLOT_FILE, plot_loss, read_log
from minifaas.train.trainer import Trainer, learning_rate

ROOT = Path(__file__).resolve().parent.parent
TEXT = ROOT / "data" / "text" / "tinyshakespeare.txt"
SAMPLES = ["To be, or not to be", "héllo wörld 日本語 🎭", "tabs\tand\nnewlines\r\n", "\x00\x01\x7f", ""]


def tiny(out: Path, **changes: object) -> TrainConfig:
    c = TrainConfig(str(TEXT), str(out), layers=4, hidden=64, intermediate=128, seq_len=32, batch_size=2, steps=6,
                    warmup_steps=2, log_every=2, eval_every=3, eval_batches=1, save_every=3)  # fmt: skip
    return replace(c, **changes)


def train(config: TrainConfig, resume: bool = False) -> Trainer:
    trainer = Trainer(config, Console(quiet=True))
    trainer.prepare(resume=resume)
    trainer.run()
    return trainer


def test_byte_tokenizer_files_give_the_byte_tokenizers_ids(tmp_path: Path) -> None:
    write_byte_tokenizer(tmp_path)
    hf, byte = HFTokenizer(tmp_path), ByteTokenizer()
    assert (hf.vocab_size, hf.eos_token_id) == (byte.vocab_size, byte.eos_token_id)
    for text in SAMPLES:
        assert hf.encode(text) == byte.encode(text)
        assert hf.decode(byte.encode(text)) == text
    assert hf.decode([byte.bos_token_id, *byte.encode("hi"), byte.eos_token_id]) == "hi"
    messages = [{"role": "system", "content": "Speak verse."}, {"role": "user", "content": "Who's there?"}]
    assert hf.chat(messages) == byte.chat(messages)


def test_learning_rate_warms_up_then_decays_to_its_floor() -> None:
    c = TrainConfig("t", "o", steps=100, warmup_steps=10, lr=1e-3, min_lr_ratio=0.1)
    assert learning_rate(c, 5) == pytest.approx(5e-4)
    assert learning_rate(c, 10) == pytest.approx(1e-3)
    assert learning_rate(c, 100) == pytest.approx(1e-4)
    rates = [learning_rate(c, s) for s in range(10, 101)]
    assert all(a >= b for a, b in itertools.pairwise(rates))


def test_bad_settings_are_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="warmup_steps"):
        TrainConfig("t", "o", steps=10, warmup_steps=10)
    with pytest.raises(ValueError, match="stop_at"):
        TrainConfig("t", "o", steps=10, warmup_steps=1, stop_at=11)
    with pytest.raises(ValueError, match="no full-attention layer"):
        Trainer(tiny(Path("unused"), layers=2), Console(quiet=True))
    with pytest.raises(FileNotFoundError, match=r"not a shipped text \(tinyshakespeare\) or a file"):
        Trainer(tiny(Path("unused"), text="no-such-text"), Console(quiet=True))


@pytest.mark.parametrize("size", [0, 30])
def test_a_text_too_short_for_one_window_is_refused_by_its_size(size: int, tmp_path: Path) -> None:
    text = tmp_path / "short.txt"
    text.write_bytes(b"a" * size)
    training = int(size * (1 - 0.05))  # the default validation share
    with pytest.raises(ValueError, match=rf"short\.txt: {training} training bytes, fewer than the 34 a window needs"):
        Trainer(tiny(tmp_path / "out", text=str(text)), Console(quiet=True))


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("straight")
    train(tiny(out))
    return out


def test_a_run_writes_a_checkpoint_that_loads_as_any_other(straight: Path) -> None:
    names = {p.name for p in straight.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= names
    assert {"tokenizer_config.json", "chat_template.jinja", LOG_FILE, PLOT_FILE, STATE_FILE} <= names
    rows = read_log(straight / LOG_FILE)
    assert [r["step"] for r in rows] == [2, 4, 6]
    assert [r["step"] for r in rows if "val_loss" in r] == [6]
    assert rows[-1]["tokens"] == 6 * 2 * 32
    assert ModelSpec.resolve(str(straight)).kind == "checkpoint"
    rt = ModelRuntime.load(str(straight))
    assert rt.model.dtype.is_floating_point and isinstance(rt.tokenizer, HFTokenizer)
    assert len(generate(rt, rt.tokenizer.encode("ROMEO:"), SamplingParams(max_tokens=4, ignore_eos=True))) == 4


def test_training_is_seeded(straight: Path, tmp_path: Path) -> None:
    again = train(tiny(tmp_path / "again"))
    assert (tmp_path / "again" / "model.safetensors").read_bytes() == (straight / "model.safetensors").read_bytes()
    assert read_log(tmp_path / "again" / LOG_FILE)[-1]["val_loss"] == read_log(straight / LOG_FILE)[-1]["val_loss"]
    other = train(tiny(tmp_path / "other", seed=1))
    assert other.evaluate() != again.evaluate()


def test_a_resumed_run_continues_exactly(straight: Path, tmp_path: Path) -> None:
    out = tmp_path / "resumed"
    first = train(tiny(out, stop_at=4))
    assert first.step == 4 and read_log(out / LOG_FILE)[-1]["step"] == 4
    with pytest.raises(FileExistsError, match="--resume"):
        train(tiny(out))
    with pytest.raises(ValueError, match=r"lr: saved 0\.002, now 0\.001"):
        train(tiny(out, lr=1e-3), resume=True)
    second = train(tiny(out), resume=True)
    assert second.step == 6
    assert (out / "model.safetensors").read_bytes() == (straight / "model.safetensors").read_bytes()
    assert [r["step"] for r in read_log(out / LOG_FILE)] == [2, 4, 6]


def command_settings(*flags: str) -> TrainConfig:
    parser = argparse.ArgumentParser()
    train_command.add_arguments(parser)
    return train_command.settings(parser.parse_args(["--text", str(TEXT), *flags]))


def test_the_command_resumes_with_the_saved_settings_where_no_flag_gives_one(tmp_path: Path) -> None:
    out = tmp_path / "resumed"
    train(tiny(out, stop_at=4, log_every=3))
    assert command_settings("--out", str(out), "--resume") == tiny(out, log_every=3)
    assert command_settings("--out", str(out), "--resume", "--log-every", "1") == tiny(out, log_every=1)
    assert command_settings("--out", str(tmp_path / "new")) == TrainConfig(str(TEXT), str(tmp_path / "new"))


def test_a_short_run_warms_up_for_a_tenth_of_its_steps_unless_told() -> None:
    assert command_settings("--out", "o").warmup_steps == 50
    assert command_settings("--out", "o", "--steps", "51").warmup_steps == 50
    assert command_settings("--out", "o", "--steps", "30").warmup_steps == 3
    assert command_settings("--out", "o", "--steps", "30", "--warmup-steps", "7").warmup_steps == 7
    with pytest.raises(ValueError, match="warmup_steps"):
        command_settings("--out", "o", "--steps", "30", "--warmup-steps", "30")


def test_out_is_a_directory(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file: the checkpoint is a directory"):
        train(tiny(tmp_path / "a-file"))


def test_resume_needs_a_saved_run(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no training_state\.pt"):
        train(tiny(tmp_path), resume=True)


def test_without_matplotlib_no_png_is_written(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert plot_loss([{"tokens": 1, "train_loss": 2.0}], tmp_path / "x.png", "t") is False
    assert not (tmp_path / "x.png").exists()


@pytest.mark.slow
def test_the_command_stops_on_sigterm_saved_and_resumes(tmp_path: Path, python: Preloaded) -> None:
    out = tmp_path / "cli"
    cmd = ["-m", "minifaas.commands.main", "train", "--text", "tinyshakespeare", "--out", str(out),
           "--layers", "4", "--hidden", "64", "--intermediate", "128", "--seq-len", "32", "--batch-size", "2",
           "--steps", "150", "--warmup-steps", "1", "--log-every", "1", "--eval-every", "75", "--eval-batches", "1",
           "--sample-tokens", "8"]  # fmt: skip
    proc = python.start(cmd, cwd=ROOT, env=dict(os.environ))
    deadline = time.monotonic() + 120
    log = out / LOG_FILE
    while not (log.is_file() and log.read_text().endswith("\n")) and time.monotonic() < deadline:
        time.sleep(0.1)  # until the first row is written whole
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "stopped after step" in stdout, stderr[-2000:]
    stopped = torch.load(out / STATE_FILE, weights_only=True)["step"]
    assert 1 <= stopped < 150
    resume = [*cmd[:7], "--sample-tokens", "8", "--resume"]  # the saved run's settings, none given again
    done = python.run(resume, cwd=ROOT, env=dict(os.environ), timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "step 150/150" in done.stdout and "sample (temperature 0.8" in done.stdout
    assert [r["step"] for r in read_log(out / LOG_FILE)] == list(range(1, 151))
    again = python.run(cmd, cwd=ROOT, env=dict(os.environ), timeout=300)
    assert again.returncode == 2 and "add --resume" in again.stderr and "Traceback" not in again.stderr
