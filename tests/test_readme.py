"""The README stays true: its table is the one the registry generates, its quick start exists.

Its code blocks (and those of docs/*.md) run in tests/test_docs_examples.py.
"""

import pathlib
import re
import sys

import pytest

from posenc import readme_table

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def test_table_is_the_generated_one():
    text = README.read_text(encoding="utf-8")
    have, want = readme_table.current(text), readme_table.table()
    if have != want:
        stale = sorted(set(have.splitlines()) ^ set(want.splitlines()))
        raise AssertionError(
            f"README.md's table of encodings is not the one the registry generates; run: {readme_table.COMMAND}\n"
            "rows that differ:\n" + "\n".join(stale[:10])
        )


def test_table_command_is_documented():
    assert "posenc readme-table --write README.md" in README.read_text(encoding="utf-8")


def test_quick_start_commands_exist():
    text = README.read_text(encoding="utf-8")
    for cmd in ("bash scripts/bench.sh", "bash scripts/test.sh"):
        assert cmd in text
        assert (ROOT / cmd.split()[1]).exists()
    assert "scripts/test.sh" in (ROOT / ".ci" / "run").read_text()



def _python_blocks(text: str) -> list[str]:
    return [m.group(1) for m in re.finditer(r"^```python\n(.*?)^```", text, flags=re.S | re.M)]


def test_the_use_it_block_prints_what_its_comments_say():
    """Each ``print(...)  # <kernel>: ...`` line of the README's "Use it" block prints a plan of that kernel."""
    from posenc.attention import KERNELS

    code = next(b for b in _python_blocks(README.read_text(encoding="utf-8")) if "shaw.plan(" in b)
    printed: list[tuple[int, str]] = []

    def record(*args, **kwargs):
        printed.append((sys._getframe(1).f_lineno, " ".join(map(str, args))))

    exec(compile(code, "README-use-it", "exec"), {"__name__": "__main__", "print": record})
    lines = code.splitlines()
    checked = 0
    for lineno, out in printed:
        comment = lines[lineno - 1].partition("  # ")[2]
        said = comment.split(":")[0].strip()
        if said in KERNELS:
            assert out.startswith(f"{said}:"), f"README line {lines[lineno - 1]!r} prints {out!r}"
            checked += 1
    assert checked >= 1


def test_readme_python_blocks_stand_alone():
    """Each Python block of the README defines every name it uses (a reader copies one block): ruff's F821 on each
    block alone (tests/test_docs_examples.py runs each in a namespace of its own and lints it fully)."""
    import subprocess

    ruff = pathlib.Path(sys.executable).parent / "ruff"
    if not ruff.exists():
        pytest.skip("ruff is not installed next to this interpreter")
    for code in _python_blocks(README.read_text(encoding="utf-8")):
        r = subprocess.run(
            [str(ruff), "check", "--no-cache", "--select", "F821", "--stdin-filename", "block.py", "-"],
            input=code,
            capture_output=True,
            text=True,
        )
        assert r.returncode == 0, f"a README block uses names it does not define:\n{r.stdout}\n{code}"
