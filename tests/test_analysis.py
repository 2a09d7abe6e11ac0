"""posenc.analysis: the background articles' claims (docs/background.md), measured, and checked
against values computed independently here.

Independent truths used below (float64 unless stated):
* sinusoidal dot products: ``PE_t·PE_{t+k} = Σ_i cos(ω_i k)`` (Wu (2022); Xixiaoyao, "Three positional
  encoding methods", eq. (10)), tolerance 1e-5 (float32 codes);
* normalized positions: the code of t at length N is t/(N-1), so the first s codes differ by 1 - (s-1)/(L-1);
* integer positions: the mean of (t + 1) over the last 10% of positions;
* binary code: the step t -> t+1 flips popcount(t ^ (t+1)) bits, a distance sqrt(popcount);
* RoPE scores: q·R(n-m)k with 2x2 rotations written out in a loop, tolerance 1e-4 (float32 rotation);
* parameters of a learned table: max_len × d_model.
"""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

import posenc
from posenc.analysis import PROPERTY_KEYS, Probe, claims_for, measure
from posenc.analysis.cli import add_parser, run
from posenc.analysis.properties import mean_score_by_offset
from posenc.analysis.report import card_html, card_markdown, card_text, comparison_html, comparison_markdown
from posenc.base import AttentionContext, Card, PositionalEncoding
from posenc.cli import main as posenc_main

SMALL = dict(dim=16, heads=2, length=16)


# -------------------------------------------------------------- the articles' claims
def test_sinusoidal_dot_products_match_the_formula_are_symmetric_and_decay():
    dim, length = 32, 64
    probe = Probe("sinusoidal", dim=dim, length=length, heads=2)
    offsets, means = mean_score_by_offset(probe, length)
    omega = 10000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    expected = torch.cos(offsets.double()[:, None] * omega).sum(-1)  # Σ_i cos(ω_i k), Wu (2022)
    torch.testing.assert_close(means, expected, atol=1e-5, rtol=1e-5)
    r = measure("sinusoidal", dim=dim, length=length, heads=2, properties=("direction_aware", "decay"))
    assert r["direction_aware"].holds is False  # PE_t·PE_{t+k} == PE_t·PE_{t-k}
    assert r["direction_aware"].data["rel_diff"] < 1e-6
    assert r["direction_aware"].data["rel_diff_through_w"] > 0.05  # a random W breaks the symmetry
    assert r["decay"].holds is True and r["decay"].verdict == "pass"


def test_sinusoidal_decay_needs_the_standard_base():
    # with base 10 every frequency is fast: Σ cos(ω k) oscillates instead of decaying
    r = measure("sinusoidal", dim=32, length=64, heads=2, options={"base": 10.0}, properties=("decay",))
    assert r["decay"].holds is False


def test_normalized_positions_fail_consistency_across_lengths():
    length, short = 100, 10
    r = measure("normalized", dim=8, length=length, heads=1, short_length=short, properties=("consistent", "bounded"))
    m = r["consistent"]
    assert m.holds is False and m.claim is False and m.verdict == "pass"
    # code of t at length N is t/(N-1): the largest difference is at t = short-1
    assert m.data["rel_diff"] == pytest.approx(1 - (short - 1) / (length - 1), rel=1e-6)
    assert r["bounded"].holds is True
    assert measure("sinusoidal", dim=8, length=length, heads=1, properties=("consistent",))["consistent"].holds


