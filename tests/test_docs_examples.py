"""Every code block of README.md and docs/*.md runs here, or is marked as not run, with the reason.

The mark is an HTML comment on the line before the block's opening fence (blank lines between
are allowed); it is invisible on a rendered page and says why in the source:

    <!-- not run: the whole quick benchmark (minutes) -->
    ```bash
    bash scripts/bench.sh
    ```

What runs, and how (each in an empty temporary folder, with the interpreter running the tests,
i.e. the .venv's, and OMP_NUM_THREADS=1):

* ``python``: the blocks of one file in order, in a fresh interpreter, each in a namespace of its own
  (a reader copies one block, not the page: a block defines every name it uses), as ``__main__``. A
  traceback names the Markdown file and line.
* ``bash``, ``sh``, ``shell``: each block as a script under ``set -euo pipefail``, with the .venv's
  ``bin`` first on PATH (``posenc`` and ``python`` are the installed ones). ``console``: the
  lines that start with ``$ ``.
* ``toml``: a suite file (docs/bench.md), loaded and validated by ``posenc.bench.load_suite``.

Every Python block that runs is also linted with ruff under the project's own configuration
(pyproject.toml), as a user's file would be after pasting it, alone: an example that fails ``ruff check``
(unsorted imports, a name an earlier block defined ...) fails here.

A block without a language, or ``text``, is not code. Any other language must be marked.
Every ``posenc ...`` line of a shell block, run or marked, must parse with posenc's own
argument parser, so that a renamed option cannot hide in a block that is not run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

PYTHON = {"python", "py"}
SHELL = {"bash", "sh", "shell", "console"}
TOML = {"toml"}
TEXT = {"", "text"}
MARK = re.compile(r"<!--\s*not run:(.*?)-->")
FENCE = re.compile(r"^(\s*)(`{3,})\s*([\w+-]*)[^`]*$")
TIMEOUT = 600


@dataclasses.dataclass
class Block:
    doc: pathlib.Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    reason: str | None  # why it is not run (None: it runs)

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def parse(doc: pathlib.Path) -> tuple[list[Block], list[str]]:
    """The fenced blocks of ``doc``, and the problems of its marks (a mark not followed by a block, no reason)."""
    lines = doc.read_text(encoding="utf-8").splitlines()
    blocks, problems = [], []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, ticks, lang = m.group(1), m.group(2), m.group(3).lower()
        start = i
        i += 1
        body = []
        while i < len(lines) and lines[i].strip() != ticks:
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
            i += 1
        i += 1  # the closing fence
        reason = None
        j = start - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        mark = MARK.search(lines[j]) if j >= 0 else None
        if mark:
            reason = mark.group(1).strip()
            if not reason:
                problems.append(f"{doc.relative_to(ROOT)}:{j + 1}: a 'not run' mark without its reason")
        blocks.append(Block(doc, start + 1, lang, "\n".join(body) + "\n", reason))
    marked = {b.line for b in blocks if b.reason is not None}
    for n, text in enumerate(lines, 1):
        if MARK.search(text):
            k = n  # the next non-blank line must open a block
            while k < len(lines) and not lines[k].strip():
                k += 1
            if k + 1 not in marked:
                problems.append(f"{doc.relative_to(ROOT)}:{n}: a 'not run' mark with no code block right after it")
    return blocks, problems


BLOCKS = {doc: parse(doc)[0] for doc in DOCS}


def _id(doc: pathlib.Path) -> str:
    return str(doc.relative_to(ROOT))


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = str(pathlib.Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env["OMP_NUM_THREADS"] = "1"
    env["MPLBACKEND"] = "Agg"
    return env


def _to_run(kinds: set[str]) -> list[Block]:
    return [b for blocks in BLOCKS.values() for b in blocks if b.lang in kinds and b.reason is None]


@pytest.mark.parametrize("doc", DOCS, ids=_id)
def test_every_block_is_run_or_marked(doc):
    blocks, problems = parse(doc)
    for b in blocks:
        if b.reason is None and b.lang not in PYTHON | SHELL | TOML | TEXT:
            problems.append(
                f"{b.where}: a ```{b.lang} block that this test cannot run: "
                "mark it with <!-- not run: REASON --> on the line before"
            )
    assert not problems, "\n".join(problems)


# The driver that runs one file's Python blocks in a fresh interpreter. Each block is compiled
# with its own file name and line numbers, so that a traceback points into the Markdown.
DRIVER = r"""
import json, sys, traceback
for path, line, code in json.load(sys.stdin):
    ns = {"__name__": "__main__"}  # each block on its own, as a reader pastes it
    try:
        exec(compile("\n" * line + code, path, "exec"), ns)
    except BaseException:
        print(f"\nthe block at {path}:{line} failed:", file=sys.stderr)
        traceback.print_exc()
        sys.exit(1)
