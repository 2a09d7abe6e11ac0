"""Leaderboard, plots and report of a suite's results.

Runs are grouped by task and *label* (the suite's display name of an encoding
with its options, e.g. ``shaw k=4``; by default the encoding name plus its
options), and summarised as mean ± std over seeds (each seed's value kept:
``per_seed``; seeds that split flagged: :func:`seeds_disagree`), beside each
task's chance level (``Task.chance``; one rule says what is *at chance*:
:func:`at_chance`). Each task gets a :func:`verdict`: who won, by how much, and
whether a 95 % paired interval over the seeds separates the first two rows. Where a suite carries the paper's numbers
(``published``), the report shows them beside ours. Every plot gives an
encoding the same colour and marker (:func:`encoding_styles`), and
``report.html`` is one self-contained page.
"""

from __future__ import annotations

import base64
import datetime
import html
import importlib.metadata
import json
import math
import statistics
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..runenv import differences
from .outcomes import (
    LEARNED_SHARE,
    PCT_METRICS,
    PPL_METRICS,
    _chance_of,
    _task_says,
    at_chance,
    chance_level,
    ranking_labels,
    run_learned,
    trained_lengths,
)
from .outcomes import gap_closed as _gap_closed
from .outcomes import is_pct as _pct
from .outcomes import metric_range as _range
from .runner import label_of

__all__ = ["LEARNED_SHARE", "PCT_METRICS", "PPL_METRICS", "_chance_of", "_task_says", "run_learned"]


def _mean_std(xs: list[float]) -> tuple[float, float]:
    if not xs:
        return float("nan"), float("nan")
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def leaderboard(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (task, label): the metric per test length as mean ± std over seeds.

    Rows are ranked within a task by the mean metric on lengths longer than
    training (out of distribution; a length an encoding could not reach counts as
    the worst value), then in distribution. A task evaluated on splits, or one that
    names its ranking labels (``Task.ranking_labels``), ranks by the mean of those
    labels only (``ranked_by``; text classification: ``"test"``, not ``"valid"``).
    ``trained`` is the task's training lengths (``Task.training_lengths``) or None
    where it has none to claim (real data).
    """
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
            per_len[n] = None if any(v is None for v in vals) else _mean_std([float(v) for v in vals])
            per_seed[n] = [float(v) for v in vals if isinstance(v, int | float)]
        chance = _row_chance(runs, labels)
        worst = 0.0 if higher else float("inf")
        ind = [per_len[str(n)][0] for n in lengths if n <= train_max and per_len[str(n)] is not None]
        ood = [per_len[str(n)][0] if per_len[str(n)] is not None else worst for n in lengths if n > train_max]
        ranked_by = ranking_labels(cfg, labels)
        seed_scores = {
            int(r["config"]["seed"]): _run_score(r["metrics"], lengths, train_max, ranked_by, higher) for r in runs
        }
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
                "in_distribution": statistics.fmean(ind) if ind else float("nan"),
                "extrapolation": statistics.fmean(ood) if ood else float("nan"),
                "train_max": train_max,
                "trained": trained_lengths(cfg) if lengths else None,
                "ranked_by": ranked_by,
                "seconds": statistics.fmean(r["train_seconds"] for r in runs),
                "errors": sorted({v for r in runs for k, v in r["metrics"].items() if k.endswith("_error")}),
                "chance": chance,
                # the environments the runs were trained in (None: stored before posenc recorded them)
                "envs": _distinct([r.get("env") for r in runs]),
            }
        )
        rows[-1]["learned"] = _learned(rows[-1])[0]
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


def _trained_text(rows: dict[str, Any] | list[dict[str, Any]]) -> str:
    """The text "trained on lengths ≤ 16" / "trained on length 64" of a row, or of a task's rows ("trained on length
    64; some rows up to 256" where they differ, e.g. fine-tuned rows), or "" where the task claims none."""
    trs = sorted({tuple(r["trained"]) for r in ([rows] if isinstance(rows, dict) else rows) if r.get("trained")})
    if not trs:
        return ""
    lo, hi = trs[0], trs[-1]
    text = f"trained on length {lo[1]}" if lo[0] == lo[1] else f"trained on lengths ≤ {lo[1]}"
    return text if hi[1] == lo[1] else f"{text}; some rows up to {hi[1]}"


def _rank(x: float, row: dict[str, Any]) -> float:
    """Sort key: better first, NaN last."""
    if x != x:
        return float("inf")
    return -x if row["higher_is_better"] else x


def _fmt(x: float, metric: str) -> str:
    if x != x:
        return "n/a"
    if x == float("inf"):
        return "inf"
    return f"{100 * x:.1f}" if _pct(metric) else f"{x:.2f}"


def _cell(
    v: tuple[float, float] | None, metric: str = "accuracy", row: dict[str, Any] | None = None, key: str = ""
) -> str:
    """``mean ± std``; one seed: ``value (1 seed)`` (never ``± 0.0``); seeds that disagree (:func:`seeds_disagree`):
    the seeds' values after it, e.g. ``74.5 ± 36.0 (seeds split: 49.0 / 100.0)``."""
    if v is None:
        return "n/a"
    m, s = v
    if row is not None and row.get("seeds") == 1:
        return f"{_fmt(m, metric)} (1 seed)"
    text = f"{_fmt(m, metric)} ± {_fmt(s, metric)}"
    if row is not None and row.get("split", {}).get(key):
        text += " (seeds split: " + " / ".join(_fmt(x, metric) for x in sorted(row["per_seed"][key])) + ")"
    return text


def _label(n: str, train_max: int) -> str:
    if not n.isdigit():
        return n
    return f"L={n}{' (train)' if int(n) <= train_max else ''}"


def _summary_name(rows: list[dict[str, Any]]) -> str:
    if rows[0].get("ranked_by"):
        return "ranked by " + ", ".join(rows[0]["ranked_by"])
    tm = rows[0]["train_max"]
    has_ood = any(k.isdigit() and int(k) > tm for r in rows for k in r["values"])
    return "mean > train" if has_ood else "mean"


def markdown_table(rows: list[dict[str, Any]]) -> str:
    out = []
    mixed = mixed_environments(rows)
    for task in sorted({r["task"] for r in rows}):
        sub = [r for r in rows if r["task"] == task]
        labels = list(sub[0]["values"])
        tm = sub[0]["train_max"]
        metric = sub[0]["metric"]
        unit = f"{metric} %" if _pct(metric) else metric
        summary = _summary_name(sub)
        head = ["#", "encoding", *[_label(n, tm) for n in labels], summary, "s/run"]
        better = "higher" if sub[0]["higher_is_better"] else "lower"
        trained = f", {_trained_text(sub)}" if _trained_text(sub) else ""
        out.append(f"**{task}** — {unit} ({better} is better; mean ± std over seeds){trained}\n")
        out.append(f"**Verdict:** {verdict(sub)}\n")
        if task in mixed:
            out.append(f"> **Warning:** {mixed[task]}.\n")
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "---|" * len(head))
        for i, r in enumerate(sub, 1):
            cells = [str(i), r["label"]]
            for n in labels:
                text = _cell(r["values"].get(n), metric, r, n)
                cells.append(f"*{text}*" if _cell_at_chance(r, n) else text)
            value = r["extrapolation"] if summary == "mean > train" else r["in_distribution"]
            cells += [_fmt(value, metric), f"{r['seconds']:.1f}"]
            out.append("| " + " | ".join(cells) + " |")
        chance = [_task_chance(sub, n) for n in labels]
        if any(c is not None for c in chance):
            out.append(
                "|  | _chance_ | " + " | ".join("?" if c is None else _fmt(c, metric) for c in chance) + " |  |  |"
            )
        out.append("")
        out.append(f"_{TABLE_NOTE}_")
        out.append("")
    return "\n".join(out)


