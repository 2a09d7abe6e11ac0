"""``posenc results``: the results page, from real (tiny) benchmark stores.

Two tiny suites are trained for real (5 steps, one layer), one is never run. The truths the page
is checked against are read from the stores with ``sqlite3`` itself and recomputed here (mean and
std over seeds), not taken from posenc's report code.
"""

from __future__ import annotations

import datetime
import json
import math
import re
import shutil
import sqlite3
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from posenc.bench import load_suite, run_suite  # noqa: E402
from posenc.bench.results_page import (  # noqa: E402
    README_END,
    README_START,
    build_page,
    check_page,
    duration,
    measured_time,
    read_jsonl,
    write_page,
)
from posenc.bench.store import SQLiteStore  # noqa: E402
from posenc.bench.suites import Finding, parse_suite  # noqa: E402
from posenc.cli import main  # noqa: E402
from posenc.errors import ConfigError, PosencError  # noqa: E402

SETTINGS = """
[settings]
steps = 5
batch_size = 8
d_model = 16
n_layers = 1
n_heads = 2
eval_samples = 32
train_lengths = [4, 8]
test_lengths = [8, 16]
"""

SUITE_A = (
    """
name = "tiny-a"
description = "order: none against rope, two seeds"
paper = "Nobody et al. 2000, A Made-Up Paper"
tasks = ["order"]
encodings = ["none", "rope"]
seeds = [0, 1]
measured = "about 9 s in-process on a shared 2-vCPU machine (test)"
"""
    + SETTINGS
    + """
[published]
task = "order"
source = "Nobody et al. 2000, Table 1"
metric = "accuracy"
columns = ["L=16"]
rows = { rope = [99.0], none = [50.0] }

[[findings]]
finding = "rope beats no encoding on order"
claim = '"rope beats none on order"'
source = "Nobody et al. 2000, §1, Table 1"
tests = "as published"
verdict = "reproduced"
evidence = "order, L=8: rope above none"
written = "2000-01-01"

[[comparisons]]
name = "rope minus none beyond the training lengths"
pairs = [["rope", "none"]]
lengths = "beyond"
"""
)

SUITE_B = (
    """
name = "tiny-b"
description = "adjacent: none against sinusoidal"
tasks = ["adjacent"]
encodings = ["none", "sinusoidal"]
seeds = [0, 1]
"""
    + SETTINGS
    + """
[[findings]]
finding = "sinusoidal extrapolates a little"
claim = "the sinusoid extrapolates (a close paraphrase)"
source = "Nobody et al. 2000 (section not checked)"
tests = "as published"
verdict = "partly"
evidence = "adjacent, L=16"
written = "2999-01-01"

[[findings]]
finding = "nothing can be said at 5 steps"
claim = "a variant of our own"
source = "Nobody et al. 2000, §2"
tests = "posenc's question"
verdict = "inconclusive"
written = 2999-01-01
"""
)

SUITE_C = (
    """
name = "tiny-c"
description = "never run"
tasks = ["order"]
encodings = ["none"]
seeds = [0]
"""
    + SETTINGS
)

FAILURE = "Traceback (most recent call last):\n  ...\nRuntimeError: a made-up failure for the test"


