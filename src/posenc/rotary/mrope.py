r"""Multimodal rotary position embedding: M-RoPE (Qwen2-VL, Qwen2.5-VL) and interleaved MRoPE (Qwen3-VL).

Every token has three position ids, ``p = (p_t, p_h, p_w)`` (time, height, width), and each rotary pair is rotated
by one of them. With ``a(i) ∈ {t, h, w}`` the axis of pair ``i`` and ``θ_i = base^{-2i/d}``:

.. math::
    \phi_i(p) = p_{a(i)}\,\theta_i, \qquad
    q_p^\top k_{p'} \text{ depends only on } (p'_t - p_t,\ p'_h - p_h,\ p'_w - p_w)

and each pair ``(x_i, x_{i+d/2})`` is rotated by ``φ_i`` as in ``rope`` (rotate-half layout). The axes:

* ``mrope`` (Wang et al. 2024, Qwen2-VL, §2.1 "Multimodal Rotary Position Embedding"): the spectrum is cut
  into three contiguous sections, ``mrope_section = [s_t, s_h, s_w]`` pairs (Qwen2-VL: ``[16, 24, 24]`` of 64):
  ``a(i) = t`` for ``i < s_t``, ``h`` for ``s_t <= i < s_t + s_h``, ``w`` above. The temporal axis thus gets the
  fastest frequencies and the width the slowest.
* ``mrope-interleaved`` (Qwen3-VL's Interleaved-MRoPE): the axes alternate along the spectrum, ``t h w t h w ...``,
  so that every axis gets fast and slow frequencies: ``a(i) = h`` if ``i ≡ 1 (mod 3)`` and ``i < 3 s_h``, ``w`` if
  ``i ≡ 2 (mod 3)`` and ``i < 3 s_w``, ``t`` otherwise (Qwen3-VL: ``[24, 20, 20]``: pairs 0..59 interleaved, 60..63
  temporal), as transformers' ``Qwen3VLTextRotaryEmbedding`` lays them out.

For text all three ids are the token's position ``m``: ``φ_i = m θ_i`` for every pair and both are exactly ``rope``.

**The position ids** (:func:`mrope_positions`): text tokens count up by one on all three rows; an image or video of
``(t, h, w)`` patches, merged ``m × m`` by the vision encoder (``spatial_merge_size``), gives ``t·h·w / m²`` tokens at
``(start + τ_k, start + row, start + col)`` (``τ_k = k`` for Qwen2-VL and Qwen3-VL; Qwen2.5-VL's videos
``⌊k · tokens_per_second · seconds_per_grid⌋``, absolute time); the next span starts one past the largest id so far
(Qwen2-VL §2.1: "incrementing the maximum position ID of the preceding modality by one"; transformers from 5.3 on
starts it ``max(h, w) / m`` past the span's start instead, ``next_start="spatial"``: the same ids except after a
video whose temporal ids reach further than its rows and columns). Qwen3-VL gives each video frame its own grid of
``t = 1``, with its timestamp as text between the frames.

**How the three rows reach the encoding.** posenc's attention carries one position per token (``ctx.q_pos`` /
``ctx.k_pos``: masks, KV caches and contiguity checks read them); the three rows travel beside them, in the
``cache`` dict that :class:`~posenc.MultiHeadAttention` shares between the layers of one forward, under the key
:data:`MROPE_POSITIONS` (:func:`mrope_cache` makes it). Where no three rows are given, the rows are the 1-D
positions repeated: ``mrope`` is then ``rope``, bit for bit, so a :class:`~posenc.LanguageModel` on text (which
builds its own per-forward dict), KV-cache decoding, ``posenc inspect`` and ``posenc bench`` need nothing else::

    attn = posenc.MultiHeadAttention(64, 4, posenc.get("mrope", head_dim=16))
    pos = mrope_positions([3, image(4, 6), 2], spatial_merge_size=2)  # [3, 3 + 6 + 2]
    y = attn(x, cache=mrope_cache(pos))  # x: [B, 11, 64]

The three rows describe this call's queries and its new keys (a KV-cache step passes the rows of its new tokens
only: the cached keys were rotated when they were stored). A call whose new keys are not its queries (memory,
cross-attention) passes ``mrope_cache(query_rows, key_rows)``.

Precision: as ``rope`` (float32 phases, HF transformers' numbers bit for bit below position ``2**24``; the cos/sin
of each row come from RoPE's shared table).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..base import AttentionContext, Card, check_positions
from ..errors import ConfigError, PositionError
from ..registry import register
from .rope import RoPE

#: the key of :class:`~posenc.base.AttentionContext.cache` under which the three position rows travel
MROPE_POSITIONS = "posenc:mrope-positions"

_AXES = ("temporal", "height", "width")


def mrope_cache(positions: Tensor, key_positions: Tensor | None = None) -> dict[Any, Any]:
    """The per-forward ``cache`` dict that gives ``mrope`` / ``mrope-interleaved`` their three position rows.

    ``positions``: ``[3, L]`` or ``[3, B, L]`` (time, height, width ids of the call's tokens, as
    :func:`mrope_positions` and transformers' ``get_rope_index`` make them); ``key_positions``: the same for the
    call's new keys where they are not its queries (memory, cross-attention). Pass the dict as
    ``MultiHeadAttention(...)(x, cache=...)``.
    """
    return {MROPE_POSITIONS: positions if key_positions is None else (positions, key_positions)}


# ------------------------------------------------------------------ position ids
@dataclass(frozen=True)
class VisionSpan:
    """An image or a video in a multimodal sequence: ``t × h × w`` patches before the spatial merge.

    ``seconds_per_grid`` is a video's time per temporal patch (Qwen2.5-VL's ``second_per_grid_ts``); it counts only
    where :func:`mrope_positions` is given ``tokens_per_second``.
    """

    t: int
    h: int
    w: int
    video: bool = False
    seconds_per_grid: float = 1.0


def image(h: int, w: int, t: int = 1) -> VisionSpan:
    """An image of ``h × w`` patches (transformers' ``image_grid_thw`` row ``(t, h, w)``)."""
    return VisionSpan(t, h, w)


def video(t: int, h: int, w: int, seconds_per_grid: float = 1.0) -> VisionSpan:
    """A video of ``t`` temporal patches of ``h × w`` (``video_grid_thw``; ``seconds_per_grid``: Qwen2.5-VL's
    ``second_per_grid_ts``)."""
    return VisionSpan(t, h, w, video=True, seconds_per_grid=seconds_per_grid)


def _whole(what: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"mrope_positions: {what} must be an integer >= {low}, got {value!r}")
    return value


def mrope_positions(
    spans: Sequence[int | VisionSpan],
    *,
    spatial_merge_size: int = 2,
    tokens_per_second: float | None = None,
    next_start: str = "max",
    start: int = 0,
) -> Tensor:
    """The ``[3, L]`` (time, height, width) position ids of one sequence of text, image and video spans.

    Args:
        spans: in order, an ``int`` (that many text tokens: the vision start/end tokens and timestamps included) or
            a :class:`VisionSpan` (:func:`image`, :func:`video`) of ``t·h·w / spatial_merge_size²`` tokens.
        spatial_merge_size: ``m``, the vision encoder's ``m × m`` patch merge (Qwen2/2.5/3-VL: 2); ``h`` and ``w``
            must be multiples of it.
        tokens_per_second: Qwen2.5-VL's absolute time: a video's temporal id ``k`` is
            ``⌊k · tokens_per_second · seconds_per_grid⌋`` (computed in float32 as transformers does);
            ``None`` (Qwen2-VL, Qwen3-VL): ``k``. Images always take ``k``.
        next_start: where the span after an image or video starts: ``"max"``, one past the largest id so far (the
            Qwen2-VL paper and Qwen's own code, which the models were trained with); ``"spatial"``,
            ``start + max(h, w) / m``, what transformers' ``get_rope_index`` does from 5.3 on. They differ only for a
            video whose temporal ids reach past its spatial ones (``t > max(h, w) / m``, or Qwen2.5-VL's time scale);
            Qwen3-VL's one-frame grids take the same ids either way.
        start: the first id (a decoding step's text: one past the prompt's largest id, plus the tokens since).

    Returns:
        ``[3, L]`` long, to stack into ``[3, B, L]`` and pass with :func:`mrope_cache`.
    """
    m = _whole("spatial_merge_size", spatial_merge_size, 1)
    start = _whole("start", start, 0)
    if next_start not in ("max", "spatial"):
        raise ConfigError(f"mrope_positions: next_start must be 'max' or 'spatial', got {next_start!r}")
    if tokens_per_second is not None and (
        isinstance(tokens_per_second, bool) or not isinstance(tokens_per_second, (int, float)) or tokens_per_second < 0
    ):
        raise ConfigError(
            f"mrope_positions: tokens_per_second must be a number >= 0 or None, got {tokens_per_second!r}"
        )
    if isinstance(spans, (int, VisionSpan)) or not isinstance(spans, Sequence):
        raise ConfigError(f"mrope_positions: spans must be a list of text lengths and vision spans, got {spans!r}")
    pieces: list[Tensor] = []
    pos = start
    for n, span in enumerate(spans):
        if isinstance(span, VisionSpan):
            t, h, w = (_whole(f"span {n}'s {k}", getattr(span, k), 1) for k in "thw")
            if h % m or w % m:
                raise ConfigError(
                    f"mrope_positions: span {n} is {h} x {w} patches, which spatial_merge_size={m} does not divide; "
                    f"the vision encoder merges {m} x {m} patches into a token, so h and w are multiples of {m}"
                )
            time = torch.arange(t)
            if span.video and tokens_per_second is not None:
                step = torch.tensor(span.seconds_per_grid, dtype=torch.float32) * tokens_per_second
                if not bool(torch.isfinite(step)) or float(step) < 0:
                    raise ConfigError(f"mrope_positions: span {n}'s seconds_per_grid must be >= 0, got {step}")
                time = (time * step).long()
            grid = torch.stack(torch.meshgrid(time, torch.arange(h // m), torch.arange(w // m), indexing="ij"))
            pieces.append(grid.reshape(3, -1) + pos)
            pos = (pos + max(h, w) // m) if next_start == "spatial" else int(pieces[-1].max()) + 1
        elif isinstance(span, int) and not isinstance(span, bool) and span >= 0:
            length = span
            pieces.append(torch.arange(pos, pos + length).expand(3, -1))
            pos += length
        else:
            raise ConfigError(
                f"mrope_positions: span {n} must be a number of text tokens (an integer >= 0) or a vision span "
                f"(image(h, w), video(t, h, w)), got {span!r}"
            )
    out = torch.cat(pieces, dim=1) if pieces else torch.zeros(3, 0, dtype=torch.long)
    if out.shape[1] == 0:
        raise ConfigError("mrope_positions: the spans hold no tokens; give at least one text token or vision span")
    return out


# ------------------------------------------------------------------ the encodings
def _default_section(pairs: int, interleaved: bool) -> list[int]:
    # Qwen2-VL's [16, 24, 24] and Qwen3-VL's [24, 20, 20] of 64 pairs, scaled to this head
    hw = (5 * pairs) // 16 if interleaved else (3 * pairs) // 8
    return [pairs - 2 * hw, hw, hw]


def _axis_positions(given: Any, n: int, batch: int, what: str) -> Tensor:
    """``given`` as ``[3, 1|B, n]`` rows, checked."""
    if not isinstance(given, Tensor):
        raise PositionError(f"{what} must be a tensor [3, L] or [3, B, L], got {type(given).__name__}")
    rows = given[:, None] if given.dim() == 2 else given
    if rows.dim() != 3 or rows.shape[0] != 3:
        raise PositionError(
            f"{what} must be [3, L] or [3, B, L] (time, height and width rows), got shape {tuple(given.shape)}"
        )
    if rows.shape[2] != n:
        raise PositionError(f"{what} describe {rows.shape[2]} tokens but this call has {n}; pass one column per token")
    if rows.shape[1] not in (1, batch):
        raise PositionError(f"{what} have batch size {rows.shape[1]} (shape {tuple(given.shape)}) but q has {batch}")
    check_positions(rows, what=what, integer=False)
    return rows


@register
class MRoPE(RoPE):
    r"""M-RoPE (Qwen2-VL): rotary pairs in three sections, rotated by the time, height and width ids.

    .. math::
        \phi_i(p) = p_{a(i)}\,\theta_i,\quad a(i) = \begin{cases} t & i < s_t \\ h & s_t \le i < s_t + s_h \\
        w & \text{otherwise} \end{cases}, \qquad \theta_i = \mathrm{base}^{-2i/d}

    Args:
        head_dim: head width, even.
        mrope_section: ``[s_t, s_h, s_w]``, pairs per axis, summing to ``head_dim / 2`` (default: Qwen2-VL's
            ``[16, 24, 24]`` proportions, ``s_h = s_w = ⌊3 d / 16⌋``).
        base: frequency base (Qwen2-VL: ``1e6``; default 10000 as ``rope``).

    Positions: three rows per token (see the module docstring), or the 1-D positions repeated (then: ``rope``).
    """

    info = Card(
        name="mrope",
        title="M-RoPE (multimodal RoPE)",
        paper="Wang et al., Qwen2-VL: Enhancing Vision-Language Model's Perception of the World at Any Resolution",
        year=2024,
        family="rotary",
        position="relative",
        learnable=False,
        summary="Rotary pairs in (time, height, width) sections, each rotated by its own position id; text: RoPE.",
        reference=(
            "HF transformers 5.24 Qwen2VLRotaryEmbedding (mrope_section) + apply_rotary_pos_emb, float64: max diff 0 "
            "(values and gradients); Qwen2VLModel / Qwen2_5_VLModel.get_rope_index: equal ids"
        ),
        aliases=("m-rope", "multimodal-rope", "qwen2-vl-rope"),
    )
    randomized_variant = False
    # on text (the 1-D positions the analysis gives) it is RoPE: RoFormer's claims
    claims = dict(
        relative_only=True, direction_aware=True, decay=True, bounded=True, linear_offset=True, consistent=True
    )
    interleaved_axes = False

    def __init__(self, head_dim: int, mrope_section: Sequence[int] | None = None, base: float = 10000.0):
        name = self.info.name
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2:
            raise ConfigError(
                f"{name} rotates pairs of dimensions, so head_dim must be an even integer >= 2, got {head_dim!r}"
                + (
                    f"; use head_dim={head_dim - 1} or {head_dim + 1}"
                    if isinstance(head_dim, int) and head_dim > 2
                    else ""
                )
            )
        super().__init__(head_dim, base)
        pairs = head_dim // 2
        if mrope_section is None:
            section = _default_section(pairs, self.interleaved_axes)
        else:
            section = list(mrope_section) if isinstance(mrope_section, (list, tuple)) else None
            if (
                section is None
                or len(section) != 3
                or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in section)
            ):
                raise ConfigError(
                    f"{name}: mrope_section must be three integers >= 0 (rotary pairs for time, height and width), "
                    f"got {mrope_section!r}"
                )
            if sum(section) != pairs:
                raise ConfigError(
                    f"{name}: mrope_section {section} sums to {sum(section)} but head_dim={head_dim} has "
                    f"{pairs} rotary pairs (head_dim / 2); the three sections must sum to {pairs}"
                )
        self.mrope_section = section
        self.register_buffer("axis", self._axes(section, pairs), persistent=False)

    def _axes(self, section: list[int], pairs: int) -> Tensor:
        """The axis (0 time, 1 height, 2 width) of each rotary pair: ``[head_dim / 2]`` long."""
        return torch.repeat_interleave(torch.arange(3), torch.tensor(section))

    def axes(self) -> list[str]:
        """The axis of each rotary pair, fastest first: ``["temporal", ..., "width"]``."""
        return [_AXES[int(a)] for a in self.axis]

    # ------------------------------------------------------------ the phases
    def axis_cos_sin(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        """cos and sin (float32, ``[B, L, head_dim/2]``) of three position rows ``[3, B, L]``: pair ``i`` takes row
        ``axis[i]``'s phase (RoPE's table of the row)."""
        cos, sin = self.cos_sin(rows)  # [3, B, L, d/2]
        axis = self.axis.to(cos.device)
        pick = [axis == a for a in range(3)]
        cos = torch.where(pick[0], cos[0], torch.where(pick[1], cos[1], cos[2]))
        sin = torch.where(pick[0], sin[0], torch.where(pick[1], sin[1], sin[2]))
        return cos, sin

    def _given_rows(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> tuple[Tensor, Tensor] | None:
        given = ctx.cache.get(MROPE_POSITIONS)
        if given is None:
            return None
        b, lq, lk = q.shape[0], q.shape[-2], k.shape[-2]
        if isinstance(given, tuple):
            if len(given) != 2:
                raise PositionError(
                    f"{self.info.name}: the cache's {MROPE_POSITIONS!r} must be rows or (query, key) rows"
                )
            q_rows = _axis_positions(given[0], lq, b, f"{self.info.name} query positions")
            k_rows = _axis_positions(given[1], lk, k.shape[0], f"{self.info.name} key positions")
            return q_rows, k_rows
        q_rows = _axis_positions(given, lq, b, f"{self.info.name} positions")
        if lk != lq:
            raise PositionError(
                f"{self.info.name}: this call has {lq} queries but {lk} new keys (memory or cross-attention); "
                "give the keys their own rows: cache=mrope_cache(query_rows, key_rows)"
            )
        return q_rows, q_rows

    def rotate(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> tuple[Tensor, Tensor]:
        rows = self._given_rows(q, k, ctx)
        if rows is None:  # one position per token: every row is it, and the rotation is RoPE's
            return super().rotate(q, k, ctx)
        key = ("mrope-cos-sin", id(self))
        got = ctx.cache.get(key)
        if got is None or got[0] is not rows[0] or got[1] is not rows[1]:
            qc, qs = self.axis_cos_sin(rows[0])
            kc, ks = (qc, qs) if rows[1] is rows[0] else self.axis_cos_sin(rows[1])
            got = (rows[0], rows[1], qc[:, None], qs[:, None], kc[:, None], ks[:, None])
            ctx.cache[key] = got
        _, _, qc, qs, kc, ks = got
        return self.apply(q, qc, qs), self.apply(k, kc, ks)

    def forward(self, x: Tensor, positions: Tensor | None = None, *, axis_positions: Tensor | None = None) -> Tensor:
        """Rotate one tensor ``(b, l, d)`` or ``(b, h, l, d)`` by 1-D ``positions`` ``[L]`` / ``[B, L]`` (all rows
        equal: ``rope``) or by ``axis_positions`` ``[3, L]`` / ``[3, B, L]``."""
        if axis_positions is None:
            return super().forward(x, positions)
        if positions is not None:
            raise ConfigError(f"{self.info.name}: pass positions (one row) or axis_positions (three), not both")
        if x.dim() not in (3, 4):
            raise ConfigError(f"expected (b, l, d) or (b, h, l, d), got {tuple(x.shape)}")
        rows = _axis_positions(axis_positions, x.shape[-2], x.shape[0], f"{self.info.name} axis_positions")
        cos, sin = self.axis_cos_sin(rows)
        if x.dim() == 4:
            cos, sin = cos[:, None], sin[:, None]
        return self.apply(x, cos, sin)


@register
class MRoPEInterleaved(MRoPE):
    r"""Interleaved MRoPE (Qwen3-VL): the time, height and width axes alternate along the rotary spectrum.

    .. math::
        \phi_i(p) = p_{a(i)}\,\theta_i,\quad a(i) = \begin{cases} h & i \equiv 1 \pmod 3,\ i < 3 s_h \\
        w & i \equiv 2 \pmod 3,\ i < 3 s_w \\ t & \text{otherwise} \end{cases}

    Args:
        head_dim: head width, even.
        mrope_section: ``[s_t, s_h, s_w]`` summing to ``head_dim / 2``, with ``3 s_h - 1 <= head_dim / 2`` and
            ``3 s_w <= head_dim / 2`` so that each axis gets its count (default: Qwen3-VL's ``[24, 20, 20]``
            proportions, ``s_h = s_w = ⌊5 d / 32⌋``).
        base: frequency base (Qwen3-VL: ``5e6``; default 10000 as ``rope``).
    """

    info = Card(
        name="mrope-interleaved",
        title="Interleaved MRoPE (Qwen3-VL)",
        paper="Qwen Team, Qwen3-VL Technical Report",
        year=2025,
        family="rotary",
        position="relative",
        learnable=False,
        summary="M-RoPE with the time, height and width axes interleaved t h w t h w ... across the spectrum.",
        reference=(
            "HF transformers 5.24 Qwen3VLTextRotaryEmbedding (interleaved mrope_section) + apply_rotary_pos_emb, "
            "float64: max diff 0 (values and gradients); Qwen3VLModel.get_rope_index: equal ids"
        ),
        aliases=("interleaved-mrope", "imrope", "qwen3-vl-rope"),
    )
    interleaved_axes = True

    def _axes(self, section: list[int], pairs: int) -> Tensor:
        _, sh, sw = section
        if 3 * sh - 1 > pairs or 3 * sw > pairs:
            raise ConfigError(
                f"{self.info.name}: mrope_section {section} does not fit {pairs} interleaved pairs: height takes "
                f"pairs 1, 4, ... below 3*{sh} = {3 * sh} and width pairs 2, 5, ... below 3*{sw} = {3 * sw}, so "
                f"3*s_h - 1 and 3*s_w must be <= {pairs}"
            )
        i = torch.arange(pairs)
        axis = torch.zeros(pairs, dtype=torch.long)
        axis[(i % 3 == 1) & (i < 3 * sh)] = 1
        axis[(i % 3 == 2) & (i < 3 * sw)] = 2
        return axis


__all__ = [
    "MROPE_POSITIONS",
    "MRoPE",
    "MRoPEInterleaved",
    "VisionSpan",
    "image",
    "mrope_cache",
    "mrope_positions",
    "video",
]