# ---------------------------------------------------------------------------- published numbers
def published_table(published: dict[str, Any], rows: list[dict[str, Any]] | None = None) -> str:
    """The paper's table (Markdown) with our rank beside each row, where our labels match."""
    if not published:
        return ""
    out = [f"**Published** — {published.get('source', '')}"]
    if published.get("metric"):
        out[0] += f" ({published['metric']})"
    cols = published.get("columns")
    prow = published.get("rows", {})
    ours = {}
    sub: list[dict[str, Any]] = []  # no runs yet (a report of an empty store): the paper's table alone
    if rows:
        task = published.get("task")
        sub = [r for r in rows if task is None or r["task"] == task]
        ours = {r["label"]: (i, r) for i, r in enumerate(sub, 1)}
    if prow:
        summary = _summary_name(sub) if sub else "mean > train"
        head = ["encoding", *(cols or ["value"]), "our rank", f"ours ({summary})"]
        out += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for lab, vals in prow.items():
            vals = vals if isinstance(vals, list) else [vals]
            rank, ourv = "—", "—"
            if lab in ours:
                i, r = ours[lab]
                rank = str(i) + (" (did not learn: at chance)" if r.get("learned") is False else "")
                v = r["extrapolation"] if summary == "mean > train" else r["in_distribution"]
                ourv = _fmt(v, r["metric"])
            out.append("| " + " | ".join([lab, *map(str, vals), rank, ourv]) + " |")
    if published.get("text"):
        out += ["", str(published["text"])]
    note = published.get(
        "note",
        "Our models are tiny and trained briefly on CPU: compare the shape (the ranking, the trend), not the values.",
    )
    out += ["", f"_{note}_", ""]
    return "\n".join(out)