def _quiet(_: str) -> None:
    pass


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Stores of tiny-a (4 runs) and tiny-b (3 runs and a failure), no store of tiny-c; the page written."""
    root = tmp_path_factory.mktemp("results-page")
    files = {}
    for name, text in (("tiny-a", SUITE_A), ("tiny-b", SUITE_B), ("tiny-c", SUITE_C)):
        files[name] = root / f"{name}.toml"
        files[name].write_text(text)
    stores = root / "stores"
    run_suite(load_suite(files["tiny-a"]), out=stores / "tiny-a", progress=False)
    jobs = load_suite(files["tiny-b"]).jobs()
    run_suite(jobs[:-1], out=stores / "tiny-b", progress=False)
    with SQLiteStore(stores / "tiny-b" / "results.sqlite") as st:
        st.add_failure(jobs[-1].key, jobs[-1].config.as_dict(), FAILURE, jobs[-1].label)
    page = root / "docs" / "results.md"
    suites = [str(files[n]) for n in ("tiny-a", "tiny-b", "tiny-c")]
    out = write_page(page, stores=stores, suites=suites, log=_quiet)
    return {"root": root, "stores": stores, "page": page, "suites": suites, "out": out, "failed": jobs[-1]}


def _section(text: str, name: str) -> str:
    start = text.index(f"\n## {name}\n")
    end = text.find("\n## ", start + 1)
    return text[start : None if end < 0 else end]


def _stored(store: Path) -> list[tuple[dict, float]]:
    """(record, finished_at) of every run, read with sqlite3 itself."""
    con = sqlite3.connect(store)
    try:
        rows = con.execute("SELECT payload, finished_at FROM runs").fetchall()
    finally:
        con.close()
    return [(json.loads(p), t) for p, t in rows]


def _table(section: str, header_start: str) -> tuple[list[str], list[list[str]]]:
    lines = section.splitlines()
    i = next(k for k, line in enumerate(lines) if line.startswith(header_start))
    head = [c.strip() for c in lines[i].strip("|").split("|")]
    body = []
    for line in lines[i + 2 :]:
        if not line.startswith("|"):
            break
        body.append([c.strip() for c in line.strip("|").split("|")])
    return head, body


# ---------------------------------------------------------------------------- what the page says
@pytest.mark.parametrize("suite", ["tiny-a", "tiny-b"])
def test_the_leaderboard_holds_the_mean_and_std_over_seeds_recomputed_from_the_store(built, suite):
    text = built["page"].read_text()
    sec = _section(text, suite)
    by_label = defaultdict(list)
    for rec, _ in _stored(built["stores"] / suite / "results.sqlite"):
        by_label[rec["label"]].append(rec["metrics"])
    head, body = _table(sec, "| # | encoding |")
    rows = {r[1]: r for r in body}
    assert set(by_label) <= set(rows)
    for label, metrics in by_label.items():
        for length, column in (("8", "L=8 (train)"), ("16", "L=16")):
            xs = [100 * m[length] for m in metrics]
            mean = sum(xs) / len(xs)
            std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
            cell = rows[label][head.index(column)].strip("*")  # italics: at chance
            if len(xs) == 1:  # one seed: its value and "1 seed", never "± 0.0"
                assert cell.endswith(" (1 seed)") and abs(float(cell.split()[0]) - mean) <= 0.05 + 1e-9
                continue
            cell = cell.split(" (seeds split")[0]
            shown_mean, shown_std = (float(v) for v in cell.split("±"))
            assert abs(shown_mean - mean) <= 0.05 + 1e-9 and abs(shown_std - std) <= 0.05 + 1e-9, (label, column)
    # and its plot, drawn and linked relative to the page
    task = "order" if suite == "tiny-a" else "adjacent"
    assert f"](results/img/{suite}-{task}.png)" in sec
    assert (built["page"].parent / "results" / "img" / f"{suite}-{task}.png").stat().st_size > 1000


def test_the_page_gives_the_machine_seeds_dates_and_commands(built):
    sec = _section(built["page"].read_text(), "tiny-a")
    stored = _stored(built["stores"] / "tiny-a" / "results.sqlite")
    env = stored[0][0]["env"]
    head, body = _table(sec, "| runs | CPU |")
    assert len(body) == 1
    row = dict(zip(head, body[0]))
    assert row["runs"] == "4"
    assert row["CPU"] == env["cpu"] and row["kernels"] == env["kernels"] and row["torch"] == env["torch"]
    assert row["threads"] == str(env["threads"])
    assert row["posenc"].startswith(env["posenc"])
    if env["git_commit"]:
        assert env["git_commit"][:10] in row["posenc"]
        assert ("(modified)" in row["posenc"]) == bool(env["git_dirty"])
    assert "**Seeds:** 0, 1 (2 seeds)" in sec
    times = [t for _, t in stored]
    first, last = (datetime.datetime.fromtimestamp(t, datetime.UTC) for t in (min(times), max(times)))
    assert f"first run {first:%Y-%m-%d %H:%M} UTC, last run {last:%Y-%m-%d %H:%M} UTC" in sec
    # every run records when it started: the wall time is the first start to the last finish
    wall = max(times) - min(r["started_at"] for r, _ in stored)
    assert f"**Time, from the records:** {duration(wall)} wall time, from the first run's start" in sec
    assert "**Time, as measured (suite file):** about 9 s in-process on a shared 2-vCPU machine (test)" in sec
    assert f"`posenc bench --suite {built['suites'][0]} --workers 2`" in sec
    assert "`posenc results --stores posenc-results --write docs/results.md --readme README.md`" in sec
    assert "**Paper:** Nobody et al. 2000, A Made-Up Paper" in sec
    assert "**Published** — Nobody et al. 2000, Table 1" in sec
    assert "environments" not in sec.split("### Results")[0].split("### Machine")[1]  # one environment: no warning


def test_verdicts_are_a_table_and_a_stale_one_is_flagged(built):
    text = built["page"].read_text()
    a, b = _section(text, "tiny-a"), _section(text, "tiny-b")
    head, body = _table(a, "| finding | the paper's claim |")
    assert head == ["finding", "the paper's claim", "source", "tests", "verdict", "evidence", "written"]
    assert body == [
        [
            "rope beats no encoding on order",
            '"rope beats none on order"',
            "Nobody et al. 2000, §1, Table 1",
            "as published",
            "**reproduced**",
            "order, L=8: rope above none",
            "2000-01-01",
        ]
    ]
    assert "**Warning:** 1 of these verdicts (written 2000-01-01) were written before the latest runs" in a
    _, body_b = _table(b, "| finding | the paper's claim |")
    assert [r[4] for r in body_b] == ["**partly**", "**inconclusive**"]
    assert [r[3] for r in body_b] == ["as published", "**posenc's question**"]
    assert body_b[1][6] == "2999-01-01"  # an unquoted TOML date is written as the string
    assert "written before the latest runs" not in b
    # the summary: seeds, runs, measured time, verdict counts
    _, summary = _table(text, "| suite | seeds |")
    rows = {r[0]: r for r in summary}
    assert rows["[tiny-a](#tiny-a)"][1:] == [
        "0, 1",
        "4 of 4",
        "about 9 s in-process on a shared 2-vCPU machine (test)",
        "1 reproduced (written before the latest runs)",
    ]
    assert rows["[tiny-b](#tiny-b)"][2] == "3 of 4, 1 failed"
    assert rows["[tiny-b](#tiny-b)"][3].endswith(" wall")
    assert (
        rows["[tiny-b](#tiny-b)"][4]
        == "1 partly, 1 inconclusive (1 of them on posenc's question, not the paper's claim as published)"
    )
    assert rows["[tiny-c](#tiny-c)"][2:] == ["not run yet", "—", "none yet"]


def test_a_comparison_is_the_per_seed_difference_recomputed_from_the_store(built):
    sec = _section(built["page"].read_text(), "tiny-a")
    acc = {
        (rec["label"], rec["config"]["seed"]): rec["metrics"]["16"]
        for rec, _ in _stored(built["stores"] / "tiny-a" / "results.sqlite")
    }
    diffs = [100 * (acc[("rope", seed)] - acc[("none", seed)]) for seed in (0, 1)]
    mean = sum(diffs) / 2
    std = math.sqrt(sum((d - mean) ** 2 for d in diffs))  # n - 1 = 1
    head, body = _table(sec, "| task | rope − none |")
    assert body[0][0] == "order"
    shown, rest = body[0][1].split("±")
    assert abs(float(shown) - mean) <= 0.05 + 1e-9
    assert abs(float(rest.split("(")[0]) - std) <= 0.05 + 1e-9 and rest.strip().endswith("(2)")
    assert f"**{mean:+.1f} points**" in sec


@pytest.mark.parametrize(
    ("comparison", "says"),
    [
        ('pairs = [["rope", "nope"]]', "'nope' is not the label of an encoding of this suite"),
        ('pairs = [["rope"]]', "pairs must be a list of [a, b] label pairs"),
        ('pairs = [["rope", "none"]]\nlengths = "longer"', "lengths must be one of beyond, train, all"),
    ],
)
def test_a_bad_comparison_is_a_clear_config_error(comparison, says):
    import tomllib

    text = SUITE_C.replace('encodings = ["none"]', 'encodings = ["none", "rope"]') + "\n[[comparisons]]\n" + comparison
    with pytest.raises(ConfigError) as err:
        parse_suite(tomllib.loads(text))
    assert says in str(err.value)


def test_records_without_start_times_give_the_summed_training_time_and_say_so():
    records = [{"finished_at": 100.0, "train_seconds": 30.0}, {"finished_at": 200.0, "train_seconds": 45.0}]
    long, short = measured_time(records)
    assert long.startswith(f"{duration(75.0)} of training, summed over the 2 runs") and "not a wall time" in long
    assert short == f"{duration(75.0)} summed over runs"
    records[0]["started_at"] = 50.0  # one record without a start time is not enough for a wall time
    assert "summed" in measured_time(records)[0]
    records[1]["started_at"] = 120.0
    assert (
        measured_time(records)[0] == f"{duration(150.0)} wall time, from the first run's start to the last run's finish"
    )


def test_the_readme_block_lists_the_decided_claims_counts_the_rest_and_check_sees_an_edit(built, tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\nbefore\n\n{README_START}\nold text\n{README_END}\n\nafter\n")
    page = tmp_path / "docs" / "results.md"
    shutil.copytree(built["page"].parent / "results" / "data", page.parent / "results" / "data")
    write_page(page, suites=built["suites"], readme=readme, plots=False, log=_quiet)
    text = readme.read_text()
    assert text.startswith("# x\n\nbefore\n\n") and text.endswith("\n\nafter\n") and "old text" not in text
    head, body = _table(text, "| suite | finding (claim and source")
    assert head == ["suite", "finding (claim and source: the results page)", "verdict"]
    assert body[0] == [
        "[tiny-a](docs/results.md#tiny-a)",  # every seed of the suite ran: no count
        "rope beats no encoding on order",
        "**reproduced** (written before the latest runs)",
    ]
    # the decided claims as published get a row each; the inconclusive ones and posenc's questions are counted
    assert body[1][2] == "**partly**"
    assert body[2] == ["", "*and 1 posenc's question: on the page*", ""]
    assert "No verdict yet: [tiny-c](docs/results.md#tiny-c) (not run yet)." in text
    assert check_page(page, suites=built["suites"], readme=readme) == (True, "")
    readme.write_text(text.replace("**partly**", "**reproduced**"))
    same, diff = check_page(page, suites=built["suites"], readme=readme)
    assert not same and "README.md (from the data)" in diff
    with pytest.raises(PosencError, match="no results block"):
        write_page(page, suites=built["suites"], readme=tmp_path / "docs" / "results.md", plots=False, log=_quiet)


def test_failed_runs_are_listed(built):
    b = _section(built["page"].read_text(), "tiny-b")
    job = built["failed"]
    assert f"- {job.config.task}/{job.label}/seed{job.config.seed}: RuntimeError: a made-up failure for the test" in b
    assert "3 finished of the suite's 4; 1 failed" in b
    assert "No run failed." in _section(built["page"].read_text(), "tiny-a")


def test_a_suite_with_nothing_stored_is_not_run_yet(built):
    c = _section(built["page"].read_text(), "tiny-c")
    assert "**Not run yet.**" in c and f"`posenc bench --suite {built['suites'][2]} --workers 2`" in c
    assert "### Results" not in c
    assert not (built["page"].parent / "results" / "data" / "tiny-c.jsonl").exists()


def test_a_suite_that_cannot_be_loaded_does_not_break_the_page(tmp_path):
    text, datas = build_page(tmp_path / "results.md", suites=[str(tmp_path / "gone.toml")])
    assert "cannot be loaded here" in _section(text, "gone") and "Not run yet" in text
    assert not datas[0].ran


# ---------------------------------------------------------------------------- data, round trip, --check
def test_the_jsonl_export_round_trips_through_a_store(built, tmp_path):
    data = built["page"].parent / "results" / "data"
    assert sorted(p.name for p in data.iterdir()) == ["tiny-a.jsonl", "tiny-b.jsonl"]
    lines = [json.loads(x) for x in (data / "tiny-b.jsonl").read_text().splitlines()]
    assert [x["key"] for x in lines if not x.get("failed")] == sorted(x["key"] for x in lines if not x.get("failed"))
    assert sum(1 for x in lines if x.get("failed")) == 1
    # the existing import_jsonl reads it: runs with their finish times, the failure as a failure
    with SQLiteStore(tmp_path / "copy.sqlite", migrate=False) as st:
        assert st.import_jsonl(data / "tiny-b.jsonl") == 3
        assert [f["key"] for f in st.failures()] == [built["failed"].key]
        st.export_jsonl(tmp_path / "again.jsonl")
        got = {k: st.finished_at(k) for k in st.keys()}
    assert (tmp_path / "again.jsonl").read_text() == (data / "tiny-b.jsonl").read_text()
    stored = _stored(built["stores"] / "tiny-b" / "results.sqlite")
    assert got == {r["key"]: t for r, t in stored}
    runs, failures = read_jsonl(data / "tiny-b.jsonl")
    assert [{k: v for k, v in r.items() if k != "finished_at"} for r in runs] == sorted(
        (r for r, _ in stored), key=lambda r: r["key"]
    )
    assert failures[0]["error"] == FAILURE


def test_the_page_from_the_committed_data_alone_is_the_same(built):
    page, suites = built["page"], built["suites"]
    before = page.read_text()
    img = page.parent / "results" / "img"
    shutil.rmtree(img)
    page.unlink()
    write_page(page, suites=suites, log=_quiet)  # no stores: the JSONL files only
    assert page.read_text() == before
    assert sorted(p.name for p in img.iterdir()) == sorted(p.name for p in built["out"]["plots"])
    assert check_page(page, suites=suites) == (True, "")


def test_check_passes_on_a_fresh_page_and_fails_after_an_edit(built, tmp_path, capsys):
    page = tmp_path / "docs" / "results.md"
    shutil.copytree(built["page"].parent, page.parent)
    args = [a for s in built["suites"] for a in ("--suite", s)]
    assert main(["results", *args, "--check", str(page)]) == 0
    assert "up to date" in capsys.readouterr().out
    text = page.read_text()
    page.write_text(text.replace("**Seeds:** 0, 1 (2 seeds)", "**Seeds:** 0, 1, 2 (3 seeds)", 1))
    assert main(["results", *args, "--check", str(page)]) == 1
    err = capsys.readouterr().err
    assert "not the page its data gives" in err and f"posenc results --write {page}" in err
    assert "\n-- **Seeds:** 0, 1, 2 (3 seeds)\n+- **Seeds:** 0, 1 (2 seeds)" in err  # the diff
    assert main(["results", *args, "--check", str(page), "--stores", str(built["stores"])]) == 2


# ---------------------------------------------------------------------------- the suite file's keys
def _suite(**top) -> dict:
    return {
        "name": "x",
        "tasks": ["order"],
        "encodings": ["none"],
        "seeds": [0],
        "settings": {"steps": 5, "train_lengths": [4, 8], "test_lengths": [8]},
        **top,
    }


def test_an_invalid_verdict_is_a_clear_config_error():
    claim = {"claim": "c", "source": "Nobody et al. 2000, §1", "tests": "as published"}
    bad = {"finding": "f", "verdict": "reproducible", "evidence": "e", "written": "2026-11-24", **claim}
    with pytest.raises(ConfigError, match="verdict 'reproducible' is not one of 'reproduced', 'partly'.*reproduced"):
        parse_suite(_suite(findings=[bad]))
    with pytest.raises(ConfigError, match="no written"):
        parse_suite(_suite(findings=[{"finding": "f", "verdict": "partly", **claim}]))
    with pytest.raises(ConfigError, match="written must be a date"):
        parse_suite(_suite(findings=[{**bad, "verdict": "partly", "written": "last week"}]))
    with pytest.raises(ConfigError, match="unknown key 'verdic'"):
        parse_suite(_suite(findings=[{"finding": "f", "verdic": "partly", "written": "2026-11-24"}]))
    with pytest.raises(ConfigError, match="measured must be a string"):
        parse_suite(_suite(measured=42))
    ok = parse_suite(_suite(measured="3 min", findings=[{**bad, "verdict": "not reproduced"}]))
    assert ok.measured == "3 min" and ok.findings[0].verdict == "not reproduced"


def test_a_verdict_dated_by_day_counts_the_whole_utc_day():
    f = Finding("f", "partly", written="2026-11-24")
    utc = datetime.UTC
    assert not f.written_before(datetime.datetime(2026, 11, 24, 23, 59, tzinfo=utc))
    assert f.written_before(datetime.datetime(2026, 11, 25, 0, 1, tzinfo=utc))
    g = Finding("g", "partly", written="2026-11-24T12:00")
    assert g.written_before(datetime.datetime(2026, 11, 24, 12, 1, tzinfo=utc))
    assert not g.written_before(datetime.datetime(2026, 11, 24, 11, 59, tzinfo=utc))


def test_results_help_does_not_import_torch():
    probe = (
        "import sys\nfrom posenc.cli import main\ntry:\n    main(['results', '--help'])\nexcept SystemExit:\n    pass\n"
        "print('TORCH:', 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert "posenc results" in out.stdout and "TORCH: False" in out.stdout, out.stdout + out.stderr


def test_the_committed_results_page_is_what_its_committed_data_gives():
    """docs/results.md is generated (`posenc results --write docs/results.md`): its text is what the committed
    docs/results/data/*.jsonl and the suite files give. A suite file edited after the page was written (a
    verdict, a setting) or a hand edit of the page fails here until the page is written again."""
    page = Path(__file__).resolve().parents[1] / "docs" / "results.md"
    if not page.is_file():
        pytest.skip("no docs/results.md in this checkout")
    same, diff = check_page(page, readme=page.parents[1] / "README.md")
    assert same, (
        "docs/results.md or README.md's block of verdicts is not what the data gives; run: "
        "posenc results --write docs/results.md --readme README.md\n" + diff
    )
    text = page.read_text(encoding="utf-8")
    linked = [page.parent / m for m in re.findall(r"\]\((results/img/[^)]+\.png)\)", text)]
    assert linked and all(p.is_file() for p in linked), [str(p) for p in linked if not p.is_file()]
