"""Synthetic sequence tasks (Delétang et al. 2023, Zhou et al. 2024, CoPE's counting) and their training loop.

Generators are checked against definitions written independently here (string
slicing, Python integers, a small interpreter); the training loop end to end in
both model styles, for learnability, purity and bad input.
"""

from __future__ import annotations

import random
from collections import Counter
from functools import reduce

import pytest
import torch

from posenc.bench.api import get_task
from posenc.bench.runner import RunConfig, run_one
from posenc.bench.seq_training import (
    BOS,
    FIRST,
    OUT,
    PAD,
    SEP,
    _greedy,
    decoder_batch,
    encoder_batch,
    eval_rng,
    predict,
)
from posenc.bench.tasks import arithmetic, counting
from posenc.errors import ConfigError
from posenc.models import LanguageModel

SEQ_TASKS = ["copy", "reverse", "duplicate", "bucket-sort", "addition"]
LABEL_TASKS = ["parity", "even-pairs", "missing-duplicate", "counting"]
ALL_TASKS = SEQ_TASKS + LABEL_TASKS


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # tiny models on a shared 2-core machine: one thread is many times faster than two contending
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny(task: str, **kw) -> RunConfig:
    base = dict(
        task=task,
        encoding="rope",
        train_lengths=(2, 4),
        test_lengths=(4, 8),
        steps=5,
        batch_size=8,
        d_model=16,
        n_layers=1,
        n_heads=2,
        eval_samples=12,
    )
    base.update(kw)
    return RunConfig(**base)


def examples(task: str, n: int, count: int = 300, seed: int = 0, **task_options):
    t = get_task(task)
    cfg = tiny(task, train_lengths=(n, n), test_lengths=(max(n, 4),), task_options=task_options)
    opts = t.options(cfg)
    if task == "addition":
        opts["hints"] = arithmetic.hints_for(cfg, opts)
    return t.make(count, (n, n), random.Random(seed), opts), opts


# ---- string tasks: independent definitions --------------------------------------------------------


def as_text(tokens: list[int]) -> str:
    return "".join("abcdefghijklmnopqrstuvwxyz"[t - FIRST] for t in tokens)


def reverse_loop(s: str) -> str:
    out = ""
    for ch in s:
        out = ch + out
    return out


def counting_sort(s: str) -> str:
    c = Counter(s)
    return "".join(ch * c[ch] for ch in sorted(c))


@pytest.mark.parametrize(
    "task, truth",
    [
        ("copy", lambda s: s),
        ("reverse", reverse_loop),
        ("duplicate", lambda s: s * 2),
        ("bucket-sort", counting_sort),
    ],
)
@pytest.mark.parametrize("n", [1, 3, 9])
def test_string_outputs_follow_their_definition(task, truth, n):
    exs, opts = examples(task, n)
    k = opts["symbols"]
    for inp, out in exs:
        assert len(inp) == n
        assert all(FIRST <= t < FIRST + k for t in inp)
        assert as_text(out) == truth(as_text(inp))
    seen = Counter(t for inp, _ in exs for t in inp)
    assert set(seen) == set(range(FIRST, FIRST + k)) or n * len(exs) < 50


def test_alphabet_option_and_defaults():
    _, opts = examples("bucket-sort", 4)
    assert opts["symbols"] == 5  # Delétang et al.'s bucket sort alphabet
    assert examples("reverse", 4)[1]["symbols"] == 2 and examples("copy", 4)[1]["symbols"] == 10
    exs, opts = examples("reverse", 6, symbols=7)
    assert {t for inp, _ in exs for t in inp} == set(range(FIRST, FIRST + 7))


def test_parity_by_xor():
    exs, _ = examples("parity", 7, count=2000)
    b = FIRST + 1
    labels = []
    for inp, out in exs:
        odd = reduce(lambda acc, t: acc ^ (t == b), inp, False)
        labels.append(odd)
        assert out == [FIRST + 3 if odd else FIRST + 2]
    assert 0.45 < sum(labels) / len(labels) < 0.55


def test_even_pairs_counts_ab_and_ba():
    exs, _ = examples("even-pairs", 9, count=2000)
    yes = []
    for inp, out in exs:
        s = as_text(inp)
        pairs = sum(s[i : i + 2] in ("ab", "ba") for i in range(len(s) - 1))
        yes.append(pairs % 2 == 0)
        assert out == [FIRST + 3 if pairs % 2 == 0 else FIRST + 2]
    assert 0.45 < sum(yes) / len(yes) < 0.55


