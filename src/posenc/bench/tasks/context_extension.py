"""Context extension of a RoPE language model: train short once, stretch with each scaling (issue 13).

The study of Chen et al. 2023 (position interpolation, "PI") and Peng et al. 2023
(YaRN) at small scale: a causal :class:`~posenc.models.LanguageModel` with plain RoPE
is trained at a short context ``L``, and the *same trained weights* are evaluated at
``L' = 2L, 4L, 8L, 16L`` with each RoPE scaling swapped in for plain RoPE -- first
without any further training, then after a short fine-tune at a longer length.
Encodings that are not RoPE scalings (ALiBi, xPos, FIRE ...) are trained at ``L``
with their own encoding and evaluated the same way, beside them.

How it maps onto the harness (one run = one row of the leaderboard):

* ``RunConfig.encoding`` is the **extension method**: ``rope`` (no scaling: plain
  extrapolation), ``rope-linear`` (PI), ``rope-ntk``, ``rope-dynamic``, ``rope-yarn``,
  ``rope-llama3`` (any :class:`~posenc.rotary.scaling.ScaledRoPE`). The run trains --
  or loads, see below -- the shared *base* model: plain ``rope`` (with the same
  ``base`` / ``rotary_dim`` options as the method) for ``cfg.steps`` steps at ``L``,
  then builds the model again with the method's encoding and loads the base weights
  (RoPE scalings have no parameters: only the rotation changes). Any other encoding
  is trained natively (the base model is that encoding itself).
* ``task_options finetune_steps > 0`` fine-tunes the swapped model at
  ``finetune_factor × L`` before evaluating (a separate run, shown under its own label,
  e.g. ``rope-yarn +ft``); ``0`` (the default) evaluates it as trained.
* **The base model is shared, not retrained**: six methods × (as trained, fine-tuned)
  would otherwise train the same RoPE model twelve times. It is kept in memory in the
  process and on disk in ``$POSENC_CACHE/bench-base/`` (default ``~/.cache/posenc``;
  a run does not know its suite's output folder), keyed by a hash of everything that
  decides its weights (the task, the data, the seed, the base encoding and its options,
  the training settings, torch's version and the source of this module and of the
  task's). Concurrent workers wait for each other on a file lock instead of training it
  twice. A cache hit gives the weights the run would have trained (the same seed, the
  same code), so a run stays a pure function of its config; ``POSENC_BENCH_CACHE=0``
  turns the disk cache off.

**The factor.** A scaled encoding keeps one ``factor`` for every evaluated length, the
encoding option given in the suite (``factor = 4``, ``original_max_len = L``); when it
is not given the task fills in ``factor = finetune_factor`` and ``original_max_len = L``
(an ``original_max_len`` other than ``L`` is refused). We chose a fixed factor rather
than ``factor = L'/L`` per evaluated length because a fine-tuned model has one factor
(PI fine-tunes at ``s·L`` with the factor ``s``), because the papers compare methods at a
fixed ``s`` across lengths (YaRN's static-vs-dynamic comparison is exactly "fixed ``s``"
against "``s`` follows the length"), and because with ``factor = L'/L`` every method
would be plain RoPE at ``L``, hiding the cost a static scaling has at the trained
length. So ``rope-linear`` / ``rope-ntk`` / ``rope-yarn`` / ``rope-llama3`` are
configured for ``4L`` and evaluated at ``L`` .. ``16L`` (beyond ``4L`` they extrapolate
again), while ``rope-dynamic`` adapts to each length by itself.

**The fine-tune** (PI: about 1000 steps of AdamW at learning rate 2e-5 after a
pre-training of 1T+ tokens, i.e. a tiny share of it): ``finetune_steps`` steps
(the suite: a tenth of ``cfg.steps``) of AdamW at ``finetune_lr`` (default 3e-4, a third
of the suite's training rate; linear warm-up over the first 10 % of the steps, then
constant), on chunks of ``finetune_factor × L`` tokens, ``batch_size / finetune_factor``
of them per step (the tokens per step of pre-training), gradient norm clipped to 1,
batches drawn from ``seed + 1``.

Protocol of the language-model tasks (``shakespeare-ctx-ext``, characters;
``ptb-ctx-ext``, words): training as :mod:`.lm` (``L = cfg.train_lengths[1]``, random
chunks of the training stream, AdamW with a one-cycle schedule), evaluation as
:mod:`.lm` (ALiBi's non-overlapping windows of each ``L'`` over the first
``eval_tokens`` predicted tokens of the validation stream, the same tokens for every
``L'``); metric ``perplexity`` per test length, lower is better, chance = the
vocabulary size (a uniform guess). ``task_options``: ``eval_tokens`` (8192), ``split``
("valid"), ``finetune_steps`` (0), ``finetune_factor`` (4), ``finetune_lr`` (3e-4).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import inspect
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ...errors import ConfigError
from ...models import LanguageModel
from ...registry import resolve
from ...rotary.scaling import ScaledRoPE
from ..real_training import count_parameters, guarded, perplexity, require, sample_chunks, task_options, train_loop
from ..steps import model_options, optimise
from ..types import OnStep, ReportSection, RunConfig, Task, register_task
from .lm import encoded_lm, uniform_perplexity

#: the RoPE scalings of the suite (any ScaledRoPE works; these are the ones compared)
SCALINGS = ("rope-linear", "rope-ntk", "rope-dynamic", "rope-yarn", "rope-llama3")
#: options of a scaled encoding that the base ``rope`` shares with it
SHARED_OPTIONS = ("base", "rotary_dim")
#: task_options longrope: "" (rope-longrope's factors as given) or "search" (LongRoPE's search replaces them)
LONGROPE_FORMS = ("", "search")

# --------------------------------------------------------------------------- which encodings are methods


def is_extension(encoding: str) -> bool:
    """``True`` for plain ``rope`` and every RoPE scaling: they evaluate the shared base RoPE model. A schedule of
    encodings per layer (``"rope@w64*3+nope"``) is not a method: it trains as a model of its own."""
    from ...schedule import is_schedule_text

    if is_schedule_text(encoding):
        return False
    cls = resolve(encoding)
    return encoding == "rope" or (isinstance(cls, type) and issubclass(cls, ScaledRoPE))


def base_encoding(cfg: RunConfig) -> tuple[str, dict[str, Any]]:
    """The encoding (and options) the base model of ``cfg`` is trained with."""
    if is_extension(cfg.encoding):
        opts = cfg.encoding_options or {}
        return "rope", {k: opts[k] for k in SHARED_OPTIONS if k in opts}
    return cfg.encoding, dict(cfg.encoding_options or {})


def method_options(cfg: RunConfig, train_len: int, factor: float) -> dict[str, Any]:
    """The method's encoding options with ``factor`` and ``original_max_len`` filled in where missing."""
    opts = dict(cfg.encoding_options or {})
    if not is_extension(cfg.encoding) or cfg.encoding == "rope":
        return opts
    takes = inspect.signature(resolve(cfg.encoding).__init__).parameters
    if "factor" in takes and "factor" not in opts:
        opts["factor"] = factor
    if "original_max_len" in takes:
        given = opts.setdefault("original_max_len", train_len)
        require(
            given == train_len,
            f"{cfg.encoding}: original_max_len={given} is not the training length {train_len}; "
            f"the base model is trained at {train_len} (leave original_max_len out, or set it to {train_len})",
        )
    return opts


