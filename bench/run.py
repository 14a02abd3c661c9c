"""Benchmarks: eager autograd vs torch's built-in compiled autograd vs ours.

1 CPU thread. For each workload the three implementations run the same
forward; only ``loss.backward()`` is timed. The first backward of each
implementation is timed in a process of its own, with a fresh Inductor cache
directory and Inductor's FX graph cache off, so that none reuses anything
another compiled (``--first-backward``). Then, in this process, each is
warmed up and ``--iters`` rounds interleave ours with eager so that drift
hits both alike, each round in another order (rotated), then as many rounds
interleave torch's with eager (see ``ROUNDS``: torch's backward never runs
between two of ours'). Reports median and min, the ratios ours/eager and
ours/torch (the latter through eager: ours/eager over torch/eager, each
paired in its own rounds), captures and Dynamo graphs, and ours/eager per
round: the median of the rounds' own ratios with a bootstrap 95 % interval
(see ``paired_ratio``); writes JSON, a markdown table and a PNG of
per-node overhead against node count.

A last workload times whole training steps (forward + backward) of a
decoder whose forward is ``torch.compile``'d with inductor: the backward on
the eager engine (torch.compile alone), on torch's compiled autograd, on
ours, and on ours with Inductor compiling in the background
(``compile_in_background=True``, "ours-bg"; also a first-backward column
of the inductor workloads).

    python bench/run.py [--iters 30] [--out bench/results] [--quick] [--only training|memory|per-node|...]
    python bench/run.py --only small-ops --iters 30   # LSTM, gated cell, PINN: with a torch.compile column
    python bench/run.py --device cuda                 # the same on a GPU (skipped without CUDA)
    python bench/run.py --first-backward gpt inductor ours   # one cold first backward, as JSON
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import ca_runtime
import torch
import torch._inductor.codecache
import torch._inductor.config
import torch.utils.checkpoint
from ca_testkit.implementations import IMPLEMENTATIONS, as_compiler, get_implementation
from ca_testkit.memory import backward_tensor_peak_bytes as tensor_peak_bytes
from ca_testkit.scenarios import Decoder
from torch._dynamo.utils import counters

IMPLS = ("eager", "torch", "ours", "ours-compiled")
#: Backwards after which each of ours' cache entries has timed its graph
#: against the eager engine and chosen (a first run, 4 untimed hits, 8 timed
#: runs each way, up to 24 while undecided; see [Note: Eager if faster]
#: in ca_core), plus one.
CHOICE_RUNS = 1 + 4 + 2 * 24 + 1
Compiler = Callable[[torch.fx.GraphModule], Callable[..., Any]]


@dataclasses.dataclass
class Workload:
    """A forward that returns a loss, the compiler both compiled autograds use, its node count."""

    name: str
    forward: Callable[[int], torch.Tensor]
    compiler: Compiler | None
    nodes: int = 0
    params: list[torch.Tensor] = dataclasses.field(default_factory=list)
    #: Its name in WORKLOADS (how a --first-backward process rebuilds it).
    key: str = ""
    #: Its compiler's name (see compiler_named).
    compiler_name: str = ""
    #: Whether ``torch.compile`` can compile its forward with a backward of its
    #: own (AOTAutograd): not for a forward that calls ``autograd.grad``.
    torch_compilable: bool = True
    #: ``torch.compile(forward)`` with its compiler, made on first use ("torch.compile" column).
    compiled_forward: Callable[[int], torch.Tensor] | None = None

    def forward_for(self, impl: str) -> Callable[[int], torch.Tensor]:
        """The forward ``impl`` runs: the ``torch.compile``'d one for "tc", else the plain one."""
        if impl != "tc":
            return self.forward
        if self.compiled_forward is None:
            self.compiled_forward = torch.compile(self.forward, backend=self.compiler_name or "inductor")
        return self.compiled_forward


def backend(name: str) -> Compiler:
    """The same compiler_fn object for ours and torch's (a backend name would give each its own)."""
    return as_compiler(name)


def no_work(gm: torch.fx.GraphModule) -> Callable[..., Any]:
    """A compiled function that computes nothing: isolates the engine's own cost."""
    outputs = [None] * len(gm.graph.output_node().args[0])
    return lambda *args: list(outputs)


@contextlib.contextmanager
def implementation(impl: str, compiler: Compiler | None) -> Iterator[None]:
    if impl in ("eager", "eager-again", "tc"):
        # "tc": the backward of a torch.compile'd forward (AOTAutograd's graph), on the eager engine.
        # "eager-again": eager timed a second time in the same rounds (see ROUNDS).
        with ca_runtime.disable():
            yield
    elif impl == "ours-bg":
        # Ours with Inductor compiling in the background (see [Note: Compiling
        # in the background]): the backend is "inductor" whatever `compiler` is;
        # capture_after=1, as every ca_testkit implementation but the default's.
        with get_implementation("ca-background").enable("inductor"):
            yield
    else:
        assert compiler is not None
        # "ours": ours choosing by timing (enable(eager_if_faster=True));
        # "ours-compiled": ours' default, the graph on every hit.
        names = {"ours": "ca-timed", "ours-compiled": "ca-compiled", "torch": "torch"}
        with get_implementation(names[impl]).enable(compiler):
            yield


def ours_eager_if_faster_choice() -> list[str]:
    """How ours' cache entries with a graph run (``CacheEntry.eager_if_faster_choice``), each way once."""
    return sorted({e.eager_if_faster_choice for e in ca_runtime.cache_info() if e.eager_if_faster_choice})


def _graph_nodes(loss: torch.Tensor) -> int:
    seen, stack = set(), [loss.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        stack.extend(f for f, _ in fn.next_functions)
    return len(seen)


def mlp(batch: int = 64) -> Workload:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 10),
    )
    x, y = torch.randn(batch, 512), torch.randint(0, 10, (batch,))

    def forward(i: int) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(model(x), y)

    return Workload("mlp 512-1024-1024-10 b64", forward, None, params=list(model.parameters()))


