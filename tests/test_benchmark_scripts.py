"""The scripts of benchmarks/: their shared harness, and their reports of the committed results.

The truths: the Markdown tables committed beside each results JSON (``benchmarks/results/<tag>.md``, written by
the report of the code that measured them: a report must still render them to the byte), and a worker script
written here whose records are known in advance (a run stores them, a second run measures nothing again, a
failed case is retried only where the benchmark asks for it). Nothing here times anything.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import attention_report  # noqa: E402
import harness  # noqa: E402
import models_report  # noqa: E402


@pytest.mark.parametrize(
    ("module", "tag"),
    [
        (attention_report, "cpu-fp32"),  # with its side-by-side parts (cpu-fp32.part-*.json)
        (models_report, "models-cpu-fp32"),
        (models_report, "models-cpu-fp32-round2"),
        (models_report, "hf-patch-cpu-fp32-round2"),
    ],
)
def test_reports_render_the_committed_tables(module, tag, tmp_path, monkeypatch, capsys) -> None:
    for f in (BENCH / "results").glob(f"{tag}*.json"):
        shutil.copy(f, tmp_path)
    monkeypatch.setattr(module, "RESULTS", tmp_path)
    module.report(argparse.Namespace(tag=tag, metric="cpu", no_plot=True))
    capsys.readouterr()
    assert (tmp_path / f"{tag}.md").read_text() == (BENCH / "results" / f"{tag}.md").read_text()


WORKER = """
import sys
sys.path.insert(0, {bench!r})
import harness

def measure(spec):
    if spec["case"] == "bad":
        raise SystemExit("this case fails")
    return {{"case": spec["case"], "L": spec["L"], "value": 2 * spec["L"]}}

harness.serve_worker(measure)
"""


def test_a_run_stores_resumes_and_retries_what_it_is_told(tmp_path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(bench=str(BENCH)))
    store = harness.Store(tmp_path / "results" / "t.json", key=lambda r: (r["case"], r["L"]))
    measured = []

    def measure(job):
        measured.append(job)
        return harness.fresh_process(script, {"case": job[0], "L": job[1]}, harness.worker_env(1), 60)[0]

    jobs = [((c, L), (c, L)) for c in ("good", "bad") for L in (1, 2)]
    harness.run_cases(store, jobs, measure, str, store.keys())
    assert len(measured) == 4
    records = json.loads((tmp_path / "results" / "t.json").read_text())
    assert {(r["case"], r["L"]): r.get("value") for r in records} == {
        ("good", 1): 2,
        ("good", 2): 4,
        ("bad", 1): None,
        ("bad", 2): None,
    }
    assert all("this case fails" in r["error"] for r in records if r["case"] == "bad")

    measured.clear()  # a second run of the same store: nothing again; with failed=False, the failures again
    again = harness.Store(store.path, store.key)
    harness.run_cases(again, jobs, measure, str, again.keys())
    assert measured == []
    harness.run_cases(again, jobs, measure, str, again.keys(failed=False))
    assert measured == [("bad", 1), ("bad", 2)]
    assert len(json.loads(store.path.read_text())) == 4  # replaced, not appended


def test_rounds_alternate_and_the_timed_loop_interleaves() -> None:
    assert harness.round_order(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert harness.round_order(["a", "b", "c"], 1) == ["c", "b", "a"]
    calls = []
    t = harness.timed(((n, lambda n=n: calls.append(n)) for _ in range(3) for n in ("fwd", "step")), threads=1)
    assert calls == ["fwd", "step"] * 3
    assert {k: len(v) for k, v in t.cpu.items()} == {"fwd": 3, "step": 3} == {k: len(v) for k, v in t.wall.items()}
    assert set(t.summary()) == {"cpu_util", "loadavg_1m"}
    assert harness.spread("step", [3.0, 1.0, 2.0]) == {"step_s": 2.0, "step_min_s": 1.0, "step_max_s": 3.0}


# the modules of benchmarks/, bottom to top: each imports at module level only the standard library and the ones
# below it; torch, transformers and posenc inside functions, so that a report needs none of them and a worker
# (under either interpreter, transformers 5 or 4.57) loads only what its case builds
LAYERS = [
    ["harness"],
    ["attention_cases"],
    ["model_cases"],
    ["attention_report", "models_report"],
    ["bench_attention", "bench_models"],
]


def test_benchmark_modules_import_only_downwards_at_module_level() -> None:
    import ast

    level = {m: i for i, names in enumerate(LAYERS) for m in names}
    for name, i in level.items():
        tree = ast.parse((BENCH / f"{name}.py").read_text())
        for node in tree.body:
            if isinstance(node, ast.Import | ast.ImportFrom):
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
                for m in mods:
                    top = m.split(".")[0]
                    ok = top in sys.stdlib_module_names or top == "__future__" or level.get(top, 99) < i
                    assert ok, f"{name}.py imports {m} at module level"
