"""The commands that make the results page and the README's block of verdicts, and the block's marker lines.

Printed on the page, in ``posenc results --help`` and in its errors; plain strings, so that the command line
can show its help without importing the model (nor torch). It imports nothing.
"""

from __future__ import annotations

#: the page's canonical place and the commands that make it (printed on the page)
PAGE = "docs/results.md"
STORES = "posenc-results"
WRITE_FROM_STORES = f"posenc results --stores {STORES} --write {PAGE} --readme README.md"
WRITE_FROM_DATA = f"posenc results --write {PAGE} --readme README.md"
CHECK = f"posenc results --check {PAGE} --readme README.md"

#: the README's block of verdicts lies between these two lines (``--readme README.md``)
README_START = "<!-- results:start (written by posenc results --readme README.md; do not edit by hand) -->"
README_END = "<!-- results:end -->"
