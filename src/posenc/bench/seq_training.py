"""Shared training and evaluation for tasks whose answer is a sequence of tokens.

A :class:`SeqTask` generates examples ``(input, output)`` of token ids (lists of
ints) for an *input length* ``N`` and trains one of two model styles on them,
chosen by ``cfg.model``:

* ``"encoder"`` (Delétang et al. 2023; Ruoss et al. 2023): the model reads
  ``input + [SEP] + [OUT] * len(output)`` bidirectionally and a per-token head
  (:class:`~posenc.models.TokenTagger`) predicts every output token in parallel
  at its ``OUT`` slot. The number of slots tells the model the output length.
* ``"decoder"`` (Kazemnejad et al. 2023): a causal
  :class:`~posenc.models.LanguageModel` is trained with teacher forcing on
  ``[BOS] + input + [SEP] + output``, the loss on the output tokens only; it is
  evaluated by greedy decoding of ``len(output)`` tokens after
  ``[BOS] + input + [SEP]`` (with a KV cache; a recomputation of the whole prefix
  each step if the encoding cannot decode with a cache). The ``BOS`` token is
  what lets a decoder without position encoding (NoPE) count positions through
  its causal mask (Kazemnejad et al. 2023, Theorem 1): without it a 4-layer NoPE
  decoder does not learn ``copy`` (0% of length-20 copies in 1000 steps; 96% with
  it; docs/diagnosis-kazemnejad.md).

Sequence-level labels (parity, even pairs ...) are outputs of one token, so
both styles treat them the same way.

Training lengths are drawn per example uniformly from ``cfg.train_lengths``;
each test length ``n`` is evaluated on ``cfg.eval_samples`` fresh examples from
a generator of its own, seeded by ``(cfg.seed, n)``. The metric at ``"n"`` is the
fraction of examples whose whole output is right (``sequence_accuracy``; for
one-token outputs that is plain ``accuracy``); ``"n_token"`` is the fraction of
output tokens right (for addition: of the answer digits, not their index
hints). Every run is a pure function of its configuration.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from ..attention import KVCache
from ..errors import ConfigError
from ..models import LanguageModel, TokenTagger
from .distributed import ddp_wrap, distributed, mean_over_ranks, shard
from .steps import fit, model_options
from .types import OnStep, RunConfig, Task

PAD, SEP, OUT = 0, 1, 2
#: the decoder's start-of-sequence token: the id of the encoder's output slots, which a decoder never reads
BOS = OUT
#: the first token id a task may use for its own symbols
FIRST = 3

Example = tuple[list[int], list[int]]


def eval_rng(seed: int, length: int) -> random.Random:
    """The fixed generator of the evaluation examples at one test length."""
    return random.Random(1_000_003 * (seed + 1) + 7919 * length + 17)


class SeqTask(Task):
    """A task with token outputs; subclasses define the data, this class trains and tests.

    Subclasses set ``name``, ``description``, ``metric``, ``min_length``, ``defaults``
    (the task options they accept, with default values) and implement
    :meth:`example`, :meth:`vocab_size` and :meth:`max_total`.
    """

    metric = "sequence_accuracy"
    #: the shortest input length the task is defined for
    min_length: ClassVar[int] = 1
    #: accepted ``task_options`` and their defaults (the type of the default is the required type)
    defaults: ClassVar[dict[str, Any]] = {}
    #: whether outputs have more than one token (then ``"<n>_token"`` accuracies are reported)
    multi_token: ClassVar[bool] = True

    # ---- to implement -------------------------------------------------------------------------
    def example(self, n: int, rng: random.Random, opts: dict[str, Any]) -> Example:  # pragma: no cover
        """One ``(input, output)`` pair of input length ``n``."""
        raise NotImplementedError

    def vocab_size(self, opts: dict[str, Any]) -> int:  # pragma: no cover
        raise NotImplementedError

    def max_total(self, n: int, opts: dict[str, Any]) -> int:  # pragma: no cover
        """An upper bound on ``len(input) + 1 + len(output)`` at input length ``n``."""
        raise NotImplementedError

    def scored(self, output: list[int]) -> list[bool]:
        """Which output tokens count in the per-token accuracy (all; addition leaves out its index hints)."""
        return [True] * len(output)

    def check_options(self, cfg: RunConfig, opts: dict[str, Any]) -> None:
        """Task-specific checks of the options against the config (raise ConfigError)."""

    def eval_splits(self, cfg: RunConfig, n: int, opts: dict[str, Any]) -> dict[str, list[Example]]:
        """The evaluation examples at test length ``n``, by metric key: ``"<n>"``, the examples drawn as in training;
        a task with an out-of-distribution split at the same length adds ``"<n>_<split>"`` (Flip-Flop's sparse one)."""
        return {str(n): self.make(cfg.eval_samples, (n, n), eval_rng(cfg.seed, n), opts)}

    # ---- shared -------------------------------------------------------------------------------
    def options(self, cfg: RunConfig) -> dict[str, Any]:
        """``cfg.task_options`` merged over :attr:`defaults`; unknown keys or wrong types raise."""
        given = dict(cfg.task_options or {})
        unknown = sorted(set(given) - set(self.defaults))
        if unknown:
            known = ", ".join(f"{k} (default {v!r})" for k, v in self.defaults.items()) or "none"
            raise ConfigError(f"task {self.name!r} has no option(s) {unknown}; its options are: {known}")
        opts = dict(self.defaults)
        for key, value in given.items():
            want = type(self.defaults[key])
            if want is tuple and isinstance(value, list):
                value = tuple(value)
            ok = isinstance(value, want) and not (want is int and isinstance(value, bool))
            if want is float and isinstance(value, int) and not isinstance(value, bool):
                value, ok = float(value), True
            if not ok:
                raise ConfigError(
                    f"task {self.name!r} option {key!r} must be a {want.__name__}, got {value!r} "
                    f"({type(value).__name__})"
                )
            opts[key] = value
        return opts

    def validate(self, cfg: RunConfig) -> None:
        lo = cfg.train_lengths[0]
        if lo < self.min_length:
            raise ConfigError(
                f"task {self.name!r} needs input length >= {self.min_length}, but train_lengths starts at {lo}; "
                f"use train_lengths=({self.min_length}, {max(cfg.train_lengths[1], self.min_length)}) or longer"
            )
        if cfg.model not in ("encoder", "decoder"):
            raise ConfigError(f"task {self.name!r} runs an 'encoder' or a 'decoder', got model={cfg.model!r}")
        self.check_options(cfg, self.options(cfg))

    def make(self, count: int, lengths: tuple[int, int], rng: random.Random, opts: dict[str, Any]) -> list[Example]:
        """``count`` examples, each of an input length drawn uniformly from ``lengths`` (inclusive)."""
        lo, hi = lengths
        return [self.example(rng.randint(lo, hi), rng, opts) for _ in range(count)]

    def run(self, cfg: RunConfig, on_step: OnStep | None = None) -> dict[str, Any]:
        self.validate(cfg)
        return train_seq(self, cfg, self.options(cfg), on_step)

    def eval_options(self, cfg: RunConfig) -> dict[str, Any]:
        """The options the evaluation examples are drawn with (those :meth:`run` trains with)."""
        return self.options(cfg)

    def examples(self, cfg: RunConfig, label: str) -> int | None:
        """``"<n>"`` is the share of ``cfg.eval_samples`` examples whose whole output is right (:func:`train_seq`);
        ``"<n>_token"`` a share of tokens, not of independent examples."""
        return cfg.eval_samples if label.isdigit() else None

    def chance(self, cfg: RunConfig, label: str) -> float | None:
        """The score of the best constant answer on the evaluation examples of ``label``.

        ``"<n>"``: the share of the most frequent whole output; ``"<n>_token"``: the share of
        scored output tokens equal to the most frequent token at their output position.
        """
        n_text, _, kind = label.partition("_")
        if not n_text.isdigit() or kind not in ("", "token"):
            return None
        n = int(n_text)
        examples = self.make(cfg.eval_samples, (n, n), eval_rng(cfg.seed, n), self.eval_options(cfg))
        if not kind:
            return max(Counter(tuple(out) for _, out in examples).values()) / len(examples)
        at: dict[int, Counter[int]] = {}
        for _, out in examples:
            for i, (t, keep) in enumerate(zip(out, self.scored(out))):
                if keep:
                    at.setdefault(i, Counter())[t] += 1
        total = sum(c.total() for c in at.values())
        return sum(max(c.values()) for c in at.values()) / total if total else None


# ---- batches ------------------------------------------------------------------------------------


def encoder_batch(examples: list[Example]) -> tuple[Tensor, Tensor, Tensor]:
    """``input + SEP + OUT*m`` right-padded; targets are the output tokens at the slots, -100 elsewhere."""
    seqs = [inp + [SEP] + [OUT] * len(out) for inp, out in examples]
    width = max(len(s) for s in seqs)
    tokens = torch.full((len(seqs), width), PAD, dtype=torch.long)
    targets = torch.full((len(seqs), width), -100, dtype=torch.long)
    for r, ((inp, out), s) in enumerate(zip(examples, seqs)):
        tokens[r, : len(s)] = torch.tensor(s)
        targets[r, len(inp) + 1 : len(s)] = torch.tensor(out)
    return tokens, tokens != PAD, targets


def decoder_batch(examples: list[Example]) -> tuple[Tensor, Tensor, Tensor]:
    """Teacher forcing: read ``(BOS + input + SEP + output)[:-1]``, predict the output tokens only."""
    seqs = [[BOS] + inp + [SEP] + out for inp, out in examples]
    width = max(len(s) for s in seqs) - 1
    tokens = torch.full((len(seqs), width), PAD, dtype=torch.long)
    targets = torch.full((len(seqs), width), -100, dtype=torch.long)
    for r, ((inp, out), s) in enumerate(zip(examples, seqs)):
        tokens[r, : len(s) - 1] = torch.tensor(s[:-1])
        # the token at index 1 + len(inp) is SEP; its prediction is out[0]
        targets[r, 1 + len(inp) : len(s) - 1] = torch.tensor(out)
    return tokens, tokens != PAD, targets


def build_model(cfg: RunConfig, vocab: int, max_len: int) -> torch.nn.Module:
    """A causal language model for a decoder, else a bidirectional tagger over the same vocabulary."""
    options = model_options(cfg, max_len=max_len)
    if cfg.model == "decoder":
        return LanguageModel(vocab, **options)
    return TokenTagger(vocab, vocab, **options)


# ---- evaluation ---------------------------------------------------------------------------------


@torch.no_grad()
def _greedy(model: LanguageModel, prompts: Tensor, m: int, cache: bool) -> Tensor:
    """Greedy decoding of ``m`` tokens after equal-length ``prompts`` ``[B, P]``."""
    if cache:
        kv = KVCache()
        logits = model(prompts, kv_cache=kv)
        nxt = logits[:, -1].argmax(-1)
        outs = [nxt]
        for _ in range(m - 1):
            nxt = model(nxt[:, None], kv_cache=kv)[:, -1].argmax(-1)
            outs.append(nxt)
        return torch.stack(outs, 1)
    seq = prompts
    for _ in range(m):
        nxt = model(seq)[:, -1].argmax(-1)
        seq = torch.cat([seq, nxt[:, None]], 1)
    return seq[:, prompts.shape[1] :]


@torch.no_grad()
def predict(model: torch.nn.Module, style: str, examples: list[Example], chunk: int = 256) -> list[list[int]]:
    """The model's output for every example (parallel slots, or greedy decoding)."""
    model.eval()
    preds: list[list[int] | None] = [None] * len(examples)
    if style == "encoder":
        for s in range(0, len(examples), chunk):
            part = examples[s : s + chunk]
            tokens, mask, targets = encoder_batch(part)
            guess = model(tokens, attention_mask=mask).argmax(-1)
            for r, (inp, out) in enumerate(part):
                preds[s + r] = guess[r, len(inp) + 1 : len(inp) + 1 + len(out)].tolist()
        return preds  # type: ignore[return-value]
    groups: dict[tuple[int, int], list[int]] = {}
    for i, (inp, out) in enumerate(examples):
        groups.setdefault((len(inp), len(out)), []).append(i)
    for (_, m), idx in sorted(groups.items()):
        for s in range(0, len(idx), chunk):
            part = idx[s : s + chunk]
            prompts = torch.tensor([[BOS] + examples[i][0] + [SEP] for i in part])
            try:
                guess = _greedy(model, prompts, m, cache=True)
            except Exception:  # an encoding that cannot decode with a cache: recompute the prefix
                guess = _greedy(model, prompts, m, cache=False)
            for r, i in enumerate(part):
                preds[i] = guess[r].tolist()
    return preds  # type: ignore[return-value]


def score(examples: list[Example], preds: list[list[int]], task: SeqTask | None = None) -> tuple[float, float]:
    """(fraction of examples entirely right, fraction of scored output tokens right).

    The tokens scored are those ``task.scored`` marks (all of them without a task).
    """
    whole = sum(p == out for (_, out), p in zip(examples, preds))
    right = total = 0
    for (_, out), p in zip(examples, preds):
        keep = task.scored(out) if task is not None else [True] * len(out)
        right += sum(k and a == b for a, b, k in zip(p, out, keep))
        total += sum(keep)
    return whole / len(examples), right / max(total, 1)


# ---- training -----------------------------------------------------------------------------------


def train_seq(task: SeqTask, cfg: RunConfig, opts: dict[str, Any], on_step: OnStep | None = None) -> dict[str, Any]:
    """Train ``cfg.model`` on ``task`` at ``cfg.train_lengths``; evaluate at every ``cfg.test_lengths``."""
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    vocab = task.vocab_size(opts)
    longest = max(max(cfg.test_lengths), cfg.train_lengths[1])
    # + 1: the decoder's BOS token
    max_len = max(task.max_total(n, opts) for n in {longest, *cfg.test_lengths}) + (cfg.model == "decoder")
    model = build_model(cfg, vocab, max_len)
    collate = decoder_batch if cfg.model == "decoder" else encoder_batch
    # under torchrun (posenc bench --ddp N): DistributedDataParallel, each rank its share of every batch
    trained = ddp_wrap(model)
    ranks = distributed()

    def loss_at(step: int) -> Tensor:
        # every rank draws the same full batch (the same rng), then keeps its rows
        tokens, mask, targets = collate(task.make(cfg.batch_size, cfg.train_lengths, rng, opts))
        if ranks is None:
            logits = model(tokens, attention_mask=mask)
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)
        # the mean over the full batch's target tokens, not over this rank's: the shards hold different numbers
        # of them, and DDP averages the ranks' gradients, so each rank's sum is scaled by world / (all targets)
        count = int((targets != -100).sum().clamp(min=1))
        tokens, mask, targets = shard(tokens, mask, targets)
        logits = trained(tokens, attention_mask=mask)
        total = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100, reduction="sum"
        )
        return total * (ranks[1] / count)

    curve, train_s = fit(model, cfg, loss_at, on_step=on_step, reduce=mean_over_ranks)
    metrics: dict[str, Any] = {}
    for n in cfg.test_lengths:
        for key, examples in task.eval_splits(cfg, n, opts).items():
            try:
                whole, tok = score(examples, predict(model, cfg.model, examples), task)
            except Exception as exc:  # an encoding that cannot reach this length: recorded, not fatal
                metrics[key] = None
                metrics[f"{key}_error"] = f"{type(exc).__name__}: {exc}"
                continue
            metrics[key] = whole
            if task.multi_token:
                metrics[f"{key}_token"] = tok
    return {
        "metrics": metrics,
        "curve": curve,
        "train_seconds": round(train_s, 2),
        "parameters": sum(p.numel() for p in model.parameters()),
    }
