"""The mkdocs hooks of posenc's documentation site (``hooks:`` in mkdocs.yml).

The pages of docs/ are written for GitHub first: their relative links point at files of the repository, some of
them outside docs/ (``../benchmarks/README.md``, ``../CHANGELOG.md``, an image of ``benchmarks/results/``). The
site carries the same pages and must have no broken link, so these hooks do three things:

* **Includes.** A page may show a Markdown file of the repository that lies outside docs/ with a line of its own,
  ``<!-- include: ../README.md -->`` (the path relative to the page). On GitHub the line is an invisible comment;
  on the site it is replaced by the file's text, with that file's relative links rewritten to work from the page.
  docs/index.md shows README.md this way, docs/benchmarks.md benchmarks/README.md, docs/changelog.md
  CHANGELOG.md: one text, two places, nothing to keep in step.
* **Links out of docs/.** A link to a file that a page includes goes to that page (``../benchmarks/README.md#x``
  -> ``benchmarks.md#x``); a link to any other file of the repository that is not Markdown (an image, a script)
  goes to a copy of it that the site carries under ``repo/``. A link to a missing file, a folder or a Markdown
  file no page includes is left as it is, so that ``mkdocs build --strict`` reports it.
* **reST in docstrings.** The docstrings that the API reference shows (mkdocstrings) write ``:class:`~posenc.X```;
  the rendered ``:class:`` prefix is dropped (and a ``~`` keeps the last dotted part, as Sphinx does). A
  ``.. math::`` paragraph is shown as its LaTeX source in a block of its own (rendering it would need MathJax,
  which the site does not fetch).

Nothing here downloads anything. :func:`rewrite_links` is a plain function, tested in tests/test_docs_site.py.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
#: where the site keeps its copies of repository files outside docs/
REPO_PREFIX = "repo/"

INCLUDE = re.compile(r"^<!--\s*include:\s*(\S+?)\s*-->[ \t]*$", re.M)
# an inline link or image: [text](target) / ![alt](target "title"); the target has no spaces
LINK = re.compile(r"(\]\()([^)\s]+)((?:\s+\"[^\"]*\")?\))")
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})")
MATH = re.compile(r"<p>\.\. math::\s*(.*?)</p>", re.S)
ROLE = re.compile(r":(?:py:)?(?:class|func|meth|data|mod|attr|exc|obj|const):<code>(~?)([^<]*)</code>")

# the included file (absolute) -> the docs page that shows it (its src_uri)
_included: dict[Path, str] = {}


def includes_of(text: str, base: Path) -> list[Path]:
    """The files that the include lines of ``text`` (a page in folder ``base``) name, resolved."""
    return [(base / m.group(1)).resolve() for m in INCLUDE.finditer(text)]


def _outside_code(text: str) -> list[tuple[bool, str]]:
    """``text`` cut into (is code, chunk): fenced blocks and inline code spans are code."""
    out: list[tuple[bool, str]] = []
    lines = text.splitlines(keepends=True)
    i = 0
    prose: list[str] = []
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            prose.append(lines[i])
            i += 1
            continue
        out.append((False, "".join(prose)))
        prose = []
        fence = m.group(2)
        block = [lines[i]]
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            block.append(lines[i])
            i += 1
        if i < len(lines):
            block.append(lines[i])
            i += 1
        out.append((True, "".join(block)))
    out.append((False, "".join(prose)))
    cut: list[tuple[bool, str]] = []
    for code, chunk in out:
        if code:
            cut.append((True, chunk))
            continue
        pos = 0
        for span in re.finditer(r"(`+)(?!`).*?(?<!`)\1(?!`)", chunk, flags=re.S):
            cut.append((False, chunk[pos : span.start()]))
            cut.append((True, span.group(0)))
            pos = span.end()
        cut.append((False, chunk[pos:]))
    return cut


def target_for(target: str, base: Path, page_uri: str, included: dict[Path, str], extra: set[Path]) -> str:
    """The link ``target`` of a text whose relative links start in folder ``base``, rewritten for the docs page
    ``page_uri`` (e.g. ``"benchmarks.md"``). Files outside docs/ that the site must copy are added to ``extra``."""
    if re.match(r"[a-zA-Z][\w+.-]*:", target) or target.startswith(("#", "/")):
        return target  # a web address, an anchor on the same page, an absolute path
    path, hash_, anchor = target.partition("#")
    if not path:
        return target
    file = (base / path).resolve()
    page_dir = posixpath.dirname(page_uri)

    def rel(uri: str) -> str:
        return posixpath.relpath(uri, page_dir or ".") + hash_ + anchor

    if file in included:
        return rel(included[file])
    if file.is_relative_to(DOCS):
        return rel(file.relative_to(DOCS).as_posix())
    if file.is_file() and file.is_relative_to(ROOT) and file.suffix != ".md":
        extra.add(file)
        return rel(REPO_PREFIX + file.relative_to(ROOT).as_posix())
    return target  # missing, a folder, or Markdown no page shows: mkdocs reports it


def rewrite_links(text: str, base: Path, page_uri: str, included: dict[Path, str], extra: set[Path]) -> str:
    """``text`` with each relative link outside code rewritten by :func:`target_for`."""
    out = []
    for code, chunk in _outside_code(text):
        if code:
            out.append(chunk)
        else:
            out.append(
                LINK.sub(
                    lambda m: m.group(1) + target_for(m.group(2), base, page_uri, included, extra) + m.group(3),
                    chunk,
                )
            )
    return "".join(out)


def expand(text: str, page_path: Path, page_uri: str, included: dict[Path, str], extra: set[Path]) -> str:
    """A page's Markdown as the site shows it: its include lines replaced by the files' (links rewritten), and its
    own links out of docs/ rewritten."""
    text = rewrite_links(text, page_path.parent, page_uri, included, extra)

    def one(m: re.Match[str]) -> str:
        file = (page_path.parent / m.group(1)).resolve()
        if not file.is_file():
            raise FileNotFoundError(f"{page_uri}: the include line names {m.group(1)}, which does not exist")
        return rewrite_links(file.read_text(encoding="utf-8"), file.parent, page_uri, included, extra)

    return INCLUDE.sub(one, text)


# ----------------------------------------------------------------------------------------------- mkdocs events


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    _included.clear()
    pages = [f for f in files if f.is_documentation_page()]
    for f in pages:
        for file in includes_of(Path(f.abs_src_path).read_text(encoding="utf-8"), Path(f.abs_src_path).parent):
            _included[file] = f.src_uri
    extra: set[Path] = set()
    for f in pages:  # the files outside docs/ that the pages link to, copied under repo/
        expand(Path(f.abs_src_path).read_text(encoding="utf-8"), Path(f.abs_src_path), f.src_uri, _included, extra)
    for file in sorted(extra):
        uri = REPO_PREFIX + file.relative_to(ROOT).as_posix()
        if files.get_file_from_path(uri) is None:
            files.append(File.generated(config, uri, abs_src_path=str(file)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    return expand(markdown, Path(page.file.abs_src_path), page.file.src_uri, _included, set())


def docstring_html(html: str) -> str:
    """The rendered reST of the docstrings made readable: roles dropped, ``.. math::`` paragraphs as blocks."""
    html = ROLE.sub(lambda m: f"<code>{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}</code>", html)

    def math(m: re.Match[str]) -> str:
        return f'<pre class="math-source"><code>{re.sub(r"<[^>]+>", "", m.group(1)).strip()}</code></pre>'

    return MATH.sub(math, html)


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    return docstring_html(html)
