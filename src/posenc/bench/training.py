"""Shared training loops for benchmark tasks (sequence classification on generated data).

Under ``torchrun`` (see :mod:`posenc.bench.ddp`) the loop trains a
DistributedDataParallel model on this rank's share of each batch; otherwise it
is the plain single-process loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..models import SequenceClassifier
from .distributed import ddp_wrap, mean_over_ranks, shard
from .steps import fit, model_options
from .types import OnStep, RunConfig

# make(n, (min_len, max_len), generator) -> (tokens [N, L], attention_mask [N, L], labels [N])
MakeBatch = Callable[[int, tuple[int, int], torch.Generator], tuple[Tensor, Tensor, Tensor]]


def classifier_for(cfg: RunConfig, vocab_size: int, n_classes: int) -> SequenceClassifier:
    """The model a classification config asks for (``cfg.model``: encoder or decoder trunk)."""
    return SequenceClassifier(
        vocab_size, n_classes, **model_options(cfg, pooling="last" if cfg.model == "decoder" else "mean")
    )


@torch.no_grad()
def accuracy(model: SequenceClassifier, make: MakeBatch, length: int, n: int, seed: int) -> float:
    """Accuracy on ``n`` fresh samples of exactly ``length`` tokens (a seed of its own per length)."""
    model.eval()
    g = torch.Generator().manual_seed(10_000 + 97 * seed + length)
    tokens, mask, labels = make(n, (length, length), g)
    correct = 0
    for s in range(0, n, 256):
        logits = model(tokens[s : s + 256], attention_mask=mask[s : s + 256])
        correct += int((logits.argmax(-1) == labels[s : s + 256]).sum())
    return correct / n


def train_classifier(
    cfg: RunConfig, make: MakeBatch, vocab_size: int, n_classes: int, on_step: OnStep | None = None
) -> dict[str, Any]:
    """Train on lengths ``cfg.train_lengths``, report accuracy at every ``cfg.test_lengths``."""
    torch.manual_seed(cfg.seed)
    g = torch.Generator().manual_seed(cfg.seed)
    model = classifier_for(cfg, vocab_size, n_classes)
    trained = ddp_wrap(model)  # the model itself unless torch.distributed is initialised

    def loss_at(step: int) -> Tensor:
        tokens, mask, labels = shard(*make(cfg.batch_size, cfg.train_lengths, g))
        return F.cross_entropy(trained(tokens, attention_mask=mask), labels)

    curve, train_s = fit(model, cfg, loss_at, on_step=on_step, reduce=mean_over_ranks)
    metrics: dict[str, Any] = {}
    for n in cfg.test_lengths:
        try:
            metrics[str(n)] = accuracy(model, make, n, cfg.eval_samples, cfg.seed)
        except Exception as exc:  # an encoding that cannot reach this length: recorded, not fatal
            metrics[str(n)] = None
            metrics[f"{n}_error"] = f"{type(exc).__name__}: {exc}"
    return {
        "metrics": metrics,
        "curve": curve,
        "train_seconds": round(train_s, 2),
        "parameters": sum(p.numel() for p in model.parameters()),
    }
