"""Context extension *with* fine-tuning: patch a causal LM with a RoPE scaling, then train it at the extended length.

This is what the papers behind the scalings do after the patch (``posenc extend`` measures them without it):

* Chen et al. 2023, "Extending Context Window of Large Language Models via Positional Interpolation" (PI,
  ``rope-linear``): at most 1000 steps of next-token prediction at the extended length on the Pile (and PG-19),
  AdamW (beta1 = 0.9, beta2 = 0.95), learning rate 2e-5 (7B / 13B; 1e-5 for 33B / 65B), no weight decay, a linear
  warmup of 20 steps, global batch 64 (128 for the larger models).
* Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large Language Models" (``rope-yarn``): 400 steps,
  learning rate 2e-5, no weight decay, 20 warmup steps, AdamW (0.9, 0.95), global batch 64, on PG-19 chunks of the
  extended length.
* Ding et al. 2024, "LongRoPE" (``rope-longrope``): its searched factors (:mod:`posenc.extend.longrope_search`) are
  the initialisation that its fine-tuning starts from.

Those are the defaults here: ``lr=2e-5``, ``warmup=20``, ``betas=(0.9, 0.95)``, ``weight_decay=0``, a constant rate
after the warmup, ``tokens_per_step = 64 x length`` (the papers' batch of 64 sequences), reached by gradient
accumulation over sequences of ``length`` tokens. The papers' corpora do not ship offline; the text here does:
Shakespeare's 42 Gutenberg works (the ``shakespeare`` package) with the evaluation document held out of it (King
Lear by default), or any one document of :data:`posenc.extend.config.DOCUMENTS`.

A run with ``out`` writes, as it goes:

* ``<out>/finetune-curve.jsonl``: one JSON line a step (``step``, ``loss``, ``lr``, ``tokens``, ``seconds``; and
  ``eval_loss`` where the held-out document was scored: step 0 before training, then every ``eval_every`` steps and
  the last);
* ``<out>/finetune-state.pt`` every ``save_every`` steps (and the last): the trained parameters, the optimizer, the
  scheduler, the RNG states and the step, written whole then renamed, so that an interrupted run resumes from its
  last checkpoint and ends with the weights and losses an uninterrupted run has (the batches are a function of the
  step alone).

With ``torch.distributed`` initialised (gloo on CPU, NCCL on GPUs), every rank runs this same function: the
sequences of a step are dealt out across the ranks, the gradients summed, so that a step equals one process's step
with the same global batch; the trained parameters start from rank 0's (broadcast, as DistributedDataParallel
does; with LoRA the frozen weights must be the same on every rank, as a pretrained model loaded on each is); rank 0
alone writes the curve and the checkpoints.

``mode="lora"`` trains low-rank adapters (``peft``; the attention projections by default) instead of every weight,
and merges them into the model at the end, so that the fine-tuned model is a plain patched transformers model again:
:func:`posenc.hf.export` writes it as a folder that stock transformers loads with the scaling in its config.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..settings import number, positive_int, whole
from .config import DOCUMENTS, SCALINGS
from .finetune_state import (
    CHECKPOINT,
    CURVE,
    all_reduce,
    append_curve,
    barrier,
    broadcast,
    load_checkpoint,
    read_curve,
    save_checkpoint,
    set_rng_state,
    trainable,
    write_curve,
)
from .finetune_state import world as _world

__all__ = [
    "CHECKPOINT",
    "CURVE",
    "MODES",
    "SCHEDULES",
    "FinetuneResult",
    "FinetuneSettings",
    "add_finetune_arguments",
    "check_finetune_args",
    "finetune",
    "run_finetune",
    "settings_from_args",
]

MODES = ("full", "lora")
#: the rate after the warmup: ``constant`` (PI and YaRN), or decaying to 0 at the last step
SCHEDULES = ("constant", "linear", "cosine")
#: the training text made of every Shakespeare work except the evaluation document
SHAKESPEARE = "shakespeare"
#: the documents of :data:`DOCUMENTS` that are Shakespeare works (in the ``shakespeare`` text unless held out)
SHAKESPEARE_DOCUMENTS = ("hamlet", "lear")
#: the papers' global batch, in sequences of the extended length (PI and YaRN: 64)
PAPER_BATCH = 64
#: the modules that LoRA adapts by default (Llama-style attention projections)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


# ---------------------------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class FinetuneSettings:
    """What a fine-tuning run does; checked on construction (no torch needed), so that a bad value is said before a
    model loads. ``length`` / ``tokens_per_step`` ``None``: ``factor x`` the model's trained length, and
    :data:`PAPER_BATCH` sequences of it (filled in by :meth:`resolved`)."""

    scaling: str = "rope-yarn"
    factor: float = 4.0
    steps: int = 400
    length: int | None = None
    lr: float = 2e-5
    tokens_per_step: int | None = None
    micro_batch: int = 1
    warmup: int = 20
    schedule: str = "constant"
    mode: str = "full"
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_targets: tuple[str, ...] = LORA_TARGETS
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float | None = None
    text: str = SHAKESPEARE
    eval_text: str = "lear"
    eval_every: int = 0
    save_every: int = 50
    seed: int = 0

    def __post_init__(self) -> None:
        if self.scaling not in SCALINGS:
            raise ConfigError(_unknown("scaling", self.scaling, SCALINGS))
        number("factor", self.factor, low=1.0, why="the extension ratio over the trained length")
        positive_int("steps", self.steps)
        if self.length is not None:
            whole("length", self.length, low=2)
        number("lr", self.lr, low=0.0, low_open=True, why="the peak learning rate")
        if self.tokens_per_step is not None:
            positive_int("tokens_per_step", self.tokens_per_step)
            if self.length is not None and self.tokens_per_step % self.length:
                raise ConfigError(_multiple(self.tokens_per_step, self.length))
        positive_int("micro_batch", self.micro_batch)
        whole("warmup", self.warmup, low=0)
        if self.schedule not in SCHEDULES:
            raise ConfigError(_unknown("schedule", self.schedule, SCHEDULES))
        if self.mode not in MODES:
            raise ConfigError(_unknown("mode", self.mode, MODES))
        positive_int("lora_rank", self.lora_rank)
        number("lora_alpha", self.lora_alpha, low=0.0, low_open=True)
        number("lora_dropout", self.lora_dropout, low=0.0, high=1.0)
        if not self.lora_targets or not all(isinstance(t, str) and t for t in self.lora_targets):
            raise ConfigError(f"lora_targets must name the modules LoRA adapts, got {self.lora_targets!r}")
        number("weight_decay", self.weight_decay, low=0.0)
        if len(self.betas) != 2:
            raise ConfigError(f"betas must be two numbers (AdamW's beta1, beta2), got {self.betas!r}")
        for i, b in enumerate(self.betas):
            number(f"betas[{i}]", b, low=0.0, high=1.0)
        if self.grad_clip is not None:
            number("grad_clip", self.grad_clip, low=0.0, low_open=True, why="the gradient norm clipped to")
        if self.text != SHAKESPEARE and self.text not in DOCUMENTS:
            raise ConfigError(_unknown("text", self.text, (SHAKESPEARE, *DOCUMENTS)))
        if self.eval_text not in DOCUMENTS:
            raise ConfigError(_unknown("eval_text", self.eval_text, tuple(DOCUMENTS)))
        if self.text == self.eval_text:
            raise ConfigError(
                f"text and eval_text are both {self.text!r}: hold out a different document for the evaluation"
            )
        whole("eval_every", self.eval_every, low=0)
        positive_int("save_every", self.save_every)
        whole("seed", self.seed, low=0)

    def resolved(self, trained: int) -> FinetuneSettings:
        """These settings with ``length`` and ``tokens_per_step`` filled in for a model trained at ``trained``."""
        length = self.length if self.length is not None else int(round(self.factor * trained))
        tokens = self.tokens_per_step if self.tokens_per_step is not None else PAPER_BATCH * length
        if tokens % length:
            raise ConfigError(_multiple(tokens, length))
        return replace(self, length=length, tokens_per_step=tokens)

    @property
    def sequences(self) -> int:
        """Sequences of ``length`` tokens a step (the global batch)."""
        if self.length is None or self.tokens_per_step is None:
            raise ConfigError("FinetuneSettings.sequences needs length and tokens_per_step (see resolved)")
        return self.tokens_per_step // self.length

    def record(self) -> dict[str, Any]:
        """The settings as JSON values (what a checkpoint keeps and a resume compares)."""
        out = asdict(self)
        out["lora_targets"] = list(self.lora_targets)
        out["betas"] = list(self.betas)
        return out


def _unknown(what: str, value: object, names: Sequence[str]) -> str:
    import difflib

    close = difflib.get_close_matches(str(value), list(names), n=2, cutoff=0.5)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    return f"unknown {what} {value!r}{hint}; the choices are {', '.join(names)}"


def _multiple(tokens: int, length: int) -> str:
    low = max(length, tokens // length * length)
    return (
        f"tokens_per_step ({tokens}) must be a whole number of sequences of length {length} (gradient accumulation "
        f"over sequences): give {low} or {low + length}"
    )


# ---------------------------------------------------------------------------------------------- result
@dataclass
class FinetuneResult:
    """What :func:`finetune` returns: the fine-tuned model (still patched with the scaling; LoRA merged unless
    ``merge=False``), the loss curve (one dict a step, as in ``finetune-curve.jsonl``), the held-out loss before and
    after, the settings as run, and the step the run resumed from (0: a fresh start)."""

    model: Any
    curve: list[dict[str, Any]]
    settings: FinetuneSettings
    eval_before: float | None = None
    eval_after: float | None = None
    resumed_from: int = 0
    out: Path | None = None
    seconds_per_step: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------- text
def _document_text(name: str) -> str:
    return DOCUMENTS[name][1]()


def training_text(text: str, eval_text: str) -> str:
    """The training text: document ``text``, or (``"shakespeare"``) every Shakespeare work joined by blank lines,
    less the works whose text is (or holds) the evaluation document's."""
    if text != SHAKESPEARE:
        return _document_text(text)
    from ..data.lm import shakespeare_works

    held = _document_text(eval_text)
    works = [w for w in shakespeare_works().values() if w not in held and held not in w]
    return "\n\n".join(works)


