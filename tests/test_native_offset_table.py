"""The native fused attention of the offset-table family (:mod:`posenc.native.offset_table`, issue 49) against the
PyTorch row blocks of :func:`posenc.fused.relative_attention` (the path it takes the place of in the attention's
blocked kernel, itself tested against the
formula in tests/test_fused.py): outputs and the gradients of q, k, v, the operands and every table, in float64 to
1e-10 and float32 to 1e-5, for random shapes, clip distances and masks; a hidden key, NaN and inf included, reaches
no output through the attention; torch.compile keeps the kernel as one op and equals eager.
"""

from __future__ import annotations

import pytest
import torch

import posenc
from posenc import fused, native
from posenc.fused import RelativeForm, Rows
from posenc.fused import relative_attention as _blocked
from posenc.native import offset_table as ot
from posenc.registry import accepted_arguments

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler: the kernel is off (its fallback runs)")

D = 32  # a multiple of every build's 2 vectors (16 floats or 8 doubles with AVX-512)


@pytest.fixture(autouse=True)
def _on(monkeypatch):
    monkeypatch.setattr(ot, "ENABLED", True)
    monkeypatch.setattr(ot, "KEY_TERMS", True)


def relative_attention(form, v, scale, allowed=None, **kw):
    """What the attention's blocked kernel runs: the native pass where it applies, else the PyTorch blocks."""
    fast = ot.form_attention(form, v, scale, allowed, **kw)
    return fast if fast is not None else _blocked(form, v, scale, allowed, **kw)


def _count(monkeypatch) -> list[int]:
    """Calls of the kernel's forward (the custom op's body)."""
    calls: list[int] = []
    real = ot._forward
    monkeypatch.setattr(ot, "_forward", lambda *a: calls.append(1) or real(*a))
    return calls


def _table(kind: str, p: int, h: int, clip: int, g: torch.Generator, dt: torch.dtype):
    """A table of the form: ``expanded`` ``[P, H|1, d]``, ``clipped`` (Rows of ``2 clip + 1`` rows: runs at both
    ends) or ``buckets`` (Rows per head, an index with its own pattern)."""
    lq_minus_1 = (p - 1) // 2
    off = torch.arange(p) - lq_minus_1
    if kind == "expanded":
        return torch.randn(p, h, D, generator=g, dtype=dt).requires_grad_()
    if kind == "clipped":
        rows = torch.randn(2 * clip + 1, 1, D, generator=g, dtype=dt).requires_grad_()
        return Rows(rows, off.clamp(-clip, clip) + clip)
    idx = (off.sign() * torch.log1p(off.abs().double()).floor().long()).clamp(-clip, clip) + clip
    return Rows(torch.randn(2 * clip + 1, h, D, generator=g, dtype=dt).requires_grad_(), idx)


def _leaf(t) -> torch.Tensor:
    return t.table if isinstance(t, Rows) else t


CASES = [
    # (query table, key table, value table, causal, mask, B, H, Lq, Lk, clip)
    ("expanded", None, None, True, None, 2, 2, 23, 23, 3),
    ("expanded", "expanded", None, True, None, 1, 3, 17, 17, 3),
    ("clipped", None, "clipped", True, "pad", 2, 2, 21, 21, 2),
    ("buckets", "buckets", None, False, "pad", 2, 2, 19, 19, 3),
    ("clipped", "clipped", "clipped", False, "rows", 2, 1, 13, 13, 2),
    (None, None, "clipped", True, None, 1, 2, 9, 9, 4),
    ("expanded", "expanded", "expanded", True, "pad", 2, 2, 7, 12, 20),
    (None, None, None, False, None, 1, 1, 5, 5, 1),
    ("clipped", None, "clipped", True, "pad", 1, 2, 64, 64, 4),
    ("buckets", "buckets", None, True, "rows", 1, 2, 45, 45, 2),
    # longer than a key chunk (256) and a row block (32): the chunks and blocks meet
    ("clipped", "buckets", "clipped", True, "pad", 1, 1, 290, 300, 5),
    ("expanded", "expanded", "expanded", False, "rows", 1, 1, 270, 270, 3),
]


