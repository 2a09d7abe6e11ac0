"""Passkey retrieval (Mohtashami and Jaggi 2023, "Landmark Attention"), trained short and tested long.

A number of ``digits`` digits is hidden in filler text at a random depth and asked for
at the end (words as tokens; ``D`` a digit)::

    the grass is green . the sky is blue . ... the pass key is D D D D D . remember it . ...
    here we go . there and back again . what is the pass key ? the pass key is D D D D D

The filler is Landmark Attention's five sentences repeated (cut at any token to reach
the length); the whole example is ``n`` tokens, its answer the last ``digits`` of them.
A causal :class:`~posenc.models.LanguageModel` (a 32-word vocabulary) is trained on the
task itself at lengths ``cfg.train_lengths`` (one length per batch, uniform in the
range; depth uniform in [0, 1]; the key uniform), with the next-token loss on the answer
tokens only. Testing: at each ``n`` in ``cfg.test_lengths``, ``eval_samples`` examples
spread evenly over ``depths`` depths (0, 0.25, 0.5, 0.75, 1 by default: the key
sentence at the start, ..., just before the question), keys and depths drawn from
``seed``; the metric is the share of examples whose answer digits are **all** the
argmax of the model (teacher-forced, which is greedy decoding as long as every digit
is right), chance 10^-digits. ``extra["by_depth"][n][depth]`` holds the accuracy at
each depth, ``extra["digits"][n]`` the per-digit accuracy.

It is a task of the context-extension suite (:mod:`.context_extension`): with
``encoding`` a RoPE scaling (or ``rope``), the run trains -- or loads -- the shared
base model with plain RoPE and evaluates its weights with the scaling swapped in
(``factor`` fixed, ``original_max_len`` = the longest training length), optionally
after ``finetune_steps`` steps at ``finetune_factor`` times the training lengths
(``batch_size / finetune_factor`` examples per step); any other encoding is trained
natively. ``task_options``: ``digits`` (5), ``depths`` (5), ``finetune_steps`` (0),
``finetune_factor`` (4), ``finetune_lr`` (3e-4).
"""

from __future__ import annotations

import random
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ...models import LanguageModel
from ..real_training import require
from ..types import RunConfig, register_task
from .context_extension import ExtensionTask

FILLER = ("the grass is green . the sky is blue . the sun is yellow . here we go . there and back again .").split()
WORDS = sorted(set(FILLER) | set("the pass key is remember it what ?".split()))
DIGITS = [str(d) for d in range(10)]
VOCAB = ["<pad>", *WORDS, *DIGITS]
INDEX = {w: i for i, w in enumerate(VOCAB)}


def _ids(words: str) -> list[int]:
    return [INDEX[w] for w in words.split()]


KEY_OPEN, KEY_CLOSE = _ids("the pass key is"), _ids(". remember it .")
QUESTION = _ids("what is the pass key ? the pass key is")
FILLER_IDS = [INDEX[w] for w in FILLER]


def min_length(digits: int) -> int:
    """The shortest example: the key sentence, the question and the answer, no filler."""
    return len(KEY_OPEN) + digits + len(KEY_CLOSE) + len(QUESTION) + digits


def example(n: int, depth: float, key: list[int], rng: random.Random | None = None) -> list[int]:
    """One example of ``n`` tokens with the key sentence at ``depth`` (0: first, 1: just before the question)."""
    digits = [INDEX[str(d)] for d in key]
    filler = n - min_length(len(key))
    require(filler >= 0, f"a passkey example of {len(key)} digits needs n >= {min_length(len(key))}, got {n}")
    before = int(round(depth * filler))
    stream = [FILLER_IDS[i % len(FILLER_IDS)] for i in range(filler)]
    return [*stream[:before], *KEY_OPEN, *digits, *KEY_CLOSE, *stream[before:], *QUESTION, *digits]


def batch(n: int, rows: int, digits: int, rng: random.Random, depths: list[float] | None = None) -> Tensor:
    """``rows`` examples of ``n`` tokens: random keys, depths uniform (or the given ones): ``[rows, n]``."""
    out = []
    for i in range(rows):
        depth = rng.random() if depths is None else depths[i]
        out.append(example(n, depth, [rng.randrange(10) for _ in range(digits)]))
    return torch.tensor(out, dtype=torch.long)


def answer_logits(model: LanguageModel, tokens: Tensor, digits: int) -> Tensor:
    """The logits that predict the answer's digits: ``[rows, digits, vocab]``."""
    logits = model(tokens[:, :-1])
    return logits[:, -digits:]


