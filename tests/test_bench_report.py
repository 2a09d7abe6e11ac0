"""posenc bench's report: one style per encoding, chance lines, real length ticks, clipped error bars,
and a self-contained report.html (and leaderboard.md) with every section a newcomer needs.

The records are made up (no training): every test here takes well under a second.
"""

from __future__ import annotations

import datetime
import io
import platform
import re

import pytest

pytest.importorskip("matplotlib")

from posenc.bench.api import Task, get_task, register_task  # noqa: E402
from posenc.bench.report import (  # noqa: E402
    curves_figure,
    encoding_styles,
    leaderboard,
    metric_figure,
    write_report,
)
from posenc.bench.runner import RunConfig  # noqa: E402

SMALL = dict(steps=5, batch_size=8, d_model=16, n_layers=1, n_heads=2, eval_samples=32)


@register_task
class _SplitTask(Task):
    """A task evaluated on splits, whose chance level its own class declares (test only)."""

    name = "test-report-splits"
    description = "a made-up task evaluated on two splits (test only)"
    metric = "accuracy"

    def chance(self, cfg, label):
        return {"test": 0.25, "valid": 0.3}.get(label)


def record(task, encoding, seed, metrics, *, curve=None, label=None, metric="accuracy", higher=True, **kw):
    cfg = RunConfig(task=task, encoding=encoding, seed=seed, **{**SMALL, **kw}).as_dict()
    rec = {
        "key": f"{task}/{encoding}/{seed}/{label}",
        "config": cfg,
        "metric": metric,
        "higher_is_better": higher,
        "metrics": metrics,
        "curve": curve if curve is not None else [[s, 0.7] for s in range(1, 13)],
        "train_seconds": 0.5,
        "parameters": 1234,
        "suite": "made-up",
    }
    if label:
        rec["label"] = label
    return rec


ORDER = dict(train_lengths=(4, 16), test_lengths=(16, 32, 64))


def runs() -> list[dict]:
    """rope ranks first on order and last on adjacent; the alphabet puts it in the middle."""
    out = []
    for seed in (0, 1):
        out += [
            record("order", "rope", seed, {"16": 1.0, "32": 0.95, "64": 0.9}, **ORDER),
            record("order", "alibi", seed, {"16": 0.98, "32": 0.7, "64": 0.6}, **ORDER),
            record("order", "none", seed, {"16": 0.51, "32": 0.5, "64": 0.49}, **ORDER),
            # a huge spread near the top and the bottom: ± std would leave [0, 100]
            record("order", "sinusoidal", seed, {"16": [0.99, 0.4][seed], "32": [0.02, 0.6][seed], "64": 0.5}, **ORDER),
            record("adjacent", "rope", seed, {"16": 0.6, "32": 0.55, "64": 0.5}, **ORDER),
            record("adjacent", "alibi", seed, {"16": 1.0, "32": 1.0, "64": 0.99}, **ORDER),
            record("adjacent", "none", seed, {"16": 0.9, "32": 0.8, "64": 0.7}, **ORDER),
            record("test-report-splits", "rope", seed, {"test": 0.8, "valid": 0.75}),
            record("test-report-splits", "none", seed, {"test": 0.9, "valid": 0.85}),
        ]
    return out


def _metric_styles(fig) -> list[dict[str, tuple[str, str]]]:
    """Per panel: label -> (colour, marker) of its error-bar line."""
    from matplotlib.colors import to_hex

    panels = []
    for ax in fig.axes:
        got = {}
        for c in ax.containers:
            line = c.lines[0]
            got[c.get_label()] = (to_hex(line.get_color()), line.get_marker())
        if got:
            panels.append(got)
    return panels


def _curve_styles(fig) -> list[dict[str, tuple[str, str]]]:
    from matplotlib.colors import to_hex

    return [
        {ln.get_label(): (to_hex(ln.get_color()), ln.get_marker()) for ln in ax.get_lines()}
        for ax in fig.axes
        if ax.get_lines()
    ]


def test_one_colour_and_marker_per_encoding_in_every_panel_and_plot():
    res = runs()
    panels = _metric_styles(metric_figure(res)) + _curve_styles(curves_figure(res))
    assert len(panels) == 6  # 3 tasks × 2 figures
    seen: dict[str, tuple[str, str]] = {}
    for panel in panels:
        for label, style in panel.items():
            if label in ("chance", "each seed (hollow)") or label.startswith("_"):  # seeds' marks: unlabelled
                continue
            assert seen.setdefault(label, style) == style, f"{label} changes style between panels"
    assert set(seen) == {"rope", "alibi", "none", "sinusoidal"}
    assert len(set(seen.values())) == len(seen), "two encodings share a colour and marker"
    # the mapping depends on the set of labels only, not on ranks or the order of the results
    assert encoding_styles(["rope", "alibi", "none"]) == encoding_styles(["none", "rope", "alibi", "rope"])
    many = encoding_styles(f"enc{i}" for i in range(60))
    assert len({(s["color"], s["marker"]) for s in many.values()}) == 60


def test_error_bars_stay_inside_the_metric_range():
    fig = metric_figure(runs())
    n = 0
    for ax in fig.axes:
        for c in ax.containers:
            for seg in c.lines[2][0].get_segments():  # the vertical bars
                n += 1
                assert -1e-9 <= seg[:, 1].min() and seg[:, 1].max() <= 100 + 1e-9, (c.get_label(), seg)
    assert n > 0
    # perplexity: never below 1
    ppl = [
        record("order", "rope", s, {"16": v, "32": 1.2}, metric="perplexity", higher=False, **ORDER)
        for s, v in ((0, 1.0), (1, 3.0))
    ]
    for ax in metric_figure(ppl).axes:
        for c in ax.containers:
            for seg in c.lines[2][0].get_segments():
                assert seg[:, 1].min() >= 1 - 1e-9


