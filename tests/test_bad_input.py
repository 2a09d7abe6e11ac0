"""Issue 15, "nothing lost, nothing silent": every bad input to a public entry point is a :class:`posenc.PosencError`
that names the value and what would be right, and every valid edge case gives the right answer.

``CASES`` is the list of bad inputs (API and CLI), each a small lambda, the error type and a regex on the message
(the value and the fix). Generated cases cover every registered encoding: NaN / infinite float settings, sizes of 0,
and empty input (refused, the same way for every encoding; see :class:`posenc.PositionalEncoding`). The tests after
it check the valid edge cases: fully-masked rows, ALiBi with a number of heads that is not a power of two, Shaw with
clip k = 0, and that no encoding (``normalized``, which divides by the length, included) changes a sequence's outputs
when it is padded beside a longer one.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch

import posenc
from posenc import ConfigError, KVCache, PosencError, PositionError, UnknownNameError
from posenc.base import _annotation_kinds
from posenc.cli import main as cli_main
from posenc.registry import accepted_arguments, example, example_options, resolve

D, H, V = 16, 2, 20
DIMS = dict(d_model=D, n_heads=H, head_dim=D // H, max_len=32, vocab_size=V, n_layers=2)
NAMES = posenc.available()
PLAIN = [n for n in NAMES if not n.startswith("randomized-")]


def mha(enc=None, **kw):
    return posenc.MultiHeadAttention(D, H, enc, **kw)


def x(b=2, n=5, dtype=torch.float32):
    return torch.randn(b, n, D, dtype=dtype)


def toks(b=2, n=5):
    return torch.randint(0, V, (b, n))


def lm(encoding="rope", **kw):
    torch.manual_seed(0)
    kw = {**dict(d_model=D, n_heads=H, n_layers=2, max_len=32, encoding=encoding), **kw}
    return posenc.LanguageModel(V, **kw).eval()


def filled(model, b=1, n=3):
    """A KV cache filled by ``model`` with ``b`` sequences of ``n`` tokens."""
    cache = KVCache()
    with torch.no_grad():
        model(toks(b, n), kv_cache=cache)
    return cache


def mha_filled(attn, b=1, n=3):
    cache = KVCache()
    with torch.no_grad():
        attn(x(b, n), kv_cache=cache)
    return cache


def half_filled():
    model = lm()
    cache = filled(model)
    del cache.layers[1]  # as a forward that failed after its first layer leaves it
    return model(toks(1, 1), kv_cache=cache)


def cli(*argv):
    return lambda: cli_main(list(argv))


def _offset_bias(vals_len=None, lk=5, vlk=None, causal=False, q3=False):
    from posenc.offset_bias import offset_bias_attention

    q = torch.randn(1, 2, 5, 4)
    k = torch.randn(1, 2, lk, 4)
    v = torch.randn(1, 2, vlk or lk, 4)
    vals = torch.randn(2, vals_len or 5 + lk - 1)
    return offset_bias_attention(q[0] if q3 else q, k, v, vals, 0.5, causal=causal)


def _block_bias():
    from posenc.block_bias import block_bias_attention

    q, k = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    return block_bias_attention(
        q, k, torch.randn(1, 2, 4, 4), lambda p, r0, r1, ke: torch.zeros(1, r1 - r0, ke), [], 1.0
    )


C = ConfigError
P = PositionError
FIN = r"must be finite \(not NaN or infinity\), got {}"

# (id, call, error type, regex on the message)
CASES: list[tuple[str, object, type[Exception], str]] = [
    # ---------------------------------------------------------------- posenc.get and the constructors
    ("get-unknown", lambda: posenc.get("ropee", head_dim=8), UnknownNameError, r"unknown encoding 'ropee'.*rope"),
    ("get-not-str", lambda: posenc.get(3), C, r"name must be a string, got int"),
    ("get-unknown-option", lambda: posenc.get("rope", head_dim=8, bass=1), C, r"does not take 'bass'.*base"),
    ("get-missing", lambda: posenc.get("rope"), C, r"needs 'head_dim'"),
    ("rope-odd-head-dim", lambda: posenc.get("rope", head_dim=7), C, r"head_dim.*7"),
    ("rope-base-str", lambda: posenc.get("rope", head_dim=8, base="big"), C, r"base must be a number, got 'big'"),
    ("rope-base-1", lambda: posenc.get("rope", head_dim=8, base=1.0), C, r"base must be > 1.*got 1\.0"),
    ("rope-base-neg", lambda: posenc.get("rope", head_dim=8, base=-1), C, r"base must be > 1.*got -1"),
    ("sin-base-0", lambda: posenc.get("sinusoidal", d_model=8, base=0), C, r"base must be > 1.*got 0"),
    ("sin-only-base-half", lambda: posenc.get("sin-only", d_model=8, base=0.5), C, r"base must be > 1.*got 0\.5"),
    ("t5-bidirectional-int", lambda: posenc.get("t5", n_heads=2, bidirectional=1), C, r"True or False, got 1"),
    ("alibi-bidirectional-str", lambda: posenc.get("alibi", n_heads=2, bidirectional="no"), C, r"True or False"),
    ("learned-max-len-float", lambda: posenc.get("learned", d_model=8, max_len=1e9), C, r"max_len must be an integ"),
    ("learned-max-len-0", lambda: posenc.get("learned", d_model=8, max_len=0), C, r"max_len must be .*>= 1, got 0"),
    ("learned-init-std-neg", lambda: posenc.get("learned", d_model=8, init_std=-1.0), C, r"init_std must be >= 0"),
    ("alibi-heads-0", lambda: posenc.get("alibi", n_heads=0), C, r"n_heads must be .*>= 1, got 0"),
    ("alibi-heads-float", lambda: posenc.get("alibi", n_heads=2.0), C, r"n_heads must be an integer, got 2\.0"),
    ("shaw-k-neg", lambda: posenc.get("shaw", head_dim=8, max_relative_position=-1), C, r"max_relative_position.*-1"),
    ("xpos-gamma-neg", lambda: posenc.get("xpos", head_dim=8, gamma=-0.1), C, r"gamma must be >= 0, got -0\.1"),
    ("xpos-scale-base-0", lambda: posenc.get("xpos", head_dim=8, scale_base=0), C, r"scale_base must be > 0"),
    ("deberta-eps-0", lambda: posenc.get("deberta", d_model=8, n_heads=2, layer_norm_eps=0.0), C, r"eps must be > 0"),
    ("deberta-dropout-1", lambda: posenc.get("deberta", d_model=8, n_heads=2, dropout=1.0), C, r"in \[0, 1\)"),
    (
        "longrope-nan-list",
        lambda: posenc.get(
            "rope-longrope",
            head_dim=8,
            short_factor=[1.0, math.nan, 1, 1],
            long_factor=[1.0] * 4,
            factor=2.0,
            original_max_len=8,
        ),
        C,
        r"short_factor must be finite",
    ),
    ("yarn-beta-inf", lambda: example("rope-yarn", beta_fast=math.inf), C, FIN.format("inf")),
    ("fire-init-c-inf", lambda: example("fire", init_c=math.inf), C, FIN.format("inf")),
    ("kerple-r1-inf", lambda: example("kerple-log", r1=math.inf), C, FIN.format("inf")),
    ("integer-start-nan", lambda: example("integer", start=math.nan), C, r"start must be an integer, got nan"),
    ("normalized-length-0", lambda: example("normalized", length=0), C, r"length must be .*>= 1, got 0"),
    ("t5-buckets-0", lambda: example("t5", num_buckets=0), C, r"num_buckets must be .*>= 1, got 0"),
    ("cope-npos-0", lambda: example("cope", npos_max=0), C, r"npos_max must be .*>= 1, got 0"),
    ("xlnet-segment-float", lambda: example("xlnet", memory_segment=0.5), C, r"memory_segment must be an integer"),
    ("rope-output-str-type", lambda: example("complex-order", output=3), C, r"output must be a string, got 3"),
    ("randomized-inner-nan", lambda: example("randomized-rope", inner_options={"base": math.nan}), C, r"base.*nan"),
    # MultiHeadAttention
    ("mha-d-model-0", lambda: posenc.MultiHeadAttention(0, 2), C, r"d_model must be an integer >= 1, got 0"),
    ("mha-d-model-float", lambda: posenc.MultiHeadAttention(16.0, 2), C, r"d_model must be an integer >= 1, got 16\.0"),
    ("mha-heads-indivisible", lambda: posenc.MultiHeadAttention(16, 3), C, r"d_model=16 is not divisible by n_heads=3"),
    ("mha-dropout-1", lambda: mha(dropout=1.0), C, r"dropout must be a number in \[0, 1\), got 1\.0"),
    ("mha-dropout-nan", lambda: mha(dropout=math.nan), C, r"dropout must be a number in \[0, 1\), got nan"),
    ("mha-path", lambda: mha(path="slow"), C, r"path must be one of .*'slow'"),
    ("mha-encoding-str", lambda: mha("rope"), C, r"encoding must be a posenc.PositionalEncoding.*str"),
    ("mha-layer-neg", lambda: mha(layer=-1), C, r"layer must be an integer >= 0, got -1"),
    ("mha-rope-size", lambda: mha(posenc.get("rope", head_dim=4)), C, r"built for head_dim=4.*head_dim=8"),
    ("mha-alibi-heads", lambda: mha(posenc.get("alibi", n_heads=4)), C, r"n_heads=4.*n_heads=2"),
    # ---------------------------------------------------------------- MultiHeadAttention calls
    ("mha-x-2d", lambda: mha()(torch.randn(5, D)), C, r"x must be \[batch, length, 16\].*\(5, 16\)"),
    ("mha-x-width", lambda: mha()(torch.randn(2, 5, D + 1)), C, r"x must be \[batch, length, 16\].*17"),
    ("mha-x-float64", lambda: mha()(x(dtype=torch.float64)), C, r"x has dtype torch.float64 .*torch.float32.*\.to\("),
    ("mha-x-bf16", lambda: mha()(x(dtype=torch.bfloat16)), C, r"x has dtype torch.bfloat16"),
    ("mha-x-int", lambda: mha()(torch.ones(2, 5, D, dtype=torch.long)), C, r"x has dtype torch.int64"),
    ("mha-x-list", lambda: mha()([[0.0] * D]), C, r"x must be a tensor .*got list"),
    ("mha-x-empty-length", lambda: mha()(x(2, 0)), C, r"x has no tokens \(shape \(2, 0, 16\)\).*empty input"),
    ("mha-x-empty-batch", lambda: mha()(x(0, 4)), C, r"x has no tokens \(shape \(0, 4, 16\)\)"),
    ("mha-kv-batch", lambda: mha()(x(2, 5), key_value=x(3, 4)), C, r"key_value must be \[batch=2, length, 16\]"),
    ("mha-kv-dtype", lambda: mha()(x(), key_value=x(dtype=torch.float64)), C, r"key_value has dtype torch.float64"),
    ("mha-kv-empty", lambda: mha()(x(), key_value=x(2, 0)), C, r"key_value has no tokens"),
    ("mha-memory-width", lambda: mha()(x(), memory=torch.randn(2, 3, D + 1)), C, r"memory must be \[batch=2"),
    ("mha-memory-2d", lambda: mha()(x(), memory=torch.randn(3, D)), C, r"memory must be \[batch=2, M, d_model=16\]"),
    ("mha-memory-dtype", lambda: mha()(x(), memory=x(2, 3, torch.float64)), C, r"memory has dtype torch.float64"),
    ("mha-mask-float", lambda: mha()(x(), mask=torch.ones(5, 5)), C, r"mask must be a boolean tensor.*float32"),
    ("mha-mask-shape", lambda: mha()(x(), mask=torch.ones(3, 3, dtype=torch.bool)), C, r"broadcastable .*\(3, 3\)"),
    (
        "mha-mask-heads",
        lambda: mha()(x(), mask=torch.ones(1, 3, 5, 5, dtype=torch.bool)),
        C,
        r"mask has 3 heads but this attention has n_heads=2",
    ),
    ("mha-mask-5d", lambda: mha()(x(), mask=torch.ones(1, 1, 1, 5, 5, dtype=torch.bool)), C, r"broadcastable"),
    ("mha-mask-list", lambda: mha()(x(), mask=[[True]]), C, r"mask must be a boolean tensor.*list"),
    (
        "mha-am-shape",
        lambda: mha()(x(), attention_mask=torch.ones(2, 4)),
        C,
        r"attention_mask must have shape .*\[2, 5\]",
    ),
    ("mha-am-additive", lambda: mha()(x(), attention_mask=torch.zeros(2, 5) - math.inf), C, r"additive.*-inf"),
    ("mha-am-half", lambda: mha()(x(), attention_mask=torch.full((2, 5), 0.5)), C, r"1/True for real.*0\.5"),
    ("mha-am-list", lambda: mha()(x(), attention_mask=[[1] * 5] * 2), C, r"attention_mask must be a tensor.*list"),
    (
        "mha-docs-float",
        lambda: mha()(x(), document_ids=torch.zeros(2, 5)),
        C,
        r"document_ids must be an integer .*float",
    ),
    (
        "mha-docs-shape",
        lambda: mha()(x(), document_ids=torch.zeros(2, 4, dtype=torch.long)),
        C,
        r"document_ids .*\[2, 5\]",
    ),
    (
        "mha-pos-nan",
        lambda: mha()(x(), positions=torch.tensor([0.0, 1, math.nan, 3, 4])),
        P,
        r"finite numbers, got nan",
    ),
    (
        "mha-pos-inf",
        lambda: mha()(x(), positions=torch.tensor([0.0, 1, 2, 3, math.inf])),
        P,
        r"finite numbers, got inf",
    ),
    (
        "mha-pos-neg",
        lambda: mha()(x(), positions=torch.tensor([-1, 0, 1, 2, 3])),
        P,
        r"must be >= 0, got a position of -1",
    ),
    ("mha-pos-neg-frac", lambda: mha()(x(), positions=torch.tensor([-0.5, 0, 1, 2, 3])), P, r">= 0, got .*-0\.5"),
    ("mha-pos-bool", lambda: mha()(x(), positions=torch.ones(5, dtype=torch.bool)), P, r"integers .*torch.bool"),
    ("mha-pos-length", lambda: mha()(x(), positions=torch.arange(4)), P, r"positions describe 4 tokens .*has 5"),
    (
        "mha-pos-batch",
        lambda: mha()(x(), positions=torch.arange(5).expand(3, 5)),
        P,
        r"positions have batch size 3 \(shape \(3, 5\)\) but x has batch size 2.*\[2, L\]",
    ),
    (
        "mha-keypos-batch",
        lambda: mha()(x(), key_value=x(2, 3), key_positions=torch.arange(3).expand(3, 3)),
        P,
        r"key_positions have batch size 3 .*x has batch size 2",
    ),
    ("mha-pos-3d", lambda: mha()(x(), positions=torch.zeros(1, 1, 5, dtype=torch.long)), P, r"\[L\] or \[B, L\]"),
    ("mha-keypos-length", lambda: mha()(x(), key_value=x(2, 3), key_positions=torch.arange(4)), P, r"describe 4 .* 3"),
    (
        "mha-memory-explicit-pos",
        lambda: mha()(x(), memory=x(2, 3), positions=torch.arange(5)),
        P,
        r"pass key_positions for all 8 keys",
    ),
    ("mha-cache-type", lambda: mha()(x(), kv_cache={}), C, r"kv_cache must be a posenc.KVCache, got dict"),
    (
        "mha-cache-batch",
        lambda: (lambda a: a(x(2, 1), kv_cache=mha_filled(a, b=1)))(mha()),
        C,
        r"KVCache holds keys of batch=1.*batch=2.*new posenc.KVCache",
    ),
    (
        "mha-cache-overlap",
        lambda: (lambda a: a(x(1, 1), kv_cache=mha_filled(a), positions=torch.tensor([2])))(mha()),
        P,
        r"positions \(from 2\) overlap the 3 the KVCache holds \(up to 2\)",
    ),
    ("mha-cache-other", lambda: mha()(x(1, 1), kv_cache=mha_filled(mha())), C, r"filled by another attention module"),
    (
        "mha-cache-dtype",
        lambda: (lambda a, c: a.double()(x(1, 1, torch.float64), kv_cache=c))(*(lambda a: (a, mha_filled(a)))(mha())),
        C,
        r"KVCache holds torch.float32 keys .*torch.float64",
    ),
    (
        "mha-learned-beyond",
        lambda: mha(posenc.get("relative-key", head_dim=8, max_len=4))(x(1, 6)),
        P,
        r"4|max_len",
    ),
    # ---------------------------------------------------------------- models: constructors
    ("model-vocab-0", lambda: posenc.Transformer(0), C, r"vocab_size must be an integer >= 1, got 0"),
    ("model-layers-0", lambda: posenc.Transformer(V, n_layers=0), C, r"n_layers must be an integer >= 1, got 0"),
    ("model-d-model-str", lambda: posenc.Transformer(V, d_model="16"), C, r"d_model must be an integer >= 1, got '16'"),
    (
        "model-heads",
        lambda: posenc.Transformer(V, d_model=16, n_heads=3),
        C,
        r"d_model=16 must be divisible by n_heads=3",
    ),
    ("model-dropout", lambda: posenc.Transformer(V, dropout=2), C, r"dropout must be a number in \[0, 1\), got 2"),
    ("model-norm", lambda: posenc.Transformer(V, norm="mid"), C, r"norm must be one of .*'mid'"),
    ("model-causal-str", lambda: posenc.Transformer(V, causal="yes"), C, r"causal must be True or False, got 'yes'"),
    ("model-max-len-0", lambda: posenc.Transformer(V, max_len=0), C, r"max_len must be an integer >= 1, got 0"),
    ("model-d-ff-0", lambda: posenc.Transformer(V, d_ff=0), C, r"d_ff must be an integer >= 1, got 0"),
    ("model-emb-0", lambda: posenc.Transformer(V, embedding_size=0), C, r"embedding_size must be an integer >= 1"),
    ("model-encoding-unknown", lambda: posenc.Transformer(V, encoding="alibbi"), UnknownNameError, r"alibi"),
    (
        "model-instance-options",
        lambda: posenc.Transformer(
            V, d_model=D, n_heads=H, encoding=posenc.get("alibi", n_heads=H), encoding_options={"bidirectional": True}
        ),
        C,
        r"options only with an encoding name",
    ),
    ("model-options-nan", lambda: lm(encoding_options={"base": math.nan}), C, r"'rope': base must be finite.*nan"),
    ("model-options-unknown", lambda: lm(encoding_options={"bass": 1}), C, r"does not take 'bass'"),
    ("model-encoding-size", lambda: lm(encoding=posenc.get("rope", head_dim=4)), C, r"head_dim=4 .*head_dim=8"),
    ("clf-pooling", lambda: posenc.SequenceClassifier(V, 2, pooling="sum"), C, r"pooling must be one of .*'sum'"),
    ("clf-classes-0", lambda: posenc.SequenceClassifier(V, 0), C, r"n_classes must be an integer >= 1, got 0"),
    ("tagger-tags-0", lambda: posenc.TokenTagger(V, 0), C, r"n_tags must be an integer >= 1, got 0"),
    ("encoder-causal", lambda: posenc.Encoder(V, causal=True), C, r"takes no causal=.*posenc.Decoder"),
    ("decoder-causal", lambda: posenc.Decoder(V, causal=False), C, r"takes no causal=.*posenc.Encoder"),
    # ---------------------------------------------------------------- models: calls
    ("tokens-oob", lambda: lm()(torch.tensor([[1, 2, V]])), C, r"token id 20 is out of range.*\[0, vocab_size=20\)"),
    ("tokens-neg", lambda: lm()(torch.tensor([[1, -1]])), C, r"token id -1 is out of range"),
    ("tokens-float", lambda: lm()(torch.tensor([[1.0, 2.0]])), C, r"integer token ids .*float32.*tokens.long\(\)"),
    ("tokens-bool", lambda: lm()(torch.ones(1, 3, dtype=torch.bool)), C, r"integer token ids .*torch.bool"),
    ("tokens-1d", lambda: lm()(torch.tensor([1, 2, 3])), C, r"tokens must be \[batch, length\].*\(3,\).*tokens\[None"),
    ("tokens-3d", lambda: lm()(torch.ones(1, 2, 3, dtype=torch.long)), C, r"tokens must be \[batch, length\]"),
    ("tokens-list", lambda: lm()([[1, 2]]), C, r"tokens must be a tensor .*got list"),
    ("tokens-empty", lambda: lm()(torch.zeros(2, 0, dtype=torch.long)), C, r"no tokens \(shape \(2, 0\)\)"),
    ("tokens-empty-batch", lambda: lm()(torch.zeros(0, 3, dtype=torch.long)), C, r"no tokens \(shape \(0, 3\)\)"),
    (
        "clf-empty",
        lambda: posenc.SequenceClassifier(V, 3, d_model=D, n_heads=H, n_layers=1)(torch.zeros(1, 0, dtype=torch.long)),
        C,
        r"no tokens",
    ),
    ("tagger-oob", lambda: posenc.TokenTagger(V, 3, d_model=D, n_heads=H)(torch.tensor([[V + 5]])), C, r"token id 25"),
    (
        "model-pos-nan",
        lambda: lm()(toks(1, 2), positions=torch.tensor([0.0, math.nan])),
        P,
        r"positions must be finite",
    ),
    ("model-pos-neg", lambda: lm("sinusoidal")(toks(1, 2), positions=torch.tensor([-3, 0])), P, r">= 0, got .*-3"),
    ("model-pos-length", lambda: lm()(toks(1, 3), positions=torch.arange(2)), P, r"describe 2 tokens .*has 3"),
    (
        "model-pos-batch",
        lambda: lm()(toks(2, 3), positions=torch.arange(3).expand(3, 3)),
        P,
        r"batch size 1 or 2, got shape \(3, 3\)",
    ),
    ("model-pos-list", lambda: lm()(toks(1, 3), positions=[0, 1, 2]), P, r"positions must be a tensor"),
    ("model-learned-beyond", lambda: lm("learned")(toks(1, 2), positions=torch.tensor([0, 40])), P, r"max_len=32"),
    ("model-am-shape", lambda: lm()(toks(2, 3), attention_mask=torch.ones(2, 2)), C, r"attention_mask must have shape"),
    ("model-am-additive", lambda: lm()(toks(1, 2), attention_mask=torch.tensor([[0.0, -1e9]])), C, r"additive"),
    (
        "model-memory-count",
        lambda: lm()(toks(1, 2), memory=[torch.randn(1, 3, D)]),
        C,
        r"one tensor per layer \(2\), got 1",
    ),
    ("model-memory-width", lambda: lm()(toks(1, 2), memory=[torch.randn(1, 3, 8)] * 2), C, r"memory\[0\] has shape"),
    (
        "model-memory-lengths",
        lambda: lm()(toks(1, 2), memory=[torch.randn(1, 3, D), torch.randn(1, 4, D)]),
        C,
        r"of one length M",
    ),
    ("model-memory-tensor", lambda: lm()(toks(1, 2), memory=torch.randn(2, 1, 3, D)), C, r"memory must be a list"),
    ("model-memory-batch", lambda: lm()(toks(1, 2), memory=[torch.randn(2, 3, D)] * 2), C, r"memory\[0\].*batch=1"),
    ("model-mempos-alone", lambda: lm()(toks(1, 2), memory_positions=torch.arange(2)), C, r"without memory"),
    (
        "model-mempos-nan",
        lambda: lm()(toks(1, 2), memory=[torch.randn(1, 2, D)] * 2, memory_positions=torch.tensor([math.nan, 1])),
        P,
        r"memory_positions must be finite",
    ),
    ("model-cache-type", lambda: lm()(toks(1, 1), kv_cache=[]), C, r"kv_cache must be a posenc.KVCache, got list"),
    (
        "model-cache-batch",
        lambda: (lambda m: m(toks(2, 1), kv_cache=filled(m, b=1)))(lm()),
        C,
        r"KVCache holds keys of batch=1,.*batch=2",
    ),
    (
        "model-cache-fewer",
        lambda: lm(n_layers=3)(toks(1, 1), kv_cache=filled(lm())),
        C,
        r"only layers \[0, 1\] of .* 3",
    ),
    (
        "model-cache-more",
        lambda: lm()(toks(1, 1), kv_cache=filled(lm(n_layers=3))),
        C,
        r"layers \[0, 1, 2\] .*2 layers",
    ),
    ("model-cache-same-size", lambda: lm()(toks(1, 1), kv_cache=filled(lm())), C, r"filled by another attention"),
    (
        "model-cache-width",
        lambda: lm(d_model=32)(toks(1, 1), kv_cache=filled(lm())),
        C,
        r"filled by another attention module \(d_model=16, n_heads=2, head_dim=8\) and is read by one of "
        r"d_model=32, n_heads=2, head_dim=16",
    ),
    (
        "mha-cache-width",
        lambda: posenc.MultiHeadAttention(32, 4)(x(1, 1).repeat(1, 1, 2), kv_cache=mha_filled(mha())),
        C,
        r"\(d_model=16, n_heads=2, head_dim=8\).* d_model=32, n_heads=4, head_dim=8",
    ),
    (
        "offset-bias-vals-length",
        lambda: _offset_bias(vals_len=7),
        C,
        r"vals must be \[2\|1, Lq \+ Lk - 1 = 9\] .*Lq=5 queries and Lk=5 keys, got \(2, 7\)",
    ),
    ("offset-bias-causal-keys", lambda: _offset_bias(lk=3, causal=True), C, r"Lk=3 < Lq=5"),
    ("offset-bias-3d", lambda: _offset_bias(q3=True), C, r"q must be a tensor \[batch, heads, length, head_dim\]"),
    ("offset-bias-mismatch", lambda: _offset_bias(lk=4, vlk=5), C, r"do not match; k and v must be \[1, 2, Lk, 4\]"),
    ("block-bias-mismatch", lambda: _block_bias(), C, r"block_bias_attention: .*do not match"),
    ("rope-all-odd-head-dim", lambda: posenc.get("rope", head_dim=15), C, r"even, got 15.*rotary_dim=14"),
    ("rope-rotary-odd", lambda: posenc.get("rope", head_dim=15, rotary_dim=13), C, r"in 2\.\.14 .*got 13"),
    ("rope-rotary-wide", lambda: posenc.get("rope", head_dim=15, rotary_dim=16), C, r"in 2\.\.14 .*got 16"),
    (
        "rope-forward-nan",
        lambda: posenc.get("rope", head_dim=8)(x(1, 3, torch.float32)[..., :8], torch.tensor([0.0, math.nan, 2.0])),
        P,
        r"finite numbers, got nan",
    ),
    (
        "rope-forward-inf",
        lambda: posenc.get("rope-interleaved", head_dim=8)(torch.randn(1, 2, 3, 8), torch.tensor([0, math.inf, 2])),
        P,
        r"finite numbers, got inf",
    ),
    (
        "xpos-forward-nan",
        lambda: posenc.get("xpos", head_dim=8)(torch.randn(1, 3, 8), torch.tensor([0.0, 1.0, math.nan])),
        P,
        r"finite numbers, got nan",
    ),
    ("model-cache-half", half_filled, C, r"holds only layers \[0\] of this model's 2: a forward failed part way"),
    (
        "model-cache-overlap",
        lambda: (lambda m: m(toks(1, 1), kv_cache=filled(m), positions=torch.tensor([1])))(lm()),
        P,
        r"overlap the 3 the KVCache holds",
    ),
    # generate
    ("gen-float", lambda: lm().generate(torch.tensor([[1.0]]), 2), C, r"integer token ids .*float32"),
    ("gen-oob", lambda: lm().generate(torch.tensor([[V]]), 2), C, r"\[0, vocab_size=20\).*20"),
    ("gen-empty", lambda: lm().generate(torch.zeros(1, 0, dtype=torch.long), 2), C, r"at least one token"),
    ("gen-new-neg", lambda: lm().generate(toks(1, 2), -1), C, r"max_new_tokens must be an integer >= 0, got -1"),
    ("gen-temp-nan", lambda: lm().generate(toks(1, 2), 2, temperature=math.nan), C, r"temperature .*got nan"),
    ("gen-top-k-0", lambda: lm().generate(toks(1, 2), 2, top_k=0), C, r"top_k must be an integer >= 1"),
    ("gen-eos", lambda: lm().generate(toks(1, 2), 2, eos_token_id=V), C, r"eos_token_id must be a token id"),
    ("gen-too-long", lambda: lm("learned").generate(toks(1, 2), 40), C, r"max_new_tokens <= 31"),
    # ---------------------------------------------------------------- the command line
    ("cli-workers-0", cli("bench", "--workers", "0"), C, r"--workers must be an integer >= 1, got 0"),
    ("cli-workers-neg", cli("bench", "--workers", "-2"), C, r"--workers must be an integer >= 1, got -2"),
    ("cli-steps-0", cli("bench", "--steps", "0"), C, r"--steps must be an integer >= 1, got 0"),
    ("cli-train-max-0", cli("bench", "--train-max", "0"), C, r"--train-max must be an integer >= 1, got 0"),
    ("cli-test-lengths-0", cli("bench", "--test-lengths", "8", "0"), C, r"--test-lengths must be integers >= 1, got 0"),
    ("cli-seeds-neg", cli("bench", "--seeds", "0", "-1"), C, r"--seeds must be integers >= 0, got -1"),
    ("cli-ddp-neg", cli("bench", "--ddp", "-1"), C, r"--ddp must be an integer >= 0, got -1"),
    (
        "cli-option-no-eq",
        cli("bench", "--encoding-option", "base"),
        C,
        r"--encoding-option takes KEY=VALUE, got 'base'",
    ),
    ("cli-inspect-base-neg", cli("inspect", "rope", "--option", "base=-1", "--no-plots"), C, r"base must be > 1.*-1"),
    ("cli-inspect-base-nan", cli("inspect", "rope", "--option", "base=nan", "--no-plots"), C, r"base must be a number"),
    ("cli-inspect-unknown-opt", cli("inspect", "rope", "--option", "bass=2", "--no-plots"), C, r"does not take 'bass'"),
    ("cli-inspect-no-eq", cli("inspect", "rope", "--option", "base", "--no-plots"), C, r"KEY=VALUE, got 'base'"),
    ("cli-inspect-dim-0", cli("inspect", "rope", "--dim", "0", "--no-plots"), C, r"dim must be an integer >= 2, got 0"),
    ("cli-inspect-heads-0", cli("inspect", "rope", "--heads", "0", "--no-plots"), C, r"heads must be .*>= 1, got 0"),
    ("cli-inspect-length", cli("inspect", "rope", "--length", "-5", "--no-plots"), C, r"length must be .*got -5"),
    ("cli-inspect-unknown", cli("inspect", "ropee", "--no-plots"), C, r"unknown encoding 'ropee'"),
    ("cli-inspect-all-and-name", cli("inspect", "rope", "--all"), C, r"either an encoding NAME or --all"),
    ("cli-inspect-all-option", cli("inspect", "--all", "--option", "base=2"), C, r"cannot be used with --all"),
]


def _float_settings(name):
    """(setting, value) of ``name``'s example whose ``__init__`` annotation is a float."""
    cls = resolve(name)
    args = accepted_arguments(cls)
    params = example(name, DIMS).params
    return [
        k
        for k, p in args.items()
        if p.annotation is not inspect.Parameter.empty
        and _annotation_kinds(p.annotation) - {"None"} == {"float"}
        and k not in ("embedding_std",)
        and isinstance(params.get(k), (int, float, type(None)))
    ]


