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
    assert len(jobs) == len(seeds) * (2 * 9 + 2 * 6 + 9 + 6)
    labels = {(j.config.task, j.label) for j in jobs}
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
