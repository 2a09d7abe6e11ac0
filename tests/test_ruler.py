"""RULER's tasks as NVIDIA/RULER builds them (posenc.extend.ruler): each prompt one string, tokenised at once, its unit
count the largest that fits (one more overflows), every reference found in its prompt, the chat template as the
tokenizer's apply_chat_template writes it, RULER's post-processing; many questions on one prefill give the answers a
full forward of each whole prompt gives; the plan in tokens, the 64 x L cap, the command line. On the tiny GGUF
model's tokenizer (byte-level BPE: about a token a byte) and model (tests/tiny_gguf.py)."""

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
from posenc.extend import ruler, ruler_prose, ruler_report  # noqa: E402
from posenc.extend import runner as extend_run  # noqa: E402
from posenc.extend.config import AS_TRAINED, FULL, QUICK, RULER_TASKS, ExtendConfig, count_cells  # noqa: E402

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


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
    assert not tok.chat_template  # the tiny model is a base model: "auto" is "base" for it
    return model, tok, path


@pytest.fixture()
def chat(tiny):
    _, tok, _ = tiny
    tok.chat_template = CHATML
    try:
        yield tok
    finally:
        tok.chat_template = None


def _ids(tok, text, special=True):
    return list(tok(text, add_special_tokens=special)["input_ids"])


# ---------------------------------------------------------------------------------------------- construction
def test_the_task_set_is_rulers_less_the_two_qa_tasks():
    assert ruler.TASKS == RULER_TASKS and len(ruler.TASKS) == 11 and set(ruler.NOT_RUN) == {"qa_1", "qa_2"}
    with pytest.raises(ConfigError, match="qa_1 is RULER's but not run here: SQuAD"):
        ruler.build("qa_1", None, 4096, seed=0)


@pytest.mark.parametrize("task", ruler.TASKS)
@pytest.mark.parametrize("n", [2200, 3111])
def test_every_task_hits_its_length_the_binary_search_way(tiny, task, n):
    """The prompt is the whole string tokenised at once; it plus the generation budget fits in n, and one more
    haystack unit would not (the slack, under a unit, is at the end); every reference is in the prompt."""
    _, tok, _ = tiny
    q = 3 if task in ruler.MULTI else 1
    ex = ruler.build(task, tok, n, seed=3, questions=q)
    assert ex.generate == ruler.GENERATE[task] and len(ex.questions) == q
    for i in range(q):
        text = ex.text if i == 0 else tok.decode(ex.prompt(i))
        assert ex.prompt(i) == _ids(tok, text)  # one string, tokenised at once (BOS as the tokenizer adds it)
        assert len(ex.prompt(i)) + ex.generate <= n
    units = ex.info["units"]
    bigger = ruler.build_at(task, tok, n, seed=3, questions=q, count=units + 1)
    assert max(len(_ids(tok, t)) for t in bigger) + ex.generate > n
    same = ruler.build_at(task, tok, n, seed=3, questions=q, count=units)
    assert same[0] == ex.text
    # every reference in its prompt, where the task puts it
    for i, question in enumerate(ex.questions):
        text = tok.decode(ex.prompt(i))
        if task in ruler.NIAH:
            for v in question.answers:
                assert text.count(f"is: {v}.") == 1
            assert 0 < question.depth < 1
        elif task == "vt":
            first, *rest = question.answers
            assert re.search(rf"VAR {first} = {question.key}\n", text)
            assert all(f"VAR {b} = VAR {a} " in text for a, b in zip(question.answers, rest))
        elif task == "cwe":
            listed = Counter(re.findall(r"\d+\. (\S+)", text.rsplit("Below is a numbered list", 1)[1]))
            common = 30 if n >= 4096 else 6
            assert all(listed[w] == common for w in question.answers)
            assert max(c for w, c in listed.items() if w not in question.answers) < common
        else:
            coded = Counter(text.rsplit("coded words. ", 1)[1].split("\nQuestion:")[0].split())
            top = [w for w, _ in coded.most_common(4)]
            assert top[0] == "..." and set(top[1:]) == set(question.answers)
    assert ex.info["template"] == "base"


