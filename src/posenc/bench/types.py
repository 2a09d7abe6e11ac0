"""What a run is: the task it runs, its config, the job that shows it. The bottom of ``posenc.bench``.

A *task* (:class:`Task`) trains and evaluates one configuration; tasks register themselves by name
(:func:`register_task`) and are looked up with :func:`get_task`. A :class:`RunConfig` is one training run (every
field is part of its key); a :class:`Job` is a run of a suite with the label it is shown under.

Everything else in the harness -- the tasks and training loops, the store, the executors, the runner, the
reports, the CLI -- imports these names from here; this module imports nothing of the harness (only
:mod:`posenc.errors`, and :mod:`posenc.registry` when a config is made, to check its encoding's name: importing
this module does not import torch). The built-in tasks
(:data:`BUILTIN_PACKAGE`) are found as plugins, by walking their package by name the first time a task is looked
up, like the tasks of installed packages (entry points) and those given to :func:`posenc.bench.api.load_tasks`.
The loading of task modules for worker processes and the running of one config live in :mod:`posenc.bench.api`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import inspect
import json
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from ..errors import ConfigError, UnknownNameError

OnStep = Callable[[int, float], None]

#: the entry-point group an installed package uses to make its tasks known to ``posenc bench``
ENTRY_POINT_GROUP = "posenc.tasks"
#: the package of the built-in tasks (their runs are keyed without a version unless they declare one)
BUILTIN_PACKAGE = "posenc.bench.tasks"


class Task:
    """Base class of a benchmark task."""

    name: ClassVar[str]
    description: ClassVar[str] = ""
    metric: ClassVar[str] = "accuracy"
    higher_is_better: ClassVar[bool] = True
    #: "encoder" or "decoder": the model style used when the config says "auto"
    default_model: ClassVar[str] = "encoder"
    #: part of the run key: ``None`` means a hash of the task's source code (for a task that is not
    #: built in); set a string (``"2"``) to decide yourself when old results stop counting
    version: ClassVar[str | None] = None

    def validate(self, cfg: RunConfig) -> None:
        """Raise :class:`~posenc.errors.ConfigError` for settings this task cannot run."""

    def run(self, cfg: RunConfig, on_step: OnStep | None = None) -> dict[str, Any]:  # pragma: no cover
        raise NotImplementedError

    def chance(self, cfg: RunConfig, label: str) -> float | None:
        """The metric at evaluation ``label`` (``"32"``, ``"test"`` ...) of a model that learned nothing.

        That is the best answer that ignores the input (the majority class; for perplexity
        a uniform guess over the vocabulary), on the scale of ``metric``. The report draws
        it as the chance line and lists runs that stay near it. ``None``: unknown.
        """
        return None

    def examples(self, cfg: RunConfig, label: str) -> int | None:
        """How many examples the metric at evaluation ``label`` counts, where it is the share of them answered right.

        The report then compares two encodings on those examples, pooled over seeds and lengths
        (:mod:`posenc.bench.reporting.separation`), not on the seeds' scores alone. ``None`` (the default): the
        metric is not such a share (perplexity, F1, a share of tokens) or the count is unknown.
        """
        return None

    def training_lengths(self, cfg: RunConfig) -> tuple[int, int] | None:
        """The lengths the model is trained on, ``(shortest, longest)``, as the report states them.

        ``None``: the task does not use ``cfg.train_lengths`` (real data, whose sentences fix the
        lengths), and the report claims no training lengths for it.
        """
        return (cfg.train_lengths[0], cfg.train_lengths[1])

    def ranking_labels(self, cfg: RunConfig) -> tuple[str, ...] | None:
        """The evaluation labels whose mean ranks the encodings in the report (e.g. ``("test",)``).

        ``None`` (the default): the report's rule -- by the mean beyond the training length, then
        in distribution; for a task evaluated on splits, ``"test"`` where there is one, else every
        label. The other labels (``"valid"`` ...) are still shown as columns.
        """
        return None

    def report_sections(self, records: list[dict[str, Any]]) -> list[ReportSection]:
        """Tables and figures of this task's own, shown on the results page under its leaderboard table.

        ``records``: the stored runs of this task in one suite (their ``extra`` holds what :meth:`run` put there).
        The default: none. A section's lines must depend on the records alone (the page is checked against its
        data), and its ``draw`` (if any) writes one PNG.
        """
        return []


@dataclass(frozen=True)
class ReportSection:
    """One table or figure a task adds to the results page (:meth:`Task.report_sections`): ``slug`` names its
    picture (``<suite>-<task>-<slug>.png``), ``lines`` are Markdown, ``draw(path)`` saves the picture (or
    returns None, e.g. without matplotlib) and ``caption`` is its alt text."""

    slug: str
    title: str
    lines: tuple[str, ...]
    draw: Callable[[Path], Path | None] | None = None
    caption: str = ""


_TASKS: dict[str, Task] = {}
_VERSIONS: dict[str, str | None] = {}
T = TypeVar("T", bound=type[Task])


def is_builtin(cls: type) -> bool:
    return cls.__module__ == BUILTIN_PACKAGE or cls.__module__.startswith(BUILTIN_PACKAGE + ".")


def _source_version(cls: type) -> str:
    """``src-<hash>`` of the source of the module that defines ``cls`` (helpers included), or of the
    class alone when the module has no file (a notebook cell), or of its methods' bytecode."""
    mod = sys.modules.get(cls.__module__)
    text: str | None = None
    file = getattr(mod, "__file__", None)
    if file and str(file).endswith(".py"):
        try:
            text = Path(file).read_text(encoding="utf-8")
        except OSError:
            text = None
    if text is None:
        try:
            text = inspect.getsource(cls)
        except (OSError, TypeError):
            parts = [cls.__qualname__]
            for name, value in sorted(vars(cls).items()):
                code = getattr(getattr(value, "__func__", value), "__code__", None)
                if code is not None:
                    parts.append(f"{name}:{code.co_code.hex()}:{code.co_names}")
                elif not name.startswith("__"):
                    parts.append(f"{name}={value!r}")
            text = "\n".join(parts)
    return "src-" + hashlib.sha1(text.encode()).hexdigest()[:12]


