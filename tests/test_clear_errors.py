"""Issue 48, item 4: inputs that ended in a bare Python exception (``MemoryError``, ``ValueError`` from ``int()``,
``TypeError``, ``SafetensorError``) or a message the user cannot act on. Each is a :class:`posenc.PosencError`
naming the argument or flag and the fix, tested as a class: schedule strings by hypothesis, the bounds of every
length setting of ``posenc extend``, every shape of a stored schedule's ``layers``."""

from __future__ import annotations

import errno
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import posenc
from posenc import ConfigError, PosencError, Schedule
from posenc.schedule import MAX_LAYERS


# ------------------------------------------------------------------------------- schedule strings
@settings(max_examples=80, deadline=None)
@given(st.text(min_size=1, max_size=3))
def test_any_count_after_a_star_is_a_number_or_a_clear_error(count: str) -> None:
    text = f"rope*{count}"
    try:
        sched = posenc.schedule(text)
    except PosencError as err:
        assert re.search(r"layer \d+|schedule", str(err)), str(err)  # it says where
        return
    # accepted: the count was ASCII digits, and the schedule holds that many layers
    assert re.fullmatch(r"\s*[0-9]+\s*", count) and len(sched) == int(count)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 10**12), min_size=1, max_size=4))
def test_large_counts_are_refused_before_the_list_is_built(counts: list[int]) -> None:
    text = "+".join(f"rope*{c}" for c in counts)
    if sum(counts) <= MAX_LAYERS:
        assert len(posenc.schedule(text)) == sum(counts)
        return
    with pytest.raises(ConfigError, match=rf"at most {MAX_LAYERS} layers"):
        posenc.schedule(text)  # a MemoryError (or 9 s) before: the check comes first


@pytest.mark.parametrize("text", ["rope*1000000000", "rope*99999999999999999999", "nope*3+rope*100000"])
def test_the_issue_rows_of_huge_counts(text: str) -> None:
    with pytest.raises(ConfigError, match=rf"at most {MAX_LAYERS} layers"):
        posenc.schedule(text)


@pytest.mark.parametrize("digit", ["²", "٣", "３", "Ⅳ", "-1", "0", "1.5", "3x"])
def test_counts_that_int_would_take_or_refuse_are_clear_errors(digit: str) -> None:
    with pytest.raises(ConfigError, match=r"layer 0: .*the count after '\*' must be an integer >= 1, got "):
        posenc.schedule(f"rope*{digit}")


@pytest.mark.parametrize("text", ["rope@", "rope@ ", "rope(base=500.0)@", "nope+rope@", "rope@#qk"])
def test_an_empty_span_says_what_a_span_is_not_a_question_mark(text: str) -> None:
    with pytest.raises(ConfigError) as err:
        posenc.schedule(text)
    assert "'?'" not in str(err.value) and "@w<W>" in str(err.value)


@pytest.mark.parametrize("layers", [5, 2.5, "rope", b"rope", {"encoding": "rope"}, None, True])
def test_a_stored_schedule_whose_layers_is_not_a_list(layers) -> None:
    with pytest.raises(ConfigError, match=r"'layers' is a list of layer dicts, got"):
        Schedule.from_dict({"layers": layers})


# ------------------------------------------------------------------------------- posenc extend
LENGTH_FIELDS = [
    ("ruler_lengths", (1e9,), "--ruler-lengths"),
    ("ruler_floor_lengths", (65.0,), "--ruler-floor-lengths"),
    ("passkey_lengths", (1e9,), "--passkey-lengths"),
    ("loss_extension", 1e9, "--loss-extension"),
]


@pytest.mark.parametrize(("field", "value", "flag"), LENGTH_FIELDS)
def test_extend_lengths_have_an_upper_bound(field: str, value, flag: str) -> None:
    from posenc.extend.config import LENGTH_MOST, ExtendConfig

    with pytest.raises(ConfigError, match=rf"<= {LENGTH_MOST:g}"):
        ExtendConfig(ruler_tasks=("vt",), **{field: value})


def test_the_ruler_lengths_flag_is_bounded_before_a_model_loads(capsys) -> None:
    from posenc.cli import main

    assert main(["extend", "--tasks", "ruler", "--ruler-lengths", "1e9", "--out", "/nonexistent/never-written"]) != 0
    err = capsys.readouterr().err
    assert "--ruler-lengths" in err and "<= 64" in err and "1000000000" in err