def _token_ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def training_windows(tokenizer: Any, settings: FinetuneSettings) -> Any:
    """The training text cut into non-overlapping windows of ``settings.length`` tokens: a ``[n, length]`` tensor."""
    import torch

    ids = _token_ids(tokenizer, training_text(settings.text, settings.eval_text))
    length = int(settings.length or 0)
    n = len(ids) // length
    if n < 1:
        raise ConfigError(
            f"the training text {settings.text!r} has {len(ids)} tokens with this tokenizer, fewer than one sequence "
            f"of {length}; ask for a shorter length or another text"
        )
    return torch.tensor(ids[: n * length], dtype=torch.long).view(n, length)


def eval_ids(tokenizer: Any, settings: FinetuneSettings) -> Any:
    """The first ``length`` tokens of the held-out document (``[1, length]``)."""
    from .runner import document_ids

    ids, _ = document_ids(settings.eval_text, tokenizer, int(settings.length or 0))
    return ids.view(1, -1)


def step_windows(step: int, sequences: int, windows: int, seed: int) -> list[int]:
    """The windows of step ``step`` (0-based): the next ``sequences`` of a shuffled pass over the ``windows`` (a new
    order every pass, drawn from ``(seed, pass)``). A function of the step alone, so that a resumed run sees the
    batches an uninterrupted one does."""
    import torch

    out = []
    orders: dict[int, list[int]] = {}
    for g in range(step * sequences, (step + 1) * sequences):
        epoch, i = divmod(g, windows)
        if epoch not in orders:
            gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
            orders[epoch] = torch.randperm(windows, generator=gen).tolist()
        out.append(orders[epoch][i])
    return out


