"""Steps to target: the context-extension task's fine-tuning curves on the results page (issue 46).

A run of an extension task with ``task_options checkpoints = [0, 10, ...]`` evaluates its model after each of those
fine-tuning steps (``extra.checkpoints``: step -> {test length: perplexity}). This module turns those runs into
what the context-extension papers claim about fine-tuning:

* Peng et al. 2023 (YaRN), abstract: "requiring 10x less tokens and 2.5x less training steps than previous
  methods". The target is PI's perplexity at the fine-tuning length after its whole budget (the ``rope-linear``
  run of the same seed and fine-tune); a method's *steps to target* is the first step at which its perplexity at
  that length is at or below the target, linearly interpolated between the two checkpoints around the crossing
  (``None``: never within the budget). The ratio PI / method says how many times fewer steps it needed.
* Chen et al. 2023 (PI): the perplexity at ``L`` (the trained window) and at ``s·L`` against the step count.

:func:`sections` gives the table and the figure (:class:`~posenc.bench.types.ReportSection`) for the runs of one
suite; the numbers are a function of the records alone.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..types import ReportSection, label_of

#: the method whose fine-tuned perplexity is the target (PI)
REFERENCE = "rope-linear"


def steps_to(curve: Sequence[tuple[float, float]], target: float) -> float | None:
    """The first step at which ``curve`` (``(step, value)`` in step order) is at or below ``target``: a checkpoint's
    step where it is met there first, else linearly interpolated between the last checkpoint above the target and
    the first one at or below it; ``None`` if no checkpoint reaches it."""
    prev: tuple[float, float] | None = None
    for step, value in curve:
        if value <= target:
            if prev is None or prev[1] == value:
                return float(step)
            s0, v0 = prev
            return s0 + (v0 - target) / (v0 - value) * (step - s0)
        prev = (step, value)
    return None


def _curve(record: dict[str, Any], length: int) -> list[tuple[float, float]]:
    points = record["extra"]["checkpoints"]
    return sorted((int(k), float(v[str(length)])) for k, v in points.items() if str(length) in v)


def curve_runs(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The fine-tuned runs with a curve of three checkpoints or more, in a stable order."""
    runs = [r for r in records if len((r.get("extra") or {}).get("checkpoints") or {}) >= 3]
    return sorted(runs, key=lambda r: (label_of(r), r["config"]["seed"]))


def _setting(r: dict[str, Any]) -> tuple[Any, ...]:
    """What two runs must share for one to be the other's target: the seed, the fine-tune and its checkpoints."""
    opts = r["config"].get("task_options") or {}
    return (r["config"]["seed"], r["extra"].get("finetune_length"), opts.get("finetune_steps"),
            tuple(opts.get("checkpoints") or ()), r["config"]["train_lengths"][1])


