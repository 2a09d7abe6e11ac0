"""Issue 40: nothing silent on the new surfaces. Bad and edge inputs on ``posenc.hf.load_pretrained``, ``posenc
extend`` (its flags and :class:`ExtendConfig`), the native kernels' settings and cache, and ``posenc bench --task
text`` / ``--report-only``: each is a clear error that names the value and what would be right (the words listed
with the case), or the right behaviour (checked against what a whole, correct input gives).

The command lines run in this process (``posenc.cli.main``); model files are tiny ones written here
(tests/tiny_gguf.py), never a download: a hub lookup goes to a closed local port. With the native kernels on or
off (``POSENC_NATIVE=0``) alike: every case that reads ``POSENC_NATIVE`` sets it itself.
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from posenc import native, settings
from posenc.errors import ConfigError


def _says(text: str, words: list[str]) -> None:
    for w in words:
        assert w in text, f"{w!r} not in: {text}"


def _cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """``posenc ARGV`` in this process: (exit status, stdout, stderr); an argparse usage error included."""
    from posenc.cli import main

    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse: a usage error
        rc = exc.code
    got = capsys.readouterr()
    return int(rc or 0), got.out, got.err


# ============================================================================== the shared helpers (posenc.settings)
@pytest.mark.parametrize(
    "value, default, want",
    [
        ("1", False, True), ("true", False, True), ("YES", False, True), (" on ", False, True),
        ("0", True, False), ("False", True, False), ("no", True, False), ("OFF", True, False),
        ("", True, True), ("", False, False), ("  ", True, True),
    ],
)
def test_env_flag_takes_the_yes_no_words(value, default, want):
    assert settings.env_flag("POSENC_X", default, environ={"POSENC_X": value}) is want
    assert settings.env_flag("POSENC_X", default, environ={}) is default


@pytest.mark.parametrize("value", ["maybe", "2", "-1", "onn", "banana", "y", "tru", "0.0", "enabled"])
def test_env_flag_refuses_anything_else_naming_it(value):
    with pytest.raises(ConfigError) as err:
        settings.env_flag("POSENC_X", True, environ={"POSENC_X": value})
    _says(str(err.value), [f"POSENC_X={value!r}", "yes/no", "1, true, yes, on", "0, false, no, off", "unset it"])


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda: settings.positive_int("--threads", 0), ["--threads", ">= 1", "got 0"]),
        (lambda: settings.positive_int("--threads", -3), ["--threads", "got -3"]),
        (lambda: settings.positive_int("--threads", 2.5), ["--threads", "whole number", "got 2.5"]),
        (lambda: settings.positive_int("--threads", True), ["--threads", "got True"]),
        (lambda: settings.positive_int("--threads", "4"), ["--threads", "got '4'"]),
        (lambda: settings.positive_int("--threads", float("nan")), ["--threads", "got nan"]),
        (lambda: settings.whole("n", 11, low=0, high=10), ["n", "in [0, 10]", "got 11"]),
        (lambda: settings.number("x", float("nan"), low=1), ["x", "finite", ">= 1", "got nan"]),
        (lambda: settings.number("x", float("inf")), ["x", "finite", "got inf"]),
        (lambda: settings.number("x", 0.0, low=0, low_open=True), ["x", "> 0", "got 0.0"]),
        (lambda: settings.number("x", None), ["x", "got None"]),
        (lambda: settings.number("x", "1.5"), ["x", "got '1.5'"]),
        (lambda: settings.fraction("depth", 1.01), ["depth", ">= 0 and <= 1", "got 1.01"]),
        (lambda: settings.nonempty_text("--model", "  ", "a name"), ["--model", "a name", "got '  '"]),
        (
            lambda: settings.env_choice("POSENC_ISA", ("a", "b"), "a", environ={"POSENC_ISA": "c"}),
            ["POSENC_ISA='c'", "a, b"],
        ),
    ],
)
def test_the_checks_name_the_option_the_value_and_the_range(call, words):
    with pytest.raises(ConfigError) as err:
        call()
    _says(str(err.value), words)


def test_the_checks_give_back_good_values():
    assert settings.positive_int("n", 4.0) == 4 and type(settings.positive_int("n", 4.0)) is int
    assert settings.whole("n", 0) == 0
    assert settings.number("x", 3) == 3.0 and settings.fraction("x", 1) == 1.0
    assert settings.env_choice("V", ("a", "b"), "a", environ={"V": " B "}) == "b"


# ============================================================================== native kernels: settings and cache
@pytest.fixture
def fresh_native(monkeypatch):
    """The kernels' loader as if in a new process (its state restored afterwards)."""
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setattr(native, "enabled", True)
    return monkeypatch


