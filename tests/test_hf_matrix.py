"""docs/hf.md's support matrix (model family × feature) is the one posenc.hf_matrix generates by running its
checks; no check finds a wrong answer (a wrong answer raises, so a row with one fails here)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("posenc.hf")

from posenc.hf import matrix as hf_matrix  # noqa: E402

DOC = Path(__file__).resolve().parent.parent / "docs" / "hf.md"
ROWS: dict[str, dict[str, str]] = {}


@pytest.mark.parametrize("row", list(hf_matrix._models()))
def test_each_row_of_the_matrix_is_right_or_refused(row):
    ROWS[row] = cells = hf_matrix.row(row)
    assert set(cells) == set(hf_matrix.FEATURES)
    assert all(c in ("yes", "n/a") or c.startswith(("refused: ", "yes (")) for c in cells.values()), cells


def test_docs_hf_md_holds_the_generated_matrix():
    pytest.importorskip("peft", reason="without peft the PEFT column reads n/a: the table is made with the test extra")
    for row in hf_matrix._models():
        if row not in ROWS:  # run alone (-k): compute what the row tests above did not
            ROWS[row] = hf_matrix.row(row)
    have = hf_matrix.current(DOC.read_text())
    want = hf_matrix.table({row: ROWS[row] for row in hf_matrix._models()})
    assert have == want, f"docs/hf.md's support matrix is not the generated one; run: {hf_matrix.COMMAND}"


def test_the_check_command_says_when_the_table_is_stale(tmp_path, monkeypatch):
    doc = tmp_path / "hf.md"
    cache = f"{hf_matrix.CACHE_START}\n| cache fresh |\n{hf_matrix.CACHE_END}\n"
    doc.write_text(f"intro\n{hf_matrix.START}\n| stale |\n{hf_matrix.END}\nrest\n{cache}")
    monkeypatch.setattr(hf_matrix, "table", lambda cells=None: "| fresh |\n")
    monkeypatch.setattr(hf_matrix, "cache_table", lambda cells=None: "| cache fresh |\n")
    assert hf_matrix.main(["--check", str(doc)]) == 1
    assert hf_matrix.main(["--write", str(doc)]) == 0
    assert doc.read_text() == f"intro\n{hf_matrix.START}\n| fresh |\n{hf_matrix.END}\nrest\n{cache}"
    assert hf_matrix.main(["--check", str(doc)]) == 0
    monkeypatch.setattr(hf_matrix, "cache_table", lambda cells=None: "| cache newer |\n")
    assert hf_matrix.main(["--check", str(doc)]) == 1  # the second table counts too