def test_chance_line_in_every_panel():
    fig = metric_figure(runs())
    panels = {ax.get_title().split(" ")[0]: ax for ax in fig.axes if ax.get_title()}
    for task in ("order", "adjacent"):
        lines = [ln for ln in panels[task].get_lines() if ln.get_label() == "chance"]
        assert len(lines) == 1 and set(lines[0].get_ydata()) == {50.0}
    # a task evaluated on splits: one chance segment per split, at the levels the task declares
    ax = panels["test-report-splits"]
    (segs,) = [c for c in ax.collections if c.get_label() == "chance"]
    assert sorted(float(seg[0, 1]) for seg in segs.get_segments()) == [25.0, 30.0]
    rows = leaderboard(runs())
    assert {r["chance"]["16"] for r in rows if r["task"] == "order"} == {0.5}


def test_x_ticks_are_the_real_lengths():
    fig = metric_figure(runs())
    fig.savefig(io.BytesIO(), format="png")  # draw: tick labels are final
    for ax in fig.axes:
        if ax.get_xscale() != "log":
            continue
        labels = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
        assert labels == ["16", "32", "64"], labels
        assert not [t.get_text() for t in ax.get_xticklabels(minor=True) if t.get_text()]


def test_builtin_tasks_declare_their_chance():
    cfg = RunConfig(task="order", **SMALL)
    assert get_task("order").chance(cfg, "16") == 0.5 and get_task("adjacent").chance(cfg, "32") == 0.5
    seq = dict(SMALL, train_lengths=(2, 8), test_lengths=(8, 12))
    assert get_task("parity").chance(RunConfig(task="parity", **seq), "8") == 0.5
    assert get_task("msra-ner").chance(RunConfig(task="msra-ner", **SMALL), "test") == 0.0
    # the best constant answer on the evaluation examples: whole outputs of 8 random bits hardly repeat,
    # the most frequent bit at each position is right a little over half the time
    copy = get_task("copy")
    cfg = RunConfig(task="copy", task_options={"symbols": 2}, **seq)
    assert copy.chance(cfg, "8") < 0.1
    assert 0.5 <= copy.chance(cfg, "8_token") < 0.7
    # counting: the answer is a small number, most often a small one
    c = get_task("counting").chance(RunConfig(task="counting", **seq), "8")
    assert 1 / 11 < c < 1


def test_report_html_stands_alone_with_every_section(tmp_path):
    res = runs()
    failures = [
        {
            "key": "f",
            "label": "t5",
            "config": RunConfig(task="order", encoding="t5", seed=3, **SMALL, **ORDER).as_dict(),
            "error": "Traceback (most recent call last):\nRuntimeError: out of memory at length 64",
        }
    ]
    pub = {"task": "order", "source": "Someone et al. 2024", "columns": ["L=64"], "rows": {"rope": [61.0]}}
    files = write_report(res, tmp_path, "posenc bench — made-up", published=pub, failures=failures, description="d")
    page = files["report"].read_text()
    md = files["leaderboard"].read_text()
    # self-contained: nothing fetched, nothing linked but the page's own sections
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//|file:)""", page, re.I)
    assert all(h.startswith("#") for h in re.findall(r"""href\s*=\s*["']?([^"'\s>]+)""", page))
    assert not re.search(r"<link|<script|@import|url\(", page, re.I)
    imgs = re.findall(r"""<img[^>]*src\s*=\s*["']([^"']+)""", page)
    assert len(imgs) == 2 and all(s.startswith("data:image/png;base64,") for s in imgs)
    for section in ("tasks", "results", "plots", "published", "failures", "settings", "environment"):
        assert f'id="{section}"' in page, section
    # tasks and their chance levels
    assert get_task("order").description in page and "50.0 %" in page and "chance" in page
    # settings: suite, lengths, steps, seeds, model size
    assert "made-up" in page and "4–16" in page and "16, 32, 64" in page and "0, 1" in page and "1,234" in page
    # environment and date
    today = datetime.date.today().isoformat()
    import torch

    import posenc

    for text in (today, platform.python_version(), torch.__version__, posenc.__version__, "CPU count", "torch threads"):
        assert text in page, text
    # published numbers beside ours
    assert "Someone et al. 2024" in page and "61.0" in page
    # failures: the run that raised (with its error) and the rows that did not learn in distribution
    assert "out of memory at length 64" in page and "order/t5/seed3" in page
    assert "order/none" in page and "did not learn" in page.lower()
    assert "order/rope" not in page.split('id="failures"')[1].split('id="settings"')[0]
    # the Markdown report says the same
    for heading in ("## Tasks", "## Results", "## Beside the published numbers", "## Failures", "## Settings"):
        assert heading in md, heading
    assert "## Environment" in md and today in md and "out of memory at length 64" in md and "order/none" in md
    assert "| 50.0 |" in md.replace("_chance_ | 50.0 |", "| 50.0 |")


def test_the_trained_length_of_a_task_whose_rows_differ_says_so():
    """A task whose rows were trained on different lengths (context-extension's fine-tuned rows) is not titled
    with whichever row ranks first."""
    from posenc.bench.report import _trained_text

    plain, tuned, none = {"trained": [64, 64]}, {"trained": [64, 256]}, {"trained": None}
    assert _trained_text(plain) == "trained on length 64"
    assert _trained_text({"trained": [4, 16]}) == "trained on lengths ≤ 16"
    assert _trained_text([tuned, plain]) == _trained_text([plain, tuned]) == "trained on length 64; some rows up to 256"
    assert _trained_text([plain, plain]) == "trained on length 64"
    assert _trained_text([none]) == ""
