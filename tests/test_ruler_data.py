"""posenc.extend.ruler_data: RULER's own data read, asked and scored as NVIDIA/RULER's scripts do.

The truths: per-sample and task scores worked by hand from RULER's rules (scripts/eval/evaluate.py's
``postprocess_pred``, scripts/eval/synthetic/constants.py's ``string_match_all`` / ``string_match_part``) on fixture
files written for these tests in RULER's formats (tests/fixtures/ruler_data: ``data/`` as prepare.py lays out its
output, ``pred/`` as call_api.py does); the predictions of a slow greedy loop (a full forward a token, no cache) on
the tiny GGUF model; and, where a RULER checkout is given (``POSENC_RULER_DIR``), RULER's own evaluate.py and
prepare.py through benchmarks/ruler_crosscheck.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest

from posenc.errors import ConfigError
from posenc.extend import ruler_data

FIX = Path(__file__).parent / "fixtures" / "ruler_data"
BENCH = Path(__file__).resolve().parent.parent / "benchmarks"

#: RULER's per-sample numbers (round(100 x, 2)) for tests/fixtures/ruler_data/pred, worked by hand
BY_HAND = {
    "niah_single_1": [100.0, 100.0, 0.0, 0.0, 0.0, 0.0, 100.0],
    "niah_multikey_3": [100.0, 0.0],
    "vt": [60.0, 100.0, 40.0],
    "cwe": [70.0, 100.0],
    "fwe": [66.67, 0.0, 0.0],
    "qa_1": [100.0, 100.0, 0.0],
}
#: RULER's task score (round(100 mean, 2)) and nulls, by hand
TASK_BY_HAND = {
    "niah_single_1": (42.86, "3/7"),  # 3/7 = 0.428571...; "", " \n\t ", "\x00\x1f" are empty after post-processing
    "niah_multikey_3": (50.0, "0/2"),
    "vt": (66.67, "0/3"),
    "cwe": (85.0, "0/2"),
    "fwe": (22.22, "0/3"),  # (2/3 + 0 + 0) / 3 = 0.2222...
    "qa_1": (66.67, "0/3"),
}


def test_postprocessing_strips_and_turns_control_characters_into_newlines():
    assert ruler_data.postprocess("  42 \n") == "42"
    assert ruler_data.postprocess("\x00 42\x1f") == "42"  # U+0000 is no whitespace: it goes only through the sub
    assert ruler_data.postprocess("4\x0b2") == "4\n2"
    assert ruler_data.postprocess("\x00\x1f") == ""
    assert ruler_data.postprocess("42\x7f") == "42\x7f"  # DEL lies outside U+0000..U+001F


def test_the_metrics_per_sample():
    refs = ["QWERT", "ASDFG", "ZXCVB", "POIUY", "LKJHG"]
    assert ruler_data.string_match_all("qwert asdfg", refs) == 0.4
    assert ruler_data.string_match_part("qwert asdfg", refs) == 1.0
    assert ruler_data.string_match_part("nothing", refs) == 0.0
    assert ruler_data.score_sample("qa_2", " the broncos", ["Denver Broncos", "Broncos"]) == 1.0
    assert ruler_data.score_sample("niah_single_2", " the broncos", ["Denver Broncos", "Broncos"]) == 0.5
    assert ruler_data.task_score([1.0, 0.0, 0.0]) == 33.33 and ruler_data.task_score([2 / 3]) == 66.67


@pytest.mark.parametrize("task", sorted(BY_HAND))
def test_fixture_predictions_score_as_worked_by_hand(task):
    got = ruler_data.score_predictions(FIX / "pred")[task]
    assert [round(100 * s, 2) for s in got["scores"]] == BY_HAND[task]
    assert (got["score"], got["nulls"]) == TASK_BY_HAND[task]
    assert got["metric"] == ("string_match_part" if task == "qa_1" else "string_match_all")


def test_the_task_files_are_found_in_both_layouts_in_rulers_order(tmp_path):
    assert list(ruler_data.find_tasks(FIX / "data")) == ["niah_single_1", "vt"]
    assert list(ruler_data.find_tasks(FIX / "pred")) == ["niah_single_1", "niah_multikey_3", "vt", "cwe", "fwe", "qa_1"]
    with pytest.raises(ConfigError, match="holds no RULER data"):
        ruler_data.find_tasks(tmp_path)
    (tmp_path / "x.jsonl").write_text('{"input": "a", "outputs": []}\n')
    with pytest.raises(ConfigError, match="non-empty list of strings"):
        ruler_data.read_jsonl(tmp_path / "x.jsonl")
    (tmp_path / "x.jsonl").write_text('{"input": "a", "outputs": ["b"], "pred": "b"}\n')
    with pytest.raises(ConfigError, match="not one of RULER's synthetic.yaml tasks"):
        ruler_data.score_predictions(tmp_path)
    with pytest.raises(ConfigError, match="without a string 'pred'"):
        ruler_data.score_predictions(FIX / "data")


# ---------------------------------------------------------------------------------------------- a model
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    from tiny_gguf import write

    import posenc.hf

    root = tmp_path_factory.mktemp("ruler_data")
    path = root / "tiny.gguf"
    write(path, layers=2, hidden=32, heads=4, kv_heads=2, ff=64, context=512)
    old = os.environ.get("POSENC_DATA")
    os.environ["POSENC_DATA"] = str(root / "cache")
    try:
        model, tok = posenc.hf.load_pretrained(path, quiet=True)
    finally:
        if old is None:
            del os.environ["POSENC_DATA"]
        else:
            os.environ["POSENC_DATA"] = old
    return model, tok


def _slow_truth(model, tok, prompt: str, budget: int) -> str:
    """Greedy decoding by a full forward of everything each token, then RULER's cut of the decoded prompt."""
    import torch

    from posenc.extend.ruler import greedy

    ids = tok(prompt, return_tensors="pt")["input_ids"]
    eos = model.generation_config.eos_token_id
    gen = greedy(model, ids, None, budget, eos if isinstance(eos, int) else None)
    with torch.no_grad():
        full = tok.decode(ids[0].tolist() + gen, skip_special_tokens=True)
    return full[len(tok.decode(ids[0].tolist(), skip_special_tokens=True)) :]


