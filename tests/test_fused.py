"""posenc.fused: the row-blocked relative attention against the formula written out, and the attention's use of it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from shape_recorder import ShapeRecorder

import posenc
import posenc.fused as fused
from posenc.attention import MultiHeadAttention
from posenc.fused import RelativeForm, Rows, relative_attention
from posenc.registry import accepted_arguments, build, example, example_options


class NewTensors(ShapeRecorder):
    """Shapes of the tensors an operation *allocates* (views of existing storage left out)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.shapes.append(tuple(t.shape))
        return out


F64 = torch.float64


def expand(table):
    """A :class:`Rows` table at every offset: ``[P, H|1, d]``."""
    return table.table[table.index] if isinstance(table, Rows) else table


def literal(form: RelativeForm, v: torch.Tensor, scale: float, allowed: torch.Tensor | None) -> torch.Tensor:
    """The module docstring's formula with every [Lq, Lk, d] table gathered explicitly (float64 reference)."""
    q, k = form.q, form.k
    lq, lk = q.shape[2], k.shape[2]
    t = torch.arange(lk)[None, :] - torch.arange(lq)[:, None] + lq - 1  # [Lq, Lk]
    form = RelativeForm(
        q=form.q,
        k=form.k,
        query_terms=[(a, expand(x)) for a, x in form.query_terms],
        key_terms=[(c, expand(x)) for c, x in form.key_terms],
        value_table=None if form.value_table is None else expand(form.value_table),
        segment=form.segment,
    )
    logits = q @ k.transpose(-1, -2)
    for a, table in form.query_terms:
        g = table[t].permute(2, 0, 1, 3)  # [H|1, Lq, Lk, d]
        logits = logits + torch.einsum("bhid,hijd->bhij", a, g.expand(q.shape[1], -1, -1, -1))
    for c, table in form.key_terms:
        g = table[t].permute(2, 0, 1, 3)
        logits = logits + torch.einsum("bhjd,hijd->bhij", c, g.expand(q.shape[1], -1, -1, -1))
    if form.segment is not None:
        e, same = form.segment
        logits = logits + torch.where(same[:, None], e[..., :1], e[..., 1:])
    logits = logits * scale
    if allowed is not None:
        logits = logits.masked_fill(~allowed, torch.finfo(logits.dtype).min)
    p = torch.softmax(logits, -1)
    out = p @ v
    if form.value_table is not None:
        g = form.value_table[t].permute(2, 0, 1, 3)
        out = out + torch.einsum("bhij,hijd->bhid", p, g.expand(q.shape[1], -1, -1, -1))
    return out


def random_case(
    seed: int,
    b: int,
    h: int,
    lq: int,
    lk: int,
    d: int,
    nq: int,
    nk: int,
    values: bool,
    seg: bool,
    shared: bool,
    mask: str,
    compact: bool = False,
):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=F64).requires_grad_()

    p, th = lq + lk - 1, 1 if shared else h

    def table():
        """A table at every offset, or (compact) a few rows and a random row per offset (runs included)."""
        if not compact:
            return r(p, th, d)
        rows = int(torch.randint(1, 6, (1,), generator=g))
        index = torch.randint(0, rows, (p,), generator=g).sort().values if p > 3 else torch.zeros(p, dtype=torch.long)
        return Rows(r(rows, th, d), index)

    form = RelativeForm(
        q=r(b, h, lq, d),
        k=r(b, h, lk, d),
        query_terms=[(r(b, h, lq, d), table()) for _ in range(nq)],
        key_terms=[(r(b, h, lk, d), table()) for _ in range(nk)],
        value_table=table() if values else None,
        segment=(
            r(b, h, lq, 2),
            torch.randint(0, 2, (b, lq, 1), generator=g) == torch.randint(0, 2, (b, 1, lk), generator=g),
        )
        if seg
        else None,
    )
    v = r(b, h, lk, d)
    allowed = None
    if mask == "padding":
        allowed = torch.ones(b, 1, 1, lk, dtype=torch.bool)
        allowed[-1, ..., : lk // 2] = False
    elif mask == "causal":
        allowed = (torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq))[None, None]
    elif mask == "random":
        allowed = torch.rand(b, h, lq, lk, generator=g) > 0.3
        allowed[..., 0] = True
    return form, v, allowed


def expand_leaf(table):
    return table.table if isinstance(table, Rows) else table