def _run_both(case, dt: torch.dtype, seed: int):
    qk, kk, vk, causal, mask, b, h, lq, lk, clip = case
    g = torch.Generator().manual_seed(seed)
    p = lq + lk - 1

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=dt).requires_grad_()

    q, k, v = rnd(b, h, lq, D), rnd(b, h, lk, D), rnd(b, h, lk, D)
    qt = _table(qk, p, h, clip, g, dt) if qk else None
    kt = _table(kk, p, h, clip, g, dt) if kk else None
    vt = _table(vk, p, 1, clip, g, dt) if vk else None
    allowed = None
    if mask == "pad":  # key padding, the first sequence's first keys hidden from every query
        allowed = torch.ones(b, 1, 1, lk, dtype=torch.bool)
        allowed[0, ..., : lk // 3] = False
    elif mask == "rows":  # a mask per query, with a query that sees no key at all
        allowed = torch.rand(b, h, lq, lk, generator=g) > 0.4
        allowed[:, :, 1] = False
        allowed[..., -1] = True if not causal else allowed[..., -1]
    sees = torch.ones(b, h, lq, dtype=torch.bool)
    if allowed is not None:
        vis = allowed.expand(b, h, lq, lk)
        if causal:
            vis = vis & (torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + lk - lq)
        sees = vis.any(-1)
    form = RelativeForm(
        q=q,
        k=k,
        query_terms=[(q, qt)] if qt is not None else [],
        key_terms=[(k, kt)] if kt is not None else [],
        value_table=vt,
    )
    leaves = [q, k, v] + [_leaf(t) for t in (qt, kt, vt) if t is not None]
    weight = torch.randn(b, h, lq, D, generator=g, dtype=dt) * sees[..., None]  # rows that see no key: no gradient
    results = []
    for on in (False, True):
        ot.ENABLED = on
        out = relative_attention(form, v, 0.37, allowed, causal=causal)
        grads = torch.autograd.grad((out * weight).sum(), leaves)
        results.append((out * sees[..., None], grads))
    return results


@pytest.mark.parametrize("case", CASES)
def test_float64_equals_the_blocked_path(case, monkeypatch):
    """Outputs and the gradients of q, k, v and every table, to 1e-10, and the kernel ran."""
    calls = _count(monkeypatch)
    (ref, ref_g), (got, got_g) = _run_both(case, torch.float64, seed=CASES.index(case))
    assert calls, "the native kernel did not run"
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)
    for a, b in zip(got_g, ref_g):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("case", CASES[:6])
def test_float32_within_1e_5(case):
    (ref, ref_g), (got, got_g) = _run_both(case, torch.float32, seed=7)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(got_g, ref_g):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("seed", range(4))
def test_random_shapes_and_clips(seed, monkeypatch):
    """Random lengths (odd, Lk >= Lq), heads, clips and table kinds: the same as the blocked path (float64)."""
    calls = _count(monkeypatch)
    g = torch.Generator().manual_seed(100 + seed)

    def pick(xs):
        return xs[int(torch.randint(len(xs), (1,), generator=g))]

    lq = int(torch.randint(1, 30, (1,), generator=g))
    lk = lq + pick([0, 0, 3])
    case = (
        pick(["expanded", "clipped", "buckets", None]),
        pick(["expanded", "buckets", None]),
        pick(["clipped", "expanded", None]),
        pick([True, False]),
        pick([None, "pad", "rows"]),
        pick([1, 2]),
        pick([1, 3]),
        lq,
        lk,
        pick([1, 2, 5, 40]),
    )
    (ref, ref_g), (got, got_g) = _run_both(case, torch.float64, seed=seed)
    assert calls
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)
    for a, b in zip(got_g, ref_g):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_falls_back_where_it_does_not_apply(monkeypatch):
    """A head dimension the vectors do not divide, a bias, dropout, or the kernels off: the PyTorch blocks run."""
    calls = _count(monkeypatch)
    q = torch.randn(1, 2, 9, 24, dtype=torch.float64)
    t = torch.randn(17, 1, 24, dtype=torch.float64)
    relative_attention(RelativeForm(q=q, k=q, query_terms=[(q, t)]), q, 0.5)
    q32 = torch.randn(1, 2, 9, D, dtype=torch.float64)
    t32 = torch.randn(17, 1, D, dtype=torch.float64)
    form = RelativeForm(q=q32, k=q32, query_terms=[(q32, t32)])
    relative_attention(form, q32, 0.5, bias=torch.zeros(1, 1, 1, 9, dtype=torch.float64))
    relative_attention(form, q32, 0.5, dropout=0.1)
    assert not calls
    monkeypatch.setattr(native, "enabled", False)
    relative_attention(form, q32, 0.5)
    assert not calls
    assert ot.offset_table_attention(q32, q32, q32, 0.5) is None
    monkeypatch.setattr(native, "enabled", True)
    relative_attention(form, q32, 0.5)
    assert calls


