r"""FIRE, functional interpolation for relative positions (Li et al. 2024, ICLR).

FIRE learns the bias as a function of a *normalised* distance, so that a longer
input maps into the range of distances seen in training (progressive
interpolation):

.. math::
    b(i, j) = f_\theta\!\left( \frac{\psi(i - j)}{\psi(\max\{L, i\})} \right), \qquad
    \psi(x) = \log(c\,x + 1), \qquad j \le i

with ``f_θ : R -> R^H`` a small MLP (1 -> hidden -> heads, ReLU), ``c > 0`` a learned
scalar and ``L`` a learned threshold: for queries at ``i < L`` the normaliser is
``ψ(L)``, so short contexts are not stretched to ``[0, 1]``. The bias is added
after the temperature (the ``bias`` hook).

Where the paper's equation and its appendix pseudo-code differ we follow the
pseudo-code and say so:

* ``c`` enters as ``|c|`` (``ψ(x) = log(|c x| + 1)``), which keeps ``c > 0`` in effect;
* ``L = |ℓ · L_0|`` with a fixed ``L_0`` (``init_L``, 512) and a learned multiplier
  ``ℓ`` (init 1);
* ``ε`` (1e-6) is added to the denominator ``ψ(max{L, i})``;
* for a key after the query (``j > i``, only without a causal mask) the distance
  enters as ``|i - j|``, so FIRE is then symmetric.

FIRE is *not* translation invariant: the normaliser depends on the query
position ``i`` once ``i > L``. Each layer has its own FIRE by default
(``shared=False``); ``shared=True`` is the paper's layer-shared ablation.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .. import native
from ..base import AttentionContext, Card, Cost, PositionalEncoding
from ..block_bias import block_function
from ..errors import ConfigError
from ..registry import register
from ..relative._skew import kept_offset_table, offset_rows


def _rowdot(a: Tensor, b: Tensor) -> Tensor:
    """``Σ_j a[i, j] b[i, j]`` per row ``i`` of two ``[n, m]`` tensors, in one pass (a batched dot product)."""
    return torch.bmm(a[:, None, :], b[:, :, None]).view(-1)


def _distances(params, r0: int, r1: int, ke: int) -> tuple[Tensor, Tensor]:
    """``x_ij = ψ(|i - j|) / n_i`` of query rows ``r0 .. r1 - 1`` against keys ``0 .. ke - 1``, and ``ψ(|i - j|)``
    (``ψ(d) = log(|c| d + 1)``, ``n_i = ψ(max{L, i}) + ε`` given per query): ``[r1 - r0, ke]`` each."""
    c, norm, _, _, q_pos, k_pos, _ = params
    i, j = q_pos[r0:r1].to(c.dtype), k_pos[:ke].to(c.dtype)
    psi = (i[:, None] - j[None, :]).abs_().mul_(c.abs()).log1p_()
    return psi / norm[r0:r1, None], psi


def _block_bias(params, r0: int, r1: int, ke: int) -> Tensor:
    """FIRE's bias of a block of pairs from the MLP's pieces: ``[H, r1 - r0, ke]``. ``params`` are ``(c, n, A, B,
    query positions, key positions, knots)`` with ``n [Lq]`` the normalisers ``ψ(max{L, i}) + ε``."""
    knots, a, b = params[6], params[2], params[3]
    x, _ = _distances(params, r0, r1, ke)
    return FIRE._piecewise(x, knots.to(x.dtype), a.to(x.dtype), b.to(x.dtype))


def _block_grad(params, r0: int, r1: int, ke: int, dbias: Tensor, grads: list) -> None:
    r"""The gradients of a block's bias from its ``∂L/∂bias`` ``g`` (``[H, r1 - r0, ke]``), added to ``grads`` for
    ``(c, n, A, B)``.

    Per pair, ``∂L/∂x_ij = Σ_h g_hij A_{s,h}`` and the pieces' ``∂A_{s,h} = Σ g_hij x_ij``, ``∂B_{s,h} = Σ g_hij``
    (the C kernel's backward). Then, as ``x = ψ / n`` and ``∂ψ(d)/∂c = \mathrm{sign}(c) d / (1 + |c| d) =
    -\mathrm{expm1}(-ψ(d)) / c``: ``∂L/∂n_i = -Σ_j ∂x_ij ψ_ij / n_i²`` and ``∂L/∂c = -Σ_i (Σ_j ∂x_ij
    \mathrm{expm1}(-ψ_ij)) / (c n_i)`` (0 at ``c = 0``, as autograd's ``|c|``): two batched dot products and one
    ``expm1`` over the pairs. The normalisers' own dependence on ``c`` and the threshold is autograd's, outside."""
    c, norm, a, _, _, _, knots = params
    x, psi = _distances(params, r0, r1, ke)
    kn, a_, b_ = knots.to(x.dtype), a.to(x.dtype), params[3].to(x.dtype)
    g = dbias.to(x.dtype)
    got = native.fire_bias_grad(x, kn, a_, b_, g)
    if got is None:  # PyTorch ops: the piece of every pair, its slope per head
        seg = torch.searchsorted(kn, x.contiguous()).view(-1)
        gh = g.reshape(a.shape[1], -1)  # [H, pairs]
        dx = (a_.t()[:, seg] * gh).sum(0).view_as(x)
        da = x.new_zeros(a.shape).index_add_(0, seg, (gh * x.view(-1)).t())
        db = x.new_zeros(a.shape).index_add_(0, seg, gh.t())
    else:
        dx, da, db = got
    for i, d in ((2, da), (3, db)):
        if grads[i] is not None:
            grads[i].add_(d.to(grads[i].dtype))
    n = norm[r0:r1].to(x.dtype)
    if grads[1] is not None:
        grads[1][r0:r1] -= (_rowdot(dx, psi) / n.square()).to(grads[1].dtype)
    if grads[0] is not None:
        per_row = _rowdot(dx, torch.expm1(psi.neg())) / n  # Σ_j ∂x_ij expm1(-ψ_ij) / n_i
        cc = c.to(x.dtype)
        grads[0] += torch.where(cc == 0, torch.zeros_like(cc), -per_row.sum() / cc).to(grads[0].dtype)


_BLOCKS = block_function("fire", _block_bias, _block_grad)


@register
class FIRE(PositionalEncoding):
    r"""FIRE: :math:`b(i,j) = f_\theta(\psi(i-j)/\psi(\max\{L,i\}))`, :math:`\psi(x) = \log(cx+1)`.

    Args:
        n_heads: heads (the MLP's output width).
        hidden: the MLP's hidden width (32 in the paper).
        init_c: initial ``c`` (0.1).
        init_L: the threshold's base ``L_0`` (512); ``L = |ℓ L_0|`` with learned ``ℓ``.
        learn_threshold: whether ``ℓ`` is learned (True, the paper's progressive interpolation).
        eps: added to the normaliser.
        shared: one FIRE for all layers (the paper's FIRE-S) instead of one per layer.
    """

    info = Card(
        name="fire",
        title="FIRE (functional interpolation for relative positions)",
        paper="Li et al., Functional Interpolation for Relative Positions Improves Long Context Transformers",
        year=2024,
        family="bias",
        position="relative",
        learnable=True,
        summary="MLP of log(c(i-j)+1)/log(c max(L,i)+1) per head, added after scaling.",
        reference="the paper's equation (and appendix pseudo-code) on hand-computed cases",
        shortcoming="not translation invariant past the threshold L; a bias per pair (no Toeplitz shortcut)",
    )
    randomized_variant = True

    def __init__(
        self,
        n_heads: int,
        hidden: int = 32,
        init_c: float = 0.1,
        init_L: float = 512.0,
        learn_threshold: bool = True,
        eps: float = 1e-6,
        shared: bool = False,
    ):
        super().__init__()
        if not isinstance(n_heads, int) or isinstance(n_heads, bool) or n_heads < 1:
            raise ConfigError(f"fire needs n_heads >= 1 (an integer), got {n_heads!r}")
        if not isinstance(hidden, int) or hidden < 1:
            raise ConfigError(f"fire: hidden must be a positive integer, got {hidden!r}")
        if not init_c > 0:
            raise ConfigError(f"fire: init_c must be > 0 (psi(x) = log(c x + 1)), got {init_c}")
        if not init_L > 0:
            raise ConfigError(f"fire: init_L (the threshold L) must be > 0, got {init_L}")
        if not eps >= 0:
            raise ConfigError(f"fire: eps must be >= 0, got {eps}")
        self.n_heads, self.hidden, self.eps = n_heads, hidden, eps
        self.init_c_value, self.init_L_value = float(init_c), float(init_L)
        self.shared_across_layers = bool(shared)  # type: ignore[misc]  # instance override of the ClassVar
        self.mlp = nn.Sequential(nn.Linear(1, hidden), nn.ReLU(), nn.Linear(hidden, n_heads))
        self.c = nn.Parameter(torch.tensor(self.init_c_value))
        self.register_buffer("L0", torch.tensor(self.init_L_value))
        self.L_multiplier = nn.Parameter(torch.tensor(1.0), requires_grad=learn_threshold)

    def reset_parameters(self) -> None:
        super().reset_parameters()
        with torch.no_grad():
            self.c.fill_(self.init_c_value)
            self.L_multiplier.fill_(1.0)

    def cost(self, head_dim: int) -> Cost:
        # f(x) = W_2 relu(w_1 x + b_1) + b_2 of a scalar x is piecewise linear with at most w + 1 pieces: the MLP
        # (2·w + 2·w·H products) once per piece, then per pair x = ψ(|i-j|) / ψ(max{L, i}) (abs, mul, log1p, div,
        # shared by the heads; x depends on i, not on j - i alone) and a piece lookup, and per head slope·x + intercept
        # (2) and the add (1). The kernels (block-bias, native fire_bias) do exactly this.
        w, h = self.hidden, self.n_heads
        return Cost(
            pair_elementwise=3.0 + 8.0 / h,
            row=2.0 * (w + w * h),
            rows=w + 1,
            note="the MLP is piecewise linear in its scalar input: one multiply-add per pair and head, not the MLP",
        )

    def threshold(self) -> Tensor:
        """``L = |ℓ L_0|``."""
        return (self.L_multiplier * self.L0).abs()

    def psi(self, x: Tensor) -> Tensor:
        r"""``ψ(x) = log(|c x| + 1)``."""
        return torch.log1p((self.c * x).abs())

    def normalized_distance(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """``ψ(|i - j|) / (ψ(max{L, i}) + ε)``: ``[B, Lq, Lk]``."""
        dtype = self.c.dtype
        i = q_pos.to(dtype)
        dist = (i[:, :, None] - k_pos.to(dtype)[:, None, :]).abs()
        norm = self.psi(torch.maximum(i, self.threshold())) + self.eps  # [B, Lq]
        return self.psi(dist) / norm[:, :, None]

    def bias(self, ctx: AttentionContext) -> Tensor:
        if ctx.n_heads != self.n_heads:
            raise ConfigError(f"fire was built for n_heads={self.n_heads} but the attention has {ctx.n_heads}")
        if ctx.reference or not self._is_relu_mlp():
            x = self.normalized_distance(ctx.q_pos, ctx.k_pos)  # [B, Lq, Lk]
            return self.mlp(x[..., None]).permute(0, 3, 1, 2)  # [B, H, Lq, Lk]: the MLP on every pair
        kept = self._kept_bias(ctx)
        if kept is not None:  # decoding: from the tables kept between calls
            return kept.transpose(0, 1)
        x = self.normalized_distance(ctx.q_pos, ctx.k_pos)  # [B, Lq, Lk]
        # [H, B, Lq, Lk] -> [B, H, Lq, Lk] (a free transpose for B = 1)
        return self._piecewise(x, *self.piecewise_linear()).transpose(0, 1)

    @staticmethod
    def _piecewise(x: Tensor, knots: Tensor, slope: Tensor, intercept: Tensor) -> Tensor:
        """``f(x)`` from its pieces (:meth:`piecewise_linear`): ``[H, *x.shape]``."""
        fast = native.fire_bias(x, knots.to(x.dtype), slope.to(x.dtype), intercept.to(x.dtype))
        if fast is not None:  # one pass in C
            return fast
        seg = torch.searchsorted(knots, x.detach().contiguous())  # the linear piece of every pair
        return slope.t()[:, seg] * x + intercept.t()[:, seg]

    def _kept_bias(self, ctx: AttentionContext) -> Tensor | None:
        """The bias ``[H, B, 1, Lk]`` of a decoding step (one query, contiguous integer positions, no autograd, not
        training) from tables this module keeps between calls, or ``None``.

        The step's offsets ``j - i`` are one run (``ctx.contiguous``), so a table over offsets gives them as a slice.
        ``ψ(|j - i|)`` depends on ``c`` alone: a table of it leaves a division per key, ``ψ(|i - j|) / (ψ(max{L, i})
        + ε)``, and the MLP's pieces (kept too) per key and head: the work the maths sets once ``i > L``, where the
        normaliser moves with ``i``. While the query is at ``i ≤ L`` the normaliser is the constant ``ψ(L)``, so the
        bias depends on ``j - i`` alone and the bias itself is kept per offset: the step reads a slice of it. Each
        table gains offsets as the cache grows (a half more at a time) and is rebuilt when a parameter changed
        (version counters)."""
        q_pos, k_pos = ctx.q_pos, ctx.k_pos
        if torch.is_grad_enabled() or self.training or q_pos.shape[-1] != 1 or not offset_rows(ctx):
            return None
        if q_pos.is_floating_point() or k_pos.is_floating_point():
            return None
        b, lk = q_pos.shape[0], k_pos.shape[-1]
        low = int(k_pos[0, 0]) - int(q_pos[0, 0])  # the offset j - i of the first key; the others follow one by one
        n = max(abs(low), abs(low + lk - 1))  # the largest distance
        if float(q_pos.max()) <= float(self.threshold()):  # every query at i <= L (exact: positions < 2^24)
            table = self._kept_table("_bias_memo", n, self._bias_of_distance, list(self.parameters()))
            mid = table.shape[-1] // 2  # offset 0
            return table[:, None, None, mid + low : mid + low + lk].expand(-1, b, 1, lk)
        table = self._kept_table("_psi_memo", n, self.psi, [self.c])
        mid = table.shape[-1] // 2
        norm = self.psi(torch.maximum(q_pos.to(self.c.dtype), self.threshold())) + self.eps  # [B, 1]
        return self._piecewise(table[mid + low : mid + low + lk] / norm[:, :, None], *self._kept_pieces())

    def _bias_of_distance(self, d: Tensor) -> Tensor:
        """``f(ψ(d) / (ψ(L) + ε))`` at the distances ``d`` (float ``[N]``): ``[H, N]``, the bias of a query at i ≤ L."""
        x = self.psi(d) / (self.psi(self.threshold()) + self.eps)
        return self._piecewise(x, *self._kept_pieces())

    def _kept_pieces(self) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`piecewise_linear`, kept while the MLP's parameters do not change (calls without autograd)."""
        params = list(self.mlp.parameters())
        key = tuple((id(t), t._version, t.dtype, t.device) for t in params)
        memo = self.__dict__.get("_pieces_memo")
        if memo is None or memo[0] != key:
            memo = (key, self.piecewise_linear(), params)  # params kept: their ids stay theirs
            self.__dict__["_pieces_memo"] = memo
        return memo[1]

    def _kept_table(self, name: str, n: int, of_distance, params: list[Tensor]) -> Tensor:
        """``of_distance(|o|)`` at the offsets ``-N .. N`` (``N >= n``), kept while ``params`` and the threshold's
        ``L0`` do not change (:func:`~posenc.relative._skew.kept_offset_table`)."""
        return kept_offset_table(self, name, n, of_distance, [*params, self.L0], self.c)

    def bias_blocks(self, ctx: AttentionContext):  # -> tuple[BlockFunction, tuple[Tensor, ...]] | None
        """The bias of a block of query rows from the piecewise-linear MLP: ``(fn, params)``, or ``None``.

        For positions shared by the batch (``[1, L]``), off the reference path, with the 1 -> hidden -> heads ReLU MLP:
        :func:`posenc.block_bias.block_bias_attention` then evaluates ``f(ψ(|i - j|) / ψ(max{L, i}))`` one block of
        query rows at a time (a causal block only up to its diagonal), and never holds the ``[H, L, L]`` bias or its
        gradient. ``fn`` is a :class:`~posenc.block_bias.BlockFunction` (the gradient of a block by hand), so the
        kernel is one custom op, which ``torch.compile`` keeps. Its parameters are ``(c, n, A, B, query positions,
        key positions, knots)``: the normalisers ``n_i = ψ(max{L, i}) + ε`` (``[Lq]``, made here under autograd, so
        the threshold's gradient is autograd's) and the MLP's pieces, its knots constants (as in :meth:`bias`).
        """
        if ctx.reference or not self._is_relu_mlp():
            return None
        if ctx.q_pos.shape[0] != 1 or ctx.k_pos.shape[0] != 1:
            return None
        if ctx.n_heads != self.n_heads:
            raise ConfigError(f"fire was built for n_heads={self.n_heads} but the attention has {ctx.n_heads}")
        knots, slope, intercept = self.piecewise_linear()
        q_pos, k_pos = ctx.q_pos[0], ctx.k_pos[0]
        norm = self.psi(torch.maximum(q_pos.to(self.c.dtype), self.threshold())) + self.eps  # ψ(max{L, i}) + ε
        return _BLOCKS, (self.c, norm, slope, intercept, q_pos, k_pos, knots)

    def flex_score(self, q: Tensor, k: Tensor, ctx: AttentionContext):  # -> tuple[Tensor, Tensor, ScoreMod] | None
        r"""FIRE as a flex_attention score_mod: ``score + f_θ(ψ(|i - j|) / (ψ(\max\{L, i\}) + ε))`` per pair, the MLP
        ``f_θ(x)_h = W_{2,h} · \mathrm{relu}(w_1 x + b_1) + b_{2,h}`` evaluated in the kernel (a ``hidden``-wide dot
        product per pair and head, which flex fuses; no ``[H, L, L]`` bias). The positions are read per row of the
        batch, so any positions (padding offsets, a KV cache) fit; ``None`` on the reference path or for another
        MLP than the paper's ``1 -> hidden -> heads`` ReLU one."""
        if ctx.reference or not self._is_relu_mlp():
            return None
        if ctx.n_heads != self.n_heads:
            raise ConfigError(f"fire was built for n_heads={self.n_heads} but the attention has {ctx.n_heads}")
        dtype = q.dtype
        q_pos, k_pos = ctx.q_pos.to(dtype), ctx.k_pos.to(dtype)
        norm = self.psi(torch.maximum(q_pos, self.threshold().to(dtype))).to(dtype) + self.eps  # [B|1, Lq]
        c = self.c.abs().to(dtype)
        lin1, lin2 = self.mlp[0], self.mlp[2]
        w1, b1 = lin1.weight[:, 0].to(dtype), lin1.bias.to(dtype)
        w2 = lin2.weight.to(dtype)
        b2 = lin2.bias.to(dtype) if lin2.bias is not None else torch.zeros(self.n_heads, dtype=dtype, device=q.device)
        per_q, per_k = q_pos.shape[0] > 1, k_pos.shape[0] > 1

        def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            bq, bk = (b if per_q else 0), (b if per_k else 0)
            x = torch.log1p(c * (q_pos[bq, q_idx] - k_pos[bk, kv_idx]).abs()) / norm[bq, q_idx]
            return score + (w2[h] * torch.relu(w1 * x + b1)).sum() + b2[h]

        return q, k, score_mod

    def _is_relu_mlp(self) -> bool:
        m = self.mlp
        return (
            len(m) == 3
            and isinstance(m[0], nn.Linear)
            and isinstance(m[1], nn.ReLU)
            and isinstance(m[2], nn.Linear)
            and m[0].in_features == 1
            and m[0].bias is not None
        )

    def piecewise_linear(self) -> tuple[Tensor, Tensor, Tensor]:
        r"""The MLP as the piecewise-linear function it is: ``f(x) = A_s x + B_s`` on piece ``s``.

        ``f(x) = W_2 \,\mathrm{relu}(w_1 x + b_1) + b_2`` of a scalar ``x`` changes slope only where a hidden unit
        switches, at ``x = -b_{1,k} / w_{1,k}``: with those (at most ``hidden``) knots sorted, piece ``s`` has a fixed
        set of active units and ``A_s = W_2 (a_s ∘ w_1)``, ``B_s = W_2 (a_s ∘ b_1) + b_2``. Evaluating the bias is
        then a ``searchsorted`` and one multiply-add per pair and head instead of a ``hidden``-wide MLP per pair (and
        its ``L²·hidden`` activations); the gradients of ``W_2, w_1, b_1, b_2`` flow through ``A`` and ``B``.

        Returns ``(knots [m], A [m + 1, H], B [m + 1, H])`` with ``m = hidden``: a unit that never switches (``w_1 =
        0``) has its knot at ``+∞``, so its pieces past the last finite knot are never reached; ``x`` on a knot takes
        either side (``f`` is continuous).
        """
        lin1, lin2 = self.mlp[0], self.mlp[2]
        w1, b1 = lin1.weight[:, 0], lin1.bias
        with torch.no_grad():  # shapes fixed by the hidden width (no boolean index): torch.compile traces it
            moving = w1 != 0
            at = torch.where(moving, -b1 / torch.where(moving, w1, torch.ones_like(w1)), torch.full_like(w1, math.inf))
            knots, order = torch.sort(at)
            rank = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
            piece = torch.arange(order.numel() + 1, device=order.device)[:, None]  # piece s: knots[s-1] < x <= knots[s]
            # unit k is on in piece s: rising (w > 0) past its knot (rank < s), falling before it, flat where b > 0
            on = torch.where(w1 > 0, rank < piece, torch.where(w1 < 0, rank >= piece, b1 > 0))
            active = on.to(w1.dtype)  # [hidden + 1, hidden]
        slope = (active * w1) @ lin2.weight.t()
        intercept = (active * b1) @ lin2.weight.t()
        if lin2.bias is not None:
            intercept = intercept + lin2.bias
        return knots, slope, intercept

    def matrix(self, length: int) -> Tensor:
        """The ``[H, L, L]`` bias for positions ``0 .. length-1``."""
        pos = torch.arange(length)[None]
        return self.bias(AttentionContext(q_pos=pos, k_pos=pos, n_heads=self.n_heads, head_dim=1))[0]
