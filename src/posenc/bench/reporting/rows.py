"""The rows of the model: a set of runs summarised per (task, label), over seeds.

Runs are grouped by task and *label* (the suite's display name of an encoding with its options,
e.g. ``shaw k=4``; by default the encoding name plus its options), and summarised as mean ± std
over seeds (each seed's value kept: ``per_seed``; seeds that split flagged: :func:`seeds_disagree`),
beside each task's chance level (:func:`posenc.bench.outcomes.chance_level`). A row is a plain dict
(``leaderboard.json`` writes it as it is: :func:`jsonable`).

It may import :mod:`posenc.bench.outcomes` and :mod:`posenc.bench.types`; every renderer of the
reporting package reads these rows.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from ..outcomes import at_chance, chance_level, examples, gap_closed, is_pct, ranking_labels, trained_lengths
from ..types import label_of

#: seeds "split" when their shares of the gap from chance to perfect lie on both sides of one half and at least
#: this far apart (adjacent/normalized: one seed at 100 %, one at 49 % of a 50 % chance: shares 1.0 and 0)
SPLIT_SHARE = 0.4


def mean_std(xs: list[float]) -> tuple[float, float]:
    """The mean and sample standard deviation (0 for one value; NaN for none)."""
    if not xs:
        return float("nan"), float("nan")
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def leaderboard(results: list[dict[str, Any]], controls: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """One row per (task, label): the metric per test length as mean ± std over seeds.

    Rows are ranked within a task by the mean metric on lengths longer than
    training (out of distribution; a length an encoding could not reach counts as
    the worst value), then in distribution. A task evaluated on splits, or one that
    names its ranking labels (``Task.ranking_labels``), ranks by the mean of those
    labels only (``ranked_by``; text classification: ``"test"``, not ``"valid"``).
    ``trained`` is the task's training lengths (``Task.training_lengths``) or None
    where it has none to claim (real data). ``controls``: the suite's controls (label or encoding name -> why
    it is at chance by design); a row's ``control`` is that reason, or "".
    """
    controls = controls or {}
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in results:
        groups[(r["config"]["task"], label_of(r))].append(r)
    rows = []
    for (task, label), runs in groups.items():
        cfg = runs[0]["config"]
        train_max = cfg["train_lengths"][1]
        # only the test lengths the task reported (a real-data task reports "test", not lengths)
        lengths = [n for n in cfg["test_lengths"] if any(str(n) in r["metrics"] for r in runs)]
        metric = runs[0].get("metric", "accuracy")
        higher = runs[0].get("higher_is_better", True)
        labels = [str(n) for n in lengths] + sorted(
            {k for r in runs for k in r["metrics"] if not k.endswith("_error") and k not in map(str, lengths)}
        )
        runs = sorted(runs, key=lambda r: r["config"]["seed"])
        per_len: dict[str, tuple[float, float] | None] = {}
        per_seed: dict[str, list[float]] = {}
        for n in labels:
            vals = [r["metrics"].get(n) for r in runs]
            per_len[n] = None if any(v is None for v in vals) else mean_std([float(v) for v in vals])
            per_seed[n] = [float(v) for v in vals if isinstance(v, int | float)]
        chance = _row_chance(runs, labels)
        worst = 0.0 if higher else float("inf")
        ind = [per_len[str(n)][0] for n in lengths if n <= train_max and per_len[str(n)] is not None]
        ood = [per_len[str(n)][0] if per_len[str(n)] is not None else worst for n in lengths if n > train_max]
        ranked_by = ranking_labels(cfg, labels)
        seed_scores = {
            int(r["config"]["seed"]): _run_score(r["metrics"], lengths, train_max, ranked_by, higher) for r in runs
        }
        seed_values = {
            int(r["config"]["seed"]): {
                k: (float(v) if isinstance(v := r["metrics"].get(k), int | float) else None) for k in labels
            }
            for r in runs
        }
        counted = {k: {examples(r["config"], k) for r in runs} for k in labels}
        if ranked_by:  # the task's ranking labels, or a split task's "test": the other labels do not count
            ind = [per_len[k][0] if per_len[k] is not None else worst for k in ranked_by]  # type: ignore[index]
            ood = []
        elif not ind and not ood:  # metrics under other labels, none of them "test"
            ind = [v[0] for v in per_len.values() if v is not None]
        rows.append(
            {
                "task": task,
                "encoding": cfg["encoding"],
                "label": label,
                "options": cfg.get("encoding_options", {}),
                "metric": metric,
                "higher_is_better": higher,
                "seeds": len(runs),
                "values": per_len,
                # each seed's value per label (seed order), and each seed's ranking score (the verdict's pairs)
                "per_seed": per_seed,
                "seed_scores": seed_scores,
                # each seed's value per label, the labels its ranking score averages, and the examples the task
                # counted at each label (None: not a share of examples): what the verdicts compare
                "seed_values": seed_values,
                "score_keys": _score_keys(labels, lengths, train_max, ranked_by),
                "examples": {k: (ns.pop() if len(ns) == 1 else None) for k, ns in counted.items()},
                "in_distribution": statistics.fmean(ind) if ind else float("nan"),
                "extrapolation": statistics.fmean(ood) if ood else float("nan"),
                "train_max": train_max,
                "trained": trained_lengths(cfg) if lengths else None,
                "ranked_by": ranked_by,
                "seconds": statistics.fmean(r["train_seconds"] for r in runs),
                "errors": sorted({v for r in runs for k, v in r["metrics"].items() if k.endswith("_error")}),
                "chance": chance,
                # the environments the runs were trained in (None: stored before posenc recorded them)
                "envs": distinct([r.get("env") for r in runs]),
                "control": controls.get(label) or controls.get(cfg["encoding"], ""),
            }
        )
        rows[-1]["learned"] = learned(rows[-1])[0]
        rows[-1]["split"] = {
            k: seeds_disagree(per_seed[k], chance.get(k), metric, higher) for k in labels if per_len[k] is not None
        }
    rows.sort(key=lambda r: (r["task"], _rank(r["extrapolation"], r), _rank(r["in_distribution"], r)))
    return rows


def _run_score(
    metrics: dict[str, Any], lengths: list[int], train_max: int, ranked_by: list[str] | None, higher: bool
) -> float:
    """One run's ranking score, as :func:`leaderboard` ranks rows: the mean of the ranking labels, else of the
    lengths beyond training (a length not reached counts as the worst value), else of the lengths trained on."""
    worst = 0.0 if higher else float("inf")

    def val(k: str) -> float:
        v = metrics.get(k)
        return float(v) if isinstance(v, int | float) else worst

    if ranked_by:
        return statistics.fmean(val(k) for k in ranked_by)
    ood = [val(str(n)) for n in lengths if n > train_max]
    if ood:
        return statistics.fmean(ood)
    ind = [float(metrics[str(n)]) for n in lengths if isinstance(metrics.get(str(n)), int | float)]
    if ind:
        return statistics.fmean(ind)
    rest = [float(v) for k, v in metrics.items() if not k.endswith("_error") and isinstance(v, int | float)]
    return statistics.fmean(rest) if rest else float("nan")


def _score_keys(labels: list[str], lengths: list[int], train_max: int, ranked_by: list[str] | None) -> list[str]:
    """The labels whose mean is a run's ranking score, as :func:`_run_score` takes them."""
    if ranked_by:
        return list(ranked_by)
    ood = [str(n) for n in lengths if n > train_max]
    if ood:
        return ood
    if lengths:
        return [str(n) for n in lengths]
    return list(labels)


