"""The supported range of torch and transformers, declared once (posenc._version.TESTED_RANGES): pyproject.toml,
constraints.txt (the pinned leg, the oldest), constraints-latest.txt (the latest leg, the newest) and the README say
the same; posenc.hf warns only outside it; posenc's own calls into transformers emit none of its deprecation warnings.
"""

from __future__ import annotations

import tomllib
import warnings
from pathlib import Path

import pytest
import torch

from posenc._version import TESTED_RANGES

ROOT = Path(__file__).resolve().parents[1]


def _minor(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def _range_spec(name: str) -> str:
    """The pip requirement that admits every release of the tested minors: ``name>=oldest,<next minor``."""
    oldest, newest = TESTED_RANGES[name]
    major, minor = _minor(newest)
    return f"{name}>={oldest},<{major}.{minor + 1}"


def _pins(path: Path) -> dict[str, str]:
    lines = path.read_text().splitlines()
    return dict(line.split("==", 1) for line in lines if "==" in line and not line.startswith("#"))


def test_the_range_is_ordered_and_its_ends_are_the_two_legs_pins():
    for name, (oldest, newest) in TESTED_RANGES.items():
        assert _minor(oldest) <= _minor(newest), (name, oldest, newest)
        assert _minor(_pins(ROOT / "constraints.txt")[name]) == _minor(oldest), name
        assert _minor(_pins(ROOT / "constraints-latest.txt")[name]) == _minor(newest), name


def test_pyproject_declares_the_tested_range():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert _range_spec("torch") in project["dependencies"]
    extras = project["optional-dependencies"]
    with_transformers = {k: [r for r in v if r.startswith("transformers")] for k, v in extras.items()}
    with_transformers = {k: v for k, v in with_transformers.items() if v}
    assert {"hf", "test", "real", "peers", "eval"} <= set(with_transformers)
    assert all(v == [_range_spec("transformers")] for v in with_transformers.values()), with_transformers


def test_the_readme_and_docs_state_the_range():
    for doc in ("README.md", "docs/hf.md"):
        text = " ".join((ROOT / doc).read_text().split())
        for name, (oldest, newest) in TESTED_RANGES.items():
            assert f"{name} {oldest} to {newest}" in text, (doc, name)


def test_the_warning_comes_only_outside_the_tested_range(monkeypatch):
    from posenc.hf import patching

    monkeypatch.setattr(patching, "_warned_version", [])
    oldest, newest = TESTED_RANGES["transformers"]
    (om, on), (nm, nn_) = _minor(oldest), _minor(newest)
    inside = [f"{oldest}.0", f"{oldest}.7", f"{newest}.0", f"{newest}.3", f"{newest}.1.dev0"]
    after = [f"{nm}.{nn_ + 1}.0", f"{nm}.{nn_ + 1}.0.dev0", f"{nm + 1}.0.0"]
    before = [f"{om}.{on - 1}.2"] if on else [f"{om - 1}.99.0"]
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        for version in inside:
            patching.check_transformers_version(version)
        assert not got, [str(w.message) for w in got]
        for version in after + before + after:  # once per version and process
            patching.check_transformers_version(version)
    texts = [str(w.message) for w in got]
    assert len(texts) == len(after) + len(before), texts
    for text, version in zip(texts, after + before):
        assert version in text and f"{oldest} to {newest}" in text and "posenc.hf_matrix" in text
        assert ("older" if version in before else "newer") in text


def _deprecations(run) -> set[tuple[str, str]]:
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        run()
    return {
        (w.category.__name__, str(w.message)) for w in got if issubclass(w.category, DeprecationWarning | FutureWarning)
    }


def test_posenc_calls_no_deprecated_transformers_api():
    """A patched tiny Llama's forward, generate and checkpointed backward warn of nothing deprecated that the stock
    model's same calls do not warn of (before: transformers 5.24's FutureWarning for is_gradient_checkpointing)."""
    transformers = pytest.importorskip("transformers")
    from posenc import hf

    config = transformers.LlamaConfig(
        vocab_size=53, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    x = torch.randint(1, 53, (1, 6))

    def calls(patched: bool):
        def run():
            torch.manual_seed(0)
            model = transformers.LlamaForCausalLM(config)
            if patched:
                hf.patch(model, "t5")
            model.eval()
            model(x)
            model.generate(x, max_new_tokens=3, do_sample=False, pad_token_id=0)
            model.train()
            enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
            enable()
            model(x, labels=x).loss.backward()

        return run

    stock = _deprecations(calls(False))
    assert _deprecations(calls(True)) <= stock
