"""Train a small model per (task, encoding, seed), test it on longer lengths, keep every result.

Every run is a pure function of its :class:`RunConfig` (the seed fixes the data
and the initialisation). Finished runs go to an SQLite store
(:mod:`posenc.bench.store`, default ``<out>/results.sqlite``) as soon as they
finish, one transaction each, written by this (the parent) process only; an
interrupted suite loses nothing it had finished and, started again, skips
exactly the runs already stored.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, PosencError
from ..registry import resolve

if TYPE_CHECKING:
    from .store import SQLiteStore
    from .suites import Suite

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


def default_label(encoding: str, options: dict[str, Any] | None = None) -> str:
    """The display name of an encoding with options: ``shaw(max_relative_position=4)``."""
    if not options:
        return encoding
    return f"{encoding}({', '.join(f'{k}={v}' for k, v in sorted(options.items()))})"


def label_of(record: dict[str, Any]) -> str:
    """The display label of a stored run (its suite's label, or the encoding and its options)."""
    cfg = record["config"]
    return record.get("label") or default_label(cfg["encoding"], cfg.get("encoding_options"))


@dataclass(frozen=True)
class Job:
    """A run of a suite: its config, the label it is shown under, the suite it belongs to."""

    config: RunConfig
    label: str = ""
    suite: str | None = None

    def __post_init__(self) -> None:
        if not self.label:
            object.__setattr__(self, "label", default_label(self.config.encoding, self.config.encoding_options))

    @property
    def key(self) -> str:
        return self.config.key()

    @property
    def title(self) -> str:
        return f"{self.config.task}/{self.label}/seed{self.config.seed}"


class RunFailedError(PosencError):
    """A run raised an error and the suite was asked to stop (``on_error="stop"``)."""


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
        **({"extra": out["extra"]} if "extra" in out else {}),
    }


class ResultStore:
    """The JSON-lines file of the first ``posenc bench`` (read for migration; see :mod:`.store`)."""

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
                with self.path.open("r+b") as f:
                    f.truncate(text.rfind(b"\n") + 1)
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()


class SuiteResults(list):
    """The finished runs of a suite (a list of records, in suite order) with ``failures`` and ``store``."""

    failures: list[dict[str, Any]]
    store_path: Path | None
    suite: Suite | None


def as_jobs(suite_or_configs: Suite | str | Path | Sequence[RunConfig | Job]) -> tuple[list[Job], Suite | None]:
    """Jobs from a suite, a suite name or file, or a list of configs / jobs."""
    from .suites import Suite, load_suite

    if isinstance(suite_or_configs, str | Path):
        suite_or_configs = load_suite(suite_or_configs)
    if isinstance(suite_or_configs, Suite):
        return suite_or_configs.jobs(), suite_or_configs
    jobs = [j if isinstance(j, Job) else Job(j) for j in suite_or_configs]
    for j in jobs:
        if not isinstance(j.config, RunConfig):
            raise ConfigError(f"run_suite takes a suite, a suite name or RunConfigs, got {type(j.config).__name__}")
    return jobs, None


def run_suite(
    suite_or_configs: Suite | str | Path | Sequence[RunConfig | Job],
    out: str | Path | None = None,
    *,
    store: str | Path | SQLiteStore | None = None,
    workers: int = 1,
    executor: str = "auto",
    progress: bool = True,
    live: bool | None = None,
    resume: bool = True,
    on_error: str = "continue",
    ray_address: str | None = None,
    ddp: int = 0,
    log: Callable[[str], None] | None = None,
) -> SuiteResults:
    """Run every job of a suite not already in the store; return the finished ones in suite order.

    ``suite_or_configs``: a :class:`~posenc.bench.suites.Suite`, a built-in suite name
    (``"quick"``), a suite file, or a list of :class:`RunConfig`. ``out`` is the output
    folder (default ``posenc-results/<suite>``), ``store`` the SQLite file (default
    ``<out>/results.sqlite``). ``executor`` is ``"local"`` (this process), ``"process"``
    (``workers`` processes), ``"ray"`` (a Ray cluster; ``ray_address`` or a local one)
    or ``"auto"`` (``process`` when ``workers > 1``). ``ddp=N`` runs each job across N
    processes with torchrun (DDP, gloo). ``resume=False`` runs finished jobs again
    (their rows are replaced only when the new run finishes). ``on_error="continue"``
    records a failed run (e.g. a missing data package) and goes on; ``"stop"`` raises
    :class:`RunFailedError` after recording it. Results are written by this process only.
    """
    from .executors import make_executor
    from .live import LiveBoard
    from .store import open_store

    if on_error not in ("continue", "stop"):
        raise ConfigError(f"on_error must be 'continue' or 'stop', got {on_error!r}")
    jobs, suite = as_jobs(suite_or_configs)
    if out is None:
        out = Path("posenc-results") / (suite.name if suite else "runs")
    out = Path(out)
    st = open_store(store if store is not None else out / "results.sqlite")
    say = log or (lambda s: print(s))
    done = st.keys() if resume else set()
    todo = [j for j in jobs if j.key not in done]
    if len(todo) < len(jobs):  # said even when quiet: it explains why nothing (or less) runs
        say(f"resuming: {len(jobs) - len(todo)} of {len(jobs)} runs already finished in {st.path}")
    ex = make_executor(executor, workers=workers, ray_address=ray_address, ddp=ddp)
    board = LiveBoard(
        jobs,
        st,
        progress=progress,
        live=progress if live is None else live,
        per_step=ex.reports_steps,
        workers=getattr(ex, "workers", 1),  # runs in parallel (1 for local, torchrun and Ray: gaps measure rate)
    )
    failures: list[dict[str, Any]] = []
    try:
        for job, record, error in ex.run(todo, board.on_step):
            if error is None:
                assert record is not None
                record = {**record, "label": job.label, "suite": job.suite}
                st.add_or_keep(record)  # locked: kept aside, imported next time
                board.finished(job, record)
            else:
                st.add_failure(job.key, job.config.as_dict(), error, job.label)
                failures.append({"key": job.key, "label": job.label, "config": job.config.as_dict(), "error": error})
                board.failed(job, error)
                if on_error == "stop":
                    raise RunFailedError(
                        f"run {job.title} failed: {error}\n(finished runs are kept in {st.path}; "
                        "pass --on-error continue to record failures and go on)"
                    )
    finally:
        board.close()
        ex.close()
    stored = st.load()
    res = SuiteResults({**stored[j.key], "label": j.label} for j in jobs if j.key in stored)
    res.failures = failures
    res.store_path = st.path
    res.suite = suite
    return res