def test_integer_positions_fail_boundedness():
    L = 40
    m = measure("integer", dim=4, length=L, heads=1, properties=("bounded",))["bounded"]
    assert m.holds is False and m.verdict == "pass"  # the card claims "unbounded"

    def tail_mean(n):  # mean of t + 1 over the last n // 10 positions (start=1)
        tail = max(1, n // 10)
        return sum(t + 1 for t in range(n - tail, n)) / tail

    assert m.data["far"] == pytest.approx([tail_mean(n) for n in (L, 2 * L, 4 * L, 8 * L)], rel=1e-6)
    for name in ("binary", "sinusoidal", "normalized"):
        assert measure(name, dim=16, length=L, heads=1, properties=("bounded",))["bounded"].holds is True, name


def test_binary_code_is_unique_but_not_continuous():
    L = 128
    r = measure("binary", dim=16, length=L, heads=1, properties=("unique", "continuous"))
    assert r["unique"].holds is True
    assert r["unique"].data["min_distance"] == pytest.approx(1.0)  # neighbours that differ in one bit
    c = r["continuous"]
    assert c.holds is False and c.verdict == "pass"
    steps = [math.sqrt(bin(t ^ (t + 1)).count("1")) for t in range(L - 1)]
    assert c.data["max_step"] == pytest.approx(max(steps))  # 63 -> 64 flips 7 bits
    assert c.data["median_step"] == pytest.approx(float(torch.tensor(steps).median()))
    assert measure("sinusoidal", dim=16, length=L, heads=1, properties=("continuous",))["continuous"].holds


class _TenerLike(PositionalEncoding):
    """TENER's terms u·R_{t-j} + Q_t·R_{t-j} (Wu (2022), formula (2)), R = [sin, cos] of t - j (not registered)."""

    info = Card("tener-like", "test", "test", 2019, "relative", "relative", True, "test")

    def __init__(self, head_dim: int, n_heads: int, sine: bool = True):
        super().__init__()
        self.u = torch.nn.Parameter(torch.randn(n_heads, head_dim))
        self.sine = sine
        self.omega = 10000.0 ** (-torch.arange(0, head_dim, 2).float() / head_dim)

    def R(self, d: torch.Tensor) -> torch.Tensor:
        a = d[..., None].float() * self.omega
        first = a.sin() if self.sine else a.cos()  # cos only: an even function of t - j
        return torch.stack([first, a.cos()], -1).flatten(-2)

    def logits(self, q, k, ctx):
        r = self.R(-ctx.relative())  # [B, Lq, Lk, D], t - j
        return torch.einsum("bhid,bijd->bhij", q, r) + torch.einsum("hd,bijd->bhij", self.u, r)


def test_tener_scores_are_direction_aware():
    aware = measure(_TenerLike(8, 2), dim=16, heads=2, length=32, properties=("direction_aware", "relative_only"))
    assert aware["direction_aware"].holds is True
    assert aware["relative_only"].holds is True
    blind = measure(_TenerLike(8, 2, sine=False), dim=16, heads=2, length=32, properties=("direction_aware",))
    assert blind["direction_aware"].holds is False  # an even R cannot tell +k from -k
    if "tener" in posenc.available():
        m = measure("tener", dim=16, heads=2, length=32, properties=("direction_aware",))["direction_aware"]
        assert m.holds is True and m.verdict == "pass"


def _naive_rope_score(q, k, m, n, base=10000.0):
    """(R_m q)·(R_n k) with every 2x2 rotation written out (interleaved pairs)."""
    d = q.numel()
    total = 0.0
    for i in range(d // 2):
        theta = base ** (-2 * i / d)
        a, b = q[2 * i].item(), q[2 * i + 1].item()
        c, e = k[2 * i].item(), k[2 * i + 1].item()
        qa, qb = a * math.cos(m * theta) - b * math.sin(m * theta), b * math.cos(m * theta) + a * math.sin(m * theta)
        kc, ke = c * math.cos(n * theta) - e * math.sin(n * theta), e * math.cos(n * theta) + c * math.sin(n * theta)
        total += qa * kc + qb * ke
    return total


def test_rope_scores_match_a_naive_rotation_and_are_relative_only():
    probe = Probe("rope-interleaved", dim=16, heads=2, length=16)
    pos = torch.tensor([0, 3, 9, 40])
    s = probe.attention_scores(pos, pos)
    for b in (0, 5):
        for h in (0, 1):
            for i, m in enumerate(pos.tolist()):
                for j, n in enumerate(pos.tolist()):
                    want = _naive_rope_score(probe.q0[b, h, 0], probe.k0[b, h, 0], m, n) * 8**-0.5
                    assert s[b, h, i, j].item() == pytest.approx(want, abs=1e-4)
    r = measure("rope", dim=16, heads=2, length=64, properties=("relative_only", "direction_aware", "linear_offset"))
    assert r["relative_only"].holds is True and r["relative_only"].verdict == "pass"
    assert r["direction_aware"].holds is True
    assert r["linear_offset"].holds is True  # R_{t+k} = R_k R_t
    assert measure("learned", **SMALL, properties=("relative_only",))["relative_only"].holds is False


def test_linear_offset_residuals():
    r = measure("sinusoidal", dim=16, length=64, heads=1, properties=("linear_offset",))
    assert r["linear_offset"].holds is True
    assert max(r["linear_offset"].data["residuals"].values()) < 1e-5
    # anon., "Positional encoding of the Transformer": sine alone has no linear map
    for name in ("sin-only", "sin-pow2", "binary", "learned"):
        m = measure(name, dim=16, length=64, heads=1, properties=("linear_offset",))["linear_offset"]
        assert m.holds is False and min(m.data["residuals"].values()) > 0.01, name


def test_learned_positions_are_not_defined_past_their_table():
    r = measure("learned", dim=8, length=32, heads=1)
    ext = r["extrapolates"]
    assert ext.holds is False and ext.claim is False and ext.verdict == "pass"
    assert "not defined past" in ext.value and "max_len=32" in ext.value
    assert r["bounded"].holds is None and r["bounded"].value.startswith("n/a")  # said in the card, no crash
    p = r["params_constant"]
    assert p.holds is False and p.data["counts"] == [32 * 8, 64 * 8, 128 * 8]  # max_len × d_model


def test_every_registered_encoding_gets_a_card():
    for name in posenc.available():
        r = measure(name, **SMALL)
        assert set(r.measurements) == set(PROPERTY_KEYS), name
        for m in r.measurements.values():
            assert m.holds in (True, False, None)
            if m.holds is None:
                assert "n/a" in m.value, (name, m.key, m.value)
            assert m.verdict in ("pass", "FAIL", "-", "n/a")
        assert r.name in card_text(r)


class _Broken(PositionalEncoding):
    info = Card("broken", "test", "test", 2024, "bias", "relative", False, "test")

    def bias(self, ctx: AttentionContext) -> torch.Tensor:
        raise RuntimeError("this bias cannot be computed")


def test_unmeasurable_properties_say_why_instead_of_failing():
    r = measure(_Broken(), **SMALL)
    assert r["relative_only"].holds is None
    assert "this bias cannot be computed" in r["relative_only"].value
    assert r["linear_offset"].value.startswith("n/a (no per-position code")
    bad = measure("rope", **SMALL, options={"base": 0.5})  # cannot be built
    assert bad.kind == "unbuilt"
    assert all("cannot build" in m.value and "base" in m.value for m in bad.measurements.values())


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(dim=0), "dim must be an integer >= 2"),
        (dict(dim=10, heads=4), "not divisible by heads=4"),
        (dict(length=4), "length must be an integer >= 8"),
        (dict(length=100_000), "length must be <= 4096"),
        (dict(length=16, short_length=16), "short_length must be an integer in 2..15"),
        (dict(heads=0), "heads must be an integer >= 1"),
        (dict(properties=("nonsense",)), "unknown properties"),
    ],
)
def test_invalid_sizes_give_clear_errors(kwargs, message):
    with pytest.raises(posenc.ConfigError, match=message):
        measure("sinusoidal", **kwargs)