@pytest.mark.parametrize("value", ["maybe", "2", "of", "disabled"])
def test_posenc_native_that_is_not_yes_or_no_is_an_error_not_off(fresh_native, value):
    from posenc import runenv

    fresh_native.setenv("POSENC_NATIVE", value)
    with pytest.raises(ConfigError) as err:
        native.available()
    _says(str(err.value), [f"POSENC_NATIVE={value!r}", "yes/no", "0, false, no, off"])
    with pytest.raises(ConfigError):
        native.status()  # what `posenc info` prints: the same error, not "on"
    # a run's record says why, in words
    assert f"POSENC_NATIVE={value!r}" in runenv.kernel_path()


@pytest.mark.parametrize("value", ["0", "off", " NO ", "False"])
def test_posenc_native_off_words_turn_the_kernels_off(fresh_native, value):
    fresh_native.setenv("POSENC_NATIVE", value)
    assert native.available() is False
    assert "disabled by POSENC_NATIVE" in native.status()


@pytest.mark.parametrize("value", ["avx3", "AVX-2", "sse"])
def test_posenc_native_isa_that_names_no_build_is_an_error(fresh_native, value):
    fresh_native.setenv("POSENC_NATIVE", "1")
    fresh_native.setenv("POSENC_NATIVE_ISA", value)
    with pytest.raises(ConfigError) as err:
        native.available()
    _says(str(err.value), [f"POSENC_NATIVE_ISA={value.lower()!r}", "auto, baseline, avx2, avx512, native"])