def test_missing_duplicate_fills_the_mask():
    n = 6
    exs, _ = examples("missing-duplicate", n, count=2000)
    mask = FIRST + 2
    answers = []
    for inp, out in exs:
        assert len(inp) == 2 * n and inp.count(mask) == 1 and len(out) == 1
        filled = [out[0] if t == mask else t for t in inp]
        assert filled[:n] == filled[n:]
        # the answer is the symbol at the mirror position
        i = inp.index(mask)
        assert out[0] == inp[(i + n) % (2 * n)]
        answers.append(out[0])
    assert 0.45 < answers.count(FIRST) / len(answers) < 0.55


# ---- addition ---------------------------------------------------------------------------------------


def parse_hinted(tokens: list[int]) -> tuple[list[int], str]:
    """(hint ids, digit string least significant first) of a hint/digit run."""
    hints, digits = tokens[0::2], tokens[1::2]
    assert len(hints) == len(digits)
    assert all(t >= arithmetic.HINT0 for t in hints)
    assert all(arithmetic.DIGIT0 <= t < arithmetic.DIGIT0 + 10 for t in digits)
    return [t - arithmetic.HINT0 for t in hints], "".join(str(t - arithmetic.DIGIT0) for t in digits)


@pytest.mark.parametrize("n", [1, 4, 11])
def test_addition_is_python_integer_addition(n):
    exs, opts = examples("addition", n, count=400)
    starts = set()
    for inp, out in exs:
        plus = inp.index(arithmetic.PLUS)
        ha, a = parse_hinted(inp[:plus])
        hb, b = parse_hinted(inp[plus + 1 :])
        hc, c = parse_hinted(out)
        assert len(a) == len(b) == n and len(c) == n + 1
        assert ha == hb == hc[:n]
        assert hc == list(range(hc[0], hc[0] + n + 1)) and hc[-1] < opts["hints"]
        starts.add(hc[0])
        # the written numbers are least significant first
        assert int(c[::-1]) == int(a[::-1]) + int(b[::-1])
        assert arithmetic.decode_number(out) == int(c[::-1])
    # random offsets: every hint offset 0 .. hints - n - 1 occurs
    assert starts == set(range(opts["hints"] - n))


def test_addition_carries_occur_and_hints_can_be_turned_off():
    exs, _ = examples("addition", 5, count=300)
    assert any(out[-1] == arithmetic.DIGIT0 + 1 for _, out in exs)  # a final carry
    exs, _ = examples("addition", 5, count=50, index_hints=False)
    for inp, out in exs:
        assert len(inp) == 11 and len(out) == 6
        a = "".join(str(t - arithmetic.DIGIT0) for t in inp[:5])
        b = "".join(str(t - arithmetic.DIGIT0) for t in inp[6:])
        c = "".join(str(t - arithmetic.DIGIT0) for t in out)
        assert int(c[::-1]) == int(a[::-1]) + int(b[::-1])


# ---- counting ---------------------------------------------------------------------------------------


def interpret(tokens: list[int], opts: dict) -> tuple[int, int]:
    """Run a counting program; return (number of statements, printed value)."""
    names = {counting.var0(opts) + i: chr(ord("x") + i) if i < 3 else f"v{i}" for i in range(opts["vars"])}
    words = {counting.EQ: "=", counting.INC: "++", counting.SEMI: ";", counting.PASS: "pass", counting.PRINT: "print"}
    words.update({counting.VAL0 + v: str(v) for v in range(opts["max_value"] + 1)})
    words.update(names)
    text = " ".join(words[t] for t in tokens)
    *statements, query = text.split(" ; ")
    env: dict[str, int] = {}
    for st in statements:
        parts = st.split()
        if parts == ["pass"]:
            continue
        if len(parts) == 3 and parts[1] == "=":
            env[parts[0]] = int(parts[2])
        elif len(parts) == 2 and parts[1] == "++":
            env[parts[0]] += 1  # a KeyError here would mean an increment before an assignment
        else:
            raise AssertionError(f"bad statement {st!r}")
    kw, var = query.split()
    assert kw == "print"
    return len(statements), env[var]


@pytest.mark.parametrize("n", [1, 6, 20])
def test_counting_program_re_executed(n):
    exs, opts = examples("counting", n, count=400)
    answers = Counter()
    for inp, out in exs:
        n_statements, value = interpret(inp, opts)
        assert n_statements == n
        assert out == [counting.VAL0 + value]
        assert 0 <= value <= opts["max_value"]
        answers[value] += 1
    if n >= 6:
        assert len(answers) >= 3  # not a constant answer


