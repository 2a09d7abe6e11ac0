"""The decode kernel with a value table (Shaw's and NEZHA's a^V) and a query term looked up per table row.

:func:`posenc.native.decode_attention` sums the probabilities per row of a value table in its one pass over the keys
and multiplies the rows once after it; a query term whose table has fewer rows than there are keys is taken once
per row and looked up per key. These tests hold the kernel to the softmax written out, and a KV-cache decoding step
of Shaw and NEZHA (which now takes the ``decode`` kernel) to the reference path, with left padding and a mask, the
compiled kernels on and off (``posenc.native.enabled``: the PyTorch path gives the same numbers).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import posenc
from posenc import native

needs_kernel = pytest.mark.skipif(not native.available(), reason="no compiled kernel on this machine")


@needs_kernel
@settings(max_examples=60, deadline=None)
@given(
    shape=st.tuples(st.integers(1, 2), st.integers(1, 3), st.integers(1, 40), st.sampled_from([1, 7, 16, 64])),
    rows=st.integers(1, 9),
    flags=st.fixed_dictionaries({f: st.booleans() for f in ("indexed", "shared", "query_term", "masked")}),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    seed=st.integers(0, 2**16),
)
def test_decode_attention_with_a_value_table_equals_the_softmax_formula(shape, rows, flags, dtype, seed):
    """``o = Σ_j p_j (v_j + W[w_j])`` with ``s_j = scale (q·k_j + a·T[t_j]) + add_j``: tables of fewer rows than keys
    (looked up per key) or one row per key, shared by the heads or per head, keys masked (all of a row's, too)."""
    b, h, lk, d = shape
    indexed, with_query_term = flags["indexed"], flags["query_term"]
    g = torch.Generator().manual_seed(seed)
    q, a, k, v = (
        torch.randn(*s, generator=g, dtype=dtype) for s in ((b, h, d), (b, h, d), (b, lk, h, d), (b, lk, h, d))
    )
    k, v = k.transpose(1, 2), v.transpose(1, 2)  # a projection's strided views
    r, heads = (rows if indexed else lk), (1 if flags["shared"] else h)
    table_t, table_w = torch.randn(2, r, heads, d, generator=g, dtype=dtype).unbind(0)
    index = torch.randint(0, r, (lk,), generator=g) if indexed else None
    add = torch.randn(b, 1, lk, generator=g, dtype=dtype)
    if flags["masked"]:
        add[0, 0, : max(1, lk // 2)] = float("-inf")
        if b > 1:
            add[1] = float("-inf")  # a row that may see no key: zeros
    rows_t = (table_t[index] if indexed else table_t).expand(lk, h, d)  # [Lk, H, d]
    rows_w = (table_w[index] if indexed else table_w).expand(lk, h, d)
    s = (k @ q[..., None])[..., 0]
    if with_query_term:
        s = s + torch.einsum("bhd,jhd->bhj", a, rows_t)
    p = torch.softmax(0.7 * s + add, -1).nan_to_num(0.0)  # no key at all: zeros, as every kernel gives
    want = torch.einsum("bhj,bhjd->bhd", p, v) + torch.einsum("bhj,jhd->bhd", p, rows_w)
    got = native.decode_attention(
        q,
        k,
        v,
        0.7,
        query_term=(a, table_t, index) if with_query_term else None,
        value_table=(table_w, index),
        add=add,
    )
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@needs_kernel
def test_decode_attention_checks_the_value_table():
    q, k = torch.randn(1, 2, 4), torch.randn(1, 2, 5, 4)
    with pytest.raises(IndexError, match="out of range for a table of 3 rows"):
        native.decode_attention(q, k, k, 1.0, value_table=(torch.randn(3, 1, 4), torch.tensor([0, 1, 2, 3, 0])))
    assert native.decode_attention(q, k, k, 1.0, value_table=(torch.randn(3, 2, 5), None)) is None  # wrong width
    assert native.decode_attention(q, k, k, 1.0, value_table=(torch.randn(4, 2, 4), None)) is None  # a row per key


def _attention(name: str, clip: int, heads: int, path: str) -> posenc.MultiHeadAttention:
    torch.manual_seed(0)
    enc = posenc.get(name, head_dim=8, max_relative_position=clip)
    attn = posenc.MultiHeadAttention(8 * heads, heads, encoding=enc, path=path).double().eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # Shaw's tables off their initial values, so a dropped term shows
        for p in attn.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return attn


@settings(max_examples=12, deadline=None)
@given(
    name=st.sampled_from(["shaw", "nezha"]),
    context=st.integers(1, 40),
    clip=st.integers(0, 12),
    heads=st.integers(1, 3),
    batch=st.integers(1, 2),
    padded=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_shaw_and_nezha_decoding_steps_equal_the_reference_path(name, context, clip, heads, batch, padded, seed):
    """Three KV-cache decoding steps after a prefill of ``context`` tokens equal the reference path's (the a^K and
    a^V tables materialised as the paper writes them), the compiled kernels on (the ``decode`` kernel) and off."""
    fast, ref = _attention(name, clip, heads, "auto"), _attention(name, clip, heads, "reference")
    g = torch.Generator().manual_seed(seed)
    n = context + 3
    x = torch.randn(batch, n, 8 * heads, generator=g, dtype=torch.float64)
    mask = torch.ones(batch, n, dtype=torch.bool)
    if padded and batch > 1:
        mask[1, : min(3, context)] = False  # left padding in the second row

    def run(attn: posenc.MultiHeadAttention) -> tuple[torch.Tensor, set[str]]:
        cache, kernels = posenc.KVCache(), set()
        outs = [attn(x[:, :context], causal=True, kv_cache=cache, attention_mask=mask[:, :context])]
        for t in range(context, n):
            outs.append(attn(x[:, t : t + 1], causal=True, kv_cache=cache, attention_mask=mask[:, : t + 1]))
            kernels.add(attn.last_plan.kernel)
        return torch.cat(outs, dim=1), kernels

    with torch.no_grad():
        want, _ = run(ref)
        for on in (True, False):
            native.enabled = on
            try:
                got, kernels = run(fast)
            finally:
                native.enabled = True
            if on and native.available():
                assert kernels == {"decode"}, kernels
            rows = mask[:, :, None]  # a padded query's row is left out (it sees no key in the reference)
            torch.testing.assert_close(got * rows, want * rows, rtol=1e-10, atol=1e-11)


def _fire(path: str, heads: int, threshold: float) -> posenc.MultiHeadAttention:
    torch.manual_seed(0)
    enc = posenc.get("fire", n_heads=heads, hidden=8, init_L=threshold)
    return posenc.MultiHeadAttention(4 * heads, heads, encoding=enc, path=path).double().eval()


def _steps_input(batch: int, context: int, total: int, width: int, padded: bool, seed: int):
    """Float64 inputs ``[batch, total, width]``, their mask (the second sequence left-padded by up to 3 tokens when
    ``padded``) and the rows to compare (``[batch, total, 1]``: a padded query sees no key in the reference)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, total, width, generator=g, dtype=torch.float64)
    mask = torch.ones(batch, total, dtype=torch.bool)
    if padded and batch > 1:
        mask[1, : min(3, context)] = False
    return x, mask, mask[:, :, None]


def _decode(attn: posenc.MultiHeadAttention, x: torch.Tensor, context: int, mask: torch.Tensor) -> torch.Tensor:
    """A prefill of ``context`` tokens, then one step per token left."""
    cache = posenc.KVCache()
    outs = [attn(x[:, :context], causal=True, kv_cache=cache, attention_mask=mask[:, :context])]
    for t in range(context, x.shape[1]):
        outs.append(attn(x[:, t : t + 1], causal=True, kv_cache=cache, attention_mask=mask[:, : t + 1]))
    return torch.cat(outs, dim=1)


@settings(max_examples=12, deadline=None)
@given(
    context=st.integers(1, 30),
    threshold=st.sampled_from([3.0, 12.5, 20.0, 512.0]),
    heads=st.integers(1, 3),
    batch=st.integers(1, 2),
    padded=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_fire_decoding_steps_equal_the_reference_path(context, threshold, heads, batch, padded, seed):
    """FIRE's decoding steps, from the tables it keeps between steps (the bias per offset while the query is at
    ``i <= L``, ``ψ`` per distance past it), equal the MLP on every pair, across the threshold ``L``, native on and
    off; then again after each parameter changed in place (the tables follow the version counters)."""
    fast, ref = _fire("auto", heads, threshold), _fire("reference", heads, threshold)
    x, mask, rows = _steps_input(batch, context, context + 8, 4 * heads, padded, seed)
    with torch.no_grad():
        for change in (None, "mlp", "c", "L_multiplier"):
            if change is not None:  # the same change in both models
                for attn in (fast, ref):
                    enc = attn.encoding
                    param = enc.mlp[0].weight if change == "mlp" else getattr(enc, change)
                    param.mul_(1.5)
            want = _decode(ref, x, context, mask)
            for on in (True, False):
                native.enabled = on
                try:
                    got = _decode(fast, x, context, mask)
                finally:
                    native.enabled = True
                torch.testing.assert_close(got * rows, want * rows, rtol=1e-10, atol=1e-11)
    assert "_psi_memo" in fast.encoding.__dict__ or "_bias_memo" in fast.encoding.__dict__


def test_fire_keeps_no_table_under_autograd_or_in_training():
    """A step that records a gradient, or in training mode, evaluates the bias per pair (its gradient reaches the
    parameters), and leaves no table behind."""
    fast, ref = _fire("auto", 2, 6.0), _fire("reference", 2, 6.0)
    x = torch.randn(1, 12, 8, dtype=torch.float64)
    mask = torch.ones(1, 12, dtype=torch.bool)
    got = _decode(fast, x, 4, mask)
    torch.testing.assert_close(got, _decode(ref, x, 4, mask), rtol=1e-10, atol=1e-11)
    got.sum().backward()
    assert fast.encoding.c.grad is not None and fast.encoding.mlp[0].weight.grad is not None
    with torch.no_grad():
        _decode(fast.train(), x, 4, mask)
    assert not any(k in fast.encoding.__dict__ for k in ("_psi_memo", "_bias_memo", "_pieces_memo"))


@settings(max_examples=16, deadline=None)
@given(
    name=st.sampled_from(["kerple-log", "kerple-power"]),
    constraint=st.sampled_from(["clamp", "softplus"]),
    context=st.integers(1, 90),
    heads=st.integers(1, 3),
    batch=st.integers(1, 2),
    padded=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_kerple_decoding_steps_from_the_kept_table_equal_the_reference_path(
    name, constraint, context, heads, batch, padded, seed
):
    """KERPLE's decoding steps read the kernel per offset from a table kept between steps (grown past 64 offsets
    within a decode of up to 97 tokens): equal to the reference path's kernel of every pair, then again after each
    parameter changed in place, once out of range (the clamp runs when the table is rebuilt, as on every call of
    the reference path)."""
    torch.manual_seed(seed)
    enc = posenc.get(name, n_heads=heads, constraint=constraint)
    fast = posenc.MultiHeadAttention(4 * heads, heads, encoding=enc).double().eval()
    ref = posenc.MultiHeadAttention(4 * heads, heads, encoding=enc, path="reference").double().eval()
    ref.load_state_dict(fast.state_dict())
    x, mask, rows = _steps_input(batch, context, context + 7, 4 * heads, padded, seed)
    with torch.no_grad():
        for change in (None, 1.7, -0.5):  # -0.5: r1 below eps (clamped) or a softplus argument below 0
            if change is not None:
                enc.raw_r1.mul_(change)
                enc.raw_r2.mul_(abs(change))
            got = _decode(fast, x, context, mask)
            assert "_offsets_memo" in enc.__dict__
            want = _decode(ref, x, context, mask)
            torch.testing.assert_close(got * rows, want * rows, rtol=1e-10, atol=1e-11)
    assert enc.__dict__["_offsets_memo"][1].shape[-1] >= 2 * (context + 6) + 1  # every offset of the last step


def test_kerple_keeps_no_table_under_autograd_or_in_training():
    """A step that records a gradient, or in training mode, computes the kernel per offset (its gradient reaches
    ``raw_r1`` and ``raw_r2``), and leaves no table behind."""
    enc = posenc.get("kerple-log", n_heads=2)
    fast = posenc.MultiHeadAttention(8, 2, encoding=enc).double().eval()
    x = torch.randn(1, 12, 8, dtype=torch.float64)
    mask = torch.ones(1, 12, dtype=torch.bool)
    _decode(fast, x, 4, mask).sum().backward()
    assert enc.raw_r1.grad is not None and enc.raw_r2.grad is not None
    with torch.no_grad():
        _decode(fast.train(), x, 4, mask)
    assert "_offsets_memo" not in enc.__dict__


@pytest.mark.parametrize("name", ["contextual-1", "contextual-2"])
def test_contextual_decoding_keeps_its_projected_tables_while_the_weights_hold(name):
    """contextual-1/2 decoding steps project their bucket tables once and keep them (and the offsets' buckets)
    between steps: equal to the reference path, then again after each weight changed in place."""
    torch.manual_seed(0)
    opts = {"n_heads": 2, "head_dim": 4} if name == "contextual-1" else {}
    enc = posenc.get(name, d_model=8, num_buckets=8, max_distance=16, **opts)
    fast = posenc.MultiHeadAttention(8, 2, encoding=enc).double().eval()
    ref = posenc.MultiHeadAttention(8, 2, encoding=enc, path="reference").double().eval()
    ref.load_state_dict(fast.state_dict())
    x = torch.randn(2, 30, 8, dtype=torch.float64)
    mask = torch.ones(2, 30, dtype=torch.bool)
    weights = [enc.embeddings.weight] + ([enc.to_r.weight] if name == "contextual-1" else [fast.k_proj.bias])
    with torch.no_grad():
        for change in [None, *weights]:
            if change is not None:
                change.mul_(1.5)
                ref.load_state_dict(fast.state_dict())
            torch.testing.assert_close(_decode(fast, x, 5, mask), _decode(ref, x, 5, mask), rtol=1e-10, atol=1e-11)
            assert fast.last_plan.kernel == "decode"
    assert enc.__dict__["_projected_memo"] and enc.__dict__["_bucket_memo"].shape[0] >= 2 * 29 + 1


@needs_kernel
@pytest.mark.parametrize("order", ["descending", "ascending", "random", "on-knots"])
def test_fire_kernel_by_runs_of_one_piece_equals_the_search_per_value(order):
    """FIRE's C kernel takes a run of values in one piece at a time (a row of distances is monotone): the same
    numbers as a search per value (torch.searchsorted), for values in order, in no order and on the knots, across
    chunks of the kernel."""
    torch.manual_seed(0)
    knots = torch.sort(torch.randn(9)).values
    slope, intercept = torch.randn(10, 3), torch.randn(10, 3)
    x = {
        "descending": torch.linspace(3, -3, 5000),
        "ascending": torch.linspace(-3, 3, 5000),
        "random": torch.randn(5000),
        "on-knots": knots.repeat_interleave(556)[:5000],
    }[order].reshape(2, 2500)
    seg = torch.searchsorted(knots, x)
    want = slope.t()[:, seg] * x + intercept.t()[:, seg]
    assert torch.equal(native.fire_bias(x, knots, slope, intercept), want)
