"""CoPE's Flip-Flop and selective copy tasks (Golovneva et al. 2024): the generators against their rules.

Each generator is checked against a reading of its rule written here, apart from the task's code: a register
machine that runs the instructions in order for Flip-Flop, a filter of the non-blank tokens for selective copy;
and the splits are checked to differ as the paper defines them (the sparse Flip-Flop split holds more ignores
and a longer gap to the last write; the longer selective-copy inputs hold more blanks and the same symbols).
"""

from __future__ import annotations

import random
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from posenc.bench.api import get_task
from posenc.bench.runner import RunConfig, run_one
from posenc.bench.seq_training import FIRST
from posenc.bench.tasks import flipflop, selective_copy
from posenc.errors import ConfigError

FF = get_task("flipflop")
SC = get_task("selective_copy")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def register_machine(tokens: list[int]) -> tuple[int, list[tuple[str, int]]]:
    """Run the instructions: the register after them, and every read's (given bit, register) for checking."""
    names = {flipflop.W: "w", flipflop.R: "r", flipflop.I: "i"}
    register = None
    reads = []
    pairs = [(tokens[k], tokens[k + 1] if k + 1 < len(tokens) else None) for k in range(0, len(tokens), 2)]
    for op, bit in pairs:
        kind = names[op]
        if kind == "w":
            register = bit
        elif kind == "r" and bit is not None:
            reads.append((bit, register))
    return register, reads


@settings(max_examples=200, deadline=None)
@given(n=st.integers(2, 60), seed=st.integers(0, 10**6), p=st.sampled_from([0.0, 0.5, 0.8, 0.98]))
def test_flipflop_follows_its_rule(n: int, seed: int, p: float) -> None:
    inp, out = FF.draw(n, random.Random(seed), p)
    # n instructions, each with a bit but the last read, which is asked for
    assert len(inp) == 2 * n - 1
    assert inp[0] == flipflop.W and inp[-1] == flipflop.R
    assert all(t in (flipflop.W, flipflop.R, flipflop.I) for t in inp[0::2])
    assert all(t in (flipflop.B0, flipflop.B0 + 1) for t in inp[1::2])
    register, reads = register_machine(inp)
    assert out == [register]
    assert all(given_bit == reg for given_bit, reg in reads)  # the reads before the last carry the right bit
    assert out == [flipflop.flipflop_answer(inp)]
    assert max(inp + out) < FF.vocab_size(FF.defaults) and len(inp) + 1 + len(out) <= FF.max_total(n, FF.defaults)


def test_flipflop_instruction_frequencies() -> None:
    rng = random.Random(0)
    for p in (0.8, 0.98):
        ops = [t for _ in range(400) for t in FF.draw(40, rng, p)[0][2:-1:2]]
        share_i = ops.count(flipflop.I) / len(ops)
        assert abs(share_i - p) < 0.01
        # writes and reads share the rest equally
        w, r = ops.count(flipflop.W), ops.count(flipflop.R)
        assert abs(w - r) / (w + r) < 0.1


def gap_to_last_write(inp: list[int]) -> int:
    ops = inp[0::2]
    last = max(k for k, t in enumerate(ops) if t == flipflop.W)
    return len(ops) - 1 - last


def test_flipflop_splits_differ_as_defined() -> None:
    cfg = RunConfig(task="flipflop", encoding="rope", train_lengths=(32, 32), test_lengths=(32,), eval_samples=300)
    opts = FF.options(cfg)
    ind = FF.make(cfg.eval_samples, (32, 32), random.Random(1), opts)
    sparse = FF.split_examples(cfg, 32, opts)
    assert len(sparse) == cfg.eval_samples
    share = [sum(t == flipflop.I for t in inp[0::2]) / 32 for inp, _ in sparse]
    share_ind = [sum(t == flipflop.I for t in inp[0::2]) / 32 for inp, _ in ind]
    assert statistics.fmean(share) > 0.9 > 0.85 > statistics.fmean(share_ind) > 0.7
    assert statistics.fmean(gap_to_last_write(i) for i, _ in sparse) > 2 * statistics.fmean(
        gap_to_last_write(i) for i, _ in ind
    )
    # same length, different generator: no example of the split is the in-distribution one at the same index
    assert all(len(i) == 63 for i, _ in sparse)
    assert sparse != FF.make(cfg.eval_samples, (32, 32), random.Random(1), opts)
    # answers are balanced bits: chance is about one half in both splits
    assert 0.4 < FF.chance(cfg, "32_sparse") < 0.6 and 0.4 < FF.chance(cfg, "32") < 0.6
    assert FF.examples(cfg, "32_sparse") == FF.examples(cfg, "32") == 300
    assert FF.examples(cfg, "32_token") is None


