"""RULER's six tasks (posenc.extend.ruler): each built to an exact token count with its needles, chains, words and
answers where the paper's configuration puts them, the same for a seed; many questions on one prefill give the
answers a full forward of each whole prompt gives (transformers' generate); the Wilson interval against worked
values; the table, verdicts and floor from stored cells; the command line. On the tiny GGUF model's tokenizer
(byte-level BPE: about a token a byte) and model (tests/tiny_gguf.py)."""

from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import replace

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("wonderwords")

from tiny_gguf import write  # noqa: E402

import posenc.hf  # noqa: E402
from posenc.errors import ConfigError  # noqa: E402
from posenc.extend import ruler, ruler_report  # noqa: E402
from posenc.extend import runner as extend_run  # noqa: E402
from posenc.extend.config import AS_TRAINED, FULL, QUICK, ExtendConfig, count_cells  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("ruler")
    path = root / "tiny.gguf"
    write(path, layers=2, hidden=32, heads=4, kv_heads=2, ff=64, context=256)
    old = os.environ.get("POSENC_DATA")
    os.environ["POSENC_DATA"] = str(root / "cache")
    try:
        model, tok = posenc.hf.load_pretrained(path, quiet=True)
    finally:
        if old is None:
            del os.environ["POSENC_DATA"]
        else:
            os.environ["POSENC_DATA"] = old
    return model, tok, path


def _text(tok, ids) -> str:
    return tok.decode(list(ids))


# ---------------------------------------------------------------------------------------------- construction
@pytest.mark.parametrize("task", ruler.TASKS)
@pytest.mark.parametrize("n", [2200, 3111])
def test_every_task_is_built_to_its_exact_length(tiny, task, n):
    _, tok, _ = tiny
    ex = ruler.build(task, tok, n, seed=3, questions=6)
    longest = max(len(q.ids) for q in ex.questions)
    assert len(ex.context) + longest + ex.generate == n == ex.length
    assert ex.generate == ruler.GENERATE[task]
    # the ids are the pieces' own tokenizations: they decode to the text of the example
    assert _text(tok, ex.context) == ex.text and ex.text.startswith(("A special", "Memorize", "Below", "Read"))
    for q in ex.questions:
        assert 0 < q.depth < 1
        prompt = _text(tok, ex.prompt(ex.questions.index(q)))
        assert prompt.rstrip().endswith(("provided text is", "they are:", "in the list are:", "words are:"))
    assert (len(ex.questions) == 6) == (task in ruler.MULTI)


def test_niah_single_needle_once_at_its_depth(tiny):
    _, tok, _ = tiny
    depths = []
    for seed in range(6):
        ex = ruler.build("niah_single_1", tok, 1200, seed=seed)
        (q,) = ex.questions
        (value,) = q.answers
        assert re.fullmatch(r"[1-9]\d{6}", value) and re.fullmatch(r"[a-z]+-[a-z]+", q.key.lower())
        needle = f"One of the special magic numbers for {q.key} is: {value}."
        assert ex.text.count(needle) == 1 and ex.text.count(value) == 1 and ex.text.count(q.key) == 1
        # the recorded depth is where the needle starts, as a share of the context's tokens
        start = ex.text.index(needle)
        assert abs(len(tok(ex.text[:start], add_special_tokens=False)["input_ids"]) / len(ex.context) - q.depth) < 0.02
        assert ex.text.replace(needle + "\n", "").count(ruler.NOISE) >= 8
        depths.append(q.depth)
    assert max(depths) - min(depths) > 0.3  # RULER's random places, not one depth


@pytest.mark.parametrize("task", ruler.MULTI)
def test_multikey_every_asked_key_and_value_once(tiny, task):
    _, tok, _ = tiny
    ex = ruler.build(task, tok, 3000, seed=1, questions=8)
    lines = [line for line in ex.text.split("\n") if line.startswith("One of the special magic")]
    assert len(lines) == ex.info["needles"] >= 8
    pattern = r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}" if task.endswith("3") else None
    depths = [q.depth for q in ex.questions]
    assert depths == sorted(depths) and len({q.key for q in ex.questions}) == 8
    for q in ex.questions:
        (value,) = q.answers
        assert ex.text.count(q.key) == 1 and ex.text.count(value) == 1
        assert f"for {q.key} is: {value}." in ex.text
        if pattern:
            assert re.fullmatch(pattern, q.key) and re.fullmatch(pattern, value)