def test_counting_respects_max_value_and_weights():
    exs, opts = examples("counting", 30, count=200, max_value=2, weights=[1, 0, 10], vars=1)
    for inp, out in exs:
        _, value = interpret(inp, opts)
        assert value <= 2 and out == [counting.VAL0 + value]
        assert counting.PASS not in inp


# ---- batches and decoding ---------------------------------------------------------------------------


def test_batches_put_targets_on_output_tokens():
    exs = [([5, 6, 7], [8, 9]), ([5], [6, 7, 8])]
    tokens, mask, targets = encoder_batch(exs)
    assert tokens.tolist() == [[5, 6, 7, SEP, OUT, OUT], [5, SEP, OUT, OUT, OUT, PAD]]
    assert targets.tolist() == [[-100, -100, -100, -100, 8, 9], [-100, -100, 6, 7, 8, -100]]
    assert mask.tolist() == [[True] * 6, [True] * 5 + [False]]
    tokens, mask, targets = decoder_batch(exs)
    # a decoder reads BOS first: NoPE counts positions from it (docs/diagnosis-kazemnejad.md)
    assert tokens.tolist() == [[BOS, 5, 6, 7, SEP, 8], [BOS, 5, SEP, 6, 7, PAD]]
    full = [[BOS] + inp + [SEP] + out for inp, out in exs]
    for r, seq in enumerate(full):
        for t in range(tokens.shape[1]):
            if targets[r, t] != -100:
                assert int(targets[r, t]) == seq[t + 1] and t + 1 > len(exs[r][0]) + 1
        assert [int(targets[r, t]) for t in range(tokens.shape[1]) if targets[r, t] != -100] == exs[r][1]


@pytest.mark.parametrize("encoding", ["rope", "alibi", "learned"])
def test_batched_cached_decoding_equals_a_naive_loop(encoding):
    model = LanguageModel(12, encoding=encoding, d_model=16, n_layers=2, n_heads=2, max_len=32).eval()
    rng = random.Random(3)
    exs = [([rng.randrange(3, 12) for _ in range(rng.choice([2, 5]))], [3] * rng.choice([1, 4])) for _ in range(10)]
    got = predict(model, "decoder", exs)
    for (inp, out), pred in zip(exs, got):
        seq = [BOS] + inp + [SEP]
        with torch.no_grad():
            for _ in out:
                seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
        assert pred == seq[len(inp) + 2 :]
    prompts = torch.tensor([[BOS] + e[0] + [SEP] for e in exs if len(e[0]) == 5])
    assert torch.equal(_greedy(model, prompts, 6, cache=True), _greedy(model, prompts, 6, cache=False))


def test_eval_generators_are_fixed_per_seed_and_length():
    assert eval_rng(0, 8).random() == eval_rng(0, 8).random()
    assert len({eval_rng(s, n).random() for s in range(3) for n in (8, 16, 97)}) == 9


# ---- end to end -------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["encoder", "decoder"])
@pytest.mark.parametrize("task", ALL_TASKS)
def test_every_task_runs_in_both_styles(task, model):
    # a learned table: the model must be built long enough for the longest test sequence
    lo = 2 if task == "even-pairs" else 1
    cfg = tiny(task, encoding="learned", model=model, train_lengths=(lo, 4), test_lengths=(4, 9))
    out = run_one(cfg)
    assert out["metric"] == ("sequence_accuracy" if task in SEQ_TASKS else "accuracy")
    for n in (4, 9):
        assert out["metrics"][str(n)] is not None and 0.0 <= out["metrics"][str(n)] <= 1.0
        assert (f"{n}_token" in out["metrics"]) == (task in SEQ_TASKS)
    assert out["parameters"] > 0 and out["curve"][-1][0] == 5


def test_default_model_styles():
    assert tiny("reverse").model == "encoder"
    assert tiny("addition").model == "decoder"
    assert tiny("counting").model == "decoder"


def test_a_length_the_encoding_cannot_reach_is_recorded():
    cfg = tiny("copy", encoding="learned", encoding_options={"max_len": 12}, test_lengths=(4, 8))
    out = run_one(cfg)  # copy at 8 needs 17 positions
    assert out["metrics"]["4"] is not None
    assert out["metrics"]["8"] is None and "8_error" in out["metrics"]


