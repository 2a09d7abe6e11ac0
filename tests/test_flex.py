"""The ``flex`` kernel (flex_attention with a score_mod made from each encoding's fast forms) against the reference
path, on CPU, forward only (flex_attention has no backward on CPU): every registered encoding with a flex form, at
several lengths, causal and not, with left padding, packed documents (positions restarting at 0) and a KV-cache
decoding step; compiled in one graph for inference; the encodings whose maths has no score_mod refused by name; the
plan taking flex on CUDA for long calls. The CUDA tests (gradients through learnable tables, bf16 and fp32) say
that they need CUDA when there is none.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from posenc.analysis import flex_support
from posenc.attention import KVCache, MultiHeadAttention
from posenc.attention import flex as flex_kernel
from posenc.attention.call import _Call
from posenc.attention.plan import FLEX_MIN_PAIRS, Facts, plan_call
from posenc.base import AttentionContext
from posenc.errors import ConfigError
from posenc.registry import available, build, example_options

pytestmark = pytest.mark.skipif(not flex_kernel.available(), reason="this torch has no flex_attention")

D_MODEL, N_HEADS = 32, 4
DIMS = dict(d_model=D_MODEL, n_heads=N_HEADS, head_dim=D_MODEL // N_HEADS, max_len=256, n_layers=1, vocab_size=50)
#: the encodings whose maths a score_mod cannot carry, and the words of the reason (the issue's examples)
NO_FLEX = {
    "shaw": "values term",
    "nezha": "values term",
    "cope": "q·kᵀ",
    "stick-breaking": "own attention weights",
    "path": "offset-table form",  # PaTH's Householder products depend on the data between i and j
}
NAMES = [n for n in available() if not n.startswith("randomized-")]
FLEX = [n for n in NAMES if n not in NO_FLEX]
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the flex backward runs on GPUs only)")


def _layers(name: str, causal: bool, device: str = "cpu") -> tuple[MultiHeadAttention, MultiHeadAttention]:
    """The same attention (random parameters, nudged away from their initial values, so that a zero-initialised
    table such as T5's counts) on the reference path and on the flex path."""
    torch.manual_seed(0)
    enc = build(name, dims=dict(DIMS, causal=causal), options=example_options(name, DIMS))
    ref = MultiHeadAttention(D_MODEL, N_HEADS, enc, path="reference").eval()
    with torch.no_grad():
        gen = torch.Generator().manual_seed(1)
        for p in ref.parameters():
            if p.is_floating_point():
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    fl = MultiHeadAttention(D_MODEL, N_HEADS, enc, path="flex").eval()
    fl.load_state_dict(ref.state_dict())
    return ref.to(device), fl.to(device)


def _x(b: int, n: int, seed: int = 2) -> torch.Tensor:
    return torch.randn(b, n, D_MODEL, generator=torch.Generator().manual_seed(seed))


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", FLEX)
@pytest.mark.parametrize("length", [1, 9, 37])
def test_flex_equals_the_reference_path_causal(name, length):
    ref, fl = _layers(name, causal=True)
    x = _x(2, length)
    with torch.no_grad():
        want = ref(x, causal=True)
        got = fl(x, causal=True)
    assert fl.last_plan is not None and fl.last_plan.kernel == "flex", str(fl.last_plan)
    _close(got, want)


@pytest.mark.parametrize("name", FLEX)
def test_flex_equals_the_reference_path_bidirectional_with_left_padding(name):
    ref, fl = _layers(name, causal=False)
    x = _x(2, 23)
    pad = torch.ones(2, 23, dtype=torch.bool)
    pad[0, :5] = False  # five pads before the first row's tokens
    with torch.no_grad():
        want = ref(x, attention_mask=pad)
        got = fl(x, attention_mask=pad)
    assert fl.last_plan.kernel == "flex", str(fl.last_plan)
    _close(got, want)


@pytest.mark.parametrize("name", FLEX)
def test_flex_equals_the_reference_path_on_packed_documents(name):
    """Two documents packed in each row, positions restarting at 0 in each (not ``start + arange``: the offset forms
    are read at each pair's own offset)."""
    ref, fl = _layers(name, causal=True)
    x = _x(2, 20)
    docs = torch.tensor([[0] * 12 + [1] * 8, [0] * 5 + [1] * 15])
    pos = torch.stack([torch.cat([torch.arange(12), torch.arange(8)]), torch.cat([torch.arange(5), torch.arange(15)])])
    with torch.no_grad():
        want = ref(x, causal=True, document_ids=docs, positions=pos)
        got = fl(x, causal=True, document_ids=docs, positions=pos)
    assert fl.last_plan.kernel == "flex", str(fl.last_plan)
    _close(got, want)


@pytest.mark.parametrize("name", FLEX)
def test_flex_equals_the_reference_path_on_a_kv_cache_step(name):
    ref, fl = _layers(name, causal=True)
    x = _x(1, 13)
    outs = []
    for layer in (ref, fl):
        cache = KVCache()
        with torch.no_grad():
            layer(x[:, :12], causal=True, kv_cache=cache)
            outs.append(layer(x[:, 12:], causal=True, kv_cache=cache))
    assert fl.last_plan.kernel == "flex", str(fl.last_plan)
    _close(outs[1], outs[0])


@pytest.mark.parametrize("span", [("window", 5), ("chunk", 8)])
@pytest.mark.parametrize("name", ["rope", "alibi", "t5", "relative-key", "fire", "fox"])
def test_flex_on_a_local_layer_equals_the_reference_path(name, span):
    """A schedule's local layer (a sliding window or chunks, posenc.schedule): its span is part of the call's mask,
    which the block mask reads; a KV-cache step keeps only the span's keys."""
    ref, fl = _layers(name, causal=True)
    ref.span = fl.span = MultiHeadAttention(D_MODEL, N_HEADS, None, span=span).span
    x = _x(2, 21)
    with torch.no_grad():
        want, got = ref(x, causal=True), fl(x, causal=True)
        _close(got, want)
        outs = []
        for layer in (ref, fl):
            cache = KVCache()
            layer(x[:, :20], causal=True, kv_cache=cache)
            outs.append(layer(x[:, 20:], causal=True, kv_cache=cache))
    assert fl.last_plan.kernel == "flex", str(fl.last_plan)
    _close(outs[1], outs[0])


@pytest.mark.parametrize("name", sorted(NO_FLEX))
def test_an_encoding_without_a_score_mod_is_refused_by_name(name):
    _, fl = _layers(name, causal=True)
    with torch.no_grad(), pytest.raises(ConfigError, match=NO_FLEX[name]):
        fl(_x(1, 9), causal=True)
    assert NO_FLEX[name] in flex_kernel.why_not(fl.encoding)


def test_flex_on_a_cpu_with_gradients_is_a_clear_error():
    _, fl = _layers("alibi", causal=True)
    with pytest.raises(ConfigError, match="no backward on CPU"):
        fl(_x(1, 9).requires_grad_(), causal=True)


def test_flex_refuses_what_it_cannot_do_instead_of_running_something_else():
    _, fl = _layers("t5", causal=True)
    with torch.no_grad(), pytest.raises(ConfigError, match="return_weights"):
        fl(_x(1, 9), causal=True, return_weights=True)


@pytest.mark.parametrize("name", ["none", "alibi", "t5", "relative-key-query", "fire"])
def test_compiled_flex_keeps_one_graph_for_inference(name):
    """``fullgraph=True``: the whole call (forms, block mask, flex_attention) is one Dynamo graph. The ``aot_eager``
    backend runs that graph as traced; Inductor's CPU flex template (torch 2.13) takes the plain call (``none``) but
    rejects score_mods whose captured tables are computed in the same graph ("No choices exist for backend"), so
    the compiled CPU check of the encodings' score_mods is aot_eager's; on CUDA Inductor's Triton template runs
    them (benchmarks/gpu.sh)."""
    torch._dynamo.reset()
    ref, fl = _layers(name, causal=True)
    x = _x(2, 40)
    backend = "inductor" if name == "none" else "aot_eager"
    with torch.no_grad():
        want = ref(x, causal=True)
        got = torch.compile(fl, fullgraph=True, backend=backend)(x, causal=True)
    assert fl.last_plan.kernel == "flex"
    _close(got, want)


def _facts_on_cuda(name: str, length: int) -> tuple[Facts, object, _Call]:
    """The facts of a causal call as a CUDA device would have them (``on_cuda``, no CPU kernels)."""
    _, layer = _layers(name, causal=True)
    layer.path = "auto"
    enc = layer.encoding
    q = torch.randn(1, N_HEADS, length, D_MODEL // N_HEADS)
    pos = torch.arange(length)[None]
    ctx = AttentionContext(
        q_pos=pos, k_pos=pos, n_heads=N_HEADS, head_dim=D_MODEL // N_HEADS, contiguous=True, attention=layer
    )
    call = _Call(q, q.clone(), q.clone(), ctx, None, plain_causal=True, causal=True, any_padding=False)
    facts = Facts.of(call, enc, layer._has, True, 0.0, False)
    on_cuda = dataclasses.replace(facts, on_cpu=False, on_cuda=True, flex_pairs=length * length >= FLEX_MIN_PAIRS)
    return on_cuda, enc, call


@pytest.mark.parametrize("name", ["alibi", "t5", "kerple-log", "fire", "dynamic-bias", "transformer-xl", "deberta"])
def test_the_plan_takes_flex_on_cuda_for_long_calls_and_sdpa_for_short_ones(name):
    with torch.no_grad():
        facts, enc, call = _facts_on_cuda(name, int(FLEX_MIN_PAIRS**0.5) + 1)
        plan, _, form = plan_call(facts, enc, call, 0.35)
        assert plan.kernel == "flex" and "score_mod" in plan.reason and plan.portable, str(plan)
        assert isinstance(form, flex_kernel.FlexForm) and form.score_mod is not None
        facts, enc, call = _facts_on_cuda(name, 64)
        plan, _, _ = plan_call(facts, enc, call, 0.35)
    assert plan.kernel in ("sdpa", "materialised"), str(plan)


def test_the_plan_keeps_shaws_values_term_off_flex_on_cuda():
    with torch.no_grad():
        facts, enc, call = _facts_on_cuda("shaw", int(FLEX_MIN_PAIRS**0.5) + 1)
        plan, _, _ = plan_call(facts, enc, call, 0.35)
    assert plan.kernel != "flex", str(plan)


def test_block_masks_are_made_on_the_calls_device_and_kept_by_shape():
    q = torch.randn(1, 2, 16, 8)
    pos = torch.arange(16)[None]
    ctx = AttentionContext(q_pos=pos, k_pos=pos, n_heads=2, head_dim=8, contiguous=True)
    allowed = torch.ones(1, 1, 16, 16, dtype=torch.bool).tril()
    call = _Call(q, q, q, ctx, allowed, plain_causal=True, causal=True, any_padding=False)
    cache: dict = {}
    first = flex_kernel.block_mask(call, cache)
    assert flex_kernel.block_mask(call, cache) is first  # kept
    dense = first.to_dense()
    assert dense.device == q.device and bool(dense.any())
    assert flex_kernel.block_mask(dataclasses.replace(call, allowed=None), cache) is None


# ---------------------------------------------------------------- CUDA: the backward and half precision
@CUDA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["alibi", "t5", "kerple-log", "fire", "relative-key-query", "transformer-xl"])
def test_cuda_flex_gradients_through_learnable_tables_equal_the_reference(name, dtype):
    ref, fl = _layers(name, causal=True, device="cuda")
    ref, fl = ref.to(dtype), fl.to(dtype)
    x = _x(2, 300).to("cuda", dtype)
    grads = []
    for layer in (ref, fl):
        layer.zero_grad(set_to_none=True)
        xx = x.clone().requires_grad_()
        out = layer(xx, causal=True)
        out.float().square().sum().backward()
        grads.append((out.detach().float(), xx.grad.float(), [p.grad for p in layer.parameters()]))
    assert fl.last_plan.kernel == "flex"
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(grads[1][0], grads[0][0], **tol)
    torch.testing.assert_close(grads[1][1], grads[0][1], **tol)
    for g_flex, g_ref in zip(grads[1][2], grads[0][2], strict=True):
        if g_ref is not None:
            torch.testing.assert_close(g_flex.float(), g_ref.float(), **tol)


def test_docs_gpu_md_holds_the_generated_support_table():
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parent.parent / "docs" / "gpu.md").read_text()
    have = re.search(r"<!-- flex-support:start -->\n(.*?)<!-- flex-support:end -->", doc, flags=re.S)
    assert have is not None
    cells = flex_support.support()
    assert have.group(1) == flex_support.support_table(cells), "docs/gpu.md's table is stale: see its command"
    for name in FLEX:  # every encoding with terms in the attention takes flex; the others name why not
        assert cells[name].startswith(("flex: ", "sdpa: ")), (name, cells[name])
    for name, words in NO_FLEX.items():
        assert words in cells[name], (name, cells[name])


def test_the_gpu_leg_dry_run_builds_every_case_on_the_cpu():
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    got = subprocess.run(
        ["bash", "benchmarks/gpu.sh", "--dry-run", "--encodings", "alibi", "t5", "fire", "relative-key"],
        cwd=root, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHON": sys.executable},
    )
    assert got.returncode == 0, got.stderr[-2000:]
    rows = [line for line in got.stdout.splitlines() if line.startswith("| ") and "| 16 |" in line]
    assert len(rows) == 1 + 4 * 2, got.stdout  # none, then each encoding with flex and with the dense bias
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        want = "flex" if cells[1] == "flex" else "sdpa"
        assert cells[3] == want, line