def _generated():
    out = []
    for n in PLAIN:
        for k in _float_settings(n):
            for bad in (math.nan, math.inf):
                out.append(
                    (f"{n}-{k}-{bad}", lambda n=n, k=k, bad=bad: example(n, DIMS, **{k: bad}), C, FIN.format(bad))
                )
        for k in ("d_model", "n_heads", "head_dim"):
            if k in accepted_arguments(resolve(n)):
                kw = {**example(n, DIMS).params, k: 0}
                out.append((f"{n}-{k}-0", lambda n=n, kw=kw: posenc.get(n, **kw), C, rf"{k} must be .*>= 1, got 0"))
    for n in NAMES:  # empty input: refused the same way by every encoding, in a model and in an attention
        opts = example_options(n, DIMS) or None
        model = lambda n=n, opts=opts: posenc.Transformer(  # noqa: E731
            V, d_model=D, n_heads=H, n_layers=1, max_len=32, encoding=n, encoding_options=opts
        )
        out.append((f"empty-model-{n}", lambda m=model: m()(torch.zeros(2, 0, dtype=torch.long)), C, r"no tokens"))
        attn = lambda n=n: mha(example(n, DIMS))  # noqa: E731
        out.append((f"empty-attention-{n}", lambda a=attn: a()(x(1, 0)), C, r"x has no tokens .*empty input"))
    return out


