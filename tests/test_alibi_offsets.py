"""ALiBi's bias per offset (``bias_offsets``): the ``offset-bias`` kernel instead of an ``[H, L, L]`` matrix.

Truth:
* the values per offset laid out as a Toeplitz matrix equal the paper's matrix ``-m_h (i - j)`` /
  ``-m_h |i - j|`` computed from explicit positions (float64, exact up to rounding), for random lengths,
  both directions, ``Lq != Lk`` (a cache of earlier keys) and batches of shifted rows;
* a plain :class:`posenc.LanguageModel` with ALiBi plans ``offset-bias`` and equals ``path="reference"``
  (the formula as written), forward and gradients (float64);
* a tiny random grouped-query Llama patched with ALiBi by :mod:`posenc.hf` plans ``offset-bias`` in prefill
  (the keys repeated to the query heads) and equals the same model patched with ``path="reference"``, logits,
  gradients and one cached decoding step.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import posenc
from posenc import ConfigError
from posenc.base import AttentionContext, contiguous_positions
from posenc.bias.alibi import ALiBi, ALiBiBidirectional
from posenc.relative._skew import toeplitz

F64 = torch.float64
TOL = dict(rtol=1e-9, atol=1e-10)


def ctx_for(q_pos: torch.Tensor, k_pos: torch.Tensor, n_heads: int, reference: bool = False) -> AttentionContext:
    return AttentionContext(
        q_pos=q_pos,
        k_pos=k_pos,
        n_heads=n_heads,
        head_dim=8,
        reference=reference,
        contiguous=contiguous_positions(q_pos, k_pos),
    )


def naive(enc: ALiBi, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """``-m_h (i - j)`` (``|i - j|`` bidirectional) by a loop over the pairs: ``[B, H, Lq, Lk]``, float64."""
    slopes = enc.slopes.tolist()
    b, lq, lk = q_pos.shape[0], q_pos.shape[1], k_pos.shape[1]
    out = torch.empty(b, len(slopes), lq, lk, dtype=F64)
    for r in range(b):
        for i in range(lq):
            for j in range(lk):
                dist = float(q_pos[r, i] - k_pos[r, j])
                dist = abs(dist) if enc.bidirectional else dist
                for h, m in enumerate(slopes):
                    out[r, h, i, j] = -m * dist
    return out


@pytest.mark.parametrize("cls", [ALiBi, ALiBiBidirectional])
@pytest.mark.parametrize("seed", range(4))
def test_offsets_laid_out_equal_the_paper_matrix(cls, seed: int) -> None:
    """Random Lq <= Lk (Lq < Lk: a cache of Lk - Lq earlier keys), random heads and starts, batches of shifted
    rows: the Toeplitz layout of bias_offsets is the paper's matrix, and bias() is that same matrix."""
    g = torch.Generator().manual_seed(seed)
    n_heads = int(torch.randint(1, 10, (1,), generator=g))
    lk = int(torch.randint(1, 40, (1,), generator=g))
    lq = int(torch.randint(1, lk + 1, (1,), generator=g))
    b = int(torch.randint(1, 3, (1,), generator=g))
    start = torch.randint(0, 50, (b, 1), generator=g)  # one shift per row (left padding, an offset)
    k_pos = start + torch.arange(lk)
    q_pos = start + (lk - lq) + torch.arange(lq)  # the last Lq positions: after a cache of Lk - Lq keys
    enc = cls(n_heads)
    ctx = ctx_for(q_pos, k_pos, n_heads)
    assert ctx.contiguous
    vals = enc.bias_offsets(ctx)
    assert vals is not None and vals.shape == (n_heads, lq + lk - 1)
    truth = naive(enc, q_pos, k_pos)
    laid_out = toeplitz(vals.double(), lq, lk).expand(b, -1, -1, -1)
    torch.testing.assert_close(laid_out, truth, rtol=1e-6, atol=1e-6)  # float32 values (no attention: float32)
    torch.testing.assert_close(enc.bias(ctx).double().expand(b, -1, -1, -1), truth, rtol=1e-6, atol=1e-6)
    ref = enc.bias(ctx_for(q_pos, k_pos, n_heads, reference=True))
    torch.testing.assert_close(ref.double(), truth, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("cls", [ALiBi, ALiBiBidirectional])
def test_offsets_in_float64_are_the_reference_numbers(cls) -> None:
    """In a float64 attention the values per offset are the paper's numbers to the last bit's rounding."""
    enc = cls(6)
    layer = posenc.MultiHeadAttention(48, 6, enc).double()
    q_pos, k_pos = torch.arange(5, 12)[None], torch.arange(12)[None]
    ctx = ctx_for(q_pos, k_pos, 6)
    ctx.attention = layer
    vals = enc.bias_offsets(ctx)
    assert vals.dtype == F64
    torch.testing.assert_close(toeplitz(vals, 7, 12), naive(enc, q_pos, k_pos), rtol=1e-15, atol=1e-15)


def test_no_offsets_where_they_do_not_apply() -> None:
    """The reference path and arbitrary positions get None (the plan then calls bias())."""
    enc = ALiBi(4)
    pos = torch.arange(6)[None]
    assert enc.bias_offsets(ctx_for(pos, pos, 4, reference=True)) is None
    odd = torch.tensor([[0, 2, 3, 7, 8, 9]])
    ctx = ctx_for(odd, odd, 4)
    assert not ctx.contiguous and enc.bias_offsets(ctx) is None
    torch.testing.assert_close(enc.bias(ctx).double(), naive(enc, odd, odd), rtol=1e-6, atol=1e-6)
    with pytest.raises(ConfigError, match="n_heads=4"):
        enc.bias_offsets(ctx_for(pos, pos, 3))


def test_long_calls_keep_no_matrix() -> None:
    """The matrix kept across forwards (x-transformers style) is only for calls below fused_min_pairs (where the plan
    takes SDPA): a long call's Toeplitz matrix is built for that forward and not kept for the model's life."""
    enc = ALiBi(3)
    enc.fused_min_pairs = 64
    short = torch.arange(7)[None]
    enc.bias(ctx_for(short, short, 3))
    kept = enc._memo
    assert kept is not None and kept[1].shape[-1] == 7
    long = torch.arange(8)[None]  # 8 * 8 = 64 pairs: the offset-bias kernel's size
    enc.bias(ctx_for(long, long, 3))
    assert enc._memo is kept


def lm(name: str, path: str = "auto") -> posenc.LanguageModel:
    torch.manual_seed(0)
    model = posenc.LanguageModel(
        31, encoding=name, d_model=24, n_heads=3, n_layers=2, max_len=64, path=path, causal=name == "alibi"
    ).double()
    for m in model.modules():
        if isinstance(m, ALiBi):
            m.fused_min_pairs = 1  # the offset-bias kernel at these short lengths (its threshold is for speed)
    return model


@pytest.mark.parametrize("name", ["alibi", "alibi-bidirectional"])
def test_language_model_plans_offset_bias_and_equals_reference(name: str) -> None:
    fast, ref = lm(name), lm(name, path="reference")
    ref.load_state_dict(fast.state_dict())
    tokens = torch.randint(0, 31, (2, 37), generator=torch.Generator().manual_seed(5))
    weight = torch.linspace(-1, 1, 2 * 37 * 31, dtype=F64).view(2, 37, 31)
    outs, grads = [], []
    for model in (fast, ref):
        out = model(tokens)
        (out * weight).sum().backward()
        outs.append(out)
        grads.append([p.grad for p in model.parameters()])
    assert {b.attn.last_plan.kernel for b in fast.trunk.blocks} == {"offset-bias"}
    assert {b.attn.last_plan.kernel for b in ref.trunk.blocks} == {"materialised"}
    torch.testing.assert_close(outs[0], outs[1], **TOL)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-9)


