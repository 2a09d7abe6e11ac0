"""The harness of posenc bench: suites, the SQLite store, executors (process pool, Ray, torchrun), errors.

The truth each test checks against is independent of the code under test:
sqlite3 itself (rows counted with a separate connection), the run being a pure
function of its config (a process pool, Ray and DDP must give the results a plain
in-process run gives), and hand-written suite files with known mistakes.
"""

from __future__ import annotations

import json
import sqlite3
import tomllib
from pathlib import Path

import pytest
import torch

from posenc import bench
from posenc.bench import RunConfig, load_suite, run_suite
from posenc.bench.api import Task, register_task
from posenc.bench.report import leaderboard, markdown_table, published_table, write_report
from posenc.bench.runner import Job, RunFailedError
from posenc.bench.store import SQLiteStore, StoreCorruptError, StoreLockedError
from posenc.bench.suites import available_suites, parse_suite
from posenc.cli import main
from posenc.errors import ConfigError, PosencError, UnknownNameError


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models run fastest on one thread (and on a shared machine two threads can be 100x slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


TINY = dict(
    steps=5,
    batch_size=8,
    d_model=16,
    n_layers=1,
    n_heads=2,
    eval_samples=32,
    train_lengths=(4, 8),
    test_lengths=(8, 12),
)


def tiny(**kw) -> RunConfig:
    return RunConfig(**{**TINY, **kw})


def _count(path: Path) -> int:
    """Rows in the store counted through a separate sqlite3 connection (not the store's code)."""
    con = sqlite3.connect(path)
    try:
        return con.execute("SELECT COUNT(*) FROM runs").fetchone()[0]
    finally:
        con.close()


def _strip(rec: dict) -> dict:
    """A record without what legitimately differs between two executions (wall time)."""
    return {k: v for k, v in rec.items() if k not in ("train_seconds", "extra")}


def _same_run(a: dict, b: dict) -> None:
    """Two executions of one config: same key, config and metrics; losses equal to float32 summation order.

    (A worker with another number of torch threads sums in another order: the loss
    differs in the 8th digit, rel 1e-5 allows that and nothing else.)
    """
    assert a["key"] == b["key"] and a["config"] == b["config"]
    assert a["metrics"] == b["metrics"]
    assert [s for s, _ in a["curve"]] == [s for s, _ in b["curve"]]
    assert [v for _, v in a["curve"]] == pytest.approx([v for _, v in b["curve"]], rel=1e-5)


# ------------------------------------------------------------------------------------------ store
def test_store_one_row_per_run_wal_and_resume(tmp_path):
    cfgs = [tiny(encoding="none"), tiny(encoding="sinusoidal")]
    res = run_suite(cfgs, tmp_path, progress=False)
    db = tmp_path / "results.sqlite"
    assert _count(db) == 2 and len(res) == 2
    con = sqlite3.connect(db)
    assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    payloads = {k: json.loads(p) for k, p in con.execute("SELECT key, payload FROM runs")}
    con.close()
    assert set(payloads) == {c.key() for c in cfgs}
    # again: nothing runs (run_one is not called), nothing is added
    from posenc.bench import runner

    calls = []
    real = runner.run_one
    runner.run_one = lambda cfg, on_step=None: calls.append(cfg) or real(cfg, on_step)
    try:
        again = run_suite(cfgs, tmp_path, progress=False)
    finally:
        runner.run_one = real
    assert calls == [] and [_strip(r) for r in again] == [_strip(r) for r in res] and _count(db) == 2
    # adding the same run twice keeps one row
    SQLiteStore(db).add(res[0])
    assert _count(db) == 2


def test_interrupted_suite_resumes_where_it_stopped(tmp_path, monkeypatch):
    from posenc.bench import runner

    cfgs = [tiny(encoding="none"), tiny(encoding="rope"), tiny(encoding="learned")]
    real = runner.run_one
    calls = []

    def flaky(cfg, on_step=None):
        calls.append(cfg.encoding)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(cfg, on_step)

    monkeypatch.setattr(runner, "run_one", flaky)
    with pytest.raises(KeyboardInterrupt):
        run_suite(cfgs, tmp_path, progress=False)
    assert _count(tmp_path / "results.sqlite") == 1
    calls.clear()
    monkeypatch.setattr(runner, "run_one", lambda cfg, on_step=None: calls.append(cfg.encoding) or real(cfg, on_step))
    res = run_suite(cfgs, tmp_path, progress=False)
    assert calls == ["rope", "learned"]  # the finished run is not run again
    assert [r["config"]["encoding"] for r in res] == ["none", "rope", "learned"]
    assert _count(tmp_path / "results.sqlite") == 3


def test_old_jsonl_results_are_migrated(tmp_path):
    rec = bench.run_one(tiny(encoding="none"))
    (tmp_path / "results.jsonl").write_text(json.dumps(rec) + "\n" + '{"key": "cut sh')  # last line cut short
    before = (tmp_path / "results.jsonl").read_bytes()
    store = SQLiteStore(tmp_path / "results.sqlite")
    assert store.keys() == {rec["key"]}
    assert (tmp_path / "results.jsonl").read_bytes() == before  # the old file is left as it was
    # opening again does not import twice
    assert len(SQLiteStore(tmp_path / "results.sqlite")) == 1 == _count(tmp_path / "results.sqlite")
    # and the migrated run is not run again
    res = run_suite([tiny(encoding="none")], tmp_path, progress=False)
    assert _strip(res[0]) == _strip({**rec, "label": "none"}) or res[0]["metrics"] == rec["metrics"]


def test_corrupt_store_is_a_clear_error_and_left_untouched(tmp_path):
    db = tmp_path / "results.sqlite"
    db.write_bytes(b"this is not a database" * 100)
    before = db.read_bytes()
    with pytest.raises(StoreCorruptError, match="not a readable SQLite database.*Move it away"):
        SQLiteStore(db)
    with pytest.raises(StoreCorruptError):
        run_suite([tiny(encoding="none")], tmp_path, progress=False)
    assert db.read_bytes() == before
    # a real database whose pages are damaged
    good = tmp_path / "good" / "results.sqlite"
    run_suite([tiny(encoding="none")], good.parent, progress=False)
    SQLiteStore(good).close()
    con = sqlite3.connect(good)
    con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    con.close()
    raw = bytearray(good.read_bytes())
    raw[100:4000] = b"\xff" * 3900  # the schema page
    good.write_bytes(bytes(raw))
    with pytest.raises(StoreCorruptError, match="move it away|Move it away"):
        SQLiteStore(good)
    assert good.read_bytes() == bytes(raw)
    # the CLI says the same and exits with 2
    assert main(["bench", "--task", "order", "--encodings", "none", "--seeds", "0", "--out", str(tmp_path)]) == 2


def test_locked_store_is_a_clear_error_and_loses_nothing(tmp_path):
    res = run_suite([tiny(encoding="none")], tmp_path, progress=False)
    db = tmp_path / "results.sqlite"
    other = sqlite3.connect(db, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # another writer holds the write lock
    try:
        store = SQLiteStore(db, timeout=0.2)
        assert len(store) == 1  # reading works beside a writer (WAL)
        rec2 = {**res[0], "key": "another-run"}
        with pytest.raises(StoreLockedError, match="locked by another process.*--store"):
            store.add(rec2)
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert _count(db) == 1
    store.add(rec2)
    assert _count(db) == 2
    # a suite whose store stays locked after its last run finished: the run is kept aside, not lost
    other = sqlite3.connect(db, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(StoreLockedError, match="stayed locked.*kept in .*pending-.*jsonl.*nothing finished"):
            run_suite([tiny(encoding="rope")], tmp_path, store=SQLiteStore(db, timeout=0.2), progress=False)
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert _count(db) == 2
    assert tiny(encoding="rope").key() in SQLiteStore(db).keys()  # imported when opened again
    assert _count(db) == 3 and not list(tmp_path.glob("results.sqlite.pending*"))


def test_a_store_locked_for_a_while_makes_the_finisher_wait_not_the_suite(tmp_path):
    """The lock is held for 2 s while runs finish: they wait in a pending file, the suite goes on and
    ends with every run stored (before, the suite stopped with an error after the store's timeout)."""
    import threading
    import time

    db = tmp_path / "results.sqlite"
    SQLiteStore(db).close()
    other = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
    other.execute("BEGIN IMMEDIATE")
    released = []

    def release():
        time.sleep(2.0)
        other.execute("ROLLBACK")
        other.close()
        released.append(time.monotonic())

    threading.Thread(target=release, daemon=True).start()
    cfgs = [tiny(encoding="none"), tiny(encoding="rope"), tiny(encoding="sinusoidal")]
    lines = []
    t0 = time.monotonic()
    res = run_suite(cfgs, tmp_path, store=SQLiteStore(db, timeout=10), progress=False, log=lines.append)
    assert released and len(res) == 3 and _count(db) == 3
    assert any("locked by another process" in ln and "the other runs go on" in ln for ln in lines)
    assert any("free again" in ln for ln in lines)
    assert not list(tmp_path.glob("results.sqlite.pending*"))  # the pending file is gone once written
    assert time.monotonic() - t0 < 30


# ------------------------------------------------------------------------------------------ suites
SUITE = """
name = "mine"
description = "a test suite"
tasks = ["order"]
seeds = [0, 1]
encodings = ["rope", {name = "shaw", label = "shaw k=1", options = {max_relative_position = 1}},
             {name = "shaw", options = {max_relative_position = 4}}]

[settings]
steps = 5
batch_size = 8
d_model = 16
n_layers = 1
n_heads = 2
eval_samples = 32
train_lengths = [4, 8]
test_lengths = [8, 12]

[[grid]]

[[grid]]
tasks = ["adjacent"]
encodings = ["none"]
seeds = [3]
settings = {steps = 6}

[published]
source = "Someone et al."
metric = "accuracy"
columns = ["8", "12"]
rows = {rope = [99.0, 90.0], "shaw k=1" = [98.0, 97.0]}
"""


def _suite(text: str = SUITE, **edits):
    data = tomllib.loads(text)
    data.update(edits)
    return parse_suite(data, name="mine")


def test_suite_file_grid_labels_and_options(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text(SUITE)
    s = load_suite(path)
    jobs = s.jobs()
    assert len(jobs) == 3 * 2 + 1
    labels = [j.label for j in jobs if j.config.task == "order"]
    assert labels == ["rope", "rope", "shaw k=1", "shaw k=1"] + ["shaw(max_relative_position=4)"] * 2
    shaw = [j for j in jobs if j.label == "shaw k=1"][0].config
    assert shaw.encoding_options == {"max_relative_position": 1} and shaw.steps == 5
    adj = [j for j in jobs if j.config.task == "adjacent"]
    assert [(j.config.seed, j.config.steps) for j in adj] == [(3, 6)]
    # filters
    assert len(s.jobs(encodings=["shaw k=1"], seeds=[0])) == 1
    with pytest.raises(UnknownNameError, match="Did you mean: rope"):
        s.jobs(encodings=["rpoe"])


@pytest.mark.parametrize(
    "edit, match",
    [
        ({"seed": [0]}, r"unknown key 'seed'. Did you mean: seeds"),
        ({"tasks": ["ordr"]}, r"unknown task 'ordr'. Did you mean: order"),
        ({"encodings": ["sinusiodal"]}, r"Did you mean: sinusoidal"),
        ({"encodings": [{"name": "rope", "lable": "x"}]}, r"unknown key 'lable'. Did you mean: label"),
        ({"settings": {"step": 3}}, r"unknown key 'step'. Did you mean: steps"),
        ({"settings": {"train_lengths": [4, 16], "test_lengths": [8, 32]}}, r"shorter than the longest training"),
        (
            {"encodings": [{"name": "learned", "options": {"max_len": 10}}]},
            r"'learned'.*cannot reach test length 12.*max_len",
        ),
        ({"encodings": [{"name": "shaw", "options": {"max_relative": 2}}]}, r"does not take 'max_relative'"),
        ({"encodings": ["rope", {"name": "alibi", "label": "rope"}]}, r"share the label"),
        ({"seeds": []}, r"seeds must be a non-empty list"),
        ({"published": {"task": "copy"}}, r"published: task 'copy' is not a task of this suite"),
    ],
)
def test_suite_errors_are_clear(edit, match):
    data = tomllib.loads(SUITE)
    data.pop("grid")
    data.update(edit)
    with pytest.raises(PosencError, match=match):
        parse_suite(data, name="bad")


def test_unknown_suite_and_bad_toml(tmp_path):
    with pytest.raises(UnknownNameError, match="Did you mean: quick"):
        load_suite("quik")
    bad = tmp_path / "bad.toml"
    bad.write_text("name = [unclosed")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_suite(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        load_suite(tmp_path / "nope.toml")


def test_quick_suite_is_the_old_default():
    s = load_suite("quick")
    assert [j.key for j in s.jobs()] == [c.key() for c in bench.quick_suite()]


@pytest.mark.parametrize("name", available_suites())
def test_builtin_suites_are_valid(name):
    from posenc.bench.api import available_tasks
    from posenc.bench.suites import suite_path

    data = tomllib.loads(suite_path(name).read_text())
    tasks = {t for g in data.get("grid", [{}]) for t in g.get("tasks", data.get("tasks", []))}
    missing = tasks - set(available_tasks())
    if missing:
        pytest.skip(f"tasks {sorted(missing)} of suite {name!r} are not registered in this checkout")
    s = load_suite(name)
    assert s.jobs() and s.description
    if name != "quick":
        assert s.published, f"suite {name} reproduces a paper: it should carry the published numbers"


# ------------------------------------------------------------------------------------------ report
def _fake(task, encoding, seed, metrics, options=None, label=None):
    cfg = tiny(task=task, encoding=encoding, seed=seed, encoding_options=options or {}).as_dict()
    rec = {"key": f"{encoding}{seed}{options}", "config": cfg, "metric": "accuracy", "higher_is_better": True}
    rec.update(metrics=metrics, curve=[[1, 1.0], [5, 0.5]], train_seconds=1.0)
    if label:
        rec["label"] = label
    return rec


def test_leaderboard_mean_std_groups_by_label_and_published_side_by_side(tmp_path):
    runs = [
        _fake("order", "shaw", 0, {"8": 1.0, "12": 0.5}, {"max_relative_position": 0}),
        _fake("order", "shaw", 1, {"8": 0.8, "12": 0.7}, {"max_relative_position": 0}),
        _fake("order", "shaw", 0, {"8": 1.0, "12": 0.9}, {"max_relative_position": 4}, label="shaw k=4"),
    ]
    rows = leaderboard(runs)
    assert [r["label"] for r in rows] == ["shaw k=4", "shaw(max_relative_position=0)"]
    m, s = rows[1]["values"]["12"]
    assert m == pytest.approx(0.6) and s == pytest.approx(0.1414213562, rel=1e-6)  # statistics.stdev of .5, .7
    pub = {"source": "Shaw et al. 2018", "columns": ["BLEU"], "rows": {"shaw k=4": [25.9], "shaw k=0": [12.5]}}
    md = published_table(pub, rows)
    assert "| shaw k=4 | 25.9 | 1 | 90.0 |" in md and "| shaw k=0 | 12.5 | — | — |" in md and "shape" in md
    files = write_report(runs, tmp_path, published=pub)
    page = files["report"].read_text()
    assert "Beside the published numbers" in page and "25.9" in page and "data:image/png;base64" in page
    assert files["curves"].read_bytes()[:4] == b"\x89PNG"
    assert json.loads(files["leaderboard_json"].read_text())["rows"][0]["label"] == "shaw k=4"
    assert "± 14.1" in markdown_table(rows)


# ------------------------------------------------------------------------------------------ failures
@register_task
class _NeedsData(Task):
    name = "test-needs-data"
    description = "a task whose data package is missing (test only)"

    def run(self, cfg, on_step=None):
        from posenc.data import DataUnavailableError

        raise DataUnavailableError("data set 'x' needs the package posenc-data-x: pip install posenc-data-x")


def test_missing_data_is_recorded_and_other_runs_go_on(tmp_path, capsys):
    jobs = [tiny(encoding="none"), tiny(task="test-needs-data", encoding="none"), tiny(encoding="rope")]
    res = run_suite(jobs, tmp_path, progress=False)
    assert [r["config"]["encoding"] for r in res] == ["none", "rope"]
    assert len(res.failures) == 1 and "pip install posenc-data-x" in res.failures[0]["error"]
    store = SQLiteStore(tmp_path / "results.sqlite")
    assert len(store) == 2 and len(store.failures()) == 1
    # stop: raises with the message, keeps what was stored
    with pytest.raises(RunFailedError, match="pip install posenc-data-x"):
        run_suite(jobs, tmp_path, progress=False, on_error="stop")
    assert _count(tmp_path / "results.sqlite") == 2
    # the CLI: message on stderr, exit code 1, report written for the rest
    rc = main(
        ["bench", "--tasks", "order", "test-needs-data", "--encodings", "none", "--seeds", "0", "--steps", "5"]
        + ["--train-max", "8", "--test-lengths", "8", "--out", str(tmp_path / "cli"), "--quiet"]
    )
    captured = capsys.readouterr()
    assert rc == 1 and "pip install posenc-data-x" in captured.err and "1 run(s) failed" in captured.err
    assert (tmp_path / "cli" / "report.html").exists()


# ------------------------------------------------------------------------------------------ executors
def test_process_pool_gives_the_in_process_results(tmp_path):
    cfgs = [tiny(encoding="none", seed=0), tiny(encoding="rope", seed=1)]
    local = run_suite(cfgs, tmp_path / "local", progress=False)
    pool = run_suite(cfgs, tmp_path / "pool", progress=False, workers=2)
    assert len(pool) == len(local) == 2
    for a, b in zip(pool, local):
        _same_run(a, b)
    assert _count(tmp_path / "pool" / "results.sqlite") == 2


def test_ray_executor_on_a_local_cluster(tmp_path):
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'posenc[cluster]')")
    cfgs = [tiny(encoding="none"), tiny(encoding="sinusoidal")]
    local = run_suite(cfgs, tmp_path / "local", progress=False)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        remote = run_suite(cfgs, tmp_path / "ray", progress=False, executor="ray")
    finally:
        ray.shutdown()
    assert len(remote) == len(local) == 2
    for a, b in zip(remote, local):
        _same_run(a, b)
    assert _count(tmp_path / "ray" / "results.sqlite") == 2


def test_ddp_two_gloo_processes(tmp_path):
    cfg = tiny(encoding="rope", steps=6, batch_size=8)
    single = bench.run_one(cfg)
    res = run_suite([cfg], tmp_path, progress=False, ddp=2)
    assert res.failures == [] and len(res) == 1
    assert _count(tmp_path / "results.sqlite") == 1  # stored once (by the parent), not once per rank
    ddp = res[0]["extra"]["ddp"]
    assert ddp["world_size"] == 2 and ddp["wrapped"] and ddp["in_sync"]
    assert ddp["parameter_checksums"][0] == ddp["parameter_checksums"][1]
    # the same run as on one process, up to summation order: every rank has half of each batch
    assert res[0]["final_loss"] == pytest.approx(single["final_loss"], rel=1e-4)


# ------------------------------------------------------------------------------------------ CLI and API
def test_cli_suite_file_list_and_report_only(tmp_path, capsys):
    assert main(["bench", "--list-suites"]) == 0
    out = capsys.readouterr().out
    for name in ("quick", "alibi", "tener", "complex-order", "chomsky", "kazemnejad", "shaw-k"):
        assert name in out
    path = tmp_path / "mine.toml"
    path.write_text(SUITE)
    args = ["bench", "--suite", str(path), "--encodings", "rope", "--tasks", "order", "--seeds", "0"]
    assert main([*args, "--out", str(tmp_path / "o"), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "suite 'mine': 1 runs" in out and "Someone et al." in out
    assert _count(tmp_path / "o" / "results.sqlite") == 1
    assert main([*args, "--out", str(tmp_path / "o"), "--report-only"]) == 0
    assert "1 of 1 runs" in capsys.readouterr().out
    # a name the suite does not have
    assert main(["bench", "--suite", str(path), "--encodings", "alibi", "--out", str(tmp_path / "o")]) == 2
    assert "alibi" in capsys.readouterr().err


def test_python_api(tmp_path):
    suite = _suite()
    res = bench.run_suite(suite, out=tmp_path, progress=False, workers=1, executor="local")
    assert len(res) == 7 and res.suite is suite
    stored = bench.results(tmp_path)
    assert len(stored) == 7 and len(bench.results(tmp_path / "results.sqlite", task="adjacent")) == 1
    rows = bench.leaderboard(res)
    assert {r["label"] for r in rows} >= {"rope", "shaw k=1", "shaw(max_relative_position=4)", "none"}
    assert Job(tiny(encoding="shaw", encoding_options={"max_relative_position": 2})).label == (
        "shaw(max_relative_position=2)"
    )