def test_unknown_name():
    with pytest.raises(posenc.UnknownNameError, match="sinusoidal"):
        measure("sinusoidl")


def test_claims_from_cards():
    def card(**kw):
        base = dict(name="x", title="x", paper="x", year=2000, family="absolute", position="absolute")
        return Card(**{**base, "learnable": False, "summary": "x", **kw})

    c = claims_for(card(shortcoming="unbounded: grows"))
    assert c["bounded"] is False and c["unique"] is True and c["params_constant"] is True
    c = claims_for(card(position="relative", learnable=True, shortcoming="undefined past max_len; parameters grow"))
    assert c["relative_only"] is True and c["extrapolates"] is False and c["params_constant"] is False
    c = claims_for(card(position="none"))
    assert c["unique"] is False and c["direction_aware"] is False
    assert claims_for(posenc.card("sinusoidal"))["linear_offset"] is True
    assert claims_for(posenc.card("binary"))["continuous"] is False


def test_card_and_comparison_rendering():
    reports = [measure(n, **SMALL) for n in ("sinusoidal", "integer", "t5")]
    md = card_markdown(reports[1])
    assert "| Bounded |" in md and "| no | no | pass |" in md
    html = card_html(reports[0])
    assert html.startswith("<!DOCTYPE html>") and html.count("<tr>") == len(PROPERTY_KEYS) + 1
    table = comparison_markdown(reports)
    assert table.count("\n| ") == len(reports)  # one row each, after the header
    assert all(f"| {r.name} |" in table for r in reports)
    assert comparison_html(reports).count("<tr>") == len(reports) + 1