def test_flipflop_options_checked() -> None:
    with pytest.raises(ConfigError, match="ood_ignore"):
        FF.validate(RunConfig(task="flipflop", encoding="rope", model="decoder", task_options={"ood_ignore": 1.0}))
    with pytest.raises(ConfigError, match="no option"):
        FF.validate(RunConfig(task="flipflop", encoding="rope", model="decoder", task_options={"p": 0.5}))


@settings(max_examples=200, deadline=None)
@given(n=st.integers(4, 80), k=st.integers(1, 4), symbols=st.integers(2, 10), seed=st.integers(0, 10**6))
def test_selective_copy_follows_its_rule(n: int, k: int, symbols: int, seed: int) -> None:
    opts = {"tokens": k, "symbols": symbols}
    inp, out = SC.example(n, random.Random(seed), opts)
    assert len(inp) == n and len(out) == k
    assert out == [t for t in inp if t != selective_copy.BLANK]  # the non-blank tokens, in order
    assert inp.count(selective_copy.BLANK) == n - k
    assert all(selective_copy.SYM0 <= t < SC.vocab_size(opts) for t in out)
    assert min(inp) >= FIRST and len(inp) + 1 + len(out) <= SC.max_total(n, opts)


def test_selective_copy_positions_are_uniform() -> None:
    # every position holds a symbol with probability k / n
    rng, n, k = random.Random(3), 24, 4
    hits = [0] * n
    for _ in range(3000):
        inp, _ = SC.example(n, rng, {"tokens": k, "symbols": 8})
        for i, t in enumerate(inp):
            hits[i] += t != selective_copy.BLANK
    assert all(abs(h / 3000 - k / n) < 0.04 for h in hits)


def test_selective_copy_longer_split_has_more_blanks() -> None:
    opts = SC.defaults
    short = SC.make(200, (24, 24), random.Random(0), opts)
    long = SC.make(200, (48, 48), random.Random(0), opts)
    blanks = [i.count(selective_copy.BLANK) for i, _ in short]
    assert set(blanks) == {20}
    assert {i.count(selective_copy.BLANK) for i, _ in long} == {44}
    assert {len(o) for _, o in short + long} == {4}


def test_selective_copy_options_checked() -> None:
    with pytest.raises(ConfigError, match="cannot hold"):
        SC.validate(RunConfig(task="selective_copy", encoding="rope", model="decoder", train_lengths=(2, 8)))
    with pytest.raises(ConfigError, match="symbols"):
        SC.validate(RunConfig(task="selective_copy", encoding="rope", model="decoder", task_options={"symbols": 1}))


@pytest.mark.parametrize("task", ["flipflop", "selective_copy"])
def test_runs_end_to_end(task: str) -> None:
    cfg = RunConfig(
        task=task,
        encoding="cope",
        model="decoder",
        train_lengths=(6, 6),
        test_lengths=(6, 12),
        steps=3,
        batch_size=4,
        d_model=16,
        n_layers=1,
        n_heads=2,
        eval_samples=8,
    )
    metrics = run_one(cfg)["metrics"]
    want = {"6", "12"} | ({"6_sparse", "12_sparse"} if task == "flipflop" else {"6_token", "12_token"})
    assert want <= set(metrics)
    assert all(0.0 <= metrics[k] <= 1.0 for k in want)
    assert run_one(cfg)["metrics"] == metrics  # a pure function of its configuration