# ---------------------------------------------------------------------------------------------- schedule
def lr_factor(step: int, settings: FinetuneSettings) -> float:
    """The multiple of the peak rate at optimizer step ``step`` (0-based): a linear warmup over ``warmup`` steps
    (PI and YaRN: 20), then constant, or a linear / cosine decay to 0 at the last step."""
    if settings.warmup and step < settings.warmup:
        return (step + 1) / settings.warmup
    if settings.schedule == "constant":
        return 1.0
    rest = max(settings.steps - settings.warmup, 1)
    done = min(max(step - settings.warmup, 0) / rest, 1.0)
    if settings.schedule == "linear":
        return 1.0 - done
    return 0.5 * (1.0 + math.cos(math.pi * done))


# ---------------------------------------------------------------------------------------------- the run
def _fmt(seconds: float) -> str:
    seconds = max(seconds, 0.0)
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def held_out_loss(model: Any, ids: Any) -> float:
    """The mean next-token loss of ``model`` on ``ids`` (``[1, n]``) in one forward, no gradient."""
    import torch

    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            dev = next(model.parameters()).device
            return float(model(ids.to(dev), labels=ids.to(dev), use_cache=False).loss)
    finally:
        model.train(was)


def _with_lora(model: Any, settings: FinetuneSettings) -> Any:
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as e:  # pragma: no cover - peft is a dependency of the extras that run this
        raise ConfigError("mode='lora' needs the peft package (pip install peft)") from e
    cfg = LoraConfig(
        r=settings.lora_rank,
        lora_alpha=settings.lora_alpha,
        lora_dropout=settings.lora_dropout,
        target_modules=list(settings.lora_targets),
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, cfg)