def test_a_model_on_rulers_data_matches_slow_greedy_decoding_and_resumes(tiny, tmp_path, monkeypatch):
    model, tok = tiny
    seen = []
    got = ruler_data.score_ruler_data(
        model, tok, FIX / "data", tmp_path, tokens_to_generate=6, progress=lambda t, d, n: seen.append((t, d, n))
    )
    assert seen == [("niah_single_1", 1, 2), ("niah_single_1", 2, 2), ("vt", 1, 1)]
    for task in ("niah_single_1", "vt"):
        rows = ruler_data.read_jsonl(FIX / "data" / task / "validation.jsonl")
        recs = [json.loads(x) for x in (tmp_path / f"{task}.jsonl").read_text().splitlines()]
        assert len(recs) == len(rows) == got[task]["samples"]
        for row, rec in zip(rows, recs):
            assert rec["pred"] == _slow_truth(model, tok, row["input"] + row["answer_prefix"], 6)
            assert rec["score"] == ruler_data.score_sample(task, rec["pred"], row["outputs"])
            assert {"index", "pred", "input", "outputs", "others", "truncation", "length"} <= set(rec)
            assert rec["input"] == row["input"] and 1 <= rec["generated"] <= 6
        assert got[task]["score"] == ruler_data.task_score([r["score"] for r in recs])
    assert json.loads((tmp_path / "summary.json").read_text()) == got
    # a second run over the same output folder asks nothing again
    monkeypatch.setattr(ruler_data, "predict", lambda *a, **k: pytest.fail("asked again"))
    again = ruler_data.score_ruler_data(model, tok, FIX / "data", tmp_path, tokens_to_generate=6)
    assert {t: s["score"] for t, s in again.items()} == {t: s["score"] for t, s in got.items()}


def test_a_posenc_patched_model_generates_as_its_slow_truth(tiny, tmp_path):
    """YaRN (s = 2) patched in by posenc: transformers' generate with its cache gives the tokens a full forward a
    token gives, so ``posenc extend --ruler-data`` scores a scaled model as it scores the plain one."""
    from posenc.extend.runner import apply_scaling

    model, tok = tiny
    plain = ruler_data.score_ruler_data(model, tok, FIX / "data", tmp_path / "plain", tokens_to_generate=6)
    try:
        apply_scaling(model, "rope-yarn", 2.0)
        ruler_data.score_ruler_data(model, tok, FIX / "data", tmp_path / "yarn", tokens_to_generate=6)
        rows = ruler_data.read_jsonl(FIX / "data" / "niah_single_1" / "validation.jsonl")
        recs = ruler_data.read_jsonl(tmp_path / "yarn" / "niah_single_1.jsonl")
        truth = [_slow_truth(model, tok, r["input"] + r["answer_prefix"], 6) for r in rows]
    finally:
        apply_scaling(model, "as-trained", 1.0)
    assert [r["pred"] for r in recs] == truth
    again = ruler_data.score_ruler_data(model, tok, FIX / "data", tmp_path / "plain2", tokens_to_generate=6)
    assert {t: s["score"] for t, s in again.items()} == {t: s["score"] for t, s in plain.items()}


def test_rulers_budgets_are_the_default_and_bad_arguments_say_so(tiny, tmp_path, monkeypatch):
    model, tok = tiny
    budgets = []
    monkeypatch.setattr(ruler_data, "predict", lambda m, t, p, n: (budgets.append(n), ("", 0))[1])
    got = ruler_data.score_ruler_data(model, tok, FIX / "data", tmp_path, limit=1)
    assert budgets == [128, 30] and got["niah_single_1"]["nulls"] == "1/1"
    with pytest.raises(ConfigError, match="no RULER data for cwe"):
        ruler_data.score_ruler_data(model, tok, FIX / "data", tmp_path, tasks=["cwe"])
    with pytest.raises(ConfigError, match="limit is a positive number"):
        ruler_data.score_ruler_data(model, tok, FIX / "data", tmp_path, limit=0)


