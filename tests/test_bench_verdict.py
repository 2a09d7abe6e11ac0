"""The report's verdict, its seeds and its one rule for "at chance" (issue 27), on made-up run records.

Independent truth: the gaps and intervals are recomputed here from the records (the t quantiles from
Student's density, integrated numerically); the greying, italics and Failures list are read back from the
written files and compared with each other.
"""

from __future__ import annotations

import math
import re
import statistics

import pytest

pytest.importorskip("matplotlib")

from posenc.bench.report import (  # noqa: E402
    T975,
    at_chance,
    curves_figure,
    leaderboard,
    learning_warnings,
    markdown_table,
    metric_figure,
    paired_interval,
    problems,
    seeds_disagree,
    verdict,
    write_report,
)
from posenc.bench.runner import RunConfig  # noqa: E402

SMALL = dict(steps=5, batch_size=8, d_model=16, n_layers=1, n_heads=2, eval_samples=32)
ORDER = dict(train_lengths=(4, 16), test_lengths=(16, 32, 64))


def record(task, encoding, seed, metrics, *, metric="accuracy", higher=True, curve=None, **kw):
    cfg = RunConfig(task=task, encoding=encoding, seed=seed, **{**SMALL, **ORDER, **kw}).as_dict()
    return {
        "key": f"{task}/{encoding}/{seed}",
        "config": cfg,
        "metric": metric,
        "higher_is_better": higher,
        "metrics": metrics,
        "curve": curve if curve is not None else [[s, 0.7 - 0.01 * s] for s in range(1, 13)],
        "train_seconds": 0.5,
        "parameters": 1234,
        "suite": "made-up",
    }


def lengths(ind: float, ood: float) -> dict[str, float]:
    return {"16": ind, "32": ood, "64": ood}


def _t975(df: int) -> float:
    """Student's t 97.5 % quantile: bisection on the CDF, its density integrated by Simpson's rule."""

    def pdf(x: float) -> float:
        c = math.gamma((df + 1) / 2) / (math.sqrt(df * math.pi) * math.gamma(df / 2))
        return c * (1 + x * x / df) ** (-(df + 1) / 2)

    def cdf(t: float, n: int = 20000) -> float:
        h = t / n
        s = pdf(0) + pdf(t) + sum((4 if i % 2 else 2) * pdf(i * h) for i in range(1, n))
        return 0.5 + s * h / 3

    lo, hi = 0.0, 20.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < 0.975 else (lo, mid)
    return (lo + hi) / 2


@pytest.mark.parametrize("df", [1, 2, 3, 5, 10, 30])
def test_the_t_quantiles_are_students(df):
    assert T975[df - 1] == pytest.approx(_t975(df), abs=2e-3)


def test_a_clear_winner_is_named_with_its_gap_and_interval():
    rope = [0.90, 0.93, 0.91]
    alibi = [0.60, 0.64, 0.59]
    res = [record("order", "rope", s, lengths(1.0, v)) for s, v in enumerate(rope)]
    res += [record("order", "alibi", s, lengths(1.0, v)) for s, v in enumerate(alibi)]
    rows = leaderboard(res)
    text = verdict(rows)
    diffs = [100 * (a - b) for a, b in zip(rope, alibi)]
    m, sd = statistics.fmean(diffs), statistics.stdev(diffs)
    half = _t975(2) * sd / math.sqrt(3)
    assert text.startswith("rope wins, ")
    assert f"{m:.1f} points ahead of alibi" in text
    # 0.9 of 32 examples is no count: the seeds' paired t interval, at 95 % for the one pair of the table
    got = re.search(r"over 3 seeds, ([+-][\d.]+) to ([+-][\d.]+) points \(95%\), excludes 0", text)
    assert got is not None, text
    assert float(got.group(1)) == pytest.approx(m - half, abs=0.06)
    assert float(got.group(2)) == pytest.approx(m + half, abs=0.06)
    # the same sentence in leaderboard.md's table and in the terminal's (markdown_table)
    assert f"**Verdict:** {text}" in markdown_table(rows)


