"""One encoding, one file: what an encoding declares on its class is discovered everywhere.

A throwaway encoding is registered here (and removed afterwards) with a setting no model dimension supplies,
``example_options``, ``claims``, ``randomized_variant`` and a ``relative_form``; the registry's helpers, the
analysis, the randomized registry, ``posenc bench --encodings all`` and the encoding-generic tests must all pick it
up without any list being edited.
"""

from __future__ import annotations

import argparse

import pytest
import torch

import posenc
from posenc import registry
from posenc.base import Card, PositionalEncoding
from posenc.bias import randomized_registry


class ThrowawayBias(PositionalEncoding):
    """``-slope_h |i - j|`` with a ``slope`` that no model dimension supplies."""

    info = Card(
        name="throwaway-bias",
        title="Throwaway bias",
        paper="(test)",
        year=2026,
        family="bias",
        position="relative",
        learnable=True,
        summary="-slope |i-j|",
    )
    example_options = {"slope": 0.5}
    claims = {"decay": True, "bounded": False}
    randomized_variant = True

    def __init__(self, n_heads: int, slope: float):
        super().__init__()
        self.slope = torch.nn.Parameter(torch.full((n_heads,), float(slope)))

    def bias(self, ctx):
        return -self.slope[:, None, None] * ctx.relative().abs()[:, None].to(self.slope.dtype)

    def relative_form(self, q, k, ctx):
        return None  # declared (overridden): the discovery is what is tested here


class SizedExample(PositionalEncoding):
    """Example options that depend on the model's sizes."""

    info = Card(
        name="throwaway-sized",
        title="",
        paper="",
        year=2026,
        family="rotary",
        position="relative",
        learnable=False,
        summary="",
    )
    example_options = staticmethod(lambda dims: {"pairs": dims["head_dim"] // 2})

    def __init__(self, head_dim: int, pairs: int):
        super().__init__()
        if pairs != head_dim // 2:
            raise posenc.ConfigError(f"pairs must be head_dim // 2 = {head_dim // 2}, got {pairs}")
        self.pairs = pairs


@pytest.fixture
def throwaway():
    """Register the throwaway encodings; restore the registry (and the randomized variants) afterwards."""
    posenc.available()
    saved = dict(registry._REGISTRY), dict(registry._ALIASES), dict(randomized_registry.REGISTERED)
    registry.register(ThrowawayBias)
    registry.register(SizedExample)
    try:
        yield
    finally:
        for live, old in zip((registry._REGISTRY, registry._ALIASES, randomized_registry.REGISTERED), saved):
            live.clear()
            live.update(old)


def test_registry_helpers_build_it_with_its_example_options(throwaway):
    assert "throwaway-bias" in posenc.available()
    assert registry.needs_options("throwaway-bias") == ["slope"]
    assert registry.example_options("throwaway-bias") == {"slope": 0.5}
    enc = registry.example("throwaway-bias", dict(d_model=16, n_heads=2, head_dim=8, max_len=32))
    assert isinstance(enc, ThrowawayBias) and enc.slope.tolist() == [0.5, 0.5]
    assert registry.example("throwaway-bias", slope=2.0).slope[0].item() == 2.0  # options on top
    assert enc.offers_relative_form()
    assert registry.example_options("throwaway-sized", dict(d_model=24, n_heads=2)) == {"pairs": 6}
    assert registry.example("throwaway-sized", dict(d_model=24, n_heads=2, head_dim=12, max_len=8)).pairs == 6
    assert not posenc.get("rope", head_dim=8).offers_relative_form()


def test_every_registered_encoding_builds_from_its_declarations():
    for name in posenc.available():
        missing = [k for k in registry.needs_options(name) if k not in registry.example_options(name)]
        assert not missing, f"{name} needs {missing}: declare them in its example_options"
        registry.example(name)


def test_randomized_variant_is_registered_with_the_inner_example(throwaway):
    assert "randomized-throwaway-bias" in posenc.available()
    cls = randomized_registry.REGISTERED["randomized-throwaway-bias"]
    assert cls.inner_class is ThrowawayBias
    enc = registry.example("randomized-throwaway-bias")
    assert enc.inner.slope[0].item() == 0.5 and enc.hooks() == {"bias", "positions"}
    assert "randomized-throwaway-sized" not in posenc.available()  # not declared


def test_analysis_uses_its_claims_and_example_options(throwaway):
    from posenc.analysis import claims_for, measure

    claims = claims_for(posenc.card("throwaway-bias"))
    assert claims["decay"] is True and claims["bounded"] is False and claims["relative_only"] is True
    report = measure("throwaway-bias", dim=16, heads=2, length=16, properties=["decay"])
    assert report.kind == "attention"
    assert report.measurements["decay"].claim is True
    assert any("slope=0.5" in note for note in report.notes)


def test_bench_all_runs_it_with_its_example_options(throwaway, capsys):
    from posenc.bench.cli import _all_buildable
    from posenc.bench.suites import load_suite

    entries = _all_buildable(load_suite("quick"))
    assert {"name": "throwaway-bias", "options": {"slope": 0.5}} in entries
    assert "rope" in entries  # no options: the name alone
    names = [e if isinstance(e, str) else e["name"] for e in entries]
    assert sorted(names) == sorted(posenc.available())  # nothing left out
    assert "leaving out" not in capsys.readouterr().err
    # through the command line's grid: every encoding, each with its declared options (and --encoding-option on top)
    from posenc.bench.cli import _suite

    args = argparse.Namespace(suite=None, encoding_option=[], encodings=["all"], tasks=None, seeds=None)
    specs = {e.name: e.options for e in _suite(args)[0].grids[0].encodings}
    assert specs["throwaway-bias"] == {"slope": 0.5} and specs["rope"] == {}
    assert specs["rope-yarn"]["factor"] == 2.0 and set(specs) == set(posenc.available())


def test_encoding_generic_tests_discover_it(throwaway):
    import test_attention
    import test_fused
    import test_generate

    assert "throwaway-bias" in test_attention.names()
    assert test_attention.make("throwaway-bias").slope.shape == (4,)
    assert "throwaway-bias" in test_fused.form_encodings()
    assert test_generate.options_for("throwaway-bias") == {"slope": 0.5}