def leaves(form: RelativeForm, v: torch.Tensor) -> list[torch.Tensor]:
    out = [form.q, form.k, v]
    for op, table in form.query_terms + form.key_terms:
        out += [op, table.table if isinstance(table, Rows) else table]
    if form.value_table is not None:
        out.append(expand_leaf(form.value_table))
    if form.segment is not None:
        out.append(form.segment[0])
    return out


@settings(max_examples=100, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    b=st.integers(1, 2),
    h=st.integers(1, 3),
    lq=st.integers(1, 40),
    lk=st.integers(1, 52),
    d=st.sampled_from([1, 4, 8]),
    nq=st.integers(0, 2),
    nk=st.integers(0, 2),
    values=st.booleans(),
    seg=st.booleans(),
    shared=st.booleans(),
    mask=st.sampled_from(["none", "padding", "causal", "random"]),
    block=st.sampled_from([1, 2**10, 2**20]),
    ratio=st.sampled_from([0.25, 1.0]),
    compact=st.booleans(),
    save=st.sampled_from([0, 2**40]),
)
def test_kernel_equals_the_formula(
    seed, b, h, lq, lk, d, nq, nk, values, seg, shared, mask, block, ratio, compact, save
):
    """Random shapes (Lk > Lq as with memory, Lk < Lq as in cross-attention), every term and mask, 16-row blocks,
    probabilities kept for the backward or recomputed there."""
    form, v, allowed = random_case(seed, b, h, lq, lk, d, nq, nk, values, seg, shared, mask, compact)
    old = fused.BLOCK_BYTES, fused.CHUNK_RATIO, fused.SAVE_BYTES
    # 1 byte: blocks of 16 rows, key chunks of 16 or 4
    fused.BLOCK_BYTES, fused.CHUNK_RATIO, fused.SAVE_BYTES = block, ratio, save
    try:
        got = relative_attention(form, v, 0.37, allowed)
    finally:
        fused.BLOCK_BYTES, fused.CHUNK_RATIO, fused.SAVE_BYTES = old
    want = literal(form, v, 0.37, allowed)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    weight = torch.randn(got.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=F64)
    fused.BLOCK_BYTES, fused.CHUNK_RATIO = block, ratio
    try:
        g_got = torch.autograd.grad((got * weight).sum(), leaves(form, v))
    finally:
        fused.BLOCK_BYTES, fused.CHUNK_RATIO = old[:2]
    g_want = torch.autograd.grad((want * weight).sum(), leaves(form, v))
    for x, y in zip(g_got, g_want):
        torch.testing.assert_close(x, y, rtol=1e-9, atol=1e-11)


def test_kernel_never_makes_a_full_score_tensor(monkeypatch):
    """Past SAVE_BYTES, forward and backward: no tensor as large as [B, H, Lq, Lk] (a block is [H, b, Lk]:
    all heads of one sequence's rows)."""
    monkeypatch.setattr(fused, "BLOCK_BYTES", 1)  # 16-row blocks
    monkeypatch.setattr(fused, "SAVE_BYTES", 0)
    b, h, lq, lk, d = 2, 2, 64, 64, 4
    form, v, allowed = random_case(0, b, h, lq, lk, d, 1, 1, True, True, False, "padding")
    with NewTensors() as rec:
        out = relative_attention(form, v, 0.5, allowed)
        out.sum().backward()
    biggest = max(torch.Size(s).numel() for s in rec.shapes)
    assert biggest < lq * lk  # smaller than the scores of even one head
    assert form.q.grad is not None and form.value_table is not None and form.value_table.grad is not None


def grads_and_score_products(form, v, allowed, saves, monkeypatch) -> tuple[list, list[int]]:
    """Per ``SAVE_BYTES`` in ``saves``: the gradients of a weighted sum of the output, and how many ``[Lq, d] x
    [d, Lk]`` products the backward made (one block per head: ``q kᵀ`` where it recomputes, ``dO vᵀ`` always), a
    product batched over the heads (``torch.bmm``, ``[H, Lq, d] x [H, d, Lk]``) counting once per head."""
    b, h, lq, d = form.q.shape
    lk = form.k.shape[2]
    weight = torch.randn(b, h, lq, d, dtype=F64)
    real = {"mm": torch.mm, "bmm": torch.bmm}
    grads, counts = [], []
    for save in saves:
        monkeypatch.setattr(fused, "SAVE_BYTES", save)
        out = relative_attention(form, v, 0.5, allowed)
        shapes: list[tuple] = []

        def counting(name, shapes=shapes):
            def product(a, b_, **kw):
                shapes.append((tuple(a.shape), tuple(b_.shape)))
                return real[name](a, b_, **kw)

            return product

        for name in real:
            monkeypatch.setattr(torch, name, counting(name))
        grads.append(torch.autograd.grad((out * weight).sum(), leaves(form, v)))
        for name, fn in real.items():
            monkeypatch.setattr(torch, name, fn)
        counts.append(shapes.count(((lq, d), (d, lk))) + h * shapes.count(((h, lq, d), (h, d, lk))))
    return grads, counts


