"""What a training loop needs to run across torchrun ranks (DDP, gloo); each is a no-op in a plain process.

:func:`ddp_wrap` wraps the model in :class:`~torch.nn.parallel.DistributedDataParallel` when
``torch.distributed`` is initialised (else returns it as it is), :func:`shard` keeps this rank's rows of a
batch and :func:`mean_over_ranks` averages a loss value over the ranks. The shared loops
(:func:`posenc.bench.training.train_classifier`, :func:`posenc.bench.seq_training.train_seq`) use them, so their
tasks run under ``torchrun`` unchanged (see :mod:`posenc.bench.ddp`, which also checks with
:func:`last_wrapped` and :func:`parameter_checksum` that every rank ends with the same parameters).

It sits with the training loops, below the executors, and imports nothing of the harness.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def distributed() -> tuple[int, int] | None:
    """``(rank, world_size)`` inside an initialised process group, else ``None``."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return None


_WRAPPED: list[nn.Module] = []


def ddp_wrap(model: nn.Module) -> nn.Module:
    """``DistributedDataParallel(model)`` under torchrun, ``model`` itself otherwise.

    Gradients are averaged over ranks in ``backward``; parameters start equal
    (DDP broadcasts rank 0's). The plain model is remembered (:func:`last_wrapped`)
    so the launcher can check that every rank ends with the same parameters.
    """
    if distributed() is None:
        return model
    _WRAPPED.clear()
    _WRAPPED.append(model)
    return nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)


def last_wrapped() -> nn.Module | None:
    return _WRAPPED[-1] if _WRAPPED else None


def shard(*tensors: Tensor) -> tuple[Tensor, ...]:
    """This rank's rows (``rank::world``) of each batch tensor; all rows when not distributed.

    Every rank draws the same full batch from the same seeded generator and keeps
    its share, so the averaged gradient is the full batch's gradient (for a batch
    size divisible by the number of ranks) and a run's result does not depend on
    how many processes ran it, up to floating-point summation order.
    """
    d = distributed()
    if d is None:
        return tensors
    rank, world = d
    return tuple(t[rank::world] for t in tensors)


def mean_over_ranks(value: float) -> float:
    d = distributed()
    if d is None:
        return value
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t.item()) / d[1]


def parameter_checksum(model: nn.Module) -> float:
    """Sum of |p| · (1 + index) over all parameters (float64): equal models, equal checksums."""
    total = torch.zeros((), dtype=torch.float64)
    for i, p in enumerate(model.parameters()):
        total += p.detach().double().abs().sum() * (1 + i)
    return float(total)
