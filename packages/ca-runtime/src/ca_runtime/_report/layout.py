"""Draws a backward graph as inline SVG: with graphviz ``dot`` when installed, else a layered layout of our own.

Both take a ``DrawGraph`` (boxes with label lines, colours, a tooltip and the
element id a link can point at, plus edges) and return an ``<svg>`` element
meant to be pasted into an HTML page: no XML prolog, no namespace URLs, every
text escaped (``dot`` escapes its own output; the built-in layout uses
``html.escape``).

[Note: Built-in layered layout]
Longest-path layering: a node's layer is one more than the deepest node with
an edge into it (the root at the top, leaves at the bottom), computed in
topological order (Kahn's algorithm; a cycle, which an autograd graph cannot
have, would put the rest in one last layer). Within a layer, nodes keep their
order in the input, which is the walk's (eager's) order. An edge that spans
more than one layer gets a waypoint in each layer it passes (a narrow slot
after that layer's boxes), so that it runs through the gaps, never through
another node's box. Each edge leaves its box straight down to the bottom of
its row, then runs as cubic curves between rows (where no box is) and
straight down through each waypoint's slot, to the top of the next box.
Edges may cross each other (no crossing reduction): enough to read graphs of
tens to hundreds of nodes.

[Note: Bands of a tall drawing]
Backward graphs are deep and narrow (a 300-node chain is one box wide and
300 layers tall), so one column of layers would use a sliver of the page and
scroll for metres. The layers are therefore cut into bands placed side by
side, as newspaper columns: as many as fit the page's width and as the height
needs (about ``_BAND_H`` each), rows kept whole and in order, every band as
wide as the widest row. An edge from a band's last layer to the next band's
first runs straight down into the lane below its band, across to the gutter
on its right, up the gutter to the lane above all bands, across, and down
into its target: lanes and gutters hold no box, so the rule that edges never
cross a box holds for bands too.
"""

from __future__ import annotations

import dataclasses
import functools
import html
import math
import re
import shutil
import subprocess
from collections.abc import Sequence

__all__ = ["LAYOUTS", "DrawGraph", "DrawNode", "LayoutError", "dot_version", "draw", "layers"]

#: The ``layout`` values ``draw`` takes: ``auto`` is ``dot`` when it is installed.
LAYOUTS = ("auto", "dot", "builtin")
#: Seconds one ``dot`` run may take before the built-in layout is used instead.
DOT_TIMEOUT_S = 30.0
#: Larger graphs get the built-in layout under ``auto`` (dot's time grows quickly).
DOT_MAX_NODES = 1500
_SAFE_ID = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")


class LayoutError(Exception):
    """``dot`` is missing or failed on a graph."""


@dataclasses.dataclass(frozen=True)
class DrawNode:
    """One box of the drawing."""

    #: The id of the node's ``<g>`` element (what ``<a href="#...">`` points at).
    element_id: str
    lines: tuple[str, ...]
    #: Shown when hovering the box.
    title: str
    fill: str
    stroke: str = "#444444"
    stroke_width: float = 1.0
    dashed: bool = False


@dataclasses.dataclass(frozen=True)
class DrawGraph:
    nodes: tuple[DrawNode, ...]
    #: (from, to) positions in ``nodes``.
    edges: tuple[tuple[int, int], ...]


@functools.cache
def dot_version() -> str | None:
    """``graphviz version 2.43.0 (0)`` when ``dot`` is on PATH, else None."""
    program = shutil.which("dot")
    if program is None:
        return None
    try:
        out = subprocess.run([program, "-V"], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"graphviz version \S+", out.stderr + out.stdout)
    return match.group(0) if match else "graphviz (unknown version)"


