r"""XLNet relative attention with relative segment encodings (Yang et al. 2019, section 2.5).

XLNet keeps Transformer-XL's relative positions (``transformer-xl``) and adds a
*relative segment* term: whether two tokens come from the same segment, not
which segment each is in (Wu (2022), section "XLNet"):

.. math::
    s_{ij} = \begin{cases} s_+ & \text{segment}(i) = \text{segment}(j) \\ s_- & \text{otherwise} \end{cases}
    \qquad a_{ij} = (q_i + b)^\top s_{ij}

so the full logit is

.. math::
    A_{ij} = q_i^\top k_j + (q_i + v)^\top W_{k,R} R_{i-j} + u^\top k_j + (q_i + b)^\top s_{ij}

with ``s_+, s_-, b`` learned per head (HF's ``seg_embed[0]``, ``seg_embed[1]``,
``r_s_bias``; ``u``, ``v`` are ``r_w_bias``, ``r_r_bias``; ``W_{k,R}`` is ``r``),
every term inside the ``1/sqrt(d_head)`` temperature.

Conventions, as HF's ``XLNetModel`` (``attn_type="bi"``):

* ``R_{i-j}`` is the ``[sin | cos]`` sinusoid of width ``d_model`` of the signed
  distance ``i - j``; XLNet's table runs over ``klen, klen-1, ..., -qlen+1``
  (bidirectional: keys after the query give negative distances) and is shifted
  by ``rel_shift_bnij`` -- the same numbers as the explicit positions here,
  queries continuing after the memory.
* segment ids come in ``ctx.q_segments`` ``[B, Lq]`` and ``ctx.k_segments``
  ``[B, Lk]``. When the keys include a memory (or a KV cache) and only the
  ``Lq`` ids of the current tokens are given, the memory keys get segment
  ``memory_segment`` (0), as XLNet pads ``mems`` with segment 0.
* no segment ids: no segment term (HF's ``seg_mat=None``), unless
  ``require_segments=True``, which makes their absence an error.

Fast path: ``(q_i + b)·s_+`` and ``(q_i + b)·s_-`` per query (``[B, H, Lq, 2]``)
selected by the ``[B, Lq, Lk]`` same-segment pattern; reference path: ``s_{ij}``
materialised for every pair and dotted literally.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..base import AttentionContext, Card, Cost
from ..errors import ConfigError
from ..fused import RelativeForm
from ..registry import register
from .transformer_xl import TransformerXL, check_heads


@register
class XLNet(TransformerXL):
    r"""XLNet relative attention: Transformer-XL's terms plus the relative segment term.

    .. math::
        A_{ij} = q_i^\top k_j + (q_i + v)^\top W_{k,R} R_{i-j} + u^\top k_j + (q_i + b)^\top s_{ij},
        \qquad s_{ij} = s_+ \text{ if } \mathrm{seg}_i = \mathrm{seg}_j \text{ else } s_-
    """

    info = Card(
        name="xlnet",
        title="XLNet relative attention + relative segment encoding",
        paper="Yang et al., XLNet: Generalized Autoregressive Pretraining for Language Understanding",
        year=2019,
        family="relative",
        position="relative",
        learnable=True,
        summary="Transformer-XL terms + (q_i + b)·s_ij with s_ij = s+ (same segment) or s- (different).",
        reference="HF transformers 5.x XLNetRelativeAttention and XLNetModel given the same weights; naive loop",
    )

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        head_dim: int | None = None,
        clamp_len: int | None = None,
        require_segments: bool = False,
        memory_segment: int = 0,
        base: float = 10000.0,
    ):
        super().__init__(d_model, n_heads, head_dim=head_dim, clamp_len=clamp_len, untie_r=True, base=base)
        self.require_segments, self.memory_segment = require_segments, memory_segment
        self.b = nn.Parameter(torch.empty(n_heads, self.head_dim))  # HF r_s_bias
        self.seg_embed = nn.Parameter(torch.empty(2, n_heads, self.head_dim))  # [s+, s-]
        self._init_segment()

    def _init_segment(self) -> None:
        nn.init.normal_(self.b, std=0.02)
        nn.init.normal_(self.seg_embed, std=0.02)

    def reset_parameters(self) -> None:
        super().reset_parameters()
        self._init_segment()

    # -------------------------------------------------------------- segments
    def cost(self, head_dim: int) -> Cost:
        # Transformer-XL's terms; with segment ids (q_i + b) · s± is 2 × 2·d per query and head and a choice per pair
        # (not counted: the benchmarks and the language model pass no segment ids, and then there is no term)
        base = super().cost(head_dim)
        return Cost(**{**base.as_dict(), "note": base.note + "; segment ids add 4·d per query, a select per pair"})

    def segments(self, ctx: AttentionContext, batch: int, lq: int, lk: int) -> tuple[Tensor, Tensor] | None:
        """Validated ``(q_segments [B|1, Lq], k_segments [B|1, Lk])``, or ``None`` when absent."""
        qs, ks = ctx.q_segments, ctx.k_segments
        if qs is None and ks is None:
            if self.require_segments:
                raise ConfigError(
                    f"{self.info.name} was built with require_segments=True but no segment ids were given; "
                    f"pass segment_ids of shape [batch={batch}, length={lq}]"
                )
            return None
        if qs is None:
            raise ConfigError(
                f"{self.info.name} got key segment ids but no query segment ids; pass segment_ids [{batch}, {lq}]"
            )
        for what, ids in (("segment_ids", qs), ("key_segment_ids", ks)):
            if not isinstance(ids, Tensor):
                raise ConfigError(f"{what} must be a torch.Tensor of integer ids, got {type(ids).__name__}")
            if ids.is_floating_point() or ids.dtype == torch.bool:
                raise ConfigError(f"{what} must be integer ids (torch.long), got dtype {ids.dtype}")
        if qs.dim() != 2 or qs.shape[0] not in (1, batch) or qs.shape[1] != lq:
            raise ConfigError(
                f"segment_ids must have shape [batch={batch}, length={lq}] (one id per query), got {tuple(qs.shape)}"
            )
        if ks.dim() != 2 or ks.shape[0] not in (1, batch) or ks.shape[1] not in (lk, lq):
            raise ConfigError(
                f"key segment ids must have shape [batch={batch}, keys={lk}]"
                + (f" (or [{batch}, {lq}], the memory then counts as segment {self.memory_segment})" if lk > lq else "")
                + f", got {tuple(ks.shape)}"
            )
        if ks.shape[1] != lk:  # the current tokens' ids only: memory / cached keys are segment 0 (XLNet)
            if lk < lq:
                raise ConfigError(f"key segment ids must have shape [{batch}, {lk}], got {tuple(ks.shape)}")
            pad = ks.new_full((ks.shape[0], lk - lq), self.memory_segment)
            ks = torch.cat([pad, ks], dim=1)
        return qs, ks

    def segment_terms(self, q: Tensor, ctx: AttentionContext, lk: int) -> Tensor | None:
        """``(q_i + b) · s_ij``: ``[B, H, Lq, Lk]`` (``None`` without segment ids)."""
        got = self.segments(ctx, q.shape[0], q.shape[2], lk)
        if got is None:
            return None
        qs, ks = got
        same = qs[:, :, None] == ks[:, None, :]  # [B|1, Lq, Lk]
        qb = q + self.b[:, None, :].to(q.dtype)
        seg = self.seg_embed.to(q.dtype)
        if ctx.reference:
            s_ij = torch.where(same[..., None, None], seg[0], seg[1])  # [B, Lq, Lk, H, Dh]
            return torch.einsum("bhid,bijhd->bhij", qb, s_ij.expand(q.shape[0], -1, -1, -1, -1))
        e = torch.einsum("bhid,shd->bhis", qb, seg)  # [B, H, Lq, 2]: (q_i + b)·s+, (q_i + b)·s-
        return torch.where(same[:, None], e[..., :1], e[..., 1:])

    def relative_form(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> RelativeForm | None:
        """Transformer-XL's form plus ``(q_i + b) · s±`` as a per-row pair chosen by segment equality."""
        form = super().relative_form(q, k, ctx)
        if form is None:
            return None
        got = self.segments(ctx, q.shape[0], q.shape[2], k.shape[2])
        if got is not None:
            qs, ks = got
            qb = q + self.b[:, None, :].to(q.dtype)
            e = torch.einsum("bhid,shd->bhis", qb, self.seg_embed.to(q.dtype))  # [B, H, Lq, 2]
            form.segment = (e, qs[:, :, None] == ks[:, None, :])
        return form

    def logits(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> Tensor:
        check_heads(self.info.name, q, self.n_heads, self.head_dim)
        out = self.position_terms(q, ctx)
        if not ctx.content_folded:
            out = out + self.content_bias(k)
        seg = self.segment_terms(q, ctx, k.shape[2])
        return out if seg is None else out + seg