def test_kept_probabilities_spare_the_backward_every_score(monkeypatch):
    """Within SAVE_BYTES the forward keeps one [Lq, Lk] tensor of probabilities per head and the backward computes
    no score again (no q·kᵀ product), with the same gradients as when it recomputes them."""
    b, h, lq, lk, d = 2, 2, 24, 30, 4
    form, v, allowed = random_case(3, b, h, lq, lk, d, 1, 1, True, True, False, "causal")
    grads, counts = grads_and_score_products(form, v, allowed, (0, 2**40), monkeypatch)
    # [Lq, d] x [d, Lk] per head (one block): q kᵀ when recomputing, and dO vᵀ always
    assert counts == [2 * b * h, b * h]
    for x, y in zip(*grads):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-13)


def test_probabilities_kept_up_to_the_budget(monkeypatch):
    """A budget of two heads' probabilities: the forward keeps the first sequence's (its one block, both heads at
    once), the backward recomputes the scores of the other two heads only, with the gradients of keeping none."""
    b, h, lq, lk, d = 2, 2, 24, 30, 4
    form, v, allowed = random_case(4, b, h, lq, lk, d, 1, 1, True, False, False, "causal", True)
    grads, counts = grads_and_score_products(form, v, allowed, (0, 2 * lq * lk * 8 + 7), monkeypatch)
    assert counts == [2 * b * h, b * h + 2]
    for x, y in zip(*grads):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-13)


def test_kernel_rejects_mismatched_tables():
    form, v, _ = random_case(0, 1, 2, 5, 5, 4, 1, 0, False, False, False, "none")
    bad = RelativeForm(q=form.q, k=form.k, query_terms=[(form.query_terms[0][0], torch.zeros(8, 2, 4, dtype=F64))])
    with pytest.raises(ValueError, match=r"table of a query term must be \[9, 2\|1, 4\], got \(8, 2, 4\)"):
        relative_attention(bad, v, 1.0)
    rows = RelativeForm(q=form.q, k=form.k, value_table=Rows(torch.zeros(3, 1, 4, dtype=F64), torch.zeros(8).long()))
    with pytest.raises(ValueError, match=r"row index of the value table must be \[9\]"):
        relative_attention(rows, v, 1.0)
    with pytest.raises(ValueError, match=r"allowed must be \[B\|1, H\|1, Lq\|1, Lk\]"):
        relative_attention(form, v, 1.0, torch.ones(5, 5, dtype=torch.bool))


FORM_DIMS = dict(d_model=32, n_heads=4, head_dim=8, max_len=40, n_layers=1, causal=False, vocab_size=50)
# clip and bucket distances shorter than the 37 tokens below, for every encoding that takes them (by setting name)
SHORT = {"max_relative_position": 3, "num_buckets": 8, "max_distance": 12, "position_buckets": 8, "clip": True}
SHORT_MAX_LEN = 16  # with clip or position_buckets: a table shorter than the sequence


def form_encodings() -> list[str]:
    """Every registered encoding that offers a relative_form with the settings it declares (discovered)."""
    return [n for n in posenc.available() if example(n, FORM_DIMS).offers_relative_form()]


def form_options(name: str, short: bool = True) -> dict:
    options = example_options(name, FORM_DIMS)
    if short:
        accepted = accepted_arguments(posenc.resolve(name))
        extra = {k: v for k, v in SHORT.items() if k in accepted}
        if extra.keys() & {"clip", "position_buckets"} and "max_len" in accepted:
            extra["max_len"] = SHORT_MAX_LEN
        options.update(extra)
    return options


CASES = [(n, s) for n in form_encodings() for s in ("plain", "causal+padding", "memory")]
CASES += [(n, "example") for n in form_encodings() if form_options(n) != form_options(n, short=False)]
CASES += [("xlnet", "segments")]