def test_vt_chain_in_order_after_a_one_shot(tiny):
    _, tok, _ = tiny
    ex = ruler.build("vt", tok, 2000, seed=5)
    (q,) = ex.questions
    names = q.answers
    assert len(names) == 5 and all(re.fullmatch(r"[A-Z]{5}", v) for v in names)
    value = q.key
    body = ex.text[ex.text.rindex("Memorize and track"):]  # after the one-shot example
    assert body.count(value) == 1 and f"VAR {names[0]} = {value}" in body
    at = [body.index(f"VAR {names[0]} = {value}")] + [body.index(f"VAR {names[i + 1]} = VAR {names[i]}") for i in
                                                       range(4)]
    assert at == sorted(at)  # the hops in order
    shot = ex.text[: ex.text.rindex("Memorize and track")]
    assert re.search(r"they are: [A-Z]{3} [A-Z]{3} [A-Z]{3} [A-Z]{3} [A-Z]{3}\n\n$", shot)
    assert value not in shot


@pytest.mark.parametrize("n, common, rare", [(2500, 6, 1), (8000, 30, 3)])
def test_cwe_counts_its_words(tiny, n, common, rare):
    _, tok, _ = tiny
    ex = ruler.build("cwe", tok, n, seed=2)
    (q,) = ex.questions
    listing = ex.text[ex.text.rindex(ruler.CWE_HEAD) + len(ruler.CWE_HEAD):]
    items = re.findall(r"(\d+)\. (\S+)", listing)
    assert [int(i) for i, _ in items] == list(range(1, len(items) + 1))
    counts = Counter(w for _, w in items)
    assert {counts[w] for w in q.answers} == {common} and len(q.answers) == 10
    assert {c for w, c in counts.items() if w not in q.answers} == {rare}
    assert len(counts) == 10 + ex.info["uncommon_words"]


def test_fwe_counts_follow_zipf(tiny):
    _, tok, _ = tiny
    ex = ruler.build("fwe", tok, 3000, seed=4)
    (q,) = ex.questions
    words = ex.text[len(ruler.FWE_HEAD):].split()
    counts = Counter(w for w in words if w != "...")
    want = ruler.zipf_counts(ex.info["words"], ex.info["vocabulary"])
    assert [counts[w] for w in q.answers] == want[1:4]
    assert [w for w, _ in counts.most_common(3)] == list(q.answers)
    # zeta(2) = pi^2 / 6
    assert ruler.zipf_counts(1000, 3) == [int(1000 / (torch.pi**2 / 6) / k**2) for k in (1, 2, 3)]


@pytest.mark.parametrize("task", ruler.TASKS)
def test_the_same_seed_the_same_example(tiny, task):
    _, tok, _ = tiny
    a, b = ruler.build(task, tok, 2400, seed=9, questions=3), ruler.build(task, tok, 2400, seed=9, questions=3)
    assert a == b
    assert ruler.build(task, tok, 2400, seed=10, questions=3).context != a.context


def test_bad_input_is_named(tiny):
    _, tok, _ = tiny
    with pytest.raises(ConfigError, match="unknown RULER task 'niah'"):
        ruler.build("niah", tok, 1000, 0)
    with pytest.raises(ConfigError, match="needs more than"):
        ruler.build("cwe", tok, 300, 0)
    with pytest.raises(ConfigError, match="positive number of tokens"):
        ruler.build("vt", tok, 0, 0)


# ---------------------------------------------------------------------------------------------- scoring
def test_wilson_against_worked_values():
    # 8 of 10, z = 1.96: centre (0.8 + 0.19208) / 1.38416 = 0.71674, half 1.96 sqrt(0.016 + 0.009604) / 1.38416
    lo, hi = ruler.wilson(8, 10)
    assert lo == pytest.approx(0.4902, abs=1e-4) and hi == pytest.approx(0.9433, abs=1e-4)
    assert ruler.wilson(0, 20) == pytest.approx((0.0, 0.1611), abs=1e-4)  # 3.8416 / 23.8416
    assert ruler.wilson(20, 20) == pytest.approx((0.8389, 1.0), abs=1e-4)
    with pytest.raises(ConfigError):
        ruler.wilson(3, 0)