def _extend(*argv: str) -> int:
    from posenc.cli import main

    return main(["extend", *argv])


def test_the_cli_scores_rulers_data_for_each_scaling_as_the_library_does(tiny, tmp_path, monkeypatch, capsys):
    """``posenc extend --ruler-data DIR``: the same predictions and scores as score_ruler_data on the same model, one
    folder a scaling, the model as trained again afterwards; its bad flags are named before a model loads."""
    import posenc.pretrained

    model, tok = tiny
    monkeypatch.setattr(posenc.pretrained, "load_pretrained", lambda name, **k: (model, tok))
    monkeypatch.setattr(ruler_data, "TOKENS_TO_GENERATE", {k: 4 for k in ruler_data.TOKENS_TO_GENERATE})
    assert _extend("--ruler-data", str(FIX / "data"), "--ruler-scalings", "as-trained", "rope-yarn",
                   "--haystacks", "1", "--out", str(tmp_path)) == 0
    printed = capsys.readouterr().out
    assert "rope-yarn" in printed and "niah_single_1" in printed and "vt" in printed
    plain = ruler_data.score_ruler_data(model, tok, FIX / "data", tmp_path / "lib", limit=1)
    for task in ("niah_single_1", "vt"):
        got = ruler_data.read_jsonl(tmp_path / "ruler-data" / "as-trained" / f"{task}.jsonl")
        want = ruler_data.read_jsonl(tmp_path / "lib" / f"{task}.jsonl")
        assert [r["pred"] for r in got] == [r["pred"] for r in want] and len(got) == 1
        assert (tmp_path / "ruler-data" / "rope-yarn" / f"{task}.jsonl").is_file()
    from posenc.hf.state import patched

    assert patched(model) is None  # as trained again after the rope-yarn pass
    again = ruler_data.score_ruler_data(model, tok, FIX / "data", tmp_path / "lib2", limit=1)
    assert {t: s["score"] for t, s in again.items()} == {t: s["score"] for t, s in plain.items()}


@pytest.mark.parametrize("argv, words", [
    (["--quick"], ["--quick", "describe posenc's own cells"]),
    (["--template", "base"], ["--template"]),
    (["--tasks", "cwe"], ["no RULER data for cwe", "niah_single_1"]),
    (["--ruler-scalings", "rope-yarnn"], ["unknown scaling 'rope-yarnn'", "did you mean rope-yarn"]),
    (["--haystacks", "0"], ["--haystacks"]),
])
def test_the_cli_names_a_bad_flag_beside_ruler_data_before_loading(argv, words, tmp_path, monkeypatch, capsys):
    import posenc.pretrained

    monkeypatch.setattr(posenc.pretrained, "load_pretrained", lambda *a, **k: pytest.fail("loaded a model"))
    assert _extend("--ruler-data", str(FIX / "data"), "--out", str(tmp_path), *argv) == 2
    err = capsys.readouterr().err
    for w in words:
        assert w in err
    assert _extend("--ruler-data", str(tmp_path / "nowhere"), "--out", str(tmp_path)) == 2
    assert "is not a folder" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- NVIDIA's scripts
def _crosscheck():
    spec = importlib.util.spec_from_file_location("ruler_crosscheck", BENCH / "ruler_crosscheck.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def ruler_checkout():
    cc = _crosscheck()
    where = os.environ.get("POSENC_RULER_DIR")
    problem = cc.checkout_problem(Path(where) if where else None)
    if problem:
        pytest.skip(f"{problem}: benchmarks/ruler_crosscheck.py's docstring says how to make one")
    return cc, Path(where)


def test_rulers_evaluate_gives_the_hand_worked_scores_on_the_fixtures(ruler_checkout, tmp_path):
    cc, ruler = ruler_checkout
    preds = tmp_path / "pred"
    shutil.copytree(FIX / "pred", preds)
    shim = cc.make_shim(tmp_path / "shim")
    rows = cc.compare(ruler, shim, preds, ruler_data.score_predictions(preds))
    assert {r["task"]: r["ruler_task"] for r in rows} == TASK_BY_HAND
    assert all(r["per_sample_equal"] and r["task_equal"] for r in rows), rows


@pytest.mark.slow
def test_rulers_prepare_offline_then_both_scorers_agree(ruler_checkout, tmp_path):
    cc, ruler = ruler_checkout
    code = cc.main(["--ruler", str(ruler), "--length", "1024", "--samples", "8", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "crosscheck.json").read_text())
    ok = {r["task"] for r in report["prepare"] if r["ok"]}
    assert ok == set(cc.OFFLINE), report["prepare"]
    assert all(r["fits"] for r in report["prepare"])
    assert code == 0 and report["equal"]
