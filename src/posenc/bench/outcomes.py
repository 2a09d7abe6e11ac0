"""Judgements on single runs: what a run's metrics mean beside its task.

One place for the rules that every view of the results shares, the report's tables and verdicts
(:mod:`posenc.bench.reporting`), the results page and the live board (:mod:`posenc.bench.live`):

- which metrics are percentages (:data:`PCT_METRICS`) or perplexities (:data:`PPL_METRICS`);
- what a task says of one run's config: its chance level (:func:`chance_level`), the lengths it was
  trained on (:func:`trained_lengths`), the labels that rank it (:func:`ranking_labels`) and how many
  examples a metric counts (:func:`examples`);
- the one rule of *at chance* (:func:`at_chance`, :data:`LEARNED_SHARE`) and whether one run learned
  its task (:func:`run_learned`).

It works on stored records (plain dicts: ``record["config"]``, ``record["metrics"]`` ...) and asks the
task registry (:mod:`posenc.bench.api`); it may import the bench layers below the suites (``types``,
``api``) and nothing above them (not the store, the runner or the report).
"""

from __future__ import annotations

import functools
import json
import math
import statistics
from collections.abc import Iterable
from typing import Any

#: metrics shown as percentages (stored as fractions in [0, 1])
PCT_METRICS = ("accuracy", "f1", "sequence_accuracy", "entity_f1", "exact_match")
#: metrics whose perfect score is 1 and whose chance level is compared on a log scale
PPL_METRICS = ("perplexity", "ppl")
#: a run "did not learn" a task when its mean in-distribution metric closes less than this share of
#: the gap between chance and a perfect score (100 %; perplexity 1, measured on a log scale)
LEARNED_SHARE = 0.2


def is_pct(metric: str) -> bool:
    """Whether ``metric`` is a fraction shown as a percentage."""
    return metric in PCT_METRICS


def _run_config(config: dict[str, Any]) -> Any:
    """A stored config as a :class:`~posenc.bench.types.RunConfig`."""
    from .types import RunConfig

    return RunConfig.from_dict(config)


# ---------------------------------------------------------------------------- what the task says
@functools.lru_cache(maxsize=1024)
def _task_says(task: str, config_json: str, what: str) -> Any:
    """``Task.<what>(cfg)`` for a run's config; ``"unknown"`` for a task no longer registered or an old config."""
    from .api import get_task

    try:
        return getattr(get_task(task), what)(_run_config(json.loads(config_json)))
    except Exception:  # noqa: BLE001
        return "unknown"


def _config_json(config: dict[str, Any]) -> str:
    return json.dumps(config, sort_keys=True, default=str)


def ranking_labels(config: dict[str, Any], labels: Iterable[str]) -> list[str] | None:
    """The evaluation labels whose mean ranks a task's rows, or None: by lengths (beyond training first).

    The task's own (``Task.ranking_labels``) where it names some that were reported; else, for a
    task evaluated on splits (no length among ``labels``), ``"test"`` where it is reported. A
    validation split is shown, never averaged into the ranking.
    """
    labels = [k for k in labels if not k.endswith("_error")]
    said = _task_says(config["task"], _config_json(config), "ranking_labels")
    if said not in (None, "unknown"):
        keys = [k for k in said if k in labels]
        if keys:
            return keys
    if not any(k.isdigit() for k in labels) and "test" in labels:
        return ["test"]
    return None


def trained_lengths(config: dict[str, Any]) -> tuple[int, int] | None:
    """The lengths a run was trained on (``Task.training_lengths``); None where the task uses none (real data)."""
    said = _task_says(config["task"], _config_json(config), "training_lengths")
    if said == "unknown":  # not registered here: the config's lengths, as runs of length tasks have them
        return tuple(config["train_lengths"])  # type: ignore[return-value]
    return None if said is None else (int(said[0]), int(said[1]))