def draw(graph: DrawGraph, layout: str = "auto") -> tuple[str, str]:
    """The graph as an ``<svg>`` element, and the layout that drew it (``dot`` or ``builtin``).

    ``auto`` uses ``dot`` when installed and falls back to the built-in layout
    if it fails; ``dot`` raises LayoutError instead.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}; got {layout!r}")
    for node in graph.nodes:
        if not _SAFE_ID.fullmatch(node.element_id):
            raise ValueError(f"element id {node.element_id!r} is not a plain identifier")
    if layout == "dot" or (layout == "auto" and len(graph.nodes) <= DOT_MAX_NODES):
        try:
            return draw_with_dot(graph), "dot"
        except LayoutError:
            if layout == "dot":
                raise
    return draw_builtin(graph), "builtin"


# -- graphviz -------------------------------------------------------------------


def _dot_string(text: str) -> str:
    """A DOT quoted string showing ``text`` literally (``&`` would start an entity for dot)."""
    text = text.replace("\\", "\\\\").replace('"', '\\"').replace("&", "&amp;")
    return '"' + text.replace("\r", " ").replace("\n", " ") + '"'


def to_dot(graph: DrawGraph) -> str:
    lines = [
        "digraph backward {",
        '  graph [rankdir=TB, nodesep=0.25, ranksep=0.35, bgcolor="transparent"];',
        '  node [shape=box, style="rounded,filled", fontname="monospace", fontsize=10, margin="0.12,0.04"];',
        '  edge [color="#777777", arrowsize=0.6];',
    ]
    for i, node in enumerate(graph.nodes):
        label = "\\n".join(_dot_string(line)[1:-1] for line in node.lines)
        style = "rounded,filled,dashed" if node.dashed else "rounded,filled"
        lines.append(
            f'  n{i} [id="{node.element_id}", label="{label}", fillcolor="{node.fill}", '
            f'color="{node.stroke}", penwidth={node.stroke_width:g}, style="{style}"];'
        )
    lines.extend(f"  n{a} -> n{b};" for a, b in graph.edges)
    lines.append("}")
    return "\n".join(lines) + "\n"


def draw_with_dot(graph: DrawGraph) -> str:
    """``dot -Tsvg`` of the graph, cleaned for inlining into HTML; raises LayoutError."""
    program = shutil.which("dot")
    if program is None:
        raise LayoutError("graphviz dot is not installed")
    try:
        out = subprocess.run(
            [program, "-Tsvg"],
            input=to_dot(graph).encode(),
            capture_output=True,
            timeout=DOT_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as e:
        raise LayoutError(f"dot failed: {e}") from e
    svg = out.stdout.decode("utf-8", "replace")
    start = svg.find("<svg")
    if out.returncode != 0 or start < 0:
        raise LayoutError(f"dot failed ({out.returncode}): {out.stderr.decode('utf-8', 'replace')[:200]}")
    svg = re.sub(r"<!--.*?-->", "", svg[start:], flags=re.DOTALL)
    # Namespace declarations are not needed inline (and are URLs).
    svg = re.sub(r'\s+xmlns(:\w+)?="[^"]*"', "", svg, count=2)

    def title(match: re.Match[str]) -> str:
        node = re.fullmatch(r"n(\d+)", match.group(1))
        if node is None:
            return ""  # the graph's and edges' titles: ids, not worth a tooltip
        return f"<title>{html.escape(graph.nodes[int(node.group(1))].title)}</title>"

    ours = {node.element_id for node in graph.nodes}

    def element_id(match: re.Match[str]) -> str:
        # dot writes our ids with "-" as "&#45;"; its own (graph0, edge1, ...)
        # would repeat in every drawing of the page, so they go.
        value = html.unescape(match.group(1))
        return f' id="{value}"' if value in ours else ""

    svg = re.sub(r' id="([^"]*)"', element_id, svg)
    return re.sub(r"<title>([^<]*)</title>", title, svg).strip()


# -- built-in layout -------------------------------------------------------------

_CHAR_W = 6.6
_LINE_H = 14.0
_PAD_X, _PAD_Y = 8.0, 5.0
_GAP_X, _GAP_Y = 14.0, 34.0
_MARGIN = 8.0
#: Width of the slot a long edge passes a layer through.
_WAYPOINT_W = 6.0
#: The page's drawing area (the report's ``max-width`` less its padding), which bands fill.
_PAGE_W = 1360.0
#: A band is about this tall (the drawing's scroll box shows roughly one).
_BAND_H = 640.0
#: Space between bands, and above and below them, that edges from one band to the next run through.
_GUTTER, _LANE_H = 28.0, 16.0


def layers(num_nodes: int, edges: Sequence[tuple[int, int]]) -> list[int]:
    """Each node's layer; see [Note: Built-in layered layout]."""
    into: list[int] = [0] * num_nodes
    out: list[list[int]] = [[] for _ in range(num_nodes)]
    for a, b in edges:
        out[a].append(b)
        into[b] += 1
    layer = [0] * num_nodes
    ready = [i for i in range(num_nodes) if into[i] == 0]
    done = 0
    while ready:
        a = ready.pop()
        done += 1
        for b in out[a]:
            layer[b] = max(layer[b], layer[a] + 1)
            into[b] -= 1
            if into[b] == 0:
                ready.append(b)
    if done < num_nodes:  # a cycle: the rest below everything else
        last = max(layer, default=0) + 1
        layer = [last if into[i] > 0 else layer[i] for i in range(num_nodes)]
    return layer


