"""What ``posenc extend`` shows: loss against position, perplexity at fixed lengths, passkey heatmaps, and a
verdict per published shape, computed from the stored cells (never written by hand, so never stale).

The published shapes (7B-scale models; a 135M model need not follow them, which is what the verdicts say):

* plain RoPE past the trained length ``L``: the loss rises steeply within about 1.2-1.5 L (Chen et al. 2023,
  Press et al. 2022);
* position interpolation without fine-tuning keeps the model usable: near its own perplexity inside ``L`` and
  past it (Chen et al. 2023). Judged against the model's own perplexity inside ``L``, never against plain RoPE's
  blow-up past ``L``, next to which anything is "smoother" (:func:`.shapes.pi_rule`);
* NTK-aware and dynamic NTK beat PI without fine-tuning (bloc97 2023; Peng et al. 2023);
* YaRN is the best scaling without fine-tuning (Peng et al. 2023);
* passkey: plain RoPE fails past ``L``; the scalings retrieve past it (Chen et al. 2023; Peng et al. 2023;
  Mohtashami and Jaggi 2023; measured there after fine-tuning, here without: posenc's question). No verdict below
  :data:`.shapes.PASSKEY_MIN_KEYS` keys a cell; above it, decided on Wilson intervals
  (:func:`.shapes.passkey_verdict`).

Each verdict is ``reproduced``, ``partly``, ``not reproduced``, ``inconclusive`` (too few keys) or ``not measured``
(its cells are not in the store yet), with the numbers it was decided on, the paper's claim as it states it
(:data:`.shapes.CLAIMS`), its source, and whether posenc tests it as published or a question of its own. The
numbers and the rules are in :mod:`.shapes`; this module draws and writes them.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .config import AS_TRAINED, SCALINGS, base_scaling, is_variant, order_key, scaling_label
from .shapes import (  # noqa: F401 -- the numbers and verdicts, re-exported: report.verdicts(...) reads on
    AS_PUBLISHED,
    CLAIMS,
    PASSKEY_MIN_KEYS,
    PI_TOLERANCE,
    POSENC_QUESTION,
    Verdict,
    _fmt,
    _keys,
    _mult,
    comparison_set,
    keys_per_cell,
    loss_groups,
    mean_loss,
    passkey_accuracy,
    passkey_grid,
    passkey_verdict,
    perplexity,
    pi_rule,
    table_lengths,
)
from .shapes import verdicts as _shape_verdicts

ORDER = (AS_TRAINED, *SCALINGS)
COLOURS = {
    AS_TRAINED: "#000000",
    "rope-linear": "#d62728",
    "rope-ntk": "#2ca02c",
    "rope-dynamic": "#17becf",
    "rope-yarn": "#1f77b4",
    "rope-llama3": "#ff7f0e",
    "rope-longrope": "#9467bd",
}
NOTE_QUANT = (
    "The model is SmolLM2-135M-Instruct with 4-bit (Q4_1) GGUF weights, de-quantised to float32: "
    "a quantised checkpoint, not the bf16 original."
)


def label(scaling: str, factor: float | None = None) -> str:
    base = scaling_label(scaling)
    return base if scaling == AS_TRAINED or not factor else f"{base}, s={factor:g}"


def _order(names: Sequence[str]) -> list[str]:
    return sorted(set(names), key=order_key)


def training_free(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The cells of the scalings patched in without fine-tuning or a search (what the published shapes and their
    verdicts are about): not the searched LongRoPE's, not a fine-tuned model's."""
    return [r for r in records if not is_variant(str(r.get("scaling"))) and "variant" not in r]


def verdicts(records: Sequence[dict[str, Any]]) -> list[Verdict]:
    """The verdicts beside the published shapes (:func:`posenc.extend.shapes.verdicts`), on the training-free
    cells alone (:func:`training_free`): a fine-tuned row is no scaling "without fine-tuning"."""
    return _shape_verdicts(training_free(records))


