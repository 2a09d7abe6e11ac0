"""Draw posenc's layers from the code: docs/img/architecture.svg.

The layers are the import-linter contracts in pyproject.toml (``[tool.importlinter]``); which layer imports
which is read from the code itself (grimp, the import graph import-linter checks). The picture is made of
nothing else, so it cannot go stale: ``--check`` (run by tests/test_architecture.py) fails when the committed
file differs from what the code draws now.

    python scripts/architecture.py            # write docs/img/architecture.svg
    python scripts/architecture.py --check    # exit 1 if the committed picture is stale
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from dataclasses import dataclass
from html import escape
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "img" / "architecture.svg"

# drawing sizes (px)
ROW, GAP, PAD, BOX_H, CHAR, LEFT = 40, 8, 10, 24, 7.2, 10
TITLE_H = 34


@dataclass
class Layer:
    modules: list[str]  # the names in the contract that exist, relative to the container
    independent: bool  # `a | b`: the modules may not import each other


def contracts() -> list[dict]:
    """The layer contracts of pyproject.toml, in their order."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    return [c for c in cfg["contracts"] if c["type"] == "layers"]


def parse_layers(contract: dict, existing: set[str]) -> list[Layer]:
    """The contract's layers from top to bottom, keeping the modules that exist (a name in parentheses is optional)."""
    container = contract["containers"][0]
    out = []
    for spec in contract["layers"]:
        independent = "|" in spec
        names = [n.strip().strip("()") for n in re.split(r"[|:]", spec)]
        names = [n for n in names if f"{container}.{n}" in existing]
        if names:
            out.append(Layer(names, independent))
    return out


def layer_edges(graph, container: str, layers: list[Layer]) -> dict[int, dict[str, int]]:
    """For each layer (by index), the modules of other layers its modules import directly: name -> their layer."""
    where = {}
    for i, layer in enumerate(layers):
        for name in layer.modules:
            where[f"{container}.{name}"] = (i, name)

    def layer_of(module: str) -> tuple[int, str] | None:
        parts = module.split(".")
        for k in range(len(parts), 0, -1):
            hit = where.get(".".join(parts[:k]))
            if hit is not None:
                return hit
        return None

    edges: dict[int, dict[str, int]] = {i: {} for i in range(len(layers))}
    for module in graph.modules:
        a = layer_of(module)
        if a is None:
            continue
        for imported in graph.find_modules_directly_imported_by(module):
            b = layer_of(imported)
            if b is not None and b[0] != a[0]:
                edges[a[0]][b[1]] = b[0]
    return edges


def panel(
    title: str, layers: list[Layer], edges: dict[int, dict[str, int]], x0: float, y0: float
) -> tuple[list[str], float, float]:
    """One contract as SVG elements: a band per layer, top to bottom, a box per module, and on the right the
    modules of other layers it imports (an upward one in red). Returns the elements, the width and the height."""
    def names(i: int) -> list[tuple[str, bool]]:  # (module, upward: a broken contract) by layer, top first
        return sorted(((n, j < i) for n, j in edges[i].items()), key=lambda t: (edges[i][t[0]], t[0]))

    label = [", ".join(n + (" (upward)" if up else "") for n, up in names(i)) or "-" for i in range(len(layers))]
    widths = [sum(len(m) * CHAR + 2 * PAD + GAP for m in layer.modules) for layer in layers]
    band_w = max(max(widths) + 2 * LEFT, len(title) * 9.2)  # the title (15 px bold) stays over the bands
    imports_w = max(len(s) for s in label) * CHAR + 2 * PAD
    width = band_w + 24 + imports_w
    head = "what it imports (red: upward, a broken contract)"
    els = [
        f'<text x="{x0:.0f}" y="{y0 + 20:.0f}" class="title">{escape(title)}</text>',
        f'<text x="{x0 + band_w + 24:.0f}" y="{y0 + 20:.0f}" class="head">{head}</text>',
    ]
    y = y0 + TITLE_H
    for i, layer in enumerate(layers):
        els.append(f'<rect x="{x0:.0f}" y="{y:.0f}" width="{band_w:.0f}" height="{ROW}" rx="6" class="band"/>')
        x = x0 + LEFT
        for m in layer.modules:
            w = len(m) * CHAR + 2 * PAD
            top = y + (ROW - BOX_H) / 2
            els.append(f'<rect x="{x:.0f}" y="{top:.0f}" width="{w:.0f}" height="{BOX_H}" rx="4" class="mod"/>')
            els.append(f'<text x="{x + PAD:.0f}" y="{y + ROW / 2 + 4:.0f}" class="name">{escape(m)}</text>')
            x += w + GAP
        if layer.independent and len(layer.modules) > 1:
            note = f'x="{x0 + band_w - 6:.0f}" y="{y + 12:.0f}" class="note" text-anchor="end"'
            els.append(f"<text {note}>independent</text>")
        spans = ", ".join(f'<tspan class="up">{escape(n)} (upward)</tspan>' if up else escape(n) for n, up in names(i))
        els.append(f'<text x="{x0 + band_w + 24:.0f}" y="{y + ROW / 2 + 4:.0f}" class="uses">{spans or "-"}</text>')
        y += ROW + 6
    return els, width, y - y0


def draw() -> str:
    import grimp

    graph = grimp.build_graph("posenc", include_external_packages=False)
    existing = set(graph.modules)
    parts, y, width = [], 10.0, 0.0
    for contract in contracts():
        layers = parse_layers(contract, existing)
        container = contract["containers"][0]
        edges = layer_edges(graph, container, layers)
        els, w, h = panel(f"{container}: each layer imports only from below", layers, edges, 10, y)
        parts += els
        y += h + 30
        width = max(width, w + 20)
    style = (
        "<style>text{font-family:DejaVu Sans Mono,monospace;font-size:12px;fill:#222}"
        ".title{font-size:15px;font-weight:bold}.head{font-size:11px;fill:#666}.uses{fill:#444}.up{fill:#c00;font-weight:bold}"
        ".note{font-size:9px;fill:#888}.band{fill:#eef3fa;stroke:#9ab}.mod{fill:#fff;stroke:#579}</style>"
    )
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{y - 10:.0f}" '
        f'viewBox="0 0 {width:.0f} {y - 10:.0f}">\n<!-- generated by scripts/architecture.py from pyproject.toml '
        "and the import graph: do not edit -->\n"
        f'<rect width="100%" height="100%" fill="white"/>\n{style}\n' + "\n".join(parts) + "\n</svg>\n"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if the committed picture is not what the code draws")
    args = p.parse_args(argv)
    svg = draw()
    if args.check:
        if not OUT.exists() or OUT.read_text() != svg:
            print(f"{OUT.relative_to(ROOT)} is stale: run python scripts/architecture.py", file=sys.stderr)
            return 1
        print(f"{OUT.relative_to(ROOT)} is up to date")
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(svg)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
