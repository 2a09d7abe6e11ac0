"""posenc.bench.reporting: one model of a set of runs, which every report renders.

The Markdown table, the HTML table and the plot of a task draw the same TaskTable (cells, chance, verdict);
report.py and results_page.py are thin faces of the package; the results page's command loads without it.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("matplotlib")

from posenc.bench import report, results_page  # noqa: E402
from posenc.bench.reporting import html, markdown, plots  # noqa: E402
from posenc.bench.reporting.model import RunSet, TaskTable  # noqa: E402
from posenc.bench.types import RunConfig  # noqa: E402

SMALL = dict(steps=5, batch_size=8, d_model=16, n_layers=1, n_heads=2, eval_samples=32)
ORDER = dict(train_lengths=(4, 16), test_lengths=(16, 32, 64))


def record(encoding: str, seed: int, ind: float, ood: float) -> dict:
    cfg = RunConfig(task="order", encoding=encoding, seed=seed, **{**SMALL, **ORDER}).as_dict()
    return {
        "key": f"order/{encoding}/{seed}",
        "config": cfg,
        "metric": "accuracy",
        "higher_is_better": True,
        "metrics": {"16": ind, "32": ood, "64": ood - 0.01 * seed},
        "curve": [[s, 0.7 - 0.01 * s] for s in range(1, 13)],
        "train_seconds": 0.5,
        "parameters": 1234,
        "suite": "made-up",
    }


@pytest.fixture
def runs() -> RunSet:
    res = [record(enc, s, ind, ood) for s in range(3) for enc, ind, ood in (("rope", 0.99, 0.7), ("none", 0.51, 0.5))]
    return RunSet(res)


def test_one_task_table_per_task_ranked_with_its_verdict_and_chance(runs):
    (table,) = runs.tables
    assert isinstance(table, TaskTable) and table.task == "order"
    assert [r["label"] for r in table.rows] == ["rope", "none"]
    assert table.labels == ["16", "32", "64"] and table.summary == "mean > train"
    assert table.verdict == report.verdict(table.rows)
    assert table.chance == [pytest.approx(0.5)] * 3
    assert table.at_chance(table.rows[1], "16") and not table.at_chance(table.rows[0], "16")
    assert table.best["16"] == pytest.approx(0.99)


def test_markdown_and_html_tables_show_the_model_s_cells(runs):
    (table,) = runs.tables
    md = "\n".join(markdown.task_table(table))
    page = "\n".join(html.task_table(table, runs.styles))
    for r in table.rows:
        for key in table.labels:
            cell = table.cell(r, key)
            assert cell in md and cell in page
    assert f"**Verdict:** {table.verdict}" in md
    assert "<tr class=chance>" in page and "<td class=low><span>" in page and "<td class=best><span>" in page
    assert markdown.markdown_table(runs.rows) == md


def test_the_plot_draws_the_model_s_rows(runs):
    fig = plots.metric_figure(runs.results, rows=runs.rows, styles=runs.styles)
    labels = fig.axes[0].get_legend_handles_labels()[1]
    assert {"rope", "none", "chance"} <= set(labels)


def test_report_and_results_page_are_faces_of_the_package():
    from posenc.bench.reporting import readme, rows, suite_data, write

    assert report.leaderboard is rows.leaderboard and report.write_report is write.write_report
    assert report.markdown_table is markdown.markdown_table
    assert results_page.read_jsonl is suite_data.read_jsonl and results_page.readme_block is readme.readme_block


def test_the_results_command_loads_without_the_model():
    code = (
        "import sys\nimport posenc.bench.results_page as rp\n"
        "print(rp.PAGE, 'posenc.bench.reporting.model' in sys.modules, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["docs/results.md", "False", "False"]
