"""One helper for the tests that decode through a layer's KV cache and compare with the uncached forward."""

from __future__ import annotations

import torch

from posenc.attention import KVCache


def cached_steps(layer: torch.nn.Module, x: torch.Tensor, prefill: int) -> tuple[torch.Tensor, KVCache]:
    """``layer``'s causal output over ``x`` ``[B, L, D]`` computed through a fresh KV cache: the first ``prefill``
    tokens in one call, then one token a call; the outputs joined along the sequence, and the cache."""
    cache = KVCache()
    steps = [layer(x[:, :prefill], causal=True, kv_cache=cache)]
    steps += [layer(x[:, t : t + 1], causal=True, kv_cache=cache) for t in range(prefill, x.shape[1])]
    return torch.cat(steps, 1), cache