def transformer() -> Workload:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(128, 4, 512, dropout=0.0, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    x = torch.randn(8, 32, 128)

    def forward(i: int) -> torch.Tensor:
        return model(x).pow(2).mean()

    return Workload("transformer 2x d128 h4 s32 b8", forward, None, params=list(model.parameters()))


def chain(n: int) -> Workload:
    x = torch.randn(16, requires_grad=True)
    factors = [torch.full((16,), 1.0001) for _ in range(n)]

    def forward(i: int) -> torch.Tensor:
        y = x
        for f in factors:
            y = y * f
        return y.sum()

    return Workload(f"chain {n}", forward, None, params=[x])


def gpt() -> Workload:
    """The GPT-style decoder of the performance issue: 6 layers, d 384, 6 heads, seq 128, batch 4, AdamW.

    An AdamW step runs before each forward (untimed), as in training.
    """
    torch.manual_seed(0)
    model = Decoder(d=384, heads=6, layers=6, seq=128)
    tokens = torch.randint(0, 512, (4, 128))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def forward(i: int) -> torch.Tensor:
        if any(p.grad is not None for p in model.parameters()):
            optimizer.step()
        return model(tokens)

    return Workload("GPT-style decoder 6x d384 h6 s128 b4", forward, None, params=list(model.parameters()))


def checkpointed_mlp(determinism_check: str = "default") -> Workload:
    """Three non-reentrant checkpointed blocks 512-1024-512 (GELU), batch 64.

    With the default ``determinism_check`` each region is recomputed inside
    our graph; with ``"none"`` behind one graph break per region (see
    [Note: Checkpoint regions in the graph] in ca_runtime).
    """
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(
        torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 512))
        for _ in range(3)
    )
    x = torch.randn(64, 512)

    def forward(i: int) -> torch.Tensor:
        h = x
        for block in blocks:
            h = torch.utils.checkpoint.checkpoint(
                block, h, use_reentrant=False, determinism_check=determinism_check
            )
        return h.pow(2).mean()

    name = "checkpointed MLP 3x 512-1024-512 b64" + (
        ", regions behind breaks" if determinism_check == "none" else ""
    )
    return Workload(name, forward, None, params=list(blocks.parameters()))


def lstm() -> Workload:
    """Many small ops: ``nn.LSTMCell(32, 64)`` unrolled over 48 steps, batch 16, a linear head, MSE."""
    torch.manual_seed(0)
    cell, head = torch.nn.LSTMCell(32, 64), torch.nn.Linear(64, 1)
    xs, target = torch.randn(48, 16, 32), torch.randn(16, 1)

    def forward(i: int) -> torch.Tensor:
        h = c = torch.zeros(16, 64)
        for x in xs:
            h, c = cell(x, (h, c))
        return torch.nn.functional.mse_loss(head(h), target)

    params = [*cell.parameters(), *head.parameters()]
    return Workload("LSTMCell 32-64 x48 steps b16", forward, None, params=params)


class GatedCell(torch.nn.Module):
    """A GRU-like cell written out: two ``Linear(48, 144)``, sigmoid/tanh gates, ``LayerNorm(48)``."""

    def __init__(self, d: int = 48) -> None:
        super().__init__()
        self.from_x, self.from_h = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, 3 * d)
        self.norm = torch.nn.LayerNorm(d)

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        xr, xz, xn = self.from_x(x).chunk(3, dim=-1)
        hr, hz, hn = self.from_h(h).chunk(3, dim=-1)
        r, z = torch.sigmoid(xr + hr), torch.sigmoid(xz + hz)
        n = torch.tanh(xn + r * hn)
        return self.norm((1 - z) * n + z * h)


def gated_cell() -> Workload:
    """Many small ops: GatedCell unrolled over 32 steps, batch 8, MSE against a target."""
    torch.manual_seed(0)
    cell = GatedCell()
    xs, target = torch.randn(32, 8, 48), torch.randn(8, 48)

    def forward(i: int) -> torch.Tensor:
        h = torch.zeros(8, 48)
        for x in xs:
            h = cell(x, h)
        return torch.nn.functional.mse_loss(h, target)

    return Workload("gated cell d48 x32 steps b8", forward, None, params=list(cell.parameters()))


def pinn() -> Workload:
    """A physics-informed MLP 2-32-32-32-1 (tanh) on 256 points (t, x): u, du/dt and d2u/dx2.

    The residual of the heat equation u_t = 0.1 u_xx, plus u itself, is the
    loss; du/dt and d2u/dx2 come from two ``autograd.grad(create_graph=True)``
    in the (untimed) forward, so the timed backward differentiates backward
    graphs: a double backward, which ``torch.compile`` cannot compile.
    """
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(2, 32),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 32),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 32),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 1),
    )
    points = torch.rand(256, 2)

    def forward(i: int) -> torch.Tensor:
        p = points.clone().requires_grad_(True)
        u = net(p)
        (du,) = torch.autograd.grad(u.sum(), p, create_graph=True)
        (ddu,) = torch.autograd.grad(du[:, 1].sum(), p, create_graph=True)
        residual = du[:, 0] - 0.1 * ddu[:, 1]
        return residual.pow(2).mean() + u.pow(2).mean()

    return Workload(
        "PINN MLP 2-32x3-1 tanh, 256 points, u_t and u_xx",
        forward,
        None,
        params=list(net.parameters()),
        torch_compilable=False,
    )


#: Every backward workload by key, for --first-backward's processes.
WORKLOADS: dict[str, Callable[[], Workload]] = {
    "mlp": mlp,
    "transformer": transformer,
    "gpt": gpt,
    "ckpt_mlp": checkpointed_mlp,
    "ckpt_mlp_breaks": functools.partial(checkpointed_mlp, "none"),
    **{f"chain{n}": functools.partial(chain, n) for n in (10, 100, 1000)},
    "lstm": lstm,
    "gated": gated_cell,
    "pinn": pinn,
}
#: The small-op backwards (--only small-ops), each with inductor.
SMALL_OP_WORKLOADS = ("lstm", "gated", "pinn")


def compiler_named(name: str) -> Compiler:
    """The compiler called ``name``: a backend name, or ``no-work``."""
    return no_work if name == "no-work" else backend(name)


def make_workload(key: str, compiler_name: str) -> Workload:
    work = WORKLOADS[key]()
    work.key, work.compiler_name, work.compiler = key, compiler_name, compiler_named(compiler_name)
    return work


def first_backward_here(key: str, compiler_name: str, impl: str) -> dict[str, Any]:
    """``--first-backward``: the first backward of a fresh process (see first_backward_cold)."""
    work = make_workload(key, compiler_name)
    first_s = time_backward(work, impl)
    captures = {
        "ours": ca_runtime.stats()["captures"],
        "ours-bg": ca_runtime.stats()["captures"],
        "torch": int(counters["compiled_autograd"]["captures"]),
        "eager": 0,
    }[impl]
    return {
        "first_s": first_s,
        "captures": captures,
        "dynamo_graphs": int(counters["stats"]["unique_graphs"]),
    }


