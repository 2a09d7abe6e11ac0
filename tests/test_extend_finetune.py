"""posenc.extend.finetune: a RoPE scaling patched in, then fine-tuning at the extended length (issue 46).

A tiny random Llama (trained length 64, ``tiny_llama_text``) fine-tuned at 128 tokens on Hamlet, King Lear held out.
The truths: the first step's recorded loss equals the model's own loss on the windows that step draws, computed on an
untouched copy; the warmup is the papers' linear ramp; an interrupted run resumed from its checkpoint ends with the
very weights and losses of an uninterrupted one; two gloo ranks give one process's losses; the exported folder loads
in stock transformers with the same logits; bad settings and flags are named before any model loads.
"""

from __future__ import annotations

import argparse
import copy
import json
import math

import pytest
import torch

pytest.importorskip("transformers")

import tiny_llama_text as tiny  # noqa: E402

from posenc.errors import ConfigError  # noqa: E402
from posenc.extend import finetune as ft  # noqa: E402

pytestmark = pytest.mark.usefixtures("quiet_transformers")

LENGTH = 128  # 2 x the trained length
BASE = dict(factor=2.0, length=LENGTH, tokens_per_step=4 * LENGTH, lr=1e-3, warmup=2, text="hamlet",
            eval_text="lear", quiet=True)


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if ".posenc." not in f".{k}"}


# ---------------------------------------------------------------------------------------------- settings
@pytest.mark.parametrize(
    "kw, words",
    [
        ({"scaling": "rope-yarm"}, "did you mean rope-yarn"),
        ({"factor": 0.5}, "factor must be a finite number >= 1"),
        ({"length": 128, "tokens_per_step": 300}, "give 256 or 384"),
        ({"text": "lear", "eval_text": "lear"}, "hold out a different document"),
        ({"mode": "qlora"}, "the choices are full, lora"),
        ({"steps": 0}, "steps must be a whole number >= 1"),
        ({"text": "pg19"}, "unknown text 'pg19'"),
    ],
)
def test_bad_settings_are_named(kw, words):
    with pytest.raises(ConfigError, match=words):
        ft.FinetuneSettings(**kw)


def test_defaults_are_the_papers():
    s = ft.FinetuneSettings().resolved(trained=8192)
    assert (s.lr, s.warmup, s.betas, s.weight_decay, s.schedule) == (2e-5, 20, (0.9, 0.95), 0.0, "constant")
    assert s.length == 4 * 8192 and s.sequences == 64 and s.steps == 400  # YaRN: 400 steps, batch 64


def test_warmup_is_linear_then_constant_or_decays():
    s = ft.FinetuneSettings(steps=100, warmup=20)
    assert [ft.lr_factor(i, s) for i in range(20)] == pytest.approx([(i + 1) / 20 for i in range(20)])
    assert all(ft.lr_factor(i, s) == 1.0 for i in range(20, 100))
    c = ft.FinetuneSettings(steps=100, warmup=20, schedule="cosine")
    assert ft.lr_factor(60, c) == pytest.approx(0.5 * (1 + math.cos(math.pi * 40 / 80)))
    assert ft.lr_factor(100, c) == pytest.approx(0.0, abs=1e-12)


def test_each_pass_draws_every_window_once_and_the_order_is_the_steps():
    n, per = 10, 4
    got = [w for step in range(5) for w in ft.step_windows(step, per, n, seed=3)]  # 20 draws = 2 passes
    assert sorted(got[:10]) == list(range(10)) and sorted(got[10:]) == list(range(10))
    assert got[:10] != got[10:]  # a new order each pass
    assert ft.step_windows(3, per, n, seed=3) == got[12:16]  # a function of the step alone


def test_the_shakespeare_text_holds_out_the_evaluation_play():
    from posenc.extend.config import DOCUMENTS

    text = ft.training_text("shakespeare", "lear")
    lear, hamlet = DOCUMENTS["lear"][1](), DOCUMENTS["hamlet"][1]()
    assert lear not in text and lear[5000:6000] not in text
    assert hamlet in text and len(text) > 4_000_000


