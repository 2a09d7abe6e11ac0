"""posenc.extend.longrope_search: LongRoPE's evolutionary search (Ding et al. 2024, Algorithm 1), issue 46.

Properties on a cheap synthetic fitness (hypothesis draws the seeds and sizes): every candidate keeps the monotone
constraint and the search range, the best never gets worse than the best initial candidate nor from one iteration
to the next, the same seed gives the same search, the evaluation budget holds. On a tiny Llama trained for a few
hundred steps on Hamlet at 64 tokens: the searched factors beat YaRN's (the unsearched form) on held-out King Lear at
4x, the search's own perplexity equals posenc.hf.patch's "rope-longrope" with the returned factors, and the exported
folder runs them in stock transformers.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("transformers")
import tiny_llama_text as tiny  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from posenc.errors import ConfigError  # noqa: E402
from posenc.extend import longrope_search as ls  # noqa: E402

pytestmark = pytest.mark.usefixtures("quiet_transformers")

FACTOR = 4.0
LENGTH = int(FACTOR * tiny.TRAINED)
SMALL = dict(population=8, iterations=6, parents=4, mutations=2, crossovers=2, quiet=True)


@pytest.fixture(scope="module")
def bare():
    return tiny.model()


@pytest.fixture(scope="module")
def trained():
    """The tiny Llama trained on Hamlet at its trained length (64 tokens), plain RoPE: a model whose positions
    matter, so that the factors change its perplexity past 64 tokens."""
    from posenc.extend.finetune import FinetuneSettings, training_windows

    torch.manual_seed(0)
    model, tok = tiny.model(), tiny.tokenizer()
    windows = training_windows(tok, FinetuneSettings(length=64, tokens_per_step=64, text="hamlet"))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(200):
        batch = windows[torch.randint(0, len(windows), (8,), generator=g)]
        loss = model(batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval(), tok


def _target_fitness(calls: list | None = None):
    """A smooth bowl around a monotone target (and n̂ = 8): cheap, and its optimum is known."""
    target = (1.2, 1.9, 2.6, 3.7)

    def f(c: ls.Candidate) -> float:
        if calls is not None:
            calls.append(c)
        return 1.0 + sum((a - b) ** 2 for a, b in zip(c.factors, target, strict=True)) + abs(c.n_hat - 8) / 10

    return f


# ---------------------------------------------------------------------------------------------- properties
@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), population=st.integers(3, 10), parents=st.integers(2, 3),
       mutations=st.integers(0, 4), crossovers=st.integers(0, 4), exportable=st.booleans())
def test_every_candidate_keeps_the_constraint_and_the_best_never_gets_worse(
    bare, seed, population, parents, mutations, crossovers, exportable
):
    r = ls.search(bare, factor=FACTOR, fitness=_target_fitness(), seed=seed, population=population,
                  iterations=4, parents=parents, mutations=mutations, crossovers=crossovers, exportable=exportable,
                  quiet=True)
    top = 1.25 * FACTOR
    for c in r.evaluated:
        assert all(a <= b for a, b in zip(c.factors, c.factors[1:], strict=False)), c  # λ_i <= λ_{i+1}
        assert all(1.0 <= x <= top + 1e-9 for x in c.factors) and len(c.factors) == 4
        assert c.n_hat in ((0,) if exportable else ls.N_HAT_CHOICES)
    assert len({c.key() for c in r.evaluated}) == len(r.evaluated)  # none evaluated twice
    assert r.best.fitness <= r.initial_best.fitness
    assert all(b <= a for a, b in zip(r.curve, r.curve[1:], strict=False))  # elitism: the best only improves
    assert r.best.fitness == min(c.fitness for c in r.evaluated)


def test_the_initial_population_is_pi_ntk_and_yarn(bare):
    from posenc.extend.runner import yarn_pair_factors
    from posenc.rotary.rope import RoPE

    got = ls.initial_factors(8, 10000.0, FACTOR, 64)
    assert got["pi"] == (FACTOR,) * 4
    # NTK-aware: RoPE with base θ s^(d/(d-2)); its factors are the plain inverse frequencies over the new ones
    plain, ntk = RoPE(8, base=1e4).inv_freq.double(), RoPE(8, base=1e4 * FACTOR ** (8 / 6)).inv_freq.double()
    assert got["ntk"] == pytest.approx((plain / ntk).tolist(), rel=1e-6)
    assert got["yarn"] == pytest.approx(yarn_pair_factors(8, 1e4, FACTOR, 64))
    assert all(ls.is_monotone(v) for v in got.values())
    r = ls.search(bare, factor=FACTOR, fitness=_target_fitness(), **SMALL)
    assert set(r.initial) == {"pi", "ntk", "yarn"} and r.initial["yarn"].factors == pytest.approx(got["yarn"])


def test_it_moves_towards_a_known_optimum(bare):
    r = ls.search(bare, factor=FACTOR, fitness=_target_fitness(), seed=1, population=16, iterations=30, parents=8,
                  mutations=6, crossovers=6, exportable=False, quiet=True)
    # the bowl's floor is 1 (at the target, n̂ = 8): the search closes most of the gap the best start leaves
    assert r.best.fitness - 1 < 0.2 * (r.initial_best.fitness - 1)
    assert r.best.n_hat in (4, 8, 12)  # at or next to the optimum among the paper's n̂ choices


def test_the_same_seed_gives_the_same_search_and_another_seed_another(bare):
    a = ls.search(bare, factor=FACTOR, fitness=_target_fitness(), seed=7, **SMALL)
    b = ls.search(bare, factor=FACTOR, fitness=_target_fitness(), seed=7, **SMALL)
    c = ls.search(bare, factor=FACTOR, fitness=_target_fitness(), seed=8, **SMALL)
    assert [x.key() for x in a.evaluated] == [x.key() for x in b.evaluated] and a.curve == b.curve
    assert [x.key() for x in a.evaluated] != [x.key() for x in c.evaluated]


@pytest.mark.parametrize("budget", [1, 3, 10, 17])
def test_the_evaluation_budget_is_respected(bare, budget):
    calls: list = []
    r = ls.search(bare, factor=FACTOR, fitness=_target_fitness(calls), max_evaluations=budget, **SMALL)
    assert len(calls) == len(r.evaluated) <= budget
    assert len(calls) == min(budget, 8 + 6 * 4)  # the budget, or every evaluation the sizes ask for


@pytest.mark.parametrize(
    "kw, words",
    [
        ({"parents": 9}, "parents \\(9\\) cannot exceed the population \\(8\\)"),
        ({"n_hat_choices": (0, 4)}, "exportable=True searches n̂ = 0 only"),
        ({"factor": 1.0}, "factor must be a finite number > 1"),
        ({"max_evaluations": 0}, "max_evaluations must be a whole number >= 1"),
        ({"mutation_prob": 0.0}, "mutation_prob must be"),
    ],
)
def test_bad_arguments_are_named(bare, kw, words):
    args = {**SMALL, "factor": FACTOR, "fitness": _target_fitness(), **kw}
    with pytest.raises(ConfigError, match=words):
        ls.search(bare, **args)


# ---------------------------------------------------------------------------------------------- the rotation
def test_the_first_n_hat_positions_keep_plain_rope():
    import posenc.hf

    model = tiny.model()
    rot = model.model.rotary_emb
    lam = (1.0, 1.5, 2.0, 3.0)
    x = torch.zeros(1, 20, 8)
    pos = torch.arange(20).view(1, -1)
    plain_cos, _ = rot(x, pos)
    with ls.longrope_rotation(model, ls.Candidate(lam, n_hat=5), attention_factor=1.1):
        cos, sin = rot(x, pos)
    inv = rot.inv_freq.float()
    want = torch.cat([pos[0, :5, None] * inv, pos[0, 5:, None] * inv / torch.tensor(lam)], dim=0)
    assert torch.allclose(cos[0], 1.1 * torch.cat([want, want], -1).cos(), atol=1e-6)
    assert torch.allclose(sin[0], 1.1 * torch.cat([want, want], -1).sin(), atol=1e-6)
    assert torch.equal(rot(x, pos)[0], plain_cos) and posenc.hf.patched(model) is None  # left as it was


# ---------------------------------------------------------------------------------------------- a real search
def test_on_a_trained_tiny_model_the_search_beats_yarns_factors_and_exports(trained, tmp_path):
    import transformers

    import posenc.hf

    model, tok = trained
    r = ls.search(model, tok, factor=FACTOR, document="lear", seed=0, **SMALL)
    assert r.length == LENGTH and len(r.evaluated) == 8 + 6 * 4
    yarn = r.initial["yarn"].fitness
    assert r.best.fitness < yarn * 0.99, (r.best.fitness, yarn)  # at least 1% lower perplexity than YaRN's form
    # the independent path: posenc.hf.patch's rope-longrope with the returned factors, on the same held-out text
    from posenc.extend.runner import document_ids

    ids, _ = document_ids("lear", tok, LENGTH)
    ids = ids.view(1, -1)
    posenc.hf.patch(model, "rope-longrope", **r.patch_options())
    try:
        with torch.no_grad():
            ppl = math.exp(float(model(ids, labels=ids).loss))
        assert ppl == pytest.approx(r.best.fitness, rel=1e-4)
        folder = posenc.hf.export(model, tmp_path / "searched", tokenizer=tok)
        with torch.no_grad():
            ours = model(ids).logits
    finally:
        posenc.hf.unpatch(model)
    params = json.loads((folder / "config.json").read_text())["rope_parameters"]
    assert params["rope_type"] == "longrope" and params["long_factor"] == pytest.approx(r.long_factor)
    assert params["short_factor"] == [1.0] * 4
    stock = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        assert (stock(ids).logits - ours).abs().max() < 1e-4
