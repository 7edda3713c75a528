"""TrainConfig: everything that defines a training run, validated once."""

from __future__ import annotations

from dataclasses import dataclass, fields

# May differ between a run and its --resume: they change what is printed and saved, not the weights
# (the text may be named another way: its bytes are checked instead).
RESUMABLE_CHANGES = ("text", "out", "log_every", "eval_every", "save_every", "stop_at")


@dataclass(frozen=True, slots=True)
class TrainConfig:
    text: str  # a shipped text's name (data/text/) or a file of any bytes; its last val_fraction is held out
    out: str  # the checkpoint directory written (and read back by --resume)
    arch: str = "qwen3.5-tiny"  # a preset: architecture and layer schedule
    layers: int | None = None  # resize the preset (None: as it is)
    hidden: int | None = None
    intermediate: int | None = None
    seq_len: int = 256  # bytes per training window
    batch_size: int = 8  # windows per step
    steps: int = 1200  # the learning-rate schedule's length
    lr: float = 2e-3  # peak, after warmup; cosine down to lr * min_lr_ratio at the last step
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1  # on matrices only, not on norms or biases
    grad_clip: float = 1.0
    val_fraction: float = 0.05
    seed: int = 0
    log_every: int = 10  # steps between log rows (train loss, tokens/s)
    eval_every: int = 100  # steps between validations
    eval_batches: int = 8  # held-out batches per validation, the same ones every time
    save_every: int = 100  # steps between checkpoints (weights and the state to resume from)
    stop_at: int | None = None  # stop after this step (saved), to go on later with --resume

    def __post_init__(self) -> None:
        for name in ("seq_len", "batch_size", "steps", "log_every", "eval_every", "eval_batches", "save_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"need lr > 0 and min_lr_ratio in [0, 1], got {self.lr}, {self.min_lr_ratio}")
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"warmup_steps must be in [0, steps), got {self.warmup_steps}")
        if self.weight_decay < 0 or self.grad_clip <= 0:
            raise ValueError("need weight_decay >= 0 and grad_clip > 0")
        if not 0 < self.val_fraction < 0.5:
            raise ValueError(f"val_fraction must be in (0, 0.5), got {self.val_fraction}")
        if self.stop_at is not None and not 1 <= self.stop_at <= self.steps:
            raise ValueError(f"stop_at must be in [1, steps={self.steps}], got {self.stop_at}")

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.batch_size

    @property
    def last_step(self) -> int:
        return self.stop_at or self.steps

    def resume_mismatch(self, saved: dict) -> list[str]:
        """The settings that differ from a saved run's and would change its weights."""
        return [
            f"{f.name}: saved {saved.get(f.name)!r}, now {getattr(self, f.name)!r}"
            for f in fields(self)
            if f.name not in RESUMABLE_CHANGES and saved.get(f.name) != getattr(self, f.name)
        ]
