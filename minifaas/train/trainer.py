"""The training loop: AdamW, warmup then cosine, periodic validation, checkpoints, exact resume.

Weights start from ``torch.manual_seed(seed)`` and batches from (seed, step), so a run is the same on every start
and a resumed run continues bit for bit.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from minifaas.model.kernels import select_kernels
from minifaas.model.loader import config_from_dict
from minifaas.train.architecture import architecture_dict
from minifaas.train.checkpoint import STATE_FILE, clear_exports, export_checkpoint, load_state, save_state
from minifaas.train.text_data import TextData
from minifaas.train.train_config import TrainConfig
from minifaas.train.train_log import LOG_FILE, PLOT_FILE, TrainLog, plot_loss, read_log


@dataclass(frozen=True, slots=True)
class TrainResult:
    step: int
    tokens: int
    seconds: float  # wall time of training, over every resumed session
    val_loss: float | None
    plotted: bool
    stopped: bool  # by request (a signal) before the last step


def learning_rate(c: TrainConfig, step: int) -> float:
    """Linear warmup to ``lr`` over ``warmup_steps``, then cosine down to ``lr * min_lr_ratio``."""
    if step <= c.warmup_steps:
        return c.lr * step / max(c.warmup_steps, 1)
    progress = (step - c.warmup_steps) / (c.steps - c.warmup_steps)
    return c.lr * (c.min_lr_ratio + (1 - c.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class Trainer:
    def __init__(self, config: TrainConfig, console: Console) -> None:
        self.c, self.console = config, console
        self.out = Path(config.out)
        self.data = TextData(config.text, config.val_fraction, config.seq_len)
        select_kernels("cpu")  # before transformers loads the model code
        from transformers import AutoModelForCausalLM

        self.arch = architecture_dict(config.arch, config.layers, config.hidden, config.intermediate)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            self.model = AutoModelForCausalLM.from_config(config_from_dict(self.arch), dtype=torch.float32)
        self.model.train()
        matrices = [p for p in self.model.parameters() if p.dim() >= 2]
        others = [p for p in self.model.parameters() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": matrices, "weight_decay": config.weight_decay}, {"params": others, "weight_decay": 0.0}],
            lr=config.lr,
            betas=(0.9, 0.95),
        )
        self.val = self.data.val_batches(config.eval_batches, config.batch_size)
        self.step, self.seconds = 0, 0.0
        self.stop_requested = False  # set from a signal handler: the loop stops, saved, after the step under way
        self.resumed = False

    @property
    def parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def resume(self) -> None:
        state = load_state(self.out)
        wrong = self.c.resume_mismatch(state["config"])
        if state["text_sha256"] != self.data.sha256:
            wrong.append(f"text: {self.c.text} is not the text the saved run trained on")
        if wrong:
            raise ValueError("--resume: the saved run was started differently: " + "; ".join(wrong))
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.seconds = int(state["step"]), float(state["seconds"])

    def prepare(self, resume: bool = False) -> None:
        """The output directory, and the saved run to go on from: its errors are the user's to fix."""
        if self.out.exists() and not self.out.is_dir():
            raise NotADirectoryError(f"--out {self.out} is a file: the checkpoint is a directory")
        self.out.mkdir(parents=True, exist_ok=True)
        clear_exports(self.out)
        if resume:
            self.resume()
        elif (self.out / STATE_FILE).exists():
            raise FileExistsError(
                f"{self.out} holds a run already: add --resume to go on with it, or pick another --out"
            )
        self.resumed = resume

    def run(self) -> TrainResult:
        """Train from the step ``prepare`` left (``prepare`` first) to ``last_step``, or until stopped."""
        log = TrainLog(self.out, self.step if self.resumed else None)
        first, val_loss = self.step, None
        session_start = time.perf_counter()
        with self._progress() as progress:
            task = progress.add_task("training", total=self.c.last_step, completed=self.step, rate="-", loss="-")
            losses: list[float] = []
            window_start = time.perf_counter()
            while self.step < self.c.last_step and not self.stop_requested:
                losses.append(self._train_step(self.step + 1))
                self.step += 1
                progress.update(task, completed=self.step)
                if self.step % self.c.log_every == 0 or self.step == self.c.last_step:
                    now = time.perf_counter()
                    rate = len(losses) * self.c.tokens_per_step / (now - window_start)
                    row = self._row(sum(losses) / len(losses), rate, session_start)
                    losses, window_start = [], now
                    if self.step % self.c.eval_every == 0 or self.step == self.c.last_step:
                        row["val_loss"] = val_loss = self.evaluate()
                        self._say(row, first, session_start)
                    log.write(row)
                    progress.update(task, rate=f"{rate:,.0f}", loss=f"{row['train_loss']:.3f}")
                if self.step % self.c.save_every == 0 or self.step == self.c.last_step or self.stop_requested:
                    self.save(session_start)
        if self.stop_requested:
            self.console.print(f"stopped after step {self.step}: saved; the same command with --resume goes on")
        self.seconds += time.perf_counter() - session_start
        plotted = (self.out / PLOT_FILE).is_file()
        tokens = self.step * self.c.tokens_per_step
        return TrainResult(self.step, tokens, self.seconds, val_loss, plotted, self.stop_requested)

    def _train_step(self, step: int) -> float:
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate(self.c, step)
        inputs, targets = self.data.batch(self.c.seed, step, self.c.batch_size)
        loss = self._loss(inputs, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.c.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    def _loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=inputs, use_cache=False).logits  # [batch, seq, vocab]
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean next-byte loss over the held-out batches."""
        self.model.eval()
        try:
            return sum(float(self._loss(x, y)) for x, y in self.val) / len(self.val)
        finally:
            self.model.train()

    def save(self, session_start: float) -> None:
        """The checkpoint, the state to resume from, and the loss curve, as of ``self.step``."""
        export_checkpoint(self.model, self.out)
        seconds = self.seconds + time.perf_counter() - session_start
        save_state(
            self.out,
            {
                "config": asdict(self.c),
                "text_sha256": self.data.sha256,
                "step": self.step,
                "seconds": seconds,
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
            },
        )
        title = f"{self.arch['model_type']}, {self.parameters / 1e6:.1f}M parameters, {self.data.path.name}"
        plot_loss(read_log(self.out / LOG_FILE), self.out / PLOT_FILE, title)

    def _row(self, train_loss: float, rate: float, session_start: float) -> dict:
        seconds = self.seconds + time.perf_counter() - session_start
        tokens = self.step * self.c.tokens_per_step
        return {"step": self.step, "tokens": tokens, "seconds": round(seconds, 1), "train_loss": round(train_loss, 4),
                "lr": learning_rate(self.c, self.step), "tokens_per_s": round(rate, 1)}  # fmt: skip

    def _say(self, row: dict, first: int, session_start: float) -> None:
        spent = time.perf_counter() - session_start
        eta = (self.c.last_step - self.step) * spent / max(self.step - first, 1)
        self.console.print(
            f"step {self.step}/{self.c.last_step}  tokens {row['tokens']:,}  train {row['train_loss']:.3f}  "
            f"val {row['val_loss']:.3f}  lr {row['lr']:.2e}  {row['tokens_per_s']:,.0f} tok/s  "
            f"elapsed {_clock(row['seconds'])}  ETA {_clock(eta)}"
        )

    def _progress(self) -> Progress:
        return Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[rate]} tok/s  loss {task.fields[loss]}"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=self.console,
        )


def _clock(seconds: float) -> str:
    minutes, s = divmod(int(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{s:02d}"