# ---------------------------------------------------------------------------------------------- training
def test_the_first_loss_is_the_models_own_loss_on_its_windows_and_training_lowers_the_held_out_loss(capsys):
    from posenc.extend.runner import apply_scaling

    model, tok = tiny.model(), tiny.tokenizer()
    copy_ = copy.deepcopy(model)
    result = ft.finetune(model, tok, scaling="rope-yarn", steps=8, **{**BASE, "quiet": False})
    # the truth, on an untouched copy patched alike: the mean HF loss of the 4 windows that step 0 draws
    apply_scaling(copy_, "rope-yarn", 2.0)
    s = result.settings
    windows = ft.training_windows(tok, s)
    chosen = ft.step_windows(0, s.sequences, len(windows), s.seed)
    with torch.no_grad():
        truth = sum(float(copy_(windows[[k]], labels=windows[[k]]).loss) for k in chosen) / len(chosen)
        held = ft.eval_ids(tok, s)
        before = float(copy_(held, labels=held).loss)
    steps = [r for r in result.curve if r["step"] > 0]
    assert len(steps) == 8 and [r["step"] for r in steps] == list(range(1, 9))
    assert steps[0]["loss"] == pytest.approx(truth, abs=1e-5)
    assert result.eval_before == pytest.approx(before, abs=1e-5)
    assert steps[0]["lr"] == pytest.approx(1e-3 / 2) and steps[1]["lr"] == pytest.approx(1e-3)  # 2 warmup steps
    assert result.eval_after < result.eval_before - 0.05  # the held-out play's loss falls
    ident = result.model.posenc_identity  # another model now, said in its identity (extend's store keeps them apart)
    assert ident["finetuned"]["steps"] == 8 and ident["finetuned"]["scaling"] == "rope-yarn"
    assert ident["name"].endswith("fine-tuned")
    err = capsys.readouterr().err
    assert "step 8/8: loss" in err and "left" in err and "held-out loss" in err


def _interrupt_at(step: int):
    def progress(rec):
        if rec["step"] == step:
            raise KeyboardInterrupt

    return progress


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_an_interrupted_run_resumes_to_the_same_weights_and_losses(mode, tmp_path):
    kw = dict(BASE, scaling="rope-linear", steps=6, mode=mode, save_every=2, lora_rank=2)
    if mode == "lora":
        kw["lr"] = 1e-2
    whole = ft.finetune(tiny.model(), tiny.tokenizer(), out=tmp_path / "whole", **kw)
    with pytest.raises(KeyboardInterrupt):  # killed after step 3: the checkpoint is step 2's, step 3 is redone
        ft.finetune(tiny.model(), tiny.tokenizer(), out=tmp_path / "cut", progress=_interrupt_at(3), **kw)
    stored = [json.loads(x) for x in (tmp_path / "cut" / ft.CURVE).read_text().splitlines()]
    assert [r["step"] for r in stored] == [0, 1, 2, 3]
    again = ft.finetune(tiny.model(), tiny.tokenizer(), out=tmp_path / "cut", **kw)
    assert again.resumed_from == 2
    a, b = _weights(whole.model), _weights(again.model)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [r.get("loss") for r in whole.curve] == [r.get("loss") for r in again.curve]
    on_disk = [json.loads(x) for x in (tmp_path / "cut" / ft.CURVE).read_text().splitlines()]
    assert [r["step"] for r in on_disk] == list(range(7)) and on_disk[-1]["loss"] == whole.curve[-1]["loss"]
    if mode == "lora":  # the adapters trained and were merged: the weights moved, no LoRA module is left
        fresh = _weights(tiny.model())
        assert any(not torch.equal(fresh[k], a[k]) for k in fresh if "q_proj" in k)
        assert not any("lora" in k for k in a)


def test_max_new_steps_stops_and_the_next_call_goes_on(tmp_path):
    kw = dict(BASE, scaling="rope-ntk", steps=4, save_every=10)
    first = ft.finetune(tiny.model(), tiny.tokenizer(), out=tmp_path, max_new_steps=3, **kw)
    assert [r["step"] for r in first.curve][-1] == 3 and first.eval_after is None
    rest = ft.finetune(tiny.model(), tiny.tokenizer(), out=tmp_path, **kw)
    whole = ft.finetune(tiny.model(), tiny.tokenizer(), **kw)
    assert rest.resumed_from == 3 and rest.curve[-1]["loss"] == whole.curve[-1]["loss"]


def test_a_checkpoint_of_other_settings_is_refused(tmp_path):
    kw = dict(BASE, scaling="rope-yarn", steps=2, save_every=1)
    ft.finetune(tiny.model(), tiny.tokenizer(), out=tmp_path, **kw)
    with pytest.raises(ConfigError, match=r"other settings \(lr: stored 0.001, asked 0.002"):
        ft.finetune(tiny.model(), tiny.tokenizer(), out=tmp_path, **{**kw, "lr": 2e-3})
    fresh = ft.finetune(tiny.model(), tiny.tokenizer(), out=tmp_path, resume=False, **{**kw, "lr": 2e-3})
    assert fresh.resumed_from == 0