def _compute_version(cls: type[Task]) -> str | None:
    if cls.version is not None:
        return str(cls.version)
    if is_builtin(cls):
        return None
    return _source_version(cls)


def register_task(cls: T) -> T:
    """Class decorator: register one instance of ``cls`` under ``cls.name``.

    Registering a name again replaces the task (a notebook cell run again); a warning
    says so when the new class comes from another module than the old one.
    """
    if not isinstance(getattr(cls, "name", None), str) or not cls.name:
        raise ConfigError(f"task class {cls.__qualname__} needs a name (a class attribute: name = 'my-task')")
    old = _TASKS.get(cls.name)
    if old is not None and type(old) is not cls:
        before, now = type(old).__module__, cls.__module__
        if before != now and not {before, now} <= {"__main__", "__mp_main__"}:
            warnings.warn(
                f"task {cls.name!r} from {before} is replaced by the one from {now}",
                RuntimeWarning,
                stacklevel=2,
            )
    _TASKS[cls.name] = cls()
    _VERSIONS[cls.name] = _compute_version(cls)
    return cls


def task_version(task: str | Task) -> str | None:
    """The version that goes into the run key of ``task`` (``None``: a built-in task without one)."""
    name = task if isinstance(task, str) else task.name
    get_task(name)
    return _VERSIONS.get(name)


_loaded = False


