"""The real-data benchmark tasks: text classification (mr, trec, chinese-sentiment), msra-ner, ptb-lm, shakespeare-lm.

Truths used: perplexity against exp(mean NLL) from a naive per-token loop (float64,
rel. tol 1e-9); the non-overlapping windows against a naive loop that assigns each
token to its window; entity F1 against hand-counted spans of well-formed BMES tags
(exact); the classifier against the majority class of the test split.
"""

from __future__ import annotations

import math

import pytest
import torch

import posenc.data as D
from posenc.bench.real_training import nonoverlapping_windows, perplexity, window_nll
from posenc.bench.runner import RunConfig, run_one
from posenc.errors import ConfigError
from posenc.models import LanguageModel

DATASET = {
    "mr": "mr",
    "trec": "trec",
    "chinese-sentiment": "chinese-sentiment",
    "msra-ner": "msra",
    "ptb-lm": "ptb",
    "shakespeare-lm": "shakespeare",
}
SMALL = {
    "mr": {"max_tokens": 16},
    "trec": {"max_tokens": 16},
    "chinese-sentiment": {"max_tokens": 16},
    "msra-ner": {"n_train": 200, "n_test": 40, "max_tokens": 32},
    "ptb-lm": {"eval_tokens": 300},
    "shakespeare-lm": {"eval_tokens": 300},
}


@pytest.fixture(autouse=True)
def _one_thread():
    # two threads on two cores shared with other processes slow tiny models down many times over
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def need(task: str) -> None:
    name = DATASET[task]
    if not D.available(name):
        pytest.skip(f"data set {name!r} is not installed (bash scripts/install_data.sh)")


def tiny(task: str, **kw) -> RunConfig:
    lm = task.endswith("-lm")
    base = dict(
        task=task,
        encoding="sinusoidal",
        seed=0,
        train_lengths=(8, 8) if lm else (1, 16),
        test_lengths=(8, 16) if lm else (16,),
        steps=4,
        batch_size=8,
        d_model=16,
        n_layers=1,
        n_heads=2,
        d_ff=32,
        lr=3e-3,
        task_options=dict(SMALL[task]),
    )
    base.update(kw)
    return RunConfig(**base)


LABELS = {
    "mr": {"test", "valid", "test_long"},
    "trec": {"test", "valid", "test_long"},
    "chinese-sentiment": {"test", "valid", "test_long"},
    "msra-ner": {"test"},
    "ptb-lm": {"8", "16"},
    "shakespeare-lm": {"8", "16"},
}


@pytest.mark.parametrize("task", sorted(DATASET))
def test_each_task_runs_end_to_end(task):
    need(task)
    steps: list[int] = []
    res = run_one(tiny(task), lambda s, loss: steps.append(s))
    assert steps == [1, 2, 3, 4]
    assert set(res["metrics"]) == LABELS[task]
    for v in res["metrics"].values():
        assert isinstance(v, float) and math.isfinite(v)
        if task.endswith("-lm"):
            assert v > 1
            assert res["metric"] == "perplexity" and res["higher_is_better"] is False
        else:
            assert 0 <= v <= 1
    assert res["parameters"] > 0 and res["curve"][-1][0] == 4


# --------------------------------------------------------------------------- language-model evaluation


