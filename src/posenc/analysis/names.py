"""The names ``posenc inspect`` offers, without importing torch (its ``--help`` lists them).

:mod:`posenc.analysis.properties`, :mod:`~posenc.analysis.plots` and
:mod:`~posenc.analysis.report` take these from here.
"""

from __future__ import annotations

# (key, title, what "yes" means)
PROPERTIES: tuple[tuple[str, str, str], ...] = (
    ("unique", "Unique", "different positions (offsets) get different codes (scores)"),
    ("continuous", "Continuous", "one step moves the code by a similar, small amount everywhere"),
    ("bounded", "Bounded", "values at far positions do not grow with the length"),
    ("consistent", "Consistent across lengths", "a position's code does not depend on the sequence length"),
    ("linear_offset", "Linear offset", "PE_{t+k} = T_k PE_t for a matrix T_k independent of t"),
    ("direction_aware", "Direction-aware", "the score for +k differs from the score for -k"),
    ("relative_only", "Relative only", "scores unchanged when every position shifts"),
    ("decay", "Distance decay", "the score falls as |i-j| grows"),
    ("extrapolates", "Extrapolates", "defined, finite and in range past the trained length"),
    ("params_constant", "Parameters constant in length", "the parameter count does not grow with max_len"),
)
PROPERTY_KEYS = tuple(p[0] for p in PROPERTIES)
PROPERTY_TITLES = {p[0]: p[1] for p in PROPERTIES}
PROPERTY_MEANING = {p[0]: p[2] for p in PROPERTIES}

# picture file formats
FORMATS = ("png", "svg")

# how a property card is printed (the keys of posenc.analysis.report.RENDERERS)
CARD_FORMATS = ("text", "markdown", "html", "json")