@register_task
class Passkey(ExtensionTask):
    name = "passkey"
    description = (
        "passkey retrieval (Landmark Attention): a 5-digit key hidden at a random depth in filler text, asked for "
        "at the end; trained short, exact-match accuracy at each test length (depth breakdown in extra)"
    )
    metric = "accuracy"
    higher_is_better = True
    DEFAULTS = {**ExtensionTask.DEFAULTS, "digits": 5, "depths": 5}

    def options(self, cfg: RunConfig) -> dict[str, Any]:
        opts = super().options(cfg)
        require(1 <= opts["digits"] <= 12, f"task_options digits must be in 1..12, got {opts['digits']}")
        require(opts["depths"] >= 1, f"task_options depths must be >= 1, got {opts['depths']}")
        return opts

    def validate(self, cfg: RunConfig) -> None:
        super().validate(cfg)
        shortest = min_length(self.options(cfg)["digits"])
        require(
            cfg.train_lengths[0] >= shortest,
            f"passkey examples of {self.options(cfg)['digits']} digits are at least {shortest} tokens long: "
            f"train_lengths must start at {shortest} or more, got {cfg.train_lengths}",
        )

    def chance(self, cfg: RunConfig, label: str) -> float | None:
        """A uniform guess of every digit."""
        return 10.0 ** -self.options(cfg)["digits"]

    def examples(self, cfg: RunConfig, label: str) -> int | None:
        """``"<n>"``: the share of exact answers among ``per_depth`` keys at each of ``depths`` depths (evaluate)."""
        if not label.isdigit():
            return None
        n_depths = self.options(cfg)["depths"]
        return max(1, cfg.eval_samples // n_depths) * n_depths

    def base_extra(self, cfg: RunConfig) -> dict[str, Any]:
        return {"digits": self.options(cfg)["digits"]}

    def vocab_size(self, cfg: RunConfig) -> int:
        return len(VOCAB)

    def _loss(self, model: LanguageModel, lo: int, hi: int, rows: int, digits: int, g: torch.Generator) -> Tensor:
        n = int(torch.randint(lo, hi + 1, (1,), generator=g))
        rng = random.Random(int(torch.randint(0, 2**31 - 1, (1,), generator=g)))
        tokens = batch(n, rows, digits, rng)
        logits = answer_logits(model, tokens, digits)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, -digits:].reshape(-1))

    def train_loss(self, model: LanguageModel, cfg: RunConfig, step: int, g: torch.Generator) -> Tensor:
        lo, hi = cfg.train_lengths
        return self._loss(model, lo, hi, cfg.batch_size, self.options(cfg)["digits"], g)

    def finetune_loss(self, model: LanguageModel, cfg: RunConfig, g: torch.Generator) -> Tensor:
        opts = self.options(cfg)
        f = opts["finetune_factor"]
        lo, hi = cfg.train_lengths
        return self._loss(model, lo * f, hi * f, max(1, cfg.batch_size // f), opts["digits"], g)

    def evaluate(self, model: LanguageModel, cfg: RunConfig) -> tuple[dict[str, Any], dict[str, Any]]:
        opts = self.options(cfg)
        k, n_depths = opts["digits"], opts["depths"]
        depths = [0.0] if n_depths == 1 else [i / (n_depths - 1) for i in range(n_depths)]
        per_depth = max(1, cfg.eval_samples // n_depths)
        metrics: dict[str, Any] = {}
        by_depth: dict[str, dict[str, float]] = {}
        per_digit: dict[str, float] = {}
        for n in cfg.test_lengths:
            rng = random.Random(1000 + 31 * cfg.seed + n)
            tokens = batch(n, per_depth * len(depths), k, rng, [d for d in depths for _ in range(per_depth)])
            rows_per_call = max(1, 16384 // n)
            right = torch.cat(
                [answer_logits(model, part, k).argmax(-1) == part[:, -k:] for part in tokens.split(rows_per_call)]
            )
            exact = right.all(-1).float()
            metrics[str(n)] = exact.mean().item()
            by_depth[str(n)] = {
                f"{d:g}": exact[i * per_depth : (i + 1) * per_depth].mean().item() for i, d in enumerate(depths)
            }
            per_digit[str(n)] = right.float().mean().item()
        return metrics, {"by_depth": by_depth, "digits": per_digit}