ALL = CASES + _generated()


def test_there_are_at_least_150_cases():
    assert len(ALL) >= 150
    assert len({c[0] for c in ALL}) == len(ALL), "case ids must be unique"


@pytest.mark.parametrize("name,call,error,pattern", ALL, ids=[c[0] for c in ALL])
def test_bad_input_is_a_clear_error(name, call, error, pattern, capsys):
    """Each bad input raises ``error`` (a PosencError) whose message matches ``pattern``; the command line exits
    with status 2 and one line on stderr, no traceback."""
    assert issubclass(error, PosencError)
    torch.manual_seed(0)
    if name.startswith("cli-"):
        status = call()
        err = capsys.readouterr().err.strip()
        assert status == 2, err
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err
        assert err.startswith("posenc"), err
        import re

        assert re.search(pattern, err), (pattern, err)
        return
    with pytest.raises(error, match=pattern):
        call()


# ------------------------------------------------------------------ valid edge cases give the right answer
def test_fully_masked_rows_are_zero_and_finite_for_every_encoding():
    """A query that may see no key (all its keys masked) gets a zero output on every kernel, never NaN."""
    torch.manual_seed(0)
    for n in NAMES:
        enc = example(n, DIMS)
        mask = torch.ones(2, 1, 4, 4, dtype=torch.bool)
        mask[0, :, 1] = False  # query 1 of sequence 0 sees nothing
        outs = {}
        for path in ("auto", "reference"):
            torch.manual_seed(1)
            a = posenc.MultiHeadAttention(D, H, enc, path=path, bias=False).eval()
            with torch.no_grad():
                outs[path] = a(x(2, 4), mask=mask)
        assert torch.isfinite(outs["auto"]).all(), n
        torch.testing.assert_close(outs["auto"], outs["reference"], atol=1e-5, rtol=1e-4, msg=n)
        assert outs["auto"][0, 1].abs().max() == 0, n


