"""What every kind of model the harness trains shares: the model a config asks for, and the one optimisation loop.

:func:`model_options` turns a :class:`~posenc.bench.types.RunConfig` into the keyword arguments of a
:mod:`posenc.models` model (encoding, sizes, causal attention for a decoder, positions up to the longest test
length): the classifier, tagger, sequence-to-sequence and language-model tasks all build their model from it.

Classifiers (:mod:`posenc.bench.training`), sequence tasks (:mod:`posenc.bench.seq_training`), real data
(:mod:`posenc.bench.real_training`) and the context-extension fine-tune differ in how a batch's loss is made,
not in how a step is taken (:func:`optimise`): AdamW's step after a gradient clipped to norm 1, the learning-rate
schedule, a smoothed loss curve, and a stop at the first non-finite loss.

It sits with the training loops and imports only :mod:`posenc.bench.types` of the harness.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from .types import RunConfig


def model_options(cfg: RunConfig, **overrides: Any) -> dict[str, Any]:
    """The keyword arguments of the model ``cfg`` asks for, for any :mod:`posenc.models` model.

    The encoding and its options, ``d_model``, ``n_layers``, ``n_heads``, ``d_ff``, causal attention for
    ``cfg.model == "decoder"`` and positions up to the longest test length; ``overrides`` replace or add
    (a task's ``max_len`` or ``dropout``, a classifier's ``pooling``, another encoding).
    """
    return {
        "encoding": cfg.encoding,
        "encoding_options": cfg.encoding_options or None,
        "d_model": cfg.d_model,
        "n_layers": cfg.n_layers,
        "n_heads": cfg.n_heads,
        "d_ff": cfg.d_ff,
        "causal": cfg.model == "decoder",
        "max_len": max(cfg.test_lengths),
        **overrides,
    }


def one_cycle(opt: torch.optim.Optimizer, lr: float, steps: int) -> Any:
    """A one-cycle schedule with 10% warm-up; a constant rate below 20 steps (OneCycleLR's warm-up would have no
    length, and it divides by zero for some short schedules)."""
    if steps >= 20:
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)


def optimise(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    sched: Any,
    steps: int,
    loss_at: Callable[[int], Tensor],
    *,
    every: int = 25,
    on_step: Callable[[int, float], None] | None = None,
    reduce: Callable[[float], float] | None = None,
) -> tuple[list[list[float]], float]:
    """Train ``model`` for ``steps`` steps of ``loss_at(step)`` (steps count from 1).

    Returns ``(curve, seconds)``: ``curve`` holds ``[step, loss]`` every ``every`` steps and at the last one, the
    loss an exponential moving average (0.9) of the steps' losses; a non-finite loss ends training and the curve
    with ``[step, that loss]``. ``reduce`` maps a step's loss before it is recorded (the mean over DDP ranks);
    ``on_step(step, loss)`` is called after each step.
    """
    curve: list[list[float]] = []
    running = 0.0
    t0 = time.perf_counter()
    model.train()
    for step in range(1, steps + 1):
        loss = loss_at(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if sched is not None:
            sched.step()
        value = loss.item() if reduce is None else reduce(loss.item())
        if not math.isfinite(value):
            curve.append([step, value])
            break
        running = value if step == 1 else 0.9 * running + 0.1 * value
        if step % every == 0 or step == steps:
            curve.append([step, running])
        if on_step is not None:
            on_step(step, value)
    return curve, time.perf_counter() - t0


def fit(
    model: nn.Module,
    cfg: RunConfig,
    loss_at: Callable[[int], Tensor],
    *,
    on_step: Callable[[int, float], None] | None = None,
    reduce: Callable[[float], float] | None = None,
) -> tuple[list[list[float]], float]:
    """A run's training: ``cfg.steps`` steps of AdamW at ``cfg.lr`` (weight decay 0.01) on the one-cycle schedule.

    Every task's training goes through here (the classifier, sequence and real-data loops); what differs is
    ``loss_at``. Returns :func:`optimise`'s ``(curve, seconds)``.
    """
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
    return optimise(model, opt, one_cycle(opt, cfg.lr, cfg.steps), cfg.steps, loss_at, on_step=on_step, reduce=reduce)
