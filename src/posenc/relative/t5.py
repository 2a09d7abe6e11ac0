r"""T5's bucketed relative position bias (Raffel et al. 2020).

T5 keeps only terms (a) content·content and (d) position·position of the
decomposed attention logit (Wu (2022), section "T5"): every head h has one learned
scalar per *bucket* of the relative distance ``j - i``, the table is shared by
all layers (HF computes it in the first layer and hands it on), and it is added
to the logits without any temperature:

.. math::
    A_{ij} = q_i^\top k_j \cdot s + b_h\big(\mathrm{bucket}(j - i)\big)

Buckets (Mesh TensorFlow / HF ``T5Attention._relative_position_bucket``), with
``n = j - i``, ``N = num_buckets`` and ``D = max_distance``:

* bidirectional (encoder): half of the buckets for ``n > 0``, half for
  ``n <= 0``; then, on ``|n|`` with ``N' = N/2`` buckets:
* unidirectional (decoder): ``m = max(-n, 0)`` (keys in the future all share
  bucket 0, and are masked anyway) with all ``N' = N`` buckets;
* exact buckets for ``m < E = N'/2``; logarithmic ones beyond:
  ``E + floor(log(m/E) / log(D/E) · (N' - E))``, capped at ``N' - 1`` so every
  distance ``>= D`` shares the last bucket.

The temperature ``s``: T5 itself uses none (``s = 1``; HF ``T5Attention.scaling
= 1.0``, it folds ``1/sqrt(d)`` into the initialisation of ``W_q``). Pass
``scaling="t5"`` for that; the default ``scaling="default"`` keeps the usual
``1/sqrt(d_head)`` so the encoding can be swapped with others in the same model.
The bias is always added *after* the temperature (the ``bias`` hook).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..base import AttentionContext, Card, Cost, PositionalEncoding
from ..errors import ConfigError, PositionError
from ..registry import register
from ._skew import offset_rows, offsets, toeplitz

SCALINGS = ("default", "t5")


def t5_max_exact(num_buckets: int, bidirectional: bool) -> int:
    """The number of exact (one distance each) buckets on one side."""
    n = num_buckets // 2 if bidirectional else num_buckets
    return n // 2


def t5_relative_position_bucket(
    relative_position: Tensor, *, bidirectional: bool = True, num_buckets: int = 32, max_distance: int = 128
) -> Tensor:
    """Bucket ids in ``[0, num_buckets)`` of integer offsets ``j - i`` (any shape).

    The logarithm is taken in float32, as Mesh TensorFlow and HF do, so the
    bucket boundaries are the ones a pretrained T5 was trained with.
    """
    if relative_position.is_floating_point():
        raise PositionError(
            f"T5 buckets integer offsets; got positions of dtype {relative_position.dtype}. "
            "Pass integer (torch.long) positions"
        )
    rel = relative_position.long()
    out = torch.zeros_like(rel)
    n = num_buckets
    if bidirectional:
        n //= 2
        out = out + (rel > 0).long() * n
        rel = rel.abs()
    else:
        rel = (-rel).clamp(min=0)
    max_exact = n // 2
    is_small = rel < max_exact
    # clamp(min=1) only keeps log() finite where the small branch is taken anyway
    ratio = rel.clamp(min=1).to(torch.float32) / max_exact
    large = max_exact + (torch.log(ratio) / math.log(max_distance / max_exact) * (n - max_exact)).long()
    large = large.clamp(max=n - 1)
    return out + torch.where(is_small, rel, large)


@register
class T5Bias(PositionalEncoding):
    r"""T5 relative position bias: one learned scalar per head and distance bucket.

    .. math::
        A_{ij} = s\, q_i^\top k_j + b_{h,\,\mathrm{bucket}(j-i)}, \qquad
        s = 1 \text{ (``scaling="t5"``)} \text{ or } 1/\sqrt{d_h} \text{ (default)}

    Args:
        n_heads: number of heads (one bias per head and bucket).
        num_buckets: number of buckets (T5: 32); even and >= 4 when bidirectional, >= 2 otherwise.
        max_distance: distances from here on share the last bucket (T5: 128).
        bidirectional: ``True`` for an encoder (separate buckets for keys before and
            after the query), ``False`` for a decoder (HF uses ``not is_decoder``);
            ``None`` (default): ``not causal``.
        scaling: ``"default"`` (``1/sqrt(d_head)``) or ``"t5"`` (no temperature, as T5).
        causal: set by the models: a causal decoder defaults to one-directional buckets.

    The bias depends on positions only, so one table serves every layer
    (``shared_across_layers``), and it is computed once per forward and cached in
    ``ctx.cache`` under the query / key positions it was built for.
    """

    info = Card(
        name="t5",
        title="T5 relative position bias (log buckets)",
        paper="Raffel et al., Exploring the Limits of Transfer Learning with a Unified Text-to-Text Transformer",
        year=2020,
        family="relative",
        position="relative",
        learnable=True,
        summary="A learned scalar per head and log-bucket of j-i, shared by all layers, added after scaling.",
        reference="HF transformers T5Attention (_relative_position_bucket and the full forward)",
        shortcoming="distances beyond max_distance all look the same",
        aliases=("t5-bias",),
    )
    claims = {"relative_only": True, "bounded": True}
    shared_across_layers = True

    def __init__(
        self,
        n_heads: int,
        num_buckets: int = 32,
        max_distance: int = 128,
        bidirectional: bool | None = None,
        scaling: str = "default",
        causal: bool = False,
    ):
        super().__init__()
        if bidirectional is None:  # a decoder (causal model) buckets one direction, as T5's decoder does
            bidirectional = not causal
        if not isinstance(n_heads, int) or n_heads <= 0:
            raise ConfigError(f"n_heads must be a positive integer, got {n_heads!r}")
        if not isinstance(num_buckets, int) or isinstance(num_buckets, bool):
            raise ConfigError(f"num_buckets must be an integer, got {num_buckets!r}")
        if bidirectional:
            if num_buckets < 4 or num_buckets % 2:
                raise ConfigError(
                    f"bidirectional T5 buckets split num_buckets into two halves with at least one exact and "
                    f"one log bucket each, so num_buckets must be even and >= 4, got {num_buckets}"
                )
        elif num_buckets < 2:
            raise ConfigError(f"unidirectional T5 buckets need num_buckets >= 2, got {num_buckets}")
        max_exact = t5_max_exact(num_buckets, bidirectional)
        if not isinstance(max_distance, int) or max_distance <= max_exact:
            raise ConfigError(
                f"max_distance must be an integer larger than the {max_exact} exact buckets "
                f"(num_buckets={num_buckets}, bidirectional={bidirectional}), i.e. >= {max_exact + 1}; "
                f"got {max_distance!r}"
            )
        if scaling not in SCALINGS:
            raise ConfigError(f"scaling must be one of {SCALINGS}, got {scaling!r}")
        self.n_heads, self.num_buckets, self.max_distance = n_heads, num_buckets, max_distance
        self.bidirectional, self.scaling = bidirectional, scaling
        self.relative_attention_bias = nn.Embedding(num_buckets, n_heads)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # HF initialises with std (d_model * d_kv)^-0.5; a small normal works for any width
        nn.init.normal_(self.relative_attention_bias.weight, std=0.02)

    def scale(self, head_dim: int) -> float:
        return 1.0 if self.scaling == "t5" else head_dim**-0.5

    def cost(self, head_dim: int) -> Cost:
        # bucket(j - i) and its table row are one value per offset and head (a lookup, O(L)); each pair adds it
        return Cost(pair_elementwise=1.0, note="a lookup per offset, one add per pair and head (offset-bias kernel)")

    def buckets(self, relative_position: Tensor) -> Tensor:
        """Bucket ids of offsets ``j - i`` (see :func:`t5_relative_position_bucket`)."""
        return t5_relative_position_bucket(
            relative_position,
            bidirectional=self.bidirectional,
            num_buckets=self.num_buckets,
            max_distance=self.max_distance,
        )

    def compute_bias(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """``b[h, bucket(k_pos_j - q_pos_i)]`` as ``[B, H, Lq, Lk]`` (B of the positions, may be 1)."""
        rel = k_pos[:, None, :] - q_pos[:, :, None]
        return self.relative_attention_bias(self.buckets(rel)).permute(0, 3, 1, 2)

    def _check_heads(self, ctx: AttentionContext) -> None:
        if ctx.n_heads != self.n_heads:
            raise ConfigError(
                f"t5 was built for n_heads={self.n_heads} but the attention has {ctx.n_heads} heads; "
                f"build it with n_heads={ctx.n_heads}"
            )

    def bias_offsets(self, ctx: AttentionContext) -> Tensor | None:
        """``b[h, bucket(δ)]`` for the ``Lq + Lk - 1`` offsets of contiguous positions: ``[H, P]`` (else ``None``).

        Positions made by the attention: the bias depends on ``j - i`` only, so ``P`` lookups (no ``Lq·Lk`` bucket
        arithmetic, no ``Lq·Lk``-row embedding backward); once per forward, shared by the layers."""
        if ctx.reference or not offset_rows(ctx):
            return None
        self._check_heads(ctx)
        key = ("t5-offsets", id(self))
        got = ctx.cache.get(key)
        if got is not None and _same(got[0], ctx.q_pos) and _same(got[1], ctx.k_pos):
            return got[2]
        vals = self.relative_attention_bias(self.buckets(offsets(ctx))).t()  # [H, P]
        ctx.cache[key] = (ctx.q_pos, ctx.k_pos, vals)
        return vals

    def bias(self, ctx: AttentionContext) -> Tensor:
        self._check_heads(ctx)
        key = ("t5-bias", id(self))
        got = ctx.cache.get(key)
        if got is not None and _same(got[0], ctx.q_pos) and _same(got[1], ctx.k_pos):
            return got[2]
        vals = self.bias_offsets(ctx)
        if vals is not None:  # laid out as a Toeplitz matrix
            out = toeplitz(vals, ctx.q_pos.shape[-1], ctx.k_pos.shape[-1])
        else:
            out = self.compute_bias(ctx.q_pos, ctx.k_pos)
        ctx.cache[key] = (ctx.q_pos, ctx.k_pos, out)
        return out


def _same(a: Tensor, b: Tensor) -> bool:
    return a is b or (a.shape == b.shape and a.device == b.device and bool(torch.equal(a, b)))
