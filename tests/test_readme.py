"""The README stays true: its code runs, and its table lists every registered encoding."""

import pathlib
import re

import posenc

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_python_examples_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks
    for code in blocks:
        exec(compile(code, str(README), "exec"), {})


def test_table_lists_every_encoding_with_its_reference():
    text = README.read_text()
    table = text.split("<!-- encodings:start -->")[1].split("<!-- encodings:end -->")[0]
    for name in posenc.available():
        row = next((line for line in table.splitlines() if line.startswith(f"| `{name}` |")), None)
        assert row is not None, f"{name} missing from the README table: run python scripts/update_readme_table.py"
        assert row.rstrip().endswith(f"| {posenc.resolve(name).info.reference} |")


def test_quick_start_commands_exist():
    text = README.read_text()
    for cmd in ("bash scripts/bench.sh", "bash scripts/test.sh"):
        assert cmd in text
        assert (README.parent / cmd.split()[1]).exists()
    assert "scripts/test.sh" in (README.parent / ".ci" / "run").read_text()