def test_language_model_at_the_default_threshold_takes_offset_bias() -> None:
    """No threshold lowered: 256 tokens (256² pairs, fused_min_pairs) plan offset-bias, below it SDPA."""
    torch.manual_seed(0)
    model = posenc.LanguageModel(31, encoding="alibi", d_model=16, n_heads=2, n_layers=1, max_len=256).eval()
    with torch.no_grad():
        model(torch.randint(0, 31, (1, 256)))
        assert model.trunk.blocks[0].attn.last_plan.kernel == "offset-bias"
        model(torch.randint(0, 31, (1, 255)))
        assert model.trunk.blocks[0].attn.last_plan.kernel == "sdpa"


# ------------------------------------------------------------------------------------------ a patched Llama
transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("posenc.hf")


def llama() -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention: two query heads per key head
        max_position_embeddings=32,
    )
    return transformers.LlamaForCausalLM(cfg).eval()


def test_grouped_llama_prefill_plans_offset_bias_and_equals_reference() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast, ref = llama(), llama()
        hf.patch(fast, "alibi")
        hf.patch(ref, "alibi", path="reference")
        for enc in hf.patched(fast).modules():
            if isinstance(enc, ALiBi):
                enc.fused_min_pairs = 1
        ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(1))
        outs, grads, caches = [], [], []
        for model in (fast, ref):
            model.zero_grad(set_to_none=True)
            cache = transformers.DynamicCache()
            out = model(input_ids=ids, past_key_values=cache, use_cache=True).logits
            (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
            outs.append(out.detach())
            grads.append([p.grad for p in model.parameters()])
            caches.append(cache)
        plan = hf.patched(fast).cores[0].last_plan
        assert (plan.kernel, plan.grouped) == ("offset-bias", False)
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-5)
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)
        with torch.no_grad():  # one decoding step from the prefill's cache: the grouped keys kept as they are
            step = [
                m(input_ids=ids[:, :1], past_key_values=c, use_cache=True).logits for m, c in zip((fast, ref), caches)
            ]
        assert hf.patched(fast).cores[0].last_plan.grouped
        torch.testing.assert_close(step[0], step[1], rtol=1e-4, atol=1e-5)