def table(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The steps-to-target numbers of ``records``: per label, the seeds, the fine-tuning length, the perplexity at
    ``L`` and at the fine-tuning length after each checkpoint (per seed), the target (PI's at its last checkpoint),
    the steps to it and the ratio of PI's steps to it, per seed."""
    runs = curve_runs(records)
    refs = {_setting(r): r for r in runs if r["config"]["encoding"] == REFERENCE}
    out: dict[str, Any] = {}
    for r in runs:
        label, ft = label_of(r), int(r["extra"]["finetune_length"])
        L = int(r["config"]["train_lengths"][1])
        row = out.setdefault(label, {"seeds": [], "L": L, "ft_length": ft, "at_L": [], "at_ft": [], "target": [],
                                     "steps": [], "pi_steps": [], "ratio": []})
        row["seeds"].append(r["config"]["seed"])
        row["at_L"].append(dict(_curve(r, L)))
        mine = _curve(r, ft)
        row["at_ft"].append(dict(mine))
        ref = refs.get(_setting(r))
        if ref is None:
            for key in ("target", "steps", "pi_steps", "ratio"):
                row[key].append(None)
            continue
        ref_curve = _curve(ref, ft)
        target = ref_curve[-1][1]
        steps, pi_steps = steps_to(mine, target), steps_to(ref_curve, target)
        row["target"].append(target)
        row["steps"].append(steps)
        row["pi_steps"].append(pi_steps)
        row["ratio"].append(pi_steps / steps if steps and pi_steps else (math.inf if steps == 0 else None))
    return out


def _mean_sd(values: Sequence[float]) -> str:
    if not values:
        return "—"
    m = statistics.fmean(values)
    return f"{m:.2f}" if len(values) == 1 else f"{m:.2f} ± {statistics.stdev(values):.2f}"


def _steps_text(v: float | None, budget: int) -> str:
    return f"> {budget}" if v is None else f"{v:.0f}"


def _ratio_text(v: float | None) -> str:
    return "—" if v is None else ("∞" if math.isinf(v) else f"{v:.1f}×")


def ratio_interval(ratios: Sequence[float | None]) -> tuple[float, float, float] | None:
    """The mean of the per-seed ratios and its 95 % *t* interval (seeds as independent replicates); None where a
    seed never reached the target (its ratio is unknown) or fewer than two seeds did."""
    from ..._stats import paired_t

    if any(r is None or math.isinf(r) for r in ratios):
        return None
    values = [float(r) for r in ratios if r is not None]
    ci = paired_t(values)
    return None if ci is None else (statistics.fmean(values), ci[0], ci[1])


def ratio_interval_text(ratios: Sequence[float | None]) -> str:
    ci = ratio_interval(ratios)
    return "—" if ci is None else f"{ci[0]:.2f}× [{ci[1]:.2f}, {ci[2]:.2f}]"


def lines(data: dict[str, Any]) -> list[str]:
    """The Markdown table of :func:`table`'s numbers."""
    if not data:
        return []
    first = next(iter(data.values()))
    steps = sorted({k for row in data.values() for d in row["at_ft"] for k in d})
    budget = steps[-1]
    L, ft = first["L"], first["ft_length"]
    head = ["encoding", "seeds", *[f"{ft} @ {k}" for k in steps], f"{L} @ {budget}",
            "steps to PI's target, per seed", "PI's steps / its steps, per seed", "that ratio: mean [95 % t]"]
    out = [
        f"Perplexity at the fine-tuning length {ft} (= s·L) after each number of fine-tuning steps (mean ± sd over the "
        f"seeds), and at L = {L} after the last; the target is PI's ({REFERENCE}) perplexity at {ft} after {budget} "
        f"steps of the same seed, the steps to it are interpolated between checkpoints (> {budget}: not reached); the "
        f"ratio's interval treats the seeds as independent replicates (Student's t on seeds - 1 degrees of freedom).",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for label, row in data.items():
        cells = [label, ", ".join(map(str, row["seeds"]))]
        cells += [_mean_sd([d[k] for d in row["at_ft"] if k in d]) for k in steps]
        cells.append(_mean_sd([d[budget] for d in row["at_L"] if budget in d]))
        cells.append(" / ".join(_steps_text(v, budget) for v in row["steps"]) if any(
            t is not None for t in row["target"]) else "—")
        cells.append(" / ".join(_ratio_text(v) for v in row["ratio"]) if any(
            t is not None for t in row["target"]) else "—")
        cells.append(ratio_interval_text(row["ratio"]))
        out.append("| " + " | ".join(cells) + " |")
    return out


def draw(data: dict[str, Any], path: Path) -> Path | None:
    """Two panels, perplexity at L and at the fine-tuning length against the fine-tuning steps (symlog), a line
    per encoding (the seeds' mean, each seed hollow), PI's target dashed; a log perplexity axis."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import ScalarFormatter
    except ImportError:
        return None
    if not data:
        return None
    first = next(iter(data.values()))
    fig = Figure(figsize=(10, 4.2), dpi=100, layout="constrained")
    axes = fig.subplots(1, 2)
    for ax, key, length in ((axes[0], "at_L", first["L"]), (axes[1], "at_ft", first["ft_length"])):
        for i, (label, row) in enumerate(data.items()):
            color = f"C{i}"
            steps = sorted({k for d in row[key] for k in d})
            means = [statistics.fmean([d[k] for d in row[key] if k in d]) for k in steps]
            ax.plot(steps, means, marker="o", color=color, label=label)
            for d in row[key]:
                ax.plot(sorted(d), [d[k] for k in sorted(d)], ls="none", marker="o", mfc="none", color=color,
                        alpha=0.5, ms=4)
        targets = [t for row in data.values() for t in row["target"] if t is not None]
        if key == "at_ft" and targets:
            ax.axhline(statistics.fmean(targets), ls="--", color="0.4", lw=1,
                       label=f"target: PI after its budget ({statistics.fmean(targets):.2f})")
        ax.set_xscale("symlog", linthresh=10)
        ax.set_xlim(-2, max(k for row in data.values() for d in row[key] for k in d) * 1.15)
        ax.set_yscale("log")  # PI starts ~3x higher than the rest: a log axis keeps the others apart
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter(ScalarFormatter())
        ax.tick_params(axis="y", which="minor", labelsize=7)
        ax.set_xlabel("fine-tuning steps")
        ax.set_ylabel(f"perplexity at {length}")
        ax.set_title(f"at {'L' if key == 'at_L' else 's·L'} = {length}")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.suptitle("Steps to target: each scaling fine-tuned at s·L, evaluated along the way")
    fig.savefig(path, dpi=100)
    return Path(path)


def sections(records: Sequence[dict[str, Any]]) -> list[ReportSection]:
    """The page's steps-to-target section for these runs (none without curves)."""
    data = table(records)
    if not data:
        return []
    return [ReportSection(
        slug="steps-to-target",
        title="Steps to target",
        lines=tuple(lines(data)),
        draw=lambda path: draw(data, path),
        caption="perplexity against fine-tuning steps, at L and at s·L",
    )]
