"""posenc.analysis pictures: every plotted file exists, is a valid, non-empty image, and shows what it claims.

Independent truths: T5's buckets from HF transformers' ``T5Attention._relative_position_bucket``
(the grouping of offsets must be the same partition), and RoFormer's relative upper bound
``(1/(d/2)) Σ_j |Σ_{i<j} e^{i k θ_i}|`` computed with a plain Python loop (tolerance 1e-9).
"""

from __future__ import annotations

import argparse
import cmath
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

pytest.importorskip("matplotlib")

from posenc.analysis import Probe  # noqa: E402
from posenc.analysis.cli import add_parser, run  # noqa: E402
from posenc.analysis.plots import offset_groups, plot, roformer_bound  # noqa: E402
from posenc.analysis.report import gallery, inspect  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SMALL = dict(dim=16, heads=2, length=32)


def assert_valid_png(path: Path) -> None:
    from matplotlib.image import imread

    assert path.exists() and path.stat().st_size > 1000, path
    assert path.read_bytes()[:8] == PNG_MAGIC, path
    img = imread(path)
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
    assert float(img[..., :3].std()) > 0.01, f"{path} is blank"  # something was drawn


def assert_valid_svg(path: Path) -> None:
    assert path.exists() and path.stat().st_size > 1000, path
    root = ET.parse(path).getroot()
    assert root.tag.endswith("svg")
    assert len(list(root.iter())) > 20  # has drawn elements


def test_absolute_pictures(tmp_path):
    got = plot("sinusoidal", tmp_path, **SMALL)
    assert set(got) == {"code", "dot", "scores", "buckets", "decay", "phase"}
    for name in ("code", "dot"):
        assert isinstance(got[name], list), got[name]
        assert_valid_png(tmp_path / f"{name}.png")
        assert_valid_svg(tmp_path / f"{name}.svg")
    for name in ("scores", "buckets", "decay", "phase"):  # do not apply: said, not drawn
        assert isinstance(got[name], str) and got[name].startswith("n/a")
        assert not (tmp_path / f"{name}.png").exists()


def test_attention_pictures(tmp_path):
    got = plot("t5", tmp_path, **SMALL, formats=("png",))
    for name in ("scores", "buckets", "decay"):
        assert isinstance(got[name], list), got[name]
        assert_valid_png(tmp_path / f"{name}.png")
    assert not (tmp_path / "scores.svg").exists()
    got = plot("rope", tmp_path / "rope", **SMALL, formats=("png",))
    assert isinstance(got["decay"], list) and isinstance(got["code"], list)
    assert got["buckets"].startswith("n/a")  # every offset has its own score profile
    assert_valid_png(tmp_path / "rope" / "decay.png")


def test_complex_order_phase_picture(tmp_path):
    got = plot("complex-order", tmp_path, **SMALL, pictures=("phase",), formats=("png", "svg"))
    assert isinstance(got["phase"], list)
    assert_valid_png(tmp_path / "phase.png")
    assert_valid_svg(tmp_path / "phase.svg")


def test_t5_bucket_map_matches_hf_buckets():
    transformers = pytest.importorskip("transformers")
    hf_bucket = transformers.models.t5.modeling_t5.T5Attention._relative_position_bucket
    probe = Probe("t5", dim=16, heads=2, length=64)
    offsets, groups = offset_groups(probe, 256)
    enc = probe.enc
    hf = hf_bucket(offsets, bidirectional=enc.bidirectional, num_buckets=enc.num_buckets, max_distance=enc.max_distance)
    # the same partition of the offsets: a group is one HF bucket and a bucket is one group
    pairs = set(zip(groups.tolist(), hf.tolist()))
    assert len(pairs) == len(set(groups.tolist())) == len(set(hf.tolist()))


def test_roformer_bound_matches_a_loop():
    theta = 10000.0 ** (-torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    k, bound = roformer_bound(theta, 40)
    for kk in (0, 1, 7, 40):
        partial, total = 0j, 0.0
        for t in theta.tolist():
            partial += cmath.exp(1j * kk * t)
            total += abs(partial)
        assert bound[kk].item() == pytest.approx(total / len(theta), abs=1e-9)
    assert bound[0].item() == pytest.approx((len(theta) + 1) / 2)  # Σ_j j / (d/2)


def test_unbuildable_encoding_draws_nothing_and_says_why(tmp_path):
    got = plot("rope", tmp_path, **SMALL, options={"base": 0.5})
    assert all(v.startswith("n/a (cannot build") for v in got.values())
    assert not any(tmp_path.iterdir())


def test_inspect_writes_card_and_pictures(tmp_path):
    report, pics = inspect("alibi", tmp_path / "alibi", **SMALL, formats=("png",))
    card = (tmp_path / "alibi" / "card.md").read_text()
    assert "| Relative only |" in card and "![alibi scores](scores.png)" in card
    assert (tmp_path / "alibi" / "card.html").exists()
    assert_valid_png(tmp_path / "alibi" / "scores.png")


def test_gallery_links_existing_images(tmp_path):
    reports = gallery(tmp_path, names=["sinusoidal", "t5", "rope"], **SMALL, formats=("png",))
    assert [r.name for r in reports] == ["sinusoidal", "t5", "rope"]
    index = (tmp_path / "index.md").read_text()
    links = [line.split("](")[1].rstrip(")") for line in index.splitlines() if line.startswith("![")]
    assert len(links) >= 6
    for link in links:
        assert_valid_png(tmp_path / link)
    html = (tmp_path / "index.html").read_text()
    assert html.count("<img ") == len(links)


def test_cli_inspect_name_writes_pictures(tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="posenc")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        ["inspect", "binary", "--dim", "16", "--length", "32", "--out", str(tmp_path), "--image-format", "png"]
    )
    assert run(args) == 0
    out = capsys.readouterr().out
    assert "== binary ==" in out and "pictures (code, dot)" in out
    assert_valid_png(tmp_path / "code.png")
    assert_valid_png(tmp_path / "dot.png")
    assert not (tmp_path / "code.svg").exists()
