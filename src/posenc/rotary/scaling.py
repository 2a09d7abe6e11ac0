r"""RoPE context-window extension: rescaled inverse frequencies (and an attention factor).

Every method here keeps RoPE's rotation (rotate-half layout, as ``rope``) and
changes only the inverse frequencies ``θ_i = base^{-2i/d}`` (``d`` the rotary
dimension) -- and, for YaRN and LongRoPE, multiplies cos and sin by an
*attention factor* ``a``, so that ``q·k`` is multiplied by ``a²``:

==================  ===============================================================  ==========================
name                inverse frequencies                                              HF ``rope_type``
==================  ===============================================================  ==========================
``rope-linear``     ``θ_i / s`` (position interpolation: ``m -> m / s``)              ``linear``
``rope-ntk``        ``base' = base · s^{d/(d-2)}`` (static NTK-aware)                 (``dynamic`` at L' = s·L)
``rope-dynamic``    NTK-aware base from the current length L': ``base · (s L'/L - s + 1)^{d/(d-2)}``  ``dynamic``
``rope-yarn``       NTK-by-parts ramp between ``θ_i`` and ``θ_i / s``; ``a = 0.1 ln s + 1``  ``yarn``
``rope-llama3``     ``θ_i`` (short wavelengths), ``θ_i / s`` (long), smooth in between      ``llama3``
``rope-longrope``   ``θ_i / λ_i`` with searched per-pair factors (short / long set)       ``longrope``
==================  ===============================================================  ==========================

``s`` is ``factor`` and ``L`` is ``original_max_len`` (the context the model
was trained on). The numbers are those of HF transformers 5.x
``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS`` for the same settings,
computed in float32 in the same order so that the tables agree to the last bit
(the tests compare them, and a full rotation against ``LlamaRotaryEmbedding`` +
``apply_rotary_pos_emb``).

``rope-dynamic`` and ``rope-longrope`` depend on the current sequence length,
taken (as HF does) as ``max(position) + 1`` over the queries and keys of the
call. They are stateless: HF's ``dynamic`` keeps the largest frequencies it has
grown to until the length falls below ``L`` again; here the same positions
always give the same rotation. Like HF, keys already in a KV cache keep the
rotation they were stored with.

Precision: as ``rope`` (:func:`~posenc.rotary.rope.rope_angles`). The scaled
inverse frequencies (and LongRoPE's long set) are float32 buffers that stay
float32 when the module is cast to another dtype; the angle ``m · θ'_i`` is
float32's product below position ``2**24`` (HF's numbers bit for bit) and is
reduced modulo 2π in float64 from ``2**24`` on, so that offsets stay exact.
The attention factor multiplies the float32 cos and sin.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from ..base import AttentionContext, Card, check_positions
from ..errors import ConfigError
from ..registry import register
from .rope import RoPE, rope_angles, rope_inverse_frequencies


def _check_factor(name: str, factor: float, what: str = "factor") -> float:
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor):
        raise ConfigError(f"{name}: {what} must be a finite number, got {factor!r}")
    if factor <= 0:
        raise ConfigError(f"{name}: {what} must be > 0, got {factor}")
    if factor < 1:
        raise ConfigError(
            f"{name}: {what} is the context extension ratio (new length / trained length) and must be >= 1, "
            f"got {factor}; use {what}=1 for no scaling"
        )
    return float(factor)


def _check_original(name: str, original_max_len: int | None) -> int:
    if original_max_len is None:
        raise ConfigError(
            f"{name} needs original_max_len, the context length the model was trained on "
            "(HF's original_max_position_embeddings), e.g. original_max_len=2048"
        )
    if isinstance(original_max_len, bool) or not isinstance(original_max_len, int) or original_max_len <= 0:
        raise ConfigError(f"{name}: original_max_len must be a positive integer, got {original_max_len!r}")
    return original_max_len


def _sequence_length(positions: Tensor) -> int | Tensor:
    """``max(position) + 1`` (HF's ``seq_len``), 0 for no positions.

    While ``torch.compile`` traces, the same value as a 0-d int64 tensor (a Python int would need the data)."""
    if positions.numel() == 0:
        return 0
    check_positions(positions, integer=False)
    if torch.compiler.is_compiling():
        return positions.max().to(torch.float64).floor().to(torch.int64) + 1
    return int(math.floor(float(positions.max()))) + 1


def _longrope_example(head_dim: int, max_len: int) -> dict[str, object]:
    pairs = max(1, head_dim // 2)
    ramp = [i / max(1, pairs - 1) for i in range(pairs)]
    return dict(
        short_factor=[1.0 + 0.5 * r for r in ramp],
        long_factor=[1.0 + 3.0 * r for r in ramp],
        factor=2.0,
        original_max_len=max(1, max_len // 2),
    )


class ScaledRoPE(RoPE):
    """RoPE with rescaled inverse frequencies and an attention factor on cos and sin (not registered).

    Subclasses set ``inv_freq`` (static variants) or override :meth:`frequencies`
    (``length_dependent = True``) and set ``attention_factor``.
    """

    length_dependent = False
    attention_factor: float = 1.0
    randomized_variant = False
    claims = {}  # RoFormer's claims are not the scaled variants' (a length-dependent one is not consistent)
    # a model built for max_len positions from one trained on max_len / 2 (the factor 2)
    example_options = staticmethod(lambda dims: {"factor": 2.0, "original_max_len": max(1, dims["max_len"] // 2)})

    def _set_frequencies(self, inv_freq: Tensor) -> None:
        self.inv_freq = inv_freq.to(torch.float32)
        self._cos = torch.empty(0, self.rotary_dim // 2)
        self._sin = torch.empty(0, self.rotary_dim // 2)

    def frequencies(self, seq_len: int) -> Tensor:
        """The inverse frequencies used for a sequence of ``seq_len`` positions (float32, ``[rotary_dim/2]``)."""
        return self.inv_freq

    def cache_problem(self, shortest: int, longest: int) -> str | None:
        """Length-dependent scaling changes its frequencies with the length, while keys already in a cache keep
        the rotation they were stored with: a cache is exact only while the frequencies stay the same."""
        if not self.length_dependent:
            return None
        first = self.frequencies(shortest)
        if all(torch.equal(first, self.frequencies(n)) for n in range(shortest + 1, longest + 1)):
            return None
        limit = getattr(self, "original_max_len", None)
        beyond = f" (beyond original_max_len={limit})" if limit is not None else ""
        return (
            f"{self.info.name} computes its RoPE frequencies from the current length{beyond}, which goes from "
            f"{shortest} to {longest} here, while keys already in a cache keep the rotation they were stored with"
        )

    def cos_sin(self, positions: Tensor, seq_len: int | None = None) -> tuple[Tensor, Tensor]:
        """cos and sin of the phases, multiplied by the attention factor (as HF does)."""
        if self.length_dependent:
            if seq_len is None:
                seq_len = _sequence_length(positions)
            if not positions.is_floating_point():
                check_positions(positions)
            a = rope_angles(positions[..., None], self.frequencies(seq_len).to(positions.device))
            cos, sin = a.cos(), a.sin()
        else:
            cos, sin = super().cos_sin(positions)
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos, sin

    def rotate(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> tuple[Tensor, Tensor]:
        if not self.length_dependent:
            return super().rotate(q, k, ctx)
        key = ("scaled-rope-cos-sin", id(self))
        got = ctx.cache.get(key)
        if got is None or got[0] is not ctx.q_pos or got[1] is not ctx.k_pos:
            lq, lk = _sequence_length(ctx.q_pos), _sequence_length(ctx.k_pos)
            if isinstance(lq, Tensor) or isinstance(lk, Tensor):
                seq_len = torch.maximum(torch.as_tensor(lq), torch.as_tensor(lk))
            else:
                seq_len = max(lq, lk)
            qc, qs = self.cos_sin(ctx.q_pos, seq_len)
            kc, ks = (qc, qs) if ctx.k_pos is ctx.q_pos else self.cos_sin(ctx.k_pos, seq_len)
            got = (ctx.q_pos, ctx.k_pos, qc[:, None], qs[:, None], kc[:, None], ks[:, None])
            ctx.cache[key] = got
        _, _, qc, qs, kc, ks = got
        return self.apply(q, qc, qs), self.apply(k, kc, ks)


def _card(name: str, title: str, paper: str, year: int, summary: str, hf: str, **kw) -> Card:
    return Card(
        name=name,
        title=title,
        paper=paper,
        year=year,
        family="rotary",
        position="relative",
        learnable=False,
        summary=summary,
        reference=f"HF transformers 5.x ROPE_INIT_FUNCTIONS[{hf!r}] and LlamaRotaryEmbedding + apply_rotary_pos_emb",
        **kw,
    )


@register
class RoPELinear(ScaledRoPE):
    r"""RoPE with position interpolation (Chen et al. 2023; kaiokendev's "SuperHOT").

    .. math::
        f(x, m) = \mathrm{RoPE}(x, m / s), \quad\text{i.e.}\quad \theta_i' = \theta_i / s

    so ``s · L`` positions fall in the trained range ``[0, L)`` of angles.
    """

    info = _card(
        "rope-linear",
        "RoPE + position interpolation",
        "Chen et al., Extending Context Window of Large Language Models via Positional Interpolation",
        2023,
        "Divide positions (equivalently θ_i) by the factor s: s·L positions map into the trained range.",
        "linear",
        aliases=("rope-pi", "position-interpolation"),
        shortcoming="crowds nearby positions together: high frequencies lose resolution",
    )
    example_options = {"factor": 2.0}

    def __init__(self, head_dim: int, factor: float, base: float = 10000.0, rotary_dim: int | None = None):
        super().__init__(head_dim, base, rotary_dim)
        self.factor = _check_factor(self.info.name, factor)
        self._set_frequencies(rope_inverse_frequencies(self.rotary_dim, base) / self.factor)


def ntk_base(base: float, alpha: float, rotary_dim: int) -> float:
    r"""NTK-aware base: ``base · α^{d/(d-2)}``."""
    return base * alpha ** (rotary_dim / (rotary_dim - 2))


def _check_ntk_dim(name: str, rotary_dim: int) -> None:
    if rotary_dim <= 2:
        raise ConfigError(
            f"{name} changes the base by an exponent d/(d-2), which needs a rotary dimension d > 2, got {rotary_dim}"
        )


@register
class RoPENTK(ScaledRoPE):
    r"""RoPE with static NTK-aware base scaling (bloc97, 2023).

    .. math::
        \mathrm{base}' = \mathrm{base} \cdot s^{d/(d-2)}, \qquad \theta_i' = \mathrm{base}'^{-2i/d}

    The highest frequency is kept (``θ_0 = 1``) and the lowest is divided by
    ``s`` exactly (``θ'_{d/2-1} = θ_{d/2-1} / s``): high frequencies
    extrapolate, low ones interpolate. It equals HF's ``dynamic`` type with
    ``factor = 1`` at a sequence length ``s · L``.
    """

    info = _card(
        "rope-ntk",
        "RoPE + NTK-aware scaling",
        "bloc97, NTK-Aware Scaled RoPE (r/LocalLLaMA post)",
        2023,
        "Raise the base to base·s^(d/(d-2)): low frequencies interpolate by s, high ones are kept.",
        "dynamic",
        aliases=("rope-ntk-aware",),
    )
    example_options = {"factor": 2.0}

    def __init__(self, head_dim: int, factor: float, base: float = 10000.0, rotary_dim: int | None = None):
        super().__init__(head_dim, base, rotary_dim)
        self.factor = _check_factor(self.info.name, factor)
        _check_ntk_dim(self.info.name, self.rotary_dim)
        self.scaled_base = ntk_base(base, self.factor, self.rotary_dim)
        self._set_frequencies(rope_inverse_frequencies(self.rotary_dim, self.scaled_base))


@register
class RoPEDynamicNTK(ScaledRoPE):
    r"""RoPE with dynamic NTK scaling (emozilla, 2023; HF ``rope_type="dynamic"``).

    For a sequence of length ``L' = max(position) + 1``:

    .. math::
        \mathrm{base}' = \mathrm{base}\cdot\Big(\frac{s\,\max(L', L)}{L} - (s - 1)\Big)^{d/(d-2)}

    Up to the trained length ``L`` it is plain RoPE; beyond, the base grows with ``L'``.
    """

    info = _card(
        "rope-dynamic",
        "RoPE + dynamic NTK scaling",
        "emozilla, Dynamically Scaled RoPE further increases performance of long context LLaMA (r/LocalLLaMA post)",
        2023,
        "Recompute the NTK-aware base from the current length beyond the trained length L.",
        "dynamic",
        aliases=("rope-dynamic-ntk",),
    )
    # relative within one length only: past original_max_len the frequencies follow max(position) + 1, so a
    # shift of every position changes the scores (the card's position="relative" would claim otherwise)
    claims = {"relative_only": None}
    length_dependent = True

    def __init__(
        self,
        head_dim: int,
        factor: float,
        original_max_len: int | None = None,
        base: float = 10000.0,
        rotary_dim: int | None = None,
    ):
        super().__init__(head_dim, base, rotary_dim)
        self.factor = _check_factor(self.info.name, factor)
        self.original_max_len = _check_original(self.info.name, original_max_len)
        _check_ntk_dim(self.info.name, self.rotary_dim)

    def dynamic_base(self, seq_len: int) -> Tensor:
        """The base for ``seq_len`` positions, a float32 scalar computed as HF's forward does
        (from a tensor length; its ``ROPE_INIT_FUNCTIONS`` with a Python ``int`` length rounds
        the base in float64, which can differ in the last bit)."""
        s, n = self.factor, self.original_max_len
        if isinstance(seq_len, Tensor):  # traced by torch.compile
            length = torch.clamp(seq_len.to(torch.int64), min=n)
        else:
            length = torch.tensor(max(seq_len, n), dtype=torch.int64)
        return self.base * ((s * length / n) - (s - 1)) ** (self.rotary_dim / (self.rotary_dim - 2))

    def frequencies(self, seq_len: int | Tensor) -> Tensor:
        if isinstance(seq_len, Tensor):  # traced by torch.compile: both branches, chosen by value
            base = self.dynamic_base(seq_len)
            exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64).float() / self.rotary_dim
            scaled = (1.0 / (base**exponents)).to(self.inv_freq.device)
            return torch.where(seq_len.to(self.inv_freq.device) <= self.original_max_len, self.inv_freq, scaled)
        if seq_len <= self.original_max_len:
            return self.inv_freq
        base = self.dynamic_base(seq_len)
        exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64).float() / self.rotary_dim
        return (1.0 / (base**exponents)).to(self.inv_freq.device)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    r"""YaRN's ``\sqrt{1/t} = 0.1 · mscale · ln s + 1`` (1 for ``s <= 1``)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