def finetune(
    model: Any,
    tokenizer: Any,
    *,
    scaling: str = "rope-yarn",
    factor: float = 4.0,
    steps: int = 400,
    length: int | None = None,
    lr: float = 2e-5,
    tokens_per_step: int | None = None,
    micro_batch: int = 1,
    warmup: int = 20,
    schedule: str = "constant",
    mode: str = "full",
    lora_rank: int = 8,
    lora_alpha: float = 16.0,
    lora_dropout: float = 0.0,
    lora_targets: Sequence[str] = LORA_TARGETS,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.95),
    grad_clip: float | None = None,
    text: str = SHAKESPEARE,
    eval_text: str = "lear",
    eval_every: int = 0,
    evaluate: bool = True,
    out: str | os.PathLike | None = None,
    save_every: int = 50,
    resume: bool = True,
    max_new_steps: int | None = None,
    merge: bool = True,
    gradient_checkpointing: bool = False,
    seed: int = 0,
    progress: Callable[[dict[str, Any]], None] | None = None,
    quiet: bool = False,
    scaling_options: dict[str, Any] | None = None,
) -> FinetuneResult:
    """Patch ``model`` (a transformers causal LM) with RoPE scaling ``scaling`` at ``factor`` and fine-tune it on
    long real text at the extended ``length``, as PI (Chen et al. 2023) and YaRN (Peng et al. 2023) do.

    Args:
        model, tokenizer: the model (changed in place: patched, then trained) and its tokenizer.
        scaling, factor: the scaling (:data:`posenc.extend.config.SCALINGS`) and its extension ratio, applied with
            :func:`posenc.extend.runner.apply_scaling`; ``scaling_options`` instead patches with these options
            (``rope-longrope`` with searched ``short_factor`` / ``long_factor``:
            :func:`posenc.extend.longrope_search.search`).
        steps: optimizer steps (PI: up to 1000; YaRN: 400).
        length: tokens a training sequence (default ``factor x`` the trained length).
        lr, warmup, schedule, betas, weight_decay: AdamW's peak rate (2e-5), the linear warmup (20 steps), what
            follows it (``constant``, as the papers; or ``linear`` / ``cosine`` decay), its betas (0.9, 0.95) and
            decay (0), all as PI and YaRN.
        tokens_per_step: tokens a step, a whole number of sequences (default: 64 sequences, the papers' batch),
            reached by gradient accumulation over ``micro_batch`` sequences a forward.
        mode: ``"full"`` (every weight, as PI and YaRN) or ``"lora"`` (``peft`` adapters of rank ``lora_rank`` on
            ``lora_targets``, merged at the end unless ``merge=False``).
        grad_clip: clip the gradient norm to this (``None``: no clipping; neither paper states one).
        text, eval_text: the training text (``"shakespeare"``: the 42 works without the evaluation document; or a
            document of :data:`~posenc.extend.config.DOCUMENTS`) and the held-out document scored at ``length``
            before training, every ``eval_every`` steps and at the end (``evaluate=False``: never).
        out: the folder of the curve and the checkpoints (``None``: keep nothing on disk, no resume).
        save_every: steps between checkpoints (and the last step's).
        resume: continue from ``out``'s checkpoint when one is there (of the same settings, else refused; with the
            constant schedule ``steps`` may grow, to go on training a finished run).
        max_new_steps: stop after this many steps in this call (the next call resumes), e.g. to fit a time box.
        gradient_checkpointing: recompute each layer's activations in the backward pass (transformers'
            ``gradient_checkpointing_enable``, non-reentrant): the memory of long sequences for about a third more
            time; the losses are the same.
        seed: the order of the training windows and the LoRA initialisation.
        progress: called with each step's record (the curve line) after the step; a line to stderr unless ``quiet``.

    Returns a :class:`FinetuneResult`: the model (patched, in eval mode), the curve, the held-out losses.

    Raises:
        ConfigError: a bad setting (said before any work), a text too short for one sequence, or a checkpoint in
            ``out`` of other settings.
    """
    settings = FinetuneSettings(
        scaling=scaling, factor=factor, steps=steps, length=length, lr=lr, tokens_per_step=tokens_per_step,
        micro_batch=micro_batch, warmup=warmup, schedule=schedule, mode=mode, lora_rank=lora_rank,
        lora_alpha=lora_alpha, lora_dropout=lora_dropout, lora_targets=tuple(lora_targets),
        weight_decay=weight_decay, betas=(float(betas[0]), float(betas[1])), grad_clip=grad_clip, text=text,
        eval_text=eval_text, eval_every=eval_every, save_every=save_every, seed=seed,
    )
    if max_new_steps is not None:
        positive_int("max_new_steps", max_new_steps)
    return _finetune(model, tokenizer, settings, evaluate=evaluate, out=out, resume=resume,
                     max_new_steps=max_new_steps, merge=merge, progress=progress, quiet=quiet,
                     scaling_options=scaling_options, checkpointing=bool(gradient_checkpointing))