def variants_note(records: Sequence[dict[str, Any]]) -> list[str]:
    """A line per searched or fine-tuned row of the store: what it is (the search's budget and best perplexity, the
    fine-tune's steps and settings)."""
    seen: dict[str, dict[str, Any]] = {}
    for r in records:
        if "variant" in r and r.get("scaling") not in seen:
            seen[r["scaling"]] = r
    lines = []
    for name in _order(list(seen)):
        r = seen[name]
        about = r["variant"].get("about", {})
        if "search" in about:
            s = about["search"]
            lines.append(
                f"- **{label(name, r.get('factor'))}:** the per-pair factors of LongRoPE's evolutionary search "
                f"(`posenc extend --longrope-search {s.get('evaluations')}`: population {s.get('population')}, "
                f"{s.get('iterations')} iterations, fitness the perplexity of {s.get('document')}'s first "
                f"{s.get('length')} tokens; best {_fmt(about.get('best_perplexity'))} against YaRN's factors' "
                f"{_fmt(about.get('yarn_perplexity'))}), patched as `rope-longrope`."
            )
        if "finetune" in about:
            f = about["finetune"]
            lines.append(
                f"- **{label(name, r.get('factor'))}:** the model fine-tuned by `posenc extend --finetune "
                f"{f.get('steps')}` ({f.get('mode')}, {f.get('scaling')} x{f.get('factor'):g}, sequences of "
                f"{f.get('length')} tokens, {f.get('tokens_per_step')} tokens a step, lr {f.get('lr'):g}, on "
                f"{f.get('text')} with {f.get('eval_text')} held out), then measured on the same cells as the rows "
                "without fine-tuning."
            )
    return lines


# ---------------------------------------------------------------------------------------------- plots
def _smooth(values: list[float], window: int) -> list[float]:
    out = []
    for i in range(len(values)):
        part = values[max(0, i - window + 1) : i + 1]
        out.append(sum(part) / len(part))
    return out


