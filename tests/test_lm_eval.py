"""posenc in lm-evaluation-harness (src/posenc/lm_eval): the harness's own CLI, run on a tiny Llama patched with
ALiBi over two local tasks (tests/fixtures/lm_eval: multiple choice, and perplexity by rolling loglikelihood),
gives the numbers computed here directly from the model's logits."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install -c constraints.txt 'posenc[eval]')")
pytest.importorskip("transformers", reason="transformers is not installed")
torch = pytest.importorskip("torch")

FIXTURES = Path(__file__).parent / "fixtures" / "lm_eval"
MAX_LENGTH = 16  # shorter than the longer texts: the rolling windows are exercised


def _jsonl(name: str) -> list[dict]:
    return [json.loads(line) for line in (FIXTURES / name).read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with a byte-level BPE tokenizer trained on the fixtures' text, saved as a transformers folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    texts = [d["text"] for d in _jsonl("ppl.jsonl")]
    texts += [d["question"] + " " + " ".join(d["choices"]) for d in _jsonl("mc.jsonl")]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>")
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=fast.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        eos_token_id=fast.eos_token_id,
        bos_token_id=fast.eos_token_id,
    )
    model = LlamaForCausalLM(cfg)
    folder = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(folder)
    fast.save_pretrained(folder)
    return folder


def _direct_model(folder: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from posenc.hf import patch

    model = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    return patch(model, "alibi"), AutoTokenizer.from_pretrained(str(folder))


def _logp_next(model, ids: list[int]) -> torch.Tensor:
    """log p(next token) after each prefix of ``ids``: one forward of ``ids`` alone (no batch, no padding)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.double(), -1)


def _continuation_ll(model, tok, context: str, continuation: str) -> float:
    ctx = tok(context, add_special_tokens=False).input_ids
    whole = tok(context + continuation, add_special_tokens=False).input_ids
    cont = whole[len(ctx) :]
    logp = _logp_next(model, whole[:-1])
    return sum(float(logp[len(ctx) - 1 + k, t]) for k, t in enumerate(cont))


