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

Where things live: the interface and the registry (:class:`Task`, :func:`register_task`,
:func:`get_task`, :func:`task_version`) are defined at the bottom of the harness, in
:mod:`posenc.bench.types`, because a :class:`~posenc.bench.types.RunConfig` checks its task
when it is made; they are re-exported here, the place a task's author imports them from.
This module adds the loading of task modules (:func:`load_tasks`, :func:`worker_imports`,
:func:`prepare_process`), :func:`run_one`, which runs one config with its task and makes
the run's record, and :func:`describe_error`, a failed run's error as text. It imports
:mod:`.types` and nothing else of the harness.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
import time
import traceback
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from ..errors import ConfigError, PosencError

# the task interface and its registry live at the bottom of the harness (a RunConfig checks its task there);
# this is where a task's author finds them
from .types import (  # noqa: F401 -- re-exported
    BUILTIN_PACKAGE,
    ENTRY_POINT_GROUP,
    OnStep,
    RunConfig,
    Task,
    available_tasks,
    get_task,
    is_builtin,
    load_builtin_tasks,
    register_task,
    task_version,
)

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
    load_builtin_tasks()
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


# ---------------------------------------------------------------------------- one run
def run_one(cfg: RunConfig, on_step: OnStep | None = None) -> dict[str, Any]:
    """Train and evaluate one configuration with its task; return a JSON-able result.

    ``env`` is the environment of this process (:func:`posenc.runenv.run_environment`:
    versions, git commit, kernel path, CPU, threads), so every stored run says where it ran.
    """
    from ..runenv import run_environment  # on first use: it asks torch and git

    task = get_task(cfg.task)
    now = task_version(cfg.task)
    if cfg.task_version != now:
        raise ConfigError(
            f"task {cfg.task!r} is at version {now!r} in this process, but the run was planned with version "
            f"{cfg.task_version!r}: its code changed while the suite ran (or a worker imports another file). "
            "Start the suite again to run the new version"
        )
    started, t0 = time.time(), time.perf_counter()
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
        # when the run started (Unix time) and its wall seconds, evaluation included: a suite's wall time is the span
        # from its first start to its last finish (docs/results.md)
        "started_at": round(started, 3),
        "run_seconds": round(time.perf_counter() - t0, 2),
        "parameters": out.get("parameters"),
        "final_loss": curve[-1][1] if curve else None,
        # the process that trained the run (a worker, a Ray task, torchrun's rank 0), not the parent
        "env": run_environment(),
        **({"extra": out["extra"]} if "extra" in out else {}),
    }


def describe_error(exc: BaseException) -> str:
    """A failed run as text: the message of a posenc error, a short traceback for anything else."""
    if isinstance(exc, PosencError):
        return f"{type(exc).__name__}: {exc}"
    tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
    return f"{type(exc).__name__}: {exc}\n" + "".join(tb[-4:-1]).rstrip()
