"""Pictures of an encoding (matplotlib, saved as PNG and SVG).

=========  ==================================================================  ========================
picture    what it shows                                                       for
=========  ==================================================================  ========================
code       the code as a heatmap, position × dimension                        absolute codes, rotary
dot        ``PE_t·PE_{t+k}`` against ``k``, raw and through two random ``W``   absolute codes
           (the TENER figure, Wu (2022))
scores     the position-induced score per head,                                attention-level
           ``A - scale·q·k`` for a fixed random q, k (the bias for T5, ALiBi,
           KERPLE, FIRE ...)
buckets    which offsets share a score profile (T5 / DeBERTa buckets,          attention-level, when
           Shaw's clipping)                                                    offsets share scores
decay      mean score against the offset (content q = k), per head; rotary     attention-level
           encodings add RoFormer's relative upper bound (its long-term
           decay figure)
phase      the complex-order phase ``ω_j pos + θ_j`` of a fixed word, on the   encodings with a
           unit circle and against position                                   ``phase`` method
=========  ==================================================================  ========================

matplotlib is imported lazily (it is an optional dependency: ``pip install posenc[plots]``)
and only through :class:`matplotlib.figure.Figure`, so the global backend is never changed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..base import PositionalEncoding
from ..errors import ConfigError
from .names import FORMATS
from .probe import Probe, Unmeasurable, _short, check_settings, single_thread

PICTURES = ("code", "dot", "scores", "buckets", "decay", "phase")


def _figure(w: float = 5.5, h: float = 3.6, **margins: float) -> Any:
    """A figure with fixed margins (a layout engine would double the drawing time)."""
    try:
        from matplotlib.figure import Figure
    except ImportError as e:  # pragma: no cover - matplotlib is installed with posenc[plots]
        raise ConfigError("the pictures need matplotlib: pip install 'posenc[plots]'") from e
    fig = Figure(figsize=(w, h), dpi=80)
    fig.subplots_adjust(**{"left": 0.12, "right": 0.96, "bottom": 0.14, "top": 0.9, **margins})
    return fig


def _save(fig: Any, out: Path, stem: str, formats: tuple[str, ...]) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for fmt in formats:
        p = out / f"{stem}.{fmt}"
        fig.savefig(p, format=fmt)
        paths.append(p)
    return paths


def _title(probe: Probe, what: str) -> str:
    return f"{probe.name}: {what}"


# ---------------------------------------------------------------- pictures
def plot_code(probe: Probe, out: Path, formats: tuple[str, ...]) -> list[Path]:
    if not probe.has_code:
        raise Unmeasurable("no per-position code")
    L = probe.length
    c = probe.code(torch.arange(L)).float().numpy()
    fig = _figure(right=1.0)
    ax = fig.add_subplot()
    lim = float(abs(c).max()) or 1.0
    signed = bool((c < 0).any())
    im = ax.imshow(
        c,
        aspect="auto",
        interpolation="nearest",
        cmap="RdBu_r" if signed else "viridis",
        vmin=-lim if signed else None,
        vmax=lim if signed else None,
    )
    ax.set_xlabel("dimension")
    ax.set_ylabel("position")
    what = "rotation of a fixed vector R_t v" if probe.kind == "attention" else "code PE_t"
    ax.set_title(_title(probe, what), fontsize=10)
    fig.colorbar(im, ax=ax, shrink=0.8)
    return _save(fig, out, "code", formats)


def plot_dot(probe: Probe, out: Path, formats: tuple[str, ...]) -> list[Path]:
    if probe.kind != "code":
        raise Unmeasurable("not an absolute code (see the decay picture)")
    L = probe.length
    t = L // 2
    pos = torch.arange(L)
    q = torch.tensor([t])
    raw = probe.scores(q, pos)[0, 0, 0]
    w = probe.scores_through_w(q, pos)[:, 0, 0]
    k = (pos - t).numpy()
    fig = _figure()
    ax = fig.add_subplot()
    ax.plot(k, raw.numpy(), ".", ms=3, color="tab:blue", label="PE_t · PE_{t+k}")
    ax.plot(k, w[0].numpy(), ".", ms=3, color="tab:green", label="PE_t^T W_1 PE_{t+k}")
    ax.plot(k, w[1].numpy(), ".", ms=3, color="tab:red", label="PE_t^T W_2 PE_{t+k}")
    ax.axvline(0, color="0.7", lw=0.8)
    ax.set_xlabel(f"offset k (t = {t})")
    ax.set_ylabel("dot product")
    ax.set_title(_title(probe, "dot product against offset, raw and through random W"), fontsize=10)
    ax.legend(fontsize=7, loc="best")
    return _save(fig, out, "dot", formats)


def position_scores(probe: Probe, n: int) -> Tensor:
    """``A - scale·q·k`` for the first content draw: ``[H, n, n]`` (the bias itself for bias encodings)."""
    pos = torch.arange(n)
    s = probe.attention_scores(pos, pos)[0]
    content = (probe.q0[0] @ probe.k0[0].transpose(-1, -2)).double() * probe.enc.scale(probe.head_dim)
    return s - content.expand_as(s)


def plot_scores(probe: Probe, out: Path, formats: tuple[str, ...]) -> list[Path]:
    if probe.kind != "attention":
        raise Unmeasurable("acts before attention (see the code picture)")
    n = min(probe.length, 48)
    s = position_scores(probe, n).float().numpy()
    h = s.shape[0]
    cols = min(h, 4)
    rows = math.ceil(h / cols)
    fig = _figure(2.2 * cols + 0.4, 2.2 * rows + 0.6, left=0.06, right=0.98, bottom=0.12, top=0.8, wspace=0.35)
    axes = fig.subplots(rows, cols, squeeze=False)
    for i in range(rows * cols):
        ax = axes[i // cols][i % cols]
        if i >= h:
            ax.axis("off")
            continue
        lim = float(abs(s[i]).max()) or 1.0  # each head on its own symmetric scale (red +, blue -)
        ax.imshow(s[i], cmap="RdBu_r", vmin=-lim, vmax=lim, interpolation="nearest")
        ax.set_title(f"head {i} (|max| {lim:.3g})", fontsize=8)
        ax.set_xlabel("key j", fontsize=7)
        ax.set_ylabel("query i", fontsize=7)
        ax.tick_params(labelsize=6)
    fig.suptitle(_title(probe, "position-induced score per head"), fontsize=10)
    return _save(fig, out, "scores", formats)


def offset_groups(probe: Probe, length: int | None = None) -> tuple[Tensor, Tensor]:
    """Offsets ``-(L-1) .. L-1`` and the id of the group of offsets with the same score profile.

    Offsets whose scores (over content draws and heads) agree to 1e-5 (relative to the largest score) share a
    group: the buckets of T5 / DeBERTa, or the clipped distances of Shaw.
    """
    L = probe.length if length is None else length
    q = torch.tensor([L - 1])
    s = probe.scores(q, torch.arange(2 * L - 1))[..., 0, :]  # [B, H, 2L-1], offsets -(L-1) .. L-1
    prof = s.reshape(-1, 2 * L - 1).T
    tol = 1e-5 * max(float(prof.abs().max()), 1e-12)
    close = torch.cdist(prof, prof) <= tol
    first = close.double().argmax(dim=1)  # the first offset whose profile matches
    _, ids = torch.unique(first, return_inverse=True)  # representatives are in offset order
    return torch.arange(-(L - 1), L), ids


def plot_buckets(probe: Probe, out: Path, formats: tuple[str, ...]) -> list[Path]:
    if probe.kind != "attention":
        raise Unmeasurable("acts before attention")
    try:  # far offsets show the far buckets (DeBERTa's log buckets start late); tables may stop at L
        offsets, groups = offset_groups(probe, 4 * probe.length)
    except Exception:
        offsets, groups = offset_groups(probe)
    n_groups = int(groups.max()) + 1
    n_past = int(torch.unique(groups[offsets <= 0]).numel())
    if n_groups == 1:
        raise Unmeasurable("every offset gets the same score: no position information")
    if n_past >= 0.9 * int((offsets <= 0).sum()):
        raise Unmeasurable(
            f"{n_past} distinct score profiles for {int((offsets <= 0).sum())} offsets j - i <= 0: no buckets"
        )
    fig = _figure()
    ax = fig.add_subplot()
    ax.step(offsets.numpy(), groups.numpy(), where="mid", color="tab:purple")
    ax.plot(offsets.numpy(), groups.numpy(), ".", ms=3, color="tab:purple")
    ax.set_xlabel("offset j - i")
    ax.set_ylabel("bucket (group of offsets with equal scores)")
    ax.set_title(_title(probe, f"{n_groups} buckets for {offsets.numel()} offsets"), fontsize=10)
    return _save(fig, out, "buckets", formats)


def roformer_bound(inv_freq: Tensor, max_offset: int) -> tuple[Tensor, Tensor]:
    r"""RoFormer's relative upper bound of the rotary score, ``(1/(d/2)) Σ_{j=1}^{d/2} |S_j|``.

    ``S_j = Σ_{i=0}^{j-1} e^{i k θ_i}`` (RoFormer, section 3.4.3): the bound on
    ``|Σ_i h_i e^{i k θ_i}|`` for slowly varying ``h``, which decays with the offset ``k``.
    """
    k = torch.arange(max_offset + 1, dtype=torch.float64)
    theta = inv_freq.double().flatten()
    phase = k[:, None] * theta[None, :]
    s = torch.cumsum(torch.polar(torch.ones_like(phase), phase), dim=-1)
    return k, s.abs().mean(dim=-1)


def plot_decay(probe: Probe, out: Path, formats: tuple[str, ...]) -> list[Path]:
    if probe.kind != "attention":
        raise Unmeasurable("absolute code (see the dot picture)")
    L = probe.length
    pos = torch.arange(L)
    s = probe.attention_scores(pos, pos, same_content=True).mean(dim=0)  # [H, L, L]
    offsets = torch.arange(-(L - 1), L)
    per_head = torch.stack(
        [torch.stack([torch.diagonal(s[h], offset=int(k)).mean() for k in offsets]) for h in range(s.shape[0])]
    )
    inv_freq = getattr(probe.enc, "inv_freq", None)
    has_bound = isinstance(inv_freq, Tensor) and inv_freq.numel() > 0 and "rotate" in probe.hooks
    fig = _figure(5.5 if not has_bound else 9.0, 3.6, left=0.1 if not has_bound else 0.07, wspace=0.25)
    axes = fig.subplots(1, 2 if has_bound else 1, squeeze=False)[0]
    ax = axes[0]
    for h in range(per_head.shape[0]):
        ax.plot(offsets.numpy(), per_head[h].numpy(), lw=0.8, alpha=0.6, label=f"head {h}" if h < 8 else None)
    ax.plot(offsets.numpy(), per_head.mean(0).numpy(), color="k", lw=1.6, label="mean")
    ax.set_xlabel("offset j - i")
    ax.set_ylabel("mean score (q = k content)")
    ax.set_title(_title(probe, "score against offset"), fontsize=10)
    ax.legend(fontsize=6, ncol=2)
    if has_bound:
        assert isinstance(inv_freq, Tensor)
        k, bound = roformer_bound(inv_freq, max(4 * L, 256))
        ax2 = axes[1]
        ax2.plot(k.numpy(), bound.numpy(), color="tab:orange")
        ax2.set_xlabel("relative distance")
        ax2.set_ylabel("relative upper bound")
        ax2.set_title(f"RoFormer long-term decay (d = {2 * inv_freq.numel()})", fontsize=10)
    return _save(fig, out, "decay", formats)


def plot_phase(probe: Probe, out: Path, formats: tuple[str, ...]) -> list[Path]:
    phase = getattr(probe.enc, "phase", None)
    if not callable(phase):
        raise Unmeasurable("no phase")
    L = probe.length
    tokens = torch.zeros(1, L, dtype=torch.long)
    with torch.no_grad():
        phi = phase(tokens, torch.arange(L)[None])[0].double()  # [L, D]
    dims = [0, 1, phi.shape[-1] // 4, phi.shape[-1] // 2]
    fig = _figure(9.0, 3.8, left=0.02, top=0.85, wspace=0.1)
    ax1, ax2 = fig.subplots(1, 2)
    t = torch.arange(L).numpy()
    for i, d in enumerate(dims):
        z = torch.polar(torch.ones(L, dtype=torch.float64), phi[:, d])
        r = 1.0 - 0.15 * i
        ax1.scatter(r * z.real.numpy(), r * z.imag.numpy(), c=t, s=6, cmap="viridis")
        ax2.plot(t, torch.remainder(phi[:, d] + math.pi, 2 * math.pi).numpy() - math.pi, ".", ms=2, label=f"dim {d}")
    ax1.set_aspect("equal")
    ax1.set_title("e^{i(ω pos + θ)} of word 0 (rings: dims; colour: position)", fontsize=8)
    ax1.axis("off")
    ax2.set_xlabel("position")
    ax2.set_ylabel("phase (wrapped)")
    ax2.legend(fontsize=7)
    fig.suptitle(_title(probe, "complex-order phase"), fontsize=10)
    return _save(fig, out, "phase", formats)


PLOTS: dict[str, Callable[[Probe, Path, tuple[str, ...]], list[Path]]] = {
    "code": plot_code,
    "dot": plot_dot,
    "scores": plot_scores,
    "buckets": plot_buckets,
    "decay": plot_decay,
    "phase": plot_phase,
}


def plot(
    encoding: str | PositionalEncoding | Probe,
    out: str | Path,
    *,
    dim: int = 64,
    length: int = 128,
    heads: int = 4,
    options: dict[str, Any] | None = None,
    pictures: tuple[str, ...] | None = None,
    formats: tuple[str, ...] = FORMATS,
) -> dict[str, list[Path] | str]:
    """Draw the pictures that apply to ``encoding`` into ``out``.

    Returns ``{picture: [paths]}`` for the pictures drawn and ``{picture: "n/a (reason)"}`` for the
    ones that do not apply or failed; never raises for an encoding that builds.
    """
    check_settings(dim, length, heads)
    bad = [f for f in formats if f not in FORMATS]
    if bad:
        raise ConfigError(f"unknown image formats {bad}; use some of {FORMATS}")
    names = PICTURES if pictures is None else pictures
    unknown = [p for p in names if p not in PLOTS]
    if unknown:
        raise ConfigError(f"unknown pictures {unknown}; known: {', '.join(PICTURES)}")
    out = Path(out)
    result: dict[str, list[Path] | str] = {}
    with single_thread():
        if isinstance(encoding, Probe):
            probe = encoding
        else:
            try:
                probe = Probe(encoding, dim=dim, length=length, heads=heads, options=options)
            except Exception as e:
                return {p: f"n/a (cannot build: {_short(e)})" for p in names}
        for p in names:
            try:
                result[p] = PLOTS[p](probe, out, formats)
            except Unmeasurable as e:
                result[p] = f"n/a ({e})"
            except Exception as e:
                result[p] = f"n/a ({_short(e)})"
    return result