def test_string_match_all_is_rulers():
    assert ruler.string_match_all(" 1234567.", ["1234567"]) == 1.0
    assert ruler.string_match_all("ABCDE fghij", ["abcde", "FGHIJ", "KLMNO"]) == pytest.approx(2 / 3)
    assert ruler.string_match_all("nothing", ["x1"]) == 0.0


# ---------------------------------------------------------------------------------------------- asking
@pytest.mark.parametrize("scaling", [None, ("rope-yarn", {"factor": 4})])
@pytest.mark.parametrize("chunk", [64, None])
def test_many_questions_on_one_prefill_equal_a_full_forward_each(tiny, scaling, chunk):
    model, tok, _ = tiny
    posenc.hf.unpatch(model)
    if scaling:
        posenc.hf.patch(model, scaling[0], **scaling[1])
    try:
        ex = ruler.build("niah_multikey_2", tok, 700, seed=0, questions=4)
        got = ruler.ask(model, tok, ex, chunk=chunk)
        assert len(got) == 4
        for i, rec in enumerate(got):
            ids = torch.tensor([ex.prompt(i)])
            with torch.no_grad():
                full = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=ex.generate,
                                      do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
            want = tok.decode(full[0, ids.shape[1]:].tolist())
            assert rec["prediction"] == want  # the tiny random model finds no answer: it stops at the limit or EOS
            assert rec["generated"] == full.shape[1] - ids.shape[1] and rec["score"] == 0.0
            slow = ruler.greedy(model, torch.tensor([ex.prompt(i)]), None, ex.generate, tok.eos_token_id)
            assert tok.decode(slow) == want
    finally:
        posenc.hf.unpatch(model)


def test_generation_stops_once_every_reference_is_found(tiny):
    model, tok, _ = tiny
    ex = ruler.build("niah_single_1", tok, 600, seed=0)
    q = ex.questions[0]
    first = ruler.greedy(model, torch.tensor([ex.prompt(0)]), None, 1, None)
    # a question whose reference is the model's own first generated token is done after one step
    fake = ruler.Example(ex.task, ex.context, (ruler.Question(q.ids, (tok.decode(first),), q.key, q.depth),),
                         ex.length, ex.generate, ex.seed)
    got = ruler.ask(model, tok, fake)[0]
    assert got["generated"] == 1 and got["score"] == 1.0


# ---------------------------------------------------------------------------------------------- cells and report
def _cfg(**kw):
    base = dict(model="tiny", scalings=(), loss_long_scalings=(), passkey_scalings=(),
                ruler_tasks=("niah_multikey_2", "vt"), ruler_scalings=(AS_TRAINED, "rope-yarn"),
                ruler_lengths=(3.0, 4.0), ruler_haystacks=2, ruler_questions=3, chunk=128)
    base.update(kw)
    return ExtendConfig(**base)


def test_the_plan_of_ruler_cells_and_the_quick_mode():
    cfg = _cfg()
    cells = extend_run.plan(cfg, 256)
    assert len(cells) == count_cells(cfg) == 2 * 2 * 2 * 2
    assert [c.tokens for c in cells] == [768] * 8 + [1024] * 8
    assert [c.haystack for c in cells[:8]] == [0] * 4 + [1] * 4  # every first haystack before any second
    assert {c.factor for c in cells if c.scaling == "rope-yarn"} == {4.0}
    assert {c.questions for c in cells if c.task == "vt"} == {1} and {c.questions for c in cells} == {1, 3}
    full = extend_run.plan(replace_ruler(FULL), 8192)
    short = [c for c in full if c.tokens == 2048]
    # L/4: the model as trained only, 20 questions a cell (20 haystacks for a one-question task, one for a multi-key)
    assert {c.scaling for c in short} == {AS_TRAINED} and not any(c.unless_floor for c in short)
    for task in ruler.TASKS:
        mine = [c for c in short if c.task == task]
        assert sum(c.questions for c in mine) == 20 and sorted(c.haystack for c in mine) == list(range(len(mine)))
    assert [c.haystack for c in short[:6]] == [0] * 6  # every task's first haystack before any second
    # L and 2L: every scaling, s = 2, unless the model is at the floor on the task inside L
    long = [c for c in full if c.tokens > 2048]
    assert len(long) == 6 * 4 * 2 and all(c.unless_floor for c in long) and {c.factor for c in long} == {1, 2}
    assert len(full) == count_cells(replace_ruler(FULL)) == len(short) + len(long)
    quick = [(c.task, c.scaling, c.tokens) for c in extend_run.plan(replace_ruler(QUICK), 8192)]
    assert quick == [(t, AS_TRAINED, 2048) for t in ruler.TASKS] + [
        ("niah_multikey_2", AS_TRAINED, 16384), ("niah_multikey_2", "rope-yarn", 16384)]


