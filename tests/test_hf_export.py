"""posenc.hf.export(format="transformers"): a folder that stock transformers loads, with posenc not importable, and
whose logits and greedy tokens are the patched model's; the refusals of what no native config expresses.

The round trip: each tiny float64 model is patched, exported and run here (logits over a sequence past the trained
length, and a greedy continuation through the KV cache); one subprocess in which ``import posenc`` raises loads every
folder with ``AutoModelForCausalLM`` and runs the same; the two must agree (logits to 1e-10, tokens exactly).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

import posenc.hf
from posenc.errors import ConfigError
from posenc.hf.export import native_config_changes, native_rope_parameters
from posenc.hf.matrix_checks import DEEPSEEK_YARN, GEMMA3_4B_ROPE, OLMO3_ROPE

t = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("quiet_transformers")

VOCAB = 97
TRAINED = 24  # max_position_embeddings of the tiny models: the inputs below go past it
DEC = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=TRAINED, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
DEC4 = {**DEC, "num_hidden_layers": 4}
PAIRS = 8  # rotary pairs of a 16-wide head
SHORT = [1.0 + 0.05 * i for i in range(PAIRS)]
LONG = [1.0 + 0.4 * i for i in range(PAIRS)]


def sharp(model, by: float = 6.0):
    """Query/key projections × ``by`` (a fresh model's attention is near uniform: a wrong rotation barely shows)."""
    with torch.no_grad():
        for m in model.modules():
            for name in ("q_proj", "k_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "qkv_proj"):
                lin = getattr(m, name, None)
                if isinstance(lin, torch.nn.Linear):
                    lin.weight.mul_(by)
    return model.double().eval()


def build(cls, config):
    torch.manual_seed(0)
    model = cls(config)
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")
    return sharp(model)


def llama():
    return build(t.LlamaForCausalLM, t.LlamaConfig(**DEC))


def deepseek():
    sizes = dict(
        moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=12, rope_parameters={**DEEPSEEK_YARN, "original_max_position_embeddings": 8},
    )  # fmt: skip
    return build(t.DeepseekV3ForCausalLM, t.DeepseekV3Config(**{**DEC, "num_key_value_heads": 4, **sizes}))


def gemma3():
    types = ["sliding_attention"] * 3 + ["full_attention"]
    cfg = t.Gemma3TextConfig(**DEC4, head_dim=16, sliding_window=6, layer_types=types, rope_parameters=GEMMA3_4B_ROPE)
    return build(t.Gemma3ForCausalLM, cfg)


def olmo3():
    rope = {**OLMO3_ROPE, "full_attention": {**OLMO3_ROPE["full_attention"], "original_max_position_embeddings": 12}}
    return build(t.Olmo3ForCausalLM, t.Olmo3Config(**DEC4, sliding_window=6, rope_parameters=rope))


YARN = ("rope-yarn", {"factor": 2.0})
#: name -> (model, encoding, options): every scaling on Llama, and each family's own
CASES = {
    "llama-rope-theta": (llama, "rope", {"base": 5e4}),
    "llama-ntk": (llama, "rope-ntk", {"factor": 3.0}),
    "llama-linear": (llama, "rope-linear", {"factor": 2.0}),
    "llama-dynamic": (llama, "rope-dynamic", {"factor": 2.0}),
    "llama-yarn": (llama, "rope-yarn", {"factor": 2.0, "beta_fast": 16.0, "beta_slow": 2.0}),
    "llama-yarn-attention-factor": (llama, "rope-yarn", {"factor": 4.0, "attention_factor": 1.25}),
    "llama-llama3": (llama, "rope-llama3", {"factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 2.0}),
    "llama-longrope": (
        llama,
        "rope-longrope",
        {"short_factor": SHORT, "long_factor": LONG, "factor": 2.0, "original_max_len": 12},
    ),
    "qwen2-yarn": (lambda: build(t.Qwen2ForCausalLM, t.Qwen2Config(**DEC)), "rope-yarn", {"factor": 2.0}),
    "gemma3-yarn": (gemma3, "rope-yarn", {"factor": 2.0}),
    "gemma3-per-type": (gemma3, {"sliding_attention": ("rope-ntk", {"factor": 2.0}), "full_attention": YARN}, {}),
    "gemma3-full-only": (gemma3, {"full_attention": ("rope-llama3", {"factor": 4.0})}, {}),
    "olmo3-per-type": (olmo3, {"sliding_attention": ("rope", {"base": 1e4}), "full_attention": YARN}, {}),
    "cohere2-linear": (
        lambda: build(t.Cohere2ForCausalLM, t.Cohere2Config(**DEC4, sliding_window=6)),
        "rope-linear",
        {"factor": 2.0},
    ),
    "smollm3-yarn": (lambda: build(t.SmolLM3ForCausalLM, t.SmolLM3Config(**DEC4)), "rope-yarn", {"factor": 2.0}),
    "smollm3-schedule": (
        lambda: build(t.SmolLM3ForCausalLM, t.SmolLM3Config(**DEC4)),
        ["nope", "rope-linear(factor=2)", "rope-linear(factor=2)", "rope-linear(factor=2)"],
        {},
    ),
    "phi3-longrope": (
        lambda: build(t.Phi3ForCausalLM, t.Phi3Config(**DEC, original_max_position_embeddings=12)),
        "rope-longrope",
        {"short_factor": SHORT, "long_factor": LONG, "factor": 2.0},
    ),
    "deepseek-v3-yarn-mscale": (deepseek, "rope-mla", {"factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.8}),
}

PROMPT = 20  # the greedy continuation starts inside the trained length and goes past it
NEW = 12
LENGTH = 40


def _ids() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(3, VOCAB, (2, LENGTH), generator=g), torch.randint(3, VOCAB, (1, PROMPT), generator=g)


def _run(model, ids, prompt):
    with torch.no_grad():
        logits = model(ids).logits
        out = model.generate(
            prompt, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=None
        )
    return logits, out[0, prompt.shape[1] :]


#: runs in a Python in which posenc cannot be imported: loads every folder and writes its logits and tokens
CHILD = textwrap.dedent(
    """
    import sys

    class _NoPosenc:
        def find_spec(self, name, path=None, target=None):
            if name == "posenc" or name.startswith("posenc."):
                raise ImportError("posenc is not importable in this test")
            return None

    sys.meta_path.insert(0, _NoPosenc())
    sys.path[:] = [p for p in sys.path if not p.rstrip("/").endswith("/src")]
    try:
        import posenc  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("posenc could be imported")
    import json
    import torch
    from transformers import AutoModelForCausalLM

    job = json.loads(sys.argv[1])
    ids, prompt = torch.load(job["inputs"])
    got = {}
    for name, folder in job["folders"].items():
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
        if hasattr(model, "set_experts_implementation"):
            model.set_experts_implementation("eager")
        with torch.no_grad():
            logits = model(ids).logits
            new = job["new"]
            out = model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
                                 eos_token_id=None)
        got[name] = (logits, out[0, prompt.shape[1]:], type(model).__name__)
    assert not any(m == "posenc" or m.startswith("posenc.") for m in sys.modules)
    torch.save(got, job["out"])
    """
)


@pytest.fixture(scope="module")
def round_trip(tmp_path_factory):
    """Every case exported, and what this process and a posenc-free one computed from it."""
    root = tmp_path_factory.mktemp("export")
    ids, prompt = _ids()
    torch.save((ids, prompt), root / "inputs.pt")
    ours, folders, models, configs = {}, {}, {}, {}
    for name, (make, encoding, options) in CASES.items():
        model = make()
        posenc.hf.patch(model, encoding, **options)
        before = json.dumps(model.config.to_dict(), sort_keys=True, default=str)
        folder = root / name
        posenc.hf.export(model, folder)
        assert json.dumps(model.config.to_dict(), sort_keys=True, default=str) == before, "export changed the model"
        assert posenc.hf.patched(model) is not None
        ours[name] = _run(model, ids, prompt)
        folders[name], models[name] = str(folder), model
        configs[name] = json.loads((folder / "config.json").read_text())
    job = {"inputs": str(root / "inputs.pt"), "folders": folders, "out": str(root / "theirs.pt"), "new": NEW}
    env = {k: v for k, v in __import__("os").environ.items() if k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(job)], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = torch.load(root / "theirs.pt")
    return ours, theirs, configs, models


@pytest.mark.parametrize("name", list(CASES))
def test_round_trip_without_posenc(round_trip, name):
    ours, theirs, configs, _ = round_trip
    logits, tokens = ours[name]
    their_logits, their_tokens, cls = theirs[name]
    assert their_logits.dtype == torch.float64
    assert (their_logits - logits).abs().max().item() <= 1e-10, name
    assert torch.equal(their_tokens, tokens), (name, tokens.tolist(), their_tokens.tolist())
    assert "posenc" not in configs[name]
    assert cls == type(round_trip[3][name]).__name__


def test_the_scaling_changes_the_logits(round_trip):
    """The export would pass trivially if the scalings did nothing here: each changes the model's logits."""
    ids, _ = _ids()
    for name, (make, _, _) in CASES.items():
        with torch.no_grad():
            own = make()(ids).logits
        assert (own - round_trip[0][name][0]).abs().max().item() > 1e-3, name


def test_native_config(round_trip):
    """The config.json says the patch in transformers' own words, with the stretched length."""
    _, _, configs, _ = round_trip
    yarn = configs["llama-yarn"]
    assert yarn["rope_parameters"]["rope_type"] == "yarn"
    assert yarn["rope_parameters"]["original_max_position_embeddings"] == TRAINED
    assert (yarn["rope_parameters"]["beta_fast"], yarn["rope_parameters"]["beta_slow"]) == (16.0, 2.0)
    assert yarn["max_position_embeddings"] == 2 * TRAINED
    ntk = configs["llama-ntk"]["rope_parameters"]
    assert ntk["rope_type"] == "default" and ntk["rope_theta"] == pytest.approx(1e4 * 3.0 ** (16 / 14), rel=1e-12)
    assert configs["llama-ntk"]["max_position_embeddings"] == 3 * TRAINED
    assert configs["llama-rope-theta"]["max_position_embeddings"] == TRAINED  # another θ stretches nothing
    assert configs["llama-dynamic"]["max_position_embeddings"] == TRAINED  # the length its NTK grows from
    per_type = configs["gemma3-per-type"]["rope_parameters"]
    assert per_type["sliding_attention"]["rope_type"] == "default"
    assert per_type["full_attention"]["rope_type"] == "yarn"
    assert per_type["full_attention"]["rope_theta"] == 1e6  # the type's own θ
    assert configs["gemma3-full-only"]["rope_parameters"]["sliding_attention"] == GEMMA3_4B_ROPE["sliding_attention"]
    assert configs["smollm3-schedule"]["no_rope_layers"] == [0, 1, 1, 1]
    phi = configs["phi3-longrope"]
    assert phi["rope_parameters"]["short_factor"] == SHORT and phi["rope_parameters"]["long_factor"] == LONG
    assert phi["max_position_embeddings"] == 24 and phi["original_max_position_embeddings"] == 12
    ds = configs["deepseek-v3-yarn-mscale"]["rope_parameters"]
    assert ds["mscale_all_dim"] == 0.8 and ds["factor"] == 4.0


def test_weights_are_the_models_own(round_trip, tmp_path):
    """No posenc tensor in the weights; the same tensors as the unpatched model's save_pretrained."""
    from safetensors import safe_open

    _, _, _, models = round_trip
    model = models["llama-yarn"]
    folder = tmp_path / "yarn"
    posenc.hf.export(model, folder)
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        tensors = {k: f.get_tensor(k) for k in keys}
    fresh = llama()
    fresh.save_pretrained(tmp_path / "plain")
    with safe_open(str(tmp_path / "plain" / "model.safetensors"), framework="pt") as f:
        assert keys == set(f.keys())
        assert all(torch.equal(tensors[k], f.get_tensor(k)) for k in keys)
    assert not any("posenc" in k for k in keys)


def test_native_rope_parameters_is_a_copy():
    model = gemma3()
    posenc.hf.patch(model, {"full_attention": YARN})
    got = native_rope_parameters(model)
    assert set(got) == {"sliding_attention", "full_attention"}
    json.dumps(got)
    got["full_attention"]["factor"] = 99.0
    assert native_rope_parameters(model)["full_attention"]["factor"] == 2.0
    assert model.config.rope_parameters == GEMMA3_4B_ROPE


def test_unpatched_model_exports_as_it_is(tmp_path):
    model = llama()
    assert native_rope_parameters(model) == model.config.rope_parameters
    posenc.hf.export(model, tmp_path / "plain")
    assert json.loads((tmp_path / "plain" / "config.json").read_text())["rope_parameters"]["rope_type"] == "default"


def test_max_length_and_tokenizer(tmp_path):
    model = llama()
    posenc.hf.patch(model, "rope-linear", factor=2.0)
    assert native_config_changes(model, max_length=100)["max_position_embeddings"] == 100

    class Tok:
        def save_pretrained(self, folder):
            (folder / "tokenizer.json").write_text("{}")

    posenc.hf.export(model, tmp_path / "m", tokenizer=Tok(), max_length=100)
    assert json.loads((tmp_path / "m" / "config.json").read_text())["max_position_embeddings"] == 100
    assert (tmp_path / "m" / "tokenizer.json").is_file()
    with pytest.raises(ConfigError, match="max_length must be a positive integer"):
        posenc.hf.export(model, tmp_path / "n", max_length=0)
    with pytest.raises(ConfigError, match="format must be one of 'transformers', 'gguf'"):
        posenc.hf.export(model, tmp_path / "n", format="onnx")
    dynamic = llama()
    posenc.hf.patch(dynamic, "rope-dynamic", factor=2.0)
    with pytest.raises(ConfigError, match="max_length=100: with rope-dynamic"):
        native_config_changes(dynamic, max_length=100)


# ------------------------------------------------------------------------------------------------------ refusals
def _refused(model, encoding, **options) -> str:
    posenc.hf.patch(model, encoding, **options)
    with pytest.raises(ConfigError) as err:
        posenc.hf.export(model, "/nonexistent/never-written")
    text = str(err.value)
    assert "posenc.hf.save_pretrained" in text and "posenc's own format" in text
    return text


def test_refuses_alibi():
    text = _refused(llama(), "alibi")
    assert "the patch with alibi cannot be exported natively" in text and "linear bias" in text


def test_refuses_t5():
    text = _refused(llama(), "t5")
    assert "the patch with t5 cannot be exported natively" in text and "bias table learned" in text


def test_refuses_fire():
    text = _refused(llama(), "fire")
    assert "the patch with fire cannot be exported natively" in text and "trained MLP" in text


def test_refuses_learned_parameters():
    text = _refused(llama(), "learned")
    assert "the patch with learned cannot be exported natively" in text and "trained with the model" in text


def test_refuses_rope_mixed():
    model = build(t.LlamaForCausalLM, t.LlamaConfig(**{**DEC, "num_key_value_heads": 4}))
    text = _refused(model, "rope-mixed", grid_width=4)
    assert "the patch with rope-mixed cannot be exported natively" in text and "trained per head" in text


def test_refuses_a_rotation_transformers_does_not_apply():
    text = _refused(llama(), "rope-interleaved")
    assert "the patch with rope-interleaved cannot be exported natively" in text and "rotary module" in text


def test_refuses_a_schedule_the_family_cannot_switch():
    text = _refused(llama(), "rope+nope")
    assert "layer 1 gets no positional encoding" in text and "cannot switch" in text
    text = _refused(gemma3(), ["rope", ("rope-yarn", {"factor": 2.0}), "rope", "rope"])
    assert "layers 0 and 1 are both 'sliding_attention' layers" in text and "cannot switch" in text
    cohere = build(t.Cohere2ForCausalLM, t.Cohere2Config(**DEC4, sliding_window=6))
    text = _refused(cohere, {"full_attention": "rope"})
    assert "layer 3 has no RoPE in Cohere2ForCausalLM" in text and "cannot switch" in text


def test_refuses_a_per_layer_patch_without_layer_types():
    text = _refused(llama(), "rope-yarn", factor=2.0, layers=[0])
    assert "LlamaForCausalLM has one rope_parameters for every layer" in text
    assert "no native config expresses a per-layer patch" in text


# ------------------------------------------------------------------------------------------------ the commands
def test_posenc_export_command(tmp_path, monkeypatch, capsys):
    """``posenc export SOURCE FOLDER --encoding rope-yarn --factor 2`` writes the folder the function does; the model
    it loads is the one posenc.hf.load_pretrained gives (here a tiny Llama, no tokenizer)."""
    from posenc.cli import main

    monkeypatch.setattr(posenc.hf, "load_pretrained", lambda source: (llama(), None))
    argv = ["export", "tiny", str(tmp_path / "cli"), "--encoding", "rope-yarn", "--factor", "2"]
    assert main([*argv, "--option", "beta_fast=16"]) == 0
    assert "rope_parameters" in capsys.readouterr().out
    config = json.loads((tmp_path / "cli" / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == "yarn" and config["rope_parameters"]["beta_fast"] == 16.0
    ids, _ = _ids()
    patched = posenc.hf.patch(llama(), "rope-yarn", factor=2.0, beta_fast=16.0)
    stock = t.AutoModelForCausalLM.from_pretrained(tmp_path / "cli", dtype=torch.float64).eval()
    with torch.no_grad():
        assert (stock(ids).logits - patched(ids).logits).abs().max().item() <= 1e-10
    assert main(["export", "tiny", str(tmp_path / "a"), "--encoding", "alibi"]) == 2
    assert "posenc.hf.save_pretrained" in capsys.readouterr().err
    assert main([*argv, "--option", "beta_fast"]) == 2
    assert "--option takes KEY=VALUE" in capsys.readouterr().err
    assert main(["export", "tiny", str(tmp_path / "b"), "--encoding", "rope-yarm"]) == 2
    assert "rope-yarn" in capsys.readouterr().err


def test_extend_export_flags_are_checked_before_the_model_loads(capsys):
    from posenc.cli import main

    assert main(["extend", "--quick", "--export", "rope-yarm"]) == 2
    assert "--export: unknown scaling 'rope-yarm' (did you mean rope-yarn" in capsys.readouterr().err
    assert main(["extend", "--quick", "--export-factor", "4"]) == 2
    assert "--export-factor describe the export, which needs --export SCALING" in capsys.readouterr().err


def test_extend_export_writes_the_named_scaling(tmp_path):
    """What ``posenc extend --export rope-longrope`` does after its run: the model with posenc extend's LongRoPE
    (YaRN's per-pair long factors) at the factor asked, written natively, the model left unpatched."""
    import argparse

    from posenc.extend.cli import _export
    from posenc.extend.runner import scaling_options

    model = llama()
    args = argparse.Namespace(export="rope-longrope", export_factor=4.0, loss_extension=None, export_dir=None)
    folder = _export(args, model, None, tmp_path)
    assert folder == tmp_path / "export-rope-longrope"
    params = json.loads((folder / "config.json").read_text())["rope_parameters"]
    assert params["long_factor"] == scaling_options("rope-longrope", model, 4.0)["long_factor"]
    assert params["factor"] == 4.0 and posenc.hf.patched(model) is None


def test_export_help_does_not_import_torch():
    probe = (
        "import sys\nfrom posenc.cli import main\ntry:\n    main(['export', '--help'])\nexcept SystemExit:\n    pass\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert "posenc export" in done.stdout and done.stdout.strip().endswith("NO-TORCH"), done.stdout + done.stderr