"""


@pytest.mark.parametrize("doc", sorted({b.doc for b in _to_run(PYTHON)}, key=DOCS.index), ids=_id)
def test_python_blocks_run(doc, tmp_path):
    blocks = [b for b in BLOCKS[doc] if b.lang in PYTHON and b.reason is None]
    payload = json.dumps([[str(b.doc), b.line, b.code] for b in blocks])
    r = subprocess.run(
        [sys.executable, "-c", DRIVER],
        input=payload,
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert r.returncode == 0, f"{_id(doc)}: a Python block failed\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"


def lint(code: str, name: str) -> str:
    """ruff's findings on ``code`` under the project's configuration ("" when clean)."""
    ruff = pathlib.Path(sys.executable).parent / "ruff"
    if not ruff.exists():
        pytest.skip("ruff is not installed next to this interpreter (bash scripts/setup.sh test installs it)")
    cmd = [str(ruff), "check", "--no-cache", "--output-format", "concise", "--stdin-filename", str(ROOT / name), "-"]
    r = subprocess.run(cmd, input=code, cwd=ROOT, capture_output=True, text=True, timeout=120)
    return "" if r.returncode == 0 else (r.stdout + r.stderr).strip()


@pytest.mark.parametrize("doc", sorted({b.doc for b in _to_run(PYTHON)}, key=DOCS.index), ids=_id)
def test_python_blocks_pass_ruff(doc):
    found = []
    for b in [b for b in BLOCKS[doc] if b.lang in PYTHON and b.reason is None]:
        # a name of its own per block: the project's per-file ignores (tests/*, ...) do not apply to it
        out = lint(b.code, f"doc_block_{doc.stem}_{b.line}.py")
        if out:
            found.append(f"{b.where}: ruff check fails on this block as written, alone:\n{out}")
    assert not found, "\n\n".join(found)


def test_each_block_runs_in_a_namespace_of_its_own(tmp_path):
    """The driver itself: a block that uses a name the block before it defined fails, and names its line."""
    doc = [["page.md", 3, "x = 1\n"], ["page.md", 7, "print(x)\n"]]
    r = subprocess.run(
        [sys.executable, "-c", DRIVER], input=json.dumps(doc), cwd=tmp_path, capture_output=True, text=True,
        timeout=120,
    )
    assert r.returncode == 1 and "the block at page.md:7 failed" in r.stderr and "NameError" in r.stderr


def test_the_linter_sees_an_unsorted_import_and_an_undefined_name():
    """The check itself: I001 (the MyBias example's old import block) and F821 (a block that is not standalone)."""
    bad = "import torch\nfrom torch import nn\nfrom posenc.base import Card\n\nprint(torch, nn, Card, prompt)\n"
    out = lint(bad, "doc_block_x.py")
    assert "I001" in out and "F821" in out and "prompt" in out
    assert lint("import torch\n\nprint(torch.pi)\n", "doc_block_x.py") == ""


def _commands(block: Block) -> str:
    if block.lang != "console":
        return block.code
    return "\n".join(line[2:] for line in block.code.splitlines() if line.startswith("$ ")) + "\n"


@pytest.mark.parametrize("block", _to_run(SHELL), ids=lambda b: b.where)
def test_shell_block_runs(block, tmp_path):
    script = tmp_path / "block.sh"
    script.write_text("set -euo pipefail\n" + _commands(block))
    r = subprocess.run(["bash", str(script)], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 0, (
        f"{block.where}: the shell block failed (exit {r.returncode})\n{block.code}\n"
        f"stdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"
    )


@pytest.mark.parametrize("block", _to_run(TOML), ids=lambda b: b.where)
def test_toml_block_is_a_suite_that_loads(block, tmp_path):
    from posenc import bench

    path = tmp_path / "suite.toml"
    path.write_text(block.code)
    try:
        suite = bench.load_suite(path)
    except Exception as exc:  # noqa: BLE001 -- any failure is the doc's
        pytest.fail(f"{block.where}: the suite file does not load: {type(exc).__name__}: {exc}")
    assert suite.jobs()


def posenc_commands(block: Block) -> list[list[str]]:
    """The ``posenc ...`` command lines of a shell block, each as its arguments after ``posenc``."""
    text = re.sub(r"\\\n", " ", _commands(block))
    out = []
    for line in text.splitlines():
        for part in re.split(r"&&|\|\||;|\|", line):
            try:
                words = shlex.split(part, comments=True)
            except ValueError:
                continue
            while words and re.fullmatch(r"\w+=\S*", words[0]):  # VAR=value posenc ...
                words = words[1:]
            if words and (words[0] == "posenc" or words[0].endswith("/posenc")):
                out.append(words[1:])
    return out


@pytest.mark.parametrize("doc", [d for d in DOCS if any(b.lang in SHELL for b in BLOCKS[d])], ids=_id)
def test_posenc_commands_parse(doc):
    from posenc.cli import build_parser

    bad = []
    for b in BLOCKS[doc]:
        if b.lang not in SHELL:
            continue
        for argv in posenc_commands(b):
            err = io.StringIO()
            try:
                with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                    build_parser().parse_args(argv)
            except SystemExit as exc:
                if exc.code:
                    bad.append(f"{b.where}: posenc {shlex.join(argv)}\n  {err.getvalue().strip()}")
    assert not bad, "\n".join(bad)


def test_the_parser_finds_blocks_and_marks(tmp_path):
    """The test's own parsing: fences, languages, marks and their problems."""
    global ROOT
    doc = tmp_path / "x.md"
    doc.write_text(
        "# x\n\n```python\nprint(1)\n```\n\n<!-- not run: needs a GPU -->\n\n```bash\nposenc bench\n```\n"
        "\n<!-- not run: -->\n```sh\nls\n```\n\n<!-- not run: dangling -->\ntext\n\n  ```\n  layout\n  ```\n"
    )
    old, ROOT = ROOT, tmp_path
    try:
        blocks, problems = parse(doc)
    finally:
        ROOT = old
    assert [(b.line, b.lang, b.reason) for b in blocks] == [
        (3, "python", None),
        (9, "bash", "needs a GPU"),
        (14, "sh", ""),
        (21, "", None),
    ]
    assert blocks[0].code == "print(1)\n" and blocks[3].code == "layout\n"
    assert posenc_commands(blocks[1]) == [["bench"]]
    assert len(problems) == 2 and "without its reason" in problems[0] and "no code block" in problems[1]
