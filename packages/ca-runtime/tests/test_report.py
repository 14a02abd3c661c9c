"""ca_runtime.report(): what is recorded (the model), the HTML it renders, CA_REPORT and the CLI."""

from __future__ import annotations

import html
import html.parser
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import ca_core
import ca_runtime
import pytest
import torch
from ca_runtime.__main__ import main as cli_main
from ca_runtime._cache_entry import CacheEntry
from ca_runtime._report.html import SECTION_IDS, render
from ca_runtime._report.layout import DrawGraph, DrawNode, dot_version, draw, layers
from ca_runtime._report.model import ReportData, build_report_data
from ca_runtime._report.records import (
    _TENSOR_PRE_HOOK_KINDS,
    RECORDER,
    HookKind,
    NodeKind,
    Outcome,
    ReasonKind,
    Stage,
    miss_category,
)

pytestmark = pytest.mark.filterwarnings("ignore::ca_runtime.GraphBreakWarning")

XSS_NAME = "<script>alert(1)</script>"
XSS_MESSAGE = "<img src=x onerror=alert(1)>"


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # .grad defined from the start: no extra capture on step 2
    return model


def _step(model: torch.nn.Sequential, batch: int, retain: bool = True) -> None:
    hidden = model[1](model[0](torch.randn(batch, 4)))
    if retain:
        hidden.retain_grad()  # a graph break at ReluBackward0
    model[2](hidden).sum().backward()


def _node(capture, name: str):
    return next(n for n in capture.nodes if n.name == name)


# -- the model ------------------------------------------------------------------


def test_captures_breaks_and_dynamic_sizes_are_recorded(backend: str) -> None:
    ca_runtime.reset()
    model = _model()
    with ca_runtime.enable(backend, capture_after=1):
        for batch in (4, 8, 16):  # static capture, dynamic capture, hit
            _step(model, batch)
    data = build_report_data()
    assert data.counters == ca_runtime.stats()  # every counter, see test_counters.py
    assert {k: data.counters[k] for k in ("captures", "cache_hits", "graph_breaks", "eager_fallbacks")} == {
        "captures": 2,
        "cache_hits": 1,
        "graph_breaks": 2,
        "eager_fallbacks": 0,
    }
    first, second = data.captures
    assert (first.id, second.id) == (1, 2) and data.num_captures == 2
    assert first.miss_node is None and first.outcome is second.outcome is Outcome.RAN
    assert "changed from 4 to 8 and is now dynamic" in second.miss_reason
    assert second.nodes[second.miss_node].name == "SumBackward0"
    assert first.lifted.num_dynamic_sizes == 0 < second.lifted.num_dynamic_sizes
    assert "float32[4, 4]" in first.lifted.tensors and "float32[8, 4]" in second.lifted.tensors
    for capture in data.captures:
        assert capture.capture_s > 0 and capture.compile_s > 0 and capture.first_run_s > 0
        assert "apply_node" in capture.code
        assert [b.node_name for b in capture.breaks] == ["ReluBackward0"]
        relu = _node(capture, "ReluBackward0")
        assert relu.kind == "break" and "retain_grad" in relu.detail
        assert relu.hooks[0].kind is HookKind.TENSOR_PRE_RETAINS_GRAD
        assert _node(capture, "AddmmBackward0").kind == "traced"
        leaves = [n for n in capture.nodes if n.is_leaf]
        assert len(leaves) == 4 and {n.kind for n in leaves} == {"leaf"}
        assert all(n.sequence_nr >= 0 for n in capture.nodes if not n.is_leaf)
    # The cache tree: both captures were stored at the same entry, which now has dynamic sizes and the hit.
    tree = {n.id: n for n in data.cache_tree}
    assert first.entry_id == second.entry_id
    entry = tree[second.entry_id]
    assert entry.has_graph and entry.hits == 1 and entry.dynamic_sizes > 0 and not entry.failed
    assert entry.node_name.endswith("AccumulateGrad")  # the last node of the key path
    (root,) = (n for n in data.cache_tree if n.parent == -1 and n.compiler == f"backend:{backend}")
    assert tree[first.entry_id].compiler == root.compiler
    assert data.top_reasons["break"] == [("retain_grad() sets .grad eagerly", 2)]
    assert ("a size changed and is now dynamic", 1) in data.top_reasons["miss"]
    assert set(data.seconds) == {"capture", "compile", "first_run"}