def test_overlapping_seeds_are_not_separable():
    res = [record("order", "rope", s, lengths(1.0, v)) for s, v in enumerate([0.9, 0.5])]
    res += [record("order", "alibi", s, lengths(1.0, v)) for s, v in enumerate([0.6, 0.7])]
    text = verdict(leaderboard(res))
    assert "rope and alibi are not separable" in text and "includes 0" in text
    lo, hi = paired_interval([30.0, -20.0])
    assert lo < 0 < hi


def test_one_seed_says_so_and_is_not_separable():
    res = [record("order", "rope", 0, lengths(1.0, 0.9)), record("order", "alibi", 0, lengths(1.0, 0.6))]
    rows = leaderboard(res)
    text = verdict(rows)
    assert "one seed" in text and "not separable" in text and "30.0 points" in text
    table = markdown_table(rows)
    assert "± 0.0" not in table and "90.0 (1 seed)" in table


def test_lower_is_better_ranks_and_names_the_lower():
    res = [
        record("order", enc, s, {"16": v, "32": v + 1, "64": v + 2}, metric="perplexity", higher=False)
        for s in range(3)
        for enc, v in (("alibi", 5.0 + 0.1 * s), ("rope", 9.0 + 0.05 * s))
    ]
    text = verdict(leaderboard(res))
    assert text.startswith("alibi wins, ") and "ahead of rope" in text


def test_a_task_nobody_learned_says_so_in_the_verdict_and_the_terminal():
    res = [record("order", enc, s, lengths(0.51, 0.5)) for s in range(2) for enc in ("rope", "alibi")]
    rows = leaderboard(res)
    assert "No encoding learned the task in distribution" in verdict(rows)
    warn = learning_warnings(rows)
    assert len(warn) == 1 and "no encoding learned task 'order'" in warn[0]


def test_split_seeds_are_flagged_and_shown():
    # adjacent/normalized: one seed at 100 %, one at 49 %, chance 50 %
    assert seeds_disagree([1.0, 0.49], 0.5, "accuracy")
    assert not seeds_disagree([0.97, 0.99], 0.5, "accuracy")
    assert not seeds_disagree([0.7, 0.8], 0.5, "accuracy")  # shares 0.4 and 0.6: not 0.4 apart
    assert not seeds_disagree([0.9], 0.5, "accuracy")
    res = [record("adjacent", "normalized", s, lengths(v, v)) for s, v in enumerate([1.0, 0.49])]
    table = markdown_table(leaderboard(res))
    assert "74.5 ± 36.1 (seeds split: 49.0 / 100.0)" in table


def test_every_seed_is_a_point_on_the_plot_and_a_thin_curve():
    seeds = [0.99, 0.41]
    res = [record("adjacent", "normalized", s, lengths(v, v / 2)) for s, v in enumerate(seeds)]
    res += [record("adjacent", "rope", s, lengths(1.0, 0.9)) for s in range(2)]
    fig = metric_figure(res)
    hollow = [
        ln for ln in fig.axes[0].get_lines() if ln.get_label() == "_nolegend_" and ln.get_markerfacecolor() == "none"
    ]
    ys = sorted(round(float(y), 6) for ln in hollow for y in ln.get_ydata())
    want = sorted(round(100 * x, 6) for v in seeds for x in (v, v / 2, v / 2)) + [90.0] * 4 + [100.0] * 2
    assert ys == sorted(want)
    thin = [ln for ln in curves_figure(res).axes[0].get_lines() if ln.get_label() == "_nolegend_"]
    assert len(thin) == 4  # 2 encodings × 2 seeds