def _alibi_slopes(n):
    """The slopes of the ALiBi authors' code (ofirpress/attention_with_linear_biases, get_slopes)."""

    def power_of_2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(n).is_integer():
        return power_of_2(n)
    closest = 2 ** math.floor(math.log2(n))
    return power_of_2(closest) + _alibi_slopes(2 * closest)[0::2][: n - closest]


@pytest.mark.parametrize("heads", [1, 3, 5, 6, 7, 12])
def test_alibi_heads_that_are_not_a_power_of_two(heads):
    enc = posenc.get("alibi", n_heads=heads)
    lq = 5
    pos = torch.arange(lq)[None]
    ctx = posenc.AttentionContext(q_pos=pos, k_pos=pos, n_heads=heads, head_dim=4)
    bias = enc.bias(ctx).reshape(-1, heads, lq, lq)[0]
    slopes = torch.tensor(_alibi_slopes(heads))
    rel = (pos[0][None, :] - pos[0][:, None]).float()
    want = slopes[:, None, None] * rel.clamp(max=0)[None]
    torch.testing.assert_close(
        bias[:, torch.tril(torch.ones(lq, lq, dtype=torch.bool))],
        want[:, torch.tril(torch.ones(lq, lq, dtype=torch.bool))],
    )
    a = posenc.MultiHeadAttention(4 * heads, heads, enc)
    assert torch.isfinite(a(torch.randn(2, lq, 4 * heads), causal=True)).all()