def first_backward_cold(work: Workload, impl: str) -> dict[str, Any]:
    """The first backward of ``impl`` in a process of its own, from a cold Inductor cache."""
    cache = tempfile.mkdtemp(prefix="inductor_", dir=_CACHE_ROOT.name)
    command = [sys.executable, __file__, "--first-backward", work.key, work.compiler_name, impl]
    run = subprocess.run(
        command,
        env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache},
        capture_output=True,
        text=True,
        timeout=3600,
        check=False,
    )
    if run.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{run.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(run.stdout.strip().splitlines()[-1])
    return result


#: The compiled training step's implementations: the backward on the eager
#: engine (torch.compile alone), torch's compiled autograd, ours, and ours with
#: Inductor compiling in the background.
STEP_IMPLS = ("compile", "torch", "ours", "ours-bg")
#: Steps timed from cold, the first included: how soon a job gets going.
COLD_STEPS = 10


def compiled_training_step(iters: int, warmup: int = 3) -> dict[str, Any]:
    """Whole steps (forward + backward) of a decoder whose forward is torch.compile'd with inductor."""
    torch.manual_seed(0)
    model = Decoder()
    tokens = torch.randint(0, 512, (8, 64))
    compiler = backend("inductor")
    engine = {"compile": "eager", "torch": "torch", "ours": "ours", "ours-bg": "ours-bg"}
    compiled_forward: dict[str, Any] = {}

    def step(impl: str) -> tuple[float, float]:
        """(forward, backward) seconds of one step."""
        for p in model.parameters():
            p.grad = None
        start = time.perf_counter()
        loss = compiled_forward[impl](tokens)
        middle = time.perf_counter()
        with implementation(engine[impl], compiler):
            loss.backward()
        return middle - start, time.perf_counter() - middle

    row: dict[str, Any] = {
        "workload": "compiled training step: decoder 4x d256 h4 s64 b8",
        "backend": "inductor",
        "nodes": 0,
        "first_s": {},
        "first_forward_s": {},
        "first_backward_s": {},
        "cold_steps_s": {},
        "captures": {},
        "dynamo_graphs": {},
    }
    # A throw-away compile first, so that no implementation pays the
    # process's one-time Dynamo/Inductor start-up; then ours before torch's,
    # as in measure(): whatever the second reuses favours torch's.
    reset_all()
    torch.compile(Decoder(layers=1), backend="inductor")(tokens).backward()
    for impl in ("compile", "ours", "ours-bg", "torch"):
        reset_all()
        compiled_forward[impl] = torch.compile(model, backend="inductor")
        forward_s, backward_s = step(impl)
        row["first_s"][impl] = forward_s + backward_s
        row["first_forward_s"][impl] = forward_s
        row["first_backward_s"][impl] = backward_s
        # The first COLD_STEPS steps in all, and for ours-bg how long its
        # compile went on after them (waited for before the next one starts).
        row["cold_steps_s"][impl] = row["first_s"][impl] + sum(sum(step(impl)) for _ in range(COLD_STEPS - 1))
        if impl == "ours-bg":
            start = time.perf_counter()
            ca_runtime.wait_for_background_compiles()
            row["bg_compile_left_s"] = time.perf_counter() - start
            row["uncompiled_runs_bg"] = ca_runtime.stats()["uncompiled_runs"]
        if impl in ("ours", "ours-bg"):
            row["captures"][impl] = ca_runtime.stats()["captures"]
            row[f"fallbacks_{impl}"] = ca_runtime.stats()["eager_fallbacks"]
        if impl == "torch":
            row["captures"]["torch"] = int(counters["compiled_autograd"]["captures"])
        row["dynamo_graphs"][impl] = int(counters["stats"]["unique_graphs"])
    # Dynamo was reset per implementation: compile each forward again, warm up, then interleave.
    for impl in STEP_IMPLS:
        for _ in range(warmup):
            step(impl)
    ca_runtime.wait_for_background_compiles()  # ours-bg's steady state is its compiled one
    times: dict[str, list[tuple[float, float]]] = {impl: [] for impl in STEP_IMPLS}
    for round_nr in range(iters):
        for impl in rotated(STEP_IMPLS, round_nr):
            times[impl].append(step(impl))
    steps = {impl: [f + b for f, b in t] for impl, t in times.items()}
    row["median_s"] = {impl: statistics.median(t) for impl, t in steps.items()}
    row["min_s"] = {impl: min(t) for impl, t in steps.items()}
    row["median_backward_s"] = {impl: statistics.median(b for _, b in t) for impl, t in times.items()}
    med = row["median_s"]
    row["ours_over_compile"] = med["ours"] / med["compile"]
    row["ours_over_torch"] = med["ours"] / med["torch"]
    row["first_ours_over_torch"] = row["first_s"]["ours"] / row["first_s"]["torch"]
    row["first_bg_over_torch"] = row["first_s"]["ours-bg"] / row["first_s"]["torch"]
    row["bg_over_torch"] = med["ours-bg"] / med["torch"]
    row["ours_over_compile_paired"] = paired_ratio(steps["ours"], steps["compile"])
    return row


def training_markdown(r: dict[str, Any]) -> str:
    m, f, b = r["median_s"], r["first_s"], r["median_backward_s"]
    ff, fb = r["first_forward_s"], r["first_backward_s"]
    return (
        "\n".join(
            [
                (
                    "| workload | compile alone ms | + torch's CA ms | + ours ms | ours/compile | ours/torch "
                    "| backward alone compile / torch / ours ms "
                    "| first step compile / torch / ours s (forward + backward) | ours/torch first "
                    "| captures torch / ours |"
                ),
                "|---|---|---|---|---|---|---|---|---|---|",
                f"| {r['workload']} | {m['compile'] * 1e3:.2f} | {m['torch'] * 1e3:.2f} | {m['ours'] * 1e3:.2f} | "
                f"{r['ours_over_compile']:.2f} ({_interval(r['ours_over_compile_paired'])} per round) | "
                f"{r['ours_over_torch']:.2f} | "
                f"{b['compile'] * 1e3:.1f} / {b['torch'] * 1e3:.1f} / {b['ours'] * 1e3:.1f} | "
                + " / ".join(f"{f[i]:.1f} ({ff[i]:.1f} + {fb[i]:.1f})" for i in ("compile", "torch", "ours"))
                + f" | {r['first_ours_over_torch']:.2f} | {r['captures']['torch']} / {r['captures']['ours']} |",
                "",
                'With Inductor compiling in the background (`enable("inductor", compile_in_background=True)`):',
                "",
                (
                    "| steady step ms | /torch | first step s (forward + backward) | /torch's first "
                    f"| first {COLD_STEPS} steps compile / torch / ours / background s "
                    "| compile left after them s | uncompiled runs |"
                ),
                "|---|---|---|---|---|---|---|",
                f"| {m['ours-bg'] * 1e3:.2f} | {r['bg_over_torch']:.2f} | {f['ours-bg']:.1f} "
                f"({ff['ours-bg']:.1f} + {fb['ours-bg']:.1f}) | {r['first_bg_over_torch']:.2f} | "
                + " / ".join(f"{r['cold_steps_s'][i]:.1f}" for i in ("compile", "torch", "ours", "ours-bg"))
                + f" | {r['bg_compile_left_s']:.1f} | {r['uncompiled_runs_bg']} |",
            ]
        )
        + "\n"
    )


def _no_sync() -> None:
    pass


@dataclasses.dataclass
class BenchDevice:
    """Where the workloads run (``--device``)."""

    name: str = "cpu"
    #: Waits for the device's queued work (CUDA's kernels run asynchronously).
    sync: Callable[[], None] = _no_sync


DEVICE = BenchDevice()


def time_backward(work: Workload, impl: str) -> float:
    loss = work.forward_for(impl)(0)
    for p in work.params:
        p.grad = None
    with implementation(impl, work.compiler):
        DEVICE.sync()
        start = time.perf_counter()
        loss.backward()
        DEVICE.sync()
        return time.perf_counter() - start


_CACHE_ROOT = tempfile.TemporaryDirectory(prefix="ca_bench_")


def reset_all() -> None:
    """Empties every cache, Inductor's on-disk ones too: each first backward compiles cold."""
    torch._dynamo.reset()
    for impl in IMPLEMENTATIONS.values():
        impl.reset()
    counters.clear()
    # A fresh Inductor cache directory, so that the implementation measured
    # second does not reuse kernels the first one compiled.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor_", dir=_CACHE_ROOT.name)
    torch._inductor.codecache.PyCodeCache.cache_clear(purge=True)


#: The rounds of measure(), each timed --iters times: ours', ours always
#: compiled and eager, with eager timed a second time as "eager-again"; then
#: torch's and eager. Torch's compiled autograd (Dynamo and a long Python
#: graph) run between two of ours' backwards left ours' walk and graph cold
#: and turned a chain of 100 muls from 0.73-0.79x eager to 1.02x (bench/LOG.md,
#: 2026-12-02 "Paired ratios"); a training loop has its forward there instead.
#: "eager-again" over "eager" is the A/A control: the spread that two runs
#: of the same code show in these rounds, against which ours/eager is read.
ROUNDS = (("eager", "ours", "ours-compiled", "eager-again"), ("eager", "torch"))


def williams_order(n: int) -> list[tuple[int, ...]]:
    """A Williams design for ``n`` treatments: each one follows each other one equally often.

    Rows are ``0, 1, n-1, 2, n-2, ...`` plus a row offset, mod n; for an odd
    ``n`` the mirrored rows are added, since n rows alone cannot balance
    who follows whom (with three, plain rotations put eager after ours always
    compiled in two rounds of three, ours after it in one).
    """
    first = [0]
    lo, hi = 1, n - 1
    while len(first) < n:
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    rows = [tuple((i + r) % n for i in first) for r in range(n)]
    if n % 2:
        rows += [row[::-1] for row in rows]
    return rows


def rotated(impls: tuple[str, ...], round_nr: int) -> tuple[str, ...]:
    """``impls`` in the ``round_nr``-th order of a Williams design (see williams_order).

    In a fixed order one implementation always runs right after the same
    other one, finding the caches and the allocator as that one left them;
    over a whole cycle of the design each runs right after each other one
    equally often within the rounds.
    """
    rows = williams_order(len(impls))
    return tuple(impls[i] for i in rows[round_nr % len(rows)])


def paired_ratio(num: list[float], den: list[float], resamples: int = 2000) -> dict[str, float]:
    """Median of the per-round ratios ``num[i] / den[i]`` and a bootstrap 95 % interval of that median.

    A round's two times are taken seconds apart, so their ratio cancels the
    drift of a shared machine that the ratio of two medians keeps; the
    interval says how far the median ratio could move in another run of as
    many rounds. Resampled with a fixed seed: the same times give the same
    interval.
    """
    ratios = [a / b for a, b in zip(num, den, strict=True)]
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    return {
        "median": statistics.median(ratios),
        "low": medians[int(0.025 * resamples)],
        "high": medians[int(0.975 * resamples) - 1],
    }


def measure(work: Workload, iters: int, warmup: int = 3) -> dict[str, Any]:
    work.nodes = _graph_nodes(work.forward(0))
    row: dict[str, Any] = {
        "workload": work.name,
        "nodes": work.nodes,
        "first_s": {},
        "first_captures": {},
        "captures": {},
        "dynamo_graphs": {},
    }
    if work.compiler_name == "inductor":
        row["first_s"]["ours-bg"] = first_backward_cold(work, "ours-bg")["first_s"]
    for impl in ("eager", "ours", "torch"):
        cold = first_backward_cold(work, impl)
        row["first_s"][impl] = cold["first_s"]
        row["first_captures"][impl] = cold["captures"]
        reset_all()
        for _ in range(warmup + 1):
            time_backward(work, impl)
        if impl == "ours":
            row["captures"]["ours"] = ca_runtime.stats()["captures"]
        if impl == "torch":
            row["captures"]["torch"] = int(counters["compiled_autograd"]["captures"])
        # Graphs Dynamo compiled for this implementation (more than one per
        # capture means recompiles).
        row["dynamo_graphs"][impl] = int(counters["stats"]["unique_graphs"])
    # Dynamo was reset per implementation: warm everything again, then
    # interleave. Ours warms until its entries have chosen how they run.
    for impl in IMPLS:
        for _ in range(max(warmup, CHOICE_RUNS) if impl == "ours" else warmup):
            time_backward(work, impl)
    row["ours_eager_if_faster_choice"] = ours_eager_if_faster_choice()
    # Ours' rounds, then torch's: see ROUNDS.
    by_round: list[dict[str, list[float]]] = [{impl: [] for impl in r} for r in ROUNDS]
    for round_impls, round_times in zip(ROUNDS, by_round, strict=True):
        # Whole cycles of the order, so that each follows each other equally often.
        cycle = len(williams_order(len(round_impls)))
        for round_nr in range(-(-iters // cycle) * cycle):
            for impl in rotated(round_impls, round_nr):
                round_times[impl].append(time_backward(work, impl))
    ours_rounds, torch_rounds = by_round
    times = {**ours_rounds, "torch": torch_rounds["torch"]}
    row["median_s"] = {impl: statistics.median(t) for impl, t in times.items()}
    row["min_s"] = {impl: min(t) for impl, t in times.items()}
    med = row["median_s"]
    row["ours_over_eager"] = med["ours"] / med["eager"]
    row["ours_compiled_over_eager"] = med["ours-compiled"] / med["eager"]
    row["ours_over_eager_paired"] = paired_ratio(times["ours"], times["eager"])
    row["ours_compiled_over_eager_paired"] = paired_ratio(times["ours-compiled"], times["eager"])
    row["torch_over_eager_paired"] = paired_ratio(torch_rounds["torch"], torch_rounds["eager"])
    row["eager_again_over_eager_paired"] = paired_ratio(times["eager-again"], times["eager"])
    # Through eager, each side paired in its own rounds.
    row["ours_over_torch"] = (
        row["ours_over_eager_paired"]["median"] / row["torch_over_eager_paired"]["median"]
    )
    return row


def _rss_kib() -> dict[str, int]:
    """VmHWM (peak resident set) and VmRSS of this process, in KiB."""
    with open("/proc/self/status") as f:
        return {line.split(":")[0]: int(line.split()[1]) for line in f if line.startswith(("VmHWM", "VmRSS"))}


def backward_peak_bytes(loss: torch.Tensor) -> tuple[int, int]:
    """(peak, end) resident memory during ``loss.backward()``, in bytes above its start.

    The kernel's peak-RSS counter is reset first (``/proc/self/clear_refs``).
    ``--only memory`` runs with ``MALLOC_MMAP_THRESHOLD_=65536`` so that every
    tensor buffer is its own mapping and a free returns it to the system at
    once: RSS then follows live tensor bytes. Eager frees each node's saved
    tensors as soon as the node has run, which keeps its peak down.
    """
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start = _rss_kib()["VmRSS"]
    loss.backward()
    after = _rss_kib()
    return (after["VmHWM"] - start) * 1024, (after["VmRSS"] - start) * 1024


def backward_tensor_peak_bytes(work: Workload, i: int, impl: str) -> tuple[int, int]:
    """(peak, end) live tensor bytes of one backward of ``work`` under ``impl`` (``ca_testkit.memory``: exact)."""

    def backward(loss: torch.Tensor) -> None:
        with implementation(impl, work.compiler):
            loss.backward()

    return tensor_peak_bytes(lambda: work.forward(i), backward)


def memory_peaks(compiler_name: str = "aot_eager") -> dict[str, Any]:
    """Peak memory of one warm backward, eager / torch's / ours, on the transformer and a GPT-style decoder.

    Two measures of each: ``tensor`` (live tensor bytes, exact; see
    backward_tensor_peak_bytes) and ``rss`` (resident memory, page-grained
    and noisy: Python's and glibc's heaps move it too; see
    backward_peak_bytes). Ours is measured on its third and fourth backwards,
    which run its compiled graph (an entry times how it runs from its sixth
    on), and again as its entry chose (``ours-chosen``, after CHOICE_RUNS
    backwards); ``ours-compiled`` never serves a hit eagerly.
    """
    torch.manual_seed(0)
    out: dict[str, Any] = {}
    for work in (transformer(), gpt()):
        work.compiler = backend(compiler_name)
        row: dict[str, Any] = {}
        for impl in ("eager", "torch", "ours", "ours-compiled"):
            reset_all()
            # Ours goes on until its entry has chosen, then is measured once more.
            runs = CHOICE_RUNS if impl == "ours" else 3
            for i in range(runs + 1):
                for p in work.params:
                    p.grad = None
                if i == 3:
                    tensor_peak, tensor_end = backward_tensor_peak_bytes(work, i, impl)
                    row[impl]["tensor"] = {"peak_bytes": tensor_peak, "end_bytes": tensor_end}
                    continue
                if impl == "ours" and i == runs:
                    tensor_peak, tensor_end = backward_tensor_peak_bytes(work, i, impl)
                    row["ours-chosen"] = {
                        "tensor": {"peak_bytes": tensor_peak, "end_bytes": tensor_end},
                        "eager_if_faster_choice": ours_eager_if_faster_choice(),
                    }
                    continue
                loss = work.forward(i)
                with implementation(impl, work.compiler):
                    if i == 2:
                        peak, end = backward_peak_bytes(loss)
                        row[impl] = {"rss": {"peak_bytes": peak, "end_bytes": end}}
                    else:
                        loss.backward()
        out[work.name] = row
    return out


def memory_markdown(r: dict[str, Any], compiler_name: str = "aot_eager") -> str:
    impls = ("eager", "torch", "ours", "ours-compiled", "ours-chosen")
    lines = [
        (
            f"Peak memory of one backward above its start, MiB (compiler {compiler_name}): live tensor bytes "
            "(exact), resident memory in brackets. ours-chosen: after its entry chose how it runs."
        ),
        "",
        "| workload | " + " | ".join(impls) + " | ours/eager (tensors) | ours-chosen/eager (tensors) |",
        "|---|" + "---|" * (len(impls) + 2),
    ]
    for name, row in r.items():
        tensor = {impl: row[impl]["tensor"]["peak_bytes"] / 2**20 for impl in impls}
        cells = [
            f"{tensor[impl]:.3f}"
            + (f" ({row[impl]['rss']['peak_bytes'] / 2**20:.2f})" if "rss" in row[impl] else "")
            for impl in impls
        ]
        chosen = ",".join(row["ours-chosen"]["eager_if_faster_choice"])
        lines.append(
            f"| {name} | {' | '.join(cells)} | {tensor['ours'] / tensor['eager']:.2f} | "
            f"{tensor['ours-chosen'] / tensor['eager']:.2f} ({chosen}) |"
        )
    return "\n".join(lines) + "\n"


def report_overhead(iters: int) -> dict[str, Any]:
    """What ``ca_runtime.report()``'s collection costs on the cache-hit path.

    The report records on misses only; on a hit, with timings off (the
    default), the engine hook reads one flag. Ours is timed with timings off
    and on (``collect_timings``), interleaved, on the chain of 1000 nodes with
    the no-work compiled function (where per-backward overhead is largest)
    and on the MLP with aot_eager.
    """
    out: dict[str, Any] = {}
    for work, compiler in ((chain(1000), no_work), (mlp(), backend("aot_eager"))):
        work.compiler = compiler
        reset_all()
        for _ in range(5):
            time_backward(work, "ours")
        times: dict[str, list[float]] = {"eager": [], "timings off": [], "timings on": []}
        for _ in range(iters):
            times["eager"].append(time_backward(work, "eager"))
            times["timings off"].append(time_backward(work, "ours"))
            ca_runtime.collect_timings(True)
            times["timings on"].append(time_backward(work, "ours"))
            ca_runtime.collect_timings(False)
        med = {k: statistics.median(v) for k, v in times.items()}
        out[work.name] = {"median_s": med, "on_over_off": med["timings on"] / med["timings off"]}
    return out


def report_overhead_markdown(r: dict[str, Any]) -> str:
    lines = [
        "| workload | eager us | ours, timings off us | ours, timings on us | on/off |",
        "|---|---|---|---|---|",
    ]
    for name, row in r.items():
        m = row["median_s"]
        lines.append(
            f"| {name} | {m['eager'] * 1e6:.0f} | {m['timings off'] * 1e6:.0f} | "
            f"{m['timings on'] * 1e6:.0f} | {row['on_over_off']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def per_node_us(small_s: float, large_s: float, small_nodes: int, large_nodes: int) -> float:
    """µs per node: the slope between two chain lengths' backward times (s)."""
    return (large_s - small_s) / (large_nodes - small_nodes) * 1e6


def per_node_fresh(rounds: int) -> dict[str, Any]:
    """Per-node cost with backend eager in this process alone: chains of 10 and 1000 muls, eager and ours.

    The full run measures the chains after the model workloads, in a process
    whose heap and Python objects those left behind (ours' per-node cost
    grows there, eager's barely; see bench/LOG.md). Here nothing else ran
    first, and the four backwards alternate for ``rounds`` rounds; the slope
    between 10 and 1000 nodes of the median, 25th percentile and minimum.
    """
    works = {n: make_workload(f"chain{n}", "eager") for n in (10, 1000)}
    # The hit path's cost is ours always compiled; ours as it runs by default
    # (after its entries chose, see CHOICE_RUNS) beside it.
    impls = ("eager", "ours-compiled", "ours")
    for work in works.values():
        work.nodes = _graph_nodes(work.forward(0))
        for impl in impls:
            for _ in range(CHOICE_RUNS if impl == "ours" else 4):
                time_backward(work, impl)
    times: dict[tuple[int, str], list[float]] = {(n, impl): [] for n in works for impl in impls}
    for _ in range(rounds):
        for n, work in works.items():
            for impl in impls:
                times[(n, impl)].append(time_backward(work, impl))
    stats: dict[str, Callable[[list[float]], float]] = {
        "median": statistics.median,
        "p25": lambda t: statistics.quantiles(t, n=4)[0],
        "min": min,
    }
    # Ours must have run compiled: a silent fallback would time eager twice.
    counts = ca_runtime.stats()
    out: dict[str, Any] = {
        "rounds": rounds,
        **{k: counts[k] for k in ("captures", "cache_hits", "eager_fallbacks", "eager_if_faster_runs")},
        "ours_eager_if_faster_choice": ours_eager_if_faster_choice(),
    }
    for name, stat in stats.items():
        slope = {
            impl: per_node_us(
                stat(times[(10, impl)]), stat(times[(1000, impl)]), works[10].nodes, works[1000].nodes
            )
            for impl in impls
        }
        out[name] = {
            **slope,
            "overhead": slope["ours-compiled"] - slope["eager"],
            "default_overhead": slope["ours"] - slope["eager"],
        }
    return out


def per_node_markdown(r: dict[str, Any]) -> str:
    lines = [
        (
            f"Per-node cost, backend eager, chains of 10 and 1000 muls alone in a fresh process, {r['rounds']} "
            "interleaved rounds (slope between 10 and 1000 nodes):"
        ),
        "",
        (
            "| statistic | eager µs/node | ours always compiled µs/node | its overhead µs/node "
            "| ours (default) µs/node | its overhead µs/node |"
        ),
        "|---|---|---|---|---|---|",
    ]
    for name in ("median", "p25", "min"):
        v = r[name]
        lines.append(
            f"| {name} | {v['eager']:.2f} | {v['ours-compiled']:.2f} | {v['overhead']:.2f} | "
            f"{v['ours']:.2f} | {v['default_overhead']:.2f} |"
        )
    lines += [
        "",
        (
            f"Ours: {r['captures']} captures, {r['cache_hits']} cache hits, {r['eager_fallbacks']} eager fallbacks, "
            f"{r['eager_if_faster_runs']} backwards on the eager engine by choice; ours (default) runs "
            f"{' and '.join(r['ours_eager_if_faster_choice']) or '-'}."
        ),
    ]
    return "\n".join(lines) + "\n"


def batch_sweep(compiler: Compiler, sizes: tuple[int, ...] = (4, 8, 16, 32, 8, 64)) -> dict[str, Any]:
    out: dict[str, Any] = {"workload": "batch sweep " + ",".join(map(str, sizes))}
    for impl in ("torch", "ours"):
        reset_all()
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
        for b in sizes:
            model.zero_grad(set_to_none=True)  # a training step: optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(torch.randn(b, 32)), torch.randint(0, 10, (b,)))
            with implementation(impl, compiler):
                loss.backward()
        captures = (
            ca_runtime.stats()["captures"]
            if impl == "ours"
            else int(counters["compiled_autograd"]["captures"])
        )
        out[impl] = {"captures": captures, "dynamo_graphs": int(counters["stats"]["unique_graphs"])}
    return out


def _interval(r: dict[str, float]) -> str:
    return f"{r['median']:.3f} [{r['low']:.3f}, {r['high']:.3f}]"


def models_markdown(rows: list[dict[str, Any]], per_node: dict[str, Any]) -> str:
    """The backward-only workloads' table and the per-node cost from the chains."""
    lines = [
        (
            "| workload | backend | nodes | eager ms | torch ms | ours ms | ours/eager "
            "| ours/eager per round [95 % interval] | eager again/eager per round (A/A) | ours/torch "
            "| ours runs | ours always compiled ms (/eager) | always compiled/eager per round [95 % interval] "
            "| first backward torch / ours / ours in background s | captures torch / ours "
            "| Dynamo graphs torch / ours |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        m = r["median_s"]
        bg = r["first_s"].get("ours-bg")
        lines.append(
            f"| {r['workload']} | {r['backend']} | {r['nodes']} | {m['eager'] * 1e3:.3f} | {m['torch'] * 1e3:.3f} | "
            f"{m['ours'] * 1e3:.3f} | {r['ours_over_eager']:.2f} | {_interval(r['ours_over_eager_paired'])} | "
            f"{_interval(r['eager_again_over_eager_paired'])} | {r['ours_over_torch']:.2f} | {' and '.join(r.get('ours_eager_if_faster_choice', [])) or '-'} | "
            f"{m['ours-compiled'] * 1e3:.3f} ({r['ours_compiled_over_eager']:.2f}) | "
            f"{_interval(r['ours_compiled_over_eager_paired'])} | "
            f"{r['first_s']['torch']:.2f} / {r['first_s']['ours']:.2f} / {'-' if bg is None else f'{bg:.2f}'} | "
            f"{r['captures'].get('torch', '-')} / {r['captures'].get('ours', '-')} | "
            f"{r['dynamo_graphs'].get('torch', '-')} / {r['dynamo_graphs'].get('ours', '-')} |"
        )
    lines += [
        "",
        "Per-node cost from the chain workloads (slope between N=10 and N=1000, of median and of minimum times):",
        "",
        (
            "| compiler | eager µs/node | torch µs/node | ours µs/node | torch overhead µs/node "
            "| ours overhead µs/node | ours always compiled: overhead µs/node |"
        ),
        "|---|---|---|---|---|---|---|",
    ]
    for name, v in per_node.items():
        lines.append(
            f"| {name} | {v['eager']:.2f} | {v['torch']:.2f} | {v['ours']:.2f} | "
            f"{v['torch'] - v['eager']:.2f} | {v['ours'] - v['eager']:.2f} | "
            f"{v['ours-compiled'] - v['eager']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def markdown(rows: list[dict[str, Any]], sweep: dict[str, Any], per_node: dict[str, Any]) -> str:
    """The full run's tables: models_markdown and the batch sweep."""
    return (
        models_markdown(rows, per_node)
        + "\n"
        + (
            f"Batch sweep {sweep['workload']}: torch {sweep['torch']['captures']} captures / "
            f"{sweep['torch']['dynamo_graphs']} Dynamo graphs; ours {sweep['ours']['captures']} captures / "
            f"{sweep['ours']['dynamo_graphs']} Dynamo graphs.\n"
        )
    )


def plot(rows: list[dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for compiler in ("eager", "no-work"):
        chain_rows = [r for r in rows if r["workload"].startswith("chain") and r["backend"] == compiler]
        n = [r["nodes"] for r in chain_rows]
        for impl, style in (("torch", "--"), ("ours", "-")):
            overhead = [(r["min_s"][impl] - r["min_s"]["eager"]) / r["nodes"] * 1e6 for r in chain_rows]
            ax.plot(n, overhead, style, marker="o", label=f"{impl} ({compiler})")
    ax.set_xscale("log")
    ax.set_xlabel("autograd nodes")
    ax.set_ylabel("overhead over eager, µs per node (min times)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


#: The rounds of small_op_rows, as ROUNDS: eager, the torch.compile'd forward's
#: backward ("tc") and ours both ways, eager again; then torch's and eager.
SMALL_OP_ROUNDS = (("eager", "tc", "ours-compiled", "ours", "eager-again"), ("eager", "torch"))


def small_op_rows(iters: int, warmup: int = 3) -> list[dict[str, Any]]:
    """The small-op backwards (SMALL_OP_WORKLOADS) with inductor, in rounds as measure() but with a "tc" column.

    "tc" is the backward that ``torch.compile`` itself makes (AOTAutograd's,
    from the ``torch.compile``'d forward), timed as the others: only
    ``loss.backward()``. Also: ours' walk per node on its hits (ca_core's
    timings, over the "ours-compiled" rounds) and the kernel floor (the share
    of eager's backward in matmul kernels, bench/profile_models.py).
    """
    import ca_core
    from profile_models import kernel_floor

    rows = []
    for key in SMALL_OP_WORKLOADS:
        reset_all()
        work = make_workload(key, "inductor")
        work.nodes = _graph_nodes(work.forward(0))
        rounds = (
            SMALL_OP_ROUNDS
            if work.torch_compilable
            else tuple(tuple(i for i in r if i != "tc") for r in SMALL_OP_ROUNDS)
        )
        impls = dict.fromkeys(i for r in rounds for i in r)
        for impl in impls:
            for _ in range(max(warmup, CHOICE_RUNS) if impl == "ours" else warmup):
                time_backward(work, impl)
        before = ca_runtime.stats()
        by_round: list[dict[str, list[float]]] = [{impl: [] for impl in r} for r in rounds]
        walk_ns = timed = 0
        for round_impls, round_times in zip(rounds, by_round, strict=True):
            cycle = len(williams_order(len(round_impls)))
            for round_nr in range(-(-iters // cycle) * cycle):
                for impl in rotated(round_impls, round_nr):
                    ca_core.set_timing(impl == "ours-compiled")
                    start = ca_core.timings()
                    round_times[impl].append(time_backward(work, impl))
                    end = ca_core.timings()
                    walk_ns += end["walk_ns"] - start["walk_ns"]
                    timed += end["timed_backwards"] - start["timed_backwards"]
        ca_core.set_timing(False)
        after = ca_runtime.stats()
        ours_rounds, torch_rounds = by_round
        row: dict[str, Any] = {
            "workload": work.name,
            "key": key,
            "nodes": work.nodes,
            "median_s": {i: statistics.median(t) for i, t in {**ours_rounds, **torch_rounds}.items()},
            "over_eager": {
                i: paired_ratio(t, ours_rounds["eager"]) for i, t in ours_rounds.items() if i != "eager"
            },
            "ours_eager_if_faster_choice": ours_eager_if_faster_choice(),
            "walk_us_per_node": walk_ns / max(timed, 1) / 1e3 / work.nodes,
            "hits": {
                k: after[k] - before[k] for k in ("cache_hits", "eager_if_faster_runs", "eager_fallbacks")
            },
        }
        row["over_eager"]["torch"] = paired_ratio(torch_rounds["torch"], torch_rounds["eager"])
        if "tc" in ours_rounds:
            row["ours_compiled_over_tc"] = paired_ratio(ours_rounds["ours-compiled"], ours_rounds["tc"])
        row["kernel_floor"] = kernel_floor(key, "inductor", rounds=max(5, iters // 3))["floor_ratio"]
        rows.append(row)
        print(row["workload"], {k: f"{v * 1e3:.3f}ms" for k, v in row["median_s"].items()}, flush=True)
    return rows


def small_ops_markdown(rows: list[dict[str, Any]]) -> str:
    """The small-op backwards' table: ratios to eager per round, [95 %]."""
    lines = [
        (
            "| workload | nodes | eager ms | torch.compile backward | torch's compiled autograd "
            "| ours (default, compiled) | ours/torch.compile | ours timed (chose) | walk us/node | kernel floor |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = r["over_eager"]
        tc = _interval(ratio["tc"]) if "tc" in ratio else "cannot (double backward)"
        vs_tc = _interval(r["ours_compiled_over_tc"]) if "ours_compiled_over_tc" in r else "-"
        lines.append(
            f"| {r['workload']} | {r['nodes']} | {r['median_s']['eager'] * 1e3:.2f} | {tc} "
            f"| {_interval(ratio['torch'])} | {_interval(ratio['ours-compiled'])} | {vs_tc} "
            f"| {_interval(ratio['ours'])} ({', '.join(r['ours_eager_if_faster_choice']) or '-'}) "
            f"| {r['walk_us_per_node']:.2f} | {r['kernel_floor']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def checkpoint_rows(iters: int) -> list[dict[str, Any]]:
    """The checkpointed MLP with inductor, its regions recomputed in our graph and behind breaks."""
    rows = []
    for key in ("ckpt_mlp", "ckpt_mlp_breaks"):
        work = make_workload(key, "inductor")
        row = {**measure(work, iters), "backend": "inductor"}
        reset_all()
        for _ in range(3):
            time_backward(work, "ours")
        row["graph_breaks"] = ca_runtime.stats()["graph_breaks"]
        rows.append(row)
        print(row["workload"], {k: f"{v * 1e3:.2f}ms" for k, v in row["median_s"].items()}, flush=True)
    return rows


def checkpoint_markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| workload | eager | torch | ours | ours/eager | ours/torch | our graph breaks | first backward torch / ours (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        med, first = r["median_s"], r["first_s"]
        lines.append(
            f"| {r['workload']} | {med['eager'] * 1e3:.2f} ms | {med['torch'] * 1e3:.2f} ms | "
            f"{med['ours'] * 1e3:.2f} ms | {r['ours_over_eager']:.2f} | {r['ours_over_torch']:.2f} | "
            f"{r['graph_breaks']} | {first['torch']:.1f} / {first['ours']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--quick", action="store_true", help="aot_eager instead of inductor for the models")
    parser.add_argument(
        "--first-backward",
        nargs=3,
        metavar=("WORKLOAD", "COMPILER", "IMPL"),
        help=f"time one first backward in this fresh process and print it as JSON; WORKLOAD one of "
        f"{', '.join(WORKLOADS)}, COMPILER a backend name or no-work, IMPL one of {', '.join(IMPLS)} or ours-bg",
    )
    parser.add_argument(
        "--only",
        choices=("training", "models", "small-ops", "report-overhead", "memory", "checkpoint", "per-node"),
        help="run one measurement alone: the compiled training step, the backward-only workloads (models and "
        "chains, without the batch sweep), the report's cost on cache hits, "
        "the small-op backwards (LSTM, gated cell, PINN) with a torch.compile column, "
        "the peak memory of a backward, checkpointed regions recomputed in the graph or behind breaks, "
        "or the per-node cost with backend eager in a fresh process (--iters 10x rounds)",
    )
    parser.add_argument(
        "--memory-compiler",
        default="aot_eager",
        choices=("aot_eager", "inductor"),
        help="the compiler of --only memory",
    )
    parser.add_argument(
        "--device",
        default=os.environ.get("CA_BENCH_DEVICE", "cpu"),
        choices=("cpu", "cuda"),
        help="where the workloads' tensors live (cuda: backwards timed to torch.cuda.synchronize(); "
        "skipped with a message where CUDA is not available)",
    )
    args = parser.parse_args()
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("bench/run.py --device cuda: skipped, CUDA is not available on this machine")
            return
        DEVICE.name, DEVICE.sync = "cuda", torch.cuda.synchronize
        torch.set_default_device("cuda")
        os.environ["CA_BENCH_DEVICE"] = "cuda"  # --first-backward's processes too
    torch.set_num_threads(1)
    torch._inductor.config.fx_graph_cache = False  # first backwards compile cold; see reset_all()
    if args.first_backward:
        print(json.dumps(first_backward_here(*args.first_backward)))
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    if args.only == "memory":
        if os.environ.get("MALLOC_MMAP_THRESHOLD_") != "65536":
            # See backward_peak_bytes: glibc reads this at start-up only.
            os.execve(
                sys.executable, [sys.executable, *sys.argv], {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
            )
        compiler_name = args.memory_compiler
        peaks = memory_peaks(compiler_name)
        (out / f"memory_{compiler_name}.json").write_text(json.dumps(peaks, indent=1))
        print(memory_markdown(peaks, compiler_name))
        return
    if args.only == "report-overhead":
        overhead = report_overhead(args.iters)
        (out / "report_overhead.json").write_text(json.dumps(overhead, indent=1))
        print(report_overhead_markdown(overhead))
        return

    if args.only == "per-node":
        per_node_row = per_node_fresh(args.iters * 10)
        (out / "per_node.json").write_text(json.dumps(per_node_row, indent=1))
        print(per_node_markdown(per_node_row))
        return

    if args.only == "small-ops":
        small = small_op_rows(args.iters)
        (out / "small_ops.json").write_text(json.dumps(small, indent=1))
        print(small_ops_markdown(small))
        return

    if args.only == "checkpoint":
        rows = checkpoint_rows(args.iters)
        (out / "checkpoint.json").write_text(json.dumps(rows, indent=1))
        print(checkpoint_markdown(rows))
        return

    training = compiled_training_step(args.iters) if args.only != "models" else None
    if training is not None:
        print(training_markdown(training), flush=True)
    if args.only == "training":
        (out / "training.json").write_text(json.dumps(training, indent=1))
        (out / "training.md").write_text(training_markdown(training))
        return

    model_backend = "aot_eager" if args.quick else "inductor"
    rows = []
    for key in ("mlp", "transformer", "gpt"):
        work = make_workload(key, model_backend)
        rows.append({**measure(work, args.iters), "backend": model_backend})
        print(
            rows[-1]["workload"],
            model_backend,
            {k: f"{v * 1e3:.2f}ms" for k, v in rows[-1]["median_s"].items()},
            flush=True,
        )
    work = make_workload("transformer", "aot_eager")
    rows.append({**measure(work, args.iters), "backend": "aot_eager"})
    for n in (10, 100, 1000):
        for name in ("eager", "no-work"):
            work = make_workload(f"chain{n}", name)
            rows.append({**measure(work, args.iters), "backend": name})
            print(
                rows[-1]["workload"],
                name,
                {k: f"{v * 1e6:.0f}us" for k, v in rows[-1]["median_s"].items()},
                flush=True,
            )
    per_node = {}
    for name in ("eager", "no-work"):
        small = next(r for r in rows if r["workload"] == "chain 10" and r["backend"] == name)
        large = next(r for r in rows if r["workload"] == "chain 1000" and r["backend"] == name)
        # Medians and minima: on a shared machine the minimum is the steadier
        # estimate of what the code costs (noise only ever adds time).
        for stat in ("median_s", "min_s"):
            per_node[f"{name} ({stat[:-2]})"] = {
                impl: per_node_us(small[stat][impl], large[stat][impl], small["nodes"], large["nodes"])
                for impl in IMPLS
            }
    if training is None:  # --only models
        (out / "models.json").write_text(json.dumps({"rows": rows, "per_node_us": per_node}, indent=1))
        print(models_markdown(rows, per_node))
        return
    sweep = batch_sweep(backend("aot_eager"))
    (out / "results.json").write_text(
        json.dumps(
            {"rows": rows, "batch_sweep": sweep, "per_node_us": per_node, "training": training}, indent=1
        )
    )
    table = markdown(rows, sweep, per_node) + "\n" + training_markdown(training)
    (out / "results.md").write_text(table)
    plotted = plot(rows, out / "overhead.png")
    print(table)
    if not plotted:
        print("(matplotlib not installed: no PNG)")


if __name__ == "__main__":
    main()
