"""What :meth:`posenc.LanguageModel.generate` checks before it decodes, and how it draws each token: the decoding
modes, the arguments' checks (each a clear error naming the value), the length check against the encoding's reach,
and sampling (greedy, temperature, top-k).

Imports torch and :mod:`posenc.errors` (the model is :class:`posenc.LanguageModel`, not imported: it is above).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .errors import ConfigError, PositionError

DECODING_MODES = ("cache", "memory", "recompute")


def _check_generate_arguments(
    model: Any,
    tokens: Any,
    max_new_tokens: Any,
    temperature: Any,
    top_k: Any,
    generator: Any,
    eos_token_id: Any,
) -> None:
    import math

    vocab = model.trunk.vocab_size
    if not isinstance(tokens, Tensor):
        raise ConfigError(f"tokens must be a tensor of token ids [batch, length], got {type(tokens).__name__}")
    if tokens.dim() != 2 or tokens.shape[0] < 1 or tokens.shape[1] < 1:
        raise ConfigError(
            "tokens must be [batch, length] with at least one prompt of at least one token, "
            f"got shape {tuple(tokens.shape)}; a single prompt is tokens[None, :]"
        )
    if tokens.dtype == torch.bool or tokens.is_floating_point() or tokens.is_complex():
        raise ConfigError(f"tokens must hold integer token ids (torch.long), got dtype {tokens.dtype}")
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0 or high >= vocab:
        raise ConfigError(f"token ids must be in [0, vocab_size={vocab}), got ids from {low} to {high}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ConfigError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, (int, float))
        or not math.isfinite(temperature)
        or temperature < 0
    ):
        raise ConfigError(f"temperature must be a finite number >= 0 (0: greedy), got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ConfigError(f"top_k must be an integer >= 1 (1: greedy) or None (no limit), got {top_k!r}")
    if eos_token_id is not None and (
        isinstance(eos_token_id, bool) or not isinstance(eos_token_id, int) or not 0 <= eos_token_id < vocab
    ):
        raise ConfigError(f"eos_token_id must be a token id in [0, vocab_size={vocab}) or None, got {eos_token_id!r}")
    if generator is not None:
        if not isinstance(generator, torch.Generator):
            raise ConfigError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
        if generator.device.type != tokens.device.type:
            raise ConfigError(
                f"generator is on {generator.device} but the tokens are on {tokens.device}; "
                f"make it with torch.Generator(device={str(tokens.device)!r})"
            )


def _check_generate_length(model: Any, prompt: int, longest: int, device: torch.device) -> None:
    """Raise a :class:`ConfigError` if the encoding cannot take a sequence of ``longest`` tokens.

    One forward of two tokens at positions ``0`` and ``n - 1`` meets both the largest position
    (``learned``'s table) and the largest distance (``relative-key``'s table) of a sequence of ``n`` tokens.
    """
    from .errors import PositionError

    def error_at(n: int) -> PositionError | None:
        positions = torch.tensor([[0, n - 1]] if n > 1 else [[0]], device=device)
        try:
            model.trunk(torch.zeros_like(positions), positions=positions)
        except PositionError as e:
            return e
        return None

    error = error_at(longest)
    if error is None:
        return
    low, high = 0, longest  # the longest length that fits is in [low, high)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if error_at(mid) is None else (low, mid)
    if low >= prompt:
        fix = f"use max_new_tokens <= {low - prompt + 1}"
    else:
        fix = f"the prompt alone is longer: use prompt length + max_new_tokens - 1 <= {low}"
    raise ConfigError(
        f"generate feeds the model up to {longest} tokens (the prompt's {prompt} + max_new_tokens - 1), but "
        f"its encoding {model.trunk.encoding_name!r} takes at most {low}: {fix}. ({error})"
    ) from error


def _sample(logits: Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None) -> Tensor:
    """One token per row of ``logits`` ``[B, V]`` from ``softmax(logits / temperature)`` over the ``top_k`` largest."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    # the largest logit becomes 0 before dividing, so a tiny temperature gives -inf, never inf - inf
    scaled = (logits - logits.amax(-1, keepdim=True)) / temperature
    return torch.multinomial(torch.softmax(scaled, -1), 1, generator=generator)[:, 0]