class _Doubled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        return x * 2

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad * 2


def _scale_hook(grad: torch.Tensor) -> torch.Tensor:
    return grad * 3


def test_functions_and_hooks_are_marked() -> None:
    ca_runtime.reset()
    x = torch.randn(3, requires_grad=True)
    with ca_runtime.enable("eager", capture_after=1):
        y = _Doubled.apply(x * 1.5)
        y.register_hook(_scale_hook)
        y.sum().backward()
    (capture,) = build_report_data().captures
    doubled = _node(capture, "_DoubledBackward")
    assert doubled.kind == "function"
    ((hook),) = doubled.hooks
    assert hook.kind is HookKind.TENSOR_PRE_PYTHON and "_scale_hook" in hook.repr
    assert capture.lifted.num_hooks >= 2  # the hook and the Function's ctx


def test_every_tensor_pre_hook_kind_has_a_report_kind() -> None:
    assert set(_TENSOR_PRE_HOOK_KINDS) == set(ca_core.TensorPreHookKind)


def test_compiler_fn_failure_is_a_recorded_fallback() -> None:
    ca_runtime.reset()

    def broken(gm: torch.fx.GraphModule):
        raise RuntimeError("this compiler is broken today")

    x = torch.randn(3, requires_grad=True)
    with pytest.warns(ca_runtime.EagerFallbackWarning), ca_runtime.enable(broken, capture_after=1):
        (x * 2).sum().backward()
    data = build_report_data()
    (capture,) = data.captures
    (fallback,) = data.fallbacks
    assert (
        capture.outcome is Outcome.FAILED and capture.failure_stage is Stage.COMPILE and capture.ran_eagerly
    )
    assert "this compiler is broken today" in capture.failure
    assert capture.compile_s is None and capture.first_run_s is None
    assert {n.kind for n in capture.nodes if n.needed} == {"eager"}
    assert "planned: traced" in _node(capture, "MulBackward0").detail
    assert (fallback.where, fallback.capture_id) == ("compiler_fn", capture.id)
    assert "this compiler is broken today" in fallback.reason
    assert data.counters["eager_fallbacks"] == 1
    (entry,) = [n for n in data.cache_tree if n.id == capture.entry_id]
    assert entry.failed and "this compiler is broken today" in entry.failure
    assert data.top_reasons["fallback"][0][0].startswith("compiler_fn: RuntimeError: this compiler")
    # Stages and outcomes are read back from the JSON as what they are.
    again = ReportData.from_json(json.loads(json.dumps(data.to_json())))
    assert again == data and again.captures[0].failure_stage is Stage.COMPILE
    assert again.captures[0].outcome is Outcome.FAILED and set(again.seconds) <= set(Stage)
    assert all(type(stage) is Stage for stage in again.seconds)
    assert "failed at compiler_fn" in render(again)


def test_first_run_failure_is_a_recorded_fallback() -> None:
    ca_runtime.reset()

    def refusing_backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
        raise RuntimeError("the backend refuses")

    def compile_lazily(gm: torch.fx.GraphModule):
        return torch.compile(gm, backend=refusing_backend)

    x = torch.randn(3, requires_grad=True)
    with pytest.warns(ca_runtime.EagerFallbackWarning), ca_runtime.enable(compile_lazily, capture_after=1):
        (x * 2).sum().backward()
    data = build_report_data()
    (capture,) = data.captures
    (fallback,) = data.fallbacks
    assert capture.failure_stage is Stage.FIRST_RUN and "the backend refuses" in capture.failure
    assert capture.compile_s is not None and capture.first_run_s is not None and capture.ran_eagerly
    assert (fallback.where, fallback.capture_id) == ("compiled graph", capture.id)


def test_unsupported_capture_marks_the_failing_node(monkeypatch: pytest.MonkeyPatch) -> None:
    from ca_runtime import _runtime
    from ca_runtime._capture import UnsupportedNode

    def refuse(graph: ca_core.BackwardGraph):
        raise UnsupportedNode(graph.nodes[1], "refused by the test")

    monkeypatch.setattr(_runtime, "build_graph_module", refuse)
    ca_runtime.reset()
    x = torch.randn(3, requires_grad=True)
    with pytest.warns(ca_runtime.EagerFallbackWarning), ca_runtime.enable("eager", capture_after=1):
        (x * 2).sum().backward()
    data = build_report_data()
    (capture,) = data.captures
    assert capture.failure_stage == "capture" and capture.failed_node == 1 and capture.code == ""
    assert data.fallbacks[0].where == capture.nodes[1].name
    page = render(data, "builtin")
    assert 'href="#c1-n1"' in page  # the fallback links to the node


