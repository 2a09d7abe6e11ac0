r"""MLA's decoupled RoPE (DeepSeek-V2, DeepSeek-V3, Kimi K2), with DeepSeek's YaRN and its softmax scale.

Multi-head latent attention compresses the keys into a latent that RoPE cannot pass through, so DeepSeek-V2 (§2.1.3,
eq. 14-19) *decouples* the position: each head's query and key are the concatenation of a part without position
(``qk_nope_head_dim`` channels, from the latent) and a small rotated part (``qk_rope_head_dim``):

.. math::
    q_{t,i} = [q^C_{t,i};\ \mathrm{RoPE}(q^R_{t,i}, t)], \qquad k_{s,i} = [k^C_{s,i};\ \mathrm{RoPE}(k^R_s, s)],
    \qquad a_{ts} = \mathrm{softmax}_s\Big(\frac{q^{C\top}_{t,i} k^C_{s,i} + q^{R\top}_{t,i} k^R_s}
    {\sqrt{d_{nope} + d_{rope}}}\, m^2\Big)

so that ``q·k`` is content on the first part and RoPE's relative score on the second. Here the encoding is the
rotation of the ``rope_dim`` slice of each head (the last channels, as DeepSeek concatenates them; or the first)
and the softmax scale; the latent projections are the attention's business (posenc's
:class:`~posenc.MultiHeadAttention` gives every head its own rotated key slice where MLA shares one between heads,
which changes the parameters, not the encoding).

**Layout.** DeepSeek's checkpoints hold the rotary channels in interleaved pairs ``(x_0, x_1), (x_2, x_3), ...``;
transformers' ``apply_rotary_pos_emb_interleave`` (``rope_interleave=True``, the default of ``DeepseekV3Config``)
gathers the even channels then the odd ones and rotates the result in the rotate-half layout, so the rotated slice
comes out *de-interleaved*: ``[x_0 c - x_1 s, x_2 c - x_3 s, ...; x_1 c + x_0 s, ...]``. ``interleaved=True`` does
the same (the default); ``interleaved=False`` is plain rotate-half on the slice (``rope_interleave=False``), which
gives the same scores on the de-interleaved copy of such weights.

**YaRN, DeepSeek's way** (``factor`` set): the slice's frequencies are YaRN's (``rope-yarn``, NTK-by-parts over the
``rope_dim`` slice, trained length ``original_max_len``), and with ``μ(s, c) = 0.1 c \ln s + 1``:

* cos and sin are multiplied by ``μ(s, mscale) / μ(s, mscale_all_dim)`` (1 for DeepSeek-V3 and Kimi K2, whose
  ``mscale = mscale_all_dim = 1``; DeepSeek-V2's are both 0.707);
* the softmax scale is ``(d_nope + d_rope)^{-1/2} · μ(s, mscale_all_dim)²`` (``m²`` above): the whole head's logits
  are sharpened, the unrotated part's too, which is why it cannot ride on cos and sin. A runtime that leaves
  ``mscale_all_dim`` out of the softmax scale attends with logits ``μ²`` times too flat (1.88 times at DeepSeek-V3's
  ``factor = 40``); ``tests/test_rotary_mla.py`` checks posenc's scale against transformers'
  ``DeepseekV3Attention.scaling`` and the whole attention against ``DeepseekV3Attention``.

Without ``factor`` the slice is plain RoPE and the scale ``head_dim^{-1/2}``. Precision: as ``rope`` (float32 phases,
HF transformers' numbers bit for bit below position ``2**24``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..base import AttentionContext, Card, Cost, PositionalEncoding, as_position_rows, check_positions
from ..errors import ConfigError
from ..registry import register
from .rope import RoPE, cached_cos_sin
from .scaling import RoPEYaRN, yarn_mscale


def _default_rope_dim(head_dim: int) -> int:
    # DeepSeek-V2/V3: 64 of 192 channels, a third, even
    return max(2, 2 * (head_dim // 6))


def _yarn_example(dims: dict) -> dict:
    # DeepSeek-V3's YaRN (mscale = mscale_all_dim = 1) on a model built for max_len from one trained on max_len / 4
    return {"factor": 4.0, "original_max_len": max(1, dims["max_len"] // 4), "mscale": 1.0, "mscale_all_dim": 1.0}


@register
class RoPEMLA(PositionalEncoding):
    r"""MLA's decoupled RoPE: RoPE (optionally DeepSeek's YaRN) on a ``rope_dim`` slice of each head.

    .. math::
        q = [q^C;\ R_{\Theta', t}\,q^R], \quad k = [k^C;\ R_{\Theta', s}\,k^R], \qquad
        \mathrm{scale} = \frac{\mu(s, \texttt{mscale\_all\_dim})^2}{\sqrt{\texttt{head\_dim}}}

    with ``Θ'`` RoPE's (or YaRN's) frequencies over ``rope_dim`` and ``R`` multiplied by
    ``μ(s, mscale) / μ(s, mscale_all_dim)`` under YaRN.

    Args:
        head_dim: the query/key head width, ``qk_nope_head_dim + qk_rope_head_dim`` (DeepSeek-V3: 192).
        rope_dim: ``qk_rope_head_dim``, the rotated channels (DeepSeek-V3: 64; default a third of the head, even).
        base: RoPE's base (DeepSeek-V3: 10000).
        factor: YaRN's extension factor (DeepSeek-V3: 40; ``None``: plain RoPE on the slice).
        original_max_len: the trained context, YaRN's ``original_max_position_embeddings`` (DeepSeek-V3: 4096).
        beta_fast, beta_slow: YaRN's ramp (32 and 1).
        mscale, mscale_all_dim: DeepSeek's YaRN scales (DeepSeek-V3, Kimi K2: 1 and 1; V2: 0.707 and 0.707).
        interleaved: the slice is in DeepSeek's interleaved pairs (``rope_interleave``), rotated de-interleaved.
        rope_first: the rotated slice is the first ``rope_dim`` channels of the head, not the last (DeepSeek).
    """

    info = Card(
        name="rope-mla",
        title="MLA decoupled RoPE (DeepSeek YaRN)",
        paper="DeepSeek-AI, DeepSeek-V2: A Strong, Economical, and Efficient Mixture-of-Experts Language Model",
        year=2024,
        family="rotary",
        position="relative",
        learnable=False,
        summary="RoPE on a qk_rope_head_dim slice of each head, the rest unrotated; YaRN sharpens the whole softmax.",
        reference=(
            "HF transformers 5.24 DeepseekV3RotaryEmbedding (yarn) + apply_rotary_pos_emb_interleave and "
            "DeepseekV3Attention (its scaling and output), float64: max diff 0 (the rotation and its gradients), "
            "4.4e-16 (the attention's output)"
        ),
        aliases=("mla-rope", "decoupled-rope", "deepseek-rope"),
    )
    # relative scores; RoFormer's decay and the rest hold on the rotated slice
    claims = dict(relative_only=True, direction_aware=True, bounded=True, linear_offset=True, consistent=True)
    example_options = staticmethod(_yarn_example)

    def __init__(
        self,
        head_dim: int,
        rope_dim: int | None = None,
        base: float = 10000.0,
        factor: float | None = None,
        original_max_len: int | None = None,
        beta_fast: float | None = None,
        beta_slow: float | None = None,
        mscale: float | None = None,
        mscale_all_dim: float | None = None,
        interleaved: bool = True,
        rope_first: bool = False,
    ):
        super().__init__()
        name = self.info.name
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 2:
            raise ConfigError(f"{name}: head_dim must be an integer >= 2 (nope + rope channels), got {head_dim!r}")
        rope_dim = _default_rope_dim(head_dim) if rope_dim is None else rope_dim
        if isinstance(rope_dim, bool) or not isinstance(rope_dim, int) or rope_dim < 2 or rope_dim % 2:
            raise ConfigError(
                f"{name}: rope_dim (qk_rope_head_dim) must be an even integer >= 2 (it rotates pairs), got {rope_dim!r}"
            )
        if rope_dim > head_dim:
            raise ConfigError(
                f"{name}: rope_dim={rope_dim} is larger than head_dim={head_dim}; head_dim is the whole query/key head "
                f"(qk_nope_head_dim + qk_rope_head_dim), so rope_dim must be <= {head_dim}"
            )
        yarn_only = {"original_max_len": original_max_len, "beta_fast": beta_fast, "beta_slow": beta_slow}
        yarn_only.update(mscale=mscale, mscale_all_dim=mscale_all_dim)
        if factor is None:
            given = [k for k, v in yarn_only.items() if v is not None]
            if given:
                raise ConfigError(
                    f"{name}: {', '.join(given)} set YaRN, which needs factor (the extension ratio, DeepSeek-V3: 40); "
                    "pass factor too, or leave them out for plain RoPE on the slice"
                )
            self.rope: RoPE = RoPE(rope_dim, base)
        else:
            if original_max_len is None:
                raise ConfigError(
                    f"{name}: YaRN (factor={factor}) needs original_max_len, the context the model was trained on "
                    "(original_max_position_embeddings; DeepSeek-V3: 4096)"
                )
            try:
                self.rope = RoPEYaRN(
                    rope_dim,
                    factor,
                    original_max_len,
                    base,
                    beta_fast=32.0 if beta_fast is None else beta_fast,
                    beta_slow=1.0 if beta_slow is None else beta_slow,
                    mscale=mscale,
                    mscale_all_dim=mscale_all_dim,
                )
            except ConfigError as e:
                raise ConfigError(f"{name} (YaRN on its rope_dim={rope_dim} slice): {e}") from None
        self.head_dim, self.rope_dim, self.nope_dim = head_dim, rope_dim, head_dim - rope_dim
        self.interleaved, self.rope_first = bool(interleaved), bool(rope_first)
        self.factor, self.mscale_all_dim = factor, mscale_all_dim
        # DeepSeek's softmax factor: μ(s, mscale_all_dim)² where mscale_all_dim is set (transformers' yarn_apply_mscale)
        self.softmax_mscale = yarn_mscale(float(factor), mscale_all_dim) if factor and mscale_all_dim else None

    @property
    def inv_freq(self) -> Tensor:
        """The slice's inverse frequencies (float32, ``[rope_dim / 2]``)."""
        return self.rope.inv_freq

    def scale(self, head_dim: int) -> float:
        """``head_dim^{-1/2}``, times ``μ(factor, mscale_all_dim)²`` under DeepSeek's YaRN (in transformers' order)."""
        s = head_dim**-0.5
        if self.softmax_mscale is not None:
            s = s * self.softmax_mscale * self.softmax_mscale
        return s

    def cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos and sin of the slice's phases (float32, ``[..., rope_dim / 2]``; YaRN's attention factor applied)."""
        return self.rope.cos_sin(positions)

    def apply(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Rotate the ``rope_dim`` slice of ``x [..., L, head_dim]`` by ``cos``/``sin`` ``[..., L, rope_dim/2]``; the
        other channels pass through."""
        if x.shape[-1] != self.head_dim:
            raise ConfigError(f"{self.info.name} was built for head_dim={self.head_dim}, got {x.shape[-1]}")
        r, n = self.rope_dim, self.nope_dim
        pe, rest = (x[..., :r], x[..., r:]) if self.rope_first else (x[..., n:], x[..., :n])
        if self.interleaved:  # DeepSeek's pairs (2i, 2i + 1) -> (i, i + r/2): evens, then odds
            pe = torch.cat((pe[..., 0::2], pe[..., 1::2]), dim=-1)
        pe = self.rope.apply(pe, cos, sin)
        if n == 0:
            return pe
        return torch.cat((pe, rest) if self.rope_first else (rest, pe), dim=-1)

    def cost(self, head_dim: int) -> Cost:
        # x ⊙ cos + rotate_half(x) ⊙ sin on the rope_dim slice of q and of k: 2 × 3·rope_dim per token and head
        # (cos / sin are a table per position shared by the heads); the softmax scale is a number; nothing per pair
        return Cost(token_elementwise=6.0 * self.rope_dim, note="the rope_dim slice of q and k rotated once per token")

    def rotate(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> tuple[Tensor, Tensor]:
        qc, qs, kc, ks = cached_cos_sin(self, ctx, "rope-mla-cos-sin")
        return self.apply(q, qc, qs), self.apply(k, kc, ks)

    def forward(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        """Rotate one tensor: ``x`` is ``(b, l, head_dim)`` or ``(b, h, l, head_dim)``; positions ``[L]`` or
        ``[B, L]``."""
        if x.dim() not in (3, 4):
            raise ConfigError(f"expected (b, l, d) or (b, h, l, d), got {tuple(x.shape)}")
        rows = as_position_rows(positions, x.shape[-2], x.device)
        if rows.is_floating_point():
            check_positions(rows, integer=False)
        cos, sin = self.cos_sin(rows)
        if x.dim() == 4:
            cos, sin = cos[:, None], sin[:, None]
        return self.apply(x, cos, sin)
