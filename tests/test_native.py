"""The compiled one-pass RoPE kernel (posenc.native) against the rotation written out from the paper."""

import os
import shutil
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import posenc
from posenc import native
from posenc.base import AttentionContext

HAVE_CC = any(shutil.which(c) for c in ("cc", "gcc", "clang"))
needs_kernel = pytest.mark.skipif(not native.available(), reason="no compiled kernel on this machine")


def literal(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, r: int, interleaved: bool) -> torch.Tensor:
    """RoFormer eq. (34) pair by pair, in float64, with a Python loop over the pairs."""
    x64, c, s = x.double(), cos.double(), sin.double()
    out = x64.clone()
    for i in range(r // 2):
        a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + r // 2)
        out[..., a] = x64[..., a] * c[..., i] - x64[..., b] * s[..., i]
        out[..., b] = x64[..., b] * c[..., i] + x64[..., a] * s[..., i]
    return out


def _env(**extra: str) -> dict[str, str]:
    """This process's environment for a child, without the switches a test leg may have set (POSENC_NATIVE=0,
    POSENC_NATIVE_ISA=...), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in ("POSENC_NATIVE", "POSENC_NATIVE_ISA")}
    return {**env, **extra}


def test_the_kernel_builds_wherever_there_is_a_compiler():
    if not HAVE_CC:
        pytest.skip("no C compiler on this machine")
    if os.environ.get("POSENC_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        pytest.skip("POSENC_NATIVE turns the kernels off in this run")
    assert native.available(), native.status()
    assert "native CPU kernels: /" in native.status()


@needs_kernel
@settings(max_examples=80, deadline=None)
@given(
    b=st.integers(1, 3),
    h=st.integers(1, 4),
    n=st.integers(1, 24),
    d=st.sampled_from([2, 6, 16, 32, 34, 64]),
    part=st.floats(0.01, 1.0),
    interleaved=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    layout=st.sampled_from(["contiguous", "bhld-view", "three-d"]),
    per_row=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_kernel_equals_the_formula_and_its_gradient(b, h, n, d, part, interleaved, dtype, layout, per_row, seed):
    g = torch.Generator().manual_seed(seed)
    r = max(2, 2 * int(part * d / 2))
    if layout == "bhld-view":  # what a projection gives: [B, L, H, d] seen as [B, H, L, d]
        x = torch.randn(b, n, h, d, generator=g, dtype=dtype).transpose(1, 2)
    elif layout == "three-d":
        x = torch.randn(b, n, d, generator=g, dtype=dtype)
    else:
        x = torch.randn(b, h, n, d, generator=g, dtype=dtype)
    ang = torch.rand(b if per_row else 1, n, r // 2, generator=g, dtype=dtype) * 50
    if layout != "three-d":
        ang = ang[:, None]
    cos, sin = ang.cos(), ang.sin()
    x = x.requires_grad_()
    got = native.rope_rotate(x, cos, sin, r, interleaved)
    assert got is not None
    want = literal(x, cos, sin, r, interleaved)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got.double(), want, **tol)
    w = torch.randn(got.shape, generator=g, dtype=dtype)
    (gx,) = torch.autograd.grad((got * w).sum(), x)
    x64 = x.detach().double().requires_grad_()
    (wx,) = torch.autograd.grad((literal(x64, cos, sin, r, interleaved) * w.double()).sum(), x64)
    torch.testing.assert_close(gx.double(), wx, **tol)


@needs_kernel
@pytest.mark.parametrize("r", [64, 32])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_large_tensors_streamed_and_split_over_threads(interleaved, threads, r, monkeypatch):
    """Past NT_BYTES the AVX-512 path writes with streaming stores; past PARALLEL_NUMEL it splits over threads;
    past POPULATE_BYTES (lowered here) the output's pages are mapped first with madvise."""
    monkeypatch.setattr(native, "POPULATE_BYTES", 1 if threads == 2 else 2**40)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(1)
        x = torch.randn(2, 512, 4, 64, generator=g).transpose(1, 2)  # 1 MiB, strided
        assert x.numel() * 4 >= native.NT_BYTES and x.numel() >= native.PARALLEL_NUMEL
        ang = torch.rand(1, 1, 512, r // 2, generator=g) * 100
        x = x.requires_grad_()
        got = native.rope_rotate(x, ang.cos(), ang.sin(), r, interleaved)
        want = literal(x, ang.cos(), ang.sin(), r, interleaved)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
        w = torch.randn(got.shape, generator=g)
        (gx,) = torch.autograd.grad((got * w).sum(), x)  # the backward: the same kernel rotating by -θ
        x64 = x.detach().double().requires_grad_()
        (wx,) = torch.autograd.grad((literal(x64, ang.cos(), ang.sin(), r, interleaved) * w.double()).sum(), x64)
        torch.testing.assert_close(gx.double(), wx, rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(old)


@needs_kernel
def test_where_the_kernel_does_not_apply_it_says_so():
    x = torch.randn(1, 2, 5, 8)
    c, s = torch.ones(1, 1, 5, 4), torch.zeros(1, 1, 5, 4)
    assert native.rope_rotate(x, c, s, 8, False) is not None
    assert native.rope_rotate(x.bfloat16(), c.bfloat16(), s.bfloat16(), 8, False) is None  # dtype
    assert native.rope_rotate(x, c.requires_grad_(), s, 8, False) is None  # learned phases
    assert native.rope_rotate(torch.randn(1, 2, 8, 5).transpose(-1, -2), c, s, 8, False) is None  # strided last dim
    assert native.rope_rotate(x, torch.ones(1, 1, 4, 4), torch.zeros(1, 1, 4, 4), 8, False) is None  # lengths
    assert native.rope_rotate(x, c.detach(), s, 6, False) is None  # r / 2 != phases


@needs_kernel
@pytest.mark.parametrize(
    ("name", "kw"),
    [
        ("rope", {}),
        ("rope-interleaved", {}),
        ("rope", {"rotary_dim": 16}),
        ("rope-ntk", {"factor": 4.0}),
        ("rope-yarn", {"factor": 4.0, "original_max_len": 16}),
    ],
)
def test_encodings_give_the_same_numbers_with_and_without_the_kernel(name, kw, monkeypatch):
    enc = posenc.get(name, head_dim=32, **kw)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 3, 40, 32, generator=g, requires_grad=True)
    k = torch.randn(2, 3, 40, 32, generator=g, requires_grad=True)
    pos = torch.arange(40)[None]
    w = torch.randn(2, 3, 40, 32, generator=g)

    def run():
        a, b = enc.rotate(q, k, AttentionContext(q_pos=pos, k_pos=pos, n_heads=3, head_dim=32))
        return (a, b, *torch.autograd.grad((a * w).sum() + (b * w.flip(-1)).sum(), (q, k)))

    calls = []
    real = native._rope
    monkeypatch.setattr(native, "_rope", lambda *a: calls.append(1) or real(*a))
    fast = run()
    assert calls, "the kernel was not used"
    monkeypatch.setattr(native, "enabled", False)
    slow = run()
    for f, s in zip(fast, slow):
        torch.testing.assert_close(f, s, rtol=1e-5, atol=1e-6)


def test_without_a_compiler_rope_keeps_its_pytorch_path(tmp_path):
    """POSENC_NATIVE=0, no compiler or a failing build turn the kernels off with a reason; RoPE still rotates."""
    code = (
        "import torch, posenc; from posenc import native; "
        "print(native.available()); print(native.status()); "
        "x = torch.randn(1, 2, 3, 4, dtype=torch.float64); e = posenc.get('rope', head_dim=4); "
        "c, s = e.cos_sin(torch.arange(3)[None]); "
        "print(float((e(x) - torch.cat((x[..., :2]*c[:, None] - x[..., 2:]*s[:, None], "
        "x[..., 2:]*c[:, None] + x[..., :2]*s[:, None]), -1)).abs().max()))"
    )
    # disabled; no compiler at all; a compiler that fails (`false` exits 1)
    envs = [{"POSENC_NATIVE": "0"}, {"CC": str(tmp_path / "no-such-cc"), "PATH": str(tmp_path)}]
    if shutil.which("false"):
        envs.append({"CC": "false"})
    for env in envs:
        full = _env(POSENC_CACHE_DIR=str(tmp_path / "cache"), **env)
        out = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, check=True)
        avail, line, err = out.stdout.strip().splitlines()
        assert avail == "False"
        assert "off (" in line and "PyTorch ops are used instead" in line
        assert float(err) < 1e-12
        # one line on stderr says the kernels are off and why, unless POSENC_NATIVE=0 asked for it
        said = [ln for ln in out.stderr.splitlines() if "posenc: native CPU kernels off" in ln]
        if "POSENC_NATIVE" in env:
            assert said == []
        else:
            assert len(said) == 1 and "using the PyTorch paths" in said[0], out.stderr
            assert ("no C compiler" in said[0]) == ("PATH" in env)


def test_the_build_follows_the_cpu_flags(monkeypatch):
    """The runtime dispatch: the best build whose flags the CPU has; only the baseline off x86 or without cpuinfo."""
    monkeypatch.setattr(native, "_is_x86", lambda: True)
    cases = [
        ({"sse2", "avx", "avx2", "fma", "avx512f"}, ["avx512", "avx2", "baseline"]),
        ({"sse2", "avx", "avx2", "fma"}, ["avx2", "baseline"]),
        ({"sse2", "avx", "avx2"}, ["baseline"]),  # AVX2 without FMA (some VIA / emulators): -mfma would trap
        ({"sse2", "avx512f"}, ["baseline"]),
        (None, ["baseline"]),  # no /proc/cpuinfo
    ]
    for flags, want in cases:
        monkeypatch.setattr(native, "_cpu_flags", lambda f=flags: f)
        monkeypatch.delenv("POSENC_NATIVE_ISA", raising=False)
        assert native.supported_isas() == want
        assert native.isa() == want[0]
    monkeypatch.setattr(native, "_is_x86", lambda: False)
    monkeypatch.setattr(native, "_cpu_flags", lambda: {"avx2", "fma", "avx512f"})
    assert native.supported_isas() == ["baseline"]


def test_a_forced_build_is_checked(monkeypatch):
    monkeypatch.setattr(native, "_is_x86", lambda: True)
    monkeypatch.setattr(native, "_cpu_flags", lambda: {"sse2", "avx2", "fma"})
    for value, want in [("baseline", "baseline"), ("AVX2", "avx2"), ("native", "native"), ("auto", "avx2")]:
        monkeypatch.setenv("POSENC_NATIVE_ISA", value)
        assert native.isa() == want
    monkeypatch.setenv("POSENC_NATIVE_ISA", "avx3")
    with pytest.raises(posenc.errors.ConfigError, match="'avx3' names no build; use one of auto, baseline, avx2"):
        native.isa()
    monkeypatch.setenv("POSENC_NATIVE_ISA", "avx512")
    with pytest.raises(posenc.errors.ConfigError, match="this CPU lacks avx512f; it runs avx2, baseline"):
        native.isa()
    monkeypatch.setattr(native, "_is_x86", lambda: False)
    monkeypatch.setenv("POSENC_NATIVE_ISA", "avx2")
    with pytest.raises(posenc.errors.ConfigError, match="is not x86"):
        native.isa()


# every kernel once, on fixed inputs: a child process per build prints its outputs' bytes (hex)
_KERNELS = """
import sys, torch
from posenc import native
assert native.available(), native.status()
g = torch.Generator().manual_seed(0)
out = []
for dt in (torch.float32, torch.float64):
    x = torch.randn(2, 3, 37, 64, generator=g, dtype=dt)
    ang = torch.rand(1, 1, 37, 32, generator=g, dtype=dt) * 30
    out += [native.rope_rotate(x, ang.cos(), ang.sin(), 64, il) for il in (False, True)]
    knots = torch.sort(torch.randn(7, generator=g, dtype=dt)).values
    xs = torch.randn(5, 40, generator=g, dtype=dt).requires_grad_()
    a = torch.randn(8, 3, generator=g, dtype=dt).requires_grad_()
    b = torch.randn(8, 3, generator=g, dtype=dt).requires_grad_()
    f = native.fire_bias(xs, knots, a, b)
    out += [f, *torch.autograd.grad((f * torch.randn(f.shape, generator=g, dtype=dt)).sum(), (xs, a, b))]
    q, k, v = torch.randn(2, 3, 48, generator=g, dtype=dt), *torch.randn(2, 2, 3, 33, 48, generator=g, dtype=dt)
    tab, idx = torch.randn(40, 3, 48, generator=g, dtype=dt), torch.randint(0, 40, (33,), generator=g)
    out.append(native.decode_attention(q, k, v, 0.3, query_term=(q.flip(-1), tab, idx), key_table=(tab, None)))
    out.append(native.rows_dot(k, tab, idx))
print(native.build())
for t in out:
    print(t.detach().contiguous().numpy().tobytes().hex())
"""


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler on this machine")
def test_every_build_this_cpu_runs_gives_the_same_numbers():
    """The builds add vector instructions, not other arithmetic: no -ffast-math, no fused multiply-adds (the flags
    forbid the compiler's, the AVX-512 RoPE multiplies and adds apart), so the baseline, AVX2, AVX-512 and
    -march=native builds agree to the last bit (the AVX-512 one only where the CPU runs it)."""
    outs = {}
    for name in [*native.supported_isas(), "native"]:
        env = _env(POSENC_NATIVE_ISA=name)  # the builds are cached: compiled once per machine
        res = subprocess.run([sys.executable, "-c", _KERNELS], env=env, capture_output=True, text=True, check=True)
        got, *lines = res.stdout.split()
        assert got == name
        outs[name] = lines
    assert len(outs["baseline"]) == 16  # 8 outputs a dtype
    for name, lines in outs.items():
        assert lines == outs["baseline"], name


def fire_literal(x, knots, slope, intercept):
    """``A[s] x + B[s]`` with ``s`` = the number of knots below ``x``, by a comparison per knot (float64)."""
    s = (x.double()[..., None] > knots.double()).sum(-1)
    return (slope.double()[s] * x.double()[..., None] + intercept.double()[s]).movedim(-1, 0)


@needs_kernel
@settings(max_examples=60, deadline=None)
@given(
    m=st.integers(0, 9),
    heads=st.integers(1, 4),
    shape=st.sampled_from([(1, 7, 7), (2, 5, 9), (1, 1, 1), (3, 40)]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    seed=st.integers(0, 2**16),
)
def test_fire_kernel_equals_the_piecewise_formula_and_its_gradient(m, heads, shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    knots = torch.sort(torch.randn(m, generator=g, dtype=dtype)).values
    x = torch.rand(shape, generator=g, dtype=dtype) * 4 - 2
    if m:  # some values exactly on a knot: they take the piece to the left, as torch.searchsorted does
        flat = x.view(-1)
        flat[::3] = knots[torch.randint(0, m, (flat[::3].numel(),), generator=g)]
    slope = torch.randn(m + 1, heads, generator=g, dtype=dtype, requires_grad=True)
    intercept = torch.randn(m + 1, heads, generator=g, dtype=dtype, requires_grad=True)
    x = x.requires_grad_()
    got = native.fire_bias(x, knots, slope, intercept)
    want = fire_literal(x, knots, slope, intercept)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got.double(), want, **tol)
    w = torch.randn(got.shape, generator=g, dtype=dtype)
    grads = torch.autograd.grad((got * w).sum(), (x, slope, intercept))
    x64, a64, b64 = (t.detach().double().requires_grad_() for t in (x, slope, intercept))
    wants = torch.autograd.grad((fire_literal(x64, knots, a64, b64) * w.double()).sum(), (x64, a64, b64))
    for a, b in zip(grads, wants):
        torch.testing.assert_close(a.double(), b, **tol)


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_fire_kernel_on_a_large_input_split_over_threads(threads):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(5)
        knots = torch.sort(torch.randn(12, generator=g, dtype=torch.float64)).values
        x = (torch.rand(1, 300, 300, generator=g, dtype=torch.float64) * 6 - 3).requires_grad_()
        slope = torch.randn(13, 4, generator=g, dtype=torch.float64, requires_grad=True)
        intercept = torch.randn(13, 4, generator=g, dtype=torch.float64, requires_grad=True)
        assert x.numel() * 4 >= native.PARALLEL_NUMEL
        got = native.fire_bias(x, knots, slope, intercept)
        torch.testing.assert_close(got, fire_literal(x, knots, slope, intercept), rtol=1e-12, atol=1e-12)
        w = torch.randn(got.shape, generator=g, dtype=torch.float64)
        grads = torch.autograd.grad((got * w).sum(), (x, slope, intercept))
        wants = torch.autograd.grad((fire_literal(x, knots, slope, intercept) * w).sum(), (x, slope, intercept))
        for a, b in zip(grads, wants):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    finally:
        torch.set_num_threads(old)


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler on this machine")
def test_an_unwritable_cache_falls_back_to_the_temporary_directory(tmp_path):
    code = "from posenc import native; print(native.status())"
    env = _env(POSENC_CACHE_DIR="/proc/posenc-cannot-write-here", TMPDIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip().startswith(f"native CPU kernels: {tmp_path}/posenc-")


@needs_kernel
@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_kernel_twice_differentiable(interleaved):
    """The backward is itself a rotation (by -θ), so gradients of gradients work (gradgradcheck, float64)."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 2, 5, 8, generator=g, dtype=torch.float64, requires_grad=True)
    ang = torch.rand(1, 1, 5, 3, generator=g, dtype=torch.float64) * 10
    c, s = ang.cos(), ang.sin()
    assert torch.autograd.gradcheck(lambda t: native.rope_rotate(t, c, s, 6, interleaved), (x,))
    assert torch.autograd.gradgradcheck(lambda t: native.rope_rotate(t, c, s, 6, interleaved), (x,))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_the_thread_pool_is_remade_in_a_forked_child():
    """A child forked after the parent used the pool gets its own (the parent's worker threads do not exist there;
    submitting to the inherited pool would wait forever)."""
    import multiprocessing as mp

    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert native._threads().submit(sum, [1, 2]).result(timeout=10) == 3  # the parent's pool, with idle workers
        with mp.get_context("fork").Pool(1) as pool:
            assert pool.apply_async(_submit_in_child).get(timeout=60) == 3
    finally:
        torch.set_num_threads(old)


def _submit_in_child():
    return native._threads().submit(sum, [1, 2]).result(timeout=10)


@needs_kernel
@settings(max_examples=60, deadline=None)
@given(
    b=st.integers(1, 2),
    h=st.integers(1, 3),
    lk=st.integers(1, 40),
    d=st.sampled_from([1, 7, 16, 33, 64]),
    per_head=st.booleans(),
    strided=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    seed=st.integers(0, 2**16),
)
def test_rows_dot_equals_the_gathered_product(b, h, lk, d, per_head, strided, dtype, seed):
    """``k_j · T[index_j]`` in one pass equals gathering the rows, multiplying and summing."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(b, lk, h, d, generator=g, dtype=dtype)
    k = k.transpose(1, 2) if strided else k.transpose(1, 2).contiguous()  # a projection's view, or a cache's
    r = lk + 5
    table = torch.randn(r, h, d, generator=g, dtype=dtype) if per_head else torch.randn(r, d, generator=g, dtype=dtype)
    index = torch.randint(0, r, (lk,), generator=g)
    rows = table[index]  # [Lk, (H,) d]
    rows = rows.transpose(0, 1) if per_head else rows
    want = k * rows
    got = native.rows_dot(k, table, index)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(got, want.sum(-1), rtol=tol, atol=tol * d)


@needs_kernel
def test_rows_dot_declines_what_it_cannot_do_and_checks_the_index():
    k = torch.randn(1, 2, 5, 4)
    table = torch.randn(6, 4)
    assert native.rows_dot(k.requires_grad_(), table, torch.arange(5)) is None  # a gradient to record
    assert native.rows_dot(k.detach().double(), table, torch.arange(5)) is None  # mixed dtypes
    assert native.rows_dot(k.detach(), table, torch.arange(5).int()) is None  # not a long index
    with pytest.raises(IndexError, match="out of range for a table of 6 rows"):
        native.rows_dot(k.detach(), table, torch.tensor([0, 1, 2, 3, 6]))


@needs_kernel
@pytest.mark.parametrize(
    "name, options, kernel_on",
    [
        ("relative-key-query", {"max_len": 64}, "decode"),
        ("deberta", None, "decode"),
        ("contextual-2", None, "decode"),
        ("deberta", {"pos_att_type": ("c2p", "p2c", "p2p")}, "sdpa"),  # no offset-table form: rows_dot in the hooks
    ],
)
def test_decoding_gives_the_full_forwards_numbers_with_and_without_the_kernels(name, options, kernel_on, monkeypatch):
    """KV-cache decoding equals the full forward with the native kernels (the decode kernel, or rows_dot in the
    hooks where there is no form) and without them (the PyTorch hooks)."""
    torch.manual_seed(0)
    model = posenc.LanguageModel(
        40, encoding=name, encoding_options=options, d_model=32, n_heads=4, n_layers=2, max_len=64
    ).double()
    model.eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    tokens = torch.randint(0, 40, (2, 30))
    computed = []  # rows_dot calls with the kernels on
    real = native.rows_dot
    monkeypatch.setattr(native, "rows_dot", lambda *a: computed.append(1) or real(*a) if native.enabled else real(*a))
    with torch.no_grad():
        full = model(tokens)
        for on in (True, False):
            monkeypatch.setattr(native, "enabled", on)
            cache = posenc.KVCache()
            steps = [model(tokens[:, :20], kv_cache=cache)]
            for t in range(20, 30):
                steps.append(model(tokens[:, t : t + 1], kv_cache=cache))
                kernels = {blk.attn.last_plan.kernel for blk in model.trunk.blocks}
                assert kernels == ({kernel_on} if on else {"sdpa"}), (on, kernels)
            torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-10, atol=1e-11)
    assert bool(computed) == (kernel_on == "sdpa")  # rows_dot ran exactly where the hooks took the decoding steps


@needs_kernel
@settings(max_examples=60, deadline=None)
@given(
    b=st.integers(1, 2),
    h=st.integers(1, 3),
    lk=st.integers(1, 40),
    d=st.sampled_from([1, 7, 16, 64]),
    with_query_term=st.booleans(),
    with_key_table=st.booleans(),
    indexed=st.booleans(),
    masked=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    seed=st.integers(0, 2**16),
)
def test_decode_attention_equals_the_softmax_formula(
    b, h, lk, d, with_query_term, with_key_table, indexed, masked, dtype, seed
):
    """One query over its keys with a query term, a key term and a mask, in one pass: the softmax written out."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype)

    q, a = rnd(b, h, d), rnd(b, h, d)
    k = rnd(b, lk, h, d).transpose(1, 2)  # a projection's strided view
    v = rnd(b, h, lk, d)
    r = lk + 3
    table_t, table_u = rnd(r, h, d), rnd(r, 1, d)
    ti = torch.randint(0, r, (lk,), generator=g) if indexed else None
    ui = torch.randint(0, r, (lk,), generator=g) if indexed else None
    add = rnd(1, h, lk)
    if masked and lk > 1:
        add[0, 0, 0] = float("-inf")  # one key dropped for head 0
    s = (k @ q[..., None])[..., 0]
    rows_t = table_t[ti] if indexed else table_t[:lk]  # [Lk, H, d]
    rows_u = table_u[ui] if indexed else table_u[:lk]  # [Lk, 1, d]
    if with_query_term:
        s = s + torch.einsum("bhd,jhd->bhj", a, rows_t)
    if with_key_table:
        s = s + torch.einsum("bhjd,jd->bhj", k, rows_u[:, 0])
    s = 0.7 * s + add
    want = torch.einsum("bhj,bhjd->bhd", torch.softmax(s, -1), v)
    got = native.decode_attention(
        q,
        k,
        v,
        0.7,
        query_term=(a, table_t, ti) if with_query_term else None,
        key_table=(table_u, ui) if with_key_table else None,
        add=add,
    )
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@needs_kernel
def test_decode_attention_declines_what_it_cannot_do():
    q, k = torch.randn(1, 2, 4), torch.randn(1, 2, 5, 4)
    assert native.decode_attention(q.requires_grad_(), k, k, 1.0) is None  # a gradient to record
    assert native.decode_attention(q.detach().double(), k, k, 1.0) is None  # mixed dtypes
    assert (
        native.decode_attention(torch.randn(1, 2, 300), torch.randn(1, 2, 5, 300), torch.randn(1, 2, 5, 300), 1.0)
        is None
    )
    with pytest.raises(IndexError, match="out of range for a table of 6 rows"):
        native.decode_attention(q.detach(), k, k, 1.0, key_table=(torch.randn(6, 1, 4), torch.tensor([0, 1, 2, 3, 6])))
