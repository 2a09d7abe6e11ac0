"""The README stays true: its table is the one the registry generates, its quick start exists.

Its code blocks (and those of docs/*.md) run in tests/test_docs_examples.py.
"""

import pathlib

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