def _rolling_ll(model, tok, text: str, window: int) -> float:
    """Token j of the first ``window`` is scored after the end-of-text token and the tokens before it; each later
    block of ``window`` tokens (the last one shorter) after the ``window`` tokens before the block's end, less one."""
    ids = tok(text, add_special_tokens=False).input_ids
    total = 0.0
    for j, t in enumerate(ids):
        if j < window:
            ctx = [tok.eos_token_id] + ids[:j]
        else:
            end = min(window * (j // window + 1), len(ids))
            ctx = ids[end - window - 1 : j]
        total += float(_logp_next(model, ctx)[-1, t])
    return total


def test_harness_cli_equals_direct_computation(tiny_folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {
        **os.environ,
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf"),
        "HF_DATASETS_CACHE": str(tmp_path / "datasets"),
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    args = [
        sys.executable,
        "-m",
        "posenc.lm_eval",
        "--model",
        "posenc",
        "--model_args",
        f"pretrained={tiny_folder},encoding=alibi,max_length={MAX_LENGTH}",
        "--tasks",
        "posenc_tiny_mc,posenc_tiny_ppl",
        "--include_path",
        str(FIXTURES),
        "--output_path",
        str(out),
        "--batch_size",
        "2",
        "--device",
        "cpu",
    ]
    run = subprocess.run(args, cwd=FIXTURES, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    found = sorted(out.rglob("results_*.json"))
    assert found, f"no results_*.json under {out}: {run.stderr[-2000:]}"
    results = json.loads(found[-1].read_text())["results"]

    model, tok = _direct_model(tiny_folder)
    docs = _jsonl("mc.jsonl")
    acc, acc_norm = [], []
    for doc in docs:
        lls = [_continuation_ll(model, tok, doc["question"], " " + c) for c in doc["choices"]]
        norm = [ll / len(" " + c) for ll, c in zip(lls, doc["choices"])]
        acc.append(float(max(range(len(lls)), key=lls.__getitem__) == doc["label"]))
        acc_norm.append(float(max(range(len(norm)), key=norm.__getitem__) == doc["label"]))
    mc = results["posenc_tiny_mc"]
    assert mc["acc,none"] == pytest.approx(sum(acc) / len(acc))
    assert mc["acc_norm,none"] == pytest.approx(sum(acc_norm) / len(acc_norm))

    texts = [d["text"] for d in _jsonl("ppl.jsonl")]
    lls = [_rolling_ll(model, tok, t, MAX_LENGTH) for t in texts]
    words = sum(len(re.split(r"\s+", t)) for t in texts)
    nbytes = sum(len(t.encode("utf-8")) for t in texts)
    ppl = results["posenc_tiny_ppl"]
    assert ppl["word_perplexity,none"] == pytest.approx(math.exp(-sum(lls) / words), rel=1e-4)
    assert ppl["byte_perplexity,none"] == pytest.approx(math.exp(-sum(lls) / nbytes), rel=1e-4)
    assert ppl["bits_per_byte,none"] == pytest.approx(-sum(lls) / nbytes / math.log(2), rel=1e-4)
    # the model does not fit this text: a perplexity near the vocabulary's size, not 1
    assert ppl["word_perplexity,none"] > 10


def test_posenc_harness_passes_every_argument_through(monkeypatch: pytest.MonkeyPatch) -> None:
    """``posenc harness ARGS`` hands ARGS, options and -h included, to the harness's CLI unchanged."""
    import posenc.lm_eval
    from posenc.cli import main

    seen: list[list[str]] = []
    monkeypatch.setattr(posenc.lm_eval, "main", lambda argv: seen.append(argv))
    argv = ["--model", "posenc", "--model_args", "pretrained=x,encoding=alibi", "--tasks", "a,b", "-h", "--limit", "2"]
    assert main(["harness", *argv]) == 0
    assert seen == [argv]


def test_the_model_is_registered_and_the_layers_json_is_read() -> None:
    from lm_eval.api.registry import get_model

    from posenc.errors import ConfigError
    from posenc.lm_eval import PosencLM, parse_encoding

    assert get_model("posenc") is PosencLM
    assert parse_encoding("alibi", "[0, 2]", 4) == ("alibi", [0, 2])
    assert parse_encoding(None, '{"1": ["rope-yarn", {"factor": 2}], "-1": "alibi"}', 4) == (
        [None, ("rope-yarn", {"factor": 2}), None, "alibi"],
        None,
    )
    assert parse_encoding('{"full_attention": "alibi"}', None, 4) == ({"full_attention": "alibi"}, None)
    with pytest.raises(ConfigError, match="layers"):
        parse_encoding("alibi", '{"0": "alibi"}', 4)
    with pytest.raises(ConfigError, match="does not exist"):
        parse_encoding(None, '{"7": "alibi"}', 4)
    with pytest.raises(ConfigError, match="not valid JSON"):
        parse_encoding(None, "[0, ", 4)


def test_generate_until_is_greedy_and_stops_at_until(tiny_folder: Path) -> None:
    """generate_until: the greedy continuation (argmax after each prefix, computed here one forward per token),
    cut before the first ``until`` string, at most ``max_gen_toks`` tokens."""
    from lm_eval.api.instance import Instance

    from posenc.lm_eval import PosencLM

    lm = PosencLM(pretrained=str(tiny_folder), encoding="alibi", max_length=MAX_LENGTH, device="cpu")
    model, tok = _direct_model(tiny_folder)
    context = "the cat sat on the"
    ids = tok(context, add_special_tokens=False).input_ids
    for _ in range(6):
        nxt = int(_logp_next(model, ids[-MAX_LENGTH:])[-1].argmax())
        if nxt == tok.eos_token_id:
            break
        ids.append(nxt)
    greedy = tok.decode(ids[len(tok(context, add_special_tokens=False).input_ids) :])
    assert len(greedy) > 2  # something to cut
    stop = greedy[len(greedy) // 2 :][:2]
    requests = [
        Instance("generate_until", {}, (context, {"until": [], "max_gen_toks": 6}), 0),
        Instance("generate_until", {}, (context, {"until": [stop], "max_gen_toks": 6}), 1),
    ]
    plain, cut = lm.generate_until(requests, disable_tqdm=True)
    assert plain == greedy
    assert cut == greedy.split(stop)[0]