def replace_ruler(cfg):
    return replace(cfg, scalings=(), passkey_scalings=(), ruler_tasks=ruler.TASKS)


def test_run_stores_resumes_and_reports_ruler(tiny, tmp_path, capsys):
    model, tok, _ = tiny
    cfg = _cfg(ruler_lengths=(5.0, 6.0))  # vt needs about 1200 tokens of this byte-level tokenizer
    first = extend_run.run(cfg, tmp_path, model=model, tokenizer=tok, max_cells=3)
    err = capsys.readouterr().err
    assert "prefilled" in err and "question 3/3" in err and "left in the run at this pace" in err
    assert len(first) == 3
    records = extend_run.run(cfg, tmp_path, model=model, tokenizer=tok, quiet=True)
    assert len(records) == 16 and posenc.hf.patched(model) is None
    r = next(r for r in records if r["task"] == "niah_multikey_2")
    assert len(r["answers"]) == 3 and r["context_tokens"] < r["tokens"] and r["model"]["sha256"] and r["env"]
    cs = ruler_report.cells(records)
    c = cs[("niah_multikey_2", AS_TRAINED, 1.0, 1280)]
    assert (c.questions, c.haystacks) == (6, 2)
    assert (c.low, c.high) == pytest.approx(ruler.wilson(c.score * 6, 6))
    table = "\n".join(ruler_report.table(records))
    assert "n=6/2h" in table and "**average**" in table
    # past L only (L = 256): no floor known, and the random model's zeros resolve no difference
    assert ruler_report.floor_tasks(records) == {}
    assert {v.verdict for v in ruler_report.verdicts(records)} == {"no difference resolved"}
    # taken as inside a longer L, the tiny random model is at the floor on every task: no verdict
    assert set(ruler_report.floor_tasks(records, 2000)) == {"niah_multikey_2"}  # 0 of 6: [0 %, 39 %]
    assert set(ruler_report.too_few(records, 2000)) == {"vt"}  # 0 of 2 questions: [0 %, 66 %] is no floor
    from posenc.extend import report

    paths = report.write(records, tmp_path, command="posenc extend --tasks ruler (test)")
    assert paths["ruler"].stat().st_size > 10_000 and paths["markdown"].read_text().startswith(
        "# RULER by length: tiny.gguf")


def test_lengths_past_the_floor_are_cut(tmp_path, monkeypatch):
    path = tmp_path / "tiny-2k.gguf"
    write(path, layers=1, hidden=16, heads=2, kv_heads=1, ff=32, context=2048)  # L = 2048: room inside L
    monkeypatch.setenv("POSENC_DATA", str(tmp_path / "cache"))
    model, tok = posenc.hf.load_pretrained(path, quiet=True)
    cfg = _cfg(ruler_tasks=("niah_multikey_2",), ruler_lengths=(0.5,), ruler_floor_lengths=(2.0,), ruler_haystacks=1,
               ruler_scalings=(AS_TRAINED,), ruler_questions=8, chunk=512)
    records = extend_run.run(cfg, tmp_path, model=model, tokenizer=tok, quiet=True)
    assert [r["tokens"] for r in records] == [1024]  # at the floor inside L: 2L never runs
    assert ruler_report.floor_tasks(records) == {"niah_multikey_2": "0% [0%–32%] of 8 question(s) at 1024 tokens"}


