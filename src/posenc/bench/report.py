"""Leaderboard, plots and report of a suite's results.

Runs are grouped by task and *label* (the suite's display name of an encoding
with its options, e.g. ``shaw k=4``; by default the encoding name plus its
options), and summarised as mean ± std over seeds. Where a suite carries the
paper's numbers (``published``), the report shows them beside ours.
"""

from __future__ import annotations

import base64
import html
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from .runner import label_of

PCT_METRICS = ("accuracy", "f1", "sequence_accuracy", "entity_f1", "exact_match")


def _mean_std(xs: list[float]) -> tuple[float, float]:
    if not xs:
        return float("nan"), float("nan")
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def leaderboard(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (task, label): the metric per test length as mean ± std over seeds.

    Rows are ranked within a task by the mean metric on lengths longer than
    training (out of distribution; a length an encoding could not reach counts as
    the worst value), then in distribution.
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
        per_len: dict[str, tuple[float, float] | None] = {}
        for n in labels:
            vals = [r["metrics"].get(n) for r in runs]
            per_len[n] = None if any(v is None for v in vals) else _mean_std([float(v) for v in vals])
        worst = 0.0 if higher else float("inf")
        ind = [per_len[str(n)][0] for n in lengths if n <= train_max and per_len[str(n)] is not None]
        ood = [per_len[str(n)][0] if per_len[str(n)] is not None else worst for n in lengths if n > train_max]
        if not ind and not ood:  # metrics under other labels (e.g. "test")
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
    return metric in PCT_METRICS


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


def _summary_name(rows: list[dict[str, Any]]) -> str:
    tm = rows[0]["train_max"]
    has_ood = any(k.isdigit() and int(k) > tm for r in rows for k in r["values"])
    return "mean > train" if has_ood else "mean"


def markdown_table(rows: list[dict[str, Any]]) -> str:
    out = []
    for task in sorted({r["task"] for r in rows}):
        sub = [r for r in rows if r["task"] == task]
        labels = list(sub[0]["values"])
        tm = sub[0]["train_max"]
        metric = sub[0]["metric"]
        unit = f"{metric} %" if _pct(metric) else metric
        summary = _summary_name(sub)
        head = ["#", "encoding", *[_label(n, tm) for n in labels], summary, "s/run"]
        better = "higher" if sub[0]["higher_is_better"] else "lower"
        out.append(f"**{task}** — {unit} ({better} is better; mean ± std over seeds), trained on lengths ≤ {tm}\n")
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "---|" * len(head))
        for i, r in enumerate(sub, 1):
            cells = [str(i), r["label"], *[_cell(r["values"].get(n), metric) for n in labels]]
            value = r["extrapolation"] if summary == "mean > train" else r["in_distribution"]
            cells += [_fmt(value, metric), f"{r['seconds']:.1f}"]
            out.append("| " + " | ".join(cells) + " |")
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
    if rows:
        task = published.get("task")
        sub = [r for r in rows if task is None or r["task"] == task]
        ours = {r["label"]: (i, r) for i, r in enumerate(sub, 1)}
    if prow:
        head = ["encoding", *(cols or ["value"]), "our rank", "ours (mean > train)"]
        out += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for lab, vals in prow.items():
            vals = vals if isinstance(vals, list) else [vals]
            rank, ourv = "—", "—"
            if lab in ours:
                i, r = ours[lab]
                rank = str(i)
                v = r["extrapolation"] if r["extrapolation"] == r["extrapolation"] else r["in_distribution"]
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
    parts = ["<h2>Beside the published numbers</h2>"]
    lines = md.splitlines()
    parts.append(f"<p>{html.escape(lines[0].replace('**', ''))}</p>")
    table = [ln for ln in lines if ln.startswith("|") and not ln.startswith("|---")]
    if table:
        parts.append("<table border=1 cellpadding=4>")
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


# ---------------------------------------------------------------------------- plots
def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # plots are an extra: pip install 'posenc[plots]'
        return None
    return plt


