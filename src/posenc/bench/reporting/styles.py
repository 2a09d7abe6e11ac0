"""One colour, marker and dash pattern per encoding label, shared by every plot and the tables' swatches.

matplotlib's tab10 with black for its grey (grey is the chance band), markers and dash patterns: label i
of the report's sorted labels gets colour i % 10 and marker (i + i // 10) % 10, so every label up to 100
has a (colour, marker) of its own. Plain data; it imports nothing of posenc.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#000000", "#bcbd22", "#17becf")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "*")
DASHES: tuple[Any, ...] = ("-", (0, (6, 2)), (0, (2, 1.5)), (0, (6, 1.5, 1.5, 1.5)))
#: the text glyph of each marker (the HTML tables' swatches)
GLYPHS = {"o": "●", "s": "■", "^": "▲", "D": "◆", "v": "▼", "P": "✚", "X": "✖", "<": "◀", ">": "▶", "*": "★"}
CHANCE_STYLE = {"color": "0.45", "lw": 3.0, "alpha": 0.45, "zorder": 1.5}


def encoding_styles(labels: Iterable[str]) -> dict[str, dict[str, Any]]:
    """One colour, marker and dash pattern per label, by its place in the sorted labels.

    The report computes it once from every label it shows, so an encoding looks the
    same in every panel of every plot (and in the tables' swatches).
    """
    out = {}
    for i, lab in enumerate(sorted(set(labels))):
        out[lab] = {
            "color": PALETTE[i % len(PALETTE)],
            "marker": MARKERS[(i + i // len(PALETTE)) % len(MARKERS)],
            "linestyle": DASHES[i % len(DASHES)],
        }
    return out