# --------------------------------------------------------------------------- the shared base model cache

_MEMORY: dict[str, tuple[dict[str, Tensor], dict[str, Any]]] = {}
_MEMORY_LOCK = threading.Lock()


def cache_folder() -> Path | None:
    """``$POSENC_CACHE/bench-base`` (default ``~/.cache/posenc/bench-base``); ``None`` if ``POSENC_BENCH_CACHE=0``."""
    if os.environ.get("POSENC_BENCH_CACHE", "1").lower() in ("0", "off", "no", "false"):
        return None
    env = os.environ.get("POSENC_CACHE")
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "posenc"
    return root / "bench-base"


@functools.cache
def _module_hash(module_name: str) -> str:
    """A hash of a module's source, read once per process (an edit while a suite runs does not change it)."""
    module = sys.modules[module_name]
    try:
        text = inspect.getsource(module)
    except (OSError, TypeError):  # no source (a notebook): the module's name only
        text = module_name
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def base_key(task: Task, cfg: RunConfig, extra: dict[str, Any]) -> str:
    """A hash of everything that decides the base model's weights."""
    enc, opts = base_encoding(cfg)
    parts = {
        "task": task.name,
        "encoding": enc,
        "encoding_options": opts,
        "seed": cfg.seed,
        "train_lengths": list(cfg.train_lengths),
        "max_len": max(cfg.test_lengths),
        **{k: getattr(cfg, k) for k in ("steps", "batch_size", "d_model", "n_layers", "n_heads", "d_ff", "lr")},
        "extra": extra,
        "torch": torch.__version__.split("+")[0],
        "source": [_module_hash(__name__), _module_hash(type(task).__module__)],
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # no fcntl (Windows): no lock, at worst two workers train the same base
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def shared_base(
    key: str, train: Callable[[], tuple[dict[str, Tensor], dict[str, Any]]]
) -> tuple[dict[str, Tensor], dict[str, Any], bool]:
    """``(state_dict, meta, cached)``: the base model under ``key`` from memory or disk, else ``train()`` it.

    ``train`` returns the state dict and a JSON-able ``meta`` (curve, seconds). The disk
    copy is written atomically (a temporary file, then a rename), under a lock shared by
    the processes of this machine.
    """
    with _MEMORY_LOCK:
        if key in _MEMORY:
            state, meta = _MEMORY[key]
            return state, meta, True
    folder = cache_folder()
    if folder is None:
        state, meta = train()
        cached = False
    else:
        path = folder / f"{key}.pt"
        with _file_lock(folder / f"{key}.lock"):
            state = meta = None
            if path.exists():
                try:
                    saved = torch.load(path, map_location="cpu", weights_only=True)
                    state, meta = saved["state"], json.loads(saved["meta"])
                except Exception:  # noqa: BLE001 -- a damaged cache file is trained again
                    state = meta = None
            cached = state is not None
            if state is None:
                state, meta = train()
                tmp = path.with_suffix(f".tmp-{os.getpid()}")
                torch.save({"state": state, "meta": json.dumps(meta)}, tmp)
                os.replace(tmp, path)
    with _MEMORY_LOCK:
        _MEMORY.clear()  # one base at a time in memory (a suite runs them task by task)
        _MEMORY[key] = (state, meta)
    return state, meta, cached


# --------------------------------------------------------------------------- the task skeleton


def finetune(
    model: torch.nn.Module,
    steps: int,
    lr: float,
    seed: int,
    batch_loss: Callable[[torch.Generator], Tensor],
    at: Sequence[int] = (),
    checkpoint: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """``steps`` AdamW steps at ``lr`` (linear warm-up over 10 %, then constant), clip 1; batches from ``seed``.

    ``checkpoint(k)`` is called once the ``k``-th step of ``at`` is done (``0``: before the first), the model
    then in eval mode and back in train mode after; it must not draw from torch's random state (an evaluation
    does not), so the fine-tune is the same with or without checkpoints."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    warm = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / warm))
    wanted = set(at)

    def on_step(step: int, _loss: float) -> None:
        if checkpoint is not None and step in wanted:
            model.eval()
            checkpoint(step)
            model.train()

    if checkpoint is not None and 0 in wanted:
        model.eval()
        checkpoint(0)
    curve, seconds = optimise(model, opt, sched, steps, lambda step: batch_loss(g), every=10, on_step=on_step)
    model.eval()
    return {"curve": curve, "seconds": round(seconds, 2)}


class ExtensionTask(Task):
    """Train (or load) the shared base model, swap in the run's encoding, fine-tune if asked, evaluate.

    Subclasses say how to build the model (:meth:`build`), the loss of a training batch at a
    length (:meth:`train_loss`), the training length (:meth:`train_length`), and how to
    evaluate (:meth:`evaluate`).
    """

    default_model = "decoder"
    version = "1"
    DEFAULTS: dict[str, Any] = {
        "finetune_steps": 0,
        "finetune_factor": 4,
        "finetune_lr": 3e-4,
        "checkpoints": [],
        "longrope": "",
        "longrope_population": 64,
        "longrope_iterations": 40,
        "longrope_samples": 8,
    }

    # ---- to override
    def vocab_size(self, cfg: RunConfig) -> int:
        raise NotImplementedError

    def build(self, cfg: RunConfig, encoding: str, options: dict[str, Any]) -> LanguageModel:
        """The run's causal LM with ``encoding`` (the model sizes of ``cfg``, positions up to the longest test)."""
        return LanguageModel(
            self.vocab_size(cfg), **model_options(cfg, encoding=encoding, encoding_options=options or None)
        )

    def train_loss(self, model: LanguageModel, cfg: RunConfig, step: int, g: torch.Generator) -> Tensor:
        raise NotImplementedError

    def finetune_loss(self, model: LanguageModel, cfg: RunConfig, g: torch.Generator) -> Tensor:
        raise NotImplementedError

    def evaluate(self, model: LanguageModel, cfg: RunConfig) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(metrics, extra)``."""
        raise NotImplementedError

    def train_length(self, cfg: RunConfig) -> int:
        return cfg.train_lengths[1]

    def training_lengths(self, cfg: RunConfig) -> tuple[int, int] | None:
        """What the report says the model was trained on: ``L``, or up to ``finetune_factor × L`` when fine-tuned."""
        L = self.train_length(cfg)
        opts = self.options(cfg)
        top = int(round(opts["finetune_factor"] * L)) if opts["finetune_steps"] else L
        return (cfg.train_lengths[0], top)

    def base_extra(self, cfg: RunConfig) -> dict[str, Any]:
        """Task options that change the base model (part of its cache key)."""
        return {}

    # ---- shared
    def options(self, cfg: RunConfig) -> dict[str, Any]:
        opts = task_options(self.name, cfg, self.DEFAULTS)
        require(opts["finetune_steps"] >= 0, f"task_options finetune_steps must be >= 0, got {opts['finetune_steps']}")
        require(
            opts["finetune_factor"] >= 1, f"task_options finetune_factor must be >= 1, got {opts['finetune_factor']}"
        )
        require(opts["finetune_lr"] > 0, f"task_options finetune_lr must be > 0, got {opts['finetune_lr']}")
        at = opts["checkpoints"]
        require(
            all(isinstance(k, int) and not isinstance(k, bool) and 0 <= k <= opts["finetune_steps"] for k in at)
            and list(at) == sorted(set(at)),
            f"task_options checkpoints must be increasing step counts in 0..finetune_steps "
            f"({opts['finetune_steps']}), got {at!r}",
        )
        require(
            opts["longrope"] in LONGROPE_FORMS,
            f"task_options longrope must be one of {LONGROPE_FORMS}, got {opts['longrope']!r}",
        )
        for key in ("longrope_population", "longrope_iterations", "longrope_samples"):
            require(opts[key] >= 1, f"task_options {key} must be >= 1, got {opts[key]}")
        return opts

    def validate(self, cfg: RunConfig) -> None:
        if cfg.model != "decoder":
            raise ConfigError(
                f"{self.name} trains a causal language model: model must be 'decoder' or 'auto', got {cfg.model!r}"
            )
        opts = self.options(cfg)
        method_options(cfg, self.train_length(cfg), float(opts["finetune_factor"]))
        require(
            not opts["longrope"] or cfg.encoding == "rope-longrope",
            f"task_options longrope = 'search' searches rope-longrope's factors; the encoding is {cfg.encoding}",
        )

    def heldout(self, cfg: RunConfig, length: int, n: int) -> Tensor:
        """``n x length + 1`` held-out tokens (a stream) for LongRoPE's search, not the evaluated ones."""
        raise ConfigError(f"{self.name} has no held-out text for LongRoPE's search (task_options longrope)")

    def longrope_factors(self, cfg: RunConfig, state: dict[str, Tensor], key: str) -> dict[str, Any]:
        """The per-pair factors of a ``rope-longrope`` run with ``task_options longrope = 'search'``: LongRoPE's
        evolutionary search on the base model at ``factor x L`` (the encoding's factor; see
        :func:`posenc.extend.longrope_search.search`, its initial population PI's, NTK's and YaRN's factors; cached
        beside the base). They replace the encoding's
        given ``short_factor`` / ``long_factor`` (rope-longrope cannot be built without some)."""
        opts = self.options(cfg)
        L = self.train_length(cfg)
        s = float(method_options(cfg, L, float(opts["finetune_factor"]))["factor"])  # the encoding's own ratio
        base = float((cfg.encoding_options or {}).get("base", 10000.0))
        head_dim = cfg.d_model // cfg.n_heads
        pairs = int((cfg.encoding_options or {}).get("rotary_dim", head_dim)) // 2
        return search_longrope(self, cfg, state, key, L, s, base, head_dim, pairs)

    def report_sections(self, records: list[dict[str, Any]]) -> list[ReportSection]:
        """The steps-to-target table and figure of the runs fine-tuned with checkpoints
        (:mod:`posenc.bench.tasks.steps_to_target`)."""
        from .steps_to_target import sections

        return sections(records)

    def run(self, cfg: RunConfig, on_step: OnStep | None = None) -> dict[str, Any]:
        self.validate(cfg)
        opts = self.options(cfg)
        enc, enc_opts = base_encoding(cfg)

        def train_base() -> tuple[dict[str, Tensor], dict[str, Any]]:
            torch.manual_seed(cfg.seed)
            model = self.build(cfg, enc, enc_opts)
            out = train_loop(cfg, model, lambda step, g: self.train_loss(model, cfg, step, g), on_step)
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            return state, {"curve": out["curve"], "seconds": out["train_seconds"]}

        state, meta, cached = shared_base(base_key(self, cfg, self.base_extra(cfg)), train_base)
        if cached and on_step is not None:  # the progress bar: the base's steps are done
            on_step(cfg.steps, meta["curve"][-1][1] if meta["curve"] else float("nan"))
        L = self.train_length(cfg)
        method = method_options(cfg, L, float(opts["finetune_factor"]))
        found: dict[str, Any] = {}
        if opts["longrope"]:
            found = self.longrope_factors(cfg, state, base_key(self, cfg, self.base_extra(cfg)))
            replaced = {k: method.get(k) for k in ("short_factor", "long_factor")}
            method = {**method, "short_factor": found["short_factor"], "long_factor": found["long_factor"]}
            found = {**found, "longrope": {**found["longrope"], "replaced": replaced}}
        model = self.build(cfg, cfg.encoding, method)
        missing, unexpected = model.load_state_dict(copy.deepcopy(state), strict=False)
        stray = [k for k in [*missing, *unexpected] if "encoding" not in k]
        require(not stray, f"the base model's weights do not fit {cfg.encoding}: {stray[:5]}")
        model.eval()
        curve = [list(p) for p in meta["curve"]]
        extra: dict[str, Any] = {
            "base_encoding": enc,
            "base_from_cache": cached,
            "base_seconds": meta["seconds"],
            "encoding_options_used": method,
        }
        if found:
            extra["longrope"] = found["longrope"]
        seconds = float(meta["seconds"])
        at = list(opts["checkpoints"])
        points: dict[str, Any] = {}
        spent = [0.0]

        def checkpoint(k: int) -> None:
            t0 = time.perf_counter()
            with torch.no_grad():
                points[str(k)] = self.evaluate(model, cfg)[0]
            spent[0] += time.perf_counter() - t0

        if opts["finetune_steps"]:
            ft_len = int(round(opts["finetune_factor"] * L))
            extra["finetune_length"] = ft_len
            ft = finetune(
                model,
                opts["finetune_steps"],
                opts["finetune_lr"],
                cfg.seed + 1,
                lambda g: self.finetune_loss(model, cfg, g),
                at=at,
                checkpoint=checkpoint if at else None,
            )
            curve += [[cfg.steps + s, v] for s, v in ft["curve"]]
            ft_seconds = round(ft["seconds"] - spent[0], 2)  # the checkpoints' evaluations are not training
            extra["finetune_seconds"] = ft_seconds
            seconds += ft_seconds
        elif at:  # checkpoints = [0]: the model as swapped in
            checkpoint(0)
        if at:
            # the metrics at each checkpoint (fine-tune steps done -> {test length: value}), in step order
            extra["checkpoints"] = {str(k): points[str(k)] for k in at}
            extra["checkpoint_seconds"] = round(spent[0], 2)
        with torch.no_grad():
            metrics, more = self.evaluate(model, cfg)
        extra.update(more)
        return {
            "metrics": metrics,
            "curve": curve,
            "parameters": count_parameters(model),
            "train_seconds": round(seconds, 2),
            "extra": extra,
        }


# --------------------------------------------------------------------------- LongRoPE's search on the base model

_SEARCHED: dict[str, dict[str, Any]] = {}


class _ToyRotaryEmbedding(torch.nn.Module):
    """What :func:`posenc.extend.longrope_search.search` reads of a model's rotary module: ``inv_freq``."""

    def __init__(self, inv_freq: Tensor) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inv_freq)


class _SearchView(torch.nn.Module):
    """The base model's RoPE as a transformers-like config and rotary module, for the search's bookkeeping (its
    base, head width, pairs and trained length); the fitness is ours, so the search never runs this module."""

    def __init__(self, base: float, head_dim: int, pairs: int, L: int) -> None:
        super().__init__()
        from types import SimpleNamespace

        self.config = SimpleNamespace(rope_theta=base, head_dim=head_dim, max_position_embeddings=L)
        self.rotary = _ToyRotaryEmbedding(torch.ones(pairs))


def search_longrope(
    task: ExtensionTask,
    cfg: RunConfig,
    state: dict[str, Tensor],
    key: str,
    L: int,
    factor: float,
    base: float,
    head_dim: int,
    pairs: int,
) -> dict[str, Any]:
    """LongRoPE's search (microsoft/LongRoPE's sizes unless the task options say) of ``rope-longrope``'s long
    factors for the base model ``state``: fitness = perplexity at ``factor x L`` on ``longrope_samples`` held-out
    windows (:meth:`ExtensionTask.heldout`), short factors 1, ``n̂ = 0`` (what ``rope-longrope`` can express).
    The result is a pure function of the base and the options, kept in memory and beside the base on disk."""
    opts = task.options(cfg)
    sizes = {k: opts[f"longrope_{k}"] for k in ("population", "iterations", "samples")}
    parts = {"base": key, "factor": factor, "base_theta": base, "pairs": pairs, **sizes}
    skey = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]
    with _MEMORY_LOCK:
        if skey in _SEARCHED:
            return _SEARCHED[skey]
    folder = cache_folder()
    if folder is None:
        return _search_longrope(task, cfg, state, skey, None, L, factor, base, head_dim, pairs, sizes)
    path = folder / f"{key}-longrope-{skey}.json"
    with _file_lock(folder / f"{key}-longrope-{skey}.lock"):  # concurrent workers wait instead of searching twice
        if path.exists():
            with contextlib.suppress(ValueError, OSError):
                out = json.loads(path.read_text())
                with _MEMORY_LOCK:
                    _SEARCHED[skey] = out
                return out
        return _search_longrope(task, cfg, state, skey, path, L, factor, base, head_dim, pairs, sizes)