def plot(results: list[dict[str, Any]], path: Path) -> Path | None:
    """The metric against test length, one panel per task, one line per encoding (PNG)."""
    plt = _pyplot()
    if plt is None:
        return None
    rows = leaderboard(results)
    tasks = sorted({r["task"] for r in rows})
    if not tasks:
        return None
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks), 4.2), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        metric = "accuracy"
        for r in [r for r in rows if r["task"] == task]:
            metric = r["metric"]
            k = 100 if _pct(metric) else 1
            xs = [n for n, v in r["values"].items() if v is not None and n.isdigit()]
            ys = [k * r["values"][n][0] for n in xs]
            err = [k * r["values"][n][1] for n in xs]
            if xs:
                ax.errorbar([int(x) for x in xs], ys, yerr=err, marker="o", capsize=2, label=r["label"])
            else:  # a single split ("test"): one bar-like point
                vals = [(n, v) for n, v in r["values"].items() if v is not None]
                ax.plot([n for n, _ in vals], [k * v[0] for _, v in vals], "o", label=r["label"])
        tm = next(r["train_max"] for r in rows if r["task"] == task)
        if any(n.isdigit() for r in rows if r["task"] == task for n in r["values"]):
            ax.axvline(tm, color="grey", ls=":", lw=1)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("test length")
        ax.set_title(f"{task} (trained on lengths ≤ {tm})")
        if _pct(metric):
            ax.set_ylabel(f"{metric} %")
            ax.set_ylim(-2, 102)
        else:
            ax.set_ylabel(metric)
            if metric in ("perplexity", "ppl"):
                ax.set_yscale("log")
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_curves(results: list[dict[str, Any]], path: Path) -> Path | None:
    """Training loss against step, one panel per task, one line per encoding (seed 0 or the first seed)."""
    plt = _pyplot()
    if plt is None:
        return None
    tasks = sorted({r["config"]["task"] for r in results if r.get("curve")})
    if not tasks:
        return None
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks), 4.0), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        by_label: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for r in results:
            if r["config"]["task"] == task and r.get("curve"):
                by_label[label_of(r)].append(r)
        for lab, runs in sorted(by_label.items()):
            # mean over seeds at the steps every seed logged
            steps = sorted(set.intersection(*[{int(s) for s, _ in r["curve"]} for r in runs]))
            ys = [statistics.fmean(dict((int(s), v) for s, v in r["curve"])[s] for r in runs) for s in steps]
            ax.plot(steps, ys, marker="o" if len(steps) <= 3 else None, label=lab)
        ax.set_title(f"{task}: training loss (mean over seeds)")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (smoothed)")
        ax.set_yscale("log")
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------- files
def _jsonable(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    def num(x: Any) -> Any:
        return None if isinstance(x, float) and (x != x or x in (float("inf"), float("-inf"))) else x

    out = []
    for r in rows:
        d = {k: num(v) for k, v in r.items() if k != "values"}
        d["values"] = {k: None if v is None else {"mean": num(v[0]), "std": num(v[1])} for k, v in r["values"].items()}
        out.append(d)
    return out


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

    ``published`` (a suite's ``published`` section) adds the paper's table beside ours;
    ``failures`` (runs that raised) are listed at the end.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = leaderboard(results)
    table = markdown_table(rows)
    pub = published_table(published or {}, rows)
    fail_md = ""
    if failures:
        fail_md = "\n**Failed runs** (not in the table; run the suite again to retry them)\n\n" + "\n".join(
            f"- {f['config']['task']}/{f.get('label') or f['config']['encoding']}/seed{f['config']['seed']}: "
            f"{f['error'].strip().splitlines()[0] if f['error'].strip() else ''}"
            for f in failures
        )
    files = {
        "results": out_dir / "results.json",
        "leaderboard": out_dir / "leaderboard.md",
        "leaderboard_json": out_dir / "leaderboard.json",
    }
    files["results"].write_text(json.dumps({"leaderboard": _jsonable(rows), "runs": results}, indent=1))
    files["leaderboard_json"].write_text(json.dumps({"title": title, "rows": _jsonable(rows)}, indent=1))
    md = f"# {title}\n\n" + (f"{description}\n\n" if description else "") + table
    md += ("\n" + pub if pub else "") + (fail_md + "\n" if fail_md else "")
    files["leaderboard"].write_text(md + "\n")
    png = plot(results, out_dir / "accuracy_vs_length.png")
    if png is not None:
        files["plot"] = png
    curves = plot_curves(results, out_dir / "training_curves.png")
    if curves is not None:
        files["curves"] = curves

    body = [f"<h1>{html.escape(title)}</h1>"]
    if description:
        body.append(f"<p>{html.escape(description)}</p>")
    for task in sorted({r["task"] for r in rows}):
        sub = [r for r in rows if r["task"] == task]
        labels = list(sub[0]["values"])
        metric = sub[0]["metric"]
        tm = sub[0]["train_max"]
        summary = _summary_name(sub)
        better = "higher" if sub[0]["higher_is_better"] else "lower"
        body.append(f"<h2>{html.escape(task)} — {html.escape(metric)} ({better} is better)</h2>")
        body.append("<table border=1 cellpadding=4><tr><th>#</th><th>encoding</th>")
        body += [f"<th>{html.escape(_label(n, tm))}</th>" for n in labels] + [f"<th>{summary}</th><th>seeds</th></tr>"]
        for i, r in enumerate(sub, 1):
            body.append(f"<tr><td>{i}</td><td>{html.escape(r['label'])}</td>")
            body += [f"<td>{_cell(r['values'].get(n), metric)}</td>" for n in labels]
            value = r["extrapolation"] if summary == "mean > train" else r["in_distribution"]
            body.append(f"<td>{_fmt(value, metric)}</td><td>{r['seeds']}</td></tr>")
        body.append("</table>")
        errs = sorted({e for r in sub for e in r["errors"]})
        if errs:
            body.append("<p>Lengths an encoding could not reach: " + html.escape("; ".join(errs[:5])) + "</p>")
    body.append(_published_html(published or {}, rows))
    for key, alt in (("plot", "metric against test length"), ("curves", "training curves")):
        if key in files:
            data = base64.b64encode(files[key].read_bytes()).decode()
            body.append(f'<h2>{alt.capitalize()}</h2><p><img src="data:image/png;base64,{data}" alt="{alt}"></p>')
    if failures:
        body.append("<h2>Failed runs</h2><ul>")
        body += [
            f"<li>{html.escape(f['config']['task'])}/{html.escape(f.get('label') or f['config']['encoding'])}"
            f"/seed{f['config']['seed']}: <pre>{html.escape(f['error'])}</pre></li>"
            for f in failures
        ]
        body.append("</ul>")
    files["report"] = out_dir / "report.html"
    files["report"].write_text(
        f"<!doctype html><meta charset=utf-8><title>{html.escape(title)}</title>\n"
        "<style>body{font-family:sans-serif;max-width:1200px;margin:auto} td,th{text-align:right}</style>\n"
        + "\n".join(body)
    )
    return files