def _patch(model: Any, settings: FinetuneSettings, options: dict[str, Any] | None) -> dict[str, Any]:
    """Patch ``model`` with the scaling: :func:`posenc.extend.runner.apply_scaling`'s options for it (LongRoPE:
    YaRN's per-pair factors as the long set, unsearched), or ``options``; returns every option patched with."""
    import posenc.hf

    from .runner import apply_scaling, scaling_options

    if options is None:
        apply_scaling(model, settings.scaling, settings.factor)
        return scaling_options(settings.scaling, model, settings.factor)
    posenc.hf.unpatch(model)
    opts = {"factor": settings.factor, **options}
    posenc.hf.patch(model, settings.scaling, **opts)
    return opts


def _finetune(model: Any, tokenizer: Any, settings: FinetuneSettings, *, evaluate: bool, out: Any, resume: bool,
              max_new_steps: int | None, merge: bool, progress: Any, quiet: bool,
              scaling_options: Any, checkpointing: bool = False) -> FinetuneResult:
    import torch

    from .runner import trained_length

    rank, world = _world()
    settings = settings.resolved(trained_length(model))
    length, sequences = int(settings.length or 0), settings.sequences
    options = _patch(model, settings, scaling_options)
    windows = training_windows(tokenizer, settings)
    held = eval_ids(tokenizer, settings) if evaluate else None
    folder = Path(out) if out is not None else None
    ckpt_path = folder / CHECKPOINT if folder is not None else None
    curve_path = folder / CURVE if folder is not None else None

    torch.manual_seed(settings.seed)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    trainer = _with_lora(model, settings) if settings.mode == "lora" else model
    if settings.mode == "full":
        for p in trainer.parameters():
            p.requires_grad_(True)
    params = list(trainable(trainer).values())
    optimizer = torch.optim.AdamW(params, lr=settings.lr, betas=settings.betas, weight_decay=settings.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, settings))

    start, curve, eval_before = 0, [], None
    state = load_checkpoint(ckpt_path, settings.record()) if (ckpt_path is not None and resume) else None
    if state is not None:
        stored = state["extra"].get("scaling_options")
        if stored is not None and stored != _jsonable(options):
            raise ConfigError(
                f"{ckpt_path} was fine-tuned with other {settings.scaling} options ({stored}, now "
                f"{_jsonable(options)}); give another out folder or resume=False"
            )
        named = trainable(trainer)
        if set(named) != set(state["trainable"]):
            raise ConfigError(f"{ckpt_path} holds parameters of another model; give another out folder")
        with torch.no_grad():
            for n, p in named.items():
                p.copy_(state["trainable"][n].to(p.device, p.dtype))
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        start = int(state["step"])
        eval_before = state["extra"].get("eval_before")
        curve = read_curve(curve_path, start) if curve_path is not None else []
    if rank == 0 and curve_path is not None:
        write_curve(curve_path, curve)
    if world > 1:  # every rank starts from rank 0's weights (as DistributedDataParallel does)
        with torch.no_grad():
            for p in params:
                broadcast(p.data)

    def say(line: str) -> None:
        if not quiet and rank == 0:
            print(line, file=sys.stderr, flush=True)

    if start == 0 and held is not None:
        eval_before = held_out_loss(trainer, held)
        rec0 = {"step": 0, "eval_loss": round(eval_before, 6)}
        curve.append(rec0)
        if rank == 0 and curve_path is not None:
            append_curve(curve_path, rec0)
    if start:
        say(f"posenc finetune: resuming {folder} at step {start}/{settings.steps}")
    else:
        say(f"posenc finetune: {settings.scaling} x{settings.factor:g} ({settings.mode}), {settings.steps} steps of "
            f"{sequences} x {length} tokens on {settings.text}, {len(windows)} windows"
            + (f", {world} ranks" if world > 1 else ""))

    trainer.train()
    dev = next(trainer.parameters()).device
    mine = [k for k in range(sequences) if k % world == rank]
    spent, ran, seconds = 0.0, 0, None
    end = settings.steps if max_new_steps is None else min(settings.steps, start + max_new_steps)
    for step in range(start, end):
        t0 = time.perf_counter()
        chosen = step_windows(step, sequences, len(windows), settings.seed)
        optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), dtype=torch.float64)
        for a in range(0, len(mine), settings.micro_batch):
            ks = mine[a : a + settings.micro_batch]
            batch = windows[[chosen[k] for k in ks]].to(dev)
            loss = trainer(input_ids=batch, labels=batch, use_cache=False).loss
            (loss * (len(ks) / sequences)).backward()
            total += float(loss.detach()) * len(ks) / sequences
        if world > 1:
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                all_reduce(p.grad)
            all_reduce(total)
        if settings.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(params, settings.grad_clip)
        lr_now = optimizer.param_groups[0]["lr"]
        optimizer.step()
        scheduler.step()
        dt = time.perf_counter() - t0
        spent, ran = spent + dt, ran + 1
        rec: dict[str, Any] = {"step": step + 1, "loss": round(float(total), 6), "lr": lr_now,
                               "tokens": (step + 1) * settings.tokens_per_step, "seconds": round(dt, 4)}
        last = step + 1 == settings.steps
        if held is not None and (last or (settings.eval_every and (step + 1) % settings.eval_every == 0)):
            rec["eval_loss"] = round(held_out_loss(trainer, held), 6)
        curve.append(rec)
        if rank == 0 and curve_path is not None:
            append_curve(curve_path, rec)
        if ckpt_path is not None and ((step + 1) % settings.save_every == 0 or step + 1 == end):
            if rank == 0:
                save_checkpoint(ckpt_path, step + 1, trainer, optimizer, scheduler, settings.record(),
                                {"eval_before": eval_before, "scaling_options": _jsonable(options)})
            barrier()
        left = (settings.steps - step - 1) * spent / ran
        extra = f", held-out loss {rec['eval_loss']:.4f}" if "eval_loss" in rec else ""
        say(f"  step {step + 1}/{settings.steps}: loss {rec['loss']:.4f}, lr {lr_now:.2e}, {dt:.2f} s/step "
            f"({settings.tokens_per_step / max(dt, 1e-9):.0f} tokens/s){extra}, about {_fmt(left)} left")
        if progress is not None:
            progress(rec)
        seconds = spent / ran

    eval_after = next((r["eval_loss"] for r in reversed(curve) if r.get("step", 0) > 0 and "eval_loss" in r), None)
    finished = end == settings.steps
    if settings.mode == "lora" and merge and finished:
        # an unfinished LoRA run stays wrapped (its checkpoint holds the adapters; a new process resumes them)
        trainer = trainer.merge_and_unload()
    if checkpointing:
        _unwrap_model(trainer).gradient_checkpointing_disable()
    if finished:  # another model now: a store of the pretrained model's cells refuses its records (runner.Store)
        from ..pretrained import identity

        base = _unwrap_model(trainer)
        was = identity(base)
        base.posenc_identity = {**was, "name": f"{was.get('name', 'model')} fine-tuned",
                                "finetuned_from": was.get("finetuned_from", was.get("name")),
                                "finetuned": {**settings.record(), "scaling_options": _jsonable(options)}}
    trainer.eval()
    return FinetuneResult(model=trainer, curve=curve, settings=settings, eval_before=eval_before,
                          eval_after=eval_after if finished else None, resumed_from=start, out=folder,
                          seconds_per_step=seconds, extra={"scaling_options": _jsonable(options)})


