"""The cost of a cache hit itself, without the backward's kernels: ours with a compiler that computes nothing.

One ``loss.backward(retain_graph=True)`` repeated on one graph, under
``ca_runtime.enable(no_work, eager_if_faster=False)``: every backward walks
the graph, finds its entry, lifts the inputs, calls a graph that returns at
once and finishes. Eager's real backward of the same graph runs in the same
process as a yardstick of the machine's speed, so that two builds measured
in turns on a busy machine compare by ``ours / eager``.

Graphs: ``tf`` (2-layer TransformerEncoder, d 16, 111 nodes), ``mlp`` (8
Linear+ReLU layers, 42 nodes), ``chain`` (200 muls, 202 nodes).

    python bench/hit_cost.py [--graphs tf,mlp,chain] [--iters 300] [--rounds 10]

To compare two ca_core builds (``pip install --target DIR packages/ca-core``
of the other commit), run it in turns with ``PYTHONPATH=DIR`` and without.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import ca_core
import ca_runtime
import torch
from run import chain, no_work

GRAPHS = ("tf", "mlp", "chain")


def make_graph(name: str) -> Callable[[], torch.Tensor]:
    """A function returning the loss of one small graph (tiny tensors: the nodes cost, not the kernels)."""
    torch.manual_seed(0)
    if name == "tf":
        layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        model: torch.nn.Module = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        x = torch.randn(2, 4, 16)
        return lambda: model(x).pow(2).mean()
    if name == "mlp":
        model = torch.nn.Sequential(
            *[m for _ in range(8) for m in (torch.nn.Linear(16, 16), torch.nn.ReLU())]
        )
        x = torch.randn(4, 16)
        return lambda: model(x).pow(2).mean()
    if name == "chain":
        work = chain(200)
        return lambda: work.forward(0)
    raise ValueError(f"graph must be one of {', '.join(GRAPHS)}, not {name!r}")


def hit_cost(name: str, iters: int, rounds: int) -> dict[str, float]:
    """Median µs per backward, ours (no-work graph) and eager, alternating per round; ours' walk from ca_core."""
    loss = make_graph(name)()

    def loop() -> float:
        start = time.perf_counter()
        for _ in range(iters):
            loss.backward(retain_graph=True)
        return (time.perf_counter() - start) / iters * 1e6

    ours, eager = [], []
    # Eager first defines every .grad, as the eager rounds below keep it (the
    # no-work graph returns no grads): the same cache key throughout.
    with ca_runtime.disable():
        loss.backward(retain_graph=True)
    with ca_runtime.enable(no_work, eager_if_faster=False):
        for _ in range(5):
            loss.backward(retain_graph=True)
        assert ca_runtime.stats()["captures"] == 1
        ca_core.reset_counters()
        ca_core.set_timing(True)
        for _ in range(rounds):
            ours.append(loop())
            with ca_runtime.disable():
                eager.append(loop())
        timings = ca_core.timings()
        ca_core.set_timing(False)
        stats = ca_runtime.stats()
    assert stats["cache_hits"] == iters * rounds and stats["eager_fallbacks"] == 0, stats
    assert stats["captures"] == 0 and stats["graph_breaks"] == 0, stats
    result = {
        "ours_us": statistics.median(ours),
        "eager_us": statistics.median(eager),
        "walk_us": timings["walk_ns"] / timings["timed_backwards"] / 1e3,
    }
    result["ours_over_eager"] = result["ours_us"] / result["eager_us"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graphs", default=",".join(GRAPHS))
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--json", action="store_true", help="one JSON line per graph")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for name in args.graphs.split(","):
        r = hit_cost(name, args.iters, args.rounds)
        if args.json:
            print(json.dumps({"graph": name, **r}))
        else:
            print(
                f"{name}: ours {r['ours_us']:.1f} µs (walk {r['walk_us']:.1f}), eager {r['eager_us']:.1f} µs, "
                f"ours/eager {r['ours_over_eager']:.3f}"
            )


if __name__ == "__main__":
    main()