def test_many_rows_are_a_heatmap_and_perplexity_is_linear_with_chance_off_the_axis():
    import posenc

    names = posenc.available()[:10]
    res = [
        record("order", enc, s, lengths(1.0 - 0.05 * i, 0.8 - 0.05 * i)) for i, enc in enumerate(names) for s in (0, 1)
    ]
    fig = metric_figure(res)
    images = [im for ax in fig.axes for im in ax.get_images()]
    assert len(images) == 1
    grid = images[0].get_array()
    assert grid.shape == (10, 3) and grid[0, 0] == pytest.approx(100.0) and grid[9, 2] == pytest.approx(35.0)
    ppl = [
        record("order", enc, s, {"16": v, "32": v + 20, "64": v + 40}, metric="perplexity", higher=False)
        for s in range(2)
        for enc, v in (("alibi", 340.0 + s), ("rope", 360.0 + s))
    ]
    from posenc.bench import report

    report._chance_of.cache_clear()
    ax = metric_figure(ppl).axes[0]
    assert ax.get_yscale() == "linear"
    lo, hi = ax.get_ylim()
    assert lo > 300 and hi < 450  # the curves fill the axis


def test_one_rule_for_at_chance_in_tables_caption_and_failures(tmp_path):
    # order's chance is 50 %: 50.9 / 51.0 / 51.8 are at chance (the rows), 75 and 99 are not
    res = []
    for s in range(2):
        res += [
            record("order", "none", s, {"16": 0.509, "32": 0.51, "64": 0.518}),
            record("order", "learned", s, {"16": 0.99, "32": 0.75, "64": 0.52}),
        ]
    files = write_report(res, tmp_path, "t")
    rows = leaderboard(res)
    html_text = files["report"].read_text()
    md = files["leaderboard"].read_text()
    for r in rows:
        for key, v in r["values"].items():
            low = at_chance(v[0], r["chance"][key], r["metric"])
            cell = f"{100 * v[0]:.1f} ± {100 * v[1]:.1f}"
            assert (f"<td class=low><span>{cell}" in html_text) == low, (r["label"], key)
            assert (f"*{cell}*" in md) == low, (r["label"], key)
    weak = [p["run"] for p in problems(rows, None)["not learned"]]
    assert weak == ["order/none (2 seeds)"]
    assert "at chance" in md and "in grey: at chance" in html_text
    assert "s/run: mean training seconds" in html_text and "s/run: mean training seconds" in md
    assert "Verdict:" in html_text


def test_files_beside_the_page_include_the_store(tmp_path):
    (tmp_path / "results.sqlite").write_bytes(b"")
    res = [record("order", "rope", s, lengths(1.0, 0.9)) for s in range(2)]
    text = write_report(res, tmp_path, "t")["report"].read_text()
    assert "Files beside this page: results.sqlite" in text


def test_a_row_that_did_not_learn_says_so_beside_the_published_numbers():
    from posenc.bench.report import published_table

    res = [record("order", enc, s, lengths(v, v)) for s in range(2) for enc, v in (("rope", 0.5), ("alibi", 0.45))]
    text = published_table(
        {"source": "a paper", "task": "order", "rows": {"rope": 27.1, "alibi": 26.0}}, leaderboard(res)
    )
    assert "| rope | 27.1 | 1 (did not learn: at chance) |" in text


def test_the_json_files_hold_each_seed_and_strict_json(tmp_path):
    import json

    res = [
        record("order", "learned", s, {"16": 0.99, "32": None, "32_error": "beyond the table", "64": None})
        for s in range(2)
    ] + [record("order", "rope", s, lengths(1.0, 0.9 - 0.1 * s)) for s in range(2)]
    files = write_report(res, tmp_path, "t")
    data = json.loads(files["leaderboard_json"].read_text(), parse_constant=lambda c: pytest.fail(f"{c} in JSON"))
    rope = next(r for r in data["rows"] if r["label"] == "rope")
    assert rope["per_seed"]["32"] == [0.9, 0.8] and rope["seed_scores"] == {"0": 0.9, "1": 0.8}
