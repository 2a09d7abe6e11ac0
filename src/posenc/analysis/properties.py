"""Measured properties of a positional encoding (``posenc inspect``).

The articles posenc started from (docs/background.md) argue about what makes an
encoding good. Each claim becomes a measurement here, for any registered encoding:

==================  ===========================================================================
property            measured as
==================  ===========================================================================
unique              absolute codes: smallest ``||PE_i - PE_j||`` over positions ``i != j < L``;
                    attention-level encodings: smallest distance between the score profiles of
                    two different offsets (a query looking ``0 .. L-1`` positions back)
continuous          one step moves the code by about the same amount everywhere
                    (largest / median step <= 1.5) and by less than a typical distance
                    (median step / median distance <= 0.5)
bounded             from length L to 8L, the mean ``|PE|`` (``|score|``) over the farthest 10% of
                    positions grows by at most 1.2x, or the largest value by at most 1.05x
consistent          the code (scores) of the first ``L_s`` positions is the same in a sequence of
                    length ``L_s`` and of length ``L``
linear_offset       least-squares ``T_k`` with ``PE_{t+k} ≈ T_k PE_t`` has a relative residual < 1e-3
direction_aware     ``score(t, t+k) != score(t, t-k)`` (raw dot products for absolute codes)
relative_only       scores unchanged when every position shifts by a constant
decay               the mean score falls with ``|i-j|`` (rank correlation <= -0.5)
extrapolates        defined and finite past the trained length, in the range seen within it
params_constant     the number of parameters does not grow with ``max_len``
==================  ===========================================================================

Encodings that act inside attention (rotate, logits, bias, scale) are
measured on the attention scores they induce,
``A = scale · (q·k + logits) + bias`` after ``rotate``, with a fixed random
content vector at every position (so that ``A`` depends on positions only),
never on an embedding table. Absolute encodings are measured on their codes
(``PE_t``), and their scores are the raw dot products ``PE_i · PE_j`` that
Wu (2022) and Xixiaoyao, "Three positional encoding methods" analyse, with the dot
product through a random ``W`` (the TENER figure) reported alongside.

A property that cannot be measured for an encoding (no table past its
length, no per-position code, a hook that fails on the probe) is reported as
``n/a (reason)``; nothing here raises for a registered encoding that builds.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..absolute._additive import AdditiveAbsolute
from ..attention import MultiHeadAttention
from ..base import AttentionContext, Card, PositionalEncoding
from ..errors import ConfigError
from ..registry import accepted_arguments, available, build, example_options, registered_class, resolve
from .names import PROPERTIES

ATTENTION_HOOKS = frozenset({"rotate", "logits", "bias", "scale"})

PROPERTY_KEYS = tuple(p[0] for p in PROPERTIES)
PROPERTY_TITLES = {p[0]: p[1] for p in PROPERTIES}
PROPERTY_MEANING = {p[0]: p[2] for p in PROPERTIES}

REL_TOL = 1e-3  # relative tolerance under which two float32 quantities count as equal

# shortcoming phrases -> (property, claimed value)
_SHORTCOMING_RULES: tuple[tuple[tuple[str, ...], str, bool], ...] = (
    (("unbounded",), "bounded", False),
    (("inconsistent across lengths", "depends on the length"), "consistent", False),
    (("discontinuous",), "continuous", False),
    (("no linear map",), "linear_offset", False),
    (("symmetric in the offset", "no direction"), "direction_aware", False),
    (("undefined past", "not defined past"), "extrapolates", False),
    (("grow with max_len", "grows with max_len", "parameters grow"), "params_constant", False),
    (("no positional information",), "unique", False),
)


def claims_for(card: Card, encoding_class: type[PositionalEncoding] | None = None) -> dict[str, bool | None]:
    """What the encoding claims, property by property (``None``: no claim).

    The mapping: ``position="none"`` claims no unique code, no direction, no decay and
    (trivially) relative-only scores; ``position="absolute"`` claims a unique code per position;
    ``position="relative"`` claims relative-only scores; ``learnable=False`` claims a parameter
    count that does not grow with the length; phrases of the card's ``shortcoming`` (for
    example "unbounded", "undefined past max_len", "no direction") claim the property fails;
    the class's own ``claims`` (declared in its file: the background articles' and papers' claims) come last.
    ``encoding_class`` is the encoding's class (default: the one registered as ``card.name``, if any).
    """
    out: dict[str, bool | None] = {k: None for k in PROPERTY_KEYS}
    if card.position == "none":
        out.update(unique=False, direction_aware=False, decay=False, relative_only=True)
    elif card.position == "absolute":
        out["unique"] = True
    elif card.position == "relative":
        out["relative_only"] = True
    if not card.learnable:
        out["params_constant"] = True
    if encoding_class is None:
        encoding_class = registered_class(card.name)
    if encoding_class is not None:
        out.update(encoding_class.claims)
    text = f"{card.shortcoming}".lower()
    for phrases, key, value in _SHORTCOMING_RULES:
        if any(p in text for p in phrases):
            out[key] = value
    return out


class Unmeasurable(Exception):
    """A property that cannot be measured for this encoding; the message says why."""


@dataclass
class Measurement:
    """One row of a property card."""

    key: str
    value: str  # the measured value, for people
    holds: bool | None  # None: not measurable
    claim: bool | None = None
    how: str = ""
    data: dict[str, Any] = field(default_factory=dict)

    @property
    def title(self) -> str:
        return PROPERTY_TITLES.get(self.key, self.key)

    @property
    def measurable(self) -> bool:
        return self.holds is not None

    @property
    def verdict(self) -> str:
        """``pass`` (the measurement agrees with the claim), ``FAIL``, ``-`` (no claim) or ``n/a``."""
        if self.holds is None:
            return "n/a"
        if self.claim is None:
            return "-"
        return "pass" if self.holds == self.claim else "FAIL"


@dataclass
class Report:
    """The property card of one encoding."""

    name: str
    card: Card
    settings: dict[str, Any]
    kind: str  # "code" (absolute, measured on PE_t), "attention" (measured on scores) or "unbuilt"
    hooks: tuple[str, ...]
    measurements: dict[str, Measurement]
    notes: list[str] = field(default_factory=list)
    error: str | None = None  # kind "unbuilt": why the encoding could not be built at these sizes

    def __getitem__(self, key: str) -> Measurement:
        return self.measurements[key]

    @property
    def failures(self) -> list[str]:
        return [k for k, m in self.measurements.items() if m.verdict == "FAIL"]

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "title": self.card.title,
            "family": self.card.family,
            "position": self.card.position,
            "kind": self.kind,
            "hooks": list(self.hooks),
            "settings": dict(self.settings),
            "notes": list(self.notes),
            "properties": {
                k: {
                    "title": m.title,
                    "value": m.value,
                    "holds": m.holds,
                    "claim": m.claim,
                    "verdict": m.verdict,
                    "how": m.how,
                }
                for k, m in self.measurements.items()
            },
        }


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
        """Only the rotate hook acts inside attention: the rotation of a fixed vector is a per-position code."""
        return set(self.hooks) & ATTENTION_HOOKS == {"rotate"}

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
        """``scale · (rotate(q)·rotate(k) + logits) + bias``: ``[draws, H, Lq, Lk]`` (float64)."""
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


# ------------------------------------------------------------ helpers
def _fmt(x: float) -> str:
    if x != x:  # nan
        return "nan"
    if math.isinf(x):
        return "inf"
    if x == 0:
        return "0"
    a = abs(x)
    if a >= 1e4 or a < 1e-3:
        return f"{x:.2e}"
    return f"{x:.4g}"


def _rel_diff(a: Tensor, b: Tensor) -> float:
    scale = max(float(b.abs().max()), float(a.abs().max()), 1e-12)
    return float((a - b).abs().max()) / scale


def _spearman(x: Tensor, y: Tensor) -> float:
    rx = x.argsort().argsort().double()
    ry = y.argsort().argsort().double()
    rx, ry = rx - rx.mean(), ry - ry.mean()
    den = float(rx.norm() * ry.norm())
    return float((rx * ry).sum()) / den if den > 0 else 0.0


def _arange(n: int, start: int = 0) -> Tensor:
    return torch.arange(start, start + n)


def offset_profiles(probe: Probe, length: int) -> Tensor:
    """Scores of a query at position ``length-1`` and keys ``0 .. length-1``: ``[length, n]``.

    Row ``k`` is the profile (over content draws and heads) of the key ``k`` positions back.
    """
    q = torch.tensor([length - 1])
    s = probe.scores(q, _arange(length))  # [B, H, 1, L]
    prof = s[:, :, 0, :].reshape(-1, length).T  # [L(key), n]
    return prof.flip(0)  # row k: the key k positions back


def mean_score_by_offset(probe: Probe, length: int, *, through_w: bool = False) -> tuple[Tensor, Tensor]:
    """Offsets ``-(L-1) .. L-1`` and the mean score ``score(i, i+k)`` over queries i (and content q = k)."""
    pos = _arange(length)
    if through_w:
        s = probe.scores_through_w(pos, pos)
    else:
        s = probe.scores(pos, pos, same_content=True)
    s = s.mean(dim=(0, 1)) if s.dim() == 4 else s  # [L, L]
    offsets = torch.arange(-(length - 1), length)
    means = torch.stack([torch.diagonal(s, offset=int(k)).mean() for k in offsets])
    return offsets, means


# ------------------------------------------------------------ the properties
def measure_unique(probe: Probe) -> Measurement:
    L = probe.length
    if probe.kind == "attention":
        prof = offset_profiles(probe, L)
        d = torch.cdist(prof, prof)
        d.fill_diagonal_(float("inf"))
        scale = max(float(prof.abs().max()), 1e-12)
        i, j = divmod(int(d.argmin()), L)
        dmin = float(d.min())
        holds = dmin > REL_TOL * scale
        value = (
            f"min distance between offset profiles {_fmt(dmin)} (offsets {min(i, j)}, {max(i, j)}; "
            f"|score| up to {_fmt(scale)})"
        )
        how = f"scores of a query at {L - 1} with keys 0..{L - 1}, over {prof.shape[1]} content draws x heads"
        return Measurement("unique", value, holds, how=how, data=dict(min_distance=dmin, pair=(min(i, j), max(i, j))))
    c = probe.code(_arange(L))
    d = torch.cdist(c, c)
    d.fill_diagonal_(float("inf"))
    scale = max(float(c.norm(dim=-1).max()), 1e-12)
    i, j = divmod(int(d.argmin()), L)
    dmin = float(d.min())
    holds = dmin > REL_TOL * scale
    value = f"min ||PE_i - PE_j|| = {_fmt(dmin)} (positions {min(i, j)}, {max(i, j)}; max norm {_fmt(scale)})"
    return Measurement(
        "unique", value, holds, how=f"all pairs of positions 0..{L - 1}", data=dict(min_distance=dmin, pair=(i, j))
    )


def measure_continuous(probe: Probe) -> Measurement:
    L = probe.length
    if probe.kind == "attention":
        c = offset_profiles(probe, L)
        what = "offset profiles"
    else:
        c = probe.code(_arange(L))
        what = "codes"
    steps = (c[1:] - c[:-1]).norm(dim=-1)
    d = torch.cdist(c, c)
    iu = torch.triu_indices(L, L, offset=1)
    med_dist = float(d[iu[0], iu[1]].median())
    med_step, max_step = float(steps.median()), float(steps.max())
    if med_dist == 0:
        return Measurement("continuous", "all codes are equal", False, how=what, data={})
    uniform = max_step <= 1.5 * max(med_step, 1e-12 * med_dist) and med_step > 0
    small = med_step <= 0.5 * med_dist
    holds = uniform and small
    t = int(steps.argmax())
    value = (
        f"largest/median step {_fmt(max_step / med_step) if med_step else 'inf'} (largest at {t}->{t + 1}); "
        f"median step/median distance {_fmt(med_step / med_dist)}"
    )
    return Measurement(
        "continuous",
        value,
        holds,
        how=f"adjacent {what} over 0..{L - 1}: largest/median step <= 1.5 and median step <= 0.5 x median distance",
        data=dict(max_step=max_step, median_step=med_step, median_distance=med_dist),
    )


def _far_and_max(probe: Probe, n: int) -> tuple[float, float]:
    """Mean ``|value|`` over the farthest 10% of positions (offsets) and the largest ``|value|``, at length n."""
    tail = max(1, n // 10)
    if probe.kind == "attention":
        s = probe.scores(torch.tensor([n - 1]), _arange(n))[..., 0, :]  # keys 0..n-1 of the last query
        return float(s[..., :tail].abs().mean()), float(s.abs().max())
    c = probe.code(_arange(n))
    return float(c[-tail:].abs().mean()), float(c.abs().max())


def measure_bounded(probe: Probe) -> Measurement:
    L = probe.length
    lengths = [L, 2 * L, 4 * L, 8 * L]
    far: list[float] = []
    top: list[float] = []
    for n in lengths:
        try:
            f, m = _far_and_max(probe, n)
        except Unmeasurable:
            raise
        except Exception as e:
            if n == L:
                raise
            return Measurement(
                "bounded",
                f"n/a: max |value| {_fmt(top[0])} at L={L}, but not defined at length {n} ({_short(e)})",
                None,
                how="not measurable past the table",
                data=dict(lengths=lengths[: len(far)], far=far, max=top),
            )
        far.append(f)
        top.append(m)
    growth = far[-1] / max(far[0], 1e-12)
    top_growth = top[-1] / max(top[0], 1e-12)
    finite = all(math.isfinite(v) for v in far + top)
    holds = finite and (growth <= 1.2 or top_growth <= 1.05)
    what = "|score|" if probe.kind == "attention" else "|PE|"
    where = "keys farthest from the last query" if probe.kind == "attention" else "last positions"
    value = (
        f"mean {what} over the {where}: "
        + ", ".join(f"{_fmt(v)} (L={n})" for n, v in zip(lengths, far))
        + f" (x{_fmt(growth)}); max {what} {_fmt(top[0])} -> {_fmt(top[-1])}"
    )
    return Measurement(
        "bounded",
        value,
        holds,
        how=f"mean {what} over the farthest 10% of positions at lengths L, 2L, 4L, 8L; holds when it grows <= 1.2x "
        "or the largest value grows <= 1.05x",
        data=dict(lengths=lengths, far=far, max=top, growth=growth),
    )


def measure_consistent(probe: Probe, short_length: int) -> Measurement:
    L, s = probe.length, short_length
    if probe.kind == "attention":
        a = probe.scores(_arange(s), _arange(s))
        b = probe.scores(_arange(L), _arange(L))[..., :s, :s]
    else:
        a = probe.code(_arange(s))
        b = probe.code(_arange(L))[:s]
    diff = _rel_diff(a, b)
    holds = diff <= REL_TOL
    what = "scores" if probe.kind == "attention" else "codes"
    value = f"max relative difference of the {what} of positions 0..{s - 1} at length {s} vs {L}: {_fmt(diff)}"
    return Measurement("consistent", value, holds, how=f"lengths {s} and {L}", data=dict(rel_diff=diff))


def measure_linear_offset(probe: Probe) -> Measurement:
    if probe.kind == "attention" and not probe.rotary_only:
        raise Unmeasurable(f"no per-position code ({', '.join(probe.hooks)} act on scores)")
    L = probe.length
    c = probe.code(_arange(L))
    D = c.shape[-1]
    ks = [k for k in (1, 2, 4, 8, L // 4) if L - k >= D + 1]
    if not ks:
        raise Unmeasurable(f"needs length > dim + 1 positions to fit a {D}x{D} map (length={L})")
    res = {}
    for k in sorted(set(ks)):
        x, y = c[: L - k], c[k:]
        sol = torch.linalg.lstsq(x, y, driver="gelsy").solution
        r = float((x @ sol - y).norm()) / max(float(y.norm()), 1e-12)
        res[k] = r
    worst = max(res.values())
    holds = worst <= REL_TOL
    value = "residual ||PE_{t+k} - T_k PE_t|| / ||PE_{t+k}||: " + ", ".join(f"k={k}: {_fmt(r)}" for k, r in res.items())
    return Measurement(
        "linear_offset",
        value,
        holds,
        how=f"least squares over t = 0..L-k-1, L={L}; holds when every residual <= {REL_TOL}",
        data=dict(residuals=res),
    )


def measure_direction(probe: Probe) -> Measurement:
    L = probe.length
    pos = _arange(L)
    s = probe.scores(pos, pos)  # [B, H, L, L]
    diffs, scale = [], max(float(s.abs().max()), 1e-12)
    for k in range(1, L // 2):
        i = torch.arange(k, L - k)
        fwd, bwd = s[..., i, i + k], s[..., i, i - k]
        diffs.append(float((fwd - bwd).abs().mean()))
    d = max(diffs) / scale
    holds = d > REL_TOL
    what = "PE_t·PE_{t+k} vs PE_t·PE_{t-k}" if probe.kind == "code" else "score(t, t+k) vs score(t, t-k)"
    extra = ""
    data: dict[str, Any] = dict(rel_diff=d)
    if probe.kind == "code":
        sw = probe.scores_through_w(pos, pos)
        dws = []
        for k in range(1, L // 2):
            i = torch.arange(k, L - k)
            dws.append(float((sw[..., i, i + k] - sw[..., i, i - k]).abs().mean()))
        dw = max(dws) / max(float(sw.abs().max()), 1e-12)
        extra = f"; through a random W: {_fmt(dw)}"
        data["rel_diff_through_w"] = dw
    value = f"largest mean |{what}| / max|score|: {_fmt(d)}{extra}"
    return Measurement("direction_aware", value, holds, how=f"k = 1..{L // 2 - 1}, same query t", data=data)


def measure_relative_only(probe: Probe) -> Measurement:
    L = probe.length // 2  # positions 0..L/2-1 shifted by up to L/2 stay inside a table of max_len = L
    pos = _arange(L)
    base = probe.scores(pos, pos)
    diffs = {}
    for shift in (1, 7, L):
        diffs[shift] = _rel_diff(probe.scores(pos + shift, pos + shift), base)
    worst = max(diffs.values())
    holds = worst <= REL_TOL
    value = "max relative change of the scores when all positions shift by " + ", ".join(
        f"{s}: {_fmt(d)}" for s, d in diffs.items()
    )
    data: dict[str, Any] = dict(rel_diffs=diffs)
    if probe.kind == "code":
        dw = _rel_diff(probe.scores_through_w(pos + 7, pos + 7), probe.scores_through_w(pos, pos))
        value += f"; through a random W (shift 7): {_fmt(dw)}"
        data["rel_diff_through_w"] = dw
    return Measurement("relative_only", value, holds, how=f"positions 0..{L - 1} vs shifted", data=data)


def measure_decay(probe: Probe) -> Measurement:
    L = probe.length
    offsets, means = mean_score_by_offset(probe, L)
    stats = {}
    for side, sel in (("past", offsets <= 0), ("future", offsets >= 0)):
        dist, m = offsets[sel].abs().double(), means[sel]
        near = float(m[dist == 0].mean())
        far = float(m[dist >= 0.75 * (L - 1)].mean())
        stats[side] = (_spearman(dist, m), near, far)
    rho, near, far = stats["past"]
    holds = rho <= -0.5 and far < near
    content = " (content q = k, mean over draws and heads)" if probe.kind == "attention" else ""
    value = (
        f"keys before the query: rank correlation of the mean score with |k| {_fmt(rho)}, "
        f"score at k=0 {_fmt(near)}, at |k| >= {math.ceil(0.75 * (L - 1))}: {_fmt(far)}; "
        f"keys after: rank correlation {_fmt(stats['future'][0])}"
    )
    return Measurement(
        "decay",
        value,
        holds,
        how=f"mean score(i, i-k) over queries i, k = 0..{L - 1}{content}; holds when the rank correlation "
        "with k is <= -0.5 for keys before the query (the direction every model sees)",
        data=dict(spearman=rho, near=near, far=far, future_spearman=stats["future"][0]),
    )


def measure_extrapolates(probe: Probe) -> Measurement:
    L = probe.length
    n = 4 * L
    try:
        if probe.kind == "attention":
            qs = torch.tensor([L - 1, 2 * L, n - 1])
            s = probe.scores(qs, _arange(n))
            within = float(s[..., :1, :L].abs().max())
            past = float(s.abs().max())
            finite = bool(torch.isfinite(s).all())
        else:
            c = probe.code(_arange(n))
            within = float(c[:L].abs().max())
            past = float(c[L:].abs().max())
            finite = bool(torch.isfinite(c).all())
    except Unmeasurable:
        raise
    except Exception as e:
        return Measurement(
            "extrapolates",
            f"not defined past the trained length {L}: {_short(e)}",
            False,
            how=f"positions up to {n - 1} with max_len={L}",
            data=dict(defined=False),
        )
    ratio = past / max(within, 1e-12)
    holds = finite and ratio <= 1.5
    value = f"finite: {'yes' if finite else 'no'}; max |value| past L / within L: {_fmt(ratio)}"
    return Measurement(
        "extrapolates",
        value,
        holds,
        how=f"positions up to 4L = {n - 1}, trained length L = {L}; holds when finite and the range grows <= 1.5x",
        data=dict(defined=True, finite=finite, ratio=ratio),
    )


def measure_params(probe: Probe) -> Measurement:
    if not probe.from_name:
        counts = [probe.parameter_count()]
        return Measurement(
            "params_constant",
            f"{counts[0]} parameters (growth not measured: built from an instance)",
            None,
            data=dict(counts=counts),
        )
    L = probe.length
    lengths = [L, 2 * L, 4 * L]
    counts = []
    for n in lengths:
        counts.append(probe.parameter_count(probe.build(n)))
    d1, d2 = counts[1] - counts[0], counts[2] - counts[1]
    if d1 == 0 and d2 == 0:
        growth = "constant in max_len"
    elif d2 == 2 * d1:
        growth = f"linear in max_len (+{d1 // L} per position)" if d1 % L == 0 else "linear in max_len"
    else:
        growth = "grows with max_len"
    others = ", ".join(f"{c} at {n}" for n, c in zip(lengths[1:], counts[1:]))
    value = f"{counts[0]} at max_len={L} ({growth}; {others})"
    return Measurement(
        "params_constant",
        value,
        d1 == 0 and d2 == 0,
        how="trainable parameters of the encoding at max_len = L, 2L, 4L",
        data=dict(lengths=lengths, counts=counts),
    )


def _short(e: BaseException, n: int = 160) -> str:
    msg = f"{type(e).__name__}: {e}"
    return msg if len(msg) <= n else msg[: n - 3] + "..."


MEASURES: dict[str, Callable[..., Measurement]] = {
    "unique": measure_unique,
    "continuous": measure_continuous,
    "bounded": measure_bounded,
    "consistent": measure_consistent,
    "linear_offset": measure_linear_offset,
    "direction_aware": measure_direction,
    "relative_only": measure_relative_only,
    "decay": measure_decay,
    "extrapolates": measure_extrapolates,
    "params_constant": measure_params,
}


def measure(
    encoding: str | PositionalEncoding,
    *,
    dim: int = 64,
    length: int = 128,
    heads: int = 4,
    short_length: int | None = None,
    options: dict[str, Any] | None = None,
    properties: tuple[str, ...] | None = None,
    seed: int = 0,
) -> Report:
    """Measure every property of ``encoding`` (a registered name or an instance) and build its card.

    Args:
        dim: model width ``d_model`` (``head_dim = dim // heads``).
        length: the trained length (``max_len``); extrapolation is measured up to ``4 * length``.
        heads: attention heads.
        short_length: the short length compared with ``length`` for consistency (default ``length // 10``).
        options: extra settings passed to the encoding (``{"base": 100.0}``).
        properties: a subset of :data:`PROPERTY_KEYS` (default all).

    Raises :class:`~posenc.ConfigError` for invalid sizes and
    :class:`~posenc.UnknownNameError` for unknown names; everything else an encoding
    cannot do is reported as ``n/a`` in the card.
    """
    short = check_settings(dim, length, heads, short_length)
    keys = PROPERTY_KEYS if properties is None else tuple(properties)
    unknown = [k for k in keys if k not in MEASURES]
    if unknown:
        raise ConfigError(f"unknown properties {unknown}; known: {', '.join(PROPERTY_KEYS)}")
    settings = dict(dim=dim, length=length, heads=heads, head_dim=dim // heads, short_length=short)
    if options:
        settings["options"] = dict(options)
    if isinstance(encoding, PositionalEncoding):
        card = encoding.info
    else:
        card = resolve(encoding).info
    claims = claims_for(card, type(encoding) if isinstance(encoding, PositionalEncoding) else resolve(encoding))
    with single_thread():
        return _measure(encoding, card, claims, keys, settings, dim, length, heads, short, options, seed)


def _measure(
    encoding: str | PositionalEncoding,
    card: Card,
    claims: dict[str, bool | None],
    keys: tuple[str, ...],
    settings: dict[str, Any],
    dim: int,
    length: int,
    heads: int,
    short: int,
    options: dict[str, Any] | None,
    seed: int,
) -> Report:
    try:
        probe = Probe(encoding, dim=dim, length=length, heads=heads, options=options, seed=seed)
    except Exception as e:  # the encoding cannot be built at these sizes
        reason = _short(e, 240)
        ms = {k: Measurement(k, f"n/a (cannot build: {reason})", None, claims.get(k)) for k in keys}
        return Report(
            card.name, card, settings, "unbuilt", (), ms, notes=[f"cannot build: {reason}"], error=_short(e, 1000)
        )
    notes = []
    if probe.kind == "attention":
        notes.append(
            "measured on the attention scores it induces: scale·(rotate(q)·rotate(k) + logits) + bias, "
            "with a fixed random q and k at every position"
        )
    else:
        notes.append("measured on its codes PE_t; scores are the raw dot products PE_i·PE_j")
    if probe.defaulted:
        notes.append(
            "built with " + ", ".join(f"{k}={v!r}" for k, v in probe.defaulted.items()) + " (settings the probe "
            "chose because the sizes alone do not build it; pass options to change them)"
        )
    if "values" in probe.hooks:
        notes.append("its values hook (a^V) changes the attention output, not the scores: not measured here")
    if "positions" in probe.hooks:
        notes.append("its positions hook acts in training only; measured at evaluation")
    if probe.enc.requires_tokens:
        notes.append("needs token ids: measured for a fixed token (id 0, unit amplitude)")
    ms: dict[str, Measurement] = {}
    for k in keys:
        fn = MEASURES[k]
        try:
            m = fn(probe, short) if k == "consistent" else fn(probe)
        except Unmeasurable as e:
            m = Measurement(k, f"n/a ({e})", None)
        except Exception as e:  # a hook that fails on the probe: say so, never crash
            m = Measurement(k, f"n/a ({_short(e)})", None)
        m.claim = claims.get(k)
        ms[k] = m
    return Report(probe.name, card, settings, probe.kind, probe.hooks, ms, notes)


def measure_all(names: list[str] | None = None, **kwargs: Any) -> list[Report]:
    """:func:`measure` for every registered encoding (or ``names``)."""
    return [measure(n, **kwargs) for n in (available() if names is None else names)]