def test_cache_hits_record_nothing() -> None:
    ca_runtime.reset()
    model = _model()
    with ca_runtime.enable("eager", capture_after=1):
        _step(model, 4, retain=False)
        before = RECORDER.snapshot()
        for _ in range(3):
            _step(model, 4, retain=False)
    after = RECORDER.snapshot()
    assert ca_runtime.stats()["cache_hits"] == 3
    assert (after.num_captures, after.num_fallbacks, after.seconds) == (
        before.num_captures,
        before.num_fallbacks,
        before.seconds,
    )


def test_reset_forgets_records_and_timings() -> None:
    ca_runtime.collect_timings()
    try:
        model = _model()
        with ca_runtime.enable("eager", capture_after=1):
            _step(model, 4, retain=False)
            _step(model, 4, retain=False)
        timings = build_report_data().timings
        assert timings is not None and timings["timed_backwards"] == 2
        assert timings["walk_ns"] > 0 and timings["run_ns"] > 0 and timings["finish_ns"] > 0
        assert timings["lookup_ns"] > 0
        # The whole hook holds its steps.
        steps = sum(timings[k] for k in ("walk_ns", "lookup_ns", "run_ns", "finish_ns"))
        assert timings["hook_ns"] >= steps
        ca_runtime.reset()
        data = build_report_data()
        assert data.captures == [] and data.num_captures == 0
        assert all(n.parent == -1 for n in data.cache_tree)  # at most the empty compiler roots
        assert data.timings == {
            "walk_ns": 0,
            "lookup_ns": 0,
            "run_ns": 0,
            "finish_ns": 0,
            "hook_ns": 0,
            "timed_backwards": 0,
            "keys_hashed": 0,
        }
    finally:
        ca_runtime.collect_timings(False)
    assert build_report_data().timings is None  # off and nothing timed: "not collected"


def test_records_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    from ca_runtime._report import records

    monkeypatch.setattr(records, "REPORT_LIMIT", 3)
    ca_runtime.reset()  # a new log, bounded at 3
    with ca_runtime.enable("eager", capture_after=1):
        for n in range(5):  # five distinct graphs: chains of 1..5 muls
            y = torch.randn(2, requires_grad=True)
            for _ in range(n + 1):
                y = y * 2
            y.sum().backward()
    data = build_report_data()
    assert data.num_captures == 5 and [c.id for c in data.captures] == [3, 4, 5]
    assert data.record_limit == 3
    assert "showing 3 of 5 captures" in render(data, "builtin")
    monkeypatch.undo()
    ca_runtime.reset()
    assert RECORDER.log.captures.maxlen == records.REPORT_LIMIT == 200


def test_miss_categories_drop_numbers() -> None:
    assert miss_category(None, "").startswith("first capture")
    assert (
        miss_category(
            3,
            "a size SumBackward0 (node 1) saved in the forward (#0) changed from 4 to 8 and is now dynamic; "
            "a dimension of an output grad of MmBackward0 (node 3) changed from 4 to 8 and is now dynamic; "
            "and 2 more sizes changed",
        )
        == "a size changed and is now dynamic"
    )
    assert (
        miss_category(2, "a hook was added to its Python tensor hooks (1 now, 0 in the cached graph)")
        == "a hook was added to its Python tensor hooks"
    )


# -- JSON and HTML ------------------------------------------------------------------


def _recorded_run(backend: str = "eager") -> ReportData:
    ca_runtime.reset()
    model = _model()
    with ca_runtime.enable(backend, capture_after=1):
        for batch in (4, 8):
            _step(model, batch)
    return build_report_data()


