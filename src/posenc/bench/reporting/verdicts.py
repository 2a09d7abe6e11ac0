"""What the model concludes from its rows: a verdict per task, the terminal's warnings and the problems.

:func:`verdict` says who won a task, by how much, and whether a 95 % paired t interval over the seeds
separates the first two rows; :func:`learning_warnings` and :func:`problems` list the rows that did not
learn their task (:func:`posenc.bench.outcomes.at_chance`: one rule for every view), the runs that
failed and the lengths not reached. It imports the rows (:mod:`.rows`) and the formats (:mod:`.format`).
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from ..outcomes import LEARNED_SHARE
from .format import amount, fmt, summary_name, summary_value, unit
from .rows import learned

#: two-sided 95 % quantiles of Student's t for 1..30 degrees of freedom (beyond: the normal's 1.96)
T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
    2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def paired_interval(diffs: list[float]) -> tuple[float, float] | None:
    """The 95 % t interval of the mean of paired per-seed differences (None for fewer than 2 pairs)."""
    n = len(diffs)
    if n < 2:
        return None
    m, sd = statistics.fmean(diffs), statistics.stdev(diffs)
    half = (T975[n - 2] if n - 1 <= len(T975) else 1.96) * sd / math.sqrt(n)
    return m - half, m + half


def verdict(sub: list[dict[str, Any]]) -> str:
    """One sentence on a task's rows (ranked, as :func:`leaderboard` gives them): who won, by how much, and how
    sure: the 95 % paired t interval of the per-seed difference between the first and the second row (seeds in
    common), "not separable" where it includes 0 or there is one seed; and whether the rows learned the task."""
    first = sub[0]
    metric, higher = first["metric"], first["higher_is_better"]
    what = summary_name(sub)
    score = summary_value(first, what)
    u = unit(metric)
    if len(sub) == 1:
        n = first["seeds"]
        text = f"only {first['label']} was run ({what} {fmt(score, metric)}{u}, {n} seed{'s' if n != 1 else ''})."
    else:
        second = sub[1]
        shared = sorted(set(first["seed_scores"]) & set(second["seed_scores"]))
        sign = 1.0 if higher else -1.0
        diffs = [sign * (first["seed_scores"][k] - second["seed_scores"][k]) for k in shared]
        other = summary_value(second, what)
        gap = sign * (score - other)
        a, b = first["label"], second["label"]
        vs = f"{what} {fmt(score, metric)}{u} against {fmt(other, metric)}{u}"
        if not all(math.isfinite(d) for d in diffs) or not math.isfinite(gap):
            text = f"{a} wins ({what} {fmt(score, metric)}{u}); {b} could not evaluate every length."
        elif len(shared) < 2:
            seeds = "one seed" if shared else "no seed in common"
            text = (
                f"{a} is ahead of {b} by {amount(gap, metric)} ({vs}) on {seeds}: not separable "
                "(one seed gives no interval; run more seeds)."
            )
        else:
            lo, hi = paired_interval(diffs)  # type: ignore[misc]
            k = 100.0 if u else 1.0
            ci = f"{k * lo:+.1f} to {k * hi:+.1f}"
            n = len(shared)
            if lo > 0:
                text = (
                    f"{a} wins, {amount(gap, metric)} ahead of {b} ({vs}); the 95% paired interval of the "
                    f"difference over {n} seeds, {ci}, excludes 0."
                )
            else:
                text = (
                    f"{a} and {b} are not separable: {a} leads by {amount(gap, metric)} ({vs}), but the 95% "
                    f"paired interval of the difference over {n} seeds, {ci}, includes 0"
                    + (" (two seeds give a wide interval: more seeds narrow it)." if n == 2 else ".")
                )
    learned_ = [r.get("learned") for r in sub]
    if learned_ and all(x is False for x in learned_):
        text += " No encoding learned the task in distribution (at chance): the ranking means little."
    elif first.get("learned") is False:
        text += f" {first['label']} did not learn the task in distribution (at chance)."
    return text


def by_task(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The rows of each task (sorted by task name), in their ranked order."""
    return {task: [r for r in rows if r["task"] == task] for task in sorted({r["task"] for r in rows})}


def learning_warnings(rows: list[dict[str, Any]]) -> list[str]:
    """Warnings for the terminal: a task no encoding learned in distribution, and the rows that did not."""
    out = []
    for task, sub in by_task(rows).items():
        weak = [r for r in sub if r.get("learned") is False]
        if weak and len(weak) == len(sub):
            out.append(
                f"no encoding learned task {task!r} in distribution (every row at chance): its ranking means "
                "nothing; train longer (--steps) or check the task's settings"
            )
        elif weak:
            out.append(
                f"{task}: did not learn in distribution (at chance; their extrapolation means little): "
                + ", ".join(f"{r['label']} ({fmt(r['in_distribution'], r['metric'])}{unit(r['metric'])})" for r in weak)
            )
    return out


def problems(rows: list[dict[str, Any]], failures: list[dict[str, Any]] | None) -> dict[str, list[dict[str, str]]]:
    """What went wrong: runs that raised, rows that did not learn in distribution, lengths not reached."""
    failed = [
        {
            "run": f"{f['config']['task']}/{f.get('label') or f['config']['encoding']}/seed{f['config']['seed']}",
            "error": f["error"].strip(),
        }
        for f in failures or []
    ]
    weak = []
    for r in rows:
        ok, c = learned(r)
        pct = unit(r["metric"])
        if ok is False:
            weak.append(
                {
                    "run": f"{r['task']}/{r['label']} ({r['seeds']} seed{'s' if r['seeds'] != 1 else ''})",
                    "error": f"in distribution {fmt(r['in_distribution'], r['metric'])}{pct}, "
                    f"chance {fmt(c, r['metric'])}{pct}",  # type: ignore[arg-type]
                }
            )
    unreached = [{"run": f"{r['task']}/{r['label']}", "error": e} for r in rows for e in r["errors"]]
    return {"failed": failed, "not learned": weak, "not reached": unreached}


PROBLEM_TEXT = {
    "failed": "Runs that failed (not in the tables; fix the cause and run the same command again to retry them)",
    "not learned": (
        "Did not learn the task in distribution: at chance, i.e. the mean at the training lengths closes less than "
        f"{LEARNED_SHARE:.0%} of the gap between chance and a perfect score (the rule of the tables' grey or "
        "italic cells; their extrapolation means little)"
    ),
    "not reached": "Lengths an encoding could not evaluate (n/a in the tables)",
}
