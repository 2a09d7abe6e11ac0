"""torch.compile(fullgraph=True) works for the attention with every registered encoding.

``fullgraph=True`` fails on any graph break, so these tests prove that the whole attention forward (and, with
``aot_eager``, its backward graph) is captured by Dynamo for every encoding. Every registered encoding is
traced with the ``aot_eager`` backend (Dynamo + AOTAutograd, no C++ code generation: seconds, not minutes);
one representative per family (rotary, bias, relative with skewing, relative with values) is also compiled
with the default Inductor backend, forward and backward. Each compiled output must equal the eager output
(float32, rtol=atol=1e-5; Inductor: 1e-4, it may re-associate sums), and where the eager call takes a kernel that is
a custom op (``COMPILABLE_KERNELS``: offset-bias, biased-sdpa) the compiled call takes it too (tests/test_custom_ops.py
checks the ops themselves, and longer lengths under ``dynamic=True``).
"""

from __future__ import annotations

import pytest
import torch

import posenc  # noqa: F401
from posenc.attention import MultiHeadAttention
from posenc.attention.kernels import COMPILABLE_KERNELS
from posenc.registry import accepted_arguments, available, build, example_options, resolve

D_MODEL, N_HEADS, LENGTH = 16, 2, 7
DIMS = dict(d_model=D_MODEL, n_heads=N_HEADS, head_dim=D_MODEL // N_HEADS, max_len=32, n_layers=1, vocab_size=50)
# clip distances shorter than LENGTH and DeBERTa's log buckets on, for every encoding that takes them (by setting
# name: no list of encodings); settings no size supplies come from the encoding's example_options
SHORT = {"max_relative_position": 3, "position_buckets": 8, "max_len": 16}
INDUCTOR = ["rope", "alibi", "t5", "transformer-xl", "shaw"]


def _layer(name: str, causal: bool = False) -> MultiHeadAttention:
    torch.manual_seed(0)
    accepted = accepted_arguments(resolve(name))
    options = {**example_options(name, DIMS), **{k: v for k, v in SHORT.items() if k in accepted}}
    enc = build(name, dims=dict(DIMS, causal=causal), options=options)
    return MultiHeadAttention(D_MODEL, N_HEADS, enc, path="fast").eval()


def _inputs() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(2, LENGTH, D_MODEL)


def _attention_encodings() -> list[str]:
    # embed-only encodings do not enter the attention: one of them stands for all
    out = []
    for n in available():
        cls = posenc.registry.resolve(n)
        if cls.hooks() & {"rotate", "logits", "bias", "values"} or n in ("none", "sinusoidal"):
            out.append(n)
    return out


@pytest.mark.parametrize("name", _attention_encodings())
def test_fullgraph_aot_eager_forward_backward(name: str) -> None:
    torch._dynamo.reset()
    layer = _layer(name, causal=name == "cope")
    kw = {"causal": True} if name == "cope" else {}
    x = _inputs()

    def run(fn) -> tuple[torch.Tensor, torch.Tensor, dict]:
        layer.zero_grad(set_to_none=True)
        xx = x.clone().requires_grad_()
        out = fn(xx, **kw)
        out.square().sum().backward()
        return out.detach(), xx.grad, {n: p.grad for n, p in layer.named_parameters()}

    want, gx_want, gp_want = run(layer)
    eager_plan = layer.last_plan
    got, gx_got, gp_got = run(torch.compile(layer, fullgraph=True, backend="aot_eager"))
    if eager_plan is not None and eager_plan.kernel in COMPILABLE_KERNELS:  # a custom op: the compiled call keeps it
        assert layer.last_plan is not None and layer.last_plan.kernel == eager_plan.kernel, str(layer.last_plan)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx_got, gx_want, rtol=1e-4, atol=1e-5)
    for n, g in gp_want.items():
        if g is None:
            assert gp_got[n] is None, n
        else:
            torch.testing.assert_close(gp_got[n], g, rtol=1e-4, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("name", INDUCTOR)
def test_fullgraph_inductor(name: str) -> None:
    torch._dynamo.reset()
    layer = _layer(name)
    x = _inputs().requires_grad_()
    want = layer(x)
    (gx_want,) = torch.autograd.grad(want.sum(), x)
    compiled = torch.compile(layer, fullgraph=True)
    got = compiled(x)
    (gx_got,) = torch.autograd.grad(got.sum(), x)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gx_got, gx_want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["none", "rope", "alibi", "t5", "shaw"])
def test_a_compiled_language_model_takes_every_length_in_one_graph(name: str) -> None:
    """``torch.compile(model, fullgraph=True, dynamic=True)`` on the causal LanguageModel users train: the same
    numbers as eager at two lengths, and no second compile for the second (a comparison of symbolic lengths once
    reached SDPA's ``is_causal`` as a SymBool, which it refuses: a graph break, an error under fullgraph)."""
    torch.manual_seed(0)
    model = posenc.LanguageModel(vocab_size=50, d_model=D_MODEL, n_heads=N_HEADS, n_layers=1, encoding=name, max_len=64)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend="aot_eager")
    for i, n in enumerate((9, 13)):
        tokens = torch.randint(0, 50, (2, n), generator=torch.Generator().manual_seed(n))
        want = model(tokens)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            got = compiled(tokens)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_inductor_deberta_forward_backward_at_a_length_that_expands_its_table() -> None:
    """DeBERTa's 2k-row table (k = 256 here, 512 rows) is more than half as many rows as the offsets of L = 300
    (599), so the relative kernel expands it and sums its gradient back per row: that gradient is contiguous, where
    a clipped table's was a permuted view, and the custom op's fake kernel promised the view (Inductor's stride
    check failed in the backward: "expected size 512==512, stride 32==8"). Compiled and eager agree, parameters'
    gradients included."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    enc = build("deberta", dims=dict(d_model=32, n_heads=4, head_dim=8, max_len=512, n_layers=1, vocab_size=50))
    layer = MultiHeadAttention(32, 4, enc, path="fast").eval()
    x = torch.randn(2, 300, 32)

    def run(fn) -> tuple[torch.Tensor, torch.Tensor, dict]:
        layer.zero_grad(set_to_none=True)
        xx = x.clone().requires_grad_()
        out = fn(xx)
        out.square().sum().backward()
        return out.detach(), xx.grad, {n: p.grad for n, p in layer.named_parameters()}

    want, gx_want, gp_want = run(layer)
    got, gx_got, gp_got = run(torch.compile(layer, fullgraph=True))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gx_got, gx_want, rtol=1e-4, atol=1e-4)
    assert gp_want and all(g is not None for g in gp_want.values())
    for n, g in gp_want.items():
        torch.testing.assert_close(gp_got[n], g, rtol=1e-3, atol=1e-4, msg=lambda m, n=n: f"{n}: {m}")
