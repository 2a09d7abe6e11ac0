"""What the model concludes from its rows: a verdict per task, the terminal's warnings and the problems.

:func:`verdict` says who won a task, by how much, and whether the gap between the first two rows is
separable (:mod:`.separation`: an interval for the difference that stays within what the metric can take,
on the test examples pooled over seeds and lengths where the task counts them, with every seed agreeing),
and which rows are separably ahead of the suite's controls; :func:`learning_warnings` and :func:`problems`
list the rows that did not learn their task (:func:`posenc.bench.outcomes.at_chance`: one rule for every
view), the controls that are *not* at chance (a control at chance is as designed: neither a failure nor a
warning), the runs that failed and the lengths not reached. It imports the rows (:mod:`.rows`), the
separation rule and the formats (:mod:`.format`).
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from ..outcomes import LEARNED_SHARE, is_pct
from .format import amount, fmt, summary_name, summary_value, unit
from .rows import learned
from .separation import Separation, compare_all

#: two-sided 95 % quantiles of Student's t for 1..30 degrees of freedom (beyond: the normal's 1.96)
T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
    2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def paired_interval(diffs: list[float], bounds: tuple[float, float] | None = None) -> tuple[float, float] | None:
    """The 95 % t interval of the mean of paired per-seed differences, cut to ``bounds`` (the range the difference
    can take, e.g. ``(-1, 1)`` for accuracies) where given; None for fewer than 2 pairs."""
    n = len(diffs)
    if n < 2:
        return None
    m, sd = statistics.fmean(diffs), statistics.stdev(diffs)
    half = (T975[n - 2] if n - 1 <= len(T975) else 1.96) * sd / math.sqrt(n)
    lo, hi = m - half, m + half
    if bounds is not None:
        lo, hi = max(lo, bounds[0]), min(hi, bounds[1])
    return lo, hi


def _signed(x: float, metric: str) -> str:
    return f"{100 * x:+.1f}" if is_pct(metric) else f"{x:+.2f}"


def _units(metric: str) -> str:
    return " points" if is_pct(metric) else ""


def _level(n_rows: int) -> str:
    pairs = n_rows * (n_rows - 1) // 2
    return "95%" + (f" for the table's {pairs} pairs together" if pairs > 1 else "")


def _interval(s: Separation, metric: str, n_rows: int, a: str) -> str:
    """The interval of ``s`` and what it is over: ``the interval of the difference on the test examples, +16.5 to
    +22.9 points (95% ...; 2 seeds × 2 lengths × 512 examples a row)``."""
    ci = f"{_signed(s.low, metric)} to {_signed(s.high, metric)}{_units(metric)}"  # type: ignore[arg-type]
    if s.method == "examples":
        per = s.strata // max(1, len(s.seeds))
        n = "/".join(str(x) for x in s.examples)
        over = f"{len(s.seeds)} seeds × {per} length{'s' if per != 1 else ''} × {n} examples a row"
        return f"the interval of the difference on the test examples, {ci} ({_level(n_rows)}; {over})"
    return f"the paired interval of the difference over {len(s.seeds)} seeds, {ci} ({_level(n_rows)})"


def _seeds(s: Separation, metric: str) -> str:
    return ", ".join(_signed(d, metric) for d in s.per_seed) + _units(metric)


def _pair(seps: dict[tuple[str, str], Separation], x: str, y: str) -> Separation | None:
    return seps.get((x, y)) or seps.get((y, x))


def verdict(sub: list[dict[str, Any]], seps: dict[tuple[str, str], Separation] | None = None) -> str:
    """One sentence on a task's rows (ranked, as :func:`leaderboard` gives them): who won, by how much, and how
    sure (:mod:`.separation`: "not separable" where the interval of the difference includes 0, where the seeds
    disagree, or where there is one seed); which rows are separably ahead of the task's controls; and whether the
    rows learned the task (a control at chance is not news; one that is not at chance is). ``seps``: the pairs'
    separations (:func:`.separation.compare_all`), computed here where not given."""
    seps = compare_all(sub) if seps is None else seps
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
        sep = _pair(seps, first["label"], second["label"])
        other = summary_value(second, what)
        gap = (1.0 if higher else -1.0) * (score - other)
        a, b = first["label"], second["label"]
        vs = f"{what} {fmt(score, metric)}{u} against {fmt(other, metric)}{u}"
        if sep is None or not math.isfinite(sep.diff) or not math.isfinite(gap):
            text = f"{a} wins ({what} {fmt(score, metric)}{u}); {b} could not evaluate every length."
        elif len(sep.seeds) < 2:
            seeds = "one seed" if sep.seeds else "no seed in common"
            text = (
                f"{a} is ahead of {b} by {amount(gap, metric)} ({vs}) on {seeds}: not separable "
                "(one seed says nothing of another: run more seeds)."
            )
        elif sep.separable:
            text = f"{a} wins, {amount(gap, metric)} ahead of {b} ({vs}): {_interval(sep, metric, len(sub), a)}"
            if sep.method == "examples":
                text += f", excludes 0, and every seed has {a} ahead ({_seeds(sep, metric)})."
            else:
                text += ", excludes 0."
        else:
            text = f"{a} and {b} are not separable: {a} leads by {amount(gap, metric)} ({vs}), but "
            if sep.low is None:
                text += "no interval could be computed."
            elif sep.interval_excludes_zero:  # the examples separate these runs, the seeds do not agree
                text += f"the seeds disagree ({_seeds(sep, metric)}): the gap is one seed's, not the encodings'."
            else:
                text += f"{_interval(sep, metric, len(sub), a)}, includes 0"
                text += (
                    " (two seeds give a wide interval: more seeds narrow it)."
                    if sep.method == "seeds" and len(sep.seeds) == 2
                    else "."
                )
    text += control_text(sub, seps)
    tested = [r for r in sub if not r.get("control")]
    if tested and all(r.get("learned") is False for r in tested):
        text += " No encoding learned the task in distribution (at chance): the ranking means little."
    elif first.get("learned") is False and not first.get("control"):
        text += f" {first['label']} did not learn the task in distribution (at chance)."
    for c in sub:
        if c.get("control") and c.get("learned") is True:
            text += (
                f" The control {c['label']} is not at chance in distribution "
                f"({fmt(c['in_distribution'], metric)}{u}), though it is meant to be: check the task."
            )
    return text


def control_text(sub: list[dict[str, Any]], seps: dict[tuple[str, str], Separation] | None = None) -> str:
    """Per control of a task's rows: which rows are separably ahead of it, which not, which behind it ("" where the
    task has no control, or nothing beside it)."""
    controls = [r for r in sub if r.get("control")]
    others = [r for r in sub if not r.get("control")]
    if not controls or not others:
        return ""
    seps = compare_all(sub) if seps is None else seps
    out = ""
    for c in controls:
        ahead, tied, behind = [], [], []
        for r in others:
            sep = _pair(seps, r["label"], c["label"])
            winner = sep.winner if sep is not None else None
            (ahead if winner == r["label"] else behind if winner == c["label"] else tied).append(r["label"])
        name = f"the control {c['label']}"
        out += (
            f" Separably ahead of {name}: {', '.join(ahead)}" if ahead else f" No encoding is separably ahead of {name}"
        )
        if tied:
            out += f"; not separable from it: {', '.join(tied)}"
        if behind:
            out += f"; behind it: {', '.join(behind)}"
        out += "."
    return out


def by_task(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The rows of each task (sorted by task name), in their ranked order."""
    return {task: [r for r in rows if r["task"] == task] for task in sorted({r["task"] for r in rows})}


