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
        per_len: dict[int, tuple[float, float] | None] = {}
        for n in lengths:
            vals = [r["accuracy"].get(str(n)) for r in runs]
            per_len[n] = None if any(v is None for v in vals) else _mean_std([float(v) for v in vals])
        ind = [per_len[n][0] for n in lengths if n <= train_max and per_len[n] is not None]
        ood = [per_len[n][0] if per_len[n] is not None else 0.0 for n in lengths if n > train_max]
        rows.append(
            {
                "task": task,
                "encoding": enc,
                "seeds": len(runs),
                "accuracy": per_len,
                "in_distribution": statistics.fmean(ind) if ind else float("nan"),
                "extrapolation": statistics.fmean(ood) if ood else float("nan"),
                "train_max": train_max,
                "seconds": statistics.fmean(r["train_seconds"] for r in runs),
                "errors": sorted({v for r in runs for k, v in r["accuracy"].items() if k.endswith("_error")}),
            }
        )
    rows.sort(key=lambda r: (r["task"], -_nan0(r["extrapolation"]), -_nan0(r["in_distribution"])))
    return rows


def _nan0(x: float) -> float:
    return 0.0 if x != x else x


def _cell(v: tuple[float, float] | None) -> str:
    if v is None:
        return "n/a"
    m, s = v
    return f"{100 * m:.1f} ± {100 * s:.1f}"


def markdown_table(rows: list[dict[str, Any]]) -> str:
    out = []
    for task in sorted({r["task"] for r in rows}):
        sub = [r for r in rows if r["task"] == task]
        lengths = list(sub[0]["accuracy"])
        tm = sub[0]["train_max"]
        head = ["#", "encoding", *[f"L={n}{' (train)' if n <= tm else ''}" for n in lengths], "mean > train", "s/run"]
        out.append(f"**{task}** — accuracy % (mean ± std over seeds), trained on lengths ≤ {tm}\n")
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "---|" * len(head))
        for i, r in enumerate(sub, 1):
            cells = [str(i), r["encoding"], *[_cell(r["accuracy"][n]) for n in lengths]]
            cells += [f"{100 * r['extrapolation']:.1f}", f"{r['seconds']:.1f}"]
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
        for r in [r for r in rows if r["task"] == task]:
            xs = [n for n, v in r["accuracy"].items() if v is not None]
            ys = [100 * r["accuracy"][n][0] for n in xs]
            err = [100 * r["accuracy"][n][1] for n in xs]
            ax.errorbar(xs, ys, yerr=err, marker="o", capsize=2, label=r["encoding"])
        tm = next(r["train_max"] for r in rows if r["task"] == task)
        ax.axvline(tm, color="grey", ls=":", lw=1)
        ax.axhline(50, color="grey", ls="--", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{task} (trained on lengths ≤ {tm})")
        ax.set_xlabel("test length")
        ax.set_ylabel("accuracy %")
        ax.set_ylim(40, 101)
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
    serial = [{**r, "accuracy": {str(k): v for k, v in r["accuracy"].items()}} for r in rows]
    files["results"].write_text(json.dumps({"leaderboard": serial, "runs": results}, indent=1))
    files["leaderboard"].write_text(f"# {title}\n\n{table}\n")
    png = plot(results, out_dir / "accuracy_vs_length.png")
    if png is not None:
        files["plot"] = png
    body = [f"<h1>{html.escape(title)}</h1>"]
    for task in sorted({r["task"] for r in rows}):
        sub = [r for r in rows if r["task"] == task]
        lengths = list(sub[0]["accuracy"])
        body.append(f"<h2>{html.escape(task)}</h2><table border=1 cellpadding=4><tr><th>#</th><th>encoding</th>")
        body += [f"<th>L={n}</th>" for n in lengths] + ["<th>mean beyond training</th></tr>"]
        for i, r in enumerate(sub, 1):
            body.append(f"<tr><td>{i}</td><td>{html.escape(r['encoding'])}</td>")
            body += [f"<td>{_cell(r['accuracy'][n])}</td>" for n in lengths]
            body.append(f"<td>{100 * r['extrapolation']:.1f}</td></tr>")
        body.append("</table>")
    if png is not None:
        body.append(f'<p><img src="{png.name}" alt="accuracy against test length"></p>')
    files["report"] = out_dir / "report.html"
    files["report"].write_text("<!doctype html><meta charset=utf-8><title>posenc bench</title>" + "\n".join(body))
    return files
