"""The plots of a set of runs (matplotlib, an extra: ``pip install 'posenc[plots]'``).

:func:`metric_figure`: the metric against test length, one panel per task, one line per encoding (a task
with more than :data:`HEATMAP_ROWS` rows: a heatmap); :func:`curves_figure`: the training loss against
step. The panels draw the model's task tables (:class:`~.model.TaskTable`: the rows, chance and training
lengths that the tables show) with the model's styles (:func:`.styles.encoding_styles`), so an encoding looks
the same in every panel and in the tables. They use matplotlib's Figure, never pyplot (the global backend is
left alone). It imports the model and the lower modules of the reporting package, and
:mod:`posenc.bench.outcomes`.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from ..outcomes import is_pct, metric_range
from ..types import label_of
from .format import fmt
from .model import TaskTable, task_tables
from .rows import leaderboard, task_chance
from .styles import CHANCE_STYLE, encoding_styles


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


def _use_heatmap(t: TaskTable) -> bool:
    return len(t.rows) > HEATMAP_ROWS and any(k.isdigit() for r in t.rows for k in r["values"])


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
    cs = [c for key in keys if (c := task_chance(sub, key)) is not None]
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
        f"chance: {fmt(c, sub[0]['metric'])} ({where} the axis)",
        transform=ax.transAxes,
        va="top" if where == "above" else "bottom",
        fontsize=8,
        color="0.35",
    )
    return True


def _heatmap_panel(ax: Any, t: TaskTable) -> Any:
    """Rows (ranked) × test lengths, coloured by the mean over seeds; each cell gives the mean and, below it, each
    seed's value; an orange frame marks seeds that disagree (:func:`seeds_disagree`). Returns the image."""
    from matplotlib.patches import Rectangle

    sub, task, metric, tm, higher = t.rows, t.task, t.metric, t.train_max, t.higher
    k = 100.0 if is_pct(metric) else 1.0
    lengths = sorted({int(n) for r in sub for n, v in r["values"].items() if v is not None and n.isdigit()})
    grid = [[float("nan")] * len(lengths) for _ in sub]
    for i, r in enumerate(sub):
        for j, n in enumerate(lengths):
            v = r["values"].get(str(n))
            if v is not None:
                grid[i][j] = k * v[0]
    finite = [x for row in grid for x in row if x == x]
    vmin, vmax = (0.0, 100.0) if is_pct(metric) else (min(finite, default=0.0), max(finite, default=1.0))
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
            mean = f"{x:.0f}" if is_pct(metric) else f"{x:.3g}"
            # each seed's value below the mean, three to a line (six seeds' values on one line overrun the cell)
            each = [f"{k * v:.0f}" if is_pct(metric) else f"{k * v:.3g}" for v in seeds] if many else []
            lines = [" ".join(each[a : a + 3]) for a in range(0, len(each), 3)]
            top = -0.14 if len(lines) == 1 else -0.24 if lines else 0.0
            ax.text(j, i + top, mean, ha="center", va="center", fontsize=8, color=color, weight="bold")
            for m, line in enumerate(lines):
                ax.text(
                    j,
                    i + (0.22 if len(lines) == 1 else 0.06 + 0.22 * m),
                    line,
                    ha="center",
                    va="center",
                    fontsize=5.5,
                    color=color,
                )
            if r.get("split", {}).get(str(n)):
                ax.add_patch(Rectangle((j - 0.46, i - 0.46), 0.92, 0.92, fill=False, ec="#ff7f0e", lw=2))
    ax.set_xticks(range(len(lengths)), [f"{n}\n(train)" if n <= tm else str(n) for n in lengths])
    ax.set_yticks(range(len(sub)), [r["label"] for r in sub], fontsize=8)
    trained = [j for j, n in enumerate(lengths) if n <= tm]
    if trained and len(trained) < len(lengths):
        ax.axvline(trained[-1] + 0.5, color="white", lw=3)
    ax.set_xlabel("test length")
    said = t.trained
    ax.set_title(
        f"{task}" + (f" ({said})" if said else "") + f"\n{metric}{' %' if is_pct(metric) else ''}, mean over seeds "
        "(bold) and each seed (below); orange frame: seeds split",
        fontsize=9,
    )
    return im


def _metric_panel(ax: Any, t: TaskTable, styles: dict[str, dict[str, Any]]) -> None:
    from matplotlib.ticker import NullLocator

    sub, task, metric, tm = t.rows, t.task, t.metric, t.train_max
    k = 100.0 if is_pct(metric) else 1.0
    rng = metric_range(metric)
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
            chance = [(n, task_chance(sub, str(n))) for n in lengths]
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
        said = t.trained
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
        chance = [(i, c) for i, key in enumerate(keys) if (c := task_chance(sub, key)) is not None]
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
    better = "higher" if t.higher else "lower"
    ax.set_ylabel(f"{metric} {'%' if is_pct(metric) else ''} ({better} is better)".replace("  ", " "))
    if is_pct(metric):
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
    tables = task_tables(rows)
    if not tables:
        return None
    styles = styles or encoding_styles(r["label"] for r in rows)
    heat = {t.task: len(t.rows) for t in tables if _use_heatmap(t)}
    height = max([3.9] + [0.42 * n + 1.6 for n in heat.values()])
    fig = _new_figure(4.6 * len(tables) + 1.6 + 1.2 * len(heat), height)
    if fig is None:
        return None
    axes = fig.subplots(1, len(tables), squeeze=False)[0]
    for ax, t in zip(axes, tables):
        if t.task in heat:
            fig.colorbar(_heatmap_panel(ax, t), ax=ax, shrink=0.6, pad=0.02)
        else:
            _metric_panel(ax, t, styles)
    if len(heat) < len(tables):
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
        ax.set_title(f"{task}: training loss\n(mean over seeds; thin: each seed)", fontsize=10)
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


def plot(
    results: list[dict[str, Any]],
    path: Path,
    *,
    styles: dict[str, dict[str, Any]] | None = None,
    rows: list[dict[str, Any]] | None = None,
) -> Path | None:
    """Save :func:`metric_figure` as a PNG (None without matplotlib or results); ``rows``: the results' leaderboard
    where the caller has it already."""
    return _save(metric_figure(results, styles=styles, rows=rows), path)


def plot_curves(
    results: list[dict[str, Any]], path: Path, *, styles: dict[str, dict[str, Any]] | None = None
) -> Path | None:
    """Save :func:`curves_figure` as a PNG (None without matplotlib or curves)."""
    return _save(curves_figure(results, styles=styles), path)
