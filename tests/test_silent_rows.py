"""Issue 48, item 3: inputs that were accepted and gave a silently wrong answer, each tested as a class.

* ``schedule(layers=[...])`` is a full per-layer list: a model of any other layer count is refused, naming both
  counts and the pattern syntax (a pattern repeats; a full list never does);
* a scale or temperature that would invert or erase every softmax is refused, for every registered encoding that
  takes a setting of that kind;
* a partial rotary encoding that would keep no rotated pair (NoPE in disguise) is refused with the smallest value
  that keeps one (``p-rope``'s ``p``, ``hope``'s ``max_len``);
* the encodings that draw random numbers draw the same numbers whatever torch's default dtype.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import posenc
from posenc import ConfigError, Schedule
from posenc.registry import accepted_arguments, example_options, resolve

NAMES = ["rope", "nope", "alibi", "rope@w4", "sinusoidal#qk"]
DIMS = dict(d_model=16, n_heads=2, head_dim=8, max_len=32, vocab_size=20, n_layers=2)


# ------------------------------------------------------------------------------- a full per-layer list
@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(NAMES), min_size=1, max_size=6), st.integers(1, 12))
def test_a_full_layer_list_fits_only_its_own_layer_count(items: list[str], n_layers: int) -> None:
    sched = posenc.schedule(layers=items)
    expected = posenc.schedule(*items)  # the same layers as a pattern
    if n_layers == len(expected):
        assert sched.for_layers(n_layers) == expected.layers
        return
    with pytest.raises(ConfigError) as err:
        sched.for_layers(n_layers)
    text = str(err.value)
    assert f"{len(expected)} entries" in text and f"n_layers={n_layers}" in text
    assert "rope*3+nope" in text and repr(str(expected)) in text  # the pattern syntax, and this list as a pattern


def test_the_issue_row_a_list_of_two_on_four_layers_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"2 entries.*n_layers=4"):
        posenc.LanguageModel(50, encoding=posenc.schedule(layers=["rope", "nope"]), n_layers=4, d_model=16, n_heads=2)
    with pytest.raises(ConfigError, match=r"2 entries.*n_layers=4"):  # a plain list as the encoding is the same
        posenc.LanguageModel(50, encoding=["rope", "nope"], n_layers=4, d_model=16, n_heads=2)
    lm = posenc.LanguageModel(50, encoding=posenc.schedule("rope", "nope"), n_layers=4, d_model=16, n_heads=2)
    names = ["nope" if b.attn.encoding is None else b.attn.encoding.info.name for b in lm.trunk.blocks]
    assert names == ["rope", "nope", "rope", "nope"]


def test_a_full_list_stays_full_through_its_stored_form() -> None:
    sched = posenc.schedule(layers=["rope", "rope", "nope"])
    back = Schedule.from_dict(sched.as_dict())
    assert back.full and back == sched
    assert "full" not in posenc.schedule("rope*2+nope").as_dict()  # a pattern stores as before
    with pytest.raises(ConfigError, match="truncate=True goes with a pattern"):
        posenc.schedule(layers=["rope", "nope"], truncate=True)


# ------------------------------------------------------------------------------- scales and temperatures
#: settings that multiply every logit of a softmax: a negative one inverts every attention, 0 erases it or is "off"
TEMPERATURE_LIKE = {"s_init": False, "attn_scale": True, "beta": True, "temperature": False}


def _temperature_cases() -> list[tuple[str, str, bool]]:
    out = []
    for name in posenc.available():
        args = accepted_arguments(resolve(name))
        out += [(name, key, zero_ok) for key, zero_ok in TEMPERATURE_LIKE.items() if key in args]
    return out


@pytest.mark.parametrize(("name", "key", "zero_ok"), _temperature_cases())
@pytest.mark.parametrize("value", [-1.0, -1e-9, 0.0])
def test_no_scale_or_temperature_inverts_the_softmax(name: str, key: str, zero_ok: bool, value: float) -> None:
    options = {**example_options(name, DIMS), key: value}
    if value == 0.0 and zero_ok:
        posenc.get(name, **DIMS, **options)
        return
    with pytest.raises(ConfigError, match=rf"{re.escape(key)} must be"):
        posenc.get(name, **DIMS, **options)


def test_the_temperature_class_is_not_empty() -> None:
    assert "ssmax" in {c[0] for c in _temperature_cases()} and len(_temperature_cases()) >= 3


def test_ssmax_issue_row() -> None:
    with pytest.raises(ConfigError, match=r"s_init must be > 0.*inverts every softmax.*got -1.0"):
        posenc.get("ssmax", n_heads=4, max_len=16, s_init=-1.0)
    assert float(posenc.get("ssmax", n_heads=4, max_len=16, s_init=0.3).s[0].detach()) == pytest.approx(0.3)


# ------------------------------------------------------------------------------- partial rotary: no pair kept
@settings(max_examples=80, deadline=None)
@given(st.integers(1, 32).map(lambda k: 2 * k), st.floats(1e-6, 1.0))
def test_p_rope_refuses_a_p_that_keeps_no_pair(head_dim: int, p: float) -> None:
    if int(p * head_dim // 2) == 0:  # the paper's count
        with pytest.raises(ConfigError, match=rf"keeps .* = 0 .*smallest p that keeps one pair is .*{2 / head_dim:g}"):
            posenc.get("p-rope", head_dim=head_dim, p=p)
        assert posenc.get("p-rope", head_dim=head_dim, p=2 / head_dim).kept == 1  # the value the error names
    else:
        enc = posenc.get("p-rope", head_dim=head_dim, p=p)
        assert enc.kept == int(p * head_dim // 2) >= 1
        assert int((enc.inv_freq != 0).sum()) == enc.kept  # the pairs it says it keeps rotate


@pytest.mark.parametrize("head_dim", [2, 8, 64])
@pytest.mark.parametrize("max_len", range(1, 10))
def test_hope_refuses_a_max_len_that_keeps_no_pair(head_dim: int, max_len: int) -> None:
    # RoPE's highest frequency is theta_0 = 1: it completes a turn within L positions iff L >= 2 pi, so L >= 7
    if max_len < 2 * math.pi:
        with pytest.raises(ConfigError, match=r"NoPE.*smallest max_len that keeps one pair is 7"):
            posenc.get("hope", head_dim=head_dim, max_len=max_len)
    else:
        assert posenc.get("hope", head_dim=head_dim, max_len=max_len).kept >= 1


# ------------------------------------------------------------------------------- draws and the default dtype
def _with_default(dtype: torch.dtype, draw):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        torch.manual_seed(7)
        return draw()
    finally:
        torch.set_default_dtype(old)


def _dinov3():
    enc = posenc.get("rope-dinov3", head_dim=16, grid_width=4, grid_height=4, shift=0.5, jitter=2.0, rescale=2.0)
    return enc.augmentation()


def _mixed():
    return posenc.get("rope-mixed", head_dim=16, n_heads=2, grid_width=4).freqs.detach().float()


def _randomized():
    enc = posenc.get("randomized-rope", head_dim=8, random_max_len=64)
    return enc.positions(torch.arange(6)[None].expand(3, 6), training=True)


@pytest.mark.parametrize("draw", [_dinov3, _mixed, _randomized], ids=["rope-dinov3", "rope-mixed", "randomized"])
def test_random_draws_do_not_follow_the_default_dtype(draw) -> None:
    a = _with_default(torch.float32, draw)
    b = _with_default(torch.float64, draw)
    a, b = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype
        assert torch.equal(x, y)


# ------------------------------------------------------------------------------- right padding
PAD_NAMES = [n for n in posenc.available() if not n.startswith("randomized-")]  # random positions by design


PAD_CASES = [(n, None) for n in PAD_NAMES] + [("rope-dinov3", {"grid_width": 4}), ("rope-dinov3", {"grid_width": 3})]


@pytest.mark.parametrize(("name", "options"), PAD_CASES)
def test_right_padding_changes_no_sequence_classifier_logits(name: str, options: dict | None) -> None:
    """20 real tokens, alone and right-padded to 28: past the example's original_max_len (16), so dynamic NTK
    (which computes its base from the length) scales, and must see the real length, not the padded one."""
    torch.manual_seed(0)
    opts = options or example_options(name, DIMS) or None  # rope-dinov3 without grid_height: rows from the length
    m = posenc.SequenceClassifier(
        20, 3, d_model=16, n_heads=2, n_layers=2, max_len=32, encoding=name, encoding_options=opts
    ).eval()
    real = torch.randint(0, 20, (1, 20))
    padded = torch.zeros(1, 28, dtype=torch.long)
    padded[0, :20] = real[0]
    mask = torch.zeros(1, 28, dtype=torch.bool)
    mask[0, :20] = True
    with torch.no_grad():
        assert (m(real) - m(padded, attention_mask=mask)).abs().max().item() < 1e-5