def _rec(task, scaling, tokens, scores, factor=2.0, trained=100, haystack=0):
    return {"kind": "ruler", "task": task, "scaling": scaling, "factor": 1.0 if scaling == AS_TRAINED else factor,
            "tokens": tokens, "trained_length": trained, "haystack": haystack,
            "answers": [{"score": s} for s in scores]}


def test_verdicts_follow_the_intervals():
    recs = [
        _rec("niah_multikey_2", AS_TRAINED, 100, [1] * 18 + [0] * 2),
        _rec("niah_multikey_2", AS_TRAINED, 200, [0] * 20),
        _rec("niah_multikey_2", "rope-yarn", 200, [1] * 15 + [0] * 5),
        _rec("niah_multikey_2", "rope-linear", 200, [1] * 3 + [0] * 17),
        _rec("niah_multikey_2", "rope-ntk", 200, [1] * 12 + [0] * 8),
        _rec("cwe", AS_TRAINED, 100, [0.0] * 19 + [0.05]),  # at the floor inside L
        _rec("cwe", AS_TRAINED, 200, [0.0] * 20),
        _rec("vt", AS_TRAINED, 100, [0.0]),  # one question: too few to call the floor
    ]
    v = {x.finding: x for x in ruler_report.verdicts(recs)}
    assert v["as trained fails past L (at 2L)"].verdict == "yes"
    assert v["YaRN, s=2 beats PI (linear), s=2 at 2L"].verdict == "yes"
    assert v["NTK-aware, s=2 against YaRN, s=2 at 2L"].verdict == "no difference resolved"
    assert v["cwe"].verdict == "at the floor" and "cwe" not in v["YaRN, s=2 beats PI (linear), s=2 at 2L"].evidence
    table = "\n".join(ruler_report.table(recs))
    assert "At the floor inside L (no verdict): cwe" in table and "75% [53%–89%] n=20/1h" in table


def test_cli_tasks_ruler_on_the_tiny_model(tiny, tmp_path, capsys, monkeypatch):
    from posenc.cli import main

    _, _, path = tiny
    monkeypatch.setenv("POSENC_DATA", str(tmp_path / "cache"))
    out = tmp_path / "r"
    argv = ["extend", "--tasks", "niah_multikey_3", "--model", str(path), "--out", str(out), "--ruler-lengths", "8",
            "--ruler-scalings", "as-trained", "--questions", "2", "--chunk", "512"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "RULER by length" in printed and "RULER verdicts" in printed
    assert {r["kind"] for r in extend_run.Store(out).records()} == {"ruler"}
    assert (out / "extend-ruler.png").is_file()
    assert main(["extend", "--tasks", "rulr", "--out", str(out)]) == 2
    assert "did you mean ruler" in capsys.readouterr().err
    assert main(["extend", "--tasks", "ruler", "--scalings", "rope-yarn", "--out", str(out)]) == 2
    assert "add loss" in capsys.readouterr().err


def test_cli_takes_a_transformers_folder(tiny, tmp_path, capsys, monkeypatch):
    """--model: a transformers folder works as a GGUF file does (the tiny model's converted cache is one)."""
    from posenc.cli import main

    _, _, path = tiny
    monkeypatch.setenv("POSENC_DATA", str(tmp_path / "cache"))
    posenc.hf.load_pretrained(path, quiet=True)
    (folder,) = (tmp_path / "cache" / "models").iterdir()
    out = tmp_path / "f"
    argv = ["extend", "--tasks", "niah_single_1", "--model", str(folder), "--out", str(out), "--ruler-lengths", "4",
            "--ruler-scalings", "as-trained", "rope-linear"]
    assert main(argv) == 0
    records = extend_run.Store(out).records()
    assert [(r["scaling"], r["tokens"]) for r in records] == [(AS_TRAINED, 1024), ("rope-linear", 1024)]
    assert records[0]["model"]["source"] == "local folder"


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(ruler_tasks=("niah_single",)), "unknown task 'niah_single' \\(did you mean niah_single_1"),
        (dict(ruler_lengths=(0.01,)), "ExtendConfig.ruler_lengths"),
        (dict(ruler_haystacks=0), "ExtendConfig.ruler_haystacks"),
        (dict(ruler_scalings=()), "ruler_scalings or ruler_lengths is empty"),
    ],
)
def test_bad_ruler_configs_are_named(change, message):
    with pytest.raises(ConfigError, match=message):
        _cfg(**change)