@pytest.mark.parametrize("name", ["shaw", "nezha"])
def test_clip_zero_is_one_shared_offset(name):
    """k = 0: every offset clips to 0, so one table row serves every pair; the fast and reference paths agree,
    and the output does not depend on the positions."""
    torch.manual_seed(0)
    enc = posenc.get(name, head_dim=D // H, max_relative_position=0)
    a = posenc.MultiHeadAttention(D, H, enc).eval()
    r = posenc.MultiHeadAttention(D, H, enc, path="reference").eval()
    r.load_state_dict(a.state_dict())
    inp = x(2, 6)
    with torch.no_grad():
        out = a(inp)
        torch.testing.assert_close(out, r(inp), atol=1e-5, rtol=1e-4)
        shuffled = a(inp, positions=torch.tensor([5, 0, 3, 1, 9, 2]))
    torch.testing.assert_close(out, shuffled, atol=1e-5, rtol=1e-4)


def _padded_difference(name, causal, side):
    """Max |difference| between a sequence alone and the same sequence padded beside a longer one."""
    torch.manual_seed(0)
    opts = example_options(name, DIMS) or None
    m = posenc.Transformer(
        V, d_model=D, n_heads=H, n_layers=2, max_len=32, causal=causal, encoding=name, encoding_options=opts
    ).eval()
    a, b = toks(1, 5), toks(1, 9)
    t = torch.zeros(2, 9, dtype=torch.long)
    am = torch.zeros(2, 9, dtype=torch.bool)
    t[1], am[1] = b[0], True
    with torch.no_grad():
        alone = m(a).hidden[0]
        if side == "right":
            t[0, :5], am[0, :5] = a[0], True
            return (m(t, attention_mask=am).hidden[0, :5] - alone).abs().max().item()
        t[0, 4:], am[0, 4:] = a[0], True
        pos = torch.stack([(torch.arange(9) - 4).clamp(min=0), torch.arange(9)])  # left padding: shifted positions
        return (m(t, attention_mask=am, positions=pos).hidden[0, 4:] - alone).abs().max().item()


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("causal", [False, True])
def test_padding_beside_a_longer_sequence_changes_nothing(side, causal):
    changed = [n for n in NAMES if _padded_difference(n, causal, side) > 1e-4]
    # normalized divides by N = the row's largest position + 1: the models hide the padding from it (issue 24)
    assert changed == [], changed


@pytest.mark.parametrize("kind", ["lm", "classifier"])
def test_normalized_logits_of_a_sequence_do_not_depend_on_its_padded_batch_mates(kind):
    """Issue 24: a sequence right-padded beside a longer one gave other logits (0.26) than alone, because N
    counted the padding. Its logits (every real position; the pooled class logits) are now those it gets alone."""
    torch.manual_seed(0)
    common = dict(d_model=D, n_heads=H, n_layers=2, max_len=32, encoding="normalized")
    if kind == "lm":
        model = posenc.LanguageModel(V, **common).eval()
    else:
        model = posenc.SequenceClassifier(V, 3, **common).eval()
    short, long = toks(1, 5), toks(1, 11)
    batch = torch.zeros(2, 11, dtype=torch.long)
    mask = torch.zeros(2, 11, dtype=torch.bool)
    batch[0, :5], mask[0, :5] = short[0], True
    batch[1], mask[1] = long[0], True
    with torch.no_grad():
        alone = model(short)[0]
        padded = model(batch, attention_mask=mask)[0]
        # the codes themselves: t / (N - 1) with N = 5, the short sequence's own length
        codes = model.trunk.encoding.codes(torch.arange(5))
    if kind == "lm":
        padded = padded[:5]
    torch.testing.assert_close(padded, alone, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(codes[:, 0], torch.arange(5.0) / 4)
    # and the long sequence is as it is alone too
    with torch.no_grad():
        torch.testing.assert_close(model(batch, attention_mask=mask)[1], model(long)[0], atol=1e-5, rtol=1e-4)


def test_rope_odd_head_dim_with_an_even_rotary_dim_is_the_partial_rotation():
    """head_dim=15, rotary_dim=14: the first 14 dimensions rotate (rotate-half over them, θ_i = base^(-2i/14)) and
    the 15th passes through, as HF's partial rotary (GPT-NeoX's rotary_pct) does; written out in float64."""
    enc = posenc.get("rope", head_dim=15, rotary_dim=14)
    q = torch.randn(2, 3, 6, 15, dtype=torch.float64)
    pos = torch.tensor([0, 1, 2, 5, 9, 40])
    got = enc(q, pos)
    theta = 10000.0 ** (-torch.arange(0, 14, 2, dtype=torch.float64) / 14)
    ang = pos[:, None].double() * theta  # [6, 7]
    c, s_ = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    rot = q[..., :14]
    half = torch.cat([-rot[..., 7:], rot[..., :7]], -1)
    want = torch.cat([rot * c + half * s_, q[..., 14:]], -1)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)  # the phases are float32 (HF's): m·θ to ~m·2^-24 rad
    attn = posenc.MultiHeadAttention(30, 2, enc)
    ref = posenc.MultiHeadAttention(30, 2, enc, path="reference")
    ref.load_state_dict(attn.state_dict())
    inp = torch.randn(2, 7, 30)
    torch.testing.assert_close(attn(inp, causal=True), ref(inp, causal=True), atol=1e-5, rtol=1e-4)


def test_normalized_padded_gives_the_unpadded_codes_with_padding_at_position_0():
    torch.manual_seed(0)
    m = posenc.Transformer(V, d_model=D, n_heads=H, n_layers=1, encoding="normalized").eval()
    a, b = toks(1, 5), toks(1, 9)
    t = torch.zeros(2, 9, dtype=torch.long)
    am = torch.zeros(2, 9, dtype=torch.long)
    t[0, :5], t[1], am[0, :5], am[1] = a[0], b[0], 1, 1
    with torch.no_grad():
        alone = m(a).hidden[0]
        padded = m(t, attention_mask=am, positions=torch.arange(9) * am).hidden[0, :5]
    torch.testing.assert_close(padded, alone, atol=1e-5, rtol=1e-4)