@pytest.mark.parametrize(("name", "setting"), CASES)
def test_attention_uses_the_kernel_and_matches_both_other_paths(name, setting, monkeypatch):
    """fused == the hook-by-hook fast path == the reference path, outputs and every gradient (float64)."""
    calls = []
    real = fused._RelativeAttention.apply
    monkeypatch.setattr(fused._RelativeAttention, "apply", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(fused, "BLOCK_BYTES", 1)  # several blocks and key chunks even at L = 37
    torch.manual_seed(3)
    enc = build(name, dims=FORM_DIMS, options=form_options(name, short=setting != "example")).double()
    enc.fused_min_pairs = 1  # the kernel even at L = 37 (its default threshold is for speed only)
    with torch.no_grad():
        for p in enc.parameters():  # away from zero-initialised tables, so that a dropped term shows
            p.add_(torch.randn_like(p))
    layers = [MultiHeadAttention(32, 4, enc, path=p).double() for p in ("fast", "fast", "reference")]
    layers[1].fused = False
    for layer in layers[1:]:
        layer.load_state_dict(layers[0].state_dict())
    x = torch.randn(2, 37, 32, dtype=F64)
    kw: dict = {}
    if setting == "causal+padding":
        am = torch.ones(2, 37, dtype=torch.bool)
        am[0, :6] = False
        kw = dict(causal=True, attention_mask=am)
    elif setting == "memory":
        kw = dict(memory=torch.randn(2, 11, 32, dtype=F64), causal=True)
    elif setting == "segments":
        kw = dict(segment_ids=(torch.arange(37) >= 20).long()[None].expand(2, -1))
    results = []
    for i, layer in enumerate(layers):
        xx = x.clone().requires_grad_()
        n_before = len(calls)
        out = layer(xx, **kw)
        assert (len(calls) > n_before) == (i == 0)  # only the first layer took the kernel
        params = [xx, *layer.parameters()]
        grads = torch.autograd.grad(
            (out * torch.linspace(-1, 1, out.numel(), dtype=F64).view_as(out)).sum(), params, allow_unused=True
        )
        results.append((out, grads))
    for out, grads in results[1:]:
        torch.testing.assert_close(results[0][0], out, rtol=1e-9, atol=1e-11)
        for a, b in zip(results[0][1], grads):
            if a is None or b is None:
                assert (a is None or not a.any()) and (b is None or not b.any())
                continue
            torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)


def test_kernel_is_skipped_where_it_does_not_apply(monkeypatch):
    """Arbitrary positions and returned weights keep the hook paths; dropout and inference take the kernel."""
    calls = []
    real = fused._RelativeAttention.apply
    monkeypatch.setattr(fused._RelativeAttention, "apply", lambda *a: calls.append(1) or real(*a))
    enc = build("shaw", dims=dict(d_model=16, n_heads=2, head_dim=8, max_len=32), options={}).double()
    enc.fused_min_pairs = 1
    layer = MultiHeadAttention(16, 2, enc, dropout=0.5).double()
    x = torch.randn(1, 9, 16, dtype=F64)
    layer.eval()
    layer(x, positions=torch.arange(9) * 2)
    assert layer.last_plan.kernel == "materialised" and not layer.last_plan.contiguous
    layer(x, return_weights=True)
    assert not calls
    layer.train()
    layer(x)  # attention dropout runs in the kernel (no fallback)
    assert len(calls) == 1 and layer.last_plan.kernel == "blocked" and layer.last_plan.dropout == 0.5
    layer.eval()
    with torch.no_grad():
        layer(x)  # inference takes it too
    assert len(calls) == 2


def test_short_sequences_keep_the_batched_hook_path(monkeypatch):
    """Below an encoding's fused_min_pairs the attention keeps its batched path (faster there), same numbers."""
    calls = []
    real = fused._RelativeAttention.apply
    monkeypatch.setattr(fused._RelativeAttention, "apply", lambda *a: calls.append(1) or real(*a))
    enc = build("transformer-xl", dims=dict(d_model=16, n_heads=2, head_dim=8, max_len=32), options={}).double()
    layer = MultiHeadAttention(16, 2, enc).double()
    x = torch.randn(2, 9, 16, dtype=F64)
    short = layer(x)
    assert not calls and 9 * 9 < enc.fused_min_pairs
    enc.fused_min_pairs = 81
    torch.testing.assert_close(layer(x), short, rtol=1e-10, atol=1e-12)
    assert calls