def _layer(name: str, dt: torch.dtype = torch.float32, **kw) -> posenc.MultiHeadAttention:
    torch.manual_seed(0)
    want = {"n_heads": 2, "head_dim": D, "d_model": 2 * D, "max_len": 64, "max_relative_position": 4}
    if name == "deberta":  # buckets and a clip within the test's lengths
        want.update(max_len=16, position_buckets=8)
    accepted = accepted_arguments(posenc.resolve(name))
    enc = posenc.get(name, **{k: v for k, v in want.items() if k in accepted})
    enc.fused_min_pairs = 1  # the offset-table form even for a short test sequence
    with torch.no_grad():
        for p in enc.parameters():
            p.add_(torch.randn_like(p))
    return posenc.MultiHeadAttention(2 * D, 2, encoding=enc, **kw).to(dt)


@pytest.mark.parametrize("name", ["relative-key", "relative-key-query", "shaw", "nezha", "deberta", "tener"])
def test_encodings_take_the_kernel_and_match_it_off(name, monkeypatch):
    """Each encoding of the family, through the attention (causal and padded), equals itself with the kernel off."""
    calls = _count(monkeypatch)
    layer = _layer(name, torch.float64)
    x = torch.randn(2, 19, 2 * D, dtype=torch.float64)
    am = torch.ones(2, 19, dtype=torch.bool)
    am[1, :4] = False
    outs = []
    for on in (True, False):
        ot.ENABLED = on
        xx = x.clone().requires_grad_()
        out = layer(xx, causal=True, attention_mask=am)
        grads = torch.autograd.grad(out.square().sum(), [xx, *layer.parameters()], allow_unused=True)
        outs.append((out, grads))
        if on:
            assert calls and layer.last_plan.kernel == "blocked", layer.last_plan
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-10, atol=1e-10)
    for a, b in zip(outs[0][1], outs[1][1]):
        if a is None or b is None:
            assert a is None and b is None
            continue
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("name", ["shaw", "relative-key-query"])
def test_a_hidden_key_reaches_no_output(name, where, value, monkeypatch):
    """Padded and causally hidden keys holding NaN or inf: every query that may not see them is unchanged and finite
    (the attention zeroes such rows before the kernel; the kernel gives a hidden key probability 0)."""
    calls = _count(monkeypatch)
    layer = _layer(name).eval()
    x = torch.randn(2, 16, 2 * D)
    am = torch.ones(2, 16, dtype=torch.bool)
    am[0, 3] = False  # a padded key in the first sequence
    bad = [(0, 3), (1, 9)]  # (1, 9) is hidden from the queries before it (causal)

    def run(val: float) -> torch.Tensor:
        def hook(_m, _i, out):
            out = out.clone()
            for b, t in bad:
                out[b, t] = val
            return out

        handle = getattr(layer, f"{where}_proj").register_forward_hook(hook)
        try:
            with torch.no_grad():
                return layer(x, causal=True, attention_mask=am)
        finally:
            handle.remove()

    clean, got = run(0.5), run(value)
    assert calls
    keep = torch.ones(2, 16, dtype=torch.bool)
    keep[0, 3] = False  # the padded token itself
    keep[1, 9:] = False  # the queries that see the poisoned key (and it)
    assert torch.isfinite(got[keep]).all()
    torch.testing.assert_close(got[keep], clean[keep], rtol=1e-5, atol=1e-6)
    assert not torch.isfinite(got[1, 9:]).all()  # the queries that do see it are not quietly finite