# ------------------------------------------------------------------ the CLI
def _parser():
    p = argparse.ArgumentParser(prog="posenc")
    add_parser(p.add_subparsers(dest="command"))
    return p


def test_cli_help_names_every_option(capsys):
    with pytest.raises(SystemExit):
        _parser().parse_args(["inspect", "--help"])
    out = capsys.readouterr().out
    for opt in ("NAME", "--all", "--dim", "--length", "--out", "--heads", "--format"):
        assert opt in out


def test_cli_prints_a_card(capsys):
    args = _parser().parse_args(
        ["inspect", "integer", "--dim", "8", "--length", "16", "--no-plots", "--format", "json"]
    )
    assert run(args) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["name"] == "integer" and got["properties"]["bounded"]["holds"] is False
    args = _parser().parse_args(["inspect", "sinusoidal", "--option", "base=100", "--no-plots", "--length", "16"])
    assert run(args) == 0
    assert "options {'base': 100}" in capsys.readouterr().out


def test_cli_all_without_pictures(capsys, tmp_path):
    args = _parser().parse_args(
        ["inspect", "--all", "--no-plots", "--dim", "16", "--heads", "2", "--length", "16", "--out", str(tmp_path)]
    )
    assert run(args) == 0
    table = (tmp_path / "comparison.md").read_text()
    assert all(f"| {n} |" in table for n in posenc.available())
    assert (tmp_path / "index.html").read_text().startswith("<!DOCTYPE html>")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["inspect"], "give an encoding NAME"),
        (["inspect", "rope", "--all"], "not both"),
        (["inspect", "rope", "--dim", "-3"], "dim must be"),
        (["inspect", "rope", "--option", "base"], "KEY=VALUE"),
        (["inspect", "nosuch"], "unknown encoding"),
    ],
)
def test_cli_bad_input(argv, message, capsys):
    assert run(_parser().parse_args(argv)) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, needs",
    [
        (["inspect", "rope-linear", "--option", "factor=0.5"], "must be >= 1, got 0.5"),  # not the example's
        (["inspect", "rope", "--option", "base=-1"], "base must be > 1, got -1"),  # a bad setting
        (["inspect", "rope", "--option", "base=-1", "--format", "json"], "base must be > 1, got -1"),
    ],
)
def test_cli_encoding_that_cannot_be_built_fails_once_with_exit_2(argv, needs, capsys, tmp_path):
    out = tmp_path / "pictures"
    code = posenc_main([*argv, "--dim", "16", "--heads", "2", "--length", "16", "--out", str(out)])
    got = capsys.readouterr()
    assert code == 2
    assert got.err.count(needs) == 1 and got.err.startswith("posenc inspect: error: cannot build")
    assert "agrees with the claims" not in got.out and got.out == ""
    assert not out.exists()  # nothing drawn or written


def test_cli_a_good_setting_still_prints_the_card(capsys):
    argv = ["inspect", "rope", "--option", "base=100", "--no-plots", "--dim", "16", "--heads", "2", "--length", "16"]
    assert posenc_main(argv) == 0
    got = capsys.readouterr()
    assert got.out.startswith("== rope ==") and "options {'base': 100}" in got.out and got.err == ""


def test_unbuilt_card_does_not_claim_agreement():
    bad = measure("rope", **SMALL, options={"base": 0.5})
    assert bad.kind == "unbuilt" and "base" in bad.error
    text = card_text(bad)
    assert "agrees with the claims" not in text and "cannot be built" in text