@pytest.mark.parametrize("compact", [False, True])
@pytest.mark.parametrize("lk", [48, 53])  # whole key chunks only, and a last partial chunk
def test_key_terms_in_tiles(compact, lk, monkeypatch):
    """Blocks of 16 rows, key chunks of 16 (the last one partial or not): a key term tile by tile."""
    monkeypatch.setattr(fused, "BLOCK_BYTES", 1)
    monkeypatch.setattr(fused, "CHUNK_RATIO", 1.0)
    form, v, allowed = random_case(7, 2, 2, 40, lk, 4, 0, 2, False, False, False, "causal", compact)
    got, want = relative_attention(form, v, 0.6, allowed), literal(form, v, 0.6, allowed)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    weight = torch.randn(got.shape, generator=torch.Generator().manual_seed(2), dtype=F64)
    for x, y in zip(
        torch.autograd.grad((got * weight).sum(), leaves(form, v)),
        torch.autograd.grad((want * weight).sum(), leaves(form, v)),
    ):
        torch.testing.assert_close(x, y, rtol=1e-9, atol=1e-11)


def clipped_rows(p: int, lq: int, k: int, reverse: bool = False) -> torch.Tensor:
    """A clip of the offsets (Shaw's ``clip(j - i, k) + k``; reversed: a decreasing index), long runs at both ends."""
    rows = (torch.arange(p) - (lq - 1)).clamp(-k, k) + k
    return 2 * k - rows if reverse else rows


@pytest.mark.parametrize("min_run", [1, 5, None])  # None: the tables expanded to every offset
@pytest.mark.parametrize(("lq", "lk"), [(40, 40), (24, 56), (56, 24)])
@pytest.mark.parametrize("mask", ["none", "causal", "causal-flag", "padding"])
@pytest.mark.parametrize("save", [0, 2**40])
def test_runs_of_one_row_are_broadcast(min_run, lq, lk, mask, save, monkeypatch):
    """Compact tables whose index starts and ends in long runs of one row (a clip): where a block's queries all sit
    in a run, the term is added per query (query and value terms) or per key (key terms) instead of through the
    skewed buffers; 16-row blocks and key chunks, every term compact, equal to the formula with its gradients. The
    same tables expanded: with ``causal=True`` the products skip the offsets past the diagonal."""
    if mask == "causal-flag" and lk < lq:
        pytest.skip("causal needs Lk >= Lq")
    monkeypatch.setattr(fused, "BLOCK_BYTES", 1)
    monkeypatch.setattr(fused, "CHUNK_RATIO", 1.0)
    monkeypatch.setattr(fused, "SAVE_BYTES", save)
    monkeypatch.setattr(fused, "MIN_RUN", min_run or 1)
    b, h, d, p = 2, 2, 4, lq + lk - 1
    form, v, allowed = random_case(11, b, h, lq, lk, d, 0, 0, False, False, False, mask.removesuffix("-flag"))
    g = torch.Generator().manual_seed(5)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=F64).requires_grad_()

    form.query_terms = [(r(b, h, lq, d), Rows(r(7, h, d), clipped_rows(p, lq, 3)))]
    form.key_terms = [
        (r(b, h, lk, d), Rows(r(9, 1, d), clipped_rows(p, lq, 4))),
        (r(b, h, lk, d), Rows(r(7, h, d), clipped_rows(p, lq, 3, reverse=True))),
    ]
    form.value_table = Rows(r(5, 1, d), clipped_rows(p, lq, 2))
    if min_run is None:
        form.query_terms = [(a, expand(t)) for a, t in form.query_terms]
        form.key_terms = [(c, expand(t)) for c, t in form.key_terms]
        form.value_table = expand(form.value_table)
    causal = mask == "causal-flag"
    got = relative_attention(form, v, 0.45, None if causal else allowed, causal=causal)
    want = literal(form, v, 0.45, allowed)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    weight = torch.randn(got.shape, generator=g, dtype=F64)
    for x, y in zip(
        torch.autograd.grad((got * weight).sum(), leaves(form, v)),
        torch.autograd.grad((want * weight).sum(), leaves(form, v)),
    ):
        torch.testing.assert_close(x, y, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("name", ["transformer-xl", "deberta", "shaw"])
def test_bfloat16_inputs_stay_close_to_float64(name):
    """bf16 on CPU: the kernel runs in the input dtype and lands within bf16 rounding of the float64 answer."""
    torch.manual_seed(5)
    dims = dict(d_model=32, n_heads=4, head_dim=8, max_len=64, n_layers=1, causal=False, vocab_size=50)
    enc = build(name, dims=dims, options=form_options(name))
    enc.fused_min_pairs = 1
    with torch.no_grad():
        for p in enc.parameters():  # position terms as large as the content ones
            p.add_(torch.randn_like(p))
    layer = MultiHeadAttention(32, 4, enc)
    x = torch.randn(2, 40, 32)
    want = layer.double()(x.double())
    got = layer.to(torch.bfloat16)(x.to(torch.bfloat16))
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, rtol=5e-2, atol=2e-2)


