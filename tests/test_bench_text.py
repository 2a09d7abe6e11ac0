"""``posenc bench --task text --data PATH``: a language model on a text file of the user's (issue 27).

Independent truth: the vocabulary size is counted here from the file's first 90 % (characters) or read from
the tokenizer; the streams are the tokenizer's own ids of each part; perplexities are finite and above 1.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from posenc.bench import RunConfig, run_one
from posenc.bench.api import get_task
from posenc.bench.tasks.text import encoded_text, file_digest
from posenc.cli import main
from posenc.errors import ConfigError

SMALL = dict(steps=3, batch_size=8, d_model=16, n_layers=1, n_heads=2, train_lengths=(8, 8), test_lengths=(8, 16))


@pytest.fixture
def notes(tmp_path):
    rng = random.Random(0)
    words = "the quick brown fox jumps over a lazy dog while seven wizards hum".split()
    text = "\n".join(" ".join(rng.choice(words) for _ in range(10)) for _ in range(60)) + "\nÜnïcode ✓\n"
    path = tmp_path / "notes.txt"
    path.write_text(text, encoding="utf-8")
    return path


def _cfg(path, **kw):
    opts = {"path": str(path), "digest": file_digest(path), **kw.pop("task_options", {})}
    return RunConfig(task="text", encoding="rope", seed=0, task_options=opts, **{**SMALL, **kw})


def test_a_character_lm_on_a_small_file(notes):
    text = notes.read_text(encoding="utf-8")
    train = text[: int(0.9 * len(text))]
    cfg = _cfg(notes)
    assert get_task("text").chance(cfg, "8") == len(set(train)) + 2  # the training part's characters, <pad>, <unk>
    rec = run_one(cfg)
    assert set(rec["metrics"]) == {"8", "16"}
    for v in rec["metrics"].values():
        assert math.isfinite(v) and 1.0 < v < 3 * (len(set(train)) + 2)
    assert rec["extra"]["unit"] == "characters"


def test_a_tokenizer_level_lm_with_a_local_tokenizer(notes, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        notes.read_text().splitlines(), tokenizers.trainers.BpeTrainer(vocab_size=80, special_tokens=["[UNK]"])
    )
    folder = tmp_path / "tok"
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(folder)
    loaded = transformers.AutoTokenizer.from_pretrained(str(folder))
    text = notes.read_text(encoding="utf-8")
    a = int(0.9 * len(text))
    size, streams, unit = encoded_text(str(notes), str(folder), file_digest(notes))
    assert size == len(loaded) and unit.startswith("tokens")
    assert streams["train"].tolist() == loaded(text[:a], add_special_tokens=False)["input_ids"]
    rec = run_one(_cfg(notes, task_options={"tokenizer": str(folder)}, test_lengths=(8,)))
    assert math.isfinite(rec["metrics"]["8"]) and rec["metrics"]["8"] > 1


def test_the_command_line_trains_on_the_file(notes, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["bench", "--task", "text", "--data", str(notes), "--encodings", "rope", "--seeds", "0"]
    argv += ["--steps", "3", "--train-max", "8", "--test-lengths", "8", "16", "--out", str(out), "--quiet"]
    assert main(argv) == 0
    got = capsys.readouterr().out
    assert "**text** — perplexity" in got and "| rope |" in got
    assert (out / "report.html").exists()


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--task", "order"], "--data is a file for task 'text' alone"),
        (["--suite", "quick"], "--data is for task 'text' without --suite"),
    ],
)
def test_data_goes_with_task_text_alone(notes, capsys, extra, says):
    assert main(["bench", "--data", str(notes), *extra]) == 2
    assert says in capsys.readouterr().err


def test_a_missing_file_and_a_tokenizer_without_data_are_clear_errors(tmp_path, capsys):
    assert main(["bench", "--task", "text", "--data", str(tmp_path / "nope.txt")]) == 2
    assert "nope.txt: no such file" in capsys.readouterr().err
    assert main(["bench", "--tokenizer", "smollm2-135m"]) == 2
    assert "--tokenizer goes with --data" in capsys.readouterr().err


def test_a_file_too_short_or_changed_says_what_to_do(tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("tiny text")
    with pytest.raises(ConfigError, match="has 8 characters, too few for chunks of 9"):
        run_one(_cfg(short))
    short.write_text("tiny text " * 3)  # 27 characters to train on, 1 to evaluate
    with pytest.raises(ConfigError, match="the valid part .* has 1 characters, fewer than the longest test length 16"):
        run_one(_cfg(short))
    changed = tmp_path / "changed.txt"
    changed.write_text("a" * 500)
    cfg = _cfg(changed)
    changed.write_text("b" * 500)
    with pytest.raises(ConfigError, match="changed since this run was planned"):
        get_task("text").run(cfg)
    torch.manual_seed(0)  # leave the global generator as a later test may expect it