def test_masked_keys_with_finite_garbage_reach_nothing():
    """Called directly: whatever finite values a masked key holds, no output or gradient of another key moves."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 11, D, generator=g, dtype=torch.float64) for _ in range(3))
    t = Rows(torch.randn(5, 1, D, generator=g, dtype=torch.float64), (torch.arange(21) - 10).clamp(-2, 2) + 2)
    allowed = torch.ones(1, 1, 1, 11, dtype=torch.bool)
    allowed[..., 4] = False
    outs = []
    for scale in (1.0, 1e6):
        k2, v2 = k.clone(), v.clone()
        k2[:, :, 4] *= scale
        v2[:, :, 4] *= scale
        form = RelativeForm(q=q, k=k2, query_terms=[(q, t)], key_terms=[(k2, t)], value_table=t)
        outs.append(relative_attention(form, v2, 0.3, allowed, causal=True))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    ("name", "backend"),
    [("shaw", "aot_eager"), ("relative-key-query", "aot_eager"), ("relative-key-query", "inductor")],
)
def test_compile_keeps_the_kernel_and_equals_eager(name, backend, monkeypatch):
    """torch.compile over the attention (fullgraph: no break at the kernel, a custom op) equals eager, forward and the
    input's gradient; inductor too (it generates the code around the op and keeps the op's C kernel as a call)."""
    torch._dynamo.reset()
    calls = _count(monkeypatch)
    layer = _layer(name)
    x = torch.randn(2, 20, 2 * D)
    compiled = torch.compile(layer, backend=backend, fullgraph=True)
    outs, ran = [], []
    for f in (layer, compiled):
        before = len(calls)
        xx = x.clone().requires_grad_()
        out = f(xx, causal=True)
        (gx,) = torch.autograd.grad(out.square().sum(), [xx])
        outs.append((out, gx))
        ran.append(len(calls) - before)
    assert all(ran), ran  # eager and the compiled graph both ran the kernel
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[1][1], outs[0][1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["shaw", "deberta"])
def test_a_compiled_graph_keeps_the_tables_runs(name, monkeypatch):
    """A clipped table's runs (the offsets past the clip share one row: one number a row, not a band) are found
    inside the op from the index, so a compiled graph, where the index is data, takes them as eager does."""
    torch._dynamo.reset()
    seen: list[list[int]] = []
    real = ot._forward
    monkeypatch.setattr(ot, "_forward", lambda *a: seen.append(list(a[9])) or real(*a))
    layer = _layer(name)
    x = torch.randn(2, 40, 2 * D)
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        want = layer(x, causal=True)
        got = compiled(x, causal=True)
    assert len(seen) == 2 and seen[1] == seen[0], seen  # [lead, trail] per table: the same in the compiled graph
    p = 2 * 40 - 1
    assert any(lead > 0 or trail < p for lead, trail in zip(seen[0][0::2], seen[0][1::2])), seen
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_key_terms_keep_the_blocked_path_without_key_terms(monkeypatch):
    """With KEY_TERMS off a form with a key term is left to the PyTorch blocks; one without is not."""
    monkeypatch.setattr(ot, "KEY_TERMS", False)
    calls = _count(monkeypatch)
    q = torch.randn(1, 2, 9, D, dtype=torch.float64)
    t = torch.randn(17, 1, D, dtype=torch.float64)
    relative_attention(RelativeForm(q=q, k=q, query_terms=[(q, t)], key_terms=[(q, t)]), q, 0.5)
    assert not calls
    relative_attention(RelativeForm(q=q, k=q, query_terms=[(q, t)]), q, 0.5)
    assert calls


def test_threads_split_the_rows(monkeypatch):
    """Split over two threads (each part its own scratch and table gradients, summed): the same as one."""
    monkeypatch.setattr(native.threads, "PARALLEL_NUMEL", 0)
    case = ("clipped", "buckets", "clipped", True, "pad", 2, 3, 15, 15, 2)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _run_both(case, torch.float64, seed=3)[1]
        torch.set_num_threads(2)
        two = _run_both(case, torch.float64, seed=3)[1]
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(two[0], one[0], rtol=1e-12, atol=1e-12)
    for a, b in zip(two[1], one[1]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_keeps_only_the_logsumexp(monkeypatch):
    """The forward saves q, k, v, the tables, the output and one number per row: no block of probabilities."""
    monkeypatch.setattr(fused, "SAVE_BYTES", 1 << 30)  # the blocked path would keep every block
    q = torch.randn(1, 2, 40, D, dtype=torch.float64, requires_grad=True)
    t = torch.randn(79, 1, D, dtype=torch.float64, requires_grad=True)
    saved: list[torch.Size] = []

    def pack(x):
        saved.append(x.shape)
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        relative_attention(RelativeForm(q=q, k=q, query_terms=[(q, t)]), q, 0.5, causal=True)
    assert (1, 2, 40) in saved, saved  # the logsumexp
    assert not any(len(s) >= 2 and s[-2:] == (40, 40) for s in saved), saved  # no [.., Lq, Lk] probabilities
