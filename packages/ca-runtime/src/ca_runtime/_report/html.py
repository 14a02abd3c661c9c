"""Renders a ``ReportData`` as one self-contained HTML page.

All CSS, JavaScript and SVG are inline; the page loads nothing (its Content
Security Policy forbids it, and allows only its own script, by hash). Every
string that comes from the user's program (node and Function names, exception
messages, hook reprs, FX code, failure reasons) goes through ``html.escape``
here or in ``layout.py``: a payload in a name shows as text.

Sections, each an element with a fixed id: ``overview``, ``cache-tree``,
``graphs``, ``misses``, ``breaks``. Link targets: ``capture-N`` (a captured
graph), ``cN-nI`` (node I in capture N's drawing), ``tree-ID`` (a cache tree
node).
"""

from __future__ import annotations

import base64
import hashlib
import html
from collections.abc import Iterable, Sequence

from ca_runtime._cache_entry import CacheEntry, EagerIfFasterChoice
from ca_runtime._report.layout import DrawGraph, DrawNode, dot_version, draw
from ca_runtime._report.model import ReportData
from ca_runtime._report.records import CaptureRecord, NodeKind, NodeRecord, Outcome, ReasonKind, Stage

__all__ = ["KIND_COLOURS", "SECTION_IDS", "render"]

#: Section ids, in page order, with their headings.
SECTION_IDS: dict[str, str] = {
    "overview": "Overview",
    "cache-tree": "Cache tree",
    "graphs": "Captured graphs",
    "misses": "Timeline of misses",
    "breaks": "Graph breaks and fallbacks",
}
#: Fill per node kind.
KIND_COLOURS: dict[NodeKind, str] = {
    NodeKind.TRACED: "#cdeccd",
    NodeKind.AOT: "#b7e3dc",
    NodeKind.FUNCTION: "#cfe0f8",
    NodeKind.BREAK: "#fbcb9f",
    NodeKind.EAGER: "#f5b5b5",
    NodeKind.LEAF: "#fff1a8",
    NodeKind.UNUSED: "#ffffff",
}
HOOK_STROKE = "#7b3fbf"
FAILED_STROKE = "#d00000"
#: Most nodes drawn per graph (larger ones are listed, not drawn).
MAX_DRAWN_NODES = 3000
#: Captured graphs shown open (the latest ones); the others are collapsed.
OPEN_CAPTURES = 3
#: Placeholder id prefix of a drawing, replaced per capture (identical graphs are drawn once).
_ID_PREFIX = "cXq9Z"
_NAME_CHARS = 48

e = html.escape


def _seconds(value: float | None) -> str:
    if value is None:
        return "—"
    if value < 1e-3:
        return f"{value * 1e6:.0f} µs"
    if value < 1.0:
        return f"{value * 1e3:.1f} ms"
    return f"{value:.2f} s"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _short(name: str) -> str:
    """A node's name for its box: without a C++ namespace, at most _NAME_CHARS characters."""
    name = name.rsplit("::", 1)[-1] if name.startswith("torch::") else name
    return name if len(name) <= _NAME_CHARS else name[: _NAME_CHARS - 1] + "…"