@pytest.mark.parametrize("scaling, mode", [("rope-yarn", "full"), ("rope-linear", "lora"), ("rope-longrope", "full")])
def test_the_fine_tuned_model_exports_and_stock_transformers_gives_its_logits(scaling, mode, tmp_path):
    import transformers

    import posenc.hf

    tok = tiny.tokenizer()
    result = ft.finetune(tiny.model(sharpen=4.0), tok, scaling=scaling, steps=3, mode=mode, lora_rank=2,
                         evaluate=False, **{**BASE, "lr": 1e-2})
    model = result.model
    assert posenc.hf.patched(model) is not None and not any("lora" in n for n, _ in model.named_parameters())
    folder = posenc.hf.export(model, tmp_path / "out", tokenizer=tok)
    stock = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    params = json.loads((folder / "config.json").read_text())["rope_parameters"]
    assert params["rope_type"] == {"rope-yarn": "yarn", "rope-linear": "linear", "rope-longrope": "longrope"}[scaling]
    ids = torch.randint(1, len(tok), (1, LENGTH), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ours, theirs = model(ids).logits, stock(ids).logits
    assert (ours - theirs).abs().max() < 1e-5
    # and the export holds the fine-tuned weights, not the pretrained ones
    with torch.no_grad():
        before = tiny.model(sharpen=4.0)
        posenc.hf.patch(before, scaling, **result.extra["scaling_options"])
        assert (before(ids).logits - theirs).abs().max() > 1e-3


# ---------------------------------------------------------------------------------------------- DDP
def _rank(rank: int, world: int, port: int, path: str) -> None:
    import os

    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        # rank 1 starts from other weights: the run broadcasts rank 0's, as DistributedDataParallel does
        r = ft.finetune(tiny.model(seed=rank), tiny.tokenizer(), scaling="rope-yarn", steps=3, evaluate=False,
                        **{**BASE, "tokens_per_step": 6 * LENGTH, "micro_batch": 2})
        if rank == 0:
            torch.save({"losses": [c["loss"] for c in r.curve], "weights": _weights(r.model)}, path)
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_give_one_processs_losses_with_the_same_global_batch(tmp_path):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = str(tmp_path / "ranks.pt")
    mp.spawn(_rank, args=(2, port, path), nprocs=2, join=True)
    two = torch.load(path)
    one = ft.finetune(tiny.model(), tiny.tokenizer(), scaling="rope-yarn", steps=3, evaluate=False,
                      **{**BASE, "tokens_per_step": 6 * LENGTH, "micro_batch": 2})
    assert two["losses"] == pytest.approx([c["loss"] for c in one.curve], abs=1e-5)
    w = _weights(one.model)
    assert max(float((w[k] - two["weights"][k]).abs().max()) for k in w) < 1e-5


# ---------------------------------------------------------------------------------------------- the CLI
def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--out")
    p.add_argument("--loss-extension", type=float)
    ft.add_finetune_arguments(p)
    return p.parse_args(list(argv))


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--finetune-lr", "1e-4"], "--finetune-lr describe the fine-tuning, which needs --finetune STEPS"),
        (["--finetune", "0"], "--finetune STEPS must be a whole number of steps >= 1"),
        (["--finetune", "5", "--finetune-scaling", "rope-yarm"], "--finetune-scaling: unknown scaling 'rope-yarm'"),
        (["--finetune", "5", "--finetune-lr", "-1"], "--finetune-lr: lr must be a finite number > 0"),
        (["--finetune", "5", "--finetune-factor", "0.5"], "--finetune-factor: factor must be"),
        (["--finetune", "5", "--finetune-length", "100", "--finetune-tokens-per-step", "150"],
         "--finetune-tokens-per-step: tokens_per_step \\(150\\) must be a whole number of sequences"),
    ],
)
def test_bad_flags_are_named_before_the_model_loads(argv, words, monkeypatch):
    import posenc.pretrained

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(posenc.pretrained, "load_pretrained", no_load)
    with pytest.raises(ConfigError, match=words):
        ft.run_finetune(_parse(*argv))


def test_the_cli_runs_the_library_in_its_folder(tmp_path):
    args = _parse("--finetune", "2", "--finetune-mode", "lora", "--finetune-length", "128",
                  "--finetune-tokens-per-step", "256", "--finetune-factor", "2", "--finetune-text", "hamlet",
                  "--finetune-lr", "1e-3", "--out", str(tmp_path))
    assert ft.run_finetune(_parse()) is None  # no --finetune: nothing to do
    result = ft.run_finetune(args, tiny.model(), tiny.tokenizer())
    folder = tmp_path / "finetune-rope-yarn-x2-lora"
    assert result.out == folder and (folder / ft.CHECKPOINT).is_file()
    lines = (folder / ft.CURVE).read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [0, 1, 2]
    assert result.settings.mode == "lora" and result.settings.sequences == 2