def _search_longrope(
    task: ExtensionTask,
    cfg: RunConfig,
    state: dict[str, Tensor],
    skey: str,
    path: Path | None,
    L: int,
    factor: float,
    base: float,
    head_dim: int,
    pairs: int,
    sizes: dict[str, int],
) -> dict[str, Any]:
    from ...extend.longrope_search import search

    length = int(round(factor * L))
    held = task.heldout(cfg, length, sizes["samples"])
    fixed = method_options(cfg, L, factor)

    def fitness(c: Any) -> float:
        model = task.build(cfg, "rope-longrope", {**fixed, "short_factor": [1.0] * pairs,
                                                  "long_factor": list(c.factors)})
        model.load_state_dict(state, strict=False)
        with torch.no_grad():
            return perplexity(model, held, length)

    # parents: half the population, as microsoft/LongRoPE's defaults (64 -> 32, with 16 mutations, 16 crossovers)
    population = sizes["population"]
    parents = max(1, population // 2)
    kids = max(1, population // 4)
    found = search(_SearchView(base, head_dim, pairs, L), factor=factor, length=length, fitness=fitness,
                   population=population, iterations=sizes["iterations"], parents=parents, mutations=kids,
                   crossovers=kids, seed=cfg.seed, quiet=True)
    out = {
        "short_factor": found.short_factor,
        "long_factor": found.long_factor,
        "longrope": {
            "form": "search",
            "length": length,
            "fitness": found.best.fitness,
            "initial": {k: c.fitness for k, c in found.initial.items()},
            "curve": found.curve,
            "evaluated": len(found.evaluated),
            "seconds": round(found.seconds, 2),
            "sizes": {**sizes, "parents": parents, "mutations": kids, "crossovers": kids},
        },
    }
    with _MEMORY_LOCK:
        _SEARCHED[skey] = out
    if path is not None:
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps(out))
        os.replace(tmp, path)
    return out


# --------------------------------------------------------------------------- language modelling


class LMExtensionTask(ExtensionTask):
    """Perplexity at each test length of a causal LM trained at ``L`` (the base shared by the RoPE scalings)."""

    dataset: str = ""
    metric = "perplexity"
    higher_is_better = False
    DEFAULTS = {**ExtensionTask.DEFAULTS, "eval_tokens": 8192, "split": "valid"}

    def options(self, cfg: RunConfig) -> dict[str, Any]:
        opts = super().options(cfg)
        require(opts["eval_tokens"] >= 1, f"task_options eval_tokens must be >= 1, got {opts['eval_tokens']}")
        require(
            opts["split"] in ("valid", "test"), f"task_options split must be 'valid' or 'test', got {opts['split']!r}"
        )
        return opts

    def chance(self, cfg: RunConfig, label: str) -> float | None:
        return uniform_perplexity(self.dataset)

    def vocab_size(self, cfg: RunConfig) -> int:
        return encoded_lm(self.dataset)[0]

    def train_loss(self, model: LanguageModel, cfg: RunConfig, step: int, g: torch.Generator) -> Tensor:
        train = encoded_lm(self.dataset)[1]["train"]
        return model.loss(sample_chunks(train, cfg.batch_size, cfg.train_lengths[1], g))

    def finetune_loss(self, model: LanguageModel, cfg: RunConfig, g: torch.Generator) -> Tensor:
        opts = self.options(cfg)
        train = encoded_lm(self.dataset)[1]["train"]
        length = int(round(opts["finetune_factor"] * cfg.train_lengths[1]))
        rows = max(1, int(cfg.batch_size // opts["finetune_factor"]))
        return model.loss(sample_chunks(train, rows, length, g))

    def heldout(self, cfg: RunConfig, length: int, n: int) -> Tensor:
        """``n`` windows of ``length`` tokens of the evaluated split after the evaluated tokens (held out)."""
        opts = self.options(cfg)
        stream = encoded_lm(self.dataset)[1][opts["split"]]
        start = opts["eval_tokens"] + 1
        need = n * length + 1
        require(
            stream.numel() >= start + need,
            f"{self.name}: {opts['split']} has {stream.numel()} tokens, too few for {n} search windows of {length} "
            f"after the {opts['eval_tokens']} evaluated ones (lower longrope_samples or eval_tokens)",
        )
        return stream[start : start + need]

    def evaluate(self, model: LanguageModel, cfg: RunConfig) -> tuple[dict[str, Any], dict[str, Any]]:
        opts = self.options(cfg)
        stream = encoded_lm(self.dataset)[1][opts["split"]]
        metrics: dict[str, Any] = {}
        for n in cfg.test_lengths:
            guarded(str(n), metrics, lambda n=n: perplexity(model, stream, n, opts["eval_tokens"]))
        return metrics, {}


@register_task
class ShakespeareExtension(LMExtensionTask):
    name = "shakespeare-ctx-ext"
    dataset = "shakespeare"
    description = (
        "context extension (PI, YaRN ...): a character LM on Shakespeare trained at L with RoPE, the same weights "
        "evaluated with each RoPE scaling at 2L..16L, as trained or after a short fine-tune (perplexity)"
    )


@register_task
class PTBExtension(LMExtensionTask):
    name = "ptb-ctx-ext"
    dataset = "ptb"
    description = (
        "context extension (PI, YaRN ...): a word LM on Penn Treebank trained at L with RoPE, the same weights "
        "evaluated with each RoPE scaling at 2L..16L, as trained or after a short fine-tune (perplexity)"
    )
