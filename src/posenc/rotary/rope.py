r"""Rotary position embedding, RoPE (Su et al. 2021, RoFormer), in both layouts.

RoPE rotates each pair of query / key dimensions by an angle proportional to
the position. With ``R_Θ,m`` the block-diagonal rotation of position m,

.. math::
    q_m = R_{\Theta,m} W_q x_m, \qquad k_n = R_{\Theta,n} W_k x_n, \qquad
    q_m^\top k_n = (W_q x_m)^\top R_{\Theta,\,n-m} (W_k x_n)

so the content-content term (a) depends on the offset ``n - m`` only.
``Θ = {θ_i = base^{-2i/d}}, i = 0 .. d/2 - 1``.

Layouts (which dimensions form a pair):

* ``rope`` -- *rotate-half* (GPT-NeoX, Llama): dimension i pairs with i + d/2;
* ``rope-interleaved`` -- *rotate-every-two* (RoFormer, GPT-J, the ``forward_rope`` of
  anon., "Positional encoding of the Transformer"): dimension 2i pairs with 2i + 1.

Both accept a partial ``rotary_dim`` (only the first ``rotary_dim`` dimensions
rotate, as GPT-NeoX's ``rotary_pct``; an odd ``head_dim`` with an even ``rotary_dim`` too),
compute the phases in float32 whatever the input dtype, and keep a cos/sin table of the first positions (up to
``RoPE.table_limit``) that every layer shares.

Precision of the phases (:func:`rope_angles`). ``θ_i`` is float32 and, for
``|m| < 2**24`` (:data:`FLOAT32_EXACT`, where float32 still holds every integer),
the angle is float32's own product ``fl32(m · θ_i)`` and cos/sin are float32:
bit for bit the numbers of HF transformers (``inv_freq`` float32, position
float32, product float32). That product is rounded to float32, so its absolute
error grows with the position (half a float32 ulp of ``m θ_i``, at most
``m θ_i · 2^-24`` rad: ~0.004 rad at ``m = 2**16``, ~0.5 rad just below
``2**24``), exactly as in HF. From ``|m| >= 2**24`` on,
where float32 would merge neighbouring positions (``2**24 + 1`` would rotate as
``2**24``), the angle is computed exactly in float64 from the integer position
and the same float32 ``θ_i``, reduced modulo 2π, and rounded once to float32 in
``[-π, π]``: any position up to ``2**63`` keeps its offsets to ``~1.2e-7`` rad.
The phases do not follow the module's dtype: ``.double()``, ``.half()`` or
``.to(torch.bfloat16)`` leave ``inv_freq`` and the table float32 (``.to(device)``
moves them); only the rotation itself runs in the input's dtype.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from .. import native
from ..base import AttentionContext, Card, Cost, PositionalEncoding, as_position_rows, check_positions
from ..errors import ConfigError
from ..registry import register

#: From this position on float32 does not hold every integer; below it ``fl32(m · θ)`` is HF's angle.
FLOAT32_EXACT = 1 << 24
_TWO_PI = 2 * math.pi  # float64(2π)
_TWO_PI_LOW = 2.4492935982947064e-16  # 2π - float64(2π)
_CHUNK = 24  # bits of a position per exact float64 product with a float32 θ (24 + 24 <= 53)


def rope_inverse_frequencies(rotary_dim: int, base: float) -> Tensor:
    r"""``θ_i = base^{-2i/d}`` in float32, computed as HF transformers does."""
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))


def _far_mask(m: Tensor) -> Tensor:
    far = m.abs() >= FLOAT32_EXACT
    return far & m.isfinite() if m.is_floating_point() else far


def _reduced_angles(m: Tensor, inv_freq: Tensor) -> Tensor:
    """``m · θ`` modulo 2π, in float32 ``[-π, π]``, computed exactly in float64 (see :func:`rope_angles`)."""
    theta = inv_freq.to(torch.float64)
    if m.is_floating_point():
        m64 = m.to(torch.float64)
        whole = torch.floor(m64)
        rest = (m64 - whole) * theta  # the fraction's phase (m64 - whole is exact)
        n = whole.clamp(-(2.0**62), 2.0**62).to(torch.int64)
    else:
        m64, rest, n = m.to(torch.float64), None, m.to(torch.int64)
    # n = c2·2^48 + c1·2^24 + c0 with c0, c1 in [0, 2^24): each c·θ is exact in float64, and so is
    # fmod(c·θ·2^k, C), which removes whole multiples of C = float64(2π)
    mask = (1 << _CHUNK) - 1
    a = torch.fmod((n & mask).to(torch.float64) * theta, _TWO_PI)
    a = a + torch.fmod(((n >> _CHUNK) & mask).to(torch.float64) * (theta * 2.0**_CHUNK), _TWO_PI)
    a = a + torch.fmod((n >> (2 * _CHUNK)).to(torch.float64) * (theta * 2.0 ** (2 * _CHUNK)), _TWO_PI)
    if rest is not None:
        a = a + rest
    # K turns of C were removed, K ≈ m·θ / C: add back what K true turns of 2π would also remove
    a = a - (m64 * theta) * (_TWO_PI_LOW / _TWO_PI)
    a = a - torch.round(a / _TWO_PI) * _TWO_PI  # into [-π, π]; |a| was < 3C + 360θ: error < 1e-13
    return a.to(torch.float32)


def rope_angles(multipliers: Tensor, inv_freq: Tensor, far: bool | None = None) -> Tensor:
    r"""The phases ``m · θ_i`` in float32: ``multipliers [..., 1 | n]`` times float32 ``inv_freq [n]``.

    * ``|m| < 2**24`` (:data:`FLOAT32_EXACT`): ``fl32(m) · θ_i`` in float32, HF's number bit for bit
      (a float64 ``m`` is multiplied in float64 and rounded once: the same number when float32
      holds ``m``, a closer one otherwise).
    * ``|m| >= 2**24``: ``m · θ_i`` reduced modulo 2π and rounded to float32 in ``[-π, π]``. The
      integer part of ``m`` is split into 24-bit pieces whose products with ``θ_i`` are exact in
      float64; each is reduced by ``fmod`` (exact) and the turns of ``float64(2π) ≠ 2π`` removed
      are corrected for, so the angle is within ``~1e-13`` rad of the exact one before the
      float32 rounding (``<= 1.2e-7`` rad). Exact for integer positions up to ``2**63`` (float
      positions: up to ``2**62``).

    ``far`` says whether any ``|m| >= 2**24`` may be present (``None``: look, which reads the
    data; under ``torch.compile`` both forms are computed and chosen element-wise).
    """
    if multipliers.dtype == torch.float64:
        a = (multipliers * inv_freq.to(torch.float64)).to(torch.float32)
    else:
        a = multipliers.float() * inv_freq
    if far is None:
        far = torch.compiler.is_compiling() or (multipliers.numel() > 0 and bool(_far_mask(multipliers).any()))
    if not far:
        return a
    return torch.where(_far_mask(multipliers), _reduced_angles(multipliers, inv_freq), a)


def _fast_rotation(x: Tensor, cos: Tensor, sin: Tensor) -> bool:
    """Whether :meth:`RoPE.apply` may use its one-pass forms (eager, constant phases, real floats)."""
    return (
        not torch.compiler.is_compiling()
        and x.dtype in (torch.float32, torch.float64)
        and not cos.requires_grad
        and not sin.requires_grad
    )


def _version(t: Tensor) -> int | None:
    """A tensor's in-place version counter (``None`` for inference tensors, which keep none)."""
    try:
        return t._version
    except RuntimeError:
        return None