def test_json_round_trip() -> None:
    data = _recorded_run()
    again = ReportData.from_json(json.loads(json.dumps(data.to_json())))
    assert again == data
    assert all(type(node.kind) is NodeKind for capture in again.captures for node in capture.nodes)
    hooks = [hook for capture in again.captures for node in capture.nodes for hook in node.hooks]
    assert hooks and all(type(hook.kind) is HookKind for hook in hooks)
    assert list(again.top_reasons) == list(ReasonKind) and all(
        type(k) is ReasonKind for k in again.top_reasons
    )
    with pytest.raises(ValueError, match="format version"):
        ReportData.from_json({**data.to_json(), "format_version": 99})


class _Tags(html.parser.HTMLParser):
    """Every start tag with its attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))


def _tags(page: str) -> list[tuple[str, dict[str, str | None]]]:
    parser = _Tags()
    parser.feed(page)
    return parser.tags


def _assert_self_contained(page: str) -> None:
    """Nothing loaded from outside, no markup from user strings, every internal link resolves."""
    tags = _tags(page)
    ids = {attrs["id"] for _, attrs in tags if attrs.get("id")}
    assert [t for t, _ in tags].count("script") == 1, "only the report's own script"
    for tag, attrs in tags:
        assert tag not in ("img", "iframe", "link", "object", "embed"), tag
        assert "src" not in attrs, (tag, attrs)
        for name, value in attrs.items():
            assert not name.startswith("on"), (tag, name)
            if name in ("href", "xlink:href", "action"):
                assert value is not None and value.startswith("#"), (tag, name, value)
                assert value[1:] in ids, f"link to a missing id: {value}"
    assert "http://" not in page and "https://" not in page


@pytest.mark.parametrize("layout", ["builtin", "dot"])
def test_page_has_every_section_and_links_resolve(layout: str) -> None:
    if layout == "dot" and dot_version() is None:
        pytest.skip("graphviz dot is not installed")
    page = render(_recorded_run(), layout)
    all_ids = [attrs["id"] for _, attrs in _tags(page) if attrs.get("id")]
    assert len(all_ids) == len(set(all_ids)), "ids are unique"
    ids = set(all_ids)
    assert set(SECTION_IDS) <= ids
    assert {"capture-1", "capture-2", "c1-n0", "c2-n2"} <= ids
    links = {attrs["href"][1:] for tag, attrs in _tags(page) if tag == "a" and attrs.get("href")}
    assert links <= ids, links - ids
    assert "c2-n2" in links  # the break at ReluBackward0, node 2 of capture 2
    assert "Timed backwards" not in page and "were not timed" in page
    _assert_self_contained(page)


def test_user_strings_are_escaped() -> None:
    ca_runtime.reset()
    payload_function = type(
        XSS_NAME,
        (torch.autograd.Function,),
        {
            "forward": staticmethod(lambda ctx, x: x * 2),
            "backward": staticmethod(lambda ctx, grad: grad * 2),
        },
    )

    def hook(grad: torch.Tensor) -> torch.Tensor:
        return grad

    hook.__qualname__ = XSS_NAME

    def broken(gm: torch.fx.GraphModule):
        raise RuntimeError(f"compiler says {XSS_MESSAGE} and {XSS_NAME}")

    x = torch.randn(3, requires_grad=True)
    with ca_runtime.enable("eager", capture_after=1):
        y = payload_function.apply(x)
        y.retain_grad()  # a graph break at the Function's node, named after it
        y.register_hook(hook)
        (y * 3).sum().backward()
    with pytest.warns(ca_runtime.EagerFallbackWarning), ca_runtime.enable(broken, capture_after=1):
        (x * 5).sum().backward()
    data = build_report_data()
    assert data.captures[0].breaks[0].node_name == XSS_NAME + "Backward"
    assert any(XSS_NAME in h.repr for n in data.captures[0].nodes for h in n.hooks)
    assert XSS_MESSAGE in data.fallbacks[0].reason
    for layout in ("builtin", "dot") if dot_version() else ("builtin",):
        page = render(data, layout)
        for payload in (XSS_NAME, XSS_MESSAGE):
            assert payload not in page, layout
            assert html.escape(payload) in page, layout
        _assert_self_contained(page)


# -- graph layouts ---------------------------------------------------------------


def test_layered_layout_layers() -> None:
    # root -> a, root -> b, a -> c, b -> c, c -> d, root -> d: d is below c.
    assert layers(5, [(0, 1), (0, 2), (1, 3), (2, 3), (3, 4), (0, 4)]) == [0, 1, 1, 2, 3]
    assert layers(3, []) == [0, 0, 0]


def _tiny_graph() -> DrawGraph:
    nodes = tuple(
        DrawNode(f"g-n{i}", (f"Node{i}", f"#{i}"), f"title {i} {XSS_NAME}", "#cdeccd") for i in range(3)
    )
    return DrawGraph(nodes, ((0, 1), (0, 2), (1, 2)))


def test_builtin_layout_draws_escaped_svg() -> None:
    svg, used = draw(_tiny_graph(), "builtin")
    assert used == "builtin" and svg.startswith("<svg")
    assert all(f'id="g-n{i}"' in svg for i in range(3)) and svg.count('<path class="edge"') == 3
    assert XSS_NAME not in svg and html.escape(XSS_NAME) in svg


def _points_on(d: str) -> list[tuple[float, float]]:
    """Points along an SVG path of M, L and C commands (as the built-in layout writes them)."""
    tokens = re.findall(r"[MLC]|-?\d+(?:\.\d+)?", d)
    points: list[tuple[float, float]] = []
    at = (0.0, 0.0)
    i = 0
    while i < len(tokens):
        cmd = tokens[i]
        i += 1
        count = {"M": 1, "L": 1, "C": 3}[cmd]
        xy = [(float(tokens[i + 2 * k]), float(tokens[i + 2 * k + 1])) for k in range(count)]
        i += 2 * count
        for t in (j / 40 for j in range(41)):
            if cmd == "L":
                points.append((at[0] + (xy[0][0] - at[0]) * t, at[1] + (xy[0][1] - at[1]) * t))
            elif cmd == "C":
                (x1, y1), (x2, y2), (x3, y3) = xy
                u = 1 - t
                points.append(
                    (
                        u**3 * at[0] + 3 * u * u * t * x1 + 3 * u * t * t * x2 + t**3 * x3,
                        u**3 * at[1] + 3 * u * u * t * y1 + 3 * u * t * t * y2 + t**3 * y3,
                    )
                )
        at = xy[-1]
    return points


def test_builtin_layout_edges_never_cross_a_box() -> None:
    """Long edges (a root feeding every layer, a skip connection) run through the gaps between boxes."""
    wide = [("AddmmBackward0", "#1"), ("x", "#2"), ("AccumulateGrad", "#3 long name here")]
    nodes = tuple(DrawNode(f"g-n{i}", wide[i % 3], "", "#cdeccd") for i in range(9))
    edges = ((0, 1), (1, 2), (2, 3), (3, 4), (0, 4), (0, 5), (1, 5), (2, 6), (0, 7), (5, 8), (1, 8), (4, 6))
    svg, _ = draw(DrawGraph(nodes, edges), "builtin")
    boxes = [
        tuple(float(v) for v in m)
        for m in re.findall(r'<rect x="([\d.]+)" y="([\d.]+)" width="([\d.]+)" height="([\d.]+)"', svg)
    ]
    paths = re.findall(r'<path class="edge" d="([^"]+)"', svg)
    assert len(boxes) == 9 and len(paths) == len(edges)
    for d in paths:
        for px, py in _points_on(d):
            for bx, by, bw, bh in boxes:
                inside = bx + 1 < px < bx + bw - 1 and by + 1 < py < by + bh - 1
                assert not inside, f"edge {d} passes through the box at {(bx, by, bw, bh)}"


def _boxes_and_paths(svg: str) -> tuple[list[tuple[float, ...]], list[str]]:
    boxes = [
        tuple(float(v) for v in m)
        for m in re.findall(r'<rect x="([\d.]+)" y="([\d.]+)" width="([\d.]+)" height="([\d.]+)"', svg)
    ]
    return boxes, re.findall(r'<path class="edge" d="([^"]+)"', svg)


def test_builtin_layout_puts_a_tall_graph_in_bands_across_the_page() -> None:
    """A 300-node chain (with skip edges) fills the page's width in bands, and no edge crosses a box."""
    nodes = tuple(DrawNode(f"g-n{i}", (f"MulBackward0 #{i}", "x"), "", "#cdeccd") for i in range(300))
    edges = tuple((i, i + 1) for i in range(299)) + tuple((i, i + 7) for i in range(0, 290, 23))
    svg, _ = draw(DrawGraph(nodes, edges), "builtin")
    width, height = (float(v) for v in re.search(r'<svg[^>]* width="(\d+)" height="(\d+)"', svg).groups())
    boxes, paths = _boxes_and_paths(svg)
    assert len(boxes) == 300 and len(paths) == len(edges)
    columns = {bx for bx, _, _, _ in boxes}
    assert len(columns) >= 6, "a chain drawn as one column uses a sliver of the page"
    assert 1000 < width <= 1400 and height < width * 3
    for d in paths:
        for px, py in _points_on(d):
            assert 0 <= px <= width and 0 <= py <= height
            for bx, by, bw, bh in boxes:
                inside = bx + 1 < px < bx + bw - 1 and by + 1 < py < by + bh - 1
                assert not inside, f"edge {d} passes through the box at {(bx, by, bw, bh)}"