def _table(header: Sequence[str], rows: Iterable[Sequence[str]], cls: str = "") -> str:
    """A table; ``rows`` hold HTML already escaped."""
    head = "".join(f"<th>{e(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    cls_attr = f' class="{cls}"' if cls else ""
    return f"<table{cls_attr}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


# -- overview ------------------------------------------------------------------


def _overview(data: ReportData) -> str:
    c = data.counters
    cards = "".join(
        f'<div class="card {cls}"><div class="num">{value}</div><div>{e(label)}</div></div>'
        for label, value, cls in (
            ("captures", c["captures"], ""),
            ("cache hits", c["cache_hits"], ""),
            ("graph breaks", c["graph_breaks"], "warn" if c["graph_breaks"] else ""),
            ("eager fallbacks", c["eager_fallbacks"], "bad" if c["eager_fallbacks"] else ""),
            ("eager if faster", c.get("eager_if_faster_runs", 0), ""),
        )
    )
    t = data.timings
    backwards = t["timed_backwards"] if t else 0

    def ns(key: str) -> tuple[str, str]:
        if t is None or key not in t:  # not collected, or a report saved before the key existed
            return "—", "—"
        total = t[key] / 1e9
        return _seconds(total), (_seconds(total / backwards) if backwards else "—")

    def per(total: float, count: int) -> str:
        return _seconds(total / count) if count else "—"

    # First runs (lazy compiles: seconds) and hits (microseconds) apart: one
    # average over both says nothing about either. The run step's timer
    # covers both; a hit's share is what the first runs leave.
    first_runs = sum(1 for c in data.captures if c.first_run_s is not None)
    first_run_s = data.seconds.get(Stage.FIRST_RUN, 0.0)
    if t is None:
        hit_runs = ("—", "—")
    else:
        on_hits = max(t["run_ns"] / 1e9 - first_run_s, 0.0)
        hit_runs = (_seconds(on_hits), per(on_hits, data.counters.get("cache_hits", 0)))
    rows = [
        ("walk of the autograd graph (every backward)", *ns("walk_ns"), "timed backward"),
        ("lookup: the entry, lifting the graph's inputs", *ns("lookup_ns"), "timed backward"),
        ("capture: building the FX graph (misses)", _seconds(data.seconds.get(Stage.CAPTURE, 0.0)), "", ""),
        ("compile: the compiler_fn call (misses)", _seconds(data.seconds.get(Stage.COMPILE, 0.0)), "", ""),
        (
            "first runs (include the lazy compile)",
            _seconds(first_run_s),
            per(first_run_s, first_runs),
            "first run",
        ),
        ("compiled runs on cache hits", *hit_runs, "cache hit"),
        ("finish: leaf accumulation and callbacks", *ns("finish_ns"), "timed backward"),
        ("the whole engine hook (the above and the rest)", *ns("hook_ns"), "timed backward"),
    ]
    times = _table(("stage", "total", "average", "per"), [(e(a), e(b), e(c_), e(d)) for a, b, c_, d in rows])
    if t is None:
        note = (
            '<p class="note">The walk, compiled runs and finish were not timed: call '
            "<code>ca_runtime.collect_timings()</code> before the backwards, or set "
            "<code>CA_REPORT</code>. Capture, compile and first-run times are always recorded.</p>"
        )
    else:
        note = f'<p class="note">Timed backwards: {backwards}.</p>'
    reasons = "".join(
        f"<div><h3>{e(kind.heading)}</h3>"
        + (
            _table(("count", "reason"), [(str(n), e(reason)) for reason, n in data.top_reasons.get(kind, [])])
            if data.top_reasons.get(kind)
            else '<p class="none">none</p>'
        )
        + "</div>"
        for kind in ReasonKind
    )
    kept = ""
    if data.num_captures > len(data.captures) or data.num_fallbacks > len(data.fallbacks):
        kept = (
            f'<p class="note">The report keeps the latest {data.record_limit} captures and fallbacks: '
            f"showing {len(data.captures)} of {data.num_captures} captures and "
            f"{len(data.fallbacks)} of {data.num_fallbacks} fallbacks.</p>"
        )
    return (
        f'<div class="cards">{cards}</div>{kept}<h3>Time</h3>{times}{note}'
        f'<div class="reasons">{reasons}</div>'
    )


# -- cache tree ----------------------------------------------------------------


def _is_stop(node: CacheEntry, children: dict[int, list[int]]) -> bool:
    """Where a row of the tree ends: an entry, a branch point, a leaf of the tree."""
    return (
        node.parent == -1
        or node.has_graph
        or node.failed
        or node.hits > 0
        or len(children.get(node.id, [])) != 1
    )


def _cache_tree(data: ReportData) -> str:
    if not data.cache_tree:
        return '<p class="none">The cache is empty.</p>'
    by_id = {n.id: n for n in data.cache_tree}
    children: dict[int, list[int]] = {}
    for n in data.cache_tree:
        children.setdefault(n.parent, []).append(n.id)
    captures_at: dict[int, list[int]] = {}
    for capture in data.captures:
        captures_at.setdefault(capture.entry_id, []).append(capture.id)
    rows: list[str] = []
    # Rows in depth-first order; a chain of nodes with one child each is one row.
    stack = [(root, 0) for root in reversed(children.get(-1, []))]
    while stack:
        first, depth = stack.pop()
        chain = [by_id[first]]
        while not _is_stop(chain[-1], children):
            chain.append(by_id[children[chain[-1].id][0]])
        end = chain[-1]
        anchors = "".join(f'<span id="tree-{n.id}"></span>' for n in chain[:-1])
        if end.parent == -1:
            label = f'<span class="compiler">{e(end.compiler)}</span>'
        else:
            names = [n.node_name for n in chain]
            if len(names) > 5:
                names = [*names[:2], f"… {len(names) - 4} nodes …", *names[-2:]]
            label = " → ".join(f"<code>{e(name)}</code>" for name in names)
            # Siblings whose first node has the same name differ in what it
            # looked like (a hook, .grad, a saved dtype): say so.
            twins = [by_id[s] for s in children.get(chain[0].parent, []) if s != chain[0].id]
            if chain[0].node_detail and any(t.node_name == chain[0].node_name for t in twins):
                label += f' <span class="detail">({e(chain[0].node_detail)})</span>'

        badges = []
        if end.parent == -1 and not children.get(end.id):
            badges.append('<span class="badge">empty</span>')
        if end.has_graph:
            badges.append('<span class="badge graph">graph</span>')
        if end.hits or end.has_graph:
            badges.append(f'<span class="badge">{_plural(end.hits, "hit")}</span>')
        if end.sizes:
            badges.append(
                f'<span class="badge">{_plural(end.sizes, "size")}, {end.dynamic_sizes} dynamic</span>'
            )
        if end.static_sizes:
            badges.append('<span class="badge">static sizes (a dynamic graph failed)</span>')
        if end.compiled_median_s and end.eager_median_s:
            timing = (
                f"compiled {_seconds(end.compiled_median_s)}, eager {_seconds(end.eager_median_s)}, "
                f"compiled/eager {end.compiled_over_eager:.3f} paired"
            )
            if end.eager_if_faster_choice is EagerIfFasterChoice.EAGER:
                badges.append(
                    f'<span class="badge eager">runs eagerly, compiled not measurably faster ({timing})</span>'
                )
            else:
                badges.append(f'<span class="badge">runs compiled ({timing})</span>')
        if end.failed:
            badges.append(f'<span class="badge bad">failed: {e(end.failure)}</span>')
        captured = captures_at.get(end.id, [])
        if captured:
            links = ", ".join(f'<a href="#capture-{i}">#{i}</a>' for i in captured)
            badges.append(f'<span class="captures">captured {links}</span>')
        rows.append(
            f'<div class="tree-row{" entry" if end.has_graph or end.failed else ""}" id="tree-{end.id}" '
            f'style="padding-left:{depth * 1.4 + 0.4:.1f}em">{anchors}'
            f"{'└ ' if depth else ''}{label} {' '.join(badges)}</div>"
        )
        stack.extend((child, depth + 1) for child in reversed(children.get(end.id, [])))
    return (
        '<p class="note">One tree per compiler; each edge is the cache key of one autograd node in '
        "walk order. Chains without a branch are shown as one row.</p>"
        f'<div class="tree">{"".join(rows)}</div>'
    )


# -- captured graphs -----------------------------------------------------------


def _node_title(node: NodeRecord, capture: CaptureRecord) -> str:
    lines = [
        f"{node.name} (node {node.index} of {len(capture.nodes)} in the walk)",
        f"type: {node.type_name}",
        f"sequence_nr: {node.sequence_nr}",
        f"{node.kind}: {node.kind.description}",
    ]
    if node.detail:
        lines.append(node.detail)
    lines.extend(f"{hook.kind}: {hook.repr}" if hook.repr else hook.kind for hook in node.hooks)
    if node.index == capture.miss_node:
        lines.append(f"cache miss here: {capture.miss_reason}")
    return "\n".join(lines)


def _draw_graph(capture: CaptureRecord) -> DrawGraph:
    nodes = []
    for node in capture.nodes:
        tags = [f"#{node.index}", node.kind]
        if node.hooks:
            tags.append(_plural(len(node.hooks), "hook"))
        if node.index == capture.miss_node:
            tags.append("miss")
        stroke, width = "#555555", 1.0
        if node.hooks:
            stroke, width = HOOK_STROKE, 2.5
        if node.index == capture.failed_node:
            stroke, width = FAILED_STROKE, 3.0
        nodes.append(
            DrawNode(
                element_id=f"{_ID_PREFIX}-n{node.index}",
                lines=(_short(node.name), " · ".join(tags)),
                title=_node_title(node, capture),
                fill=KIND_COLOURS[node.kind],
                stroke=stroke,
                stroke_width=width,
                dashed=node.kind is NodeKind.UNUSED or node.index == capture.miss_node,
            )
        )
    edges = tuple(
        (node.index, target)
        for node in capture.nodes
        for target in node.edges
        if 0 <= target < len(capture.nodes)
    )
    return DrawGraph(tuple(nodes), edges)


def _legend() -> str:
    items = "".join(
        f'<span class="swatch" style="background:{KIND_COLOURS[kind]}"></span>{e(kind)}'
        f'<span class="legend-help"> — {e(kind.description)}</span><br>'
        for kind in NodeKind
    )
    return (
        f'<div class="legend">{items}'
        f'<span class="swatch" style="border:2.5px solid {HOOK_STROKE}"></span>hook: '
        '<span class="legend-help">the node has hooks (tensor pre-hooks, grad_fn hooks, '
        "post-accumulate-grad hooks)</span><br>"
        '<span class="swatch" style="border:1px dashed #555"></span>miss: '
        '<span class="legend-help">where this backward left the cached paths</span><br>'
        f'<span class="swatch" style="border:3px solid {FAILED_STROKE}"></span>failed: '
        '<span class="legend-help">the node the capture could not take</span></div>'
    )


class _Drawer:
    """Draws captured graphs, each distinct one once, and remembers which layouts were used."""

    def __init__(self, layout: str) -> None:
        self.layout = layout
        self.used: set[str] = set()
        self._drawn: dict[DrawGraph, str] = {}

    def svg(self, capture: CaptureRecord) -> str:
        if len(capture.nodes) > MAX_DRAWN_NODES:
            return f'<p class="note">{len(capture.nodes)} nodes: too many to draw; see the node list.</p>'
        graph = _draw_graph(capture)
        if graph not in self._drawn:
            svg, used = draw(graph, self.layout)
            self.used.add(used)
            self._drawn[graph] = svg
        return self._drawn[graph].replace(f"{_ID_PREFIX}-", f"c{capture.id}-")

    def description(self) -> str:
        version = dot_version()
        if self.used == {"dot"}:
            return f"Graphs drawn with graphviz dot ({e(version or 'dot')})."
        why = (
            "requested"
            if self.layout == "builtin"
            else "graphviz dot is not installed"
            if version is None
            else "dot failed on some graphs or they were too large"
        )
        if self.used == {"builtin"}:
            return f"Graphs drawn with ca_runtime's built-in layered layout ({why})."
        if not self.used:
            return "No graphs drawn."
        return f"Graphs drawn with graphviz dot ({e(version or 'dot')}), some with the built-in layered layout ({why})."


#: A capture's outcome in the report's words (a failure names its stage).
_OUTCOME_WORDS = {
    Outcome.RAN: "compiled and ran",
    Outcome.COMPILED: "compiled",
    Outcome.CAPTURING: "capturing",
}


def _outcome(capture: CaptureRecord) -> str:
    if capture.outcome is Outcome.FAILED:
        stage = capture.failure_stage.label if capture.failure_stage else ""
        return f'<span class="bad">failed at {e(stage)}</span>' + (
            ", ran eagerly" if capture.ran_eagerly else ""
        )
    return _OUTCOME_WORDS[capture.outcome]


def _node_link(capture_id: int, index: int | None, text: str) -> str:
    if index is None:
        return f'<a href="#capture-{capture_id}">{e(text)}</a>'
    return f'<a href="#c{capture_id}-n{index}">{e(text)}</a>'


def _lifted(capture: CaptureRecord) -> str:
    lifted = capture.lifted
    counts = (
        f"{_plural(lifted.num_tensors, 'tensor')}, {_plural(lifted.num_sizes, 'size')} "
        f"({lifted.num_dynamic_sizes} dynamic), {_plural(lifted.num_scalars, 'scalar')}, "
    )
    if capture.first_run_s is None:
        counts += "hook objects, shapes and dtypes unknown (the graph never ran)"
    else:
        counts += _plural(lifted.num_hooks, "hook object")
    parts = [f"<p>{e(counts)}</p>"]
    if lifted.tensors:
        more = f" (first {len(lifted.tensors)})" if len(lifted.tensors) < lifted.num_tensors else ""
        items = " ".join(f"<code>{i}: {e(t)}</code>" for i, t in enumerate(lifted.tensors))
        parts.append(f'<details><summary>tensors{more}</summary><p class="wrap">{items}</p></details>')
    if lifted.scalars:
        items = " ".join(f"<code>{e(s)}</code>" for s in lifted.scalars)
        parts.append(f'<details><summary>scalars</summary><p class="wrap">{items}</p></details>')
    return "".join(parts)


def _node_table(capture: CaptureRecord) -> str:
    rows = []
    for node in capture.nodes:
        hooks = "<br>".join(
            e(hook.kind) + (f": <code>{e(hook.repr)}</code>" if hook.repr else "") for hook in node.hooks
        )
        rows.append(
            (
                _node_link(capture.id, node.index, str(node.index)),
                f"<code>{e(node.name)}</code>",
                f"<code>{e(node.type_name)}</code>",
                str(node.sequence_nr),
                f'<span class="swatch" style="background:{KIND_COLOURS[node.kind]}"></span>' + e(node.kind),
                e(node.detail),
                hooks,
            )
        )
    return _table(("#", "name", "type", "sequence_nr", "how", "detail", "hooks"), rows, "nodes")


def _capture_section(capture: CaptureRecord, drawer: _Drawer, open_: bool, in_tree: bool) -> str:
    needed = sum(n.needed for n in capture.nodes)
    summary = (
        f"#{capture.id} · {e(capture.compiler)} · {_plural(len(capture.nodes), 'node')} ({needed} needed) · "
        f"{_outcome(capture)}"
        + (f" · {_plural(len(capture.breaks), 'graph break')}" if capture.breaks else "")
        + (" · miss at " + e(capture.nodes[capture.miss_node].name) if capture.miss_node is not None else "")
    )
    entry = (
        f'stored at <a href="#tree-{capture.entry_id}">cache entry {capture.entry_id}</a>'
        if in_tree
        else f"stored at cache entry {capture.entry_id} (no longer in the cache)"
    )
    facts = [
        entry,
        f"at {capture.at_s:.2f} s",
        f"thread {e(capture.thread)}",
        f"capture {_seconds(capture.capture_s)}",
        f"compile {_seconds(capture.compile_s)}",
        f"first run (includes lazy compile) {_seconds(capture.first_run_s)}",
    ]
    if capture.create_graph:
        facts.append("create_graph=True")
    parts = [f'<p class="facts">{" · ".join(facts)}</p>']
    if capture.failure:
        stage = capture.failure_stage.label if capture.failure_stage else ""
        parts.append(f'<p class="failure">{e(stage)}: {e(capture.failure)}</p>')
    if capture.miss_node is not None:
        parts.append(
            f"<p>Cache miss at {_node_link(capture.id, capture.miss_node, capture.nodes[capture.miss_node].name)}: "
            f"{e(capture.miss_reason)}</p>"
        )
    parts.append(f'<div class="drawing">{drawer.svg(capture)}</div>')
    if capture.breaks:
        items = "".join(
            f"<li>{_node_link(capture.id, b.node_index, b.node_name)} (node {b.node_index}): {e(b.reason)}</li>"
            for b in capture.breaks
        )
        parts.append(f"<h4>Graph breaks</h4><ul>{items}</ul>")
    parts.append(f"<h4>Lifted inputs</h4>{_lifted(capture)}")
    parts.append(f"<details><summary>Nodes</summary>{_node_table(capture)}</details>")
    if capture.code:
        parts.append(f"<details><summary>FX code</summary><pre>{e(capture.code)}</pre></details>")
    return (
        f'<details class="capture" id="capture-{capture.id}"{" open" if open_ else ""}>'
        f"<summary>{summary}</summary>{''.join(parts)}</details>"
    )


def _graphs(data: ReportData, drawer: _Drawer) -> str:
    if not data.captures:
        return '<p class="none">No backward was captured.</p>'
    first_open = len(data.captures) - OPEN_CAPTURES
    tree_ids = {n.id for n in data.cache_tree}
    sections = "".join(
        _capture_section(capture, drawer, i >= first_open, capture.entry_id in tree_ids)
        for i, capture in enumerate(data.captures)
    )
    return f'<p class="note" id="layout">{drawer.description()}</p>{_legend()}{sections}'


# -- misses, breaks and fallbacks ------------------------------------------------


def _misses(data: ReportData) -> str:
    if not data.captures:
        return '<p class="none">No captures.</p>'
    rows = []
    for capture in data.captures:
        if capture.miss_node is None:
            where, why = "—", "first capture of this backward: no cached graph on its path"
        else:
            where = _node_link(capture.id, capture.miss_node, capture.nodes[capture.miss_node].name)
            where += f" (node {capture.miss_node} of {len(capture.nodes)})"
            why = capture.miss_reason
        rows.append(
            (
                f'<a href="#capture-{capture.id}">#{capture.id}</a>',
                f"{capture.at_s:.2f} s",
                e(capture.compiler),
                where,
                e(why),
                _outcome(capture),
            )
        )
    return (
        '<p class="note">Each capture after the first on a path says where the backward left the '
        "cached paths and why (ca_core's explained misses).</p>"
        + _table(("capture", "at", "compiler", "where", "why", "outcome"), rows)
    )


def _breaks_and_fallbacks(data: ReportData) -> str:
    break_rows = [
        (
            f'<a href="#capture-{capture.id}">#{capture.id}</a>',
            _node_link(capture.id, b.node_index, b.node_name),
            f"node {b.node_index} of {len(capture.nodes)}",
            e(b.reason),
        )
        for capture in data.captures
        for b in capture.breaks
    ]
    by_id = {c.id: c for c in data.captures}
    fallback_rows = []
    for f in data.fallbacks:
        capture = by_id.get(f.capture_id) if f.capture_id is not None else None
        if capture is not None:
            where = _node_link(capture.id, capture.failed_node, f.where)
            of = f'<a href="#capture-{capture.id}">#{capture.id}</a>'
        else:
            where, of = f"<code>{e(f.where)}</code>", "—"
        fallback_rows.append((str(f.id), f"{f.at_s:.2f} s", e(f.compiler), where, e(f.reason), of))
    return (
        "<h3>Graph breaks</h3>"
        + (
            _table(("capture", "node", "position in walk", "reason"), break_rows)
            if break_rows
            else '<p class="none">none</p>'
        )
        + "<h3>Eager fallbacks</h3>"
        + (
            _table(("#", "at", "compiler", "what failed", "reason", "capture"), fallback_rows)
            if fallback_rows
            else '<p class="none">none</p>'
        )
        + (
            f'<p class="note">{unlisted} more backwards ran eagerly without a warning: a failure '
            "remembered on their path (see the cache tree), anomaly mode, or a backward inside a "
            "backward.</p>"
            if (unlisted := data.counters["eager_fallbacks"] - data.num_fallbacks) > 0
            else ""
        )
    )


# -- the page ------------------------------------------------------------------

_CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 0 auto; max-width: 1400px; padding: 0 1.2em 3em;
  color: #1d1d1f; background: #fafafa; }
header { border-bottom: 1px solid #ddd; margin-bottom: 1em; }
h1 { font-size: 1.6em; margin: .6em 0 .2em; } h2 { margin-top: 1.6em; border-bottom: 1px solid #e4e4e4; }
h3 { font-size: 1.05em; margin: 1em 0 .4em; } h4 { margin: .8em 0 .3em; }
nav a { margin-right: 1em; } .meta { color: #555; margin: .2em 0; }
code, pre { font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 12.5px; }
pre { background: #fff; border: 1px solid #ddd; padding: .6em; overflow: auto; max-height: 40em; }
table { border-collapse: collapse; margin: .3em 0; background: #fff; }
th, td { border: 1px solid #ddd; padding: .2em .5em; text-align: left; vertical-align: top; }
th { background: #f0f0f0; }
.cards { display: flex; gap: 1em; flex-wrap: wrap; }
.card { background: #fff; border: 1px solid #ddd; border-radius: 6px; padding: .5em 1.2em; min-width: 8em; }
.card .num { font-size: 1.8em; font-weight: 600; }
.card.warn .num, .warn { color: #b35c00; } .card.bad .num, .bad { color: #c00000; }
.reasons { display: flex; gap: 2em; flex-wrap: wrap; } .reasons > div { max-width: 44em; }
.note { color: #555; } .none { color: #888; font-style: italic; }
.tree { background: #fff; border: 1px solid #ddd; padding: .4em 0; font-size: 13px; }
.tree-row { padding: .1em .4em; white-space: nowrap; overflow-x: auto; } .tree-row.entry { background: #f6fbf6; }
.badge { display: inline-block; border: 1px solid #ccc; border-radius: 4px; padding: 0 .35em; margin-left: .2em;
  font-size: 12px; background: #fafafa; white-space: normal; }
.badge.graph { background: #cdeccd; } .badge.bad { border-color: #e0a0a0; background: #fdeaea; }
.badge.eager { background: #fff3cd; border-color: #e0c870; }
.compiler { font-weight: 600; } .captures { margin-left: .5em; font-size: 12px; }
details.capture { background: #fff; border: 1px solid #ddd; border-radius: 6px; margin: .6em 0; padding: .3em .8em; }
details.capture > summary { cursor: pointer; font-weight: 600; }
.facts { color: #444; } .failure { color: #c00000; white-space: pre-wrap; }
.drawing { overflow: auto; max-height: 70vh; border: 1px solid #eee; background: #fff; margin: .4em 0; }
.legend { font-size: 13px; background: #fff; border: 1px solid #ddd; padding: .4em .8em; display: inline-block; }
.legend-help { color: #666; }
.swatch { display: inline-block; width: 1em; height: 1em; border: 1px solid #888; vertical-align: middle;
  margin-right: .35em; box-sizing: border-box; }
.wrap code { display: inline-block; margin: 0 .6em .2em 0; }
table.nodes td { font-size: 12.5px; }
.target > rect, .target > path, .target > polygon, .target > ellipse { stroke: #ff0066 !important;
  stroke-width: 4px !important; }
div.target, tr.target { outline: 2px solid #ff0066; }
"""

_SCRIPT = """
(function () {
  "use strict";
  function reveal(id) {
    var el = document.getElementById(id);
    if (!el) { return; }
    for (var p = el; p; p = p.parentElement) {
      if (p.tagName === "DETAILS") { p.open = true; }
    }
    document.querySelectorAll(".target").forEach(function (t) { t.classList.remove("target"); });
    el.classList.add("target");
    el.scrollIntoView({block: "center"});
  }
  function fromHash() {
    if (location.hash.length > 1) { reveal(decodeURIComponent(location.hash.slice(1))); }
  }
  document.addEventListener("click", function (event) {
    var link = event.target.closest ? event.target.closest("a[href^='#']") : null;
    if (link) { reveal(decodeURIComponent(link.getAttribute("href").slice(1))); }
  });
  function setAll(open) {
    document.querySelectorAll("details.capture").forEach(function (d) { d.open = open; });
  }
  document.getElementById("expand-all").addEventListener("click", function () { setAll(true); });
  document.getElementById("collapse-all").addEventListener("click", function () { setAll(false); });
  window.addEventListener("hashchange", fromHash);
  fromHash();
})();
"""


def _script_hash(script: str) -> str:
    return "sha256-" + base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()


def render(data: ReportData, layout: str = "auto") -> str:
    """The report page; ``layout`` is ``auto``, ``dot`` or ``builtin`` (see ``layout.draw``)."""
    drawer = _Drawer(layout)
    graphs = _graphs(data, drawer)  # first: the header names the layout it used
    sections = {
        "overview": _overview(data),
        "cache-tree": _cache_tree(data),
        "graphs": graphs,
        "misses": _misses(data),
        "breaks": _breaks_and_fallbacks(data),
    }
    body = "".join(
        f'<section id="{sid}"><h2>{e(SECTION_IDS[sid])}</h2>{content}</section>'
        for sid, content in sections.items()
    )
    nav = "".join(f'<a href="#{sid}">{e(title)}</a>' for sid, title in SECTION_IDS.items())
    versions = ", ".join(f"{e(k)} {e(v)}" for k, v in data.versions.items())
    csp = (
        f"default-src 'none'; style-src 'unsafe-inline'; img-src data:; script-src '{_script_hash(_SCRIPT)}'"
    )
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{csp}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>ca_runtime report: {e(data.command)}</title><style>{_CSS}</style></head><body>"
        "<header><h1>Compiled autograd report</h1>"
        f'<p class="meta"><code>{e(data.command)}</code> · pid {data.pid} · {e(data.created)}</p>'
        f'<p class="meta">{versions} · {drawer.description()}</p>'
        f'<nav>{nav} <button id="expand-all" type="button">expand all graphs</button> '
        '<button id="collapse-all" type="button">collapse all</button></nav></header>'
        f"{body}<script>{_SCRIPT}</script></body></html>\n"
    )