def test_cli_names_a_bad_ruler_flag(tmp_path, capsys):
    from posenc.cli import main

    assert main(["extend", "--tasks", "ruler", "--haystacks", "0", "--out", str(tmp_path)]) == 2
    assert "--haystacks" in capsys.readouterr().err
    assert main(["extend", "--haystacks", "2", "--out", str(tmp_path)]) == 2
    assert "add --tasks ruler" in capsys.readouterr().err


def test_fill_below_gives_one_question_tasks_their_questions_and_the_page_shows_ruler(tiny, tmp_path):
    """--fill-below: a one-question task's cell gets a haystack per question; `posenc results` exports the RULER
    store to its own data file and the page's section (table, heatmap) comes from it."""
    from posenc.extend import report

    model, tok, _ = tiny
    cfg = _cfg(ruler_lengths=(5.0,), ruler_scalings=(AS_TRAINED,), ruler_fill_below=5.0, ruler_questions=3,
               ruler_haystacks=1)
    assert count_cells(cfg) == 1 + 3  # niah_multikey_2: one haystack of 3 questions; vt: 3 haystacks of one
    stores = tmp_path / "posenc-results"
    records = extend_run.run(cfg, stores / "extend-ruler-quick", model=model, tokenizer=tok, quiet=True)
    cs = ruler_report.cells(records)
    assert (cs[("vt", AS_TRAINED, 1.0, 1280)].questions, cs[("vt", AS_TRAINED, 1.0, 1280)].haystacks) == (3, 3)
    mk = cs[("niah_multikey_2", AS_TRAINED, 1.0, 1280)]
    assert (mk.questions, mk.haystacks) == (3, 1)
    assert len({r["key"] for r in records}) == 4 and {r["haystack"] for r in records if r["task"] == "vt"} == {0, 1, 2}
    data = tmp_path / "data"
    assert report.export_store(stores, data) == [data / report.RULER_PAGE_DATA]
    text = "\n".join(report.page_section(data, img_rel="results/img", img_dir=tmp_path / "img"))
    assert text.startswith("## RULER by length: tiny.gguf") and "### RULER by length" not in text
    assert "`posenc extend --tasks ruler`" in text and "n=3/3h" in text and "n=3/1h" in text
    assert (tmp_path / "img" / "extend-ruler.png").is_file()
    # below the fill length only: past it, one haystack a cell again
    assert count_cells(replace(cfg, ruler_lengths=(5.0, 6.0), ruler_fill_below=5.5)) == 4 + 2


def test_a_small_model_decodes_on_one_thread_and_the_threads_come_back(tiny, monkeypatch):
    model, tok, _ = tiny
    before = torch.get_num_threads()
    seen = []
    real = ruler.greedy
    monkeypatch.setattr(ruler, "greedy", lambda *a, **k: (seen.append(torch.get_num_threads()), real(*a, **k))[1])
    torch.set_num_threads(2)
    try:
        ruler.ask(model, tok, ruler.build("niah_multikey_2", tok, 600, seed=0, questions=2))
        assert seen == [1, 1] and torch.get_num_threads() == 2  # the prefill's threads are back afterwards
        monkeypatch.setattr(ruler, "SMALL_MODEL", 10)  # a "large" model keeps the threads it was given
        seen.clear()
        ruler.ask(model, tok, ruler.build("niah_multikey_2", tok, 600, seed=0, questions=2))
        assert seen == [2, 2]
    finally:
        torch.set_num_threads(before)


