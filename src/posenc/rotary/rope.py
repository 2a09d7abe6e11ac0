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
* ``rope-interleaved`` -- *rotate-every-two* (RoFormer, GPT-J, seed 001's
  ``forward_rope``): dimension 2i pairs with 2i + 1.

Both accept a partial ``rotary_dim`` (only the first ``rotary_dim`` dimensions
rotate, as GPT-NeoX's ``rotary_pct``), compute the phases in float32 whatever
the input dtype, and keep a cos/sin table by position that every layer shares.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import native
from ..base import AttentionContext, Card, PositionalEncoding, as_position_rows, check_positions
from ..errors import ConfigError
from ..registry import register


def rope_inverse_frequencies(rotary_dim: int, base: float) -> Tensor:
    r"""``θ_i = base^{-2i/d}`` in float32, computed as HF transformers does."""
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))


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


@register
class RoPE(PositionalEncoding):
    r"""Rotary position embedding, rotate-half layout (GPT-NeoX / Llama).

    .. math::
        \mathrm{RoPE}(x, m) = x \odot \cos(m\Theta) + \mathrm{rotate\_half}(x) \odot \sin(m\Theta),
        \quad \mathrm{rotate\_half}([x_1; x_2]) = [-x_2; x_1]

    with ``Θ`` repeated over the two halves, ``θ_i = base^{-2i/d}``.
    """

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
    interleaved = False

    def __init__(self, head_dim: int, base: float = 10000.0, rotary_dim: int | None = None):
        super().__init__()
        if not isinstance(head_dim, int) or head_dim <= 0:
            raise ConfigError(f"head_dim must be a positive integer, got {head_dim!r}")
        if head_dim % 2:
            raise ConfigError(
                f"RoPE rotates pairs of dimensions, so head_dim must be even, got {head_dim}; "
                f"use head_dim={head_dim - 1} or {head_dim + 1}, or rotate part of it with rotary_dim"
            )
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
            raise ConfigError(f"rotary_dim must be even and in 2..{head_dim}, got {rotary_dim}")
        if base <= 1:
            raise ConfigError(f"base must be > 1, got {base}")
        self.head_dim, self.rotary_dim, self.base = head_dim, rotary_dim, base
        self.register_buffer("inv_freq", rope_inverse_frequencies(rotary_dim, base), persistent=False)
        self.register_buffer("_cos", torch.empty(0, rotary_dim // 2), persistent=False)
        self.register_buffer("_sin", torch.empty(0, rotary_dim // 2), persistent=False)
        # the last lookup: (positions, its version, the table, cos, sin); a repeated call skips the checks
        self._memo: tuple | None = None

    # ------------------------------------------------------------ the phases
    def angles(self, positions: Tensor) -> Tensor:
        """``m · θ_i`` in float32: ``[..., rotary_dim/2]``."""
        return positions[..., None].float() * self.inv_freq

    def _grow(self, n: int) -> None:
        size = 1 << max(n - 1, 1).bit_length()
        a = self.angles(torch.arange(size, device=self.inv_freq.device))
        self._cos, self._sin = a.cos(), a.sin()

    def cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos and sin of the phases of ``positions`` (float32, ``[..., rotary_dim/2]``).

        Integer positions are looked up in a table that grows as needed and is
        shared by every layer; fractional positions are computed directly.
        """
        if positions.is_floating_point() or torch.compiler.is_compiling():
            a = self.angles(positions)
            return a.cos(), a.sin()
        memo = self._memo
        version = _version(positions)
        if memo is not None and memo[0] is positions and memo[1] == version and memo[2] is self._cos:
            return memo[3], memo[4]  # the same positions tensor, unchanged, as last time
        if positions.numel():
            check_positions(positions)
            top = int(positions.max()) + 1
            if top > self._cos.shape[0]:
                self._grow(top)
        cos, sin = self._cos[positions], self._sin[positions]
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

    def rotate(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> tuple[Tensor, Tensor]:
        key = ("rope-cos-sin", id(self))
        got = ctx.cache.get(key)
        if got is None or got[0] is not ctx.q_pos or got[1] is not ctx.k_pos:
            qc, qs = self.cos_sin(ctx.q_pos)
            kc, ks = (qc, qs) if ctx.k_pos is ctx.q_pos else self.cos_sin(ctx.k_pos)
            # [B, L, r/2] -> [B, 1, L, r/2] to broadcast over heads
            got = (ctx.q_pos, ctx.k_pos, qc[:, None], qs[:, None], kc[:, None], ks[:, None])
            ctx.cache[key] = got
        _, _, qc, qs, kc, ks = got
        return self.apply(q, qc, qs), self.apply(k, kc, ks)

    def forward(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        """Rotate one tensor: ``x`` is ``(b, l, d)`` or ``(b, h, l, d)``; positions ``[L]`` or ``[B, L]``."""
        if x.dim() not in (3, 4):
            raise ConfigError(f"expected (b, l, d) or (b, h, l, d), got {tuple(x.shape)}")
        rows = as_position_rows(positions, x.shape[-2], x.device)
        cos, sin = self.cos_sin(rows)
        if x.dim() == 4:
            cos, sin = cos[:, None], sin[:, None]
        return self.apply(x, cos, sin)


@register
class RoPEInterleaved(RoPE):
    r"""Rotary position embedding, rotate-every-two layout (RoFormer, GPT-J, seed 001).

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
        reference="HF transformers RoFormer apply_rotary_position_embeddings; seed 001 forward_rope",
        aliases=("rope-every-two", "roformer", "rope-gptj"),
    )
    interleaved = True
