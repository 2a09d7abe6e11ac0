"""Each encoding's declared floor (:meth:`posenc.base.PositionalEncoding.cost`) against an independent count.

The count: ``torch.utils.flop_counter.FlopCounterMode`` over the *reference* attention (``path="reference"``, the
formula as written, materialised), minus the same attention with no encoding. The counter sees matrix products
only (``mm``, ``bmm``, ``addmm``: einsum and linear layers go through them), not adds, gates or lookups, so:

* the products an encoding declares are checked against what the reference computes. The reference is measured
  at batch 1 and 2 and at three lengths, which separates its work into the part that grows with the batch (per
  pair ``a·L²`` and per token ``b·L``, per head) and the position-only part (``P(L)``: tables of offsets, computed
  once for the batch). Where the reference's batch part is ``a·L² + b·L`` (checked at the third length), ``a`` must
  equal the declared per-pair products: that is the term that sets the floor at long L. The per-token products
  may be lower than the reference's (the floor folds Transformer-XL's ``u·k_j`` into the query, the reference
  computes it literally), never higher. The position-only part is the declared row cost times either the rows the
  floor declares or one row per pair (a reference that projects ``R_{i-j}`` for every pair, as the formula reads).
  Where the reference's batch part is not of that form (it evaluates a sum over the keys as a product: more than
  ``L²`` work), the declared products must still be below it: a floor is a lower bound of every exact evaluation.
* the elementwise work an encoding declares (a bias add, a rotation, CoPE's gate and interpolation) is invisible
  to the counter: it must be small against the ``4·d`` products plain attention spends per pair and head
  (``q·k`` and ``p·v``), which is what makes such an encoding's floor ``≈ 1`` whatever its exact count.

No encoding is named: every registered one is built from the model sizes (``posenc.registry.example``).
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import posenc
from posenc import registry
from posenc.base import Cost, PositionalEncoding

D, H = 128, 4
DH = D // H  # 32: 4·d = 128 products per pair, against which elementwise work is "small"
LENGTHS = (48, 96, 144)  # the fit uses the first two, the third checks that the reference is a·L² + b·L
DIMS = dict(d_model=D, n_heads=H, head_dim=DH, max_len=256, vocab_size=64, n_layers=2)
ENCODINGS = posenc.available()


def flops(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def attention_flops(name: str | None, batch: int, length: int) -> int:
    """Products of one reference attention forward (projections included), bidirectional, no mask."""
    torch.manual_seed(0)
    enc = None if name is None else registry.example(name, DIMS)
    att = posenc.MultiHeadAttention(D, H, enc, path="reference").eval()
    x = torch.randn(batch, length, D)
    with torch.no_grad():
        return flops(lambda: att(x))


@functools.cache
def baseline(batch: int, length: int) -> int:
    return attention_flops(None, batch, length)


@functools.cache
def measured(name: str) -> dict[int, tuple[float, float]]:
    """Per length: (the reference's extra products per sequence, its position-only extra products)."""
    out = {}
    for L in LENGTHS:
        one = attention_flops(name, 1, L) - baseline(1, L)
        two = attention_flops(name, 2, L) - baseline(2, L)
        out[L] = (two - one, 2 * one - two)
    return out


def declared(name: str) -> Cost:
    return registry.example(name, DIMS).cost(DH)


@pytest.mark.parametrize("name", ENCODINGS)
def test_every_encoding_declares_its_cost(name):
    """No encoding is left at the base class's "nothing extra" by accident: its class (or the class it inherits
    the method from) declares one, with its derivation in words."""
    cls = registry.resolve(name)
    assert cls.cost is not PositionalEncoding.cost, f"{name} declares no cost(): add one in its file"
    cost = declared(name)
    assert isinstance(cost, Cost) and cost.note, f"{name}: a Cost with a note saying where it comes from"
    if cls.hooks() - {"positions"}:  # a hook that acts: some work is declared
        work = (cost.pair, cost.pair_elementwise, cost.token, cost.token_elementwise, cost.row, cost.embed)
        assert any(work) or cost.embed_elementwise, f"{name} has hooks {sorted(cls.hooks())} but declares no work"


@pytest.mark.parametrize("name", ENCODINGS)
def test_declared_products_match_the_reference(name):
    cost = declared(name)
    got = measured(name)
    (l1, l2, l3) = LENGTHS
    s1, s2, s3 = (got[L][0] / H for L in LENGTHS)
    # per head: s(L) = a·L² + b·L from the first two lengths
    a = (s2 / l2 - s1 / l1) / (l2 - l1)
    b = s1 / l1 - a * l1
    quadratic = abs(a * l3 * l3 + b * l3 - s3) <= 1e-6 * max(abs(s3), 1.0)
    if quadratic:
        assert a == pytest.approx(cost.pair, rel=1e-6, abs=1e-6), f"{name}: products per pair and head"
        assert cost.token <= b + 1e-6, f"{name}: more products per token ({cost.token}) than the reference ({b})"
    else:  # the reference evaluates some sum as a product: the floor is below it
        for L in LENGTHS:
            floor = H * (cost.pair * L * L + cost.token * L)
            assert floor <= got[L][0], f"{name}: declared products above the reference's at L={L}"
    for L in LENGTHS:
        position_only = got[L][1]
        forms = {0.0} if not cost.row else {cost.row * cost.table_rows(2 * L - 1), cost.row * L * L}
        assert any(position_only == pytest.approx(f, rel=1e-6, abs=1e-6) for f in forms), (
            f"{name}: position-only products {position_only} at L={L}, declared {sorted(forms)}"
        )


@pytest.mark.parametrize("name", ENCODINGS)
def test_elementwise_work_is_small_against_attention(name):
    """The counter does not see adds: such work must be small against plain attention's 4·d products per pair
    (a tenth of it) and a few passes over q and k per token, so that the floor it sets is ≈ 1 whatever its count."""
    cost = declared(name)
    assert 0 <= cost.pair_elementwise <= 0.1 * 4 * DH, name
    assert 0 <= cost.token_elementwise <= 8 * DH, name


@pytest.mark.parametrize("name", [n for n in ENCODINGS if declared(n).embed])
def test_declared_embedding_products_match(name):
    """Products of the ``embed`` hook (complex-order's projection back to d_model), per token."""
    enc = registry.example(name, DIMS)
    B, L = 2, 40
    x, tokens = torch.randn(B, L, D), torch.randint(0, DIMS["vocab_size"], (B, L))
    positions = torch.arange(L)[None].expand(B, L)
    with torch.no_grad():
        got = flops(lambda: enc.embed(x, positions, tokens=tokens))
    assert got == pytest.approx(declared(name).embed * B * L, rel=1e-6)


def test_the_default_is_nothing_extra():
    """The base class declares nothing extra; ``none`` declares it on purpose."""
    assert PositionalEncoding.cost(posenc.get("none"), 64) == Cost()
    assert posenc.get("none").cost(64).note


# ---------------------------------------------------------------- benchmarks/floors.py: the model's own count
BENCH = __import__("pathlib").Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def floors():
    import sys

    sys.path.insert(0, str(BENCH))
    import floors as module

    return module


@pytest.mark.parametrize("kind", ["lm", "classifier"])
def test_model_products_match_a_flop_counter(floors, kind):
    """``floors.model_products`` (the ``none`` model's products, counted by hand) against FlopCounterMode on the
    benchmark's own model. The counter has no formula for the CPU kernel of SDPA (it counts nothing there), so the
    attention's share is checked on the reference attention instead: ``q·k`` and ``p·v`` are ``2 · 2·d`` per pair
    and head, all ``L × L`` pairs of a materialised bidirectional call."""
    import model_cases

    B, L, V = 2, 64, 256
    model = model_cases.posenc_model(kind, "none", L, V).eval()
    tokens = torch.randint(0, V, (B, L))
    with torch.no_grad():
        got = flops(lambda: model(tokens))
    step = floors.Step(kind, L, B, V)
    attention = floors.N_LAYERS * 4 * floors.D * B * step.pairs()
    # torch 2.15's counter has a formula for the CPU SDPA kernel: all L x L pairs, whatever the causal mask;
    # torch <= 2.14's counts nothing there
    full = floors.N_LAYERS * 4 * floors.D * B * L * L
    counted_sdpa = got - (floors.model_products(step) - attention)
    assert counted_sdpa == pytest.approx(0, abs=1e-6) or counted_sdpa == pytest.approx(full, rel=1e-9), counted_sdpa
    assert baseline(B, L) == 8 * B * L * D * D + 4 * D * B * L * L


def test_floors_of_the_benchmark(floors):
    """The floor is 1 for ``none``, a little above 1 for an added bias, grows with L for a per-pair product, and a
    decoding step keeps its tables (no per-step projection of a table of parameters)."""
    lm = floors.Step("lm", 2048, 2, 8192)
    assert floors.floor("none", lm) == 1.0
    assert 1.0 < floors.floor("alibi", lm) < 1.01
    assert floors.floor("rope", lm) < 1.001
    shaw = [floors.floor("shaw", floors.Step("lm", L, 2, 8192)) for L in (1024, 2048, 4096)]
    assert 1.05 < shaw[0] < shaw[1] < shaw[2] < 2
    assert floors.floor("tener", floors.Step("lm", 256, 2, 8192)) < 1.0  # K = H: no key projection
    dec = floors.Step("decode", 4096, 1, 8192)
    cost = floors.step_cost("deberta", dec)
    assert cost.row and cost.rows  # a table of parameters: projected once, not per decoding step
    per_step = floors.N_LAYERS * floors.H * (4096 + 1) * (cost.pair + cost.pair_elementwise)
    assert floors.extra_work(cost, dec) == per_step


def test_floors_table(floors):
    """The report: one table per (kind, L, threads), the ratio to ``none`` divided by the floor, the targets."""
    cfg = {"threads": 2, "vocab": 8192, "batch": 2}

    def rec(case, L, t, peak):
        return {"case": case, "L": L, "step_cpu_s": t, "step_s": t, "step_cpu_min_s": t, "peak_step_MB": peak,
                "config": cfg}  # fmt: skip

    records = [rec("lm:posenc:none", 2048, 1.0, 100.0), rec("lm:posenc:shaw", 2048, 1.5, 200.0)]
    records.append({"case": "decode:posenc:none", "L": 4096, "token_cpu_ms": 2.0, "token_ms": 2.0,
                    "token_cpu_min_ms": 2.0, "peak_prefill_MB": 10.0, "config": dict(cfg, batch=1)})  # fmt: skip
    text = floors.floors_table(records)
    assert "L=2048, 2 thread(s), batch 2 (wall time, median of 1 round(s))" in text
    assert "context=4096" in text
    shaw = next(line for line in text.splitlines() if line.startswith("| shaw |"))
    fl = floors.floor("shaw", floors.Step("lm", 2048, 2, 8192))
    assert f"| {fl:.3f} | 1.500 | {1.5 / fl:.3f} ✗ | 2.00 ✗ |" in shaw


def test_interleaved_training_table(floors):
    """benchmarks/train_interleaved.py: the ratio to ``none`` is the median of the per-round ratios (not the ratio of
    the medians), divided by the floor, with the target's mark."""
    import train_interleaved

    run = {"L": 2048, "threads": 1, "clock": "cpu", "load": [1.0, 1.5],
           "seconds": {"none": [1.0, 2.0, 1.0], "shaw": [1.5, 2.2, 1.3]}}  # fmt: skip
    text = train_interleaved.table(run, vocab=1024, batch=2)
    assert "L = 2048, 1 thread(s), cpu seconds, 3 rounds, load 1.0-1.5" in text
    shaw = next(line for line in text.splitlines() if line.startswith("| shaw |"))
    fl = floors.floor("shaw", floors.Step("lm", 2048, 2, 1024))
    ratio = 1.3  # the rounds' ratios 1.5, 1.1, 1.3 (their median); the medians' ratio would be 1.5
    fast = 1.3  # each model's fastest step: 1.3 / 1.0
    mark, fmark = (" ✗" if x / fl > floors.TIME_TARGET else "" for x in (ratio, fast))
    assert shaw == (
        f"| shaw | {fl:.3f} | 1.50 | 1.50 / 1.10 / 1.30 | {ratio:.3f} | {ratio / fl:.3f}{mark} | {fast:.3f} | "
        f"{fast / fl:.3f}{fmark} |"
    )
    run["seconds"]["shaw"] = [1.2, 2.2, 1.3]  # the fastest steps 1.2 and 1.0, in different rounds
    run["seconds"]["none"] = [1.1, 2.0, 1.0]
    shaw = next(line for line in train_interleaved.table(run, 1024, 2).splitlines() if line.startswith("| shaw |"))
    assert f"| {1.2:.3f} | {1.2 / fl:.3f}" in shaw


def test_attention_floor_given_bias_is_attention_with_that_bias(floors):
    """benchmarks/attention_floor.py's ``flash + given bias`` (PyTorch's flash kernels on reversed row blocks, the bias
    a strided view of one number per offset) computes the gradients of causal attention with that bias; the table
    divides by flash and by the product floor (flash + the term's FLOPs at the measured rate)."""
    import attention_floor

    got: dict = {}
    runs = attention_floor.cases(300, 1, inputs=got)
    dq, dk, dv = runs["flash + given bias"][0]()
    q, k, v = (got[n].detach().requires_grad_() for n in "qkv")
    L = q.shape[2]
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    bias = got["alibi"][:, (j - i + L - 1)].masked_fill(j > i, float("-inf"))  # [H, L, L]
    out = torch.softmax(q @ k.transpose(-1, -2) * got["scale"] + bias, -1) @ v
    out.backward(got["do"])
    for mine, ref in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        torch.testing.assert_close(mine, ref, atol=2e-5, rtol=1e-4)
    for name, (fn, _) in runs.items():
        if name != "flash + given bias":
            fn()  # every case runs
    run = {"L": 300, "threads": 1, "batch": 1, "load": [1.0], "product_rate": 1e9, "none_step_s": 2.0,
           "pass_rate": 8 * 300 * 301 / 2 / 0.25,  # a pass over the 8 heads' causal pairs in 0.25 s
           "seconds": {"flash": [1.0, 1.2, 1.1], "relative: query term": [1.5, 1.6, 1.7]},
           "extra_flops": {"flash": None, "relative: query term": 2e8}}  # fmt: skip
    text = attention_floor.table(run)
    row = next(line for line in text.splitlines() if line.startswith("| relative: query term |"))
    # median 1.6 s, × flash 1.6 / 1.1; floor 1.1 + 0.2 s; implied 1 + 2 layers × 0.5 s / 2 s
    assert row == f"| relative: query term | 1.600 | {1.6 / 1.1:.2f} | 1.300 | {1.6 / 1.3:.2f} | 1.500 |"
    assert "one elementwise pass over a layer's causal pairs 0.250 s (+0.250 on the model step)" in text


def test_decode_interleaved_arguments(floors):
    """benchmarks/decode_interleaved.py: its positional arguments with their defaults, and a clear error (not a
    bare ValueError or IndexError) for a context that is not a number, a missing encoding list, a round count of
    0, or an encoding name it does not know (with the close match)."""
    import decode_interleaved

    args = decode_interleaved._args(["4096", "none,t5"])
    assert (args.context, args.encodings, args.rounds, args.threads) == (4096, "none,t5", 20, 1)
    assert decode_interleaved._args(["512", "none", "7", "2"]).threads == 2
    for bad in (["4k", "none"], ["4096"], ["4096", "none", "0"]):
        with pytest.raises(SystemExit) as e:
            decode_interleaved._args(bad)
        assert e.value.code == 2  # argparse's usage error
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, str(BENCH / "decode_interleaved.py"), "64", "none,alibbi", "2"], capture_output=True, text=True
    )
    assert run.returncode != 0 and "unknown encoding 'alibbi'. Did you mean: alibi?" in run.stderr, run.stderr