@register
class RoPEYaRN(ScaledRoPE):
    r"""YaRN: NTK-by-parts interpolation plus an attention temperature (Peng et al. 2023).

    With ``r_i = L / λ_i`` the number of turns of pair ``i`` over the trained
    length (``λ_i = 2π/θ_i``) and a ramp ``γ`` that is 0 below ``β_slow`` turns
    and 1 above ``β_fast`` turns,

    .. math::
        \theta_i' = (1 - \gamma(r_i))\,\frac{\theta_i}{s} + \gamma(r_i)\,\theta_i, \qquad
        \mathrm{softmax}\Big(\frac{q_m^\top k_n}{t\sqrt{d}}\Big),\ \sqrt{1/t} = 0.1 \ln s + 1

    The temperature is applied as HF does: cos and sin (so q and k) are
    multiplied by ``a = \sqrt{1/t}`` (``attention_factor``), scaling ``q·k`` by
    ``a²``. The ramp is computed on pair indices as HF: the pair at which ``r``
    crosses ``β`` is ``d \ln(L / (2πβ)) / (2 \ln base)``, floored / ceiled
    (``truncate``) and clamped to ``[0, d-1]``. ``mscale`` / ``mscale_all_dim``
    give DeepSeek's ratio ``a = mscale(s, mscale) / mscale(s, mscale_all_dim)``.
    """

    info = _card(
        "rope-yarn",
        "YaRN",
        "Peng et al., YaRN: Efficient Context Window Extension of Large Language Models",
        2023,
        "Interpolate low frequencies by s, keep high ones (ramp between), and sharpen attention by (0.1 ln s + 1)^2.",
        "yarn",
        aliases=("yarn",),
    )

    def __init__(
        self,
        head_dim: int,
        factor: float,
        original_max_len: int | None = None,
        base: float = 10000.0,
        rotary_dim: int | None = None,
        beta_fast: float = 32.0,
        beta_slow: float = 1.0,
        attention_factor: float | None = None,
        mscale: float | None = None,
        mscale_all_dim: float | None = None,
        truncate: bool = True,
    ):
        super().__init__(head_dim, base, rotary_dim)
        name = self.info.name
        self.factor = _check_factor(name, factor)
        self.original_max_len = _check_original(name, original_max_len)
        if not (beta_fast > 0 and beta_slow > 0 and beta_fast > beta_slow):
            raise ConfigError(
                f"{name}: need beta_fast > beta_slow > 0 (turns over the trained length above which a pair is kept "
                f"and below which it is interpolated), got beta_fast={beta_fast}, beta_slow={beta_slow}"
            )
        self.beta_fast, self.beta_slow, self.truncate = float(beta_fast), float(beta_slow), bool(truncate)
        if attention_factor is None:
            if mscale and mscale_all_dim:
                attention_factor = yarn_mscale(self.factor, mscale) / yarn_mscale(self.factor, mscale_all_dim)
            else:
                attention_factor = yarn_mscale(self.factor)
        elif not attention_factor > 0:
            raise ConfigError(f"{name}: attention_factor must be > 0, got {attention_factor}")
        self.attention_factor = float(attention_factor)
        self._set_frequencies(self._yarn_frequencies())

    def correction_range(self) -> tuple[float, float]:
        """The pair indices ``(low, high)`` between which the ramp runs."""
        d, base, n = self.rotary_dim, self.base, self.original_max_len

        def pair_of(turns: float) -> float:
            return (d * math.log(n / (turns * 2 * math.pi))) / (2 * math.log(base))

        low, high = pair_of(self.beta_fast), pair_of(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        return max(low, 0), min(high, d - 1)

    def _yarn_frequencies(self) -> Tensor:
        d = self.rotary_dim
        wavelength_base = self.base ** (torch.arange(0, d, 2).float() / d)  # 1 / θ_i
        keep = 1.0 / wavelength_base
        interpolated = 1.0 / (self.factor * wavelength_base)
        low, high = self.correction_range()
        if low == high:
            high += 0.001  # a one-step ramp; avoids 0/0
        ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        kept = 1 - ramp  # 1 for pairs with many turns (kept), 0 for few (interpolated)
        return interpolated * (1 - kept) + keep * kept


@register
class RoPELlama3(ScaledRoPE):
    r"""Llama 3.1's frequency-dependent scaling (Meta, "The Llama 3 Herd of Models", 2024).

    With wavelengths ``λ_i = 2π/θ_i``, ``λ_lo = L / low_freq_factor`` and ``λ_hi = L / high_freq_factor``:

    .. math::
        \theta_i' = \begin{cases} \theta_i & \lambda_i < \lambda_{hi} \\
            \theta_i / s & \lambda_i > \lambda_{lo} \\
            (1-\mu_i)\,\theta_i / s + \mu_i\,\theta_i & \text{otherwise} \end{cases}, \qquad
        \mu_i = \frac{L/\lambda_i - \mathrm{low}}{\mathrm{high} - \mathrm{low}}
    """

    info = _card(
        "rope-llama3",
        "RoPE + Llama 3.1 scaling",
        "Llama Team (Meta), The Llama 3 Herd of Models",
        2024,
        "Keep short wavelengths, divide long ones by s, interpolate smoothly in between (Llama 3.1).",
        "llama3",
    )

    def __init__(
        self,
        head_dim: int,
        factor: float,
        original_max_len: int | None = None,
        low_freq_factor: float = 1.0,
        high_freq_factor: float = 4.0,
        base: float = 10000.0,
        rotary_dim: int | None = None,
    ):
        super().__init__(head_dim, base, rotary_dim)
        name = self.info.name
        self.factor = _check_factor(name, factor)
        self.original_max_len = _check_original(name, original_max_len)
        if not (0 < low_freq_factor < high_freq_factor):
            raise ConfigError(
                f"{name}: need 0 < low_freq_factor < high_freq_factor, got low_freq_factor={low_freq_factor}, "
                f"high_freq_factor={high_freq_factor} (Llama 3.1 uses 1 and 4)"
            )
        self.low_freq_factor, self.high_freq_factor = float(low_freq_factor), float(high_freq_factor)
        inv = rope_inverse_frequencies(self.rotary_dim, base)
        n, s, lo, hi = self.original_max_len, self.factor, self.low_freq_factor, self.high_freq_factor
        wavelength = 2 * math.pi / inv
        scaled = torch.where(wavelength > n / lo, inv / s, inv)
        mu = (n / wavelength - lo) / (hi - lo)
        smooth = (1 - mu) * scaled / s + mu * scaled
        medium = (wavelength >= n / hi) & (wavelength <= n / lo)
        self._set_frequencies(torch.where(medium, smooth, scaled))


@register
class RoPELongRoPE(ScaledRoPE):
    r"""LongRoPE (Ding et al. 2024; Phi-3): searched per-pair rescale factors.

    .. math::
        \theta_i' = \frac{\theta_i}{\lambda_i}, \quad
        \lambda = \begin{cases}\texttt{short\_factor} & L' \le L\\ \texttt{long\_factor} & L' > L\end{cases},
        \qquad a = \sqrt{1 + \ln s / \ln L}\ \ (s > 1)

    ``L' = max(position) + 1`` of the call; ``a`` multiplies cos and sin (HF).
    ``factor`` (``s``, Phi-3: ``max_position_embeddings / original_max_position_embeddings``)
    only sets the default attention factor.
    """

    info = _card(
        "rope-longrope",
        "LongRoPE",
        "Ding et al., LongRoPE: Extending LLM Context Window Beyond 2 Million Tokens",
        2024,
        "Per-pair searched factors (short set up to L, long set beyond) and attention factor sqrt(1 + ln s / ln L).",
        "longrope",
        aliases=("longrope",),
    )
    # relative within one length only: past original_max_len the frequencies follow max(position) + 1, so a
    # shift of every position changes the scores (the card's position="relative" would claim otherwise)
    claims = {"relative_only": None}
    # trained on max_len / 2; per-pair factors rising from 1 (the fastest pair) to 1.5 (short set) and 4 (long set)
    example_options = staticmethod(lambda dims: _longrope_example(dims["head_dim"], dims["max_len"]))
    length_dependent = True
    phase_buffers = (*RoPE.phase_buffers, "long_inv_freq")

    def __init__(
        self,
        head_dim: int,
        short_factor: Sequence[float],
        long_factor: Sequence[float],
        original_max_len: int | None = None,
        factor: float | None = None,
        attention_factor: float | None = None,
        base: float = 10000.0,
        rotary_dim: int | None = None,
    ):
        super().__init__(head_dim, base, rotary_dim)
        name = self.info.name
        self.original_max_len = _check_original(name, original_max_len)
        pairs = self.rotary_dim // 2
        lists = {}
        for what, values in (("short_factor", short_factor), ("long_factor", long_factor)):
            vals = list(values) if isinstance(values, (list, tuple, Tensor)) else None
            if vals is None or len(vals) != pairs:
                got = f"length {len(vals)}" if vals is not None else type(values).__name__
                raise ConfigError(
                    f"{name}: {what} must be a list of one factor per rotary pair (rotary_dim/2 = {pairs}), got {got}"
                )
            vals = [float(v) for v in vals]
            if not all(v > 0 and math.isfinite(v) for v in vals):
                raise ConfigError(f"{name}: every {what} must be a finite number > 0, got {vals}")
            lists[what] = vals
        if attention_factor is None:
            if factor is None:
                raise ConfigError(
                    f"{name} needs factor (the extension ratio, max_len / original_max_len as Phi-3) "
                    "or an explicit attention_factor"
                )
            self.factor = _check_factor(name, factor)
            attention_factor = (
                1.0 if self.factor <= 1 else math.sqrt(1 + math.log(self.factor) / math.log(self.original_max_len))
            )
        else:
            self.factor = None if factor is None else _check_factor(name, factor)
            if not attention_factor > 0:
                raise ConfigError(f"{name}: attention_factor must be > 0, got {attention_factor}")
        self.attention_factor = float(attention_factor)
        shape = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64).float() / self.rotary_dim
        short = 1.0 / (torch.tensor(lists["short_factor"], dtype=torch.float32) * base**shape)
        long = 1.0 / (torch.tensor(lists["long_factor"], dtype=torch.float32) * base**shape)
        self._set_frequencies(short)
        self.register_buffer("long_inv_freq", long, persistent=False)

    def frequencies(self, seq_len: int) -> Tensor:
        if isinstance(seq_len, Tensor):  # traced by torch.compile: chosen by value
            return torch.where(
                seq_len.to(self.inv_freq.device) > self.original_max_len, self.long_inv_freq, self.inv_freq
            )
        return self.long_inv_freq if seq_len > self.original_max_len else self.inv_freq