def test_runs_are_pure_functions_of_config_and_seed():
    cfg = tiny("reverse", steps=8, model="decoder")
    a, b = run_one(cfg), run_one(cfg)
    assert a["metrics"] == b["metrics"] and a["curve"] == b["curve"]
    c = run_one(tiny("reverse", steps=8, model="decoder", seed=1))
    assert c["curve"] != a["curve"]


# lr 1e-2 (the old setting) made this a coin toss across CPUs: the sequence accuracy of seeds 0-5 ranged 0.28-1.0
# (encoder) and 0.77-1.0 (decoder) and moved with the kernels' rounding. At these learning rates it converges:
# sequence accuracy at length 5 over seeds 0-5, with the native kernels (the -march=native build of the time; seeds
# 0-2 also with the portable baseline build: 1.0) and without them,
#   encoder, lr 3e-3, 200 steps: 1.0 for all 12 runs (final / first loss 0.003-0.08)
#   decoder, lr 5e-3, 150 steps: 1.0 for all 12 runs (final / first loss 0.015-0.04)
# (the neighbours encoder lr 5e-3 and decoder lr 3e-3 had a worst seed of 0.91). The threshold 0.6 sits well below
# every seed and far above chance (1 / 32 for five binary symbols; token accuracy 0.5).
@pytest.mark.parametrize(
    "model, steps, lr",
    [("encoder", 200, 3e-3), ("decoder", 150, 5e-3)],
)
def test_copy_is_learnable_with_rope(model, steps, lr):
    cfg = tiny(
        "copy",
        model=model,
        steps=steps,
        train_lengths=(3, 5),
        test_lengths=(5,),
        batch_size=32,
        d_model=32,
        n_layers=2,
        lr=lr,
        eval_samples=128,
        task_options={"symbols": 2},
        seed=0,
    )
    out = run_one(cfg)
    assert out["metrics"]["5"] >= 0.6, out["metrics"]
    assert out["curve"][-1][1] < 0.3 * out["curve"][0][1]


# ---- bad input --------------------------------------------------------------------------------------


def test_bad_settings_raise_config_errors():
    with pytest.raises(ConfigError, match="even-pairs.*input length >= 2.*starts at 1"):
        tiny("even-pairs", train_lengths=(1, 4))
    with pytest.raises(ConfigError, match=r"no option\(s\) \['symbol'\].*symbols \(default 2\)"):
        tiny("reverse", task_options={"symbol": 3})
    with pytest.raises(ConfigError, match="no option"):
        tiny("parity", task_options={"symbols": 3})
    with pytest.raises(ConfigError, match="symbols must be in 2..64, got 1"):
        tiny("copy", task_options={"symbols": 1})
    with pytest.raises(ConfigError, match="option 'symbols' must be a int"):
        tiny("copy", task_options={"symbols": "4"})
    with pytest.raises(ConfigError, match="hints=5 cannot tag the 9 answer digits at length 8; use hints >= 9"):
        tiny("addition", task_options={"hints": 5})
    with pytest.raises(ConfigError, match="weights must be three numbers"):
        tiny("counting", task_options={"weights": [1, 2]})
    with pytest.raises(ConfigError, match="weights must be three numbers"):
        tiny("counting", task_options={"weights": [0, 2, 3]})
    with pytest.raises(ConfigError, match="vars must be in 1..26"):
        tiny("counting", task_options={"vars": 0})


def test_token_accuracy_of_addition_counts_digits_not_hints():
    from posenc.bench.seq_training import score

    exs, _ = examples("addition", 3, count=4)
    task = get_task("addition")
    # hints all wrong, digits right: no whole answer is right, every digit is
    wrong_hints = [[t if t < arithmetic.HINT0 else arithmetic.HINT0 for t in out] for _, out in exs]
    shifted = [[t if t < arithmetic.HINT0 else t + 1 for t in out] for _, out in exs]
    assert score(exs, shifted, task) == (0.0, 1.0)
    # one digit wrong in each example: 4 digits per answer, 3 right
    bad = [list(out) for _, out in exs]
    for b in bad:
        b[1] = arithmetic.DIGIT0 + (b[1] - arithmetic.DIGIT0 + 1) % 10
    assert score(exs, bad, task) == (0.0, 0.75)
    assert score(exs, [out for _, out in exs], task) == (1.0, 1.0)
    assert score(exs, wrong_hints, None)[1] < 1.0  # without the task every token counts
