"""The command-line name of the support matrix of :mod:`posenc.hf`: ``python -m posenc.hf_matrix``.

    python -m posenc.hf_matrix                      print the table
    python -m posenc.hf_matrix --write docs/hf.md   rewrite the table between the markers of docs/hf.md
    python -m posenc.hf_matrix --check docs/hf.md   exit 1 when docs/hf.md's table is not the generated one

The matrix itself (columns, cells, table, command line) is :mod:`posenc.hf.matrix`, its rows and checks
:mod:`posenc.hf.matrix_checks`; this module runs its :func:`~posenc.hf.matrix.main` and re-exports its names for
code that imports ``posenc.hf_matrix``. It sits in its own layer above :mod:`posenc.hf` and imports only that.
"""

from __future__ import annotations

import sys

from .hf.matrix import *  # noqa: F403
from .hf.matrix import main

if __name__ == "__main__":
    sys.exit(main())
