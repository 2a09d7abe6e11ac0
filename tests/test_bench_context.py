"""The context-extension suite: passkey retrieval, the RoPE scalings on one shared base model, fine-tuning."""

from __future__ import annotations

import random

import pytest
import torch

from posenc.bench import RunConfig, available_tasks, load_suite, run_one
from posenc.bench.api import get_task
from posenc.bench.tasks import context_extension as ce
from posenc.bench.tasks import passkey as pk
from posenc.errors import ConfigError

TINY = dict(
    task="passkey",
    steps=6,
    batch_size=4,
    train_lengths=(28, 32),
    test_lengths=(32, 64),
    d_model=16,
    n_layers=1,
    n_heads=2,
    eval_samples=10,
)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    """Every test starts with an empty base-model cache of its own (memory and disk)."""
    monkeypatch.setenv("POSENC_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("POSENC_BENCH_CACHE", raising=False)
    ce._MEMORY.clear()
    yield
    ce._MEMORY.clear()


def tiny(**kw):
    return RunConfig(**{**TINY, **kw})


def test_tasks_and_suite_are_registered():
    assert {"passkey", "shakespeare-ctx-ext", "ptb-ctx-ext"} <= set(available_tasks())
    suite = load_suite("context-extension")
    jobs = suite.jobs()
    seeds = {j.config.seed for j in jobs}
    assert seeds == {0, 1, 2}  # three seeds, like every paper suite
    # as trained + fine-tuned per task, and Shakespeare's fine-tuning curves (4 + 1), train-short (2), LongRoPE (2)
    assert len(jobs) == len(seeds) * (2 * 9 + 2 * 6 + 9 + 6 + 5 + 2 + 2)
    labels = {(j.config.task, j.label) for j in jobs}
    assert ("shakespeare-ctx-ext", "rope-yarn +ft400") in labels
    curves = [j for j in jobs if j.label.endswith("+ft400")]
    assert all(j.config.task_options["checkpoints"] == [0, 10, 25, 50, 100, 200, 400] for j in curves)
    assert ("ptb-ctx-ext", "rope-yarn +ft") in labels and ("passkey", "fire") in labels
    assert suite.published["task"] == "shakespeare-ctx-ext"


def test_passkey_example_layout():
    key = [7, 1, 4, 3, 2]
    words = lambda ids: " ".join(pk.VOCAB[i] for i in ids)  # noqa: E731
    n = 60
    first, last = pk.example(n, 0.0, key), pk.example(n, 1.0, key)
    assert len(first) == len(last) == n
    assert words(first).startswith("the pass key is 7 1 4 3 2 . remember it . the grass is green")
    assert words(first).endswith("what is the pass key ? the pass key is 7 1 4 3 2")
    assert words(last).endswith(
        "the pass key is 7 1 4 3 2 . remember it . what is the pass key ? the pass key is 7 1 4 3 2"
    )
    assert pk.min_length(5) == 28 and len(pk.example(28, 0.5, key)) == 28
    with pytest.raises(ConfigError, match="needs n >= 28"):
        pk.example(27, 0.5, key)
    rows = pk.batch(40, 3, 5, random.Random(0))
    assert rows.shape == (3, 40) and int(rows.max()) < len(pk.VOCAB)
    with pytest.raises(ConfigError, match="train_lengths must start at 28"):
        tiny(train_lengths=(20, 32))


def test_scalings_share_one_base_model_and_a_cache_hit_changes_nothing():
    rope = run_one(tiny(encoding="rope"))
    assert rope["extra"]["base_from_cache"] is False and rope["extra"]["base_encoding"] == "rope"
    assert set(rope["metrics"]) == {"32", "64"}
    assert set(rope["extra"]["by_depth"]["64"]) == {"0", "0.25", "0.5", "0.75", "1"}
    yarn = run_one(tiny(encoding="rope-yarn", encoding_options={"factor": 2, "original_max_len": 32}))
    assert yarn["extra"]["base_from_cache"] is True  # from memory: not trained again
    assert yarn["curve"] == rope["curve"] and yarn["extra"]["encoding_options_used"]["factor"] == 2
    files = list((ce.cache_folder()).glob("*.pt"))
    assert len(files) == 1
    # another process (empty memory) reads the disk copy; without any cache the run trains it: the same numbers
    ce._MEMORY.clear()
    again = run_one(tiny(encoding="rope-yarn", encoding_options={"factor": 2, "original_max_len": 32}))
    assert again["extra"]["base_from_cache"] is True and again["metrics"] == yarn["metrics"]
    ce._MEMORY.clear()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("POSENC_BENCH_CACHE", "0")
        fresh = run_one(tiny(encoding="rope-yarn", encoding_options={"factor": 2, "original_max_len": 32}))
    assert fresh["extra"]["base_from_cache"] is False and fresh["metrics"] == yarn["metrics"]


def test_the_swapped_model_holds_the_base_weights():
    task = get_task("passkey")
    cfg = tiny(encoding="rope-linear", encoding_options={"factor": 4})
    run_one(tiny(encoding="rope"))
    key = ce.base_key(task, cfg, task.base_extra(cfg))
    state, _, cached = ce.shared_base(key, lambda: pytest.fail("the base should be cached"))
    assert cached
    model = task.build(cfg, "rope-linear", {"factor": 4})
    model.load_state_dict(state, strict=False)
    for name, value in state.items():
        assert torch.equal(model.state_dict()[name], value), name


def test_defaults_filled_in_and_original_max_len_checked():
    cfg = tiny(encoding="rope-dynamic")
    assert ce.method_options(cfg, 32, 4.0) == {"factor": 4.0, "original_max_len": 32}
    assert ce.method_options(tiny(encoding="rope-ntk"), 32, 4.0) == {"factor": 4.0}
    assert ce.base_encoding(tiny(encoding="rope-ntk", encoding_options={"factor": 2, "base": 500.0})) == (
        "rope",
        {"base": 500.0},
    )
    assert ce.base_encoding(tiny(encoding="alibi")) == ("alibi", {})
    with pytest.raises(ConfigError, match="original_max_len=64 is not the training length 32"):
        tiny(encoding="rope-yarn", encoding_options={"factor": 2, "original_max_len": 64})
    with pytest.raises(ConfigError, match="finetune_factor"):
        tiny(encoding="rope", task_options={"finetune_factor": 0})
    with pytest.raises(ConfigError, match="model must be 'decoder'"):
        tiny(encoding="rope", model="encoder")


def test_finetune_and_native_encodings():
    ft = run_one(tiny(encoding="rope-linear", encoding_options={"factor": 2}, task_options={"finetune_steps": 3}))
    assert ft["extra"]["finetune_length"] == 4 * 32 and ft["curve"][-1][0] == TINY["steps"] + 3
    plain = run_one(tiny(encoding="rope-linear", encoding_options={"factor": 2}))
    assert plain["extra"]["base_from_cache"] is True and "finetune_length" not in plain["extra"]
    alibi = run_one(tiny(encoding="alibi"))
    assert alibi["extra"]["base_encoding"] == "alibi" and alibi["extra"]["base_from_cache"] is False
    assert all(0.0 <= v <= 1.0 for v in alibi["metrics"].values())


def test_lm_extension_task_runs():
    from posenc.data import DataUnavailableError

    try:
        from posenc.bench.tasks.lm import encoded_lm

        vocab = encoded_lm("shakespeare")[0]
    except DataUnavailableError as exc:
        pytest.skip(str(exc))
    cfg = RunConfig(
        task="shakespeare-ctx-ext",
        encoding="rope-yarn",
        encoding_options={"factor": 2, "original_max_len": 16},
        steps=4,
        batch_size=4,
        train_lengths=(16, 16),
        test_lengths=(16, 32),
        d_model=16,
        n_layers=1,
        n_heads=2,
        task_options={"eval_tokens": 64, "finetune_steps": 2},
    )
    rec = run_one(cfg)
    assert set(rec["metrics"]) == {"16", "32"} and all(1 < v < 10 * vocab for v in rec["metrics"].values())
    assert rec["metric"] == "perplexity" and rec["higher_is_better"] is False
    assert ce.ShakespeareExtension().chance(cfg, "16") == float(vocab)


def test_the_report_says_a_fine_tuned_run_was_trained_up_to_the_fine_tuning_length():
    from posenc.bench import RunConfig
    from posenc.bench.api import get_task

    task = get_task("shakespeare-ctx-ext")
    plain = RunConfig(task="shakespeare-ctx-ext", encoding="rope-yarn", train_lengths=(64, 64), test_lengths=(64,))
    tuned = RunConfig(
        task="shakespeare-ctx-ext", encoding="rope-yarn", train_lengths=(64, 64), test_lengths=(64,),
        task_options={"finetune_steps": 5, "finetune_factor": 4},
    )
    assert task.training_lengths(plain) == (64, 64)
    assert task.training_lengths(tuned) == (64, 256)


# ---------------------------------------------------------------------------- steps to target, LongRoPE's search
def _lm(**kw):
    from posenc.data import DataUnavailableError

    try:
        from posenc.bench.tasks.lm import encoded_lm

        encoded_lm("shakespeare")
    except DataUnavailableError as exc:
        pytest.skip(str(exc))
    base = dict(task="shakespeare-ctx-ext", steps=8, batch_size=4, train_lengths=(16, 16), test_lengths=(16, 32, 64),
                d_model=16, n_layers=1, n_heads=2)
    return RunConfig(**{**base, **kw})


YARN4 = {"encoding": "rope-yarn", "encoding_options": {"factor": 4, "original_max_len": 16}}


def test_checkpoints_do_not_change_the_fine_tune_and_the_last_one_is_the_run():
    with_points = run_one(_lm(**YARN4, task_options={"eval_tokens": 128, "finetune_steps": 6,
                                                      "checkpoints": [0, 2, 6]}))
    without = run_one(_lm(**YARN4, task_options={"eval_tokens": 128, "finetune_steps": 6}))
    untuned = run_one(_lm(**YARN4, task_options={"eval_tokens": 128}))
    points = with_points["extra"]["checkpoints"]
    assert list(points) == ["0", "2", "6"]
    assert with_points["metrics"] == without["metrics"] == points["6"]  # evaluating draws no randomness
    assert points["0"] == untuned["metrics"]  # step 0: the scaling swapped in, not tuned
    assert points["2"] != points["0"] and points["2"] != points["6"]
    assert with_points["extra"]["finetune_seconds"] <= without["extra"]["finetune_seconds"] + 5


@pytest.mark.parametrize("bad", [[6, 2], [0, 7], [1, 1], [-1], ["3"]])
def test_checkpoints_out_of_order_or_range_are_refused(bad):
    with pytest.raises(ConfigError, match="checkpoints must be increasing step counts in 0..finetune_steps"):
        _lm(**YARN4, task_options={"finetune_steps": 6, "checkpoints": bad})


def test_longrope_search_replaces_the_factors_monotone_and_beats_its_start():
    given = {"factor": 4, "original_max_len": 16, "short_factor": [1.0] * 4, "long_factor": [1.0, 2.0, 4.0, 4.0]}
    opts = {"eval_tokens": 128, "longrope": "search", "longrope_population": 8, "longrope_iterations": 3,
            "longrope_samples": 2}
    rec = run_one(_lm(encoding="rope-longrope", encoding_options=given, task_options=opts))
    found = rec["extra"]["longrope"]
    used = rec["extra"]["encoding_options_used"]
    lam = used["long_factor"]
    assert found["replaced"]["long_factor"] == given["long_factor"] and used["short_factor"] == [1.0] * 4
    assert all(1.0 <= a <= b <= 1.25 * 4 for a, b in zip(lam, lam[1:], strict=False))  # LongRoPE's constraint
    assert found["fitness"] <= min(found["initial"].values())  # elitism: never worse than PI / NTK / YaRN
    assert found["curve"] == sorted(found["curve"], reverse=True)
    assert found["length"] == 64  # the encoding's factor x L
    # the search is a function of the base and the options: a second run reuses it (memory, then disk)
    again = run_one(_lm(encoding="rope-longrope", encoding_options=given, task_options=opts, seed=0, steps=8))
    assert again["extra"]["encoding_options_used"]["long_factor"] == lam
    ce._MEMORY.clear()
    ce._SEARCHED.clear()
    from_disk = run_one(_lm(encoding="rope-longrope", encoding_options=given, task_options=opts))
    assert from_disk["extra"]["longrope"]["curve"] == found["curve"]


def test_longrope_search_is_refused_for_another_encoding_and_held_out_text_is_after_the_evaluated():
    with pytest.raises(ConfigError, match="searches rope-longrope's factors"):
        _lm(**YARN4, task_options={"longrope": "search"})
    with pytest.raises(ConfigError, match="longrope must be one of"):
        _lm(**YARN4, task_options={"longrope": "evolve"})
    from posenc.bench.tasks.lm import encoded_lm

    cfg = _lm(**YARN4, task_options={"eval_tokens": 128})
    task = get_task("shakespeare-ctx-ext")
    held = task.heldout(cfg, 32, 3)
    stream = encoded_lm("shakespeare")[1][task.options(cfg)["split"]]
    assert held.numel() == 3 * 32 + 1 and torch.equal(held, stream[129 : 129 + 97])
    with pytest.raises(ConfigError, match="too few"):
        task.heldout(cfg, 10**7, 2)


def test_steps_to_target_interpolates_between_checkpoints():
    from posenc.bench.tasks.steps_to_target import steps_to

    curve = [(0, 20.0), (10, 12.0), (25, 9.0), (50, 8.0)]
    assert steps_to(curve, 20.0) == 0
    assert steps_to(curve, 10.0) == pytest.approx(10 + (12 - 10) / (12 - 9) * 15)
    assert steps_to(curve, 8.0) == pytest.approx(50)
    assert steps_to(curve, 7.9) is None
    # property: the step found lies between the checkpoints around the first crossing
    rng = random.Random(0)
    for _ in range(200):
        vals = [rng.uniform(5, 20) for _ in range(6)]
        pts = list(zip([0, 10, 25, 50, 100, 200], vals, strict=True))
        t = rng.uniform(5, 20)
        s = steps_to(pts, t)
        hit = next((i for i, v in enumerate(vals) if v <= t), None)
        if hit is None:
            assert s is None
        elif hit == 0:
            assert s == 0
        else:
            assert pts[hit - 1][0] <= s <= pts[hit][0]


def test_the_steps_to_target_table_reads_the_records():
    from posenc.bench.tasks.steps_to_target import lines, table

    def rec(enc, seed, at_ft):
        pts = {str(k): {"16": 9.0, "64": v} for k, v in zip([0, 10, 50], at_ft, strict=True)}
        return {"label": f"{enc} +ft", "config": {"encoding": enc, "seed": seed, "train_lengths": [16, 16],
                                                   "task_options": {"finetune_steps": 50, "checkpoints": [0, 10, 50]}},
                "extra": {"checkpoints": pts, "finetune_length": 64}}

    records = [rec("rope-linear", 0, [30, 12, 8]), rec("rope-yarn", 0, [11, 8, 7]), rec("rope-ntk", 0, [15, 9, 8.5])]
    t = table(records)
    assert t["rope-linear +ft"]["target"] == [8] and t["rope-linear +ft"]["steps"] == [50]
    assert t["rope-yarn +ft"]["steps"] == [pytest.approx(10)] and t["rope-yarn +ft"]["ratio"] == [pytest.approx(5)]
    assert t["rope-ntk +ft"]["steps"] == [None]
    text = "\n".join(lines(t))
    assert "| rope-ntk +ft | 0 |" in text and "> 50" in text and "5.0×" in text
