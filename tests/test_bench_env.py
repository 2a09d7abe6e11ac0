"""What a stored run says about where it ran, and what the report claims about real-data tasks.

Every run records the environment of the process that trained it (``record["env"]``:
posenc and its git commit, torch, the kernel path, CPU, threads, Python, platform); the
report lists them per suite and warns where one table mixes environments. Real-data
tasks claim no training lengths, and text classification ranks by the test split
only (the validation split is shown, not averaged in).

All but the first test use made-up records (no training).
"""

from __future__ import annotations

import json
import platform
import sqlite3

import pytest
import torch

import posenc
from posenc.bench import RunConfig, run_suite
from posenc.bench.api import Task, get_task, register_task
from posenc.bench.live import LiveBoard
from posenc.bench.report import leaderboard, markdown_table, published_table, write_report
from posenc.bench.runner import Job
from posenc.runenv import KEYS, run_environment

SMALL = dict(steps=5, batch_size=8, d_model=16, n_layers=1, n_heads=2, eval_samples=32)
ENV = {
    "posenc": "0.1.0",
    "git_commit": "0123456789abcdef0123456789abcdef01234567",
    "git_dirty": False,
    "torch": "2.5.0",
    "kernels": "native C (-march=native)",
    "cpu": "Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz",
    "threads": 1,
    "python": "3.11.7 (CPython)",
    "platform": "Linux-x86_64",
}


@register_task
class _SameLengthTask(Task):
    """Trained on chunks of exactly the longest training length, as the LM tasks are."""

    name = "test-env-same-length"
    description = "a made-up task trained at one length"

    def training_lengths(self, cfg):
        return (cfg.train_lengths[1], cfg.train_lengths[1])


@register_task
class _SplitOnlyTask(Task):
    """Evaluated on splits, with no ranking labels of its own: the report's rule ranks it by "test"."""

    name = "test-env-splits"
    description = "a made-up task evaluated on two splits"


def record(task, encoding, metrics, *, env=None, seed=0, **kw):
    cfg = RunConfig(task=task, encoding=encoding, seed=seed, **{**SMALL, **kw}).as_dict()
    rec = {
        "key": f"{task}/{encoding}/{seed}",
        "config": cfg,
        "metric": "accuracy",
        "higher_is_better": True,
        "metrics": metrics,
        "curve": [[1, 0.7], [5, 0.5]],
        "train_seconds": 0.5,
        "parameters": 1234,
        "suite": "made-up",
    }
    if env is not None:
        rec["env"] = env
    return rec


# ------------------------------------------------------------------------------- the record
def test_a_stored_run_records_its_environment(tmp_path):
    cfg = RunConfig(task="order", encoding="none", train_lengths=(4, 8), test_lengths=(8,), **SMALL)
    run_suite([cfg], tmp_path, progress=False)
    # read back with sqlite3 itself: the env is in the stored payload, not added when loading
    con = sqlite3.connect(tmp_path / "results.sqlite")
    (payload,) = con.execute("SELECT payload FROM runs").fetchone()
    con.close()
    env = json.loads(payload)["env"]
    assert tuple(env) == KEYS
    assert env["posenc"] == posenc.__version__ and env["torch"] == torch.__version__
    assert env["threads"] == torch.get_num_threads() and isinstance(env["threads"], int)
    assert env["python"].startswith(platform.python_version()) and env["platform"] == platform.platform()
    assert env["kernels"].startswith(("native C", "PyTorch")) and env["cpu"]
    assert env["git_commit"] is None or len(env["git_commit"]) == 40


def test_the_kernel_path_says_pytorch_when_the_native_kernels_are_off(monkeypatch):
    from posenc import native

    monkeypatch.setattr(native, "enabled", False)
    assert run_environment()["kernels"].startswith("PyTorch")


# ------------------------------------------------------------------------------- environments in the report
def test_old_records_without_env_still_load_and_report(tmp_path):
    res = [record("order", "rope", {"16": 0.9, "32": 0.8}), record("order", "none", {"16": 0.5, "32": 0.5})]
    files = write_report(res, tmp_path, "old store")
    page, md = files["report"].read_text(), files["leaderboard"].read_text()
    assert "not recorded" in page and "not recorded" in md
    assert "Warning" not in page and "Warning" not in md  # unknown is not different


