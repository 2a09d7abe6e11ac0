"""docs/tasks.md runs: its Python blocks, in order and in one namespace, in a fresh interpreter in an
empty folder (as tests/test_docs_examples.py runs every page's), and they print what the page says."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "tasks.md"

DRIVER = r"""
import json, sys
ns = {"__name__": "__main__"}
for path, line, code in json.load(sys.stdin):
    exec(compile("\n" * line + code, path, "exec"), ns)
"""


def python_blocks(text: str) -> list[tuple[int, str]]:
    lines = text.splitlines()
    out, i = [], 0
    while i < len(lines):
        if re.match(r"^```python\s*$", lines[i]):
            j = i + 1
            while lines[j].strip() != "```":
                j += 1
            out.append((i + 1, "\n".join(lines[i + 1 : j]) + "\n"))
            i = j
        i += 1
    return out


def test_tasks_doc_examples_run(tmp_path):
    blocks = python_blocks(DOC.read_text())
    assert len(blocks) >= 4
    payload = json.dumps([[str(DOC), line, code] for line, code in blocks])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}
    r = subprocess.run(
        [sys.executable, "-c", DRIVER],
        input=payload,
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    out = r.stdout.splitlines()
    assert out[0].startswith("{'6': ") and "'8_token'" in out[0]  # the SeqTask's metrics
    assert out[1].startswith("none {'8': ") and out[2].startswith("rope {'8': ")  # the own-loop task, two runs
    assert out[3] == "True" and out[4] == "1 src-"
    assert (tmp_path / "doc-results" / "results.sqlite").exists() and (tmp_path / "my_tasks.py").exists()