def _unwrap_model(model: Any) -> Any:
    """The transformers model inside a ``peft`` wrapper (or the model itself)."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=float))


# ---------------------------------------------------------------------------------------------- the CLI
#: the fine-tuning flags and the settings field each sets
_FLAGS = {
    "finetune_mode": ("--finetune-mode", "mode"),
    "finetune_lr": ("--finetune-lr", "lr"),
    "finetune_length": ("--finetune-length", "length"),
    "finetune_tokens_per_step": ("--finetune-tokens-per-step", "tokens_per_step"),
    "finetune_scaling": ("--finetune-scaling", "scaling"),
    "finetune_factor": ("--finetune-factor", "factor"),
    "finetune_lora_rank": ("--finetune-lora-rank", "lora_rank"),
    "finetune_text": ("--finetune-text", "text"),
    "finetune_eval_text": ("--finetune-eval-text", "eval_text"),
    "finetune_warmup": ("--finetune-warmup", "warmup"),
    "finetune_save_every": ("--finetune-save-every", "save_every"),
    "finetune_dir": ("--finetune-dir", None),
}


def add_finetune_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``posenc extend``'s fine-tuning flags (``--finetune STEPS`` and the ``--finetune-*`` options) to
    ``parser``; :func:`check_finetune_args` checks them, :func:`run_finetune` runs them."""
    g = parser.add_argument_group(
        "fine-tuning at the extended length (PI: Chen et al. 2023; YaRN: Peng et al. 2023)",
        "patch the model with a scaling, then fine-tune it at the extended length on Shakespeare (King Lear held "
        "out), AdamW lr 2e-5, 20 warmup steps, 64 sequences a step as the papers; resumes from --finetune-dir; the "
        "cells (the quick ones at the factor, or the cells flags) are measured before the fine-tune on the model "
        "patched and after it on the tuned model (rows <scaling>+ft<STEPS>), side by side in --out",
    )
    g.add_argument("--finetune", type=int, metavar="STEPS", help="fine-tune for STEPS optimizer steps (YaRN: 400)")
    g.add_argument("--finetune-mode", choices=MODES, help="every weight (full, the papers') or LoRA adapters")
    g.add_argument("--finetune-lr", type=float, metavar="LR", help="the peak learning rate (default 2e-5)")
    g.add_argument("--finetune-length", type=int, metavar="N",
                   help="tokens a training sequence (default: the factor times the trained length)")
    g.add_argument("--finetune-tokens-per-step", type=int, metavar="N",
                   help="tokens a step, a multiple of the length (default: 64 sequences)")
    g.add_argument("--finetune-scaling", metavar="NAME", help=f"the scaling (default rope-yarn; {', '.join(SCALINGS)})")
    g.add_argument("--finetune-factor", type=float, metavar="S", help="the extension ratio (default 4)")
    g.add_argument("--finetune-lora-rank", type=int, metavar="R", help="LoRA's rank (default 8)")
    g.add_argument("--finetune-text", metavar="DOC",
                   help=f"the training text ({SHAKESPEARE}, the default, or one of {', '.join(DOCUMENTS)})")
    g.add_argument("--finetune-eval-text", metavar="DOC", help="the held-out document (default lear)")
    g.add_argument("--finetune-warmup", type=int, metavar="N", help="linear warmup steps (default 20)")
    g.add_argument("--finetune-save-every", type=int, metavar="N", help="steps between checkpoints (default 50)")
    g.add_argument("--finetune-dir", metavar="DIR",
                   help="where the checkpoints and the curve go (default: <--out>/finetune-<scaling>-x<factor>-<mode>)")
    return parser


