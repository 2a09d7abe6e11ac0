"""Train a small encoder per (task, encoding, seed), test it on longer lengths, keep every result.

Every run is a pure function of its :class:`RunConfig` (the seed fixes the data
and the initialisation). Finished runs are appended to ``results.jsonl`` in the
output folder as soon as they finish, so an interrupted suite loses nothing it
had finished; started again, it skips the runs already there.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from ..models import SequenceClassifier
from ..registry import resolve
from .tasks import N_CLASSES, VOCAB, get_task


@dataclass(frozen=True)
class RunConfig:
    """One training run. Every field changes the result; the key hashes all of them."""

    task: str = "order"
    encoding: str = "sinusoidal"
    seed: int = 0
    train_lengths: tuple[int, int] = (4, 16)
    test_lengths: tuple[int, ...] = (16, 32, 64)
    steps: int = 300
    batch_size: int = 64
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    lr: float = 3e-3
    eval_samples: int = 512
    encoding_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        get_task(self.task)
        resolve(self.encoding)
        lo, hi = self.train_lengths
        if not 2 <= lo <= hi:
            raise ConfigError(f"train_lengths must satisfy 2 <= min <= max, got {self.train_lengths}")
        if not self.test_lengths:
            raise ConfigError("test_lengths must name at least one length")
        short = [n for n in self.test_lengths if n < hi]
        if short:
            raise ConfigError(
                f"test lengths {short} are shorter than the longest training length {hi}; "
                f"test at {hi} (in distribution) and longer"
            )
        for name in ("steps", "batch_size", "d_model", "n_layers", "n_heads", "eval_samples"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["train_lengths"] = list(self.train_lengths)
        d["test_lengths"] = list(self.test_lengths)
        return d

    def key(self) -> str:
        blob = json.dumps(self.as_dict(), sort_keys=True, default=str)
        return hashlib.sha1(blob.encode()).hexdigest()[:16]


def _model(cfg: RunConfig) -> SequenceClassifier:
    return SequenceClassifier(
        VOCAB,
        N_CLASSES[cfg.task],
        encoding=cfg.encoding,
        encoding_options=cfg.encoding_options or None,
        d_model=cfg.d_model,
        n_layers=cfg.n_layers,
        n_heads=cfg.n_heads,
        max_len=max(cfg.test_lengths),
        pooling="mean",
    )


@torch.no_grad()
def evaluate(model: SequenceClassifier, task: str, length: int, n: int, seed: int) -> float:
    """Accuracy on ``n`` fresh samples of exactly ``length`` tokens."""
    model.eval()
    g = torch.Generator().manual_seed(10_000 + 97 * seed + length)
    batch = get_task(task)(n, (length, length), g)
    correct = 0
    for s in range(0, n, 256):
        logits = model(batch.tokens[s : s + 256], attention_mask=batch.attention_mask[s : s + 256])
        correct += int((logits.argmax(-1) == batch.labels[s : s + 256]).sum())
    return correct / n


def run_one(cfg: RunConfig, on_step: Callable[[int, float], None] | None = None) -> dict[str, Any]:
    """Train and evaluate one configuration; return a JSON-able result."""
    torch.manual_seed(cfg.seed)
    g = torch.Generator().manual_seed(cfg.seed)
    model = _model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.lr, total_steps=cfg.steps, pct_start=0.1)
    make = get_task(cfg.task)
    curve: list[list[float]] = []
    t0 = time.perf_counter()
    model.train()
    running = 0.0
    for step in range(1, cfg.steps + 1):
        batch = make(cfg.batch_size, cfg.train_lengths, g)
        logits = model(batch.tokens, attention_mask=batch.attention_mask)
        loss = F.cross_entropy(logits, batch.labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        value = loss.item()
        if not math.isfinite(value):
            break
        running = value if step == 1 else 0.9 * running + 0.1 * value
        if step % 25 == 0 or step == cfg.steps:
            curve.append([step, running])
        if on_step is not None:
            on_step(step, value)
    train_s = time.perf_counter() - t0
    accuracy = {}
    for n in cfg.test_lengths:
        try:
            accuracy[str(n)] = evaluate(model, cfg.task, n, cfg.eval_samples, cfg.seed)
        except Exception as exc:  # an encoding that cannot reach this length: recorded, not fatal
            accuracy[str(n)] = None
            accuracy[f"{n}_error"] = f"{type(exc).__name__}: {exc}"
    return {
        "key": cfg.key(),
        "config": cfg.as_dict(),
        "accuracy": accuracy,
        "curve": curve,
        "train_seconds": round(train_s, 2),
        "parameters": sum(p.numel() for p in model.parameters()),
        "final_loss": curve[-1][1] if curve else None,
    }


class ResultStore:
    """Append-only JSON-lines file of finished runs, keyed by :meth:`RunConfig.key`."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def load(self) -> dict[str, dict[str, Any]]:
        if not self.path.exists():
            return {}
        out: dict[str, dict[str, Any]] = {}
        lines = self.path.read_text().splitlines()
        for lineno, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                out[rec["key"]] = rec
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                # the last line may be cut short by an interruption: every earlier run is kept
                if lineno != len(lines):
                    raise ConfigError(
                        f"{self.path} line {lineno} is corrupt ({exc}); move the file away to start afresh"
                    ) from None
        return out

    def add(self, record: dict[str, Any]) -> None:
        if self.path.exists():
            text = self.path.read_bytes()
            if text and not text.endswith(b"\n"):
                # a line cut short by an interruption: drop it (it was never a finished run)
                with self.path.open("r+b") as f:
                    f.truncate(text.rfind(b"\n") + 1)
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()


def run_suite(
    configs: Sequence[RunConfig],
    out_dir: Path,
    *,
    progress: bool = True,
    resume: bool = True,
) -> list[dict[str, Any]]:
    """Run every configuration not already in ``out_dir/results.jsonl``; return all their results."""
    store = ResultStore(Path(out_dir) / "results.jsonl")
    done = store.load() if resume else {}
    todo = [c for c in configs if c.key() not in done]
    if progress and len(todo) < len(configs):
        print(f"resuming: {len(configs) - len(todo)} of {len(configs)} runs already finished in {store.path}")
    bar = None
    if progress and todo:
        from tqdm.auto import tqdm

        bar = tqdm(total=sum(c.steps for c in todo), unit="step", dynamic_ncols=True)
    try:
        for cfg in todo:
            if bar is not None:
                bar.set_description(f"{cfg.task}/{cfg.encoding}/seed{cfg.seed}")

            def tick(step: int, loss: float) -> None:
                if bar is not None:
                    bar.update(1)
                    if step % 25 == 0:
                        bar.set_postfix(loss=f"{loss:.3f}")

            rec = run_one(cfg, tick)
            store.add(rec)
            done[rec["key"]] = rec
    finally:
        if bar is not None:
            bar.close()
    return [done[c.key()] for c in configs]