def test_one_table_from_two_cpus_gets_a_warning(tmp_path):
    other = {**ENV, "cpu": "AMD EPYC 7R13 Processor"}
    res = [
        record("order", "rope", {"16": 0.9, "32": 0.8}, env=ENV),
        record("order", "none", {"16": 0.5, "32": 0.5}, env=other),
        record("adjacent", "rope", {"16": 0.9, "32": 0.8}, env=ENV),
        record("adjacent", "none", {"16": 0.5, "32": 0.5}, env={**ENV, "threads": 4}),  # threads: not warned
    ]
    table = markdown_table(leaderboard(res))
    order, adjacent = table.split("**order**")[1], table.split("**order**")[0]
    assert "Warning" in order and "AMD EPYC 7R13 Processor" in order and "Xeon" in order
    assert "Warning" not in adjacent
    files = write_report(res, tmp_path, "two machines")
    page, md = files["report"].read_text(), files["leaderboard"].read_text()
    results = page.split('id="results"')[1].split('id="plots"')[0]
    assert results.count("class=warn") == 1 and "AMD EPYC 7R13 Processor" in results
    # the environment section lists both environments of the suite, with the commit
    env_section = page.split('id="environment"')[1]
    assert "AMD EPYC 7R13 Processor" in env_section and "Xeon" in env_section and "0123456789" in env_section
    assert "native C (-march=native)" in md.split("## Environment")[1]
    # a different kernel path or torch is warned about too
    res = [
        record("order", "rope", {"16": 0.9, "32": 0.8}, env=ENV),
        record("order", "none", {"16": 0.5, "32": 0.5}, env={**ENV, "kernels": "PyTorch (native kernels off: x)"}),
    ]
    assert "Warning" in markdown_table(leaderboard(res))


# ------------------------------------------------------------------------------- real-data tables
def _text_runs(task: str) -> list[dict]:
    """Valid and test disagree: rope is ahead on valid (and on the mean of all three), none on test."""
    return [
        record(task, "rope", {"test": 0.80, "valid": 0.95, "test_long": 0.80}),
        record(task, "none", {"test": 0.85, "valid": 0.60, "test_long": 0.70}),
    ]


def test_text_tasks_claim_no_training_lengths(tmp_path):
    rows = leaderboard(_text_runs("mr"))
    assert get_task("mr").training_lengths(RunConfig(task="mr", **SMALL)) is None
    assert get_task("msra-ner").training_lengths(RunConfig(task="msra-ner", **SMALL)) is None
    assert "trained on" not in markdown_table(rows)
    files = write_report(_text_runs("mr"), tmp_path, "text")
    page, md = files["report"].read_text(), files["leaderboard"].read_text()
    assert "trained on" not in page and "trained on" not in md
    assert "not used" in page  # the settings do not show the config's lengths as if they were trained on
    assert "4–16" not in page


def test_a_task_trained_at_one_length_says_so():
    lengths = dict(train_lengths=(4, 64), test_lengths=(64, 128))
    res = [record("test-env-same-length", "rope", {"64": 0.9, "128": 0.8}, **lengths)]
    assert "trained on length 64" in markdown_table(leaderboard(res))
    lm = get_task("ptb-lm")
    assert lm.training_lengths(RunConfig(task="ptb-lm", **lengths, **SMALL)) == (64, 64)
    # a length task keeps its claim
    res = [record("order", "rope", {"16": 0.9, "32": 0.8})]
    assert "trained on lengths ≤ 16" in markdown_table(leaderboard(res))


@pytest.mark.parametrize("task", ["mr", "trec", "test-env-splits"])
def test_text_tasks_rank_by_test_not_by_a_mean_with_valid(task):
    rows = leaderboard(_text_runs(task))
    assert [r["label"] for r in rows] == ["none", "rope"]  # test: 85 > 80 (the mean of all three says rope)
    assert rows[0]["ranked_by"] == ["test"] and rows[0]["in_distribution"] == pytest.approx(0.85)
    table = markdown_table(rows)
    assert "ranked by test" in table
    head = next(line for line in table.splitlines() if line.startswith("| #"))
    assert "valid" in head and "test_long" in head  # still shown
    pub = {"task": task, "source": "someone", "rows": {"none": 1.0}}
    assert "ours (ranked by test)" in published_table(pub, rows)


def test_the_live_board_ranks_text_tasks_by_test():
    jobs = [Job(RunConfig(task="mr", encoding=e, **SMALL)) for e in ("rope", "none")]
    board = LiveBoard(jobs, None, progress=False, live=False, per_step=False, fresh=True)
    for job, rec in zip(jobs, _text_runs("mr")):
        assert board._score({**rec, "label": job.label}) == rec["metrics"]["test"]
    assert board.leaders("mr").startswith("none")


def test_the_commit_is_the_checkout_s_where_posenc_runs_from_one():
    """A checkout's commit is recorded (independent truth: git itself); None only where posenc is not tracked."""
    import shutil
    import subprocess
    from pathlib import Path

    from posenc.runenv import git_state

    pkg = Path(posenc.__file__).resolve().parent
    git = shutil.which("git")
    tracked = git and subprocess.run([git, "ls-files", "--error-unmatch", "__init__.py"], cwd=pkg,
                                     capture_output=True).returncode == 0
    commit, dirty = git_state()
    if not tracked:
        assert commit is None and dirty is None
        return
    head = subprocess.run([git, "rev-parse", "HEAD"], cwd=pkg, capture_output=True, text=True).stdout.strip()
    assert commit == head and isinstance(dirty, bool)