def settings_from_args(args: argparse.Namespace) -> FinetuneSettings | None:
    """The :class:`FinetuneSettings` the flags ask for (``None`` without ``--finetune``), checked: a bad value or a
    ``--finetune-*`` flag without ``--finetune`` is a :class:`~posenc.errors.ConfigError` naming the flag. Imports
    no torch, loads no model."""
    steps = getattr(args, "finetune", None)
    given = {k: getattr(args, k, None) for k in _FLAGS}
    if steps is None:
        named = [_FLAGS[k][0] for k, v in given.items() if v is not None]
        if named:
            raise ConfigError(f"{', '.join(named)} describe the fine-tuning, which needs --finetune STEPS")
        return None
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"--finetune STEPS must be a whole number of steps >= 1, got {steps!r}")
    kw: dict[str, Any] = {"steps": steps}
    if given["finetune_factor"] is None and getattr(args, "loss_extension", None):
        kw["factor"] = float(args.loss_extension)
    for key, (_flag, fieldname) in _FLAGS.items():
        if fieldname is not None and given[key] is not None:
            kw[fieldname] = given[key]
    try:
        return FinetuneSettings(**kw)
    except ConfigError as e:
        text = str(e)
        for flag, fieldname in _FLAGS.values():
            if fieldname is not None and text.startswith((f"{fieldname} ", f"unknown {fieldname} ")):
                raise ConfigError(f"{flag}: {text}") from e
        if text.startswith("tokens_per_step"):
            raise ConfigError(f"--finetune-tokens-per-step: {text}") from e
        raise ConfigError(f"--finetune: {text}") from e