def plot_losses(records: Sequence[dict[str, Any]], path: Path, window_tokens: int = 512) -> Path | None:
    """Loss against position, one panel per document and factor (:func:`loss_groups`), one line per scaling, the
    trained length marked."""
    groups = loss_groups(records)
    panels = [(doc, f, curves) for doc, by in groups.items() for f, curves in by.items() if curves]
    if not panels:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(7.5 * len(panels), 4.8), squeeze=False)
    for ax, (doc, factor, curves) in zip(axes[0], panels):
        trained = next(iter(curves.values()))["trained_length"]
        scaled = [r["tokens"] for s, r in curves.items() if s != AS_TRAINED]
        right = max(scaled) if scaled else max(r["tokens"] for r in curves.values())
        for s in _order(list(curves)):
            r = curves[s]
            b = r["bin"]
            ys = _smooth(r["loss_bins"], max(1, window_tokens // b))
            xs = [(i + 1) * b for i in range(len(ys))]
            keep = [i for i, x in enumerate(xs) if x <= right]
            ax.plot(
                [xs[i] for i in keep],
                [ys[i] for i in keep],
                color=COLOURS.get(base_scaling(s) or s),
                lw=1.6 if s in (AS_TRAINED, "rope-yarn") or is_variant(s) else 1.1,
                ls=":" if "+ft" in s else "--" if is_variant(s) else "-",
                label=label(s, r.get("factor")),
            )
        ax.set_xlim(0, right)
        ax.axvline(trained, color="grey", ls="--", lw=1)
        ax.text(
            trained,
            0.98,
            f" trained context L = {trained}",
            transform=ax.get_xaxis_transform(),
            va="top",
            fontsize=8,
            color="grey",
        )
        ax.set_xlabel("position (tokens)")
        ax.set_ylabel(f"next-token loss (nats; mean over the last {window_tokens} tokens)")
        what = f"scalings at s = {factor:g}" if factor and factor > 1 else "as trained"
        ax.set_title(f"{doc}, {what}: the loss of each position in one forward", fontsize=10)
        top = max(max(r["loss_bins"][: max(1, trained // r["bin"])]) for r in curves.values())
        ax.set_ylim(bottom=0, top=max(top * 2.2, 1.0))  # a blown-up curve leaves the axis rather than squash the rest
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(0.0, 0.93))
    model = next(iter(records))["model"].get("name", "")
    quant = str(next(iter(records))["model"].get("quantization", "")).split(" (")[0]
    tuned = any("+ft" in str(r.get("scaling")) for r in records)
    how = "without and with fine-tuning" if tuned else "no fine-tuning"
    fig.suptitle(f"{model}{f' ({quant} weights)' if quant else ''}: each RoPE scaling, {how}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_passkey(records: Sequence[dict[str, Any]], path: Path) -> Path | None:
    """Passkey retrieval as a heatmap per scaling: length on x, depth on y, retrieved (share of the key's
    tokens right) as colour, the trained length marked."""
    grid = passkey_grid(records)
    if not grid:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = _order(list(grid))
    lengths = sorted({n for c in grid.values() for n, _ in c})
    depths = sorted({d for c in grid.values() for _, d in c})
    trained = next(r["trained_length"] for r in records if r.get("kind") == "passkey")
    cols = 2 if len(names) == 4 else min(len(names), 3)
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(3.6 * cols + 1.4, 2.7 * rows + 0.9), squeeze=False, layout="constrained"
    )
    image = None
    for k, ax in enumerate(axes.flat):
        if k >= len(names):
            ax.axis("off")
            continue
        s = names[k]
        cells = grid[s]
        values = [[float("nan")] * len(lengths) for _ in depths]
        for (n, d), r in cells.items():
            values[depths.index(d)][lengths.index(n)] = r["tokens_right"]
        image = ax.imshow(values, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto", origin="upper")
        for (n, d), r in cells.items():
            ax.text(
                lengths.index(n),
                depths.index(d),
                "✓" if r["correct"] else "✗",
                ha="center",
                va="center",
                fontsize=10,
                color="black",
            )
        ax.set_xticks(range(len(lengths)), [f"{n / 1024:g}k" for n in lengths], fontsize=8)
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths], fontsize=8)
        beyond = [i for i, n in enumerate(lengths) if n > trained]
        if beyond:
            ax.axvline(beyond[0] - 0.5, color="black", lw=1.5, ls="--")
        factor = next(iter(cells.values())).get("factor")
        ax.set_title(label(s, factor), fontsize=9)
        if k + cols >= len(names):  # the lowest panel of its column
            ax.set_xlabel("context length (tokens)", fontsize=8)
        if k % cols == 0:
            ax.set_ylabel("depth of the key", fontsize=8)
    if image is not None:
        bar = fig.colorbar(image, ax=axes, shrink=0.8)
        bar.set_label("share of the key's tokens right (✓ all right)", fontsize=8)
    how = "the rows marked fine-tuned after it, the others without" if any("+ft" in s for s in names) else \
        "no fine-tuning"
    fig.suptitle(
        f"passkey retrieval, {how}: one example per cell; dashed: the trained context L = {trained}",
        fontsize=10,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------- text
def ppl_table(records: Sequence[dict[str, Any]]) -> list[str]:
    """Markdown: per document, the perplexity of the first n tokens (one forward: the causal prefix) and of the
    positions in each doubling past L alone (L..2L, 2L..4L, ...), a row per scaling and factor."""
    lines: list[str] = []
    for doc, groups in loss_groups(records).items():
        first = min(groups)  # the model as trained is in every group: one row
        rows = [(s, r) for f, curves in groups.items() for s, r in curves.items() if s != AS_TRAINED or f == first]
        rows.sort(key=lambda sr: (order_key(sr[0]), sr[1].get("factor") or 1.0))
        if not rows:
            continue
        trained = rows[0][1]["trained_length"]
        longest = max(r["tokens"] - 1 for _, r in rows)
        lengths = table_lengths(trained, longest + 1)
        spans = []  # L..2L, 2L..4L, ...: each doubling past L that some curve reaches
        a = trained
        while a < longest:
            spans.append((a, min(2 * a, longest)))
            a *= 2
        head = " | ".join(f"{n / 1024:g}k" for n in lengths)
        span_head = "".join(f" {'L' if a == trained else _mult(a, trained)}..{_mult(b, trained)} |" for a, b in spans)
        lines += [
            f"**{doc}** ({rows[0][1].get('about', '')}): perplexity of the first n tokens, "
            f"and of the positions in each doubling past L = {trained} alone",
            "",
            f"| scaling | {head} |{span_head}",
            "|---|" + "---:|" * (len(lengths) + len(spans)),
        ]
        for s, r in rows:
            n_r = r["tokens"] - 1
            cells = [_fmt(perplexity(r, 0, min(n, n_r))) if n <= r["tokens"] else "—" for n in lengths]
            cells += [_fmt(perplexity(r, a, min(b, n_r))) if b <= n_r + 1 else "—" for a, b in spans]
            lines.append(f"| {label(s, r.get('factor'))} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def passkey_table(records: Sequence[dict[str, Any]]) -> list[str]:
    grid = passkey_grid(records)
    if not grid:
        return []
    lengths = sorted({n for c in grid.values() for n, _ in c})
    lines = [
        "Passkey: keys retrieved (all digits right) over the depths, per context length",
        "",
        "| scaling | " + " | ".join(f"{n / 1024:g}k" for n in lengths) + " |",
        "|---|" + "---:|" * len(lengths),
    ]
    for s in _order(list(grid)):
        cells = grid[s]
        row = []
        for n in lengths:
            got = [r for (m, _), r in cells.items() if m == n]
            row.append(f"{sum(r['correct'] for r in got)}/{len(got)}" if got else "—")
        factor = next(iter(cells.values())).get("factor")
        lines.append(f"| {label(s, factor)} | " + " | ".join(row) + " |")
    return [*lines, ""]


def summary(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """What the store holds: the model, the cells, the time they took, the machines."""
    from ..runenv import machines_and_commits

    # the pretrained model's identity (a fine-tuned row's model is made from it)
    model = next((r["model"] for r in records if "finetuned" not in r["model"]), records[0]["model"]) if records else {}
    seconds = sum(float(r.get("seconds", 0)) for r in records)
    envs, commits = machines_and_commits([r.get("env") for r in records])
    loads = [x for r in records for x in (r.get("load_average") or []) if x is not None]
    return {
        "model": model,
        "cells": len(records),
        "seconds": seconds,
        "machines": envs,
        "commits": commits,
        "load": (min(loads), max(loads)) if loads else None,
    }


def markdown(records: Sequence[dict[str, Any]], *, img_rel: str = ".", heading: str = "#", command: str = "") -> str:
    """The report (or the results page's section) as Markdown; the plots are ``extend-loss.png`` and
    ``extend-passkey.png`` under ``img_rel``."""
    from .runner import _fmt as duration

    s = summary(records)
    model = s["model"]
    ruler_only = bool(records) and not any(r.get("kind") in ("loss", "passkey") for r in records)
    title = "RULER by length" if ruler_only else "Stretching a real model's context"
    lines = [f"{heading} {title}: {model.get('name', '?')}", ""]
    if not records:
        return "\n".join([*lines, "No cells measured yet.", ""])
    trained = records[0]["trained_length"]
    lines += [
        f"{model.get('description', model.get('name', ''))}; trained context L = {trained}. "
        f"{NOTE_QUANT if 'Q4_1' in str(model.get('quantization', '')) else ''}",
        "",
        f"- **Model file:** {model.get('file', '?')} ({model.get('package', model.get('source', ''))}), "
        f"sha256 `{str(model.get('sha256', '?'))[:16]}…`",
        "- **What was done:** each RoPE scaling patched into the pretrained model with `posenc.hf.patch`, "
        "no fine-tuning; the loss of every position of one long document in one forward (whole where its "
        "activations fit, else chunked through the KV cache, which gives the same losses; always whole for "
        "dynamic NTK and LongRoPE, whose frequencies follow the length; each record says which), and passkey "
        "retrieval (one example per length and depth). LongRoPE is its mechanism with YaRN's per-pair factors, "
        "not a searched set" + (" (the searched set is its own row)." if any(
            r.get("scaling") == "rope-longrope-searched" for r in records) else "."),
    ]
    if not any(r.get("kind") in ("loss", "passkey") for r in records):
        lines[-1] = (
            "- **What was done:** RULER's synthetic tasks (Hsieh et al. 2024; `posenc/extend/ruler.py`), each "
            "haystack built to an exact token count for the model's tokenizer and prefilled once through the KV "
            "cache, each of its questions asked from that cache (cut back after each) with greedy decoding, scored "
            "by RULER's string_match_all; the model as trained and RoPE scalings patched in by `posenc.hf.patch`, "
            "no fine-tuning."
        )
    lines += variants_note(records)
    if command:
        lines.append("- **Produced by:** " + " and ".join(f"`{c}`" for c in command.split(" and ")))
    lines += [
        f"- **Cells:** {s['cells']} ({sum(1 for r in records if r['kind'] == 'loss')} loss curves, "
        f"{sum(1 for r in records if r['kind'] == 'passkey')} passkey examples, "
        f"{sum(1 for r in records if r['kind'] == 'ruler')} RULER haystacks), {duration(s['seconds'])} of "
        "wall time in all"
        + (f" at a load average of {s['load'][0]:.1f}-{s['load'][1]:.1f}" if s["load"] else " (load not recorded)"),
        "- **Machine:** " + " / ".join(s["machines"]),
        *(["- **posenc commits:** " + ", ".join(s["commits"])] if s["commits"] else []),
        "",
    ]
    if any(r.get("kind") == "loss" for r in records):
        lines += [f"![loss against position]({img_rel}/extend-loss.png)", "", *ppl_table(records)]
    if passkey_grid(records):
        lines += [f"![passkey retrieval]({img_rel}/extend-passkey.png)", "", *passkey_table(records)]
    if any(r.get("kind") == "ruler" for r in records):
        lines += ruler_section(records, img_rel=img_rel, heading=heading, title=not ruler_only)
    if ruler_only:
        return "\n".join(lines)
    lines += [
        f"{heading}# Verdicts beside the published shapes",
        "",
        "| published shape | the paper's claim | source | tests | verdict | our numbers |",
        "|---|---|---|---|---|---|",
    ]
    for v in verdicts(records):
        tests = v.tests if v.tests == AS_PUBLISHED else f"**{v.tests}**"
        lines.append(f"| {v.finding} | {v.claim} | {v.source} | {tests} | **{v.verdict}** | {v.evidence} |")
    lines += [
        "",
        "The papers' models have 7B+ parameters and were trained on far longer contexts; a 135M model that was "
        "quantised to 4 bits need not follow them. The verdicts are computed from the cells above by the rules "
        "in `posenc/extend/report.py`.",
        "",
    ]
    return "\n".join(lines)


def ruler_section(
    records: Sequence[dict[str, Any]], *, img_rel: str = ".", heading: str = "#", title: bool = True
) -> list[str]:
    """RULER by length: the table, the heatmaps and the verdicts (:mod:`posenc.extend.ruler_report`); ``title``:
    under a heading of its own (else the caller's heading says it)."""
    from . import ruler_report

    lines = [f"{heading}# RULER by length", ""] if title else []
    lines += [
        f"![RULER by length]({img_rel}/extend-ruler.png)",
        "",
        *ruler_report.table(records, environment=False),  # the section's header names the machines and commits
        "| finding | the paper's claim | source | tests | verdict | on |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {v.finding} | {v.claim} | {v.source} | {v.tests if v.tests == AS_PUBLISHED else f'**{v.tests}**'} "
        f"| **{v.verdict}** | {v.evidence} |"
        for v in ruler_report.verdicts(training_free(records))
    ]
    return [*lines, ""]


def write(records: Sequence[dict[str, Any]], out: str | Path, *, command: str = "") -> dict[str, Path]:
    """Write ``report.md``, ``report.html`` and the plots into ``out``; returns their paths."""
    from .ruler_report import plot as plot_ruler

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    for name, fn in (("loss", plot_losses), ("passkey", plot_passkey), ("ruler", plot_ruler)):
        p = fn(records, out / f"extend-{name}.png")
        if p:
            paths[name] = p
    text = markdown(records, command=command)
    (out / "report.md").write_text(text)
    paths["markdown"] = out / "report.md"
    (out / "report.html").write_text(_html(text))
    paths["html"] = out / "report.html"
    return paths


def _html(md: str) -> str:
    """A small, dependency-free rendering of the report's Markdown (headings, lists, tables, images)."""
    body: list[str] = []
    table: list[list[str]] = []

    def inline(t: str) -> str:
        t = html.escape(t)
        import re

        t = re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", t)
        return re.sub(r"`(.+?)`", r"<code>\1</code>", t)

    def flush() -> None:
        if table:
            rows = [r for r in table if not all(set(c) <= set("-:") for c in r)]
            body.append(
                "<table>"
                + "".join(
                    "<tr>"
                    + "".join(f"<{'th' if i == 0 else 'td'}>{inline(c)}</{'th' if i == 0 else 'td'}>" for c in r)
                    + "</tr>"
                    for i, r in enumerate(rows)
                )
                + "</table>"
            )
            table.clear()

    for line in md.splitlines():
        if line.startswith("|"):
            table.append([c.strip() for c in line.strip("|").split("|")])
            continue
        flush()
        if line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            body.append(f"<h{level}>{inline(line.lstrip('#').strip())}</h{level}>")
        elif line.startswith("!["):
            alt, src = line[2:].split("](", 1)
            src = html.escape(src.rstrip(")"))
            body.append(f'<p><img src="{src}" alt="{html.escape(alt)}" style="max-width:100%"></p>')
        elif line.startswith("- "):
            body.append(f"<ul><li>{inline(line[2:])}</li></ul>")
        elif line.strip():
            body.append(f"<p>{inline(line)}</p>")
    flush()
    style = (
        "body{font-family:sans-serif;max-width:1100px;margin:2em auto;line-height:1.4}"
        "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 8px;"
        "font-size:90%}th{background:#f3f3f3}code{background:#f3f3f3}"
    )
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>posenc extend</title><style>{style}</style>"
        f"</head><body>{''.join(body)}</body></html>\n"
    )


# ---------------------------------------------------------------------------------------------- the results page
#: the real model's cells on the results page: ``<data folder>/extend.jsonl`` (loss curves and passkey), and
#: ``<data folder>/extend-ruler.jsonl`` (RULER by length), each from its own store
PAGE_DATA = "extend.jsonl"
RULER_PAGE_DATA = "extend-ruler.jsonl"
#: the stores each data file is exported from, the first found (the full run's before the quick one's)
PAGE_STORES = {PAGE_DATA: ("extend", "extend-quick"), RULER_PAGE_DATA: ("extend-ruler", "extend-ruler-quick")}


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """The records of an ``extend.jsonl`` store (a line cut by an interrupted write is skipped)."""
    from .runner import Store

    path = Path(path)
    return Store(path.parent).records() if path.name == "extend.jsonl" else _read_lines(path)


def _read_lines(path: Path) -> list[dict[str, Any]]:
    import json

    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def export_store(stores: str | Path, data_dir: str | Path) -> list[Path]:
    """Copy the real model's stores under ``stores`` to the page's data folder, sorted by cell: ``extend/`` (else
    ``extend-quick/``) to :data:`PAGE_DATA`, ``extend-ruler/`` (else ``extend-ruler-quick/``) to
    :data:`RULER_PAGE_DATA`; the files written (none where there is no store)."""
    import json

    out = []
    for data, names in PAGE_STORES.items():
        for name in names:
            src = Path(stores) / name / "extend.jsonl"
            if src.is_file():
                records = sorted(read_records(src), key=lambda r: r["key"])
                dst = Path(data_dir) / data
                dst.parent.mkdir(parents=True, exist_ok=True)
                dst.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in records))
                out.append(dst)
                break
    return out


def page_plots(data_dir: str | Path, img_dir: str | Path) -> list[Path]:
    """Draw the results page's plots of the real model into ``img_dir``: ``extend-loss.png`` and
    ``extend-passkey.png`` from :data:`PAGE_DATA`, ``extend-ruler.png`` from :data:`RULER_PAGE_DATA`; the files
    drawn (none where a data file is not there)."""
    from .ruler_report import plot as plot_ruler

    drawn = []
    Path(img_dir).mkdir(parents=True, exist_ok=True)
    path = Path(data_dir) / PAGE_DATA
    if path.is_file():
        records = _read_lines(path)
        drawn += [
            plot_losses(records, Path(img_dir) / "extend-loss.png"),
            plot_passkey(records, Path(img_dir) / "extend-passkey.png"),
        ]
    path = Path(data_dir) / RULER_PAGE_DATA
    if path.is_file():
        drawn.append(plot_ruler(_read_lines(path), Path(img_dir) / "extend-ruler.png"))
    return [p for p in drawn if p is not None]


def page_section(data_dir: str | Path, *, img_rel: str, img_dir: str | Path | None = None) -> list[str]:
    """The results page's sections for the real model, from ``<data_dir>/extend.jsonl`` and
    ``<data_dir>/extend-ruler.jsonl`` (nothing where neither is there); with ``img_dir``, their plots are drawn
    there too (:func:`page_plots`)."""
    if img_dir is not None:
        page_plots(data_dir, img_dir)
    lines: list[str] = []
    for name in (PAGE_DATA, RULER_PAGE_DATA):
        path = Path(data_dir) / name
        if not path.is_file():
            continue
        records = _read_lines(path)
        modes = sorted({str(r.get("mode", "quick")).split(",")[0] for r in records})
        tasks = " --tasks ruler" if name == RULER_PAGE_DATA else ""
        command = " and ".join(
            f"posenc extend{tasks} --{m}" if m in ("quick", "full") else f"posenc extend{tasks}" for m in modes
        )
        lines += markdown(records, img_rel=img_rel, heading="##", command=command).splitlines() + [""]
    return lines
