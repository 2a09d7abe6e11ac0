"""The essay haystack of RULER's essay tasks (niah_single_2/3, niah_multikey_1, niah_multivalue, niah_multiquery), in
place of Paul Graham's essays, which RULER downloads and which cannot be had offline here.

The substitute is long public-domain English text that ships in a registry package already used by posenc: the 42
Shakespeare plays and poems of the ``shakespeare`` 0.6 package (Gutenberg texts, about 5 M characters), in file-name
order. No package installed here (nor one of the registries' lists searched: ``gutenberg``, ``public domain``,
``classic literature``) ships Gutenberg *prose*; the plays are dialogue and verse, with speaker tags and stage
directions, where the essays are expository prose. Every table that shows an essay task names this substitution
(:data:`SUBSTITUTE`): scores on it are not the published essay tasks' scores.

As RULER does, the text is cut into words at runs of whitespace (``re.sub(r"\\s+", " ", text).split(" ")``), a
haystack is its first ``count`` words (repeated where it runs out) and the needles go in at sentence boundaries.
RULER splits sentences with nltk's punkt model, not installed here; :func:`sentences` splits after ``.``, ``!`` or
``?`` (with closing quotes or brackets) followed by a space, which is punkt's rule without its abbreviation list.
"""

from __future__ import annotations

import re

#: what every table says of the essay tasks' haystack
SUBSTITUTE = (
    "essay tasks: Shakespeare's plays (Gutenberg texts of the shakespeare 0.6 package) in place of Paul Graham's "
    "essays, which cannot be downloaded here"
)

_WORDS: list[str] = []
_SENTENCE_END = re.compile(r"[.!?]['\")\]]*\s+")


def words() -> list[str]:
    """The substitute essay text as words (RULER's split at whitespace), cached."""
    if not _WORDS:
        from ..data.lm import shakespeare_works

        text = " ".join(shakespeare_works().values())
        _WORDS.extend(w for w in re.sub(r"\s+", " ", text).split(" ") if w)
    return _WORDS


def haystack(count: int) -> str:
    """The first ``count`` words of the essay text, joined by spaces (the text repeated where it runs out)."""
    ws = words()
    if count <= len(ws):
        return " ".join(ws[:count])
    return " ".join((ws * (count // len(ws) + 1))[:count])


def sentences(text: str) -> list[str]:
    """``text`` cut into sentences: after ``.``, ``!`` or ``?`` (and closing quotes or brackets) and a space."""
    text = text.strip()
    out, start = [], 0
    for m in _SENTENCE_END.finditer(text):
        end = m.start() + len(m.group().rstrip())
        out.append(text[start:end])
        start = m.end()
    out.append(text[start:])
    return [s for s in (p.strip() for p in out) if s]


def vocabulary() -> list[str]:
    """cwe's fallback vocabulary: the distinct lower-case alphabetic words (3 letters or more) of the essay text,
    sorted. RULER falls back to its own ``english_words.json`` where a length needs more words than wonderwords'
    lists hold; that file is RULER's, not a package's, so the substitute text gives the words here."""
    seen = {w.lower() for w in (re.sub(r"[^A-Za-z]", "", w) for w in words()) if len(w) >= 3}
    return sorted(seen)