def check_finetune_args(args: argparse.Namespace) -> FinetuneSettings | None:
    """Check the fine-tuning flags before any model loads (see :func:`settings_from_args`)."""
    settings = settings_from_args(args)
    folder = getattr(args, "finetune_dir", None)
    if settings is not None and folder is not None and Path(folder).is_file():
        raise ConfigError(f"--finetune-dir {folder} is a file; give a folder for the checkpoints and the curve")
    return settings


def finetune_dir(args: argparse.Namespace, settings: FinetuneSettings, name: str | None = None) -> Path:
    """Where a CLI run keeps its checkpoints and curve (``name``: the untuned scaling's cells, e.g.
    ``rope-longrope-searched``; default the scaling)."""
    if getattr(args, "finetune_dir", None):
        return Path(args.finetune_dir)
    base = Path(getattr(args, "out", None) or "posenc-results/extend")
    return base / f"finetune-{name or settings.scaling}-x{settings.factor:g}-{settings.mode}"


def trains_on(settings: FinetuneSettings, document: str) -> bool:
    """Whether the training text of ``settings`` holds document ``document`` of :data:`DOCUMENTS` (a loss measured
    on it after the fine-tune is not held out): the document itself, or a Shakespeare play other than the held-out
    one when the text is every Shakespeare work."""
    if document == settings.text:
        return True
    return settings.text == SHAKESPEARE and document in SHAKESPEARE_DOCUMENTS and document != settings.eval_text


def run_finetune(args: argparse.Namespace, model: Any = None, tokenizer: Any = None, *,
                 scaling_options: dict[str, Any] | None = None, name: str | None = None) -> FinetuneResult | None:
    """What ``posenc extend --finetune STEPS`` does: check the flags, load ``--model`` (unless ``model`` and
    ``tokenizer`` are given), fine-tune with checkpoints in :func:`finetune_dir` (an interrupted run resumes there),
    and return the result (the model patched and fine-tuned, ready for the extend run's cells or ``--export``).
    ``scaling_options``: patch with these (LongRoPE's searched factors, ``name`` ``rope-longrope-searched``) instead
    of the scaling's own. ``None`` without ``--finetune``."""
    settings = check_finetune_args(args)
    if settings is None:
        return None
    if model is None or tokenizer is None:
        from ..pretrained import load_pretrained

        model, tokenizer = load_pretrained(getattr(args, "model", None) or "smollm2-135m")
    kw = {k: v for k, v in asdict(settings).items()}
    kw["lora_targets"] = tuple(settings.lora_targets)
    return finetune(model, tokenizer, **kw, out=finetune_dir(args, settings, name), scaling_options=scaling_options)