def test_the_readme_paragraph_averages_the_tasks_not_at_the_floor(tmp_path):
    """The README's RULER table: per scaling and length, the mean over the tasks not at the floor inside L (cwe is),
    its interval the tasks' Wilson half-widths in quadrature over their count; written into the README's block by
    `posenc results --readme` from the page's data file, and `--check` holds afterwards."""
    import json

    from posenc.bench import results_page
    from posenc.extend import report

    recs = [
        _rec("niah_single_1", AS_TRAINED, 25, [1] * 16 + [0] * 4),
        _rec("niah_multikey_2", AS_TRAINED, 25, [1] * 10 + [0] * 10),
        _rec("cwe", AS_TRAINED, 25, [0.0] * 20),
        _rec("niah_single_1", AS_TRAINED, 200, [0] * 5),
        _rec("niah_multikey_2", AS_TRAINED, 200, [0] * 20),
        _rec("niah_single_1", "rope-yarn", 200, [1] * 5),
        _rec("niah_multikey_2", "rope-yarn", 200, [1] * 4 + [0] * 16),
    ]
    for r in recs:
        r["model"] = {"name": "m"}
    lines = ruler_report.readme_lines(recs, "docs/results.md#ruler-by-length-m")
    assert "(niah_single_1, niah_multikey_2)" in lines[0] and "at the floor (no verdict): cwe" in lines[0]

    def want(cells):
        score = sum(k / n for k, n in cells) / len(cells)
        half = sum(((ruler.wilson(k, n)[1] - ruler.wilson(k, n)[0]) / 2) ** 2 for k, n in cells) ** 0.5 / len(cells)
        return f"{score:.0%} [{max(0, score - half):.0%}–{min(1, score + half):.0%}]"

    assert lines[4] == f"| as trained (plain RoPE) | {want([(16, 20), (10, 20)])} | {want([(0, 5), (0, 20)])} |"
    assert lines[5] == f"| YaRN, s=2 | — | {want([(5, 5), (4, 20)])} |"
    # through posenc results: the README's block gains the paragraph, and --check agrees with it
    page, data = tmp_path / "docs" / "results.md", tmp_path / "docs" / "results" / "data"
    data.mkdir(parents=True)
    (data / report.RULER_PAGE_DATA).write_text("".join(json.dumps(r) + "\n" for r in recs))
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\n<!-- results:start (written by posenc results --readme README.md; do not edit by hand) "
                      "-->\n<!-- results:end -->\n")
    results_page.write_page(page, readme=readme, plots=False, log=lambda _: None)
    text = readme.read_text()
    assert "**RULER by length** ([the real model](docs/results.md#ruler-by-length-m))" in text and lines[4] in text
    assert results_page.check_page(page, readme=readme)[0]


def test_the_time_left_leaves_out_the_cells_the_floor_will_cut(tmp_path):
    from posenc.extend.runner import Cell, Store, cell_work, work_left

    store = Store(tmp_path)
    at_floor = _rec("cwe", AS_TRAINED, 25, [0.0] * 20)  # 0 of 20 inside L = 100: at the floor
    live = _rec("vt", AS_TRAINED, 25, [1.0] * 20)
    for i, r in enumerate((at_floor, live)):
        store.add({**r, "key": f"k{i}", "model": {"name": "m"}})
    cells = [Cell("ruler", AS_TRAINED, 1.0, tokens=200, task=t, unless_floor=u)
             for t, u in (("cwe", True), ("vt", True), ("cwe", False))]
    assert work_left(cells, store, 100) == pytest.approx(cell_work(cells[1], 100) + cell_work(cells[2], 100))
    assert work_left(cells, Store(tmp_path / "empty"), 100) == pytest.approx(sum(cell_work(c, 100) for c in cells))


def test_a_task_that_resolves_what_the_average_does_not_is_said():
    recs = [
        _rec("niah_single_1", AS_TRAINED, 100, [1] * 20),
        _rec("niah_single_1", "rope-yarn", 100, [0] * 20),
        _rec("fwe", AS_TRAINED, 100, [0.0]),
        _rec("fwe", "rope-yarn", 100, [1.0]),
        _rec("niah_single_1", AS_TRAINED, 200, [0] * 20),
        _rec("fwe", AS_TRAINED, 200, [1.0]),
    ]
    v = {x.finding: x for x in ruler_report.verdicts(recs)}
    # the average (50 % against 50 %) resolves nothing; niah_single_1 alone does (20 of 20 against 0 of 20)
    assert v["as trained (plain RoPE) against YaRN, s=2 at L"].verdict == "no difference resolved"
    assert v["as trained (plain RoPE) beats YaRN, s=2 at L on niah_single_1"].verdict == "yes"
    assert not any(k.endswith("on fwe") for k in v)  # fwe's one question resolves nothing
    assert v["as trained fails past L (at 2L) on niah_single_1"].verdict == "yes"
    assert v["as trained fails past L (at 2L)"].verdict == "no difference resolved"
