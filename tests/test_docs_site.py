"""The documentation site (mkdocs.yml) carries every page, builds offline, and its link rewriting is right.

``mkdocs build --strict`` itself runs in scripts/test.sh (once, after ruff): it fails on a broken link, a missing
anchor or a docstring the API reference cannot read. Here, without building: the nav names every docs/*.md page
(mkdocs would only log a page left out), nothing in the configuration fetches from the network, the build step is
in the test command, and the hook that rewrites links (docs/_site/hooks.py) gives the targets the file system says.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

yaml = pytest.importorskip("yaml", reason="PyYAML comes with mkdocs (the test extra)")


def _config() -> dict:
    class Loader(yaml.SafeLoader):
        pass

    # mkdocs.yml names a Python function (the toc's slugify) with a !!python tag: read it as its name
    Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: suffix)
    return yaml.load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"), Loader=Loader)


def _nav_pages(nav) -> list[str]:
    out: list[str] = []
    for item in nav:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        out += _nav_pages(value) if isinstance(value, list) else [value]
    return out


def _hooks():
    spec = importlib.util.spec_from_file_location("posenc_site_hooks", DOCS / "_site" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_nav_names_every_page_once():
    nav = _nav_pages(_config()["nav"])
    pages = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md") if "_site" not in p.parts)
    assert sorted(set(nav)) == pages, (
        f"docs pages missing from mkdocs.yml's nav: {sorted(set(pages) - set(nav))}; "
        f"nav entries with no page: {sorted(set(nav) - set(pages))}"
    )
    assert len(nav) == len(set(nav)), "a page is named twice in the nav"


def test_the_site_builds_offline():
    """No web fonts (Material fetches Google Fonts unless theme.font is false) and only plugins that fetch nothing:
    the built-in search and mkdocstrings without inventories."""
    config = _config()
    assert config["theme"]["name"] == "material" and config["theme"]["font"] is False
    plugins = [p if isinstance(p, str) else next(iter(p)) for p in config["plugins"]]
    assert sorted(plugins) == ["mkdocstrings", "search"]
    python = next(p for p in config["plugins"] if isinstance(p, dict))["mkdocstrings"]["handlers"]["python"]
    assert "inventories" not in python and "import" not in python
    assert config["strict"] is True and config["site_dir"] == "site"
    assert "site/" in (ROOT / ".gitignore").read_text().splitlines()


def test_the_test_command_builds_the_site_strictly():
    script = (ROOT / "scripts" / "test.sh").read_text()
    ruff, build = script.index(".venv/bin/ruff check ."), script.index(".venv/bin/mkdocs build --strict")
    assert ruff < build < script.index(".venv/bin/python -m pytest")


def test_every_include_line_names_a_markdown_file_outside_docs():
    hooks = _hooks()
    found = {}
    for page in DOCS.glob("*.md"):
        for file in hooks.includes_of(page.read_text(encoding="utf-8"), page.parent):
            assert file.is_file() and file.suffix == ".md" and not file.is_relative_to(DOCS), (page, file)
            found[file.relative_to(ROOT).as_posix()] = page.name
    assert found == {"README.md": "index.md", "benchmarks/README.md": "benchmarks.md", "CHANGELOG.md": "changelog.md"}


def test_links_are_rewritten_for_the_page_that_shows_them():
    hooks = _hooks()
    included = {ROOT / "README.md": "index.md", ROOT / "benchmarks" / "README.md": "benchmarks.md"}
    extra: set[Path] = set()

    def from_readme(target: str) -> str:  # a link of README.md, shown on index.md
        return hooks.target_for(target, ROOT, "index.md", included, extra)

    assert from_readme("docs/hf.md#support-matrix") == "hf.md#support-matrix"
    assert from_readme("docs/results/img/extend-loss.png") == "results/img/extend-loss.png"
    assert from_readme("benchmarks/README.md#the-machine") == "benchmarks.md#the-machine"
    assert from_readme("mkdocs.yml") == "repo/mkdocs.yml" and extra == {ROOT / "mkdocs.yml"}
    assert from_readme("https://example.org/a.md") == "https://example.org/a.md"
    assert from_readme("#quick-start") == "#quick-start"
    assert from_readme("no/such/file.md") == "no/such/file.md"  # left for mkdocs --strict to report
    assert from_readme("src/posenc/bench/suites/") == "src/posenc/bench/suites/"  # a folder: the same
    # a link of benchmarks/README.md (relative to benchmarks/), shown on benchmarks.md
    assert hooks.target_for("results/cpu-fp32.png", ROOT / "benchmarks", "benchmarks.md", included, extra) == (
        "repo/benchmarks/results/cpu-fp32.png"
    )
    # a docs page's own link out of docs/ (GitHub's), from a page in a sub-folder
    assert hooks.target_for("../../README.md#x", DOCS / "sub", "sub/page.md", included, extra) == "../index.md#x"


def test_links_in_code_are_left_alone():
    hooks = _hooks()
    text = (
        "See [hf](docs/hf.md) and `[not](docs/hf.md)`.\n\n```python\nx = '[a](docs/hf.md)'\n```\n"
        "![pic](docs/img/architecture.svg \"the layers\")\n"
    )
    out = hooks.rewrite_links(text, ROOT, "index.md", {}, set())
    assert out == (
        "See [hf](hf.md) and `[not](docs/hf.md)`.\n\n```python\nx = '[a](docs/hf.md)'\n```\n"
        "![pic](img/architecture.svg \"the layers\")\n"
    )


def test_docstring_rest_is_made_readable():
    hooks = _hooks()
    html = "<p>See :class:<code>~posenc.attention.KVCache</code> and :func:<code>posenc.get</code>.</p>\n"
    html += "<p>.. math:: q_m = R_{\\Theta,m} <em>W</em></p>"
    out = hooks.docstring_html(html)
    assert out == (
        "<p>See <code>KVCache</code> and <code>posenc.get</code>.</p>\n"
        '<pre class="math-source"><code>q_m = R_{\\Theta,m} W</code></pre>'
    )


def test_the_readme_and_the_pages_link_only_to_pages_of_the_site_or_repository_files():
    """Every relative link of README.md resolves (on GitHub) to a file of the repository; the docs pages' own links
    are checked by tests/test_docs_links.py, and on the site by mkdocs --strict."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)", text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        if not (ROOT / target.split("#")[0]).exists():
            broken.append(target)
    assert broken == []