def test_layer_threads_table(floors, capsys):
    """benchmarks/layer_threads.py on a short sequence: a row per encoding (none added) with the plan's kernel, the
    ratios to none at each thread count, the speedup and the ratio's change, consistent with the seconds printed."""
    import layer_threads

    layer_threads.main(["--length", "96", "--encodings", "alibi", "shaw", "--threads", "1", "1", "--repeats", "1"])
    rows = {line.split(" | ")[0][2:]: line.strip("| ").split(" | ") for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and not line.startswith("| encoding")}  # fmt: skip
    assert set(rows) == {"none", "alibi", "shaw"}
    from posenc.attention.kernels import KERNELS

    assert rows["none"][1] == "sdpa" and all(cells[1] in KERNELS for cells in rows.values())
    for cells in rows.values():
        s1, s2, r1, r2, speedup, delta = (float(c) for c in cells[2:])
        none1, none2 = (float(c) for c in rows["none"][2:4])
        # (printed to 4 decimals: steps of a few ms carry up to ~3 % of rounding)
        assert r1 == pytest.approx(s1 / none1, rel=0.03, abs=0.006)
        assert r2 == pytest.approx(s2 / none2, rel=0.03, abs=0.006)
        assert speedup == pytest.approx(s1 / s2, rel=0.03, abs=0.006) and delta == pytest.approx(r2 - r1, abs=0.011)
    with pytest.raises(SystemExit):
        layer_threads._args(["--threads", "0"])
