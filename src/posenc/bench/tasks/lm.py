"""Language modelling with length extrapolation, ALiBi's set-up at small scale (Press, Smith and Lewis 2022).

ALiBi ("Train Short, Test Long", ICLR 2022) trains a causal language model on
contiguous chunks of ``L`` tokens and evaluates it, unchanged, on windows of
``L' >= L`` tokens; an encoding that extrapolates keeps (or improves) its perplexity
as ``L'`` grows, one that does not blows up. Two corpora ship in registry packages:
``ptb-lm`` (Penn Treebank, Mikolov's version, words, 10,000-word vocabulary plus
``<pad>``; ``<eos>`` after each sentence) and ``shakespeare-lm`` (the complete works,
characters).

Protocol (one run):

* ``L = cfg.train_lengths[1]`` (the first element is not used); ``cfg.steps`` steps of
  AdamW (``cfg.lr``, one-cycle schedule) on ``cfg.batch_size`` chunks of ``L + 1``
  tokens taken at uniformly random offsets of the training stream (offsets drawn from
  ``cfg.seed``), next-token cross-entropy over the ``L`` predictions of each chunk;
* a :class:`~posenc.models.LanguageModel` (a causal decoder, tied embeddings) whose
  ``max_len`` is ``task_options max_len`` (default: the longest test length, so every
  encoding with a table can be asked for every length; set ``max_len = L`` to give a
  learned table only the positions it is trained on, as in ALiBi's comparison);
* evaluation on the **validation** stream (``task_options split="test"`` for the test
  stream), for every ``L'`` in ``cfg.test_lengths``: ALiBi's *non-overlapping*
  evaluation -- consecutive windows of ``L'`` inputs, each predicting its ``L'`` next
  tokens from inside the window only; perplexity = ``exp(mean NLL)`` over all of them.
  Only the first ``eval_tokens`` (default 16,384) predicted tokens of the stream are
  scored, the same tokens for every ``L'`` (the last window may be shorter);
* metric ``"perplexity"`` (lower is better), labels ``str(L')``; a length the encoding
  cannot reach (positions beyond a learned table) gives ``None`` and ``"<L'>_error"``.

``cfg.eval_samples`` is not used. ``task_options``: ``eval_tokens`` (16384),
``split`` ("valid"), ``max_len`` (None = longest test length), ``dropout`` (0.0).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from ... import data as D
from ...errors import ConfigError
from ...models import LanguageModel
from ..real_training import count_parameters, guarded, perplexity, require, sample_chunks, task_options, train_loop
from ..steps import model_options
from ..types import OnStep, RunConfig, Task, register_task


@functools.lru_cache(maxsize=4)
def encoded_lm(dataset: str) -> tuple[int, dict[str, Tensor]]:
    """``(vocab size, {split: id stream})`` with the vocabulary of the training split, cached per process."""
    data = D.load(dataset)
    vocab = data.vocab()
    return len(vocab), {s: D.lm_stream(data[s], vocab) for s in ("train", "valid", "test")}


def uniform_perplexity(dataset: str) -> float | None:
    """A uniform guess over the corpus's vocabulary: perplexity = its size (``None`` if the corpus is not installed).

    The chance level of every task that measures perplexity on a packaged corpus."""
    try:
        return float(encoded_lm(dataset)[0])
    except Exception:
        return None


class LMTask(Task):
    """Train a causal LM on chunks of ``L`` tokens, report non-overlapping perplexity at every test length."""

    dataset: str = ""
    metric = "perplexity"
    higher_is_better = False
    default_model = "decoder"
    DEFAULTS: dict[str, Any] = {"eval_tokens": 16384, "split": "valid", "max_len": None, "dropout": 0.0}

    def options(self, cfg: RunConfig) -> dict[str, Any]:
        opts = task_options(self.name, cfg, self.DEFAULTS)
        L = cfg.train_lengths[1]
        require(opts["eval_tokens"] >= 1, f"task_options eval_tokens must be >= 1, got {opts['eval_tokens']}")
        require(
            opts["split"] in ("valid", "test"), f"task_options split must be 'valid' or 'test', got {opts['split']!r}"
        )
        require(
            opts["max_len"] is None or opts["max_len"] >= L,
            f"task_options max_len={opts['max_len']} is shorter than the training length {L}; use >= {L} or None",
        )
        require(0 <= opts["dropout"] < 1, f"task_options dropout must be in [0, 1), got {opts['dropout']}")
        return opts

    def chance(self, cfg: RunConfig, label: str) -> float | None:
        return uniform_perplexity(self.dataset)

    def training_lengths(self, cfg: RunConfig) -> tuple[int, int]:
        L = cfg.train_lengths[1]
        return (L, L)  # chunks of exactly L tokens (train_lengths[0] is not used)

    def validate(self, cfg: RunConfig) -> None:
        if cfg.model != "decoder":
            raise ConfigError(
                f"{self.name} trains a causal language model: model must be 'decoder' or 'auto', got {cfg.model!r}"
            )
        L = cfg.train_lengths[1]
        short = [n for n in cfg.test_lengths if n < L]
        require(not short, f"test lengths {short} are shorter than the training length {L}")
        self.options(cfg)

    @staticmethod
    def corpus_description(corpus: str) -> str:
        """The description of the LM task on a packaged corpus (``"Penn Treebank word-level"``)."""
        return (
            f"{corpus} LM (ALiBi's set-up): train on chunks of L, perplexity on the validation stream at each test "
            "length (non-overlapping windows)"
        )

    def streams(self, cfg: RunConfig, opts: dict[str, Any]) -> tuple[int, dict[str, Tensor], dict[str, Any]]:
        """``(vocabulary size, {split: token stream}, extra)`` of the run's text; ``extra`` goes into the record."""
        vocab_size, streams = encoded_lm(self.dataset)
        return vocab_size, streams, {}

    def run(self, cfg: RunConfig, on_step: OnStep | None = None) -> dict[str, Any]:
        self.validate(cfg)
        opts = self.options(cfg)
        vocab_size, streams, extra = self.streams(cfg, opts)
        L = cfg.train_lengths[1]
        torch.manual_seed(cfg.seed)
        model = LanguageModel(
            vocab_size, **model_options(cfg, max_len=opts["max_len"] or max(cfg.test_lengths), dropout=opts["dropout"])
        )
        train = streams["train"]

        def batch_loss(step: int, g: torch.Generator) -> Tensor:
            return model.loss(sample_chunks(train, cfg.batch_size, L, g))

        out = train_loop(cfg, model, batch_loss, on_step)
        metrics: dict[str, Any] = {}
        stream = streams[opts["split"]]
        for n in cfg.test_lengths:
            guarded(str(n), metrics, lambda n=n: perplexity(model, stream, n, opts["eval_tokens"]))
        return {**out, "metrics": metrics, "parameters": count_parameters(model), **({"extra": extra} if extra else {})}


@register_task
class PTBTask(LMTask):
    name, dataset = "ptb-lm", "ptb"
    description = LMTask.corpus_description("Penn Treebank word-level")


@register_task
class ShakespeareTask(LMTask):
    name, dataset = "shakespeare-lm", "shakespeare"
    description = LMTask.corpus_description("Shakespeare character-level")
