"""posenc in EleutherAI's lm-evaluation-harness: the model class ``posenc`` (``--model posenc``).

``python -m posenc.lm_eval ARGS`` (or ``posenc harness ARGS``) registers it and runs the harness's own CLI with
every argument passed through::

    python -m posenc.lm_eval --model posenc \\
        --model_args pretrained=smollm2-135m,encoding=rope-yarn,factor=2 --tasks TASK

``--model_args`` keys (the harness parses them as ``key=value``):

* ``pretrained``: what :func:`posenc.hf.load_pretrained` takes (``smollm2-135m``, a ``.gguf`` file, a transformers
  folder, a hub id where a hub is reachable);
* ``encoding``: a posenc encoding name (``rope-yarn``, ``alibi`` ...), a schedule string (``rope*3+nope``), or a
  JSON object by layer type / JSON list with one entry per layer, as :func:`posenc.hf.patch` takes them; left out
  (or ``none``), the model runs as trained;
* ``layers``: a JSON list of layer indices that get ``encoding`` (the others keep theirs), or a JSON object by layer
  type (``{"full_attention": "alibi"}``) or by layer index (``{"0": "alibi", "3": ["rope-yarn", {"factor": 2}]}``);
* ``max_length``: the longest sequence a request gets (the stretched length); default the model's trained length
  times ``factor`` when one is given;
* ``dtype`` (``float32`` ...), ``path`` (``auto`` / ``fast`` / ``reference``), ``tokenizer`` (read by the
  harness's RULER tasks only);
* any other key is an option of the encoding (``factor=2``, ``theta=5e5``), numbers converted.

``--batch_size`` and ``--device`` are honoured (``--batch_size auto`` means 1).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from typing import Any

from tqdm import tqdm

try:
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError(
        "posenc.lm_eval needs EleutherAI's lm-evaluation-harness: pip install -c constraints.txt 'posenc[eval]' "
        f"(lm-eval==0.4.13); the import failed with: {err}"
    ) from err

from ..errors import ConfigError

__all__ = ["PosencLM", "parse_encoding", "main"]

#: keys of ``--model_args`` that are not options of the encoding
OWN_KEYS = ("pretrained", "encoding", "layers", "max_length", "dtype", "path", "tokenizer", "trust_remote_code")


def _number(value: Any) -> Any:
    """A harness value as Python: ``"2"`` -> 2, ``"0.5"`` -> 0.5, ``"true"`` -> True, JSON as JSON."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    if text[:1] in "[{":
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            pass
    return text


def _json(name: str, value: Any) -> Any:
    if isinstance(value, str) and value.strip()[:1] in "[{":
        try:
            return json.loads(value)
        except json.JSONDecodeError as err:
            raise ConfigError(f"--model_args {name}={value!r} is not valid JSON ({err}); quote it") from err
    return value


def _entry(value: Any) -> Any:
    """One layer's encoding from JSON: a name, ``[name, {options}]`` -> ``(name, options)``, or null."""
    if isinstance(value, list) and len(value) == 2 and isinstance(value[0], str) and isinstance(value[1], dict):
        return (value[0], value[1])
    return value


def parse_encoding(encoding: Any, layers: Any, n_layers: int) -> tuple[Any, list[int] | None]:
    """``(encoding, layers)`` for :func:`posenc.hf.patch` from the harness's ``encoding=`` and ``layers=``.

    ``layers`` a list of ints: those layer indices; a dict of layer types: the encoding by type; a dict of layer
    indices (as strings): a list with one entry per layer (``None`` where not named)."""
    encoding = _json("encoding", encoding)
    layers = _json("layers", layers)
    if isinstance(encoding, dict):
        encoding = {k: _entry(v) for k, v in encoding.items()}
    elif isinstance(encoding, list):
        encoding = [_entry(v) for v in encoding]
    if layers is None or layers == "":
        return encoding, None
    if isinstance(layers, int) and not isinstance(layers, bool):
        layers = [layers]
    if isinstance(layers, list):
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
            raise ConfigError(f"--model_args layers={layers!r}: a JSON list of layer indices (ints) was expected")
        if encoding is None:
            raise ConfigError("--model_args layers= lists layer indices but no encoding= says what they get")
        return encoding, layers
    if isinstance(layers, dict):
        if encoding is not None:
            raise ConfigError(
                "--model_args: give either encoding= (with layers= a list of indices) or layers= a JSON object, not "
                "both"
            )
        if all(str(k).lstrip("-").isdigit() for k in layers):
            per_layer: list[Any] = [None] * n_layers
            for key, value in layers.items():
                index = int(key)
                if not -n_layers <= index < n_layers:
                    raise ConfigError(f"--model_args layers: layer {index} does not exist (the model has {n_layers})")
                per_layer[index] = _entry(value)
            return per_layer, None
        return {k: _entry(v) for k, v in layers.items()}, None
    raise ConfigError(
        f"--model_args layers={layers!r}: a JSON list of layer indices, or a JSON object by layer type or index, "
        "was expected"
    )


def _batch(value: Any, name: str) -> int:
    if value is None:
        return 1
    if isinstance(value, str):
        if value.startswith("auto"):
            return 1
        try:
            value = int(value)
        except ValueError:
            raise ConfigError(f"--{name} {value!r}: a positive integer (or auto) was expected") from None
    if not isinstance(value, int) or value < 1:
        raise ConfigError(f"--{name} {value!r}: a positive integer (or auto) was expected")
    return value


def _stop_at(tokenizer: Any, start: int, until: list[str]) -> Any:
    """A transformers stopping criterion: stop once the text generated after ``start`` holds one of ``until``.
    (``generate(stop_strings=..., tokenizer=...)`` would hand ``tokenizer=`` to the attention, which posenc's
    attention refuses.)"""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    stops = [s for s in until if s]

    class _Stop(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
            done = [any(s in tokenizer.decode(row[start:].tolist()) for s in stops) for row in input_ids]
            return torch.tensor(done, dtype=torch.bool, device=input_ids.device)

    return StoppingCriteriaList([_Stop()])


@register_model("posenc")
class PosencLM(TemplateLM):
    """A causal LM loaded by :func:`posenc.hf.load_pretrained` and patched with a posenc encoding.

    See the module's docstring for the ``--model_args`` keys."""

    def __init__(
        self,
        pretrained: str = "smollm2-135m",
        encoding: Any = None,
        layers: Any = None,
        max_length: int | None = None,
        batch_size: int | str | None = 1,
        max_batch_size: int | None = None,
        device: str | None = None,
        dtype: str | None = None,
        path: str = "auto",
        tokenizer: str | None = None,
        **options: Any,
    ) -> None:
        super().__init__()
        import torch

        from ..hf import load_pretrained, patch

        options.pop("trust_remote_code", None)
        options = {k: _number(v) for k, v in options.items()}
        if isinstance(encoding, str) and encoding.strip().lower() in ("", "none", "trained"):
            encoding = None
        if device in (None, "", "auto"):
            device = "cuda" if torch.cuda.is_available() else "cpu"
        elif str(device).startswith("cuda") and not torch.cuda.is_available():
            # the harness's CLI asks for cuda by default; as its HFLM does, run where torch can
            logging.getLogger(__name__).warning("--device %s: torch sees no CUDA device; running on the CPU", device)
            device = "cpu"
        self._device = torch.device(device)
        model, tok = load_pretrained(str(pretrained), dtype=dtype, quiet=True)
        cfg = model.config
        n_layers = int(getattr(cfg, "num_hidden_layers", 0) or 0)
        enc, idx = parse_encoding(encoding, layers, n_layers)
        if enc is None and options:
            raise ConfigError(
                f"--model_args {', '.join(f'{k}=' for k in options)}: encoding options, but no encoding= was given"
            )
        if enc is not None:
            model = patch(model, enc, layers=idx, path=path, **options)
        self.model = model.to(self._device).eval()
        self.tokenizer = tok
        params = getattr(cfg, "rope_parameters", None) or {}
        self.trained_length = int(params.get("original_max_position_embeddings") or cfg.max_position_embeddings)
        if max_length is None:
            factor = options.get("factor", 1) if enc is not None else 1
            max_length = int(self.trained_length * float(factor))
        max_length = _number(max_length)
        if not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < 2:
            raise ConfigError(f"--model_args max_length={max_length!r}: an integer of at least 2 was expected")
        self._max_length = max_length
        self.batch_size_per_gpu = _batch(batch_size, "batch_size")
        self.encoding = enc
        self.options = options

    # ----------------------------------------------------------------------------------------------- properties
    @property
    def eot_token_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return 256

    @property
    def batch_size(self) -> int:
        return self.batch_size_per_gpu

    @property
    def device(self) -> Any:
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "posenc")).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """Token ids of ``string``, without special tokens unless asked (as the harness's HFLM does)."""
        return list(self.tokenizer(string, add_special_tokens=bool(add_special_tokens)).input_ids)

    def tok_decode(self, tokens: Iterable[int]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=False)

    # ----------------------------------------------------------------------------------------------- scoring
    def _logprobs(self, rows: list[list[int]]) -> Any:
        """Log-softmax of the model's logits for right-padded ``rows`` (causal: the padding changes nothing
        before it)."""
        import torch

        width = max(len(r) for r in rows)
        pad = self.eot_token_id
        ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.long, device=self._device)
        with torch.no_grad():
            logits = self.model(input_ids=ids).logits
        return torch.log_softmax(logits.float(), dim=-1)

    def _loglikelihood_tokens(
        self,
        requests: list[tuple[tuple[str, str] | tuple[None], list[int], list[int]]],
        disable_tqdm: bool = False,
        **kwargs: Any,
    ) -> list[tuple[float, bool]]:
        """``(sum of log p(continuation | context), whether greedy decoding gives it)`` per request: the last
        ``max_length`` tokens of context + continuation (less the last) are the input, as HFLM does."""
        import torch

        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1] + requests[i][2]))
        out: list[tuple[float, bool] | None] = [None] * len(requests)
        starts = range(0, len(order), self.batch_size)
        for start in tqdm(starts, desc="posenc: loglikelihood", disable=disable_tqdm or len(starts) < 2):
            chunk = order[start : start + self.batch_size]
            rows = []
            for i in chunk:
                _, ctx, cont = requests[i]
                if not cont:
                    raise ConfigError("a loglikelihood request with an empty continuation")
                rows.append((ctx + cont)[-(self.max_length + 1) :][:-1])
            logp = self._logprobs(rows)
            for row_i, i in enumerate(chunk):
                key, _, cont = requests[i]
                n = len(rows[row_i])
                part = logp[row_i, n - len(cont) : n]
                target = torch.tensor(cont, dtype=torch.long, device=part.device)
                total = float(part.gather(-1, target[:, None]).sum())
                greedy = bool((part.argmax(-1) == target).all())
                out[i] = (total, greedy)
                if key is not None and key[0] is not None:
                    self.cache_hook.add_partial("loglikelihood", key, (total, greedy))
        return [o for o in out if o is not None]

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of each whole string: disjoint windows of ``max_length`` tokens (the first one after
        the end-of-text token), each conditioned on the window before it, as the harness's HFLM does."""
        windows: list[tuple[tuple[None], list[int], list[int]]] = []
        owner: list[int] = []
        for n, req in enumerate(requests):
            (string,) = req.args
            pieces = get_rolling_token_windows(
                token_list=self.tok_encode(string),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            for ctx, cont in map(make_disjoint_window, pieces):
                windows.append(((None,), ctx, cont))
                owner.append(n)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=True)
        totals = [0.0] * len(requests)
        for n, (score, _) in zip(owner, scores):
            totals[n] += score
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations, cut before the first of ``until`` (default the end-of-text token), at most
        ``max_gen_toks`` tokens; the context is its last ``max_length - max_gen_toks`` tokens."""
        import torch

        order = sorted(range(len(requests)), key=lambda i: -len(self.tok_encode(requests[i].args[0])))
        out: list[str] = [""] * len(requests)
        eos = self.tok_decode([self.eot_token_id])
        for i in tqdm(order, desc="posenc: generate_until", disable=disable_tqdm):
            context, gen = requests[i].args
            gen = dict(gen or {})
            until = gen.pop("until", None) or []
            if isinstance(until, str):
                until = [until]
            until = list(until)
            if eos not in until:
                until.append(eos)
            max_gen = int(gen.pop("max_gen_toks", self.max_gen_toks))
            ids = self.tok_encode(context)[-max(1, self.max_length - max_gen) :]
            input_ids = torch.tensor([ids], dtype=torch.long, device=self._device)
            with torch.no_grad():
                produced = self.model.generate(
                    input_ids=input_ids,
                    attention_mask=torch.ones_like(input_ids),
                    max_new_tokens=max_gen,
                    do_sample=False,
                    stopping_criteria=_stop_at(self.tokenizer, len(ids), until),
                    pad_token_id=self.eot_token_id,
                )
            text = self.tok_decode(produced[0, len(ids) :].tolist())
            for stop in until:
                if stop:
                    text = text.split(stop)[0]
            out[i] = text
            self.cache_hook.add_partial("generate_until", (context, requests[i].args[1]), text)
        return out


def main(argv: list[str] | None = None) -> None:
    """Run the harness's own CLI (``lm_eval ...``) with ``posenc`` registered; ``argv`` as ``sys.argv[1:]``."""
    import sys

    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0] if sys.argv else "lm_eval", *argv]
    cli_evaluate()