def _rank(x: float, row: dict[str, Any]) -> float:
    """Sort key: better first, NaN last."""
    if x != x:
        return float("inf")
    return -x if row["higher_is_better"] else x


def distinct(items: list[Any]) -> list[Any]:
    """``items`` without repeats, in their first order (for unhashable items: environments are dicts)."""
    out: list[Any] = []
    for e in items:
        if e not in out:
            out.append(e)
    return out


# ---------------------------------------------------------------------------- chance and learning
def _row_chance(runs: list[dict[str, Any]], keys: list[str]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for k in keys:
        vals = [chance_level(r["config"], k) for r in runs]
        out[k] = None if not vals or any(v is None for v in vals) else statistics.fmean(vals)  # type: ignore[arg-type]
    return out


def task_chance(sub: list[dict[str, Any]], key: str) -> float | None:
    """The chance level of a task's rows at evaluation ``key`` (their mean), or None where no row knows it."""
    vals = [r["chance"].get(key) for r in sub if r["chance"].get(key) is not None]
    return statistics.fmean(vals) if vals else None


def _ind_keys(row: dict[str, Any]) -> list[str]:
    """The evaluation keys of the in-distribution mean (the ranking labels; lengths <= the training length;
    else every key)."""
    if row.get("ranked_by"):
        return [k for k in row["ranked_by"] if row["values"].get(k) is not None]
    keys = [k for k, v in row["values"].items() if v is not None and k.isdigit() and int(k) <= row["train_max"]]
    if not keys and not any(k.isdigit() and int(k) > row["train_max"] for k in row["values"]):
        keys = [k for k, v in row["values"].items() if v is not None]
    return keys


def cell_at_chance(row: dict[str, Any], key: str) -> bool:
    """Whether the row's mean at ``key`` is at chance (:func:`~posenc.bench.outcomes.at_chance`)."""
    v = row["values"].get(key)
    return v is not None and bool(at_chance(v[0], row["chance"].get(key), row["metric"], row["higher_is_better"]))


def learned(row: dict[str, Any]) -> tuple[bool | None, float | None]:
    """(whether the row learned its task in distribution, the chance level of its in-distribution mean)."""
    keys = _ind_keys(row)
    cs = [row["chance"].get(k) for k in keys]
    if not keys or any(c is None for c in cs):
        return None, None
    c = statistics.fmean(cs)  # type: ignore[arg-type]
    low = at_chance(row["in_distribution"], c, row["metric"], row["higher_is_better"])
    return (None if low is None else not low), c


def seeds_disagree(values: list[float], chance: float | None, metric: str, higher: bool = True) -> bool:
    """Whether the seeds of one cell split (a bimodal cell, whose mean sits where no seed is): with a chance level
    and a perfect score, some seeds close less than half the gap between them and some more, at least
    :data:`SPLIT_SHARE` apart; without one, a spread (max − min) of at least :data:`SPLIT_SHARE` of the mean's
    size. One seed never splits."""
    xs = [x for x in values if x == x and math.isfinite(x)]
    if len(xs) < 2:
        return False
    c = chance if chance is not None else (0.0 if is_pct(metric) and higher else None)
    shares = [gap_closed(x, c, metric, higher) for x in xs] if c is not None else [None]
    if all(sh is not None for sh in shares):
        lo, hi = min(shares), max(shares)  # type: ignore[type-var]
        return lo < 0.5 <= hi and hi - lo >= SPLIT_SHARE  # type: ignore[operator]
    size = abs(statistics.fmean(xs))
    return size > 0 and (max(xs) - min(xs)) >= SPLIT_SHARE * size


# ---------------------------------------------------------------------------- files
def jsonable(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows as JSON can hold them (``leaderboard.json``): NaN and infinities as null, (mean, std) pairs as
    ``{"mean", "std"}``."""

    def num(x: Any) -> Any:
        return None if isinstance(x, float) and (x != x or x in (float("inf"), float("-inf"))) else x

    out = []
    for r in rows:
        d = {k: num(v) for k, v in r.items() if k not in ("values", "chance")}
        d["values"] = {k: None if v is None else {"mean": num(v[0]), "std": num(v[1])} for k, v in r["values"].items()}
        d["chance"] = {k: num(v) for k, v in r["chance"].items()}
        d["per_seed"] = {k: [num(x) for x in xs] for k, xs in r.get("per_seed", {}).items()}
        d["seed_scores"] = {str(k): num(v) for k, v in r.get("seed_scores", {}).items()}
        d["seed_values"] = {
            str(s): {k: num(v) for k, v in vals.items()} for s, vals in r.get("seed_values", {}).items()
        }
        out.append(d)
    return out