@functools.lru_cache(maxsize=4096)
def _chance_of(task: str, config_json: str, key: str) -> float | None:
    from .api import get_task

    try:
        t = get_task(task)
        # chance does not depend on the encoding: every run of a task and seed shares one value
        cfg = _run_config({**json.loads(config_json), "encoding": "none", "encoding_options": {}})
        c = getattr(t, "chance", None)
        value = c(cfg, key) if callable(c) else c
    except Exception:  # a task no longer registered, an old config: unknown
        return None
    return None if value is None else float(value)


def chance_level(record_config: dict[str, Any], key: str) -> float | None:
    """The task's chance level at evaluation ``key`` for one run's config (``Task.chance``), or None."""
    blob = json.dumps(
        {k: v for k, v in record_config.items() if k not in ("encoding", "encoding_options")}, default=str
    )
    return _chance_of(record_config["task"], blob, key)


@functools.lru_cache(maxsize=4096)
def _examples_of(task: str, config_json: str, key: str) -> int | None:
    from .api import get_task

    try:
        n = get_task(task).examples(_run_config(json.loads(config_json)), key)
    except Exception:  # a task no longer registered, an old config, a task class without the method: unknown
        return None
    return int(n) if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def examples(record_config: dict[str, Any], key: str) -> int | None:
    """How many examples a run's metric at evaluation ``key`` counts (``Task.examples``), where it is the share of
    them answered right; None where the task does not say."""
    return _examples_of(record_config["task"], _config_json(record_config), key)


# ---------------------------------------------------------------------------- at chance
def metric_range(metric: str) -> tuple[float, float] | None:
    """The values the metric can take (for clipping error bars), or None if unbounded / unknown."""
    if is_pct(metric):
        return 0.0, 1.0
    if metric in PPL_METRICS:
        return 1.0, float("inf")
    return None


def gap_closed(value: float, chance: float | None, metric: str, higher: bool) -> float | None:
    """The share of the way from chance to a perfect score that ``value`` covers, or None if unknown."""
    if chance is None or value != value:
        return None
    if is_pct(metric) and higher and chance < 1:
        return (value - chance) / (1 - chance)
    if metric in PPL_METRICS and not higher and chance > 1:
        return (math.log(chance) - math.log(max(value, 1e-12))) / math.log(chance)
    return None


def at_chance(value: float, chance: float | None, metric: str, higher: bool = True) -> bool | None:
    """Whether ``value`` is *at chance*: it closes less than :data:`LEARNED_SHARE` of the gap between the chance
    level and a perfect score (for a metric without a perfect score: not better than chance); None if unknown.

    The one rule of the report: the tables' grey (HTML) or italic (Markdown) cells, the Failures list's rows
    that did not learn, and the terminal's warnings all ask this function.
    """
    if chance is None or value != value:
        return None
    share = gap_closed(value, chance, metric, higher)
    if share is not None:
        return share < LEARNED_SHARE
    if is_pct(metric) or metric in PPL_METRICS:  # chance at the perfect score itself: nothing to learn
        return None
    return value <= chance if higher else value >= chance


def run_learned(record: dict[str, Any]) -> bool | None:
    """Whether one run learned its task in distribution (:func:`at_chance` of its mean at the training lengths, or
    at its ranking labels); None where the chance level is unknown. The live board warns with it."""
    cfg = record["config"]
    metric = record.get("metric", "accuracy")
    higher = record.get("higher_is_better", True)
    vals = {k: v for k, v in record["metrics"].items() if not k.endswith("_error")}
    ranked = ranking_labels(cfg, vals)
    tm = cfg["train_lengths"][1]
    keys = ranked or [k for k in vals if k.isdigit() and int(k) <= tm] or [k for k in vals if not k.isdigit()]
    keys = [k for k in keys if isinstance(vals.get(k), int | float)]
    cs = [chance_level(cfg, k) for k in keys]
    if not keys or any(c is None for c in cs):
        return None
    low = at_chance(statistics.fmean(float(vals[k]) for k in keys), statistics.fmean(cs), metric, higher)  # type: ignore[arg-type]
    return None if low is None else not low
