"""The README stays a true front page: its tables are the ones the registry and the results data generate, its quick
start exists, it is short (the long sections live in docs/, on the site).

Its code blocks (and those of docs/*.md) run in tests/test_docs_examples.py.
"""

import pathlib
import re
import sys

import pytest

from posenc import readme_table

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
ENCODINGS = ROOT / "docs" / "encodings.md"
#: the front page's limit in bytes (issue 40: it was 48 KB; the long sections moved to docs/)
MAX_BYTES = 15_000


def _same(path: pathlib.Path, have: str, want: str) -> None:
    if have != want:
        stale = sorted(set(have.splitlines()) ^ set(want.splitlines()))
        raise AssertionError(
            f"{path.relative_to(ROOT)}'s table of encodings is not the one the registry generates; run: "
            f"{readme_table.COMMAND}\nrows that differ:\n" + "\n".join(stale[:10])
        )


def test_table_is_the_generated_one():
    """The README's short table and docs/encodings.md's full one are what the registry generates."""
    _same(README, readme_table.current(README.read_text(encoding="utf-8"), short=True), readme_table.short_table())
    _same(ENCODINGS, readme_table.current(ENCODINGS.read_text(encoding="utf-8")), readme_table.table())


def test_the_short_table_names_every_encoding_once_with_its_card():
    """Independent of the generator: the README's rows are posenc.available() in order, each row's family and
    learned column the encoding's card, and its year the card's."""
    import posenc

    rows = [r for r in readme_table.current(README.read_text(encoding="utf-8"), short=True).splitlines()[2:]]
    cells = [[c.strip() for c in r.strip("|").split(" | ")] for r in rows]
    assert [c[0].strip("`") for c in cells] == posenc.available()
    for name, family, learned, source in cells:
        card = posenc.card(name.strip("`"))
        assert (family, learned) == (card.family, "yes" if card.learnable else "no"), name
        assert source.endswith(f" {card.year}") and source.split()[0] in card.paper, (name, source)


def test_the_short_citation():
    assert readme_table.cited("Su et al., RoFormer: Enhanced Transformer") == "Su et al."
    assert readme_table.cited("Shaw, Uszkoreit, Vaswani, Self-Attention with Relative Position") == "Shaw et al."
    assert readme_table.cited("Heo, Rotary Position Embedding for Vision Transformer") == "Heo"
    assert readme_table.cited('anon., "Positional encoding of the Transformer"') == "anon."
    assert readme_table.cited("Llama Team (Meta), The Llama 3 Herd of Models") == "Llama Team (Meta)"


def test_table_command_is_documented():
    assert "posenc readme-table --write README.md" in README.read_text(encoding="utf-8")
    assert readme_table.COMMAND.removeprefix(".venv/bin/") in ENCODINGS.read_text(encoding="utf-8")


def test_the_readme_is_a_front_page():
    """At most MAX_BYTES; the long sections are docs pages it links to, and every docs/*.md page it links to
    exists (relative links work on GitHub and on the site)."""
    data = README.read_bytes()
    assert len(data) <= MAX_BYTES, f"README.md is {len(data):,} bytes, over {MAX_BYTES:,}: move a section to docs/"
    links = re.findall(r"\]\((docs/[^)#\s]+\.md)", data.decode("utf-8"))
    assert len(set(links)) >= 10
    missing = [link for link in links if not (ROOT / link).is_file()]
    assert not missing, missing


def test_quick_start_commands_exist():
    text = README.read_text(encoding="utf-8")
    for cmd in ("bash scripts/bench.sh", "bash scripts/test.sh"):
        assert cmd in text
        assert (ROOT / cmd.split()[1]).exists()
    assert "scripts/test.sh" in (ROOT / ".ci" / "run").read_text()


def _python_blocks(text: str) -> list[str]:
    return [m.group(1) for m in re.finditer(r"^```python\n(.*?)^```", text, flags=re.S | re.M)]


def test_the_use_it_block_prints_what_its_comments_say():
    """Each ``print(...)  # <kernel>: ...`` line of docs/usage.md's first block (the README's "Use it" block before
    it moved there) prints a plan of that kernel."""
    from posenc.attention import KERNELS

    usage = ROOT / "docs" / "usage.md"
    code = next(b for b in _python_blocks(usage.read_text(encoding="utf-8")) if "shaw.plan(" in b)
    printed: list[tuple[int, str]] = []

    def record(*args, **kwargs):
        printed.append((sys._getframe(1).f_lineno, " ".join(map(str, args))))

    exec(compile(code, "docs-usage", "exec"), {"__name__": "__main__", "print": record})
    lines = code.splitlines()
    checked = 0
    for lineno, out in printed:
        comment = lines[lineno - 1].partition("  # ")[2]
        said = comment.split(":")[0].strip()
        if said in KERNELS:
            assert out.startswith(f"{said}:"), f"docs/usage.md line {lines[lineno - 1]!r} prints {out!r}"
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
