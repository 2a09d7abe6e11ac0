"""Training and evaluation shared by the real-data benchmark tasks (text classification, NER, language modelling).

The synthetic tasks draw fresh samples every step (:mod:`posenc.bench.training`); the
tasks here read fixed corpora from :mod:`posenc.data`. Everything is a pure function
of the run's :class:`~posenc.bench.runner.RunConfig`: the seed fixes the
initialisation, the order of the training examples and dropout.

Language-model evaluation follows ALiBi's *non-overlapping* protocol (Press et al.
2022, fairseq ``--tokens-per-sample L' --context-window 0``): the evaluation stream is
cut into consecutive windows of ``L'`` inputs; each window predicts its ``L'`` next
tokens from the tokens inside the window only, and perplexity is
``exp(sum NLL / number of predicted tokens)`` over all windows. Every predicted token
is predicted exactly once (:func:`nonoverlapping_windows`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import ConfigError
from .steps import fit
from .types import OnStep, RunConfig

# --------------------------------------------------------------------------- options


def task_options(task: str, cfg: RunConfig, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """``cfg.task_options`` merged over ``defaults``; an unknown key or a value of the wrong type is a ConfigError.

    A default of ``None`` accepts an ``int`` or ``None``; a ``bool`` default takes only
    bools; an ``int`` default takes ints (not bools); a ``float`` default takes ints or
    floats; a ``str`` default takes strings.
    """
    given = dict(cfg.task_options or {})
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise ConfigError(
            f"unknown task_options {unknown} for task {task!r}; known: "
            + ", ".join(f"{k} (default {v!r})" for k, v in defaults.items())
        )
    out = dict(defaults)
    for key, value in given.items():
        default = defaults[key]
        if default is None:
            ok = value is None or (isinstance(value, int) and not isinstance(value, bool))
        elif isinstance(default, bool):
            ok = isinstance(value, bool)
        elif isinstance(default, int):
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif isinstance(default, float):
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        else:
            ok = isinstance(value, type(default))
        if not ok:
            raise ConfigError(
                f"task_options[{key!r}] for task {task!r} must be like {default!r} "
                f"({type(default).__name__}), got {value!r}"
            )
        out[key] = value
    return out


def require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


# --------------------------------------------------------------------------- training loop


def train_loop(
    cfg: RunConfig,
    model: nn.Module,
    batch_loss: Callable[[int, torch.Generator], Tensor],
    on_step: OnStep | None = None,
) -> dict[str, Any]:
    """Train ``cfg.steps`` steps; ``batch_loss(step, generator)`` returns each step's loss.

    AdamW (``cfg.lr``, weight decay 0.01), one-cycle schedule (a constant rate below 20
    steps), gradient norm clipped to 1; single process.

    Returns ``{"curve": [[step, smoothed loss], ...], "train_seconds": float}``. A
    non-finite loss stops training (the curve ends there).
    """
    g = torch.Generator().manual_seed(cfg.seed)
    curve, seconds = fit(model, cfg, lambda step: batch_loss(step, g), on_step=on_step)
    model.eval()
    return {"curve": curve, "train_seconds": round(seconds, 2)}


class EpochSampler:
    """Mini-batches of example indices: a fresh permutation (from the run's generator) every epoch."""

    def __init__(self, n: int, batch_size: int):
        require(n >= 1, "no training examples")
        self.n, self.batch_size = n, min(batch_size, n)
        self.order: list[int] = []

    def next(self, g: torch.Generator) -> list[int]:
        if len(self.order) < self.batch_size:
            self.order = self.order + torch.randperm(self.n, generator=g).tolist()
        out, self.order = self.order[: self.batch_size], self.order[self.batch_size :]
        return out


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def guarded(label: str, metrics: dict[str, Any], fn: Callable[[], float]) -> None:
    """``metrics[label] = fn()``; an exception (a length beyond a learned table ...) gives None + ``label_error``."""
    try:
        metrics[label] = fn()
    except Exception as exc:  # recorded, not fatal: the harness shows the error
        metrics[label] = None
        metrics[f"{label}_error"] = f"{type(exc).__name__}: {exc}"


# --------------------------------------------------------------------------- language modelling


def sample_chunks(stream: Tensor, n: int, length: int, g: torch.Generator) -> Tensor:
    """``n`` contiguous chunks of ``length + 1`` ids at uniformly random offsets: ``[n, length + 1]``."""
    require(stream.numel() > length + 1, f"a stream of {stream.numel()} tokens is too short for chunks of {length + 1}")
    starts = torch.randint(0, stream.numel() - length, (n,), generator=g)
    return torch.stack([stream[s : s + length + 1] for s in starts.tolist()])


def nonoverlapping_windows(n_targets: int, length: int) -> list[tuple[int, int]]:
    """Windows ``[start, end)`` over predicted positions ``0 .. n_targets - 1``, ``length`` long (the last: shorter).

    Window ``[s, e)`` feeds inputs ``stream[s:e]`` and predicts ``stream[s+1:e+1]``;
    the windows partition the predicted tokens.
    """
    require(length >= 1, f"window length must be >= 1, got {length}")
    require(n_targets >= 1, f"need at least one token to predict, got {n_targets}")
    return [(s, min(s + length, n_targets)) for s in range(0, n_targets, length)]


@torch.no_grad()
def window_nll(model: nn.Module, stream: Tensor, length: int, max_tokens: int | None = None) -> tuple[float, int]:
    """Total next-token NLL (nats) and token count over non-overlapping windows of ``length`` inputs.

    The first ``min(max_tokens, len(stream) - 1)`` tokens after the first are predicted,
    whatever ``length`` is, so every length is scored on the same tokens. Windows of
    equal size are run in batches of about 8,192 tokens.
    """
    n_targets = stream.numel() - 1
    if max_tokens is not None:
        n_targets = min(n_targets, max_tokens)
    windows = nonoverlapping_windows(n_targets, length)
    full = [w for w in windows if w[1] - w[0] == length]
    rest = [w for w in windows if w[1] - w[0] != length]
    per_batch = max(1, 8192 // length)
    total, count = 0.0, 0
    model.eval()
    groups = [full[i : i + per_batch] for i in range(0, len(full), per_batch)] + [[w] for w in rest]
    for group in groups:
        x = torch.stack([stream[s:e] for s, e in group])
        y = torch.stack([stream[s + 1 : e + 1] for s, e in group])
        logits = model(x)
        logits = logits if logits.dtype == torch.float64 else logits.float()  # half precision: sum in float32
        total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum"))
        count += y.numel()
    return total, count


def perplexity(model: nn.Module, stream: Tensor, length: int, max_tokens: int | None = None) -> float:
    """``exp(mean NLL)`` over non-overlapping windows of ``length`` (see :func:`window_nll`)."""
    total, count = window_nll(model, stream, length, max_tokens)
    return math.exp(total / count)
