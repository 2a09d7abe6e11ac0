"""Synthetic tasks in which word order decides the answer.

Each task is a function ``(n_samples, length_range, generator) -> (tokens, labels)``
registered in :data:`TASKS`. Token 0 is padding; sequences in a batch are
right-padded to the longest one and come with an ``attention_mask``.

Both tasks below have labels that a bag-of-words model cannot predict better
than chance (50%): the multiset of tokens is independent of the label, so a
position-insensitive model (in the sense of Xixiaoyao, "Three positional encoding
methods") must fail them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ...errors import ConfigError
from ..training import train_classifier
from ..types import OnStep, RunConfig, Task, register_task

PAD, A, B = 0, 1, 2
N_FILLER = 13  # filler tokens 3 .. 15
VOCAB = 3 + N_FILLER


@dataclass
class Batch:
    tokens: Tensor  # [N, L] long, 0 = padding
    attention_mask: Tensor  # [N, L] bool
    labels: Tensor  # [N] long


def _lengths(n: int, lo: int, hi: int, g: torch.Generator) -> Tensor:
    if lo < 2 or hi < lo:
        raise ConfigError(f"a length range must satisfy 2 <= min <= max, got {lo}..{hi}")
    return torch.randint(lo, hi + 1, (n,), generator=g)


def _fill(lengths: Tensor, g: torch.Generator) -> tuple[Tensor, Tensor]:
    n, width = lengths.numel(), int(lengths.max())
    tokens = torch.randint(3, VOCAB, (n, width), generator=g)
    mask = torch.arange(width)[None, :] < lengths[:, None]
    return tokens.masked_fill(~mask, PAD), mask


def _two_distinct(lengths: Tensor, g: torch.Generator) -> tuple[Tensor, Tensor]:
    """Two distinct random positions per row, uniform over ordered pairs."""
    u = (torch.rand(lengths.shape, generator=g) * lengths).long()
    v = (torch.rand(lengths.shape, generator=g) * (lengths - 1)).long()
    v = v + (v >= u).long()
    return u, v


def order_task(n: int, lengths: tuple[int, int], g: torch.Generator) -> Batch:
    """``order``: one A and one B among filler tokens; is A before B? (balanced)."""
    lens = _lengths(n, *lengths, g)
    tokens, mask = _fill(lens, g)
    i, j = _two_distinct(lens, g)
    rows = torch.arange(n)
    tokens[rows, i] = A
    tokens[rows, j] = B
    return Batch(tokens, mask, (i < j).long())


def adjacent_task(n: int, lengths: tuple[int, int], g: torch.Generator) -> Batch:
    """``adjacent``: one A and one B; are they next to each other? (balanced).

    Half the rows place B right before or after A; the other half at a random
    distance >= 2. Needs the *relative* distance, which relative encodings get
    for free and absolute ones must learn.
    """
    lens = _lengths(n, max(lengths[0], 4), max(lengths[1], 4), g)
    tokens, mask = _fill(lens, g)
    rows = torch.arange(n)
    label = torch.rand(n, generator=g) < 0.5
    i, j = _two_distinct(lens, g)
    # adjacent rows: put B at i +/- 1 (inside the sequence)
    step = torch.where(torch.rand(n, generator=g) < 0.5, 1, -1)
    step = torch.where(i + step >= lens, -1, step)
    step = torch.where(i + step < 0, 1, step)
    j_adj = i + step
    # far rows: redraw j until |i - j| >= 2 (rejection, vectorised a few times)
    far = j.clone()
    for _ in range(64):
        bad = (far - i).abs() < 2
        if not bool(bad.any()):
            break
        redraw = (torch.rand(n, generator=g) * lens).long()
        far = torch.where(bad, redraw, far)
    j = torch.where(label, j_adj, far)
    tokens[rows, i] = A
    tokens[rows, j] = B
    return Batch(tokens, mask, ((i - j).abs() == 1).long())


def _as_tuple(fn: Callable[[int, tuple[int, int], torch.Generator], Batch]):
    def make(n: int, lengths: tuple[int, int], g: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
        b = fn(n, lengths, g)
        return b.tokens, b.attention_mask, b.labels

    return make


@register_task
class OrderTask(Task):
    name = "order"
    description = "one A and one B among filler tokens: is A before B? (bag of words: 50%)"
    metric = "accuracy"

    def validate(self, cfg: RunConfig) -> None:
        if cfg.train_lengths[0] < 2:
            raise ConfigError(f"{self.name} needs sequences of at least 2 tokens, got {cfg.train_lengths}")

    def run(self, cfg: RunConfig, on_step: OnStep | None = None) -> dict[str, Any]:
        return train_classifier(cfg, _as_tuple(order_task), VOCAB, 2, on_step)

    def chance(self, cfg: RunConfig, label: str) -> float | None:
        return 0.5  # balanced labels

    def examples(self, cfg: RunConfig, label: str) -> int | None:
        return cfg.eval_samples if label.isdigit() else None  # training.accuracy: eval_samples per length


@register_task
class AdjacentTask(OrderTask):
    name = "adjacent"
    description = "one A and one B among filler tokens: are they neighbours? (bag of words: 50%)"

    def run(self, cfg: RunConfig, on_step: OnStep | None = None) -> dict[str, Any]:
        return train_classifier(cfg, _as_tuple(adjacent_task), VOCAB, 2, on_step)