def test_builtin_layout_keeps_a_short_graph_in_one_band() -> None:
    svg, _ = draw(_tiny_graph(), "builtin")
    boxes, _ = _boxes_and_paths(svg)
    assert max(bx + bw for bx, _, bw, _ in boxes) < 400


@pytest.mark.skipif(dot_version() is None, reason="graphviz dot is not installed")
def test_dot_layout_draws_inlinable_svg() -> None:
    svg, used = draw(_tiny_graph(), "dot")
    assert used == "dot" and svg.startswith("<svg") and "<?xml" not in svg and "xmlns" not in svg
    assert all(f'id="g-n{i}"' in svg for i in range(3)) and svg.count(" id=") == 3
    assert XSS_NAME not in svg and html.escape(XSS_NAME) in svg
    page = render(_recorded_run(), "dot")
    assert "Graphs drawn with graphviz dot" in page
    ids = [attrs.get("id") for _, attrs in _tags(page) if attrs.get("id")]
    assert len(ids) == len(set(ids)) and {"c1-n0", "c2-n2"} <= set(ids)


def test_auto_layout_falls_back_without_dot(monkeypatch: pytest.MonkeyPatch) -> None:
    from ca_runtime._report import layout

    monkeypatch.setattr(layout.shutil, "which", lambda name: None)
    monkeypatch.setattr(layout, "dot_version", lambda: None)
    from ca_runtime._report import html as report_html

    monkeypatch.setattr(report_html, "dot_version", lambda: None)
    assert draw(_tiny_graph(), "auto")[1] == "builtin"
    with pytest.raises(layout.LayoutError):
        draw(_tiny_graph(), "dot")
    page = render(_recorded_run(), "auto")
    assert "built-in layered layout (graphviz dot is not installed)" in page


