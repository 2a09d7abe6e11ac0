"""The device-portable plan (issue 24): what a CUDA, MPS or XPU call takes, tested on CPU by forcing it.

``with posenc.attention.portable():`` makes the plan skip every CPU-only kernel (the CPU flash op, the row-blocked
kernels, the C code of posenc.native), as it does on any non-CPU device. Every registered encoding must then give the
reference path's outputs and gradients (a training step, right padding, packed documents, Transformer-XL memory,
KV-cache decoding), and every call must report a portable kernel. The models here use ``fused_min_pairs = 1``, so
outside the forced plan these same calls take the CPU kernels (blocked, offset-bias, block-bias, biased-sdpa,
decode): the contrast is checked too.
"""

from __future__ import annotations

import inspect
import itertools

import pytest
import torch
from test_attention import LENGTH_DEPENDENT, NEEDS_SEGMENTS, names
from test_plan import TOKENS, assert_same, pair, plans, weighted

import posenc
from posenc import native
from posenc.attention import KERNELS, PORTABLE_KERNELS, MultiHeadAttention, choose_kernel, portable, portable_forced

CPU_KERNELS = set(KERNELS) - set(PORTABLE_KERNELS)


def seg(name: str, n: int = 14, sl: slice = slice(None)) -> dict:
    if name not in NEEDS_SEGMENTS:
        return {}
    return {"segment_ids": (torch.arange(n) >= n // 2).long().expand(2, n)[:, sl]}


def assert_portable(model) -> None:
    ps = plans(model)
    assert all(p.portable and p.kernel in PORTABLE_KERNELS for p in ps), [str(p) for p in ps]
    assert all("portable plan" in str(p) for p in ps)


# ---------------------------------------------------------------- the table
def test_choose_kernel_off_cpu_never_picks_a_cpu_kernel():
    """Every combination of the table's conditions: without the CPU kernels the answer is sdpa or materialised."""
    # every boolean condition the table takes (read from its signature: a condition added later is covered too)
    flags = tuple(n for n in inspect.signature(choose_kernel).parameters if n not in ("dropout", "on_cpu"))
    assert {"reference", "has_form", "has_offsets", "has_blocks", "one_query", "learned_bias"} <= set(flags)
    seen = set()
    for values in itertools.product((False, True), repeat=len(flags)):
        for dropout in (0.0, 0.1):
            kw = dict(zip(flags, values), dropout=dropout)
            kernel, reason = choose_kernel(**kw, on_cpu=False)
            assert kernel in PORTABLE_KERNELS, (kw, kernel)
            seen.add(kernel)
            if kw["needs_values"]:  # a^V needs the probabilities on every device
                assert kernel == "materialised" and reason
            on_cpu = choose_kernel(**kw, on_cpu=True)[0]
            assert on_cpu in KERNELS
    assert seen == set(PORTABLE_KERNELS) - {"flex"}  # flex is chosen before this table (plan_call; tests/test_flex.py)


def test_portable_nests_restores_and_turns_the_native_code_off():
    before = native.enabled
    assert not portable_forced()
    with portable():
        assert portable_forced() and native.enabled is False
        with portable(False):
            assert not portable_forced()
        assert portable_forced()
    assert not portable_forced() and native.enabled is before
    with pytest.raises(RuntimeError, match="inside"), portable():
        raise RuntimeError("inside")
    assert not portable_forced() and native.enabled is before


def test_the_portable_plan_calls_no_native_code_and_no_cpu_flash(monkeypatch):
    """Inside the block no native wrapper computes anything and the CPU flash op is never chosen."""
    from posenc.attention import sdpa as attention

    computed = []
    for fn in ("rope_rotate", "fire_bias", "rows_dot", "decode_attention"):
        real = getattr(native, fn)

        def spy(*a, _real=real, _fn=fn, **k):
            out = _real(*a, **k)
            if out is not None:
                computed.append(_fn)
            return out

        monkeypatch.setattr(native, fn, spy)

    real_flash = attention._cpu_flash

    def flash(*a, **k):
        if real_flash(*a, **k):
            computed.append("cpu flash")
        return False

    monkeypatch.setattr(attention, "_cpu_flash", flash)
    for name in ("rope", "fire", "relative-key-query", "t5", "alibi", "deberta"):
        fast, _ = pair(name)
        fast.eval()
        with portable(), torch.no_grad():
            cache = posenc.KVCache()
            fast(TOKENS[:, :6], kv_cache=cache)
            fast(TOKENS[:, 6:7], kv_cache=cache)
        assert_portable(fast)
        with portable():
            fast.train()
            fast.loss(TOKENS).backward()
        assert_portable(fast)
    assert computed == []


# ---------------------------------------------------------------- every encoding
@pytest.mark.parametrize("name", names())
def test_every_encoding_under_the_portable_plan_equals_the_reference_with_gradients(name):
    """A training step (causal LM), a right-padded batch and packed documents: the reference path's values and
    gradients, every layer on a portable kernel."""
    fast, ref = pair(name)
    with portable():
        assert_same(fast, ref, lambda m: weighted(m(TOKENS, **seg(name))))
    assert_portable(fast)
    # the same model without the forced plan takes a CPU kernel wherever it has one (the contrast)
    fast(TOKENS, **seg(name))
    assert not any(p.portable for p in plans(fast))
    mask = torch.ones(2, 14, dtype=torch.bool)
    mask[0, 9:] = False  # right padding in the first row
    fast.eval(), ref.eval()
    with portable():
        assert_same(fast, ref, lambda m: weighted(m(TOKENS, attention_mask=mask, **seg(name))[:, :9]))
    assert_portable(fast)
    # packed documents restarting at 0: arbitrary positions (the hooks' gather forms)
    docs = torch.tensor([[0] * 5 + [1] * 9, [0] * 8 + [1] * 6])
    pos = torch.stack([torch.cat([torch.arange(5), torch.arange(9)]), torch.cat([torch.arange(8), torch.arange(6)])])
    with portable():
        assert_same(fast, ref, lambda m: weighted(m(TOKENS, positions=pos, document_ids=docs, **seg(name))))
    assert_portable(fast)
    assert not any(p.contiguous for p in plans(fast))


@pytest.mark.parametrize("name", [n for n in names() if n not in LENGTH_DEPENDENT])
def test_every_encoding_decodes_under_the_portable_plan_as_the_full_reference_forward(name):
    fast, ref = pair(name)
    fast.eval(), ref.eval()
    with torch.no_grad():
        full = ref(TOKENS, **seg(name))
        with portable():
            cache = posenc.KVCache()
            steps = [fast(TOKENS[:, :9], kv_cache=cache, **seg(name, sl=slice(0, 9)))]
            for t in range(9, 14):
                steps.append(fast(TOKENS[:, t : t + 1], kv_cache=cache, **seg(name, sl=slice(t, t + 1))))
                assert_portable(fast)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("name", [n for n in names() if n not in NEEDS_SEGMENTS])
def test_every_encoding_with_memory_under_the_portable_plan_equals_the_reference(name):
    """Transformer-XL recurrence: a segment attends to the previous one's hidden states, values and gradients."""
    fast, ref = pair(name)
    fast.eval(), ref.eval()

    def run(m):
        _, mem = m(TOKENS[:, :6], return_memory=True)
        return weighted(m(TOKENS[:, 6:], memory=mem))

    with portable():
        assert_same(fast, ref, run)
    assert_portable(fast)


@pytest.mark.parametrize("name", ["shaw", "t5", "fire", "alibi", "rope", "transformer-xl"])
def test_dropout_under_the_portable_plan_is_sdpas_own(name):
    """Training with attention dropout: SDPA's dropout (or the materialised formula for a^V), no blocked kernel."""
    fast, _ = pair(name)
    for m in fast.modules():
        if isinstance(m, MultiHeadAttention):
            m.dropout = 0.3
    fast.train()
    with portable():
        loss = fast.loss(TOKENS, **seg(name))
        loss.backward()
    assert torch.isfinite(loss)
    assert_portable(fast)
    assert all(p.dropout == 0.3 for p in plans(fast))


def test_the_plan_reports_portable_for_multi_head_attention_and_says_why():
    enc = posenc.get("t5", n_heads=2, causal=True)
    enc.fused_min_pairs = 1
    attn = MultiHeadAttention(16, 2, enc).double()
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    assert attn.plan(x, causal=True).kernel == "offset-bias"
    with portable():
        p = attn.plan(x, causal=True)
    assert p.kernel == "sdpa" and p.portable and "portable" in p.reason and "portable plan" in str(p)


def test_posenc_portable_in_the_environment_forces_it_for_the_process():
    import os
    import subprocess
    import sys

    code = (
        "import torch, posenc\n"
        "from posenc import native\n"
        "from posenc.attention import portable_forced\n"
        "enc = posenc.get('t5', n_heads=2, causal=True); enc.fused_min_pairs = 1\n"
        "attn = posenc.MultiHeadAttention(16, 2, enc)\n"
        "p = attn.plan(torch.randn(2, 9, 16), causal=True)\n"
        "print(portable_forced(), native.enabled, p.kernel, p.portable)\n"
    )
    env = {**os.environ, "POSENC_PORTABLE": "1", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["True", "False", "sdpa", "True"]