def _complex_view_ok(x: Tensor) -> bool:
    """``view_as_complex`` needs unit stride in the last dim and even strides / offset elsewhere."""
    return x.stride(-1) == 1 and x.storage_offset() % 2 == 0 and all(st % 2 == 0 for st in x.stride()[:-1])


def _rotate_half_into(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``cat(x1 cos - x2 sin, x2 cos + x1 sin)`` written straight into one output (no temporaries, no cat)."""
    h = x.shape[-1] // 2
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    x1, x2, o1, o2 = x[..., :h], x[..., h:], out[..., :h], out[..., h:]
    torch.mul(x1, cos, out=o1)
    o1.addcmul_(x2, sin, value=-1)
    torch.mul(x2, cos, out=o2)
    o2.addcmul_(x1, sin)
    return out


class _RotateHalf(torch.autograd.Function):
    """Rotate-half RoPE as one autograd node; the backward rotates the gradient back (by ``-θ``)."""

    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(cos, sin)
        return _rotate_half_into(x, cos, sin)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        cos, sin = ctx.saved_tensors
        return _RotateHalf.apply(grad, cos, -sin), None, None


def cached_cos_sin(enc: Any, ctx: AttentionContext, tag: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``enc.cos_sin`` of the call's query and key positions, ``[B, 1, L, r/2]`` each (broadcast over heads), kept in
    the forward's cache under ``(tag, id(enc))`` while the positions are the same tensors (every layer of a forward
    shares them): ``(q cos, q sin, k cos, k sin)``."""
    key = (tag, id(enc))
    got = ctx.cache.get(key)
    if got is None or got[0] is not ctx.q_pos or got[1] is not ctx.k_pos:
        qc, qs = enc.cos_sin(ctx.q_pos)
        kc, ks = (qc, qs) if ctx.k_pos is ctx.q_pos else enc.cos_sin(ctx.k_pos)
        got = (ctx.q_pos, ctx.k_pos, qc[:, None], qs[:, None], kc[:, None], ks[:, None])
        ctx.cache[key] = got
    return got[2], got[3], got[4], got[5]


@register
class RoPE(PositionalEncoding):
    r"""Rotary position embedding, rotate-half layout (GPT-NeoX / Llama).

    .. math::
        \mathrm{RoPE}(x, m) = x \odot \cos(m\Theta) + \mathrm{rotate\_half}(x) \odot \sin(m\Theta),
        \quad \mathrm{rotate\_half}([x_1; x_2]) = [-x_2; x_1]

    with ``Θ`` repeated over the two halves, ``θ_i = base^{-2i/d}``.

    Precision: ``θ_i``, the angles and cos/sin are float32 whatever the module's or the
    input's dtype; below position ``2**24`` they are HF's numbers bit for bit, from ``2**24``
    on the angle is reduced modulo 2π in float64 so that offsets stay exact (see
    :func:`rope_angles` and the module docstring). cos/sin of positions below
    :attr:`table_limit` come from a table shared by the layers; a call with a position
    beyond it computes the phases of its own positions only (the same numbers).
    """

    #: rows of the shared cos/sin table at most (positions ``0 .. table_limit - 1``); beyond, computed per call
    table_limit: int = 1 << 16
    #: buffers that keep their dtype when the module is cast (``.double()``, ``.half()``, ``.to(dtype)``)
    phase_buffers: tuple[str, ...] = ("inv_freq", "_cos", "_sin")
    #: dtypes a module cast may still give them (none: ``.to(device)`` moves them, nothing casts them)
    phase_casts: tuple[torch.dtype, ...] = ()

    info = Card(
        name="rope",
        title="RoPE (rotate-half)",
        paper="Su et al., RoFormer: Enhanced Transformer with Rotary Position Embedding",
        year=2021,
        family="rotary",
        position="relative",
        learnable=False,
        summary="Rotate q, k pairs (i, i+d/2) by m·θ_i: q·k depends on n-m only.",
        reference="HF transformers Llama apply_rotary_pos_emb",
        aliases=("rotary", "rope-half", "rope-neox"),
    )
    randomized_variant = True
    # RoFormer: relative scores, long-term decay
    claims = dict(
        relative_only=True, direction_aware=True, decay=True, bounded=True, linear_offset=True, consistent=True
    )
    interleaved = False

    def __init__(self, head_dim: int, base: float = 10000.0, rotary_dim: int | None = None):
        super().__init__()
        if not isinstance(head_dim, int) or head_dim <= 0:
            raise ConfigError(f"head_dim must be a positive integer, got {head_dim!r}")
        if head_dim % 2 and rotary_dim is None:
            # an odd head_dim is fine with a partial rotation (the last dimensions pass through, as GPT-NeoX's
            # rotary_pct and HF's partial rotary factor do); rotating all of it is not
            raise ConfigError(
                f"RoPE rotates pairs of dimensions, so head_dim must be even, got {head_dim}; "
                f"use head_dim={head_dim - 1} or {head_dim + 1}, or rotate an even part of it with rotary_dim "
                f"(e.g. rotary_dim={head_dim - 1}: the last dimension then passes through unrotated)"
                if head_dim > 1
                else f"RoPE rotates pairs of dimensions, so head_dim must be even, got {head_dim}; use head_dim=2"
            )
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int):
            raise ConfigError(f"rotary_dim must be an even integer in 2..{head_dim}, got {rotary_dim!r}")
        if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
            top = head_dim - head_dim % 2
            raise ConfigError(
                f"rotary_dim must be even and in 2..{top} (it rotates pairs of the head_dim={head_dim} "
                f"dimensions), got {rotary_dim}"
                + (f"; the largest is {top}" if top >= 2 else "; head_dim=1 has no pair to rotate: use head_dim >= 2")
            )
        if base <= 1:
            raise ConfigError(f"base must be > 1, got {base}")
        self.head_dim, self.rotary_dim, self.base = head_dim, rotary_dim, base
        self.register_buffer("inv_freq", rope_inverse_frequencies(rotary_dim, base), persistent=False)
        self.register_buffer("_cos", torch.empty(0, rotary_dim // 2), persistent=False)
        self.register_buffer("_sin", torch.empty(0, rotary_dim // 2), persistent=False)
        # the last lookup: (positions, its version, the table, cos, sin); a repeated call skips the checks
        self._memo: tuple | None = None

    def _apply(self, fn, recurse=True):
        # a dtype cast of the module leaves the phase buffers as they are; a move still moves them
        kept = {name: buf for name in self.phase_buffers if (buf := self._buffers.get(name)) is not None}
        out = super()._apply(fn, recurse)
        for name, before in kept.items():
            after = self._buffers.get(name)
            if after is not None and after.dtype != before.dtype and after.dtype not in self.phase_casts:
                self._buffers[name] = before.to(after.device)
        self._memo = None
        return out

    # ------------------------------------------------------------ the phases
    def angles(self, positions: Tensor) -> Tensor:
        """``m · θ_i`` in float32: ``[..., rotary_dim/2]`` (reduced modulo 2π from ``2**24`` on, see
        :func:`rope_angles`)."""
        return rope_angles(positions[..., None], self.inv_freq)

    def _grow(self, n: int) -> None:
        size = max(n, min(1 << max(n - 1, 1).bit_length(), self.table_limit))
        a = self.angles(torch.arange(size, device=self.inv_freq.device))
        self._cos, self._sin = a.cos(), a.sin()

    def cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos and sin of the phases of ``positions`` (float32, ``[..., rotary_dim/2]``).

        Integer positions below :attr:`table_limit` are looked up in a table that grows
        as needed (to a power of two, at most ``table_limit`` rows) and is shared by every
        layer; a call that reaches beyond it, and fractional positions, compute the
        phases of their own positions (the same numbers as the table's).
        """
        if positions.is_floating_point() or torch.compiler.is_compiling():
            a = self.angles(positions)
            return a.cos(), a.sin()
        memo = self._memo
        version = _version(positions)
        if memo is not None and memo[0] is positions and memo[1] == version and memo[2] is self._cos:
            return memo[3], memo[4]  # the same positions tensor, unchanged, as last time
        top = 0
        if positions.numel():
            check_positions(positions)
            top = int(positions.max()) + 1
        if top <= self.table_limit:
            if top > self._cos.shape[0]:
                self._grow(top)
            cos, sin = self._cos[positions], self._sin[positions]
        else:  # far positions: only those in use (a table up to them could be gigabytes)
            a = self.angles(positions)
            cos, sin = a.cos(), a.sin()
        self._memo = None if version is None else (positions, version, self._cos, cos, sin)
        return cos, sin

    # ----------------------------------------------------------- the rotation
    def apply(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Rotate ``x [..., L, head_dim]`` by float32 ``cos``/``sin`` ``[..., L, rotary_dim/2]``."""
        if x.shape[-1] != self.head_dim:
            raise ConfigError(f"{self.info.name} was built for head_dim={self.head_dim}, got {x.shape[-1]}")
        r = self.rotary_dim
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        out = native.rope_rotate(x, cos, sin, r, self.interleaved)  # one pass in C, where it applies
        if out is not None:
            return out
        rot, rest = (x, None) if r == self.head_dim else (x[..., :r], x[..., r:])
        if _fast_rotation(rot, cos, sin):
            if self.interleaved and _complex_view_ok(rot):
                # pairs (2i, 2i+1) are the real and imaginary parts of one complex number: one multiply
                z = torch.view_as_complex(rot.unflatten(-1, (r // 2, 2)))
                out = torch.view_as_real(z * torch.complex(cos, sin)).flatten(-2)
            elif not self.interleaved:
                out = _RotateHalf.apply(rot, cos, sin)
            else:
                out = None
            if out is not None:
                return out if rest is None else torch.cat((out, rest), dim=-1)
        if self.interleaved:
            pairs = rot.unflatten(-1, (r // 2, 2))
            x0, x1 = pairs[..., 0], pairs[..., 1]
            out = torch.stack((x0 * cos - x1 * sin, x1 * cos + x0 * sin), dim=-1).flatten(-2)
        else:
            x1, x2 = rot[..., : r // 2], rot[..., r // 2 :]
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return out if rest is None else torch.cat((out, rest), dim=-1)

    def cost(self, head_dim: int) -> Cost:
        # x ⊙ cos + rotate_half(x) ⊙ sin: 3 per rotated element of q and of k, 2 × 3·rotary_dim per token and head
        # (cos / sin are a table per position shared by the heads); nothing per pair
        return Cost(token_elementwise=6.0 * self.rotary_dim, note="q and k rotated once per token, nothing per pair")

    def rotate(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> tuple[Tensor, Tensor]:
        qc, qs, kc, ks = cached_cos_sin(self, ctx, "rope-cos-sin")
        return self.apply(q, qc, qs), self.apply(k, kc, ks)

    def forward(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        """Rotate one tensor: ``x`` is ``(b, l, d)`` or ``(b, h, l, d)``; positions ``[L]`` or ``[B, L]``."""
        if x.dim() not in (3, 4):
            raise ConfigError(f"expected (b, l, d) or (b, h, l, d), got {tuple(x.shape)}")
        rows = as_position_rows(positions, x.shape[-2], x.device)
        if rows.is_floating_point():  # integer positions are checked where the table is read (cos_sin)
            check_positions(rows, integer=False)  # NaN / inf / negative: refused, as the attention does
        cos, sin = self.cos_sin(rows)
        if x.dim() == 4:
            cos, sin = cos[:, None], sin[:, None]
        return self.apply(x, cos, sin)


@register
class RoPEInterleaved(RoPE):
    r"""Rotary position embedding, rotate-every-two layout (RoFormer, GPT-J).

    The layout of ``forward_rope`` in anon., "Positional encoding of the Transformer".

    .. math::
        \mathrm{RoPE}(x, m)_{2i}   = x_{2i}\cos m\theta_i - x_{2i+1}\sin m\theta_i \\
        \mathrm{RoPE}(x, m)_{2i+1} = x_{2i+1}\cos m\theta_i + x_{2i}\sin m\theta_i
    """

    info = Card(
        name="rope-interleaved",
        title="RoPE (rotate-every-two)",
        paper="Su et al., RoFormer: Enhanced Transformer with Rotary Position Embedding",
        year=2021,
        family="rotary",
        position="relative",
        learnable=False,
        summary="Rotate q, k pairs (2i, 2i+1) by m·θ_i, as RoFormer and GPT-J.",
        reference=(
            "HF transformers RoFormer apply_rotary_position_embeddings; "
            'forward_rope of anon., "Positional encoding of the Transformer"'
        ),
        aliases=("rope-every-two", "roformer", "rope-gptj"),
    )
    interleaved = True