def test_cache_tree_chains_are_one_row() -> None:
    def tree_node(i: int, parent: int, name: str, **kw: object) -> CacheEntry:
        fields: dict[str, object] = dict(
            key_path_length=0,
            compiler="backend:eager",
            hits=0,
            failed=False,
            failure="",
            sizes=0,
            dynamic_sizes=0,
        )
        fields.update(kw)
        return CacheEntry(id=i, parent=parent, node_name=name, **fields)  # type: ignore[arg-type]

    chain = [tree_node(1, -1, "")] + [tree_node(i, i - 1, f"Node{i}") for i in range(2, 12)]
    chain += [tree_node(12, 11, "Leaf", has_graph=True, hits=5, failed=True, failure=XSS_MESSAGE)]
    data = _recorded_run()
    data.cache_tree = chain
    page = render(data, "builtin")
    tree = page[page.index('id="cache-tree"') : page.index('id="graphs"')]
    assert tree.count('class="tree-row') == 2  # the root, then one row for the chain
    assert "… 7 nodes …" in tree and "5 hits" in tree and html.escape(XSS_MESSAGE) in tree
    assert all(f'id="tree-{i}"' in tree for i in range(1, 13))  # every node stays a link target


# -- report(), CA_REPORT and the CLI -------------------------------------------------


def test_report_writes_html_and_json(tmp_path: Path) -> None:
    _recorded_run()
    path = ca_runtime.report(tmp_path / "sub" / "r.html", layout="builtin")
    assert path == (tmp_path / "sub" / "r.html").resolve()
    assert 'id="overview"' in path.read_text()
    data = ReportData.from_json(json.loads(path.with_suffix(".json").read_text()))
    assert data.counters["captures"] == 2
    with pytest.raises(ValueError, match="layout"):
        ca_runtime.report(tmp_path / "r.html", layout="neato")