def test_searched_longrope_factors_are_trained_with_and_a_resume_with_others_is_refused(tmp_path):
    import posenc.hf

    long = [1.0, 1.4, 2.1, 2.6]  # monotone per-pair factors, as longrope_search returns them
    kw = dict(BASE, scaling="rope-longrope", steps=2, save_every=1)
    opts = {"short_factor": [1.0] * 4, "long_factor": long}
    r = ft.finetune(tiny.model(), tiny.tokenizer(), out=tmp_path, scaling_options=opts, **kw)
    enc = posenc.hf.patched(r.model).encodings[0]
    assert torch.allclose(enc.long_inv_freq, enc.inv_freq / torch.tensor(long))  # trained with these factors
    with pytest.raises(ConfigError, match="other rope-longrope options"):
        ft.finetune(tiny.model(), tiny.tokenizer(), out=tmp_path, scaling_options={**opts, "long_factor": [2.0] * 4},
                    **kw)
    # the same options, more steps (constant schedule): the finished run goes on, as one run of 3 steps would
    more = ft.finetune(tiny.model(), tiny.tokenizer(), out=tmp_path, scaling_options=opts, **{**kw, "steps": 3})
    once = ft.finetune(tiny.model(), tiny.tokenizer(), scaling_options=opts, **{**kw, "steps": 3})
    assert more.resumed_from == 2 and [c.get("loss") for c in more.curve] == [c.get("loss") for c in once.curve]


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_gradient_checkpointing_gives_the_same_losses(mode):
    kw = dict(BASE, scaling="rope-yarn", steps=3, mode=mode, lora_rank=2, evaluate=False)
    plain = ft.finetune(tiny.model(), tiny.tokenizer(), **kw)
    saved = ft.finetune(tiny.model(), tiny.tokenizer(), gradient_checkpointing=True, **kw)
    assert [c["loss"] for c in saved.curve] == pytest.approx([c["loss"] for c in plain.curve], abs=1e-6)
    assert not saved.model.is_gradient_checkpointing


def test_importing_the_cli_helpers_imports_no_torch():
    import subprocess
    import sys

    probe = ("import sys, argparse\nfrom posenc.extend.finetune import add_finetune_arguments, check_finetune_args\n"
             "a = add_finetune_arguments(argparse.ArgumentParser()).parse_args(['--finetune', '3'])\n"
             "check_finetune_args(a)\nprint('TORCH' if 'torch' in sys.modules else 'NO-TORCH')")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "NO-TORCH", done.stdout + done.stderr


def test_posenc_extend_finetune_trains_resumes_and_exports(tmp_path, monkeypatch, capsys):
    """``posenc extend --finetune 2 ... --export rope-yarn``: the command line end to end on the tiny Llama; a second
    call resumes (trains nothing again); the export loads in stock transformers with the tuned model's logits; a
    scaling to export other than the tuned one is refused before the model loads."""
    import posenc.pretrained
    from posenc.cli import main

    model, tok = tiny.model(), tiny.tokenizer()
    loads = iter([model])  # the first run tunes this model in place; a rerun loads the pretrained one again
    monkeypatch.setattr(posenc.pretrained, "load_pretrained", lambda *a, **k: (next(loads, None) or tiny.model(), tok))
    argv = ["extend", "--finetune", "2", "--finetune-length", "128", "--finetune-tokens-per-step", "256",
            "--finetune-factor", "2", "--finetune-text", "hamlet", "--no-passkey", "--out", str(tmp_path),
            "--export", "rope-yarn"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "fine-tuned 2 steps (rope-yarn x2, full): held-out loss" in printed and "exported" in printed
    folder = tmp_path / "export-rope-yarn-finetuned"
    import transformers

    stock = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.randint(1, len(tok), (1, 100), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(stock(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-5)
    curve = (tmp_path / "finetune-rope-yarn-x2-full" / ft.CURVE).read_text()
    assert main(argv[:-2]) == 0 and (tmp_path / "finetune-rope-yarn-x2-full" / ft.CURVE).read_text() == curve
    assert main([*argv[:-1], "rope-linear"]) == 2
    assert "the fine-tuned model is patched with rope-yarn" in capsys.readouterr().err
    assert main([*argv, "--full"]) == 2 and "--full is the training-free grid" in capsys.readouterr().err
