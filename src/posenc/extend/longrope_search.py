"""LongRoPE's evolutionary search for per-pair RoPE rescale factors (Ding et al. 2024, "LongRoPE: Extending LLM
Context Window Beyond 2 Million Tokens", §3.2 and Algorithm 1).

LongRoPE rescales each rotary pair's frequency by its own factor, ``θ_i' = θ_i / λ_i`` (pair 0 the fastest), and
leaves the first ``n̂`` positions of a sequence un-interpolated (plain RoPE there). The factors are found by an
evolutionary search whose fitness is the perplexity at the target length on held-out text:

* **search space** -- ``λ_i`` on a grid of step ``0.01`` from 1 to ``1.25 s`` (``s`` the extension ratio) and ``n̂``
  in ``{0, 1, 2, 4, 8, 12, 16, 20, 24, 28, 32, 64, 128, 256}`` (the grid step is microsoft/LongRoPE's
  ``list_step``; the range and the ``n̂`` set are the paper's Table 2 as we remember it, not checked against its
  text here: both are arguments, ``top`` and ``n_hat_choices``);
* **constraint** -- ``λ_i <= λ_{i+1}``: the factors never fall from the high-frequency pairs to the low-frequency
  ones (the paper's monotonically non-decreasing constraint, kept by every mutation and crossover here and checked
  on every candidate);
* **initial population** -- PI's factors (``λ_i = s``), NTK-aware's (``λ_i = (s^{d/(d-2)})^{2i/d}``, the base
  rescaled by ``s^{d/(d-2)}``) and YaRN's (:func:`posenc.extend.runner.yarn_pair_factors`), each with ``n̂ = 0``,
  and mutations of them for the rest of the population;
* **each iteration** -- the ``parents`` fittest survive (elitism: the best never gets worse), ``mutations`` children
  are mutations of random parents (each ``λ_i`` and ``n̂`` redrawn with probability ``mutation_prob`` = 0.3, ``λ_i``
  between its neighbours), ``crossovers`` children mix two parents (each gene from either, a child that breaks the
  constraint redrawn up to ``crossover_tries`` times, then a mutation of the first parent instead); a candidate
  already evaluated is not evaluated again.

The defaults are microsoft/LongRoPE's ``evolution/default_hyper_params/dim_mono_llama.json`` (read for this
module): population 64, 40 iterations (``max_time_budget``), 16 mutations, 16 crossovers, 32 parents, 20 crossover
tries, step 0.01; the 0.3 is the probability in that repository's mutation and crossover code. The paper's own text
could not be consulted offline while this was written, so its numbers are not checked here; the brief this was
written for gives population 64, 40 iterations, 16 parents and mutation probability 0.3 for the paper, which differs
from the code in the parents only (``parents=16`` is one argument away).

What transformers' ``rope_type: "longrope"`` can say is the factors (``long_factor`` past the trained length,
``short_factor`` within it) and the attention factor ``sqrt(1 + ln s / ln L)``; it has no field for ``n̂``. So
:attr:`SearchResult.long_factor` goes into ``posenc.hf.patch(model, "rope-longrope", ...)`` and the exported config,
and a searched ``n̂ > 0`` is reported but would be lost there: ``n_hat_choices=(0,)`` (``exportable=True``, the
default) searches the factors alone, as what is exported then is what was searched. ``short_factor`` is 1 for every
pair (the model as trained within ``L``; LongRoPE's §3.3 searches it again at the short length, not done here).

>>> found = search(model, tokenizer, factor=4, population=16, iterations=8)              # doctest: +SKIP
>>> posenc.hf.patch(model, "rope-longrope", **found.patch_options())                     # doctest: +SKIP
>>> posenc.hf.export(model, "smol-longrope", tokenizer=tokenizer)                        # doctest: +SKIP
>>> finetune(model, tokenizer, scaling="rope-longrope", factor=4,                        # doctest: +SKIP
...          scaling_options=found.patch_options())   # LongRoPE: fine-tune from the searched factors
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..settings import number, positive_int, whole

__all__ = [
    "N_HAT_CHOICES",
    "Candidate",
    "SearchResult",
    "initial_factors",
    "is_monotone",
    "perplexity",
    "search",
    "sizes_for",
    "stored_search",
]

#: the paper's search space for n̂, the initial tokens left un-interpolated (Table 2)
N_HAT_CHOICES = (0, 1, 2, 4, 8, 12, 16, 20, 24, 28, 32, 64, 128, 256)
#: the grid step of the factors (microsoft/LongRoPE's list_step)
STEP = 0.01
#: the largest factor, as a multiple of the extension ratio (the paper's Table 2: up to 1.25 s)
TOP = 1.25


@dataclass(frozen=True)
class Candidate:
    """One point of the search: the per-pair factors (pair 0 the fastest) and ``n̂``; ``fitness`` is the
    perplexity at the target length once evaluated (lower is better)."""

    factors: tuple[float, ...]
    n_hat: int = 0
    fitness: float | None = None
    origin: str = ""

    def key(self) -> tuple[tuple[float, ...], int]:
        return tuple(round(f, 6) for f in self.factors), self.n_hat


@dataclass
class SearchResult:
    """The search's outcome: the best candidate, the best of the initial ones, the best fitness after each
    iteration (``curve[0]``: the initial population's), and every candidate evaluated, in order."""

    best: Candidate
    initial_best: Candidate
    initial: dict[str, Candidate]
    factor: float
    original: int
    length: int
    curve: list[float]
    evaluated: list[Candidate] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def long_factor(self) -> list[float]:
        """The searched factors as transformers' ``long_factor`` (one per rotary pair)."""
        return [float(f) for f in self.best.factors]

    @property
    def short_factor(self) -> list[float]:
        """1 for every pair: the model as trained within its trained length."""
        return [1.0] * len(self.best.factors)

    @property
    def n_hat(self) -> int:
        return self.best.n_hat

    def patch_options(self) -> dict[str, Any]:
        """The options of ``posenc.hf.patch(model, "rope-longrope", **options)`` (and of
        :func:`posenc.extend.finetune.finetune`'s ``scaling_options``) for the searched factors."""
        return {"factor": float(self.factor), "short_factor": self.short_factor, "long_factor": self.long_factor}

    def to_json(self) -> dict[str, Any]:
        """The result as JSON values (:meth:`from_json` reads them back)."""
        return {"best": _cand_json(self.best), "initial_best": _cand_json(self.initial_best),
                "initial": {k: _cand_json(c) for k, c in self.initial.items()}, "factor": self.factor,
                "original": self.original, "length": self.length, "curve": list(self.curve),
                "evaluated": [_cand_json(c) for c in self.evaluated], "seconds": self.seconds}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SearchResult:
        return cls(best=_cand(data["best"]), initial_best=_cand(data["initial_best"]),
                   initial={k: _cand(c) for k, c in data["initial"].items()}, factor=float(data["factor"]),
                   original=int(data["original"]), length=int(data["length"]), curve=[float(x) for x in data["curve"]],
                   evaluated=[_cand(c) for c in data["evaluated"]], seconds=float(data.get("seconds", 0.0)))


def _cand_json(c: Candidate) -> dict[str, Any]:
    return {"factors": list(c.factors), "n_hat": c.n_hat, "fitness": c.fitness, "origin": c.origin}


def _cand(d: Mapping[str, Any]) -> Candidate:
    fit = d.get("fitness")
    return Candidate(tuple(float(x) for x in d["factors"]), int(d.get("n_hat", 0)),
                     None if fit is None else float(fit), str(d.get("origin", "")))


# ---------------------------------------------------------------------------------------------- factors
def is_monotone(factors: Sequence[float]) -> bool:
    """Whether ``λ_i <= λ_{i+1}`` for every pair (LongRoPE's constraint)."""
    return all(a <= b + 1e-12 for a, b in zip(factors, factors[1:], strict=False))


def initial_factors(head_dim: int, base: float, factor: float, original: int, pairs: int | None = None
                    ) -> dict[str, tuple[float, ...]]:
    """PI's, NTK-aware's and YaRN's per-pair factors ``θ_i / θ_i'`` for these settings (the search's start)."""
    from .runner import yarn_pair_factors

    n = pairs or head_dim // 2
    d = 2 * n
    ntk = factor ** (d / (d - 2)) if d > 2 else factor
    return {
        "pi": tuple([float(factor)] * n),
        "ntk": tuple(float(ntk ** (2 * i / d)) for i in range(n)),
        "yarn": tuple(float(x) for x in yarn_pair_factors(d, base, factor, original)),
    }


def _rotary_modules(model: Any) -> list[Any]:
    mods = [m for m in model.modules() if hasattr(m, "inv_freq") and type(m).__name__.endswith("RotaryEmbedding")]
    if not mods:
        raise ConfigError(
            f"LongRoPE's search needs a model with a transformers rotary embedding module (Llama-style), and "
            f"{type(model).__name__} has none"
        )
    return mods


def _model_rope(model: Any) -> tuple[float, int, int, int]:
    """The model's RoPE base, head dimension, rotary pairs and trained length."""
    from .runner import trained_length

    cfg = model.config
    params = getattr(cfg, "rope_parameters", None) or {}
    base = float(params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    pairs = int(_rotary_modules(model)[0].inv_freq.numel())
    return base, head_dim, pairs, trained_length(model)


@contextmanager
def longrope_rotation(model: Any, candidate: Candidate, attention_factor: float) -> Iterator[None]:
    """Within the block, the model's rotary embedding computes LongRoPE's rotation for ``candidate``: positions
    below ``n̂`` with the model's own frequencies, the others with ``θ_i / λ_i``, cos and sin times
    ``attention_factor`` (what transformers' ``longrope`` does past the trained length when ``n̂ = 0``)."""
    import torch

    mods = _rotary_modules(model)
    saved = []
    for m in mods:
        own = getattr(m, "original_inv_freq", m.inv_freq).detach().float()
        lam = torch.tensor(candidate.factors, dtype=torch.float32, device=own.device)
        if lam.numel() != own.numel():
            raise ConfigError(f"a candidate has {lam.numel()} factors, the model {own.numel()} rotary pairs")
        scaled, n_hat = own / lam, candidate.n_hat

        def forward(x: Any, position_ids: Any, *_: Any, own: Any = own, scaled: Any = scaled, n_hat: int = n_hat,
                    **__: Any) -> Any:
            pos = position_ids[..., None].float()
            inv = torch.where(pos < n_hat, own.to(x.device), scaled.to(x.device))
            freqs = pos * inv
            emb = torch.cat((freqs, freqs), dim=-1)
            return (emb.cos() * attention_factor).to(x.dtype), (emb.sin() * attention_factor).to(x.dtype)

        saved.append((m, m.__dict__.get("forward")))
        m.forward = forward
    try:
        yield
    finally:
        for m, old in saved:
            if old is None:
                del m.forward
            else:
                m.forward = old


def perplexity(model: Any, samples: Any, candidate: Candidate, attention_factor: float) -> float:
    """``exp`` of the mean next-token loss over ``samples`` (``[n, length]`` token ids) with ``candidate``'s
    rotation: the search's fitness."""
    import torch

    dev = next(model.parameters()).device
    losses = []
    with torch.no_grad(), longrope_rotation(model, candidate, attention_factor):
        for row in samples:
            ids = row.view(1, -1).to(dev)
            losses.append(float(model(input_ids=ids, labels=ids, use_cache=False).loss))
    return math.exp(sum(losses) / len(losses))


# ---------------------------------------------------------------------------------------------- the search
class _Search:
    def __init__(self, evaluate: Callable[[Candidate], float], rng: random.Random, top: float, step: float,
                 n_hat_choices: Sequence[int], mutation_prob: float, crossover_tries: int,
                 budget: int | None, known: Mapping[tuple, float] | None = None,
                 on_evaluation: Callable[[Candidate, float], None] | None = None) -> None:
        self.evaluate_fn, self.rng, self.top, self.step = evaluate, rng, top, step
        self.n_hat_choices, self.p = tuple(n_hat_choices), mutation_prob
        self.tries, self.budget = crossover_tries, budget
        self.known, self.on_evaluation = dict(known or {}), on_evaluation
        self.seen: dict[tuple, Candidate] = {}
        self.order: list[Candidate] = []

    def exhausted(self) -> bool:
        return self.budget is not None and len(self.order) >= self.budget

    def evaluate(self, c: Candidate) -> Candidate:
        if not is_monotone(c.factors):  # never happens by construction; a guard that says so if it did
            raise AssertionError(f"a candidate breaks LongRoPE's monotone constraint: {c.factors}")
        done = self.seen.get(c.key())
        if done is not None:
            return done
        fresh = c.key() not in self.known
        t0 = time.perf_counter()
        fit = self.evaluate_fn(c) if fresh else self.known[c.key()]
        out = Candidate(c.factors, c.n_hat, fit, c.origin)
        self.seen[c.key()] = out
        self.order.append(out)
        if fresh and self.on_evaluation is not None:
            self.on_evaluation(out, time.perf_counter() - t0)
        return out

    def _grid(self, low: float, high: float) -> list[float]:
        a, b = math.ceil(round(low / self.step, 6)), math.floor(round(high / self.step, 6))
        return [round(k * self.step, 6) for k in range(a, b + 1)]

    def mutate(self, parent: Candidate, tries: int = 50) -> Candidate:
        """Each factor redrawn with probability p from the grid between its neighbours (so the constraint holds),
        ``n̂`` redrawn with probability p; a child not yet seen (up to ``tries`` draws)."""
        child = parent
        for _ in range(tries):
            lam = list(parent.factors)
            for i in range(len(lam)):
                if self.rng.random() < self.p:
                    low = lam[i - 1] if i > 0 else 1.0
                    high = lam[i + 1] if i + 1 < len(lam) else self.top
                    grid = self._grid(low, max(low, high))
                    if grid:
                        lam[i] = self.rng.choice(grid)
            n_hat = parent.n_hat
            if len(self.n_hat_choices) > 1 and self.rng.random() < self.p:
                n_hat = self.rng.choice(self.n_hat_choices)
            child = Candidate(tuple(lam), n_hat, origin=f"mutation of {parent.origin or 'a parent'}")
            if child.key() not in self.seen and child.key() != parent.key():
                return child
        return child

    def crossover(self, a: Candidate, b: Candidate) -> Candidate:
        """Each gene (factor, ``n̂``) from either parent; a child that breaks the constraint or was seen is drawn
        again, up to ``crossover_tries`` times, then a mutation of ``a`` instead (microsoft/LongRoPE's rule)."""
        if a.key() != b.key():
            for _ in range(self.tries):
                lam = tuple(y if self.rng.random() < 0.5 else x for x, y in zip(a.factors, b.factors, strict=True))
                n_hat = b.n_hat if self.rng.random() < 0.5 else a.n_hat
                child = Candidate(lam, n_hat, origin="crossover")
                if is_monotone(lam) and child.key() not in self.seen:
                    return child
        return self.mutate(a)


def search(
    model: Any,
    tokenizer: Any = None,
    *,
    factor: float,
    length: int | None = None,
    document: str = "lear",
    samples: Any = None,
    n_samples: int = 1,
    population: int = 64,
    iterations: int = 40,
    parents: int = 32,
    mutations: int = 16,
    crossovers: int = 16,
    mutation_prob: float = 0.3,
    crossover_tries: int = 20,
    step: float = STEP,
    top: float | None = None,
    n_hat_choices: Sequence[int] | None = None,
    exportable: bool = True,
    max_evaluations: int | None = None,
    seed: int = 0,
    fitness: Callable[[Candidate], float] | None = None,
    progress: Callable[[int, float], None] | None = None,
    quiet: bool = False,
    known: Mapping[tuple, float] | None = None,
    on_evaluation: Callable[[Candidate, float], None] | None = None,
) -> SearchResult:
    """LongRoPE's evolutionary search (Ding et al. 2024, Algorithm 1) for ``model``'s per-pair rescale factors at
    extension ratio ``factor``; the fitness is the perplexity at ``length`` tokens (default ``factor x`` the
    trained length) on held-out text.

    Args:
        model: a transformers causal LM with a Llama-style rotary embedding module; any posenc patch is removed
            first, and the model is left unpatched, its weights and rotary module as they were.
        tokenizer, document, n_samples: the held-out text: the first ``n_samples`` windows of ``length`` tokens of
            document ``document`` (:data:`posenc.extend.config.DOCUMENTS`); or ``samples``, a ``[n, length]`` tensor
            of token ids. The paper scores PG-19 / Proof-pile samples at the target length.
        population, iterations, parents, mutations, crossovers, mutation_prob, crossover_tries: the evolution's
            sizes (defaults: microsoft/LongRoPE's, see the module's text). The population after the first iteration
            is ``parents + mutations + crossovers``.
        step, top: the factors' grid step (0.01) and largest value (default ``1.25 x factor``, the paper's range).
        n_hat_choices: the ``n̂`` searched (default: ``(0,)`` where ``exportable``, else the paper's
            :data:`N_HAT_CHOICES` up to ``length``).
        max_evaluations: at most this many fitness evaluations (the initial population's count); the search stops
            there and returns the best so far.
        seed: every random draw (the same seed and model give the same search).
        fitness: evaluate a candidate with this instead of the perplexity (tests, other objectives).
        progress: called after each iteration with (iteration, best fitness); a line to stderr unless ``quiet``.
        known: fitness values already measured, by :meth:`Candidate.key` (an interrupted search's): a candidate
            found there is not evaluated again, so that the same seed retraces the same search.
        on_evaluation: called with each candidate evaluated (not those of ``known``) and the seconds it took.

    Returns a :class:`SearchResult` whose ``long_factor`` / ``short_factor`` / :meth:`~SearchResult.patch_options`
    go into ``posenc.hf.patch(model, "rope-longrope", ...)`` and so into :func:`posenc.hf.export`'s config.
    """
    import posenc.hf

    factor = number("factor", factor, low=1.0, low_open=True, why="the extension ratio")
    for name, v in (("population", population), ("iterations", iterations), ("parents", parents),
                    ("crossover_tries", crossover_tries)):
        positive_int(name, v)
    whole("mutations", mutations, low=0)
    whole("crossovers", crossovers, low=0)
    if parents > population:
        raise ConfigError(f"parents ({parents}) cannot exceed the population ({population})")
    number("mutation_prob", mutation_prob, low=0.0, high=1.0, low_open=True)
    number("step", step, low=0.0, low_open=True)
    if max_evaluations is not None:
        positive_int("max_evaluations", max_evaluations)
    posenc.hf.unpatch(model)
    base, head_dim, pairs, original = _model_rope(model)
    length = int(length) if length is not None else int(round(factor * original))
    whole("length", length, low=2)
    top_ = number("top", top, low=1.0) if top is not None else TOP * factor
    if n_hat_choices is None:
        n_hat_choices = (0,) if exportable else tuple(n for n in N_HAT_CHOICES if n < length)
    choices = tuple(whole("n_hat", n, low=0) for n in n_hat_choices)
    if not choices:
        raise ConfigError("n_hat_choices is empty: give at least (0,)")
    if exportable and any(choices):
        raise ConfigError("exportable=True searches n̂ = 0 only (transformers' longrope has no field for n̂): "
                          "pass exportable=False to search n̂ too")
    attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))

    if fitness is None:
        if samples is None:
            if tokenizer is None:
                raise ConfigError("LongRoPE's search needs a tokenizer (or samples) for its held-out text")
            samples = _windows(tokenizer, document, length, positive_int("n_samples", n_samples))
        elif samples.dim() != 2 or samples.shape[1] != length:
            raise ConfigError(f"samples must be [n, {length}] token ids, got {tuple(samples.shape)}")
        was = model.training
        model.eval()

        def fitness(c: Candidate) -> float:
            return perplexity(model, samples, c, attention)
    else:
        was = model.training

    rng = random.Random(seed)
    s = _Search(fitness, rng, top_, step, choices, mutation_prob, crossover_tries, max_evaluations, known,
                on_evaluation)
    t0 = time.perf_counter()
    starts = initial_factors(head_dim, base, factor, original, pairs)
    clip = {k: tuple(min(max(x, 1.0), top_) for x in v) for k, v in starts.items()}
    try:
        initial = {}
        for k, v in clip.items():
            if s.exhausted():
                break
            initial[k] = s.evaluate(Candidate(v, 0, origin=k))
        seeds = list(initial.values())
        pop = list(seeds)
        i = 0
        while len(pop) < population and not s.exhausted():
            pop.append(s.evaluate(s.mutate(seeds[i % len(seeds)])))
            i += 1
        initial_best = min(initial.values(), key=_fit)
        curve = [_fit(min(pop, key=_fit))]
        for it in range(iterations):
            if s.exhausted():
                break
            chosen = sorted(pop, key=_fit)[:parents]
            pop = list(chosen)
            for _ in range(mutations):
                if s.exhausted():
                    break
                pop.append(s.evaluate(s.mutate(rng.choice(chosen))))
            for _ in range(crossovers):
                if s.exhausted():
                    break
                a, b = (sorted(rng.sample(range(len(chosen)), 2)) if len(chosen) > 1 else (0, 0))
                pop.append(s.evaluate(s.crossover(chosen[a], chosen[b])))
            best_now = _fit(min(pop, key=_fit))
            curve.append(best_now)
            if progress is not None:
                progress(it + 1, best_now)
            if not quiet:
                print(f"  LongRoPE search iteration {it + 1}/{iterations}: best perplexity {best_now:.4f} "
                      f"({len(s.order)} evaluated, {time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    finally:
        model.train(was)
    best = min(s.order, key=_fit)
    return SearchResult(best=best, initial_best=initial_best, initial=initial, factor=factor, original=original,
                        length=length, curve=curve, evaluated=list(s.order), seconds=time.perf_counter() - t0)


def _fit(c: Candidate) -> float:
    return math.inf if c.fitness is None or not math.isfinite(c.fitness) else c.fitness


def _windows(tokenizer: Any, document: str, length: int, n: int) -> Any:
    from .runner import document_ids

    ids, _ = document_ids(document, tokenizer, length * n)
    return ids.view(n, length)


# ---------------------------------------------------------------------------------------------- a budget, kept
#: where :func:`stored_search` keeps a search (in a run's folder): the result, and each evaluation as it finishes
SEARCH_FILE = "longrope-search-x{factor:g}.json"
EVALS_FILE = "longrope-search-x{factor:g}.evals.jsonl"


def sizes_for(evaluations: int) -> dict[str, int]:
    """The evolution's sizes for a budget of ``evaluations`` fitness evaluations, in microsoft/LongRoPE's proportions
    (parents half the population, mutations and crossovers a quarter each): population ``evaluations // 21``
    within [4, 64], and as many iterations as the budget pays for. 1344 evaluations give its defaults (population
    64, 40 iterations of 16 + 16); 40 give population 4, 18 iterations of 1 + 1."""
    n = positive_int("evaluations", evaluations)
    population = max(4, min(64, n // 21))
    parents, children = population // 2, max(1, population // 4)
    iterations = max(1, math.ceil(max(n - population, 0) / (2 * children)))
    return {"population": population, "parents": parents, "mutations": children, "crossovers": children,
            "iterations": iterations}


def stored_search(
    model: Any,
    tokenizer: Any,
    folder: str | os.PathLike,
    *,
    evaluations: int,
    factor: float,
    document: str = "lear",
    n_samples: int = 1,
    seed: int = 0,
    quiet: bool = False,
) -> SearchResult:
    """:func:`search` with a budget of ``evaluations`` (:func:`sizes_for`), kept in ``folder``: each evaluation is
    appended to ``longrope-search-x<factor>.evals.jsonl`` as it finishes (an interrupted search resumes: those are
    read back, not evaluated again, and the same seed retraces the same search), the result written to
    ``longrope-search-x<factor>.json`` at the end (settings, the best fitness after each iteration, the factors,
    every evaluation, the seconds). A folder that holds the result returns it without searching; one that holds a
    search of other settings (budget, document, model) is refused, naming what differs."""
    from ..pretrained import identity

    number("factor", factor, low=1.0, low_open=True, why="the extension ratio")
    sizes = sizes_for(evaluations)
    _, _, _, original = _model_rope(model)
    ident = identity(model)
    settings = {"evaluations": int(evaluations), "factor": float(factor), "length": int(round(factor * original)),
                "document": document, "n_samples": int(n_samples), "seed": int(seed), **sizes,
                "model": {"name": ident.get("name"), "sha256": ident.get("sha256")}}
    folder = Path(folder)
    path, evals_path = folder / SEARCH_FILE.format(factor=factor), folder / EVALS_FILE.format(factor=factor)
    if evals_path.is_file() and not evals_path.read_text().strip():
        evals_path.unlink()  # its header's write was interrupted: nothing evaluated yet
    for p in (path, evals_path):
        if p.is_file() and _stored_settings(p) is None:
            raise ConfigError(f"{p} is not a LongRoPE search's file of posenc's (no settings in it): move it away")
        stored = _stored_settings(p)
        if stored is not None and stored != settings:
            diff = [f"{k}: stored {stored.get(k)!r}, asked {settings.get(k)!r}" for k in settings
                    if stored.get(k) != settings.get(k)]
            raise ConfigError(f"{p} holds a LongRoPE search of other settings ({'; '.join(diff[:3])}): use another "
                              "--out, or delete the file to search again")
    if path.is_file():
        return SearchResult.from_json(json.loads(path.read_text())["result"])
    known: dict[tuple, float] = {}
    spent = 0.0
    if evals_path.is_file():
        for line in evals_path.read_text().splitlines()[1:]:
            try:
                rec = json.loads(line)
                c = _cand(rec)
            except (ValueError, KeyError, TypeError):  # a line cut by an interrupted write: evaluated again
                continue
            if c.fitness is not None:
                known[c.key()] = c.fitness
                spent += float(rec.get("seconds", 0.0))
    else:
        folder.mkdir(parents=True, exist_ok=True)
        evals_path.write_text(json.dumps({"settings": settings}) + "\n")
    if known and not quiet:
        print(f"  LongRoPE search: {len(known)} evaluations read back from {evals_path}", file=sys.stderr, flush=True)

    fresh = [0]

    def append(c: Candidate, seconds: float) -> None:
        nonlocal spent
        spent += seconds
        fresh[0] += 1
        if not quiet:
            done = len(known) + fresh[0]
            left = spent / done * max(int(evaluations) - done, 0)
            print(f"  LongRoPE search: evaluation {done}/{evaluations} ({c.origin or 'candidate'}): perplexity "
                  f"{c.fitness:.4f} in {seconds:.1f} s, at most about {left / 60:.0f} min left", file=sys.stderr,
                  flush=True)
        text = evals_path.read_text()
        with open(evals_path, "a") as f:
            if text and not text.endswith("\n"):
                f.write("\n")
            f.write(json.dumps({**_cand_json(c), "seconds": round(seconds, 4)}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    result = search(model, tokenizer, factor=factor, length=settings["length"], document=document,
                    n_samples=n_samples, seed=seed, max_evaluations=evaluations, known=known, on_evaluation=append,
                    quiet=quiet, **sizes)
    result.seconds = spent
    data = {"settings": settings, "result": result.to_json(), "evaluations": len(result.evaluated),
            "seconds_per_evaluation": spent / max(len(result.evaluated), 1)}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)
    return result


def _stored_settings(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    text = path.read_text()
    try:
        head = json.loads(text if path.suffix == ".json" else text.splitlines()[0])
    except (ValueError, IndexError):
        return None
    return head.get("settings") if isinstance(head, dict) else None