def test_cli_open_renders_and_opens(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _recorded_run()
    ca_runtime.report(tmp_path / "r.html")
    opened: list[str] = []
    monkeypatch.setattr("webbrowser.open", opened.append)
    out = tmp_path / "again.html"
    assert cli_main(["report", "--from", str(tmp_path / "r.json"), "-o", str(out), "--open"]) == 0
    assert opened == [out.resolve().as_uri()] and 'id="graphs"' in out.read_text()


_TRAIN_SCRIPT = textwrap.dedent(
    """
    import ca_runtime, torch

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    with ca_runtime.enable("eager", capture_after=1):
        for batch in (4, 4, 8, 8):
            model(torch.randn(batch, 4)).sum().backward()
    print("stats", ca_runtime.stats())
    """
)


def test_ca_report_writes_at_exit_and_cli_renders_it(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(_TRAIN_SCRIPT)
    out = tmp_path / "out" / "report.html"
    env = {**os.environ, "CA_REPORT": str(out), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    run = subprocess.run(
        [sys.executable, str(script)], check=False, env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    assert f"report written to {out}" in run.stderr
    data = json.loads(out.with_suffix(".json").read_text())
    # Written before _release_at_exit empties the cache, with timings on.
    assert data["cache_tree"] and any(n["has_graph"] for n in data["cache_tree"])
    assert data["timings"]["timed_backwards"] == 4
    assert data["counters"]["captures"] == 3 and data["counters"]["cache_hits"] == 1
    pointer = json.loads((tmp_path / "cache" / "ca_runtime" / "last-report.json").read_text())
    assert pointer == {"html": str(out), "json": str(out.with_suffix(".json"))}
    page = out.read_text()
    assert all(f'id="{sid}"' in page for sid in SECTION_IDS)
    # The CLI finds it through the pointer; CA_REPORT in its environment must not overwrite it.
    rendered = tmp_path / "rendered.html"
    cli = subprocess.run(
        [sys.executable, "-m", "ca_runtime", "report", "-o", str(rendered), "--layout", "builtin"],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout.strip() == str(rendered) and "built-in layered layout" in rendered.read_text()
    assert out.read_text() == page
    # {pid} in the path: one report per process.
    env["CA_REPORT"] = str(tmp_path / "per-process-{pid}.html")
    run = subprocess.run(
        [sys.executable, str(script)], check=False, env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    (written,) = tmp_path.glob("per-process-*.html")
    assert written.stem.removeprefix("per-process-").isdigit()


def test_cli_without_a_saved_report_says_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.raises(SystemExit, match=r"CA_REPORT=out\.html"):
        cli_main(["report"])


def test_stage_times_show_first_runs_apart_from_cache_hits(tmp_path: Path) -> None:
    """A first run (a lazy compile) and a hit are averaged apart: one average over both says nothing."""
    model = _model()
    ca_runtime.collect_timings()
    try:
        with ca_runtime.enable("eager", eager_if_faster=False, capture_after=1):
            for _ in range(4):
                model(torch.randn(4, 4)).sum().backward()
    finally:
        ca_runtime.collect_timings(False)
    assert ca_runtime.stats()["captures"] == 1 and ca_runtime.stats()["cache_hits"] == 3
    page = ca_runtime.report(tmp_path / "r.html").read_text()
    assert "first runs (include the lazy compile)" in page and "compiled runs on cache hits" in page
    assert "per timed backward" not in page and "cache hits and first runs" not in page


def test_cache_tree_siblings_of_one_name_say_how_they_differ(tmp_path: Path) -> None:
    """A leaf's AccumulateGrad with .grad None and with .grad defined: two branches, told apart in words."""
    lin = torch.nn.Linear(3, 2)
    with ca_runtime.enable("eager", capture_after=1):
        lin(torch.randn(2, 3)).sum().backward()  # .grad None
        lin(torch.randn(2, 3)).sum().backward()  # .grad defined
    assert ca_runtime.stats()["captures"] == 2
    page = ca_runtime.report(tmp_path / "r.html").read_text()
    assert "(.grad None" in page and "(.grad defined" in page, page[:2000]
