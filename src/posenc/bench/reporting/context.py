"""The context of a set of runs: the tasks, the settings, and the environments the runs were trained in.

Everything here is a table (head, body) or a sentence that the renderers write as they are: the tasks
with their metric and chance level (:func:`tasks_info`), the settings grouped by task
(:func:`settings_grid`), the environments per suite (:func:`run_environments`) and a warning where a
table's runs come from different environments (:func:`mixed_environments`, :func:`environments_warning`),
and the process writing a report (:func:`environment`). It imports the rows and the formats, the task
registry (:mod:`posenc.bench.api`) and :mod:`posenc.runenv`.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
from collections import defaultdict
from typing import Any

from ...runenv import differences
from ..outcomes import trained_lengths
from ..types import label_of
from .format import fmt, unit
from .rows import task_chance
from .verdicts import by_task

#: the columns of the runs' environments (``record["env"]``) in the report
ENV_COLUMNS = {
    "cpu": "CPU",
    "kernels": "kernels",
    "torch": "torch",
    "threads": "threads",
    "posenc": "posenc",
    "python": "Python",
    "platform": "platform",
}


def environments_warning(envs: list[Any], what: str = "table") -> str:
    """Where ``envs`` (runs' environments) differ, the sentence that says how ("the runs of this <what> were
    trained in different environments (CPU: a / b): ..."); "" where they agree."""
    diff = differences(envs)
    if not diff:
        return ""
    return (
        f"the runs of this {what} were trained in different environments ("
        + "; ".join(f"{ENV_COLUMNS.get(k, k)}: {' / '.join(v)}" for k, v in diff.items())
        + "): their last digits may differ for that reason alone"
    )


def mixed_environments(rows: list[dict[str, Any]]) -> dict[str, str]:
    """Per task whose runs come from different environments (CPU, kernel path or torch): what differs."""
    out = {}
    for task, sub in by_task(rows).items():
        text = environments_warning([e for r in sub for e in r.get("envs", [])])
        if text:
            out[task] = text
    return out


def run_environments(results: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """Per suite, every environment its runs were trained in and how many runs: a table (head, body).

    Runs stored before posenc recorded environments show "not recorded".
    """
    counts: dict[tuple[str, str], int] = defaultdict(int)
    envs: dict[str, dict[str, Any] | None] = {}
    for r in results:
        env = r.get("env") or None
        key = json.dumps(env, sort_keys=True, default=str)
        envs[key] = env
        counts[(str(r.get("suite") or "—"), key)] += 1
    body = []
    for (suite, key), n in sorted(counts.items()):
        env = envs[key]
        if env is None:
            cells = ["not recorded"] * len(ENV_COLUMNS)
        else:
            cells = [str(env.get(k, "?")) for k in ENV_COLUMNS]
            if env.get("git_commit"):
                i = list(ENV_COLUMNS).index("posenc")
                cells[i] += f" @ {str(env['git_commit'])[:10]}" + (" (modified)" if env.get("git_dirty") else "")
        body.append([suite, str(n), *cells])
    return ["suite", "runs", *ENV_COLUMNS.values()], body


def environment() -> dict[str, str]:
    """The versions and machine of the process writing the report, and the date."""
    import os
    import platform

    now = datetime.datetime.now().astimezone()
    env = {
        "date": f"{now:%Y-%m-%d %H:%M:%S} {now.tzname()}",
        "python": f"{platform.python_version()} ({platform.python_implementation()})",
    }
    for name in ("posenc", "torch", "numpy", "matplotlib"):
        try:
            env[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            env[name] = "not installed"
    env["platform"] = platform.platform()
    env["machine"] = platform.machine() or "unknown"
    env["CPU count"] = str(os.cpu_count())
    if hasattr(os, "sched_getaffinity"):
        env["CPUs usable by this process"] = str(len(os.sched_getaffinity(0)))
    try:
        import torch

        # the build as torch names itself: PyPI's CUDA wheel says 2.15.0 in its metadata, 2.15.0+cu132 here
        env["torch"] = str(torch.__version__)
        env["torch threads"] = str(torch.get_num_threads())
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "unset")
    return env


# ---------------------------------------------------------------------------- settings and tasks
SETTING_NAMES = (
    ("train_lengths", "train lengths"),
    ("test_lengths", "test lengths"),
    ("steps", "steps"),
    ("batch_size", "batch"),
    ("lr", "lr"),
    ("model", "model"),
    ("d_model", "d_model"),
    ("n_layers", "layers"),
    ("n_heads", "heads"),
    ("d_ff", "d_ff"),
    ("eval_samples", "eval samples"),
    ("task_options", "task options"),
)


def _show(v: Any, key: str = "") -> str:
    if isinstance(v, list | tuple):
        if key == "train_lengths" and len(v) == 2:
            return str(v[0]) if v[0] == v[1] else f"{v[0]}–{v[1]}"
        return ", ".join(map(str, v))
    if v is None:
        return "default"
    if isinstance(v, dict):
        return ", ".join(f"{k}={x}" for k, x in sorted(v.items())) or "—"
    return str(v)


def settings(results: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Per task: the suite, seeds, encodings, parameters and every run setting (values joined by "/" if they vary)."""
    out = []
    for task in sorted({r["config"]["task"] for r in results}):
        runs = [r for r in results if r["config"]["task"] == task]
        row = {"task": task, "suite": " / ".join(sorted({str(r.get("suite") or "—") for r in runs}))}
        row["seeds"] = ", ".join(map(str, sorted({r["config"]["seed"] for r in runs})))
        row["encodings"] = str(len({label_of(r) for r in runs}))
        for key, name in SETTING_NAMES:
            row[name] = " / ".join(dict.fromkeys(_show(r["config"].get(key), key) for r in runs))
        # real data: the sentences fix the lengths; the configs' lengths are only part of the run keys
        if all(trained_lengths(r["config"]) is None for r in runs):
            row["train lengths"] = "not used"
            if not any(k.isdigit() for r in runs for k in r["metrics"]):
                row["test lengths"] = "not used"
        params = [r["parameters"] for r in runs if r.get("parameters")]
        row["parameters"] = (
            "—" if not params else f"{min(params):,}" + (f"–{max(params):,}" if max(params) != min(params) else "")
        )
        out.append(row)
    return out


def settings_grid(results: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """:func:`settings` as a table of one row per setting and one column per group of tasks with equal settings."""
    groups: dict[str, list[str]] = {}
    values: dict[str, dict[str, str]] = {}
    for row in settings(results):
        rest = {k: v for k, v in row.items() if k != "task"}
        key = json.dumps(rest, sort_keys=True)
        groups.setdefault(key, []).append(row["task"])
        values[key] = rest
    if not groups:
        return [], []
    head = ["setting", *(", ".join(ts) for ts in groups.values())]
    names = list(next(iter(values.values())))
    return head, [[n, *(values[k][n] for k in groups)] for n in names]


def tasks_info(rows: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Per task: what it is, its metric and its chance level at each evaluation."""
    from ..api import get_task

    out = []
    for task, sub in by_task(rows).items():
        try:
            desc = get_task(task).description
        except Exception:
            desc = ""
        metric = sub[0]["metric"]
        keys = list(sub[0]["values"])
        chance = {key: task_chance(sub, key) for key in keys}
        known = {key: c for key, c in chance.items() if c is not None}
        if not known:
            text = "unknown"
        elif max(known.values()) - min(known.values()) < 1e-9:
            text = fmt(next(iter(known.values())), metric) + unit(metric)
        else:
            text = ", ".join(f"{key}: {fmt(c, metric)}" for key, c in known.items()) + (" (%)" if unit(metric) else "")
        better = "higher" if sub[0]["higher_is_better"] else "lower"
        out.append(
            {
                "task": task,
                "description": desc or "(no description)",
                "metric": f"{metric}{unit(metric)}, {better} is better",
                "chance": text,
            }
        )
    return out