def test_posenc_portable_that_is_not_yes_or_no_is_an_error_at_import():
    env = {**os.environ, "POSENC_PORTABLE": "banana", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", "import posenc.attention"], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode != 0
    _says(r.stderr, ["ConfigError", "POSENC_PORTABLE='banana' is not a yes/no setting", "unset it (default: off)"])


def test_a_cc_that_is_not_found_is_said_not_passed_over(monkeypatch, capsys):
    from posenc.native import builds

    monkeypatch.setenv("CC", "/no/such-cc")
    got = builds._compiler()
    assert got != "/no/such-cc"
    _says(capsys.readouterr().err, ["CC='/no/such-cc' is not found on PATH"])


needs_cc = pytest.mark.skipif(native._compiler() is None, reason="no C compiler on this machine")


@needs_cc
def test_a_truncated_cached_build_is_built_again_not_loaded(tmp_path, monkeypatch, capsys):
    """Loading a truncated .so can kill the process (a bus error); a build whose SHA-256 is not the one written
    beside it is compiled again, saying so; one cached without a digest (an older posenc's) is compiled again
    quietly."""
    import ctypes

    from posenc.native import builds

    monkeypatch.setenv("POSENC_CACHE_DIR", str(tmp_path))
    cc = native._compiler()
    lib, why = builds._compile(cc, "baseline")
    assert lib is not None, why
    whole = lib.read_bytes()
    lib.write_bytes(whole[: len(whole) // 2])
    again, _ = builds._compile(cc, "baseline")
    assert again == lib and lib.read_bytes() == whole and builds._intact(lib)
    _says(capsys.readouterr().err, [str(lib), "damaged", "rebuilding"])
    copy = tmp_path / "copy" / lib.name  # loaded from a copy: this test damages the cached file again below, and
    copy.parent.mkdir()  # a file of this process's mappings cut in place would end it with a bus error
    shutil.copy(lib, copy)
    ctypes.CDLL(str(copy)).posenc_populate  # noqa: B018 -- loads, and has the kernels' symbols
    lib.with_name(lib.name + ".sha256").unlink()
    lib.write_bytes(whole[:100])
    builds._compile(cc, "baseline")
    assert lib.read_bytes() == whole and capsys.readouterr().err == ""


@needs_cc
def test_a_cache_dir_that_is_a_file_falls_back_saying_so(tmp_path, monkeypatch, capsys):
    import tempfile

    from posenc.native import builds

    (tmp_path / "afile").write_text("x")
    monkeypatch.setenv("POSENC_CACHE_DIR", str(tmp_path / "afile"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    lib, why = builds._compile(native._compiler(), "baseline")
    assert lib is not None and lib.parent.parent == tmp_path / "tmp", why
    _says(capsys.readouterr().err, ["could not build in", "afile", "built the baseline kernels in"])


# ============================================================================== posenc extend: flags and ExtendConfig
@pytest.fixture
def no_model(monkeypatch):
    """Every case below is refused before a model is loaded: loading one fails the test."""
    from posenc import pretrained

    def refuse(*a, **k):
        raise AssertionError("a model was loaded for a command that should have been refused")

    monkeypatch.setattr(pretrained, "load_pretrained", refuse)


EXTEND_CASES = [
    (["--loss-extension", "0"], ["--loss-extension", "got 0.0", ">= 1", "multiple of the trained length"]),
    (["--loss-extension", "nan"], ["--loss-extension", "finite", "got nan"]),
    (["--loss-extension", "inf"], ["--loss-extension", "got inf"]),
    (["--loss-extension", "-2"], ["--loss-extension", "got -2.0"]),
    (["--loss-extension", "0.5"], ["--loss-extension", "got 0.5", ">= 1"]),
    (["--loss-extension", "x"], ["--loss-extension", "invalid float value: 'x'"]),
    (["--passkey-lengths", "0"], ["--passkey-lengths", "got 0.0", ">= 0.125"]),
    (["--passkey-lengths", "1", "nan"], ["--passkey-lengths", "got nan"]),
    (["--passkey-lengths", "inf"], ["--passkey-lengths", "got inf"]),
    (["--passkey-lengths", "0.01"], ["--passkey-lengths", "got 0.01", "no room for the prompt"]),
    (["--passkey-lengths", "2", "2"], ["--passkey-lengths", "2 more than once"]),
    (["--passkey-depths", "1.5"], ["--passkey-depths", ">= 0 and <= 1", "got 1.5"]),
    (["--passkey-depths", "nan"], ["--passkey-depths", "got nan"]),
    (["--passkey-depths", "-0.1"], ["--passkey-depths", "got -0.1"]),
    (["--passkey-depths", "0.5", "0.5"], ["--passkey-depths", "0.5 more than once"]),
    (["--chunk", "0"], ["--chunk", ">= 1", "got 0"]),
    (["--chunk", "-5"], ["--chunk", "got -5"]),
    (["--chunk", "1.5"], ["--chunk", "invalid int value: '1.5'"]),
    (["--threads", "0"], ["--threads", ">= 1", "got 0"]),
    (["--threads", "-1"], ["--threads", "got -1"]),
    (["--threads", "two"], ["--threads", "invalid int value: 'two'"]),
    (["--max-cells", "-1"], ["--max-cells", ">= 0", "got -1"]),
    (["--documents", "hamlett"], ["--documents", "'hamlett'", "did you mean hamlet", "lear, ptb-test"]),
    (["--documents", "hamlet", "hamlet"], ["--documents", "'hamlet' more than once"]),
    (["--scalings", "rope-yaarn"], ["--scalings", "'rope-yaarn'", "did you mean rope-yarn", "as-trained"]),
    (["--scalings", "yarn"], ["--scalings", "unknown scaling 'yarn'"]),
    (["--scalings", "as-trained", "as-trained"], ["--scalings", "more than once"]),
    (["--passkey-scalings", "alibi"], ["--passkey-scalings", "'alibi'", "rope-linear"]),
    (["--model", ""], ["--model must be", "a packaged model name", "got ''"]),
    (["--model", "   "], ["--model must be", "got '   '"]),
    (["--no-passkey", "--passkey-depths", "0.5"], ["--no-passkey", "--passkey-depths", "one or the other"]),
    (["--quick", "--full"], ["--full", "not allowed with argument --quick"]),
    (["--out", "{file}"], ["--out", "is a file", "give a folder"]),
    (["--report-only", "--chunk", "5", "--out", "{dir}"], ["--report-only", "--chunk", "would change nothing"]),
    (["--report-only", "--threads", "2", "--loss-extension", "2", "--out", "{dir}"], ["--loss-extension, --threads"]),
    (["--report-only", "--out", "{dir}"], ["extend.jsonl holds no cells", "run posenc extend first"]),
]


@pytest.mark.parametrize("argv, words", EXTEND_CASES, ids=[" ".join(a) for a, _ in EXTEND_CASES])
def test_extend_flags(argv, words, tmp_path, capsys, no_model):
    (tmp_path / "afile").write_text("x")
    argv = [a.replace("{file}", str(tmp_path / "afile")).replace("{dir}", str(tmp_path / "empty")) for a in argv]
    rc, _, err = _cli(["extend", *argv], capsys)
    assert rc == 2, err
    _says(err, words)
    assert "Traceback" not in err


CONFIG_CASES = [
    (dict(loss_extension=float("nan")), ["ExtendConfig.loss_extension", "got nan"]),
    (dict(loss_short=0), ["ExtendConfig.loss_short", "got 0"]),
    (dict(loss_extension="4"), ["ExtendConfig.loss_extension", "got '4'"]),
    (dict(passkey_lengths=(1.0, math.inf)), ["ExtendConfig.passkey_lengths", "got inf"]),
    (dict(passkey_lengths=2.0), ["ExtendConfig.passkey_lengths", "tuple of numbers", "got 2.0"]),
    (dict(passkey_depths=(None,)), ["ExtendConfig.passkey_depths", "got None"]),
    (dict(documents="hamlet"), ["ExtendConfig.documents", "tuple of documents", "('hamlet',)"]),
    (dict(scalings="rope-yarn"), ["ExtendConfig.scalings", "('rope-yarn',)"]),
    (dict(scalings=("rope-yarn", 2)), ["ExtendConfig.scalings", "2 is not a name"]),
    (dict(loss_long_scalings=("rope-yaarn",)), ["ExtendConfig.loss_long_scalings", "did you mean rope-yarn"]),
    (dict(chunk=0), ["ExtendConfig.chunk", ">= 1", "got 0"]),
    (dict(chunk=2.5), ["ExtendConfig.chunk", "got 2.5"]),
    (dict(chunk=True), ["ExtendConfig.chunk", "got True"]),
    (dict(seed=-1), ["ExtendConfig.seed", ">= 0", "got -1"]),
    (dict(model=None), ["ExtendConfig.model", "got None"]),
    (dict(documents=()), ["documents is empty"]),
    (dict(passkey_lengths=()), ["passkey_lengths or passkey_depths is empty"]),
    (dict(scalings=(), passkey_scalings=()), ["plans no cells"]),
]


@pytest.mark.parametrize("change, words", CONFIG_CASES, ids=[str(c) for c, _ in CONFIG_CASES])
def test_extend_config_fields(change, words):
    from dataclasses import replace

    from posenc.extend.config import FULL

    with pytest.raises(ConfigError) as err:
        replace(FULL, **change)
    _says(str(err.value), words)


def test_extend_good_flags_are_taken_including_the_edges(capsys):
    """The right behaviour at the edges: --loss-extension 1 (the trained length), depths 0 and 1, --chunk 1."""
    from posenc.cli import build_parser
    from posenc.extend.cli import config_from

    args = build_parser().parse_args(
        ["extend", "--loss-extension", "1", "--passkey-depths", "0", "1", "--chunk", "1", "--passkey-lengths", "0.5"]
    )
    cfg = config_from(args)
    assert (cfg.loss_short, cfg.loss_extension, cfg.passkey_depths, cfg.chunk) == (1.0, 1.0, (0.0, 1.0), 1)
    assert cfg.loss_long_scalings == () and cfg.passkey_lengths == (0.5,)


def test_a_damaged_store_line_is_named_and_skipped_not_blamed_on_another_model(tmp_path, capsys):
    from posenc.extend.runner import Store

    good = {"key": "loss|d|as-trained|1|64", "kind": "loss", "model": {"name": "m", "sha256": "ab"}}
    lines = [
        json.dumps(good).encode(),
        b'{"key": "loss|d|rope-yarn|2|128", "kind": "lo',  # cut by an interrupted write
        b"[1, 2, 3]",
        b'{"x": 1}',
        b"null",
        b'{"key": "k", "kind": "loss"}',  # no model's identity
        b"\xff\xfe binary \x00",
        b"",
    ]
    (tmp_path / "extend.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    assert Store(tmp_path).records() == [good]
    err = capsys.readouterr().err
    for i, why in ((2, "not whole JSON"), (3, "not a cell record"), (4, "not a cell record"),
                   (5, "not a cell record"), (6, "without its model's identity"), (7, "not UTF-8")):
        assert f"ignoring line {i} of" in err and why in err, (i, why, err)
    assert "another model" not in err


# ============================================================================== load_pretrained
pytest_hf = pytest.mark.skipif(
    any(__import__("importlib").util.find_spec(m) is None for m in ("transformers", "gguf", "accelerate")),
    reason="needs the real-model extra (transformers, gguf, accelerate)",
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    pytest.importorskip("gguf")
    from tiny_gguf import write

    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write(path, layers=1, hidden=16, heads=2, kv_heads=1, ff=32, context=32)
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("POSENC_DATA", str(tmp_path / "data"))
    return tmp_path / "data" / "models"


def _load(arg, **kw):
    import posenc.hf

    return posenc.hf.load_pretrained(arg, quiet=kw.pop("quiet", True), **kw)


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([[3, 4, 5, 6, 7]])).logits


def _folder(tmp_path: Path, config: str | None, **files: bytes) -> Path:
    d = tmp_path / "folder"
    d.mkdir()
    if config is not None:
        (d / "config.json").write_text(config)
    for name, data in files.items():
        (d / name.replace("__", ".")).write_bytes(data)
    return d


def _saved(tiny: Path, tmp_path: Path) -> Path:
    """A transformers folder saved from the tiny model."""
    model, tok = _load(tiny)
    d = tmp_path / "saved"
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


def _foreign_gguf(tmp_path: Path) -> Path:
    import gguf
    import numpy as np

    path = tmp_path / "foreign.gguf"
    w = gguf.GGUFWriter(str(path), "nosucharch")
    w.add_tensor("x", np.zeros((4,), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _truncated_weights(tiny: Path, tmp_path: Path) -> Path:
    d = _saved(tiny, tmp_path)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    return d


def _no_tokenizer(tiny: Path, tmp_path: Path) -> Path:
    d = _saved(tiny, tmp_path)
    for f in d.glob("tokenizer*"):
        f.unlink()
    return d


LOAD_CASES = [
    ("None", lambda t, d: None, ["name_or_path must be", "a packaged model name", "got None"]),
    ("empty", lambda t, d: "", ["name_or_path must be", "got ''"]),
    ("blank", lambda t, d: "   ", ["got '   '"]),
    ("a number", lambda t, d: 5, ["got 5"]),
    ("bytes", lambda t, d: b"smollm2-135m", ["got b'smollm2-135m'"]),
    ("empty .gguf", lambda t, d: _write(d / "e.gguf", b""), ["e.gguf is empty (0 bytes)", "get it again"]),
    ("not GGUF", lambda t, d: _write(d / "j.gguf", b"<html>nope"), ["j.gguf is not a GGUF file", "b'<htm'"]),
    ("truncated", lambda t, d: _write(d / "t.gguf", t.read_bytes()[: t.stat().st_size // 2]),
     ["t.gguf", "cannot be read as a model", "truncated"]),
    ("only the header", lambda t, d: _write(d / "h.gguf", t.read_bytes()[:24]), ["h.gguf", "cannot be read"]),
    ("foreign architecture", lambda t, d: _foreign_gguf(d), ["foreign.gguf", "cannot be read", "architecture"]),
    ("a .bin", lambda t, d: _write(d / "w.bin", b"\0" * 8), ["w.bin is a file but not a .gguf model"]),
    ("a .safetensors", lambda t, d: _write(d / "m.safetensors", b"{}"), ["not a .gguf model", "transformers folder"]),
    ("folder, no config", lambda t, d: _folder(d, None), ["is a folder without config.json"]),
    ("folder, a .GGUF", lambda t, d: _folder(d, None, m__GGUF=b"GGUF"), ["it holds m.GGUF: pass that file"]),
    ("config not JSON", lambda t, d: _folder(d, "{not json"), ["cannot be loaded as a transformers model", "JSON"]),
    ("config empty", lambda t, d: _folder(d, ""), ["cannot be loaded as a transformers model", "config.json"]),
    ("config a list", lambda t, d: _folder(d, "[1, 2]"), ["cannot be loaded", "model_type"]),
    ("unknown model_type", lambda t, d: _folder(d, '{"model_type": "nosuchmodel"}'), ["nosuchmodel"]),
    ("no weights", lambda t, d: _folder(d, '{"model_type": "llama"}'), ["cannot be loaded", "model.safetensors"]),
    ("truncated weights", _truncated_weights, ["cannot be loaded as a transformers model", "not truncated"]),
    ("no tokenizer", _no_tokenizer, ["its tokenizer cannot be loaded", "tokenizer.save_pretrained"]),
    ("missing ./x.gguf", lambda t, d: "./no-such.gguf", ["no-such.gguf: no such file or folder"]),
    ("missing x.gguf", lambda t, d: "no-such.gguf", ["no-such.gguf: no such file or folder"]),
    ("missing a/b/c", lambda t, d: "a/b/c", ["a/b/c: no such file or folder"]),
    ("missing ~/x", lambda t, d: "~/no-such-posenc-model", ["no such file or folder"]),
    ("not a hub id", lambda t, d: "my model", ["'my model' is not a packaged model", "not a hub id either"]),
    ("a slip of the packaged name", lambda t, d: "smollm2-135", ["Did you mean 'smollm2-135m'"]),
    ("a hub id, no hub", lambda t, d: "no-such-org/no-such-model", ["no hub can be reached", "smollm2-135m"]),
]


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


@pytest.fixture
def no_hub(monkeypatch):
    """The hub's address is a closed local port (nothing is ever downloaded), and it is not offline by setting."""
    constants = pytest.importorskip("huggingface_hub.constants")
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    for v in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY"):
        monkeypatch.delenv(v, raising=False)
    return port


@pytest_hf
@pytest.mark.parametrize("label, make, words", LOAD_CASES, ids=[c[0] for c in LOAD_CASES])
def test_load_pretrained_bad_inputs(label, make, words, tiny, tmp_path, cache, no_hub):
    arg = make(tiny, tmp_path)
    t0 = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        _load(arg)
    _says(str(err.value), words)
    assert time.perf_counter() - t0 < 20  # a hub id with no hub: seconds, not a minute of retries
    # nothing half-written is left in the cache
    assert not cache.exists() or [p.name for p in cache.iterdir() if p.name.startswith(".")] == []


@pytest_hf
def test_hub_unreachable_says_why_in_seconds(no_hub, monkeypatch):
    import huggingface_hub.constants

    from posenc import pretrained

    t0 = time.perf_counter()
    why = pretrained.hub_unreachable()
    assert why is not None and f"127.0.0.1:{no_hub} cannot be reached" in why
    assert time.perf_counter() - t0 < pretrained.HUB_TIMEOUT + 1
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert pretrained.hub_unreachable() == "HF_HUB_OFFLINE is set"


@pytest_hf
@pytest.mark.parametrize("dtype", ["float33", "fp16", 16, "torch.float32"])
def test_load_pretrained_bad_dtype(dtype, tiny, cache):
    with pytest.raises(ConfigError) as err:
        _load(tiny, dtype=dtype)
    _says(str(err.value), ["dtype must be", repr(dtype), "bfloat16"])


@pytest_hf
def test_an_upper_case_gguf_suffix_loads_the_same_model(tiny, tmp_path, cache):
    upper = _write(tmp_path / "TINY.GGUF", tiny.read_bytes())
    a, _ = _load(tiny)
    b, tok = _load(upper)
    assert torch.equal(_logits(a), _logits(b))
    assert tok.decode(tok("the sky", add_special_tokens=False)["input_ids"]) == "the sky"


@pytest_hf
@pytest.mark.parametrize(
    "damage, says",
    [
        (lambda f: (f / "posenc-model.json").write_text("{not json"), "no readable posenc-model.json"),
        (lambda f: (f / "posenc-model.json").unlink(), "no readable posenc-model.json"),
        (lambda f: (f / "posenc-model.json").write_text('{"sha256": "0000"}'), "records another file"),
        (lambda f: (f / "model.safetensors").write_bytes(b"\0" * 10), "cannot be loaded"),
        (lambda f: (f / "model.safetensors").unlink(), "cannot be loaded"),
        (lambda f: (f / "config.json").write_text(""), "cannot be loaded"),
    ],
    ids=["identity damaged", "identity gone", "identity of another file", "weights damaged", "weights gone",
         "config empty"],
)
def test_a_damaged_cache_is_converted_again(damage, says, tiny, cache, capsys):
    first, _ = _load(tiny)
    want = _logits(first)
    folder = next(p for p in cache.iterdir() if not p.name.startswith("."))
    damage(folder)
    again, _ = _load(tiny, quiet=False)
    err = capsys.readouterr().err
    _says(err, [str(folder), says, "converting again"])
    assert torch.equal(_logits(again), want)
    assert json.loads((folder / "posenc-model.json").read_text())["sha256"] == again.posenc_identity["sha256"]


@pytest_hf
def test_a_cache_folder_that_cannot_be_written_is_named(tiny, tmp_path, monkeypatch):
    (tmp_path / "afile").write_text("x")
    monkeypatch.setenv("POSENC_DATA", str(tmp_path / "afile"))
    with pytest.raises(ConfigError) as err:
        _load(tiny)
    _says(str(err.value), ["cannot write the converted model into", "afile", "set POSENC_DATA to a writable folder"])


@pytest_hf
def test_a_full_disk_is_named_and_leaves_nothing(tiny, cache, monkeypatch):
    import transformers

    def full(self, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", full)
    with pytest.raises(ConfigError) as err:
        _load(tiny)
    _says(str(err.value), ["no space left on the disk of", str(cache), "MB", "POSENC_DATA"])
    assert list(cache.iterdir()) == []


def _damage(folder: Path, name: str, data: bytes) -> Path:
    (folder / name).write_bytes(data)
    return folder


def _patched_save(tiny: Path, tmp_path: Path) -> Path:
    import posenc.hf

    model, _ = _load(tiny)
    posenc.hf.patch(model, "alibi")
    d = tmp_path / "patched"
    posenc.hf.save_pretrained(model, d)
    return d


CHECKPOINT_CASES = [
    ("None", lambda d: None, ["directory must be a folder", "got None"]),
    ("empty", lambda d: "", ["got ''"]),
    ("missing", lambda d: d / "no-such", ["no-such: no such folder"]),
    ("a file", lambda d: _write(d / "f", b"x"), ["no such folder"]),
    ("config damaged", lambda d: _damage(d, "config.json", b"{bad"),
     ["cannot be loaded by AutoModelForCausalLM", "config.json", "save_pretrained wrote them"]),
    ("weights truncated", lambda d: _damage(d, "model.safetensors", (d / "model.safetensors").read_bytes()[:100]),
     ["cannot be loaded by AutoModelForCausalLM", "SafetensorError"]),
    ("posenc.json binary", lambda d: _damage(d, "posenc.json", b"\xff\xfe\0"), ["posenc.json is damaged"]),
    ("encoding weights empty", lambda d: _damage(d, "posenc_encoding.pt", b""),
     ["posenc_encoding.pt cannot be read as the encoding's parameters", "copy it again"]),
]


@pytest_hf
@pytest.mark.parametrize("label, make, words", CHECKPOINT_CASES, ids=[c[0] for c in CHECKPOINT_CASES])
def test_posenc_hf_from_pretrained_bad_folders(label, make, words, tiny, tmp_path, cache):
    from transformers import AutoModelForCausalLM

    import posenc.hf

    folder = _patched_save(tiny, tmp_path)
    with pytest.raises(ConfigError) as err:
        posenc.hf.from_pretrained(AutoModelForCausalLM, make(folder))
    _says(str(err.value), words)


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest_hf
def test_a_killed_conversion_s_leftovers_are_removed_once_its_process_is_gone(tiny, cache, capsys):
    from posenc import pretrained

    cache.mkdir(parents=True)
    host = pretrained._host()
    dead = cache / f".tiny-0123456789abcdef~tmp~{host}~{_dead_pid()}~x1"
    alive = cache / f".tiny-0123456789abcdef~tmp~{host}~{os.getppid()}~x2"
    elsewhere = cache / f".tiny-0123456789abcdef~tmp~another-host~{_dead_pid()}~x3"
    legacy_old = cache / ".tiny-0123456789abcdef-abcd1234"
    legacy_new = cache / ".tiny-0123456789abcdef-efgh5678"
    for d in (dead, alive, elsewhere, legacy_old, legacy_new):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"\0" * 2_000_000)
    old = time.time() - 2 * pretrained.LEGACY_STALE_S
    os.utime(legacy_old, (old, old))
    _load(tiny, quiet=False)
    err = capsys.readouterr().err
    assert not dead.exists() and not legacy_old.exists()
    assert alive.exists() and elsewhere.exists() and legacy_new.exists()  # running, another machine's, or fresh
    _says(err, [f"removed {dead} (2 MB)", "half-written", f"process {dead.name.split('~')[3]}", "an older posenc"])


# ============================================================================== bench: --task text, --report-only
def _data(tmp_path: Path, name: str, data: bytes) -> str:
    p = tmp_path / name
    p.write_bytes(data)
    return str(p)


BENCH_CASES = [
    (lambda d: ["--data", _data(d, "b.bin", b"abc\0def\n" * 50)], ["--data", "binary file", "NUL byte at byte 3"]),
    (lambda d: ["--data", _data(d, "l1.txt", "first line\ncaf\xe9 au lait\n".encode("latin-1") * 30)],
     ["--data", "is not UTF-8 text", "byte 14, line 2", "b'\\xe9'", "iconv"]),
    (lambda d: ["--data", _data(d, "e.txt", b"")], ["--data", "is empty", "give a text"]),
    (lambda d: ["--data", _data(d, "w.txt", b" \n\t\n ")], ["--data", "only white space"]),
    (lambda d: ["--data", str(d)], ["--data", "is a folder", "UTF-8 text file"]),
    (lambda d: ["--data", str(d / "missing.txt")], ["--data", "no such file", "missing.txt"]),
    (lambda d: ["--tokenizer", "x"], ["--tokenizer goes with --data"]),
    (lambda d: ["--data", _data(d, "ok.txt", b"hi\n" * 50), "--task", "order"], ["--data is a file for task 'text'"]),
    (lambda d: ["--task", "order", "--workers", "0"], ["--workers must be an integer >= 1, got 0"]),
    (lambda d: ["--task", "order", "--steps", "0"], ["--steps must be an integer >= 1, got 0"]),
    (lambda d: ["--task", "order", "--seeds", "-1"], ["--seeds must be integers >= 0, got -1"]),
    (lambda d: ["--task", "order", "--test-lengths", "0"], ["--test-lengths must be integers >= 1, got 0"]),
    (lambda d: ["--task", "order", "--steps", "x"], ["--steps", "invalid int value: 'x'"]),
]


@pytest.mark.parametrize("make, words", BENCH_CASES, ids=[f"bench-{i}" for i in range(len(BENCH_CASES))])
def test_bench_bad_inputs(make, words, tmp_path, capsys):
    rc, out, err = _cli(["bench", *make(tmp_path), "--out", str(tmp_path / "out"), "--quiet"], capsys)
    assert rc == 2, out + err
    _says(err, words)
    assert not (tmp_path / "out" / "results.sqlite").exists()  # refused before any run


def test_text_with_a_byte_order_mark_is_read_without_it(tmp_path):
    from posenc.bench.tasks.text import encoded_text, read_text_file

    text = "a plain text\n" * 40
    p = _data(tmp_path, "bom.txt", b"\xef\xbb\xbf" + text.encode())
    assert read_text_file(p) == text
    size, streams, unit = encoded_text(p, "", "")
    assert size == len(set(text[: int(0.9 * len(text))])) + 2 and unit == "characters"


@pytest_hf
def test_a_tokenizer_hub_id_with_no_hub_fails_in_seconds(no_hub):
    from posenc.bench.tasks.text import load_tokenizer

    t0 = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        load_tokenizer("no-such-org/no-such-tokenizer")
    _says(str(err.value), ["--tokenizer no-such-org/no-such-tokenizer", "no hub can be reached", "local"])
    assert time.perf_counter() - t0 < 20


@pytest.fixture(scope="module")
def bench_store(tmp_path_factory):
    """A store of two runs picked by --task/--encodings (their suite is "runs", not a built-in one)."""
    from posenc.cli import main

    out = tmp_path_factory.mktemp("bench") / "runs"
    argv = ["bench", "--task", "order", "--encodings", "rope", "alibi", "--seeds", "0", "--steps", "1", "--quiet",
            "--out", str(out)]
    assert main(argv) == 0
    return out


def test_report_only_without_the_flags_reports_every_stored_run(bench_store, capsys):
    capsys.readouterr()
    before = json.loads((bench_store / "leaderboard.json").read_text())
    rc, out, err = _cli(["bench", "--report-only", "--out", str(bench_store)], capsys)
    assert rc == 0, err
    _says(out, ["2 runs in", "reported as stored", "| rope |", "| alibi |"])
    after = json.loads((bench_store / "leaderboard.json").read_text())
    assert after == before  # the same leaderboard as the run wrote, not "0 finished runs"


def test_report_only_with_flags_that_select_none_of_the_stored_runs_is_refused(bench_store, capsys):
    board = (bench_store / "leaderboard.md").read_text()
    rc, _, err = _cli(["bench", "--report-only", "--out", str(bench_store), "--encodings", "t5"], capsys)
    assert rc == 2
    _says(err, ["none of the", "runs of suite", "which holds 2 runs (of runs)", "give the flags that ran them",
                "not rewritten"])
    assert (bench_store / "leaderboard.md").read_text() == board


def test_report_only_of_an_empty_folder_says_so(tmp_path, capsys):
    rc, _, err = _cli(["bench", "--report-only", "--out", str(tmp_path / "none")], capsys)
    assert rc == 0
    _says(err, ["warning: --report-only", "holds no runs, so the report is empty"])


def test_report_only_of_a_copied_store_gives_the_same_numbers(bench_store, tmp_path, capsys):
    """The right behaviour, against the run's own record: a store copied elsewhere reports the same rows."""
    for f in bench_store.glob("results.sqlite*"):  # the database and its write-ahead log
        shutil.copy(f, tmp_path / f.name)
    rc, _, _ = _cli(["bench", "--report-only", "--out", str(tmp_path)], capsys)
    assert rc == 0
    assert json.loads((tmp_path / "leaderboard.json").read_text()) == json.loads(
        (bench_store / "leaderboard.json").read_text()
    )
