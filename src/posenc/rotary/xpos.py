r"""xPos: RoPE with an exponential decay by distance (Sun et al. 2023, "A Length-Extrapolatable Transformer").

Each rotary pair ``i`` of the query at position ``n`` is rotated as in RoPE and
multiplied by ``ζ_i^{n/γ}``; the key at position ``m`` by ``ζ_i^{-m/γ}``:

.. math::
    q_n' = \zeta^{\,n/\gamma} \odot R_{\Theta,n}\, q_n, \qquad
    k_m' = \zeta^{-m/\gamma} \odot R_{\Theta,m}\, k_m, \qquad
    q_n'^\top k_m' = \sum_i \zeta_i^{(n-m)/\gamma}\, \big[R_{\Theta,n-m}\big]_i (q, k)

with ``ζ_i = (i/(d/2) + γ_ζ) / (1 + γ_ζ)``, ``γ_ζ = 0.4`` and the scale base
``γ = 512``, as microsoft/torchscale's ``XPOS`` (``(arange(0, d, 2) + 0.4 d) / (1.4 d)``).
Since ``ζ_i < 1``, a pair's contribution decays with the distance ``n - m``
(faster for low ``i``, the high-frequency pairs), which stabilises attention
beyond the trained length.

Overflow. ``ζ_0 ≈ 0.29``, so ``ζ_0^{-m/512}`` exceeds float32's range near
``m ≈ 36000`` (float16: ``m ≈ 4500``). Any common shift ``c`` cancels in the
score (``ζ^{(n-c)/γ} ζ^{-(m-c)/γ} = ζ^{(n-m)/γ}``), so the scale is computed
relative to a centre ``c``: with ``center="auto"`` (default) ``c`` is the middle
of the positions of the call, ``floor((min + max) / 2)``, so only the *span* of
the positions seen together is limited, not their size. torchscale centres on
``ceil(L/2)`` of the current length (and re-applies xPos to all cached keys at
every step); its q and k are reproduced exactly with ``center=ceil(L/2)``, and
the scores q·k are the same for any centre. The KV cache stores keys after the rotation, so a cached key keeps
the centre of the call that stored it: when the attention runs with a KV cache
(``ctx.caching``), ``center="auto"`` uses the centre 0 in every call (a fixed
integer ``center`` is used as given), which limits cached decoding to positions
within the float range of the centre. Positions too far from the centre for the dtype raise a
:class:`~posenc.errors.PositionError` instead of producing inf / NaN.

Layout: the paper writes each pair as a complex number ``q_{2i} + i q_{2i+1}``
and torchscale uses rotate-every-two with ``duplicate_interleave``, so pairs
are ``(2i, 2i+1)`` by default (``interleaved=True``); ``interleaved=False`` uses
the rotate-half layout of ``rope`` (pairs ``(i, i + d/2)``), same ``ζ_i`` and ``θ_i``.
The paper's blockwise causal attention at inference is not part of this encoding.

Precision: the rotation's phases are RoPE's (float32, HF's numbers below position
``2**24``, reduced modulo 2π in float64 beyond; see :func:`~posenc.rotary.rope.rope_angles`);
``ζ`` is a float64 buffer and the decay ``ζ^{(p - c)/γ}`` is computed in float64 and
rounded to float32 (float64 for float64 inputs). Casting the module (``.double()``,
``.half()``, ``.to(torch.bfloat16)``) leaves ``θ`` float32 and ``ζ`` float64.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..base import AttentionContext, Card, Cost, as_position_rows, check_positions
from ..errors import ConfigError, PositionError
from ..registry import register
from .rope import RoPE


@register
class XPos(RoPE):
    r"""xPos (Sun et al. 2023): RoPE plus a per-pair exponential decay ``ζ_i^{(n-m)/γ}``.

    .. math::
        q_n' = \zeta^{n/\gamma} \odot R_{\Theta,n} q_n,\quad k_m' = \zeta^{-m/\gamma} \odot R_{\Theta,m} k_m,\quad
        \zeta_i = \frac{i/(d/2) + \gamma_\zeta}{1 + \gamma_\zeta}

    Args:
        head_dim: the head width (even).
        base: RoPE's base for ``θ_i = base^{-2i/d}``.
        scale_base: ``γ`` (512 in the paper and torchscale).
        gamma: ``γ_ζ`` (0.4).
        interleaved: pairs ``(2i, 2i+1)`` as the paper / torchscale (default) or ``(i, i+d/2)``.
        center: ``"auto"`` (the middle of each call's positions) or a fixed integer position
            (needed for KV-cache decoding); see the module docstring.
    """

    info = Card(
        name="xpos",
        title="xPos",
        paper="Sun et al., A Length-Extrapolatable Transformer",
        year=2023,
        family="rotary",
        position="relative",
        learnable=False,
        summary="RoPE whose pairs decay as ζ_i^((n-m)/γ): q scaled by ζ^(n/γ), k by ζ^(-m/γ).",
        reference="the paper's formula (naive per-pair loop), torchscale's ζ_i and layout",
        shortcoming="scales overflow far from the centre (cached decoding uses centre 0)",
    )
    randomized_variant = False
    claims = {"relative_only": True, "decay": True}
    phase_buffers = (*RoPE.phase_buffers, "zeta")  # ζ stays float64 under module casts

    def __init__(
        self,
        head_dim: int,
        base: float = 10000.0,
        scale_base: float = 512.0,
        gamma: float = 0.4,
        interleaved: bool = True,
        center: int | str = "auto",
    ):
        super().__init__(head_dim, base)
        if not scale_base > 0:
            raise ConfigError(f"xpos: scale_base (γ) must be > 0, got {scale_base} (the paper uses 512)")
        if not gamma > 0:
            raise ConfigError(
                f"xpos: gamma (γ_ζ) must be > 0 so that every ζ_i = (i/(d/2) + γ_ζ)/(1 + γ_ζ) is > 0, got {gamma} "
                "(the paper uses 0.4)"
            )
        if not (center == "auto" or (isinstance(center, int) and not isinstance(center, bool))):
            raise ConfigError(f"xpos: center must be 'auto' or an integer position, got {center!r}")
        self.scale_base, self.gamma, self.center = float(scale_base), float(gamma), center
        self.interleaved = bool(interleaved)
        zeta = (torch.arange(0, head_dim, 2, dtype=torch.float64) + gamma * head_dim) / ((1 + gamma) * head_dim)
        self.register_buffer("zeta", zeta, persistent=False)

    # ------------------------------------------------------------ the decay
    def decay(self, positions: Tensor, center: float, dtype: torch.dtype = torch.float32) -> Tensor:
        r"""``ζ^{(p - c)/γ}``: ``[..., head_dim/2]`` (keys use its reciprocal)."""
        exponent = (positions.to(torch.float64) - center)[..., None] / self.scale_base
        log_zeta = self.zeta.log().to(positions.device)
        work = torch.float64 if dtype == torch.float64 else torch.float32
        return torch.exp(exponent * log_zeta).to(work)

    def _check_range(self, positions: Tensor, center: float | Tensor, dtype: torch.dtype) -> None:
        if positions.numel() == 0 or torch.compiler.is_compiling():
            return
        far = float((positions.to(torch.float64) - center).abs().max())
        largest = far / self.scale_base * -math.log(float(self.zeta[0]))
        info = torch.finfo(dtype if dtype.is_floating_point else torch.float32)
        limit = -math.log(info.tiny)
        if largest > limit:
            span = int(limit * self.scale_base / -math.log(float(self.zeta[0])))
            raise PositionError(
                f"xpos: a position {far:.0f} away from the scale centre {center:g} needs "
                f"ζ_0^±{far / self.scale_base:.1f} = e^±{largest:.1f}, beyond {info.dtype} (|p - c| <= {span}); "
                "use center='auto', a center nearer the positions, or a wider dtype"
            )

    def _center(self, *positions: Tensor) -> float | Tensor:
        if self.center != "auto":
            return float(self.center)
        if torch.compiler.is_compiling():  # the same value as a 0-d float64 tensor (no data-dependent float())
            lo = torch.stack([p.min() for p in positions if p.numel()]).min().to(torch.float64)
            hi = torch.stack([p.max() for p in positions if p.numel()]).max().to(torch.float64)
            return torch.floor((lo + hi) / 2)
        lo = min(float(p.min()) for p in positions if p.numel())
        hi = max(float(p.max()) for p in positions if p.numel())
        return float(math.floor((lo + hi) / 2))

    def scaled_cos_sin(self, positions: Tensor, center: float, sign: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and sin of the phases times ``ζ^{±(p - c)/γ}`` (``sign`` +1: queries, -1: keys)."""
        self._check_range(positions, center, dtype)
        cos, sin = self.cos_sin(positions)
        scale = self.decay(positions, center, dtype)
        if sign < 0:
            scale = scale.reciprocal()
        work = scale.dtype
        return cos.to(work) * scale, sin.to(work) * scale

    # ----------------------------------------------------------- the hooks
    def cost(self, head_dim: int) -> Cost:
        # RoPE's rotation (2 × 3·rotary_dim per token and head) with ζ^{±t/γ} folded into cos and sin per position
        # (2 multiplies per rotated pair, shared by the heads): nothing per pair
        return Cost(
            token_elementwise=6.0 * self.rotary_dim,
            note="q and k rotated and scaled once per token (the scale folded into cos / sin), nothing per pair",
        )

    def rotate(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> tuple[Tensor, Tensor]:
        key = ("xpos-cos-sin", id(self), q.dtype)
        got = ctx.cache.get(key)
        if got is None or got[0] is not ctx.q_pos or got[1] is not ctx.k_pos:
            if ctx.q_pos.numel() == 0 and ctx.k_pos.numel() == 0:
                return q, k
            # keys that go into a KV cache keep the centre they were scaled with: use one centre for
            # every call then (the fixed one, or 0 under "auto")
            c = 0.0 if (ctx.caching and self.center == "auto") else self._center(ctx.q_pos, ctx.k_pos)
            qc, qs = self.scaled_cos_sin(ctx.q_pos, c, +1, q.dtype)
            kc, ks = self.scaled_cos_sin(ctx.k_pos, c, -1, q.dtype)
            got = (ctx.q_pos, ctx.k_pos, qc[:, None], qs[:, None], kc[:, None], ks[:, None])
            ctx.cache[key] = got
        _, _, qc, qs, kc, ks = got
        return self.apply(q, qc, qs), self.apply(k, kc, ks)

    def forward(
        self, x: Tensor, positions: Tensor | None = None, *, downscale: bool = False, center: float | None = None
    ) -> Tensor:
        """Transform one tensor: a query (``downscale=False``) or a key (``downscale=True``).

        Queries and keys must use the same ``center`` (default: the fixed ``center`` of the
        encoding, or 0 when it is ``"auto"``).
        """
        if x.dim() not in (3, 4):
            raise ConfigError(f"expected (b, l, d) or (b, h, l, d), got {tuple(x.shape)}")
        rows = as_position_rows(positions, x.shape[-2], x.device)
        if rows.is_floating_point():
            check_positions(rows, integer=False)  # NaN / inf / negative: refused, as the attention does
        if center is None:
            center = 0.0 if self.center == "auto" else float(self.center)
        cos, sin = self.scaled_cos_sin(rows, float(center), -1 if downscale else +1, x.dtype)
        if x.dim() == 4:
            cos, sin = cos[:, None], sin[:, None]
        return self.apply(x, cos, sin)
