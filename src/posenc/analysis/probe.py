"""The probe of ``posenc inspect``: an encoding built at given sizes, with uniform access to its per-position codes
and to the attention scores it induces (:class:`Probe`), the sizes' checks, and :class:`Unmeasurable`.

Every property (:mod:`posenc.analysis.geometry`, :mod:`~posenc.analysis.offsets`, :mod:`~posenc.analysis.length`)
and every picture (:mod:`posenc.analysis.plots`) is measured through a probe. Imports torch, the registry, the
attention module (the reference path computes the scores) and the absolute encodings' base class.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from ..absolute._additive import AdditiveAbsolute
from ..attention import MultiHeadAttention
from ..base import AttentionContext, PositionalEncoding
from ..errors import ConfigError
from ..registry import accepted_arguments, build, example_options, resolve

ATTENTION_HOOKS = frozenset({"rotate", "logits", "bias", "scale", "probabilities"})


class Unmeasurable(Exception):
    """A property that cannot be measured for this encoding; the message says why."""


def _short(e: BaseException, n: int = 160) -> str:
    msg = f"{type(e).__name__}: {e}"
    return msg if len(msg) <= n else msg[: n - 3] + "..."


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """Run torch on one thread: the probes are tiny and extra threads only contend."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


# ---------------------------------------------------------------- settings
def check_settings(dim: int, length: int, heads: int, short_length: int | None = None) -> int:
    """Validate the sizes of a measurement; return the short length used for consistency."""
    for what, v, lo in (("dim", dim, 2), ("length", length, 8), ("heads", heads, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ConfigError(f"{what} must be an integer >= {lo}, got {v!r}")
    if length > 4096:
        raise ConfigError(f"length must be <= 4096 (the measurements are O(length^2)), got {length}")
    if dim > 4096:
        raise ConfigError(f"dim must be <= 4096, got {dim}")
    if dim % heads:
        raise ConfigError(
            f"dim={dim} is not divisible by heads={heads}; pick heads among "
            f"{[h for h in range(1, min(dim, 16) + 1) if dim % h == 0]}"
        )
    if short_length is None:
        short_length = max(4, length // 10)
    if isinstance(short_length, bool) or not isinstance(short_length, int) or not 2 <= short_length < length:
        raise ConfigError(
            f"short_length must be an integer in 2..{length - 1} (below length={length}), got {short_length!r}"
        )
    return short_length


# ---------------------------------------------------------------- the probe
class Probe:
    """An encoding built at given sizes, with uniform access to its codes and induced scores."""

    def __init__(
        self,
        encoding: str | PositionalEncoding,
        *,
        dim: int = 64,
        length: int = 128,
        heads: int = 4,
        vocab_size: int = 32,
        draws: int = 32,
        seed: int = 0,
        options: dict[str, Any] | None = None,
    ):
        self.dim, self.length, self.heads = dim, length, heads
        self.head_dim = dim // heads
        self.vocab_size = vocab_size
        self.options = dict(options or {})
        self.seed = seed
        self.from_name = not isinstance(encoding, PositionalEncoding)
        self.defaulted: dict[str, Any] = {}
        if isinstance(encoding, PositionalEncoding):
            self.enc: PositionalEncoding = encoding
            self.name = encoding.info.name
        else:
            self.name = resolve(encoding).info.name
            self.enc = self.build(length)
        self.enc.eval()
        self.card = self.enc.info
        self.hooks = tuple(sorted(self.enc.hooks()))
        self.in_attention = bool(ATTENTION_HOOKS & set(self.hooks))
        self.kind = "attention" if self.in_attention or "embed" not in self.hooks else "code"
        g = torch.Generator().manual_seed(seed)
        dh = self.head_dim
        # content: one random vector per draw and head, the same at every position
        self.q0 = torch.randn(draws, heads, 1, dh, generator=g)
        self.k0 = torch.randn(draws, heads, 1, dh, generator=g)
        self.probe_vec = torch.randn(1, heads, 1, dh, generator=g) / math.sqrt(dh)
        self.w = torch.randn(2, dim, dim, generator=g) / math.sqrt(dim)  # the TENER figure's random W
        self._attention: MultiHeadAttention | None = None

    def dims(self, max_len: int) -> dict[str, int]:
        return dict(
            d_model=self.dim, n_heads=self.heads, head_dim=self.head_dim, max_len=max_len, vocab_size=self.vocab_size
        )

    def build(self, max_len: int) -> PositionalEncoding:
        """Build at ``max_len``; settings no model dimension supplies come from the encoding's ``example_options``.

        If that fails, try again with the encoding's own default ``max_len``; the first error is raised
        when every attempt fails.
        """
        cls = resolve(self.name)
        accepted = accepted_arguments(cls)
        dims = self.dims(max_len)
        options = dict(self.options)
        defaulted = {k: v for k, v in example_options(cls, dims).items() if k not in options}
        attempts: list[tuple[dict[str, Any], dict[str, Any]]] = [(dims, defaulted)]
        if "max_len" in accepted and "max_len" not in options:
            attempts.append(({k: v for k, v in dims.items() if k != "max_len"}, dict(attempts[-1][1])))
        first: Exception | None = None
        for d, extra in attempts:
            torch.manual_seed(self.seed)
            try:
                enc = build(self.name, dims=d, options={**extra, **options} or None)
            except Exception as e:
                first = first or e
                continue
            self.defaulted = dict(extra)
            if "max_len" not in d:
                self.defaulted["max_len"] = "the encoding's default"
            return enc
        assert first is not None
        raise first

    # ------------------------------------------------------------ codes
    @property
    def rotary_only(self) -> bool:
        """Only the rotate hook acts inside attention (beside a softmax temperature, which scales every score alike:
        MLA's YaRN factor): the rotation of a fixed vector is a per-position code."""
        return "rotate" in self.hooks and set(self.hooks) & ATTENTION_HOOKS <= {"rotate", "scale"}

    @property
    def has_code(self) -> bool:
        return "embed" in self.hooks or isinstance(self.enc, AdditiveAbsolute) or self.rotary_only

    def code(self, positions: Tensor) -> Tensor:
        """The code of each position ``[L, D]`` (float64).

        Additive absolute encodings: ``PE_t``. Other ``embed`` hooks: the embedding of a fixed
        input (zeros; ones and token 0 for encodings that need tokens). Rotary encodings: the
        rotation of a fixed random probe vector, all heads side by side.
        """
        enc = self.enc
        positions = positions.long()
        with torch.no_grad():
            if isinstance(enc, AdditiveAbsolute):
                return enc.codes(positions).double()
            if "embed" in self.hooks:
                n = positions.numel()
                if enc.requires_tokens:
                    x = torch.ones(1, n, self.dim)
                    tokens = torch.zeros(1, n, dtype=torch.long)
                    return enc.embed(x, positions[None], tokens=tokens)[0].double()
                return enc.embed(torch.zeros(1, n, self.dim), positions[None])[0].double()
            if self.rotary_only:
                v = self.probe_vec.expand(1, self.heads, positions.numel(), self.head_dim).contiguous()
                ctx = self.context(positions, positions)
                q, _ = enc.rotate(v, v.clone(), ctx)
                return q[0].transpose(0, 1).reshape(positions.numel(), -1).double()
        raise Unmeasurable(f"no per-position code: {self.name} acts inside attention ({', '.join(self.hooks)})")

    # ----------------------------------------------------------- scores
    def attention_module(self) -> MultiHeadAttention:
        if self._attention is None:
            torch.manual_seed(self.seed)
            self._attention = MultiHeadAttention(self.dim, self.heads, self.enc, path="reference")
            self._attention.eval()
        return self._attention

    def context(self, q_pos: Tensor, k_pos: Tensor) -> AttentionContext:
        qp, kp = q_pos.long()[None], k_pos.long()[None]
        seg_q, seg_k = torch.zeros_like(qp), torch.zeros_like(kp)
        return AttentionContext(
            q_pos=qp,
            k_pos=kp,
            n_heads=self.heads,
            head_dim=self.head_dim,
            reference=True,
            q_segments=seg_q,
            k_segments=seg_k,
            attention=self.attention_module(),
        )

    def attention_scores(self, q_pos: Tensor, k_pos: Tensor, *, same_content: bool = False) -> Tensor:
        """``scale · (rotate(q)·rotate(k) + logits) + bias``: ``[draws, H, Lq, Lk]`` (float64); for an encoding
        with weights of its own (a ``probabilities`` hook), the logarithm of those weights."""
        enc = self.enc
        lq, lk = q_pos.numel(), k_pos.numel()
        k_content = self.q0 if same_content else self.k0
        q = self.q0.expand(-1, -1, lq, -1).contiguous()
        k = k_content.expand(-1, -1, lk, -1).contiguous()
        ctx = self.context(q_pos, k_pos)
        with torch.no_grad():
            if "rotate" in self.hooks:
                q, k = enc.rotate(q, k, ctx)
            s = torch.matmul(q, k.transpose(-1, -2))
            if "logits" in self.hooks:
                extra = enc.logits(q, k, ctx)
                if extra is not None:
                    s = s + extra
            s = s * enc.scale(self.head_dim)
            if "bias" in self.hooks:
                b = enc.bias(ctx)
                if b is not None:
                    s = s + b
            if "probabilities" in self.hooks:  # weights of its own (stick-breaking): their logarithm, which is what
                p = enc.probabilities(s, ctx)  # softmax's logits are to its weights, up to a constant per query
                if p is not None:
                    s = p.clamp_min(torch.finfo(p.dtype).tiny).log()
        return s.expand(q.shape[0], self.heads, lq, lk).double()

    def scores(self, q_pos: Tensor, k_pos: Tensor, *, same_content: bool = False) -> Tensor:
        """The scores the properties are measured on: ``[draws|1, H|1, Lq, Lk]`` (float64).

        Attention-level encodings: :meth:`attention_scores`. Absolute codes: the raw dot
        product ``PE_i · PE_j`` (what the background articles study).
        """
        if self.kind == "attention":
            return self.attention_scores(q_pos, k_pos, same_content=same_content)
        cq = self.code(q_pos)
        ck = cq if k_pos is q_pos else self.code(k_pos)
        return (cq @ ck.T)[None, None]

    def scores_through_w(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """``PE_i^T W PE_j`` for two random ``W`` (the TENER figure): ``[2, 1, Lq, Lk]``."""
        cq, ck = self.code(q_pos), self.code(k_pos)
        w = self.w.double()
        if w.shape[-1] != cq.shape[-1]:
            g = torch.Generator().manual_seed(self.seed + 1)
            w = torch.randn(2, cq.shape[-1], cq.shape[-1], generator=g, dtype=torch.float64) / math.sqrt(cq.shape[-1])
        return torch.einsum("id,ndk,jk->nij", cq, w, ck)[:, None]

    def parameter_count(self, enc: PositionalEncoding | None = None) -> int:
        enc = self.enc if enc is None else enc
        return sum(p.numel() for p in enc.parameters() if p.requires_grad)