def test_the_essay_tasks_read_the_named_substitute(tiny):
    _, tok, _ = tiny
    ex = ruler.build("niah_single_2", tok, 3000, seed=1)
    words = ruler_prose.words()
    assert len(words) > 800_000 and " ".join(words[:40]) in ex.text
    assert "Shakespeare" in ruler_prose.SUBSTITUTE and "Paul Graham" in ruler_prose.SUBSTITUTE
    assert ruler_prose.sentences('He said "Go." Then she left! Why? ok') == [
        'He said "Go."',
        "Then she left!",
        "Why?",
        "ok",
    ]
    # multiquery asks four keys at once and wants all four numbers; multivalue: four numbers of one key
    mq = ruler.build("niah_multiquery", tok, 3000, seed=1).questions[0]
    assert len(mq.answers) == 4 and mq.key.count(", ") == 3 and ", and " in mq.key
    mv = ruler.build("niah_multivalue", tok, 3000, seed=1)
    assert len(mv.questions[0].answers) == 4 and "What are all the special magic numbers" in mv.text
    assert "What is the special magic number for" in ruler.build("niah_single_2", tok, 3000, seed=1).text


def test_the_chat_template_is_the_tokenizers(chat):
    tok = chat
    ex = ruler.build("niah_single_1", tok, 2000, seed=2)
    assert ex.info["template"] == "chat"
    body, prefix = ex.text.split("<|im_start|>assistant\n")
    head = tok.apply_chat_template(
        [{"role": "user", "content": body[len("<|im_start|>user\n") : -len("<|im_end|>\n")]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert ex.text == head + prefix and prefix.startswith(" The special magic number for")
    assert ex.prompt(0) == _ids(tok, ex.text, special=False)
    want = tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=True, add_generation_prompt=True)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
    assert ex.prompt(0)[:3] == list(want)[:3]  # <|im_start|>user\n as the template writes it
    base = ruler.build("niah_single_1", tok, 2000, seed=2, template="base")
    assert base.info["template"] == "base" and "<|im_start|>" not in base.text
    with pytest.raises(ConfigError, match="one of auto, chat, base"):
        ruler.build("vt", tok, 2000, seed=2, template="plain")


def test_chat_needs_a_template(tiny):
    _, tok, _ = tiny
    with pytest.raises(ConfigError, match="needs a tokenizer with a chat template"):
        ruler.build("niah_single_1", tok, 2000, seed=0, template="chat")


def test_cwe_falls_back_to_a_larger_vocabulary_instead_of_an_error(tiny, monkeypatch):
    _, tok, _ = tiny
    small = {"noun": ["apple", "bread", "cider"], "adjective": ["red", "blue"], "verb": ["run", "jump", "sing"]}
    for k, v in small.items():
        monkeypatch.setitem(ruler._WORDS, k, v)
    ex = ruler.build("cwe", tok, 2200, seed=0)
    assert ex.info["fallback_vocabulary"] and ex.info["units"] > 8
    assert set(ex.questions[0].answers) <= set(ruler_prose.vocabulary())


@pytest.mark.parametrize("task", ruler.TASKS)
def test_the_same_seed_the_same_example(tiny, task):
    _, tok, _ = tiny
    a, b = (ruler.build(task, tok, 2200, seed=5) for _ in range(2))
    assert a == b and ruler.build(task, tok, 2200, seed=6).text != a.text


def test_bad_input_is_named(tiny):
    _, tok, _ = tiny
    with pytest.raises(ConfigError, match="unknown RULER task 'niah'"):
        ruler.build("niah", tok, 1000, seed=0)
    with pytest.raises(ConfigError, match="needs more than"):
        ruler.build("vt", tok, 300, seed=0)
    with pytest.raises(ConfigError, match="positive number of tokens"):
        ruler.build("vt", tok, 0, seed=0)


# ---------------------------------------------------------------------------------------------- scoring
def test_postprocess_and_string_match_all_are_rulers():
    """RULER's evaluate.py: strip, every control character a newline, strip; string_match_all: the share of the
    references in the prediction, case-insensitive."""
    assert ruler.postprocess("  \x00 1234567\tand 7654321\x1f ") == "1234567\nand 7654321"
    assert ruler.postprocess("\n\nABC-def.\r\n") == "ABC-def."
    assert ruler.postprocess("a\x7fb") == "a\x7fb"  # DEL is not in RULER's range
    assert ruler.string_match_all(ruler.postprocess(" 12\t34 "), ["12", "34", "56", "78"]) == 0.5
    assert ruler.string_match_all("The Number is ABC", ["abc"]) == 1.0
    with pytest.raises(ConfigError):
        ruler.string_match_all("x", [])


# ---------------------------------------------------------------------------------------------- asking
@pytest.mark.parametrize("scaling", [None, ("rope-yarn", {"factor": 4})])
@pytest.mark.parametrize("chunk", [64, None])
def test_many_questions_on_one_prefill_equal_a_full_forward_each(tiny, scaling, chunk):
    model, tok, _ = tiny
    posenc.hf.unpatch(model)
    if scaling:
        posenc.hf.patch(model, scaling[0], **scaling[1])
    try:
        ex = ruler.build("niah_multikey_2", tok, 900, seed=0, questions=3)
        assert len(ex.context) > 600  # the shared prefix: the template's head and the haystack
        got = ruler.ask(model, tok, ex, chunk=chunk)
        assert len(got) == 3
        for i, rec in enumerate(got):
            ids = torch.tensor([ex.prompt(i)])
            with torch.no_grad():
                full = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=ex.generate,
                    do_sample=False,
                    eos_token_id=tok.eos_token_id,
                    pad_token_id=tok.eos_token_id,
                )
            want = tok.decode(full[0, ids.shape[1] :].tolist())
            assert rec["prediction"] == want  # the tiny random model finds no answer: it stops at the limit or EOS
            assert rec["generated"] == full.shape[1] - ids.shape[1] and rec["score"] == 0.0
    finally:
        posenc.hf.unpatch(model)


def test_generation_stops_once_every_reference_is_found(tiny):
    model, tok, _ = tiny
    ex = ruler.build("niah_single_1", tok, 900, seed=0)
    q = ex.questions[0]
    first = ruler.greedy(model, torch.tensor([ex.prompt(0)]), None, 1, None)
    fake = ruler.Example(
        ex.task,
        ex.context,
        (ruler.Question(q.ids, (tok.decode(first).strip() or "x",), q.key, q.depth),),
        ex.length,
        ex.generate,
        ex.seed,
    )
    got = ruler.ask(model, tok, fake)[0]
    if tok.decode(first).strip():
        assert got["generated"] == 1 and got["score"] == 1.0


def test_a_small_model_decodes_on_one_thread_and_the_threads_come_back(tiny, monkeypatch):
    model, tok, _ = tiny
    before = torch.get_num_threads()
    seen = []
    real = ruler.greedy
    monkeypatch.setattr(ruler, "greedy", lambda *a, **k: (seen.append(torch.get_num_threads()), real(*a, **k))[1])
    monkeypatch.setitem(ruler.GENERATE, "niah_multikey_2", 4)
    torch.set_num_threads(2)
    try:
        ruler.ask(model, tok, ruler.build("niah_multikey_2", tok, 900, seed=0, questions=2))
        assert seen == [1, 1] and torch.get_num_threads() == 2  # the prefill's threads are back afterwards
        monkeypatch.setattr(ruler, "SMALL_MODEL", 10)  # a "large" model keeps the threads it was given
        seen.clear()
        ruler.ask(model, tok, ruler.build("niah_multikey_2", tok, 900, seed=0, questions=2))
        assert seen == [2, 2]
    finally:
        torch.set_num_threads(before)


# ---------------------------------------------------------------------------------------------- the plan and runs
def _cfg(**kw):
    base = dict(
        model="tiny",
        scalings=(),
        loss_long_scalings=(),
        passkey_scalings=(),
        ruler_tasks=("niah_multikey_2", "fwe"),
        ruler_scalings=(AS_TRAINED, "rope-yarn"),
        ruler_lengths=(900, 1000),
        ruler_haystacks=2,
        ruler_questions=3,
        chunk=128,
    )
    base.update(kw)
    return ExtendConfig(**base)


def test_the_plan_is_in_tokens_with_relative_lengths_as_an_option():
    cfg = _cfg()
    cells = extend_run.plan(cfg, 256)
    assert len(cells) == count_cells(cfg, 256) == 2 * 2 * 2 * 2
    assert [c.tokens for c in cells] == [900] * 8 + [1000] * 8
    assert [c.haystack for c in cells[:8]] == [0] * 4 + [1] * 4  # every first haystack before any second
    assert {c.factor for c in cells if c.scaling == "rope-yarn"} == {1000 / 256}
    assert {c.questions for c in cells if c.task == "fwe"} == {1} and {c.questions for c in cells} == {1, 3}
    rel = _cfg(ruler_lengths=(2.0, 4.0), ruler_relative=True)
    assert sorted({c.tokens for c in extend_run.plan(rel, 256)}) == [512, 1024]
    assert ExtendConfig().ruler_lengths == (4096, 8192, 16384) and ExtendConfig().ruler_haystacks == 25
    full = extend_run.plan(replace(FULL, scalings=(), passkey_scalings=(), ruler_tasks=RULER_TASKS), 8192)
    assert sorted({(c.tokens, c.unless_floor) for c in full}) == [(4096, False), (8192, False), (16384, False)]
    assert (
        len(full)
        == 11 * 4 * 3 * 25
        == count_cells(replace(FULL, scalings=(), passkey_scalings=(), ruler_tasks=RULER_TASKS))
    )
    assert {c.haystack for c in full} == set(range(25)) and {c.factor for c in full} == {1.0, 2.0}
    quick = extend_run.plan(replace(QUICK, scalings=(), passkey_scalings=(), ruler_tasks=RULER_TASKS), 8192)
    assert {(c.tokens, c.scaling) for c in quick} == {(4096, AS_TRAINED)} and len(quick) == 11 * 5
    # the cap: 64 x L, checked against the model's L
    with pytest.raises(ConfigError, match="more than 64 x the trained length 256"):
        extend_run.plan(_cfg(ruler_lengths=(20000,)), 256)


@pytest.mark.parametrize(
    "change, message",
    [
        (
            dict(ruler_tasks=("niah_single",)),
            "unknown task 'niah_single' \\(did you mean niah_single_3, niah_single_2, niah_single_1",
        ),
        (dict(ruler_lengths=(100,)), "100 tokens is too short"),
        (dict(ruler_lengths=(1e9,)), "1000000000 tokens is too long .* <= 64 x L"),
        (dict(ruler_lengths=(4096.5,)), "not a whole number of tokens"),
        (dict(ruler_lengths=(0.01,), ruler_relative=True), "ExtendConfig.ruler_lengths"),
        (dict(ruler_haystacks=0), "ExtendConfig.ruler_haystacks"),
        (dict(ruler_template="plain"), "ExtendConfig.ruler_template is one of auto, chat, base"),
        (dict(ruler_scalings=()), "ruler_scalings or ruler_lengths is empty"),
    ],
)
def test_bad_ruler_configs_are_named(change, message):
    with pytest.raises(ConfigError, match=message):
        _cfg(**change)


def test_run_stores_resumes_and_reports_ruler(tiny, tmp_path, capsys, monkeypatch):
    model, tok, _ = tiny
    monkeypatch.setitem(ruler.GENERATE, "niah_multikey_2", 6)
    monkeypatch.setitem(ruler.GENERATE, "fwe", 6)
    cfg = _cfg()
    first = extend_run.run(cfg, tmp_path, model=model, tokenizer=tok, max_cells=3)
    err = capsys.readouterr().err
    assert "prefilled" in err and "question 3/3" in err and "left in the run at this pace" in err
    assert len(first) == 3
    records = extend_run.run(cfg, tmp_path, model=model, tokenizer=tok, quiet=True)
    assert len(records) == 16 and posenc.hf.patched(model) is None
    r = next(r for r in records if r["task"] == "niah_multikey_2")
    assert len(r["answers"]) == 3 and r["protocol"] == "ruler" and r["template"] == "base" and r["env"]
    assert r["key"].startswith("ruler|p2|") and r["key"].endswith("|tauto")
    c = ruler_report.cells(records)[("niah_multikey_2", AS_TRAINED, 1.0, 1000)]
    assert (c.questions, c.haystacks) == (6, 2)
    table = "\n".join(ruler_report.table(records))
    assert "2h, 6q*" in table and "RULER mean over the 2 tasks that ran" in table and "Effective length" in table
    assert {v.verdict for v in ruler_report.verdicts(records)} == {"too few haystacks"}
    from posenc.extend import report

    paths = report.write(records, tmp_path, command="posenc extend --tasks ruler (test)")
    assert paths["ruler"].stat().st_size > 10_000 and paths["markdown"].read_text().startswith(
        "# RULER by length: tiny.gguf"
    )


def test_lengths_past_the_floor_are_cut(tmp_path, monkeypatch):
    path = tmp_path / "tiny-2k.gguf"
    write(path, layers=1, hidden=16, heads=2, kv_heads=1, ff=32, context=2048)  # L = 2048: room inside L
    monkeypatch.setenv("POSENC_DATA", str(tmp_path / "cache"))
    monkeypatch.setitem(ruler.GENERATE, "niah_multikey_2", 4)
    model, tok = posenc.hf.load_pretrained(path, quiet=True)
    cfg = _cfg(
        ruler_tasks=("niah_multikey_2",),
        ruler_lengths=(1024,),
        ruler_floor_lengths=(4096,),
        ruler_haystacks=8,
        ruler_scalings=(AS_TRAINED,),
        ruler_questions=1,
        chunk=512,
    )
    records = extend_run.run(cfg, tmp_path, model=model, tokenizer=tok, quiet=True)
    assert [r["tokens"] for r in records] == [1024] * 8  # at the floor inside L: 2L never runs
    assert ruler_report.floor_tasks(records) == {"niah_multikey_2": "0% [0%–32%] of 8 haystack(s) at 1024 tokens"}


def test_the_cli_prints_a_ruler_verdict_with_the_claim_it_reads(capsys):
    from posenc.extend import ruler_report
    from posenc.extend.cli_shared import _print_verdict

    for kind, tests in (("fails", "as published"), ("pair", "posenc's question")):
        v = ruler_report._rv(kind, "finding x", "suggestive", "12/25 against 3/25")
        _print_verdict(v)
        out = capsys.readouterr().out
        claim, source, _ = ruler_report.RULER_CLAIMS[kind]
        assert f"suggestive: finding x{'' if tests == 'as published' else ' (' + tests + ')'}\n" in out
        assert f"claim: {claim} [{source}]" in out and "on: 12/25 against 3/25" in out


def test_cli_tasks_ruler_on_the_tiny_model(tiny, tmp_path, capsys, monkeypatch):
    from posenc.cli import main

    _, _, path = tiny
    monkeypatch.setenv("POSENC_DATA", str(tmp_path / "cache"))
    monkeypatch.setitem(ruler.GENERATE, "niah_multikey_3", 4)
    out = tmp_path / "r"
    argv = [
        "extend",
        "--tasks",
        "niah_multikey_3",
        "--model",
        str(path),
        "--out",
        str(out),
        "--ruler-lengths",
        "5",
        "--ruler-relative",
        "--ruler-scalings",
        "as-trained",
        "--questions",
        "2",
        "--haystacks",
        "1",
        "--template",
        "base",
        "--chunk",
        "512",
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "RULER by length" in printed and "RULER verdicts" in printed
    recs = extend_run.Store(out).records()
    assert [(r["kind"], r["tokens"], r["template"]) for r in recs] == [("ruler", 1280, "base")]
    assert (out / "extend-ruler.png").is_file()
    assert main(["extend", "--tasks", "rulr", "--out", str(out)]) == 2
    assert "did you mean ruler" in capsys.readouterr().err
    assert main(["extend", "--tasks", "qa_2", "--out", str(out)]) == 2
    assert "qa_2 is RULER's but does not run here: HotpotQA" in capsys.readouterr().err
    assert main(["extend", "--tasks", "ruler", "--scalings", "rope-yarn", "--out", str(out)]) == 2
    assert "add loss" in capsys.readouterr().err


def test_cli_names_a_bad_ruler_flag(tmp_path, capsys):
    from posenc.cli import main

    assert main(["extend", "--tasks", "ruler", "--haystacks", "0", "--out", str(tmp_path)]) == 2
    assert "--haystacks" in capsys.readouterr().err
    assert main(["extend", "--haystacks", "2", "--out", str(tmp_path)]) == 2
    assert "add --tasks ruler" in capsys.readouterr().err
    assert main(["extend", "--tasks", "ruler", "--ruler-lengths", "2", "--out", str(tmp_path)]) == 2
    assert "--ruler-lengths: 2 tokens is too short (lengths are tokens" in capsys.readouterr().err
    assert main(["extend", "--tasks", "ruler", "--ruler-relative", "--out", str(tmp_path)]) == 2
    assert "give --ruler-lengths too" in capsys.readouterr().err


def test_cli_takes_a_transformers_folder(tiny, tmp_path, capsys, monkeypatch):
    """--model: a transformers folder works as a GGUF file does (the tiny model's converted cache is one)."""
    from posenc.cli import main

    _, _, path = tiny
    monkeypatch.setenv("POSENC_DATA", str(tmp_path / "cache"))
    monkeypatch.setitem(ruler.GENERATE, "niah_single_1", 4)
    posenc.hf.load_pretrained(path, quiet=True)
    (folder,) = (tmp_path / "cache" / "models").iterdir()
    out = tmp_path / "f"
    argv = [
        "extend",
        "--tasks",
        "niah_single_1",
        "--model",
        str(folder),
        "--out",
        str(out),
        "--ruler-lengths",
        "1024",
        "--haystacks",
        "1",
        "--ruler-scalings",
        "as-trained",
        "rope-linear",
    ]
    assert main(argv) == 0
    records = extend_run.Store(out).records()
    assert [(r["scaling"], r["tokens"]) for r in records] == [(AS_TRAINED, 1024), ("rope-linear", 1024)]
    assert records[0]["model"]["source"] == "local folder"


def test_vts_one_shot_example_fills_rulers_500_tokens(tiny):
    """RULER sizes vt's in-context example to 500 tokens (its answer aside): the most noise lines that fit."""
    from posenc.pretrained import load_tokenizer

    got = load_tokenizer("smollm2-135m")
    if got is None:
        pytest.skip("SmolLM2's converted tokenizer is not cached here")
    tok = got[0]
    lines = ruler._vt_shot_lines(tok)
    body, prefix = ruler.TEMPLATES["vt"]
    ex = ruler.build("vt", tok, 4096, seed=0, template="base")
    shot = ex.text.split("\n\nMemorize and track", 1)[0]
    assert shot.count(ruler.NOISE) == lines > 5
    question = shot.rsplit(" Answer:", 1)[0] + prefix.format(num_v=5, query=shot.split("assigned the value ")[1][:5])
    assert len(_ids(tok, question, special=False)) <= ruler.VT_SHOT_TOKENS
    assert len(_ids(tok, question + "\n" + ruler.NOISE, special=False)) > ruler.VT_SHOT_TOKENS - 5
