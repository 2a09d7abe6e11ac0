"""The command line and the first version of the benchmark."""

import json
import sqlite3
import subprocess
import sys

import pytest
import torch

import posenc
from posenc.bench import RunConfig, run_suite, write_report
from posenc.bench.runner import ResultStore
from posenc.bench.tasks.order import A, B, adjacent_task, order_task
from posenc.cli import main
from posenc.errors import ConfigError, UnknownNameError


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models run fastest on one thread (and on a shared machine two threads can be 100x slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_version_and_help(capsys):
    with pytest.raises(SystemExit):
        main(["--version"])
    assert posenc.__version__ in capsys.readouterr().out
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "bench" in out and "list" in out and "examples" in out


def test_list_shows_every_encoding(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for name in posenc.available():
        assert f"\n{name} " in out or out.startswith(name)
    assert main(["list", "--markdown"]) == 0
    md = capsys.readouterr().out
    assert md.count("\n| `") == len(posenc.available())


def test_unknown_encoding_is_a_clear_cli_error(capsys):
    assert main(["bench", "--encodings", "sinusiodal"]) == 2
    assert "Did you mean: sinusoidal" in capsys.readouterr().err


def test_module_entry_point():
    out = subprocess.run([sys.executable, "-m", "posenc", "list"], capture_output=True, text=True, check=True)
    assert "rope" in out.stdout


@pytest.mark.parametrize("task", [order_task, adjacent_task])
def test_tasks_are_balanced_and_labels_follow_positions(task):
    g = torch.Generator().manual_seed(0)
    batch = task(2000, (4, 16), g)
    assert 0.4 < batch.labels.float().mean() < 0.6
    for row, label, keep in zip(batch.tokens, batch.labels, batch.attention_mask):
        i = int((row == A).nonzero()[0])
        j = int((row == B).nonzero()[0])
        assert int((row == A).sum()) == 1 and int((row == B).sum()) == 1
        assert keep[i] and keep[j]
        want = (i < j) if task is order_task else abs(i - j) == 1
        assert bool(label) == want


def test_order_task_bag_of_words_is_uninformative():
    # the multiset of tokens is independent of the label: A and B once each, the rest filler
    g = torch.Generator().manual_seed(1)
    batch = order_task(4000, (8, 8), g)
    counts = torch.stack([(batch.tokens == t).sum(1) for t in range(16)], 1).float()
    pos, neg = counts[batch.labels == 1].mean(0), counts[batch.labels == 0].mean(0)
    assert torch.allclose(pos, neg, atol=0.15)


def test_run_config_validation():
    with pytest.raises(ConfigError, match="shorter than the longest training length 16"):
        RunConfig(test_lengths=(8, 32))
    with pytest.raises(UnknownNameError, match="task"):
        RunConfig(task="sorting")
    with pytest.raises(UnknownNameError, match="encoding"):
        RunConfig(encoding="alibii")
    with pytest.raises(ConfigError, match="steps"):
        RunConfig(steps=0)
    with pytest.raises(ConfigError, match="model must be one of"):
        RunConfig(model="seq2seq")
    with pytest.raises(ConfigError, match="unknown run settings"):
        RunConfig.from_dict({"task": "order", "stepz": 3})
    assert RunConfig(task="order").model == "encoder"
    assert RunConfig().key() == RunConfig().key() != RunConfig(seed=1).key()


def _tiny(**kw):
    base = dict(
        steps=120,
        batch_size=32,
        d_model=32,
        n_layers=1,
        n_heads=2,
        eval_samples=128,
        train_lengths=(4, 8),
        test_lengths=(8, 16),
    )
    base.update(kw)
    return RunConfig(**base)


def test_suite_learns_order_resumes_and_reports(tmp_path):
    configs = [_tiny(encoding="none"), _tiny(encoding="rope")]
    results = run_suite(configs, tmp_path, progress=False)
    acc = {r["config"]["encoding"]: r["metrics"]["8"] for r in results}
    # over seeds 0-5, native kernels on and off: rope 1.0 every time, none 0.48-0.57
    assert acc["rope"] > 0.9  # order decides the answer and RoPE sees order
    assert 0.35 < acc["none"] < 0.65  # a position-insensitive model is at chance
    # a second call finds both runs finished and runs nothing (one row per run in the SQLite store)
    con = sqlite3.connect(tmp_path / "results.sqlite")
    rows = con.execute("SELECT key FROM runs ORDER BY key").fetchall()
    again = run_suite(configs, tmp_path, progress=False)
    assert again == results and con.execute("SELECT key FROM runs ORDER BY key").fetchall() == rows
    con.close()
    files = write_report(results, tmp_path)
    data = json.loads(files["results"].read_text())
    assert {r["encoding"] for r in data["leaderboard"]} == {"none", "rope"}
    png = files["plot"].read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert "rope" in files["leaderboard"].read_text() and "<table" in files["report"].read_text()


def test_legacy_jsonl_store_tolerates_a_cut_line_and_rejects_corruption(tmp_path):
    # the JSON-lines file of the first version: still read (and imported into results.sqlite)
    store = ResultStore(tmp_path / "results.jsonl")
    store.add({"key": "a", "config": {"task": "order"}})
    with (tmp_path / "results.jsonl").open("a") as f:
        f.write('{"key": "trunc')
    assert set(store.load()) == {"a"}
    store.add({"key": "b", "config": {"task": "order"}})
    assert set(store.load()) == {"a", "b"}
    (tmp_path / "results.jsonl").write_text("garbage\n" + json.dumps({"key": "k"}) + "\n")
    with pytest.raises(ConfigError, match="corrupt"):
        store.load()


def test_unreachable_length_is_recorded_not_fatal(tmp_path):
    cfg = _tiny(encoding="binary", steps=3, d_model=4, n_heads=1, test_lengths=(8, 16, 32))
    # d_model=4 bits code positions 0..15 only; length 32 cannot be encoded
    res = run_suite([cfg], tmp_path, progress=False)[0]
    assert res["metrics"]["32"] is None and "0..15" in res["metrics"]["32_error"]
    assert res["metrics"]["8"] is not None


def test_cli_bench_end_to_end(tmp_path, capsys):
    rc = main(
        [
            "bench",
            "--encodings",
            "none",
            "rope",
            "--tasks",
            "order",
            "--seeds",
            "0",
            "--steps",
            "5",
            "--train-max",
            "8",
            "--test-lengths",
            "8",
            "16",
            "--out",
            str(tmp_path),
            "--quiet",
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "| 1 | " in out and "rope" in out and "finished in" in out
    assert (tmp_path / "report.html").exists() and (tmp_path / "accuracy_vs_length.png").exists()


def test_info_says_whether_the_compiled_kernels_are_used(capsys):
    from posenc import native

    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("posenc ") and "threads" in out
    assert native.status() in out
    assert ("native CPU kernels: /" in out) == native.available()


def test_report_only_without_suite_reports_the_suite_of_the_stored_runs(tmp_path, capsys):
    """`posenc bench --report-only --out DIR` on a store of a built-in suite reports that suite, not an empty
    quick suite (which used to overwrite the store's report with nothing)."""
    from posenc.bench.store import open_store
    from posenc.bench.suites import load_suite

    job = load_suite("shaw-k").jobs()[0]
    record = {
        "key": job.key,
        "config": job.config.as_dict(),
        "metric": "accuracy",
        "higher_is_better": True,
        "metrics": {"16": 0.75, "32": 0.5, "64": 0.5},
        "curve": [[1, 0.7]],
        "train_seconds": 1.0,
        "label": job.label,
        "suite": "shaw-k",
    }
    with open_store(tmp_path / "results.sqlite") as store:
        store.add(record)
    assert main(["bench", "--report-only", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"1 of {len(load_suite('shaw-k').jobs())} runs of suite 'shaw-k'" in out
    assert f"| {job.label} | 75.0 (1 seed) |" in out and "± 0.0" not in out  # one seed: no spread to show
