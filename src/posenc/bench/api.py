"""The task interface of ``posenc bench``: a task trains and evaluates one configuration.

A task is an object with a name, a metric and a ``run(cfg, on_step)`` method;
register it with :func:`register_task` and every suite, the CLI and the
report can use it::

    from posenc.bench.api import Task, register_task

    @register_task
    class MyTask(Task):
        name = "my-task"
        description = "what is learned, and why order matters"
        metric = "accuracy"

        def run(self, cfg, on_step=None):
            ...  # build posenc.SequenceClassifier(..., encoding=cfg.encoding), train, evaluate
            return {"metrics": {"16": 0.98, "32": 0.91}, "curve": [[25, 0.7], ...], "parameters": 12345}

``metrics`` maps an evaluation label (a test length such as ``"32"``, or a
split such as ``"test"``) to the value of ``metric``; a value of ``None`` with a
``"<label>_error"`` entry records an evaluation the encoding could not do
(e.g. a length beyond a learned table).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from ..errors import UnknownNameError

if TYPE_CHECKING:
    from .runner import RunConfig

OnStep = Callable[[int, float], None]


class Task:
    """Base class of a benchmark task."""

    name: ClassVar[str]
    description: ClassVar[str] = ""
    metric: ClassVar[str] = "accuracy"
    higher_is_better: ClassVar[bool] = True
    #: "encoder" or "decoder": the model style used when the config says "auto"
    default_model: ClassVar[str] = "encoder"

    def validate(self, cfg: RunConfig) -> None:
        """Raise :class:`~posenc.errors.ConfigError` for settings this task cannot run."""

    def run(self, cfg: RunConfig, on_step: OnStep | None = None) -> dict[str, Any]:  # pragma: no cover
        raise NotImplementedError


_TASKS: dict[str, Task] = {}
T = TypeVar("T", bound=type[Task])


def register_task(cls: T) -> T:
    """Class decorator: register one instance of ``cls`` under ``cls.name``."""
    if cls.name in _TASKS and type(_TASKS[cls.name]) is not cls:
        raise RuntimeError(f"task {cls.name!r} is registered twice")
    _TASKS[cls.name] = cls()
    return cls


_loaded = False


def _load_builtin() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    import importlib
    import pkgutil

    from . import tasks

    for mod in pkgutil.walk_packages(tasks.__path__, prefix=f"{tasks.__name__}."):
        importlib.import_module(mod.name)


def get_task(name: str) -> Task:
    _load_builtin()
    try:
        return _TASKS[name]
    except KeyError:
        raise UnknownNameError("task", name, _TASKS) from None


def available_tasks() -> list[str]:
    _load_builtin()
    return sorted(_TASKS)