def learning_warnings(rows: list[dict[str, Any]]) -> list[str]:
    """Warnings for the terminal: a task no encoding learned in distribution, the rows that did not, and a control
    that is not at chance (a control at chance is as designed: no warning)."""
    out = []
    for task, sub in by_task(rows).items():
        tested = [r for r in sub if not r.get("control")]
        weak = [r for r in tested if r.get("learned") is False]
        if weak and len(weak) == len(tested):
            out.append(
                f"no encoding learned task {task!r} in distribution (every row at chance): its ranking means "
                "nothing; train longer (--steps) or check the task's settings"
            )
        elif weak:
            out.append(
                f"{task}: did not learn in distribution (at chance; their extrapolation means little): "
                + ", ".join(f"{r['label']} ({fmt(r['in_distribution'], r['metric'])}{unit(r['metric'])})" for r in weak)
            )
        for c in sub:
            if c.get("control") and c.get("learned") is True:
                out.append(
                    f"{task}: the control {c['label']} is not at chance in distribution "
                    f"({fmt(c['in_distribution'], c['metric'])}{unit(c['metric'])}), though it is meant to be "
                    f"({c['control']}): check the task, or whether it is a control here"
                )
    return out


def problems(rows: list[dict[str, Any]], failures: list[dict[str, Any]] | None) -> dict[str, list[dict[str, str]]]:
    """What went wrong: runs that raised, rows that did not learn in distribution (a control at chance is not one
    of them: it is at chance by design), controls that are not at chance, lengths not reached."""
    failed = [
        {
            "run": f"{f['config']['task']}/{f.get('label') or f['config']['encoding']}/seed{f['config']['seed']}",
            "error": f["error"].strip(),
        }
        for f in failures or []
    ]
    weak, loose = [], []
    for r in rows:
        ok, c = learned(r)
        pct = unit(r["metric"])
        run = f"{r['task']}/{r['label']} ({r['seeds']} seed{'s' if r['seeds'] != 1 else ''})"
        if ok is None or c is None:  # chance unknown: neither learned nor not
            continue
        said = f"in distribution {fmt(r['in_distribution'], r['metric'])}{pct}, chance {fmt(c, r['metric'])}{pct}"
        if ok is False and not r.get("control"):
            weak.append({"run": run, "error": said})
        elif ok is True and r.get("control"):
            loose.append({"run": run, "error": f"{said}; it is meant to be at chance: {r['control']}"})
    unreached = [{"run": f"{r['task']}/{r['label']}", "error": e} for r in rows for e in r["errors"]]
    return {"failed": failed, "not learned": weak, "control not at chance": loose, "not reached": unreached}


def no_problems_text(rows: list[dict[str, Any]]) -> str:
    """What the Failures section says where :func:`problems` found none (the controls at chance named: as
    designed)."""
    controls = sorted({r["label"] for r in rows if r.get("control")})
    text = "None: every run finished, reached every length and learned its task in distribution"
    if controls:
        text += f", but the control{'s' if len(controls) > 1 else ''} ({', '.join(controls)}), at chance as designed"
    return text + "."


PROBLEM_TEXT = {
    "failed": "Runs that failed (not in the tables; fix the cause and run the same command again to retry them)",
    "not learned": (
        "Did not learn the task in distribution: at chance, i.e. the mean at the training lengths closes less than "
        f"{LEARNED_SHARE:.0%} of the gap between chance and a perfect score (the rule of the tables' grey or "
        "italic cells; their extrapolation means little)"
    ),
    "control not at chance": (
        "Controls that are not at chance (a control is meant to be at chance: check the task, or whether the "
        "encoding is a control here)"
    ),
    "not reached": "Lengths an encoding could not evaluate (n/a in the tables)",
}
