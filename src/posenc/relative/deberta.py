r"""DeBERTa's disentangled attention (He et al. 2021), as HF ``DebertaV2`` computes it.

Each token is a content vector ``H_i`` and, relative to every other token, a
position vector taken from one table ``P`` of ``2k`` relative-position
embeddings shared by all layers (Wu (2022), formula (3)):

.. math::
    Q_c = H W_{q,c},\; K_c = H W_{k,c},\; V_c = H W_{v,c},\; Q_r = P W_{q,r},\; K_r = P W_{k,r}

    \tilde A_{ij} = \underbrace{Q^c_i K^{c\top}_j}_{\text{c2c}}
                  + \underbrace{Q^c_i K^{r\top}_{\delta(i,j)}}_{\text{c2p}}
                  + \underbrace{K^c_j Q^{r\top}_{\delta(j,i)}}_{\text{p2c}}
                  \;[+\; \underbrace{Q^r_{\delta(j,i)} K^{r\top}_{\delta(i,j)}}_{\text{p2p}}], \qquad
    H_o = \mathrm{softmax}\big(\tilde A / \sqrt{d\,(1 + n_{pos})}\big) V_c

with ``n_pos`` the number of position terms (``sqrt(3d)`` for c2p + p2c) and

.. math::
    \delta(i, j) = \begin{cases} 0 & i - j \le -k \\ 2k - 1 & i - j \ge k \\ i - j + k & \text{otherwise} \end{cases}

DeBERTa-v2/v3 additionally log-buckets ``i - j`` first (``position_buckets``,
HF ``make_log_bucket_position``): offsets with ``|i-j| <= b/2`` stay exact,
larger ones are compressed logarithmically up to ``max_relative_positions``;
``k`` is then ``position_buckets`` (else ``max_relative_positions``). The table
``P`` may go through a LayerNorm (``norm_rel_ebd="layer_norm"``), and with
``share_att_key`` the position projections are the attention's own ``W_q`` /
``W_k`` (DeBERTa-v3), otherwise each layer has its own ``W_{q,r}`` / ``W_{k,r}``.

**Paper vs HF.** HF (and Microsoft's code) index the p2c term with the same
``δ(i, j)`` as c2p, ``K^c_j Q^{r\top}_{δ(i,j)}``, not the paper's ``δ(j, i)``
(the sign of the offset is flipped; verified numerically in the tests).
``p2c_offset="hf"`` (default, what pretrained checkpoints expect) follows HF;
``p2c_offset="paper"`` follows the paper. HF has no p2p term; here it is an
option built from the paper's decomposition ``P_{i|j} P_{j|i}^\top`` with the
same offsets as p2c and c2p (Microsoft's DeBERTa-v1 code instead indexed the
query side by the *absolute* query position, which is not translation-invariant).

**Beyond max_relative_positions.** Microsoft's ``make_log_bucket_position``
clamps ``i - j`` to ``±(max_relative_positions - 1)`` before bucketing, so every
far-negative offset lands in table row 1 (its bucket ``-(k - 1)``) and every
far-positive one in row ``2k - 1``. HF's ``make_log_bucket_position`` does not
clamp first: a far-negative offset's bucket falls below ``-k`` and the index clamp
puts it in row 0 (far-positive ones still land in row ``2k - 1``). posenc follows
HF by default (``bucket_clamp="hf"``); ``bucket_clamp="microsoft"`` clamps first, as
Microsoft's code. Only with log buckets (``position_buckets > 0``): without them
both clip ``i - j`` to ``±k`` the same way.

**Paths.** ``ctx.reference`` materialises the gathered ``K^r_{δ(i,j)}`` and
``Q^r_{δ}`` for every pair ``(i, j)`` (``[B, H, Lq, Lk, d]``), exactly as the
formula reads; the fast path computes ``Q^c K_r^\top`` (``[B, H, Lq, 2k]``) and
``K^c Q_r^\top`` and gathers by bucket, the DeBERTa way, never an ``Lq·Lk·d`` tensor.

**EMD.** The enhanced mask decoder (absolute positions fed to the last layers)
is :class:`EnhancedMaskDecoder` below.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from ..base import AttentionContext, Card, Cost, PositionalEncoding, as_position_rows, check_positions
from ..errors import ConfigError, PositionError
from ..fused import RelativeForm, offset_table
from ..registry import register
from ._sizes import head_dim_of
from ._skew import DIRECT_KEY_TERM_ELEMENTS, key_rows_dot, offset_rows, offsets, project

POS_ATT_TYPES = ("c2p", "p2c", "p2p")
P2C_OFFSETS = ("hf", "paper")
BUCKET_CLAMPS = ("hf", "microsoft")


def deberta_log_bucket(relative_position: Tensor, bucket_size: int, max_position: int) -> Tensor:
    """HF ``make_log_bucket_position``: exact offsets up to ``bucket_size // 2``, log-spaced beyond.

    Computed in float32, as HF does, so bucket boundaries match pretrained checkpoints.
    Returns a long tensor of the same shape (sign kept: ``i - j < 0`` gives a negative bucket).
    """
    rel = relative_position.long()
    sign = torch.sign(rel)
    mid = bucket_size // 2
    inside = (rel < mid) & (rel > -mid)
    abs_pos = torch.where(inside, torch.full_like(rel, mid - 1), rel.abs())
    denom = torch.log(torch.tensor((max_position - 1) / mid, dtype=torch.float32, device=rel.device))
    log_pos = torch.ceil(torch.log(abs_pos.to(torch.float32) / mid) / denom * (mid - 1)) + mid
    bucket = torch.where(abs_pos <= mid, rel.to(torch.float32), log_pos * sign)
    return bucket.long()


def _parse_pos_att_type(pos_att_type: str | Sequence[str]) -> tuple[str, ...]:
    items = pos_att_type.lower().split("|") if isinstance(pos_att_type, str) else list(pos_att_type)
    out: list[str] = []
    for item in items:
        name = str(item).strip().lower()
        if name not in POS_ATT_TYPES:
            raise ConfigError(f"unknown pos_att_type {item!r}; use any of {POS_ATT_TYPES} (e.g. 'p2c|c2p')")
        if name in out:
            raise ConfigError(f"pos_att_type lists {name!r} twice: {pos_att_type!r}")
        out.append(name)
    if not out:
        raise ConfigError(f"pos_att_type must name at least one of {POS_ATT_TYPES}, got {pos_att_type!r}")
    return tuple(out)


def _same(a: Tensor, b: Tensor) -> bool:
    return a is b or (a.shape == b.shape and a.device == b.device and bool(torch.equal(a, b)))


@register
class DeBERTa(PositionalEncoding):
    r"""DeBERTa disentangled attention: c2c + c2p + p2c (+ p2p) over ``sqrt(d (1 + n_pos))``.

    .. math::
        A_{ij} = \frac{Q^c_i K^{c\top}_j + Q^c_i K^{r\top}_{\delta(i,j)} + K^c_j Q^{r\top}_{\delta(j,i)}}
                      {\sqrt{3d}}

    (HF: ``δ(i,j)`` in the p2c term too, see the module docstring.)

    Args:
        d_model: width of the hidden states (and of the relative-embedding table).
        n_heads, head_dim: the attention's heads (``head_dim`` defaults to ``d_model // n_heads``).
        max_len: used as ``max_relative_positions`` when that is < 1 (HF: ``max_position_embeddings``).
        position_buckets: log buckets (DeBERTa-v3: 256); ``<= 0`` clips ``i - j`` to ``±k`` instead
            (DeBERTa-v2's ``position_buckets=-1``). ``None`` (default): 256 when
            ``max_relative_positions`` is large enough for them (>= 130), else plain clipping.
        max_relative_positions: the largest offset the log buckets resolve / the clip ``k``.
        pos_att_type: position terms, any of ``"c2p"``, ``"p2c"``, ``"p2p"`` (list or ``"p2c|c2p"``).
        share_att_key: project the table with the attention's own ``W_q`` / ``W_k`` (v3).
        norm_rel_ebd: LayerNorm the table (HF ``norm_rel_ebd="layer_norm"``).
        layer_norm_eps: that LayerNorm's epsilon (HF default 1e-7).
        n_layers: layers served; needed only without ``share_att_key`` (one ``W_{q,r}, W_{k,r}`` per layer).
        p2c_offset: ``"hf"`` (``δ(i,j)``, as HF and checkpoints) or ``"paper"`` (``δ(j,i)``).
        dropout: dropout on the relative embeddings (HF ``pos_dropout``).
        bucket_clamp: ``"hf"`` (default: a far-negative offset uses table row 0, as HF) or ``"microsoft"``
            (``i - j`` clamped to ``±(max_relative_positions - 1)`` before the log buckets, as Microsoft's
            ``make_log_bucket_position``: row 1); see the module docstring.
    """

    info = Card(
        name="deberta",
        title="DeBERTa disentangled attention",
        paper="He et al., DeBERTa: Decoding-enhanced BERT with Disentangled Attention",
        year=2021,
        family="relative",
        position="relative",
        learnable=True,
        summary="c2c + c2p + p2c with a shared table of 2k (log-bucketed) relative embeddings, over sqrt(3d).",
        reference="HF transformers DebertaV2 DisentangledSelfAttention (whole DebertaV2Model, weights copied)",
        shortcoming="no absolute position at all unless the enhanced mask decoder adds it back",
        aliases=("deberta-v2", "disentangled"),
    )
    shared_across_layers = True  # one table (and LayerNorm) for all layers, as HF's encoder

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        head_dim: int | None = None,
        max_len: int = 512,
        position_buckets: int | None = None,
        max_relative_positions: int = -1,
        pos_att_type: str | Sequence[str] = ("p2c", "c2p"),
        share_att_key: bool = True,
        norm_rel_ebd: bool = True,
        layer_norm_eps: float = 1e-7,
        n_layers: int = 1,
        p2c_offset: str = "hf",
        dropout: float = 0.0,
        bucket_clamp: str = "hf",
    ):
        super().__init__()
        for name, value in (("d_model", d_model), ("n_heads", n_heads), ("n_layers", n_layers)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        head_dim = head_dim_of(d_model, n_heads, head_dim)
        if not isinstance(position_buckets, (int, type(None))) or not isinstance(max_relative_positions, int):
            raise ConfigError(
                f"position_buckets and max_relative_positions must be integers, got "
                f"{position_buckets!r} and {max_relative_positions!r}"
            )
        max_rel = max_relative_positions if max_relative_positions >= 1 else max_len
        if not isinstance(max_rel, int) or max_rel < 1:
            raise ConfigError(f"max_relative_positions (or max_len when it is < 1) must be >= 1, got {max_rel!r}")
        if position_buckets is None:
            position_buckets = 256 if max_rel - 1 > 128 else -1
        if position_buckets > 0:
            if position_buckets < 4 or position_buckets % 2:
                raise ConfigError(
                    f"position_buckets must be an even number >= 4 (half exact, half log-spaced offsets on "
                    f"each side), or <= 0 to switch log buckets off; got {position_buckets}"
                )
            if max_rel - 1 <= position_buckets // 2:
                raise ConfigError(
                    f"max_relative_positions={max_rel} is too small for position_buckets={position_buckets}: "
                    f"log buckets cover offsets {position_buckets // 2}..max_relative_positions-1, so it must be "
                    f">= {position_buckets // 2 + 2}"
                )
        if p2c_offset not in P2C_OFFSETS:
            raise ConfigError(f"p2c_offset must be one of {P2C_OFFSETS}, got {p2c_offset!r}")
        if not 0.0 <= dropout < 1.0:
            raise ConfigError(f"dropout must be in [0, 1), got {dropout}")
        if bucket_clamp not in BUCKET_CLAMPS:
            raise ConfigError(f"bucket_clamp must be one of {BUCKET_CLAMPS}, got {bucket_clamp!r}")
        self.bucket_clamp = bucket_clamp
        self.terms = _parse_pos_att_type(pos_att_type)
        self.d_model, self.n_heads, self.head_dim = d_model, n_heads, head_dim
        self.position_buckets, self.max_relative_positions = position_buckets, max_rel
        self.span = position_buckets if position_buckets > 0 else max_rel  # k: the table has 2k rows
        self.share_att_key, self.n_layers, self.p2c_offset = share_att_key, n_layers, p2c_offset
        self.rel_embeddings = nn.Embedding(2 * self.span, d_model)
        self.layer_norm = nn.LayerNorm(d_model, eps=layer_norm_eps) if norm_rel_ebd else None
        self.pos_dropout = nn.Dropout(dropout)
        inner = n_heads * head_dim
        needs_k = "c2p" in self.terms or "p2p" in self.terms
        needs_q = "p2c" in self.terms or "p2p" in self.terms
        self.pos_key_proj = (
            nn.ModuleList(nn.Linear(d_model, inner) for _ in range(n_layers)) if needs_k and not share_att_key else None
        )
        self.pos_query_proj = (
            nn.ModuleList(nn.Linear(d_model, inner) for _ in range(n_layers)) if needs_q and not share_att_key else None
        )
        nn.init.normal_(self.rel_embeddings.weight, std=0.02)

    def reset_parameters(self) -> None:
        super().reset_parameters()
        nn.init.normal_(self.rel_embeddings.weight, std=0.02)

    def cost(self, head_dim: int) -> Cost:
        # c2p Q^c_i · K^r_δ and p2c K^c_j · Q^r_δ: 2·d per pair and head each (4·d for both); p2p reads one value of
        # the [2k] (or [2k, 2k]) table per pair: an add. Q_r = P W_q,r and K_r = P W_k,r for the 2k rows of P:
        # 2·d_model·H·d each (parameters only: kept while decoding)
        products = sum(t in self.terms for t in ("c2p", "p2c"))
        tables = int("p2c" in self.terms or "p2p" in self.terms) + int("c2p" in self.terms or "p2p" in self.terms)
        return Cost(
            pair=2.0 * head_dim * products,
            pair_elementwise=float("p2p" in self.terms),
            row=2.0 * self.d_model * self.n_heads * self.head_dim * tables,
            rows=2 * self.span,
            note="projected tables of the 2k buckets (kept between decoding steps), c2p and p2c per pair",
        )

    # ------------------------------------------------------------------ hooks
    def scale(self, head_dim: int) -> float:
        return (head_dim * (1 + len(self.terms))) ** -0.5

    def relative_bucket(self, relative_position: Tensor) -> Tensor:
        """``i - j`` after DeBERTa's log bucketing (unchanged when ``position_buckets <= 0``)."""
        if self.position_buckets > 0:
            if self.bucket_clamp == "microsoft":  # Microsoft's make_log_bucket_position clamps first
                m = self.max_relative_positions
                relative_position = relative_position.long().clamp(-(m - 1), m - 1)
            return deberta_log_bucket(relative_position, self.position_buckets, self.max_relative_positions)
        return relative_position.long()

    def indices(self, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
        """Table rows for c2p (``δ(i,j)``) and p2c (``δ(i,j)`` for HF, ``δ(j,i)`` for the paper): ``[B, Lq, Lk]``."""
        if q_pos.is_floating_point() or k_pos.is_floating_point():
            raise PositionError(
                f"deberta indexes a table by integer offsets; got positions of dtype "
                f"{q_pos.dtype if q_pos.is_floating_point() else k_pos.dtype}. Pass torch.long positions"
            )
        b = self.relative_bucket(q_pos[:, :, None] - k_pos[:, None, :])
        top = 2 * self.span - 1
        c2p = (b + self.span).clamp(0, top)
        p2c = c2p if self.p2c_offset == "hf" else (self.span - b).clamp(0, top)
        return c2p, p2c

    def _cached_indices(self, ctx: AttentionContext) -> tuple[Tensor, Tensor]:
        # keyed by the bucket settings, not the instance: the per-layer copies of one model share the indices
        settings = (self.span, self.position_buckets, self.max_relative_positions, self.bucket_clamp, self.p2c_offset)
        key = ("deberta-index", *settings)
        got = ctx.cache.get(key)
        if got is not None and _same(got[0], ctx.q_pos) and _same(got[1], ctx.k_pos):
            return got[2], got[3]
        c2p, p2c = self.indices(ctx.q_pos, ctx.k_pos)
        ctx.cache[key] = (ctx.q_pos, ctx.k_pos, c2p, p2c)
        return c2p, p2c

    def relative_table(self) -> Tensor:
        """``P``: the ``[2k, d_model]`` relative embeddings after the optional LayerNorm and dropout."""
        p = self.rel_embeddings.weight
        if self.layer_norm is not None:
            p = self.layer_norm(p)
        return self.pos_dropout(p)

    def _projections(self, ctx: AttentionContext) -> tuple[Tensor | None, Tensor | None]:
        """``Q_r`` and ``K_r`` as ``[H, 2k, d_head]`` (``None`` where no term needs them).

        Without autograd (inference, decoding) they are kept between calls while the weights they come from are
        unchanged (their version counters): decoding one token then costs no ``2k × d_model × d_model`` products.
        """
        if torch.is_grad_enabled() or torch.compiler.is_compiling() or self.training:
            return self._project_tables(ctx)
        sources = self._projection_sources(ctx)
        key = (ctx.layer, tuple((id(t), t._version, t.dtype, t.device) for t in sources))
        memo = self.__dict__.setdefault("_projection_memo", {})
        got = memo.get(ctx.layer)
        if got is None or got[0] != key:
            got = (key, self._project_tables(ctx), sources)  # the sources kept alive: their ids stay theirs
            memo[ctx.layer] = got
        return got[1]

    def _projection_sources(self, ctx: AttentionContext) -> list[Tensor]:
        """Every tensor the projected tables are computed from (for the memo's key)."""
        mods: list[nn.Module] = [self.rel_embeddings]
        if self.layer_norm is not None:
            mods.append(self.layer_norm)
        if self.share_att_key and ctx.attention is not None:
            mods += [m for m in (getattr(ctx.attention, "q_proj", None), getattr(ctx.attention, "k_proj", None)) if m]
        else:
            for projs in (self.pos_query_proj, self.pos_key_proj):
                if projs is not None and ctx.layer < len(projs):
                    mods.append(projs[ctx.layer])
        return [t for m in mods for t in m.parameters()]

    def _project_tables(self, ctx: AttentionContext) -> tuple[Tensor | None, Tensor | None]:
        p = self.relative_table()
        if self.share_att_key:
            att = ctx.attention
            if att is None or not hasattr(att, "q_proj") or not hasattr(att, "k_proj"):
                raise ConfigError("deberta with share_att_key=True needs ctx.attention (with q_proj and k_proj)")
            q_proj, k_proj = att.q_proj, att.k_proj
            if getattr(att, "d_model", self.d_model) != self.d_model:
                raise ConfigError(
                    f"deberta was built for d_model={self.d_model} but the attention has d_model={att.d_model}"
                )
        else:
            if ctx.layer >= self.n_layers:
                raise ConfigError(
                    f"deberta with share_att_key=False keeps one position projection per layer and was built for "
                    f"n_layers={self.n_layers}, but layer {ctx.layer} asked; build it with n_layers >= {ctx.layer + 1}"
                )
            q_proj = self.pos_query_proj[ctx.layer] if self.pos_query_proj is not None else None
            k_proj = self.pos_key_proj[ctx.layer] if self.pos_key_proj is not None else None

        def heads(proj: nn.Module) -> Tensor:
            return project(p, proj).view(2 * self.span, self.n_heads, self.head_dim).transpose(0, 1)

        needs_q = "p2c" in self.terms or "p2p" in self.terms
        needs_k = "c2p" in self.terms or "p2p" in self.terms
        return (heads(q_proj) if needs_q else None), (heads(k_proj) if needs_k else None)

    def offers_relative_form(self) -> bool:
        return "p2p" not in self.terms  # p2p has no row-blocked form

    def relative_form(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> RelativeForm | None:
        """c2p as a query term and p2c as a key term, the tables at the ``Lq + Lk - 1`` offsets (no p2p)."""
        if ctx.reference or "p2p" in self.terms or not offset_rows(ctx):
            return None
        self._check_sizes(ctx)
        off = offsets(ctx)[None, None, :]  # j - i as a [1, 1, P] "position grid" for indices()
        c2p, p2c = self.indices(off.new_zeros(1, 1), off[0])  # rows of q_pos 0 against k_pos = j - i
        q_r, k_r = self._projections(ctx)  # [H, 2k, Dh]
        form = RelativeForm(q=q, k=k)
        if "c2p" in self.terms:
            assert k_r is not None
            form.query_terms.append((q, offset_table(k_r.to(q.dtype).transpose(0, 1), c2p[0, 0])))
        if "p2c" in self.terms:
            assert q_r is not None
            form.key_terms.append((k, offset_table(q_r.to(q.dtype).transpose(0, 1), p2c[0, 0])))
        return form

    def _check_sizes(self, ctx: AttentionContext) -> None:
        if ctx.n_heads != self.n_heads or ctx.head_dim != self.head_dim:
            raise ConfigError(
                f"deberta was built for n_heads={self.n_heads}, head_dim={self.head_dim} but the attention has "
                f"n_heads={ctx.n_heads}, head_dim={ctx.head_dim}; build it with the attention's sizes"
            )

    def logits(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> Tensor:
        self._check_sizes(ctx)
        c2p_idx, p2c_idx = self._cached_indices(ctx)  # [Bp, Lq, Lk]
        q_r, k_r = self._projections(ctx)  # [H, 2k, Dh]
        if ctx.reference:
            return self._literal(q, k, q_r, k_r, c2p_idx, p2c_idx)
        b, h, lq, lk = q.shape[0], self.n_heads, q.shape[2], k.shape[2]
        out: Tensor | None = None

        def add(t: Tensor) -> None:
            nonlocal out
            out = t if out is None else out + t

        if "c2p" in self.terms:
            assert k_r is not None
            full = torch.matmul(q, k_r.transpose(-1, -2))  # [B, H, Lq, 2k]
            if lq == 1 and c2p_idx.shape[0] == 1:
                # decoding: one row of buckets, picked from the [B·H, 2k] rows (a gather with an expanded index,
                # or index_select on the last of four dims, takes 10x as long)
                picked = full.reshape(b * h, -1).index_select(1, c2p_idx[0, 0])
                add(picked.view(b, h, 1, lk))
            else:
                add(full.gather(-1, c2p_idx[:, None].expand(b, h, lq, lk)))
        if "p2c" in self.terms:
            assert q_r is not None
            few = 8 * lq <= min(lk, 2 * self.span)  # a few queries against many keys (never an L × L × d tensor)
            if few and lq == 1 and p2c_idx.shape[0] == 1:
                # decoding: the far keys' bucket is one row (a matrix-vector product), the near ones gathered
                add(key_rows_dot(k, q_r.to(k.dtype).transpose(0, 1), p2c_idx[0, 0])[:, :, None])
            elif few and p2c_idx.shape[0] * lq * lk * h * self.head_dim <= DIRECT_KEY_TERM_ELEMENTS:
                # a few queries (decoding): each pair's row of Q_r (Lq·Lk products, not Lk·2k)
                rows = q_r.to(k.dtype)[:, p2c_idx].transpose(0, 1)  # [Bp, H, Lq, Lk, Dh]
                add(torch.einsum("bhjd,bhijd->bhij", k, rows.expand(b, -1, -1, -1, -1)))
            else:
                full = torch.matmul(k, q_r.transpose(-1, -2))  # [B, H, Lk, 2k]
                idx = p2c_idx.transpose(-1, -2)[:, None].expand(b, h, lk, lq)
                add(full.gather(-1, idx).transpose(-1, -2))
        if "p2p" in self.terms:
            assert q_r is not None and k_r is not None
            if p2c_idx is c2p_idx:  # the same row on both sides: a per-row dot product
                table = (q_r * k_r).sum(-1)  # [H, 2k]
                add(table[:, c2p_idx].transpose(0, 1))
            else:
                table = torch.matmul(q_r, k_r.transpose(-1, -2)).flatten(1)  # [H, 2k * 2k]
                add(table[:, p2c_idx * (2 * self.span) + c2p_idx].transpose(0, 1))
        assert out is not None
        return out

    def _literal(
        self, q: Tensor, k: Tensor, q_r: Tensor | None, k_r: Tensor | None, c2p_idx: Tensor, p2c_idx: Tensor
    ) -> Tensor:
        """The formula as written: gather ``K^r_{δ(i,j)}`` and ``Q^r_δ`` for every pair, then dot products."""
        k_g = k_r[:, c2p_idx].transpose(0, 1) if k_r is not None else None  # [Bp, H, Lq, Lk, Dh]
        q_g = q_r[:, p2c_idx].transpose(0, 1) if q_r is not None else None
        out = torch.zeros((), dtype=q.dtype, device=q.device)
        if "c2p" in self.terms:
            out = out + torch.einsum("bhid,bhijd->bhij", q, k_g.expand(q.shape[0], -1, -1, -1, -1))
        if "p2c" in self.terms:
            out = out + torch.einsum("bhjd,bhijd->bhij", k, q_g.expand(k.shape[0], -1, -1, -1, -1))
        if "p2p" in self.terms:
            out = out + (q_g * k_g).sum(-1)
        return out


class EnhancedMaskDecoder(nn.Module):
    r"""DeBERTa's enhanced mask decoder (EMD): absolute positions, added just before the output.

    DeBERTa's layers see relative positions only. The EMD (He et al. 2021, Sec. 3.2) gives
    the last ``n`` layers the absolute positions back: their *queries* are
    ``I = H + P_abs`` (``H`` the hidden states of the layer before them, ``P_abs`` a learned
    absolute position embedding), while keys and values stay ``H``; each further EMD layer
    takes the previous EMD layer's output as ``I``. Microsoft's code runs the last layer
    twice with shared weights (``blocks=[last, last]``).

    .. math::
        I^{(0)} = H + P_{abs}, \qquad I^{(t+1)} = \mathrm{Block}_t(\text{queries}=I^{(t)},
        \text{keys, values}=H)

    Use: ``emd = EnhancedMaskDecoder(d_model, max_len)``, then
    ``emd(model.blocks[-2:], hidden_before_those_blocks, positions)`` or
    ``emd([model.blocks[-1]] * 2, hidden, positions)``.
    """

    def __init__(self, d_model: int, max_len: int = 512):
        super().__init__()
        if d_model <= 0 or max_len <= 0:
            raise ConfigError(f"d_model and max_len must be positive, got {d_model} and {max_len}")
        self.max_len = max_len
        self.position_embeddings = nn.Embedding(max_len, d_model)
        nn.init.normal_(self.position_embeddings.weight, std=0.02)

    def forward(
        self,
        blocks: Sequence[nn.Module],
        hidden: Tensor,
        positions: Tensor | None = None,
        *,
        attention_mask: Tensor | None = None,
        causal: bool = False,
    ) -> Tensor:
        """Run ``blocks`` (posenc ``Block``s) with queries ``H + P_abs`` and keys/values ``H``."""
        if hidden.dim() != 3:
            raise ConfigError(f"hidden must be [batch, length, d_model], got {tuple(hidden.shape)}")
        if not blocks:
            raise ConfigError("the enhanced mask decoder needs at least one block")
        pos = as_position_rows(positions, hidden.shape[1], hidden.device)
        check_positions(pos, max_position=self.max_len)
        x = hidden + self.position_embeddings(pos)
        cache: dict = {}
        for block in blocks:
            kv = block.ln1(hidden) if getattr(block, "norm", "post") == "pre" else hidden
            x = block(
                x,
                key_value=kv,
                positions=pos,
                key_positions=pos,
                attention_mask=attention_mask,
                causal=causal,
                cache=cache,
            )
        return x
