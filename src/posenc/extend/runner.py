"""``posenc extend``: stretch a real pretrained model's context with each RoPE scaling, measured on real text.

One run is a list of **cells**, each a forward of its own, stored as one JSON line the moment it finishes
(``<out>/extend.jsonl``), so that an interrupted run loses at most the cell in progress and the next run
resumes from the store:

* a **loss cell** ``(document, scaling, tokens)``: the per-token losses of the document's first ``tokens``
  tokens in one chunked forward (:func:`~posenc.extend.evaluate.token_losses`), kept as means over bins of
  :data:`BIN` tokens; the perplexity of every prefix length follows from them;
* a **passkey cell** ``(scaling, length, depth)``: one passkey example (:func:`~posenc.extend.evaluate.passkey_ids`)
  with a key drawn from ``(seed, length, depth)``, scored by :func:`~posenc.extend.evaluate.passkey_score`.

A **scaling** is ``"as-trained"`` (the model untouched) or a RoPE scaling patched in with
:func:`posenc.hf.patch`, no fine-tuning: ``rope-linear`` (position interpolation, Chen et al. 2023),
``rope-ntk`` (NTK-aware, bloc97 2023), ``rope-dynamic`` (dynamic NTK), ``rope-yarn`` (Peng et al. 2023),
``rope-llama3`` (Meta's Llama 3.1 scaling) and ``rope-longrope`` (Ding et al. 2024). Each takes the model's own
``rope_theta`` and its trained length ``L`` as ``original_max_len``; ``factor`` is the extension the cell family
aims at (loss cells: the loss extension, 4 by default; passkey cells: the longest passkey length over ``L``).
LongRoPE's per-pair factors come from an evolutionary search per model, which posenc does not run: here its
long set is YaRN's per-pair factors for the same ``factor`` and its short set is 1 (the model as trained
within ``L``), with LongRoPE's own switch at ``L`` and attention factor ``sqrt(1 + ln s / ln L)`` -- the
mechanism without the search, and said so wherever it is shown.

Every record keeps the model's identity (its file's SHA-256: :func:`posenc.pretrained.identity`), the
document's (its text's SHA-256 and token count) and the environment (:func:`posenc.runenv.run_environment`);
a store holding cells of another model or another document text is refused rather than mixed.

A **variant** (:class:`Variant`) is a scaling measured under a name of its own: LongRoPE with the factors of its
search (``rope-longrope-searched``, ``posenc extend --longrope-search``), or a fine-tuned model
(``rope-yarn+ft400``, ``posenc extend --finetune``, run with that model). Its cells sit in the same store beside
the training-free ones, at the variant's own factor only; each record keeps what the variant is (its options, the
search's or the fine-tune's settings), and a store holding cells of that name from another search or fine-tune is
refused rather than mixed.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError
from .config import (
    AS_TRAINED,
    BIN,
    CHUNK,
    DOCUMENTS,
    FULL,
    LABELS,
    QUICK,
    SCALINGS,
    STORE,
    WHOLE_BYTES,
    ExtendConfig,
    base_scaling,
    loss_lengths,
)
from .evaluate import passkey_ids, passkey_score, random_key, token_losses
from .store_checks import _jsonable, check_store, check_variants

__all__ = ["AS_TRAINED", "BIN", "DOCUMENTS", "FULL", "LABELS", "QUICK", "SCALINGS", "STORE", "ExtendConfig"]

# ---------------------------------------------------------------------------------------------- documents
def document_ids(name: str, tokenizer: Any, tokens: int) -> tuple[torch.Tensor, dict[str, Any]]:
    """The first ``tokens`` token ids of document ``name`` and what it is (its text's SHA-256, its length)."""
    if name not in DOCUMENTS:
        raise ConfigError(f"unknown document {name!r}; the documents are {', '.join(DOCUMENTS)}")
    what, load = DOCUMENTS[name]
    text = load()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < tokens:
        raise ConfigError(
            f"the document {name!r} has {len(ids)} tokens with this tokenizer, fewer than the {tokens} asked for; "
            "ask for a shorter extension or another document"
        )
    info = {"document": name, "about": what, "text_sha256": hashlib.sha256(text.encode()).hexdigest(),
            "document_tokens": len(ids)}
    return torch.tensor(ids[:tokens], dtype=torch.long), info


# ---------------------------------------------------------------------------------------------- scalings
def yarn_pair_factors(head_dim: int, base: float, factor: float, original: int) -> list[float]:
    """YaRN's per-pair interpolation factors ``theta_i / theta_i'`` for these settings (1 for the fast pairs,
    ``factor`` for the slow ones, a ramp between): LongRoPE's long set here (see the module's text)."""
    from ..rotary.rope import RoPE
    from ..rotary.scaling import RoPEYaRN

    plain = RoPE(head_dim, base=base).inv_freq.double()
    yarn = RoPEYaRN(head_dim, factor=factor, original_max_len=original, base=base).inv_freq.double()
    return [float(x) for x in (plain / yarn)]


def scaling_options(name: str, model: nn.Module, factor: float) -> dict[str, Any]:
    """The options :func:`posenc.hf.patch` gets for scaling ``name`` at ``factor`` on ``model`` (its own base
    and trained length are filled in by the patch)."""
    if name not in SCALINGS:
        raise ConfigError(f"unknown scaling {name!r}; the scalings are {AS_TRAINED}, {', '.join(SCALINGS)}")
    if name != "rope-longrope":
        return {"factor": float(factor)}
    cfg = model.config
    params = getattr(cfg, "rope_parameters", None) or {}
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    original = int(params.get("original_max_position_embeddings") or cfg.max_position_embeddings)
    long = yarn_pair_factors(head_dim, float(params.get("rope_theta", 10000.0)), factor, original)
    return {"factor": float(factor), "short_factor": [1.0] * len(long), "long_factor": long}


def apply_scaling(model: nn.Module, name: str, factor: float) -> dict[str, Any]:
    """Put ``model`` in scaling ``name`` (``"as-trained"``: no patch); returns the options recorded."""
    import posenc.hf

    posenc.hf.unpatch(model)
    if name == AS_TRAINED:
        return {}
    opts = scaling_options(name, model, factor)
    posenc.hf.patch(model, name, **opts)
    return {"factor": opts["factor"]} if name == "rope-longrope" else opts


@dataclass(frozen=True)
class Variant:
    """Cells measured under a name of their own (:func:`posenc.extend.config.base_scaling`): the model patched with
    ``base`` and every option of ``options`` (LongRoPE's searched per-pair factors, a fine-tune's options), at
    ``factor`` only. ``about``: what tells these cells apart from those of another search or fine-tune of the same
    name (their settings), kept in every record; :func:`run` refuses a store whose cells of this name have
    another."""

    name: str
    base: str
    options: dict[str, Any]
    factor: float
    about: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if base_scaling(self.name) != self.base or self.base not in SCALINGS:
            raise ConfigError(
                f"Variant {self.name!r}: its name says it is patched with {base_scaling(self.name)}, not "
                f"{self.base!r} (names: rope-longrope-searched, <scaling>+ft<steps>[-lora])"
            )

    def record(self) -> dict[str, Any]:
        """What a cell's record keeps of the variant (JSON values)."""
        return _jsonable({"base": self.base, "factor": self.factor, "options": self.options, "about": self.about})

    def apply(self, model: nn.Module) -> dict[str, Any]:
        """Patch ``model`` with the variant; returns the options a record shows (LongRoPE's factor alone: its
        per-pair factors are in :meth:`record`)."""
        import posenc.hf

        posenc.hf.unpatch(model)
        opts = {**self.options, "factor": self.factor}
        posenc.hf.patch(model, self.base, **opts)
        return {"factor": self.factor} if self.base == "rope-longrope" else _jsonable(opts)


def length_dependent(scaling: str) -> bool:
    """Whether the scaling's frequencies depend on the length of the call (dynamic NTK, LongRoPE): such a cell
    runs one whole forward, not a chunked one (:mod:`posenc.extend.evaluate`)."""
    scaling = base_scaling(scaling) or scaling
    if scaling == AS_TRAINED:
        return False
    from ..registry import resolve

    return bool(getattr(resolve(scaling), "length_dependent", False))


def forward_bytes(model: nn.Module, tokens: int) -> int:
    """About the activations one whole forward of ``tokens`` takes (float32): a layer's widest tensors (the MLP's
    gate, up and product; q, k, v, the attention output and the residual) and the cache's keys and values of every
    layer. SDPA's flash kernel makes no ``[L, L]`` tensor, and the output layer runs a slice at a time."""
    cfg = model.config
    hidden = int(cfg.hidden_size)
    inter = int(getattr(cfg, "intermediate_size", 4 * hidden) or 4 * hidden)
    layers = int(getattr(cfg, "num_hidden_layers", 1))
    heads = int(cfg.num_attention_heads)
    kv = int(getattr(cfg, "num_key_value_heads", heads) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or hidden // heads)
    per_token = 3 * inter + 6 * hidden + 2 * layers * kv * head_dim
    return 4 * tokens * per_token


def choose_chunk(chunk: int | None, model: nn.Module, tokens: int) -> int | None:
    """``chunk`` where one is asked for; else one whole forward (``None``) where its activations fit in
    :data:`~posenc.extend.config.WHOLE_BYTES` (faster: SDPA's causal kernel skips the masked half, where a chunk
    against the cache passes a mask), else :data:`~posenc.extend.config.CHUNK`."""
    if chunk is not None:
        return chunk
    return None if forward_bytes(model, tokens) <= WHOLE_BYTES else CHUNK


def trained_length(model: nn.Module | Any) -> int:
    """The context the model was trained at (``original_max_position_embeddings`` where a scaling is stored, else
    ``max_position_embeddings``), of a model or of its config."""
    cfg = getattr(model, "config", model)
    params = getattr(cfg, "rope_parameters", None) or {}
    return int(params.get("original_max_position_embeddings") or cfg.max_position_embeddings)


# ---------------------------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class Cell:
    """One stored measurement. A RULER cell of the table (task, scaling, length) is several of these, one a
    haystack (``haystack`` = 0, 1, ...): each is stored as it finishes, so a run resumes per prefill."""

    kind: str  # "loss" | "passkey" | "ruler"
    scaling: str
    factor: float
    document: str = ""
    tokens: int = 0
    depth: float = 0.0
    task: str = ""
    haystack: int = 0
    questions: int = 0
    seed: int = 0
    #: a RULER length that runs only where the model as trained is not at the floor on the task inside L
    unless_floor: bool = False
    #: a RULER cell's prompt template (posenc.extend.ruler.TEMPLATE_MODES)
    template: str = "auto"

    def key(self) -> str:
        if self.kind == "loss":
            return f"loss|{self.document}|{self.scaling}|{self.factor:g}|{self.tokens}"
        if self.kind == "ruler":
            # p2: RULER's protocol (posenc 0.x, issue 45); the stored records of the older protocol have no p2
            return (f"ruler|p2|{self.task}|{self.scaling}|{self.factor:g}|{self.tokens}|h{self.haystack}"
                    f"|q{self.questions}|s{self.seed}|t{self.template}")
        return f"passkey|{self.scaling}|{self.factor:g}|{self.tokens}|{self.depth:g}"

    def describe(self) -> str:
        if self.kind == "ruler":
            scale = self.scaling if self.scaling == AS_TRAINED else f"{self.scaling} x{self.factor:g}"
            return f"RULER {self.task}, {self.tokens} tokens, {scale}, haystack {self.haystack + 1}"
        what = f"loss on {self.document}" if self.kind == "loss" else f"passkey at depth {self.depth:g}"
        scale = self.scaling if self.scaling == AS_TRAINED else f"{self.scaling} x{self.factor:g}"
        return f"{what}, {self.tokens} tokens, {scale}"


def plan(cfg: ExtendConfig, trained: int) -> list[Cell]:
    """The cells of ``cfg`` for a model trained at ``trained`` tokens, in the order they run: every loss curve
    of the first document first (the picture that matters most), then the passkey grid (by scaling, the
    shortest lengths first), then the other documents."""
    for s in (*cfg.scalings, *cfg.passkey_scalings):
        if base_scaling(s) is None:
            raise ConfigError(f"unknown scaling {s!r}; the scalings are {AS_TRAINED}, {', '.join(SCALINGS)}")
    for d in cfg.documents:
        if d not in DOCUMENTS:
            raise ConfigError(f"unknown document {d!r}; the documents are {', '.join(DOCUMENTS)}")
    if cfg.loss_extension <= 0 or cfg.loss_short <= 0:
        raise ConfigError("the loss extension is a positive multiple of the trained length")
    for d in cfg.passkey_depths:
        if not 0 <= d <= 1:
            raise ConfigError(f"a passkey depth is in [0, 1], got {d}")

    def loss_cells(doc: str) -> list[Cell]:
        out = []
        for mult in sorted({m for s in cfg.scalings for m in loss_lengths(cfg, s)}):  # the shorter curves first
            for s in cfg.scalings:
                if mult in loss_lengths(cfg, s):
                    factor = 1.0 if s == AS_TRAINED else max(1.0, float(mult))
                    out.append(Cell("loss", s, factor, document=doc, tokens=int(mult * trained)))
        return out

    cells = loss_cells(cfg.documents[0]) if cfg.documents else []
    pf = cfg.passkey_factor()
    for s in cfg.passkey_scalings:
        for mult in sorted(cfg.passkey_lengths):
            for depth in cfg.passkey_depths:
                factor = 1.0 if s == AS_TRAINED else pf
                cells.append(Cell("passkey", s, factor, tokens=int(mult * trained), depth=depth))
    for doc in cfg.documents[1:]:
        cells += loss_cells(doc)
    cells += ruler_cells(cfg, trained)
    return cells


def ruler_cells(cfg: ExtendConfig, trained: int) -> list[Cell]:
    """RULER's cells: by length (the shortest first, so that the floor inside L is known before the longer
    lengths), then by haystack (every task and scaling's first haystack before any second one: an interrupted run
    has them all), then task and scaling. ``ruler_floor_lengths`` come last, marked :attr:`Cell.unless_floor`."""
    from .config import LENGTH_MOST, RULER_MULTI, RULER_TASKS, ruler_grid, ruler_haystacks

    for t in cfg.ruler_tasks:
        if t not in RULER_TASKS:
            raise ConfigError(f"unknown RULER task {t!r}; the tasks are {', '.join(RULER_TASKS)}")
    grid = ruler_grid(cfg, trained)
    most = int(LENGTH_MOST * trained)
    for n in sorted({n for n, *_ in grid}):
        if n > most:
            raise ConfigError(
                f"--ruler-lengths: {n} tokens is more than {LENGTH_MOST:g} x the trained length {trained} ({most}): "
                "its KV cache and prefill would not fit a CPU run; give shorter lengths"
            )
    factor = cfg.ruler_factor(trained)
    out = []
    for tokens, floor in dict.fromkeys((m, f) for m, f, _, _ in grid):
        for h in range(max(ruler_haystacks(cfg, t, m, trained) for m, f, t, _ in grid if (m, f) == (tokens, floor))):
            for m, f, task, s in grid:
                if (m, f) == (tokens, floor) and h < ruler_haystacks(cfg, task, m, trained):
                    out.append(Cell("ruler", s, 1.0 if s == AS_TRAINED else factor, tokens=tokens,
                                    task=task, haystack=h, seed=cfg.seed,
                                    questions=cfg.ruler_questions if task in RULER_MULTI else 1,
                                    unless_floor=floor, template=cfg.ruler_template))
    return out


# ---------------------------------------------------------------------------------------------- the store
class Store:
    """The cells already measured: one JSON object a line in ``<out>/extend.jsonl``, appended and flushed
    as each cell finishes."""

    def __init__(self, out: str | os.PathLike):
        self.dir = Path(out)
        self.path = self.dir / STORE

    def records(self) -> list[dict[str, Any]]:
        """The stored cells. A line that is not a whole cell record (cut by an interrupted write, damaged, not
        UTF-8, JSON of another shape) is left out with one line on stderr that says which and why: its cell is
        measured again; it is never read as a cell (of "another model", or none)."""
        if not self.path.is_file():
            return []
        out = []
        for i, raw in enumerate(self.path.read_bytes().splitlines(), 1):
            if not raw.strip():
                continue
            why = ""
            try:
                rec = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                why = "not UTF-8 text"
            except json.JSONDecodeError:
                # a line cut by an interrupted write: it was never finished, so it is redone
                why = "not whole JSON (an interrupted write?)"
            else:
                if not isinstance(rec, dict) or not isinstance(rec.get("key"), str):
                    why = f"JSON but not a cell record (it has no 'key': {raw[:60].decode('utf-8', 'replace')!r})"
                elif not isinstance(rec.get("model"), dict):
                    why = "a cell record without its model's identity ('model')"
                else:
                    out.append(rec)
            if why:
                print(f"posenc extend: ignoring line {i} of {self.path}: {why}; its cell is measured again",
                      file=sys.stderr)
        return out

    def add(self, record: dict[str, Any]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        text = self.path.read_text() if self.path.is_file() else ""
        with open(self.path, "a") as f:
            if text and not text.endswith("\n"):
                f.write("\n")  # after an interrupted write: the broken line stays alone on its line
            f.write(json.dumps(record, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())


def _binned(losses: torch.Tensor) -> list[float]:
    n = losses.numel()
    out = []
    for s in range(0, n, BIN):
        out.append(round(float(losses[s : s + BIN].double().mean()), 5))
    return out


# ---------------------------------------------------------------------------------------------- running
@dataclass
class Progress:
    """One line per cell, a line per prefill chunk and per batch of questions inside a cell (to stderr), with the
    time left from the first chunk on: the seconds per unit of work so far (:func:`cell_work`: a chunk from token
    ``a`` to ``b`` is ``(b - a) / L + (b^2 - a^2) / L^2``) times the work left."""

    total: int
    quiet: bool = False
    done: int = 0
    started: float = field(default_factory=time.perf_counter)
    spent: float = 0.0  # seconds of the cells run in this process
    ran: int = 0
    work: float = 0.0  # their cell_work
    trained: int = 1
    left: float = 0.0  # the work of the cells not yet finished (less what their chunks did)
    chunk_spent: float = 0.0  # seconds and work of the chunks measured (the pace before the first cell ends)
    chunk_work: float = 0.0

    def say(self, text: str) -> None:
        if not self.quiet:
            print(text, file=sys.stderr, flush=True)

    def eta(self) -> str:
        spent, work = (self.spent, self.work) if self.ran else (self.chunk_spent, self.chunk_work)
        if work <= 0:
            return ""
        return f", about {_fmt(spent / work * max(self.left, 0.0))} left in the run at this pace"

    def chunk(self, cell: Cell) -> Callable[[int, int], None]:
        t0 = time.perf_counter()
        last = [t0, 0]

        def report(done: int, total: int) -> None:
            now = time.perf_counter()
            a, b, n = last[1], done, self.trained
            w = (b - a) / n + (b * b - a * a) / (n * n)
            self.chunk_spent += now - last[0]
            self.chunk_work += w
            self.left -= w
            last[0], last[1] = now, done
            if done < total:
                rate = done / max(now - t0, 1e-9)
                self.say(f"    {done:>6}/{total} tokens ({rate:.0f} tokens/s){self.eta()}")

        return report

    def ruler(self, cell: Cell) -> Callable[[str, int, int], None]:
        """The progress of a RULER haystack: prefill chunks as :meth:`chunk`, then each batch of questions."""
        prefill = self.chunk(cell)
        t0 = [time.perf_counter()]
        x = cell.tokens / max(self.trained, 1)
        asking = max(cell_work(cell, self.trained) - x - x * x, 0.0)  # the questions' share of the work
        last = [time.perf_counter(), 0]

        def report(what: str, done: int, total: int) -> None:
            if what == "prefill":
                prefill(done, total)
                if done == total:
                    t0[0] = last[0] = time.perf_counter()
                    self.say(f"    prefilled {total} tokens; asking {cell.task}'s question(s)")
                return
            now = time.perf_counter()
            w = asking * (done - last[1]) / max(total, 1)
            self.chunk_spent += now - last[0]
            self.chunk_work += w
            self.left -= w
            last[0], last[1] = now, done
            self.say(f"    question {done}/{total} ({now - t0[0]:.0f} s){self.eta()}")

        return report


def run(
    cfg: ExtendConfig,
    out: str | os.PathLike,
    *,
    model: nn.Module | None = None,
    tokenizer: Any = None,
    quiet: bool = False,
    max_cells: int | None = None,
    variants: Sequence[Variant] = (),
) -> list[dict[str, Any]]:
    """Measure every cell of ``cfg`` not yet in ``<out>/extend.jsonl``; returns all of the store's records.

    ``model`` / ``tokenizer``: a loaded model (else ``cfg.model`` is loaded with
    :func:`posenc.pretrained.load_pretrained`). ``max_cells``: stop after that many new cells (a budget).
    ``variants``: how to patch the cells of ``cfg`` named by a :class:`Variant` (every such name needs one; its
    cells must be at its factor). The store may hold cells of another model made from the same pretrained file (a
    fine-tuned one's, measured by another call with that model); the cells of the names ``cfg`` measures must be of
    this ``model`` and these variants.
    """
    from ..pretrained import identity, load_pretrained
    from ..runenv import run_environment

    if model is not None and tokenizer is None:
        raise ConfigError(
            "posenc.extend.run(model=...) needs tokenizer= as well (the model's own tokenizer, e.g. "
            "transformers.AutoTokenizer.from_pretrained(...)); or give neither and cfg.model is loaded with both"
        )
    store = Store(out)
    have = store.records()
    checked = None
    if model is None:
        from ..pretrained import load_tokenizer

        cheap = load_tokenizer(cfg.model)
        if cheap is not None:  # the tasks against the lengths before the weights load
            checked = check_lengths(cfg, cheap[0], trained_length(cheap[1]), resumed=bool(have))
        model, tokenizer = load_pretrained(cfg.model, quiet=quiet)
    ident = identity(model)
    trained = trained_length(model)
    by_name = {v.name: v for v in variants}
    cells, unbuildable = checked if checked is not None else check_lengths(cfg, tokenizer, trained, bool(have))
    check_variants(cells, by_name)
    check_store(have, ident, {c.scaling for c in cells}, by_name, store.path)
    done = {r["key"] for r in have}
    todo = [c for c in cells if c.key() not in done]
    progress = Progress(len(cells), quiet=quiet, done=len(cells) - len(todo), trained=trained,
                        left=sum(cell_work(c, trained) for c in todo))
    progress.say(
        f"posenc extend: {ident.get('name')} (trained context {trained}); {len(cells)} cells, "
        f"{len(cells) - len(todo)} already in {store.path}, {len(todo)} to run"
    )
    env = run_environment()
    docs: dict[tuple[str, int], tuple[torch.Tensor, dict[str, Any]]] = {}
    rng_base = cfg.seed
    for i, cell in enumerate(todo):
        if max_cells is not None and i >= max_cells:
            progress.say(f"posenc extend: stopped after {max_cells} new cells (--max-cells); run again to go on")
            break
        eta = ""
        if progress.ran:  # seconds per unit of work so far, times the work left (a 32k cell is ~10 8k ones)
            per = progress.spent / max(progress.work, 1e-9)
            left = work_left(todo[i:], store, trained)
            eta = f", about {_fmt(per * left)} left at this pace"
        if cell.unless_floor:
            floor = floor_tasks(store.records(), trained)
            if cell.task in floor:
                progress.say(f"[{progress.done + 1}/{len(cells)}] {cell.describe()}: cut, the model as trained is "
                             f"at the floor on {cell.task} inside L ({floor[cell.task]})")
                progress.done += 1
                progress.left -= cell_work(cell, trained)
                continue
        if cell.kind == "ruler" and (cell.task, cell.tokens) in unbuildable:
            progress.say(f"[{progress.done + 1}/{len(cells)}] {cell.describe()}: skipped, "
                         f"{unbuildable[cell.task, cell.tokens]}")
            progress.done += 1
            progress.left -= cell_work(cell, trained)
            continue
        progress.say(f"[{progress.done + 1}/{len(cells)}] {cell.describe()}{eta}")
        t0 = time.perf_counter()
        load0 = _load_average()
        variant = by_name.get(cell.scaling)
        options = variant.apply(model) if variant else apply_scaling(model, cell.scaling, cell.factor)
        chunk = None if length_dependent(cell.scaling) else choose_chunk(cfg.chunk, model, cell.tokens)
        if cell.kind == "ruler" and chunk is None and not length_dependent(cell.scaling):
            chunk = RULER_CHUNK  # a line per chunk: progress within seconds, and the cache is filled anyway
        record: dict[str, Any] = {
            "key": cell.key(),
            "kind": cell.kind,
            "scaling": cell.scaling,
            "factor": cell.factor,
            "options": options,
            "tokens": cell.tokens,
            "trained_length": trained,
            "chunk": chunk,
            "forward": "whole" if chunk is None else "chunked",
            "mode": cfg.mode,
            "model": ident,
        }
        if variant is not None:
            record["variant"] = variant.record()
        try:
            if cell.kind == "loss":
                key = (cell.document, cell.tokens)
                if key not in docs:
                    docs.clear()
                    docs[key] = document_ids(cell.document, tokenizer, cell.tokens)
                ids, info = docs[key]
                losses = token_losses(model, ids, chunk=chunk, progress=progress.chunk(cell))
                record.update(info, bin=BIN, loss_bins=_binned(losses), mean_loss=float(losses.double().mean()))
            elif cell.kind == "ruler":
                record.update(ruler_record(model, tokenizer, cell, chunk, progress))
            else:
                rng = random.Random(f"{rng_base}|{cell.tokens}|{cell.depth:g}")
                key_ = random_key(rng)
                prompt = passkey_ids(tokenizer, cell.tokens, cell.depth, key_)
                record.update(depth=cell.depth, key_digits=key_, key_at=prompt.key_at, seed=cfg.seed)
                record.update(passkey_score(model, prompt, chunk=chunk, progress=progress.chunk(cell)))
        finally:
            import posenc.hf

            posenc.hf.unpatch(model)
        seconds = time.perf_counter() - t0
        # the machine's load around the cell: its seconds mean little on a shared machine without it
        record.update(seconds=round(seconds, 2), finished=time.time(), env=env, load_average=[load0, _load_average()])
        store.add(record)
        progress.done += 1
        progress.ran += 1
        progress.spent += seconds
        progress.work += cell_work(cell, trained)
        progress.left = work_left(todo[i + 1 :], store, trained)
        if cell.kind == "loss":
            tail = f"ppl {math.exp(record['mean_loss']):.2f}"
        elif cell.kind == "ruler":
            tail = f"score {record['score']:.0%} over {len(record['answers'])} question(s)"
        else:
            tail = ("retrieved" if record["correct"] else "missed") + f" ({record['tokens_right']:.0%} of the key)"
        progress.say(f"    done in {_fmt(seconds)}: {tail}")
    return store.records()


def work_left(cells: Sequence[Cell], store: Store, trained: int) -> float:
    """The work of ``cells`` (:func:`cell_work`) less the cells that will be cut: those that run unless the model as
    trained is at the floor, of a task it is at the floor on in the store now."""
    floor = floor_tasks(store.records(), trained) if any(c.unless_floor for c in cells) else {}
    return sum(cell_work(c, trained) for c in cells if not (c.unless_floor and c.task in floor))


def cell_work(cell: Cell, trained: int) -> float:
    """What a cell costs, in units of one forward of ``trained`` tokens' linear layers: ``n / L`` for the layers
    plus ``(n / L)^2`` for the attention (as measured on SmolLM2: 45 s at 8k, 136 s at 16k, 488 s at 32k); a RULER
    haystack adds its questions' decoding steps at :data:`DECODE_WORK` each."""
    x = cell.tokens / max(trained, 1)
    if cell.kind == "ruler":
        from .config import RULER_MULTI

        steps = RULER_STEPS.get(cell.task, 60) * (cell.questions if cell.task in RULER_MULTI else 1)
        return x + x * x + steps * DECODE_WORK * (1 + x)
    return x + x * x


#: tokens a prefill chunk of a RULER haystack (a line each: the first within seconds)
RULER_CHUNK = 1024
#: a decoding step in units of one forward of L tokens, times ``1 + n / L`` (the cache grows); SmolLM2 on 2 busy
#: cores: a question of niah_multikey_3 at 2k (about 50 steps) took as long as a 2k prefill, 0.3 units
DECODE_WORK = 0.002
#: about the steps of one question (its ids and the answer generated)
RULER_STEPS = {"niah_single_1": 45, "niah_multikey_2": 45, "niah_multikey_3": 120, "vt": 80, "cwe": 150, "fwe": 90}


def check_lengths(
    cfg: ExtendConfig, tokenizer: Any, trained: int, resumed: bool
) -> tuple[list[Cell], dict[tuple[str, int], str]]:
    """The plan's cells and its RULER cells too short for their task (:func:`ruler_too_short`), checked before any
    cell runs and, where the tokenizer loads without the weights, before the model loads: a passkey length too short
    for a passkey prompt is a :class:`ConfigError` naming ``--passkey-lengths``."""
    cells = plan(cfg, trained)
    shortest = min((c for c in cells if c.kind == "passkey"), key=lambda c: c.tokens, default=None)
    if shortest is not None:
        try:
            passkey_ids(tokenizer, shortest.tokens, 0.5, "12345")
        except ConfigError as err:
            raise ConfigError(
                f"passkey lengths: {min(cfg.passkey_lengths):g} x the trained length {trained} is {shortest.tokens} "
                f"tokens, too short ({err}); give longer --passkey-lengths"
            ) from None
    return cells, ruler_too_short(cells, tokenizer, trained, resumed=resumed)


def ruler_too_short(cells: Sequence[Cell], tokenizer: Any, trained: int, resumed: bool) -> dict[tuple[str, int], str]:
    """The RULER cells' ``(task, tokens)`` too short for their task with this tokenizer, each with why, checked
    before any cell runs (one haystack built per pair, no forward). A fresh run stops on them with an error that
    names ``--ruler-lengths``; a resumed one (``resumed``: the store holds cells) skips them, saying so when it
    reaches them, so that it goes past a task it cannot build instead of stopping there on every resume."""
    from . import ruler

    bad: dict[tuple[str, int], str] = {}
    pairs = {(c.task, c.tokens): (c.questions, c.template) for c in cells if c.kind == "ruler"}
    built: set[str] = set()  # a task built at a length builds at every longer one: those are not tried
    for (task, tokens), (questions, template) in sorted(pairs.items(), key=lambda x: x[0][1]):
        if task in built:
            continue
        try:
            ruler.build(task, tokenizer, tokens, seed=0, questions=max(questions, 1), template=template)
            built.add(task)
        except ConfigError as err:
            bad[task, tokens] = (
                f"{tokens / trained:g} x the trained length {trained} is {tokens} tokens, too short for {task} "
                f"({err}); give longer --ruler-lengths (ExtendConfig.ruler_lengths) or leave {task} out of --tasks"
            )
    if bad and not resumed:
        raise ConfigError("RULER: " + "; ".join(bad.values()))
    return bad


def ruler_record(model: nn.Module, tokenizer: Any, cell: Cell, chunk: int | None, progress: Progress) -> dict[str, Any]:
    """One RULER haystack of ``cell``: built for the tokenizer, prefilled once, every question asked."""
    from . import ruler

    ex = ruler.build(cell.task, tokenizer, cell.tokens, seed=cell.seed * 100_003 + cell.haystack,
                     questions=cell.questions, template=cell.template)
    answers = ruler.ask(model, tokenizer, ex, chunk=chunk, progress=progress.ruler(cell))
    return {
        "task": cell.task,
        "haystack": cell.haystack,
        "seed": cell.seed,
        "protocol": "ruler",  # RULER's protocol (issue 45); records without it were built the older way
        "template": ex.info["template"],
        "generate": ex.generate,
        "context_tokens": len(ex.context),
        "example": ex.info,
        "answers": answers,
        "score": sum(a["score"] for a in answers) / len(answers),
    }


def floor_tasks(records: Sequence[dict[str, Any]], trained: int) -> dict[str, str]:
    """The RULER tasks the model as trained is at the floor on inside L (:func:`posenc.extend.report.floor_tasks`)."""
    from .ruler_report import floor_tasks as floor

    return floor(records, trained)


def _load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def _fmt(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60} min"


def cells_of(records: Sequence[dict[str, Any]], kind: str) -> Iterator[dict[str, Any]]:
    return (r for r in records if r.get("kind") == kind)


def config_dict(cfg: ExtendConfig) -> dict[str, Any]:
    return asdict(cfg)
