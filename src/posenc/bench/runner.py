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
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..registry import resolve

MODELS = ("auto", "encoder", "decoder")


@dataclass(frozen=True)
class RunConfig:
    """One training run. Every field changes the result; the key hashes all of them.

    ``train_lengths`` is the range of training lengths (or, for language modelling,
    the training context); ``test_lengths`` the lengths evaluated (the first may equal
    the longest training length: in distribution; the rest are extrapolation).
    ``model`` is ``"encoder"`` (bidirectional), ``"decoder"`` (causal) or ``"auto"``
    (the task's default). ``task_options`` are passed to the task as they are.
    """

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
    d_ff: int | None = None
    lr: float = 3e-3
    eval_samples: int = 512
    model: str = "auto"
    encoding_options: dict[str, Any] = field(default_factory=dict)
    task_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from .api import get_task

        object.__setattr__(self, "train_lengths", tuple(self.train_lengths))
        object.__setattr__(self, "test_lengths", tuple(self.test_lengths))
        task = get_task(self.task)
        resolve(self.encoding)
        if self.model not in MODELS:
            raise ConfigError(f"model must be one of {MODELS}, got {self.model!r}")
        if self.model == "auto":
            object.__setattr__(self, "model", task.default_model)
        if len(self.train_lengths) != 2:
            raise ConfigError(f"train_lengths must be (min, max), got {self.train_lengths}")
        lo, hi = self.train_lengths
        if not 1 <= lo <= hi:
            raise ConfigError(f"train_lengths must satisfy 1 <= min <= max, got {self.train_lengths}")
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
        if self.d_model % self.n_heads:
            raise ConfigError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        task.validate(self)

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["train_lengths"] = list(self.train_lengths)
        d["test_lengths"] = list(self.test_lengths)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown run settings {unknown}; known: {sorted(known)}")
        return cls(**d)

    def key(self) -> str:
        blob = json.dumps(self.as_dict(), sort_keys=True, default=str)
        return hashlib.sha1(blob.encode()).hexdigest()[:16]


def run_one(cfg: RunConfig, on_step: Callable[[int, float], None] | None = None) -> dict[str, Any]:
    """Train and evaluate one configuration with its task; return a JSON-able result."""
    from .api import get_task

    task = get_task(cfg.task)
    t0 = time.perf_counter()
    out = task.run(cfg, on_step)
    curve = out.get("curve", [])
    return {
        "key": cfg.key(),
        "config": cfg.as_dict(),
        "metric": task.metric,
        "higher_is_better": task.higher_is_better,
        "metrics": out["metrics"],
        "curve": curve,
        "train_seconds": out.get("train_seconds", round(time.perf_counter() - t0, 2)),
        "parameters": out.get("parameters"),
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
