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
(e.g. a length beyond a learned table). ``chance(cfg, label)`` says what a model
that learned nothing scores there (the report's chance line).

Where tasks come from (in the parent and in every worker process, Ray task and
torchrun rank alike): the built-in modules of :mod:`posenc.bench.tasks`; the
modules of installed packages that declare an entry point in the group
``posenc.tasks`` (:data:`ENTRY_POINT_GROUP`); and the modules given to
:func:`load_tasks` (``posenc bench --import my_tasks``, a module name or a path
to a ``.py`` file). See ``docs/tasks.md``.

A task has a *version* (:func:`task_version`) that is part of the run key of a
task that is not built in, so that editing a task's code gives new runs instead
of silently stale results.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from ..errors import ConfigError, UnknownNameError

if TYPE_CHECKING:
    from .runner import RunConfig

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


def _load_builtin() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    import pkgutil

    from . import tasks

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


# ---------------------------------------------------------------------------- user task modules
#: the task modules loaded by load_tasks in this process: spec as given -> (module name, spec for workers)
_IMPORTED: dict[str, str] = {}


def _is_path(spec: str) -> bool:
    return spec.endswith(".py") or os.sep in spec or (os.altsep is not None and os.altsep in spec)


def _load_path(path: Path) -> ModuleType:
    path = path.resolve()
    if not path.is_file():
        raise ConfigError(f"--import {path}: no such file")
    for mod in list(sys.modules.values()):  # already imported (the script being run, too)
        f = getattr(mod, "__file__", None)
        if f and str(f).endswith(".py") and Path(f).resolve() == path:
            return mod
    name = path.stem if path.stem.isidentifier() else "posenc_tasks_" + hashlib.sha1(str(path).encode()).hexdigest()[:8]
    if name in sys.modules:
        name = f"{name}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"--import {path}: not a Python file")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[name]
        raise
    return mod


def load_tasks(*specs: str | Path, base: str | Path | None = None) -> list[ModuleType]:
    """Import task modules (a module name, ``my_tasks``, or a path, ``tasks/mine.py``); return them.

    Their tasks register themselves (``@register_task``). Each spec is remembered, and
    :func:`posenc.bench.run_suite` imports it again in every worker process, Ray task and
    torchrun rank. A module name is looked up on ``sys.path`` and then in ``base`` (default:
    the current folder). An error while importing is a :class:`ConfigError` naming the module.
    """
    _load_builtin()
    base = Path(base) if base is not None else Path.cwd()
    mods = []
    for raw in specs:
        spec = str(raw)
        try:
            if _is_path(spec):
                mod = _load_path(base / spec)
                remember = str(Path(getattr(mod, "__file__", None) or (base / spec)).resolve())
            else:
                try:
                    mod = importlib.import_module(spec)
                except ModuleNotFoundError as exc:  # `posenc bench` does not look in the current folder
                    folder = str(base.resolve())
                    if exc.name != spec.split(".")[0] or folder in sys.path:
                        raise
                    sys.path.append(folder)
                    mod = importlib.import_module(spec)
                remember = spec
        except ConfigError:
            raise
        except ModuleNotFoundError as exc:
            raise ConfigError(
                f"--import {spec}: no module named {exc.name!r} (give a module on sys.path or a path to a .py file)"
            ) from None
        except Exception as exc:
            raise ConfigError(f"--import {spec}: importing it failed: {type(exc).__name__}: {exc}") from exc
        _IMPORTED.setdefault(remember, getattr(mod, "__name__", spec))
        mods.append(mod)
    return mods


def worker_imports(task_names: Iterable[str] = ()) -> list[str]:
    """What a worker must import to know ``task_names`` and every module given to :func:`load_tasks`.

    A task that is neither built in nor known already adds its module: by name when this
    process can import it by name, else by the path of its file (the script being run, too).
    """
    out = list(_IMPORTED)
    for name in task_names:
        cls = type(get_task(name))
        modname = cls.__module__
        if is_builtin(cls) or modname in _IMPORTED.values():
            continue
        file = getattr(sys.modules.get(modname), "__file__", None)
        if modname not in ("__main__", "__mp_main__") and _importable_by_name(modname):
            spec = modname
        elif file:
            spec = str(Path(file).resolve())
        else:
            continue  # a notebook or a REPL: see unimportable_tasks
        if spec not in out:
            out.append(spec)
    return out


def _importable_by_name(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def unimportable_tasks(task_names: Iterable[str]) -> list[str]:
    """Tasks that another process cannot import: defined in a notebook, a REPL or ``python -c``."""
    bad = []
    for name in task_names:
        cls = type(get_task(name))
        mod = sys.modules.get(cls.__module__)
        if not is_builtin(cls) and not getattr(mod, "__file__", None):
            bad.append(name)
    return bad


def prepare_process(imports: Sequence[str] = (), sys_path: Sequence[str] = ()) -> None:
    """In a worker process, Ray task or torchrun rank: the parent's ``sys.path`` entries and task modules."""
    for p in sys_path:
        if p and p not in sys.path:
            sys.path.append(p)
    todo = [s for s in imports if s not in _IMPORTED]
    if todo:
        load_tasks(*todo)


def get_task(name: str) -> Task:
    _load_builtin()
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
    _load_builtin()
    return sorted(_TASKS)