@pytest.mark.parametrize("n_targets, length", [(1, 1), (7, 3), (9, 3), (10, 4), (5, 100), (33, 8)])
def test_nonoverlapping_windows_cover_each_token_once(n_targets, length):
    windows = nonoverlapping_windows(n_targets, length)
    count = [0] * n_targets
    for s, e in windows:
        assert 0 < e - s <= length
        for t in range(s, e):
            count[t] += 1
    assert count == [1] * n_targets
    # naive: token t belongs to the window starting at length * (t // length)
    naive = sorted(
        {(length * (t // length), min(length * (t // length) + length, n_targets)) for t in range(n_targets)}
    )
    assert windows == naive


@pytest.mark.parametrize("encoding", ["sinusoidal", "alibi", "rope"])
@pytest.mark.parametrize("length, cap", [(4, None), (5, 23), (16, None), (7, 7)])
def test_perplexity_is_exp_mean_nll_of_a_naive_loop(encoding, length, cap):
    torch.manual_seed(1)
    model = LanguageModel(11, encoding=encoding, d_model=16, n_layers=2, n_heads=2, max_len=64).double().eval()
    stream = torch.randint(0, 11, (30,))
    n_targets = stream.numel() - 1 if cap is None else min(cap, stream.numel() - 1)
    nll = []
    with torch.no_grad():
        for t in range(1, n_targets + 1):  # predict stream[t] from the window it falls in
            start = length * ((t - 1) // length)
            logits = model(stream[None, start:t])[0, -1]
            nll.append(-torch.log_softmax(logits, -1)[stream[t]].item())
    expected = math.exp(sum(nll) / len(nll))
    total, count = window_nll(model, stream, length, cap)
    assert count == n_targets
    assert perplexity(model, stream, length, cap) == pytest.approx(expected, rel=1e-9)


def test_learned_encoding_beyond_its_table_gives_none_and_an_error():
    need("shakespeare-lm")
    res = run_one(tiny("shakespeare-lm", encoding="learned", test_lengths=(8, 16, 32), task_options={"max_len": 8}))
    m = res["metrics"]
    assert isinstance(m["8"], float) and math.isfinite(m["8"])
    for n in ("16", "32"):
        assert m[n] is None and "PositionError" in m[f"{n}_error"] and "max_len=8" in m[f"{n}_error"]
    # by default the table covers the longest test length: every length gets a number
    res = run_one(tiny("shakespeare-lm", encoding="learned", test_lengths=(8, 16, 32)))
    assert all(isinstance(res["metrics"][n], float) for n in ("8", "16", "32"))


def test_extrapolating_encoding_scores_the_same_tokens_at_every_length():
    need("ptb-lm")
    from posenc.bench.tasks.lm import encoded_lm

    _, streams = encoded_lm("ptb")
    model = LanguageModel(10001, encoding="alibi", d_model=16, n_layers=1, n_heads=2, max_len=8).eval()
    counts = {n: window_nll(model, streams["valid"], n, 200)[1] for n in (8, 16, 64)}
    assert set(counts.values()) == {200}


# --------------------------------------------------------------------------- NER


def _naive_well_formed_spans(tags: list[str]) -> set[tuple[int, int, str]]:
    spans, start = set(), None
    for i, t in enumerate(tags):
        if t.startswith("S-"):
            spans.add((i, i + 1, t[2:]))
        elif t.startswith("B-"):
            start = i
        elif t.startswith("E-"):
            spans.add((start, i + 1, t[2:]))
    return spans


def _well_formed(tags: list[str]) -> bool:
    state = None
    for t in tags:
        p, typ = (t[0], t[2:]) if t != "O" else ("O", "")
        if state is None and p in "ME" or state is not None and (p not in "ME" or typ != state):
            return False
        state = typ if p in "BM" else None
    return state is None


def test_ner_f1_is_entity_level_end_to_end(monkeypatch):
    need("msra-ner")
    from posenc.bench.tasks import ner

    cfg = tiny("msra-ner")
    _, tags, _, (_, test_y) = ner.encoded_msra(200, 40, 1)
    gold = [[tags[t] for t in y] for y in test_y]
    assert all(_well_formed(g) for g in gold), "the test subsample should be well formed for the naive count"
    half = len(gold) // 2
    n_gold = sum(len(_naive_well_formed_spans(g)) for g in gold)
    n_first = sum(len(_naive_well_formed_spans(g)) for g in gold[:half])
    assert 0 < n_first < n_gold

    # a tagger that is right on the first half of the sentences and says O elsewhere: P = 1, R = first / all
    def oracle(model, ids, batch=128):
        assert [len(x) for x in ids] == [len(y) for y in test_y]
        return [list(y) if i < half else [0] * len(y) for i, y in enumerate(test_y)]

    monkeypatch.setattr(ner, "predict_tags", oracle)
    r = n_first / n_gold
    assert run_one(cfg)["metrics"]["test"] == pytest.approx(2 * r / (1 + r), abs=1e-12)
    # all O: nothing predicted, F1 0; all gold: F1 1
    monkeypatch.setattr(ner, "predict_tags", lambda model, ids, batch=128: [[0] * len(x) for x in ids])
    assert run_one(cfg)["metrics"]["test"] == 0.0
    monkeypatch.setattr(ner, "predict_tags", lambda model, ids, batch=128: [list(y) for y in test_y])
    assert run_one(cfg)["metrics"]["test"] == 1.0


# --------------------------------------------------------------------------- behaviour


@pytest.mark.parametrize("task", ["trec", "shakespeare-lm", "msra-ner"])
def test_same_config_and_seed_give_the_same_metrics(task):
    need(task)
    a = run_one(tiny(task, steps=6))
    b = run_one(tiny(task, steps=6))
    assert a["metrics"] == b["metrics"] and a["curve"] == b["curve"]
    c = run_one(tiny(task, steps=6, seed=1))
    assert c["curve"] != a["curve"]


def test_trec_classifier_learns_beyond_the_majority_class():
    need("trec")
    cfg = tiny(
        "trec",
        steps=200,
        batch_size=32,
        d_model=32,
        n_heads=4,
        d_ff=64,
        task_options={"max_tokens": 32, "dropout": 0.0},
    )
    res = run_one(cfg)
    labels = [y for _, y in D.load_trec().test]
    majority = max(labels.count(c) for c in set(labels)) / len(labels)
    assert majority < 0.3
    assert res["metrics"]["test"] > majority + 0.2, (res["metrics"], majority)


def test_missing_data_raises_before_training(monkeypatch):
    from posenc.bench.tasks import lm, text

    def missing(*args, **kwargs):
        raise D.DataUnavailableError("package not installed; pip install it")

    steps: list[int] = []
    text.encoded_classification.cache_clear()
    lm.encoded_lm.cache_clear()
    monkeypatch.setattr(D, "load", missing)
    try:
        with pytest.raises(D.DataUnavailableError):
            run_one(tiny("trec"), lambda s, loss: steps.append(s))
        with pytest.raises(D.DataUnavailableError):
            run_one(tiny("ptb-lm"), lambda s, loss: steps.append(s))
    finally:
        text.encoded_classification.cache_clear()
        lm.encoded_lm.cache_clear()
    assert steps == []


@pytest.mark.parametrize(
    "task, kw, match",
    [
        ("trec", {"task_options": {"max_tokns": 16}}, "unknown task_options"),
        ("trec", {"task_options": {"max_tokens": "16"}}, "max_tokens"),
        ("trec", {"task_options": {"max_tokens": 0}}, "max_tokens"),
        ("trec", {"task_options": {"fold": 1}}, "unknown task_options"),
        ("mr", {"task_options": {"fold": 10}}, "fold"),
        ("mr", {"task_options": {"dropout": 1.0}}, "dropout"),
        ("msra-ner", {"task_options": {"n_train": -1}}, "n_train"),
        ("msra-ner", {"task_options": {"n_test": True}}, "n_test"),
        ("ptb-lm", {"test_lengths": (4, 8)}, "shorter"),
        ("ptb-lm", {"model": "encoder"}, "decoder"),
        ("ptb-lm", {"task_options": {"max_len": 4}}, "max_len"),
        ("ptb-lm", {"task_options": {"split": "train"}}, "split"),
        ("ptb-lm", {"task_options": {"eval_tokens": 0}}, "eval_tokens"),
        ("shakespeare-lm", {"task_options": {"seq_len": 8}}, "unknown task_options"),
    ],
)
def test_bad_settings_are_config_errors(task, kw, match):
    with pytest.raises(ConfigError, match=match):
        tiny(task, **kw)