def load_builtin_tasks() -> None:
    """Import the built-in task modules and those of installed packages' entry points (once per process)."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    import pkgutil

    tasks = importlib.import_module(BUILTIN_PACKAGE)  # plugins, found by name (this module is below them)
    for mod in pkgutil.walk_packages(tasks.__path__, prefix=f"{tasks.__name__}."):
        importlib.import_module(mod.name)
    _load_entry_points()


def _load_entry_points() -> None:
    """Import the task modules that installed packages declare (group ``posenc.tasks``)."""
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            obj = ep.load()
        except Exception as exc:  # noqa: BLE001 -- one broken package must not stop the others
            warnings.warn(
                f"posenc bench: the task entry point {ep.name} = {ep.value} could not be loaded: "
                f"{type(exc).__name__}: {exc}",
                RuntimeWarning,
                stacklevel=2,
            )
            continue
        if isinstance(obj, type) and issubclass(obj, Task) and getattr(obj, "name", None) not in _TASKS:
            register_task(obj)


def get_task(name: str) -> Task:
    load_builtin_tasks()
    try:
        return _TASKS[name]
    except KeyError:
        exc = UnknownNameError("task", name, _TASKS)
        exc.args = (
            f"{exc.args[0]} A task of your own is found when its module is imported: "
            "posenc bench --import my_tasks (a module name or a .py file), or posenc.bench.load_tasks(...)",
        )
        raise exc from None


def available_tasks() -> list[str]:
    load_builtin_tasks()
    return sorted(_TASKS)


# ---------------------------------------------------------------------------- a run
MODELS = ("auto", "encoder", "decoder")


@dataclass(frozen=True)
class RunConfig:
    """One training run. Every field changes the result; the key hashes all of them.

    ``train_lengths`` is the range of training lengths (or, for language modelling,
    the training context); ``test_lengths`` the lengths evaluated (the first may equal
    the longest training length: in distribution; the rest are extrapolation).
    ``model`` is ``"encoder"`` (bidirectional), ``"decoder"`` (causal) or ``"auto"``
    (the task's default). ``task_options`` are passed to the task as they are.
    ``encoding`` may be a schedule string (``"rope@w64*3+nope"``, :mod:`posenc.schedule`), kept in its canonical
    form, so that the key tells schedules apart and equal schedules spelled two ways share their runs.
    ``task_version`` is filled in from the task (:func:`task_version`):
    ``None`` for a built-in task that declares no version, whose keys are those of
    posenc 0.1; else it is part of the key, so a task whose code changed gives new runs.
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
    task_version: str | None = None

    def __post_init__(self) -> None:
        from ..registry import resolve  # torch: on first use, so that importing this module stays light

        object.__setattr__(self, "train_lengths", tuple(self.train_lengths))
        object.__setattr__(self, "test_lengths", tuple(self.test_lengths))
        task = get_task(self.task)
        if self.task_version is None:
            object.__setattr__(self, "task_version", task_version(self.task))
        from ..schedule import Schedule, is_schedule_text

        if is_schedule_text(self.encoding):  # a schedule of encodings per layer: its canonical string is the key
            sched = Schedule.parse(self.encoding)
            if self.encoding_options:
                raise ConfigError(
                    f"encoding options {self.encoding_options} go with one encoding name; the schedule "
                    f"{str(sched)!r} gives each layer its own (rope(base=500000.0)@w64*3+nope)"
                )
            if isinstance(self.n_layers, int) and self.n_layers >= 1:
                sched.for_layers(self.n_layers)
            object.__setattr__(self, "encoding", str(sched))
        else:
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
        if d["task_version"] is None:  # built-in tasks: the key of posenc 0.1 (existing stores stay valid)
            del d["task_version"]
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
    #: why this run is a control, at chance by design (the suite's ``[controls]``); "": not a control
    control: str = ""

    def __post_init__(self) -> None:
        if not self.label:
            object.__setattr__(self, "label", default_label(self.config.encoding, self.config.encoding_options))

    @property
    def key(self) -> str:
        return self.config.key()

    @property
    def title(self) -> str:
        return f"{self.config.task}/{self.label}/seed{self.config.seed}"
