"""``minifaas train``: train a tiny hybrid checkpoint from a text file on the CPU.

    minifaas train --text data/text/tinyshakespeare.txt --out runs/shakespeare

Writes a transformers checkpoint directory that ``--model DIR`` serves, plus the training log and the state to
resume from.
"""

from __future__ import annotations

import argparse
import signal
from dataclasses import fields
from pathlib import Path

import torch

from minifaas.commands import arguments
from minifaas.commands.main import stdout_console, user_input
from minifaas.model.interleaved_decoder import generate
from minifaas.model.runtime import ModelRuntime
from minifaas.model.sampling import SamplingParams
from minifaas.train.checkpoint import load_state
from minifaas.train.train_config import TrainConfig
from minifaas.train.trainer import Trainer

SAMPLE_PROMPT = "ROMEO:\n"
DEFAULTS = {f.name: f.default for f in fields(TrainConfig) if f.name not in ("text", "out")}


# TrainConfig fields set by a flag of the same name: (type, help); each default is TrainConfig's
SETTINGS: dict[str, tuple[type, str]] = {
    "arch": (str, "a preset giving the architecture and layer schedule"),
    "layers": (int, "layers, the preset's schedule repeated (default: the preset's)"),
    "hidden": (int, "hidden size (default: the preset's)"),
    "intermediate": (int, "MLP size (default: the preset's)"),
    "seq_len": (int, "bytes per training window"),
    "batch_size": (int, "windows per step"),
    "steps": (int, "steps of the learning-rate schedule"),
    "lr": (float, "peak learning rate, after warmup"),
    "warmup_steps": (int, "steps of linear warmup (default: 50, or a tenth of --steps where --steps is 50 or fewer)"),
    "min_lr_ratio": (float, "the cosine ends at lr times this"),
    "weight_decay": (float, "AdamW weight decay on matrices"),
    "val_fraction": (float, "the end of the text held out for validation"),
    "seed": (int, "seed of the initial weights and of every batch"),
    "log_every": (int, "steps between log rows"),
    "eval_every": (int, "steps between validations"),
    "eval_batches": (int, "held-out batches per validation"),
    "save_every": (int, "steps between checkpoints"),
    "stop_at": (int, "stop (saved) after this step; --resume goes on later (default: none, all --steps)"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--text", required=True, help="the text to train on: a shipped one by name (tinyshakespeare) or a file"
    )
    parser.add_argument("--out", required=True, help="the checkpoint directory to write")
    parser.add_argument("--resume", action="store_true",
                        help="go on from OUT/training_state.pt, with its settings where no flag gives one")  # fmt: skip
    for name, (kind, help_text) in SETTINGS.items():  # absent from args unless given: see settings()
        default = "" if "default" in help_text else f" (default: {DEFAULTS[name]})"
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, default=argparse.SUPPRESS,
                            help=help_text + default)  # fmt: skip
    parser.add_argument("--threads", type=arguments.positive_int, default=1,
                        help="torch threads (default 1: fastest on shared cores)")  # fmt: skip
    parser.add_argument("--sample-tokens", type=arguments.count, default=200,
                        help="bytes sampled from the result at the end; 0: none")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    console = stdout_console()
    torch.set_num_threads(args.threads)
    with user_input():
        config = settings(args)
        trainer = Trainer(config, console)
        trainer.prepare(resume=args.resume)
    console.print(
        f"[bold]training[/] {config.arch} ({trainer.parameters / 1e6:.2f}M parameters, "
        f"{trainer.arch['num_hidden_layers']} layers) on {config.text}: {len(trainer.data.train):,} bytes, "
        f"{len(trainer.data.val):,} held out; {config.steps} steps of {config.tokens_per_step:,} tokens, "
        f"{args.threads} thread(s)"
    )
    for signum in (signal.SIGINT, signal.SIGTERM):  # finish the step, save, stop: --resume loses nothing
        signal.signal(signum, lambda n, f: _stop(trainer, n))
    result = trainer.run()
    if result.stopped:
        return 130
    val = "-" if result.val_loss is None else f"{result.val_loss:.3f}"  # None: nothing left to train
    console.print(
        f"[bold]done[/]: step {result.step}, {result.tokens:,} tokens in {result.seconds / 60:.1f} min, "
        f"validation loss {val}; checkpoint in {config.out}"
    )
    if not result.plotted:
        console.print("no loss_curve.png: matplotlib is not installed (pip install -e '.[plot]')")
    if args.sample_tokens:
        console.print(f"sample (temperature 0.8, seed 0): {sample_text(config.out, args.sample_tokens)!r}")
    return 0


def settings(args: argparse.Namespace) -> TrainConfig:
    """The run's settings: each flag given, else (with --resume) the saved run's, else the default."""
    chosen = dict(DEFAULTS)
    if args.resume:  # stop_at is the one setting a saved run has always reached
        chosen |= {k: v for k, v in load_state(Path(args.out))["config"].items() if k in SETTINGS and k != "stop_at"}
    elif "warmup_steps" not in args and "steps" in args and args.steps <= chosen["warmup_steps"]:
        chosen["warmup_steps"] = args.steps // 10
    given = {k: v for k, v in vars(args).items() if k in SETTINGS}
    return TrainConfig(text=args.text, out=args.out, **(chosen | given))


def _stop(trainer: Trainer, signum: int) -> None:
    trainer.stop_requested = True
    signal.signal(signum, signal.SIG_DFL)  # a second Ctrl-C ends the process at once (the last save stays)


def sample_text(checkpoint: str, tokens: int, prompt: str = SAMPLE_PROMPT, seed: int = 0) -> str:
    """Text from the written checkpoint, loaded back as any user would load it."""
    rt = ModelRuntime.load(checkpoint)
    params = SamplingParams(max_tokens=tokens, temperature=0.8, seed=seed, ignore_eos=True)
    return prompt + rt.tokenizer.decode(generate(rt, rt.tokenizer.encode(prompt), params))