def test_extend_run_with_a_model_but_no_tokenizer() -> None:
    from torch import nn

    from posenc.extend import runner
    from posenc.extend.config import QUICK

    with pytest.raises(ConfigError, match=r"model=\.\.\.\) needs tokenizer="):
        runner.run(QUICK, "/nonexistent/never-written", model=nn.Linear(1, 1))


class _Chars:
    """A tokenizer of one token per character (what ``posenc.extend.ruler`` calls: ``tok(text)['input_ids']``)."""

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) % 5000 for c in text]}

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


@pytest.mark.parametrize("resumed", [False, True])
def test_a_ruler_length_too_short_for_a_task_is_found_before_any_cell(resumed: bool) -> None:
    from posenc.extend.runner import Cell, ruler_too_short

    trained = 256
    cells = [Cell("ruler", "as-trained", 1.0, tokens=t, task=task) for task in ("vt", "cwe") for t in (64, 20000)]
    if not resumed:  # a fresh run stops at once, naming the flag and each (task, length)
        with pytest.raises(ConfigError, match=r"64 tokens, too short for vt .*--ruler-lengths"):
            ruler_too_short(cells, _Chars(), trained, resumed=False)
        return
    bad = ruler_too_short(cells, _Chars(), trained, resumed=True)  # a resumed one goes past them
    assert set(bad) == {("vt", 64), ("cwe", 64)}
    assert all("--ruler-lengths" in why for why in bad.values())


def test_a_ruler_length_too_short_is_refused_before_the_model_loads(monkeypatch, tmp_path: Path) -> None:
    """Where the tokenizer loads without the weights (a converted cache, a folder), the tasks are checked against
    the lengths before the model loads: the weights are never read."""
    from dataclasses import replace
    from types import SimpleNamespace

    import posenc.pretrained
    from posenc.extend import runner
    from posenc.extend.config import ExtendConfig

    config = SimpleNamespace(max_position_embeddings=256, rope_parameters={})

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded before the lengths were checked")

    monkeypatch.setattr(posenc.pretrained, "load_tokenizer", lambda name: (_Chars(), config))
    monkeypatch.setattr(posenc.pretrained, "load_pretrained", never)
    cfg = replace(ExtendConfig(), scalings=(), passkey_scalings=(), ruler_tasks=("vt",), ruler_lengths=(0.25,),
                  ruler_relative=True)
    with pytest.raises(ConfigError, match=r"64 tokens, too short for vt .*--ruler-lengths"):
        runner.run(cfg, tmp_path / "out", quiet=True)


def test_load_tokenizer_reads_a_folder_without_its_weights(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from transformers import LlamaConfig

    from posenc.pretrained import load_tokenizer

    assert load_tokenizer(tmp_path / "nothing-here") is None  # only load_pretrained says what is wrong
    assert load_tokenizer(tmp_path) is None  # a folder without config.json
    LlamaConfig(max_position_embeddings=333).save_pretrained(tmp_path)
    assert load_tokenizer(tmp_path) is None  # no tokenizer there: load_pretrained's error names it


# ------------------------------------------------------------------------------- stores and caches
def test_a_results_store_path_that_exists_as_a_folder(tmp_path: Path) -> None:
    from posenc.bench.store import StoreError, open_store

    (tmp_path / "results.sqlite").mkdir()
    for given_path in (tmp_path, tmp_path / "results.sqlite"):
        with pytest.raises(StoreError, match=r"exists as a folder, not a SQLite file; remove or rename"):
            open_store(given_path)


def test_a_full_disk_while_safetensors_saves_names_the_cache_and_the_space(tmp_path: Path, monkeypatch) -> None:
    from safetensors import SafetensorError

    from posenc.pretrained import _as_os_error, _cache_error

    monkeypatch.setenv("POSENC_DATA", str(tmp_path))
    raw = SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space" })')
    as_os = _as_os_error(raw)
    assert isinstance(as_os, OSError) and as_os.errno == errno.ENOSPC
    text = str(_cache_error(as_os, tmp_path / "models", need_mb=540.0))
    assert str(tmp_path / "models") in text and "540 MB" in text and "MB free" in text and "POSENC_DATA" in text
    other = _as_os_error(SafetensorError("Error while serializing: IoError(Os { code: 13, kind: PermissionDenied })"))
    assert other.errno == errno.EACCES and "POSENC_DATA" in str(_cache_error(other, tmp_path))