@pytest.mark.parametrize("save", [0, 2**40])
@pytest.mark.parametrize(("compact", "padded"), [(False, slice(5, 8)), (True, slice(5, 8)), (False, slice(0, 11))])
def test_dropout_masks_drawn_again_in_the_backward(save, compact, padded, monkeypatch):
    """With dropout, the backward draws the forward's masks again (per head and block of rows): with
    the global seed fixed the call is a function, whose gradients are checked against finite differences; every
    term, a value table, a bias, a padding mask and causal, probabilities kept or recomputed. Padding the first 11
    keys, queries 0-7 of the second sequence see no key: their output (uniform weights) has no gradient through the
    scores, past the causal diagonal either."""
    monkeypatch.setattr(fused, "BLOCK_BYTES", 1)
    monkeypatch.setattr(fused, "CHUNK_RATIO", 1.0)
    monkeypatch.setattr(fused, "SAVE_BYTES", save)
    form, v, _ = random_case(13, 2, 2, 20, 23, 3, 1, 1, True, True, False, "none", compact)
    allowed = torch.ones(2, 1, 1, 23, dtype=torch.bool)
    allowed[-1, ..., padded] = False
    bias = torch.randn(1, 2, 20, 23, dtype=F64, requires_grad=True)
    inputs = leaves(form, v) + [bias]

    def call(*xs):
        torch.manual_seed(0)
        return relative_attention(form, v, 0.4, allowed, bias=xs[-1], dropout=0.3, causal=True)

    out = call(*inputs)
    assert (out != call(*inputs)).sum() == 0 and relative_attention(form, v, 0.4, allowed, causal=True).ne(out).any()
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    grads = torch.autograd.grad((out * weight).sum(), inputs)
    # a directional derivative per input, against a central difference
    for x, g in zip(inputs, grads):
        step = torch.randn(x.shape, generator=torch.Generator().manual_seed(2), dtype=F64) * 1e-6
        with torch.no_grad():
            x.add_(step)
            up = (call(*inputs) * weight).sum()
            x.sub_(2 * step)
            down = (call(*inputs) * weight).sum()
            x.add_(step)
        torch.testing.assert_close((up - down) / 2, (g * step).sum(), rtol=1e-5, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_a_compact_table_of_nearly_every_offset_is_expanded_and_its_gradient_folded_back(causal):
    """A :class:`Rows` table with more than half as many rows as offsets (what the compiled op receives, where
    offset_table keeps one form for every length) is expanded inside the kernel, as offset_table does eagerly, and
    its gradient summed back per row: the same outputs and gradients as the table given expanded."""
    g = torch.Generator().manual_seed(3)
    b, h, lq, lk, d = 2, 3, 40, 40, 8
    p = lq + lk - 1
    index = torch.randint(0, p - 9, (p,), generator=g).sort().values  # p - 9 rows: two offsets share some
    tabs = [torch.randn(p - 9, 1 if i else h, d, generator=g, dtype=F64) for i in range(3)]
    q, k, a, c, v = (torch.randn(b, h, n, d, generator=g, dtype=F64) for n in (lq, lk, lq, lk, lk))

    def run(compact: bool):
        leaves = [t.clone().requires_grad_() for t in (q, k, a, c, v, *tabs)]
        q_, k_, a_, c_, v_, t1, t2, t3 = leaves
        tab = (lambda t: Rows(t, index)) if compact else (lambda t: t[index])
        form = RelativeForm(q=q_, k=k_, query_terms=[(a_, tab(t1))], key_terms=[(c_, tab(t2))], value_table=tab(t3))
        out = relative_attention(form, v_, 0.3, causal=causal)
        grads = torch.autograd.grad((out * torch.cos(out)).sum(), leaves)
        return out, grads

    out_c, grads_c = run(True)
    out_e, grads_e = run(False)
    torch.testing.assert_close(out_c, out_e, rtol=1e-12, atol=1e-12)
    for x, y in zip(grads_c, grads_e):
        torch.testing.assert_close(x, y, rtol=1e-11, atol=1e-11)