def _published_html(published: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    if not published:
        return ""
    md = published_table(published, rows)
    parts = []
    lines = md.splitlines()
    parts.append(f"<p>{html.escape(lines[0].replace('**', ''))}</p>")
    table = [ln for ln in lines if ln.startswith("|") and not ln.startswith("|---")]
    if table:
        parts.append("<table class=left>")
        for i, ln in enumerate(table):
            cells = [c.strip() for c in ln.strip("|").split("|")]
            tag = "th" if i == 0 else "td"
            parts.append("<tr>" + "".join(f"<{tag}>{html.escape(c)}</{tag}>" for c in cells) + "</tr>")
        parts.append("</table>")
    if published.get("text"):
        parts.append(f"<p>{html.escape(str(published['text']))}</p>")
    note = [ln for ln in lines if ln.startswith("_")]
    if note:
        parts.append(f"<p><em>{html.escape(note[-1].strip('_'))}</em></p>")
    return "\n".join(parts)


# ---------------------------------------------------------------------------- chance and learning
#: a run "did not learn" a task when its mean in-distribution metric closes less than this share of
#: the gap between chance and a perfect score (100 %; perplexity 1, measured on a log scale)


def _row_chance(runs: list[dict[str, Any]], keys: list[str]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for k in keys:
        vals = [chance_level(r["config"], k) for r in runs]
        out[k] = None if not vals or any(v is None for v in vals) else statistics.fmean(vals)  # type: ignore[arg-type]
    return out


def _ind_keys(row: dict[str, Any]) -> list[str]:
    """The evaluation keys of the in-distribution mean (the ranking labels; lengths <= the training length;
    else every key)."""
    if row.get("ranked_by"):
        return [k for k in row["ranked_by"] if row["values"].get(k) is not None]
    keys = [k for k, v in row["values"].items() if v is not None and k.isdigit() and int(k) <= row["train_max"]]
    if not keys and not any(k.isdigit() and int(k) > row["train_max"] for k in row["values"]):
        keys = [k for k, v in row["values"].items() if v is not None]
    return keys


def _cell_at_chance(row: dict[str, Any], key: str) -> bool:
    v = row["values"].get(key)
    return v is not None and bool(at_chance(v[0], row["chance"].get(key), row["metric"], row["higher_is_better"]))


#: the note under every table (Markdown); the HTML report says the same with grey for italics
TABLE_NOTE = (
    f"Italics: at chance (less than {LEARNED_SHARE:.0%} of the way from chance to a perfect score). "
    "One seed: its value and (1 seed), no ±. Seeds split: the seeds disagree (some on each side of half-way "
    "between chance and a perfect score), each seed's value shown. s/run: mean training seconds of a run "
    "(wall time of the training loop; it depends on the machine and its load)."
)


def _learned(row: dict[str, Any]) -> tuple[bool | None, float | None]:
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
    c = chance if chance is not None else (0.0 if _pct(metric) and higher else None)
    shares = [_gap_closed(x, c, metric, higher) for x in xs] if c is not None else [None]
    if all(sh is not None for sh in shares):
        lo, hi = min(shares), max(shares)  # type: ignore[type-var]
        return lo < 0.5 <= hi and hi - lo >= SPLIT_SHARE  # type: ignore[operator]
    size = abs(statistics.fmean(xs))
    return size > 0 and (max(xs) - min(xs)) >= SPLIT_SHARE * size


#: seeds "split" when their shares of the gap from chance to perfect lie on both sides of one half and at least
#: this far apart (adjacent/normalized: one seed at 100 %, one at 49 % of a 50 % chance: shares 1.0 and 0)
SPLIT_SHARE = 0.4

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


def _amount(x: float, metric: str) -> str:
    return f"{100 * x:.1f} points" if _pct(metric) else f"{x:.2f} in {metric}"


def verdict(sub: list[dict[str, Any]]) -> str:
    """One sentence on a task's rows (ranked, as :func:`leaderboard` gives them): who won, by how much, and how
    sure: the 95 % paired t interval of the per-seed difference between the first and the second row (seeds in
    common), "not separable" where it includes 0 or there is one seed; and whether the rows learned the task."""
    first = sub[0]
    metric, higher = first["metric"], first["higher_is_better"]
    what = _summary_name(sub)
    score = first["extrapolation"] if what == "mean > train" else first["in_distribution"]
    unit = " %" if _pct(metric) else ""
    if len(sub) == 1:
        n = first["seeds"]
        text = f"only {first['label']} was run ({what} {_fmt(score, metric)}{unit}, {n} seed{'s' if n != 1 else ''})."
    else:
        second = sub[1]
        shared = sorted(set(first["seed_scores"]) & set(second["seed_scores"]))
        sign = 1.0 if higher else -1.0
        diffs = [sign * (first["seed_scores"][k] - second["seed_scores"][k]) for k in shared]
        other = second["extrapolation"] if what == "mean > train" else second["in_distribution"]
        gap = sign * (score - other)
        a, b = first["label"], second["label"]
        vs = f"{what} {_fmt(score, metric)}{unit} against {_fmt(other, metric)}{unit}"
        if not all(math.isfinite(d) for d in diffs) or not math.isfinite(gap):
            text = f"{a} wins ({what} {_fmt(score, metric)}{unit}); {b} could not evaluate every length."
        elif len(shared) < 2:
            seeds = "one seed" if shared else "no seed in common"
            text = (
                f"{a} is ahead of {b} by {_amount(gap, metric)} ({vs}) on {seeds}: not separable "
                "(one seed gives no interval; run more seeds)."
            )
        else:
            lo, hi = paired_interval(diffs)  # type: ignore[misc]
            k = 100.0 if _pct(metric) else 1.0
            ci = f"{k * lo:+.1f} to {k * hi:+.1f}"
            n = len(shared)
            if lo > 0:
                text = (
                    f"{a} wins, {_amount(gap, metric)} ahead of {b} ({vs}); the 95% paired interval of the "
                    f"difference over {n} seeds, {ci}, excludes 0."
                )
            else:
                text = (
                    f"{a} and {b} are not separable: {a} leads by {_amount(gap, metric)} ({vs}), but the 95% "
                    f"paired interval of the difference over {n} seeds, {ci}, includes 0"
                    + (" (two seeds give a wide interval: more seeds narrow it)." if n == 2 else ".")
                )
    learned = [r.get("learned") for r in sub]
    if learned and all(x is False for x in learned):
        text += " No encoding learned the task in distribution (at chance): the ranking means little."
    elif first.get("learned") is False:
        text += f" {first['label']} did not learn the task in distribution (at chance)."
    return text


def learning_warnings(rows: list[dict[str, Any]]) -> list[str]:
    """Warnings for the terminal: a task no encoding learned in distribution, and the rows that did not."""
    out = []
    for task in sorted({r["task"] for r in rows}):
        sub = [r for r in rows if r["task"] == task]
        weak = [r for r in sub if r.get("learned") is False]
        if weak and len(weak) == len(sub):
            out.append(
                f"no encoding learned task {task!r} in distribution (every row at chance): its ranking means "
                "nothing; train longer (--steps) or check the task's settings"
            )
        elif weak:
            out.append(
                f"{task}: did not learn in distribution (at chance; their extrapolation means little): "
                + ", ".join(
                    f"{r['label']} ({_fmt(r['in_distribution'], r['metric'])}{' %' if _pct(r['metric']) else ''})"
                    for r in weak
                )
            )
    return out


def _task_chance(sub: list[dict[str, Any]], key: str) -> float | None:
    vals = [r["chance"].get(key) for r in sub if r["chance"].get(key) is not None]
    return statistics.fmean(vals) if vals else None


# ---------------------------------------------------------------------------- styles
#: matplotlib's tab10 with black for its grey (grey is the chance band), markers and dash patterns;
#: label i of the report's sorted labels gets colour i % 10 and marker (i + i // 10) % 10, so every
#: label up to 100 has a (colour, marker) of its own
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#000000", "#bcbd22", "#17becf")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "*")
DASHES: tuple[Any, ...] = ("-", (0, (6, 2)), (0, (2, 1.5)), (0, (6, 1.5, 1.5, 1.5)))
GLYPHS = {"o": "●", "s": "■", "^": "▲", "D": "◆", "v": "▼", "P": "✚", "X": "✖", "<": "◀", ">": "▶", "*": "★"}
CHANCE_STYLE = {"color": "0.45", "lw": 3.0, "alpha": 0.45, "zorder": 1.5}


def encoding_styles(labels: Iterable[str]) -> dict[str, dict[str, Any]]:
    """One colour, marker and dash pattern per label, by its place in the sorted labels.

    The report computes it once from every label it shows, so an encoding looks the
    same in every panel of every plot (and in the tables' swatches).
    """
    out = {}
    for i, lab in enumerate(sorted(set(labels))):
        out[lab] = {
            "color": PALETTE[i % len(PALETTE)],
            "marker": MARKERS[(i + i // len(PALETTE)) % len(MARKERS)],
            "linestyle": DASHES[i % len(DASHES)],
        }
    return out


def _swatch(style: dict[str, Any] | None) -> str:
    if not style:
        return ""
    return f'<span class=sw style="color:{style["color"]}">{GLYPHS.get(style["marker"], "●")}</span> '


# ---------------------------------------------------------------------------- plots
def _new_figure(width: float, height: float) -> Any:
    """A matplotlib Figure (not pyplot: the global backend is left alone), or None without matplotlib."""
    try:
        from matplotlib.figure import Figure
    except ImportError:  # plots are an extra: pip install 'posenc[plots]'
        return None
    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def _shared_legend(fig: Any, axes: Any, styles: dict[str, dict[str, Any]]) -> None:
    """One legend for all panels: encodings in the order of their styles, then the reference marks."""
    seen: dict[str, Any] = {}
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(lab, h)
    order = [lab for lab in styles if lab in seen] + [lab for lab in seen if lab not in styles]
    fig.legend([seen[lab] for lab in order], order, loc="outside right upper", fontsize=8, frameon=False)


def _dodge(n_lines: int, gap: float) -> list[float]:
    """Offsets (in the x unit) that set ``n_lines`` lines slightly apart, so equal points stay visible."""
    step = min(0.035, 0.25 * gap / max(n_lines, 1))
    return [(j - (n_lines - 1) / 2) * step for j in range(n_lines)]


def _errors(mean: float, std: float, rng: tuple[float, float] | None) -> tuple[float, float]:
    """(below, above): ± std, clipped to the metric's range."""
    if rng is None:
        return std, std
    return max(0.0, min(std, mean - rng[0])), max(0.0, min(std, rng[1] - mean))


#: a task with more rows than this is drawn as a heatmap (rows × lengths), not as lines
HEATMAP_ROWS = 8
SEED_STYLE = {"linestyle": "none", "ms": 3.5, "mfc": "none", "mew": 0.8, "alpha": 0.65, "zorder": 2.5}


def _use_heatmap(sub: list[dict[str, Any]]) -> bool:
    return len(sub) > HEATMAP_ROWS and any(k.isdigit() for r in sub for k in r["values"])


def _seed_points(ax: Any, xs_of: dict[str, float], r: dict[str, Any], k: float, style: dict[str, Any]) -> bool:
    """Each seed's value of row ``r`` as a small hollow marker at the x of its key; whether any was drawn."""
    xs, ys = [], []
    for key, x in xs_of.items():
        vals = r.get("per_seed", {}).get(key, [])
        if len(vals) > 1:
            xs += [x] * len(vals)
            ys += [k * v for v in vals]
    if xs:
        ax.plot(xs, ys, marker=style.get("marker", "o"), color=style.get("color"), label="_nolegend_", **SEED_STYLE)
    return bool(xs)


def _chance_off_axis(ax: Any, sub: list[dict[str, Any]], keys: list[str], k: float, lo: float, hi: float) -> bool:
    """For a metric without a fixed range (perplexity): the chance level far outside the data's range [lo, hi] is
    written in the panel instead of drawn (a line at 10⁴ would squash curves at 340–480 into a thin band)."""
    cs = [c for key in keys if (c := _task_chance(sub, key)) is not None]
    if not cs:
        return True
    span = max(hi - lo, 1e-9 * max(abs(hi), 1.0))
    c = statistics.fmean(cs)
    if lo - span <= k * c <= hi + span:
        return False
    where = "above" if k * c > hi else "below"
    ax.text(
        0.02,
        0.97 if where == "above" else 0.03,
        f"chance: {_fmt(c, sub[0]['metric'])} ({where} the axis)",
        transform=ax.transAxes,
        va="top" if where == "above" else "bottom",
        fontsize=8,
        color="0.35",
    )
    return True


def _heatmap_panel(ax: Any, sub: list[dict[str, Any]]) -> Any:
    """Rows (ranked) × test lengths, coloured by the mean over seeds; each cell gives the mean and, below it, each
    seed's value; an orange frame marks seeds that disagree (:func:`seeds_disagree`). Returns the image."""
    from matplotlib.patches import Rectangle

    task, metric, tm = sub[0]["task"], sub[0]["metric"], sub[0]["train_max"]
    higher = sub[0]["higher_is_better"]
    k = 100.0 if _pct(metric) else 1.0
    lengths = sorted({int(n) for r in sub for n, v in r["values"].items() if v is not None and n.isdigit()})
    grid = [[float("nan")] * len(lengths) for _ in sub]
    for i, r in enumerate(sub):
        for j, n in enumerate(lengths):
            v = r["values"].get(str(n))
            if v is not None:
                grid[i][j] = k * v[0]
    finite = [x for row in grid for x in row if x == x]
    vmin, vmax = (0.0, 100.0) if _pct(metric) else (min(finite, default=0.0), max(finite, default=1.0))
    cmap = "viridis" if higher else "viridis_r"
    im = ax.imshow(grid, aspect="auto", cmap=cmap, vmin=vmin, vmax=vmax, interpolation="nearest")
    for i, r in enumerate(sub):
        for j, n in enumerate(lengths):
            x = grid[i][j]
            if x != x:
                ax.text(j, i, "n/a", ha="center", va="center", fontsize=7, color="0.4")
                continue
            shade = (x - vmin) / max(vmax - vmin, 1e-12)  # viridis is dark at 0 (viridis_r at 1)
            dark = shade < 0.55 if higher else shade > 0.45
            color = "white" if dark else "black"
            seeds = r.get("per_seed", {}).get(str(n), [])
            many = len(seeds) > 1
            mean = f"{x:.0f}" if _pct(metric) else f"{x:.3g}"
            ax.text(
                j, i - (0.14 if many else 0), mean, ha="center", va="center", fontsize=8, color=color, weight="bold"
            )
            if many:
                each = " ".join(f"{k * v:.0f}" if _pct(metric) else f"{k * v:.3g}" for v in seeds)
                ax.text(j, i + 0.22, each, ha="center", va="center", fontsize=5.5, color=color)
            if r.get("split", {}).get(str(n)):
                ax.add_patch(Rectangle((j - 0.46, i - 0.46), 0.92, 0.92, fill=False, ec="#ff7f0e", lw=2))
    ax.set_xticks(range(len(lengths)), [f"{n}\n(train)" if n <= tm else str(n) for n in lengths])
    ax.set_yticks(range(len(sub)), [r["label"] for r in sub], fontsize=8)
    trained = [j for j, n in enumerate(lengths) if n <= tm]
    if trained and len(trained) < len(lengths):
        ax.axvline(trained[-1] + 0.5, color="white", lw=3)
    ax.set_xlabel("test length")
    said = _trained_text(sub)
    ax.set_title(
        f"{task}" + (f" ({said})" if said else "") + f"\n{metric}{' %' if _pct(metric) else ''}, mean over seeds "
        "(bold) and each seed (below); orange frame: seeds split",
        fontsize=9,
    )
    return im


def _metric_panel(ax: Any, sub: list[dict[str, Any]], styles: dict[str, dict[str, Any]]) -> None:
    from matplotlib.ticker import NullLocator

    task, metric, tm = sub[0]["task"], sub[0]["metric"], sub[0]["train_max"]
    k = 100.0 if _pct(metric) else 1.0
    rng = _range(metric)
    lengths = sorted({int(n) for r in sub for n, v in r["values"].items() if v is not None and n.isdigit()})
    seeds_drawn = False
    # the data's range (mean ± std): where a metric without a fixed range puts its axis
    spans = [
        (k * (m - sd), k * (m + sd)) for r in sub for v in r["values"].values() if v is not None for m, sd in [v]
    ] + [(k * x, k * x) for r in sub for xs in r.get("per_seed", {}).values() for x in xs]
    spans = [(a, b) for a, b in spans if math.isfinite(a) and math.isfinite(b)]
    lo_data = min((a for a, _ in spans), default=0.0)
    hi_data = max((b for _, b in spans), default=1.0)
    if lengths:
        logs = [math.log2(n) for n in lengths]
        gap = min((b - a for a, b in zip(logs, logs[1:])), default=1.0)
        offs = _dodge(len(sub), gap)
        for off, r in zip(offs, sub):
            pts = [(n, r["values"][str(n)]) for n in lengths if r["values"].get(str(n)) is not None]
            if not pts:
                continue
            err = [_errors(m, s, rng) for _, (m, s) in pts]
            ax.errorbar(
                [n * 2**off for n, _ in pts],
                [k * m for _, (m, _) in pts],
                yerr=[[k * e[0] for e in err], [k * e[1] for e in err]],
                capsize=2,
                ms=5,
                lw=1.4,
                alpha=0.9,
                label=r["label"],
                **styles[r["label"]],
            )
            seeds_drawn |= _seed_points(ax, {str(n): n * 2**off for n, _ in pts}, r, k, styles[r["label"]])
        keys = [str(n) for n in lengths]
        off_axis = rng is None or rng[1] == float("inf")
        if not (off_axis and _chance_off_axis(ax, sub, keys, k, lo_data, hi_data)):
            chance = [(n, _task_chance(sub, str(n))) for n in lengths]
            chance = [(n, c) for n, c in chance if c is not None]
            if chance and max(c for _, c in chance) - min(c for _, c in chance) < 1e-9:
                ax.axhline(k * chance[0][1], label="chance", **CHANCE_STYLE)
            elif chance:
                ax.plot([n for n, _ in chance], [k * c for _, c in chance], label="chance", **CHANCE_STYLE)
        ax.set_xscale("log", base=2)
        lo, hi = lengths[0] / 2 ** (0.5 * gap), lengths[-1] * 2 ** (0.5 * gap)
        ax.set_xlim(lo, hi)
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.xaxis.set_minor_locator(NullLocator())
        longer = [n for n in lengths if n > tm]
        if longer:  # shade the lengths beyond training, from half-way (in log) between tm and the next length
            start = math.sqrt(max(tm, lo) * longer[0]) if tm >= lengths[0] else lo
            ax.axvspan(start, hi, color="#eef2f7", zorder=0, label="longer than training")
        ax.set_xlabel("test length")
        said = _trained_text(sub)
        # a long title (rows trained on different lengths) on two lines, clear of the legend at the right
        sep = "\n" if len(task) + len(said) > 40 else " "
        ax.set_title(f"{task}{sep}({said})" if said else task, fontsize=10)
    else:  # splits ("test", "valid" ...): one column each
        keys = [key for key, v in sub[0]["values"].items() if v is not None]
        for r in sub[1:]:
            keys += [key for key, v in r["values"].items() if v is not None and key not in keys]
        offs = _dodge(len(sub), 1.0)
        for off, r in zip(offs, sub):
            pts = [(i, r["values"][key]) for i, key in enumerate(keys) if r["values"].get(key) is not None]
            err = [_errors(m, s, rng) for _, (m, s) in pts]
            ax.errorbar(
                [i + off * 3 for i, _ in pts],
                [k * m for _, (m, _) in pts],
                yerr=[[k * e[0] for e in err], [k * e[1] for e in err]],
                capsize=2,
                ms=5,
                lw=0,
                elinewidth=1.2,
                label=r["label"],
                **{**styles[r["label"]], "linestyle": "none"},
            )
            xs_of = {keys[i]: i + off * 3 for i, _ in pts}
            seeds_drawn |= _seed_points(ax, xs_of, r, k, {**styles[r["label"]], "linestyle": "none"})
        chance = [(i, c) for i, key in enumerate(keys) if (c := _task_chance(sub, key)) is not None]
        off_axis = rng is None or rng[1] == float("inf")
        if chance and not (off_axis and _chance_off_axis(ax, sub, keys, k, lo_data, hi_data)):
            ys, xs = [k * c for _, c in chance], [i for i, _ in chance]
            ax.hlines(ys, [x - 0.4 for x in xs], [x + 0.4 for x in xs], label="chance", **CHANCE_STYLE)
        ax.set_xticks(range(len(keys)), keys)
        ax.set_xlim(-0.6, len(keys) - 0.4)
        ax.set_xlabel("evaluation split")
        ax.set_title(task, fontsize=10)
    if seeds_drawn:  # one legend entry for the seeds' hollow marks
        ax.plot([], [], marker="o", color="0.3", label="each seed (hollow)", **SEED_STYLE)
    better = "higher" if sub[0]["higher_is_better"] else "lower"
    ax.set_ylabel(f"{metric} {'%' if _pct(metric) else ''} ({better} is better)".replace("  ", " "))
    if _pct(metric):
        ax.set_ylim(-3, 103)
    else:  # a linear axis around the data (a far chance level is written, not drawn: _chance_off_axis)
        pad = 0.08 * max(hi_data - lo_data, 1e-9 * max(abs(hi_data), 1.0))
        low = lo_data - pad
        if rng is not None:
            low = max(low, k * rng[0] - pad)
        ax.set_ylim(low, hi_data + pad)
    ax.grid(axis="y", color="0.9", lw=0.8)
    ax.set_axisbelow(True)


def metric_figure(
    results: list[dict[str, Any]],
    *,
    styles: dict[str, dict[str, Any]] | None = None,
    rows: list[dict[str, Any]] | None = None,
) -> Any:
    """The metric against test length: one panel per task, one line per encoding; a matplotlib Figure or None.

    Every encoding has one colour and marker (:func:`encoding_styles`); the grey band is the task's
    chance level; error bars (± std over seeds) are clipped to the metric's range; the x axis is
    the test length, on a log scale labelled with the lengths themselves.
    """
    rows = leaderboard(results) if rows is None else rows
    tasks = sorted({r["task"] for r in rows})
    if not tasks:
        return None
    styles = styles or encoding_styles(r["label"] for r in rows)
    subs = {task: [r for r in rows if r["task"] == task] for task in tasks}
    heat = [t for t in tasks if _use_heatmap(subs[t])]
    height = max([3.9] + [0.42 * len(subs[t]) + 1.6 for t in heat])
    fig = _new_figure(4.6 * len(tasks) + 1.6 + 1.2 * len(heat), height)
    if fig is None:
        return None
    axes = fig.subplots(1, len(tasks), squeeze=False)[0]
    for ax, task in zip(axes, tasks):
        if task in heat:
            fig.colorbar(_heatmap_panel(ax, subs[task]), ax=ax, shrink=0.6, pad=0.02)
        else:
            _metric_panel(ax, subs[task], styles)
    if len(heat) < len(tasks):
        _shared_legend(fig, axes, styles)
    return fig


def curves_figure(results: list[dict[str, Any]], *, styles: dict[str, dict[str, Any]] | None = None) -> Any:
    """Training loss against step, one panel per task, one line per encoding (mean over seeds, each seed thin
    beneath it); a Figure or None.

    Lines carry their encoding's colour, marker (every few points, staggered so that lines lying on
    top of each other still show each marker) and dash pattern.
    """
    tasks = sorted({r["config"]["task"] for r in results if r.get("curve")})
    if not tasks:
        return None
    styles = styles or encoding_styles(label_of(r) for r in results)
    fig = _new_figure(4.6 * len(tasks) + 1.6, 3.7)
    if fig is None:
        return None
    axes = fig.subplots(1, len(tasks), squeeze=False)[0]
    for ax, task in zip(axes, tasks):
        by_label: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for r in results:
            if r["config"]["task"] == task and r.get("curve"):
                by_label[label_of(r)].append(r)
        n_lines = len(by_label)
        for j, (lab, runs) in enumerate(sorted(by_label.items())):
            # mean over seeds at the steps every seed logged
            steps = sorted(set.intersection(*[{int(s) for s, _ in r["curve"]} for r in runs]))
            ys = [statistics.fmean(dict((int(s), v) for s, v in r["curve"])[s] for r in runs) for s in steps]
            # a marker every few points, each line starting at another point: lines on top of each other
            # show every line's marker (one per line and period, up to half the points)
            every = max(1, min(max(len(steps) // 6, n_lines), len(steps) // 2))
            style = styles.get(lab, {})
            if len(runs) > 1:  # each seed thin beneath the mean: a split (one seed learns, one not) shows
                for r in runs:
                    xy = sorted((int(st), float(v)) for st, v in r["curve"])
                    ax.plot(
                        [a for a, _ in xy],
                        [b for _, b in xy],
                        color=style.get("color"),
                        lw=0.7,
                        alpha=0.3,
                        label="_nolegend_",
                    )
            ax.plot(
                steps,
                ys,
                markevery=(j % every, every),
                ms=5,
                lw=1.5,
                alpha=0.85,
                label=lab,
                **styles.get(lab, {}),
            )
        ax.set_title(f"{task}: training loss (mean over seeds; thin: each seed)", fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel("loss (smoothed, log scale)")
        ax.set_yscale("log")
        ax.grid(color="0.92", lw=0.8)
        ax.set_axisbelow(True)
    _shared_legend(fig, axes, styles)
    return fig


def _save(fig: Any, path: Path) -> Path | None:
    if fig is None:
        return None
    path = Path(path)
    fig.savefig(path, dpi=100)
    return path


def plot(results: list[dict[str, Any]], path: Path, *, styles: dict[str, dict[str, Any]] | None = None) -> Path | None:
    """Save :func:`metric_figure` as a PNG (None without matplotlib or results)."""
    return _save(metric_figure(results, styles=styles), path)


def plot_curves(
    results: list[dict[str, Any]], path: Path, *, styles: dict[str, dict[str, Any]] | None = None
) -> Path | None:
    """Save :func:`curves_figure` as a PNG (None without matplotlib or curves)."""
    return _save(curves_figure(results, styles=styles), path)


# ---------------------------------------------------------------------------- context
def _distinct(envs: list[Any]) -> list[Any]:
    out: list[Any] = []
    for e in envs:
        if e not in out:
            out.append(e)
    return out


def mixed_environments(rows: list[dict[str, Any]]) -> dict[str, str]:
    """Per task whose runs come from different environments (CPU, kernel path or torch): what differs."""
    out = {}
    for task in sorted({r["task"] for r in rows}):
        diff = differences([e for r in rows if r["task"] == task for e in r.get("envs", [])])
        if diff:
            out[task] = (
                "the runs of this table were trained in different environments ("
                + "; ".join(f"{ENV_COLUMNS.get(k, k)}: {' / '.join(v)}" for k, v in diff.items())
                + "): their last digits may differ for that reason alone"
            )
    return out


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

        env["torch threads"] = str(torch.get_num_threads())
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "unset")
    return env


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
    from .api import get_task

    out = []
    for task in sorted({r["task"] for r in rows}):
        sub = [r for r in rows if r["task"] == task]
        try:
            desc = get_task(task).description
        except Exception:
            desc = ""
        metric = sub[0]["metric"]
        keys = list(sub[0]["values"])
        chance = {key: _task_chance(sub, key) for key in keys}
        known = {key: c for key, c in chance.items() if c is not None}
        if not known:
            text = "unknown"
        elif max(known.values()) - min(known.values()) < 1e-9:
            text = _fmt(next(iter(known.values())), metric) + (" %" if _pct(metric) else "")
        else:
            text = ", ".join(f"{key}: {_fmt(c, metric)}" for key, c in known.items()) + (" (%)" if _pct(metric) else "")
        better = "higher" if sub[0]["higher_is_better"] else "lower"
        out.append(
            {
                "task": task,
                "description": desc or "(no description)",
                "metric": f"{metric}{' %' if _pct(metric) else ''}, {better} is better",
                "chance": text,
            }
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
        ok, c = _learned(r)
        pct = " %" if _pct(r["metric"]) else ""
        if ok is False:
            weak.append(
                {
                    "run": f"{r['task']}/{r['label']} ({r['seeds']} seed{'s' if r['seeds'] != 1 else ''})",
                    "error": f"in distribution {_fmt(r['in_distribution'], r['metric'])}{pct}, "
                    f"chance {_fmt(c, r['metric'])}{pct}",
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


# ---------------------------------------------------------------------------- files
def _jsonable(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    def num(x: Any) -> Any:
        return None if isinstance(x, float) and (x != x or x in (float("inf"), float("-inf"))) else x

    out = []
    for r in rows:
        d = {k: num(v) for k, v in r.items() if k not in ("values", "chance")}
        d["values"] = {k: None if v is None else {"mean": num(v[0]), "std": num(v[1])} for k, v in r["values"].items()}
        d["chance"] = {k: num(v) for k, v in r["chance"].items()}
        d["per_seed"] = {k: [num(x) for x in xs] for k, xs in r.get("per_seed", {}).items()}
        d["seed_scores"] = {str(k): num(v) for k, v in r.get("seed_scores", {}).items()}
        out.append(d)
    return out


def _md_table(head: list[str], body: list[list[str]]) -> list[str]:
    esc = [[c.replace("|", "\\|").replace("\n", " ") for c in row] for row in [head, *body]]
    return ["| " + " | ".join(esc[0]) + " |", "|" + "---|" * len(head), *("| " + " | ".join(r) + " |" for r in esc[1:])]


def _html_table(head: list[str], body: list[list[str]], cls: str = "") -> str:
    """A table of already escaped cells."""
    out = [f"<table{f' class={cls}' if cls else ''}>"]
    if any(head):
        out.append("<tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>")
    out += ["<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in body]
    return "\n".join(out) + "\n</table>"


def _summary(results: list[dict[str, Any]], rows: list[dict[str, Any]], failures: list[dict[str, Any]] | None) -> str:
    suites = sorted({str(r.get("suite")) for r in results if r.get("suite")})
    seeds = sorted({r["config"]["seed"] for r in results})
    n_fail = len(failures or [])
    return (
        f"{len(results)} finished run{'s' if len(results) != 1 else ''}"
        + (f" of suite {', '.join(suites)}" if suites else "")
        + f": {len({r['label'] for r in rows})} encodings × {len({r['task'] for r in rows})} tasks × "
        f"{len(seeds)} seed{'s' if len(seeds) != 1 else ''}"
        + (f"; {n_fail} run{'s' if n_fail != 1 else ''} failed" if n_fail else "")
    )


CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;max-width:1200px;margin:1.5em auto;
padding:0 1em;color:#222;line-height:1.4}
h1{margin-bottom:.2em} h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:1.6em} h3{margin-bottom:.3em}
.meta{color:#555} nav a{margin-right:1em}
table{border-collapse:collapse;margin:.5em 0 1em;font-size:90%}
td,th{border:1px solid #ccc;padding:3px 8px;text-align:right;vertical-align:top}
th{background:#f3f3f3} td:nth-child(2),th:nth-child(2){text-align:left}
table.left td,table.left th{text-align:left}
tr.chance td{color:#777;font-style:italic;background:#fafafa}
td.best{font-weight:bold} td.low{color:#999}
.verdict{background:#eef5ee;padding:.3em .5em;border-left:3px solid #5a5}
.sw{font-size:110%} img{max-width:100%}
pre{white-space:pre-wrap;font-size:85%;background:#f7f7f7;padding:.4em;margin:.2em 0}
.note{color:#555;font-size:90%} .warn{color:#8a4b00;background:#fff4e0;padding:.3em .5em}
"""


def _results_html(rows: list[dict[str, Any]], styles: dict[str, dict[str, Any]]) -> list[str]:
    body = []
    mixed = mixed_environments(rows)
    for task in sorted({r["task"] for r in rows}):
        sub = [r for r in rows if r["task"] == task]
        labels = list(sub[0]["values"])
        metric, tm = sub[0]["metric"], sub[0]["train_max"]
        higher = sub[0]["higher_is_better"]
        summary = _summary_name(sub)
        unit = f"{metric} %" if _pct(metric) else metric
        body.append(f"<h3>{html.escape(task)}</h3>")
        body.append(f"<p class=verdict><strong>Verdict:</strong> {html.escape(verdict(sub))}</p>")
        body.append(
            f"<p class=note>{html.escape(unit)} ({'higher' if higher else 'lower'} is better), mean ± std over seeds"
            + (f"; {_trained_text(sub)}" if _trained_text(sub) else "")
            + f"; best value of each column in bold; in grey: at chance (less than {LEARNED_SHARE:.0%} of the way "
            "from chance to a perfect score; the Failures list uses the same rule); one seed: its value, no ±; "
            "seeds split: seeds on both sides of half-way between chance and a perfect score, each shown; "
            "s/run: mean training seconds of a run (wall time of the training loop, which depends on the machine "
            "and its load).</p>"
        )
        if task in mixed:
            body.append(f"<p class=warn><strong>Warning:</strong> {html.escape(mixed[task])}.</p>")
        head = ["#", "encoding", *[html.escape(_label(n, tm)) for n in labels], summary, "seeds", "s/run"]
        best = {}
        for n in labels:
            vals = [r["values"][n][0] for r in sub if r["values"].get(n) is not None]
            if vals:
                best[n] = max(vals) if higher else min(vals)
        table = []
        for i, r in enumerate(sub, 1):
            cells = [str(i), _swatch(styles.get(r["label"])) + html.escape(r["label"])]
            for n in labels:
                v = r["values"].get(n)
                cls = ""
                if _cell_at_chance(r, n):
                    cls = "low"
                elif v is not None and n in best and v[0] == best[n]:
                    cls = "best"
                text = html.escape(_cell(v, metric, r, n))
                cells.append(f"<span class={cls}>{text}</span>" if cls else text)
            value = r["extrapolation"] if summary == "mean > train" else r["in_distribution"]
            cells += [_fmt(value, metric), str(r["seeds"]), f"{r['seconds']:.1f}"]
            table.append(cells)
        chance_cells = [_fmt(c, metric) if (c := _task_chance(sub, n)) is not None else "?" for n in labels]
        table.append(["", "chance", *chance_cells, "", "", ""])
        text = _html_table(head, table)
        # classes on cells: a span cannot style the cell, so move them onto the <td>
        text = text.replace("<td><span class=best>", "<td class=best><span>").replace(
            "<td><span class=low>", "<td class=low><span>"
        )
        text = text.replace("<tr><td></td><td>chance</td>", "<tr class=chance><td></td><td>chance</td>")
        body.append(text)
    return body


def _markdown_page(
    title: str,
    description: str,
    summary: str,
    env: dict[str, str],
    rows: list[dict[str, Any]],
    results: list[dict[str, Any]],
    pub: str,
    probs: dict[str, list[dict[str, str]]],
    files: list[str],
) -> str:
    out = [f"# {title}", "", f"_{summary}. Written {env['date']} by posenc {env['posenc']}._", ""]
    if description:
        out += [description, ""]
    out += ["## Tasks", ""]
    info = tasks_info(rows)
    out += _md_table(
        ["task", "what it is", "metric", "chance"],
        [[d["task"], d["description"], d["metric"], d["chance"]] for d in info],
    )
    out += ["", "## Results", "", markdown_table(rows)]
    if files:
        out += ["Plots: " + ", ".join(f"`{f}`" for f in files) + " (embedded in `report.html`).", ""]
    if pub:
        out += ["## Beside the published numbers", "", pub]
    out += ["## Failures", ""]
    if not any(probs.values()):
        out += ["None: every run finished, reached every length and learned its task in distribution.", ""]
    for kind, items in probs.items():
        if items:
            out += [f"**{PROBLEM_TEXT[kind]}**", ""]
            out += [f"- {p['run']}: {p['error'].splitlines()[-1] if p['error'] else ''}" for p in items]
            out += [""]
    head, grid = settings_grid(results)
    if grid:
        out += ["## Settings", ""]
        out += _md_table(head, grid)
        out += [""]
    out += ["## Environment", "", "Where the runs were trained (each run records its own), per suite:", ""]
    out += _md_table(*run_environments(results))
    mixed = mixed_environments(rows)
    if mixed:
        out += ["", *(f"- **Warning**, {task}: {text}." for task, text in mixed.items())]
    out += ["", "Of the process that wrote this report:", ""]
    out += _md_table(["", ""], [[k, v] for k, v in env.items()])
    return "\n".join(out) + "\n"


def write_report(
    results: list[dict[str, Any]],
    out_dir: Path,
    title: str = "posenc bench",
    *,
    published: dict[str, Any] | None = None,
    failures: list[dict[str, Any]] | None = None,
    description: str = "",
) -> dict[str, Path]:
    """Write ``results.json``, ``leaderboard.md``, ``leaderboard.json``, plots and ``report.html``.

    ``report.html`` is one self-contained page (plots embedded as PNG, CSS inline, no
    external reference): the tasks and their chance levels, the results, the plots, the
    published numbers beside ours (``published``: a suite's ``published`` section), the
    failures (``failures``: runs that raised; rows that did not learn in distribution;
    lengths not reached), the settings and the environment. ``leaderboard.md`` has the
    same sections, without the plots.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = leaderboard(results)
    styles = encoding_styles(r["label"] for r in rows)
    env = environment()
    summary = _summary(results, rows, failures)
    probs = problems(rows, failures)
    pub = published_table(published or {}, rows)
    files = {
        "results": out_dir / "results.json",
        "leaderboard": out_dir / "leaderboard.md",
        "leaderboard_json": out_dir / "leaderboard.json",
    }
    files["results"].write_text(json.dumps({"leaderboard": _jsonable(rows), "runs": results}, indent=1))
    files["leaderboard_json"].write_text(json.dumps({"title": title, "rows": _jsonable(rows)}, indent=1))
    png = plot(results, out_dir / "accuracy_vs_length.png", styles=styles)
    if png is not None:
        files["plot"] = png
    curves = plot_curves(results, out_dir / "training_curves.png", styles=styles)
    if curves is not None:
        files["curves"] = curves
    pictures = [files[k].name for k in ("plot", "curves") if k in files]
    files["leaderboard"].write_text(
        _markdown_page(title, description, summary, env, rows, results, pub, probs, pictures)
    )

    sections = [("tasks", "Tasks"), ("results", "Results"), ("plots", "Plots")]
    if published:
        sections.append(("published", "Published"))
    sections += [("failures", "Failures"), ("settings", "Settings"), ("environment", "Environment")]
    body = [f"<h1>{html.escape(title)}</h1>"]
    body.append(
        f"<p class=meta>{html.escape(summary)}. Written {html.escape(env['date'])} "
        f"by posenc {html.escape(env['posenc'])}.</p>"
    )
    if description:
        body.append(f"<p>{html.escape(description)}</p>")
    body.append("<nav>" + "".join(f'<a href="#{a}">{t}</a>' for a, t in sections) + "</nav>")

    body.append('<h2 id="tasks">Tasks</h2>')
    info = tasks_info(rows)
    body.append(
        _html_table(
            ["task", "what it is", "metric", "chance"],
            [[html.escape(d[k]) for k in ("task", "description", "metric", "chance")] for d in info],
            "left",
        )
    )
    body.append(
        "<p class=note>Chance: what a model that learned nothing scores (the best answer that ignores the "
        "input: the majority class, or for perplexity a uniform guess over the vocabulary), "
        "as the task declares it (<code>Task.chance</code>); drawn as a grey band in the plots.</p>"
    )

    body.append('<h2 id="results">Results</h2>')
    body += _results_html(rows, styles)

    body.append('<h2 id="plots">Plots</h2>')
    if pictures:
        for key, alt in (("plot", "metric against test length"), ("curves", "training curves")):
            if key in files:
                data = base64.b64encode(files[key].read_bytes()).decode()
                body.append(f'<h3>{alt.capitalize()}</h3><p><img src="data:image/png;base64,{data}" alt="{alt}"></p>')
        body.append(
            "<p class=note>One colour and marker per encoding in every panel; grey band: chance; shaded: "
            "lengths longer than training; error bars: ± std over seeds, cut at the metric's range; small hollow "
            "marks: each seed; a task with more than "
            f"{HEATMAP_ROWS} rows is a heatmap (mean over seeds, each seed below it, seeds that disagree framed); "
            "a chance level far off the data (perplexity) is written in the panel, not drawn.</p>"
        )
    else:
        body.append("<p>No plots: matplotlib is not installed (<code>pip install 'posenc[plots]'</code>).</p>")

    if published:
        body.append('<h2 id="published">Beside the published numbers</h2>')
        body.append(_published_html(published, rows))

    body.append('<h2 id="failures">Failures</h2>')
    if not any(probs.values()):
        body.append("<p>None: every run finished, reached every length and learned its task in distribution.</p>")
    for kind, items in probs.items():
        if not items:
            continue
        body.append(f"<h3>{html.escape(PROBLEM_TEXT[kind])}</h3><ul>")
        for p in items:
            err = html.escape(p["error"])
            body.append(
                f"<li>{html.escape(p['run'])}: <pre>{err}</pre></li>"
                if kind == "failed"
                else f"<li>{html.escape(p['run'])}: {err}</li>"
            )
        body.append("</ul>")

    body.append('<h2 id="settings">Settings</h2>')
    head, grid = settings_grid(results)
    if grid:
        body.append(_html_table([html.escape(h) for h in head], [[html.escape(c) for c in r] for r in grid], "left"))
    else:
        body.append("<p>No finished runs.</p>")

    body.append('<h2 id="environment">Environment</h2>')
    body.append("<h3>Where the runs were trained</h3>")
    body.append("<p class=note>Each run records the environment of the process that trained it, per suite:</p>")
    env_head, env_body = run_environments(results)
    body.append(_html_table(env_head, [[html.escape(c) for c in row] for row in env_body], "left"))
    for task, text in mixed_environments(rows).items():
        body.append(f"<p class=warn><strong>Warning</strong>, {html.escape(task)}: {html.escape(text)}.</p>")
    body.append("<h3>This report</h3>")
    body.append(
        "<p class=note>Of the process that wrote this report "
        "(the runs may have run in other processes or on other machines).</p>"
    )
    body.append(_html_table(["", ""], [[html.escape(k), html.escape(v)] for k, v in env.items()], "left"))
    beside = [p.name for p in files.values()]
    if (out_dir / "results.sqlite").exists():
        beside.insert(0, "results.sqlite (every finished run and failure: the store the next run resumes from)")
    body.append("<p class=note>Files beside this page: " + ", ".join(map(html.escape, beside)) + ", report.html.</p>")

    files["report"] = out_dir / "report.html"
    files["report"].write_text(
        f"<!doctype html>\n<html lang=en><head><meta charset=utf-8><title>{html.escape(title)}</title>\n"
        f"<style>{CSS}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
    )
    return files
