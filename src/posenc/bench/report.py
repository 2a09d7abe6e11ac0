"""Leaderboard, plots and report of a suite's results."""

from __future__ import annotations

import html
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any


def _mean_std(xs: list[float]) -> tuple[float, float]:
    if not xs:
        return float("nan"), float("nan")
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def leaderboard(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (task, encoding): accuracy per test length as mean ± std over seeds.

    Rows are ranked within a task by the mean accuracy on lengths longer than
    training (out of distribution), then in distribution.
    """
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in results:
        groups[(r["config"]["task"], r["config"]["encoding"])].append(r)
    rows = []
    for (task, enc), runs in groups.items():
        cfg = runs[0]["config"]
        train_max = cfg["train_lengths"][1]
        lengths = cfg["test_lengths"]
        metric = runs[0].get("metric", "accuracy")
        higher = runs[0].get("higher_is_better", True)
        labels = [str(n) for n in lengths] + sorted(
            {k for r in runs for k in r["metrics"] if not k.endswith("_error") and k not in map(str, lengths)}
        )
        per_len: dict[str, tuple[float, float] | None] = {}
        for n in labels:
            vals = [r["metrics"].get(n) for r in runs]
            per_len[n] = None if any(v is None for v in vals) else _mean_std([float(v) for v in vals])
        worst = 0.0 if higher else float("inf")
        ind = [per_len[str(n)][0] for n in lengths if n <= train_max and per_len[str(n)] is not None]
        ood = [per_len[str(n)][0] if per_len[str(n)] is not None else worst for n in lengths if n > train_max]
        rows.append(
            {
                "task": task,
                "encoding": enc,
                "metric": metric,
                "higher_is_better": higher,
                "seeds": len(runs),
                "values": per_len,
                "in_distribution": statistics.fmean(ind) if ind else float("nan"),
                "extrapolation": statistics.fmean(ood) if ood else float("nan"),
                "train_max": train_max,
                "seconds": statistics.fmean(r["train_seconds"] for r in runs),
                "errors": sorted({v for r in runs for k, v in r["metrics"].items() if k.endswith("_error")}),
            }
        )
    rows.sort(key=lambda r: (r["task"], _rank(r["extrapolation"], r), _rank(r["in_distribution"], r)))
    return rows


def _rank(x: float, row: dict[str, Any]) -> float:
    """Sort key: better first, NaN last."""
    if x != x:
        return float("inf")
    return -x if row["higher_is_better"] else x


def _pct(metric: str) -> bool:
    return metric in ("accuracy", "f1", "sequence_accuracy")


def _fmt(x: float, metric: str) -> str:
    if x != x:
        return "n/a"
    if x == float("inf"):
        return "inf"
    return f"{100 * x:.1f}" if _pct(metric) else f"{x:.2f}"


def _cell(v: tuple[float, float] | None, metric: str = "accuracy") -> str:
    if v is None:
        return "n/a"
    m, s = v
    return f"{_fmt(m, metric)} ± {_fmt(s, metric)}"


def _label(n: str, train_max: int) -> str:
    if not n.isdigit():
        return n
    return f"L={n}{' (train)' if int(n) <= train_max else ''}"


def markdown_table(rows: list[dict[str, Any]]) -> str:
    out = []
    for task in sorted({r["task"] for r in rows}):
        sub = [r for r in rows if r["task"] == task]
        labels = list(sub[0]["values"])
        tm = sub[0]["train_max"]
        metric = sub[0]["metric"]
        unit = f"{metric} %" if _pct(metric) else metric
        head = ["#", "encoding", *[_label(n, tm) for n in labels], "mean > train", "s/run"]
        out.append(f"**{task}** — {unit} (mean ± std over seeds), trained on lengths ≤ {tm}\n")
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "---|" * len(head))
        for i, r in enumerate(sub, 1):
            cells = [str(i), r["encoding"], *[_cell(r["values"][n], metric) for n in labels]]
            cells += [_fmt(r["extrapolation"], metric), f"{r['seconds']:.1f}"]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def plot(results: list[dict[str, Any]], path: Path) -> Path | None:
    """Accuracy against test length, one panel per task, one line per encoding (PNG)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # plots are an extra: pip install 'posenc[plots]'
        return None
    rows = leaderboard(results)
    tasks = sorted({r["task"] for r in rows})
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks), 4.2), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        metric = "accuracy"
        for r in [r for r in rows if r["task"] == task]:
            metric = r["metric"]
            k = 100 if _pct(metric) else 1
            xs = [n for n, v in r["values"].items() if v is not None and n.isdigit()]
            ys = [k * r["values"][n][0] for n in xs]
            err = [k * r["values"][n][1] for n in xs]
            ax.errorbar([int(x) for x in xs], ys, yerr=err, marker="o", capsize=2, label=r["encoding"])
        tm = next(r["train_max"] for r in rows if r["task"] == task)
        ax.axvline(tm, color="grey", ls=":", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{task} (trained on lengths ≤ {tm})")
        ax.set_xlabel("test length")
        if _pct(metric):
            ax.set_ylabel(f"{metric} %")
            ax.set_ylim(-2, 102)
        else:
            ax.set_ylabel(metric)
            ax.set_yscale("log")
    axes[0][-1].legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(results: list[dict[str, Any]], out_dir: Path, title: str = "posenc bench") -> dict[str, Path]:
    """Write ``results.json``, ``leaderboard.md``, ``accuracy_vs_length.png`` and ``report.html``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = leaderboard(results)
    table = markdown_table(rows)
    files = {"results": out_dir / "results.json", "leaderboard": out_dir / "leaderboard.md"}
    serial = [{**r, "values": dict(r["values"])} for r in rows]
    files["results"].write_text(json.dumps({"leaderboard": serial, "runs": results}, indent=1))
    files["leaderboard"].write_text(f"# {title}\n\n{table}\n")
    png = plot(results, out_dir / "accuracy_vs_length.png")
    if png is not None:
        files["plot"] = png
    body = [f"<h1>{html.escape(title)}</h1>"]
    for task in sorted({r["task"] for r in rows}):
        sub = [r for r in rows if r["task"] == task]
        labels = list(sub[0]["values"])
        metric = sub[0]["metric"]
        tm = sub[0]["train_max"]
        body.append(f"<h2>{html.escape(task)} ({html.escape(metric)})</h2>")
        body.append("<table border=1 cellpadding=4><tr><th>#</th><th>encoding</th>")
        body += [f"<th>{html.escape(_label(n, tm))}</th>" for n in labels] + ["<th>mean beyond training</th></tr>"]
        for i, r in enumerate(sub, 1):
            body.append(f"<tr><td>{i}</td><td>{html.escape(r['encoding'])}</td>")
            body += [f"<td>{_cell(r['values'][n], metric)}</td>" for n in labels]
            body.append(f"<td>{_fmt(r['extrapolation'], metric)}</td></tr>")
        body.append("</table>")
    if png is not None:
        body.append(f'<p><img src="{png.name}" alt="accuracy against test length"></p>')
    files["report"] = out_dir / "report.html"
    files["report"].write_text("<!doctype html><meta charset=utf-8><title>posenc bench</title>" + "\n".join(body))
    return files