def _bands(row_heights: Sequence[float], row_w: float) -> list[int]:
    """Each row's band (column of the page); see [Note: Bands of a tall drawing]."""
    total_h = sum(row_heights) + _GAP_Y * max(len(row_heights) - 1, 0)
    fit = int((_PAGE_W - 2 * _MARGIN + _GUTTER) // (row_w + _GUTTER))
    count = max(1, min(fit, math.ceil(total_h / _BAND_H), len(row_heights)))
    band_of: list[int] = []
    done = 0.0
    for h in row_heights:
        # A row goes to the band its middle falls in, so bands come out about equally tall.
        band_of.append(min(count - 1, int((done + h / 2) * count // total_h)) if total_h else 0)
        done += h + _GAP_Y
    return band_of


def draw_builtin(graph: DrawGraph) -> str:
    """The graph drawn with [Note: Built-in layered layout] and [Note: Bands of a tall drawing]."""
    n = len(graph.nodes)
    layer_of = layers(n, graph.edges)
    rows: list[list[int]] = [[] for _ in range(max(layer_of, default=-1) + 1)]
    for i in range(n):
        rows[layer_of[i]].append(i)
    widths = [max(len(line) for line in node.lines) * _CHAR_W + 2 * _PAD_X for node in graph.nodes]
    heights = [len(node.lines) * _LINE_H + 2 * _PAD_Y for node in graph.nodes]
    # Waypoints of long edges: slots n, n+1, ... after the boxes of each layer they pass.
    routes: list[list[int]] = []
    for a, b in graph.edges:
        route = [a]
        for layer in range(layer_of[a] + 1, layer_of[b]):
            rows[layer].append(len(widths))
            widths.append(_WAYPOINT_W)
            heights.append(0.0)
            route.append(len(widths) - 1)
        routes.append([*route, b])
    row_widths = [sum(widths[i] for i in row) + _GAP_X * max(len(row) - 1, 0) for row in rows]
    band_w = max(row_widths, default=0.0)
    band_of = _bands([max(heights[i] for i in row) for row in rows], band_w)
    num_bands = max(band_of, default=0) + 1
    lane = _LANE_H if num_bands > 1 else 0.0
    total_w = num_bands * band_w + (num_bands - 1) * _GUTTER + 2 * _MARGIN
    x = [0.0] * len(widths)
    row_top: list[float] = []
    row_bottom: list[float] = []
    top = _MARGIN + lane
    for r, (row, row_w) in enumerate(zip(rows, row_widths)):
        if r > 0 and band_of[r] != band_of[r - 1]:
            top = _MARGIN + lane
        left = _MARGIN + band_of[r] * (band_w + _GUTTER) + (band_w - row_w) / 2
        for i in row:
            x[i] = left
            left += widths[i] + _GAP_X
        row_top.append(top)
        row_bottom.append(top + max(heights[i] for i in row))
        top = row_bottom[-1] + _GAP_Y
    y = [row_top[layer_of[i]] for i in range(n)]
    total_h = max(row_bottom, default=_MARGIN) + lane + _MARGIN
    marker = f"arrow-{graph.nodes[0].element_id}" if graph.nodes else "arrow"
    parts = [
        (
            f'<svg class="builtin" width="{total_w:.0f}" height="{total_h:.0f}" '
            f'viewBox="0 0 {total_w:.1f} {total_h:.1f}" font-family="monospace" font-size="11">'
        ),
        (
            f'<defs><marker id="{marker}" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" '
            'markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#777"/></marker></defs>'
        ),
    ]
    for route in routes:
        a, b = route[0], route[-1]
        cx = x[a] + widths[a] / 2
        layer = layer_of[a]
        d = f"M{cx:.1f},{y[a] + heights[a]:.1f} L{cx:.1f},{row_bottom[layer]:.1f}"
        for hop in route[1:]:
            nx = x[hop] + widths[hop] / 2
            y1, y2 = row_bottom[layer], row_top[layer + 1]
            if band_of[layer] == band_of[layer + 1]:
                bend = (y2 - y1) / 2
                d += f" C{cx:.1f},{y1 + bend:.1f} {nx:.1f},{y2 - bend:.1f} {nx:.1f},{y2:.1f}"
            else:  # below this band, up the gutter to its right, over the next band's top
                below = y1 + lane / 2
                gutter = _MARGIN + band_of[layer] * (band_w + _GUTTER) + band_w + _GUTTER / 2
                above = _MARGIN + lane / 2
                d += f" L{cx:.1f},{below:.1f} L{gutter:.1f},{below:.1f} L{gutter:.1f},{above:.1f}"
                d += f" L{nx:.1f},{above:.1f} L{nx:.1f},{y2:.1f}"
            layer += 1
            cx = nx
            if hop != b:  # straight down through the waypoint's slot
                d += f" L{cx:.1f},{row_bottom[layer]:.1f}"
        parts.append(f'<path class="edge" d="{d}" fill="none" stroke="#777" marker-end="url(#{marker})"/>')
    for i, node in enumerate(graph.nodes):
        dash = ' stroke-dasharray="4 3"' if node.dashed else ""
        parts.append(
            f'<g id="{node.element_id}" class="node"><title>{html.escape(node.title)}</title>'
            f'<rect x="{x[i]:.1f}" y="{y[i]:.1f}" width="{widths[i]:.1f}" height="{heights[i]:.1f}" rx="5" '
            f'fill="{html.escape(node.fill)}" stroke="{html.escape(node.stroke)}" '
            f'stroke-width="{node.stroke_width:g}"{dash}/>'
        )
        for k, line in enumerate(node.lines):
            parts.append(
                f'<text x="{x[i] + widths[i] / 2:.1f}" y="{y[i] + _PAD_Y + (k + 0.78) * _LINE_H:.1f}" '
                f'text-anchor="middle">{html.escape(line)}</text>'
            )
        parts.append("</g>")
    parts.append("</svg>")
    return "\n".join(parts)
